"""Shared helpers for GPU benchmarks: measured copy bandwidth, timing, table printing."""
from __future__ import annotations

import time

import torch


def copy_bandwidth(device="cuda", gigabytes: float = 4.0, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gigabytes * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / repeats
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / elapsed


def cuda_time(fn, warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def graph_replay_time(fn, repeats: int = 15) -> float:
    """Median seconds of one replay of a CUDA graph capturing fn() (warmed up on a side stream
    first, as capture requires)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time(graph.replay, warmup=1, repeats=repeats)


def graph_time_per_call(calls, repeats: int = 10) -> float:
    """Seconds per call of `calls` (callables): one CUDA graph of them all, replayed
    (graph_replay_time), divided by their number."""
    def run_all() -> None:
        for call in calls:
            call()
    return graph_replay_time(run_all, repeats=repeats) / len(calls)


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-|-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(fmt(r.get(c)).ljust(widths[c]) for c in cols), flush=True)


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def linear_config(values: str):
    """A kernels.small_matmul config from a bench spec's right-hand side:
    `bn,bk,splits,stages[,preload]`, `gemv,rows[,warps]` or `stream[,ring_kb[,ctas_per_sm]]`, then any `field:value` of
    SmallLinearConfig (`num_warps:8`, `trigger:2`)."""
    from batchd.kernels.small_matmul.triton_kernel import SmallLinearConfig

    items = values.split(",")
    named = {name: int(value) for name, value in (item.split(":") for item in items if ":" in item)}
    if items[0] == "stream":     # kernels.stream_linear; `stream[,ring_kb[,ctas_per_sm]]`
        sizes = dict(zip(("ring_kb", "stream_ctas"), (int(v) for v in items[1:] if ":" not in v)))
        return SmallLinearConfig(16, 128, 1, stream=True, **{**sizes, **named})
    if items[0] == "gemv":
        rows, warps = (*(int(v) for v in items[1:] if ":" not in v), 4)[:2]
        return SmallLinearConfig(rows, 128, 1, num_warps=warps, gemv=True, **named)
    bn, bk, splits, stages, *extra = (int(v) for v in items if ":" not in v)
    fields = dict(num_warps=4, num_stages=stages, swap=True, preload=extra[0] if extra else 0)
    return SmallLinearConfig(bn, bk, splits, **{**fields, **named})


class PhaseTimer:
    """Seconds spent inside chosen methods, each call synchronised before and after: where a run's
    time goes (a profile: the synchronisation itself slows the run, so never quote it as a figure).

        timer = PhaseTimer(); timer.wrap(batch_engine, "_run_rows"); ...; print(timer.table())
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        """Replace owner.name (an object's method or a module's function) by a timed twin."""
        fn, label = getattr(owner, name), label or name

        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def timed(*args, **kwargs):
            sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        self._wrapped.append((owner, name, fn))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, fn in reversed(self._wrapped):
            setattr(owner, name, fn)
        self._wrapped.clear()

    def table(self) -> str:
        return ", ".join(f"{k} {v:.2f} s/{self.calls[k]}" for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1]))
