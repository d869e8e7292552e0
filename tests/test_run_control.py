"""Stopping and sharing: a run claims its checkpoint folder (a second run on it is refused before it
trains, a lock left by a dead process is taken over), SIGINT / SIGTERM end a training run in one line
with a checkpoint the next run resumes from, and SIGTERM to an evolve search leaves no candidate
running. The training runs are test_train's shrunken void_tiny, as subprocesses signalled once their
first step is recorded in metrics.jsonl."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from _checks import child_env
from test_evolve import SEARCH, compose_evolve, read_records
from test_train import TINY, compose_train, data_overrides, read_metrics  # noqa: F401 (fixture)

from tritonllm.checkpoint import LOCK_FILE, claim_ckpt_dir, list_checkpoints, read_state
from tritonllm.errors import CheckpointError
from tritonllm.evolve.search import run_search
from tritonllm.runtime import SignalFlag, descendants, end_process_tree, exit_on_user_error, running as alive
from tritonllm.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: a run that would go on far longer than any test: it is stopped by a signal; checkpoints only at its end
LONG = ["trainer.max_steps=1000", "trainer.eval_interval=1000", "trainer.ckpt_interval=0"]


def start_train(run_dir, *overrides) -> subprocess.Popen:
    """``python -m tritonllm.train`` in ``run_dir``, its stdout and stderr into files there."""
    os.makedirs(run_dir, exist_ok=True)
    with open(run_dir / "out.txt", "w") as out, open(run_dir / "err.txt", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "tritonllm.train", *TINY, *overrides, f"hydra.run.dir={run_dir}"],
                                stdout=out, stderr=err, cwd=run_dir)


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"{what} did not happen (exit status {proc.returncode})")
        time.sleep(0.1)


def first_step_recorded(run_dir) -> bool:
    try:
        return bool(read_metrics(run_dir, "train"))
    except (OSError, ValueError):  # not written yet, or a line half written
        return False


def finish(proc: subprocess.Popen, run_dir, timeout: float = 120) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``proc`` once it ends."""
    proc.wait(timeout=timeout)
    with open(run_dir / "out.txt") as out, open(run_dir / "err.txt") as err:
        return proc.returncode, out.read(), err.read()


# ----------------------------------------------------------------------------- signals

def test_signal_flag_records_the_first_signal_and_ignores_more():
    before = signal.getsignal(signal.SIGINT)
    with SignalFlag() as flag:
        assert flag.signum is None
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C, as during the checkpoint: no KeyboardInterrupt
        time.sleep(0.01)
        assert flag.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_ends_an_app_in_one_line_after_its_finally(capsys):
    cleaned = []

    @exit_on_user_error
    def app():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        finally:
            cleaned.append(True)

    with pytest.raises(SystemExit) as stop:
        app()
    assert stop.value.code == 128 + signal.SIGTERM and cleaned == [True]
    assert capsys.readouterr().err == "tritonllm: stopped by SIGTERM\n"


