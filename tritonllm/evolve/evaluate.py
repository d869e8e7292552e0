"""The default evaluator: train one candidate with ``tritonllm.train.train`` inside the sandbox.

``evaluate_candidate(payload, folder)`` runs in the candidate's own process
(:mod:`tritonllm.evolve.sandbox`). ``payload``:

- ``config``: the candidate's whole training config (``conf/train.yaml`` resolved, with its model,
  ``optim.lr`` and, for a token budget, ``trainer.max_steps`` already set);
- ``budget_s``: a time budget in seconds, or null. The deadline starts at the run's first
  training record in ``metrics.jsonl`` (after the first log window: data loading, model build,
  kernel compilation and autotuning and CUDA-graph capture, which differ between shapes, are not
  counted; the window's steps are, as a small equal head start); when it passes, a stop request
  goes to the trainer through its Studio control file, which it reads at each log interval,
  checkpoints and stops; the validation loss is then measured on the weights it stopped with;
- ``gpu_memory_gb``: on a CUDA device, the allocator is capped at this much
  (``torch.cuda.set_per_process_memory_fraction``), so a candidate over the memory cap fails with
  an out-of-memory error instead of succeeding on a larger GPU than the cap describes.

It returns ``val_loss`` (what ``train`` returns), ``tokens_per_s`` (training tokens over training
time, the first log window left out when there are more: it holds compilation and CUDA-graph
capture), ``peak_mem_gb`` (``torch.cuda.max_memory_allocated`` on a GPU; on the CPU the process's
peak resident set, interpreter and libraries included: ``peak_mem_kind`` says which), ``params``,
``active_params``, ``tokens`` and ``steps`` trained. A non-finite validation loss raises (the
candidate diverged), as do the trainer's own errors (too many non-finite steps in a row, ...).
"""

from __future__ import annotations

import json
import math
import os
import resource
import threading
import time

from tritonllm.errors import TrainingError

#: seconds between checks for the trainer's start while a time budget waits
_POLL_S = 0.2


def _first_log_written(metrics_path: str) -> bool:
    try:
        with open(metrics_path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            if json.loads(line).get("kind") == "train":
                return True
        except json.JSONDecodeError:  # a line being written
            return False
    return False


def _stop_after(run_dir: str, budget_s: float, done: threading.Event) -> None:
    """Once the run in ``run_dir`` has logged its first training record, wait ``budget_s`` seconds
    and ask the trainer to stop (through its Studio control file)."""
    from tritonllm.studio.hooks import CONTROL_FILE

    while not _first_log_written(os.path.join(run_dir, "metrics.jsonl")):
        if done.wait(_POLL_S):
            return
    if done.wait(budget_s):
        return
    tmp = os.path.join(run_dir, CONTROL_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"stop": True}, f)
    os.replace(tmp, os.path.join(run_dir, CONTROL_FILE))


def training_throughput(metrics_path: str) -> tuple[float, int, int]:
    """``(tokens/s, tokens, steps)`` from a run's ``metrics.jsonl`` (first log window left out when
    there are others: compilation and graph capture)."""
    with open(metrics_path) as f:
        records = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    if not records:
        raise TrainingError(f"{metrics_path} holds no training record")
    windows, prev = [], 0
    for r in records:
        windows.append((r["tokens"] - prev, r["tokens_per_s"]))
        prev = r["tokens"]
    timed = windows[1:] if len(windows) > 1 else windows
    seconds = sum(tok / rate for tok, rate in timed if rate > 0)
    return sum(tok for tok, _ in timed) / seconds, records[-1]["tokens"], records[-1]["step"]


def evaluate_candidate(payload: dict, folder: str) -> dict:
    """Train the candidate ``payload`` describes in ``folder/run``; its metrics (see module docstring)."""
    import torch
    from omegaconf import OmegaConf

    from tritonllm.models.config import ModelConfig
    from tritonllm.runtime import resolve_device
    from tritonllm.train import train

    cfg = OmegaConf.create(payload["config"])
    device = resolve_device(cfg.device)
    if device.type == "cuda" and payload.get("gpu_memory_gb"):
        total = torch.cuda.get_device_properties(device).total_memory / 1e9
        torch.cuda.set_per_process_memory_fraction(min(1.0, payload["gpu_memory_gb"] / total), device)
    run_dir = str(cfg.out_dir)
    os.makedirs(run_dir, exist_ok=True)
    done = threading.Event()
    timer = None
    if payload.get("budget_s"):
        timer = threading.Thread(target=_stop_after, args=(run_dir, float(payload["budget_s"]), done), daemon=True)
        timer.start()
    t0 = time.perf_counter()
    try:
        val_loss = float(train(cfg))
    finally:
        done.set()
        if timer is not None:
            timer.join()
    wall = time.perf_counter() - t0
    if not math.isfinite(val_loss):
        raise TrainingError(f"diverged: validation loss {val_loss}")
    tok_s, tokens, steps = training_throughput(os.path.join(run_dir, "metrics.jsonl"))
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device) / 1e9, "cuda_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "host_rss"  # KiB on Linux
    model = ModelConfig.from_dict(cfg.model)
    return {"val_loss": val_loss, "tokens_per_s": tok_s, "peak_mem_gb": peak, "peak_mem_kind": kind,
            "params": model.param_count(), "active_params": model.param_count(active=True), "tokens": tokens,
            "steps": steps, "train_wall_s": wall}
