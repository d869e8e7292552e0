"""Side-by-side GPU timings of the GEMM family's tuning knobs (issue 3; predictions in docs/perf/history.md).

Usage, on one GPU (aims at < 120 s on an H200, compiles included; sections that would start past
TUNE_BUDGET_S=110 seconds are skipped and say so):

    python scripts/tune_linear.py                   # every section
    python scripts/tune_linear.py gemm host lce     # some of: gemm host linear swiglu overlap lce configs

Sections, in this order:
  gemm     stage A: every knob set (FLATTEN, TMA_STORE, EPILOGUE_SUBTILE, WARP_SPECIALIZE) on two
           reference configs for the GEMMs of linear at 16384x768x2304, 16384x768x32000 and
           16384x2048x768 (fwd, dx, dW; dW also unsplit where split_k_for splits it along K),
           linear_swiglu's fused forward (16384x768x2x2048, against cuBLAS + Triton swiglu) and
           the LM head's chunk GEMMs (dx split along V, dW accumulated): each cell is
           cuBLAS ms / ours ms (> 1: ours faster) for the better reference config.
  host     host time per call at a tiny shape (GPU idle): F.linear vs ours with the launch-config
           cache vs through triton.autotune's dispatch, fwd and fwd+bwd.
  linear   fwd / bwd / fwd+bwd at 16384x2048x768 and 16384x768x2304 timed as the benchmark does,
           the sum of fwd and bwd, and the GPU kernel time of fwd+bwd (torch.profiler): the rest
           of fwd+bwd is the GPU waiting on the host.
  swiglu   linear_swiglu 16384x768x(2x2048) fwd / bwd / fwd+bwd in CUDA graphs against cuBLAS + Triton
           swiglu, with the library's configs and knobs: the fused forward through _matmul_kernel and (on
           Hopper) through the WS kernel (GemmSettings.sm90_ws_gated); output and gradient errors against the pair.
  overlap  the backward of linear at every benchmark shape and of linear_swiglu in CUDA graphs, dW on a second
           stream beside dx where GemmSettings.overlap_dw applies or one after the other (static or dynamic
           tiles), against cuBLAS.
  lce      linear_cross_entropy 16384x768x32000 fwd+bwd ms and peak memory for sets of
           CHUNK_BYTES / DW_FP32 / GRAD_IN_PLACE, against Liger-Kernel and eager PyTorch.
  configs  stage B: every candidate config with each problem's best knob set.
  splits   the three GEMMs of linear (fwd, dx, dW) at every benchmark shape, each replayed in a CUDA
           graph, the best of CANDIDATES with the default knobs and (on Hopper) of gemm_sm90's WS
           configs against cuBLAS (and the WS kernel with GemmSettings.dynamic's tiles), and dW once per
           split count along K (1, 2, 3, 4, 6, 8 and split_k_for's choice): which GEMM of the
           backward trails cuBLAS, and what each split costs (its fp32 partials and their sum).
The e2e sections (host, linear, lce) autotune over the two best configs of the best knob set of stage
A (or the GPU_CONFIGS when stage A did not run). Every variant's output is compared with the
default variant's (first config, knobs off, itself checked against cuBLAS; for lce the module's
current knob values): a mismatch prints BAD instead of a time. Full numbers go to
$OUT/tune_linear.json when OUT is set.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
import triton

from tritonllm.bench.harness import graph_ms, pass_fn, kernel_times_us, liger_available, peak_memory_gb, time_ms
from tritonllm.bench.ops_linear import SHAPES
from tritonllm.kernels import configure_gemm, gemm_settings, linear, linear_cross_entropy, linear_swiglu, swiglu
from tritonllm.kernels.device import smem_budget

L = importlib.import_module("tritonllm.kernels.gemm")
LCE = importlib.import_module("tritonllm.kernels.linear_cross_entropy")
WS = importlib.import_module("tritonllm.kernels.gemm_sm90")

T0 = time.time()
LIBRARY_SETTINGS = gemm_settings()
BUDGET_S = float(os.environ.get("TUNE_BUDGET_S", "110"))
DT = torch.bfloat16
RESULTS: dict = {}

#: knob sets: (name, FLATTEN, WARP_SPECIALIZE, EPILOGUE_SUBTILE, TMA_STORE); warp-specialized
#: configs run 4 warps (linear._config)
KNOBS = [("base", False, False, False, False), ("flat", True, False, False, False),
         ("tmaS", False, False, False, True), ("flat+tmaS", True, False, False, True),
         ("flat+tmaS+sub", True, False, True, True), ("ws+tmaS", False, True, False, True)]
#: stage A reference configs (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
REFERENCE = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8)]
#: stage B candidates: the current GPU_CONFIGS and a few more
CANDIDATES = list(dict.fromkeys([tuple(c) for c in L.GPU_CONFIGS] + [
    (128, 256, 128, 2, 8), (128, 128, 128, 3, 8), (256, 128, 64, 3, 8), (64, 256, 64, 4, 4)]))


def left() -> float:
    return BUDGET_S - (time.time() - T0)


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median"))


def rel_err(got, ref) -> float:
    got, ref = got.float(), ref.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(DT)


# ----------------------------------------------------------------------------------------- gemm
class Problem:
    """One GEMM call as the ops make it: ``gemm(a, b, c, **kw)`` with fresh c (or c0 for
    accumulate), and the cuBLAS (or unfused) equivalent."""

    def __init__(self, name, a, b, c_shape, c_dtype=DT, cublas=None, c0=None, **kw):
        self.name, self.a, self.b, self.kw, self.cublas, self.c0 = name, a, b, kw, cublas, c0
        self.c_shape, self.c_dtype = c_shape, c_dtype
        self.flops = 2.0 * a.shape[0] * a.shape[1] * c_shape[1]

    def new_out(self):
        c = self.c0.clone() if self.c0 is not None else torch.empty(self.c_shape, dtype=self.c_dtype, device="cuda")
        gu = torch.empty(c.shape[0], 2 * c.shape[1], dtype=DT, device="cuda") if self.kw.get("epilogue") else None
        return c, gu

    def call(self, c, gu, config):
        return L.gemm(self.a, self.b, c, gu=gu, config=config, **self.kw)


def problems():
    out = []
    for M, K, N in [(16384, 768, 2304), (16384, 768, 32000), (16384, 2048, 768)]:
        x, w, dy = randn(M, K), randn(N, K, scale=K ** -0.5), randn(M, N)
        s = f"{M}x{K}x{N}"
        out += [Problem(f"{s} fwd", x, w.t(), (M, N), cublas=lambda x=x, w=w: F.linear(x, w)),
                Problem(f"{s} dx", dy, w, (M, K), cublas=lambda dy=dy, w=w: torch.mm(dy, w)),
                Problem(f"{s} dW", dy.t(), x, (N, K), cublas=lambda dy=dy, x=x: torch.mm(dy.t(), x))]
        splits = L.split_k_for(N, K, M, L.num_sms())
        if splits > 1:  # the same dW without the split along K (SPLIT_K_MAX = 1)
            out.append(Problem(f"{s} dW split1 ({splits})", dy.t(), x, (N, K), split_k=1,
                               cublas=lambda dy=dy, x=x: torch.mm(dy.t(), x)))
    x, w13 = randn(16384, 768), randn(4096, 768, scale=768 ** -0.5)
    out.append(Problem("swiglu 16384x768x2x2048 fwd", x, w13.t(), (16384, 2048), epilogue=L.SWIGLU_FWD,
                       cublas=lambda: swiglu(F.linear(x, w13))))
    w = randn(32000, 768, scale=768 ** -0.5)
    for C, S in [(384, 6), (2048, 4)]:
        g = randn(C, 32000, scale=1e-3)
        out.append(Problem(f"lce dx C{C} split{S}", g, w, (C, 768), split_k=S, cublas=lambda g=g: torch.mm(g, w)))
    xc, g = randn(384, 768), randn(384, 32000, scale=1e-3)
    dw0, dw_cublas = randn(32000, 768, scale=1e-2), randn(32000, 768, scale=1e-2)
    out.append(Problem("lce dW C384 acc bf16", g.t(), xc, (32000, 768), c0=dw0, accumulate=True,
                       cublas=lambda: dw_cublas.addmm_(g.t(), xc)))
    out.append(Problem("lce dW C2048 acc fp32", randn(2048, 32000, scale=1e-3).t(), randn(2048, 768), (32000, 768),
                       c0=dw0.float(), accumulate=True))
    return out


def variant(cfg, knob):
    """(triton.Config, TMA_STORE) of a config tuple under a knob set."""
    name, flat, ws, sub, tma_store = knob
    return L._config(*cfg, flatten=flat, warp_specialize=ws, subtile=sub), tma_store


def plan(prob, config, tma_store):
    """gemm's kernel arguments and grid for ``prob`` under a variant (sets GemmSettings.tma_store)."""
    configure_gemm(tma_store=tma_store)
    c, gu = prob.new_out()
    return L._gemm_plan(prob.a, prob.b, c, None, None, gu, prob.kw.get("epilogue", L.PLAIN),
                        prob.kw.get("accumulate", False), True, None, prob.kw.get("split_k"))[:2]


