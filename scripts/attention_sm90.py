"""Hopper forward (kernels/flash_attention/forward_sm90.py) against the portable kernel and SDPA: every
config's error against a float64 reference at odd shapes, then each config's forward time at the bench
shapes in CUDA graphs. JSON to $OUT/attention-sm90.json. A config that fails prints FAILED; one that
hangs (a warp-specialized schedule's barriers) stops the script: run it under ``timeout``."""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tritonllm.bench import reference_ops as ref_ops  # noqa: E402
from tritonllm.bench.train import host_cpu_model  # noqa: E402
from tritonllm.kernels._common import next_pow2, tma_scratch  # noqa: E402

fa_config = importlib.import_module("tritonllm.kernels.flash_attention.config")
fa_forward = importlib.import_module("tritonllm.kernels.flash_attention.forward")
g = importlib.import_module("tritonllm.kernels.flash_attention.forward_sm90")


def run_config(q, k, v, causal, cfg):
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=q.device)
    bm, bn, w, nb, ws = cfg
    triton.set_allocator(tma_scratch)
    g._sm90_fwd_kernel[(triton.cdiv(T, bm) * B * Hq,)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], T, S, Hq, Hq // Hkv, S - T,
        D ** -0.5 * fa_config.LOG2E, fa_config.group_programs("fwd"), next_pow2(T), next_pow2(S),
        HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, NUM_BUF=nb, CAUSAL=causal, WS=ws, num_warps=w)
    return o, lse


def portable(q, k, v, causal):
    knob, fa_config.SM90_FWD = fa_config.SM90_FWD, ()
    try:
        return fa_forward.flash_attention_fwd(q, k, v, causal)
    finally:
        fa_config.SM90_FWD = knob


def inputs(B, Hq, Hkv, T, S, D, packed=False):
    torch.manual_seed(0)
    if packed and T == S:
        qkv = torch.randn(B, T, Hq + 2 * Hkv, D, device="cuda", dtype=torch.bfloat16)
        return qkv.split([Hq, Hkv, Hkv], dim=2)
    return (torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16),
            torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16))


def main():
    res = {"gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu_model(), "torch": torch.__version__,
           "triton": triton.__version__, "errors": [], "times": []}
    cases = [(2, 4, 2, 1000, 1000, 128, True, True), (1, 4, 1, 777, 1500, 128, False, False),
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
    shapes = [(16, 12, 12, 1024, 64), (4, 16, 4, 2048, 128), (8, 32, 8, 4096, 128), (1, 32, 8, 16384, 128)]
    for B, Hq, Hkv, T, D in shapes:
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
    out = os.environ.get("OUT", ".")
    json.dump(res, open(os.path.join(out, "attention-sm90.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
