"""Capturing a CUDA graph the way every graphed path of the engine does (the decode step, the
batch engine's rows and first chunks, PFlash's padded scoring).

    graph, out = capture(run, pool)      # later: graph.replay() refreshes `out` in place
    pool = graph.pool()                  # graphs replayed one at a time can share one pool
"""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")


def capture(run: Callable[[], T], pool=None, *,
            after_warmup: Optional[Callable[[], None]] = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` twice on a side stream first, so that compiles, Triton's autotuning and the
    allocator's first allocations happen outside the capture (`after_warmup`, if given, runs
    after each of those calls: to undo what a warm-up moved), then `run` captured into `pool`
    (a graph's `pool()`, or None for a new one). -> (the graph, what the captured `run` returned:
    the tensors each replay refreshes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
            if after_warmup is not None:
                after_warmup()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out
