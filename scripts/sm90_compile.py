"""What a kernel's configs cost on Hopper, by the compiler's own count, without a GPU.

``--kernel gemm`` (default) compiles ``kernels.gemm._matmul_kernel`` for sm_90 (an H100 or H200) with
every config of ``GPU_CONFIGS`` that the shared-memory pruning keeps for the given flags and M x N x K;
``--kernel attention-fwd`` the flash-attention forward with ``FWD_CONFIGS`` at ``--shape B,Hq,Hkv,T,D``;
``--kernel gemm-sm90`` the warp-specialized Gluon GEMM of ``gemm_sm90`` with every config of ``CONFIGS``
(``--swiglu``: ``GATED_CONFIGS``, ``--store-gu`` also writing the pre-activations; ``--dynamic``: tiles
from the global counter) at ``--mnk``; ``--kernel attention-fwd-sm90`` the Gluon forward of ``forward_sm90`` with every config of its ``CONFIGS`` at
``--shape``; ``--kernel attention-bwd-sm90`` the Gluon dK/dV and dQ of ``backward_sm90``, and dK/dV with the dQ reduce, with their configs at ``--shape``. Each is specialized as a launch would be; per config
the script prints the pruning's estimate (GEMM: ``_config_smem``), the shared memory the compiled kernel
asks for (a launch fails above 232,448 bytes), ptxas's registers per thread and bytes of spill stores,
and the compiled kernel's warps. A config that does not compile prints its error. ``TRITON_INTERPRET`` is
ignored: the script compiles, it launches nothing.

To check what the GPU machines run, use their Triton version (3.6.0; from PyPI, no GPU needed):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python scripts/sm90_compile.py --dtype fp32 --tma --tma-store --residual --bias \
        --mnk 5,24,32 --all
    PYTHONPATH=/tmp/t36 python scripts/sm90_compile.py --kernel gemm-sm90 --swiglu --store-gu --mnk 16384,2048,768
    PYTHONPATH=/tmp/t36 python scripts/sm90_compile.py --kernel attention-fwd --shape 8,32,8,4096,128 --causal
    PYTHONPATH=/tmp/t36 python scripts/sm90_compile.py --kernel attention-bwd-sm90 --shape 8,32,8,4096,128 --causal
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
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import gemm  # noqa: E402
from kernels.launch import next_pow2  # noqa: E402
from kernels.flash_attention import backward_sm90, forward as attn_forward, kernel_args as attn_args  # noqa: E402
from kernels.flash_attention.settings import attention_settings  # noqa: E402
from kernels.flash_attention.tuning import LOG2E  # noqa: E402

#: shared memory per block an H100 or H200 grants (opt-in maximum)
HOPPER_SMEM = 232448
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8e4nv": torch.float8_e4m3fn}


def int_args(M: int, N: int, K: int, flags: dict) -> dict:
    """The kernel's integer arguments for an M x N x K problem with contiguous operands in the
    layouts ``flags`` name (A K-contiguous, B as B_N_CONTIGUOUS says), as gemm passes them."""
    b_n = flags["B_N_CONTIGUOUS"]
    return dict(M=M, N=N, K=K, stride_am=K, stride_ak=1, stride_bk=N if b_n else 1, stride_bn=1 if b_n else K,
                stride_cs=M * N, stride_cm=N, stride_cn=1, stride_gm=2 * N, stride_em=N, stride_en=1)


def compile_sm90(fn, args: dict, constexprs: dict, num_warps: int, num_stages: int):
    """``fn`` (a ``@triton.jit`` kernel) compiled for sm_90 with the constexprs ``constexprs`` and the
    runtime arguments ``args`` (name: a pointer type such as ``"*bf16"``, or the int / float value),
    specialized as a launch specializes them: an integer equal to 1 becomes a constant, one divisible
    by 16 and every pointer (16-byte aligned buffers) are marked divisible by 16, which decides how
    loads are vectorized and pipelined."""
    names = fn.arg_names
    const = {**constexprs, **{n: 1 for n, v in args.items() if not isinstance(v, (str, float)) and v == 1}}
    sig = {n: "constexpr" if n in const else args[n] if isinstance(args[n], str)
           else "fp32" if isinstance(args[n], float) else "i32" for n in names}
    divisible = [n for n in names if n not in const
                 and (isinstance(args[n], str) or isinstance(args[n], int) and args[n] % 16 == 0)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    src = source(fn, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 128),
                          options={"num_warps": num_warps, "num_stages": num_stages})


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


def report(fn, rows: list, args: dict, constexprs: dict) -> None:
    """Compile ``fn`` once per row ``(name, config, kept, estimate or None)`` and print the compiled
    shared memory, ptxas's registers and spill stores and the compiled warps; a config that does not
    compile prints its error instead."""
    print(f"{'config':<26}{'kept':>6}{'estimate':>10}{'shared':>10}{'regs':>6}{'spills':>8}{'warps':>7}")
    for name, cfg, kept, estimate in rows:
        head = f"{name:<26}{'yes' if kept else 'no':>6}{'-' if estimate is None else estimate:>10}"
        try:
            compiled = compile_sm90(fn, args, {**constexprs, **cfg.kwargs}, cfg.num_warps, cfg.num_stages)
        except Exception as e:  # noqa: BLE001  (a config that fails to compile is a result)
            print(f"{head}  FAILED {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            continue
        md = compiled.metadata
        regs, spills = registers(compiled.asm["ptx"])
        over = "  over" if md.shared > HOPPER_SMEM else ""
        print(f"{head}{md.shared:>10}{regs:>6}{spills:>8}{md.num_warps:>7}{over}")


def gemm_main(args) -> None:
    """Every config of ``gemm.GPU_CONFIGS`` the pruning keeps (``--all``: all of them) at ``--mnk``."""
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
    rows = [("{BLOCK_M} {BLOCK_N} {BLOCK_K}".format(**c.kwargs) + f" s{c.num_stages} w{c.num_warps}", c,
             id(c) in kept, gemm._config_smem(c, prune_args))
            for c in (pruned + [c for c in configs if id(c) not in kept] if args.all else pruned)]
    kernel_args = {**{n: f"*{args.dtype}" for n in gemm._matmul_kernel.arg_names if n.endswith("_ptr")}, **ints}
    report(gemm._matmul_kernel, rows, kernel_args, flags)


def gemm_sm90_main(args) -> None:
    """Every config of ``gemm_sm90`` (``--swiglu``: its gated configs; ``--dtype fp8e4nv``: its fp8 configs,
    scaled, bf16 output) at ``--mnk``, B as ``--b-n-contiguous`` says, A K-contiguous."""
    from kernels import gemm_sm90

    fp8 = args.dtype == "fp8e4nv"
    flags = dict(EPILOGUE=gemm.SWIGLU_FWD if args.swiglu else gemm.PLAIN, STORE_GU=args.swiglu and args.store_gu,
                 HAS_RESIDUAL=args.residual and not args.swiglu, A_K_CONTIGUOUS=True,
                 B_N_CONTIGUOUS=args.b_n_contiguous, SCALED=fp8, DYNAMIC=args.dynamic)
    ints = int_args(*(int(v) for v in args.mnk.split(",")), flags)
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, M,N,K {args.mnk}, flags "
          f"{ {k: v for k, v in flags.items() if v not in (False, 0)} }")
    rows = [("{BLOCK_M} {BLOCK_N} {BLOCK_K} s{STAGES}".format(**c.kwargs) + (" ping-pong" if c.kwargs["PINGPONG"]
             else " coop"), c, True, None) for c in gemm_sm90.configs(gated=args.swiglu, fp8=fp8)]
    kernel_args = {**{n: f"*{args.dtype}" for n in gemm_sm90.ws_matmul_kernel.arg_names if n.endswith("_ptr")},
                   "counter_ptr": "*i32", **ints}
    if fp8:  # bf16 output (and residual), fp32 scales
        kernel_args.update({n: "*bf16" for n in ("c_ptr", "gu_ptr", "bias_ptr", "e_ptr")}, sa_ptr="*fp32", sb_ptr="*fp32")
    report(gemm_sm90.ws_matmul_kernel, rows, kernel_args, flags)


def attention_fwd_main(args) -> None:
    """The one-pass forward at ``--shape`` (contiguous [B, T, H, D] q, k, v, S = T) with the configs of
    FWD_CONFIGS that the pruning keeps
    (``--all``: all of them); the ``tma`` and ``one_loop`` settings in force (``--loops``: one_loop)."""
    B, Hq, Hkv, T, D = (int(v) for v in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    probe = torch.empty(1, T, Hq, D, dtype=dtype)
    kind = "causal" if args.window is None else "window"
    settings = attention_settings()
    one_loop = settings.one_loop["fwd"][kind] if args.loops is None else args.loops == "one"
    flags = {**attn_args.kernel_flags(probe, args.causal or args.window is not None, args.window),
             "USE_TMA": settings.tma["fwd"] and dtype != torch.float32, "ONE_LOOP": one_loop,
             "HAS_DOCS": args.documents}
    q_strides, kv_strides = (T * Hq * D, Hq * D, D), (T * Hkv * D, Hkv * D, D)
    ints = dict(zip(["stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
                     "stride_vs", "stride_vh"], q_strides + kv_strides + kv_strides))
    ints.update(T=T, S=T, HQ=Hq, GROUP=Hq // Hkv, shift=0, window=args.window or 0, T_BUCKET=next_pow2(T),
                S_BUCKET=next_pow2(T), group_programs=int((settings.group_waves["fwd"] or 0) * 132) or 2**31 - 1)
    kernel_args = {"Q": f"*{args.dtype}", "K": f"*{args.dtype}", "V": f"*{args.dtype}", "O": f"*{args.dtype}",
                   "LSE": "*fp32", "qk_scale": D ** -0.5 * LOG2E,
                   "DOCS": "*i32" if args.documents else 0, **ints}
    tuned = attn_forward._fwd_kernel
    configs = tuned.configs
    pruned = tuned.prune(configs, {"Q": probe, **ints, **flags})
    kept = {id(c) for c in pruned}
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, B,Hq,Hkv,T,D {args.shape}, flags "
          f"{ {k: v for k, v in flags.items() if v not in (False, 0)} }")
    rows = [("{BLOCK_M} {BLOCK_N}".format(**c.kwargs) + f" s{c.num_stages} w{c.num_warps}", c, id(c) in kept, None)
            for c in (pruned + [c for c in configs if id(c) not in kept] if args.all else pruned)]
    report(attn_forward._flash_attention_fwd_kernel, rows, kernel_args, flags)


def attention_bwd_sm90_main(args) -> None:
    """Every config of ``backward_sm90``'s dK/dV and dQ kernels at ``--shape`` (contiguous [B, T, H, D], S = T)."""
    B, Hq, Hkv, T, D = (int(v) for v in args.shape.split(","))
    matrices = {"stride_qb": T * Hq * D, "stride_qt": Hq * D, "q_rows": T, "q_cols": Hq * D, "q_head_rows": 0,
                "q_head_cols": D, "stride_dob": T * Hq * D, "stride_dot": Hq * D, "do_rows": T, "do_cols": Hq * D,
                "do_head_rows": 0, "do_head_cols": D, "stride_kb": T * Hkv * D, "stride_ks": Hkv * D, "stride_kh": D,
                "stride_vb": T * Hkv * D, "stride_vs": Hkv * D, "stride_vh": D, "T": T, "S": T, "HQ": Hq, "HKV": Hkv,
                "stat_pitch": -(-T // 4) * 4, "shift": 0, "qk_scale": D ** -0.5 * LOG2E,
                "softmax_scale": D ** -0.5, "group_programs": 2**31 - 1, "T_BUCKET": next_pow2(T),
                "S_BUCKET": next_pow2(T), "LSE2": "*fp32", "DELTA": "*fp32", "B": B, "COUNTER": "*i32"}
    tensors = {**{n: f"*{args.dtype}" for n in ("Q", "K", "V", "DO", "DK", "DV", "DQ")}, "DQ_ACC": "*fp32"}
    outputs = {"dkdv": {"stride_dkb": T * Hkv * D, "stride_dks": Hkv * D, "stride_dkh": D},
               "dq": {"stride_dqb": T * Hq * D, "stride_dqt": Hq * D, "stride_dqh": D}}
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, B,Hq,Hkv,T,D {args.shape}, causal {args.causal}")
    for name, tuned, reduce in (("dkdv", backward_sm90._dkdv_kernel, False), ("dq", backward_sm90._dq_kernel, False),
                                ("dkdv+dq", backward_sm90._dkdv_reduce_kernel, True)):
        fn = tuned.fn
        kernel_args = {n: v for n, v in {**tensors, **matrices, **outputs[name[:4]]}.items() if n in fn.arg_names}
        need = lambda c: backward_sm90.smem(c, D, name != "dq", reduce)  # noqa: E731
        rows = [(f"{name} " + "{BLOCK_M} {BLOCK_N} b{NUM_BUF}".format(**c.kwargs) + f" w{c.num_warps}"
                 + (" dv_wait" if c.kwargs.get("DV_WAIT") else ""), c, need(c) <= HOPPER_SMEM, need(c))
                for c in tuned.configs]
        flags = {"HEAD_DIM": D, "CAUSAL": args.causal, **({"DQ_REDUCE": reduce} if name != "dq" else {})}
        report(fn, rows, kernel_args, flags)


def attention_fwd_sm90_main(args) -> None:
    """Every config of ``forward_sm90.CONFIGS`` at ``--shape`` (contiguous [B, T, H, D], S = T)."""
    from kernels.flash_attention import forward_sm90

    B, Hq, Hkv, T, D = (int(v) for v in args.shape.split(","))
    fn = forward_sm90._kernel.fn
    kernel_args = {**{n: f"*{args.dtype}" for n in ("Q", "K", "V", "O")}, "LSE": "*fp32", "SCHED": "*i32",
                   "stride_qb": T * Hq * D, "stride_qt": Hq * D, "stride_qh": D, "stride_kb": T * Hkv * D,
                   "stride_ks": Hkv * D, "stride_kh": D, "stride_vb": T * Hkv * D, "stride_vs": Hkv * D,
                   "stride_vh": D, "B": B, "T": T, "S": T, "HQ": Hq, "GROUP": Hq // Hkv, "shift": 0,
                   "qk_scale": D ** -0.5 * LOG2E, "sched_pitch": 17,
                   "T_BUCKET": next_pow2(T), "S_BUCKET": next_pow2(T)}
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, B,Hq,Hkv,T,D {args.shape}, causal {args.causal}")
    rows = [("{BLOCK_M} {BLOCK_N} b{NUM_BUF}".format(**c.kwargs) + f" w{c.num_warps}", c, True, None)
            for c in forward_sm90._kernel.configs]
    report(fn, rows, kernel_args, {"HEAD_DIM": D, "CAUSAL": args.causal})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=["gemm", "gemm-sm90", "attention-fwd", "attention-fwd-sm90",
                                           "attention-bwd-sm90"], default="gemm")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--all", action="store_true", help="also the configs the pruning drops")
    gemm_args = p.add_argument_group("gemm")
    gemm_args.add_argument("--swiglu", action="store_true", help="the SWIGLU_FWD epilogue (two B tiles)")
    for flag in ("bias", "residual", "accumulate", "tma", "tma-store", "b-n-contiguous", "store-gu", "dynamic"):
        gemm_args.add_argument(f"--{flag}", action="store_true")
    gemm_args.add_argument("--mnk", default="4096,4096,4096", help="the problem's M,N,K (contiguous operands)")
    attn_args = p.add_argument_group("attention-fwd")
    attn_args.add_argument("--shape", default="8,32,8,4096,128", help="B,Hq,Hkv,T,D (S = T)")
    attn_args.add_argument("--causal", action="store_true")
    attn_args.add_argument("--window", type=int, help="sliding window (implies --causal)")
    attn_args.add_argument("--loops", choices=["one", "three"], help="override the ONE_LOOP knob")
    attn_args.add_argument("--documents", action="store_true", help="packed documents (HAS_DOCS)")
    args = p.parse_args(argv)
    {"gemm-sm90": gemm_sm90_main, "attention-fwd": attention_fwd_main, "attention-fwd-sm90": attention_fwd_sm90_main,
     "attention-bwd-sm90": attention_bwd_sm90_main}.get(args.kernel, gemm_main)(args)


if __name__ == "__main__":
    main()
