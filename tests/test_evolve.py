"""Architecture search (tritonllm.evolve): mutations keep every constraint over many random draws,
repair and rejection, budgets, the Pareto front and the capped choice, the sandbox (a candidate that
raises, is killed, diverges or hangs is recorded as failed and the search goes on), a tiny real
search (2 generations x 2 candidates of a shrunken void_tiny) with its outputs, resume, and a warm
start (a child with an inserted layer starts from its parent's trained weights)."""

import json
import logging
import os
import random
import re
import subprocess
import sys
import time

import pytest
from _checks import DEVICE, ON_GPU, child_env, gemm_atol
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from test_train import TINY

from tritonllm.errors import ConfigError
from tritonllm.evolve.results import best_under_cap, pareto_front
from tritonllm.evolve.sandbox import run_sandboxed
from tritonllm.evolve.search import Journal, Search, parse_budget, run_search
from tritonllm.evolve.evaluate import evaluate_candidate
from tritonllm.evolve.space import STATE_BYTES_PER_PARAM, Limits, Rejection, SearchSpace, violations
from tritonllm.kernels.flash_attention import HEAD_DIMS
from tritonllm.models.config import ModelConfig
from tritonllm.train import available_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a search over a shrunken void_tiny: one training step per candidate (budget: 64 tokens = 2 x 32)
SEARCH = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.eval_interval", "trainer.ckpt_interval",
                                               "trainer.keep_last"))] + [
    "evolve_space=tiny", "evolve.space.n_layers=[1,2]", "evolve.space.d_model=[64]", "evolve.space.n_heads=[2]",
    "evolve.space.kv_ratio=[1,2]", "evolve.space.head_dim=[32]", "evolve.space.ffn_mult=[2.0]",
    "evolve.space.qk_norm=null", "evolve.space.lr=[1e-2,2e-2]", "evolve.budget=64", "evolve.population=2"]


def compose_evolve(*overrides):
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        return compose("evolve", overrides=list(overrides))


