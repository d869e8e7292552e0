"""Time flash-attention variants side by side on the GPU, to set the knobs of kernels/flash_attention.py.

Usage (on the GPU, about 100 s from a cold Triton cache; the table is printed last)::

    python scripts/tune_attention.py [--shapes causal128,causal64,window] [--kernels fwd,fused,dkdv,dq]
                                     [--budget 105] [--json FILE]

Shapes (bf16, inputs stored [B, H, T, D] and passed as [B, T, H, D] views, as in the benchmark):
``causal128`` B8 Hq32/Hkv8 T4096 D128, ``causal64`` B16 Hq12/Hkv12 T1024 D64 (both causal) and
``window`` B1 Hq32/Hkv8 T16384 D128 W1024, whose baselines add full causal attention at the same shape
(ours and SDPA: the benchmark's window ratio, and the fourth target shape); ``gqa128`` B4 Hq16/Hkv4
T2048 D128 is the benchmark's GQA row, ``causal128long`` B1 Hq32/Hkv8 T16384 D128 its long one.

Baselines first, per shape: SDPA and ours (the current knobs with the first configs, pinned: the
benchmark autotunes over the lists instead), each pass fwd / bwd / fwd+bwd. Then per shape and kernel
(``fwd``, ``dkdv``, ``dq``, each timed alone) the variants: ``default`` (first config of FWD_CONFIGS /
DKDV_CONFIGS / DQ_CONFIGS, the TMA and ONE_LOOP knobs as set) and the default config with TMA flipped
and with ONE_LOOP flipped, for every shape, then ``cfg BLOCK_MxBLOCK_N wWARPS sSTAGES``: every other
config but the last (the fp32 fallback). Each variant runs twice on the same fresh random inputs:
``err_def`` is its max abs difference from the default variant over the default's max abs value,
``err_sdpa`` its relative L2 error against SDPA (with a window: an fp32 reference by query chunks, as
SDPA has no window). A variant whose two runs differ bitwise is flagged ``RACE``, one over 2e-2 against
SDPA ``WRONG``, one that fails to compile or launch ``FAILED`` (the reason follows). TF/s: passes
count the benchmark's FLOPs (4 B Hq D pairs forward, x2.5 backward), the dK/dV and dQ kernels their own
tile products (x2 and x1.5 the forward). Variants past ``--budget`` seconds are listed as skipped so
that the script ends in time; rerun with fewer ``--shapes`` / ``--kernels`` for them (Triton's cache
keeps what was compiled). The notes at the end estimate fwd+bwd with each kernel's best variant.
``order N`` runs the default with the programs' (batch, head) pairs grouped by N waves of programs
(GROUP_WAVES; 0: one pair at a time, ``all``: one group). To adopt a winner: move its config first in its
list, or set the TMA / ONE_LOOP / GROUP_WAVES entry.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

os.environ["TRITONLLM_NO_AUTOTUNE"] = "1"  # each variant runs exactly the config it sets

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from tritonllm.bench.common import host_cpu_model  # noqa: E402
from tritonllm.bench.ops_attention import attention_flops  # noqa: E402
from tritonllm.kernels import flash_attention  # noqa: E402
from tritonllm.kernels.flash_attention.backward import AttentionBackward  # noqa: E402
from tritonllm.kernels.flash_attention.settings import attention_settings, configure_attention  # noqa: E402


class _Package:
    """The attention package's tuning constants, kernels and launchers (forward, backward), looked up in
    whichever of its modules defines them: the package itself re-exports only the public API."""

    modules = [importlib.import_module(f"tritonllm.kernels.flash_attention.{m}") for m in ("tuning", "forward", "backward")]

    def __getattr__(self, name: str):
        for module in self.modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(name)


fa = _Package()

# name: (B, Hq, Hkv, T, D, window), causal, S = T
SHAPES = {
    "causal128": (8, 32, 8, 4096, 128, None),
    "causal64": (16, 12, 12, 1024, 64, None),
    "window": (1, 32, 8, 16384, 128, 1024),
    # the two above with the head dim and the length swapped: which of the two decides a knob
    "causal64long": (4, 12, 12, 4096, 64, None),
    "causal128short": (16, 12, 12, 1024, 128, None),
    # the benchmark's GQA row: few programs a kernel, so their order matters most
    "gqa128": (4, 16, 4, 2048, 128, None),
    "causal128long": (1, 32, 8, 16384, 128, None),
}
# autotuned kernel, config list, FLOPs / forward FLOPs, TMA / ONE_LOOP knob: the deterministic backward's two
# kernels (dkdv, dq) and the default fused one (dK, dV and atomic dQ in the dK/dV kernel, with preprocess + finalize)
KERNELS = {"fwd": ("_fwd_kernel", "FWD_CONFIGS", 1.0, "fwd"), "dkdv": ("_dkdv_kernel", "DKDV_CONFIGS", 2.0, "dkdv"),
           "dq": ("_dq_kernel", "DQ_CONFIGS", 1.5, "dq"), "fused": ("_dkdv_kernel", "DKDV_CONFIGS", 2.5, "dkdv")}
TOLERANCE = 2e-2  # relative L2 error against SDPA (bf16 operands: 1e-3 to 1e-2)
DEVICE, DTYPE = "cuda", torch.bfloat16


def bench_ms(fn, rep: int = 50) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def max_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def sdpa(q, k, v):
    """Causal SDPA on [B, T, H, D] views (its native [B, H, T, D] storage underneath)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def window_reference(q, k, v, do, window: int, chunk: int = 1024):
    """(out, dq, dk, dv) of sliding-window attention in fp32, by query chunks of ``chunk`` rows that
    each see only their ``window + chunk - 1`` keys (SDPA has no window)."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    T, rep = q.shape[1], q.shape[2] // k.shape[2]
    outs = []
    for i0 in range(0, T, chunk):
        i1, j0 = min(i0 + chunk, T), max(i0 - window + 1, 0)
        kc, vc = (t[:, j0:i1].repeat_interleave(rep, 2) for t in (k, v))
        scores = torch.einsum("bthd,bshd->bhts", q[:, i0:i1], kc) * q.shape[-1] ** -0.5
        i = torch.arange(i0, i1, device=q.device)[:, None]
        j = torch.arange(j0, i1, device=q.device)[None, :]
        scores = scores.masked_fill((j > i) | (j <= i - window), float("-inf"))
        outs.append(torch.einsum("bhts,bshd->bthd", scores.softmax(-1), vc))
    out = torch.cat(outs, 1)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do.float()))


def passes(attn, q, k, v, do) -> dict[str, float]:
    """ms of fwd, bwd (autograd, graph retained) and fwd+bwd of ``attn``."""
    with torch.no_grad():
        fwd = bench_ms(lambda: attn(q, k, v), rep=100)
    out = attn(q, k, v)
    bwd = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), rep=100)
    both = bench_ms(lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), do), rep=100)
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": both}


class Knobs:
    """Sets one kernel's config and its ``tma`` / ``one_loop`` / ``group_waves`` settings; ``restore`` puts
    the configs and settings before back."""

    def __init__(self):
        self.saved = {attr: list(getattr(fa, attr).configs) for attr, *_ in KERNELS.values()}
        self.settings = attention_settings()

    def set(self, kernel: str, config: tuple, tma: bool, one_loop: bool, group: float | None, kind: str) -> None:
        bm, bn, warps, stages = config
        attr, _, _, knob = KERNELS[kernel]
        getattr(fa, attr).configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)]
        configure_attention(tma={knob: tma}, one_loop={knob: {kind: one_loop}}, group_waves={knob: group})

    def restore(self) -> None:
        for attr, configs in self.saved.items():
            getattr(fa, attr).configs = configs
        configure_attention(self.settings)


Variant = tuple[int, str, tuple, bool, bool, float | None]


def variants(kernel: str, kind: str, groups: tuple[float | None, ...]) -> list[Variant]:
    """(priority, label, config, tma, one_loop, GROUP_WAVES): the default, the two knob flips and the
    program orders of ``groups`` (priority 0), then the other configs but the last, the fp32 fallback
    (priority 1)."""
    _, configs_attr, _, knob = KERNELS[kernel]
    configs = getattr(fa, configs_attr)
    settings = attention_settings()
    tma, one_loop, group = settings.tma[knob], settings.one_loop[knob][kind], settings.group_waves[knob]
    return ([(0, "default", configs[0], tma, one_loop, group),
             (0, f"TMA={not tma}", configs[0], not tma, one_loop, group),
             (0, f"ONE_LOOP={not one_loop}", configs[0], tma, not one_loop, group)]
            + [(0, f"order {'all' if g is None else g}", configs[0], tma, one_loop, g) for g in groups if g != group]
            + [(1, "cfg {}x{} w{} s{}".format(*c), c, tma, one_loop, group) for c in configs[1:-1]])


def make_inputs(B, Hq, Hkv, T, D):
    def make(H):
        return torch.randn(B, H, T, D, device=DEVICE, dtype=DTYPE).transpose(1, 2).requires_grad_()
    return make(Hq), make(Hkv), make(Hkv), torch.randn(B, T, Hq, D, device=DEVICE, dtype=DTYPE)


class Shape:
    """One problem: fresh inputs, the references, the forward's (o, lse) and the baseline timings."""

    def __init__(self, name: str):
        B, Hq, Hkv, T, D, W = SHAPES[name]
        self.label = f"B{B} Hq{Hq}/Hkv{Hkv} T{T} D{D}" + (f" W{W}" if W else "")
        self.window, self.kind = W, "causal" if W is None else "window"
        self.flops = attention_flops(B, Hq, T, T, D, True, W)
        self.full_flops = attention_flops(B, Hq, T, T, D, True)
        self.q, self.k, self.v, self.do = make_inputs(B, Hq, Hkv, T, D)
        if W is None:
            ref_out = sdpa(self.q, self.k, self.v)
            ref_grads = torch.autograd.grad(ref_out, (self.q, self.k, self.v), self.do)
        else:
            ref_out, *ref_grads = window_reference(self.q, self.k, self.v, self.do, W)
        self.refs = {"fwd": (ref_out,), "dkdv": tuple(ref_grads[1:]), "dq": tuple(ref_grads[:1]),
                     "fused": tuple(ref_grads)}
        self.o, self.lse = fa.flash_attention_fwd(*self.qkv(), True, W)
        # every pass of SDPA and ours (current knobs, first configs); with a window both also without it
        # (full causal: the window ratio's denominators, and the fourth target shape)
        self.sdpa = "sdpa" if W is None else "sdpa full causal"
        self.base = {self.sdpa: passes(sdpa, self.q, self.k, self.v, self.do),
                     "ours": passes(lambda q, k, v: flash_attention(q, k, v, causal=True, window=W),
                                    self.q, self.k, self.v, self.do)}
        if W is not None:
            self.base["ours full causal"] = passes(flash_attention, self.q, self.k, self.v, self.do)

    def qkv(self):
        return self.q.detach(), self.k.detach(), self.v.detach()

    def launcher(self, kernel: str):
        """A call running only ``kernel`` and returning its outputs as a tuple."""
        if kernel == "fwd":
            return lambda: fa.flash_attention_fwd(*self.qkv(), True, self.window)[:1]
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in self.qkv())
        if kernel == "fused":  # preprocess (zeroes the dQ accumulator), fused kernel, dQ finalize
            def fused():
                AttentionBackward(self.do, *self.qkv(), self.o, self.lse, True, self.window, None).run(dq, dk, dv)
                return dq, dk, dv
            return fused
        bwd = AttentionBackward(self.do, *self.qkv(), self.o, self.lse, True, self.window, None, deterministic=True)
        if kernel == "dkdv":
            return lambda: (bwd.dkdv(dk, dv), (dk, dv))[1]
        return lambda: (bwd.dq(dq), (dq,))[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--orders", default="0,1,all", help="GROUP_WAVES settings tried beside the default")
    ap.add_argument("--budget", type=float, default=105.0, help="seconds after which variants are skipped")
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "tune_attention.json") if "OUT" in os.environ
                    else None, help="also write the rows here (default $OUT/tune_attention.json)")
    args = ap.parse_args()
    # GROUP_WAVES settings tried beside the default (waves of programs per group of (batch, head) pairs;
    # 0: one pair at a time; None: all)
    groups = tuple(None if g == "all" else float(g) for g in args.orders.split(","))
    start = time.perf_counter()
    knobs = Knobs()
    rows, notes = [], []

    def row(order, shape, kernel, variant, ms, flops, default_ms=None, err_def=None, err_sdpa=None, note=""):
        rows.append({"order": order, "shape": shape, "kernel": kernel, "variant": variant, "ms": ms,
                     "TF/s": flops / (ms * 1e-3) / 1e12 if ms else None,
                     "x_default": default_ms / ms if ms and default_ms else None,
                     "err_def": err_def, "err_sdpa": err_sdpa, "note": note})

    torch.manual_seed(0)
    shapes = [Shape(name) for name in args.shapes.split(",")]
    for i, sh in enumerate(shapes):
        for impl, times in sh.base.items():
            for p, ms in times.items():
                row((i, 0, 0, 0), sh.label, p, impl, ms, (sh.flops if impl == "ours" else sh.full_flops)[p],
                    note=f"{sh.base[sh.sdpa][p] / ms:.2f}x {sh.sdpa}")
        if sh.window is not None:
            notes.append(f"{sh.label}: ours full causal / ours window: " + ", ".join(
                f"{p} {sh.base['ours full causal'][p] / sh.base['ours'][p]:.2f}x" for p in sh.base["ours"]))

    # the defaults and knob flips of every shape and kernel first, then the other configs
    kernels = args.kernels.split(",")
    tasks = sorted((prio, i, j, n, label, config, tma, one_loop, group)
                   for i, sh in enumerate(shapes) for j, kernel in enumerate(kernels)
                   for n, (prio, label, config, tma, one_loop, group) in enumerate(variants(kernel, sh.kind, groups)))
    defaults = {}  # (shape index, kernel): (outputs, ms) of the default variant
    best = {}      # (shape index, kernel): (ms, label) of the fastest good variant
    for _, i, j, n, label, config, tma, one_loop, group in tasks:
        sh, kernel, order = shapes[i], kernels[j], (i, 1, j, n)
        if time.perf_counter() - start > args.budget:
            row(order, sh.label, kernel, label, None, 0, note="skipped (budget)")
            continue
        knobs.set(kernel, config, tma, one_loop, group, sh.kind)
        try:
            fn = sh.launcher(kernel)
            first, second = (tuple(t.clone() for t in fn()) for _ in range(2))
            torch.cuda.synchronize()
            ms = bench_ms(fn)
        except Exception as e:  # noqa: BLE001  (a variant that does not compile is a result)
            row(order, sh.label, kernel, label, None, 0, note=f"FAILED {type(e).__name__}: {str(e)[:90]}")
            continue
        finally:
            knobs.restore()
        # the fused kernel's dQ is summed by atomics in a varying order: only dK, dV must repeat bitwise
        race = any(not torch.equal(a, b) for a, b in zip(first[kernel == "fused":], second[kernel == "fused":]))
        err_sdpa = max(rel_l2(x, r) for x, r in zip(first, sh.refs[kernel]))
        if label == "default":
            defaults[(i, kernel)] = (first, ms)
        default_out, default_ms = defaults.get((i, kernel), (None, None))
        err_def = max(max_rel(x, r) for x, r in zip(first, default_out)) if default_out else None
        note = "RACE" if race else "WRONG" if not err_sdpa <= TOLERANCE else ""
        row(order, sh.label, kernel, label, ms, sh.flops["fwd"] * KERNELS[kernel][2], default_ms, err_def,
            err_sdpa, note)
        if not note and ms < best.get((i, kernel), (float("inf"),))[0]:
            best[(i, kernel)] = (ms, label)
        del first, second

    for i, sh in enumerate(shapes):
        found = [(kn, best[(i, kn)]) for kn in kernels if (i, kn) in best and (i, kn) in defaults]
        if not found:
            continue
        est = sh.base["ours"]["fwd+bwd"] - sum(defaults[(i, kn)][1] - b[0] for kn, b in found)
        ratio = (f"{sh.base['ours full causal']['fwd+bwd'] / est:.2f}x under ours full causal" if sh.window
                 else f"{sh.base['sdpa']['fwd+bwd'] / est:.2f}x sdpa")
        notes.append(f"{sh.label}: best " + ", ".join(f"{kn} {b[1]}" for kn, b in found)
                     + f": fwd+bwd ~{est:.3f} ms = {ratio}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu_model(), "triton": triton.__version__,
                       "torch": torch.__version__, "rows": rows, "notes": notes}, f, indent=1)
    print(f"{'shape':<34}{'kernel':<9}{'variant':<20}{'ms':>9}{'TF/s':>7}{'x def':>7}{'err_def':>9}"
          f"{'err_sdpa':>9}  note")
    for r in sorted(rows, key=lambda r: r["order"]):  # stable: the baselines keep their order
        def fmt(key, width, spec):
            return f"{r[key]:>{width}{spec}}" if r[key] is not None else f"{'-':>{width}}"
        print(f"{r['shape']:<34}{r['kernel']:<9}{r['variant']:<20}{fmt('ms', 9, '.4f')}{fmt('TF/s', 7, '.0f')}"
              f"{fmt('x_default', 7, '.2f')}{fmt('err_def', 9, '.1e')}{fmt('err_sdpa', 9, '.1e')}  {r['note']}")
    for n in notes:
        print(n)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
