"""Backend choice shared by every op: Triton on CUDA, the PyTorch reference elsewhere.

`triton` is an optional dependency (`pip install 'batchd[triton]'`); nothing here imports it, so the
references run on a machine without it. Under `TRITON_INTERPRET=1` the Triton kernels run on CPU
tensors (slowly), which is how CI checks their logic without a GPU.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from batchd.kernels.options import current_options

BACKENDS = ("auto", "triton", "reference")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return "triton" or "reference" for tensors on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package: pip install 'batchd[triton]'")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"backend='triton' on {device.type} tensors needs TRITON_INTERPRET=1 "
                "(set before the first Triton kernel is used), or CUDA tensors"
            )
    return backend


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 elsewhere, which keeps interpreter grids small."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def seq_len_tensor(seq_len: int | torch.Tensor, batch: int, max_len: int, device: torch.device) -> torch.Tensor:
    """seq_len as an int64 tensor [B] on `device`. A tensor is never read back to the host."""
    if isinstance(seq_len, torch.Tensor):
        if seq_len.shape != (batch,):
            raise ValueError(f"seq_len tensor must have shape [{batch}], got {list(seq_len.shape)}")
        if seq_len.dtype.is_floating_point or seq_len.dtype == torch.bool:
            raise ValueError(f"seq_len tensor must be an integer tensor, got {seq_len.dtype}")
        return seq_len.to(device=device, dtype=torch.int64)
    seq_len = int(seq_len)
    if not 0 < seq_len <= max_len:
        raise ValueError(f"seq_len must be in 1..{max_len} (the cache's rows), got {seq_len}")
    return torch.full((batch,), seq_len, dtype=torch.int64, device=device)


def patch_interpreter_index() -> None:
    """Let the Triton CPU interpreter use loaded scalars as loop bounds under numpy >= 2.4.

    The interpreter keeps scalars as 1-element arrays and converts them with int(array), which
    numpy 2.4 refuses ("only 0-dimensional arrays can be converted"), so `range(start, end)` over
    values read from memory fails. Only the interpreter is touched; compiled kernels are unaffected.
    """
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_batchd_index_fix", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._batchd_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    _patch_interpreter_dot(interpreter)


def _patch_interpreter_dot(interpreter) -> None:
    """Make the interpreter's tl.dot row-independent, as the compiled MMA is.

    The interpreter multiplies tiles with np.matmul in float32, whose BLAS blocking (numpy 2.4)
    can change a row's last bits with the values in the tile's other rows, so batch-invariance
    tests would fail on the CPU for a reason the GPU does not have. Float products are summed in
    float64 (every float16/bfloat16/float32 product is exact there) and rounded once."""
    import numpy as np

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_batchd_dot_fix", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype.is_floating() and b.dtype.is_floating()) or a.dtype.primitive_bitwidth == 8 \
                or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle((product + d.data).astype(d.data.dtype), d.dtype.scalar)

    create_dot._batchd_dot_fix = True
    builder.create_dot = create_dot


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and later, compiled kernels only): a kernel may start
    while the one before it finishes, waiting (griddepcontrol.wait) only before it reads that
    kernel's results, so one kernel's launch and ramp-up hide behind the last one's tail. Measured on
    the H200 (bench/decode.py --compare-pdl): +4% decode at the Qwen2.5-1.5B shape, within noise at
    Llama-3-8B. Off with KernelOptions.pdl (BATCHD_PDL=0)."""
    if device.type != "cuda" or interpreting() or not current_options().pdl:
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def pdl_trigger_point(kernel: str) -> int:
    """Where decode kernel `kernel` (linear, reduce, split, merge) signals its dependents
    (kernels._pdl: 0 before its wait, 1 after it, 2 before its epilogue): KernelOptions.pdl_trigger."""
    return current_options().trigger_point(kernel)


def early_reads_enabled() -> bool:
    """Whether a decode kernel whose caller passed `settled=True` reads those inputs before its
    griddepcontrol.wait (kernels._pdl, "Settled inputs"): KernelOptions.early_reads_enabled."""
    return current_options().early_reads_enabled()


def launch_options(pdl: bool) -> dict:
    """Extra launch keywords for a Triton kernel: `launch_pdl` only where it is on (the CPU
    interpreter knows no such option)."""
    return {"launch_pdl": True} if pdl else {}
