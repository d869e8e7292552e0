"""Hopper attention kernels in Gluon against the portable kernels and SDPA.

``--parts fwd`` (kernels/flash_attention/forward_sm90.py): every config's error against a float64
reference at odd shapes, then each config's forward time at the bench shapes in CUDA graphs. A config
that fails prints FAILED; one that hangs (a warp-specialized schedule's barriers) stops the script: run
it under ``timeout``. ``--parts bwd`` (backward_sm90.py, the SM90_BWD knob): at the bench shapes (packed
qkv, as in training), each gradient kernel of the deterministic backward alone, portable and with each
Gluon config (its largest difference to the portable gradients: 0.0 is bitwise equal), then the whole
backward and fwd+bwd with the knob off, on for both kernels (autotuned) and as shipped ("default"), in
CUDA graphs beside SDPA's; and the ``deterministic=False`` backward with the Gluon dK/dV kernel adding dQ
by TMA bulk reduces ("fused": each config, autotuned, fwd+bwd). JSON to $OUT/attention-sm90.json."""

from __future__ import annotations

import importlib
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tritonllm.bench import reference_ops as ref_ops  # noqa: E402
from tritonllm.bench.common import host_cpu_model  # noqa: E402
from tritonllm.kernels.flash_attention import flash_attention  # noqa: E402
from tritonllm.kernels.flash_attention.settings import attention_settings, configure_attention  # noqa: E402

fa_tuning = importlib.import_module("tritonllm.kernels.flash_attention.tuning")
fa_forward = importlib.import_module("tritonllm.kernels.flash_attention.forward")
fa_backward = importlib.import_module("tritonllm.kernels.flash_attention.backward")
bwd_sm90 = importlib.import_module("tritonllm.kernels.flash_attention.backward_sm90")
g = importlib.import_module("tritonllm.kernels.flash_attention.forward_sm90")


def run_config(q, k, v, causal, cfg):
    B, T, Hq, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    g.launch(q, k, v, o, lse, causal, D ** -0.5 * fa_tuning.LOG2E, fa_tuning.group_programs("fwd"), None, config=cfg)
    return o, lse


def portable(q, k, v, causal):
    with configure_attention(sm90_fwd=()):
        return fa_forward.flash_attention_fwd(q, k, v, causal)


def inputs(B, Hq, Hkv, T, S, D, packed=False):
    torch.manual_seed(0)
    if packed and T == S:
        qkv = torch.randn(B, T, Hq + 2 * Hkv, D, device="cuda", dtype=torch.bfloat16)
        return qkv.split([Hq, Hkv, Hkv], dim=2)
    return (torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16))


#: the bench's attention shapes (B, Hq, Hkv, T, D), causal
SHAPES = [(16, 12, 12, 1024, 64), (4, 16, 4, 2048, 128), (8, 32, 8, 4096, 128), (1, 32, 8, 16384, 128)]


def fused_backward(q, k, v, do, out, lse, flops: float, off: dict) -> dict:
    """The backward of ``deterministic=False`` with backward_sm90's dK/dV kernel in its DQ_REDUCE variant
    (AttentionSettings.sm90_fused; dQ by a writer warp's TMA bulk reduces, then the finalize kernel): ms of the whole backward in CUDA graphs for each
    config and autotuned, the largest difference of its gradients to the portable deterministic ones, and
    the autotuned fwd+bwd."""
    D = q.shape[-1]
    configure_attention(sm90_bwd=off)
    want = fa_backward.flash_attention_bwd(do, q, k, v, out, lse, True)
    fused_default = configure_attention(sm90_bwd={"dkdv": (D,), "dq": (D,)}, sm90_fused=(D,))
    tuned = bwd_sm90._dkdv_reduce_kernel
    configs, res = list(tuned.configs), {}

    def run():
        return fa_backward.flash_attention_bwd(do, q, k, v, out, lse, True, deterministic=False)
    for cfg in configs + [None]:
        tuned.configs = configs if cfg is None else [cfg]
        label = "autotuned" if cfg is None else "{BLOCK_M}x{BLOCK_N} w{w} buf{NUM_BUF}".format(
            w=cfg.num_warps, **cfg.kwargs)
        try:
            got = run()
            ms = triton.testing.do_bench_cudagraph(run, rep=200)
        except Exception as e:  # noqa: BLE001  (a config that fails is a result)
            res[label] = repr(e)[:300]
            print("FAILED fused", label, repr(e)[:300])
            continue
        diff = {n: (a.double() - b.double()).abs().max().item() for n, a, b in zip(("dq", "dk", "dv"), got, want)}
        res[label] = {"bwd_ms": round(ms, 4), "bwd_tflops": round(2.5 * flops / ms / 1e9, 1), "max_diff": diff}
    res["config"] = str(tuned.autotuner.best_config)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd_bwd():
        return torch.autograd.grad(flash_attention(qg, kg, vg, causal=True, deterministic=False), (qg, kg, vg), do)
    try:
        fwd_bwd()
        res["fwd_bwd_ms"] = round(triton.testing.do_bench_cudagraph(fwd_bwd, rep=200), 4)
    except Exception as e:  # noqa: BLE001
        res["fwd_bwd_ms"] = repr(e)[:300]
    configure_attention(sm90_fused=fused_default.sm90_fused)
    return res


