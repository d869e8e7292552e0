"""``python -m tritonllm.bench train +model=void125m [hydra overrides] [--steps 20 --warmup 5 --out docs/perf]``
``python -m tritonllm.bench train --nproc 2 +model=void1b [--parallel ddp,fsdp]``: DDP and FSDP2 on
several GPUs against one, beside the baseline parallelised alike (:mod:`tritonllm.bench.dist_train`).

Training throughput of tritonllm against a strong plain-PyTorch baseline, in one process run, on
random tokens (the data does not change the speed). The config is composed like
``python -m tritonllm.train``'s; the batch defaults to B16 x T1024 (``trainer.batch_size`` /
``trainer.seq_len`` override it).

Sides, each timed alone (GPU memory freed between them):

- **tritonllm**: the model in bf16 with fp32 master weights in ``tritonllm.optim.AdamW``, one
  optimizer step = :class:`tritonllm.train.step.TrainStep` (forward, backward, clipping to
  ``trainer.grad_clip``, AdamW, gradients zeroed) with ``cuda_graph=True``: the whole step
  captured once after the warm-up and replayed (the row's headline figures; ``cuda_graph`` in the
  row says whether the capture held), and with ``cuda_graph=False`` (the ``eager`` entry). With
  ``--compiled``, both again with the model under ``torch.compile(fullgraph=True)`` (default mode:
  inductor around the ``torch.ops.tritonllm`` ops), the ``compiled`` entry: what a user who compiles a
  model made of tritonllm's kernels gets, against the same model eager.
- **baselines**: :class:`tritonllm.bench.baseline_model.BaselineTransformer` (the same architecture
  written for speed: F.rms_norm, SDPA on contiguous ``[B, H, T, D]``, RoPE tables built once,
  fused cross-entropy; MoE experts through ``torch._grouped_mm``) loaded with tritonllm's initial
  weights, fp32 parameters under ``torch.autocast("cuda", torch.bfloat16)``; the module (forward +
  loss) under ``torch.compile`` in each ``--baselines`` mode: ``compile`` (default mode),
  ``max-autotune`` (``mode="max-autotune-no-cudagraphs"``), ``reduce-overhead`` (CUDA graphs);
  then ``loss.backward()``, ``clip_grad_norm_(foreach=True)``, ``torch.optim.AdamW(fused=True)``
  with tritonllm's hyper-parameters and parameter groups, ``zero_grad(set_to_none=True)``.
  ``speedup`` = the fastest baseline's ``step_ms`` / tritonllm's graphed ``step_ms``.
  max-autotune's compilation benchmarks about 20 Triton configs per GEMM shape (13-26 s per shape
  on an H200 for void125m): it takes minutes, which is why it is timed last.

Per side, after ``--warmup`` untimed steps (>= 3, so that tritonllm's graph is captured):

- ``first_step_s``: the first warm-up step, synchronised: compilation (torch.compile sides),
  first-use autotuning of kernels at new shapes, and everything else a first call pays.

- ``step_ms`` (wall): ``--steps`` steps issued back to back, host clock from before the first call
  to after a ``torch.cuda.synchronize()`` behind the last, divided by the steps.
  ``tokens_per_s = B T / step``; ``mfu = flops_per_token * tokens_per_s / trainer.peak_flops``
  with tritonllm's ``flops_per_token = 6 N_active + 12 n_layers n_heads head_dim T`` for every side.
- ``host_ms`` (host enqueue): the mean, over ``--steps`` calls, of the host time of the step call
  alone (``time.perf_counter`` just before and just after it, nothing synchronised inside that
  window). Each call is issued behind a GPU spin kernel (``torch.cuda._sleep``) of four times the
  wall step plus 5 ms, so the GPU is busy for the whole call: a step that does not synchronise
  returns once its work is enqueued, never waiting for the GPU nor letting it drain. The device
  is synchronised between calls, outside the timed window, because steps issued back to back
  with no such gap fill the launch queue of a GPU-bound step within one or two steps, after which
  a call measures the GPU's pace instead of the host's. An event recorded behind the spin tells
  whether the spin was still running when the call returned; ``host_waited`` counts the calls for
  which it was not: such a call waited for the GPU (a synchronisation inside the step, as the MoE
  loop baseline's host-read expert sizes, or more launches than the launch queue holds), and the
  side's ``host_ms`` is then an upper bound of its enqueue time.
  ``host_ms`` close to ``step_ms`` and above ``gpu_ms``: the side is host-bound.
- ``gpu_ms`` (GPU kernel time): ``torch.profiler`` (CUDA activity only) over 3 more steps, the sum
  of every kernel's self device time, memset and memcpy excluded, per step; ``gpu_busy_ms`` the time
  during which at least one of them runs (kernels on two streams at once, as tritonllm's dW beside
  dx, count once there and twice in ``gpu_ms``).
- ``peak_mem_gb``: ``torch.cuda.max_memory_allocated()`` from before the warm-up (the previous
  side freed) to the end of the timed steps, in GB of 1e9 bytes. The warm-up is included because
  a CUDA graph's activations are allocated once, while it is captured (tritonllm's graph,
  reduce-overhead's CUDA graph trees), into a pool that its replays reuse without allocating.

tritonllm's graphed profile also gives ``triton_share``, the fraction of its GPU kernel time spent
in tritonllm's own Triton kernels, recognised by name (every ``@triton.jit`` kernel of
``tritonllm.kernels`` is ``_<name>_kernel``); the TOP_KERNELS of them that take the most GPU time a step
are listed (``kernels_ms``, each kernel's launches summed) and every other kernel (``other_kernels_ms``).
The host CPU's model (``lscpu``, else ``/proc/cpuinfo``) is printed and recorded, since the host
figures depend on it. The row goes to ``docs/perf/train-<gpu>.json`` (the bench row format, docs/architecture.md),
rewritten after every side so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

#: Triton and Gluon kernels of tritonllm.kernels: a bare `..._kernel` identifier (`_matmul_kernel`,
#: gemm_sm90's `ws_matmul_kernel`; a compiled name may carry a suffix), where CUDA libraries' kernels
#: show a signature (`void at::native::..._kernel<...>(...)`) and torch.compile's are `triton_...`
OUR_KERNEL = re.compile(r"^(?!triton_)\w*_kernel")
EXCLUDED = ("Memcpy", "Memset", "memcpy", "memset")
#: --baselines name -> torch.compile mode
#: (timed in this order: the slowest to compile last)
BASELINE_MODES = {"compile": None, "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune-no-cudagraphs"}
#: the JSON name of each baseline
BASELINE_NAMES = {"compile": "torch.compile", "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune"}
PROFILED_STEPS = 3
#: how many of tritonllm's kernels the row lists by GPU time a step (kernels_ms)
TOP_KERNELS = 20


# --- host CPU --------------------------------------------------------------------------------------

def parse_cpu_model(lscpu: str | None, cpuinfo: str | None) -> str:
    """The CPU model name from ``lscpu`` output ("Model name:" line), else from ``/proc/cpuinfo``
    ("model name" line); "unknown" when neither has one."""
    for text, pattern in ((lscpu, r"^\s*Model name:\s*(.+?)\s*$"), (cpuinfo, r"^\s*model name\s*:\s*(.+?)\s*$")):
        match = re.search(pattern, text or "", re.MULTILINE)
        if match and match.group(1) != "-":
            return match.group(1)
    return "unknown"


def host_cpu_model() -> str:
    """This machine's CPU model name and its logical CPU count, e.g. ``"AMD EPYC 9654 96-Core Processor (16 CPUs)"``."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                               env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = None
    return f"{parse_cpu_model(lscpu, cpuinfo)} ({os.cpu_count()} CPUs)"


