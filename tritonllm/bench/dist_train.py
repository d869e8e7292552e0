"""``python -m tritonllm.bench train --nproc N[,N2,...] +model=void1b [overrides] [--parallel ddp,fsdp] [--steps 20 --warmup 14]``

Training throughput on N GPUs of one host (several counts in one command: the scaling curve):
tritonllm's DDP and FSDP2 (``tritonllm.train.parallel``, the step of
:class:`tritonllm.train.step.TrainStep`) against the plain-PyTorch baseline parallelised the same way,
each measured against one GPU, in one command. The config is composed like
``python -m tritonllm.train``'s; ``trainer.batch_size`` (default 4) and ``trainer.seq_len`` (default
2048) are per GPU.

:func:`launch` (what ``--nproc`` runs) starts ``torchrun --standalone --nproc_per_node=n -m
tritonllm.bench.dist_train`` once per configuration, one after the other (each with the GPUs to
itself; ``--timeout`` seconds at most; the one-GPU runs first, then per GPU count ours and the
baseline's; the rows are rewritten after each configuration, so that a run cut short keeps what it
measured):

- tritonllm on one GPU (``parallel=none``: the single-device step, captured in a CUDA graph), the
  reference of the scaling efficiency;
- tritonllm on each N of ``--nproc`` with each ``--parallel`` mode: ``ddp`` (the step captured in a
  CUDA graph after 11 eager DDP steps) and ``fsdp`` (FSDP2, eager);
- unless ``--no-baseline``, the baseline (:class:`tritonllm.bench.baseline_model.BaselineTransformer`,
  fp32 weights, bf16 compute, ``torch.optim.AdamW(fused=True)``, ``clip_grad_norm_(foreach=True)``)
  parallelised as torchtitan does: each block compiled (``torch.compile``, mode ``--compile-mode``),
  then ``fully_shard`` per block and on the root with ``MixedPrecisionPolicy(bf16, reduce fp32)``
  (FSDP2), or DDP under ``torch.autocast`` (DDP), on one GPU (compiled blocks, autocast) and on each N.

``--no-one-gpu`` leaves out the one-GPU runs, for a model whose weights and optimizer state do not fit
one GPU (the rows then have no scaling efficiency).

``--rounds R`` (default 1) runs each GPU count's configurations R times, round after round, every
other round in the reverse order (ours first, then the baseline first: A B B A), so that a drift of the
machine over the call (seen on lent 4-H100 machines: the later of two runs 3-20% faster, whatever it
ran) falls on both sides alike. A row then holds the run with the median step time (its figures),
``step_ms_rounds`` (every round's step time, ``None`` where one failed), and ``speedup`` is the
geometric mean over the rounds of the baseline's step time over ours in the same round
(``speedup_rounds``): with an even R a drift by a constant factor per run cancels. The one-GPU
references (CUDA-graphed, steadier) run once.

``--ab NAME=VALUE`` adds a third side to every parallel configuration: tritonllm again with the
environment variable NAME set to VALUE (a knob read from the environment, e.g.
``TRITONLLM_GEMM_SM_MARGIN=8``), in the same rounds (A B C, then C B A). The row's figures stay the
default's; ``ab`` holds the variant's (the median run, ``step_ms_rounds``) and ``gain``, the geometric
mean over the rounds of our default's step time over the variant's in the same round (> 1: the
variant is faster; ``gain_rounds``).

Each rank feeds its own random tokens; after ``--warmup`` untimed steps, ``--steps`` steps are timed
between two synchronisations of every rank (``cuda.synchronize`` and a barrier). Figures per
configuration (rank 0 reports): ``tokens_per_s`` (all ranks), ``tokens_per_s_per_gpu``, ``mfu`` per
GPU (``6 N_active + 12 L H D T`` FLOPs per token at ``trainer.peak_flops``), ``step_ms``, ``host_ms``
(the mean host time of one step call over the timed steps, the slowest rank's: near ``step_ms`` the
host or a synchronisation inside the step sets the pace, not the GPU),
``peak_mem_gb`` (the largest over the ranks), from 3 profiled steps on rank 0 ``gpu_ms`` (compute
kernels) and ``comm_ms`` (NCCL kernels, which overlap the compute), ``gpu_busy_ms`` (the time any kernel
runs, compute and NCCL overlapping counted once), ``top_kernels`` (the 15 longest
kernels, ms a step), ``cuda_graph``, and tritonllm's ``triton_share``. The profiled steps follow the
timed ones, except for tritonllm's DDP step: its CUDA graph (NCCL inside) hung under the profiler, so
3 eager steps after the first are profiled (extra warm-up steps, before the capture).

Rows go to ``<out>/train-<gpu>.json`` (the bench row format, docs/architecture.md), one per tritonllm configuration on
several GPUs: ``nproc``, ``parallel``, the figures, ``scaling_efficiency`` = per-GPU tokens/s over the
one-GPU run's (``one_gpu`` holds that run's figures), ``baselines`` (the baseline parallelised alike,
with its own scaling efficiency) and ``speedup`` (the baseline's step_ms / ours). They replace rows
of the same model, batch, sequence length, ``nproc`` and ``parallel``; the one-GPU rows of
``python -m tritonllm.bench train`` (``nproc`` 1) are left as they are, and so is the file's header
(each row carries its own ``commit``, ``date``, ``torch`` and ``host_cpu``). A configuration that
fails (out of memory, the timeout) is recorded with its error.

``--device cpu`` runs the same on CPU processes with gloo (fp32, tritonllm through the Triton
interpreter; ``--compile-mode none`` leaves the baseline eager): a smoke test of the launch, not a
measurement (``train-cpu.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

#: --compile-mode -> torch.compile mode of the baseline's blocks (none: eager)
COMPILE_MODES = {"default": None, "max-autotune": "max-autotune-no-cudagraphs", "none": None}
PARALLEL = ("ddp", "fsdp")
#: the figures of a configuration copied into the rows
FIGURES = ("tokens_per_s", "tokens_per_s_per_gpu", "mfu", "step_ms", "host_ms", "peak_mem_gb", "gpu_ms", "comm_ms",
           "gpu_busy_ms", "cuda_graph", "triton_share", "gemm_grid", "loss", "top_kernels")
#: kernels (ms a step on rank 0, the longest first) kept per configuration: where a parallel step's GPU
#: time goes beside the one-GPU step's (``one_gpu`` keeps them too)
TOP_KERNELS = 15
BASELINE_FIGURES = tuple(k for k in FIGURES if k not in ("triton_share", "gemm_grid"))
#: the one-GPU reference's figures copied into each row
ONE_GPU_FIGURES = ("tokens_per_s", "step_ms", "gpu_ms", "peak_mem_gb", "cuda_graph", "top_kernels", "error")
NOT_RUN = {"error": "not run"}
ONE_GPU_SKIPPED = {"error": "not run (--no-one-gpu)"}


# --- one configuration, on every rank (under torchrun) -------------------------------------------

def _tritonllm_step(model_cfg, cfg, mode, env, dtype):
    """tritonllm's step on this rank: (step(x, y) -> loss tensor, whether the graph was captured, release:
    drop the graph before the process group goes, see :meth:`TrainStep.release`)."""
    from tritonllm.models import build_model
    from tritonllm.train.loop import build_optimizer
    from tritonllm.train.parallel import parallelize
    from tritonllm.train.step import TrainStep

    model = build_model(model_cfg, device=env.device, dtype=torch.float32 if mode == "fsdp" else dtype)
    par = parallelize(model, mode, env, compute_dtype=dtype)
    optimizer = build_optimizer(model, cfg.optim, master_weights=dtype != torch.float32)
    step = TrainStep(model, optimizer, grad_clip=cfg.trainer.grad_clip, grad_accum=1,
                     cuda_graph=env.device.type == "cuda", parallel=par if env.distributed else None)
    lr = float(cfg.optim.lr)
    return (lambda x, y: step([(x, y)], lr).loss), lambda: step.graphed, step.release


def _baseline_step(model_cfg, cfg, mode, env, dtype, compile_mode):
    """The plain-PyTorch baseline's step on this rank (see the module docstring)."""
    from tritonllm.bench.baseline_model import BaselineTransformer, default_expert_impl
    from tritonllm.bench.train import baseline_optimizer, baseline_update

    experts = default_expert_impl(env.device) if model_cfg.n_experts else None
    with torch.device(env.device):
        model = BaselineTransformer(model_cfg, experts=experts)
    if compile_mode != "none":
        for block in model.blocks:  # compiled per block, then parallelised: torchtitan's order
            block.compile(mode=COMPILE_MODES[compile_mode])
    autocast = dtype != torch.float32
    wrapped = model
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(env.device.type, (env.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
        for i, block in enumerate(model.blocks):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.blocks) - 1)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        autocast = False  # FSDP2 gathers the weights in bf16
    elif mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [env.device.index] if env.device.type == "cuda" else None
        wrapped = DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    optimizer = baseline_optimizer(model, cfg)
    params = list(model.parameters())
    clip = cfg.trainer.grad_clip

    def step(x, y):
        with torch.autocast(env.device.type, dtype=dtype, enabled=autocast):
            loss = wrapped(x, y)
        baseline_update(loss, params, optimizer, clip)
        return loss.detach()

    return step, lambda: False, lambda: None


