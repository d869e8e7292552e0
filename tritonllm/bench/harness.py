"""Benchmark harness: time tritonllm's kernels against baselines in one process run.

A benchmark module (``tritonllm/bench/ops_*.py``) exposes ``cases(size, dtype)`` yielding
:class:`Case` objects. Each case names the op, the problem shape, a factory for fresh inputs,
our implementation and the baselines (torch eager, torch.compile, Liger-Kernel where importable),
and the bytes or FLOPs of each pass. The harness times every pass of every implementation with
``triton.testing.do_bench(..., return_mode="median")`` (CUDA events, warm-up excluded, L2
flushed before each repetition), derives GB/s or TFLOP/s, and writes
``docs/perf/kernels-<gpu>.json`` in the format of DESIGN.md section 6.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from dataclasses import dataclass, field
from typing import Callable

import torch

PASSES = ("fwd", "bwd", "fwd+bwd")


@dataclass
class Case:
    """One benchmarked problem.

    ``make_inputs()`` returns a tuple of fresh tensors (those to differentiate have
    ``requires_grad=True``); every implementation is called as ``impl(*inputs)`` and returns a
    tensor or a tuple of tensors. ``bytes`` / ``flops`` map a pass name to the minimum bytes moved
    or FLOPs done, for GB/s or TFLOP/s. ``passes`` lists what to time; pass ``step`` calls the
    implementation once per repetition with no autograd (optimizers). ``ours_inputs``, when set,
    maps the inputs to the ones ours is called with, for an op whose natural layout differs from
    the baselines' (rope rotates q and k as one packed view). ``kernel_shares`` names groups of
    our kernels (a predicate on the kernel name); each row then gets ``gpu_ms`` (all our kernels'
    GPU time per call, from the profiler) and ``share`` (each group's fraction of it).
    """

    op: str
    shape: str
    dtype: torch.dtype
    make_inputs: Callable[[], tuple]
    ours: Callable
    baselines: dict[str, Callable] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)
    passes: tuple[str, ...] = PASSES
    #: also record the peak memory of ``fwd+bwd`` (``peak_mem_gb``, ``baselines_peak_mem_gb``)
    measure_memory: bool = False
    ours_inputs: Callable[[tuple], tuple] | None = None
    kernel_shares: dict[str, Callable[[str], bool]] = field(default_factory=dict)


def liger_available() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except Exception:
        return False
    return True


def compiled(fn: Callable) -> Callable:
    """``torch.compile`` of a baseline, compiled lazily on first call."""
    return torch.compile(fn, dynamic=False)


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _pass_fn(impl: Callable, inputs: tuple, kind: str, grad_seed: int = 0):
    """A zero-argument callable running ``kind`` of ``impl`` on ``inputs`` (None if not applicable)."""
    if kind == "step":
        return lambda: impl(*inputs)
    if kind == "fwd":
        def fwd():
            with torch.no_grad():
                impl(*inputs)
        return fwd
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [o for o in _as_tuple(impl(*inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
    gen = torch.Generator(device=outs[0].device).manual_seed(grad_seed)
    grads = [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outs]
    if kind == "bwd":
        return lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True)

    def fwd_bwd():
        o = [o for o in _as_tuple(impl(*inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.grad(o, wrt, grads)
    return fwd_bwd


def time_ms(fn: Callable) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (CUDA events, warm-up excluded)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def peak_memory_gb(fn: Callable) -> float:
    """Peak CUDA memory allocated while ``fn`` runs, above what was allocated before, in GB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 1e9, 4)


