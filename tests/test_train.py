"""Training app: config errors, schedules, the non-finite-loss guard, checkpoints (atomic, keep-last-K,
unreadable, wrong shape), a short void_tiny run whose loss falls, exact resume, multirun and the
generation CLI. The model is void_tiny shrunk further and the corpus a few text files written here."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from _checks import DEVICE

from tritonllm import checkpoint as ckpt_mod
from tritonllm.checkpoint import find_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from tritonllm.errors import CheckpointError, ConfigError, DataError, TrainingError
from tritonllm.schedule import lr_multiplier
from tritonllm.train import NonFiniteGuard, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: void_tiny shrunk for the interpreter, on text files, four steps, checkpoint after step 2
TINY = ["+model=void_tiny", "model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=2",
        "model.d_ff=128", "model.max_seq_len=64", "data=text", "data.vocab_size=512", f"device={DEVICE}",
        "trainer.batch_size=2", "trainer.seq_len=32", "trainer.max_steps=4", "trainer.eval_interval=2",
        "trainer.eval_batches=1", "trainer.log_interval=1", "trainer.ckpt_interval=2", "trainer.keep_last=5",
        "trainer.progress=false", "optim.lr=2e-2", "sched.warmup_steps=1"]


def compose_train(*overrides):
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


def read_metrics(out_dir, kind):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def data_overrides(tmp_path_factory):
    import argparse

    folder = tmp_path_factory.mktemp("texts")
    with open(argparse.__file__) as f:  # not a file of this repository: the tests' numbers stay put as it changes
        source = f.read()[:14000]
    for i in range(8):  # ~8 x 14 KB of Python: enough windows for 6 steps plus validation
        (folder / f"part{i}.txt").write_text(source[i * 1000:] + source[:i * 1000])
    return [f"data.files={folder}/*.txt", f"data.cache_dir={tmp_path_factory.mktemp('cache')}"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, data_overrides):
    """Four steps in one go; the checkpoint at step 2 is what an interrupted run would have left."""
    out = tmp_path_factory.mktemp("runs") / "straight"
    val = train(compose_train(*TINY, *data_overrides, f"out_dir={out}"))
    return str(out), val


# ----------------------------------------------------------------------------- config errors

def test_unknown_config_key_is_rejected():
    with pytest.raises(ConfigCompositionException, match="trainer.no_such_key"):
        compose_train("+model=void_tiny", "trainer.no_such_key=1")


def test_no_model_lists_the_models(tmp_path):
    with pytest.raises(ConfigError, match=r"\+model=<name>.*void125m.*void_tiny"):
        train(compose_train(f"out_dir={tmp_path}"))


def test_missing_data_path(tmp_path):
    with pytest.raises(DataError, match=r"data.files=.*no_such_dir"):
        train(compose_train(*TINY, f"data.files={tmp_path}/no_such_dir/*.txt", f"out_dir={tmp_path}"))


def test_cli_error_is_one_line_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tritonllm.train", f"hydra.run.dir={tmp_path}"], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1
    assert "tritonllm: error: no model chosen" in r.stderr and "void_tiny" in r.stderr
    assert "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- schedules and guard

@pytest.mark.parametrize("name", ["cosine", "wsd", "constant"])
def test_schedules(name):
    sched = compose_train(f"sched={name}", "sched.warmup_steps=10").sched
    m = [lr_multiplier(s, 100, sched) for s in range(100)]
    assert m[0] == pytest.approx(0.1) and m[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(m[:10], m[1:10]))
    assert max(m) == pytest.approx(1.0)
    if name == "constant":
        assert m[10:] == [1.0] * 90
    elif name == "wsd":
        assert m[10:80] == [1.0] * 70 and all(a >= b for a, b in zip(m[80:], m[81:])) and m[99] < 0.1
    else:
        assert all(a >= b for a, b in zip(m[10:], m[11:])) and m[99] == pytest.approx(sched.min_lr_ratio, abs=1e-3)


def test_non_finite_guard_skips_then_stops():
    guard = NonFiniteGuard(3)
    assert guard.check(0, 2.5, 1.0)
    assert not guard.check(1, math.nan, 1.0)
    assert not guard.check(2, 2.4, math.inf)
    assert guard.check(3, 2.3, 0.9) and guard.consecutive == 0  # a good step resets the count
    assert not guard.check(4, math.inf, math.nan)
    assert not guard.check(5, math.nan, math.nan)
    with pytest.raises(TrainingError, match="3 steps in a row.*trainer.max_bad_steps=3"):
        guard.check(6, math.nan, 1.0)


# ----------------------------------------------------------------------------- checkpoints

def _tiny_state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_roundtrip_and_keep_last(tmp_path):
    model, opt = _tiny_state(0)
    for step in (10, 20, 30, 40):
        save_checkpoint(str(tmp_path), step, model, opt, {"data": {"epoch": 0, "index": step}}, "a: 1\n",
                        keep_last=2)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [30, 40]
    assert sorted(os.listdir(tmp_path)) == ["step_00000030", "step_00000040"]  # no temporary folders left
    assert find_checkpoint(str(tmp_path)).endswith("step_00000040")
    other, other_opt = _tiny_state(1)
    torch.manual_seed(123)
    expected_rand = torch.rand(3)
    state = load_checkpoint(find_checkpoint(str(tmp_path)), other, other_opt)
    assert state["step"] == 40 and state["data"]["index"] == 40
    assert torch.equal(other.weight, model.weight)
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert not torch.equal(torch.rand(3), expected_rand)  # the RNG state was restored to the saved one


def test_failed_checkpoint_write_leaves_previous_intact(tmp_path, monkeypatch):
    model, opt = _tiny_state(0)
    good = save_checkpoint(str(tmp_path), 1, model, opt, {}, keep_last=1)
    before = {f: open(os.path.join(good, f), "rb").read() for f in os.listdir(good)}

    real_save = torch.save

    def failing_save(obj, path, *a, **k):
        if path.endswith("rng.pt"):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt_mod.torch, "save", failing_save)
    with pytest.raises(CheckpointError, match="step_00000002.*No space left.*untouched"):
        save_checkpoint(str(tmp_path), 2, model, opt, {}, keep_last=1)
    assert os.listdir(tmp_path) == ["step_00000001"]
    assert {f: open(os.path.join(good, f), "rb").read() for f in os.listdir(good)} == before


def test_unreadable_checkpoint(tmp_path):
    model, opt = _tiny_state(0)
    path = save_checkpoint(str(tmp_path), 5, model, opt, {})
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"garbage, not safetensors")
    with pytest.raises(CheckpointError, match="is corrupt: model.safetensors does not match the checksum"):
        load_checkpoint(path, model, opt)
    os.remove(os.path.join(path, "state.json"))
    with pytest.raises(CheckpointError, match="step_00000005 is unreadable: state.json"):
        load_checkpoint(path, model, opt)
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        load_checkpoint(str(tmp_path / "nowhere"), model, opt)


# ----------------------------------------------------------------------------- training

def test_short_run_lowers_loss_and_writes_outputs(straight_run):
    out, val = straight_run
    losses = [r["loss"] for r in read_metrics(out, "train")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses
    assert math.isfinite(val) and val == read_metrics(out, "val")[-1]["val_loss"]
    assert [os.path.basename(p) for _, p in list_checkpoints(os.path.join(out, "checkpoints"))] == \
        ["step_00000002", "step_00000004"]
    for f in ("loss.png", "run_info.json", "tokenizer.model", "checkpoints/step_00000004/tokenizer.model"):
        assert os.path.isfile(os.path.join(out, f)), f
    info = json.load(open(os.path.join(out, "run_info.json")))
    assert info["config"]["model"]["vocab_size"] <= 512 and info["versions"]["torch"] and "git" in info


def test_resume_reproduces_the_straight_run(straight_run, data_overrides, tmp_path):
    out, val = straight_run
    resumed = tmp_path / "resumed"
    val2 = train(compose_train(*TINY, *data_overrides, f"out_dir={resumed}",
                               f"trainer.resume={out}/checkpoints/step_00000002"))
    straight = {r["step"]: r["loss"] for r in read_metrics(out, "train")}
    again = {r["step"]: r["loss"] for r in read_metrics(str(resumed), "train")}
    assert sorted(again) == [3, 4]
    assert all(again[s] == straight[s] for s in again), (straight, again)  # bit-identical in fp32
    assert val2 == val


def test_resume_latest_of_name_finds_the_previous_run(straight_run, data_overrides):
    out, val = straight_run
    sibling = os.path.join(os.path.dirname(out), "later")
    assert train(compose_train(*TINY, *data_overrides, f"out_dir={sibling}", "trainer.resume=latest_of_name")) == val
    assert read_metrics(sibling, "train") == [] and read_metrics(sibling, "val")[-1]["step"] == 4  # nothing trained


def test_resume_with_another_model_shape_is_an_error(straight_run, data_overrides, tmp_path):
    out, _ = straight_run
    with pytest.raises(ConfigError, match=r"config differs .* in 1 key\(s\): model.d_model: 64 -> 96.*resume_force"):
        train(compose_train(*TINY, *data_overrides, "model.d_model=96", f"out_dir={tmp_path}",
                            f"trainer.resume={out}/checkpoints"))
    with pytest.raises(CheckpointError, match=r"different model shape.*d_model=64 saved vs 96"):
        train(compose_train(*TINY, *data_overrides, "model.d_model=96", f"out_dir={tmp_path}",
                            f"trainer.resume={out}/checkpoints", "trainer.resume_force=true"))


def test_generate_cli(straight_run):
    out, _ = straight_run
    r = subprocess.run([sys.executable, "-m", "tritonllm.generate", f"ckpt={out}", "prompt=import",
                        "max_new_tokens=4", "temperature=0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("import")


def test_multirun_two_jobs(data_overrides, tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "tritonllm.train", "-m", *TINY, *data_overrides, "trainer.max_steps=1",
           "trainer.ckpt_interval=null", "trainer.sample_tokens=3", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("--- sample after 1 steps ---") == 2
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        folder = sweep / job
        assert OmegaConf.load(folder / ".hydra" / "config.yaml").optim.lr == lr
        assert (folder / "loss.png").is_file() and (folder / "checkpoints" / "step_00000001").is_dir()
        assert len(read_metrics(str(folder), "train")) == 1
