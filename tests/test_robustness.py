"""Nothing silently wrong: corrupt checkpoints are refused and resume falls back to one that verifies,
runs own their checkpoints, impossible settings and bad values end in one clear line, data problems
are found at start. The model and data are test_train's (void_tiny shrunk, a few text files)."""

import json
import logging
import os
import shutil

import pytest
import torch
from _checks import DEVICE
from test_train import TINY, compose_train, data_overrides, read_metrics  # noqa: F401 (fixture)

from tritonllm.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint, verify_checkpoint
from tritonllm.errors import CheckpointError, ConfigError, TrainingError
from tritonllm.logging_utils import rewind_metrics
from tritonllm.train import train

#: every step checkpointed, all kept: the straight run leaves step_1 .. step_4
EVERY_STEP = ["trainer.ckpt_interval=1", "trainer.keep_last=10"]


def snapshot(folder) -> dict:
    """``{relative path: bytes}`` of every file under ``folder``."""
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(root, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def flip_byte(path: str, where: float = 0.5) -> None:
    """Flip the lowest bit of the byte at fraction ``where`` of the file."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = min(len(data) - 1, int(len(data) * where))
        data[i] ^= 1
        f.seek(0)
        f.write(data)


def steps(ckpt_dir) -> list[int]:
    return [s for s, _ in list_checkpoints(str(ckpt_dir))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_overrides):  # noqa: F811
    """Four steps in one go, a checkpoint after each; returns the run folder and its train losses."""
    out = tmp_path_factory.mktemp("robust") / "straight"
    train(compose_train(*TINY, *data_overrides, *EVERY_STEP, f"out_dir={out}"))
    return str(out), {r["step"]: r["loss"] for r in read_metrics(str(out), "train")}


def copy_run(straight_dir: str, dest) -> str:
    """A copy of the straight run's folder (metrics and checkpoints) at ``dest``."""
    shutil.copytree(straight_dir, dest)
    return str(dest)


# ----------------------------------------------------------------------------- checkpoint integrity

@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng.pt", "state.json", "config.yaml",
                                  "tokenizer.model"])
def test_flipped_byte_falls_back_to_the_previous_checkpoint(straight, data_overrides, tmp_path, caplog, name):  # noqa: F811
    """One flipped bit in any file of the newest checkpoint: resume=auto says so, resumes from the one
    before and trains the same step 4 as the uninterrupted run; the older checkpoints are untouched."""
    out = copy_run(straight[0], tmp_path / "run")
    ckpts = os.path.join(out, "checkpoints")
    flip_byte(os.path.join(ckpts, "step_00000004", name))
    before = snapshot(os.path.join(ckpts, "step_00000003"))
    with caplog.at_level(logging.WARNING, logger="tritonllm.checkpoint"):
        train(compose_train(*TINY, *data_overrides, *EVERY_STEP, f"out_dir={out}", "trainer.resume=auto"))
    fallback = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(fallback) == 1 and "step_00000004" in fallback[0] and name in fallback[0], fallback
    assert fallback[0].endswith("step_00000003")
    assert snapshot(os.path.join(ckpts, "step_00000003")) == before
    verify_checkpoint(os.path.join(ckpts, "step_00000004"))  # rewritten by the resumed run, whole again
    losses = {r["step"]: r["loss"] for r in read_metrics(out, "train")}
    assert losses == straight[1]  # steps 1-3 kept from before, step 4 trained again: bit-identical in fp32


