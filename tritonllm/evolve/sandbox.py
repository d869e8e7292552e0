"""Run one evaluation in its own process, with a wall-clock and a memory limit.

:func:`run_sandboxed` writes ``job.json`` (the evaluator ``"module:function"`` and its payload)
into the candidate's folder and starts ``python -m tritonllm.evolve.sandbox <folder>`` in a new
session, its output going to ``log.txt`` there. The child applies the host memory limit
(``RLIMIT_AS``), imports and calls ``function(payload, folder)``, which returns a dict of metrics,
and writes it to ``result.json`` (atomically) or the exception to ``error.json``. The parent
waits at most ``timeout_s`` seconds, then kills the child's whole process group and every process
below it; the same when the search itself is stopped (Ctrl-C, or SIGTERM: :class:`tritonllm.runtime.Stopped`).

So whatever a candidate does (raises, diverges, runs out of memory, crashes the interpreter,
hangs) the search process only sees an :class:`Outcome`: ``ok`` with the metrics, or ``failed``
/ ``timeout`` with a one-line reason and the tail of the log. Nothing a failed child left in its
folder is read back except that log (the caller removes the rest: the rollback).

``RLIMIT_AS`` limits address space, which CUDA reserves by the terabyte: leave
``host_memory_gb`` null on GPU machines and cap device memory in the evaluator instead
(:mod:`tritonllm.evolve.evaluate` does, from ``evolve.memory_cap_gb``).
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

JOB, RESULT, ERROR, LOG = "job.json", "result.json", "error.json", "log.txt"


@dataclass
class Outcome:
    status: str  # ok | failed | timeout
    result: dict | None
    reason: str | None
    wall_s: float
    returncode: int | None
    log_tail: str = ""


def _tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def run_sandboxed(target: str, payload: dict, folder: str, timeout_s: float | None = None,
                  host_memory_gb: float | None = None) -> Outcome:
    """Evaluate ``target`` (``"module:function"``) on ``payload`` in a child process (see module docstring)."""
    from tritonllm.runtime import end_process_tree  # here: the child's own imports stay free of torch

    os.makedirs(folder, exist_ok=True)
    for name in (RESULT, ERROR):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    with open(os.path.join(folder, JOB), "w") as f:
        json.dump({"target": target, "payload": payload, "host_memory_gb": host_memory_gb}, f, indent=1)
    env = dict(os.environ)
    # the child imports what this process can import (an evaluator in the caller's own modules too)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    t0 = time.perf_counter()
    with open(os.path.join(folder, LOG), "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "tritonllm.evolve.sandbox", folder], stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_process_tree(proc)
            return Outcome("timeout", None, f"timed out after {timeout_s:g} s (evolve.sandbox.timeout_s)",
                           time.perf_counter() - t0, None, _tail(os.path.join(folder, LOG)))
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C, or SIGTERM: runtime.Stopped): take the child down with us
                end_process_tree(proc)
    wall = time.perf_counter() - t0
    tail = _tail(os.path.join(folder, LOG))
    result_path, error_path = os.path.join(folder, RESULT), os.path.join(folder, ERROR)
    if rc == 0 and os.path.exists(result_path):
        with open(result_path) as f:
            return Outcome("ok", json.load(f), None, wall, rc, tail)
    if os.path.exists(error_path):
        with open(error_path) as f:
            reason = json.load(f)["error"]
    elif rc is not None and rc < 0:
        reason = f"killed by signal {signal.Signals(-rc).name}"
    else:
        reason = f"exited with status {rc} without a result"
    return Outcome("failed", None, reason, wall, rc, tail)


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def main(folder: str) -> int:
    """The child: apply the limits, call the evaluator, write ``result.json`` or ``error.json``."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] %(message)s")
    with open(os.path.join(folder, JOB)) as f:
        job = json.load(f)
    try:
        if job.get("host_memory_gb"):
            limit = int(job["host_memory_gb"] * 1e9)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        module, _, name = job["target"].partition(":")
        fn = getattr(importlib.import_module(module), name)
        result = fn(job["payload"], folder)
        if not isinstance(result, dict):
            raise TypeError(f"evaluator {job['target']} returned {type(result).__name__}, expected a dict")
        _write_json(os.path.join(folder, RESULT), result)
        return 0
    except BaseException as e:  # MemoryError and KeyboardInterrupt included: the parent must learn of it
        traceback.print_exc()
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _write_json(os.path.join(folder, ERROR), {"error": f"{type(e).__name__}: {first}"[:500]})
        return 1


if __name__ == "__main__":
    if isinstance(sys.stdout, io.TextIOWrapper):  # the log file
        sys.stdout.reconfigure(line_buffering=True)
    raise SystemExit(main(sys.argv[1]))
