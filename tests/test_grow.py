"""Function-preserving growth (tritonllm.evolve.grow), tiny float32 models (grown on the CPU, run on
the test device): each growth op
gives the parent's logits, the grown model learns in its new parameters (the zero output side gets
a gradient at the first step, the random input side once the output side has moved), and what is
not a growth is refused with the field named."""

import pytest
import torch
import torch.nn.functional as F

from _checks import DEVICE, ON_GPU, gemm_atol
from tritonllm.evolve.grow import GrowthError, grow, growth_steps
from tritonllm.models import build_model
from tritonllm.models.config import ModelConfig

BASE = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128, max_seq_len=64)

#: id -> (parent fields, child fields, {parameter: (index of its new entries, the axis summed over so
#: that one value per new unit (row or column) is left, the step at which each unit first gets a gradient)})
CASES = {
    "layers": ({}, dict(n_layers=4), {"blocks.1.attn.proj.weight": ((slice(None),), 0, 1),
                                      "blocks.1.mlp.w2.weight": ((slice(None),), 0, 1),
                                      "blocks.1.attn.qkv.weight": ((slice(None),), 1, 2),
                                      "blocks.3.mlp.w13.weight": ((slice(None),), 1, 2)}),
    "d_ff": ({}, dict(d_ff=192), {"blocks.0.mlp.w2.weight": ((slice(None), slice(128, None)), 0, 1),
                                  "blocks.1.mlp.w13.weight": ((slice(128, 192),), 1, 2)}),
    "heads": ({}, dict(n_heads=4, n_kv_heads=2), {"blocks.0.attn.proj.weight": ((slice(None), slice(64, None)), 0, 1),
                                                  "blocks.1.attn.qkv.weight": ((slice(64, 128),), 1, 2)}),
    "kv_split": (dict(n_heads=4, n_kv_heads=1), dict(n_kv_heads=4), {}),
    "d_model": ({}, dict(d_model=128), {"embed.weight": ((slice(None), slice(64, None)), 0, 1),
                                        "blocks.0.attn.proj.weight": ((slice(64, None),), 1, 1),
                                        "blocks.0.mlp.w2.weight": ((slice(64, None),), 1, 1),
                                        # the last block's new rows feed only the final norm and the tied LM
                                        # head, whose new columns (the embedding's) are zero until step 1 moves them
                                        "blocks.1.mlp.w2.weight": ((slice(64, None),), 1, 2),
                                        "blocks.0.attn.qkv.weight": ((slice(None), slice(64, None)), 0, 2)}),
    "all_untied_qknorm_bias": (dict(tie_embeddings=False, qk_norm=True, qkv_bias=True),
                               dict(d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, n_layers=3), {}),
    "moe": (dict(n_experts=4, moe_top_k=2, d_expert=32, n_shared_experts=1), dict(d_model=128, d_expert=64, n_layers=3),
            {"blocks.0.mlp.shared_w2.weight": ((slice(None), slice(32, None)), 0, 1)}),
    "relu2": (dict(mlp_act="relu2"), dict(d_model=128, d_ff=256, n_layers=3),
              {"blocks.0.mlp.w2.weight": ((slice(None), slice(128, None)), 0, 1)}),
    "value_embeddings_unet": (dict(n_layers=4, value_embeddings=1, unet_skips=True, logit_softcap=15.0),
                              dict(d_model=128, n_heads=4, n_kv_heads=2), {}),
}


