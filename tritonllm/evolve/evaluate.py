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

- ``warm_start`` (``evolve.warm_start``): null, or ``{"weights": <parent's weights.safetensors>,
  "parent_model": <its model config>, "parent_trial": n}``: the candidate starts from its parent's
  trained weights grown to its own shape (:func:`tritonllm.evolve.grow.grow`: same logits as the
  parent before the first step). :func:`warm_start_checkpoint` writes them as a step-0 checkpoint
  (fresh optimizer state, the data position of a fresh run) in ``folder/warm_start``, and the run
  resumes from it (``trainer.resume``), so the trainer checks the grown weights as any checkpoint
  (shapes against the candidate's model, finite values); the folder is removed after training;
- ``save_weights``: keep the trained weights as ``folder/weights.safetensors`` (the final
  checkpoint's ``model.safetensors``), for the candidate's own children to grow from.

It returns ``val_loss`` (what ``train`` returns), ``tokens_per_s`` (training tokens over training
time, the first log window left out when there are more: it holds compilation and CUDA-graph
capture), ``peak_mem_gb`` (``torch.cuda.max_memory_allocated`` on a GPU; on the CPU the process's
peak resident set, interpreter and libraries included: ``peak_mem_kind`` says which), ``device``
(the GPU's name, or ``cpu``), ``params``, ``active_params``, ``tokens`` and ``steps`` trained, and
for a warm start ``growth`` (the steps from the parent's shape). A non-finite validation loss
raises (the candidate diverged), as do the trainer's own errors (too many non-finite steps in a
row, ...).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import threading
import time
import uuid

from tritonllm.errors import TrainingError

#: seconds between checks for the trainer's start while a time budget waits
_POLL_S = 0.2
#: a candidate's trained weights in its folder (``save_weights``); the step-0 checkpoint of a warm start
WEIGHTS, WARM_DIR = "weights.safetensors", "warm_start"


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


def warm_start_checkpoint(cfg, warm: dict, folder: str) -> tuple[str, list[str]]:
    """Grow the parent's weights (``warm``, see module docstring) to the model of the run config
    ``cfg`` and write them as a step-0 checkpoint in ``folder/warm_start``: fresh optimizer state (as
    the run builds it: its master-weight setting follows ``trainer.dtype``), the training loader's
    position before its first batch. Returns the checkpoint's path and the growth steps."""
    import torch
    from safetensors.torch import load_file

    from tritonllm.checkpoint import save_checkpoint
    from tritonllm.data import load_corpus
    from tritonllm.evolve.grow import grow, growth_steps
    from tritonllm.models import build_model
    from tritonllm.models.config import ModelConfig
    from tritonllm.runtime import resolve_device, resolve_dtype
    from tritonllm.train.loop import build_optimizer

    parent, child = ModelConfig.from_dict(warm["parent_model"]), ModelConfig.from_dict(cfg.model)
    steps = growth_steps(parent, child)
    torch.manual_seed(cfg.seed)
    model = build_model(child)
    model.load_state_dict(grow(load_file(warm["weights"]), parent, child, seed=cfg.seed), strict=True)
    tr, master = cfg.trainer, cfg.optim.master_weights
    dtype = resolve_dtype(tr.dtype, resolve_device(cfg.device))
    optimizer = build_optimizer(model, cfg.optim, dtype != torch.float32 if master == "auto" else bool(master))
    loader, _ = load_corpus(cfg.data).loaders(tr.batch_size, tr.seq_len, cfg.seed, child.vocab_size)
    state = {"data": loader.state_dict(), "model_config": child.to_dict(), "tokens_seen": 0, "bad_steps": 0,
             "tokens_per_step": tr.batch_size * tr.seq_len * tr.grad_accum}
    path = save_checkpoint(os.path.join(folder, WARM_DIR), 0, model, optimizer, state, run_id=uuid.uuid4().hex[:12])
    return path, steps


def evaluate_candidate(payload: dict, folder: str) -> dict:
    """Train the candidate ``payload`` describes in ``folder/run``; its metrics (see module docstring)."""
    import torch
    from omegaconf import OmegaConf

    from tritonllm.checkpoint import MODEL_FILE, list_checkpoints
    from tritonllm.models.config import ModelConfig
    from tritonllm.runtime import resolve_device
    from tritonllm.train import train

    cfg = OmegaConf.create(payload["config"])
    device = resolve_device(cfg.device)
    if device.type == "cuda" and payload.get("gpu_memory_gb"):
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory / 1e9
        torch.cuda.set_per_process_memory_fraction(min(1.0, payload["gpu_memory_gb"] / total), index)
    run_dir = str(cfg.out_dir)
    os.makedirs(run_dir, exist_ok=True)
    warm = payload.get("warm_start")
    if warm:
        path, growth = warm_start_checkpoint(cfg, warm, folder)
        logging.getLogger("tritonllm.evolve").info("warm start from trial %s: %s", warm["parent_trial"],
                                                   ", ".join(growth))
        cfg.trainer.resume = path
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
        shutil.rmtree(os.path.join(folder, WARM_DIR), ignore_errors=True)
    wall = time.perf_counter() - t0
    if not math.isfinite(val_loss):
        raise TrainingError(f"diverged: validation loss {val_loss}")
    tok_s, tokens, steps = training_throughput(os.path.join(run_dir, "metrics.jsonl"))
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device) / 1e9, "cuda_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "host_rss"  # KiB on Linux
    if payload.get("save_weights"):
        final = list_checkpoints(str(cfg.trainer.ckpt_dir))[-1][1]
        shutil.copyfile(os.path.join(final, MODEL_FILE), os.path.join(folder, WEIGHTS))
    model = ModelConfig.from_dict(cfg.model)
    return {"val_loss": val_loss, "tokens_per_s": tok_s, "peak_mem_gb": peak, "peak_mem_kind": kind,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "params": model.param_count(), "active_params": model.param_count(active=True), "tokens": tokens,
            "steps": steps, "train_wall_s": wall, **({"growth": growth} if warm else {})}
