"""Training checkpoints: written atomically, pruned to the last K, validated on load.

A checkpoint is a folder ``<ckpt_dir>/step_<00000123>/`` holding

- ``model.safetensors``  the model's weights (``safetensors.torch.save_model``);
- ``optimizer.pt``       the optimizer's ``state_dict()`` (moments, fp32 master weights, step);
- ``rng.pt``             the torch (CPU and CUDA), Python and NumPy RNG states;
- ``state.json``         step, data-loader position, model config and anything else the trainer adds;
- ``config.yaml``        the resolved run config; ``tokenizer.model`` when the run has one.

Every file is written into a temporary sibling folder, flushed to disk, and the folder is then
renamed into place with ``os.replace``: a crash or an error mid-write leaves the previous
checkpoints as they were and no ``step_*`` folder half written (a ``.tmp-step_*`` folder left by a
killed process is removed by :func:`remove_leftovers` when the next run starts).

Integrity: ``state.json`` records a BLAKE2b digest of every other file of the checkpoint
(``checksums.files``) and one of its own content (``checksums.state``); :func:`verify_checkpoint`
recomputes them at load, and a mismatch is a CheckpointError naming the file. Weights that load
but hold a NaN or an infinity are refused the same way. :func:`load_first_valid` walks back from
the newest checkpoint to the newest one that loads, saying so in one log line per one skipped.

Ownership: each checkpoint records the ``run_id`` of the run that wrote it (a resumed run keeps
its checkpoint's id). Pruning to the newest ``keep_last`` only ever removes checkpoints of the
saving run, and only after the new one is in place.

Claim: a training run holds its ``ckpt_dir`` with :func:`claim_ckpt_dir` from before its first
step to its exit, a lock file ``run.lock`` created with ``O_CREAT | O_EXCL`` holding the pid, host
and start time; a second run on the same folder is refused with a CheckpointError naming them.
A lock left by a process that died on this host is stale and taken over with a log line.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import random
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tritonllm.errors import CheckpointError
from tritonllm.runtime import pid_alive

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
MODEL_FILE, OPTIM_FILE, RNG_FILE, STATE_FILE = "model.safetensors", "optimizer.pt", "rng.pt", "state.json"
CONFIG_FILE, TOKENIZER_FILE = "config.yaml", "tokenizer.model"
TMP_PREFIX = ".tmp-step_"
LOCK_FILE = "run.lock"
#: digest of the checkpoint files (hashlib, 16-byte BLAKE2b: about 1 GB/s per file on one core)
CHECKSUM = "blake2b-128"


def rng_state() -> dict:
    """Every RNG state a training step can touch (weights_only-loadable types only)."""
    # get_state() returns the legacy tuple (legacy=True is its default); numpy's stub types a call without
    # arguments as the legacy=False overload, a dict
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])}  # type: ignore[index]
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


def file_digest(path: str) -> str:
    """Hex BLAKE2b (16-byte) digest of the file's bytes, read in 4 MiB blocks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            h.update(block)
    return h.hexdigest()


def _state_digest(state: dict) -> str:
    """Digest of ``state`` without its ``checksums`` entry (key order and formatting do not matter)."""
    body = {k: v for k, v in state.items() if k != "checksums"}
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def _folder_files(folder: str) -> list[str]:
    """Paths relative to ``folder`` of every file under it except ``state.json``, sorted."""
    found = []
    for root, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(f for f in found if f != STATE_FILE)


def _digests(folder: str, names: list[str]) -> dict[str, str]:
    """``{name: file_digest}`` of the files ``names`` of ``folder``, hashed in parallel threads
    (hashlib releases the GIL on large buffers)."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: file_digest(os.path.join(folder, n)), names)))


def with_checksums(folder: str, state: dict, names: list[str] | None = None) -> dict:
    """``state`` plus ``checksums``: the digest of the files ``names`` of ``folder`` (default: all but
    state.json) and of ``state`` itself, as :func:`verify_checkpoint` expects them."""
    state = {k: v for k, v in state.items() if k != "checksums"}
    names = _folder_files(folder) if names is None else sorted(names)
    return {**state, "checksums": {"algorithm": CHECKSUM, "files": _digests(folder, names),
                                   "state": _state_digest(state)}}


def verify_checkpoint(path: str) -> dict:
    """The checkpoint's ``state.json`` after checking every file's digest against the one written at
    save time; a CheckpointError names the first file that is missing or differs. A checkpoint
    written before checksums existed is accepted with a log line saying it was not verified."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    state = read_state(path)
    sums = state.get("checksums")
    if sums is None:
        log.warning("checkpoint %s has no checksums (written by an older tritonllm): loaded unverified", path)
        return state
    if not isinstance(sums, dict) or sums.get("algorithm") != CHECKSUM or not isinstance(sums.get("files"), dict):
        raise CheckpointError(f"checkpoint {path} is corrupt: {STATE_FILE} holds no readable {CHECKSUM} checksums")
    if sums.get("state") != _state_digest(state):
        raise CheckpointError(f"checkpoint {path} is corrupt: {STATE_FILE} differs from what was saved "
                              f"(its content does not match its checksum)")
    missing = [n for n in sums["files"] if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {', '.join(missing)} missing")
    now = _digests(path, sorted(sums["files"]))
    for name, digest in sums["files"].items():
        if now[name] != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match the checksum written at "
                                  f"save time ({CHECKSUM} {digest} saved, {now[name]} now)")
    return state


