"""Run logging: ``metrics.jsonl``, ``run_info.json``, ``loss.png`` in the run folder, and W&B.

Every run writes, in its folder:

- ``run_info.json``: the resolved config, the git commit of the tritonllm checkout (and whether it
  had local changes), library versions, the device and the command line;
- ``metrics.jsonl``: one JSON object per line, ``{"kind": "train" | "val" | "skip", "step": ..., ...}``,
  strict JSON (a NaN or an infinity is written as null; W&B gets the numbers as they are);
- ``loss.png``: training and validation loss against step (matplotlib, Agg), redrawn at the end.

``logger=wandb`` also logs to Weights & Biases (``wandb`` is imported only then; ``logger.mode``
offline by default). Under a Hydra multirun each job is its own W&B run, grouped by the sweep.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata

from tritonllm.errors import ConfigError, MissingExtraError, import_extra

log = logging.getLogger(__name__)

PACKAGES = ("tritonllm", "torch", "triton", "numpy", "sentencepiece", "safetensors", "hydra-core", "omegaconf")


def git_info() -> dict:
    """Commit and dirty flag of the git checkout tritonllm is imported from (empty when not in one)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode:
            return {}
        return {"commit": head.stdout.strip(), "dirty": bool(git("status", "--porcelain", "-uno").stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {}


def library_versions() -> dict:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_metadata(device_name: str) -> dict:
    return {"git": git_info(), "versions": library_versions(), "device": device_name,
            "host": socket.gethostname(), "argv": sys.argv}


def hydra_job() -> dict:
    """``{"sweep": <sweep folder name>, "job": <job number>}`` of the Hydra multirun job we run in, else ``{}``."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return {}
        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return {}
        return {"sweep": os.path.basename(os.path.normpath(hc.sweep.dir)), "job": str(hc.job.num)}
    except Exception:  # Hydra absent or not configured: not a multirun job
        return {}


def json_safe(value):
    """``value`` with every non-finite float (in dicts, lists and tuples too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def rewind_metrics(path: str, step: int) -> None:
    """Drop the records after ``step`` and the ``kind: end`` records from ``metrics.jsonl`` at
    ``path`` (a run resumed at ``step`` logs those steps again: one record per step stays); the
    file is replaced atomically. Nothing happens when it does not exist."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if record.get("kind") != "end" and not (isinstance(record.get("step"), int) and record["step"] > step):
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


class RunLogger:
    """Writes the run's metrics and metadata; ``log(record)`` per event, ``close()`` at the end."""

    def __init__(self, out_dir: str, name: str, config: dict, logger_cfg, device_name: str):
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl")
        info = {"name": name, "config": config, **run_metadata(device_name)}
        with open(os.path.join(out_dir, "run_info.json"), "w") as f:
            json.dump(info, f, indent=1, default=str)
        self._file = open(self.metrics_path, "a")
        self.wandb = None
        if logger_cfg.backend == "wandb":
            self.wandb = self._init_wandb(name, info, logger_cfg)
        elif logger_cfg.backend != "local":
            raise ConfigError(f"logger.backend={logger_cfg.backend!r} is not one of local, wandb")

    def _init_wandb(self, name: str, info: dict, cfg):
        wandb = import_extra("wandb", "wandb", "logger.backend=wandb")

        job = hydra_job()
        group = cfg.group or (f"{name}-{job['sweep']}" if job else None)
        run_name = f"{name}-{job['job']}" if job else name
        run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, group=group, name=run_name,
                         tags=list(cfg.tags), dir=self.out_dir, config=info)
        log.info("W&B run %s (%s mode)%s", run_name, cfg.mode, f", group {group}" if group else "")
        return run

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._file.flush()
        if self.wandb is not None:
            kind = record["kind"]
            self.wandb.log({f"{kind}/{k}": v for k, v in record.items() if k not in ("kind", "step")},
                           step=record["step"])

    def close(self) -> None:
        self._file.close()
        try:
            plot_losses(self.metrics_path, os.path.join(self.out_dir, "loss.png"))
        except MissingExtraError as e:
            log.info("loss.png not written: %s", e)
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class NullLogger:
    """A :class:`RunLogger` that writes nothing: the ranks other than 0 of a multi-process run."""

    wandb = None

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def plot_losses(metrics_path: str, png_path: str) -> None:
    """Training loss and validation loss against step from ``metrics.jsonl`` into ``png_path``
    (a :class:`~tritonllm.errors.MissingExtraError` without matplotlib: the ``plot`` extra)."""
    matplotlib = import_extra("matplotlib", "plot", "the loss plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = [], []
    with open(metrics_path) as f:
        for line in f:
            r = json.loads(line)
            if r["kind"] == "train":
                train.append((r["step"], math.nan if r["loss"] is None else r["loss"]))
            elif r["kind"] == "val":
                val.append((r["step"], math.nan if r["val_loss"] is None else r["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