def valid(prob, cfg, knob):
    """The variant fits shared memory and, for the gated epilogue, is at most 128x128 (gemm's pruning)."""
    config, tma_store = variant(cfg, knob)
    args, _ = plan(prob, config, tma_store)
    gated_too_large = prob.kw.get("epilogue") and L.gated_too_large(config.kwargs)
    return L._config_smem(config, args) <= smem_budget(L.SMEM_RESERVE) and not gated_too_large


def _msg(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1][:100] if text else ''}"


def precompile(jobs):
    """Compile (problem, cfg, knob) variants in parallel (triton.AsyncCompileMode, Triton >= 3.4;
    sequentially without it); returns {(problem name, cfg, knob name): error} for those that failed."""
    failed, futures = {}, []
    pool = ThreadPoolExecutor(max(1, os.cpu_count() or 2))
    mode = getattr(triton, "AsyncCompileMode", None)
    ctx = None
    if mode is not None:
        try:
            ctx = mode(pool, ignore_errors=True)
        except TypeError:  # older signature
            ctx = mode(pool)
        ctx.__enter__()
    try:
        for prob, cfg, knob in jobs:
            config, tma_store = variant(cfg, knob)
            args, grid = plan(prob, config, tma_store)
            try:
                futures.append(((prob.name, cfg, knob[0]),
                                L._matmul_kernel.warmup(**args, **config.all_kwargs(), grid=grid)))
            except Exception as e:  # noqa: BLE001  (a variant that cannot compile is reported, not fatal)
                failed[(prob.name, cfg, knob[0])] = _msg(e)
    finally:
        for key, fut in futures:  # finalize the compiled ones into the kernel cache, record the rest
            pending = getattr(fut, "future", None)
            if pending is None:
                continue
            error = pending.exception()
            if error is None:
                fut.result()
            else:
                failed[key] = _msg(error)
        if ctx is not None:
            try:
                ctx.__exit__(None, None, None)
            except Exception:  # noqa: BLE001  (failures are recorded above)
                pass
        pool.shutdown()
    return failed


