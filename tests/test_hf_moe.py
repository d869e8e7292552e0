"""Hugging Face MoE import/export (tritonllm.hf: Mixtral, Qwen3-MoE, OLMoE) against transformers' own tiny
random models, fp32: logits, LM loss, gradients, the load-balancing loss and the export round trip."""

import pytest
import torch

from _checks import DEVICE

import transformers  # a test dependency (pyproject [test])

from tritonllm.hf import HFConfigError, config_from_hf, hf_config_from, load_hf_model, read_hf_config, save_hf_model
from tritonllm.models import ModelConfig, build_model

from test_hf import HF_ATOL, VOCAB, _ids, assert_logits, check_export_round_trip, hf_folder_fixture, make_hf

MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)
#: family -> (config class, model class, extra config): Mixtral always renormalises the top-k
#: weights, Qwen3-MoE and OLMoE when norm_topk_prob; OLMoE's QK-norm spans all heads
FAMILIES = {
    "mixtral_window_untied": ("MixtralConfig", "MixtralForCausalLM", dict(
        MOE, num_local_experts=4, sliding_window=6, tie_word_embeddings=False)),
    "qwen3moe_qknorm_renorm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        MOE, num_experts=4, moe_intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=True)),
    "olmoe_qknorm_all_raw": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        MOE, num_experts=4, norm_topk_prob=False, tie_word_embeddings=False)),
}


def make_moe(family: str, **overrides):
    """:func:`test_hf.make_hf` of a MoE family, with router weights spread wide enough that no
    token's top-k choice is a near tie (which rounding could decide either way)."""
    model = make_hf(family, FAMILIES, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.3)
    return model


hf_folder = hf_folder_fixture(FAMILIES, make_moe)


def _targets(idx):
    """The next tokens of ``idx`` on the test device, the last position ignored (-100): our loss over
    the same tokens, and routing the same tokens, as transformers' with ``labels=idx``."""
    return torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], 1).to(DEVICE)


def test_config_mapping(hf_folder):
    family, hf, path = hf_folder
    cfg = config_from_hf(read_hf_config(path))
    k, n_layers = hf.config.num_experts_per_tok, hf.config.num_hidden_layers
    assert (cfg.n_experts, cfg.moe_top_k, cfg.moe_score, cfg.n_shared_experts) == (4, k, "softmax", 0)
    assert cfg.d_expert == (48 if family.startswith("qwen3") else 80)
    assert cfg.moe_normalize == (family.startswith("mixtral") or hf.config.norm_topk_prob)
    assert cfg.qk_norm == (not family.startswith("mixtral"))
    assert cfg.qk_norm_span == ("all" if family.startswith("olmoe") else "head")
    assert cfg.window == (6 if family.startswith("mixtral") else None)
    assert cfg.moe_aux_loss_coef == pytest.approx(0.02 * k / n_layers)


def test_import_logits_loss_and_grads_equal(hf_folder):
    """Logits; the LM loss and the gradients of the embedding, routers, experts, output projections and
    QK-norms, relative to each gradient's largest entry (the load-balancing loss off on both sides:
    transformers adds it only with output_router_logits)."""
    family, hf, path = hf_folder
    model = load_hf_model(path, device=DEVICE)
    for block in model.blocks:
        block.mlp.aux_loss_coef = 0.0
    idx = _ids()
    with torch.no_grad():
        assert_logits(family, model(idx.to(DEVICE)), hf(idx).logits)
    hf.zero_grad()
    ref = hf(idx, labels=idx).loss
    ref.backward()
    loss = model(idx.to(DEVICE), targets=_targets(idx))
    loss.backward()
    assert abs(loss.item() - ref.item()) <= HF_ATOL * max(1.0, ref.item())
    pairs = [(model.embed.weight, hf.model.embed_tokens.weight)]
    for block, layer in zip(model.blocks, hf.model.layers):
        pairs += [(block.mlp.router.weight, layer.mlp.gate.weight), (block.mlp.w13, layer.mlp.experts.gate_up_proj),
                  (block.mlp.w2, layer.mlp.experts.down_proj), (block.attn.proj.weight, layer.self_attn.o_proj.weight)]
        if model.cfg.qk_norm:
            pairs += [(block.attn.q_norm.weight, layer.self_attn.q_norm.weight)]
    for ours, theirs in pairs:
        assert ours.grad.shape == theirs.grad.shape
        err, scale = (ours.grad.cpu() - theirs.grad).abs().max().item(), theirs.grad.abs().max().item()
        assert err <= HF_ATOL * scale, f"{family}: gradient of {tuple(ours.shape)} off by {err} (max {scale})"


