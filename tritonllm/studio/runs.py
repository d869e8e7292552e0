"""Finding training runs in folders and reading them for the Studio server.

A **run folder** is any folder under the roots holding one of ``metrics.jsonl``, ``run_info.json``,
``.hydra/``, ``checkpoints/`` or ``studio.json`` (what ``python -m tritonllm.train`` writes: see
:mod:`tritonllm.logging_utils`, :mod:`tritonllm.checkpoint`, :mod:`tritonllm.studio.hooks`), or an
empty leaf folder (a run that died before writing anything). An **evolution search** folder
(``python -m tritonllm.evolve``) holds ``results.csv`` (one candidate per row) or ``evolve.lock``;
its candidates' run folders (``candidates/<n>/run``) are listed as runs too. Folders are searched
down to :data:`MAX_DEPTH` levels; a run folder's own subfolders are not searched.

Everything is read defensively: a file that is missing, unreadable or half written becomes a line
in the run's ``problems`` and the rest of the run is still served. ``metrics.jsonl`` is read
incrementally (only the bytes appended since the last read); a last line without its newline is a
line still being written and waits for the next read.

Status: the ``status`` of the run's ``kind: end`` record (finished, stopped, failed) when there is
one; else, when ``studio.json`` names a trainer on this host, ``running`` while that process lives
and ``failed`` once it is gone; else ``running`` while a file changed within ``stale_after``
seconds, ``finished`` when the last record reached ``trainer.max_steps``, and ``stale`` otherwise;
``empty`` when the folder holds nothing readable. An evolution search's "step" is the number of
candidates evaluated, of ``evolve.population x evolve.generations``: ``finished`` once all are.
"""

from __future__ import annotations

import csv
import hmac
import json
import math
import os
import shlex
import socket
import threading
import time
from typing import TypeGuard

from tritonllm.checkpoint import MODEL_FILE, STEP_DIR
from tritonllm.runtime import pid_alive
from tritonllm.studio.hooks import CONTROL_FILE, LR_SCALE_RANGE, STUDIO_FILE, TOKEN_FILE

MAX_DEPTH = 6
RUN_MARKERS = ("metrics.jsonl", "run_info.json", ".hydra", "checkpoints", STUDIO_FILE)
EVOLVE_FILES = ("results.csv", "evolve.lock")  # what marks a search folder of tritonllm.evolve
SKIP_DIRS = {"checkpoints", ".hydra", "wandb", "__pycache__", ".git", "node_modules"}
#: objectives of an evolution search's Pareto front: column and direction (+1 minimise, -1 maximise)
OBJECTIVES = (("val_loss", 1), ("tokens_per_s", -1), ("peak_mem_gb", 1))


