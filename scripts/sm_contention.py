"""Does a kernel running on other SMs beside our GEMM (NCCL's, under FSDP2) slow ours more than cuBLAS?

Issue 19's FSDP2 analysis (docs/perf/history.md, "Several GPUs"): under FSDP2 our per-GPU compute
kernel time grew twice as much as the compiled baseline's. The suspect is the persistent GEMM's static
tile assignment (``kernels/gemm.py``, ``GemmSettings.persistent``). This measures it on one GPU, no NCCL needed.

Usage, on one GPU (about a minute, compiles included):

    python scripts/sm_contention.py [--holds 0,8,16,32] [--fractions 2.0,0.5] [--reps 15] [--variants ...]

A "hog" kernel (raw CUDA through CuPy) holds k SMs: k blocks that each take 200 KiB of shared memory,
so that no GEMM program (ours or cuBLAS's: all take far more than the 27 KiB left) can share their SM,
spinning on the clock for ``fraction`` times the op's time alone (2.0: all of it; 0.5: its first
half, an all-gather that ends midway). Each repetition starts the hog on a side stream, then replays
the op's CUDA graph on the main stream between two events; the median over repetitions is reported,
after as many repetitions alone as warm-up (the op's first timings came right after its compiles, at
a lower clock: the alone column had read slower than the held ones).

Ops: one linear layer's forward and backward (y = x W^T, then dx and dW) at void1b's shapes per GPU
(8192 tokens; qkv 2048 -> 3072, out 2048 -> 2048, w13 2048 -> 11264, w2 5632 -> 2048), bf16, each
captured in a CUDA graph: ours with ``persistent=True`` (the default) and ``False`` (one program per
tile), each also with ``sm90_ws`` (the warp-specialized Gluon kernel, "ours WS"; persistent also with
``dynamic``, tiles taken from a global counter), and ``F.linear`` (cuBLAS). With ``--holds 0`` this is the plain side-by-side timing of each of ours against cuBLAS. Printed: ms alone, ms with each hold, the slowdown against alone,
and the bound set by the SMs left (#SMs / (#SMs - k) with the hog throughout). $OUT/sm_contention.json
when OUT is set.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess

import torch
import torch.nn.functional as F

from tritonllm.bench.common import host_cpu_model
from tritonllm.kernels import configure_gemm, gemm_settings, linear

HOG_SMEM = 200 * 1024
HOG_SOURCE = r"""
extern "C" __global__ void hog(long long cycles, int* sink) {
    extern __shared__ int buf[];
    long long start = clock64();
    int acc = threadIdx.x;
    while (clock64() - start < cycles) {
        acc += buf[threadIdx.x & 255];
        buf[threadIdx.x & 255] = acc;
    }
    if (acc == 0x7fffffff) sink[0] = acc;
}
"""
SHAPES = {"qkv": (2048, 3072), "out": (2048, 2048), "w13": (2048, 11264), "w2": (5632, 2048)}
TOKENS = 8192


class Hog:
    """Holds ``k`` SMs for a given time on a stream (CuPy kernel, calibrated against CUDA events)."""

    def __init__(self, stream: torch.cuda.Stream):
        import cupy

        self.cupy, self.stream = cupy, stream
        self.kernel = cupy.RawKernel(HOG_SOURCE, "hog")
        self.kernel.max_dynamic_shared_size_bytes = HOG_SMEM
        self.sink = cupy.zeros(1, dtype=cupy.int32)
        cycles = 20_000_000
        ms = self._time(1, cycles)
        self.cycles_per_ms = cycles / ms

    def launch(self, k: int, ms: float) -> None:
        if k:
            with self.cupy.cuda.ExternalStream(self.stream.cuda_stream):
                self.kernel((k,), (256,), (self.cupy.int64(int(ms * self.cycles_per_ms)), self.sink),
                            shared_mem=HOG_SMEM)

    def _time(self, k: int, cycles: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        with self.cupy.cuda.ExternalStream(self.stream.cuda_stream):
            self.kernel((k,), (256,), (self.cupy.int64(cycles), self.sink), shared_mem=HOG_SMEM)
        end.record(self.stream)
        torch.cuda.synchronize()
        return start.elapsed_time(end)


#: our variants: GemmSettings (persistent, sm90_ws, dynamic)
OURS = {"ours, persistent": (True, False, False), "ours, one program per tile": (False, False, False),
        "ours WS, persistent": (True, True, False), "ours WS, dynamic tiles": (True, True, True),
        "ours WS, one program per tile": (False, True, False)}


def graphed_op(variant: str, K: int, N: int):
    """A CUDA graph of one linear layer's forward and backward; returns its replay and the Gluon GEMM's
    chosen configs (BLOCK_M, BLOCK_N, STAGES, PINGPONG) of its products, if it ran any."""
    gemm_module = importlib.import_module("tritonllm.kernels.gemm")
    gemm_module._LAUNCH_CONFIGS.clear()  # this op's plans only, below
    library = gemm_settings()
    gen = torch.Generator(device="cuda").manual_seed(K * N)
    x = torch.randn(TOKENS, K, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K ** -0.5).requires_grad_()
    dy = torch.randn(TOKENS, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    fn = F.linear if variant == "cuBLAS" else linear

    def step():
        persistent, ws, dynamic = OURS.get(variant, (True, False, False))
        configure_gemm(library, persistent=persistent, sm90_ws=ws, dynamic=dynamic)
        return torch.autograd.grad(fn(x, w), (x, w), dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # autotuning and compilation, outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    configure_gemm(library)
    ws = [plan[0].kwargs for plan in gemm_module._LAUNCH_CONFIGS.values() if plan[0].fn.__name__ == "ws_matmul_kernel"]
    return graph.replay, [[kw[k] for k in ("BLOCK_M", "BLOCK_N", "STAGES", "PINGPONG")] for kw in ws]


def median_ms(replay, hog: Hog, k: int, hold_ms: float, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        hog.launch(k, hold_ms)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--holds", default="0,8,16,32", help="SMs the hog holds (0: the op alone)")
    p.add_argument("--fractions", default="2.0,0.5", help="the hog's time as a multiple of the op's alone")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--variants", default=";".join([*OURS, "cuBLAS"]),
                   help=f"separated by ';' (the names hold commas), of: {'; '.join([*OURS, 'cuBLAS'])}")
    args = p.parse_args()
    holds = [int(k) for k in args.holds.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hog = Hog(torch.cuda.Stream())
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    if any(v not in OURS and v != "cuBLAS" for v in variants):
        p.error(f"--variants: of {'; '.join([*OURS, 'cuBLAS'])}, got {args.variants!r}")
    rows = []
    print(f"{torch.cuda.get_device_name()}: {sms} SMs; hog {hog.cycles_per_ms / 1e3:.0f} cycles/us")
    print(f"{'shape':<18}{'variant':<30}{'alone ms':>9}" + "".join(
        f"{f'k{k} x{f}':>16}" for k in holds if k for f in fractions))
    for name, (K, N) in SHAPES.items():
        for variant in variants:
            replay, ws_configs = graphed_op(variant, K, N)
            median_ms(replay, hog, 0, 0.0, args.reps)  # warm-up: clocks up after the compiles, caches filled
            alone = median_ms(replay, hog, 0, 0.0, args.reps)
            cells = []
            for k in (k for k in holds if k):
                for frac in fractions:
                    ms = median_ms(replay, hog, k, frac * alone, args.reps)
                    rows.append({"op": f"linear fwd+bwd {name}", "shape": f"{TOKENS}x{K}x{N}", "variant": variant,
                                 "held_sms": k, "hold_fraction": frac, "ms": round(ms, 4), "alone_ms": round(alone, 4),
                                 "slowdown": round(ms / alone, 3), "sm_bound": round(sms / (sms - k), 3),
                                 **({"ws_configs": ws_configs} if ws_configs else {})})
                    cells.append(f"{ms:7.3f} ({ms / alone:.2f}x)")
            print(f"{f'{TOKENS}x{K}x{N}':<18}{variant:<30}{alone:>9.3f}" + "".join(f"{c:>16}" for c in cells)
                  + (f"  WS (BLOCK_M, BLOCK_N, STAGES, PINGPONG): {ws_configs}" if ws_configs else ""), flush=True)
    print("bound with the hog throughout: " + ", ".join(f"k{k} {sms / (sms - k):.2f}x" for k in holds if k))
    if os.environ.get("OUT"):
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout
        doc = {"gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu_model(), "sms": sms,
               "torch": torch.__version__, "commit": commit.strip(), "method": __doc__, "results": rows}
        with open(os.path.join(os.environ["OUT"], "sm_contention.json"), "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