def time_variants(prob, jobs, failed, reference):
    """{(cfg, knob name): ms or an error string} for ``jobs`` of ``prob``; outputs checked against
    ``reference`` (the default variant's outputs, set from the first job when None)."""
    res = {}
    for cfg, knob in jobs:
        key = (prob.name, cfg, knob[0])
        if key in failed:
            res[(cfg, knob[0])] = "compile: " + failed[key]
            continue
        config, tma_store = variant(cfg, knob)
        configure_gemm(tma_store=tma_store)
        try:
            c, gu = prob.new_out()
            prob.call(c, gu, config)
            outs = (c,) if gu is None else (c, gu)
            if reference is None:
                reference = outs
            err = max(rel_err(o, r) for o, r in zip(outs, reference))
            if err > 2e-2:
                res[(cfg, knob[0])] = f"BAD err {err:.1e}"
                continue
            c, gu = prob.new_out()
            res[(cfg, knob[0])] = bench(lambda: prob.call(c, gu, config))
        except Exception as e:  # noqa: BLE001
            res[(cfg, knob[0])] = "run: " + _msg(e)
        torch.cuda.synchronize()
    return res, reference


def fmt(v, base):
    """A cell: cuBLAS ms / ours ms, or ours ms when there is no cuBLAS equivalent (base None)."""
    if not isinstance(v, float):
        return "   BAD" if "BAD" in v else "   ERR"
    return f"{v:6.3f}ms" if base is None else f"{base / v:6.2f}"


