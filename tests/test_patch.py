"""tritonllm.patch: transformers' own tiny random models run on tritonllm's kernels, fp32 on the CPU.

The patched model's logits, loss and every parameter gradient are checked against the same model
in float64 (the reference) with the unpatched float32 model as the yardstick of the tolerance rule
(docs/architecture.md, "Tests"). Sizes stay tiny (hidden 64, 2 layers, T 16): the interpreter is slow.
"""

import copy
import functools

import pytest
import torch

from _checks import assert_close, gemm_atol
from conftest import DEVICE
from test_hf import COMMON, FAMILIES, VOCAB, make_hf

import transformers  # a test dependency (pyproject [test])

import tritonllm
import tritonllm.patch as patch_mod
from tritonllm.hf import HFConfigError

T = 16
KERNELS = ("rms_norm", "linear", "swiglu", "rope", "flash_attention", "linear_cross_entropy")


def _model(family: str, **overrides):
    return make_hf(family, **overrides).to(DEVICE)


def _batch(B=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (B, T), generator=gen)
    labels = torch.randint(0, VOCAB, (B, T), generator=gen)
    labels[torch.rand(B, T, generator=gen) < 0.3] = -100  # prompt tokens: no loss
    return idx.to(DEVICE), labels.to(DEVICE)


def _loss_and_grads(model, idx, labels, **kwargs):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(idx, labels=labels, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls of each kernel tritonllm.patch launches, counted while the test runs."""
    calls = dict.fromkeys(KERNELS, 0)

    def counted(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in KERNELS:
        monkeypatch.setattr(patch_mod, name, counted(name, getattr(patch_mod, name)))
    return calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_loss_and_gradients_equal(family):
    ref = _model(family)
    ref64 = copy.deepcopy(ref).double()
    ours = tritonllm.patch(copy.deepcopy(ref))
    assert ours.config._attn_implementation == "tritonllm"
    idx, labels = _batch()
    with torch.no_grad():
        assert_close(f"{family} logits", ours.eval()(idx).logits, ref64.eval()(idx).logits, ref.eval()(idx).logits)
    loss, grads = _loss_and_grads(ours, idx, labels)
    loss64, grads64 = _loss_and_grads(ref64, idx, labels)
    loss32, grads32 = _loss_and_grads(ref, idx, labels)
    assert_close(f"{family} loss", loss, loss64, loss32)
    assert set(grads) == set(grads64)
    # a weight gradient is a product of two GEMM outputs (the upstream gradient and the layer's input,
    # e.g. o_proj's: dY^T @ attention output), each with its own TF32 error on a GPU: chain 2 (the CPU's
    # tolerance unchanged). On the H100, 4 * PyTorch's TF32 error + 2e-5 fell just short for Llama's o_proj.
    for name, g in grads.items():
        assert_close(f"{family} d{name}", g, grads64[name], grads32[name], atol=gemm_atol(torch.float32, chain=2))


def test_the_kernels_run_not_torch_math(monkeypatch, kernel_calls):
    """Every op the patch covers goes through tritonllm's kernels: the torch functions transformers
    would call instead raise, and each kernel is counted (Qwen3: QK-norm, tied head)."""
    model = tritonllm.patch(_model("qwen3_qknorm_yarn"))
    F = torch.nn.functional

    def forbidden(*args, **kwargs):
        raise AssertionError("torch math ran inside the patched model")

    for owner, name in ((F, "linear"), (F, "scaled_dot_product_attention"), (F, "silu"), (F, "cross_entropy"),
                        (torch, "rsqrt")):
        monkeypatch.setattr(owner, name, forbidden)
    idx, labels = _batch()
    _loss_and_grads(model, idx, labels)
    L = COMMON["num_hidden_layers"]
    assert kernel_calls == {"rms_norm": 4 * L + 1, "linear": 7 * L, "swiglu": L, "rope": 2 * L,
                            "flash_attention": L, "linear_cross_entropy": 1}


@pytest.mark.parametrize("off", ["attention", "rope", "mlp", "cross_entropy"])
def test_each_part_can_be_turned_off(off, kernel_calls):
    ref = _model("llama_llama3rope_untied")
    ours = tritonllm.patch(copy.deepcopy(ref), **{off: False})
    assert ours.config._attn_implementation == ("sdpa" if off == "attention" else "tritonllm")
    idx, labels = _batch(seed=1)
    with torch.no_grad():
        loss = ours(idx, labels=labels).loss
        ref64 = copy.deepcopy(ref).double()
        assert_close(f"loss without {off}", loss, ref64(idx, labels=labels).loss, ref(idx, labels=labels).loss)
    turned_off = {"attention": "flash_attention", "rope": "rope", "mlp": "swiglu", "cross_entropy": "linear_cross_entropy"}
    assert kernel_calls[turned_off[off]] == 0
    assert all(kernel_calls[k] > 0 for k in KERNELS if k != turned_off[off])


def test_trainer_loss_arguments():
    """``num_items_in_batch`` (sum over the batch's counted tokens / that number, as the Trainer passes
    under gradient accumulation) and ``shift_labels`` give transformers' own loss."""
    ref = _model("qwen2_bias_tied")
    ours = tritonllm.patch(copy.deepcopy(ref))
    idx, labels = _batch(seed=2)
    n = torch.tensor(37)
    shifted = torch.roll(labels, -1, dims=1)
    with torch.no_grad():
        for kwargs in ({"labels": labels, "num_items_in_batch": n}, {"labels": labels, "shift_labels": shifted}):
            assert_close(f"loss {sorted(kwargs)}", ours(idx, **kwargs).loss, copy.deepcopy(ref).double()(idx, **kwargs).loss,
                         ref(idx, **kwargs).loss)


def test_training_mode_skips_the_logits():
    model = tritonllm.patch(_model("llama_llama3rope_untied")).train()
    idx, labels = _batch(seed=3)
    with torch.no_grad():
        out = model(idx, labels=labels)
        assert out.logits is None and out.loss is not None
        assert model(idx).logits.shape == (2, T, VOCAB)


def test_generation_with_kv_cache_equal():
    """Greedy decoding with transformers' KV cache: RoPE offsets read from the position ids, the
    sliding window over the cached keys."""
    ref = _model("mistral_window")
    ours = tritonllm.patch(copy.deepcopy(ref))
    prompt = _batch(B=1, seed=4)[0][:, :6]
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))


