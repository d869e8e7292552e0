"""The trainer's side of Studio: what ``train(cfg)`` writes and reads in its run folder.

- ``studio.json``: the trainer's pid and host (the server tells a running trainer from a dead one)
  and the model's parameter table (name, shape, dtype, count);
- ``studio_token``: a random token, readable by the run's owner only (mode 0600); a control
  request to the Studio server must carry it;
- ``control.json``: written by the Studio server, read by the trainer at each log interval
  (one ``os.stat``; the file is read only when it changed):
  ``{"stop": bool, "checkpoint": n, "lr_scale": x}`` — stop after a checkpoint, checkpoint now
  (each increase of ``n`` asks for one), multiply the scheduled learning rate by ``x``;
- ``metrics.jsonl`` records: ``kind: control`` for each request carried out, ``kind: sample`` for
  each generated sample, ``kind: end`` with the run's ``status`` (finished, stopped, failed) last;
  the GPU telemetry (NVML through ``nvidia-ml-py``, imported only on a CUDA device) goes into each
  ``kind: train`` record as ``gpu_mem_gb``, ``gpu_mem_total_gb``, ``gpu_util``, ``gpu_temp_c``,
  ``gpu_power_w``.

Nothing here runs per step: :meth:`RunHooks.poll` and :meth:`RunHooks.telemetry` are called at
the log interval only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import time

import torch

log = logging.getLogger("tritonllm.studio")

STUDIO_FILE, TOKEN_FILE, CONTROL_FILE = "studio.json", "studio_token", "control.json"
#: the learning-rate multiplier a control request may set
LR_SCALE_RANGE = (0.0, 10.0)


def write_token(out_dir: str) -> str:
    """A fresh control token in ``<out_dir>/studio_token``, created with mode 0600; returns it."""
    token = secrets.token_hex(16)
    path = os.path.join(out_dir, TOKEN_FILE)
    if os.path.exists(path):
        os.remove(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def parameter_table(model: torch.nn.Module) -> list[dict]:
    """``[{"name", "shape", "dtype", "numel"}]`` for every parameter of ``model``."""
    return [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""), "numel": p.numel()}
            for n, p in model.named_parameters()]


class GpuTelemetry:
    """Memory, utilisation, temperature and power of one CUDA device through NVML.

    ``nvidia-ml-py`` is imported on first use; when it is missing or NVML cannot start, one log line
    says so and :meth:`read` returns ``{}`` from then on. A query the GPU does not support (power on
    some boards, utilisation under MIG) is dropped after its first failure, with one log line.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._queries: dict | None = None  # name -> () -> {field: value}; None until NVML started

    def _start(self) -> dict:
        try:
            import pynvml as nv
        except ImportError:
            log.info("GPU telemetry off: nvidia-ml-py is not installed (pip install 'tritonllm[studio]')")
            return {}
        try:
            nv.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            h = nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        except Exception as e:  # NVML absent from the driver, or a device NVML does not list
            log.info("GPU telemetry off: NVML could not start (%s: %s)", type(e).__name__, e)
            return {}

        def memory():
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            return {"gpu_mem_gb": mem.used / 1e9, "gpu_mem_total_gb": mem.total / 1e9}

        return {"memory": memory,
                "utilisation": lambda: {"gpu_util": nv.nvmlDeviceGetUtilizationRates(h).gpu},
                "temperature": lambda: {"gpu_temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)},
                "power": lambda: {"gpu_power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0}}

    def read(self) -> dict:
        if self._queries is None:
            self._queries = self._start()
        out = {}
        for name, query in list(self._queries.items()):
            try:
                out.update(query())
            except Exception as e:  # not supported on this GPU: stop asking
                log.info("GPU telemetry: no %s from NVML (%s: %s)", name, type(e).__name__, e)
                del self._queries[name]
        return out


class RunHooks:
    """Studio's files in the run folder ``out_dir``; ``run_log`` is the run's :class:`RunLogger`.

    ``lr_scale`` is the multiplier the last control request set (1.0 until one does).
    Under several processes only the ``main`` one (rank 0) writes and reads the files and reads
    NVML; ``share(obj)`` hands rank 0's ``obj`` to every rank (a broadcast, called by every rank at
    each poll), so that all ranks stop, checkpoint and scale the learning rate at the same step.
    """

    def __init__(self, out_dir: str, run_log, model: torch.nn.Module, device: torch.device, *,
                 telemetry: bool = True, control: bool = True, main: bool = True, share=None):
        self.out_dir, self.run_log = out_dir, run_log
        self.lr_scale = 1.0
        self.control, self.main = control, main
        self.share = share or (lambda obj: obj)
        self.control_path = os.path.join(out_dir, CONTROL_FILE)
        self._seen: tuple | None = None
        self._checkpoints_done = 0
        self._last_sample: tuple[int, str] | None = None  # (step, text)
        self._gpu = GpuTelemetry(device) if telemetry and main and device.type == "cuda" else None
        if not main:
            return
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "control": control,
                "params": parameter_table(model)}
        with open(os.path.join(out_dir, STUDIO_FILE), "w") as f:
            json.dump(info, f)
        if control:
            if os.path.exists(self.control_path):  # requests left by an earlier run in this folder
                os.remove(self.control_path)
            write_token(out_dir)

    def telemetry(self) -> dict:
        """The GPU's NVML figures for a ``kind: train`` record (``{}`` off a GPU or without NVML)."""
        return self._gpu.read() if self._gpu is not None else {}

    def poll(self, step: int) -> set[str]:
        """Read ``control.json`` if it changed; returns the requested actions among ``{"checkpoint", "stop"}``
        (a new ``lr_scale`` takes effect at once) and logs a ``kind: control`` record for each."""
        if not self.control:
            return set()
        actions = self._read_control(step) if self.main else set()
        actions, self.lr_scale = self.share((actions, self.lr_scale))
        return actions

    def _read_control(self, step: int) -> set[str]:
        try:
            st = os.stat(self.control_path)
        except FileNotFoundError:
            return set()
        if (st.st_mtime_ns, st.st_size) == self._seen:
            return set()
        self._seen = (st.st_mtime_ns, st.st_size)
        try:
            with open(self.control_path) as f:
                req = json.load(f)
            stop, ckpt, scale = bool(req.get("stop", False)), int(req.get("checkpoint", 0)), float(req.get("lr_scale", 1.0))
            if not (LR_SCALE_RANGE[0] <= scale <= LR_SCALE_RANGE[1] and math.isfinite(scale)):
                raise ValueError(f"lr_scale {scale} outside {LR_SCALE_RANGE}")
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("ignoring %s: %s", self.control_path, e)
            return set()
        actions = set()
        if scale != self.lr_scale:
            self.lr_scale = scale
            self.run_log.log({"kind": "control", "step": step, "action": "lr_scale", "lr_scale": scale})
            log.info("step %d: learning-rate multiplier set to %g (Studio)", step, scale)
        if ckpt > self._checkpoints_done:
            self._checkpoints_done = ckpt
            actions.add("checkpoint")
        if stop:
            actions.add("stop")
        for action in sorted(actions):
            self.run_log.log({"kind": "control", "step": step, "action": action})
            log.info("step %d: %s requested (Studio)", step, action)
        return actions

    def sample(self, step: int, model, tokenizer, prompt: str, max_new_tokens: int) -> str:
        """Generate a continuation of ``prompt``, log it as ``kind: sample`` and return it.

        The RNG states are restored afterwards, so a run with samples trains exactly as one without.
        A second call at the same step returns the first one's text without generating or logging again.
        """
        if self._last_sample is not None and self._last_sample[0] == step:
            return self._last_sample[1]
        from tritonllm.generate import generate_text
        from tritonllm.models.transformer import release_decoders

        device = next(model.parameters()).device
        was_training = model.training
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model.eval()
            try:
                text = generate_text(model, tokenizer, prompt, max_new_tokens)
            finally:
                release_decoders(model)
                model.train(was_training)
        self.run_log.log({"kind": "sample", "step": step, "prompt": prompt, "text": text})
        self._last_sample = (step, text)
        return text

    def finish(self, step: int, status: str, error: BaseException | None = None) -> None:
        """Log the run's last record, ``kind: end`` with ``status`` (finished, stopped, failed)."""
        record = {"kind": "end", "step": step, "status": status, "time": time.time()}
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}"
        self.run_log.log(record)
