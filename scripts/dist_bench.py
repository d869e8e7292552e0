"""Multi-GPU training throughput, run under torchrun: tritonllm (DDP or FSDP2 through
tritonllm.train.parallel and TrainStep) or the plain-PyTorch baseline (tritonllm.bench.baseline_model,
torch.compile per block, FSDP2 or DDP, fused AdamW) on random tokens.

    torchrun --nproc_per_node=2 scripts/dist_bench.py --model void1b --side tritonllm --parallel ddp --out $OUT

Each rank runs ``--warmup`` untimed steps (compilation, autotuning, tritonllm's graph capture after 11
DDP steps), then ``--steps`` timed steps between two device synchronisations; rank 0 appends one JSON
row to ``<out>/dist-<model>.jsonl``: global and per-GPU tokens/s, MFU per GPU, step ms, peak memory
per GPU (rank 0), whether the step was graphed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def build_tritonllm(cfg, mode, env, args):
    from omegaconf import OmegaConf

    from tritonllm.models import build_model
    from tritonllm.train.loop import build_optimizer
    from tritonllm.train.parallel import parallelize
    from tritonllm.train.step import TrainStep

    torch.manual_seed(0)
    model = build_model(cfg, device=env.device, dtype=torch.float32 if mode == "fsdp" else torch.bfloat16)
    par = parallelize(model, mode, env, compute_dtype=torch.bfloat16)
    optim_cfg = OmegaConf.create({"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1})
    optimizer = build_optimizer(model, optim_cfg, master_weights=True)
    step = TrainStep(model, optimizer, grad_clip=1.0, grad_accum=1, cuda_graph=True, parallel=par)
    return (lambda x, y: step([(x, y)], 3e-4)), model.flops_per_token(args.seq_len), lambda: step.graphed


def build_baseline(cfg, mode, env, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tritonllm.bench.baseline_model import BaselineTransformer
    from tritonllm.models import build_model

    torch.manual_seed(0)
    with torch.device(env.device):
        model = BaselineTransformer(cfg)
    flops = build_model(cfg, device="meta").flops_per_token(args.seq_len)
    for block in model.blocks:  # compile per block (in place), then shard: torchtitan's order
        block.compile()
    if mode == "fsdp":
        mesh = init_device_mesh("cuda", (env.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i, block in enumerate(model.blocks):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.blocks) - 1)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        wrapped, autocast = model, False
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped, autocast = DDP(model, device_ids=[env.device.index], gradient_as_bucket_view=True), True
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = wrapped(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, flops, lambda: False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="void1b")
    p.add_argument("--side", choices=("tritonllm", "baseline"), default="tritonllm")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=14)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak-flops", type=float, default=989e12)
    p.add_argument("--out", default=".")
    args = p.parse_args()

    from importlib.resources import files

    from omegaconf import OmegaConf

    from tritonllm.models.config import ModelConfig
    from tritonllm.train.parallel import init_distributed, shutdown

    env = init_distributed("cuda")
    raw = OmegaConf.to_container(OmegaConf.load(str(files("tritonllm.conf") / "model" / f"{args.model}.yaml")))
    cfg = ModelConfig.from_dict(raw)
    build = build_tritonllm if args.side == "tritonllm" else build_baseline
    step, flops_per_token, graphed = build(cfg, args.parallel, env, args)
    g = torch.Generator().manual_seed(1 + env.rank)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).to(env.device)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).to(env.device)
    torch.cuda.reset_peak_memory_stats(env.device)
    for _ in range(args.warmup):
        step(x, y)
    torch.cuda.synchronize(env.device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(x, y)
    torch.cuda.synchronize(env.device)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    tokens = args.batch * args.seq_len * args.steps * env.world_size
    if env.main:
        tok_s = tokens / elapsed
        row = {"model": args.model, "side": args.side, "parallel": args.parallel, "nproc": env.world_size,
               "batch_per_gpu": args.batch, "seq_len": args.seq_len, "tokens_per_s": tok_s,
               "tokens_per_s_per_gpu": tok_s / env.world_size, "step_ms": 1e3 * elapsed / args.steps,
               "mfu_per_gpu": flops_per_token * tok_s / env.world_size / args.peak_flops,
               "peak_mem_gb": torch.cuda.max_memory_allocated(env.device) / 1e9, "cuda_graph": graphed(),
               "gpu": torch.cuda.get_device_name(env.device), "torch": torch.__version__}
        print(json.dumps(row), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"dist-{args.model}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    shutdown(env)


if __name__ == "__main__":
    main()
