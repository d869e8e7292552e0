"""tritonllm.patch on transformers' MoE families (Mixtral, Qwen3-MoE, OLMoE), fp32 tiny random models:
the patched model's logits, router logits, loss (with and without transformers' load-balancing loss)
and every parameter gradient against the unpatched model's."""

import copy

import pytest
import torch

from conftest import DEVICE
from test_hf import HF_ATOL
from test_hf_moe import FAMILIES, make_moe
from test_patch import _batch, _loss_and_grads

import tritonllm
import tritonllm.patch as patch_mod
from tritonllm.hf import HFConfigError


def _close(name, ours, ref, scale=1.0):
    """``ours`` within ``HF_ATOL * scale`` of ``ref`` (HF_ATOL: 1e-5 on the CPU)."""
    err = (ours - ref).abs().max().item()
    assert err <= HF_ATOL * scale, f"{name}: off by {err} (tolerance {HF_ATOL} * {scale})"


@pytest.fixture
def expert_calls(monkeypatch):
    """Calls of tritonllm.patch's moe_experts while the test runs."""
    calls = []

    def counted(*args):
        calls.append(args)
        return moe_experts(*args)

    moe_experts = patch_mod.moe_experts
    monkeypatch.setattr(patch_mod, "moe_experts", counted)
    return calls


@pytest.mark.parametrize("router_logits", [False, True], ids=["plain", "router_logits"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_loss_and_gradients_equal(family, router_logits, expert_calls):
    ref = make_moe(family).to(DEVICE)
    ours = tritonllm.patch(copy.deepcopy(ref))
    idx, labels = _batch()
    kwargs = dict(output_router_logits=router_logits)
    with torch.no_grad():
        out, want = ours.eval()(idx, **kwargs), ref.eval()(idx, **kwargs)
    _close(f"{family} logits", out.logits, want.logits)
    assert (out.router_logits is None) == (want.router_logits is None) == (not router_logits)
    if router_logits:
        for layer, (mine, theirs) in enumerate(zip(out.router_logits, want.router_logits, strict=True)):
            _close(f"{family} router logits {layer}", mine, theirs)
        _close(f"{family} aux loss", out.aux_loss, want.aux_loss)
    assert len(expert_calls) == ref.config.num_hidden_layers
    loss, grads = _loss_and_grads(ours, idx, labels, **kwargs)
    loss_ref, grads_ref = _loss_and_grads(ref, idx, labels, **kwargs)
    _close(f"{family} loss", loss, loss_ref)
    assert set(grads) == set(grads_ref)
    for name, g in grads.items():
        _close(f"{family} d{name}", g, grads_ref[name], scale=grads_ref[name].abs().max().item())


def test_the_moe_kernels_run_not_torch_math(monkeypatch, expert_calls):
    """The router GEMM and the experts' GEMMs do not go through torch (OLMoE: all-heads QK-norm)."""
    model = tritonllm.patch(make_moe("olmoe_qknorm_all_raw").to(DEVICE))

    def forbidden(*args, **kwargs):
        raise AssertionError("torch math ran inside the patched model")

    for owner, name in ((torch.nn.functional, "linear"), (torch.nn.functional, "silu"), (torch, "topk")):
        monkeypatch.setattr(owner, name, forbidden)
    _loss_and_grads(model, *_batch())
    assert len(expert_calls) == model.config.num_hidden_layers
    w13, w2 = expert_calls[0][3:]
    assert w13 is model.model.layers[0].mlp.experts.gate_up_proj and w2 is model.model.layers[0].mlp.experts.down_proj


def test_moe_can_be_turned_off(expert_calls):
    ref = make_moe("qwen3moe_qknorm_renorm").to(DEVICE)
    ours = tritonllm.patch(copy.deepcopy(ref), moe=False)
    idx, labels = _batch(seed=1)
    with torch.no_grad():
        _close("loss without moe", ours(idx, labels=labels).loss, ref(idx, labels=labels).loss)
    assert expert_calls == []


def test_transposed_experts_are_refused():
    model = make_moe("mixtral_window_untied")
    model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.raises(HFConfigError, match="is_transposed"):
        tritonllm.patch(model)
    with pytest.raises(HFConfigError, match="clip_qkv"):
        tritonllm.patch(make_moe("olmoe_qknorm_all_raw", clip_qkv=8.0))
