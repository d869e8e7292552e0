"""Helpers shared by the command-line apps (train, generate, bench, evolve): device and dtype
choice, printing a :class:`~tritonllm.errors.TritonLLMError` or a config that does not compose
(wrong type, unknown key, missing value) as one clear line, and ``kill -USR1 <pid>`` printing where
a running app is (:func:`stacks_on_signal`; ``TRITONLLM_STACKS_EVERY=<s>``: every s seconds).

Stopping: in every command-line app SIGTERM (what ``timeout``, ``kill``, Slurm and systemd send)
and SIGINT (Ctrl-C) raise :class:`Stopped` in the main thread (:func:`stop_on_signals`), so every
``finally`` runs -- a child process is ended there (:func:`end_process_tree`), a lock released --
and the app exits with 128 + the signal's number after one line, without a traceback. The
training loop records the signal instead (:class:`SignalFlag`) and stops after its step."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import os
import re
import signal
import sys
import threading
import time
from typing import NoReturn

import torch

from tritonllm.errors import ConfigError, TritonLLMError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; anything else as given (checked)."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"device={spec!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={spec!r} but no CUDA device is available")
    return device


def resolve_dtype(spec: str, device: torch.device, key: str = "trainer.dtype") -> torch.dtype:
    """``auto`` -> bf16 on CUDA, fp32 on CPU. bf16 on the CPU is a ConfigError naming ``key``: the
    kernels run there in Triton's interpreter, which has no bfloat16 ``tl.dot`` (it multiplies the
    raw bit patterns, triton issue 11584: a first loss of 1e10, not a slow run)."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec not in DTYPES:
        raise ConfigError(f"{key}={spec!r} is not one of auto, {', '.join(DTYPES)}")
    if DTYPES[spec] == torch.bfloat16 and device.type != "cuda":
        raise ConfigError(f"{key}={spec} cannot be computed on {device}: the kernels run there in Triton's interpreter, "
                          f"whose bfloat16 matrix products are wrong (triton issue 11584); use {key}=fp32 (or auto) "
                          f"on the CPU, bf16 on a CUDA GPU")
    return DTYPES[spec]


def stacks_on_signal() -> None:
    """From now on ``kill -USR1 <pid>`` prints every thread's Python stack to the process's standard
    error (:mod:`faulthandler`) and the process goes on: where a run that seems stuck is (compiling,
    autotuning, waiting on a collective or a data loader). Registered by every command-line app.

    With ``TRITONLLM_STACKS_EVERY=<seconds>`` in the environment the stacks are also printed every that
    many seconds (faulthandler's own timer thread, so a main thread blocked in C code is still shown;
    child processes inherit the variable): the same view where no one can send the signal."""
    if sys.__stderr__ is None or threading.current_thread() is not threading.main_thread():
        return
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    every = os.environ.get("TRITONLLM_STACKS_EVERY", "").strip()
    if every:
        try:
            seconds = float(every)
        except ValueError:
            raise TritonLLMError(f"TRITONLLM_STACKS_EVERY={every!r}: give the seconds between stack dumps") from None
        if seconds > 0:
            faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.__stderr__)


#: the signals that stop an app
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(SystemExit):
    """The app was stopped by the signal ``signum``: exit status 128 + signum. ``reported``: the line
    saying so was already logged (else :func:`exit_on_user_error` prints ``tritonllm: stopped by ...``)."""

    def __init__(self, signum: int, reported: bool = False):
        super().__init__(128 + signum)
        self.signum, self.reported = signum, reported

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _raise_stopped(signum, frame):
    raise Stopped(signum)


@contextlib.contextmanager
def _handlers(handler):
    """``handler`` for :data:`STOP_SIGNALS` while the block runs, the previous handlers restored after;
    nothing changes outside the main thread (where Python cannot install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_on_signals():
    """Context manager: SIGINT and SIGTERM raise :class:`Stopped` in the main thread while it lasts."""
    return _handlers(_raise_stopped)


class SignalFlag:
    """Context manager recording SIGINT and SIGTERM instead of acting on them: ``signum`` is the first
    one received (None: none yet); later ones are ignored, so a second Ctrl-C cannot interrupt the
    checkpoint the first one asked for. The previous handlers come back at exit."""

    def __init__(self):
        self.signum: int | None = None
        self._stack = contextlib.ExitStack()

    def _record(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> SignalFlag:
        self._stack.enter_context(_handlers(self._record))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (Linux ``/proc``), parents before their children: also those
    that started sessions of their own (torchrun's workers), which a signal to a process group misses."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # not a process, or one that just exited
            continue
        children.setdefault(ppid, []).append(int(entry))
    found = list(children.get(pid, []))
    for child in found:  # the list grows while it is walked: breadth first
        found.extend(children.get(child, []))
    return found


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's included), by signal 0."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux ``/proc``; a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def end_process_tree(proc, wait_s: float = 10.0) -> None:
    """SIGKILL the child ``proc`` (a ``subprocess.Popen``), every process below it and, when it leads
    a process group of its own (``start_new_session``), that group; reap it, and wait up to ``wait_s``
    for the others to be gone (a signal lands asynchronously: a grandchild in a session of its own,
    reparented elsewhere, may still run for a moment after the kill)."""
    pids = [*descendants(proc.pid), proc.pid]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + wait_s
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.01)


def exit_on_user_error(fn):
    """Run ``fn``; a TritonLLMError is printed as ``tritonllm: error: <message>`` (``tritonllm: error on
    rank <r>: ...`` in a multi-process torchrun run) and exits with status 1. ``kill -USR1`` prints the
    stacks meanwhile (:func:`stacks_on_signal`); SIGINT and SIGTERM end it through :class:`Stopped`
    (:func:`stop_on_signals`) with ``tritonllm: stopped by SIGTERM`` and status 128 + the signal."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            stacks_on_signal()
            with stop_on_signals():
                return fn(*args, **kwargs)
        except Stopped as e:
            if not e.reported:
                print(f"tritonllm: stopped by {e.name}", file=sys.stderr, flush=True)
            raise SystemExit(e.code) from None
        except TritonLLMError as e:
            where = f" on rank {os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
            print(f"tritonllm: error{where}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    return wrapper


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for tritonllm's commands: a bad argument (an unknown option, a value
    of the wrong type or out of range, ``parser.error(...)``) raises a ConfigError, so that the command
    ends in one line ``tritonllm: error: <prog>: <message>`` and exit status 1 (:func:`exit_on_user_error`)
    instead of argparse's usage block and status 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")

    def parse_with_overrides(self, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
        """The options, and the rest as Hydra overrides (``key=value``, ``+key=value``, ``~key``); anything
        else left that starts with ``-`` is an option this command does not have: an error, not an override."""
        args, rest = self.parse_known_args(argv)
        unknown = [a for a in rest if a.startswith("-")]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)} (options: "
                       f"{', '.join(o for a in self._actions for o in a.option_strings if o.startswith('--'))})")
        return args, rest


