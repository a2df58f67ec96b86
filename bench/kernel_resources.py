"""Registers, spills and shared memory of small_linear's decode kernels, compiled for the H200
(sm_90) on any machine: no GPU needed, so a config can be checked before device time is spent.

    python bench/kernel_resources.py [--sass DIR] [--fused-mlp]

--fused-mlp lists kernels.fused_mlp's kernel instead, in the configs step_sweep's mlp= variants
tried (stop 19): its shared memory is the gate/up loop's stages (the down loop reuses them), which
decides whether 140 slices fit two to a multiprocessor or run a second wave.

--sass DIR also writes each kernel's SASS (addresses and encodings stripped) to DIR/<kernel>.sass:
run it at two commits and `diff -r` the folders to see whether a change moved any instruction of
the kernels it should not have touched (stop 15: removing k_chains left every table kernel the same).

Each row compiles `_small_linear_kernel` as a Qwen2.5-1.5B decode layer launches it (the fusions on,
pointer and stride arguments 16-divisible as the JIT specializes them) and reads the cubin's
resource usage with Triton's bundled cuobjdump. "ctas/SM" is what registers and shared memory
allow at most (65536 registers, 228 KB per multiprocessor): what decides whether a kernel's
programs fit in one wave and whether the next kernel's early programs fit beside them (stop 13:
the o projection as a gemv, 242 registers, leaves no room for gate/up's programs where two o
programs share a multiprocessor; q/k/v as a gemv spills; docs/performance.md).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.common import print_table  # noqa: E402
from batchd.kernels.fused_mlp import triton_kernel as mlp_tk  # noqa: E402
from batchd.kernels.small_matmul import triton_kernel as tk  # noqa: E402

POINTERS = dict(X="*bf16", W="*bf16", Bias="*bf16", Res="*bf16", Out="*bf16", Part="*fp32", SumSqIn="*fp32",
                NextNormW="*bf16", WeightedOut="*bf16", SumSqOut="*fp32", Cos="*fp32", Sin="*fp32", Pos="*i64",
                QOut="*bf16", KCache="*bf16", VCache="*bf16", Trace="*i64")
DIVISIBLE = set(POINTERS) | {"N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_rm", "stride_om",
                             "stride_qb", "stride_qh", "stride_qt", "stride_cb", "stride_ch", "stride_cn"}
HQ, HKV, HEAD_DIM = 12, 2, 128          # Qwen2.5-1.5B


def constexprs(cfg: tk.SmallLinearConfig, N: int, K: int, *, gated=False, rope=False, norm=False, residual=False,
               bias=False, parts_in=2) -> dict:
    """The constexpr arguments small_linear_triton passes for this call of N outputs (bf16, PDL,
    settled; a residual comes with the next norm's inputs, as in a decode layer), marks compiled out."""
    return dict(tk.linear_constexprs(cfg, N, K, torch.bfloat16, bias=bias, norm_parts=parts_in if norm else 0,
                                     gated=gated, residual=residual, emit=residual, pdl=True, early=True,
                                     rope_heads=(HQ, HKV, HEAD_DIM) if rope else None), TRACE=False)


def cuobjdump(cubin_bytes: bytes, flag: str) -> str:
    """Triton's bundled cuobjdump run with `flag` (-res-usage, -sass) on a cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as cubin:
        cubin.write(cubin_bytes)
        cubin.flush()
        return subprocess.run([str(tool), flag, cubin.name], capture_output=True, text=True, check=True).stdout


def sass_lines(cubin_bytes: bytes) -> list[str]:
    """The kernel's instructions, one per line, without addresses or encodings."""
    return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip()
            for line in cuobjdump(cubin_bytes, "-sass").splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]