def test_flipped_byte_is_an_error_naming_the_file(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(str(tmp_path), 1, model, opt, {})
    flip_byte(os.path.join(path, "model.safetensors"), 0.9)  # inside the tensor data: still loadable
    with pytest.raises(CheckpointError, match=r"step_00000001 is corrupt: model.safetensors does not match the "
                                              r"checksum written at save time"):
        load_checkpoint(path, model, opt)


def test_non_finite_weights_are_refused(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model.bias[1] = float("nan")
    path = save_checkpoint(str(tmp_path), 1, model, opt, {})
    with pytest.raises(CheckpointError, match=r"non-finite weights \(NaN or inf\) in 1 tensor\(s\): bias"):
        load_checkpoint(path, torch.nn.Linear(4, 3), opt)


def test_diverged_run_stops_before_checkpointing(data_overrides, tmp_path, monkeypatch):  # noqa: F811
    """lr 1e30: the first update blows the weights up and every later step is skipped (kind: skip with
    the step of its train record; the NaN gradient norms written as null: strict JSON). The validation
    loss at step 2, made NaN here, stops the run before its checkpoint: step_1 stays the newest."""
    from tritonllm.train import loop

    monkeypatch.setattr(loop, "evaluate", lambda *a, **k: float("nan"))
    with pytest.raises(TrainingError, match=r"step 2: the validation loss is nan; stopping without a checkpoint"):
        train(compose_train(*TINY, *data_overrides, *EVERY_STEP, "optim.lr=1e30", f"out_dir={tmp_path}"))
    assert steps(tmp_path / "checkpoints") == [1]
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in f]
    assert [(r["step"], r["grad_norm"]) for r in records if r["kind"] == "skip"] == [(2, None)]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert [r["val_loss"] for r in records if r["kind"] == "val"] == [None]


# ----------------------------------------------------------------------------- runs own their checkpoints

def test_reused_checkpoint_folder_is_refused_untouched(straight, data_overrides, tmp_path):  # noqa: F811
    """A fresh run given another run's ckpt_dir stops at start; that run's checkpoints and even the
    leftover of a save it may still be writing stay as they were."""
    ckpts = shutil.copytree(os.path.join(straight[0], "checkpoints"), tmp_path / "shared")
    os.makedirs(ckpts / ".tmp-step_00000005-4242")
    (ckpts / ".tmp-step_00000005-4242" / "model.safetensors").write_bytes(b"being written")
    before = snapshot(ckpts)
    with pytest.raises(CheckpointError, match=r"holds 4 checkpoint\(s\) of another run \(step_00000001, "
                                              r"step_00000002, step_00000003\): continue that run with "
                                              r"trainer.resume=auto"):
        train(compose_train(*TINY, *data_overrides, "trainer.max_steps=2", "trainer.keep_last=2",
                            f"out_dir={tmp_path}/run", f"trainer.ckpt_dir={ckpts}"))
    assert snapshot(ckpts) == before


def test_pruning_keeps_other_runs_checkpoints(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    for step in (3, 4):
        save_checkpoint(str(tmp_path), step, model, opt, {}, keep_last=2, run_id="first")
    for step in (1, 2):
        save_checkpoint(str(tmp_path), step, model, opt, {}, keep_last=1, run_id="second")
    assert steps(tmp_path) == [2, 3, 4]


def test_resume_auto_ignores_a_sibling_run(straight, data_overrides, tmp_path, caplog):  # noqa: F811
    """resume=auto looks only in its own ckpt_dir: beside another run of the same name it starts
    fresh (it resumed the sibling before), and the sibling's checkpoints stay as they were."""
    sibling_ckpts = os.path.join(straight[0], "checkpoints")
    before = snapshot(sibling_ckpts)
    out = os.path.join(os.path.dirname(straight[0]), "beside")
    with caplog.at_level(logging.INFO, logger="tritonllm.train"):
        train(compose_train(*TINY, *data_overrides, "trainer.max_steps=1", "optim.lr=1e-3", "seed=7",
                            f"out_dir={out}", "trainer.resume=auto"))
    assert any("trainer.resume=auto: no checkpoint in" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in read_metrics(out, "train")] == [1]
    assert snapshot(sibling_ckpts) == before


def test_resume_with_another_config_is_refused(straight, data_overrides, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match=r"differs from that of checkpoint .*step_00000004 in 2 key\(s\): "
                                          r"optim.lr: 0.02 -> 0.001; seed: 1337 -> 7; .*trainer.resume_force=true"):
        train(compose_train(*TINY, *data_overrides, "optim.lr=1e-3", "seed=7", f"out_dir={tmp_path}",
                            f"trainer.resume={straight[0]}/checkpoints"))


def test_kill_mid_save_leftovers(straight, data_overrides, tmp_path, caplog):  # noqa: F811
    """A kill during the save of step 3: its .tmp-step_ folder is removed at the next start, the run
    resumes from step 2, and metrics.jsonl keeps one record per step (the killed run had logged
    steps 3 and 4 already)."""
    out = copy_run(straight[0], tmp_path / "run")
    ckpts = os.path.join(out, "checkpoints")
    for s in (3, 4):
        os.rename(os.path.join(ckpts, f"step_0000000{s}"), os.path.join(ckpts, f".tmp-step_0000000{s}-4242"))
    with caplog.at_level(logging.INFO, logger="tritonllm.checkpoint"):
        train(compose_train(*TINY, *data_overrides, *EVERY_STEP, f"out_dir={out}", "trainer.resume=auto"))
    assert sum("left by a checkpoint save that did not finish" in r.getMessage() for r in caplog.records) == 2
    assert sorted(os.listdir(ckpts)) == [f"step_0000000{s}" for s in (1, 2, 3, 4)]
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(out, "val")] == [2, 4]
    assert {r["step"]: r["loss"] for r in read_metrics(out, "train")} == straight[1]


def test_rewind_metrics_drops_later_records_and_cut_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "val", "step": 2}\n{"kind": "end", "step": 2}\n'
                    '{"kind": "train", "step": 3}\n{"kind": "tr')
    rewind_metrics(str(path), 2)
    assert path.read_text() == '{"kind": "train", "step": 1}\n{"kind": "val", "step": 2}\n'


