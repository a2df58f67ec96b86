"""Drafter names: what a job may say instead of a path (no torch here: `batchd submit` checks them).

    catalog = DrafterCatalog({"qwen-0.5b": "/models/qwen2.5-0.5b.gguf", "smollm2-135m": target_path})
    catalog.resolve("smollm2-135m#layers=6")    # -> '/models/smollm2.gguf#layers=6'
    catalog.resolve("/etc/passwd")              # BadInputError: not a drafter name

A service never lets a job choose a file on the worker's host: the names are set by whoever
starts the engine (a worker's `--drafter-checkpoint NAME=PATH`, and the worker's own model
under its model name), and a job names one, optionally with '#layers=N' (its first N layers).
"""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional

from batchd.engine.errors import BadInputError

DRAFTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")   # like a model name


class DrafterCatalog:
    """The drafters jobs may name: name -> checkpoint path, fixed when the engine's owner starts.

    Paths are resolved once (real paths; two names of one file, by file identity, give one
    path, so the engine loads that file once). `resolve("name#layers=6")` is the path with the
    suffix; an unknown name is the job's BadInputError, which names the catalog's drafters and
    nothing of the host's files."""

    def __init__(self, named: Mapping[str, str]):
        self._paths: dict[str, str] = {}
        first_path_of: dict[object, str] = {}
        for name, path in named.items():
            if not DRAFTER_NAME.match(name):
                raise ValueError(f"drafter name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
            real = os.path.realpath(path)
            self._paths[name] = first_path_of.setdefault(file_identity(real) or real, real)

    @property
    def names(self) -> list[str]:
        return sorted(self._paths)

    def resolve(self, spec: str, *, param: str = "drafter", layers_allowed: bool = True) -> str:
        name, layers = check_drafter_name(spec, param=param, layers_allowed=layers_allowed)
        path = self._paths.get(name)
        if path is None:
            raise BadInputError(f"param {param}: unknown drafter {name!r}; this worker serves "
                                f"{', '.join(map(repr, self.names)) or 'none'} (a worker names its drafters with "
                                "--drafter-checkpoint NAME=PATH)")
        return path if layers is None else f"{path}#layers={layers}"


def check_drafter_name(spec: str, *, param: str = "drafter", layers_allowed: bool = True) -> tuple[str, Optional[int]]:
    """'name#layers=6' -> ('name', 6), or BadInputError: a job names a drafter, never a path."""
    name, layers = parse_drafter_path(spec)
    if not DRAFTER_NAME.match(name):
        raise BadInputError(f"param {param}={spec!r} is not a drafter name: a job names a drafter its workers "
                            "serve (letters, digits, '.', '_', '-'; '#layers=N' for its first N layers), never a path")
    if layers is not None and not layers_allowed:
        raise BadInputError(f"param {param}={spec!r}: '#layers=N' is for speculative drafters; name the whole "
                            "drafter here")
    return name, layers


def parse_drafter_path(drafter_path: str) -> tuple[str, Optional[int]]:
    """'model.gguf#layers=6' -> ('model.gguf', 6); 'model.gguf' -> ('model.gguf', None)."""
    path, sep, suffix = drafter_path.partition("#")
    if not sep:
        return path, None
    key, _, value = suffix.partition("=")
    if key != "layers" or not value.isdigit() or int(value) < 1:
        raise BadInputError(f"drafter {drafter_path!r}: the only suffix is '#layers=N' with N >= 1")
    return path, int(value)


def file_identity(path: str) -> Optional[tuple]:
    """(device, inode) of the checkpoint a path names, however it is spelled ('/./', '//',
    links); None when it does not exist (the load then fails with its own message)."""
    try:
        st = os.stat(os.path.realpath(path))
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
