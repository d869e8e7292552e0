"""``python -m tritonllm.bench train +model=void125m [hydra overrides] [--steps 20 --warmup 5 --out docs/perf]``

Training throughput of tritonllm against plain PyTorch in one process run, on random tokens (the
data does not change the speed). The config is composed like ``python -m tritonllm.train``'s; the
batch defaults to B16 x T1024 (``trainer.batch_size`` / ``trainer.seq_len`` override it).

- tritonllm: the model in bf16 with fp32 master weights in ``tritonllm.optim.AdamW``, the step of
  :func:`tritonllm.train.forward_backward` (forward, backward, gradient clipping) + AdamW.
- baseline: :class:`tritonllm.bench.reference_model.ReferenceTransformer` of the same shape
  (cuBLAS GEMMs, SDPA attention) under ``torch.compile``, fp32 weights with bf16 autocast,
  ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW(fused=True)``.

Reported per side: tokens/s (timed steps after warm-up, CUDA-synchronised wall time), MFU =
``model.flops_per_token(T) * tokens/s / trainer.peak_flops`` and the peak allocated memory. One
tritonllm step is profiled with ``torch.profiler``: ``triton_share`` is the fraction of GPU kernel
time (memset/memcpy excluded) spent in tritonllm's own Triton kernels, recognised by name (every
``@triton.jit`` kernel of ``tritonllm.kernels`` is ``_<name>_kernel``); every other kernel is listed.
Results go to ``docs/perf/train-<gpu>.json`` (DESIGN.md section 6).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time

import torch

#: Triton kernels of tritonllm.kernels: `_<op>_..._kernel` (a compiled name may carry a suffix)
OUR_KERNEL = re.compile(r"^_\w*_kernel")
EXCLUDED = ("Memcpy", "Memset", "memcpy", "memset")


def _time_steps(step, steps: int, warmup: int) -> tuple[float, float]:
    """Seconds per step (after ``warmup`` untimed steps) and the peak allocated memory in GB."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, torch.cuda.max_memory_allocated() / 1e9


def kernel_times(step) -> tuple[dict[str, float], dict[str, float]]:
    """GPU time in ms per kernel name of one profiled ``step()``: (ours, others), memset/memcpy excluded."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # CUDA activity only: with CPU activity on, record_function ranges such as
    # "Optimizer.step#AdamW.step" also appear on the GPU timeline and would count as kernels.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ours, others = {}, {}
    for evt in prof.key_averages():
        us = evt.self_device_time_total
        if us <= 0 or evt.key.startswith(EXCLUDED) or evt.device_type.name != "CUDA":
            continue
        table = ours if OUR_KERNEL.match(evt.key) else others
        table[evt.key] = table.get(evt.key, 0.0) + us / 1e3
    return ours, others


def _parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m tritonllm.bench train",
                                description="Hydra overrides as for python -m tritonllm.train, plus:")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--out", default="docs/perf", help="folder for train-<gpu>.json")
    p.add_argument("--no-baseline", action="store_true", help="time tritonllm only")
    return p.parse_known_args(argv)


def main(argv: list[str]) -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    from tritonllm.bench.harness import write_results
    from tritonllm.errors import TritonLLMError
    from tritonllm.models import build_model
    from tritonllm.train import build_optimizer, forward_backward, model_config

    args, overrides = _parse(argv)
    if not torch.cuda.is_available():
        sys.exit("python -m tritonllm.bench train needs a CUDA GPU")
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        cfg = compose("train", overrides=["trainer.batch_size=16", "trainer.seq_len=1024", *overrides])
    try:
        model_cfg = model_config(cfg)
    except TritonLLMError as e:
        sys.exit(f"tritonllm: error: {e}")
    B, T = cfg.trainer.batch_size, cfg.trainer.seq_len
    with open_dict(cfg):
        cfg.model.vocab_size = model_cfg.vocab_size
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (B, T + 1), device=device, generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    peak = float(cfg.trainer.peak_flops)

    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device=device, dtype=torch.bfloat16)
    optimizer = build_optimizer(model, cfg.optim, master_weights=True)
    params = [p for p in model.parameters() if p.requires_grad]
    flops_per_token = model.flops_per_token(T)

    def step():
        forward_backward(model, params, [(x, y)], cfg.trainer.grad_clip, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    print(f"{model_cfg.name}: {model.num_params() / 1e6:.1f}M parameters, B{B} x T{T} bf16, "
          f"{flops_per_token * B * T / 1e12:.2f} TFLOP per step", flush=True)
    sec, mem = _time_steps(step, args.steps, args.warmup)
    ours_ms, other_ms = kernel_times(step)
    total = sum(ours_ms.values()) + sum(other_ms.values())
    row = {"model": model_cfg.name, "batch": B, "seq_len": T, "tokens_per_s": round(B * T / sec),
           "mfu": round(flops_per_token * B * T / sec / peak, 4), "peak_mem_gb": round(mem, 2),
           "step_ms": round(sec * 1e3, 2), "triton_share": round(sum(ours_ms.values()) / total, 4) if total else None,
           "other_kernels_ms": {k: round(v, 3) for k, v in sorted(other_ms.items(), key=lambda kv: -kv[1])}}
    print(f"tritonllm: {row['tokens_per_s']:,} tokens/s, MFU {row['mfu']:.1%}, peak {mem:.2f} GB, "
          f"triton_share {row['triton_share']}", flush=True)
    for name, ms in row["other_kernels_ms"].items():
        print(f"  non-tritonllm kernel {ms:8.3f} ms  {name}")
    weights = {k: v.float() for k, v in model.state_dict().items()}
    del model, optimizer, params
    gc.collect()
    torch.cuda.empty_cache()

    if not args.no_baseline:
        from tritonllm.bench.harness import compiled
        from tritonllm.bench.reference_model import ReferenceTransformer

        ref = ReferenceTransformer(model_cfg, sdpa=True).to(device)
        ref.load_state_dict(weights)
        del weights
        ref_step_fn = compiled(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=float(cfg.optim.lr), betas=tuple(cfg.optim.betas),
                                    eps=float(cfg.optim.eps), weight_decay=float(cfg.optim.weight_decay), fused=True)
        clip = cfg.trainer.grad_clip

        def ref_step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ref_step_fn(x, y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), float(clip), foreach=True)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

        ref_sec, ref_mem = _time_steps(ref_step, args.steps, args.warmup)
        row.update(baseline_compile_tokens_per_s=round(B * T / ref_sec), baseline_peak_mem_gb=round(ref_mem, 2),
                   baseline_mfu=round(flops_per_token * B * T / ref_sec / peak, 4), speedup=round(ref_sec / sec, 3))
        print(f"PyTorch + torch.compile: {row['baseline_compile_tokens_per_s']:,} tokens/s, "
              f"MFU {row['baseline_mfu']:.1%}, peak {ref_mem:.2f} GB; speedup {row['speedup']:.2f}x", flush=True)
    path = write_results("train", [row], args.out)
    print(f"wrote {path}")
