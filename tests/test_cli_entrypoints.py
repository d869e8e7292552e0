"""Every command-line entry point of the package, on the CPU, as a user calls it.

- Every module a user (or tritonllm itself) runs with ``python -m`` is listed in ENTRY_POINTS with the
  tests that run it; a new one fails :func:`test_every_entry_point_is_exercised` until it has tests.
- ``python -m tritonllm.bench <mode>``: bad input (a misspelled mode or model, an unknown option, an
  impossible size) ends in one line ``tritonllm: error: ...`` and exit status 1; valid arguments,
  every option of the mode given, reach the one-line "needs a CUDA GPU" of the modes that time a GPU,
  so every option is parsed and every config validated before that check; ``bench train --device cpu``
  runs one step of the real code path in the interpreter (the CPU runs of the other modes that have one
  are in the tests ENTRY_POINTS names).
- Each ``python -m`` entry point in a child process: its wiring, and bad input as one line there too.
- Combinations a newcomer tries: ``experiment=cpu_smoke`` with every data kind, a run folder below a
  file, text files that hold no text.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _checks import child_env
from tritonllm.bench.__main__ import main as bench_main
from tritonllm.errors import DataError
from tritonllm.runtime import compose_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: module run with ``python -m`` -> the tests that run it (this file's run each one's argument wiring)
ENTRY_POINTS = {
    "tritonllm.train": "test_train.py (runs, resume, multirun), test_parallel.py (torchrun), test_robustness.py",
    "tritonllm.generate": "test_train.py::test_generate_cli, test_generate_hf.py",
    "tritonllm.export": "test_export_cli.py (a run merged and its LoRA adapters, loaded by transformers and PEFT)",
    "tritonllm.evolve": "test_evolve.py (a search with a stand-in evaluator)",
    "tritonllm.evolve.sandbox": "test_evolve.py (each candidate's child process)",
    "tritonllm.studio": "test_studio.py (the server answering its API), test_studio_browser.py",
    "tritonllm.bench": "this file (every mode's arguments); test_speedrun.py, test_bench_finetune.py (CPU runs)",
    "tritonllm.bench.finetune": "test_bench_finetune.py::test_smoke_run_writes_a_row (every side on the CPU)",
    "tritonllm.bench.dist_train": "test_bench_dist.py (the --nproc workers over gloo)",
    "tritonllm.train.dist_checkpoint": "test_parallel.py (export of a sharded checkpoint)",
}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
    return rel.removesuffix(".__main__")


def test_every_entry_point_is_exercised():
    """The modules with a ``__main__`` (a ``__main__.py`` or an ``if __name__ == "__main__"`` block) are
    exactly ENTRY_POINTS' keys."""
    found = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "tritonllm")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py"):
                continue
            tree = ast.parse(open(path).read())
            if name == "__main__.py" or any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
                                             for node in tree.body):
                found.add(_module_name(path))
    assert found == set(ENTRY_POINTS)


# --- python -m tritonllm.bench <mode>, in this process ------------------------------------------------

