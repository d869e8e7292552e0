"""``python -m tritonllm.bench speedrun`` on the CPU: a tiny model, a few steps and an easy target
through every side (the torch side without torch.compile), the fields of its row and how
``reached`` is computed; the data it names and its refusal of a budget that repeats the data; the
recipe's plain-PyTorch baseline against the float64 reference model; the PyTorch Muon used where
``torch.optim.Muon`` is missing against ``torch.optim.Muon``."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest
import torch

from _checks import DEVICE, assert_close
from reference_model import ReferenceTransformer
from tritonllm.bench import speedrun
from tritonllm.bench.baseline_model import BaselineTransformer
from tritonllm.data import write_shard
from tritonllm.errors import ConfigError
from tritonllm.models import ModelConfig, build_model

TINY = ["+model=void_tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.n_kv_heads=2",
        "model.d_ff=64", "model.max_seq_len=64", "data.vocab_size=40", "data.val_fraction=0.25", "trainer.batch_size=2",
        "trainer.seq_len=16", "sched.warmup_steps=1", "optim.lr=1e-2"]


def counting_shard(path, n: int) -> str:
    """A token stream of ``n`` tokens that is easy to learn: a counting pattern over 40 ids."""
    write_shard(str(path), (np.arange(n) % 37 + np.arange(n) // 37 % 3).astype(np.int64), 40)
    return str(path)


@pytest.fixture
def shard(tmp_path):
    return counting_shard(tmp_path / "tokens.bin", 4000)


def sha256_of(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(hashlib.sha256(f.read()).digest()).hexdigest()


def test_reached_is_the_first_evaluation_at_or_below_the_target():
    curve, elapsed = [(5, 3.0), (10, 2.4), (15, 2.6), (20, 2.2)], [1.0, 2.0, 3.0, 4.0]
    row = speedrun.side_row("adamw", curve, elapsed, 2.5, tokens_per_step=100, stop="target")
    assert row["reached"] and (row["steps"], row["tokens"], row["seconds"]) == (10, 1000, 2.0)
    assert (row["train_seconds"], row["tokens_per_s"], row["final_val_loss"]) == (4.0, 500, 2.2)
    assert speedrun.side_row("x", curve, elapsed, 2.4, 100, "target")["steps"] == 10  # at the target counts
    assert speedrun.side_row("x", curve, elapsed, 2.3, 100, "target")["steps"] == 20
    missed = speedrun.side_row("adamw", curve, elapsed, 2.0, 100, "max_steps")
    assert not missed["reached"] and missed["steps"] is None and missed["tokens"] is None
    assert missed["seconds"] is None and missed["stop"] == "max_steps"
    assert speedrun.compare({"adamw": {"seconds": 10.0}, "recipe": {"seconds": 6.0}, "torch": {"seconds": 9.0}}) == {
        "time_ratio_recipe_vs_adamw": 0.6, "speedup_vs_torch": 1.5}
    assert speedrun.compare({"adamw": missed, "recipe": row}) == {}


def run(shard, argv):
    args, overrides = speedrun.parse(argv + TINY + ["data=bin", f"data.files={shard}"])
    cfg, rcfg, plain, recipe, corpus = speedrun.configs(args, overrides)
    written = []
    row = speedrun.run_all(args, cfg, rcfg, plain, recipe, corpus, torch.device(DEVICE), torch.float32, written.append)
    assert len(written) == len(args.sides) and written[-1] is row
    return row


def test_every_side_reaches_an_easy_target(shard):
    row = run(shard, ["--target", "100", "--max-steps", "2", "--eval-every", "1", "--eval-batches", "1",
                      "--warmup", "1", "--torch-mode", "eager"])
    assert row["pass"] == "speedrun" and row["recipe"]["mlp_act"] == "relu2" and row["recipe"]["value_embeddings"] == 1
    assert set(row["sides"]) == {"adamw", "recipe", "torch"}
    for name, side in row["sides"].items():
        assert side["reached"] and side["stop"] == "target", name
        assert (side["steps"], side["tokens"], side["steps_run"]) == (1, 32, 1), name
        assert side["seconds"] == side["train_seconds"] > 0 and side["tokens_per_s"] > 0, name
        assert len(side["curve"]) == 1 and side["curve"][0][1] == side["final_val_loss"] < 100, name
    assert row["sides"]["recipe"]["optim"] == "muon" and row["sides"]["adamw"]["optim"] == "adamw"
    assert set(row) >= {"time_ratio_recipe_vs_adamw", "speedup_vs_torch"}
    # the data it ran on: 3000 training tokens, 187 windows of 16, of which 2 steps x B2 read 4
    assert row["corpus"] == {"name": f"bin {shard}", "files": 1, "train_tokens": 3000, "sha256": sha256_of(shard),
                             "passes": round(2 * 2 * 16 / (187 * 16), 4)}


def test_a_side_that_misses_the_target_says_so_and_allow_repeat_runs_over_the_data_again(tmp_path, caplog):
    """Training tokens for 2 steps (100 tokens, 75 for training: 4 windows of 16, 2 batches of 2) and a
    budget of 3: --allow-repeat runs it, the row says 1.5 passes and the loader logs the new epoch once."""
    small = counting_shard(tmp_path / "small.bin", 100)
    with caplog.at_level(logging.INFO, logger="tritonllm.data.loader"):
        row = run(small, ["--target", "0", "--max-steps", "3", "--eval-every", "2", "--eval-batches", "1",
                          "--warmup", "1", "--sides", "adamw", "--allow-repeat"])
    side = row["sides"]["adamw"]
    assert not side["reached"] and side["steps"] is None and side["seconds"] is None and side["stop"] == "max_steps"
    assert [s for s, _ in side["curve"]] == [2, 3] and side["steps_run"] == 3
    assert "time_ratio_recipe_vs_adamw" not in row
    assert row["corpus"]["passes"] == 1.5 and row["corpus"]["train_tokens"] == 75
    assert caplog.messages == ["data: epoch 2 begins: the training data repeats (64 tokens)"]


def test_a_budget_over_more_than_one_pass_is_refused_in_one_line_before_training(shard, monkeypatch, capsys):
    """python -m tritonllm.bench speedrun (its main, past the GPU check): 200 steps x B2 x T16 = 6400
    tokens on 2992 training tokens in whole windows is refused before any model is built, saying
    what it has, what it needs and how to get more."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(speedrun, "run_all", lambda *a, **k: pytest.fail("trained"))
    level = logging.getLogger("tritonllm").level  # main shows tritonllm's INFO lines
    try:
        with pytest.raises(SystemExit) as e:
            speedrun.main(["--max-steps", "200", *TINY, "data=bin", f"data.files={shard}"])
    finally:
        logging.getLogger("tritonllm").setLevel(level)
    message = str(e.value.code)
    assert message.startswith("tritonllm: error: ") and "\n" not in message
    for part in ("trains on 6,400 tokens", "holds 2,992 in whole training windows", "2.14 passes", "--bin",
                 "data=text", "--max-steps 93 or fewer", "--allow-repeat", sha256_of(shard)[:16]):
        assert part in message, part
    assert capsys.readouterr().out == ""


