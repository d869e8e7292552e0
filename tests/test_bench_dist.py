"""``python -m tritonllm.bench train --nproc N`` (tritonllm/bench/dist_train.py) on the CPU: two gloo
processes, tritonllm through the Triton interpreter, the baseline eager; a smoke test of the
launches and of the rows, not a measurement. The GPU measurement is in the README's multi-GPU section."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from _checks import ON_GPU, child_env
from tritonllm.bench.dist_train import launch
from tritonllm.errors import ConfigError

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")

TINY = ["+model=void_tiny", "model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2",
        "model.d_ff=128", "model.max_seq_len=64", "model.vocab_size=512", "trainer.batch_size=2", "trainer.seq_len=32"]


@pytest.mark.skipif(ON_GPU, reason="gloo processes on the CPU interpreter")
def test_two_processes_fsdp_rows(tmp_path):
    """FSDP2 on two processes against one, tritonllm and the baseline (fully_shard per block, then the
    root): one row for nproc 2, the earlier one-process row of the same model and the file's header
    kept."""
    out = tmp_path / "perf"
    out.mkdir()
    earlier = {"model": "void_tiny", "batch": 2, "seq_len": 32, "nproc": 1, "parallel": "none", "tokens_per_s": 1}
    (out / "train-cpu.json").write_text(json.dumps({"gpu": "earlier", "results": [earlier]}))
    cmd = [sys.executable, "-m", "tritonllm.bench", "train", "--nproc", "2", "--device", "cpu", "--parallel", "fsdp",
           "--steps", "1", "--warmup", "0", "--compile-mode", "none", f"--out={out}", *TINY]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=child_env(OMP_NUM_THREADS="1", TRITONLLM_NO_AUTOTUNE="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for line in ("-- tritonllm parallel=none x1", "-- tritonllm parallel=fsdp x2", "-- baseline parallel=none x1",
                 "-- baseline parallel=fsdp x2", "tritonllm fsdp x2", "baseline fsdp x2"):
        assert line in r.stdout, r.stdout
    doc = json.loads((out / "train-cpu.json").read_text())
    assert doc["gpu"] == "earlier" and doc["results"][0] == earlier
    assert len(doc["results"]) == 2
    row = doc["results"][1]
    assert (row["model"], row["batch"], row["seq_len"], row["nproc"], row["parallel"]) == ("void_tiny", 2, 32, 2, "fsdp")
    assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_gpu"] == pytest.approx(row["tokens_per_s"] / 2, abs=1)
    assert row["scaling_efficiency"] == pytest.approx(row["one_gpu"]["step_ms"] / row["step_ms"], rel=1e-3)
    base = row["baselines"]["FSDP2 + eager"]
    assert base["tokens_per_s"] > 0 and base["scaling_efficiency"] > 0 and base["compile_mode"] == "none"
    assert row["speedup"] == pytest.approx(base["step_ms"] / row["step_ms"], rel=1e-2)
    for f in (row, base):  # the host's share of a step: within the step (every rank's calls lie between barriers)
        assert 0 < f["host_ms"] <= f["step_ms"] * 1.1, f
    for loss in (row["loss"], base["loss"]):  # one step from a random init: about ln(512) = 6.24
        assert 5.5 < loss < 7.0, (row, base)


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "1"], "--nproc must be >= 2"),
    (["--nproc", "2,1"], "--nproc must be >= 2"),
    (["--nproc", "2,four"], "--nproc: comma-separated GPU counts"),
    (["--nproc", "2", "--parallel", "ddp,tp"], "--parallel: comma-separated modes of ddp, fsdp"),
    (["--nproc", "2", "--steps", "0"], "--steps must be >= 1"),
    (["--nproc", "2", "--rounds", "0"], "--rounds must be >= 1"),
], ids=["one-proc", "one-proc-in-list", "not-a-number", "unknown-mode", "no-steps", "no-rounds"])
def test_bad_arguments(argv, message):
    with pytest.raises(ConfigError, match="python -m tritonllm.bench train --nproc N: ") as e:
        launch([*argv, "--device", "cpu", *TINY])
    assert message in str(e.value)



def _fake_run(order):
    """A stand-in for one torchrun: records the configuration and returns figures whose step time
    grows with the GPU count (per-GPU batch fixed), the baseline 1.5x slower."""
    def run(side, mode, n, args, overrides, folder):
        order.append((side, mode, n))
        ms = (1.5 if side == "baseline" else 1.0) * 100 * (1 + 0.01 * (n - 1))
        return {"model": "void_tiny", "batch": 2, "seq_len": 32, "nproc": n, "device": "cpu", "torch": "t",
                "tokens_per_s": round(64 * n / ms * 1e3), "tokens_per_s_per_gpu": round(64 / ms * 1e3), "mfu": 0.1,
                "step_ms": ms, "loss": 6.2}
    return run


def test_several_gpu_counts_rows(tmp_path, monkeypatch):
    """``--nproc 2,4``: the one-GPU references once and first, then each count's configurations, ours
    before the baseline's; one row per count and mode, each with its scaling efficiency against the
    one-GPU run."""
    import tritonllm.bench.dist_train as dist_train

    order = []
    monkeypatch.setattr(dist_train, "_run", _fake_run(order))
    rows = launch(["--nproc", "4,2", "--parallel", "ddp,fsdp", "--device", "cpu", f"--out={tmp_path}", *TINY])
    assert order == [("tritonllm", "none", 1), ("baseline", "none", 1),
                     ("tritonllm", "ddp", 2), ("tritonllm", "fsdp", 2), ("baseline", "ddp", 2), ("baseline", "fsdp", 2),
                     ("tritonllm", "ddp", 4), ("tritonllm", "fsdp", 4), ("baseline", "ddp", 4), ("baseline", "fsdp", 4)]
    assert [(r["nproc"], r["parallel"]) for r in rows] == [(2, "ddp"), (2, "fsdp"), (4, "ddp"), (4, "fsdp")]
    for r in rows:
        assert r["scaling_efficiency"] == pytest.approx(1 / (1 + 0.01 * (r["nproc"] - 1)), rel=1e-3)
        base = next(iter(r["baselines"].values()))
        assert base["scaling_efficiency"] == pytest.approx(r["scaling_efficiency"], rel=1e-3)
        assert r["speedup"] == pytest.approx(1.5)
    doc = json.loads((tmp_path / "train-cpu.json").read_text())
    assert [(r["nproc"], r["parallel"]) for r in doc["results"]] == [(2, "ddp"), (2, "fsdp"), (4, "ddp"), (4, "fsdp")]


def test_rounds_alternate_and_pair(tmp_path, monkeypatch):
    """``--rounds 4``: each count's configurations run four times, every other round in the reverse
    order (A B B A A B B A), the one-GPU references once. On a machine that gets 10% faster with every
    run, each round's ratio errs by 10% one way or the other, and their geometric mean is the true
    1.5x; the row holds the median run and every round's step time."""
    import tritonllm.bench.dist_train as dist_train

    order = []
    fake = _fake_run(order)

    def drifting(side, mode, n, *rest):
        f = fake(side, mode, n, *rest)
        return {**f, "step_ms": round(f["step_ms"] * 0.9 ** len(order), 4)}

    monkeypatch.setattr(dist_train, "_run", drifting)
    rows = launch(["--nproc", "2", "--parallel", "fsdp", "--rounds", "4", "--device", "cpu", f"--out={tmp_path}", *TINY])
    ours, base = ("tritonllm", "fsdp", 2), ("baseline", "fsdp", 2)
    assert order == [("tritonllm", "none", 1), ("baseline", "none", 1), ours, base, base, ours, ours, base, base, ours]
    (row,) = rows
    expect = [101 * 0.9 ** k for k in (3, 6, 7, 10)]
    assert row["step_ms_rounds"] == pytest.approx(expect, rel=1e-4)
    assert row["step_ms"] == pytest.approx(expect[2], rel=1e-4)  # the lower of the two middle runs
    b = row["baselines"]["FSDP2 + torch.compile"]
    assert b["step_ms_rounds"] == pytest.approx([151.5 * 0.9 ** k for k in (4, 5, 8, 9)], rel=1e-4)
    assert row["speedup_rounds"] == pytest.approx([1.35, 1.5 / 0.9, 1.35, 1.5 / 0.9], abs=1e-3)
    assert row["speedup"] == pytest.approx(1.5, abs=1e-3)
    assert "speedup_rounds" not in launch(["--nproc", "2", "--parallel", "fsdp", "--device", "cpu",
                                           f"--out={tmp_path}", *TINY])[0]