def test_aux_loss_matches_transformers(hf_folder):
    """Per layer, transformers' load_balancing_loss_func of that layer's router logits is k times our
    unscaled aux loss (it counts f_i per token, we per assignment); a one-layer model's whole training
    loss (LM + the scaled aux loss) equals transformers' with output_router_logits."""
    family, hf, path = hf_folder
    modeling = __import__(type(hf).__module__, fromlist=["load_balancing_loss_func"])
    model = load_hf_model(path, device=DEVICE)
    idx = _ids(seed=1)
    k, E = hf.config.num_experts_per_tok, model.cfg.n_experts
    with torch.no_grad():
        router_logits = hf(idx, output_router_logits=True).router_logits
        _, moe = model._hidden(idx.to(DEVICE))
    assert len(router_logits) == len(moe) == hf.config.num_hidden_layers
    for logits, out in zip(router_logits, moe):
        ref = modeling.load_balancing_loss_func((logits,), E, k)
        assert abs(k * out.stats["moe_aux"].item() - ref.item()) <= 1e-5 * ref.item()

    one = make_moe(family, num_hidden_layers=1)
    one.save_pretrained(f"{path}-1layer")
    model = load_hf_model(f"{path}-1layer", device=DEVICE)
    with torch.no_grad():
        ref = one(idx, labels=idx, output_router_logits=True)
        ours = model(idx.to(DEVICE), targets=_targets(idx))
    assert ref.aux_loss.item() > 1.0
    assert abs(ours.item() - ref.loss.item()) <= HF_ATOL * ref.loss.item()


def test_export_round_trip(hf_folder, tmp_path):
    hf = hf_folder[1]
    back = check_export_round_trip(hf_folder, tmp_path)
    for field in ("num_experts_per_tok", "router_aux_loss_coef", "norm_topk_prob", "sliding_window"):
        assert getattr(back.config, field, None) == pytest.approx(getattr(hf.config, field, None)), field


@pytest.mark.parametrize("qk_norm,span,normalize,architecture", [
    (False, "head", True, "MixtralForCausalLM"), (True, "head", False, "Qwen3MoeForCausalLM"),
    (True, "all", False, "OlmoeForCausalLM")])
def test_export_native_moe_model(tmp_path, qk_norm, span, normalize, architecture):
    """A tritonllm MoE model (not from a Hugging Face folder) exports to the family with its features."""
    cfg = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=80, max_seq_len=64,
                      n_experts=4, moe_top_k=2, d_expert=48, moe_normalize=normalize, qk_norm=qk_norm,
                      qk_norm_span=span, tie_embeddings=False)
    torch.manual_seed(3)
    model = build_model(cfg, device=DEVICE)
    save_hf_model(model, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(back).__name__ == architecture
    idx = _ids(seed=3)
    with torch.no_grad():
        assert_logits(architecture, model(idx.to(DEVICE)), back(idx).logits)


QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=48)


def test_hub_style_qwen3_moe_config():
    """Qwen3-MoE's config.json on the Hub names the experts num_experts; norm_topk_prob defaults to false."""
    cfg = config_from_hf(QWEN3_MOE)
    assert (cfg.n_experts, cfg.d_expert, cfg.d_ff, cfg.moe_normalize, cfg.qk_norm) == (4, 48, 80, False, True)
    assert cfg.moe_aux_loss_coef == pytest.approx(0.001 * 2 / 2)


@pytest.mark.parametrize("change,field", [
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(num_experts=0), "num_experts"),
    (dict(model_type="mixtral", router_jitter_noise=0.1), "router_jitter_noise"),
    (dict(model_type="olmoe", clip_qkv=8.0), "clip_qkv"),
    (dict(model_type="deepseek_v3"), "model_type"),
], ids=["sparse_step", "mlp_only_layers", "no_experts", "jitter", "olmoe_clip", "deepseek"])
def test_unsupported_moe_config_names_field(change, field):
    with pytest.raises(HFConfigError, match=field):
        config_from_hf({**QWEN3_MOE, **change})


