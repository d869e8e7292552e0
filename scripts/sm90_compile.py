"""What the GEMM's configs cost on Hopper, by the compiler's own count, without a GPU.

Compiles ``kernels.gemm._matmul_kernel`` for sm_90 (an H100 or H200) with every config of
``GPU_CONFIGS`` that the shared-memory pruning keeps for the given flags and M x N x K, specialized
as a launch would be, and prints per config the pruning's estimate (``_config_smem``), the shared
memory the compiled kernel asks for (a launch fails above 232,448 bytes), and ptxas's registers per
thread and bytes of spill stores. ``TRITON_INTERPRET`` is ignored: the script compiles, it launches
nothing.

To check what the GPU machines run, use their Triton version (3.6.0; from PyPI, no GPU needed):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python scripts/sm90_compile.py --dtype fp32 --tma --tma-store --residual --bias \
        --mnk 5,24,32 --all
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: this script compiles for a GPU

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import gemm  # noqa: E402

#: shared memory per block an H100 or H200 grants (opt-in maximum)
HOPPER_SMEM = 232448
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def int_args(M: int, N: int, K: int, flags: dict) -> dict:
    """The kernel's integer arguments for an M x N x K problem with contiguous operands in the
    layouts ``flags`` name (A K-contiguous, B as B_N_CONTIGUOUS says), as gemm passes them."""
    b_n = flags["B_N_CONTIGUOUS"]
    return dict(M=M, N=N, K=K, stride_am=K, stride_ak=1, stride_bk=N if b_n else 1, stride_bn=1 if b_n else K,
                stride_cs=M * N, stride_cm=N, stride_cn=1, stride_gm=2 * N, stride_em=N, stride_en=1)


def compile_config(cfg: triton.Config, flags: dict, dtype: str, ints: dict):
    """``_matmul_kernel`` compiled for sm_90 with ``cfg``, the problem ``flags`` (constexprs) and the
    integer arguments ``ints``, specialized as a launch specializes them: an integer equal to 1
    becomes a constant, one divisible by 16 and every pointer (16-byte aligned buffers) are marked
    divisible by 16, which decides how loads are vectorized and pipelined."""
    names = gemm._matmul_kernel.arg_names
    const = {**flags, **cfg.kwargs, **{k: 1 for k, v in ints.items() if v == 1}}
    sig = {n: "constexpr" if n in const else (f"*{dtype}" if n.endswith("_ptr") else "i32") for n in names}
    divisible = [n for n in names if n not in const and (n.endswith("_ptr") or ints.get(n, 1) % 16 == 0)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(gemm._matmul_kernel, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def registers(ptx: str) -> tuple[int, int]:
    """``(registers per thread, bytes of spill stores)`` of ``ptx`` by the ptxas Triton bundles (``-v``):
    what a launch would report, without a GPU."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--swiglu", action="store_true", help="the SWIGLU_FWD epilogue (two B tiles)")
    for flag in ("bias", "residual", "accumulate", "tma", "tma-store", "b-n-contiguous"):
        p.add_argument(f"--{flag}", action="store_true")
    p.add_argument("--all", action="store_true", help="also the configs the pruning drops")
    p.add_argument("--mnk", default="4096,4096,4096", help="the problem's M,N,K (contiguous operands)")
    args = p.parse_args(argv)
    tf32 = args.dtype == "fp32"
    flags = dict(EPILOGUE=gemm.SWIGLU_FWD if args.swiglu else gemm.PLAIN, HAS_BIAS=args.bias,
                 HAS_RESIDUAL=args.residual, ACCUMULATE=args.accumulate, STORE_GU=False, USE_TMA=args.tma,
                 A_K_CONTIGUOUS=True, B_N_CONTIGUOUS=args.b_n_contiguous, TMA_STORE=args.tma_store and args.tma,
                 PRECISION="tf32" if tf32 else "ieee", SPLIT_K=1, SCALED=False, FP8=False)
    ints = int_args(*(int(v) for v in args.mnk.split(",")), flags)
    probe = torch.empty(1, dtype=DTYPES[args.dtype])
    prune_args = {"a_ptr": probe, "c_ptr": probe, **flags}
    configs = [gemm._config(*c) for c in gemm.GPU_CONFIGS]
    pruned = gemm.prune_configs(configs, prune_args)  # one shrunk config when every config overflows
    kept = {id(c) for c in pruned}
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, M,N,K {args.mnk}, flags "
          f"{ {k: v for k, v in flags.items() if v not in (False, 0)} }")
    print(f"{'BM BN BK stages warps':<24}{'kept':>6}{'estimate':>10}{'shared':>10}{'regs':>6}{'spills':>8}")
    for cfg in pruned + [c for c in configs if id(c) not in kept] if args.all else pruned:
        kw = cfg.kwargs
        compiled = compile_config(cfg, flags, args.dtype, ints)
        md = compiled.metadata
        regs, spills = registers(compiled.asm["ptx"])
        over = "  over" if md.shared > HOPPER_SMEM else ""
        name = f"{kw['BLOCK_M']} {kw['BLOCK_N']} {kw['BLOCK_K']} {cfg.num_stages} {cfg.num_warps}"
        print(f"{name:<24}{'yes' if id(cfg) in kept else 'no':>6}{gemm._config_smem(cfg, prune_args):>10}"
              f"{md.shared:>10}{regs:>6}{spills:>8}{over}")


if __name__ == "__main__":
    main()