def resources(cfg, consts: dict, sass_path: Path | None = None, fn=tk._small_linear_kernel, pointers=POINTERS,
              divisible=DIVISIBLE) -> dict:
    signature = {name: "constexpr" if name in consts else pointers.get(name, "fp32" if name == "eps" else "i32")
                 for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in divisible}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    usage = cuobjdump(kernel.asm["cubin"], "-res-usage")
    if sass_path is not None:
        sass_path.write_text("\n".join(sass_lines(kernel.asm["cubin"])) + "\n")
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    threads = cfg.num_warps * 32
    per_sm = min(65536 // (-(-regs // 8) * 8 * threads), (228 << 10) // (shared + 1024))
    return dict(regs=regs, spill_stack_bytes=stack, shared_kb=round(shared / 1024, 1), ctas_per_sm=per_sm)


MLP_POINTERS = dict(X="*bf16", SumSqIn="*fp32", GU="*bf16", DT="*bf16", Part="*fp32", Trace="*i64")
MLP_DIVISIBLE = set(MLP_POINTERS) | {"H", "I", "stride_xm"}


def fused_mlp_rows(intermediate: int = 8960) -> list[dict]:
    """kernels.fused_mlp's slice kernel at Qwen2.5-1.5B's MLP in configs measured in stop 19."""
    C = mlp_tk.FusedMlpConfig
    rows = []
    for cfg in (C(0, 64, 64, 4, 3, remainder=False), C(0, 64, 64, 4, 5, remainder=False),
                C(0, 64, 128, 4, 5, remainder=False), C(140, 64, 64, 4, 6), C(140, 128, 64, 4, 3),
                C(140, 128, 64, 4, 4), C(0, 64, 64, 4, 5), C(0, 64, 64, 4, 7), C(0, 64, 64, 4, 8)):
        programs = cfg.programs or 132
        block_t, block_r = cfg.tiles(intermediate, programs)
        consts = dict(PARTS_P2=256, USE_PDL=True, TRIGGER=1, UPCAST_DOT=False, DOT_PRECISION="tf32", BLOCK_M=16,
                      BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, TRACE=False)
        usage = resources(cfg, consts, fn=mlp_tk._fused_mlp_kernel, pointers=MLP_POINTERS, divisible=MLP_DIVISIBLE)
        tiles = f"{block_t} + {block_r}" if block_r else f"{block_t}"
        rows.append(dict(kernel=f"fused mlp, {programs} slices in {tiles} rows",
                         config=f"k {cfg.block_k}, n {cfg.block_n}, {cfg.num_stages} stages", **usage))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sass", type=Path, help="also write each kernel's SASS to this folder")
    parser.add_argument("--fused-mlp", action="store_true", help="kernels.fused_mlp's kernel instead")
    args = parser.parse_args()
    if args.fused_mlp:
        print_table(fused_mlp_rows())
        return
    if args.sass:
        args.sass.mkdir(parents=True, exist_ok=True)
    C = tk.SmallLinearConfig
    # the decode table's entry (read directly: choose_config would ask the CUDA device for its SM count)
    table = lambda n, k, gated=False: tk.TUNED[(2 * n if gated else n, k, 2)]  # noqa: E731
    H, I, QKV = 1536, 8960, (HQ + 2 * HKV) * HEAD_DIM
    cases = [
        ("qkv (table)", table(QKV, H), H, dict(rope=True, norm=True, bias=True)),
        ("qkv as gemv, 8 rows", C(8, 128, 1, gemv=True), H, dict(rope=True, norm=True, bias=True)),
        ("o (table)", table(H, H), H, dict(residual=True)),
        ("o as tiles 16x128 (before stop 13)", C(16, 128, 1, num_stages=4), H, dict(residual=True)),
        ("o as gemv, 4 rows", C(4, 128, 1, gemv=True), H, dict(residual=True)),
        # the table runs gate_up on kernels.stream_linear (CUDA) since stop 25: its Triton tiles before
        ("gate_up (Triton, table before stop 25)", C(128, 128, 1, num_stages=3), H,
         dict(gated=True, norm=True, parts_in=H // 8)),
        ("down (table)", table(H, I), I, dict()),
    ]
    rows = []
    for label, cfg, K, fusion in cases:
        if cfg.stream:   # the table runs this weight on kernels.stream_linear (CUDA), not on this kernel
            print(f"{label}: {describe(cfg)} (kernels/stream_linear: not a Triton kernel)", flush=True)
            continue
        N = I if fusion.get("gated") else QKV if fusion.get("rope") else H
        sass = args.sass / (re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_") + ".sass") if args.sass else None
        rows.append(dict(kernel=label, config=describe(cfg), **resources(cfg, constexprs(cfg, N, K, **fusion), sass)))
        print(rows[-1], flush=True)
    print_table(rows)


def describe(cfg: tk.SmallLinearConfig) -> str:
    if cfg.gemv:
        return f"gemv {cfg.block_n} rows, {cfg.num_warps} warps"
    return f"{cfg.block_n}x{cfg.block_k}, {cfg.splits} splits, {cfg.num_stages} stages, preload {cfg.preload}"


if __name__ == "__main__":
    main()
