"""Stand-in evaluators for tests/test_evolve.py, run in the sandbox's child process: fast (no
training, no torch) and misbehaving on purpose for some candidates."""

import math
import os
import signal
import subprocess
import time


def _metrics(model: dict) -> dict:
    params = model["n_layers"] * model["d_model"] * (model["d_ff"] + 4 * model["d_model"])
    return {"val_loss": 10.0 / (1 + model["n_layers"]) + 1.0 / model["d_model"], "tokens_per_s": 1e6 / params,
            "peak_mem_gb": params * 16 / 1e9, "params": params, "active_params": params}


def fake(payload: dict, folder: str) -> dict:
    """Metrics from the model's size alone."""
    return _metrics(payload["config"]["model"])


def misbehaving(payload: dict, folder: str) -> dict:
    """By layer count: 2 raises, 3 kills itself, 6 diverges (NaN loss), 4 hangs; others as :func:`fake`.
    Leaves a checkpoint folder behind first, as a training run would."""
    model = payload["config"]["model"]
    os.makedirs(os.path.join(payload["config"]["out_dir"], "checkpoints", "step_00000001"))
    n = model["n_layers"]
    if n == 2:
        raise RuntimeError("CUDA out of memory (simulated)")
    if n == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if n == 4:
        time.sleep(60)
    metrics = _metrics(model)
    if n == 6:
        metrics["val_loss"] = math.nan
    return metrics


def training_forever(payload: dict, folder: str) -> dict:
    """A candidate that never ends, with a child process of its own (as a data loader's worker would
    be); writes ``pids.txt`` (its pid and the child's) in ``folder`` once both run."""
    child = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(folder, "pids.tmp"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(os.path.join(folder, "pids.tmp"), os.path.join(folder, "pids.txt"))
    time.sleep(600)
    return {}