def backward_part(res: dict) -> None:
    """The deterministic backward at SHAPES: each gradient kernel (dK/dV, dQ) alone, portable and each
    Gluon config, with its largest gradient difference to the portable kernel's; then the whole backward
    and fwd+bwd, portable, with both Gluon kernels autotuned and as shipped (AttentionSettings.sm90_bwd), beside SDPA's
    fwd+bwd; the setting is left as shipped."""
    res["backward"] = []
    kernels = {"dkdv": bwd_sm90._dkdv_kernel, "dq": bwd_sm90._dq_kernel}
    all_configs = {name: list(t.configs) for name, t in kernels.items()}
    off = {"dkdv": (), "dq": ()}
    default = dict(attention_settings().sm90_bwd)
    for B, Hq, Hkv, T, D in SHAPES:
        q, k, v = inputs(B, Hq, Hkv, T, T, D, packed=True)
        do = torch.randn_like(q)
        out, lse = fa_forward.flash_attention_fwd(q, k, v, True)
        flops = 4 * B * Hq * T * T * D / 2
        row = {"shape": [B, Hq, Hkv, T, D], "kernels": {}}

        def one_kernel(name):
            """ms of the gradient kernel ``name`` alone (CUDA graph) and its outputs."""
            bwd = fa_backward.AttentionBackward(do, q, k, v, out, lse, True, None, None)
            grads = [torch.empty_like(t) for t in ((q,) if name == "dq" else (k, v))]
            fn = (lambda: bwd.dq(*grads)) if name == "dq" else (lambda: bwd.dkdv(*grads))
            fn()
            return triton.testing.do_bench_cudagraph(fn, rep=200), grads

        for name, tuned in kernels.items():
            configure_attention(sm90_bwd=off)
            ms, want = one_kernel(name)
            times = {"portable": round(ms, 4)}
            for cfg in all_configs[name]:
                configure_attention(sm90_bwd={**off, name: (D,)})
                tuned.configs = [cfg]
                label = ("sm90 {BLOCK_M}x{BLOCK_N} w{w} buf{NUM_BUF}".format(w=cfg.num_warps, **cfg.kwargs)
                         + (" dv_wait" if cfg.kwargs.get("DV_WAIT") else "")
                         + (" persist" if cfg.kwargs.get("PERSIST") else ""))
                try:
                    ms, got = one_kernel(name)
                except Exception as e:  # noqa: BLE001  (a config that fails is a result)
                    times[label] = repr(e)[:200]
                    continue
                diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want))
                times[label] = {"ms": round(ms, 4), "max_diff": diff}
            tuned.configs = all_configs[name]
            row["kernels"][name] = times
        for variant, knob in (("portable", off), ("sm90", {"dkdv": (D,), "dq": (D,)}), ("default", default)):
            configure_attention(sm90_bwd=knob)
            try:
                fa_backward.flash_attention_bwd(do, q, k, v, out, lse, True)  # autotunes
                bwd_ms = triton.testing.do_bench_cudagraph(
                    lambda: fa_backward.flash_attention_bwd(do, q, k, v, out, lse, True), rep=200)
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

                def fwd_bwd():
                    return torch.autograd.grad(flash_attention(qg, kg, vg, causal=True), (qg, kg, vg), do)
                fwd_bwd()  # the packed backward's own plans (autotuning) before the capture
                fwd_bwd_ms = triton.testing.do_bench_cudagraph(fwd_bwd, rep=200)
            except Exception as e:  # noqa: BLE001
                row[variant] = repr(e)[:300]
                print("FAILED", variant, repr(e)[:300])
                continue
            row[variant] = {"bwd_ms": round(bwd_ms, 4), "bwd_tflops": round(2.5 * flops / bwd_ms / 1e9, 1),
                            "fwd_bwd_ms": round(fwd_bwd_ms, 4)}
        row["fused"] = fused_backward(q, k, v, do, out, lse, flops, off)
        row["sm90_configs"] = {n: str(t.autotuner.best_config) for n, t in kernels.items()}
        configure_attention(sm90_bwd=default)
        qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        dos = do.transpose(1, 2)

        def sdpa():
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=Hq != Hkv)
            return torch.autograd.grad(o, (qs, ks, vs), dos)
        sdpa()
        row["sdpa"] = {"fwd_bwd_ms": round(triton.testing.do_bench_cudagraph(sdpa, rep=200), 4)}
        res["backward"].append(row)
        print(json.dumps(row), flush=True)