@pytest.mark.parametrize("change,architecture,field", [
    (dict(n_shared_experts=1), None, "n_shared_experts"),
    (dict(moe_score="sigmoid"), None, "moe_score"),
    (dict(moe_normalize=False), "mixtral", "moe_normalize"),
    (dict(), "qwen3_moe", "qk_norm"),
    (dict(), "llama", "n_experts"),
    (dict(qk_norm=True, qk_norm_span="all"), "qwen3_moe", "qk_norm_span"),
    (dict(n_experts=0, qk_norm=True, qk_norm_span="all"), None, "qk_norm_span"),
], ids=["shared", "sigmoid", "mixtral_raw", "qwen3moe_no_qknorm", "dense_arch", "qwen3moe_span_all", "dense_span_all"])
def test_unexportable_moe_config_names_field(change, architecture, field):
    cfg = ModelConfig(**{**dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=2, d_ff=80, n_experts=4), **change})
    with pytest.raises(HFConfigError, match=field):
        hf_config_from(cfg, architecture)


def _peft_expert_factors(wrapper, E: int, grads: bool = False):
    """(A [E, r, n_in], B [E, n_out, r]) of tritonllm's expert adapters (or, ``grads``, their gradients) from
    a PEFT ParamWrapper's A [r E, in] and B [out, r E] (its ``get_delta_weight``: ``einsum("o r e, e r i")``,
    into ``e o i`` when PEFT swapped the parameter's in/out dims, else ``e i o``); tritonllm's ``delta_e =
    B_e A_e`` in the parameter's layout."""
    a, b = (wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight)
    a, b = (a.grad, b.grad) if grads else (a, b)
    a = a.reshape(E, -1, a.shape[-1])  # e r i
    b = b.reshape(b.shape[0], -1, E).permute(2, 0, 1)  # e o r
    if wrapper._did_swap_in_out_features:
        return a, b
    return b.transpose(1, 2), a.transpose(1, 2)


def test_expert_lora_matches_peft(hf_folder):
    """LoRA on the routed experts (and on q) against PEFT's ``target_parameters`` on ``gate_up_proj`` and
    ``down_proj`` with the same adapters: the delta weights, the loss and the gradients of every adapter."""
    import peft

    from tritonllm.nn.lora import LoRAConfig, LoRAMoE, apply_lora

    family, _, path = hf_folder
    r, alpha = 4, 8.0
    model = apply_lora(load_hf_model(path, device=DEVICE), LoRAConfig(rank=r, alpha=alpha, targets=["q", "experts"]))
    for block in model.blocks:
        block.mlp.aux_loss_coef = 0.0
    torch.manual_seed(3)
    pm = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path), peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    E = model.cfg.n_experts
    pairs = []  # (ours, PEFT's, how a gradient of PEFT's maps onto ours)
    for block, layer in zip(model.blocks, pm.base_model.model.model.layers):
        moe = block.mlp
        assert isinstance(moe, LoRAMoE)
        wrappers = {m.parameter_name: m for m in layer.mlp.modules() if isinstance(m, peft.tuners.lora.ParamWrapper)}
        for pname, (a, b) in (("gate_up_proj", (moe.lora_A13, moe.lora_B13)), ("down_proj", (moe.lora_A2, moe.lora_B2))):
            w = wrappers[pname]
            pa, pb = _peft_expert_factors(w, E)
            with torch.no_grad():
                a.copy_(pa.to(DEVICE))
                b.copy_(pb.to(DEVICE))
                delta = w.get_delta_weight("default")
                ours = (b.double() @ a.double()) * alpha / r
                assert torch.allclose(ours.cpu(), delta.double(), atol=1e-5), f"{family}: {pname} delta"
            pairs.append((a, b, w))
        qkv, q = block.attn.qkv, layer.self_attn.q_proj
        with torch.no_grad():
            qkv.lora_A[0].copy_(q.lora_A["default"].weight.to(DEVICE))
            qkv.lora_B[:q.out_features].copy_(q.lora_B["default"].weight.to(DEVICE))
    idx = _ids()
    ref = pm(idx, labels=idx).loss
    ref.backward()
    loss = model(idx.to(DEVICE), targets=_targets(idx))
    loss.backward()
    assert abs(loss.item() - ref.item()) <= HF_ATOL * max(1.0, ref.item()), family
    for a, b, w in pairs:
        ga, gb = _peft_expert_factors(w, E, grads=True)
        for ours, theirs in ((a.grad, ga), (b.grad, gb)):
            err, scale = (ours.cpu() - theirs).abs().max().item(), theirs.abs().max().item()
            assert err <= HF_ATOL * scale, f"{family}: {w.parameter_name} adapter gradient off by {err} (max {scale})"