def test_ab_variant_interleaved(tmp_path, monkeypatch):
    """``--ab NAME=VALUE``: tritonllm again with that config key set, a third side in every
    round (A B C, then C B A), not on one GPU; the row keeps the default's figures and holds the
    variant's with its paired gain over the default."""
    import tritonllm.bench.dist_train as dist_train

    order = []
    fake = _fake_run(order)
    knob = "trainer.gemm_sm_margin=8"

    def faster_variant(side, mode, n, *rest):
        f = fake(side, mode, n, *rest)
        return {**f, "step_ms": f["step_ms"] * (0.8 if side == f"tritonllm[{knob}]" else 1.0)}

    monkeypatch.setattr(dist_train, "_run", faster_variant)
    (row,) = launch(["--nproc", "2", "--parallel", "fsdp", "--rounds", "2", "--ab", knob, "--device", "cpu",
                     f"--out={tmp_path}", *TINY])
    ours, var, base = ("tritonllm", "fsdp", 2), (f"tritonllm[{knob}]", "fsdp", 2), ("baseline", "fsdp", 2)
    assert order == [("tritonllm", "none", 1), ("baseline", "none", 1), ours, var, base, base, var, ours]
    assert row["step_ms"] == pytest.approx(101.0) and row["speedup"] == pytest.approx(1.5)
    assert row["ab"]["env"] == knob and row["ab"]["step_ms"] == pytest.approx(80.8)
    assert row["ab"]["gain"] == pytest.approx(1.25) and row["ab"]["gain_rounds"] == pytest.approx([1.25, 1.25])