def _bench(argv: list[str], capsys, monkeypatch) -> str:
    """``python -m tritonllm.bench <argv>`` on a machine without a GPU: its one-line error (status 1)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench_main(argv)
    out = capsys.readouterr()
    assert e.value.code == 1 and out.out == "", out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tritonllm: error: "), out.err
    return lines[0]


BAD = [
    (["trian"], "unknown mode 'trian'; choose from kernels, train, decode, finetune, speedrun"),
    (["kernels", "--ops", "rms_nrom"], "--ops: unknown ['rms_nrom']; choose from adamw,"),
    (["kernels", "--sizes", "default,huge"], "--sizes: comma-separated, of default, large"),
    (["kernels", "--bogus"], "kernels: unrecognized arguments: --bogus"),
    (["train"], "no model chosen: add +model=<name>"),
    (["train", "+model=void_tny"], "Could not find 'model/void_tny'"),
    (["train", "+model=void_tiny", "--stepz", "3"], "train: unrecognized arguments: --stepz (options: --help, --steps"),
    (["train", "+model=void_tiny", "trainer.batch_size=0"], "trainer.batch_size must be >= 1, got 0"),
    (["train", "+model=void_tiny", "trainer.seq_len=-4"], "trainer.seq_len must be >= 1, got -4"),
    (["train", "+model=void_tiny", "trainer.seq_len=1024"], "trainer.seq_len=1024 exceeds model.max_seq_len=512"),
    (["train", "+model=void_tiny", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["train", "+model=void_tiny", "--warmup", "x"], "argument --warmup: invalid int value: 'x'"),
    (["train", "--nproc", "2", "+model=void_tny"], "Could not find 'model/void_tny'"),
    (["train", "--nproc", "2", "+model=void_tiny", "--bogus"], "--nproc N: unrecognized arguments: --bogus"),
    (["train", "--nproc", "1", "+model=void_tiny"], "--nproc must be >= 2"),
    (["decode"], "no model chosen"),
    (["decode", "+model=void_tiny", "--batch", "0"], "--batch must name batch sizes >= 1"),
    (["decode", "+model=void_tiny", "--new-tokens", "100000"], "exceeds the model's max_seq_len 512"),
    (["decode", "+model=void_tiny", "--bogus", "1"], "decode: unrecognized arguments: --bogus"),
    (["finetune", "--config", "huge"], "argument --config: invalid choice: 'huge'"),
    (["finetune", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["finetune", "--seq-len", "-8"], "--seq-len must be >= 1, got -8"),
    (["finetune", "--bogus"], "finetune: unrecognized arguments: --bogus"),
    (["speedrun"], "no model chosen"),
    (["speedrun", "+model=void_tny"], "Could not find 'model/void_tny'"),
    (["speedrun", "+model=void_tiny", "--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    (["speedrun", "+model=void_tiny", "--max-seconds", "-1"], "--max-seconds must be > 0"),
    (["speedrun", "+model=void_tiny", "--bogus"], "speedrun: unrecognized arguments: --bogus"),
    (["speedrun", "+model=void_tiny", "trainer.seq_len=1024"], "trainer.seq_len=1024 exceeds model.max_seq_len=512"),
]


def test_bench_default_seq_len_fits_the_model():
    """bench train and speedrun compose B16 x T1024 unless told, T cut to a shorter model context."""
    from tritonllm.bench.common import compose_bench_config

    assert compose_bench_config(["+model=void_tiny"]).trainer.seq_len == 512
    assert compose_bench_config(["+model=void125m"]).trainer.seq_len == 1024
    assert compose_bench_config(["+model=void_tiny", "trainer.seq_len=64"]).trainer.seq_len == 64


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bench_bad_input_is_one_line(argv, message, capsys, monkeypatch):
    assert message in _bench(argv, capsys, monkeypatch)


def test_bench_every_option_is_parsed_before_the_gpu_check(capsys, monkeypatch, tmp_path):
    """Valid arguments, every option of each mode given: the modes that time a GPU stop at that check
    and nowhere before it, and write nothing."""
    out = str(tmp_path / "perf")
    tiny = ["+model=void_tiny", "trainer.batch_size=2", "trainer.seq_len=16"]
    runs = {
        "kernels": ["kernels", "--ops", "rms_norm,swiglu", "--sizes", "default", "--out", out, "--profile"],
        "train": ["train", *tiny, "--steps", "2", "--warmup", "3", "--baselines", "compile,max-autotune",
                  "--no-baseline", "--compiled", "--host-profile", "1", "--ab-rounds", "1", "--moe-experts", "loop",
                  "--out", out],
        "train --nproc": ["train", "--nproc", "2,4", *tiny, "--no-one-gpu", "--parallel", "ddp", "--steps", "1",
                          "--warmup", "0", "--no-baseline", "--ab", "X=1", "--rounds", "2", "--compile-mode", "none",
                          "--timeout", "10", "--out", out, "--log", str(tmp_path / "log")],
        "decode": ["decode", "+model=void_tiny", "--batch", "1,2", "--prompt-len", "8", "--new-tokens", "4",
                   "--baselines", "torch eager,reduce-overhead-sdpa", "--out", out],
        "speedrun": ["speedrun", *tiny, "--target", "3", "--sides", "adamw,torch", "--bin", "train_*.bin",
                     "--val-bin", "val_*.bin", "--max-steps", "2", "--max-seconds", "5", "--eval-every", "1",
                     "--eval-batches", "1", "--warmup", "1", "--torch-mode", "eager", "--cuda-graph", "false",
                     "--out", out],
    }
    for name, argv in runs.items():
        line = _bench(argv, capsys, monkeypatch)
        assert re.search(r"needs (a )?CUDA GPUs? \(the arguments are valid", line), (name, line)
    assert not os.path.exists(out) and not os.path.exists(tmp_path / "log")


def test_bench_train_runs_on_the_cpu(capsys, monkeypatch, tmp_path):
    """``bench train --device cpu``: the real code path (config, model, TrainStep, measure) at a toy size in
    Triton's interpreter, one warm-up and one timed step; nothing written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench_main(["train", "--device", "cpu", "+model=void_tiny", "model.n_layers=1", "model.d_model=64",
                "model.n_heads=2", "model.n_kv_heads=2", "model.d_ff=64", "model.vocab_size=128",
                "trainer.batch_size=1", "trainer.seq_len=16", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "void_tiny: 0.0M parameters, B1 x T16 fp32" in out, out
    assert re.search(r"^tritonllm \(eager\) on the CPU, in Triton's interpreter: \d+ ms per step", out, re.M), out
    assert list(tmp_path.iterdir()) == []
    assert "leave them out with --device cpu" in _bench(["train", "--device", "cpu", "+model=void_tiny", "--compiled"],
                                                         capsys, monkeypatch)


def test_bench_without_a_mode_prints_its_usage(capsys):
    with pytest.raises(SystemExit) as e:
        bench_main([])
    assert "python -m tritonllm.bench kernels" in str(e.value.code)
    bench_main(["--help"])
    assert "python -m tritonllm.bench speedrun" in capsys.readouterr().out


