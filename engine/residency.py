"""Drafter residency for one compressing job: the target stays resident; the drafter visits.

    residency = Residency()
    result = residency.with_drafter(engine, drafter_path, work, telemetry, prompt_tokens=n)

Phases (docs/design.md section 3, Residency), each timed into the job's telemetry:
  1. read the drafter checkpoint into host memory (it decides what must make room),
  2. park the target if the drafter does not fit beside it: synchronise EVERY stream of the
     device first (queued kernels must not touch freed memory, the seed's park() bug), then free
     the KV cache (its rows are reset per job anyway) and, if still short, the weights,
  3. place the drafter on the device, 4. run `work(drafter)` (scoring),
  5. release the drafter, 6. unpark the target.
Steps 5 and 6 run on every path, failures included; a load or scoring failure then surfaces as
an `EngineError` for the job and the worker keeps serving. A failed restore falls back to the
other strategy (host copy <-> reload from the checkpoint) before giving up.

Parked weights go to pinned host memory ("host", kept between jobs so pinning is paid once) or
are dropped and reloaded from the checkpoint ("reload"); `DEFAULT_PARK_STRATEGY` is the faster.
A reload from a Hugging Face folder reads the safetensors straight into the device weights
(`reload_hf_weights`: no hash, no host copy of the whole model), after checking that the files'
sizes and mtimes are those seen at park; a GGUF goes through the full reader (dequantisation).
Measured on the CPU (SmolLM2-135M fp32, 0.5 GiB, bench/pflash.py --device cpu): host park 0.43 s
the first time (the copy; later parks find the restored weight is its own copy), unpark 0.03 s;
reload park 0.05 s, unpark 1.1-1.3 s through load_checkpoint (read, hash, convert), before
`reload_hf_weights`. On a GPU a pinned copy moves at PCIe speed both ways while a reload reads
the disk (or the page cache) and copies from pageable memory; bench/pflash.py measures both on
the H200 (cold and warm page cache) and ranks them.

`step_hook(step, obj)` is called at "park" (engine), "load" (drafter, once it is on the
device), "score" (drafter, after work), "release" (None) and "unpark" (engine, after the first
weight is back): tests raise from it to inject a failure at that step.
"""
from __future__ import annotations

import gc
import logging
import math
import time
from collections import OrderedDict
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional, TypeVar

import torch
from safetensors import safe_open

from batchd.engine.checkpoint import Checkpoint, load_checkpoint
from batchd.engine.checkpoint.hf import _weight_files
from batchd.engine.checkpoint.validate import IGNORED_SUFFIXES
from batchd.engine.drafter_names import file_identity
from batchd.engine.errors import DeviceOutOfMemoryError, EngineError
from batchd.engine.model import Transformer, build_model, init_random
from batchd.engine.step import StepRunner
from batchd.engine.text import TextCodec
from batchd.engine.types import Telemetry

log = logging.getLogger(__name__)

ParkStrategy = Literal["host", "reload"]
ParkPolicy = Literal["auto", "always", "never"]
DEFAULT_PARK_STRATEGY: ParkStrategy = "host"
DEFAULT_HEADROOM_BYTES = 1 << 30  # allocator slack and kernels' workspaces beyond our estimate
T = TypeVar("T")


class DrafterError(EngineError):
    """The drafter could not be loaded or could not score; the target was restored."""

    kind = "model_error"


class TargetRestoreError(EngineError):
    """The parked target could not be brought back; this worker must restart."""

    kind = "internal"
    retryable = True  # on another worker


@dataclass
class Drafter:
    model: Transformer
    codec: TextCodec
    path: str
    sha256: str
    architecture: str
    scorer: Optional[object] = field(default=None, repr=False)   # engine.pflash.scoring.PaddedScorer (CUDA)


@dataclass
class _Parked:
    """What park() took away, so unpark() can put it back, weight by weight (idempotent: a
    restore that fails half-way is resumed, by either strategy)."""

    strategy: ParkStrategy
    cache_shapes: list[torch.Size]
    weight_shapes: dict[str, torch.Size] = field(default_factory=dict)
    moved: set[str] = field(default_factory=set)  # weights whose device memory was dropped
    stamp: list[tuple[str, int, int]] = field(default_factory=list)  # the checkpoint files (reload)


def synchronize_all_streams(device: torch.device) -> None:
    """Wait for every stream on the device (torch.cuda.synchronize is device-wide)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_bytes(device: torch.device) -> float:
    """Bytes a new allocation can get: the driver's free memory plus PyTorch's cached blocks.
    On the CPU the "device" is host memory, where parking would move RAM to RAM: unlimited."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return math.inf