def kernel_times_us(fn: Callable, iters: int = 10) -> dict[str, float]:
    """GPU time per call of each kernel ``fn`` launches, in microseconds, from ``torch.profiler``.

    The sum against the do_bench time shows how much of a pass is kernels and how much is idle GPU
    waiting on the host (launch overhead, synchronizations).
    """
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.self_device_time_total > 0:
            times[ev.key[:60]] = round(ev.self_device_time_total / iters, 2)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def run_case(case: Case, profile: bool = False) -> list[dict]:
    """Time every pass of ``case`` for ours and each baseline; one result row per pass.

    With ``profile`` each row also gets ``kernels_us``: our kernels' GPU time per call by name.
    """
    rows = []
    inputs = case.make_inputs()
    ours_inputs = case.ours_inputs(inputs) if case.ours_inputs is not None else inputs
    for kind in case.passes:
        fn = _pass_fn(case.ours, ours_inputs, kind)
        ms = time_ms(fn)
        measure = case.measure_memory and kind == "fwd+bwd"
        mem = peak_memory_gb(fn) if measure else None
        base, base_mem = {}, {}
        for name, impl in case.baselines.items():
            try:
                base_fn = _pass_fn(impl, inputs, kind)
                base[name] = round(time_ms(base_fn), 4)
                if measure:
                    base_mem[name] = peak_memory_gb(base_fn)
            except Exception as e:  # a baseline that cannot run this shape is reported, not fatal
                print(f"  [{case.op} {case.shape} {kind}] baseline {name} failed: {type(e).__name__}: {str(e)[:200]}")
            torch.cuda.empty_cache()
        row = {"op": case.op, "shape": case.shape, "dtype": _dtype_name(case.dtype), "pass": kind,
               "ms": round(ms, 4)}
        if kind in case.bytes:
            row["GB/s"] = round(case.bytes[kind] / (ms * 1e-3) / 1e9, 1)
        if kind in case.flops:
            row["TFLOP/s"] = round(case.flops[kind] / (ms * 1e-3) / 1e12, 1)
        row["baselines_ms"] = base
        if profile or case.kernel_shares:
            kernels = kernel_times_us(fn)
            total = sum(kernels.values())
            if profile:
                row["kernels_us"] = kernels
            if case.kernel_shares and total > 0:
                row["gpu_ms"] = round(total / 1e3, 4)
                row["share"] = {g: round(sum(us for k, us in kernels.items() if pick(k)) / total, 3)
                                for g, pick in case.kernel_shares.items()}
        if measure:
            row["peak_mem_gb"] = mem
            row["baselines_peak_mem_gb"] = base_mem
        if base:
            row["speedup_vs_best"] = round(min(base.values()) / ms, 3)
        rows.append(row)
        torch.cuda.empty_cache()
    del inputs, ours_inputs
    torch.cuda.empty_cache()
    return rows


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def gpu_slug() -> str:
    """Short GPU name for file names: 'h100', 'h200', else the device name in lower case."""
    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "h100", "a100", "b200", "l40s", "4090"):
        if key in name:
            return key
    return name.replace("nvidia ", "").replace(" ", "-")


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return os.environ.get("TRITONLLM_COMMIT", "unknown")


def write_results(kind: str, rows: list[dict], out_dir: str, extra: dict | None = None) -> str:
    """Merge ``rows`` into ``<out_dir>/<kind>-<gpu>.json`` (rows with the same op, shape, dtype
    and pass are replaced) and return the path."""
    import triton

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{kind}-{gpu_slug()}.json")
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("results", [])
    key = lambda r: (r.get("op"), r.get("shape"), r.get("dtype"), r.get("pass"), r.get("model"))  # noqa: E731
    new_keys = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in new_keys] + rows
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": git_commit(), "date": datetime.date.today().isoformat()}
    doc.update(extra or {})
    doc["results"] = merged
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def print_table(rows: list[dict]) -> None:
    """Print one line per result: ours, the baselines and the speedup over the fastest."""
    print(f"{'op':<22}{'shape':<26}{'dt':<5}{'pass':<8}{'ms':>9}{'rate':>12}  {'baselines (ms)':<50}{'x best':>7}")
    for r in rows:
        rate = f"{r['GB/s']:.0f} GB/s" if "GB/s" in r else (f"{r['TFLOP/s']:.0f} TF/s" if "TFLOP/s" in r else "")
        base = " ".join(f"{k}={v:.3f}" for k, v in r.get("baselines_ms", {}).items())
        sp = f"{r['speedup_vs_best']:.2f}" if "speedup_vs_best" in r else "-"
        print(f"{r['op']:<22}{r['shape']:<26}{r['dtype']:<5}{r['pass']:<8}{r['ms']:>9.4f}{rate:>12}  {base:<50}{sp:>7}")
        if "kernels_us" in r:
            busy = sum(r["kernels_us"].values())
            print(f"{'':<8}kernels {busy:.1f} us of {r['ms'] * 1e3:.1f} us: "
                  + ", ".join(f"{k} {v}" for k, v in r["kernels_us"].items()))