def check_finite_weights(path: str, model: torch.nn.Module | dict) -> None:
    """A CheckpointError naming the tensors of ``model`` (just loaded from ``path``; or a dict of
    the tensors read from it) that hold a NaN or an infinity."""
    tensors = model if isinstance(model, dict) else model.state_dict()
    bad = [name for name, t in tensors.items()
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"checkpoint {path} holds non-finite weights (NaN or inf) in {len(bad)} tensor(s): "
                              f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; use an earlier checkpoint")


def run_id_of(path: str) -> str | None:
    """The id of the run that wrote the checkpoint ``path``: "" when it records none (older
    checkpoints), None when its state.json is unreadable."""
    try:
        return str(read_state(path).get("run_id", ""))
    except CheckpointError:
        return None


def prune(ckpt_dir: str, keep_last: int | None, run_id: str | None) -> None:
    """Delete all but the newest ``keep_last`` checkpoints of the run ``run_id`` in ``ckpt_dir``
    (``run_id`` None: of any run); other runs' checkpoints are never touched."""
    if not keep_last:
        return
    own = [p for _, p in list_checkpoints(ckpt_dir) if run_id is None or run_id_of(p) == run_id]
    for old in own[:-int(keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


def prepare_ckpt_dir(ckpt_dir: str, key: str = "trainer.ckpt_dir") -> None:
    """Create ``ckpt_dir`` and prove it writable with a probe file: a CheckpointError naming ``key``
    otherwise, so the run fails now, not at its first checkpoint."""
    probe = os.path.join(ckpt_dir, f".write-test-{os.getpid()}")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"tritonllm")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"{key}={ckpt_dir!r} is not writable ({e.strerror or e}): choose a folder this user "
                              f"can write, the run would fail at its first checkpoint") from None


def _read_lock(path: str) -> dict | None:
    """The JSON of the lock file ``path``; None when it is gone. A file still empty (its creator is
    between ``open`` and ``write``) is read again for up to a second, then is a CheckpointError."""
    for _ in range(20):
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
            if isinstance(holder, dict) and isinstance(holder.get("pid"), int):
                return holder
        except ValueError:
            pass
        time.sleep(0.05)
    raise CheckpointError(f"{path} is unreadable (not the JSON a tritonllm run writes): delete it if no run "
                          f"uses {os.path.dirname(path)}")


def _remove_stale(path: str, holder: dict) -> None:
    """Remove the lock ``path`` judged stale from its content ``holder``. It is first renamed aside and
    read again: a lock that another run took over meanwhile is put back (``os.link`` creates only)."""
    aside = f"{path}.stale-{os.getpid()}"
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    try:
        if _read_lock(aside) == holder:
            log.warning("%s: taking over the lock of run pid %d (started %s), which is no longer running",
                        path, holder["pid"], holder.get("started"))
        else:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
    finally:
        os.remove(aside)


@contextlib.contextmanager
def claim_ckpt_dir(ckpt_dir: str, key: str = "trainer.ckpt_dir", **about):
    """Hold ``ckpt_dir`` for this process while the ``with`` block runs: create ``<ckpt_dir>/run.lock``
    (``O_CREAT | O_EXCL``) holding ``{pid, host, started, **about}`` and remove it at the block's
    exit, whatever ends it. A lock of a live process (or of a process on another host) is a
    CheckpointError naming ``key``, the holder's pid, host and start time; one of this host whose
    pid is dead, or is this process's, is stale: taken over with a log line."""
    path = os.path.join(ckpt_dir, LOCK_FILE)
    mine = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), **about}
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:  # released meanwhile
                continue
            stale = holder.get("host") == mine["host"] and (holder["pid"] == mine["pid"]
                                                             or not pid_alive(holder["pid"]))
            if not stale:
                raise CheckpointError(
                    f"{key}={ckpt_dir} is in use by run pid {holder['pid']} on host {holder.get('host')} since "
                    f"{holder.get('started')}; give this run its own {key} or stop the other (delete "
                    f"{LOCK_FILE} if that run is gone)") from None
            _remove_stale(path, holder)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
            f.flush()
            os.fsync(f.fileno())
        break
    try:
        yield path
    finally:
        with contextlib.suppress(OSError, CheckpointError):
            if _read_lock(path) == mine:  # still ours (no one deleted it and took the folder over)
                os.remove(path)