# --- each python -m entry point in a child process ----------------------------------------------------

CHILD = [
    (["tritonllm.bench", "train", "+model=void_tiny", "--stepz", "3"], "unrecognized arguments: --stepz"),
    (["tritonllm.bench.finetune", "--config", "huge"], "argument --config: invalid choice: 'huge'"),
    (["tritonllm.train", "+model=void_tiny", "--lr", "3e-3"], "unrecognized arguments: --lr (settings are key=value"),
    (["tritonllm.generate", "ckpt=/nonexistent/run", "prompt=x"], "/nonexistent/run"),
    (["tritonllm.export", "ckpt=/nonexistent/run", "out=export"], "ckpt='/nonexistent/run' does not exist"),
    (["tritonllm.evolve", "+model=void_tiny", "evolve.budget=lots"], "evolve.budget='lots'"),
    (["tritonllm.studio", "--port", "70000"], "--port must be 0 (any free port) to 65535, got 70000"),
    (["tritonllm.train.dist_checkpoint", "export", "/nonexistent/ckpt", "out"], "/nonexistent/ckpt holds no checkpoint"),
]


@pytest.mark.parametrize("argv, message", CHILD, ids=[a[0] for a, _ in CHILD])
def test_entry_point_bad_input_is_one_line(argv, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=child_env(ROOT, CUDA_VISIBLE_DEVICES=""))
    # runpy's warning that tritonllm.train (its loop) imports dist_checkpoint before running it as __main__
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("<frozen runpy>")]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("tritonllm: error: "), r.stderr[-3000:]
    assert message in lines[0]


def test_run_folder_below_a_file_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    r = subprocess.run([sys.executable, "-m", "tritonllm.train", "+model=void_tiny", "experiment=cpu_smoke",
                        "hydra.run.dir=notes.txt/run"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=child_env(ROOT, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 1 and r.stderr.strip() == (
        "tritonllm: error: cannot create the run folder notes.txt/run (hydra.run.dir, hydra.sweep.dir): "
        "Not a directory"), r.stderr[-3000:]


# --- combinations a newcomer tries ------------------------------------------------------------------

DATA_KINDS = sorted(f[:-len(".yaml")] for f in os.listdir(os.path.join(ROOT, "conf", "data")))


@pytest.mark.parametrize("kind", DATA_KINDS)
def test_cpu_smoke_composes_with_every_data_kind(kind):
    """``experiment=cpu_smoke`` sets the run's sizes with every data kind, and its data sizes where the
    kind has them (a command-line value still wins)."""
    files = [] if kind == "stdlib" else ["data.files=corpus/*"]
    cfg = compose_config("train", ["+model=void_tiny", f"data={kind}", *files, "experiment=cpu_smoke"])
    assert cfg.data.kind == kind and (cfg.trainer.max_steps, cfg.trainer.batch_size, cfg.trainer.seq_len) == (20, 4, 32)
    if kind in ("stdlib", "text"):
        assert (cfg.data.max_bytes, cfg.data.vocab_size) == (1500000, 2048)
        assert compose_config("train", ["+model=void_tiny", f"data={kind}", *files, "experiment=cpu_smoke",
                                        "data.max_bytes=1000"]).data.max_bytes == 1000
    else:
        assert "max_bytes" not in cfg.data
    assert compose_config("train", ["+model=void_tiny", f"data={kind}", *files]).trainer.max_steps != 20


@pytest.mark.parametrize("content, message", [
    ("", "the 2 text files of data.files are empty: {0}/a.txt, {0}/b.txt; point data.files at files that hold text"),
    ("\n\n\n", "cannot train a tokenizer on 2 text files ({0}/a.txt ...): they hold no text (only empty lines)"),
], ids=["empty", "only-newlines"])
def test_text_files_without_text_are_named(tmp_path, content, message):
    from tritonllm.data import load_corpus

    folder = tmp_path / "texts"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(content)
    cfg = compose_config("train", ["+model=void_tiny", "experiment=cpu_smoke", "data=text", f"data.files={folder}/*.txt",
                                   f"data.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(DataError) as e:
        load_corpus(cfg.data)
    assert str(e.value) == message.format(folder)


def test_smoke_gpu_chains_keep_each_case_after_what_it_reads(tmp_path):
    """scripts/smoke_gpu.py runs chains of cases at once: every case that reads another's output (AFTER) is
    in that case's chain, after it; every case is in exactly one chain."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("smoke_gpu", Path(__file__).parents[1] / "scripts" / "smoke_gpu.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    names = [c[0] for c in smoke.cases(tmp_path)]
    assert set(smoke.AFTER) | set(smoke.AFTER.values()) <= set(names)
    chains = smoke.chains(names)
    assert sorted(n for c in chains for n in c) == sorted(names)
    where = {n: (i, c.index(n)) for i, c in enumerate(chains) for n in c}
    for case, before in smoke.AFTER.items():
        assert where[case][0] == where[before][0] and where[case][1] > where[before][1], case
    assert smoke.chains(["generate", "patch"]) == [["generate"], ["patch"]]