def test_end_process_tree_reaches_a_grandchild_in_its_own_session(tmp_path):
    """As torchrun's workers: a process below the child that left the child's process group."""
    proc = subprocess.Popen(["sh", "-c", "setsid sleep 600 & sleep 600"], start_new_session=True)
    deadline = time.monotonic() + 30
    while not any(os.getsid(pid) != proc.pid for pid in descendants(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the two sleeps run, one of them in a session of its own
    pids = [proc.pid, *descendants(proc.pid)]
    assert len(pids) == 3
    end_process_tree(proc)
    assert proc.returncode == -signal.SIGKILL and not [pid for pid in pids if alive(pid)]


# ----------------------------------------------------------------------------- the claim of ckpt_dir

def test_claim_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path, caplog):
    folder = str(tmp_path)
    with claim_ckpt_dir(folder, out_dir="A") as lock:
        with open(lock) as f:
            holder = json.load(f)
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["out_dir"] == "A"
        assert list_checkpoints(folder) == []  # the lock is no checkpoint
    assert not os.path.exists(lock)  # released

    other = subprocess.Popen(["sleep", "60"])  # a live process of this host holds the folder
    try:
        with open(tmp_path / LOCK_FILE, "w") as f:
            json.dump({"pid": other.pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00"}, f)
        with pytest.raises(CheckpointError, match=rf"trainer.ckpt_dir={folder} is in use by run pid {other.pid} on "
                                                  rf"host {socket.gethostname()} since 2026-01-01T00:00:00"):
            with claim_ckpt_dir(folder):
                pass
    finally:
        other.kill()
        other.wait()
    with claim_ckpt_dir(folder):  # now dead: stale, taken over
        with open(tmp_path / LOCK_FILE) as f:
            assert json.load(f)["pid"] == os.getpid()
    assert f"the lock of run pid {other.pid}" in caplog.text and not os.path.exists(tmp_path / LOCK_FILE)

    with open(tmp_path / LOCK_FILE, "w") as f:  # a live pid on another host cannot be checked: refused
        json.dump({"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00"}, f)
    with pytest.raises(CheckpointError, match="in use by run pid 1 on host elsewhere"):
        with claim_ckpt_dir(folder):
            pass


def test_a_run_takes_over_a_stale_lock_and_releases_it(tmp_path, data_overrides):
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    gone = subprocess.Popen(["true"])
    gone.wait()
    with open(ckpt / LOCK_FILE, "w") as f:
        json.dump({"pid": gone.pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00"}, f)
    train(compose_train(*TINY, *data_overrides, "trainer.max_steps=1", f"out_dir={tmp_path}",
                        f"trainer.ckpt_dir={ckpt}"))
    assert sorted(os.listdir(ckpt)) == ["step_00000001"]  # the lock released, nothing else left


def test_a_second_run_on_the_folder_is_refused_then_sigterm_stops_the_first(tmp_path, data_overrides):
    """Run A trains; run B on A's ckpt_dir is refused in one line before it trains; SIGTERM ends A
    with a checkpoint, exit status 143 and no process of it left."""
    ckpt = tmp_path / "shared"
    a = start_train(tmp_path / "a", *data_overrides, *LONG, f"trainer.ckpt_dir={ckpt}")
    wait_for(a, lambda: os.path.exists(ckpt / LOCK_FILE), "run A's claim")
    b = subprocess.run([sys.executable, "-m", "tritonllm.train", *TINY, *data_overrides, f"trainer.ckpt_dir={ckpt}",
                        f"hydra.run.dir={tmp_path / 'b'}"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert b.returncode == 1 and "Traceback" not in b.stderr
    lines = b.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tritonllm: error: trainer.ckpt_dir={ckpt} is in use by run "
                                                   f"pid {a.pid} on host {socket.gethostname()} since ")
    assert not os.path.exists(tmp_path / "b" / "metrics.jsonl")  # B never trained

    wait_for(a, lambda: first_step_recorded(tmp_path / "a"), "run A's first step")
    pids = [a.pid, *descendants(a.pid)]
    a.send_signal(signal.SIGTERM)
    rc, out, err = finish(a, tmp_path / "a")
    assert rc == 128 + signal.SIGTERM and "Traceback" not in err
    (step, path), = list_checkpoints(str(ckpt))
    assert step >= 1 and f"stopped by SIGTERM at step {step}: checkpoint {path}" in out + err
    assert not [pid for pid in pids if alive(pid)]
    assert sorted(os.listdir(ckpt)) == [os.path.basename(path)]  # the lock released


def test_ctrl_c_saves_a_checkpoint_the_resumed_run_continues_from(tmp_path, data_overrides):
    run = tmp_path / "run"
    proc = start_train(run, *data_overrides, *LONG)
    wait_for(proc, lambda: first_step_recorded(run), "the first step")
    proc.send_signal(signal.SIGINT)
    rc, out, err = finish(proc, run)
    assert rc == 128 + signal.SIGINT and "Traceback" not in err and "KeyboardInterrupt" not in err
    (step, path), = list_checkpoints(str(run / "checkpoints"))
    stop_lines = [line for line in (out + err).splitlines() if "stopped by" in line]
    assert len(stop_lines) == 1 and stop_lines[0].endswith(f"stopped by SIGINT at step {step}: checkpoint {path}")
    assert read_state(path)["step"] == step == read_metrics(run, "train")[-1]["step"]
    assert read_metrics(run, "end")[-1]["status"] == "stopped"

    # resumed with the same command: it continues at the next step
    train(compose_train(*TINY, *data_overrides, *LONG, f"trainer.max_steps={step + 1}", "trainer.resume=auto",
                        f"out_dir={run}"))
    assert [r["step"] for r in read_metrics(run, "train")] == list(range(1, step + 2))
    assert [s for s, _ in list_checkpoints(str(run / "checkpoints"))] == [step, step + 1]


def test_sigterm_to_evolve_ends_the_candidate_and_the_search_resumes(tmp_path, data_overrides):
    run = tmp_path / "run"
    env = child_env(os.path.dirname(__file__), ROOT)
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tritonllm.evolve", *SEARCH, *data_overrides,
                                 "evolve.generations=1", "evolve.evaluator=_evolve_targets:training_forever",
                                 f"hydra.run.dir={run}"], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    pids_file = run / "candidates" / "0000" / "pids.txt"
    wait_for(proc, pids_file.exists, "the first candidate's start")
    candidate, its_child = map(int, pids_file.read_text().split())
    pids = [proc.pid, *descendants(proc.pid)]
    assert candidate in pids and its_child in pids
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    with open(tmp_path / "out.txt") as f:
        console = f.read()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in console
    assert console.strip().splitlines()[-1] == "tritonllm: stopped by SIGTERM"
    assert not [pid for pid in pids if alive(pid)]

    summary = run_search(compose_evolve(*SEARCH, *data_overrides, "evolve.generations=1",
                                        "evolve.evaluator=_evolve_targets:fake", f"out_dir={run}"))
    assert summary["counts"]["ok"] == 2
    assert [r["status"] for r in read_records(run) if r.get("slot") is not None] == ["ok", "ok"]
