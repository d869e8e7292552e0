"""``python -m tritonllm.bench kernels [--ops rms_norm,swiglu] [--sizes default,large]``
``python -m tritonllm.bench train +model=void125m [overrides]`` (``--device cpu``: a smoke run in Triton's interpreter)
``python -m tritonllm.bench decode +model=void125m [--batch 1,32 --prompt-len 128 --new-tokens 256]``
``python -m tritonllm.bench finetune [--config tinyllama --batch 4 --seq-len 2048 --rank 16]`` (LoRA, vs transformers + PEFT)
``python -m tritonllm.bench speedrun +model=void125m [--target 2.5 --bin 'train_*.bin' --sides adamw,recipe,torch]``

Times tritonllm against the baselines on the GPU present, in one process run, prints a table and
writes ``docs/perf/<kind>-<gpu>.json``.
"""

from __future__ import annotations

import importlib
import sys

import torch

from tritonllm.errors import ConfigError, TritonLLMError
from tritonllm.runtime import ArgumentParser, exit_on_user_error

#: benchmark modules, one per op family; each has OPS (names) and cases(size, dtype).
FAMILIES = [
    "tritonllm.bench.ops_norm",
    "tritonllm.bench.ops_rope",
    "tritonllm.bench.ops_linear",
    "tritonllm.bench.ops_loss_optim",
    "tritonllm.bench.ops_attention",
    "tritonllm.bench.ops_moe",
    "tritonllm.bench.ops_fp8",
]
#: the shape sets every family's cases() knows
SIZES = ("default", "large")
#: the modes of ``python -m tritonllm.bench``
MODES = ("kernels", "train", "decode", "finetune", "speedrun")


def _families(ops: set[str] | None):
    for name in FAMILIES:
        mod = importlib.import_module(name)
        if ops is None or ops & set(mod.OPS):
            yield mod


def bench_kernels(argv: list[str]) -> None:
    from tritonllm.bench.common import host_cpu_model
    from tritonllm.bench.harness import TIMING, copy_bandwidth_gbs, print_table, run_case, write_results

    p = ArgumentParser(prog="python -m tritonllm.bench kernels")
    p.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    p.add_argument("--sizes", default="default,large", help="comma-separated: default (void125m shapes), large")
    p.add_argument("--out", default="docs/perf", help="folder for kernels-<gpu>.json")
    p.add_argument("--profile", action="store_true", help="also list each pass's kernels and their GPU time")
    args = p.parse_args(argv)
    ops = set(args.ops.split(",")) if args.ops else None
    known = {op for name in FAMILIES for op in importlib.import_module(name).OPS}
    if ops is not None and ops - known:
        p.error(f"--ops: unknown {sorted(ops - known)}; choose from {', '.join(sorted(known))}")
    sizes = [s for s in args.sizes.split(",") if s]
    if not sizes or set(sizes) - set(SIZES):
        p.error(f"--sizes: comma-separated, of {', '.join(SIZES)}; got {args.sizes!r}")
    if not torch.cuda.is_available():
        raise TritonLLMError("python -m tritonllm.bench kernels needs a CUDA GPU (the arguments are valid; "
                             "timings under the interpreter mean nothing)")
    copy = copy_bandwidth_gbs()
    cpu = host_cpu_model()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy:.0f} GB/s (read + write); host {cpu}")
    rows = []
    for mod in _families(ops):
        for size in sizes:
            for case in mod.cases(size, torch.bfloat16):
                if ops is not None and case.op not in ops:
                    continue
                print(f"-- {case.op} {case.shape}", flush=True)
                case_rows = run_case(case, profile=args.profile)
                for r in case_rows:
                    if "GB/s" in r:
                        r["copy_fraction"] = round(r["GB/s"] / copy, 3)
                print_table(case_rows)
                rows += case_rows
                # written after every case, so a run cut short keeps what it measured
                path = write_results("kernels", rows, args.out,
                                     extra={"copy_GB/s": round(copy, 1), "host_cpu": cpu, "timing": TIMING})
    print_table(rows)
    print(f"wrote {path}")


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit(__doc__)
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv[0] not in MODES:
        raise ConfigError(f"python -m tritonllm.bench: unknown mode {argv[0]!r}; choose from {', '.join(MODES)}")
    if argv[0] == "kernels":
        bench_kernels(argv[1:])
    elif argv[0] == "speedrun":
        from tritonllm.bench.speedrun import main as bench_speedrun

        bench_speedrun(argv[1:])
    elif argv[0] == "decode":
        from tritonllm.bench.decode import main as bench_decode

        bench_decode(argv[1:])
    elif argv[0] == "finetune":
        from tritonllm.bench.finetune import main as bench_finetune

        bench_finetune(argv[1:])
    else:
        from tritonllm.bench.train import main as bench_train

        bench_train(argv[1:])


if __name__ == "__main__":
    main()
