"""Render docs/perf/<kind>-<gpu>.json as the markdown tables the README quotes.

Usage: python scripts/perf_table.py docs/perf/kernels-h200.json [docs/perf/train-h200.json] > docs/perf/TABLE.md
"""

import json
import sys


def kernel_rows(doc: dict) -> list[str]:
    out = [f"GPU: {doc['gpu']}, torch {doc['torch']}, triton {doc['triton']}, commit {doc['commit']}, {doc['date']}; "
           f"device-to-device copy {doc.get('copy_GB/s', '?')} GB/s.", "",
           "| op | shape | pass | ours ms | rate | baselines ms | x best |", "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if "GB/s" in r:
            rate = f"{r['GB/s']:.0f} GB/s" + (f" ({r['copy_fraction']:.0%} of copy)" if "copy_fraction" in r else "")
        elif "TFLOP/s" in r:
            rate = f"{r['TFLOP/s']:.0f} TFLOP/s"
        else:
            rate = ""
        base = ", ".join(f"{k} {v:.3f}" for k, v in r.get("baselines_ms", {}).items())
        if "peak_mem_gb" in r:
            mem = ", ".join(f"{k} {v:.3f}" for k, v in r.get("baselines_peak_mem_gb", {}).items())
            rate += f"; peak {r['peak_mem_gb']:.3f} GB (baselines: {mem})"
        if "share" in r:
            rate += "; " + ", ".join(f"{g} {v:.0%} of {r['gpu_ms']:.3f} GPU ms" for g, v in r["share"].items())
        best = f"{r['speedup_vs_best']:.2f}" if "speedup_vs_best" in r else "-"
        out.append(f"| {r['op']} | {r['shape']} | {r['pass']} | {r['ms']:.3f} | {rate} | {base} | {best} |")
    return out


def train_rows(doc: dict) -> list[str]:
    out = [f"GPU: {doc['gpu']}, commit {doc['commit']}.", "",
           "| model | batch x seq | tokens/s | MFU | peak GB | torch.compile tokens/s | torch.compile peak GB | speedup | triton share |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        out.append(f"| {r['model']} | {r['batch']} x {r['seq_len']} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | "
                   f"{r['peak_mem_gb']:.1f} | {r.get('baseline_compile_tokens_per_s', float('nan')):.0f} | "
                   f"{r.get('baseline_peak_mem_gb', float('nan')):.1f} | {r.get('speedup', float('nan')):.2f} | "
                   f"{r.get('triton_share', float('nan')):.1%} |")
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        rows = train_rows(doc) if "train-" in path else kernel_rows(doc)
        print("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
