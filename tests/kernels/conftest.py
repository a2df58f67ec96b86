"""Kernel tests: references everywhere; Triton kernels on CUDA, or on the CPU under TRITON_INTERPRET=1.

The interpreter decides at decoration time, so the variable is set here, before any kernel module
imports triton (kernels/ imports its Triton modules lazily). Interpreter cases are kept small.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (pip install 'batchd[triton]')")


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs a Triton kernel (compiled on CUDA, interpreted on CPU)")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    a, e = actual.double(), expected.double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


# bounds on the relative error against a float64 reference computed from the same low-precision inputs
REL_ERR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture
def use_options():
    """use_options(**changes): the current kernels.options.KernelOptions with `changes` for the rest
    of the test (the options before it come back after)."""
    import dataclasses

    from batchd.kernels import options

    previous = options._current

    def use(**changes) -> None:
        options.set_kernel_options(dataclasses.replace(options.current_options(), **changes))

    yield use
    options.set_kernel_options(previous)