@pytest.fixture(scope="module")
def data_overrides(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    with open(os.path.join(ROOT, "tritonllm", "train", "loop.py")) as f:
        source = f.read()
    for i in range(4):
        (folder / f"part{i}.txt").write_text(source[i * 1000:] + source[:i * 1000])
    return [f"data.files={folder}/*.txt", f"data.cache_dir={tmp_path_factory.mktemp('cache')}"]


def read_records(out):
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- space, constraints, mutation

def _void125m():
    return ModelConfig(name="void125m", d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048)


def _space(limits, **choices):
    default = {"n_layers": [6, 8, 12, 16], "d_model": [512, 768, 1024], "n_heads": [6, 8, 12, 16],
               "kv_ratio": [1, 2, 3, 4], "head_dim": [32, 64, 128], "ffn_mult": [2.0, 2.667, 4.0],
               "window": [None, 256, 2048], "qk_norm": [False, True], "n_experts": [0, 4, 8], "moe_top_k": [1, 2, 8],
               "lr": [3e-4, 1e-3]}
    return SearchSpace(_void125m(), 6e-4, {**default, **choices}, limits)


def _assert_valid(cand, limits):
    m = cand.model
    assert violations(m, limits) == []
    assert m.n_heads % m.n_kv_heads == 0 and m.head_dim in HEAD_DIMS
    assert m.d_model % limits.multiple_of == 0 and m.d_ff % limits.multiple_of == 0
    assert m.window is None or m.window < limits.seq_len
    if m.n_experts:
        assert 1 <= m.moe_top_k <= m.n_experts and m.d_expert % limits.multiple_of == 0
    assert m.param_count() <= limits.max_params
    assert m.param_count() * STATE_BYTES_PER_PARAM / 1e9 <= limits.memory_cap_gb
    ModelConfig.from_dict(m.to_dict())  # the model field checks pass too


def test_mutations_keep_every_constraint():
    limits = Limits(multiple_of=64, max_params=250_000_000, memory_cap_gb=3.5, seq_len=1024)
    space = _space(limits)
    rng = random.Random(0)
    genome = {g: space.seed_genome[g] for g in space.genes}
    changed = set()
    for step in range(400):
        child = space.mutate(genome, rng)
        _assert_valid(child, limits)
        assert space.contains(child.genome)
        changed |= {g for g in space.genes if child.genome[g] != genome[g]}
        genome = child.genome if step % 7 else {g: space.seed_genome[g] for g in space.genes}  # walk, restart
    assert changed == set(space.genes)  # every operator was drawn


def test_random_genomes_are_repaired_or_rejected():
    limits = Limits(multiple_of=64, max_params=150_000_000, memory_cap_gb=2.0, seq_len=1024)
    space = _space(limits)
    rng = random.Random(1)
    kinds = {"ok": 0, "repaired": 0, "rejected": 0}
    for _ in range(500):
        out = space.repair(space.random_genome(rng))
        if isinstance(out, Rejection):
            assert out.reason
            kinds["rejected"] += 1
        else:
            _assert_valid(out, limits)
            kinds["repaired" if out.repairs else "ok"] += 1
    assert all(kinds.values()), kinds


def test_repairs_and_rejections():
    limits = Limits(multiple_of=64, max_params=200_000_000, memory_cap_gb=None, seq_len=1024)
    space = _space(limits)
    base = {g: space.seed_genome[g] for g in space.genes}
    gqa = space.repair({**base, "n_heads": 6, "kv_ratio": 4})  # 4 does not divide 6: the largest choice below that does
    assert gqa.model.n_kv_heads == 2 and "kv_ratio 4 -> 3" in gqa.repairs[0]
    moe = space.repair({**base, "n_experts": 4, "moe_top_k": 8})
    assert moe.model.moe_top_k == 4 and moe.model.d_expert == 2048 // 4  # 4 experts as wide as the dense MLP
    assert space.repair({**base, "window": 2048}).model.window is None  # >= seq_len: full causal
    dense = [space.repair({**base, "moe_top_k": k}) for k in (1, 2, 8)]  # top-k means nothing without experts
    assert len({c.key for c in dense}) == 1
    big = space.repair({**base, "n_layers": 16, "d_model": 1024, "ffn_mult": 4.0})
    assert isinstance(big, Rejection) and "max_params" in big.reason
    capped = SearchSpace(_void125m(), 6e-4, {"n_layers": [12, 16]}, Limits(memory_cap_gb=1.0))
    assert "memory_cap_gb 1.0" in capped.repair({"n_layers": 16}).reason  # 16 B/param of state > 1 GB
    no_ratio = SearchSpace(ModelConfig(d_model=768, n_heads=12, n_kv_heads=6, d_ff=2048), 6e-4,
                           {"n_heads": [5, 12], "kv_ratio": [2, 4]}, Limits())
    assert "no kv_ratio choice divides n_heads=5" in no_ratio.repair({"n_heads": 5, "kv_ratio": 2}).reason


@pytest.mark.parametrize("choices, match", [
    ({"d_model": [100]}, r"evolve.space.d_model: choice 100 must be a positive multiple of evolve.multiple_of=64"),
    ({"head_dim": [48]}, r"evolve.space.head_dim: choice 48 must be one of \(32, 64, 96, 128, 256\)"),
    ({"lr": [3.0]}, r"evolve.space.lr: choice 3.0"),
    ({"depth": [2]}, r"unknown gene\(s\) \['depth'\]"),
    ({"n_layers": []}, r"evolve.space.n_layers must be a non-empty list"),
    ({}, r"searches no gene"),
])
def test_space_checks_its_choices(choices, match):
    with pytest.raises(ConfigError, match=match):
        SearchSpace(_void125m(), 6e-4, choices, Limits())


def test_seed_value_joins_the_choices():
    space = SearchSpace(_void125m(), 6e-4, {"n_layers": [16, 4]}, Limits())
    assert space.choices["n_layers"] == [4, 12, 16]
    assert space.repair({"n_layers": 12}).model.to_dict() == {**_void125m().to_dict(), "head_dim": 64}


@pytest.mark.parametrize("name", [m for m in available_models() if m != "hf"])  # hf: a folder, not a config
def test_seed_genome_repairs_to_the_seed(name):
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        seed = ModelConfig.from_dict(compose("train", overrides=[f"+model={name}"]).model)
    space = SearchSpace(seed, 6e-4, {"n_layers": [1]}, Limits(multiple_of=8, seq_len=seed.max_seq_len))
    assert space.repair(dict(space.seed_genome)).model == seed


@pytest.mark.parametrize("budget, expected", [(100000, ("tokens", 1e5)), ("500k", ("tokens", 5e5)),
                                              ("20M", ("tokens", 2e7)), ("1B", ("tokens", 1e9)),
                                              ("90s", ("seconds", 90)), ("5min", ("seconds", 300)),
                                              ("1h", ("seconds", 3600))])
def test_parse_budget(budget, expected):
    assert parse_budget(budget) == expected


@pytest.mark.parametrize("budget", ["0", "five", "5 days", -3, True])
def test_parse_budget_rejects(budget):
    with pytest.raises(ConfigError, match="evolve.budget"):
        parse_budget(budget)


def test_pareto_front_and_best_under_cap():
    def r(trial, loss, tok_s, mem, status="ok"):
        return {"trial": trial, "status": status, "val_loss": loss, "tokens_per_s": tok_s, "peak_mem_gb": mem}

    records = [r(0, 3.0, 100, 10), r(1, 2.5, 80, 20), r(2, 3.1, 90, 12), r(3, 2.0, 50, 40), r(4, 1.0, 1, 1, "failed"),
               r(5, 2.5, 80, 20)]
    objectives = ["val_loss", "tokens_per_s", "peak_mem_gb"]
    assert [x["trial"] for x in pareto_front(records, objectives)] == [0, 1, 3, 5]  # 2 is dominated by 0
    assert [x["trial"] for x in pareto_front(records, ["val_loss", "tokens_per_s"])] == [0, 1, 3, 5]
    assert best_under_cap(records, None)["trial"] == 3
    assert best_under_cap(records, 25)["trial"] == 1
    assert best_under_cap(records, 5) is None
    grown = {**r(6, 0.5, 200, 5), "warm": True, "warm_from": 0}  # dominates all, but trained its parent's budget too
    assert [x["trial"] for x in pareto_front(records + [grown], objectives)] == [0, 1, 3, 5]
    assert best_under_cap(records + [grown], None)["trial"] == 3 and best_under_cap(records + [grown], 5) is None


# ----------------------------------------------------------------------------- sandbox

def test_sandbox_outcomes(tmp_path):
    model = {"n_layers": 1, "d_model": 64, "d_ff": 128}
    ok = run_sandboxed("_evolve_targets:fake", {"config": {"model": model}}, str(tmp_path / "ok"))
    assert ok.status == "ok" and ok.result["params"] == 64 * (128 + 256) and ok.returncode == 0

    def bad(n, **kw):
        payload = {"config": {"model": {**model, "n_layers": n}, "out_dir": str(tmp_path / f"run{n}")}}
        return run_sandboxed("_evolve_targets:misbehaving", payload, str(tmp_path / f"c{n}"), **kw)

    raised = bad(2)
    assert raised.status == "failed" and raised.reason == "RuntimeError: CUDA out of memory (simulated)"
    assert "Traceback" in raised.log_tail
    killed = bad(3)
    assert killed.status == "failed" and killed.reason == "killed by signal SIGKILL"
    t0 = time.perf_counter()
    hung = bad(4, timeout_s=1.5)
    assert hung.status == "timeout" and "timed out after 1.5 s" in hung.reason and time.perf_counter() - t0 < 30
    missing = run_sandboxed("_evolve_targets:no_such_function", {}, str(tmp_path / "missing"))
    assert missing.status == "failed" and "AttributeError" in missing.reason


# ----------------------------------------------------------------------------- searches

def test_failed_candidates_do_not_stop_the_search(tmp_path, data_overrides):
    out = tmp_path / "run"
    cfg = compose_evolve(*SEARCH, *data_overrides, "evolve.space.n_layers=[1,2,3,4,5,6]",
                         "evolve.space.kv_ratio=null", "evolve.space.lr=null", "evolve.population=3",
                         "evolve.generations=2", "evolve.evaluator=_evolve_targets:misbehaving",
                         "evolve.sandbox.timeout_s=2", f"out_dir={out}")
    summary = run_search(cfg)
    records = read_records(out)
    evaluated = [r for r in records if r.get("slot") is not None]
    assert [r["slot"] for r in evaluated] == list(range(6))  # every slot done despite the failures
    assert sorted(r["model"]["n_layers"] for r in evaluated) == [1, 2, 3, 4, 5, 6]  # the 6 models of the space
    failed = [r for r in evaluated if r["status"] == "failed"]
    reasons = {r["model"]["n_layers"]: r["reason"] for r in failed}
    assert set(reasons) == {2, 3, 4, 6}
    expected = {2: "RuntimeError: CUDA out of memory", 3: "killed by signal SIGKILL", 4: "timed out after 2 s",
                6: "evaluator returned no finite ['val_loss']"}
    for n, reason in reasons.items():
        assert reason.startswith(expected[n])
    for r in failed:  # rolled back: the candidate's checkpoints are gone, its log kept
        assert not os.path.exists(os.path.join(out, r["folder"], "run", "checkpoints"))
        assert os.path.exists(os.path.join(out, r["folder"], "log.txt"))
    assert summary["counts"]["failed"] == len(failed) and summary["best"]["status"] == "ok"
    assert all(r["model"]["n_layers"] in (1, 5) for r in summary["front"])
    # the space has no seventh model: a longer search stops when it runs out, without an error
    longer = run_search(compose_evolve(*SEARCH, *data_overrides, "evolve.space.n_layers=[1,2,3,4,5,6]",
                                       "evolve.space.kv_ratio=null", "evolve.space.lr=null", "evolve.population=3",
                                       "evolve.generations=3", "evolve.evaluator=_evolve_targets:misbehaving",
                                       "evolve.sandbox.timeout_s=2", f"out_dir={out}"))
    assert [longer["counts"][k] for k in ("ok", "failed")] == [summary["counts"][k] for k in ("ok", "failed")]


def test_search_end_to_end_and_resume(tmp_path, data_overrides):
    out = tmp_path / "run"
    first = run_search(compose_evolve(*SEARCH, *data_overrides, "evolve.generations=1", f"out_dir={out}"))
    assert first["counts"]["ok"] == 2
    done = {r["trial"]: os.path.getmtime(os.path.join(out, r["folder"], "result.json"))
            for r in read_records(out) if r["status"] == "ok"}
    # a kill in the middle of the next candidate leaves its folder and half a journal line behind
    os.makedirs(out / "candidates" / "0002" / "run" / "checkpoints")
    with open(out / "trials.jsonl", "a") as f:
        f.write('{"slot": 2, "status": "o')
    with pytest.raises(ConfigError, match=r"other settings \(budget differ\)"):
        run_search(compose_evolve(*SEARCH, *data_overrides, "evolve.budget=128", f"out_dir={out}"))

    summary = run_search(compose_evolve(*SEARCH, *data_overrides, "evolve.generations=2", f"out_dir={out}"))
    records = read_records(out)
    evaluated = [r for r in records if r.get("slot") is not None]
    assert [r["slot"] for r in evaluated] == [0, 1, 2, 3] and all(r["status"] == "ok" for r in evaluated)
    for trial, mtime in done.items():  # the first generation was not trained again
        assert os.path.getmtime(os.path.join(out, f"candidates/{trial:04d}/result.json")) == mtime
    assert len(Journal(str(out / "trials.jsonl")).read()) == len(records)
    seed = evaluated[0]
    assert seed["origin"] == "seed" and seed["model"]["n_layers"] == 1 and seed["lr"] == 2e-2
    assert evaluated[1]["origin"] == "mutant" and evaluated[1]["parent"] == "seed"
    epoch_tokens = Search(compose_evolve(*SEARCH, *data_overrides, f"out_dir={tmp_path / 'other'}"),
                          str(tmp_path / "other")).epoch_tokens
    for r in evaluated:
        assert r["tokens"] == 64 and r["steps"] == 1 and r["val_loss"] > 0 and r["tokens_per_s"] > 0
        assert r["epochs"] == pytest.approx(64 / epoch_tokens)
        assert r["peak_mem_kind"] in ("host_rss", "cuda_allocated") and r["params"] == ModelConfig.from_dict(
            r["model"]).param_count()
    assert len({r["key"] for r in evaluated}) == 4  # no model trained twice

    best = summary["best"]
    lowest = min(r["val_loss"] for r in evaluated)
    assert best["val_loss"] == lowest and best["status"] == "ok"  # no memory cap: the lowest loss wins
    with open(out / "best.json") as f:
        vs_seed = json.load(f)["vs_seed"]
    assert vs_seed == summary["vs_seed"] and vs_seed["seed_trial"] == seed["trial"] == 0
    assert vs_seed["delta"]["val_loss"] == pytest.approx(best["val_loss"] - seed["val_loss"])
    assert vs_seed["delta"]["val_loss"] <= 0  # the seed is a candidate too
    with open(out / "results.csv") as f:
        rows = f.read().splitlines()
    assert rows[0].startswith("trial,generation,origin") and len(rows) == len(records) + 1
    assert os.path.getsize(out / "pareto.png") > 1000
    with open(out / "pareto.json") as f:
        assert best["trial"] in [r["trial"] for r in json.load(f)["front"]]
    # the best model is a conf/model file tritonllm.train accepts
    cfg = compose_train_with_searchpath(out)
    assert OmegaConf.to_container(cfg.model) == {**best["model"]}
    assert ModelConfig.from_dict(cfg.model).param_count() == best["params"]


def test_a_budget_past_one_pass_over_the_data_is_warned_about(tmp_path, data_overrides, caplog):
    """A token budget larger than the training split: the candidates' validation losses would measure
    memorisation (the first GPU search on the 3M-token stdlib corpus did), and the search says so."""
    cfg = compose_evolve(*SEARCH, *data_overrides, f"out_dir={tmp_path}")
    epoch = Search(cfg, str(tmp_path)).epoch_tokens
    assert epoch > 0 and "passes over" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="tritonllm.evolve"):
        Search(compose_evolve(*SEARCH, *data_overrides, f"evolve.budget={3 * epoch}", f"out_dir={tmp_path}"),
               str(tmp_path))
    assert "is 3.0 passes over the" in caplog.text and "memorisation" in caplog.text


