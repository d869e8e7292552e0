"""``python -m tritonllm.bench train +model=void125m [hydra overrides] [--steps 20 --warmup 5 --out docs/perf]``
``python -m tritonllm.bench train --nproc 2 +model=void1b [--parallel ddp,fsdp]``: DDP and FSDP2 on
several GPUs against one, beside the baseline parallelised alike (:mod:`tritonllm.bench.dist_train`).
``python -m tritonllm.bench train +model=void_tiny --device cpu``: a smoke run of the code path without a
GPU (tritonllm's eager step in Triton's interpreter, fp32; its timing means nothing and nothing is written).

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
figures depend on it. The row goes to ``docs/perf/train-<gpu>.json`` (docs/architecture.md, "Benchmarks"),
rewritten after every side so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import time

import torch

from tritonllm.bench.common import (baseline_optimizer, baseline_update, compose_bench_config, free_gpu, host_cpu_model,
                                    interleaved_ratio, measure, spin_cycles_per_ms)
from tritonllm.runtime import ArgumentParser

#: --baselines name -> torch.compile mode
#: (timed in this order: the slowest to compile last)
BASELINE_MODES = {"compile": None, "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune-no-cudagraphs",
                  "torchao-rowwise": None, "torchao-tensorwise": None}
#: the JSON name of each baseline
BASELINE_NAMES = {"compile": "torch.compile", "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune",
                  "torchao-rowwise": "torchao float8 rowwise", "torchao-tensorwise": "torchao float8 tensorwise"}
#: the FP8 baselines: the baseline's dense projections converted by torchao.float8 (that recipe), under
#: torch.compile's default mode; timed by default when trainer.precision=fp8
FLOAT8_RECIPES = {"torchao-rowwise": "rowwise", "torchao-tensorwise": "tensorwise"}
#: --baselines by default: the bf16 modes (and with trainer.precision=fp8 the FP8 ones)
DEFAULT_BASELINES = [b for b in BASELINE_MODES if b not in FLOAT8_RECIPES]
#: how many of tritonllm's kernels the row lists by GPU time a step (kernels_ms)
TOP_KERNELS = 20


# --- the sides -------------------------------------------------------------------------------------

def time_tritonllm(model_cfg, cfg, x, y, args, peak_flops, cycles_per_ms):
    """tritonllm's eager and graphed steps, and with ``args.compiled`` the same two with the model under
    ``torch.compile(fullgraph=True)``. Returns (graphed figures, eager figures, graphed kernel times
    (ours, others), whether the graph was captured, flops per token, the initial weights on the CPU,
    the compiled sides' figures by ``eager`` / ``graphed``). On the CPU (``--device cpu``) the model is
    fp32 and only the eager step runs, its figures standing for both."""
    from tritonllm.models import build_model
    from tritonllm.train import build_optimizer
    from tritonllm.train.step import TrainStep

    from tritonllm.nn.fp8 import apply_precision

    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device=x.device, dtype=torch.bfloat16 if x.is_cuda else torch.float32)
    apply_precision(model, cfg.trainer.precision, cfg.trainer.fp8_grad_dtype)
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model, cfg.optim, master_weights=x.is_cuda)
    flops_per_token = model.flops_per_token(x.shape[1])
    print(f"{model_cfg.name}: {model.num_params() / 1e6:.1f}M parameters, B{x.shape[0]} x T{x.shape[1]} "
          f"{'bf16' if x.is_cuda else 'fp32'} (linear layers {cfg.trainer.precision}), "
          f"{flops_per_token * x.numel() / 1e12:.2f} TFLOP per step", flush=True)
    lr = float(cfg.optim.lr)
    sides, captured, compiled_sides = {}, {}, {}
    for compiled in (False, True) if args.compiled else (False,):
        runner = torch.compile(model, fullgraph=True) if compiled else model
        for graph in (False, True) if x.is_cuda else (False,):
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
    (graphed, ours, others), (eager, _, _) = sides.get((False, True), sides[False, False]), sides[False, False]
    for graph in (False, True):
        if (True, graph) in sides:
            compiled_sides["graphed" if graph else "eager"] = {**sides[True, graph][0], "cuda_graph": captured[True, graph]}
    return graphed, eager, (ours, others), captured.get((False, True), False), flops_per_token, weights, compiled_sides


def time_baseline(mode: str | None, model_cfg, cfg, weights, x, y, experts, args, flops_per_token, peak_flops,
                  cycles_per_ms, float8: str | None = None) -> dict:
    """One compiled baseline (``mode`` of torch.compile; ``float8``: its dense projections converted by
    torchao.float8 with that recipe first); its figures."""
    from tritonllm.bench.baseline_model import BaselineTransformer

    torch._dynamo.reset()
    with torch.device(x.device):
        model = BaselineTransformer(model_cfg, experts=experts)
    model.load_state_dict(weights)
    if float8 is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8))
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
    p = ArgumentParser(prog="python -m tritonllm.bench train",
                       description="Hydra overrides as for python -m tritonllm.train, plus:")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps first (compilation, autotuning, tritonllm's graph capture); >= 3")
    p.add_argument("--baselines", default=None,
                   help=f"comma-separated baselines, of: {', '.join(BASELINE_MODES)} (torch.compile modes; torchao-*: "
                        f"torchao.float8 recipes under torch.compile); default {','.join(DEFAULT_BASELINES)}, and the "
                        "torchao ones with trainer.precision=fp8")
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
    p.add_argument("--device", choices=("auto", "cpu"), default="auto",
                   help="cpu: a smoke run of the code path, tritonllm's eager step in Triton's interpreter (fp32, "
                        "wall time only, no baselines, nothing written)")
    args, overrides = p.parse_with_overrides(argv)
    if args.device == "cpu" and (args.compiled or args.host_profile):
        p.error("--compiled and --host-profile time a GPU: leave them out with --device cpu")
    if args.warmup < (1 if args.device == "cpu" else 3):
        p.error(f"--warmup must be >= 3 (two eager warm-up steps, then the graph capture; >= 1 with --device cpu), "
                f"got {args.warmup}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.ab_rounds < 1:
        p.error(f"--ab-rounds must be >= 1, got {args.ab_rounds}")
    chosen = DEFAULT_BASELINES if args.baselines is None else [b for b in args.baselines.split(",") if b]
    if args.baselines is None and any(o == "trainer.precision=fp8" for o in overrides):
        chosen = [*chosen, *FLOAT8_RECIPES]
    args.baselines = [] if args.no_baseline else chosen
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
    from tritonllm.train import model_config

    if any(a == "--nproc" or a.startswith("--nproc=") for a in argv):  # several GPUs: tritonllm.bench.dist_train
        from tritonllm.bench.dist_train import launch

        launch(argv)
        return
    args, overrides = _parse(argv)
    cfg = compose_bench_config(overrides)
    model_cfg = model_config(cfg)
    if args.device == "auto" and not torch.cuda.is_available():
        raise TritonLLMError("python -m tritonllm.bench train needs a CUDA GPU (the arguments are valid; "
                             "--device cpu: a smoke run in Triton's interpreter)")
    B, T = cfg.trainer.batch_size, cfg.trainer.seq_len
    with open_dict(cfg):
        cfg.model.vocab_size = model_cfg.vocab_size
    device = torch.device("cuda" if args.device == "auto" else "cpu")
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    tokens = torch.randint(0, model_cfg.vocab_size, (B, T + 1), device=device, generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    peak_flops = float(cfg.trainer.peak_flops)
    host_cpu = host_cpu_model()
    if device.type == "cpu":
        _, eager, *_ = time_tritonllm(model_cfg, cfg, x, y, args, peak_flops, None)
        print(f"tritonllm (eager) on the CPU, in Triton's interpreter: {eager['step_ms']:.0f} ms per step; host CPU: "
              f"{host_cpu}; nothing written (the interpreter's timings mean nothing)")
        return
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
    row = {"model": model_cfg.name, "batch": B, "seq_len": T, "nproc": 1, "parallel": "none",
           "precision": cfg.trainer.precision, "cuda_graph": captured,
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
                                                   flops_per_token, peak_flops, cycles_per_ms, FLOAT8_RECIPES.get(b))
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