def drafter_bytes_needed(ckpt: Checkpoint, dtype: torch.dtype, tokens: int, rows: int) -> int:
    """Weights + a KV cache of `tokens` rows + the activations of one `rows`-row forward (an
    estimate) + the tail scoring's [Hq, 8, tokens] float32 probabilities."""
    c = ckpt.config
    element = torch.empty((), dtype=dtype).element_size()
    weights = sum(t.numel() for t in ckpt.tensors.values()) * element
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * tokens * element
    per_row = 4 * c.hidden_size + 3 * c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    activations = min(tokens, rows) * per_row * 4 + c.num_heads * 8 * tokens * 4 * 3
    return weights + kv + activations


def weight_bytes(model: Transformer) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Residency:
    """Owns the drafter's visits to one engine's device. One per engine; not thread-safe (one
    thread drives an engine: a worker's engine loop).

    `keep_resident` (the worker sets it): up to that many drafters that fitted beside the target
    without parking it stay on the device after their job, so the next job that names the same
    checkpoint (by file identity, however its path is spelled) scores with no load at all. A job
    that needs a drafter that does not fit first drops the resident ones, then parks as before."""

    def __init__(self, *, park: ParkPolicy = "auto", strategy: ParkStrategy = DEFAULT_PARK_STRATEGY,
                 headroom_bytes: int = DEFAULT_HEADROOM_BYTES, activation_rows: int = 8192,
                 read_checkpoint: Callable[..., Checkpoint] = load_checkpoint,
                 synchronize: Callable[[torch.device], None] = synchronize_all_streams,
                 free_bytes: Callable[[torch.device], float] = free_device_bytes,
                 step_hook: Optional[Callable[[str, object], None]] = None, keep_resident: int = 0):
        if park not in ("auto", "always", "never"):
            raise ValueError(f"park must be auto, always or never, got {park!r}")
        if strategy not in ("host", "reload"):
            raise ValueError(f"strategy must be host or reload, got {strategy!r}")
        self.park_policy, self.strategy = park, strategy
        self.headroom_bytes, self.activation_rows = headroom_bytes, activation_rows
        self.read_checkpoint, self.synchronize, self.free_bytes = read_checkpoint, synchronize, free_bytes
        self.step_hook = step_hook or (lambda step, obj: None)
        self.host_weights: dict[str, torch.Tensor] = {}  # pinned copies, reused across jobs
        self.parked: Optional[_Parked] = None
        self.last_drafter: Optional[weakref.ref] = None  # for leak checks
        self.keep_resident = keep_resident
        self.resident: OrderedDict[tuple, Drafter] = OrderedDict()  # file identity -> drafter, oldest first

    # ---- the job ---------------------------------------------------------------------------

    def with_drafter(self, engine, drafter_path: str, work: Callable[[Drafter], T], telemetry: Telemetry, *,
                     prompt_tokens: int, activation_rows: Optional[int] = None) -> T:
        """Load the drafter (parking the target when both do not fit), return work(drafter);
        the drafter is released and the target restored whatever happens. `prompt_tokens` and
        `activation_rows` (rows per drafter forward) size the drafter's memory estimate."""
        self.ensure_resident(engine, telemetry)
        device = engine.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        key = file_identity(drafter_path)
        if key in self.resident:
            return self._run_resident(key, drafter_path, work, telemetry)
        failure: Optional[EngineError] = None
        result = drafter = None
        try:
            rows = activation_rows or self.activation_rows
            result, drafter = self._load_and_run(engine, drafter_path, work, telemetry, prompt_tokens, rows)
        except Exception as exc:  # noqa: BLE001 - every drafter failure becomes the job's error
            failure = self.job_error(exc, drafter_path)
            forget_frames(exc)  # the traceback's frames would keep a half-built drafter alive
            del exc
        if failure is None and self.parked is None and self.keep_resident > 0 and key is not None:
            self._keep(key, drafter)   # it fitted beside the target: the next job uses it as it is
            telemetry.notes.append("PFlash drafter loaded and kept resident beside the target")
            return result
        del drafter
        started = time.perf_counter()
        self._release_drafter(device)
        telemetry.unpark_s += time.perf_counter() - started  # release counts as part of restoring
        if self.parked is not None:
            self.unpark(engine, telemetry, after=failure)
        if device.type == "cuda":
            telemetry.peak_device_memory_bytes = torch.cuda.max_memory_allocated(device)
        if failure is not None:
            raise failure
        return result

    def _load_and_run(self, engine, path: str, work, telemetry: Telemetry, prompt_tokens: int, rows: int):
        dtype, device = engine.model.dtype, engine.device
        started = time.perf_counter()
        ckpt = self.read_checkpoint(path, dtype=dtype)
        telemetry.drafter_load_s += time.perf_counter() - started
        # drafter tokens are not known before its tokenizer runs; twice the target's is ample
        needed = drafter_bytes_needed(ckpt, dtype, 2 * prompt_tokens, rows)
        if self.resident and self.free_bytes(device) < needed + self.headroom_bytes:
            self.drop_resident(telemetry)   # other drafters first, before the target is parked
        self.park_if_needed(engine, needed, telemetry)
        started = time.perf_counter()
        # the target's kernels; a target of its own kind (deepseek_v4) has none: the device's then
        drafter = self._place(ckpt, device, dtype, getattr(engine.model, "ops", None))
        del ckpt
        if device.type == "cuda":
            synchronize_all_streams(device)
        telemetry.drafter_load_s += time.perf_counter() - started
        self.step_hook("load", drafter)
        result = work(drafter)
        self.step_hook("score", drafter)
        return result, drafter

    def _run_resident(self, key: tuple, path: str, work, telemetry: Telemetry):
        self.resident.move_to_end(key)
        drafter = self.resident[key]
        try:
            result = work(drafter)
            self.step_hook("score", drafter)
            return result
        except Exception as exc:  # noqa: BLE001 - the job's error; out of memory also drops the residents
            failure = self.job_error(exc, path)
            forget_frames(exc)
            del exc
        if isinstance(failure, DeviceOutOfMemoryError):
            self.drop_resident(telemetry)
        raise failure

    def _keep(self, key: tuple, drafter: Drafter) -> None:
        while len(self.resident) >= self.keep_resident:
            self.resident.popitem(last=False)
        self.resident[key] = drafter

    def drop_resident(self, telemetry: Optional[Telemetry] = None) -> None:
        """Release every resident drafter (a job needs their memory)."""
        if not self.resident:
            return
        started = time.perf_counter()
        self.resident.clear()
        gc.collect()   # module graphs can hold reference cycles
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if telemetry is not None:
            telemetry.park_s += time.perf_counter() - started

    def _place(self, ckpt: Checkpoint, device, dtype, ops) -> Drafter:
        # with the target's kernels (engine.fused.KernelChoice), as every model the engine runs
        model = build_model(ckpt.config, str(device), dtype, tensors=ckpt.tensors, source=ckpt.path, ops=ops)
        self.last_drafter = weakref.ref(model)
        codec = TextCodec(ckpt.tokenizer, ckpt.chat_template, ckpt.bos_token, ckpt.eos_token,
                          template_source=ckpt.chat_template_source)
        return Drafter(model, codec, ckpt.path, ckpt.sha256, ckpt.config.architecture)

    def _release_drafter(self, device) -> None:
        try:
            self.step_hook("release", None)
        except Exception as exc:  # noqa: BLE001 - nothing may stop the target's restore
            log.error("release hook failed", exc_info=exc)
            forget_frames(exc)
        if self.last_drafter is not None and self.last_drafter() is not None:
            gc.collect()  # module graphs can hold reference cycles
            if self.last_drafter() is not None:
                log.error("the PFlash drafter is still referenced after release; its memory leaks")
        if device.type == "cuda":
            torch.cuda.empty_cache()

    @staticmethod
    def job_error(exc: Exception, path: str) -> EngineError:
        if isinstance(exc, torch.OutOfMemoryError):
            return DeviceOutOfMemoryError(f"out of device memory loading or running the PFlash drafter {path}; "
                                          "the target was restored; retry, or submit with --compress off")
        if isinstance(exc, EngineError):  # a bad checkpoint, a refused option: already says what to do
            return exc
        log.error("PFlash drafter %s failed", path, exc_info=exc)
        return DrafterError(f"PFlash drafter {path} failed ({type(exc).__name__}: {exc}); the target was "
                            "restored; check the drafter checkpoint or submit with --compress off")

    # ---- parking -----------------------------------------------------------------------------

    def park_if_needed(self, engine, drafter_bytes: int, telemetry: Telemetry) -> None:
        """Make room for `drafter_bytes`: nothing when it fits, else the KV cache, else all."""
        if self.park_policy == "never":
            return
        weights_too = True
        if self.park_policy == "auto":
            needed = drafter_bytes + self.headroom_bytes
            free = self.free_bytes(engine.device)
            if free >= needed:
                return
            weights_too = free + engine.cache.nbytes < needed
        self.park(engine, weights=weights_too, telemetry=telemetry)

    @torch.no_grad()  # not inference_mode: buffers made here are written in place later
    def park(self, engine, *, weights: bool = True, telemetry: Optional[Telemetry] = None) -> None:
        """Free the target's KV cache and, with `weights`, move its weights off the device."""
        if self.parked is not None:
            raise RuntimeError("the target is already parked")
        started = time.perf_counter()
        device, cache = engine.device, engine.cache
        self.synchronize(device)  # before anything is freed: queued kernels may still read it
        self.step_hook("park", engine)
        parked = self.parked = _Parked(self.strategy, [k.shape for k in cache.keys])
        _drop_step_graphs(engine)  # captured graphs point at the buffers about to go
        for buffers in (cache.keys, cache.values):
            for i, buffer in enumerate(buffers):
                buffers[i] = buffer.new_empty(0)
        if weights:
            params = dict(engine.model.named_parameters())
            parked.weight_shapes = {name: p.shape for name, p in params.items()}
            if self.strategy == "reload" and engine.checkpoint_path and Path(engine.checkpoint_path).is_dir():
                parked.stamp = checkpoint_stamp(engine.checkpoint_path)
            if self.strategy == "host":
                self._copy_to_host(params, device)
            for name, p in params.items():
                p.data = self.host_weights[name] if self.strategy == "host" else p.data.new_empty(0)
                parked.moved.add(name)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if telemetry is not None:
            telemetry.park_s += time.perf_counter() - started
            what = "KV cache and weights" if weights else "KV cache"
            telemetry.notes.append(f"PFlash parked the target's {what} ({self.strategy}) to fit the drafter")

    def _copy_to_host(self, params: dict[str, torch.nn.Parameter], device) -> None:
        pin = device.type == "cuda"
        for name, p in params.items():
            host = self.host_weights.get(name)
            if host is None or host.shape != p.shape or host.dtype != p.dtype:
                host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                self.host_weights[name] = host
            if host.data_ptr() != p.data.data_ptr():  # on the CPU a restored weight IS its copy
                host.copy_(p.data, non_blocking=pin)
        self.synchronize(device)  # the copies must land before the device memory is dropped

    @torch.no_grad()
    def unpark(self, engine, telemetry: Optional[Telemetry] = None, *, after: Optional[Exception] = None) -> None:
        """Bring the target back; when the parked strategy fails, try the other one; when both
        fail raise TargetRestoreError (the target stays parked; the next compressing job, or
        `ensure_resident`, tries again). `after`: the job's own failure, for the message."""
        started = time.perf_counter()
        parked = self.parked
        strategies = [parked.strategy] + [s for s in ("host", "reload") if s != parked.strategy]
        errors = []
        for strategy in strategies:
            try:
                self._restore(engine, parked, strategy)
                break
            except Exception as exc:  # noqa: BLE001 - a restore that fails is retried another way
                log.error("restoring the target (%s) failed", strategy, exc_info=exc)
                errors.append(f"{strategy}: {type(exc).__name__}: {exc}")
                forget_frames(exc)
        else:
            also = f"; the job had failed first: {after}" if after is not None else ""
            raise TargetRestoreError("the target model could not be restored after PFlash ("
                                     + "; ".join(errors) + f"){also}; restart the worker")
        self.parked = None
        if telemetry is not None:
            telemetry.unpark_s += time.perf_counter() - started
            if errors:
                telemetry.notes.append(f"restoring the target by {errors[0]} failed; restored by {strategy}")

    def _restore(self, engine, parked: _Parked, strategy: ParkStrategy) -> None:
        device = engine.device
        params = dict(engine.model.named_parameters())
        if parked.moved:
            if strategy == "host":
                missing = parked.moved - set(self.host_weights)
                if missing or parked.strategy != "host":
                    raise RuntimeError("no host copy of the weights (they were parked by reload)")
                for name in sorted(parked.moved):
                    params[name].data = self.host_weights[name].to(device, non_blocking=True)
                    parked.moved.discard(name)
                    self.step_hook("unpark", engine)
            else:
                self._reload(engine, params, parked)
            if engine.fused_mlp:
                engine.model.use_fused_mlp()  # restored weights are contiguous: down transposed again
        cache = engine.cache
        for buffers in (cache.keys, cache.values):
            for i, shape in enumerate(parked.cache_shapes):
                if buffers[i].shape != shape:
                    buffers[i] = torch.zeros(shape, dtype=engine.model.dtype, device=device)
        cache.truncate(0)
        self.synchronize(device)

    def _reload(self, engine, params, parked: _Parked) -> None:
        """Read the weights again: from the checkpoint, or the same random weights again."""
        device, dtype = engine.device, engine.model.dtype
        for name in parked.moved:
            params[name].data = torch.empty(parked.weight_shapes[name], dtype=dtype, device=device)
        self.step_hook("unpark", engine)
        path, sha = engine.checkpoint_path, engine.checkpoint_sha256
        if path and Path(path).is_dir():
            if parked.stamp and checkpoint_stamp(path) != parked.stamp:
                raise RuntimeError(f"{path} changed on disk since the target was parked; its weights would "
                                   "not match the job's checkpoint hash")
            reload_hf_weights(engine.model, path)
        elif path:  # GGUF: dequantised on load, through the full reader
            engine.model.load_hf_tensors(self.read_checkpoint(path, dtype=dtype).tensors, path)
        elif sha.startswith("random-seed-"):  # Engine.from_config: the same random weights again
            init_random(engine.model, int(sha.removeprefix("random-seed-")))
        else:
            raise RuntimeError("the target has no checkpoint to reload its weights from")
        parked.moved.clear()

    def ensure_resident(self, engine, telemetry: Optional[Telemetry] = None) -> None:
        """A previous job left the target parked (its restore failed): try again now."""
        if self.parked is not None:
            self.unpark(engine, telemetry)

    def release_host_copy(self) -> None:
        """Give back the pinned host memory kept for parking (the next park pins again)."""
        if self.parked is None:
            self.host_weights.clear()


