"""What a persistent decode kernel would pay per stage: a grid-wide barrier inside one Triton kernel
(an atomic arrive, then polling the counter) against a kernel boundary between programmatically
dependent launches (griddepcontrol, replayed from a CUDA graph), both doing the same tiny work per
stage (each program reads what another program wrote in the stage before, and writes its own).

    python bench/grid_barrier.py

H200, stop 13: 1.10 us per barrier (132 programs, atomic polling; 1.36 us polling with volatile
loads), 0.79 us per PDL kernel boundary: a megakernel with a barrier between the decode layer's
stages would be slower than the chain it replaces (kernels/small_matmul/NOTES.md, "Stop 13").
Every program must be resident at once (the grid is at most one wave), or the barrier deadlocks.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch, triton, triton.language as tl
from bench.common import graph_replay_time
from batchd.kernels._backend import launch_options

@triton.jit
def _persistent(Counter, Data, n_stages, NPROG: tl.constexpr, BLOCK: tl.constexpr, POLL_ATOMIC: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for s in range(n_stages):
        src = Data + (s % 2) * NPROG * BLOCK + ((pid + 1) % NPROG) * BLOCK
        v = tl.load(src + offs, cache_modifier=".cg")
        tl.store(Data + ((s + 1) % 2) * NPROG * BLOCK + pid * BLOCK + offs, v + 1.0)
        tl.debug_barrier()
        tl.atomic_add(Counter, 1, sem="release", scope="gpu")
        target = (s + 1) * NPROG
        if POLL_ATOMIC:
            while tl.atomic_add(Counter, 0, sem="acquire", scope="gpu") < target:
                pass
        else:
            while tl.load(Counter, volatile=True) < target:
                pass
        tl.debug_barrier()

@triton.jit
def _stage(Data, s, NPROG: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    src = Data + (s % 2) * NPROG * BLOCK + ((pid + 1) % NPROG) * BLOCK
    v = tl.load(src + offs)
    tl.store(Data + ((s + 1) % 2) * NPROG * BLOCK + pid * BLOCK + offs, v + 1.0)

STAGES = 200
BLOCK = 256
for nprog in (132, 264):
    data = torch.zeros(2 * nprog * BLOCK, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    for poll in (True, False):
        def persistent():
            counter.zero_()
            _persistent[(nprog,)](counter, data, STAGES, NPROG=nprog, BLOCK=BLOCK, POLL_ATOMIC=poll, num_warps=4)
        t = graph_replay_time(persistent)
        print(f"persistent nprog={nprog} poll_atomic={poll}: {t / STAGES * 1e6:.2f} us per barrier stage", flush=True)
    def chain():
        for s in range(STAGES):
            _stage[(nprog,)](data, s, NPROG=nprog, BLOCK=BLOCK, num_warps=4, **launch_options(True))
    t = graph_replay_time(chain)
    print(f"PDL chain nprog={nprog}: {t / STAGES * 1e6:.2f} us per kernel", flush=True)