def section_gemm(state):
    probs = problems()
    state["problems"] = probs
    jobs = [(p, cfg, k) for p in probs for k in KNOBS for cfg in REFERENCE if valid(p, cfg, k)]
    jobs += [(p, (128, 128, 64, 3, 8), k) for p in probs for k in KNOBS if p.kw.get("epilogue")]
    t = time.time()
    failed = precompile(jobs)
    print(f"stage A: {len(jobs)} variants compiled in {time.time() - t:.0f} s ({len(failed)} failed)", flush=True)
    table, refs, cublas = {}, {}, {}
    for p in probs:
        if left() < 5:
            print(f"  {p.name}: skipped (time budget)")
            table[p.name], refs[p.name], cublas[p.name] = {}, None, None
            continue
        pj = [(cfg, k) for q, cfg, k in jobs if q is p]
        default = [(cfg, k) for cfg, k in pj if k[0] == "base"][:1]
        res, refs[p.name] = time_variants(p, default, failed, None)
        more, _ = time_variants(p, [j for j in pj if j not in default], failed, refs[p.name])
        res.update(more)
        cublas[p.name] = bench(p.cublas) if p.cublas is not None else None
        table[p.name] = res
    state.update(stage_a=table, refs=refs, cublas=cublas, failed=failed)
    for p in probs:  # the default variant against cuBLAS (h for swiglu; accumulate problems skipped)
        if p.cublas is not None and refs[p.name] is not None and not p.kw.get("accumulate"):
            err = rel_err(refs[p.name][0], p.cublas())
            if err > 2e-2:
                print(f"  BAD: {p.name} default variant vs cuBLAS rel err {err:.1e}")
    print("\n== gemm stage A: cuBLAS ms / ours ms (best of the reference configs; swiglu: vs cuBLAS + "
          "Triton swiglu; BAD = output mismatch, ERR = compile/run error)")
    print(f"{'problem':<28}{'cuBLAS ms':>10}" + "".join(f"{k[0]:>14}" for k in KNOBS) + "   best")
    best_knob = {}
    for p in probs:
        base = cublas[p.name]
        row, best = [], (float("inf"), None)
        for k in KNOBS:
            vals = [v for (cfg, kn), v in table[p.name].items() if kn == k[0]]
            times = [v for v in vals if isinstance(v, float)]
            cell = min(times) if times else (vals[0] if vals else "-")
            row.append(fmt(cell, base) if vals else "     -")
            if times and min(times) < best[0]:
                best = (min(times), k)
        best_knob[p.name] = best[1]
        ms = f"{cublas[p.name]:10.4f}" if cublas[p.name] else f"{'-':>10}"
        print(f"{p.name:<28}{ms}" + "".join(f"{c:>14}" for c in row) + f"   {best[1][0] if best[1] else '-'}"
              + (f" {best[0]:.4f} ms" if best[1] else ""))
    state["best_knob"] = best_knob
    errs = {f"{k[0]} {k[1]} {k[2]}": v for k, v in failed.items()}
    for name, res in table.items():
        errs.update({f"{name} {cfg} {kn}": v for (cfg, kn), v in res.items() if not isinstance(v, float)})
    for k, v in list(errs.items())[:8]:
        print(f"  {k}: {v}")
    if len(errs) > 8:
        print(f"  ... {len(errs) - 8} more errors in tune_linear.json")
    RESULTS["gemm_stage_a"] = {name: {f"{cfg} {kn}": v for (cfg, kn), v in res.items()} for name, res in table.items()}
    RESULTS["cublas_ms"] = cublas
    # e2e sections autotune over the two best configs of the knob set best on most linear problems
    linear_probs = [p.name for p in probs if p.name[0].isdigit()]
    votes = {}
    for name in linear_probs:
        if best_knob[name]:
            votes[best_knob[name][0]] = votes.get(best_knob[name][0], 0) + 1
    if votes:
        kname = max(votes, key=votes.get)
        knob = next(k for k in KNOBS if k[0] == kname)
        score = {}
        for name in linear_probs:
            for (cfg, kn), v in table[name].items():
                if kn == kname and isinstance(v, float):
                    score.setdefault(cfg, []).append(v / min(x for x in table[name].values() if isinstance(x, float)))
        cfgs = sorted(score, key=lambda c: sum(score[c]) / len(score[c]))[:2]
        state["e2e"] = (knob, cfgs)


def use_library_configs(state):
    """linear's autotuner back on the library's GPU_CONFIGS and knobs (after use_e2e_configs: a later e2e
    section sets those again)."""
    state["e2e_set"] = False
    configure_gemm(LIBRARY_SETTINGS)
    tuned = L.tuned_kernel(False, LIBRARY_SETTINGS.flatten, LIBRARY_SETTINGS.warp_specialize,
                           LIBRARY_SETTINGS.epilogue_subtile)
    tuned.configs = [L._config(*c) for c in L.GPU_CONFIGS]
    tuned.cache.clear()
    L._LAUNCH_CONFIGS.clear()


def use_e2e_configs(state):
    """Point linear's autotuner at the e2e configs (stage A's choice, else GPU_CONFIGS, knobs off)."""
    knob, cfgs = state.get("e2e", (KNOBS[0], [tuple(c) for c in L.GPU_CONFIGS]))
    configs = [variant(c, knob)[0] for c in cfgs]
    _, flatten, ws, subtile, tma_store = knob
    configure_gemm(flatten=flatten, warp_specialize=ws, epilogue_subtile=subtile, tma_store=tma_store)
    tuned = L.tuned_kernel(False, flatten, ws, subtile)
    tuned.configs = configs
    tuned.cache.clear()
    L._LAUNCH_CONFIGS.clear()
    print(f"\n(e2e: knobs {knob[0]}, configs {cfgs})")