@pytest.mark.parametrize("order", ["patch_then_peft", "peft_then_patch"])
def test_peft_lora(order):
    """PEFT's LoRA over the patched projections (its low-rank update in PyTorch): equal loss and
    adapter gradients, whichever comes first."""
    peft = pytest.importorskip("peft")
    ref = _model("qwen2_bias_tied")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj",
                             "o_proj", "gate_proj", "up_proj", "down_proj"])
    ref = peft.get_peft_model(ref, config)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # B away from its zero init, so the adapters change the output
    if order == "patch_then_peft":
        ours = peft.get_peft_model(tritonllm.patch(_model("qwen2_bias_tied")), config)
        ours.load_state_dict(ref.state_dict())
    else:
        ours = tritonllm.apply_tritonllm_kernels(copy.deepcopy(ref))
    ref64 = copy.deepcopy(ref).double()
    idx, labels = _batch(seed=5)
    loss, grads = _loss_and_grads(ours, idx, labels)
    loss64, grads64 = _loss_and_grads(ref64, idx, labels)
    loss32, grads32 = _loss_and_grads(ref, idx, labels)
    assert_close("peft loss", loss, loss64, loss32)
    assert grads and all("lora_" in n for n in grads)
    for name, g in grads.items():
        assert_close(f"peft d{name}", g, grads64[name], grads32[name])


# --- refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,overrides,field", [
    ("llama_llama3rope_untied", dict(attention_bias=True), "attention_bias"),
    ("llama_llama3rope_untied", dict(mlp_bias=True), "mlp_bias"),
    ("llama_llama3rope_untied", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    ("llama_llama3rope_untied", dict(attention_dropout=0.1), "attention_dropout"),
    ("llama_llama3rope_untied", dict(head_dim=16, num_attention_heads=4), "head_dim=16"),
    ("qwen2_bias_tied", dict(use_sliding_window=True, sliding_window=4), "use_sliding_window"),
], ids=["attention_bias", "mlp_bias", "rope_dynamic", "attention_dropout", "head_dim", "qwen_sliding_window"])
def test_unsupported_config_names_the_field(family, overrides, field):
    model = _model(family, **overrides)
    with pytest.raises(HFConfigError, match=field):
        tritonllm.patch(model)
    assert not hasattr(model, "tritonllm_patched")


def test_unsupported_architecture():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=2, n_positions=32)
    with pytest.raises(HFConfigError, match="model_type='gpt2'"):
        tritonllm.patch(transformers.GPT2LMHeadModel(cfg))


def test_not_a_model_and_patched_twice():
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel"):
        tritonllm.patch(torch.nn.Linear(4, 4))
    model = tritonllm.patch(_model("llama_llama3rope_untied"))
    with pytest.raises(ValueError, match="already patched"):
        tritonllm.patch(model)


def test_padding_mask_and_packed_positions_raise():
    model = tritonllm.patch(_model("llama_llama3rope_untied"))
    idx, _ = _batch(seed=6)
    mask = torch.ones_like(idx)
    with torch.no_grad():
        assert torch.equal(model(idx, attention_mask=mask).logits, model(idx).logits)  # all ones: causal
        mask[1, -3:] = 0
        with pytest.raises(ValueError, match="attention_mask has zeros"):
            model(idx, attention_mask=mask)
        packed = torch.cat([torch.arange(10), torch.arange(T - 10)]).expand(2, T).to(DEVICE)
        with pytest.raises(ValueError, match="position_ids"):
            model(idx, position_ids=packed)
        shifted = (torch.arange(T) + 3).expand(2, T).to(DEVICE)  # one offset for every row is fine
        ref = make_hf("llama_llama3rope_untied").to(DEVICE)
        assert_close("offset positions", model(idx, position_ids=shifted).logits,
                     copy.deepcopy(ref).double()(idx, position_ids=shifted).logits, ref(idx, position_ids=shifted).logits)


@pytest.mark.gpu
def test_bf16_autocast_and_bf16_weights_on_gpu():
    """bf16 weights, and fp32 weights under autocast: loss and gradients within bf16's rule."""
    ref = _model("qwen3_qknorm_yarn")
    ref64 = copy.deepcopy(ref).double()
    idx, labels = _batch(seed=7)
    loss64, grads64 = _loss_and_grads(ref64, idx, labels)
    bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    loss_t, grads_t = _loss_and_grads(bf16, idx, labels)
    loss, grads = _loss_and_grads(tritonllm.patch(copy.deepcopy(ref).to(torch.bfloat16)), idx, labels)
    assert_close("bf16 loss", loss, loss64, loss_t, dtype=torch.bfloat16)
    for name, g in grads.items():
        assert_close(f"bf16 d{name}", g, grads64[name], grads_t[name], dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_a, _ = _loss_and_grads(tritonllm.patch(copy.deepcopy(ref)), idx, labels)
        loss_at, _ = _loss_and_grads(copy.deepcopy(ref), idx, labels)
    assert_close("autocast loss", loss_a, loss64, loss_at, dtype=torch.bfloat16)
