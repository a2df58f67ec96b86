"""A few-row linear whose weights stream through shared memory by bulk copies (CUDA, sm_90+).

    out = stream_linear(x, weight)                          # x [M, K], weight [N, K] -> [M, N]
    act = stream_linear(post.weighted, w_gate_up, row_sumsq=post.sumsq, eps=eps, gated=True)
    h, inputs = stream_linear(act, w_down, residual=h, emit_norm_weight=next_norm.weight)

The same operation and fusions as kernels.small_matmul.small_linear (its reference,
small_linear_reference, is this kernel's twin), for the decode step's weight-bound projections:
one CTA per SM, a producer thread bulk-copying whole weight rows into a ring of shared-memory
slots from the moment the CTA starts (weights depend on no kernel), eight consumer warps on the
CUDA cores. Design and measurements: stream_linear.cu and docs/performance.md, "Stop 23".

Rows are batch-invariant: row m of an M-row call equals the one-row call on x[m] bit for bit, for
every M up to MAX_ROWS, so a verify step reproduces the decode steps' logits.

The kernel is chosen per weight shape by kernels.small_matmul's table (`SmallLinearConfig(stream=
True)`: Qwen2.5-1.5B's gate_up since stop 25); small_linear routes there, so callers keep one entry
point, and a stream entry falls back to Triton tiles where this kernel cannot run.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from batchd.kernels.small_matmul.reference import NormInputs, small_linear_reference

MAX_ROWS = 32
CONSUMER_WARPS = 8
THREADS = (CONSUMER_WARPS + 1) * 32
SLOT_TARGET_BYTES = 24 * 1024      # a bulk copy of 8-32 KB streams at copy speed (NOTES, stop 20)
MAX_SHARED_MEM = 227 * 1024        # sm_90's opt-in limit per block
SHARED_MEM_PER_SM = 228 * 1024     # of which 1 KB per resident block is the system's
X_STAGE_BYTES = 64 * 1024          # x up to this size is copied into shared memory once
DEFAULT_RING_BYTES = 192 * 1024
M_BUCKETS = (1, 2, 4, 8, 17, 32)   # 17: a verify step of 16 drafts and the last token
_SOURCE = Path(__file__).with_name("stream_linear.cu")


@dataclass(frozen=True)
class StreamPlan:
    """How one call is laid out: CTAs, units per chunk, ring slots, shared memory bytes."""
    grid: int
    chunk_units: int
    slot_bytes: int
    num_slots: int
    stage_x: bool
    shared_mem: int
    m_bucket: int


def plan(M: int, N: int, K: int, itemsize: int, *, gated: bool, emit: bool, sms: int,
         ring_bytes: int = DEFAULT_RING_BYTES, ctas_per_sm: int = 1, rope_half: int = 0,
         min_shared_bytes: int = 0, max_ctas: int = 0) -> StreamPlan:
    """The launch for x [M, K] and N output units (rows, gate/up pairs when gated, or the rope
    pairs (d, d + D/2) of each head when rope_half = D/2). A chunk is the largest power-of-two count
    of units (at most the 8 consumer warps) whose rows fit SLOT_TARGET_BYTES, and never less than
    one unit (with rope also a divisor of D/2, and CTAs take whole chunks); the ring holds as many
    slots as ring_bytes and the CTA's share of shared memory allow, at least two. x is staged in
    shared memory when it takes at most X_STAGE_BYTES. max_ctas caps the grid (0: none);
    min_shared_bytes raises the shared memory asked (never past the limit), which keeps a second CTA
    off an SM once it passes half of one (a CTA that shares an SM shares its issue slots: the dot
    products of Qwen2.5-1.5B's qkv took 1.6 us for 0.5, docs/performance.md "Stop 27").
    Raises ValueError where the kernel cannot run the shape."""
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"stream_linear takes 1..{MAX_ROWS} rows, got {M}")
    if (K * itemsize) % 16:
        raise ValueError(f"stream_linear needs rows of a multiple of 16 bytes (K * {itemsize} = {K * itemsize})")
    if ctas_per_sm not in (1, 2):
        raise ValueError(f"ctas_per_sm is 1 or 2, got {ctas_per_sm}")
    if rope_half and (gated or emit or N % rope_half):
        raise ValueError(f"stream_linear's rope takes whole heads of {2 * rope_half} rows and no other fusion")
    unit_bytes = K * itemsize * (2 if gated or rope_half else 1)
    chunk_units = chunk_units_for(unit_bytes, divides=rope_half)
    slot_bytes = chunk_units * unit_bytes
    grid = min(sms * ctas_per_sm, N // chunk_units if rope_half else N, max_ctas or N)
    limit = MAX_SHARED_MEM if ctas_per_sm == 1 else SHARED_MEM_PER_SM // 2 - 1024
    x_bytes = M * K * itemsize
    stage_x = x_bytes <= X_STAGE_BYTES
    # the kernel's layout after the ring: 256 B of mbarriers, the squares (16 B aligned), x
    squares = (-(-N // grid) * M * 4 + 15) // 16 * 16 if emit else 0
    tail = 256 + squares + (x_bytes if stage_x else 0)
    num_slots, shared_mem = ring_slots(slot_bytes, tail, ring_bytes, limit,
                                       f"stream_linear: a weight row of {unit_bytes} B")
    # a request past what the kernel uses keeps other CTAs off the SM (min_shared_bytes)
    shared_mem = max(shared_mem, min(min_shared_bytes, limit))
    bucket = next(b for b in M_BUCKETS if b >= M)
    return StreamPlan(grid, chunk_units, slot_bytes, num_slots, stage_x, shared_mem, bucket)


def chunk_units_for(unit_bytes: int, divides: int = 0) -> int:
    """Units a ring slot holds: the largest power of two, at most the CONSUMER_WARPS (a warp a unit),
    whose bytes fit SLOT_TARGET_BYTES, never less than one; with `divides`, also a divisor of it."""
    chunk_units = 1
    while chunk_units < CONSUMER_WARPS and 2 * chunk_units * unit_bytes <= SLOT_TARGET_BYTES and (
            not divides or divides % (2 * chunk_units) == 0):
        chunk_units *= 2
    return chunk_units


def ring_slots(slot_bytes: int, tail: int, ring_bytes: int, limit: int, what: str) -> tuple[int, int]:
    """(slots, shared memory bytes) of a stream kernel's ring: as many slots as ring_bytes holds
    (2-16), fewer while the ring and the kernel's tail (mbarriers, staged operands) exceed `limit`.
    Raises ValueError, naming `what`, when two slots do not fit."""
    num_slots = min(16, max(2, ring_bytes // slot_bytes))
    while num_slots > 2 and num_slots * slot_bytes + tail > limit:
        num_slots -= 1
    shared_mem = num_slots * slot_bytes + tail
    if shared_mem > limit:
        raise ValueError(f"{what} does not fit two ring slots in shared memory")
    return num_slots, shared_mem


class _Args(ctypes.Structure):
    """stream_linear.cu's `struct Args`, field for field. The rope fields exist in its -DWITH_ROPE
    build only; the other build's kernels read the first 128 bytes (everything up to trace_row)."""
    _fields_ = [("weight", ctypes.c_void_p), ("x", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("row_sumsq", ctypes.c_void_p), ("residual", ctypes.c_void_p), ("emit_weight", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("weighted", ctypes.c_void_p), ("sumsq_parts", ctypes.c_void_p),
                ("M", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int), ("P", ctypes.c_int),
                ("eps", ctypes.c_float),
                ("gated", ctypes.c_int), ("chunk_units", ctypes.c_int), ("num_slots", ctypes.c_int),
                ("use_pdl", ctypes.c_int), ("stage_x", ctypes.c_int),
                ("trace", ctypes.c_void_p), ("trace_row", ctypes.c_int),
                ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                ("q_out", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("q_stride_b", ctypes.c_longlong), ("q_stride_h", ctypes.c_longlong), ("q_stride_t", ctypes.c_longlong),
                ("c_stride_b", ctypes.c_longlong), ("c_stride_h", ctypes.c_longlong), ("c_stride_n", ctypes.c_longlong),
                ("T", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("rope_early", ctypes.c_int)]


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def stream_linear(
    x: torch.Tensor,                     # [M, K], M = 1..32, bf16/f16, contiguous
    weight: torch.Tensor,                # [N, K] contiguous ([2N, K] gate then up when gated)
    bias: torch.Tensor | None = None,    # [N]
    *,
    row_sumsq: torch.Tensor | None = None,         # [P, M] f32 (x = norm_weight * h)
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,          # [M, N]
    gated: bool = False,
    emit_norm_weight: torch.Tensor | None = None,  # [N]
    ring_bytes: int = DEFAULT_RING_BYTES,
    ctas_per_sm: int = 1,
    min_shared_bytes: int = 0,                     # ask at least this much shared memory (fewer CTAs an SM)
    max_ctas: int = 0,                             # at most this many CTAs (0: one per SM and ctas_per_sm)
    rope=None,                                     # kernels.small_matmul's RopeTarget: -> rotated q
    settled: bool = False,                         # rope's tables and positions written two or more launches back
    trigger_at_start: bool = False,                # PDL trigger 0: the next launch may start before this one waits
    backend: str = "auto",                         # "auto" | "cuda" | "reference"
):
    """x @ weight.T with small_linear's fusions -> [M, N], or (out, NormInputs) with
    emit_norm_weight (its sumsq has one part per CTA), or with rope (the q/k/v projection: rows
    m = b T + t of a [B, T] step) what kernels.rope_cache does after it: q and k rotated, k and v
    rows into the caches at their positions, -> q [B, Hq, T, D]; with `settled` (and
    kernels._backend.early_reads_enabled) the tables and positions are read before the kernel waits
    on the launch before it (kernels._pdl, "Settled inputs"). `trigger_at_start` lets the next
    launch start (and its producer fill its ring) while this one still waits: the caller's promise
    that the next launch reads early nothing the launch before this one writes. "auto" runs the CUDA
    kernel on an sm_90+ GPU and the references elsewhere."""
    from batchd.kernels.small_matmul import check_fusion_inputs, check_linear_inputs

    check_linear_inputs(x, weight[: weight.shape[0] // 2] if gated else weight, bias)
    check_fusion_inputs(x, weight, bias, row_sumsq, residual, gated, emit_norm_weight)
    if backend not in ("auto", "cuda", "reference"):
        raise ValueError(f"backend must be auto, cuda or reference, got {backend!r}")
    if rope is not None and (gated or residual is not None or emit_norm_weight is not None):
        raise ValueError("stream_linear's rope is the q/k/v projection's: no gate, residual or emitted norm")
    if backend == "reference" or (backend == "auto" and not cuda_supported(x.device)):
        out = small_linear_reference(x, weight, bias, row_sumsq=row_sumsq, eps=eps, residual=residual, gated=gated,
                                     emit_norm_weight=emit_norm_weight)
        if rope is None:
            return out
        from batchd.kernels.rope_cache import rope_and_store

        return rope_and_store(out.view(rope.k_cache.shape[0], -1, out.shape[-1]), rope.cos, rope.sin, rope.positions,
                              rope.k_cache, rope.v_cache, rope.num_heads, rope.num_kv_heads, backend="reference")
    check_cuda_operands(x, "stream_linear")
    # the kernel reads every [rows, cols] operand at a row pitch of cols (the checks allow others)
    return _launch(x.contiguous(), weight.contiguous(), bias, row_sumsq, eps,
                   None if residual is None else residual.contiguous(), gated, emit_norm_weight, ring_bytes, ctas_per_sm,
                   rope, settled, trigger_at_start, min_shared_bytes, max_ctas)


def cuda_supported(device: torch.device) -> bool:
    """An sm_90+ CUDA device (bulk copies, mbarrier transaction counts, griddepcontrol)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def check_cuda_operands(x: torch.Tensor, kernel: str) -> None:
    """Raise ValueError, naming `kernel`, unless x can go to a stream kernel: on an sm_90+ GPU, bf16/f16."""
    if not cuda_supported(x.device):
        raise ValueError(f"{kernel}'s CUDA kernel needs an sm_90+ GPU, not {x.device}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{kernel}'s CUDA kernel takes bf16 or f16, got {x.dtype}")


def launch_switches() -> tuple[tuple[str, ...], int | None]:
    """(-D options, shared-memory carveout) of the stream kernels from two probes' switches, read
    when a kernel is first compiled for them (bench/step_sweep.py sets them per variant):
    BATCHD_STREAM_PRODUCER_TRIGGER=1: the producer thread also signals the dependent launch at its
    start, not only the consumers after their wait; BATCHD_STREAM_CARVEOUT=PERCENT: the kernels'
    preferred shared share of the L1/shared split (unset: the driver's choice);
    BATCHD_STREAM_PHASE_MARKS=1: traced CTAs put thread 0's phases after its wait in the trace's SM
    slot (ns; x staged, first chunk's weights landed, its dot products, its epilogue: 16 bits each),
    which bench/timeline.py prints (phase_table); =2: the same, but the cluster attention kernel marks
    its compute instead (cluster joined, first and last key block's softmax, partials pushed)."""
    import os

    trigger = os.environ.get("BATCHD_STREAM_PRODUCER_TRIGGER", "0")
    carveout = os.environ.get("BATCHD_STREAM_CARVEOUT", "")
    if trigger not in ("0", "1") or not (carveout == "" or carveout.isdigit() and int(carveout) <= 100):
        raise ValueError("BATCHD_STREAM_PRODUCER_TRIGGER is 0 or 1 and BATCHD_STREAM_CARVEOUT a percent (0-100), "
                         f"got {trigger!r} and {carveout!r}")
    marks = os.environ.get("BATCHD_STREAM_PHASE_MARKS", "0")
    if marks not in ("0", "1", "2"):
        raise ValueError(f"BATCHD_STREAM_PHASE_MARKS is 0, 1 or 2 (the cluster attention kernel's compute), got {marks!r}")
    phases = {"1": ("-DPHASE_MARKS",), "2": ("-DPHASE_MARKS", "-DPHASE_DETAIL")}.get(marks, ())
    return (("-DPRODUCER_TRIGGER",) if trigger == "1" else ()) + phases, (int(carveout) if carveout else None)


def compile_stream_kernels(source: Path, prefix: str, device: torch.device, dtype: torch.dtype,
                           options: tuple[str, ...] = ()) -> dict:
    """The stream kernels of `source` (`{prefix}_m{bucket}` for every M bucket) for `device` and
    dtype, with the probes' launch switches, compiled at first use (kernels._cuda_launch caches per
    options). Both stream sources include this folder's stream_common.cuh and bulk_ring.cuh."""
    from batchd.kernels._cuda_launch import compile_kernels

    names = tuple(f"{prefix}_m{b}" for b in M_BUCKETS)
    defines, carveout = launch_switches()
    all_options = (f"-I{_SOURCE.parent}", *options, *(("-DSCALAR_F16",) if dtype == torch.float16 else ()), *defines)
    return compile_kernels(_source_text(source), names, device, all_options, max_shared_mem=MAX_SHARED_MEM,
                           shared_carveout=carveout)


@functools.cache
def _source_text(source: Path) -> str:
    return source.read_text()     # once: the launches ask for their kernels on every call


def trace_rows(label: str, grid: int, any_tensor: torch.Tensor) -> tuple[int | None, int]:
    """(rows pointer, first row) in kernels._trace's open recorder, one row per CTA of a stream
    kernel, for bench/timeline.py; (None, 0) when none is open (or without triton, which _trace
    imports)."""
    from batchd.kernels._backend import triton_available

    if not triton_available():
        return None, 0
    from batchd.kernels import _trace

    args = _trace.trace_args(label, (grid,), any_tensor)
    return (args["Trace"].data_ptr(), args["trace_row"]) if args["TRACE"] else (None, 0)


def _rope_args(rope, M: int, dtype: torch.dtype, early: bool) -> tuple[torch.Tensor | None, tuple]:
    """(q_out [B, Hq, T, D] or None, the Args fields from rope_cos on) for `rope` (None: zeros)."""
    if rope is None:
        return None, (None,) * 6 + (0,) * 6 + (1, 0, 0, 0, 0)
    k_cache = rope.k_cache
    B, head_dim = k_cache.shape[0], k_cache.shape[3]
    T = M // B
    if k_cache.dtype != dtype or rope.v_cache.stride() != k_cache.stride():
        raise ValueError("stream_linear's rope needs caches of x's dtype with one layout")
    q_out = torch.empty(B, rope.num_heads, T, head_dim, dtype=dtype, device=k_cache.device)
    cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
    return q_out, (cos.data_ptr(), sin.data_ptr(), rope.positions.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(),
                   rope.v_cache.data_ptr(), *q_out.stride()[:3], *k_cache.stride()[:3],
                   T, rope.num_heads, rope.num_kv_heads, head_dim, int(early))


def _launch(x, weight, bias, row_sumsq, eps, residual, gated, emit_norm_weight, ring_bytes, ctas_per_sm, rope=None,
            settled=False, trigger_at_start=False, min_shared_bytes=0, max_ctas=0):
    from batchd.kernels._backend import early_reads_enabled, multiprocessor_count, pdl_enabled

    M, K = x.shape
    N = weight.shape[0] // 2 if gated or rope is not None else weight.shape[0]
    emit = emit_norm_weight is not None
    q_out, rope_fields = _rope_args(rope, M, x.dtype, settled and early_reads_enabled())
    p = plan(M, N, K, x.element_size(), gated=gated, emit=emit, sms=multiprocessor_count(x.device),
             ring_bytes=ring_bytes, ctas_per_sm=ctas_per_sm, rope_half=rope_fields[-2] // 2,
             min_shared_bytes=min_shared_bytes, max_ctas=max_ctas)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if rope is None else q_out
    weighted = torch.empty_like(out) if emit else None
    sumsq_parts = torch.empty(p.grid, M, dtype=torch.float32, device=x.device) if emit else None
    pdl = pdl_enabled(x.device)
    kind = " gated" if gated else " rope" if rope is not None else " residual" if residual is not None else ""
    args = _Args(weight.data_ptr(), x.data_ptr(), _pointer(bias), _pointer(row_sumsq), _pointer(residual),
                 _pointer(emit_norm_weight), out.data_ptr(), _pointer(weighted), _pointer(sumsq_parts),
                 M, N, K, row_sumsq.shape[0] if row_sumsq is not None else 0, float(eps),
                 int(gated), p.chunk_units, p.num_slots, int(pdl), int(p.stage_x),
                 *trace_rows(f"stream {N}x{K}{kind}", p.grid, out), *rope_fields)
    # rope: a build of its own (-DWITH_ROPE), so that the other projections' kernels carry none of its registers
    options = (*(("-DWITH_ROPE",) if rope is not None else ()), *(("-DTRIGGER_AT_START",) if trigger_at_start else ()))
    kernel = compile_stream_kernels(_SOURCE, "stream_linear", x.device, x.dtype, options)[f"stream_linear_m{p.m_bucket}"]
    kernel.launch(p.grid, THREADS, p.shared_mem, args, pdl=pdl)
    if emit:
        return out, NormInputs(weighted, sumsq_parts)
    return out


__all__ = ["stream_linear", "plan", "chunk_units_for", "ring_slots", "StreamPlan", "cuda_supported",
           "check_cuda_operands", "compile_stream_kernels", "trace_rows", "launch_switches", "MAX_ROWS"]
