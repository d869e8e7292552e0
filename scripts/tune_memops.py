"""Time the knob variants of the memory-bound ops side by side on the GPU (issue 2).

Usage (on a CUDA machine, from the repository root; under 2 minutes with a cold Triton cache)::

    python scripts/tune_memops.py [--ops host,rms_norm,rope,embedding] [--budget 100]

Sections: ``fp8`` (the quantization's amax pass: tile, row tiles per program, warps; its quantizing pass:
tile, warps; at void1b's operand shapes, both layouts, outputs bitwise those of the default), ``rms_norm`` (forward tile, backward tile / warps / programs per SM / prefetch, dW
reduction columns), ``rope`` (tile, warps), ``embedding`` (forward tile, backward id block /
column block / chunk / warps / sort key width, uniform and Zipf ids), ``host`` (fwd+bwd through
autograd at the benchmark shape and host microseconds per call at a tiny shape, ours against the
eager PyTorch op). Every variant runs the launcher at the benchmark shape on fresh random bf16 data
and is checked against the default variant's outputs (``check``: ``=`` bitwise equal, ``ok`` max
relative difference under 2e-2, i.e. a few bf16 ulps from a different reduction order, else
``BAD``: a broken variant, not a candidate). Times are ``triton.testing.do_bench`` medians of the
launcher alone (GPU-bound: one launch's host time hides behind do_bench's L2-flush memset).
``regs/spills`` is the main kernel's ptxas report (occupancy: 65536 / (regs * 32 * warps) programs
per SM). Variants whose plan equals an earlier one's are listed as ``same plan as``; variants past the
time budget are listed as skipped. A knob's default is the first variant of each group.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time

import torch
import torch.nn.functional as F
import triton.testing

rms = importlib.import_module("tritonllm.kernels.rms_norm")
rope_mod = importlib.import_module("tritonllm.kernels.rope")
emb = importlib.import_module("tritonllm.kernels.embedding")
fp8 = importlib.import_module("tritonllm.kernels.fp8")
from tritonllm.kernels import embedding, rms_norm, rope, rope_cos_sin, swiglu  # noqa: E402

DT = torch.bfloat16
T0 = time.perf_counter()
BUDGET = 100.0  # seconds after the imports; the script stays under 120 s with them


class Recorder:
    """Stands in for a ``@triton.jit`` kernel in its module and keeps the last compiled kernel it
    launched (for the ptxas register and spill counts)."""

    def __init__(self, fn):
        self.fn, self.last = fn, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = self.fn[grid](*args, **kwargs)
            return self.last
        return launch


@contextlib.contextmanager
def knobs(module, **values):
    """Set module knobs for the duration of the block (each knob must exist)."""
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def as_list(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t is not None]


def check(outs, refs) -> str:
    worst = 0.0
    for a, b in zip(outs, refs):
        if a.shape != b.shape:
            return "BAD shape"
        if torch.equal(a, b):
            continue
        a64, b64 = a.double(), b.double()
        if not torch.isfinite(a64).all():
            return "BAD nan"
        worst = max(worst, ((a64 - b64).abs().max() / b64.abs().max().clamp_min(1e-30)).item())
    if worst == 0.0:
        return "="
    return f"ok {worst:.0e}" if worst < 2e-2 else f"BAD {worst:.1e}"


def _short(knob: str) -> str:
    """``_BWD_ELEMS_PER_THREAD`` -> ``ept``: knob names short enough for one table line."""
    name = knob.strip("_").lower()
    for prefix in ("bwd_", "fwd_", "rope_", "dw_"):
        name = name.removeprefix(prefix)
    for long, short in (("elems_per_thread", "ept"), ("programs_per_sm", "pps"), ("num_warps", "warps"),
                        ("block_", "b"), ("sort_", "")):
        name = name.replace(long, short)
    return name


def print_header(title: str) -> None:
    print(f"\n== {title}")
    print(f"{'variant':<40}{'us':>9}{'GB/s':>8}{'x def':>7}{'regs/sp':>9}  check")


def run_group(title: str, module, variants: list[dict], run, nbytes: float, kernel_name: str, plan=None):
    """Time ``run()`` under each knob variant of ``module`` (the first is the reference)."""
    print_header(title)
    rec = Recorder(getattr(module, kernel_name))
    refs, base, seen = None, None, {}
    with knobs(module, **{kernel_name: rec}):
        for v in variants:
            name = " ".join(f"{_short(k)}={int(x) if isinstance(x, bool) else x}" for k, x in v.items())
            if time.perf_counter() - T0 > BUDGET:
                print(f"{name:<40}  skipped (time budget)")
                continue
            with knobs(module, **v):
                key = plan() if plan is not None else None
                if key is not None and key in seen:
                    print(f"{name:<40}  same plan as {seen[key]}")
                    continue
                seen[key] = name
                try:
                    outs = [t.clone() for t in as_list(run())]
                    torch.cuda.synchronize()
                    us = bench_us(run)
                except Exception as e:  # a variant that fails to compile or launch is reported
                    print(f"{name:<40}  FAILED {type(e).__name__}: {str(e)[:80]}")
                    continue
            if refs is None:
                refs, base = outs, us
            k = rec.last
            regs = f"{k.n_regs}/{k.n_spills}" if k is not None and hasattr(k, "n_regs") else "-"
            print(f"{name:<40}{us:>9.1f}{nbytes / us / 1e3:>8.0f}{base / us:>7.2f}{regs:>9}  {check(outs, refs)}",
                  flush=True)


# ---- rms_norm --------------------------------------------------------------------------------------

RMS_FWD = [dict(_FWD_TILE=4096, _FWD_ELEMS_PER_THREAD=16), dict(_FWD_TILE=8192, _FWD_ELEMS_PER_THREAD=16),
           dict(_FWD_TILE=2048, _FWD_ELEMS_PER_THREAD=8)]


def _bwd_variant(tile, per_thread, per_sm, prefetch):
    return dict(_BWD_NARROW_N=0, _BWD_TILE=tile, _BWD_ELEMS_PER_THREAD=per_thread, _BWD_PROGRAMS_PER_SM=per_sm, _BWD_PREFETCH=prefetch)


# the second variant is the previous code's configuration
RMS_BWD = [_bwd_variant(4096, 16, 2, True), _bwd_variant(2048, 8, 4, False), _bwd_variant(4096, 16, 2, False),
           _bwd_variant(2048, 8, 4, True), _bwd_variant(2048, 16, 4, True), _bwd_variant(4096, 8, 2, True),
           _bwd_variant(4096, 16, 3, True), _bwd_variant(8192, 16, 1, True)]
RMS_BWD_LARGE = RMS_BWD[:3]
RMS_DW = [dict(_DW_BLOCK_N=16), dict(_DW_BLOCK_N=8), dict(_DW_BLOCK_N=32)]


def tune_rms_norm():
    for m, n, bwd_variants in ((16384, 768, RMS_BWD), (32768, 4096, RMS_BWD_LARGE)):
        x = torch.randn(m, n, device="cuda", dtype=DT)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(DT)
        dy = torch.randn(m, n, device="cuda", dtype=DT)
        es = x.element_size()
        fwd_plan = lambda: rms._fwd_plan(  # noqa: E731
            n, (rms._MAX_BLOCK_N, rms._FWD_TILE, rms._FWD_ELEMS_PER_THREAD, rms._INTERP_TILE))
        run_group(f"rms_norm fwd {m}x{n}", rms, RMS_FWD if n == 768 else RMS_FWD[:2],
                  lambda: rms._fwd(x, None, w, 1e-6)[:1], 2 * m * n * es, "_rms_norm_fwd_kernel", plan=fwd_plan)
        _, _, rstd = rms._fwd(x, None, w, 1e-6)
        bwd_plan = lambda: rms._bwd_plan(m, n, x.device.index, (  # noqa: E731
            rms._MAX_BLOCK_N, rms._BWD_TILE, rms._BWD_ELEMS_PER_THREAD, rms._BWD_PROGRAMS_PER_SM,
            rms._DW_BLOCK_P, rms._DW_BLOCK_N, rms._INTERP_TILE)) + (rms._BWD_PREFETCH,)
        run_group(f"rms_norm bwd (both kernels) {m}x{n}", rms, bwd_variants,
                  lambda: rms._bwd(dy, x, w, rstd, None), 3 * m * n * es, "_rms_norm_bwd_kernel", plan=bwd_plan)
        if n == 768:
            run_group(f"rms_norm bwd dW-reduce columns {m}x{n} (regs: dw kernel)", rms, RMS_DW,
                      lambda: rms._bwd(dy, x, w, rstd, None)[1:], 3 * m * n * es, "_rms_norm_bwd_dw_kernel")
        del x, dy, rstd


# ---- rope ------------------------------------------------------------------------------------------

ROPE = [dict(_ROPE_TILE=4096, _ROPE_NUM_WARPS=8), dict(_ROPE_TILE=8192, _ROPE_NUM_WARPS=8),
        dict(_ROPE_TILE=4096, _ROPE_NUM_WARPS=4), dict(_ROPE_TILE=2048, _ROPE_NUM_WARPS=4),
        dict(_ROPE_TILE=8192, _ROPE_NUM_WARPS=16)]


def tune_rope():
    for b, t, hq, hkv, d in ((16, 1024, 12, 12, 64), (4, 8192, 32, 8, 128)):
        qkv = torch.randn(b, t, hq + 2 * hkv, d, device="cuda", dtype=DT)
        qk = qkv[:, :, :hq + hkv]
        cos, sin = rope_cos_sin(t, d, device="cuda")
        nbytes = 2 * qk.numel() * qk.element_size() + 2 * t * (d // 2) * 4
        run_group(f"rope fwd packed q|k [{b},{t},{hq}+{hkv},{d}]", rope_mod, ROPE if d == 64 else ROPE[:3],
                  lambda: rope_mod._rope_launch(qk, cos, sin, 0, False), nbytes, "_rope_kernel",
                  plan=lambda: rope_mod._plan(b * t, hq + hkv, d // 2, rope_mod._ROPE_TILE, rope_mod._ROPE_NUM_WARPS))
        del qkv, qk


# ---- embedding -------------------------------------------------------------------------------------

EMB_FWD = [dict(_FWD_BLOCK_N=16, _FWD_BLOCK_D=256, _FWD_NUM_WARPS=4),
           dict(_FWD_BLOCK_N=32, _FWD_BLOCK_D=256, _FWD_NUM_WARPS=8),
           dict(_FWD_BLOCK_N=8, _FWD_BLOCK_D=512, _FWD_NUM_WARPS=4),
           dict(_FWD_BLOCK_N=64, _FWD_BLOCK_D=128, _FWD_NUM_WARPS=4)]


def _emb_bwd_variant(block_v, block_d, chunk, warps, int16=True):
    return dict(_BWD_BLOCK_V=block_v, _BWD_BLOCK_D=block_d, _BWD_CHUNK=chunk, _BWD_NUM_WARPS=warps,
                _SORT_INT16=int16)


EMB_BWD = [_emb_bwd_variant(64, 128, 32, 4), _emb_bwd_variant(64, 128, 32, 4, int16=False),
           _emb_bwd_variant(32, 128, 32, 4), _emb_bwd_variant(128, 128, 32, 8), _emb_bwd_variant(64, 256, 32, 8),
           _emb_bwd_variant(64, 64, 32, 4), _emb_bwd_variant(64, 128, 64, 4)]


def tune_embedding():
    for n, v, d in ((16384, 32000, 768), (32768, 131072, 4096)):
        weight = torch.randn(v, d, device="cuda", dtype=DT)
        dy = torch.randn(n, d, device="cuda", dtype=DT)
        es = weight.element_size()
        rank = torch.arange(1, v + 1, dtype=torch.float64, device="cuda")
        id_sets = {"uniform": torch.randint(0, v, (n,), device="cuda")}
        if n == 16384:
            id_sets["zipf"] = torch.multinomial(1.0 / rank, n, replacement=True)
        ids = id_sets["uniform"]
        run_group(f"embedding fwd {n}x{d}x{v}", emb, EMB_FWD if n == 16384 else EMB_FWD[:2],
                  lambda: emb._fwd(ids, weight), n * 8 + 2 * n * d * es, "_embedding_fwd_kernel",
                  plan=lambda: (emb._FWD_BLOCK_N, emb._FWD_BLOCK_D, emb._FWD_NUM_WARPS))
        for kind, ids in id_sets.items():
            variants = EMB_BWD if (n == 16384 and kind == "uniform") else [EMB_BWD[i] for i in (0, 3, 4)]
            run_group(f"embedding bwd (cast + sort + kernel) {n}x{d}x{v} {kind} ids", emb, variants,
                      lambda: emb._bwd(dy, ids, v, -1), n * d * es + v * d * es, "_embedding_bwd_kernel")
        del weight, dy, id_sets


# ---- host time and end-to-end fwd+bwd ---------------------------------------------------------------

def _fwd_bwd(fn, inputs):
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [o for o in as_list(fn(*inputs)) if o.requires_grad]
    grads = [torch.randn_like(o) for o in outs]

    def step():
        o = [o for o in as_list(fn(*inputs)) if o.requires_grad]
        torch.autograd.grad(o, wrt, grads)
    return step


def _host_us(step, calls=200) -> float:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _cases(scale: int):
    """(name, ours, baseline, inputs) at ``scale`` rows/tokens (the benchmark's, or a tiny one)."""
    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=DT, requires_grad=True)

    x, w = leaf(scale, 768), (1 + 0.1 * torch.randn(768, device="cuda")).to(DT).requires_grad_()
    g, u = leaf(scale, 2048), leaf(scale, 2048)
    b, t = max(1, scale // 1024), min(scale, 1024)
    cos, sin = rope_cos_sin(t, 64, device="cuda")
    qk = torch.randn(b, t, 36, 64, device="cuda", dtype=DT)[:, :, :24].detach().requires_grad_()
    ids, table = torch.randint(0, 32000, (scale,), device="cuda"), leaf(32000, 768)

    def rope_eager(qk):
        c, s = cos[:, None, :].to(DT), sin[:, None, :].to(DT)
        x1, x2 = qk[..., :32], qk[..., 32:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return [("rms_norm", lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (768,), w, 1e-6), (x, w)),
            ("swiglu", swiglu, lambda g, u: F.silu(g) * u, (g, u)),
            ("rope packed q|k", lambda qk: rope(qk, cos, sin), rope_eager, (qk,)),
            ("embedding", lambda i, t: embedding(i, t, validate=False), F.embedding, (ids, table))]


# ---- fp8 quantization ------------------------------------------------------------------------------

def _amax_variant(block_r, block_c, row_tiles, warps):
    return dict(AMAX_BLOCK_R=block_r, AMAX_BLOCK_C=block_c, AMAX_ROW_TILES=row_tiles, AMAX_WARPS=warps)


FP8_AMAX = [_amax_variant(64, 64, 1, 4), _amax_variant(64, 128, 4, 4), _amax_variant(64, 128, 8, 8),
            _amax_variant(32, 256, 8, 4), _amax_variant(128, 64, 4, 8), _amax_variant(64, 256, 4, 8),
            _amax_variant(128, 128, 2, 8), _amax_variant(32, 128, 16, 4)]
FP8_QUANT = [dict(BLOCK_R=64, BLOCK_C=64, QUANT_WARPS=4), dict(BLOCK_R=64, BLOCK_C=64, QUANT_WARPS=8),
             dict(BLOCK_R=128, BLOCK_C=64, QUANT_WARPS=8), dict(BLOCK_R=64, BLOCK_C=128, QUANT_WARPS=8),
             dict(BLOCK_R=128, BLOCK_C=128, QUANT_WARPS=8), dict(BLOCK_R=32, BLOCK_C=128, QUANT_WARPS=4)]
#: void1b's fp8 operands (B4 x T2048 tokens, d_model 2048, qkv 3072, d_ff 5632): activations and
#: gradients [tokens, features], weights [out, in]; each quantized per row and per column
FP8_SHAPES = [(8192, 2048), (8192, 5632), (8192, 3072), (8192, 11264), (3072, 2048), (2048, 5632)]


def tune_fp8():
    for r, c in FP8_SHAPES:
        x = torch.randn(r, c, device="cuda", dtype=DT)
        q, qt = torch.empty(r, c, device="cuda", dtype=torch.float8_e4m3fn), torch.empty(c, r, device="cuda",
                                                                                         dtype=torch.float8_e4m3fn)
        s, st = torch.empty(r, device="cuda"), torch.empty(c, device="cuda")

        def run():
            fp8.quantize_into(x, 448.0, q, s, qt, st)
            return q.view(torch.uint8), s, qt.view(torch.uint8), st

        for kernel, variants in (("_amax_kernel", FP8_AMAX), ("_quantize_kernel", FP8_QUANT)):
            # GB/s of both passes: x read twice (bf16), written twice (fp8, each layout)
            run_group(f"fp8 quantize {r}x{c} rows+cols, {kernel}'s knobs", fp8, variants, run, 6 * r * c, kernel)
        del x, q, qt


def host_table():
    print("\n== fwd+bwd through autograd: us at the benchmark shape (do_bench median) and host us per call"
          " at 8 rows/tokens (GPU idle: the host's time)")
    print(f"{'op':<18}{'ours us':>9}{'eager us':>10}{'ours host':>11}{'eager host':>12}")
    big, tiny = _cases(16384), _cases(8)
    for (name, ours, eager, inputs), (_, ours_t, eager_t, inputs_t) in zip(big, tiny):
        if time.perf_counter() - T0 > BUDGET:
            print(f"{name:<18}  skipped (time budget)")
            continue
        row = [bench_us(_fwd_bwd(ours, inputs)), bench_us(_fwd_bwd(eager, inputs)),
               _host_us(_fwd_bwd(ours_t, inputs_t)), _host_us(_fwd_bwd(eager_t, inputs_t))]
        print(f"{name:<18}" + "".join(f"{v:>{wd}.1f}" for v, wd in zip(row, (9, 10, 11, 12))), flush=True)


SECTIONS = {"fp8": tune_fp8, "host": host_table, "rms_norm": tune_rms_norm, "rope": tune_rope, "embedding": tune_embedding}


def main():
    global BUDGET
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(SECTIONS), help=f"comma-separated sections of {list(SECTIONS)}")
    p.add_argument("--budget", type=float, default=BUDGET, help="seconds after which remaining variants are skipped")
    args = p.parse_args()
    BUDGET = args.budget
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name in args.ops.split(","):
        SECTIONS[name]()
    print(f"\ntotal {time.perf_counter() - T0:.0f} s")


if __name__ == "__main__":
    main()