# --- timing ----------------------------------------------------------------------------------------

def wall_ms(step: Callable[[], object], steps: int, sync: Callable[[], None],
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds per step of ``steps`` calls issued back to back, up to the ``sync()`` behind the last."""
    sync()
    t0 = clock()
    for _ in range(steps):
        step()
    sync()
    return (clock() - t0) / steps * 1e3


def interleaved_ratio(step_a: Callable[[], object], step_b: Callable[[], object], rounds: int, steps: int,
                      sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> dict:
    """B's step time over A's, robust to a host whose speed drifts over seconds: ``rounds`` rounds,
    each timing ``steps`` steps of A and of B back to back (:func:`wall_ms`; A first in even rounds,
    B first in odd ones), so that both sides of a round see the same host, after one untimed step of
    each. Returns the median and the range of the per-round ratios and the median ms per step of each side."""
    step_a()
    step_b()
    ratios: list[float] = []
    a_ms: list[float] = []
    b_ms: list[float] = []
    for r in range(rounds):
        order = ((a_ms, step_a), (b_ms, step_b)) if r % 2 == 0 else ((b_ms, step_b), (a_ms, step_a))
        for times, step in order:
            times.append(wall_ms(step, steps, sync, clock))
        ratios.append(b_ms[-1] / a_ms[-1])
    return {"ratio": round(statistics.median(ratios), 4), "min": round(min(ratios), 4), "max": round(max(ratios), 4),
            "a_ms": round(statistics.median(a_ms), 3), "b_ms": round(statistics.median(b_ms), 3), "rounds": rounds,
            "steps": steps}


def host_ms(step: Callable[[], object], steps: int, busy: Callable[[], Callable[[], bool]],
            sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> tuple[float, int]:
    """Mean host milliseconds of one ``step()`` call, and the number of calls that outlasted the busy work.

    Per call: ``sync()``, then ``busy()`` enqueues GPU work meant to outlast the call and returns a
    ``finished()`` query; the call alone is timed, and ``finished()`` right after it says whether
    the GPU ran out of that work before the call returned. The final ``sync()`` is not timed."""
    total, waited = 0.0, 0
    for _ in range(steps):
        sync()
        finished = busy()
        t0 = clock()
        step()
        total += clock() - t0
        waited += bool(finished())
    sync()
    return total / steps * 1e3, waited


def spin_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured with CUDA events (after a
    first spin of the same length, so that the clock has ramped up)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def gpu_spin(ms: float, cycles_per_ms: float) -> Callable[[], bool]:
    """Enqueue a spin kernel of about ``ms`` milliseconds; returns whether it has finished (an event query)."""
    torch.cuda._sleep(int(ms * cycles_per_ms))
    done = torch.cuda.Event()
    done.record()
    return done.query


def busy_ms(intervals: list[tuple[float, float]], steps: int) -> float:
    """Milliseconds a step during which at least one of ``intervals`` ((start, end) in us) runs: the length of
    their union over ``steps`` steps, so kernels that run side by side (another stream's, NCCL's) count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3 / steps


def kernel_times(step: Callable[[], object],
                 steps: int = PROFILED_STEPS) -> tuple[dict[str, float], dict[str, float], float]:
    """GPU ms per step of each kernel over ``steps`` profiled calls, memset/memcpy excluded: (ours, others,
    busy), busy the ms a step during which any of them runs (:func:`busy_ms`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # CUDA activity only: with CPU activity on, record_function ranges such as
    # "Optimizer.step#AdamW.step" also appear on the GPU timeline and would count as kernels.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ours: dict[str, float] = {}
    others: dict[str, float] = {}
    for evt in prof.key_averages():
        us = evt.self_device_time_total
        if us <= 0 or evt.key.startswith(EXCLUDED) or evt.device_type.name != "CUDA":
            continue
        table = ours if OUR_KERNEL.match(evt.key) else others
        table[evt.key] = table.get(evt.key, 0.0) + us / 1e3 / steps
    intervals = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type.name == "CUDA" and not e.name.startswith(EXCLUDED) and e.time_range.elapsed_us() > 0]
    return ours, others, busy_ms(intervals, steps)


def host_profile(step: Callable[[], object], steps: int, top: int = 12) -> dict:
    """Where the host time of ``step`` goes: ``steps`` calls under cProfile. Returns the profiled host
    ms per step, the share of each source area (tritonllm, triton, torch's dynamo, inductor, AOTAutograd,
    autograd, the rest of torch, other) by self time, and the ``top`` functions by self time (ms and
    calls per step). cProfile's own cost inflates the times (about 1 us per Python call), so compare
    sides with one another, not with ``host_ms``."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    areas: dict[str, float] = {}
    rows = []
    for (path, line, func), (_, calls, self_s, _, _) in stats.items():
        area = next((name for name, part in HOST_AREAS if part in path), "other")
        areas[area] = areas.get(area, 0.0) + self_s
        rows.append((self_s, calls, f"{path.split('site-packages/')[-1]}:{line}({func})"))
    total = sum(areas.values())
    rows.sort(reverse=True)
    return {"host_ms": round(total / steps * 1e3, 3),
            "areas": {k: round(v / total, 3) for k, v in sorted(areas.items(), key=lambda kv: -kv[1])},
            "top": [{"fn": fn, "ms": round(t / steps * 1e3, 3), "calls": round(n / steps, 1)} for t, n, fn in rows[:top]]}


#: source areas of :func:`host_profile`, matched in order against a function's file path
HOST_AREAS = (("tritonllm", "tritonllm"), ("tritonllm", "/kernels/"), ("triton", "/triton/"),
              ("dynamo", "torch/_dynamo"), ("inductor", "torch/_inductor"), ("aot_autograd", "torch/_functorch"),
              ("autograd", "torch/autograd"), ("torch", "torch/"), ("builtins", "~"))


def measure(step: Callable[[], object], args, tokens: int, flops_per_token: int, peak_flops: float,
            cycles_per_ms: float) -> tuple[dict, dict[str, float], dict[str, float]]:
    """Warm up, then time ``step`` (see the module docstring). Returns the side's figures and its
    kernel times per step (ours, others)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - started
    print(f"    first step (compilation, autotuning) {first_s:.1f} s", flush=True)
    for _ in range(args.warmup - 1):
        step()
    wall = wall_ms(step, args.steps, torch.cuda.synchronize)
    peak_mem = torch.cuda.max_memory_allocated() / 1e9
    host, waited = host_ms(step, args.steps, lambda: gpu_spin(4 * wall + 5, cycles_per_ms), torch.cuda.synchronize)
    ours, others, busy = kernel_times(step)
    tokens_per_s = tokens / (wall / 1e3)
    figures: dict = {"tokens_per_s": round(tokens_per_s), "mfu": round(flops_per_token * tokens_per_s / peak_flops, 4),
                     "peak_mem_gb": round(peak_mem, 2), "step_ms": round(wall, 3),
                     "gpu_ms": round(sum(ours.values()) + sum(others.values()), 3), "gpu_busy_ms": round(busy, 3),
                     "host_ms": round(host, 3)}
    figures["first_step_s"] = round(first_s, 1)
    if args.host_profile:
        hp = figures["host_profile"] = host_profile(step, args.host_profile)
        print(f"    host profile: {hp['host_ms']:.2f} ms per step; "
              + ", ".join(f"{k} {v:.0%}" for k, v in hp["areas"].items()), flush=True)
        for row in hp["top"]:
            print(f"      {row['ms']:8.3f} ms {row['calls']:8.1f} calls  {row['fn']}", flush=True)
    if waited:
        figures["host_waited"] = waited
    return figures, ours, others


def free_gpu() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# --- the sides -------------------------------------------------------------------------------------

def time_tritonllm(model_cfg, cfg, x, y, args, peak_flops, cycles_per_ms):
    """tritonllm's eager and graphed steps, and with ``args.compiled`` the same two with the model under
    ``torch.compile(fullgraph=True)``. Returns (graphed figures, eager figures, graphed kernel times
    (ours, others), whether the graph was captured, flops per token, the initial weights on the CPU,
    the compiled sides' figures by ``eager`` / ``graphed``)."""
    from tritonllm.models import build_model
    from tritonllm.train import build_optimizer
    from tritonllm.train.step import TrainStep

    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device=x.device, dtype=torch.bfloat16)
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model, cfg.optim, master_weights=True)
    flops_per_token = model.flops_per_token(x.shape[1])
    print(f"{model_cfg.name}: {model.num_params() / 1e6:.1f}M parameters, B{x.shape[0]} x T{x.shape[1]} bf16, "
          f"{flops_per_token * x.numel() / 1e12:.2f} TFLOP per step", flush=True)
    lr = float(cfg.optim.lr)
    sides, captured, compiled_sides = {}, {}, {}
    for compiled in (False, True) if args.compiled else (False,):
        runner = torch.compile(model, fullgraph=True) if compiled else model
        for graph in (False, True):
            train_step = TrainStep(runner, optimizer, grad_clip=cfg.trainer.grad_clip, grad_accum=1, cuda_graph=graph)
            try:
                started = time.perf_counter()
                sides[compiled, graph] = measure(lambda: train_step([(x, y)], lr=lr), args, x.numel(), flops_per_token,
                                                 peak_flops, cycles_per_ms)
                captured[compiled, graph] = train_step.graphed
                print(f"  measured {'compiled ' if compiled else ''}{'graphed' if graph else 'eager'} in "
                      f"{time.perf_counter() - started:.0f} s: {sides[compiled, graph][0]['step_ms']:.2f} ms per step",
                      flush=True)
            except Exception as e:  # the compiled sides are reported when they fail; the uncompiled ones are the row
                if not compiled:
                    raise
                compiled_sides["graphed" if graph else "eager"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            if compiled and not graph and (True, False) in sides:
                uncompiled = TrainStep(model, optimizer, grad_clip=cfg.trainer.grad_clip, grad_accum=1, cuda_graph=False)
                ab = interleaved_ratio(lambda: uncompiled([(x, y)], lr=lr), lambda: train_step([(x, y)], lr=lr),
                                       args.ab_rounds, args.steps, torch.cuda.synchronize)
                sides[True, False][0]["vs_uncompiled_interleaved"] = ab
                print(f"  compiled / uncompiled eager steps, {ab['rounds']} interleaved rounds of {ab['steps']}: "
                      f"median {ab['ratio']:.3f} (range {ab['min']:.3f}-{ab['max']:.3f}; {ab['b_ms']:.2f} vs "
                      f"{ab['a_ms']:.2f} ms)", flush=True)
                del uncompiled
            del train_step
            free_gpu()
        del runner
        torch._dynamo.reset()
    del model, optimizer
    free_gpu()
    (graphed, ours, others), (eager, _, _) = sides[False, True], sides[False, False]
    for graph in (False, True):
        if (True, graph) in sides:
            compiled_sides["graphed" if graph else "eager"] = {**sides[True, graph][0], "cuda_graph": captured[True, graph]}
    return graphed, eager, (ours, others), captured[False, True], flops_per_token, weights, compiled_sides


def baseline_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """The baseline's ``torch.optim.AdamW`` (fused on a GPU) with tritonllm's hyper-parameters and
    groups: weight decay on matrices, none on vectors."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": float(cfg.optim.weight_decay)},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=float(cfg.optim.lr), betas=tuple(cfg.optim.betas),
                             eps=float(cfg.optim.eps), fused=params[0].is_cuda)


def baseline_update(loss: torch.Tensor, params: list, optimizer, clip: float | None) -> None:
    """The rest of the baseline's step after its forward: ``loss.backward()``, the gradients clipped to
    ``clip`` (``clip_grad_norm_(foreach=True)``; None: not clipped), the optimizer step, the gradients
    set to None."""
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, float(clip), foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_baseline(mode: str | None, model_cfg, cfg, weights, x, y, experts, args, flops_per_token, peak_flops,
                  cycles_per_ms) -> dict:
    """One compiled baseline (``mode`` of torch.compile); its figures."""
    from tritonllm.bench.baseline_model import BaselineTransformer

    torch._dynamo.reset()
    with torch.device(x.device):
        model = BaselineTransformer(model_cfg, experts=experts)
    model.load_state_dict(weights)
    params = list(model.parameters())
    optimizer = baseline_optimizer(model, cfg)
    compiled = torch.compile(model, mode=mode, dynamic=False)
    clip = cfg.trainer.grad_clip

    def step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(x, y)
        baseline_update(loss, params, optimizer, clip)

    try:
        figures, _, _ = measure(step, args, x.numel(), flops_per_token, peak_flops, cycles_per_ms)
    finally:
        del step, compiled, optimizer, model, params
        torch._dynamo.reset()
        free_gpu()
    return figures


# --- command line ----------------------------------------------------------------------------------

def _parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m tritonllm.bench train",
                                description="Hydra overrides as for python -m tritonllm.train, plus:")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps first (compilation, autotuning, tritonllm's graph capture); >= 3")
    p.add_argument("--baselines", default=",".join(BASELINE_MODES),
                   help=f"comma-separated torch.compile modes of the baseline, of: {', '.join(BASELINE_MODES)}")
    p.add_argument("--no-baseline", action="store_true", help="time tritonllm only")
    p.add_argument("--compiled", action="store_true",
                   help="also time tritonllm's model under torch.compile(fullgraph=True), eager and graphed steps")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="also profile STEPS steps of each side with cProfile: host time by source area and the "
                        "top functions (host_profile in the JSON row)")
    p.add_argument("--ab-rounds", type=int, default=10,
                   help="with --compiled: rounds of the interleaved compiled/uncompiled eager comparison")
    p.add_argument("--moe-experts", default="auto", choices=("auto", "grouped_mm", "loop"),
                   help="the MoE baseline's experts: torch._grouped_mm, a loop over experts, or auto (the default "
                        "of tritonllm.bench.baseline_model)")
    p.add_argument("--out", default="docs/perf", help="folder for train-<gpu>.json")
    args, overrides = p.parse_known_args(argv)
    if args.warmup < 3:
        p.error(f"--warmup must be >= 3 (two eager warm-up steps, then the graph capture), got {args.warmup}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.ab_rounds < 1:
        p.error(f"--ab-rounds must be >= 1, got {args.ab_rounds}")
    args.baselines = [] if args.no_baseline else [b for b in args.baselines.split(",") if b]
    unknown = [b for b in args.baselines if b not in BASELINE_MODES]
    if unknown:
        p.error(f"--baselines: unknown {unknown}; choose from {', '.join(BASELINE_MODES)}")
    return args, overrides


HEADER = (f"{'side':<28}{'tokens/s':>12}{'MFU':>8}{'step ms':>10}{'GPU ms':>10}{'busy ms':>10}{'host ms':>11}"
          f"{'peak GB':>9}")


def _line(name: str, f: dict) -> str:
    if "error" in f:
        return f"{name:<28}failed: {f['error']}"
    return (f"{name:<28}{f['tokens_per_s']:>12,}{f['mfu']:>8.1%}{f['step_ms']:>10.2f}{f['gpu_ms']:>10.2f}"
            f"{f['gpu_busy_ms']:>10.2f}{f['host_ms']:>10.2f}{'*' if f.get('host_waited') else ' '}{f['peak_mem_gb']:>9.2f}")


def with_speedup(row: dict) -> dict:
    """``row`` with ``speedup`` (the fastest timed baseline's step_ms / ours) and ``fastest_baseline``."""
    timed = {k: v for k, v in row["baselines"].items() if "step_ms" in v}
    if timed:
        fastest = min(timed, key=lambda k: timed[k]["step_ms"])
        row.update(fastest_baseline=fastest, speedup=round(timed[fastest]["step_ms"] / row["step_ms"], 3))
    return row


def main(argv: list[str]) -> None:
    from omegaconf import open_dict

    from tritonllm.bench.baseline_model import default_expert_impl
    from tritonllm.bench.harness import write_results
    from tritonllm.errors import TritonLLMError
    from tritonllm.runtime import compose_config
    from tritonllm.train import model_config

    if any(a == "--nproc" or a.startswith("--nproc=") for a in argv):  # several GPUs: tritonllm.bench.dist_train
        from tritonllm.bench.dist_train import launch

        launch(argv)
        return
    args, overrides = _parse(argv)
    if not torch.cuda.is_available():
        sys.exit("python -m tritonllm.bench train needs a CUDA GPU")
    try:
        cfg = compose_config("train", ["trainer.batch_size=16", "trainer.seq_len=1024", *overrides])
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
    peak_flops = float(cfg.trainer.peak_flops)
    host_cpu = host_cpu_model()
    cycles_per_ms = spin_cycles_per_ms()
    print(f"{torch.cuda.get_device_name()}, host CPU: {host_cpu}, torch {torch.__version__}", flush=True)

    graphed, eager, (ours_ms, other_ms), captured, flops_per_token, weights, compiled = time_tritonllm(
        model_cfg, cfg, x, y, args, peak_flops, cycles_per_ms)
    print(HEADER)
    print(_line(f"tritonllm ({'CUDA graph' if captured else 'graph NOT captured'})", graphed))
    print(_line("tritonllm (eager)", eager), flush=True)
    for name, figures in compiled.items():
        print(_line(f"tritonllm compiled ({name})", figures))
    for name, uncompiled in (("eager", eager), ("graphed", graphed)):
        if "step_ms" in compiled.get(name, {}):
            print(f"compiled / uncompiled step time, {name} steps: "
                  f"{compiled[name]['step_ms'] / uncompiled['step_ms']:.3f}", flush=True)
    total = sum(ours_ms.values()) + sum(other_ms.values())
    row = {"model": model_cfg.name, "batch": B, "seq_len": T, "nproc": 1, "parallel": "none", "cuda_graph": captured,
           **graphed, "eager": eager, **({"compiled": compiled} if compiled else {}), "baselines": {}, "speedup": None,
           "triton_share": round(sum(ours_ms.values()) / total, 4) if total else None, "host_cpu": host_cpu,
           "kernels_ms": {k: round(v, 3) for k, v in sorted(ours_ms.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]},
           "other_kernels_ms": {k: round(v, 3) for k, v in sorted(other_ms.items(), key=lambda kv: -kv[1])}}
    print(f"tritonllm triton_share {row['triton_share']}; host CPU: {host_cpu}")
    for name, ms in row["kernels_ms"].items():
        print(f"  tritonllm kernel {ms:8.3f} ms  {name}")
    for name, ms in row["other_kernels_ms"].items():
        print(f"  non-tritonllm kernel {ms:8.3f} ms  {name}")
    experts = None
    if model_cfg.n_experts:
        experts = default_expert_impl(device) if args.moe_experts == "auto" else args.moe_experts
        row["baseline_moe_experts"] = experts
    path = write_results("train", [row], args.out, extra={"host_cpu": host_cpu})
    for b in args.baselines:
        name = BASELINE_NAMES[b]
        try:
            row["baselines"][name] = time_baseline(BASELINE_MODES[b], model_cfg, cfg, weights, x, y, experts, args,
                                                   flops_per_token, peak_flops, cycles_per_ms)
        except Exception as e:  # a baseline that fails is reported, not fatal
            row["baselines"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(_line(f"baseline {name}", row["baselines"][name]), flush=True)
        path = write_results("train", [with_speedup(row)], args.out, extra={"host_cpu": host_cpu})

    if any(f.get("host_waited") for f in (graphed, eager, *row["baselines"].values())):
        print("* some calls waited for the GPU (a synchronisation inside the step, or a full launch queue): "
              "host ms is an upper bound")
    if row["speedup"] is not None:
        print(f"speedup {row['speedup']:.3f}x over the fastest baseline ({row['fastest_baseline']})")
    print(f"wrote {path}")