class ControlError(Exception):
    """A refused control request; ``code`` is the HTTP status to answer with."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _read_json(path: str, problems: list, what: str):
    try:
        with open(path) as f:
            return json.load(f, parse_constant=_no_constant)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        problems.append(f"{what} is unreadable: {type(e).__name__}: {e}")
        return None


def _read_yaml(path: str, problems: list, what: str):
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        return None
    except (OSError, yaml.YAMLError) as e:
        problems.append(f"{what} is unreadable: {type(e).__name__}: {e}")
        return None


def _no_constant(_name: str) -> None:
    """NaN and Infinity in a JSON file read as null (a browser's JSON.parse rejects them)."""
    return None


def _number(v) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class MetricsFile:
    """The records of one ``metrics.jsonl``, read incrementally; unreadable lines are kept aside."""

    def __init__(self, path: str):
        self.path = path
        self._start()

    def _start(self) -> None:
        """Nothing read yet (a new file, or one replaced or truncated)."""
        self.records: list[dict] = []
        self.bad_lines: list[tuple[int, str]] = []  # (line number, start of the line)
        self.partial = False  # bytes after the last newline: a line being written (or cut off)
        self.mtime = 0.0
        self._offset = 0
        self._lines = 0
        self._inode: int | None = None

    def refresh(self) -> bool:
        """Read what was appended since the last call; True when anything changed."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        if st.st_ino != self._inode or st.st_size < self._offset:  # replaced or truncated: start over
            self._start()
            self._inode = st.st_ino
        self.mtime = st.st_mtime
        if st.st_size == self._offset:
            return False
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        end = data.rfind(b"\n") + 1
        self.partial = end < len(data)
        for raw in data[:end].splitlines():
            self._lines += 1
            try:
                rec = json.loads(raw, parse_constant=_no_constant)
                if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
                    raise ValueError("not a record with a kind")
                self.records.append(rec)
            except ValueError:
                self.bad_lines.append((self._lines, raw[:80].decode("utf-8", "replace")))
        self._offset += end
        return True


def safetensors_params(path: str) -> list[dict]:
    """Parameter table from the JSON header of a ``.safetensors`` file (the tensors are not read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= 64 << 20:
            raise ValueError(f"header length {n} is not plausible")
        header = json.loads(f.read(n))
    return [{"name": k, "shape": v["shape"], "dtype": v["dtype"].lower(), "numel": math.prod(v["shape"])}
            for k, v in header.items() if k != "__metadata__"]


def pareto_front(rows: list[dict]) -> list[int]:
    """Indices of the rows no other row dominates on :data:`OBJECTIVES` (those present in every
    complete row; a row missing ``val_loss`` or marked failed is never on the front)."""
    ok = [i for i, r in enumerate(rows) if _number(r.get("val_loss")) and r.get("status", "ok") == "ok"]
    objs = [(k, s) for k, s in OBJECTIVES if all(_number(rows[i].get(k)) for i in ok)]

    def dominates(a, b):
        return all(s * a[k] <= s * b[k] for k, s in objs) and any(s * a[k] < s * b[k] for k, s in objs)

    return [i for i in ok if not any(dominates(rows[j], rows[i]) for j in ok if j != i)]


def read_evolve(path: str, problems: list) -> dict | None:
    """``{"file", "rows", "pareto", "best"}`` from an evolution search's folder (what
    ``python -m tritonllm.evolve`` writes: ``results.csv``, one row per trial with a ``pareto`` column,
    and ``best.json``), or None when it holds no results table. Without a ``pareto`` column the
    front is computed over :data:`OBJECTIVES`."""
    file = os.path.join(path, "results.csv")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, newline="") as f:
            rows = [{k: _parse_cell(v) for k, v in row.items() if k is not None} for row in csv.DictReader(f)]
    except (OSError, csv.Error, UnicodeDecodeError) as e:
        problems.append(f"results.csv is unreadable: {type(e).__name__}: {e}")
        rows = []
    if rows and "pareto" in rows[0]:
        front = [i for i, r in enumerate(rows) if r.get("pareto") in ("True", "true", 1)]
    else:
        front = pareto_front(rows)
    best = _read_json(os.path.join(path, "best.json"), problems, "best.json")
    return {"file": "results.csv", "rows": rows, "pareto": front, "best": best if isinstance(best, dict) else None}


def _parse_cell(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return v
        return f if math.isfinite(f) else None


class Run:
    """One run folder; every method is safe to call from several server threads."""

    def __init__(self, run_id: str, path: str, stale_after: float):
        self.id, self.path, self.stale_after = run_id, path, stale_after
        self.metrics = MetricsFile(os.path.join(path, "metrics.jsonl"))
        self.lock = threading.Lock()
        self._control_lock = threading.Lock()

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def refresh(self) -> None:
        with self.lock:
            self.metrics.refresh()

    def records(self, since: int = 0) -> list[dict]:
        self.refresh()
        return self.metrics.records[max(0, since):]

    # ------------------------------------------------------------------ what the run list shows
    def summary(self) -> dict:
        self.refresh()
        problems: list[str] = []
        info = _read_json(self._file("run_info.json"), problems, "run_info.json") or {}
        studio = _read_json(self._file(STUDIO_FILE), problems, STUDIO_FILE) or {}
        config = info.get("config")
        if not isinstance(config, dict):
            config = {}
        records = self.metrics.records
        last = {}
        skipped, lr_scale = 0, 1.0
        for r in records:
            kind = r["kind"]
            if kind == "skip":
                skipped += 1
            elif kind == "control" and r.get("action") == "lr_scale":
                lr_scale = r.get("lr_scale", lr_scale)
            last[kind] = r
        vals = [r["val_loss"] for r in records if r["kind"] == "val" and _number(r.get("val_loss"))]
        train, end = last.get("train", {}), last.get("end")
        max_steps = (config.get("trainer") or {}).get("max_steps")
        step = max([r["step"] for r in records if _number(r.get("step"))], default=None)
        if self._is_search():  # an evolution search: candidates evaluated of population x generations
            step, max_steps = self._search_progress(problems)
        problems += self._metrics_problems(end is not None)
        status = self._status(end, studio, step, max_steps, problems)
        if end is not None and end.get("error"):
            problems.append(f"training failed: {end['error']}")
        return {"id": self.id, "path": self.path, "name": info.get("name") or os.path.basename(self.path),
                "model": (config.get("model") or {}).get("name"), "status": status, "step": step,
                "max_steps": max_steps, "loss": train.get("loss"), "val_loss": vals[-1] if vals else None,
                "best_val_loss": min(vals) if vals else None, "tokens_per_s": train.get("tokens_per_s"),
                "mfu": train.get("mfu"), "records": len(records), "skipped": skipped, "lr_scale": lr_scale,
                "checkpoints": len(self._checkpoint_dirs()), "updated": self._updated(),
                "controllable": status == "running" and os.path.isfile(self._file(TOKEN_FILE)),
                "evolve": self._is_search(), "problems": problems}

    def _metrics_problems(self, ended: bool) -> list[str]:
        m, out = self.metrics, []
        if m.bad_lines:
            line, text = m.bad_lines[0]
            out.append(f"metrics.jsonl: {len(m.bad_lines)} unreadable line(s) skipped, first at line {line}: {text!r}")
        if m.partial and (ended or time.time() - m.mtime > self.stale_after):
            out.append("metrics.jsonl: the last line is cut off (no newline)")
        return out

    def _status(self, end, studio: dict, step, max_steps, problems: list) -> str:
        if end is not None:
            return str(end.get("status", "finished"))
        pid = studio.get("pid")
        if isinstance(pid, int) and studio.get("host") == socket.gethostname():
            if pid_alive(pid):
                return "running"
            problems.append(f"the trainer (pid {pid}) exited without writing its end record")
            return "failed"
        updated = self._updated()
        if updated is None:
            if not any(os.path.exists(self._file(m)) for m in RUN_MARKERS):
                problems.append("nothing readable here: no metrics.jsonl, run_info.json, .hydra/ or checkpoints/")
            return "empty"
        complete = step is not None and max_steps is not None and step >= max_steps
        if complete and self._is_search():
            return "finished"  # every candidate evaluated (the table is written after the last one)
        if time.time() - updated < self.stale_after:
            return "running"
        return "finished" if complete else "stale"

    def _is_search(self) -> bool:
        return any(os.path.isfile(self._file(n)) for n in EVOLVE_FILES)

    def _search_progress(self, problems: list) -> tuple[int | None, int | None]:
        """``(evaluated, population x generations)`` of an evolution search (rejected and duplicate
        proposals take no slot); None for what its files do not tell."""
        ev = read_evolve(self.path, problems)
        done = sum(r.get("status", "ok") in ("ok", "failed") for r in ev["rows"]) if ev else None
        cfg = _read_yaml(self._file(os.path.join(".hydra", "config.yaml")), problems, ".hydra/config.yaml")
        search = cfg.get("evolve", {}) if isinstance(cfg, dict) else {}
        try:
            total = int(search["population"]) * int(search["generations"])
        except (TypeError, KeyError, ValueError):
            total = None
        return done, total

    def _updated(self) -> float | None:
        times = []
        for name in ("metrics.jsonl", "run_info.json", STUDIO_FILE, os.path.join(".hydra", "config.yaml"), *EVOLVE_FILES):
            try:
                times.append(os.path.getmtime(self._file(name)))
            except OSError:
                pass
        return max(times, default=None)

    def _checkpoint_dirs(self) -> list[tuple[int, str]]:
        folder = self._file("checkpoints")
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        return sorted((int(m.group(1)), os.path.join(folder, d)) for d in names if (m := STEP_DIR.match(d)))

    # ------------------------------------------------------------------ one run in full
    def detail(self, with_token: bool) -> dict:
        out = self.summary()
        problems = out["problems"]
        info = _read_json(self._file("run_info.json"), [], "run_info.json") or {}
        studio = _read_json(self._file(STUDIO_FILE), [], STUDIO_FILE) or {}
        overrides = _read_yaml(self._file(os.path.join(".hydra", "overrides.yaml")), problems, ".hydra/overrides.yaml")
        config = info.get("config")
        if config is None:  # no run_info.json: Hydra's composed (unresolved) config, when there is one
            config = _read_yaml(self._file(os.path.join(".hydra", "config.yaml")), problems, ".hydra/config.yaml")
        out.update(config=config, overrides=overrides if isinstance(overrides, list) else None,
                   meta={k: info.get(k) for k in ("git", "versions", "device", "host", "argv")},
                   checkpoints=self._checkpoints(overrides, info, problems), params=self._params(studio, problems),
                   evolve=read_evolve(self.path, problems), log=self._log_tail())
        if with_token and out["controllable"]:
            try:
                with open(self._file(TOKEN_FILE)) as f:
                    out["token"] = f.read().strip()
            except OSError as e:
                problems.append(f"{TOKEN_FILE} is unreadable: {e}")
        return out

    def _log_tail(self, max_bytes: int = 8192) -> dict | None:
        """``{"file", "text"}``: the end of the job's log (Hydra writes ``<task>.log`` into the run folder)."""
        try:
            logs = sorted(n for n in os.listdir(self.path) if n.endswith(".log"))
            if not logs:
                return None
            with open(self._file(logs[0]), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - max_bytes))
                return {"file": logs[0], "text": f.read().decode("utf-8", "replace")}
        except OSError:
            return None

    def _params(self, studio: dict, problems: list) -> list[dict] | None:
        if isinstance(studio.get("params"), list):
            return studio["params"]
        ckpts = self._checkpoint_dirs()
        if not ckpts:
            return None
        file = os.path.join(ckpts[-1][1], MODEL_FILE)
        try:
            return safetensors_params(file)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{os.path.relpath(file, self.path)} header is unreadable: {e}")
            return None

    def _checkpoints(self, overrides, info: dict, problems: list) -> list[dict]:
        if not isinstance(overrides, list):  # no .hydra/overrides.yaml: the command line of run_info.json
            argv = info.get("argv") or []
            launched = bool(argv) and str(argv[0]).replace(os.sep, "/").endswith("tritonllm/train/__main__.py")
            overrides = [a for a in argv[1:] if a not in ("-m", "--multirun")] if launched else None
        base = [o for o in map(str, overrides or []) if not o.lstrip("+~").startswith(("trainer.resume=", "hydra."))]
        records = self.metrics.records
        out = []
        for step, path in self._checkpoint_dirs():
            try:
                size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
            except OSError as e:
                problems.append(f"checkpoint {os.path.basename(path)} is unreadable: {e}")
                continue
            complete = os.path.isfile(os.path.join(path, "state.json"))
            train = [r for r in records if r["kind"] == "train" and _number(r.get("step")) and r["step"] <= step]
            val = [r for r in records if r["kind"] == "val" and r.get("step") == step]
            cmd = ["python", "-m", "tritonllm.train", *base, f"trainer.resume={path}"]
            out.append({"step": step, "path": path, "bytes": size, "complete": complete,
                        "loss": train[-1].get("loss") if train else None,
                        "val_loss": val[-1].get("val_loss") if val else None,
                        # without the run's overrides the command would train another config: none then
                        "resume": " ".join(map(shlex.quote, cmd)) if overrides is not None else None})
        return out

    # ------------------------------------------------------------------ controls
    def control(self, token: str | None, request: dict) -> dict:
        """Carry out ``request`` (``{"action": "stop" | "checkpoint"}`` or ``{"action": "lr_scale",
        "value": x}``) by updating ``control.json`` if ``token`` is the run's; returns the new file."""
        try:
            with open(self._file(TOKEN_FILE)) as f:
                expected = f.read().strip()
        except OSError:
            raise ControlError(404, "this run takes no control requests (no studio_token in its folder)") from None
        if not token or not hmac.compare_digest(token.encode(), expected.encode()):
            raise ControlError(403, "refused: the request does not carry this run's token")
        if self.summary()["status"] != "running":
            raise ControlError(409, "refused: the run is not running")
        action = request.get("action")
        with self._control_lock:
            state = _read_json(self._file(CONTROL_FILE), [], CONTROL_FILE) or {}
            state = {"stop": bool(state.get("stop", False)), "checkpoint": int(state.get("checkpoint", 0)),
                     "lr_scale": float(state.get("lr_scale", 1.0))}
            if action == "stop":
                state["stop"] = True
            elif action == "checkpoint":
                state["checkpoint"] += 1
            elif action == "lr_scale":
                value = request.get("value")
                lo, hi = LR_SCALE_RANGE
                if not (_number(value) and lo <= value <= hi):
                    raise ControlError(400, f"lr_scale value must be a number in [{lo}, {hi}], got {value!r}")
                state["lr_scale"] = float(value)
            else:
                raise ControlError(400, f"unknown action {action!r}: stop, checkpoint or lr_scale")
            tmp = self._file(f".{CONTROL_FILE}.{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self._file(CONTROL_FILE))
        return state


class RunIndex:
    """The runs under ``roots``, searched again at most every ``rescan_s`` seconds."""

    def __init__(self, roots: list[str], stale_after: float = 600.0, rescan_s: float = 1.0):
        self.roots = [os.path.abspath(r) for r in roots]
        self.stale_after, self.rescan_s = stale_after, rescan_s
        self._runs: dict[str, Run] = {}
        self._scanned = -math.inf
        self._lock = threading.Lock()

    def runs(self) -> list[Run]:
        with self._lock:
            if time.monotonic() - self._scanned >= self.rescan_s:
                self._scan()
                self._scanned = time.monotonic()
            return list(self._runs.values())

    def get(self, run_id: str) -> Run | None:
        return next((r for r in self.runs() if r.id == run_id), None)

    def _scan(self) -> None:
        found: dict[str, str] = {}
        for root in self.roots:
            label = os.path.basename(root) or root
            for path in self._walk(root, 0):
                rel = os.path.relpath(path, root)
                run_id = label if rel == "." else f"{label}/{rel}"
                while run_id in found and found[run_id] != path:
                    run_id += "+"
                found[run_id] = path
        self._runs = {i: self._runs[i] if i in self._runs and self._runs[i].path == p else Run(i, p, self.stale_after)
                      for i, p in sorted(found.items())}

    def _walk(self, folder: str, depth: int):
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        names = {e.name for e in entries}
        if any(m in names for m in EVOLVE_FILES):
            yield folder  # and on into it: its candidates' run folders are runs too
        elif any(m in names for m in RUN_MARKERS):
            yield folder
            return
        subdirs = [e.path for e in entries if e.is_dir() and e.name not in SKIP_DIRS and not e.name.startswith(".")]
        if not subdirs and depth > 0 and not any(e.is_file() for e in entries):
            yield folder  # an empty leaf: a run that died before writing anything
            return
        if depth < MAX_DEPTH:
            for sub in sorted(subdirs):
                yield from self._walk(sub, depth + 1)
