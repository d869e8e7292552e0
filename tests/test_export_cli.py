"""python -m tritonllm.export on the CPU: a 2-step void_tiny run and a 2-step ``+model=hf ... +lora`` run
written as Hugging Face folders that transformers (merged) and PEFT (``adapters_only=true``, on the base
folder) load with our logits, fp32; the tokenizer files of the run's folder along; bad input as one line."""

import json

import peft  # test dependencies (pyproject [test])
import pytest
import torch
import transformers
from safetensors import safe_open

from _checks import DEVICE
from test_generate_hf import N_TOKENS
from test_hf import assert_logits, make_hf
from test_robustness import run_cli
from test_sft import compose_run, write_jsonl, write_tokenizer
from test_train import TINY, compose_train, data_overrides  # noqa: F401 (fixture)
from tritonllm.export import main
from tritonllm.generate import load_run_model, resolve_checkpoints
from tritonllm.nn.lora import HF_MODULES, LoRALinear

TWO_STEPS = ["trainer.max_steps=2", "trainer.eval_interval=2", "trainer.ckpt_interval=2"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, data_overrides):  # noqa: F811 (the fixture imported above)
    """void_tiny shrunk, 2 steps on text files (a SentencePiece tokenizer: no Hugging Face folder)."""
    from tritonllm.train import train

    out = tmp_path_factory.mktemp("runs") / "plain"
    tiny = [o for o in TINY if o.split("=")[0] not in {t.split("=")[0] for t in TWO_STEPS}]
    train(compose_train(*tiny, *TWO_STEPS, *data_overrides, f"out_dir={out}"))
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 2-step ``+model=hf model.path=<1-layer qwen2 folder> data=sft +lora=default`` run, every target adapted:
    (run folder, base model folder)."""
    from tritonllm.train import train

    root = tmp_path_factory.mktemp("lora_export")
    folder = root / "base"
    folder.mkdir()
    make_hf("qwen2_bias_tied", vocab_size=N_TOKENS, num_hidden_layers=1).save_pretrained(folder)
    write_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    train(compose_run("+model=hf", f"model.path={folder}", "data=sft", f"data.files={write_jsonl(root / 'a.jsonl')}",
                      "data.val_fraction=0.2", "+lora=default", "lora.rank=4", "lora.alpha=8", f"device={DEVICE}",
                      "trainer.batch_size=2", "trainer.seq_len=24", *TWO_STEPS, "trainer.eval_batches=1",
                      "trainer.progress=false", "optim.lr=1e-1", "sched=constant", "sched.warmup_steps=0",
                      f"out_dir={root / 'run'}"))
    return root / "run", folder


def export_cli(args, cwd, monkeypatch, capsys) -> str:
    """The one line ``python -m tritonllm.export <args>`` prints, run in this process."""
    monkeypatch.setattr("sys.argv", ["export", *args, f"device={DEVICE}"])
    monkeypatch.chdir(cwd)
    main()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("exported "), out
    return out


def ours(run):
    """Our model of the run's newest checkpoint (adapters applied) and token ids for it."""
    model = load_run_model(resolve_checkpoints(str(run))[0], torch.device(DEVICE), torch.float32)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    return model, ids


def logits(model, ids):
    with torch.no_grad():
        return model(ids.to(DEVICE)).cpu()


def test_plain_run_exports_our_logits(plain_run, tmp_path, monkeypatch, capsys):
    line = export_cli([f"ckpt={plain_run}", "out=hf"], tmp_path, monkeypatch, capsys)
    assert line.endswith("Hugging Face model, float32, no tokenizer (the run has no Hugging Face tokenizer "
                         "folder)\n") and "step_00000002" in line
    model, ids = ours(plain_run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        assert_logits("plain run", logits(model, ids), hf(ids).logits)


def test_dtype_and_architecture(plain_run, tmp_path, monkeypatch, capsys):
    """``dtype=bf16`` writes bf16 tensors (a cast: no kernel runs in bf16); ``architecture=mistral`` names
    the family of a model both fit."""
    export_cli([f"ckpt={plain_run}", "out=hf", "dtype=bf16", "architecture=mistral"], tmp_path, monkeypatch, capsys)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["torch_dtype"]) == ("mistral", "bfloat16")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_lora_run_merged(lora_run, tmp_path, monkeypatch, capsys):
    run, base = lora_run
    line = export_cli([f"ckpt={run}", "out=merged"], tmp_path, monkeypatch, capsys)
    assert line.endswith(f"Hugging Face model (LoRA adapters merged), float32, tokenizer from {base}\n"), line
    out = tmp_path / "merged"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    model, ids = ours(run)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(layers) == 4 * model.cfg.n_layers and all(m.lora_B.abs().max() > 0 for m in layers)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
        assert (ref - base_hf(ids).logits).abs().max() > 1e-3  # the adapters are in the exported weights
    assert_logits("merged", logits(model, ids), ref)
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template is not None


def test_lora_run_adapters_only(lora_run, tmp_path, monkeypatch, capsys):
    run, base = lora_run
    line = export_cli([f"ckpt={run}", "out=adapter", "adapters_only=true"], tmp_path, monkeypatch, capsys)
    targets = ",".join(HF_MODULES)
    assert f"PEFT LoRA adapter (r=4, alpha=8, targets {targets}; base {base}), float32, tokenizer from" in line
    out = tmp_path / "adapter"
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, str(base))
    assert config["target_modules"] == sorted(m.split(".")[1] for m in HF_MODULES.values())
    model, ids = ours(run)
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {f"base_model.model.model.layers.{i}.{m}.lora_{w}.weight" for i in range(model.cfg.n_layers)
                     for m in HF_MODULES.values() for w in "AB"}
    assert (out / "tokenizer.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        assert_logits("PEFT adapter", logits(model, ids), adapted(ids).logits)


def test_overwrite_replaces_the_folder(plain_run, tmp_path, monkeypatch, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "stale.txt").write_text("from before")
    export_cli([f"ckpt={plain_run}", "out=hf", "overwrite=true"], tmp_path, monkeypatch, capsys)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left


@pytest.mark.parametrize("args,message", [
    (["out=x"], "give ckpt=<a checkpoint, checkpoints or run folder>"),
    (["ckpt={plain}"], "give out=<the folder to write>"),
    (["ckpt=nowhere", "out=x"], "ckpt='nowhere' does not exist"),
    (["ckpt={plain}", "out=x", "adapters_only=true"], "adapters_only=true: the run has no LoRA adapters"),
    (["ckpt={plain}", "out={full}"], "out='{full}' exists and is not empty; pass overwrite=true to replace it"),
    (["ckpt={plain}", "out={plain}", "overwrite=true"], "out='{plain}' holds the checkpoint ckpt='{plain}'"),
    (["ckpt={plain}", "out=x", "dtype=fp8"], "dtype='fp8' is not one of auto, bf16, fp16, fp32"),
    (["ckpt={plain}", "out=x", "architecture=gpt2"], "architecture='gpt2': expected one of"),
    (["ckpt={lora}", "out=x", "adapters_only=true", "architecture=llama"],
     "architecture='llama' applies to the merged model"),
])
def test_bad_inputs_are_one_line(plain_run, lora_run, args, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    names = dict(plain=plain_run, lora=lora_run[0], full=tmp_path / "full")
    err = run_cli("tritonllm.export", [a.format(**names) for a in args] + [f"device={DEVICE}"], tmp_path,
                  monkeypatch, capsys)
    assert err.startswith("tritonllm: error: " + message.format(**names)) and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing written