def test_unwritable_checkpoint_folder_fails_at_start(data_overrides, tmp_path):  # noqa: F811
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match=r"trainer.ckpt_dir=.*a_file/checkpoints' is not writable"):
        train(compose_train(*TINY, *data_overrides, f"out_dir={tmp_path}/run",
                            f"trainer.ckpt_dir={blocker}/checkpoints"))
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # before any training


# ----------------------------------------------------------------------------- impossible settings

def test_bf16_on_the_cpu_is_refused(data_overrides, tmp_path):  # noqa: F811
    if DEVICE != "cpu":
        pytest.skip("the interpreter's limitation")
    with pytest.raises(ConfigError, match=r"trainer.dtype=bf16 cannot be computed on cpu.*use trainer.dtype=fp32"):
        train(compose_train(*TINY, *data_overrides, "trainer.dtype=bf16", f"out_dir={tmp_path}"))


@pytest.mark.parametrize("op", ["linear", "linear_swiglu", "linear_cross_entropy", "flash_attention", "embedding",
                                "grouped_linear"])
def test_bf16_kernel_call_on_the_interpreter_is_refused(op):
    if DEVICE != "cpu":
        pytest.skip("the interpreter's limitation")
    from tritonllm import kernels

    bf = dict(dtype=torch.bfloat16)
    x, w = torch.randn(4, 16, **bf), torch.randn(32, 16, **bf)
    calls = {"linear": lambda: kernels.linear(x, w),
             "linear_swiglu": lambda: kernels.linear_swiglu(x, w),
             "linear_cross_entropy": lambda: kernels.linear_cross_entropy(x, w, torch.zeros(4, dtype=torch.int64)),
             "flash_attention": lambda: kernels.flash_attention(*(torch.randn(1, 4, 2, 16, **bf) for _ in range(3))),
             "embedding": lambda: kernels.embedding(torch.zeros(3, dtype=torch.int64), w),
             "grouped_linear": lambda: kernels.grouped_linear(x, torch.randn(2, 8, 16, **bf),
                                                              torch.tensor([0, 2, 4]))}
    name = "weight" if op == "embedding" else "q" if op == "flash_attention" else "x"
    with pytest.raises(TypeError, match=f"^{name} is bfloat16 on the CPU: Triton's interpreter computes bfloat16 "
                                        f"tl.dot wrongly .*use float32 or float16 there"):
        calls[op]()


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan")])
def test_flash_attention_softmax_scale_must_be_positive(scale):
    from tritonllm.kernels import flash_attention

    q = torch.randn(1, 4, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite number > 0 or None"):
        flash_attention(q, q, q, softmax_scale=scale)


# ----------------------------------------------------------------------------- one-line errors

def run_cli(module: str, args: list[str], cwd, monkeypatch, capsys) -> str:
    """Run ``python -m <module> <args>`` in this process; returns its stderr after checking that it
    exited with status 1 and no traceback."""
    import importlib

    main = importlib.import_module(module).main
    monkeypatch.setattr("sys.argv", [module, *args])
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=2.5", "trainer.max_steps=2.5 is not an integer"),
    ("trainer.max_steps=abc", "trainer.max_steps=abc is not an integer"),
    ("optim.lr=abc", "optim.lr=abc is not a number"),
    ("trainer.progress=maybe", "trainer.progress=maybe is not true or false"),
    ("trainer.max_steps=0", "trainer.max_steps must be >= 1, got 0"),
    ("optim.lr=-1e-3", "optim.lr must be > 0, got -0.001"),
    ("data.val_fraction=1", "data.val_fraction must be < 1, got 1.0"),
    ("trainer.cuda_graph=sometimes", "trainer.cuda_graph='sometimes' is not one of auto, true, false"),
    ("sched.name=linear", "sched.name='linear' does not name this sched option (cosine): choose another option "
                          "with sched=<option>"),
    ("trainer.no_such_key=1", "trainer.no_such_key is not a known setting: the keys of trainer are max_steps, "
                              "batch_size"),
    ("data=bin", "data.files must be set (data.files=<value>)"),
    ("+model=no_such_model", "In 'train': Could not find 'model/no_such_model', Available options in 'model': cudann_moe, "),
])
def test_train_bad_value_is_one_line(override, message, tmp_path, monkeypatch, capsys):
    err = run_cli("tritonllm.train.__main__", ["+model=void_tiny", override, f"hydra.run.dir={tmp_path}/run"],
                  tmp_path, monkeypatch, capsys)
    assert err.startswith(f"tritonllm: error: {message}") and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.parametrize("option, message", [
    ("top_k=-1", "top_k must be >= 1, got -1"),
    ("top_k=0.5", "top_k=0.5 is not an integer"),
    ("temperature=-1", "temperature must be >= 0, got -1.0"),
    ("top_p=0", "top_p must be > 0, got 0.0"),
    ("top_p=1.5", "top_p must be <= 1, got 1.5"),
    ("max_new_tokens=0", "max_new_tokens must be >= 1, got 0"),
    ("num_samples=two", "num_samples=two is not an integer"),
])
def test_generate_bad_sampling_option_is_one_line(straight, option, message, tmp_path, monkeypatch, capsys):
    err = run_cli("tritonllm.generate", [f"ckpt={straight[0]}", option], tmp_path, monkeypatch, capsys)
    assert err == f"tritonllm: error: {message}\n"


