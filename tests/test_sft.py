"""SFT data (tritonllm.data.sft), sequence packing (layout, resume, ranks; a packed batch's loss and
gradients equal those of its examples run alone) and a LoRA fine-tuning run of an imported Hugging
Face model, packed or not."""

import json
import logging

import numpy as np
import pytest
import torch
import transformers  # test dependency (pyproject [test])
from hydra import compose, initialize_config_module
from tokenizers import Tokenizer, models, pre_tokenizers

from _checks import DEVICE, gemm_atol
from tritonllm.data.hf_tokenizer import HFTokenizer
from tritonllm.data.sft import IGNORE, SFTLoader, encode_example, read_records
from tritonllm.errors import ConfigError, DataError
from tritonllm.models import ModelConfig, build_model

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


F, T = False, True


def test_packed_layout_by_hand():
    """Rows of seq_len + 1 = 8 tokens: A (4) + B (3) + padding, then C (7) alone; the next A does not
    fit, so the batch ends there and the position is epoch 1's first example; D (12 tokens) is cut."""
    examples = [(np.array([5, 6, 7, 8]), np.array([F, F, T, T])), (np.array([9, 10, 11]), np.array([F, T, T])),
                (np.arange(12, 19), np.array([F, F, T, T, T, T, T])), (np.arange(20, 32), np.array([F] + [T] * 11))]
    loader = SFTLoader(examples, 2, 7, seed=0, shuffle=False, pad_id=1, pack=True)
    x, y, docs = loader.next_batch()
    assert x.tolist() == [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
    assert y.tolist() == [[IGNORE, 7, 8, IGNORE, 10, 11, IGNORE], [IGNORE, 14, 15, 16, 17, 18, IGNORE]]
    assert docs.dtype == torch.int32 and docs.shape == (2, 7, 2)
    assert docs[0].tolist() == [[0, 4]] * 4 + [[4, 7]] * 3 and docs[1].tolist() == [[0, 7]] * 7
    assert (loader.epoch, loader.index) == (0, 3)
    x, y, docs = loader.next_batch()
    assert x[0].tolist() == list(range(20, 27)) and y[0].tolist() == list(range(21, 28))  # D cut to a row
    assert (loader.epoch, loader.index) == (1, 2)


def _numbered_examples(n=23, seed=0):
    """Examples of 1 to 6 tokens and, every 7th, 13 (longer than a packed row of 10), example e's tokens
    100 e + 1, 100 e + 2, ... (each token names its example and place); trained at random, the first
    token never."""
    rng = np.random.default_rng(seed)
    out = []
    for e in range(n):
        length = 13 if e % 7 == 3 else int(rng.integers(1, 7))
        trained = rng.random(length) < 0.6
        trained[0] = False
        out.append((100 * e + 1 + np.arange(length), trained))
    return out


def _packed_loader(examples, B=2, rank=0, world_size=1, seq_len=9):
    return SFTLoader(examples, B, seq_len, seed=5, shuffle=True, vocab_size=None, name="train", pad_id=0, rank=rank,
                     world_size=world_size, pack=True)


def test_packing_keeps_every_example_whole_once_per_epoch(caplog):
    """Three epochs of packed batches: each document is one example's first tokens (cut at a row),
    y = -100 at a document's last position (within the row) and on padding, and the trained targets
    read in batch order are every example's trained tokens, in the order of each epoch's permutation.
    Each new epoch is one log line."""
    examples = _numbered_examples()
    loader = _packed_loader(examples)
    targets = []
    while loader.epoch < 3:
        with caplog.at_level(logging.INFO, logger="tritonllm.data.sft"):
            x, y, docs = loader.next_batch()
        for row in range(x.shape[0]):
            xs, ys, d = x[row].numpy(), y[row].numpy(), docs[row].numpy()
            starts = np.flatnonzero(np.arange(9) == d[:, 0])
            for s in starts:
                end = d[s, 1]
                assert (d[s:end] == [s, end]).all()
                if xs[s] == 0:  # padding: the rest of the row, nothing trained
                    assert end == 9 and (xs[s:] == 0).all() and (ys[s:] == IGNORE).all()
                    continue
                ids, trained = examples[xs[s] // 100]
                assert (xs[s:end] == ids[:end - s]).all(), "a document is one example's first tokens"
                n = min(len(ids), 10)
                if s + n <= 9:  # the example ends inside the row: its last position predicts nothing
                    assert end == s + n and ys[end - 1] == IGNORE
                expect = np.append(np.where(trained[1:], ids[1:], IGNORE), IGNORE)  # next token, none at the end
                assert (ys[s:end] == expect[:end - s]).all()
        targets += [int(t) for t in y.flatten() if t != IGNORE]
    order = [e for epoch in range(3) for e in loader._order(epoch)] + list(loader._order(3)[:loader.index])
    expected = [int(t) for e in order for t, m in zip(examples[e][0][1:10], examples[e][1][1:10]) if m]
    assert targets == expected
    assert caplog.messages == [f"data: epoch {k} begins: the training data repeats ({len(examples)} examples)"
                               for k in (2, 3, 4)]


def test_packed_resume_mid_epoch_and_validation_batches():
    """A loader restored from a mid-epoch state gives the same packed batches as the one that went
    on; batches(n) repeats what a fresh unshuffled loader's next_batch gives, leaving the state alone."""
    examples = _numbered_examples()
    a = _packed_loader(examples)
    for _ in range(4):
        a.next_batch()
    state = a.state_dict()
    assert state["epoch"] == 0 and 0 < state["index"] < len(examples)
    b = _packed_loader(examples)
    b.load_state_dict(state)
    for _ in range(5):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))
    val = SFTLoader(examples, 2, 9, 5, False, pack=True)
    fresh = SFTLoader(examples, 2, 9, 5, False, pack=True)
    for got in val.batches(10):  # past the end of the split: cycles
        assert all(torch.equal(u, v) for u, v in zip(got, fresh.next_batch()))
    assert (val.epoch, val.index) == (0, 0) and fresh.epoch >= 1