def forget_frames(exc: BaseException) -> None:
    """Clear the locals of every frame in the tracebacks of `exc` and its causes."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _drop_step_graphs(engine) -> None:
    """Captured CUDA graphs point at the old buffers: start a fresh step runner (graphs are
    captured again on first use)."""
    runner = engine.runner
    engine.runner = StepRunner(engine.model, engine.cache, cuda_graphs=runner.cuda_graphs)
    batch = getattr(engine, "batch", None)   # the batch engine's row graphs read the weights too
    if batch is not None:
        batch.drop_graphs()   # the drafters' rows too


def checkpoint_stamp(folder: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of a Hugging Face folder's weight files: a reload checks that they
    are the files the target was loaded from, without hashing them again."""
    files, _ = _weight_files(Path(folder))
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def hf_weight_slots(config) -> dict[str, tuple[str, int]]:
    """Hugging Face tensor name -> (our parameter, first row): q/k/v and gate/up are row blocks of
    one fused matrix (engine.model.fuse_hf_tensors); every other tensor is a whole parameter."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    slots = {}
    for i in range(config.num_layers):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        for kind in ("weight", "bias"):
            for part, row in zip("qkv", (0, q_size, q_size + kv_size)):
                slots[f"model.{attn}.{part}_proj.{kind}"] = (f"{attn}.qkv_proj.{kind}", row)
        slots[f"model.{mlp}.gate_proj.weight"] = (f"{mlp}.gate_up_proj.weight", 0)
        slots[f"model.{mlp}.up_proj.weight"] = (f"{mlp}.gate_up_proj.weight", config.intermediate_size)
    return slots


@torch.no_grad()
def reload_hf_weights(model: Transformer, folder: str) -> None:
    """Read a Hugging Face folder's safetensors straight into the model's (allocated) parameters,
    one tensor at a time: each is read from disk, copied to the device and cast there, q/k/v and
    gate/up into their rows of the fused matrices. No hash, no full host copy of the model (what
    load_checkpoint costs: the reload strategy's unpark). Every parameter must be written."""
    params = dict(model.named_parameters())
    slots = hf_weight_slots(model.config)
    tied = model.config.tie_word_embeddings
    rows_left = {name: p.shape[0] for name, p in params.items()}
    files, _ = _weight_files(Path(folder))
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith(IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
                    continue
                name, row = slots.get(hf_name, (hf_name.removeprefix("model."), 0))
                if name not in params:
                    raise RuntimeError(f"{path}: tensor {hf_name} has no place in the model")
                value = f.get_tensor(hf_name).to(params[name].device, non_blocking=False)
                params[name].data[row : row + value.shape[0]].copy_(value)
                rows_left[name] -= value.shape[0]
    unfilled = sorted(name for name, rows in rows_left.items() if rows)
    if unfilled:
        raise RuntimeError(f"{folder}: reload left parameters unfilled or overfilled: {unfilled[:4]}")