def test_bad_sides_are_refused():
    with pytest.raises(ConfigError, match=r"--sides: unknown \['jax'\]"):
        speedrun.parse(["--sides", "adamw,jax"])


def test_baseline_with_the_recipe_matches_the_float64_reference():
    """BaselineTransformer with every recipe option (fp32) against ReferenceTransformer in float64,
    both loaded with a tritonllm model's weights: loss and every gradient."""
    base_cfg = ModelConfig(name="tiny", vocab_size=61, d_model=48, n_layers=4, n_heads=4, head_dim=12, d_ff=40,
                           max_seq_len=24)
    cfg = speedrun.recipe_config(base_cfg)
    cfg = ModelConfig(**{**cfg.to_dict(), "window_schedule": [None, 5]})
    state = build_model(cfg).state_dict()
    for k in state:
        if "value_mix" in k or "skip_gates" in k:  # away from their init, so a swapped mix would show
            state[k] = torch.rand_like(state[k]) + 0.5
    base = BaselineTransformer(cfg, seq_len=19).to(DEVICE)
    base.load_state_dict(state)
    idx = torch.randint(0, cfg.vocab_size, (2, 19), device=DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (2, 19), device=DEVICE)
    grads, losses = {}, {}
    for key in ("base", torch.float64, torch.float32):
        model = base
        if key != "base":
            model = ReferenceTransformer(cfg)
            model.load_state_dict(state)
            model = model.to(device=DEVICE, dtype=key)
        losses[key] = model(idx, targets)
        losses[key].backward()
        grads[key] = {n: p.grad for n, p in model.named_parameters()}
    assert_close("loss", losses["base"], losses[torch.float64], losses[torch.float32])
    assert set(grads["base"]) == set(grads[torch.float64])
    for name in grads["base"]:
        assert_close(f"grad {name}", grads["base"][name], grads[torch.float64][name], grads[torch.float32][name])


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is not in this PyTorch")
def test_newton_schulz_muon_matches_torch_muon():
    """Two steps of the fallback against torch.optim.Muon on a tall, a wide and a square matrix
    (bf16 iterations in both: bf16 tolerance)."""
    shapes = [(24, 8), (8, 20), (16, 16)]
    ref = [torch.randn(s) for s in shapes]
    ours = [p.clone() for p in ref]
    kw = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5)
    opt_ref = torch.optim.Muon(ref, adjust_lr_fn="original", **kw)
    opt_ours = speedrun.NewtonSchulzMuon(ours, **kw)
    for _ in range(2):
        for a, b in zip(ref, ours):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt_ref.step()
        opt_ours.step()
    for a, b in zip(ref, ours):
        assert_close("weight", b, a.double(), atol=2e-2, dtype=torch.bfloat16)


def test_reset_zeroes_state_but_masters():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = {"exp_avg": torch.ones(3), "step": torch.tensor(4.0), "master": torch.full((3,), 2.0)}
    speedrun.reset_optimizer_state(opt)
    state = opt.state[p]
    assert state["exp_avg"].eq(0).all() and state["step"].item() == 0 and state["master"].eq(2).all()


def test_sft_data_is_refused_by_name():
    from omegaconf import OmegaConf

    from tritonllm.errors import ConfigError

    args, _ = speedrun.parse([])
    with pytest.raises(ConfigError, match="data.kind='sft': the speedrun trains on token data"):
        speedrun.corpus_block(args, OmegaConf.create({"data": {"kind": "sft"}}), object())
