"""python -m tritonllm.generate from a Hugging Face folder (hf=<dir>) and from the checkpoint of a
+model=hf ... +lora=default data=sft run, with the model's tokenizer and chat template, on the CPU."""

import shutil

import pytest
import torch
import transformers  # test dependency (pyproject [test])
from omegaconf import OmegaConf
from tokenizers import Tokenizer, processors

from _checks import DEVICE
from test_hf import make_hf
from test_robustness import run_cli
from test_sft import SPECIALS, TEMPLATE, WORDS, compose_run, write_jsonl, write_tokenizer
from tritonllm.data.hf_tokenizer import HFTokenizer
from tritonllm.errors import CheckpointError
from tritonllm.generate import (_checkpoint_tokenizer, generate_text, load_hf_for_generation,
                                load_newest_for_generation, main, prompt_ids)
from tritonllm.nn.lora import LoRALinear

N_TOKENS = len(SPECIALS) + len(WORDS) + 1  # write_tokenizer's vocabulary
PROMPT = "what is the capital of france"


def hf_folder(path, family, bos=False, template=True):
    """A tiny random model of ``family`` saved with write_tokenizer's tokenizer (``bos``: its
    tokenizer.json adds <s> in front, as Llama's does); returns the transformers model."""
    model = make_hf(family, vocab_size=N_TOKENS)
    model.save_pretrained(path)
    write_tokenizer(path, template=None if not template else
                    "{{ bos_token }}" + TEMPLATE)
    if bos:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        tok.save(str(path / "tokenizer.json"))
    return model


def cli(args, cwd, monkeypatch, capsys) -> str:
    """stdout of ``python -m tritonllm.generate <args>`` run in this process."""
    monkeypatch.setattr("sys.argv", ["generate", *args, f"device={DEVICE}"])
    monkeypatch.chdir(cwd)
    main()
    return capsys.readouterr().out


def reference(hf, hf_tok, tok, prompt, chat, n):
    """transformers' prompt ids and greedy new tokens (cut at EOS). The chat prompt is compared as
    the text transformers' template renders (its encoding of this word-level tokenizer drops the
    words next to special tokens, so the ids are the tokenizers library's)."""
    if chat:
        text = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=False)
        assert tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True) == text
        ids = tok.tok.encode(text, add_special_tokens=False).ids
    else:
        ids = hf_tok(prompt)["input_ids"]
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return ids, new[:new.index(hf_tok.eos_token_id)] if hf_tok.eos_token_id in new else new


