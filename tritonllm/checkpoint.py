"""Training checkpoints: written atomically, pruned to the last K, validated on load.

A checkpoint is a folder ``<ckpt_dir>/step_<00000123>/`` holding

- ``model.safetensors``  the model's weights (``safetensors.torch.save_model``);
- ``optimizer.pt``       the optimizer's ``state_dict()`` (moments, fp32 master weights, step);
- ``rng.pt``             the torch (CPU and CUDA), Python and NumPy RNG states;
- ``state.json``         step, data-loader position, model config and anything else the trainer adds;
- ``config.yaml``        the resolved run config; ``tokenizer.model`` when the run has one.

Every file is written into a temporary sibling folder, flushed to disk, and the folder is then
renamed into place with ``os.replace``: a crash or an error mid-write leaves the previous
checkpoints as they were and no ``step_*`` folder half written. Older checkpoints beyond
``keep_last`` are deleted only after the new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch

from tritonllm.errors import CheckpointError

STEP_DIR = re.compile(r"^step_(\d+)$")
MODEL_FILE, OPTIM_FILE, RNG_FILE, STATE_FILE = "model.safetensors", "optimizer.pt", "rng.pt", "state.json"
CONFIG_FILE, TOKENIZER_FILE = "config.yaml", "tokenizer.model"


def rng_state() -> dict:
    """Every RNG state a training step can touch (weights_only-loadable types only)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the complete checkpoints in ``ckpt_dir``, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), os.path.join(ckpt_dir, d)) for d in os.listdir(ckpt_dir)
             if (m := STEP_DIR.match(d)) and os.path.isdir(os.path.join(ckpt_dir, d))]
    return sorted(found)


def find_checkpoint(path: str) -> str | None:
    """``path`` itself when it is a checkpoint, else the newest checkpoint inside it, else None."""
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    ckpts = list_checkpoints(path)
    return ckpts[-1][1] if ckpts else None


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _fsync_dir_files(folder: str) -> None:
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            os.fsync(f.fileno())


def publish(tmp: str, final: str, state: dict, config_yaml: str | None = None,
            tokenizer_path: str | None = None) -> None:
    """Complete the checkpoint folder ``tmp`` (``state.json``, ``config.yaml``, the tokenizer), flush
    every file to disk and rename the folder to ``final`` (``os.replace``); an existing ``final`` (the
    same step saved again, e.g. after a resume) is swapped out and deleted."""
    _write_json(os.path.join(tmp, STATE_FILE), state)
    if config_yaml is not None:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(config_yaml)
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, os.path.join(tmp, TOKENIZER_FILE))
    _fsync_dir_files(tmp)
    if os.path.exists(final):
        old = f"{tmp}.old"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save_checkpoint(ckpt_dir: str, step: int, model: torch.nn.Module, optimizer, state: dict,
                    config_yaml: str | None = None, tokenizer_path: str | None = None,
                    keep_last: int | None = None) -> str:
    """Write checkpoint ``step`` into ``ckpt_dir`` atomically and delete all but the newest ``keep_last``.

    ``state`` is a JSON-serialisable dict (the step is added to it). Returns the checkpoint's path.
    Raises a CheckpointError naming the folder when writing fails; nothing under ``step_*`` changes then.
    """
    from safetensors.torch import save_model

    final = os.path.join(ckpt_dir, f"step_{step:08d}")
    tmp = os.path.join(ckpt_dir, f".tmp-step_{step:08d}-{os.getpid()}")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_model(model, os.path.join(tmp, MODEL_FILE))
        torch.save(optimizer.state_dict(), os.path.join(tmp, OPTIM_FILE))
        torch.save(rng_state(), os.path.join(tmp, RNG_FILE))
        publish(tmp, final, {**state, "step": step}, config_yaml, tokenizer_path)
    except Exception as e:
        raise CheckpointError(f"writing checkpoint {final} failed ({type(e).__name__}: {e}); "
                              f"earlier checkpoints in {ckpt_dir} are untouched") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if keep_last:
        for _, old_path in list_checkpoints(ckpt_dir)[:-int(keep_last)]:
            shutil.rmtree(old_path, ignore_errors=True)
    return final


def read_state(path: str) -> dict:
    """The ``state.json`` of the checkpoint at ``path`` (a CheckpointError naming it if unreadable)."""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {STATE_FILE}: {e}") from None


def check_model_shapes(path: str, model: torch.nn.Module, saved_config: dict | None = None,
                       config: dict | None = None) -> None:
    """A CheckpointError listing the differences when the weights in ``path`` do not fit ``model``."""
    from safetensors import safe_open

    file = os.path.join(path, MODEL_FILE)
    try:
        with safe_open(file, framework="pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:
        raise CheckpointError(f"checkpoint {file} is unreadable: {e}") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"{k}: {saved[k]} saved, {expected[k]} in this model" for k in expected
                if k in saved and saved[k] != expected[k]]
    problems += [f"{k}: missing from the checkpoint" for k in expected if k not in saved]
    problems += [f"{k}: in the checkpoint, not in this model" for k in saved if k not in expected]
    if problems:
        diff = ""
        if saved_config and config:
            fields = [f"{k}={saved_config.get(k)!r} saved vs {config.get(k)!r}" for k in sorted(config)
                      if saved_config.get(k) != config.get(k)]
            diff = "; model config differences: " + ", ".join(fields) if fields else ""
        raise CheckpointError(f"checkpoint {path} was written for a different model shape ({len(problems)} "
                              f"tensors differ: {'; '.join(problems[:6])}){diff}")


def load_checkpoint(path: str, model: torch.nn.Module, optimizer=None, restore_rng: bool = True,
                    model_config: dict | None = None) -> dict:
    """Load the weights (and optimizer state, RNG states) of the checkpoint ``path`` into ``model``
    (and ``optimizer``); returns its ``state.json``. A CheckpointError names the file that is missing,
    unreadable or does not fit; ``model_config`` (the model's config as a dict) lets it name the
    config fields that differ from the saved ``state["model_config"]``."""
    from safetensors.torch import load_model

    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    state = read_state(path)
    check_model_shapes(path, model, state.get("model_config"), model_config)
    file = os.path.join(path, MODEL_FILE)
    try:
        load_model(model, file, strict=True, device=str(next(model.parameters()).device))
        if optimizer is not None:
            file = os.path.join(path, OPTIM_FILE)
            optimizer.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
        if restore_rng:
            file = os.path.join(path, RNG_FILE)
            set_rng_state(torch.load(file, map_location="cpu", weights_only=True))
    except Exception as e:
        raise CheckpointError(f"checkpoint file {file} is unreadable ({type(e).__name__}: {e})") from None
    return state
