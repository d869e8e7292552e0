"""Benchmark harness: time tritonllm's kernels against baselines in one process run.

A benchmark module (``tritonllm/bench/ops_*.py``) exposes ``cases(size, dtype)`` yielding
:class:`Case` objects. Each case names the op, the problem shape, a factory for fresh inputs,
our implementation and the baselines (torch eager, torch.compile, Liger-Kernel where importable),
and the bytes or FLOPs of each pass. The harness derives GB/s or TFLOP/s and writes
``docs/perf/kernels-<gpu>.json`` in the format of docs/architecture.md, "Benchmarks".

The rows measure the GPU, not the host (:func:`graph_ms`): every pass of every implementation is
captured in a CUDA graph after warm-up calls (torch.compile's compilation and our autotuning
happen there, never under capture) and the graph's replay is timed with
``triton.testing.do_bench(..., return_mode="median")`` (CUDA events, L2 flushed before each
replay). ``fwd+bwd`` captures the forward and the backward; ``bwd`` captures only the backward of
one forward run beforehand on the capture stream (``torch.autograd.grad(..., retain_graph=True)``,
so each replay re-runs the same backward kernels on the saved tensors). A side whose pass cannot
be captured (it synchronises with the host) is timed eagerly instead and named in the row's
``eager_timed``. The host is shown apart (:func:`host_us`): the host time of one eager call of
each pass at a small shape, ours and the corresponding PyTorch op, as ``host_us`` and
``baseline_host_us``.

Before timing, the forward of ours is checked against the case's ``reference`` (a function of
:mod:`tritonllm.bench.reference_ops`, the float64 references the tests use too) by
:func:`check_case`; each row records ``max_err``, ``reference_max_err`` and ``correct``.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from tritonllm.bench.common import cuda_profile

PASSES = ("fwd", "bwd", "fwd+bwd")
#: how the rows are timed, recorded in the results file
TIMING = ("ms: median of do_bench over CUDA graph replays of one pass (L2 flushed; bwd = the backward of a "
          "retained graph; rows without cuda_graph were timed eagerly by earlier runs); host_us: host time of one "
          "eager call at host_shape, mean of back-to-back calls")


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
    #: the same op at a small shape (see :func:`with_host`), for :func:`host_us`: the host time of
    #: one call of each pass, ours and ``host_baseline`` (the corresponding PyTorch op, a key of
    #: the small case's baselines)
    host: Case | None = None
    host_baseline: str | None = None
    #: baseline name -> the backend it ran, named from its GPU kernels' names (e.g. which kernel
    #: library SDPA dispatched to at this shape); recorded per pass as ``baselines_backend``
    backends: dict[str, Callable[[list[str]], str]] = field(default_factory=dict)
    #: the op in plain PyTorch (:mod:`tritonllm.bench.reference_ops`), called like ours on ours' inputs;
    #: :func:`check_case` runs it in float64 and in the case's dtype
    reference: Callable | None = None


#: absolute slack of the correctness check per dtype, relative to max(1, max|ref|) (the tests' rule;
#: float32 at TF32's truncation of both GEMM operands, 2^-9)
CHECK_ATOL = {torch.float32: 2.0 ** -9, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _max_err(outs: tuple, refs: tuple) -> float:
    """Largest ``max|out - ref| / max(1, max|ref|)`` over the outputs (inf if any output is not finite)."""
    err = 0.0
    for out, ref in zip(outs, refs):
        out, ref = out.detach().double(), ref.detach().double()
        if not torch.isfinite(out).all():
            return math.inf
        if out.numel():
            err = max(err, (out - ref).abs().max().item() / max(1.0, ref.abs().max().item()))
    return err


def check_case(case: Case, inputs: tuple | None = None) -> dict:
    """Ours' forward outputs against ``case.reference`` in float64, on ``inputs`` (ours' inputs; None:
    fresh ones), with the reference in the case's dtype as the yardstick: ``correct`` when ours' error
    is at most twice the yardstick's plus ``CHECK_ATOL`` (the tests' tolerance rule). Returns
    ``{"max_err", "reference_max_err", "correct"}`` (errors relative to max(1, max|ref64|)), or {}
    for a case without a reference."""
    if case.reference is None:
        return {}
    if inputs is None:
        inputs = case.make_inputs()
        inputs = case.ours_inputs(inputs) if case.ours_inputs is not None else inputs
    with torch.no_grad():
        outs = _as_tuple(case.ours(*inputs))
        as64 = [t.detach().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
        ref64 = _as_tuple(case.reference(*as64))
        same = _as_tuple(case.reference(*inputs))
    err, err_same = _max_err(outs, ref64), _max_err(same, ref64)
    return {"max_err": err, "reference_max_err": err_same,
            "correct": err <= 2 * err_same + CHECK_ATOL.get(case.dtype, 0.0)}


def with_host(case: Case, small: Case, baseline: str) -> Case:
    """``case`` with the host time of one call measured on ``small`` (the op at a small shape, where
    the GPU keeps up with the host), ours against ``small.baselines[baseline]``."""
    case.host, case.host_baseline = small, baseline
    return case


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


def pass_fn(impl: Callable, inputs: tuple, kind: str, grad_seed: int = 0):
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


@functools.lru_cache(maxsize=None)
def _capture_stream() -> torch.cuda.Stream:
    """The one side stream every capture uses (per-stream caches, e.g. TMA scratch, stay few)."""
    return torch.cuda.Stream()


def graph_ms(make_fn: Callable[[], Callable]) -> float:
    """Median milliseconds of one replay of a CUDA graph holding one call of ``make_fn()``.

    ``make_fn`` builds the pass (:func:`pass_fn`) on a side stream, so that a forward it runs
    beforehand (the ``bwd`` pass) records that stream and the backward's kernels follow it into the
    capture; three warm-up calls there compile, autotune and fill the allocator before capture.
    """
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn = make_fn()
        for _ in range(3):
            fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        return time_ms(graph.replay)
    finally:
        del graph, fn


def timed_ms(make_fn: Callable[[], Callable], label: str) -> tuple[float, bool]:
    """``(ms, graphed)``: :func:`graph_ms`, or, when the pass cannot be captured, the eager
    :func:`time_ms` of a freshly built pass (``graphed`` False; the reason is printed)."""
    try:
        return graph_ms(make_fn), True
    except Exception as e:  # a pass that synchronises with the host cannot be captured
        torch.cuda.synchronize()
        print(f"  [{label}] not capturable, timed eagerly: {type(e).__name__}: {str(e)[:160]}")
        _close_failed_capture()
        return time_ms(make_fn()), False


def _close_failed_capture() -> None:
    """One trivial capture after a failed one. When a capture fails, ``capture_end`` raises before PyTorch's
    CUDA generator leaves its capture mode, and every later random op on the device then fails ("Offset
    increment outside graph capture"): a capture that completes takes the generator out of it again."""
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph, stream=_capture_stream()):
        x.add_(1)
    torch.cuda.synchronize()


