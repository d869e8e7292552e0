"""FP8 loss parity: the same model trained in bf16 and in FP8 (``trainer.precision``) from the same seed (the
same init and the same batches, in the same order), validation loss compared along the way.

Both runs are ``python -m tritonllm.train`` with the overrides given after ``--`` (the data among them: real
text, e.g. ``data=stdlib data.packages=true data.max_bytes=300000000``, or FineWeb shards with ``data=bin``),
one after the other (the second reuses the first's tokenized corpus). Written to
``<out>/fp8-parity-<model>-<gpu>.json``: ``{"gpu", "host_cpu", "commit", "model", "steps", "overrides", "data" (the run's "data: ..." log line),
"curves": {"bf16": [[step, val_loss]...], "fp8": [...]}, "train_curves": {...}, "final": {"bf16", "fp8"},
"ratio" (fp8 / bf16 final), "max_gap" (largest |fp8 / bf16 - 1| at a common validation step),
"diverged" (a non-finite loss or the last FP8 validation loss above its first), "within_1pct"}``; the curves
plotted beside it as a PNG when matplotlib is there.

    python scripts/fp8_parity.py --model void125m --steps 2000 [--out docs/perf] -- data=stdlib data.packages=true
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

PRECISIONS = ("bf16", "fp8")


def read_curves(run_dir: Path) -> tuple[list[list[float]], list[list[float]]]:
    """(validation [[step, loss]], training [[step, loss]]) from a run's ``metrics.jsonl``."""
    val, train = [], []
    with open(run_dir / "metrics.jsonl") as f:
        for rec in map(json.loads, f):
            if rec.get("kind") == "val":
                val.append([rec["step"], rec["val_loss"]])
            elif rec.get("kind") == "train" and "loss" in rec:
                train.append([rec["step"], rec["loss"]])
    return val, train


def summarize(curves: dict[str, list[list[float]]]) -> dict:
    """The comparison of the bf16 and fp8 validation curves (the module docstring's fields)."""
    bf16, fp8 = curves["bf16"], curves["fp8"]
    if not bf16 or not fp8:
        raise ValueError("a run logged no validation loss: set trainer.eval_interval below --steps")
    common = sorted(set(s for s, _ in bf16) & set(s for s, _ in fp8))
    ref, got = dict((s, v) for s, v in bf16), dict((s, v) for s, v in fp8)
    gaps = [abs(got[s] / ref[s] - 1) for s in common if math.isfinite(got[s]) and ref[s] > 0]
    final = {"bf16": bf16[-1][1], "fp8": fp8[-1][1]}
    diverged = (not all(math.isfinite(v) for _, v in fp8)) or fp8[-1][1] > fp8[0][1]
    ratio = final["fp8"] / final["bf16"]
    return {"final": final, "ratio": round(ratio, 5), "max_gap": round(max(gaps), 5) if gaps else None,
            "diverged": diverged, "within_1pct": (not diverged) and abs(ratio - 1) <= 0.01}


def plot(doc: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in doc["curves"].items():
        ax.plot([s for s, _ in curve], [v for _, v in curve], label=f"{name} (final {curve[-1][1]:.4f})")
    ax.set(xlabel="step", ylabel="validation loss", title=f"{doc['model']} bf16 vs fp8, {doc['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(prog="python scripts/fp8_parity.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="void125m")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--out", default="docs/perf")
    p.add_argument("--work", default="/tmp/tritonllm-fp8-parity")
    p.add_argument("overrides", nargs="*", help="after --: Hydra overrides of both runs (the data)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("scripts/fp8_parity.py needs a CUDA GPU with fp8 tensor cores")
    from tritonllm.bench.common import host_cpu_model
    from tritonllm.bench.harness import gpu_slug

    curves, train_curves, data = {}, {}, None
    for precision in PRECISIONS:
        run_dir = Path(args.work) / precision
        cmd = [sys.executable, "-m", "tritonllm.train", f"+model={args.model}", f"trainer.precision={precision}",
               f"trainer.max_steps={args.steps}", f"trainer.eval_interval={args.eval_interval}",
               "trainer.ckpt_interval=null", "trainer.progress=false", f"hydra.run.dir={run_dir}", *args.overrides]
        print("$", " ".join(cmd), flush=True)
        log = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write(log.stdout[-3000:] + log.stderr[-3000:])
        if log.returncode:
            sys.exit(f"the {precision} run failed (rc {log.returncode})")
        curves[precision], train_curves[precision] = read_curves(run_dir)
        data = data or next((line.split(" - data: ", 1)[1] for line in (log.stderr + log.stdout).splitlines()
                             if " - data: " in line), None)
    commit = os.environ.get("TRITONLLM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"gpu": torch.cuda.get_device_name(), "host_cpu": host_cpu_model(), "commit": commit, "model": args.model,
           "steps": args.steps, "overrides": args.overrides, "data": data, "curves": curves,
           "train_curves": train_curves, **summarize(curves)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fp8-parity-{args.model}-{gpu_slug()}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, path.with_suffix(".png"))
    print(f"wrote {path}: final val loss bf16 {doc['final']['bf16']:.4f}, fp8 {doc['final']['fp8']:.4f} "
          f"(ratio {doc['ratio']}), within 1%: {doc['within_1pct']}")
    return 0 if doc["within_1pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
