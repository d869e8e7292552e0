"""SFT data (tritonllm.data.sft) and a LoRA fine-tuning run of an imported Hugging Face model."""

import json

import numpy as np
import pytest
import torch
import transformers  # test dependency (pyproject [test])
from hydra import compose, initialize_config_module
from tokenizers import Tokenizer, models, pre_tokenizers

from _checks import DEVICE
from tritonllm.data.hf_tokenizer import HFTokenizer
from tritonllm.data.sft import IGNORE, SFTLoader, encode_example, read_records
from tritonllm.errors import ConfigError, DataError

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ("user assistant system what is the capital of france paris germany berlin italy rome spain madrid "
         "say hello hi answer yes no one two three four").split()
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 64


def write_tokenizer(folder, template=TEMPLATE):
    """A word-level tokenizer.json (ids: specials, then WORDS) and tokenizer_config.json."""
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS + [":"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.add_special_tokens(SPECIALS[1:])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    if template:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return vocab


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny random Llama with the word-level tokenizer and a ChatML-style template."""
    folder = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   max_position_embeddings=64, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    write_tokenizer(folder)
    return folder


QA = [("what is the capital of france", "paris"), ("what is the capital of germany", "berlin"),
      ("what is the capital of italy", "rome"), ("what is the capital of spain", "madrid")]


def write_jsonl(path, n=24):
    lines = []
    for i in range(n):
        q, a = QA[i % len(QA)]
        if i % 2:
            lines.append({"prompt": q, "response": a})
        else:
            lines.append({"messages": [{"role": "system", "content": "answer"}, {"role": "user", "content": q},
                                       {"role": "assistant", "content": a}]})
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return path


def test_chat_template_masks_all_but_the_response(model_folder):
    tok = HFTokenizer(str(model_folder))
    msgs = [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "say one"}, {"role": "assistant", "content": "one two"}]
    ids, trained = encode_example(tok, msgs, "x:1", use_template=True)
    words = [tok.tok.id_to_token(i) for i in ids]
    assert words == ["<|im_start|>", "user", "say", "hello", "<|im_end|>", "<|im_start|>", "assistant", "hi",
                     "<|im_end|>", "<|im_start|>", "user", "say", "one", "<|im_end|>", "<|im_start|>", "assistant",
                     "one", "two", "<|im_end|>"]
    assert [w for w, t in zip(words, trained) if t] == ["hi", "<|im_end|>", "one", "two", "<|im_end|>"]


def test_fallback_layout_without_template(tmp_path):
    write_tokenizer(tmp_path, template=None)
    tok = HFTokenizer(str(tmp_path))
    ids, trained = encode_example(tok, [{"role": "user", "content": "say hi"},
                                        {"role": "assistant", "content": "hello"}], "x:1", use_template=False)
    words = [tok.tok.id_to_token(i) for i in ids]
    assert words == ["<s>", "user", ":", "say", "hi", "assistant", ":", "hello", "</s>"]
    assert [w for w, t in zip(words, trained) if t] == ["hello", "</s>"]


def test_loader_shifts_targets_and_pads_with_ignore():
    examples = [(np.array([5, 6, 7, 8]), np.array([False, False, True, True])),
                (np.array([9, 10, 11, 12, 13, 14, 15]), np.array([False, True, True, True, True, True, True]))]
    loader = SFTLoader(examples, batch_size=2, seq_len=5, seed=0, shuffle=False, vocab_size=16, pad_id=2)
    x, y = next(loader.batches(1))
    assert x.tolist() == [[5, 6, 7, 2, 2], [9, 10, 11, 12, 13]]
    assert y.tolist() == [[IGNORE, 7, 8, IGNORE, IGNORE], [10, 11, 12, 13, 14]]  # the second is cut at 6 tokens
    with pytest.raises(DataError, match="vocabulary"):
        SFTLoader(examples, 2, 5, 0, vocab_size=12)
    ranks = [SFTLoader(examples * 2, 1, 5, 3, True, None, "train", 0, r, 2) for r in range(2)]
    both = [torch.cat([r.next_batch()[0] for r in ranks]) for _ in range(2)]
    single = SFTLoader(examples * 2, 2, 5, 3, True, None, "train", 0)
    assert all(torch.equal(b, single.next_batch()[0]) for b in both)


@pytest.mark.parametrize("line,match", [
    ('{"messages": [{"role": "user", "content": "hi"}', "line 3|:3: not valid JSON"),
    ('{"prompt": "hi"}', ":3: field 'response'"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', r":3: field 'messages\[0\].role'"),
    ('{"messages": [{"role": "user", "content": 5}]}', r":3: field 'messages\[0\].content'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', ":3: field 'messages' has no assistant"),
    ('[1, 2]', ":3: a record must be a JSON object"),
], ids=["bad_json", "no_response", "bad_role", "content_not_string", "no_assistant", "not_object"])
def test_malformed_record_names_line_and_field(tmp_path, line, match):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=match) as e:
        read_records([str(path)])
    assert str(path) in str(e.value)


def compose_run(*overrides):
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_lora_finetune_run_lowers_loss(model_folder, tmp_path):
    """python -m tritonllm.train +model=hf model.path=... data=sft ... +lora=default, on the CPU."""
    from tritonllm.train import train

    data = write_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    cfg = compose_run("+model=hf", f"model.path={model_folder}", "data=sft", f"data.files={data}",
                      "data.val_fraction=0.2", "+lora=default", "lora.rank=8", "lora.alpha=16", f"device={DEVICE}",
                      "trainer.batch_size=4", "trainer.seq_len=24", "trainer.max_steps=8", "trainer.eval_interval=8",
                      "trainer.eval_batches=1", "trainer.log_interval=1", "trainer.progress=false",
                      "optim.lr=1e-1", "sched=constant", "sched.warmup_steps=0", f"out_dir={out}")
    train(cfg)
    with open(out / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    # from chance (ln 64 = 4.16) toward the 4 answers' entropy: a clear fall within 8 steps
    assert len(losses) == 8 and max(losses[-3:]) < losses[0] - 0.4, losses


def test_hf_model_config_errors(model_folder):
    from tritonllm.train.loop import model_config

    with pytest.raises(ConfigError, match="n_layers"):
        model_config(compose_run("+model=hf", f"model.path={model_folder}", "+model.n_layers=3"))
    with pytest.raises(ConfigError, match="config.json"):
        model_config(compose_run("+model=hf", f"model.path={model_folder}/nowhere"))