def forward_part(res: dict, errors: bool = True) -> None:
    """forward_sm90's configs: errors at odd shapes (unless ``errors`` is False), then forward times at SHAPES."""
    res["errors"], res["times"] = [], []
    cases = [] if not errors else [(2, 4, 2, 1000, 1000, 128, True, True), (1, 4, 1, 777, 1500, 128, False, False),
             (2, 6, 2, 1000, 1000, 64, True, True), (1, 2, 2, 1, 1, 64, True, False),
             (1, 2, 1, 17, 5, 128, True, False), (1, 4, 4, 64, 64, 64, False, False),
             (2, 8, 2, 257, 300, 128, True, False), (1, 2, 2, 4096, 4096, 128, True, True)]
    for B, Hq, Hkv, T, S, D, causal, packed in cases:
        q, k, v = inputs(B, Hq, Hkv, T, S, D, packed)
        ref, ref_lse = ref_ops.attention(q.double(), k.double(), v.double(), causal, None, None, return_lse=True)
        po, plse = portable(q, k, v, causal)
        scale = ref.abs().max().item()
        for cfg in g.CONFIGS:
            try:
                o, lse = run_config(q, k, v, causal, cfg)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                res["errors"].append({"case": [B, Hq, Hkv, T, S, D, causal], "config": cfg, "error": repr(e)[:300]})
                print("FAILED", cfg, repr(e)[:300])
                continue
            fin = torch.isfinite(ref_lse)
            row = {"case": [B, Hq, Hkv, T, S, D, causal, packed], "config": cfg,
                   "out_err": (o.double() - ref).abs().max().item() / max(scale, 1e-9),
                   "portable_out_err": (po.double() - ref).abs().max().item() / max(scale, 1e-9),
                   "lse_err": (lse[fin].double() - ref_lse[fin]).abs().max().item() if fin.any() else 0.0,
                   "lse_inf_match": bool(torch.equal(torch.isneginf(lse), ~fin)),
                   "nan": bool(torch.isnan(o).any().item())}
            res["errors"].append(row)
            print(row)
    for B, Hq, Hkv, T, D in SHAPES:
        q, k, v = inputs(B, Hq, Hkv, T, T, D, packed=True)
        flops = 4 * B * Hq * T * T * D / 2
        row = {"shape": [B, Hq, Hkv, T, D]}
        def sd():
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=Hq != Hkv)
        with torch.no_grad():
            for name, fn in [("sdpa", sd), ("portable", lambda: portable(q, k, v, True))] + [
                    (f"sm90 {c}", (lambda c=c: run_config(q, k, v, True, c))) for c in g.CONFIGS]:
                try:
                    fn()
                    ms = triton.testing.do_bench_cudagraph(fn, rep=200)
                except Exception as e:  # noqa: BLE001
                    row[name] = repr(e)[:200]
                    continue
                row[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        res["times"].append(row)
        print(json.dumps(row))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="fwd,bwd", help="comma-separated: fwd, bwd")
    p.add_argument("--no-errors", action="store_true", help="fwd: only the times (the GPU tests check each schedule)")
    args = p.parse_args()
    parts = args.parts.split(",")
    res = {"gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu_model(), "torch": torch.__version__,
           "triton": triton.__version__}
    out = os.path.join(os.environ.get("OUT", "."), "attention-sm90.json")
    for part, run in (("fwd", lambda r: forward_part(r, not args.no_errors)), ("bwd", backward_part)):
        if part in parts:
            run(res)
            json.dump(res, open(out, "w"), indent=1)  # after each part: a later hang keeps what was measured


if __name__ == "__main__":
    main()