def test_ab_sets_the_variable_for_the_variant_only(tmp_path, monkeypatch):
    """``_run`` starts torchrun with ``--side tritonllm`` for the variant, the ``--ab`` variable in its
    environment (a dotted config key: among its overrides) and not in the default's; a malformed ``--ab``
    is refused, naming the flag."""
    import tritonllm.bench.dist_train as dist_train

    started = []

    class Torchrun:
        def __init__(self, cmd, env, **kwargs):
            started.append((cmd[cmd.index("--side") + 1], env.get("NCCL_ALGO"), "trainer.gemm_sm_margin=8" in cmd))
            with open(cmd[cmd.index("--result") + 1], "w") as f:
                json.dump({"step_ms": 1.0}, f)
            self.returncode, self.pid = 0, os.getpid()

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(dist_train.subprocess, "Popen", Torchrun)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    args, _ = dist_train._parse(["--nproc", "2", "--ab", "NCCL_ALGO=Ring"])
    assert dist_train._parse(["--nproc", "2", "--ab", "trainer.gemm_sm_margin=8"])[0].ab == "trainer.gemm_sm_margin=8"
    for side in ("tritonllm", "tritonllm[NCCL_ALGO=Ring]", "tritonllm[trainer.gemm_sm_margin=8]", "baseline"):
        assert dist_train._run(side, "fsdp", 2, args, [], str(tmp_path))["step_ms"] == 1.0
    assert started == [("tritonllm", None, False), ("tritonllm", "Ring", False), ("tritonllm", None, True),
                       ("baseline", None, False)]
    with pytest.raises(ConfigError, match="--ab: a config key or an environment variable and its value"):
        dist_train._parse(["--nproc", "2", "--ab", "8"])