@pytest.mark.parametrize("family,chat", [("llama_llama3rope_untied", False), ("qwen2_bias_tied", True)])
def test_hf_folder_greedy_equals_transformers(family, chat, tmp_path, monkeypatch, capsys):
    hf = hf_folder(tmp_path, family, bos=not chat)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    model, tok = load_hf_for_generation(str(tmp_path), torch.device(DEVICE), torch.float32)
    ids, ref_new = reference(hf, hf_tok, tok, PROMPT, chat, 8)
    assert isinstance(tok, HFTokenizer) and prompt_ids(tok, PROMPT, chat) == ids
    assert ids[0] == tok.bos_id  # tokenizer.json's post-processor BOS as transformers adds it, or the template's
    ours = model.generate(torch.tensor([ids], device=DEVICE), 8, temperature=0.0)[0, len(ids):].tolist()
    assert ref_new and ours[:len(ref_new)] == ref_new
    out = cli([f"hf={tmp_path}", f"prompt={PROMPT}", f"chat={str(chat).lower()}", "temperature=0",
               "max_new_tokens=8"], tmp_path, monkeypatch, capsys)
    reply = tok.decode(ref_new)
    assert out == (reply if chat else PROMPT + reply) + "\n"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 4-step +model=hf ... +lora=default data=sft run on the CPU: (run folder, model folder)."""
    from tritonllm.train import train

    root = tmp_path_factory.mktemp("lora_gen")
    folder = root / "base"
    folder.mkdir()
    hf_folder(folder, "qwen2_bias_tied", template=True)
    data = write_jsonl(root / "train.jsonl")
    out = root / "run"
    train(compose_run("+model=hf", f"model.path={folder}", "data=sft", f"data.files={data}", "data.val_fraction=0.2",
                      "+lora=default", "lora.rank=4", "lora.alpha=8", "lora.targets=[q,v,down]", f"device={DEVICE}",
                      "trainer.batch_size=4", "trainer.seq_len=24", "trainer.max_steps=4", "trainer.eval_interval=4",
                      "trainer.eval_batches=1", "trainer.log_interval=4", "trainer.progress=false", "optim.lr=1e-1",
                      "sched=constant", "sched.warmup_steps=0", f"out_dir={out}"))
    return out, folder


def test_lora_checkpoint_generates_with_its_adapters(lora_run, tmp_path, monkeypatch, capsys):
    out, folder = lora_run
    device = torch.device(DEVICE)
    _, model, tok = load_newest_for_generation(str(out), device, torch.float32)
    assert isinstance(tok, HFTokenizer) and tok.folder == str(folder)  # the run's data.tokenizer
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(layers) == 2 * model.cfg.n_layers and all(m.lora_B.abs().max() > 0 for m in layers)
    base, _ = load_hf_for_generation(str(folder), device, torch.float32)
    idx = torch.tensor([prompt_ids(tok, PROMPT, chat=True)], device=DEVICE)
    with torch.no_grad():
        assert (model(idx) - base(idx)).abs().max() > 1e-2  # the adapters change the model
    # the CLI prints the adapted model's text (its loader is the one checked above; the base model's greedy
    # tokens may coincide with the adapted model's on random weights, so they are not compared)
    tuned = generate_text(model, tok, PROMPT, 6, temperature=0.0, chat=True)
    assert cli([f"ckpt={out}", f"prompt={PROMPT}", "chat=true", "temperature=0", "max_new_tokens=6"],
               tmp_path, monkeypatch, capsys) == tuned + "\n"
    with torch.no_grad():  # B = 0: the base model again, with its weights as the run kept them: trainer.dtype=auto
        # trains bf16 weights on a GPU (fp32 masters), so the checkpoint holds the frozen ones rounded to bf16
        for p in base.parameters():
            p.copy_(p.to(torch.bfloat16 if device.type == "cuda" else torch.float32).float())
        for m in layers:
            m.lora_B.zero_()
        assert torch.allclose(model(idx), base(idx), atol=1e-5)


@pytest.mark.parametrize("args,message", [
    ([], "give one of ckpt=<checkpoint, checkpoints or run folder> and hf=<Hugging Face model folder>"),
    (["ckpt=a", "hf=b"], "give one of ckpt=<checkpoint, checkpoints or run folder> and hf=<Hugging Face model "
                         "folder>, not both (ckpt='a', hf='b')"),
    (["hf=nowhere"], "hf='nowhere' is not a Hugging Face model folder (no config.json)"),
    (["hf={base}", "tokenizer=nowhere"], "tokenizer='nowhere' does not exist"),
    (["hf={base}", "tokenizer={run}"], "tokenizer='{run}': {run} has no tokenizer.json"),
    (["hf={plain}", "chat=true"], "chat=true: the tokenizer in {plain} has no chat template"),
    (["hf={base}", "chat=maybe"], "chat=maybe is not true or false"),
])
def test_bad_inputs_are_one_line(lora_run, args, message, tmp_path, monkeypatch, capsys):
    out, folder = lora_run
    plain = tmp_path / "plain"
    if any("{plain}" in a for a in args):
        plain.mkdir()
        shutil.copy(folder / "config.json", plain)
        shutil.copy(folder / "model.safetensors", plain)
        write_tokenizer(plain, template=None)
    names = dict(base=folder, run=out, plain=plain)
    err = run_cli("tritonllm.generate", [a.format(**names) for a in args], tmp_path, monkeypatch, capsys)
    assert err.startswith("tritonllm: error: " + message.format(**names)) and err.count("\n") == 1, err


def test_checkpoint_tokenizer_folder_gone(tmp_path):
    """A run's data.tokenizer folder that has moved is named, with the way out."""
    with pytest.raises(CheckpointError, match=r"data.tokenizer='/nowhere' \(config.yaml\) has no tokenizer.json; "
                                              r"pass tokenizer="):
        _checkpoint_tokenizer(str(tmp_path), OmegaConf.create({"data": {"tokenizer": "/nowhere"}}))
    with pytest.raises(CheckpointError, match="names no data.tokenizer"):
        _checkpoint_tokenizer(str(tmp_path), OmegaConf.create({}))