_CONVERSION = re.compile(r"Value '(.*)' (?:of type '\w+' could not be converted to (\w+)|is not a valid (bool))")
_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def describe_config_error(error: Exception) -> str:
    """One line for an error Hydra or OmegaConf raised while composing a config: the key, what it
    must be, and the allowed keys or values where the schema knows them."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    key = getattr(cause, "full_key", None)
    if isinstance(cause, OmegaConfBaseException) and key:
        msg = str(getattr(cause, "msg", cause)).splitlines()[0]
        if m := _CONVERSION.match(msg):
            wanted = m.group(2) or "Boolean"
            return f"{key}={m.group(1)} is not {_TYPE_WORDS.get(wanted, wanted)}"
        if isinstance(cause, MissingMandatoryValue):
            return f"{key} must be set ({key}=<value>)"
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
            schema = getattr(cause, "object_type", None)
            known = f": the keys of {key.rpartition('.')[0] or 'the config'} are " + ", ".join(
                f.name for f in dataclasses.fields(schema)) if dataclasses.is_dataclass(schema) else ""
            return f"{key} is not a known setting{known}"
        return f"{key}: {msg}"
    text = str(error).split("Config search path:")[0]  # Hydra's list of its search path says nothing to the user
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return ", ".join(lines).replace(":, ", ": ")


def compose_config(config_name: str, overrides: list[str]):
    """``tritonllm.conf/<config_name>.yaml`` composed with ``overrides``, for commands that parse their
    own arguments (``bench``): a config that does not compose or a value out of its schema's range
    is a ConfigError holding :func:`describe_config_error`'s line."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from tritonllm.conf.schema import check_config

    try:
        with initialize_config_module("tritonllm.conf", version_base="1.3"):
            cfg = compose(config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(describe_config_error(e)) from None
    check_config(cfg)
    return cfg


def config_dict(node, resolve: bool = True) -> dict:
    """The ``DictConfig`` ``node`` as a plain dict (``OmegaConf.to_container``, interpolations resolved
    unless ``resolve`` is False)."""
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(node, resolve=resolve)
    if not isinstance(out, dict):
        raise TypeError(f"config_dict: expected a DictConfig, got {type(node).__name__}")
    return out


def _set_full_error(value: str | None) -> None:
    if value is None:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    else:
        os.environ["HYDRA_FULL_ERROR"] = value


def hydra_app(config_name: str):
    """``@hydra.main`` over ``tritonllm.conf/<config_name>.yaml`` for a tritonllm command: a
    TritonLLMError from the app, a config that does not compose and a run folder Hydra cannot create
    (``hydra.run.dir`` below a file, a folder without write permission) end as one line
    ``tritonllm: error: ...`` and exit status 1 (``HYDRA_FULL_ERROR=1`` shows Hydra's own report)."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    def decorate(fn):
        asked = os.environ.get("HYDRA_FULL_ERROR")
        started = False  # whether Hydra has called the app (an OSError before that is Hydra's, on the run folder)

        @exit_on_user_error
        def app(cfg):
            nonlocal started
            started = True
            _set_full_error(asked)  # the app and the processes it starts see the user's setting
            try:
                return fn(cfg)
            finally:
                _set_full_error("1")

        task = hydra.main(version_base="1.3", config_path="pkg://tritonllm.conf", config_name=config_name)(app)

        @functools.wraps(fn)
        def main():
            # an option neither Hydra nor tritonllm has (a typo of a flag, an argparse habit) is one line, not
            # Hydra's usage block and status 2; key=value overrides are Hydra's positional arguments
            from hydra._internal.utils import get_args_parser

            unknown = [a for a in get_args_parser().parse_known_args(sys.argv[1:])[1] if a.startswith("-")]
            if unknown:
                print(f"tritonllm: error: unrecognized arguments: {' '.join(unknown)} (settings are key=value; "
                      f"--help lists Hydra's options)", file=sys.stderr, flush=True)
                raise SystemExit(1)
            _set_full_error("1")  # Hydra raises a composition error instead of printing its multi-line report
            try:
                return task()
            except (HydraException, OmegaConfBaseException) as e:
                if asked == "1":
                    raise
                print(f"tritonllm: error: {describe_config_error(e)}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            except OSError as e:
                if started or asked == "1":
                    raise
                print(f"tritonllm: error: cannot create the run folder {e.filename} (hydra.run.dir, hydra.sweep.dir): "
                      f"{e.strerror}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            finally:
                _set_full_error(asked)
        return main
    return decorate
