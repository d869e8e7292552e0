"""What the bench modules share: the host CPU's name, the timing of a step on the host and on the GPU
(wall, host enqueue, kernel times, a cProfile of the host side; :func:`measure` is the whole
protocol, described in :mod:`tritonllm.bench.train`'s docstring) and the baseline's optimizer step.
Every bench module imports these from here, so the package has no import cycle."""

from __future__ import annotations

import gc
import os
import re
import statistics
import subprocess
import time
from typing import Callable

import torch

#: Triton and Gluon kernels of tritonllm.kernels: a bare `..._kernel` identifier (`_matmul_kernel`,
#: gemm_sm90's `ws_matmul_kernel`; a compiled name may carry a suffix), where CUDA libraries' kernels
#: show a signature (`void at::native::..._kernel<...>(...)`) and torch.compile's are `triton_...`
OUR_KERNEL = re.compile(r"^(?!triton_)\w*_kernel")
EXCLUDED = ("Memcpy", "Memset", "memcpy", "memset")
PROFILED_STEPS = 3


# --- config ----------------------------------------------------------------------------------------

def compose_bench_config(overrides: list[str], defaults: tuple[str, ...] = ()):
    """train.yaml composed with the bench's shape B16 x T1024, then ``defaults``, then the user's
    ``overrides``; the default T1024 is cut to the model's ``max_seq_len`` (void_tiny's 512), and a
    ``trainer.seq_len`` the user gave beyond it is a ConfigError (one line, not a traceback mid-run)."""
    from omegaconf import open_dict

    from tritonllm.errors import ConfigError
    from tritonllm.runtime import compose_config
    from tritonllm.train import model_config

    cfg = compose_config("train", ["trainer.batch_size=16", "trainer.seq_len=1024", *defaults, *overrides])
    if cfg.get("model") is None:
        return cfg
    max_seq_len = model_config(cfg).max_seq_len
    if not any(o.lstrip("+").startswith("trainer.seq_len=") for o in overrides):
        with open_dict(cfg):
            cfg.trainer.seq_len = min(cfg.trainer.seq_len, max_seq_len)
    if cfg.trainer.seq_len > max_seq_len:
        raise ConfigError(f"trainer.seq_len={cfg.trainer.seq_len} exceeds model.max_seq_len={max_seq_len} "
                          f"of {cfg.model.name}")
    return cfg


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


def cuda_profile(fn: Callable[[], object], calls: int):
    """``torch.profiler``'s record of ``calls`` calls of ``fn``, from a synchronised device to the end of the
    last call's kernels. CUDA activity only: with CPU activity on, record_function ranges such as
    "Optimizer.step#AdamW.step" also appear on the GPU timeline and would count as kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_times(step: Callable[[], object],
                 steps: int = PROFILED_STEPS) -> tuple[dict[str, float], dict[str, float], float]:
    """GPU ms per step of each kernel over ``steps`` profiled calls, memset/memcpy excluded: (ours, others,
    busy), busy the ms a step during which any of them runs (:func:`busy_ms`)."""
    prof = cuda_profile(step, steps)
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
    areas_by_dir = host_area_dirs()
    areas: dict[str, float] = {}
    rows = []
    for (path, line, func), (_, calls, self_s, _, _) in stats.items():
        area = host_area(path, areas_by_dir)
        areas[area] = areas.get(area, 0.0) + self_s
        rows.append((self_s, calls, f"{path.split('site-packages/')[-1]}:{line}({func})"))
    total = sum(areas.values())
    rows.sort(reverse=True)
    return {"host_ms": round(total / steps * 1e3, 3),
            "areas": {k: round(v / total, 3) for k, v in sorted(areas.items(), key=lambda kv: -kv[1])},
            "top": [{"fn": fn, "ms": round(t / steps * 1e3, 3), "calls": round(n / steps, 1)} for t, n, fn in rows[:top]]}


def host_area_dirs() -> list[tuple[str, str]]:
    """The source areas of :func:`host_profile` as (area, directory) pairs, the innermost directory
    first: the installed packages' own folders (``tritonllm``, its ``kernels`` package, ``triton``,
    and torch's ``_dynamo``, ``_inductor``, ``_functorch``, ``autograd`` and the rest of ``torch``), so
    that what a file is does not depend on the name of the folder a project was cloned into."""
    import triton

    import tritonllm
    import tritonllm.kernels

    def folder(module) -> str:
        return os.path.dirname(os.path.abspath(module.__file__)) + os.sep

    torch_dir = folder(torch)
    pairs = [("tritonllm", folder(tritonllm)), ("tritonllm", folder(tritonllm.kernels)), ("triton", folder(triton)),
             *((area, os.path.join(torch_dir, sub) + os.sep) for area, sub in (
                 ("dynamo", "_dynamo"), ("inductor", "_inductor"), ("aot_autograd", "_functorch"),
                 ("autograd", "autograd"))),
             ("torch", torch_dir)]
    return sorted(pairs, key=lambda pair: -len(pair[1]))


def host_area(path: str, dirs: list[tuple[str, str]]) -> str:
    """The area of the source file ``path`` as cProfile names it: the first of ``dirs``
    (:func:`host_area_dirs`) that holds it, ``builtins`` for C functions (``~``), else ``other``."""
    if path == "~":
        return "builtins"
    full = os.path.abspath(path)
    return next((area for area, prefix in dirs if full.startswith(prefix)), "other")


def measure(step: Callable[[], object], args, tokens: int, flops_per_token: int, peak_flops: float,
            cycles_per_ms: float | None) -> tuple[dict, dict[str, float], dict[str, float]]:
    """Warm up, then time ``step`` (see :mod:`tritonllm.bench.train`'s docstring). Returns the side's figures and its
    kernel times per step (ours, others). ``cycles_per_ms`` None: a step on the CPU (Triton's interpreter, a smoke
    run of the code path), timed by its wall clock only."""
    if cycles_per_ms is None:
        for _ in range(args.warmup):
            step()
        wall = wall_ms(step, args.steps, lambda: None)
        return {"tokens_per_s": round(tokens / (wall / 1e3)), "step_ms": round(wall, 3)}, {}, {}
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
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


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