def remove_leftovers(ckpt_dir: str) -> None:
    """Remove the ``.tmp-step_*`` folders a killed save left in ``ckpt_dir`` (call it once the folder
    is known to be this run's), one log line each."""
    for name in sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []:
        if name.startswith(TMP_PREFIX) and os.path.isdir(os.path.join(ckpt_dir, name)):
            log.info("removing %s, left by a checkpoint save that did not finish", os.path.join(ckpt_dir, name))
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


def load_first_valid(paths: list[str], load) -> tuple[str, dict]:
    """``(path, state)`` of the first of ``paths`` (newest first) that ``load(path) -> state`` loads
    without a CheckpointError, logging one line for each one skipped; when none loads, the first
    one's error."""
    first_error = None
    for i, path in enumerate(paths):
        try:
            state = load(path)
        except CheckpointError as e:
            first_error = first_error or e
            if i + 1 < len(paths):
                log.warning("%s; falling back to the previous checkpoint, %s", e, paths[i + 1])
            continue
        return path, state
    raise first_error or CheckpointError("no checkpoint to load")


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _fsync_dir_files(folder: str) -> None:
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            os.fsync(f.fileno())


def publish(tmp: str, final: str, state: dict, config_yaml: str | None = None,
            tokenizer_path: str | None = None) -> None:
    """Complete the checkpoint folder ``tmp`` (``config.yaml``, the tokenizer, then ``state.json`` with
    the checksums of every file), flush every file to disk and rename the folder to ``final``
    (``os.replace``); an existing ``final`` (the same step saved again, e.g. after a resume) is
    swapped out and deleted."""
    if config_yaml is not None:
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            f.write(config_yaml)
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, os.path.join(tmp, TOKENIZER_FILE))
    _write_json(os.path.join(tmp, STATE_FILE), with_checksums(tmp, state))
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
                    keep_last: int | None = None, run_id: str | None = None) -> str:
    """Write checkpoint ``step`` into ``ckpt_dir`` atomically and delete all but the newest ``keep_last``
    of the run ``run_id`` (recorded in the checkpoint; None: of any run).

    ``state`` is a JSON-serialisable dict (the step is added to it). Returns the checkpoint's path.
    Raises a CheckpointError naming the folder when writing fails; nothing under ``step_*`` changes then.
    """
    from safetensors.torch import save_model

    final = os.path.join(ckpt_dir, f"step_{step:08d}")
    tmp = os.path.join(ckpt_dir, f"{TMP_PREFIX}{step:08d}-{os.getpid()}")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_model(model, os.path.join(tmp, MODEL_FILE))
        torch.save(optimizer.state_dict(), os.path.join(tmp, OPTIM_FILE))
        torch.save(rng_state(), os.path.join(tmp, RNG_FILE))
        publish(tmp, final, {**state, "step": step, **({"run_id": run_id} if run_id is not None else {})},
                config_yaml, tokenizer_path)
    except Exception as e:
        raise CheckpointError(f"writing checkpoint {final} failed ({type(e).__name__}: {e}); "
                              f"earlier checkpoints in {ckpt_dir} are untouched") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune(ckpt_dir, keep_last, run_id)
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
                    model_config: dict | None = None, verified: bool = False) -> dict:
    """Load the weights (and optimizer state, RNG states) of the checkpoint ``path`` into ``model``
    (and ``optimizer``); returns its ``state.json``. A CheckpointError names the file that is missing,
    unreadable, corrupt (its checksum differs) or does not fit, or the weights that are not finite;
    ``model_config`` (the model's config as a dict) lets it name the config fields that differ from
    the saved ``state["model_config"]``. ``verified``: the caller has just run :func:`verify_checkpoint`
    (the files are not hashed again)."""
    from safetensors.torch import load_model

    state = read_state(path) if verified else verify_checkpoint(path)
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
    check_finite_weights(path, model)
    return state
