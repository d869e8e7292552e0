"""Render docs/perf/<kind>-<gpu>.json as the markdown tables the README quotes.

Usage: python scripts/perf_table.py docs/perf/kernels-h200.json docs/perf/train-h200.json docs/perf/kernels-h100.json docs/perf/train-h100.json > docs/perf/TABLE.md
(train files: one line per side of each step row, the multi-GPU rows (nproc > 1) as a scaling table,
and the speedrun rows as time to the target per side)
"""

import json
import sys


def commits(doc: dict) -> str:
    """The commit(s) the rows were measured at: the document's, or each row's with its ops."""
    ops: dict[str, list[str]] = {}
    for r in doc["results"]:
        names = ops.setdefault(r.get("commit", doc["commit"]), [])
        name = r.get("op") or r.get("model")
        if name not in names:
            names.append(name)
    if len(ops) == 1:
        return f"commit {next(iter(ops))}"
    return "commits " + "; ".join(f"{c} ({', '.join(names)})" for c, names in ops.items())


def kernel_rows(doc: dict) -> list[str]:
    out = [f"GPU: {doc['gpu']}, torch {doc['torch']}, triton {doc['triton']}, {commits(doc)}, {doc['date']}; "
           f"device-to-device copy {doc.get('copy_GB/s', '?')} GB/s.", "",
           "| op | shape | pass | ours ms | rate | baselines ms | x best |", "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if "GB/s" in r:
            rate = f"{r['GB/s']:.0f} GB/s" + (f" ({r['copy_fraction']:.0%} of copy)" if "copy_fraction" in r else "")
        elif "TFLOP/s" in r:
            rate = f"{r['TFLOP/s']:.0f} TFLOP/s"
        else:
            rate = ""
        backend = r.get("baselines_backend", {})
        base = ", ".join(f"{k}{f' ({backend[k]})' if k in backend else ''} {v:.3f}"
                         for k, v in r.get("baselines_ms", {}).items())
        if "peak_mem_gb" in r:
            mem = ", ".join(f"{k} {v:.3f}" for k, v in r.get("baselines_peak_mem_gb", {}).items())
            rate += f"; peak {r['peak_mem_gb']:.3f} GB (baselines: {mem})"
        if "share" in r:
            rate += "; " + ", ".join(f"{g} {v:.0%} of {r['gpu_ms']:.3f} GPU ms" for g, v in r["share"].items())
        best = f"{r['speedup_vs_best']:.2f}" if "speedup_vs_best" in r else "-"
        out.append(f"| {r['op']} | {r['shape']} | {r['pass']} | {r['ms']:.3f} | {rate} | {base} | {best} |")
    return out


def fastest_baseline(row: dict) -> str:
    """The name of the row's fastest timed baseline (recorded by the train bench, found for others)."""
    timed = {k: v["step_ms"] for k, v in row.get("baselines", {}).items() if "step_ms" in v}
    return row.get("fastest_baseline") or min(timed, key=timed.__getitem__, default="?")


def train_rows(doc: dict) -> list[str]:
    """One line per side: tritonllm graphed and eager, compiled (eager and graphed, the eager one with its
    interleaved step-time ratio to the uncompiled eager step), then each baseline; wall, GPU kernel and host ms."""
    out = [f"GPU: {doc['gpu']}, host CPU: {doc.get('host_cpu', '?')}, {commits(doc)}. Host ms marked * "
           "outlasted the GPU work queued before the step (the launch queue filled up), so they include waiting.", "",
           "| model | batch x seq | side | tokens/s | MFU | step ms (wall) | GPU ms | host ms | peak GB | speedup |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        sides = [("tritonllm, CUDA graph" if r.get("cuda_graph") else "tritonllm", r)]
        sides += [("tritonllm, eager", r["eager"])] if "eager" in r else []
        sides += [(f"tritonllm compiled, {'CUDA graph' if kind == 'graphed' else kind}"
                   + (f" (earlier run, {f['commit']})" if f.get("commit", r.get("commit")) != r.get("commit") else ""), f)
                  for kind, f in r.get("compiled", {}).items()]
        sides += [(f"PyTorch {name}", f) for name, f in r.get("baselines", {}).items()]
        for name, f in sides:
            if "step_ms" not in f:
                out.append(f"| {r['model']} | {r['batch']} x {r['seq_len']} | {name} | failed: {f.get('error', '?')} |")
                continue
            speedup = f"{r['speedup']:.3f} vs {fastest_baseline(r)}" if f is r and r.get("speedup") else ""
            if "vs_uncompiled_interleaved" in f:
                ab = f["vs_uncompiled_interleaved"]
                speedup = (f"{ab['ratio']:.3f} x eager's step time (median of {ab['rounds']} interleaved rounds, "
                           f"{ab['min']:.3f}-{ab['max']:.3f})")
            out.append(f"| {r['model']} | {r['batch']} x {r['seq_len']} | {name} | {f['tokens_per_s']:.0f} | "
                       f"{f['mfu']:.1%} | {f['step_ms']:.2f} | {f.get('gpu_ms', float('nan')):.2f} | "
                       f"{f.get('host_ms', float('nan')):.2f}{'*' if f.get('host_waited') else ''} | "
                       f"{f['peak_mem_gb']:.1f} | {speedup} |")
    return out


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def scaling_rows(doc: dict) -> list[str]:
    """One line per multi-GPU row (``python -m tritonllm.bench train --nproc``): per-GPU tokens/s, MFU and
    scaling efficiency (against one GPU) of ours and of the baseline parallelised alike, and the speedup."""
    out = ["| model | GPUs | mode | per GPU batch x seq | ours tok/s/GPU | MFU | scaling | peak GB | comm ms | "
           "baseline | baseline tok/s/GPU | baseline scaling | speedup | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if r.get("nproc", 1) < 2:
            continue
        name, base = next(iter(r.get("baselines", {}).items()), ("-", {}))
        ours = (f"{r['tokens_per_s_per_gpu']:,} | {r['mfu']:.1%} | {_num(r.get('scaling_efficiency'), '.3f')} | "
                f"{_num(r.get('peak_mem_gb'), '.1f')} | {_num(r.get('comm_ms'), '.1f')}"
                if "tokens_per_s_per_gpu" in r else f"failed: {r.get('error', '?')} | | | |")
        theirs = (f"{base['tokens_per_s_per_gpu']:,} | {_num(base.get('scaling_efficiency'), '.3f')}"
                  if "tokens_per_s_per_gpu" in base else f"{base.get('error', '-')[:60]} | -")
        note = r.get("note", "")
        note = note[:80] + "..." if len(note) > 80 else note
        parts = [note] if note else []
        if r.get("speedup_rounds"):
            parts.append(f"speedup per round (paired): {' / '.join(_num(x, '.3f') for x in r['speedup_rounds'])}")
        if r.get("ab"):
            parts.append(f"with {r['ab']['env']}: {_num(r['ab'].get('gain'), '.3f')}x our default's speed")
        note = "; ".join(parts)
        out.append(f"| {r['model']} | {r['nproc']} | {r['parallel']} | {r['batch']} x {r['seq_len']} | {ours} | "
                   f"{name} | {theirs} | {_num(r.get('speedup'), '.3f')} | {note} |")
    return out


def speedrun_rows(doc: dict) -> list[str]:
    """One line per side of each ``python -m tritonllm.bench speedrun`` row: time, steps and tokens to the
    target; then the comparison and the data it trained on."""
    out = ["| model | batch x seq | side | target | reached | steps | tokens | seconds | tokens/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if r.get("pass") != "speedrun":
            continue
        for name, f in r["sides"].items():
            out.append(f"| {r['model']} | {r['batch']} x {r['seq_len']} | {name} | {f['target']} | {f['reached']} | "
                       f"{f['steps']} | {f['tokens']} | {f['seconds']:.1f} | {f['tokens_per_s']:.0f} |")
        out.append(f"| | | recipe / adamw time {r['time_ratio_recipe_vs_adamw']:.3f}, "
                   f"recipe vs torch {r['speedup_vs_torch']:.2f}x | | | | | | |")
        if "corpus" in r:  # the data it trained on (rows written before it was recorded lack it)
            c = r["corpus"]
            out.append(f"| | | data: {c['name']}, {c['files']} files, {c['train_tokens']} training tokens, sha256 "
                       f"{c['sha256'][:16]}, {c['passes']} passes | | | | | | |")
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if "train-" in path:
            steps = [r for r in doc["results"] if r.get("pass") != "speedrun" and r.get("nproc", 1) < 2]
            rows = train_rows({**doc, "results": steps}) if steps else []
            if any(r.get("nproc", 1) > 1 for r in doc["results"]):
                rows += ["", f"Several GPUs of one host ({doc.get('multi_gpu', 'python -m tritonllm.bench train --nproc')}):",
                         ""] + scaling_rows(doc)
            if any(r.get("pass") == "speedrun" for r in doc["results"]):
                rows += ([""] if rows else []) + [f"GPU: {doc['gpu']}, host CPU: {doc.get('host_cpu', '?')}."] + \
                    [""] + speedrun_rows(doc)
        else:
            rows = kernel_rows(doc)
        print("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