def host_us(fn: Callable, calls: int = 200, rounds: int = 5) -> float:
    """Host microseconds of one call of ``fn``: the mean over ``calls`` back-to-back calls on the
    host clock with no synchronisation in between (the GPU runs behind), the fastest of ``rounds``
    rounds, after warm-up calls. At a small shape the GPU keeps up, so this is the host's cost."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return round(best * 1e6, 2)


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
    fn()
    prof = cuda_profile(fn, iters)
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
    """Time every pass of ``case`` for ours and each baseline inside CUDA graphs; one result row
    per pass, with the host time of one call at the small shape when the case has a ``host`` case.

    With ``profile`` each row also gets ``kernels_us``: our kernels' GPU time per call by name.
    """
    rows = []
    inputs = case.make_inputs()
    ours_inputs = case.ours_inputs(inputs) if case.ours_inputs is not None else inputs
    check = check_case(case, ours_inputs)
    if check and not check["correct"]:
        print(f"  [{case.op} {case.shape}] WRONG: max error {check['max_err']:.3e} against float64, PyTorch in "
              f"{_dtype_name(case.dtype)} {check['reference_max_err']:.3e}")
    torch.cuda.empty_cache()
    host = _host_rows(case.host, case.host_baseline) if case.host is not None else {}
    for kind in case.passes:
        label = f"{case.op} {case.shape} {kind}"
        ms, graphed = timed_ms(lambda: pass_fn(case.ours, ours_inputs, kind), f"{label} ours")
        eager = [] if graphed else ["ours"]
        measure = case.measure_memory and kind == "fwd+bwd"
        base, base_mem, backends = {}, {}, {}
        for name, impl in case.baselines.items():
            try:
                base_ms, graphed = timed_ms(lambda: pass_fn(impl, inputs, kind), f"{label} {name}")
                base[name] = round(base_ms, 4)
                if not graphed:
                    eager.append(name)
                if measure:
                    base_mem[name] = peak_memory_gb(pass_fn(impl, inputs, kind))
            except Exception as e:  # a baseline that cannot run this shape is reported, not fatal
                print(f"  [{label}] baseline {name} failed: {type(e).__name__}: {str(e)[:200]}")
            if name in base and name in case.backends:
                backends[name] = case.backends[name](list(kernel_times_us(pass_fn(impl, inputs, kind), iters=1)))
            torch.cuda.empty_cache()
        # an eager pass built only now: one built earlier would keep its forward's graph alive,
        # and with it the leaves' gradient nodes on this stream, which breaks the baselines' capture
        fn = pass_fn(case.ours, ours_inputs, kind) if (measure or profile or case.kernel_shares) else None
        mem = peak_memory_gb(fn) if measure and fn is not None else None
        row = {"op": case.op, "shape": case.shape, "dtype": _dtype_name(case.dtype), "pass": kind,
               "ms": round(ms, 4)}
        if kind in case.bytes:
            row["GB/s"] = round(case.bytes[kind] / (ms * 1e-3) / 1e9, 1)
        if kind in case.flops:
            row["TFLOP/s"] = round(case.flops[kind] / (ms * 1e-3) / 1e12, 1)
        row["baselines_ms"] = base
        if backends:
            row["baselines_backend"] = backends
        row.update(check)
        row["cuda_graph"] = True
        if eager:
            row["eager_timed"] = eager
        row.update(host.get(kind, {}))
        if fn is not None and (profile or case.kernel_shares):
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
        del fn
        torch.cuda.empty_cache()
    del inputs, ours_inputs
    torch.cuda.empty_cache()
    return rows


def _host_rows(small: Case, baseline: str | None) -> dict[str, dict]:
    """Per pass of ``small``: ``host_us`` (ours), ``baseline_host_us`` ({baseline: us}) and
    ``host_shape``, from :func:`host_us`."""
    inputs = small.make_inputs()
    ours_inputs = small.ours_inputs(inputs) if small.ours_inputs is not None else inputs
    out = {}
    for kind in small.passes:
        row = {"host_shape": small.shape, "host_us": host_us(pass_fn(small.ours, ours_inputs, kind))}
        if baseline is not None:
            row["baseline_host_us"] = {baseline: host_us(pass_fn(small.baselines[baseline], inputs, kind))}
        out[kind] = row
    return out


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
    """The commit the results are of: ``TRITONLLM_COMMIT`` when set (a copy of the tree whose git metadata is
    stale, as on a lent GPU machine, says it itself), else ``git describe`` ("-dirty" when the working tree
    differs from the commit: what ran is then not that commit), else "unknown"."""
    if os.environ.get("TRITONLLM_COMMIT"):
        return os.environ["TRITONLLM_COMMIT"]
    try:
        return subprocess.check_output(["git", "describe", "--always", "--dirty", "--abbrev=7"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def row_key(r: dict) -> tuple:
    """What makes two result rows the same measurement, so that a new one replaces the old: op, shape,
    dtype, pass, model, batch, sequence length, GPU count, parallel mode and the linear layers' precision
    (a one-GPU training row leaves the model's multi-GPU rows alone, an fp8 row the bf16 one)."""
    return (r.get("op"), r.get("shape"), r.get("dtype"), r.get("pass"), r.get("model"), r.get("batch"),
            r.get("seq_len"), r.get("nproc", 1), r.get("parallel", "none"), r.get("precision", "bf16"))


def write_results(kind: str, rows: list[dict], out_dir: str, extra: dict | None = None) -> str:
    """Merge ``rows`` into ``<out_dir>/<kind>-<gpu>.json`` (rows of the same :func:`row_key` are replaced;
    each new row records the commit it was measured at) and return the path."""
    import triton

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{kind}-{gpu_slug()}.json")
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("results", [])
    new_keys = {row_key(r) for r in rows}
    commit = git_commit()
    merged = [r for r in old if row_key(r) not in new_keys] + [{**r, "commit": r.get("commit", commit)} for r in rows]
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": commit, "date": datetime.date.today().isoformat()}
    doc.update(extra or {})
    doc["results"] = merged
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def print_table(rows: list[dict]) -> None:
    """Print one line per result: ours, the baselines, the speedup over the fastest and, where
    measured, the host us of one call (ours / the PyTorch op's)."""
    print(f"{'op':<22}{'shape':<26}{'dt':<5}{'pass':<8}{'ms':>9}{'rate':>12}  {'baselines (ms)':<50}{'x best':>7}"
          f"  host us")
    for r in rows:
        rate = f"{r['GB/s']:.0f} GB/s" if "GB/s" in r else (f"{r['TFLOP/s']:.0f} TF/s" if "TFLOP/s" in r else "")
        backend = r.get("baselines_backend", {})
        base = " ".join(f"{k}{f'[{backend[k]}]' if k in backend else ''}={v:.3f}"
                        for k, v in r.get("baselines_ms", {}).items())
        sp = f"{r['speedup_vs_best']:.2f}" if "speedup_vs_best" in r else "-"
        host = ""
        if "host_us" in r:
            host = f"{r['host_us']:.1f}" + "".join(f" / {k} {v:.1f}" for k, v in r.get("baseline_host_us", {}).items())
        print(f"{r['op']:<22}{r['shape']:<26}{r['dtype']:<5}{r['pass']:<8}{r['ms']:>9.4f}{rate:>12}  {base:<50}{sp:>7}"
              f"  {host}")
        if "kernels_us" in r:
            busy = sum(r["kernels_us"].values())
            print(f"{'':<8}kernels {busy:.1f} us of {r['ms'] * 1e3:.1f} us: "
                  + ", ".join(f"{k} {v}" for k, v in r["kernels_us"].items()))
