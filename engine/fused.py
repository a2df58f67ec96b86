"""The elementwise pieces of a layer, as pure tensor functions that can be fused.

Eagerly each is a handful of small kernels; at batch 1 a decode step of a 1.5B model would spend
more time launching them than reading weights. On CUDA the engine's `KernelChoice` holds
`torch.compile`d versions (one Triton kernel each, dynamic in the token axis so one compile
serves decode, every verify width and every prefill chunk); norms run kernels.rms_norm (one
reduction order for any row count), the q/k rope plus the cache write one launch
(kernels.rope_cache), and silu * up of prefill-sized inputs kernels.silu_mul. The maths is
identical on CPU, where the eager versions run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; statistics in float32, as the reference implementation computes them."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then norm: returns (x + residual, rms_norm(x + residual))."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos, sin: [T, D] float32, cast to x's dtype as HF does ("rotate half")."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I] (gate then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# From this many rows (numel / last dim) the CUDA choice's silu_mul runs kernels.silu_mul instead
# of the compiled function. Inductor's dynamic-shape kernel divides each element's flat index by the
# runtime width, which held prefill chunks to about a quarter of the H200's copy bandwidth (96 us a
# layer at 4,096 rows of Qwen2.5-0.5B). The two may round differently in the last bit (inductor
# need not round silu to the model dtype before the product), so the choice follows the row count
# alone: decode (1 row a sequence) and verify (up to 17) steps stay on the compiled function and
# keep their bits, and a prompt chunk's rows are fixed by the sequence. (The batch engine's rows and
# packed chunks call kernels.silu_mul directly at any row count: engine.batch.rows.silu_mul_rows.)
SILU_MUL_KERNEL_ROWS = 64


def silu_mul_by_rows(compiled: Callable, kernel: Callable) -> Callable:
    """silu_mul through `kernel` from SILU_MUL_KERNEL_ROWS rows, else through `compiled`."""
    def silu_mul_routed(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.numel() >= SILU_MUL_KERNEL_ROWS * gate_up.shape[-1]:   # rows >= the threshold
            return kernel(gate_up)
        return compiled(gate_up)

    return silu_mul_routed


@dataclass(frozen=True)
class KernelChoice:
    """Which implementation of each elementwise piece and of small projections a model runs.

    Held by the model (`Transformer.ops`, set by `Transformer.use_ops`) rather than by module
    globals, so two models in one process can differ and nothing is rebound at run time. The
    engine builds its choice once, at construction (`kernels_for(device)`), and hands it to every
    model it runs: the target, speculative drafters and the PFlash drafter alike."""

    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    rotate: Callable = rotate
    silu_mul: Callable = silu_mul
    # kernels.rope_cache.rope_and_store: q/k rope plus the cache write in one launch (None: eager ops)
    rope_kernel: Optional[Callable] = None
    # kernels.small_matmul.small_linear: row-invariant projections of up to 17 rows (engine.linear)
    small_linear: Optional[Callable] = None

    @property
    def decode_kernels(self) -> bool:
        """Whether CUDA decode and verify steps run the invariant kernels (and the fused layer path)."""
        return self.small_linear is not None


EAGER = KernelChoice()  # the CPU's choice, and a model's until it is given another


def kernels_for(device) -> KernelChoice:
    """The kernels a model on `device` runs: eager on the CPU; on CUDA the compiled and Triton ones."""
    return cuda_kernels() if torch.device(device).type == "cuda" else EAGER


@functools.cache
def cuda_kernels() -> KernelChoice:
    """The CUDA choice, built once per process: torch.compile wrappers are made once (each new
    wrapper would compile again), dynamic in the token axis so one compile serves decode, every
    verify width and every prefill chunk."""
    compiled = {name: torch.compile(fn, dynamic=True, fullgraph=True)
                for name, fn in (("rms_norm", rms_norm), ("add_rms_norm", add_rms_norm), ("rotate", rotate),
                                 ("silu_mul", silu_mul))}
    # imported where the CUDA choice is built, as enable_fusion() and enable_invariant_kernel() did:
    # an ImportError (a kernel package that cannot load) leaves the compiled functions and the
    # library's GEMMs
    try:
        from batchd.kernels.rms_norm import rms_norm as norm_kernel
        from batchd.kernels.rope_cache import rope_and_store
    except ImportError:
        pass
    else:
        # Norms reduce over a row: torch.compile specialises one-row shapes and may split the
        # reduction there, so a decode row and the same row inside a verify step would differ
        # in the last bits. The kernel keeps one reduction order for any number of rows.
        compiled["rms_norm"] = lambda x, weight, eps: norm_kernel(x, weight, eps)[0]  # noqa: E731

        def add_rms_norm_kernel(x, residual, weight, eps):
            normed, h = norm_kernel(x, weight, eps, residual)
            return h, normed

        compiled["add_rms_norm"] = add_rms_norm_kernel
        compiled["rope_kernel"] = rope_and_store
    try:
        from batchd.kernels.silu_mul import silu_mul as silu_mul_kernel
    except ImportError:
        pass
    else:
        compiled["silu_mul"] = silu_mul_by_rows(compiled["silu_mul"], silu_mul_kernel)
    try:
        from batchd.kernels.small_matmul import small_linear  # decode and verify rows computed alike
    except ImportError:
        small_linear = None
    return KernelChoice(**compiled, small_linear=small_linear)