def test_packed_ranks_are_disjoint_shares_of_the_global_batch():
    """Rank r's packed rows are rows [r B, (r + 1) B) of one loader of the global batch, training and
    validation; every rank's position stays the global one."""
    examples = _numbered_examples()
    ranks = [_packed_loader(examples, B=1, rank=r, world_size=2) for r in range(2)]
    single = _packed_loader(examples, B=2)
    for _ in range(7):
        parts, whole = [r.next_batch() for r in ranks], single.next_batch()
        for i in range(3):
            assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    for *parts, whole in zip(*(r.batches(3) for r in ranks), single.batches(3)):
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])


def test_unpacked_loader_gives_no_documents():
    examples = _numbered_examples()
    assert len(SFTLoader(examples, 2, 9, 0).next_batch()) == 2
    with pytest.raises(DataError, match="no tokens to pack"):
        SFTLoader([(np.zeros(0, np.int64), np.zeros(0, bool))], 2, 9, 0, pack=True)


def test_packed_loss_equals_the_examples_run_alone():
    """A tiny model (float32) on a packed batch: loss and every gradient equal those of the same
    examples each alone in its own row (positions from 0, same targets); without the documents the
    packed examples would see each other and the loss differs."""
    cfg = ModelConfig(name="tiny", vocab_size=2400, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32,
                      d_ff=96, max_seq_len=32)
    torch.manual_seed(0)
    model = build_model(cfg, device=DEVICE, dtype=torch.float32)
    examples = _numbered_examples()
    x, y, docs = _packed_loader(examples, B=2, seq_len=23).next_batch()
    alone = {"x": [], "y": []}
    for row in range(x.shape[0]):
        for s in sorted(set(docs[row, :, 0].tolist()) - set(np.flatnonzero(x[row] == 0).tolist())):  # no padding
            end = int(docs[row, s, 1])
            for key, t, fill in (("x", x, 0), ("y", y, IGNORE)):
                alone[key].append(torch.cat([t[row, s:end], torch.full((23 - end + s,), fill)]))
    assert len(alone["x"]) >= 3 * x.shape[0], "the batch packs several examples per row"

    def loss_and_grads(*inputs, **kw):
        model.zero_grad(set_to_none=True)
        loss = model(*(t.to(DEVICE) for t in inputs), **kw)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, packed_grads = loss_and_grads(x, y, documents=docs.to(DEVICE))
    ref, ref_grads = loss_and_grads(torch.stack(alone["x"]), torch.stack(alone["y"]))
    torch.testing.assert_close(packed, ref, rtol=1e-5, atol=0)
    # The two runs sum the same terms in other groupings (rows, attention tiles) and so round differently:
    # 1e-5 of the largest gradient on the CPU. On a GPU the fp32 GEMMs run TF32 (attention's dots stay IEEE):
    # an operand whose last fp32 bits differ between the runs may truncate to the neighbouring TF32 value,
    # a 2^-10 step in that product, carried down the rest of the backward (the first layer's qkv gradient
    # comes back through both layers' GEMMs): a whole model's chain of products, 4 (as HF_ATOL in
    # test_lora/test_hf), of the largest gradient. A wrong mask or position moves gradients by far more.
    grad_atol = gemm_atol(torch.float32, chain=4) or 1e-5
    for name, g in ref_grads.items():
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-4, atol=grad_atol * g.abs().max().item(), msg=name)
    with torch.no_grad():
        assert not torch.allclose(model(x.to(DEVICE), y.to(DEVICE)), ref, rtol=1e-3)


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