# ------------------------------------------------------------------------------------ sections
def host_us(fn, n=200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


class _NoCache(dict):
    def get(self, key, default=None):
        return None

    def __setitem__(self, key, value):
        pass


def section_host(state):
    x, w = randn(64, 768).requires_grad_(), randn(768, 768, scale=0.03).requires_grad_()
    rows = {}
    for name, impl in [("F.linear", F.linear), ("ours", linear)]:
        for kind in ("fwd", "fwd+bwd"):
            rows[f"{name} {kind}"] = host_us(pass_fn(impl, (x, w), kind))
    cache = L._LAUNCH_CONFIGS
    L._LAUNCH_CONFIGS = _NoCache()
    try:
        for kind in ("fwd", "fwd+bwd"):
            rows[f"ours via autotuner {kind}"] = host_us(pass_fn(linear, (x, w), kind))
    finally:
        L._LAUNCH_CONFIGS = cache
    print("\n== host us per call at 64x768x768 (GPU idle; the bench host is slow)")
    for k, v in rows.items():
        print(f"  {k:<32}{v:8.1f}")
    RESULTS["host_us"] = rows


def section_linear(state):
    print("\n== linear as benchmarked: ms (cuBLAS ms); fwd+bwd GPU kernel time from torch.profiler")
    out = {}
    for M, K, N in [(16384, 2048, 768), (16384, 768, 2304)]:
        x, w = randn(M, K).requires_grad_(), randn(N, K, scale=K ** -0.5).requires_grad_()
        err = rel_err(linear(x, w), F.linear(x, w))
        row = {}
        for kind in ("fwd", "bwd", "fwd+bwd"):
            row[kind] = (time_ms(pass_fn(linear, (x, w), kind)), time_ms(pass_fn(F.linear, (x, w), kind)))
        busy = sum(kernel_times_us(pass_fn(linear, (x, w), "fwd+bwd")).values()) / 1e3
        s = f"{M}x{K}x{N}"
        print(f"  {s:<18}" + "  ".join(f"{k} {a:.4f} ({b:.4f}) {b / a:.2f}x" for k, (a, b) in row.items())
              + f"  fwd+bwd - fwd - bwd {row['fwd+bwd'][0] - row['fwd'][0] - row['bwd'][0]:+.4f}"
              + f"  kernels {busy:.4f} ms  err {err:.1e}")
        out[s] = {"ms": row, "fwd+bwd_kernels_ms": busy, "err_vs_cublas": err}
    RESULTS["linear"] = out


def section_swiglu(state):
    """linear_swiglu against cuBLAS + Triton swiglu, each pass replayed in a CUDA graph, with the library's own
    configs and knobs: the fused forward through _matmul_kernel or (Hopper) the WS kernel (gemm.SM90_WS_GATED)."""
    use_library_configs(state)
    x, w13 = randn(16384, 768).requires_grad_(), randn(4096, 768, scale=768 ** -0.5).requires_grad_()
    kinds = ("fwd", "bwd", "fwd+bwd")
    base = {k: graph_ms(lambda k=k: pass_fn(unfused_swiglu, (x, w13), k)) for k in kinds}
    print("\n== linear_swiglu 16384x768x(2x2048) in CUDA graphs: ms (cuBLAS + Triton swiglu ms), "
          "target fwd+bwd >= 1.1x")
    library = gemm_settings()
    RESULTS["swiglu"] = {"cublas_ms": base}
    for name, gated in [("_matmul_kernel", False)] + ([("WS gated", True)] if torch.cuda.get_device_capability()[0] == 9
                                                      else []):
        configure_gemm(library, sm90_ws_gated=gated)  # the fused forward through _matmul_kernel, then through the WS kernel
        L._LAUNCH_CONFIGS.clear()
        err = rel_err(linear_swiglu(x, w13), unfused_swiglu(x, w13))
        x.grad = w13.grad = None
        unfused_swiglu(x, w13).float().square().mean().backward()
        want = x.grad, w13.grad
        x.grad = w13.grad = None
        linear_swiglu(x, w13).float().square().mean().backward()
        grad_err = max(rel_err(x.grad, want[0]), rel_err(w13.grad, want[1]))
        x.grad = w13.grad = None
        row = {k: graph_ms(lambda k=k: pass_fn(linear_swiglu, (x, w13), k)) for k in kinds}
        print(f"  {name:<20}" + "  ".join(f"{k} {row[k]:.4f} ({base[k]:.4f}) {base[k] / row[k]:.2f}x" for k in row)
              + f"  err {err:.1e} grad err {grad_err:.1e}")
        RESULTS["swiglu"][name] = {"ms": row, "err": err, "grad_err": grad_err}
    configure_gemm(library)
    L._LAUNCH_CONFIGS.clear()


def unfused_swiglu(x, w13):
    return swiglu(F.linear(x, w13))


#: (name, GemmSettings.overlap_dw, GemmSettings.dynamic) timed by section_overlap: overlap_dw runs dW beside dx, both with
#: dynamic tiles, where dW's output has fewer than two waves of tiles (linear._beside), else one after the other
OVERLAP_VARIANTS = [("one after the other", False, False), ("one after the other, dynamic tiles", False, True),
                    ("dW beside dx where few dW tiles", True, False)]


def section_overlap(state):
    """The backward of linear at every benchmark shape and of linear_swiglu, replayed in CUDA graphs with the
    library's configs, for each of OVERLAP_VARIANTS, against cuBLAS (F.linear; + Triton swiglu)."""
    use_library_configs(state)
    problems = []
    for M, K, N in SHAPES["default"]["linear"] + SHAPES["large"]["linear"]:
        x, w = randn(M, K).requires_grad_(), randn(N, K, scale=K ** -0.5).requires_grad_()
        problems.append((f"linear {M}x{K}x{N}", linear, F.linear, (x, w)))
    x, w13 = randn(16384, 768).requires_grad_(), randn(4096, 768, scale=768 ** -0.5).requires_grad_()
    problems.append(("linear_swiglu 16384x768x2x2048", linear_swiglu, unfused_swiglu, (x, w13)))
    library = gemm_settings()
    print("\n== overlap: bwd ms in CUDA graphs (cuBLAS / ours), " + "; ".join(v[0] for v in OVERLAP_VARIANTS))
    RESULTS["overlap"] = {}
    for name, ours, theirs, inputs in problems:
        if left() < 5:
            print(f"  {name}: skipped (time budget)")
            continue
        base = graph_ms(lambda: pass_fn(theirs, inputs, "bwd"))
        row = {}
        for variant, overlap, dynamic in OVERLAP_VARIANTS:
            configure_gemm(library, overlap_dw=overlap, dynamic=dynamic)
            L._LAUNCH_CONFIGS.clear()
            row[variant] = graph_ms(lambda: pass_fn(ours, inputs, "bwd"))
        RESULTS["overlap"][name] = {"cublas_ms": base, "ms": row}
        print(f"  {name:<32} cuBLAS {base:.4f}  " + "  ".join(f"{v:.4f} {base / v:.3f}x" for v in row.values()))
    configure_gemm(library)
    L._LAUNCH_CONFIGS.clear()


def section_lce(state):
    T, H, V = 16384, 768, 32000
    x, w = randn(T, H).requires_grad_(), randn(V, H, scale=H ** -0.5).requires_grad_()
    t = torch.randint(0, V, (T,), device="cuda")
    inputs = (x, w, t)

    def eager(x, w, t):
        return F.cross_entropy(F.linear(x, w).float(), t)

    impls = {}
    defaults = (LCE.CHUNK_BYTES, LCE.DW_FP32, LCE.GRAD_IN_PLACE)
    sets = dict.fromkeys([defaults, (None, False, True)] + [(c * V * 2, False, True) for c in (2048, 4096, 8192)]
                         + [(2048 * V * 2, True, False)])
    knob_sets = [(f"chunk={LCE.chunk_for(T, V, 2, c) if c else 'liger'} dW={'fp32' if f else 'W dtype'} "
                  f"{'in-place' if i else 'copy'}", c, f, i) for c, f, i in sets]

    def ours_with(chunk_bytes, fp32, in_place):
        def run(x, w, t):
            LCE.CHUNK_BYTES, LCE.DW_FP32, LCE.GRAD_IN_PLACE = chunk_bytes, fp32, in_place
            return linear_cross_entropy(x, w, t)
        return run

    for name, *knobs in knob_sets:
        impls[name] = ours_with(*knobs)
    impls["eager"] = eager
    if liger_available():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        impls["liger"] = lambda x, w, t: LigerFusedLinearCrossEntropyLoss()(w, x, t)
    print(f"\n== linear_cross_entropy {T}x{H}x{V} fwd+bwd (liger chunk = {LCE.default_chunk(T, H, V, 2, L.num_sms())}"
          " (tokens, dx splits)); target >= 1.2x liger at <= liger's peak memory")
    ref, rows = None, {}
    for name, impl in impls.items():
        if left() < 8:
            print(f"  {name}: skipped (time budget)")
            continue
        try:
            loss = impl(*inputs)
            grads = [g.clone() for g in torch.autograd.grad(loss, [x, w])]
            outs = (loss.float(), *grads)
            ref = ref or outs
            err = max(rel_err(o, r) for o, r in zip(outs, ref))
            fn = pass_fn(impl, inputs, "fwd+bwd")
            rows[name] = {"ms": time_ms(fn), "peak_gb": peak_memory_gb(fn), "err_vs_first": err}
            flag = "  BAD" if err > 3e-2 else ""
            print(f"  {name:<32}{rows[name]['ms']:8.3f} ms  peak {rows[name]['peak_gb']:.4f} GB  err {err:.1e}{flag}")
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__}: {str(e)[:150]}")
        torch.cuda.empty_cache()
    LCE.CHUNK_BYTES, LCE.DW_FP32, LCE.GRAD_IN_PLACE = defaults
    if "liger" in rows:
        for name in (n for n, *_ in knob_sets if n in rows):
            print(f"  {name:<32}{rows['liger']['ms'] / rows[name]['ms']:.2f}x liger, memory "
                  f"{rows[name]['peak_gb'] / rows['liger']['peak_gb']:.2f}x liger's")
    RESULTS["lce"] = rows