#: a warm search's space: layers and the FFN width, each child a growth of the seed; float32 training
#: (trainer.dtype=auto is that on the CPU, bf16 on a GPU), so that the test can recompute a first loss
WARM = ["evolve.space.kv_ratio=null", "evolve.space.lr=null", "evolve.space.ffn_mult=[2.0,4.0]", "trainer.dtype=fp32"]


def test_warm_start_end_to_end(tmp_path, data_overrides):
    """evolve.warm_start=true: the seed's mutant (one layer inserted) starts from the seed's trained
    weights: its first training loss is the seed's final weights' loss on that batch."""
    import torch
    from safetensors.torch import load_file

    from tritonllm.data import load_corpus
    from tritonllm.models import build_model

    out = tmp_path / "run"
    summary = run_search(compose_evolve(*SEARCH, *data_overrides, *WARM,
                                        "evolve.generations=1", "evolve.warm_start=true", f"out_dir={out}"))
    seed, child = read_records(out)
    assert seed["origin"] == "seed" and not seed["warm"] and seed["warm_from"] is None
    assert child["parent"] == "seed" and child["warm"] is True and child["warm_from"] == seed["trial"]
    assert child["growth"] == ["n_layers 1 -> 2"] and child["status"] == "ok"
    for r in (seed, child):  # each keeps its trained weights for its children; the step-0 checkpoint is gone
        assert os.path.exists(out / r["folder"] / "weights.safetensors")
        assert not os.path.exists(out / r["folder"] / "warm_start")
    with open(out / "results.csv") as f:
        header, *rows = f.read().splitlines()
    warm_col = header.split(",").index("warm")
    assert [row.split(",")[warm_col] for row in rows] == ["False", "True"]
    assert summary["warm"]["warm"]["n"] == 1 and summary["warm"]["cold"]["n"] == 0
    assert summary["warm"]["warm"]["vs_parent"] == pytest.approx(child["val_loss"] - seed["val_loss"])

    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*TINY, *data_overrides])
    x, y = load_corpus(cfg.data).loaders(2, 32, cfg.seed, seed["model"]["vocab_size"])[0].next_batch()
    parent = build_model(seed["model"], device=DEVICE)  # the device the search trained on (TINY's device=)
    parent.load_state_dict(load_file(out / seed["folder"] / "weights.safetensors"))
    with torch.no_grad():
        expected = parent(x.to(DEVICE), y.to(DEVICE)).item()
        scale = max(1.0, parent(x.to(DEVICE)).abs().max().item())
    with open(out / child["folder"] / "run" / "metrics.jsonl") as f:
        first = next(r for r in map(json.loads, f) if r["kind"] == "train")
    # rel 1e-5 on the CPU. On a GPU both losses come from TF32 GEMMs (the trainer's step, this forward):
    # each one's logits within gemm_atol(chain=4) * max(1, max|logits|) of exact, and a mean cross-entropy
    # moves by at most 2 * max|logit change| (softmax - one-hot has L1 norm <= 2): 2 * 2 * that. A cold
    # start's first loss is ~ln(vocab), over 1 above the trained seed's here (tolerance ~0.03 * scale).
    gpu_abs = 4 * gemm_atol(torch.float32, chain=4) * scale if ON_GPU else None
    assert first["step"] == 1 and first["loss"] == pytest.approx(expected, rel=1e-5, abs=gpu_abs)

    # the run folder moved to a fresh machine without its weights (scripts/gpu_run.sh's evolve stage):
    # the search resumes, and a child whose source's weights are gone starts cold
    for r in (seed, child):
        os.remove(out / r["folder"] / "weights.safetensors")
    run_search(compose_evolve(*SEARCH, *data_overrides, *WARM,
                              "evolve.generations=2", "evolve.warm_start=true", f"out_dir={out}"))
    # (a later child may still start warm from a candidate trained in this resumed run: the sampler's
    # picks follow the measured losses, which differ between devices)
    later = [r for r in read_records(out) if r.get("slot") is not None and r["slot"] >= 2]
    gone = {seed["trial"], child["trial"]}
    assert later and all(r["status"] == "ok" and not (r["warm"] and r["warm_from"] in gone) for r in later), \
        [{k: r.get(k) for k in ("slot", "status", "reason", "warm", "warm_from", "origin")} for r in later]