def _parent(fields):
    """A parent model with every parameter moved off its init (norm weights not ones, output projections large)."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**BASE, **fields})
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() < 2 else 0.05))
    return cfg, model


def _grown(name):
    """(parent, child) on DEVICE: built, perturbed and grown on the CPU (the same values on every
    device), then moved."""
    parent_fields, child_fields, _ = CASES[name]
    cfg, parent = _parent(parent_fields)
    child_cfg = ModelConfig(**{**cfg.to_dict(), **child_fields})
    child = build_model(child_cfg)
    child.load_state_dict(grow(parent.state_dict(), cfg, child_cfg, seed=1), strict=True)
    return parent.to(DEVICE), child.to(DEVICE)


#: the child's logits against the parent's, relative to their largest (> 1 here): 1e-5 on the CPU. On a
#: GPU both run TF32 GEMMs whose operands the growth changes (d_model scales weights by sqrt(d'/d): they
#: truncate to other values; other shapes may take other tiles): the slack of a whole model's chained products
GROWTH_RTOL = gemm_atol(torch.float32, chain=4) or 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_growth_preserves_the_logits(name):
    parent, child = _grown(name)
    idx = torch.randint(0, BASE["vocab_size"], (2, 17))
    targets = torch.randint(0, BASE["vocab_size"], (2, 17))
    with torch.no_grad():
        ref, out = parent(idx.to(DEVICE)).double().cpu(), child(idx.to(DEVICE)).double().cpu()
        err = (out - ref).abs().max().item()
        assert err <= GROWTH_RTOL * ref.abs().max().item()
    loss, ref_loss = (F.cross_entropy(x.flatten(0, 1), targets.flatten()) for x in (out, ref))
    # the parent's loss before training: rel 1e-6 on the CPU; on a GPU the logits differ by up to err, and a
    # mean cross-entropy moves by at most 2 * max|logit change| (its gradient, softmax - one-hot, has L1 norm <= 2)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6, abs=2 * err if ON_GPU else 0)
    assert child.num_params() > parent.num_params()


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[2]])
def test_grown_model_learns_in_its_new_parameters(name):
    """One backward: the zero-initialised output side of the new units gets a gradient (every new
    row / column); after an SGD step on all parameters, the random input side does too."""
    _, child = _grown(name)
    params = dict(child.named_parameters())
    idx = torch.randint(0, BASE["vocab_size"], (2, 17)).to(DEVICE)
    targets = torch.randint(0, BASE["vocab_size"], (2, 17)).to(DEVICE)
    for step in (1, 2):
        child.zero_grad(set_to_none=True)
        child(idx, targets).backward()
        for pname, (index, axis, first) in CASES[name][2].items():
            grad = params[pname].grad[index]
            per_unit = grad.abs().sum(dim=axis)  # one value per new row (axis 1) or column (axis 0)
            if step == first:
                assert (per_unit > 0).all(), f"{pname}{index}: no gradient at step {step}"
            elif step < first:  # zero output side: the input side waits one step, as documented
                assert (per_unit == 0).all(), f"{pname}{index}: gradient before the output side moved"
        with torch.no_grad():
            for p in child.parameters():
                p -= 0.5 * p.grad


@pytest.mark.parametrize("parent, child, match", [
    ({}, dict(head_dim=64), r"head_dim 32 -> 64 is not a function-preserving growth"),
    ({}, dict(qk_norm=True), r"qk_norm False -> True"),
    ({}, dict(window=16), r"window None -> 16"),
    ({}, dict(d_ff=64), r"d_ff 128 -> 64 shrinks the model"),
    ({}, dict(n_layers=1), r"n_layers 2 -> 1 shrinks the model"),
    (dict(n_heads=4, n_kv_heads=4), dict(n_kv_heads=2), r"KV heads can be split, not merged"),
    (dict(unet_skips=True), dict(n_layers=4), r"with unet_skips=True: the layers depend on their index"),
    (dict(n_experts=4, moe_top_k=2), dict(n_experts=8), r"n_experts 4 -> 8"),
    (dict(qk_norm=True, qk_norm_span="all"), dict(n_heads=4), r"qk_norm_span='all'"),
])
def test_what_is_not_a_growth_is_refused(parent, child, match):
    cfg = ModelConfig(**{**BASE, **parent})
    with pytest.raises(GrowthError, match=match):
        growth_steps(cfg, ModelConfig(**{**cfg.to_dict(), **child}))


def test_growth_steps_and_ignored_fields():
    cfg = ModelConfig(**BASE)
    assert growth_steps(cfg, ModelConfig(**{**BASE, "name": "other"})) == []
    assert growth_steps(cfg, ModelConfig(**{**BASE, "n_layers": 3, "d_expert": 7})) == ["n_layers 2 -> 3"]  # dense: d_expert unused
    moe = ModelConfig(**{**BASE, "n_experts": 4, "d_expert": 32})
    assert growth_steps(moe, ModelConfig(**{**moe.to_dict(), "d_ff": 64, "d_expert": 64})) == ["d_expert 32 -> 64"]