def section_configs(state):
    probs = [p for p in state.get("problems", []) if state["best_knob"].get(p.name)]
    jobs = [(p, cfg, state["best_knob"][p.name]) for p in probs for cfg in CANDIDATES
            if valid(p, cfg, state["best_knob"][p.name])]
    jobs = [(p, cfg, k) for p, cfg, k in jobs if (cfg, k[0]) not in state["stage_a"][p.name]]
    t = time.time()
    failed = precompile(jobs)
    print(f"\n== gemm stage B ({len(jobs)} more variants compiled in {time.time() - t:.0f} s): cuBLAS ms / ours ms "
          "per config, each problem with its best knob set")
    print(f"{'problem':<28}{'knobs':<14}" + "".join(f"{'x'.join(map(str, c[:3]))}/{c[3]}/{c[4]:<3}"[:16].rjust(16)
                                                  for c in CANDIDATES))
    out = {}
    for p in probs:
        if left() < 3:
            print(f"  {p.name}: skipped (time budget)")
            continue
        k = state["best_knob"][p.name]
        timed, _ = time_variants(p, [(cfg, k) for q, cfg, _ in jobs if q is p], failed, state["refs"][p.name])
        res = {cfg: v for (cfg, kn), v in {**state["stage_a"][p.name], **timed}.items() if kn == k[0]}
        base = state["cublas"][p.name]
        print(f"{p.name:<28}{k[0]:<14}" + "".join(f"{fmt(res[c], base) if c in res else '     -':>16}"
                                                  for c in CANDIDATES))
        out[p.name] = {str(c): v for c, v in res.items()}
    RESULTS["gemm_stage_b"] = out