def compose_train_with_searchpath(out):
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        return compose("train", overrides=[f"hydra.searchpath=[file://{out}]", "+model=best"])


def test_time_budget_stops_training(tmp_path, data_overrides):
    """A time budget: the trainer is asked to stop (Studio control file) once the deadline has passed."""
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        cfg = compose("train", overrides=[*TINY, *data_overrides, "trainer.max_steps=1000", "trainer.eval_interval=1000",
                                          "trainer.ckpt_interval=null", f"out_dir={tmp_path / 'run'}"])
    metrics = evaluate_candidate({"config": OmegaConf.to_container(cfg, resolve=True), "budget_s": 0.5}, str(tmp_path))
    assert 1 <= metrics["steps"] < 1000 and metrics["tokens"] == 64 * metrics["steps"]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert any(r["kind"] == "control" and r.get("action") == "stop" for r in records)
    assert [r["val_loss"] for r in records if r["kind"] == "val"] == [metrics["val_loss"]]


def test_cli(tmp_path, data_overrides):
    """python -m tritonllm.evolve with a stand-in evaluator: progress on the console, the outputs written."""
    env = child_env(os.path.dirname(__file__), ROOT)
    r = subprocess.run([sys.executable, "-m", "tritonllm.evolve", *SEARCH, *data_overrides, "evolve.generations=1",
                        "evolve.evaluator=_evolve_targets:fake", "evolve.warm_start=true",
                        f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    console = r.stdout + r.stderr
    assert "generation 1/1, candidate 2/2" in console and "best under the cap: trial" in console
    # the stand-in evaluator keeps no weights: every child starts cold, set against its parent
    assert re.search(r"warm starts: 0 warm; 1 cold: mean val_loss [0-9.]+, [+-][0-9.]+ vs their parents \(1\)", console)
    with open(tmp_path / "run" / "best.json") as f:
        assert json.load(f)["counts"]["ok"] == 2
