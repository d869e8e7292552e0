"""``python -m tritonllm.bench train --nproc N`` (tritonllm/bench/dist_train.py) on the CPU: two gloo
processes, tritonllm through the Triton interpreter, the baseline eager; a smoke test of the
launches and of the rows, not a measurement. The GPU measurement is in the README's multi-GPU section."""

import json
import subprocess
import sys

import pytest
import torch

from _checks import ON_GPU, child_env
from tritonllm.bench.dist_train import launch

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
    for loss in (row["loss"], base["loss"]):  # one step from a random init: about ln(512) = 6.24
        assert 5.5 < loss < 7.0, (row, base)


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "1"], "--nproc must be >= 2"),
    (["--nproc", "2", "--parallel", "ddp,tp"], "--parallel: comma-separated modes of ddp, fsdp"),
    (["--nproc", "2", "--steps", "0"], "--steps must be >= 1"),
], ids=["one-proc", "unknown-mode", "no-steps"])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        launch([*argv, "--device", "cpu", *TINY])
    assert message in capsys.readouterr().err