@pytest.mark.parametrize("pack", [False, True], ids=["rows", "packed"])
def test_lora_finetune_run_lowers_loss(model_folder, tmp_path, pack, monkeypatch):
    """python -m tritonllm.train +model=hf model.path=... data=sft ... +lora=default, on the CPU, one
    example per row or packed (data.pack=true: documents reach the attention, training and validation)."""
    import tritonllm.nn.attention
    from tritonllm.train import train

    attention, seen = tritonllm.nn.attention.rope_flash_attention, set()

    def spy(*args, documents=None, **kw):  # (training or validation, documents given)
        seen.add((torch.is_grad_enabled(), documents is not None))
        return attention(*args, documents=documents, **kw)

    monkeypatch.setattr(tritonllm.nn.attention, "rope_flash_attention", spy)  # the attention of training

    data = write_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    cfg = compose_run("+model=hf", f"model.path={model_folder}", "data=sft", f"data.files={data}",
                      "data.val_fraction=0.2", f"data.pack={pack}", "+lora=default", "lora.rank=8", "lora.alpha=16",
                      f"device={DEVICE}", "trainer.batch_size=4", "trainer.seq_len=24", "trainer.max_steps=8",
                      "trainer.eval_interval=8", "trainer.eval_batches=1", "trainer.log_interval=1",
                      "trainer.progress=false", "optim.lr=1e-1", "sched=constant", "sched.warmup_steps=0",
                      f"out_dir={out}")
    train(cfg)
    with open(out / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]
    # from chance (ln 64 = 4.16) toward the 4 answers' entropy: a clear fall within 8 steps
    assert len(losses) == 8 and max(losses[-3:]) < losses[0] - 0.4, losses
    assert seen == {(True, pack), (False, pack)}


def test_hf_model_config_errors(model_folder):
    from tritonllm.train.loop import model_config

    with pytest.raises(ConfigError, match="n_layers"):
        model_config(compose_run("+model=hf", f"model.path={model_folder}", "+model.n_layers=3"))
    with pytest.raises(ConfigError, match="config.json"):
        model_config(compose_run("+model=hf", f"model.path={model_folder}/nowhere"))