def test_generate_refuses_a_checkpoint_with_nan_weights(straight, tmp_path, monkeypatch, capsys):
    """Weights written with a NaN (checksums intact: the run wrote them so) are refused at load."""
    from tritonllm.models import ModelConfig, build_model

    src = os.path.join(straight[0], "checkpoints", "step_00000004")
    state = verify_checkpoint(src)
    model = build_model(ModelConfig.from_dict(state["model_config"]), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    path = save_checkpoint(str(tmp_path / "ckpts"), 4, model, torch.optim.AdamW(model.parameters()),
                           {"model_config": state["model_config"]},
                           tokenizer_path=os.path.join(src, "tokenizer.model"))
    before = snapshot(path)
    err = run_cli("tritonllm.generate", [f"ckpt={path}", "max_new_tokens=2"], tmp_path, monkeypatch, capsys)
    assert err.startswith(f"tritonllm: error: checkpoint {path} holds non-finite weights (NaN or inf) in 1 tensor(s)")
    assert snapshot(path) == before


def test_cli_bf16_on_the_cpu_exits_1_in_one_line(tmp_path):
    """The real command line: exit status 1, one line on stderr, nothing trained."""
    import subprocess
    import sys

    if DEVICE != "cpu":
        pytest.skip("the interpreter's limitation")
    r = subprocess.run([sys.executable, "-m", "tritonllm.train", "+model=void_tiny", "trainer.dtype=bf16",
                        f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("tritonllm: error: trainer.dtype=bf16 cannot be computed on cpu") and \
        r.stderr.count("\n") == 1, r.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_every_config_option_composes_against_its_schema():
    """Every YAML option of the typed groups composes (a key added to a YAML file without its schema
    field fails here) and passes the range checks with its defaults."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from tritonllm.conf.schema import SCHEMAS, check_config

    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        for group, options in SCHEMAS.items():
            for option, schema in options.items():
                files = ["data.files=x"] if group == "data" and option != "stdlib" else []
                cfg = compose("train", overrides=["+model=void_tiny", f"{group}={option}", *files, "out_dir=/tmp/x"])
                assert OmegaConf.get_type(cfg[group]) is schema
                check_config(cfg)
        check_config(compose("generate", overrides=["ckpt=x"]))
        check_config(compose("export", overrides=["ckpt=x", "out=y"]))
        check_config(compose("evolve", overrides=["+model=void_tiny", "out_dir=/tmp/x"]))


# ----------------------------------------------------------------------------- data checked at start

def test_deep_out_of_vocabulary_id_is_found_at_load(tmp_path, monkeypatch):
    """One id past the vocabulary near the end of the second shard: the loaders refuse it before the
    first batch, naming the shard; the scan is cached (a second load reads no token)."""
    import numpy as np

    from tritonllm.data import load_corpus, shards, write_shard

    for i in range(2):
        ids = np.arange(5000) % 1000
        if i == 1:
            ids[4990] = 1000
        write_shard(str(tmp_path / f"train_{i}.bin"), ids, 1000)
    cfg = compose_train("+model=void_tiny", "data=bin", f"data.files={tmp_path}/train_*.bin",
                        f"data.cache_dir={tmp_path}/cache").data
    with pytest.raises(Exception, match=r"token shard .*train_1.bin holds id 1000, outside the model's vocabulary "
                                        r"of 1000 \(1 shard\(s\) do\)"):
        load_corpus(cfg).loaders(2, 8, 0, 1000)
    assert len(os.listdir(tmp_path / "cache" / "shard-max")) == 2
    monkeypatch.setattr(shards.np.memmap, "max", lambda *a, **k: pytest.fail("scanned again"), raising=False)
    corpus = load_corpus(cfg)
    assert corpus.max_ids == {str(tmp_path / "train_0.bin"): 999, str(tmp_path / "train_1.bin"): 1000}
    corpus.loaders(2, 8, 0, 1001)  # a vocabulary that covers the id: accepted


def test_random_bytes_text_file_is_reported_by_name(data_overrides, tmp_path):  # noqa: F811
    from tritonllm.errors import DataError

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "notes.txt").write_text("plain text, " * 200)
    (texts / "photo.txt").write_bytes(os.urandom(20000))
    with pytest.raises(DataError, match=r"1 of the 2 text files are not text .*: .*photo.txt; remove them"):
        train(compose_train(*TINY, f"data.files={texts}/*.txt", f"data.cache_dir={tmp_path}/cache",
                            f"out_dir={tmp_path}/run"))


def test_example_runs_each_in_a_folder_of_its_own(data_overrides, tmp_path, monkeypatch, capsys):  # noqa: F811
    """examples/train_on_your_text.py twice: two run folders, each sampling from its own checkpoint."""
    import importlib.util

    from test_train import ROOT

    spec = importlib.util.spec_from_file_location("example", os.path.join(ROOT, "examples", "train_on_your_text.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(example, "SAMPLE_TOKENS", 2)
    tiny = [o for o in TINY if o != "data=text"]
    for _ in range(2):
        example.main(data_overrides[0].split("=", 1)[1], [*tiny, data_overrides[1], "trainer.max_steps=1"])
    runs = sorted(os.listdir(tmp_path / "outputs" / "your_text"))
    assert len(runs) == 2
    printed = capsys.readouterr().out
    for run in runs:
        assert steps(tmp_path / "outputs" / "your_text" / run / "checkpoints") == [1]
        assert f"run folder {os.path.join(os.getcwd(), 'outputs', 'your_text', run)}\n" in printed


def test_generate_falls_back_past_a_corrupt_newest_checkpoint(straight, tmp_path, monkeypatch, capsys):
    out = copy_run(straight[0], tmp_path / "run")
    flip_byte(os.path.join(out, "checkpoints", "step_00000004", "model.safetensors"))
    monkeypatch.setattr("sys.argv", ["generate", f"ckpt={out}", "prompt=import", "max_new_tokens=2",
                                     "temperature=0"])
    from tritonllm.generate import main

    main()
    printed = capsys.readouterr()
    assert printed.out.startswith("import")
    assert "step_00000004 is corrupt: model.safetensors" in printed.err and \
        printed.err.rstrip().endswith("falling back to the previous checkpoint, " +
                                      os.path.join(out, "checkpoints", "step_00000003")), printed.err


def test_usr1_prints_every_stack_and_the_app_goes_on(tmp_path):
    """``kill -USR1`` on a command-line app prints where each thread is (a run that seems stuck in
    compilation or autotuning) and does not stop it."""
    import subprocess
    import sys

    code = ("import os, signal, threading\n"
            "from tritonllm.runtime import exit_on_user_error\n"
            "def busy_worker(ready):\n    ready.wait()\n"
            "@exit_on_user_error\n"
            "def app():\n"
            "    ready = threading.Event()\n"
            "    worker = threading.Thread(target=busy_worker, args=(ready,))\n"
            "    worker.start()\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    ready.set(); worker.join()\n"
            "    print('went on')\n"
            "app()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and r.stdout == "went on\n", r.stderr
    assert "most recent call first" in r.stderr and "in busy_worker" in r.stderr and "in app" in r.stderr


def test_stacks_every_prints_the_stacks_periodically(tmp_path):
    """``TRITONLLM_STACKS_EVERY=s`` prints every thread's stack every s seconds, also while the main thread
    is blocked (here in a sleep); a value that is not a number is a one-line error."""
    import subprocess
    import sys

    code = ("import time\n"
            "from tritonllm.runtime import exit_on_user_error\n"
            "@exit_on_user_error\n"
            "def app():\n    time.sleep(1.2)\n    print('done')\n"
            "app()\n")
    env = {**os.environ, "TRITONLLM_STACKS_EVERY": "0.25"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout == "done\n", r.stderr
    assert r.stderr.count("most recent call first") >= 2 and "in app" in r.stderr, r.stderr
    env["TRITONLLM_STACKS_EVERY"] = "soon"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60, env=env)
    assert r.returncode == 1 and "tritonllm: error: TRITONLLM_STACKS_EVERY='soon'" in r.stderr, r.stderr
