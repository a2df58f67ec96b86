"""Drafters a job may name (issue 38, item 3): names from the engine owner's catalog, never
paths; one drafter per file however its path is spelled; at most `capacity` kept loaded.
A tiny GGUF (test_checkpoint_builders) is the target, so every load is a real one."""
from __future__ import annotations

import os
import shutil

import pytest

from batchd.engine.drafter_names import DrafterCatalog
from batchd.engine.errors import BadInputError
from batchd.engine.runtime import Engine, EngineConfig
from tests.engine.test_checkpoint_builders import tiny_hf_model, tiny_tokenizer, write_gguf


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    folder = tmp_path_factory.mktemp("drafters")
    return write_gguf(folder / "target.gguf", tiny_hf_model("llama", tokenizer.get_vocab_size()), tokenizer)


@pytest.fixture
def engine(target_path):
    return Engine.load(str(target_path), EngineConfig(max_context=64))


def spellings(path) -> list[str]:
    """One file, four ways: as given, with '/./', with '//', and through a symbolic link."""
    link = path.parent / "link-to-target.gguf"
    if not link.exists():
        link.symlink_to(path)
    return [str(path), f"{path.parent}/./{path.name}", f"{path.parent}//{path.name}", str(link)]


def test_every_spelling_of_one_file_is_one_drafter(engine, target_path):
    drafters = [engine.drafters.get(spelling) for spelling in spellings(target_path)]
    assert all(d is drafters[0] for d in drafters) and len(engine.drafters) == 1
    truncated = [engine.drafters.get(f"{spelling}#layers=1") for spelling in spellings(target_path)]
    assert all(d is truncated[0] for d in truncated) and len(engine.drafters) == 2
    assert truncated[0].config.num_layers == 1


def test_at_most_capacity_drafters_stay_loaded(engine, target_path, tmp_path):
    copy = shutil.copy(target_path, tmp_path / "copy.gguf")   # another file: loaded on its own
    assert engine.drafters.capacity == 2
    first = engine.drafters.get(f"{target_path}#layers=1")
    engine.drafters.get(str(copy))
    engine.drafters.get(f"{target_path}#layers=2")   # a third: the least recently used goes
    assert len(engine.drafters) == 2 and f"{target_path}#layers=1" not in engine.drafters
    assert str(copy) in engine.drafters and f"{target_path}#layers=2" in engine.drafters
    assert engine.drafters.get(f"{target_path}#layers=1") is not first   # loaded again when named again


def test_a_catalog_maps_names_to_real_paths_once_per_file(target_path, tmp_path):
    link = tmp_path / "link.gguf"
    link.symlink_to(target_path)
    hard = tmp_path / "hard.gguf"
    os.link(target_path, hard)
    catalog = DrafterCatalog({"tiny": str(target_path), "again": f"{target_path.parent}/./{target_path.name}",
                              "linked": str(link), "hard": str(hard)})
    resolved = {catalog.resolve(name) for name in catalog.names}
    assert resolved == {os.path.realpath(target_path)}   # one path: the engine loads the file once
    assert catalog.resolve("tiny#layers=1") == f"{os.path.realpath(target_path)}#layers=1"


@pytest.mark.parametrize("spec", ["/etc/passwd", "/no/such/file.gguf", "../models/x.gguf", "tiny/../../etc",
                                  "C:\\models\\x.gguf", "~/x.gguf"])
def test_a_path_is_not_a_drafter_name(target_path, spec):
    catalog = DrafterCatalog({"tiny": str(target_path)})
    with pytest.raises(BadInputError) as refused:
        catalog.resolve(spec)
    message = refused.value.message
    # the same words whether the path exists or not: nothing about the host's files
    assert message == f"param drafter={spec!r} is not a drafter name: a job names a drafter its workers serve " \
                      "(letters, digits, '.', '_', '-'; '#layers=N' for its first N layers), never a path"


def test_an_unknown_name_reveals_only_the_catalogs_names(target_path):
    catalog = DrafterCatalog({"tiny": str(target_path), "qwen-0.5b": str(target_path)})
    with pytest.raises(BadInputError) as unknown:
        catalog.resolve("passwd")
    assert unknown.value.message.startswith("param drafter: unknown drafter 'passwd'; this worker serves "
                                            "'qwen-0.5b', 'tiny'")
    assert str(target_path.parent) not in unknown.value.message and "/" not in unknown.value.message


def test_layers_suffix_for_speculative_drafters_only(target_path):
    catalog = DrafterCatalog({"tiny": str(target_path)})
    assert catalog.resolve("tiny#layers=2").endswith("#layers=2")
    with pytest.raises(BadInputError, match="'#layers=N' is for speculative drafters"):
        catalog.resolve("tiny#layers=2", param="compress_drafter", layers_allowed=False)
    with pytest.raises(BadInputError, match="the only suffix is '#layers=N'"):
        catalog.resolve("tiny#depth=2")