def run_worker(argv: list[str]) -> None:
    """One configuration on this rank (torchrun's environment); rank 0 writes its figures to ``--result``."""
    p = argparse.ArgumentParser(prog="python -m tritonllm.bench.dist_train")
    p.add_argument("--side", choices=("tritonllm", "baseline"), required=True)
    p.add_argument("--parallel", choices=("none", *PARALLEL), required=True)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=14)
    p.add_argument("--compile-mode", choices=tuple(COMPILE_MODES), default="default")
    p.add_argument("--result", required=True)
    args, overrides = p.parse_known_args(argv)

    import torch.distributed as dist

    from tritonllm.bench.train import kernel_times, wall_ms
    from tritonllm.runtime import compose_config
    from tritonllm.train import model_config
    from tritonllm.train.parallel import init_distributed, shutdown

    begin = time.monotonic()
    env = init_distributed(args.device)
    cuda = env.device.type == "cuda"

    # tritonllm's log lines (the CUDA-graph capture, a fallback) into the --log file: rank 0's, and every
    # rank's warnings
    logging.basicConfig(level=logging.INFO if env.main else logging.WARNING,
                        format=f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s")

    def note(what: str) -> None:  # where a configuration's time goes, in the --log file
        if env.main:
            print(f"[rank 0, {time.monotonic() - begin:7.1f} s] {what}", flush=True)
    note(f"process group of {env.world_size} up")
    cfg = compose_config("train", ["trainer.batch_size=4", "trainer.seq_len=2048", *overrides])
    model_cfg = model_config(cfg)
    B, T = cfg.trainer.batch_size, cfg.trainer.seq_len
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(cfg.seed)
    if args.side == "tritonllm":
        step, graphed, release = _tritonllm_step(model_cfg, cfg, args.parallel, env, dtype)
    else:
        step, graphed, release = _baseline_step(model_cfg, cfg, args.parallel, env, dtype, args.compile_mode)
    gen = torch.Generator().manual_seed(cfg.seed + env.rank)
    tokens = torch.randint(0, model_cfg.vocab_size, (B, T + 1), generator=gen).to(env.device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def sync():
        if cuda:
            torch.cuda.synchronize(env.device)
        if env.distributed:
            dist.barrier()

    if cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
    last = {}

    host: list[float] = []  # the timed steps' host time per call, on this rank

    def timed():
        t0 = time.perf_counter()
        last["loss"] = step(x, y)
        host.append(time.perf_counter() - t0)

    # A DDP step captured in a CUDA graph (the NCCL all-reduces inside it) hung under the profiler on
    # 4 H200s; its kernels are profiled on eager steps before the capture instead (the same kernels),
    # run in addition to the warm-up. Every other step is profiled after the timing.
    profile_early = cuda and args.side == "tritonllm" and args.parallel == "ddp"
    kernels = None
    note("model and step built")
    for i in range(args.warmup):
        timed()
        if i == 0:
            sync()
            note("first step done (compilation, autotuning)")
            if profile_early:
                kernels = kernel_times(timed)  # on every rank: the collectives need them all
                note("profiled before the CUDA-graph capture")
    sync()
    note(f"{args.warmup} warm-up steps done")
    host.clear()
    ms = wall_ms(timed, args.steps, sync)
    # the slowest rank's mean host time of a step call: near step_ms, the host (or a synchronisation
    # inside the step) sets the pace, not the GPU
    host_ms = torch.tensor(sum(host) / len(host) * 1e3, dtype=torch.float64, device=env.device)
    if env.distributed:
        dist.all_reduce(host_ms, op=dist.ReduceOp.MAX)
    note(f"{args.steps} steps timed: {ms:.2f} ms a step, {float(host_ms):.2f} ms of it on the host")
    figures = {"step_ms": round(ms, 3), "host_ms": round(float(host_ms), 3), "loss": round(float(last["loss"]), 4),
               "cuda_graph": graphed()}
    if cuda:
        peak = torch.tensor(torch.cuda.max_memory_allocated(env.device) / 1e9, device=env.device)
        if env.distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        ours, others, busy = kernels or kernel_times(timed)  # on every rank: the collectives need them all
        note("profiled")
        comm = sum(v for k, v in others.items() if "nccl" in k.lower())
        compute = sum(ours.values()) + sum(others.values()) - comm
        top = sorted({**ours, **others}.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
        figures.update(peak_mem_gb=round(float(peak), 2), gpu_ms=round(compute, 3), comm_ms=round(comm, 3),
                       gpu_busy_ms=round(busy, 3),
                       top_kernels={name[:100]: round(ms, 3) for name, ms in top})
        if args.side == "tritonllm" and compute:
            from tritonllm.kernels import gemm

            figures["triton_share"] = round(sum(ours.values()) / compute, 4)
            figures["gemm_grid"] = "dynamic" if gemm.DYNAMIC else "persistent" if gemm.PERSISTENT else "tile"
            if gemm.SM_MARGIN:
                figures["gemm_grid"] += f", {gemm.SM_MARGIN} SMs left to NCCL"
    if env.main:
        from tritonllm.models import build_model

        tok_s = B * T * env.world_size / (ms / 1e3)
        flops = build_model(model_cfg, device="meta").flops_per_token(T)
        figures.update(tokens_per_s=round(tok_s), tokens_per_s_per_gpu=round(tok_s / env.world_size),
                       mfu=round(flops * tok_s / env.world_size / float(cfg.trainer.peak_flops), 4),
                       model=model_cfg.name, batch=B, seq_len=T, nproc=env.world_size,
                       device=torch.cuda.get_device_name(env.device) if cuda else "cpu", torch=torch.__version__)
        if cuda:
            from tritonllm.bench.harness import gpu_slug

            figures["slug"] = gpu_slug()
        with open(args.result, "w") as f:
            json.dump(figures, f)
    release()
    shutdown(env)


# --- the launcher --------------------------------------------------------------------------------

def _parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m tritonllm.bench train --nproc N",
                                description="Hydra overrides as for python -m tritonllm.train, plus:")
    p.add_argument("--nproc", required=True,
                   help="GPUs (processes) of the parallel runs, >= 2; comma-separated for several (2,4,8)")
    p.add_argument("--no-one-gpu", action="store_true",
                   help="leave out the one-GPU runs (a model too large for one GPU): no scaling efficiency")
    p.add_argument("--parallel", default=",".join(PARALLEL), help="comma-separated modes of: ddp, fsdp")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=14,
                   help="untimed steps first (compilation, autotuning; DDP's graph is captured after 11)")
    p.add_argument("--no-baseline", action="store_true", help="time tritonllm only")
    p.add_argument("--ab", metavar="NAME=VALUE",
                   help="also time tritonllm with this environment variable set, interleaved in the rounds")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each parallel configuration, rounds in alternating order (A B B A; even: drift cancels)")
    p.add_argument("--compile-mode", choices=tuple(COMPILE_MODES), default="default",
                   help="torch.compile mode of the baseline's blocks (none: eager)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: gloo processes, a smoke test")
    p.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    p.add_argument("--out", default="docs/perf", help="folder for train-<gpu>.json")
    p.add_argument("--log", help="file the configurations' output is appended to (default: discarded after the run)")
    args, overrides = p.parse_known_args(argv)
    try:
        args.nproc = sorted({int(n) for n in args.nproc.split(",") if n.strip()})
    except ValueError:
        p.error(f"--nproc: comma-separated GPU counts, got {args.nproc!r}")
    if not args.nproc or args.nproc[0] < 2:
        p.error(f"--nproc must be >= 2 (the one-GPU run is measured too), got {args.nproc}")
    args.parallel = [m for m in args.parallel.split(",") if m]
    if not args.parallel or any(m not in PARALLEL for m in args.parallel):
        p.error(f"--parallel: comma-separated modes of {', '.join(PARALLEL)}, got {','.join(args.parallel)!r}")
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.ab is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", args.ab):
        p.error(f"--ab: an environment variable and its value, NAME=VALUE, got {args.ab!r}")
    return args, overrides


def _variant(ab: str) -> str:
    """The side name of tritonllm run with the ``--ab`` setting."""
    return f"tritonllm[{ab}]"


def _descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (Linux ``/proc``): torchrun starts its workers in sessions of
    their own, out of reach of a signal to torchrun's process group."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill(proc: subprocess.Popen) -> None:
    """End torchrun and its workers (they hold the GPUs) and reap torchrun."""
    for pid in (*_descendants(proc.pid), proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _run(side: str, mode: str, n: int, args, overrides: list[str], folder: str) -> dict:
    """One configuration under torchrun; its figures, or ``{"error": ...}``. Its output is appended to
    ``--log`` (else a file in ``folder``), headed by the configuration and followed by its wall time.
    ``side`` is ``tritonllm``, ``baseline`` or :func:`_variant` (tritonllm with ``--ab`` set)."""
    env = dict(os.environ)
    if side.startswith("tritonllm["):
        name, value = side[len("tritonllm["):-1].split("=", 1)
        env[name] = value
    safe = re.sub(r"[^A-Za-z0-9_.-]", "-", side)
    result = os.path.join(folder, f"{safe}-{mode}-{n}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "tritonllm.bench.dist_train", "--side", side.split("[")[0], "--parallel", mode, "--device", args.device,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--compile-mode", args.compile_mode,
           "--result", result, *overrides]
    print(f"-- {side} parallel={mode} x{n}", flush=True)
    log_path = args.log or os.path.join(folder, f"{safe}-{mode}-{n}.log")
    start = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"==== {side} parallel={mode} x{n}: {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        error: str | None
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            error = f"timed out after {args.timeout:.0f} s"
        except BaseException:  # interrupted, or SIGTERM (launch turns it into SystemExit): no orphaned workers
            _kill(proc)
            raise
        else:
            error = None if proc.returncode == 0 and os.path.isfile(result) else f"exit status {proc.returncode}"
        wall = round(time.monotonic() - start, 1)
        log.write(f"==== {error or 'done'} after {wall} s\n")
    print(f"   {error}" if error and error.startswith("timed out") else f"   {error or 'done'} after {wall} s", flush=True)
    if error:
        with open(log_path) as f:
            tail = f.read().strip().splitlines()[-13:-1]
        if not error.startswith("timed out"):
            print("\n".join(f"   {line}" for line in tail), flush=True)
            lines = [line for line in tail if "Error" in line or "error" in line]
            error = lines[-1][:300] if lines else error
        return {"error": error}
    with open(result) as f:
        figures = json.load(f)
    figures["wall_s"] = wall
    return figures


def _line(name: str, f: dict, eff) -> str:
    if "error" in f:
        return f"{name:<25} failed: {f['error']}"
    mem = "-" if f.get("peak_mem_gb") is None else f"{f['peak_mem_gb']:.2f}"
    comm = "-" if f.get("comm_ms") is None else f"{f['comm_ms']:.2f}"
    host = "-" if f.get("host_ms") is None else f"{f['host_ms']:.2f}"
    return (f"{name:<25} {f['tokens_per_s']:>11,}{f['tokens_per_s_per_gpu']:>12,}{f['mfu']:>8.1%}{f['step_ms']:>10.2f}"
            f"{host:>9}{comm:>9}{mem:>9}{'-' if eff is None else f'{eff:.3f}':>8}")


def _efficiency(f: dict, one: dict):
    """Per-GPU tokens/s over one GPU's: with the same batch per GPU, the one-GPU step time over this one."""
    if "error" in f or "error" in one:
        return None
    return round(one["step_ms"] / f["step_ms"], 4)


def write_rows(path: str, rows: list[dict], header: dict) -> None:
    """Merge ``rows`` into the results file ``path``: rows of the same :func:`harness.row_key` (model, batch,
    seq_len, nproc, parallel) are replaced; the header is written only when the file is new."""
    from tritonllm.bench.harness import row_key

    doc = {**header, "results": []}
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
    new = {row_key(r) for r in rows}
    doc["results"] = [r for r in doc.get("results", []) if row_key(r) not in new] + rows
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _median_run(runs: list[dict]) -> dict:
    """A configuration's figures over its rounds: the run with the median step time (the lower of the
    two middle ones), with ``step_ms_rounds`` when there were several; the last error if all failed."""
    ok = sorted((f for f in runs if "error" not in f), key=lambda f: f["step_ms"])
    if not ok:
        return runs[-1]
    if len(runs) == 1:
        return ok[0]
    return {**ok[(len(ok) - 1) // 2], "step_ms_rounds": [f.get("step_ms") for f in runs]}


def _paired_speedup(ours: list[dict], base: list[dict]) -> tuple[float | None, list]:
    """The geometric mean over the rounds of the baseline's step time over ours in the same round, and
    each round's ratio (``None`` where either side failed). With the rounds' alternating order, a drift
    by a constant factor per run errs the other way in every other round: an even number of rounds
    cancels it."""
    ratios = [None if "error" in o or "error" in b else b["step_ms"] / o["step_ms"] for o, b in zip(ours, base)]
    done = [r for r in ratios if r is not None]
    return (round(statistics.geometric_mean(done), 3) if done else None), [
        None if r is None else round(r, 3) for r in ratios]


def _rows(runs: dict, args, stamp: dict) -> list[dict]:
    """The rows of the GPU counts and modes measured so far (a side not run yet: ``error: not run``);
    ``runs`` maps each configuration to its runs, one per round."""
    figures = {key: _median_run(r) for key, r in runs.items()}
    get = lambda *key: figures.get(key, ONE_GPU_SKIPPED if args.no_one_gpu and key[2] == 1 else NOT_RUN)  # noqa: E731
    pick = lambda f, keys: {k: f[k] for k in keys if k in f}  # noqa: E731
    one = get("tritonllm", "none", 1)
    done = next(f for f in figures.values() if "error" not in f)
    rows = []
    for n, mode in ((n, mode) for n in args.nproc for mode in args.parallel):
        if ("tritonllm", mode, n) not in figures and ("baseline", mode, n) not in figures:
            continue  # not reached yet: a row recorded earlier stays
        ours = get("tritonllm", mode, n)
        row = {"model": done["model"], "batch": done["batch"], "seq_len": done["seq_len"], "nproc": n,
               "parallel": mode, **pick(ours, (*FIGURES, "step_ms_rounds", "error")),
               "scaling_efficiency": _efficiency(ours, one),
               "one_gpu": pick(one, ONE_GPU_FIGURES), "baselines": {}, "speedup": None, **stamp}
        if not args.no_baseline:
            base = get("baseline", mode, n)
            name = f"{'FSDP2' if mode == 'fsdp' else 'DDP'} + " + (
                "eager" if args.compile_mode == "none" else "torch.compile")
            row["baselines"][name] = {**pick(base, (*BASELINE_FIGURES, "step_ms_rounds", "error")),
                                      "compile_mode": args.compile_mode,
                                      "scaling_efficiency": _efficiency(base, get("baseline", "none", 1))}
            row["speedup"], ratios = _paired_speedup(runs.get(("tritonllm", mode, n), []),
                                                     runs.get(("baseline", mode, n), []))
            if args.rounds > 1:
                row["speedup_rounds"] = ratios
        if args.ab is not None and (_variant(args.ab), mode, n) in runs:
            variant = runs[_variant(args.ab), mode, n]
            gain, gains = _paired_speedup(variant, runs.get(("tritonllm", mode, n), []))
            row["ab"] = {"env": args.ab, **pick(_median_run(variant), (*FIGURES, "step_ms_rounds", "error")),
                         "gain": gain, "gain_rounds": gains}
        rows.append(row)
    return rows


def launch(argv: list[str]) -> list[dict]:
    """The ``--nproc`` benchmark (module docstring); returns the rows written. The rows are rewritten
    after every configuration, so that a run cut short keeps what it measured."""
    from tritonllm.bench.harness import git_commit
    from tritonllm.bench.train import host_cpu_model

    args, overrides = _parse(argv)
    if args.device == "auto" and not torch.cuda.is_available():
        sys.exit("python -m tritonllm.bench train --nproc needs CUDA GPUs (--device cpu: a gloo smoke test)")
    if args.device == "auto" and args.nproc[-1] > torch.cuda.device_count():
        sys.exit(f"python -m tritonllm.bench train: --nproc {args.nproc[-1]} asks for more GPUs than the "
                 f"{torch.cuda.device_count()} this host has")
    host_cpu = host_cpu_model()
    print(f"host CPU: {host_cpu}", flush=True)
    # the one-GPU references first (every scaling efficiency needs them), then per GPU count its rounds,
    # ours and the baseline's, every other round in the reverse order: the most wanted figures before a cut
    sides = ("tritonllm",) if args.no_baseline else ("tritonllm", "baseline")
    configs = [] if args.no_one_gpu else [(side, "none", 1) for side in sides]
    sides = (sides[0], *([] if args.ab is None else [_variant(args.ab)]), *sides[1:])
    for n in args.nproc:
        one_round = [(side, m, n) for side in sides for m in args.parallel]
        configs += [c for r in range(args.rounds) for c in (one_round[::-1] if r % 2 else one_round)]
    runs: dict[tuple, list[dict]] = {}
    path = None
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # ends the torchrun too
    try:
        with tempfile.TemporaryDirectory() as folder:
            for side, mode, k in configs:
                runs.setdefault((side, mode, k), []).append(_run(side, mode, k, args, overrides, folder))
                done = [f for r in runs.values() for f in r if "error" not in f]
                if not done:
                    continue
                stamp = {"commit": git_commit(), "date": datetime.date.today().isoformat(), "torch": done[0]["torch"],
                         "host_cpu": host_cpu}
                path = os.path.join(args.out, f"train-{next((f['slug'] for f in done if 'slug' in f), 'cpu')}.json")
                rows = _rows(runs, args, stamp)
                write_rows(path, rows, {"gpu": done[0]["device"], "host_cpu": host_cpu,
                                        "method": "python -m tritonllm.bench train (--nproc: tritonllm/bench/dist_train.py)"})
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"{'configuration':<26}{'tokens/s':>11}{'per GPU':>12}{'MFU':>8}{'step ms':>10}{'host ms':>9}{'comm ms':>9}"
          f"{'peak GB':>9}{'scaling':>8}")
    figures = {key: _median_run(r) for key, r in runs.items()}
    for (side, mode, k), f in figures.items():
        eff = None if k == 1 else _efficiency(f, figures.get((side.split("[")[0], "none", 1), ONE_GPU_SKIPPED))
        rounds = f.get("step_ms_rounds")
        print(_line(f"{side} {mode} x{k}", f, eff)
              + ("" if rounds is None else "  rounds: " + " / ".join("-" if ms is None else f"{ms:.2f}" for ms in rounds)))
    if path is None:
        sys.exit("tritonllm: error: every configuration failed")
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    from tritonllm.runtime import exit_on_user_error

    exit_on_user_error(run_worker)(sys.argv[1:])