def test_rounds_with_a_failed_round(tmp_path, monkeypatch):
    """A round that fails on one side is left out of the paired ratios and shows as None among the
    step times; the median is taken over the runs that finished."""
    import tritonllm.bench.dist_train as dist_train

    order = []
    fake = _fake_run(order)

    def second_fails(side, mode, n, *rest):
        f = fake(side, mode, n, *rest)
        if side == "tritonllm" and n == 2 and order.count(("tritonllm", "fsdp", 2)) == 2:
            return {"error": "timed out after 300 s"}
        return f

    monkeypatch.setattr(dist_train, "_run", second_fails)
    (row,) = launch(["--nproc", "2", "--parallel", "fsdp", "--rounds", "2", "--no-one-gpu", "--device", "cpu",
                     f"--out={tmp_path}", *TINY])
    assert row["step_ms_rounds"] == [101.0, None]
    assert row["step_ms"] == 101.0 and "error" not in row
    assert row["speedup_rounds"] == [1.5, None] and row["speedup"] == 1.5


def test_no_one_gpu_and_rows_kept_until_reached(tmp_path, monkeypatch):
    """``--no-one-gpu`` runs no one-GPU configuration and says so in the rows (no scaling efficiency);
    a count not reached (the run cut short) leaves the row recorded earlier alone."""
    import tritonllm.bench.dist_train as dist_train

    earlier = {"model": "void_tiny", "batch": 2, "seq_len": 32, "nproc": 4, "parallel": "fsdp", "tokens_per_s": 7}
    (tmp_path / "train-cpu.json").write_text(json.dumps({"gpu": "cpu", "results": [earlier]}))
    order = []
    fake = _fake_run(order)

    def cut(side, mode, n, *rest):
        if n == 4:
            raise KeyboardInterrupt  # the bench stopped from outside before the 4-GPU runs
        return fake(side, mode, n, *rest)

    monkeypatch.setattr(dist_train, "_run", cut)
    with pytest.raises(KeyboardInterrupt):
        launch(["--nproc", "2,4", "--parallel", "fsdp", "--no-one-gpu", "--device", "cpu", f"--out={tmp_path}", *TINY])
    assert order == [("tritonllm", "fsdp", 2), ("baseline", "fsdp", 2)]
    doc = json.loads((tmp_path / "train-cpu.json").read_text())
    assert doc["results"][0] == earlier and len(doc["results"]) == 2
    row = doc["results"][1]
    assert (row["nproc"], row["scaling_efficiency"], row["one_gpu"]) == (2, None, {"error": "not run (--no-one-gpu)"})
    assert row["speedup"] == pytest.approx(1.5)


def _processes_with(marker: str) -> list[int]:
    """Living processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.skipif(ON_GPU or not os.path.isdir("/proc"), reason="gloo processes on the CPU; Linux /proc")
def test_timeout_ends_torchrun_and_its_workers(tmp_path):
    """A configuration past ``--timeout`` is recorded as timed out, and no worker outlives it: torchrun
    starts them in sessions of their own, which a signal to torchrun's process group would miss (they
    held the GPUs and the launcher's pipes on 4 H200s). The log file says what ran and how it ended."""
    marker = f"seed={random.randrange(10**8, 10**9)}"
    log = tmp_path / "workers.log"
    before = _processes_with(marker)
    cmd = [sys.executable, "-m", "tritonllm.bench", "train", "--nproc", "2", "--device", "cpu", "--parallel", "fsdp",
           "--no-baseline", "--no-one-gpu", "--steps", "100000", "--warmup", "0", "--timeout", "30",
           f"--out={tmp_path}", f"--log={log}", *TINY, marker]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=child_env(OMP_NUM_THREADS="1", TRITONLLM_NO_AUTOTUNE="1"))
    assert r.returncode != 0 and "every configuration failed" in r.stderr, r.stdout + r.stderr
    assert "timed out after 30 s" in r.stdout, r.stdout
    assert before == [] and _processes_with(marker) == []
    text = log.read_text()
    assert "==== tritonllm parallel=fsdp x2" in text and "==== timed out after 30 s" in text
    # the workers were running when the limit came (their rendezvous done; on a loaded 2-core machine,
    # building the model took more than 15 s)
    assert "process group of 2 up" in text, text