def ws_name(config) -> str:
    """A gemm_sm90 config as a short name: ws BMxBNxBK sSTAGES, + pp for ping-pong."""
    k = config.kwargs
    return f"ws {k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} s{k['STAGES']}" + (" pp" if k["PINGPONG"] else "")


def section_splits(state):
    default_knob = next(k for k in KNOBS if k[0] == "flat+tmaS")
    library = gemm_settings()
    probs, splits_of = [], {}
    for M, K, N in SHAPES["default"]["linear"] + SHAPES["large"]["linear"] + [(16384, 768, 768)]:
        x, w, dy = randn(M, K), randn(N, K, scale=K ** -0.5), randn(M, N)
        s = f"{M}x{K}x{N}"
        probs += [Problem(f"{s} fwd", x, w.t(), (M, N), cublas=lambda x=x, w=w: F.linear(x, w)),
                  Problem(f"{s} dx", dy, w, (M, K), cublas=lambda dy=dy, w=w: torch.mm(dy, w))]
        chosen = L.split_k_for(N, K, M, L.num_sms())
        splits_of[s] = chosen
        probs.append(Problem(f"{s} dW", dy.t(), x, (N, K), cublas=lambda dy=dy, x=x: torch.mm(dy.t(), x)))
        for sk in sorted({1, 2, 3, 4, 6, 8, chosen}):
            probs.append(Problem(f"{s} dW split{sk}", dy.t(), x, (N, K), split_k=sk,
                                 cublas=lambda dy=dy, x=x: torch.mm(dy.t(), x)))
    auto = [p for p in probs if "split" not in p.name]  # also timed through gemm's autotuner, plain and WS
    sweep = [p for p in probs if p.name.split()[-1] != "dW"]  # timed per config
    jobs = [(p, cfg, default_knob) for p in sweep
            for cfg in (CANDIDATES if "split" not in p.name else L.GPU_CONFIGS) if valid(p, cfg, default_knob)]
    t = time.time()
    failed = precompile(jobs)
    print(f"\n== splits: {len(jobs)} variants compiled in {time.time() - t:.0f} s ({len(failed)} failed); "
          "ms replayed in CUDA graphs, ours = the best config", flush=True)
    print(f"{'problem':<34}{'cuBLAS':>9}{'ours':>9}{'ratio':>7}  best config / autotuned: ratio plain, WS"
          " (, WS dynamic tiles on Hopper)")
    out = {}
    for p in probs:
        if left() < 5:
            print(f"  {p.name}: skipped (time budget)")
            continue
        res, ref = {}, None
        for cfg, k in [(c, k) for q, c, k in jobs if q is p]:
            if (p.name, cfg, k[0]) in failed:
                res[cfg] = "compile: " + failed[(p.name, cfg, k[0])]
                continue
            config, tma_store = variant(cfg, k)
            configure_gemm(tma_store=tma_store)
            c, gu = p.new_out()
            p.call(c, gu, config)
            ref = c.clone() if ref is None else ref
            err = rel_err(c, ref)
            res[cfg] = graph_ms(lambda c=c, config=config: lambda: p.call(c, None, config)) if err < 2e-2 \
                else f"BAD err {err:.1e}"
        if p in auto:  # the autotuned plain kernel, the WS kernel, and (Hopper) the WS kernel's dynamic tiles
            hopper = torch.cuda.get_device_capability()[0] == 9
            for name, ws, dynamic in [("autotuned", False, False), ("ws", True, False)] + \
                    ([("ws dynamic", True, True)] if hopper else []):
                configure_gemm(library, sm90_ws=ws, dynamic=dynamic)
                c, gu = p.new_out()
                p.call(c, gu, None)
                ref = c.clone() if ref is None else ref
                err = rel_err(c, ref)
                res[name] = graph_ms(lambda c=c: lambda: p.call(c, None, None)) if err < 2e-2 else f"BAD err {err:.1e}"
            configure_gemm(library)
            if torch.cuda.get_device_capability()[0] == 9:  # and the WS kernel at each of its configs
                for wcfg in WS.configs():
                    c, gu = p.new_out()
                    # a config that cannot compile, or a problem the kernel does not take: reported, not fatal
                    try:
                        p.call(c, gu, wcfg)
                    except Exception as e:  # noqa: BLE001
                        res[ws_name(wcfg)] = "error: " + _msg(e)
                        continue
                    err = rel_err(c, ref)
                    res[ws_name(wcfg)] = graph_ms(lambda c=c, wcfg=wcfg: lambda: p.call(c, None, wcfg)) \
                        if err < 2e-2 else f"BAD err {err:.1e}"
        times = {cfg: v for cfg, v in res.items() if isinstance(v, float)}
        base = graph_ms(lambda: p.cublas)
        if ref is not None:
            err = rel_err(ref, p.cublas())
            if err > 2e-2:
                print(f"  BAD: {p.name} vs cuBLAS rel err {err:.1e}")
        if times:
            best = min(times, key=times.get)
            tuned = "  ".join(f"{base / times[k]:.3f}" if k in times else str(res.get(k, "-"))[:12]
                              for k in ("autotuned", "ws", "ws dynamic") if k in res)
            print(f"{p.name:<34}{base:9.4f}{times[best]:9.4f}{base / times[best]:7.3f}  {best}  {tuned}")
        out[p.name] = {"cublas_ms": base, **{str(c): v for c, v in res.items()}}
    configure_gemm(tma_store=default_knob[4])
    RESULTS["splits"] = {"split_k_for": splits_of, "problems": out}


SECTIONS = {"gemm": section_gemm, "host": section_host, "linear": section_linear, "swiglu": section_swiglu,
            "overlap": section_overlap,
            "lce": section_lce, "configs": section_configs,
            "splits": section_splits}


def main(argv):
    names = argv or list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    state: dict = {}
    for name in names:
        if name == "configs" and "stage_a" not in state:
            print("\n== configs: needs the gemm section first; skipped")
            continue
        if left() < 5:
            print(f"\n== {name}: skipped (time budget, {time.time() - T0:.0f} s used)")
            continue
        if name in ("host", "linear", "lce") and not state.get("e2e_set"):
            use_e2e_configs(state)
            state["e2e_set"] = True
        SECTIONS[name](state)
        sys.stdout.flush()
    print(f"\ntotal {time.time() - T0:.0f} s")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tune_linear.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
