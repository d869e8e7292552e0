"""The speedrun architecture options of ModelConfig: ``mlp_act: relu2`` (kernels/relu2.py) and
per-layer ``window_schedule``; the relu2 kernel and the model's loss and every gradient against the
float64 plain-PyTorch reference extended with the same options."""

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, check_unary_op, dtype_id, gemm_atol, randn
from reference_model import ReferenceTransformer
from tritonllm.bench import reference_ops as ref
from tritonllm.kernels import relu2
from tritonllm.models import build_model
from tritonllm.models.config import ModelConfig, ModelConfigError

TINY = dict(vocab_size=61, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=40, max_seq_len=24)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1,), (5, 17), (3, 1000)], ids=lambda s: "x".join(map(str, s)))
def test_relu2_forward_backward(shape, dtype, poisoned_empty):
    x = randn(*shape, dtype=dtype)
    x.view(-1)[0] = 0.0  # the kink: gradient 0
    check_unary_op(relu2, ref.relu2, x, randn(*shape, dtype=dtype))


def test_relu2_bad_inputs():
    with pytest.raises(ValueError, match="x"):
        relu2(randn(4, 6).t())
    with pytest.raises(TypeError, match="x"):
        relu2(torch.ones(3, dtype=torch.int64, device=DEVICE))
    assert relu2(randn(0, 5)).shape == (0, 5)


@pytest.mark.parametrize("options", [dict(mlp_act="relu2", window_schedule=[3, None]),
                                     dict(window_schedule=[None, 2], qk_norm=True, tie_embeddings=False),
                                     dict(logit_softcap=2.0, z_loss_coef=1e-2),
                                     dict(n_layers=3, value_embeddings=1, unet_skips=True),
                                     dict(n_layers=4, value_embeddings=2, value_embedding_layers=[1, None, 0, 1],
                                          unet_skips=True, qk_norm=True, mlp_act="relu2", logit_softcap=3.0)],
                         ids=["relu2-short-long", "swiglu-long-short", "softcap", "ve1-unet-3layers",
                              "ve2-placed-unet-qknorm-relu2-softcap"])
def test_model_matches_reference(options):
    """Loss and every parameter gradient, by name, against the float64 reference with the same options
    (TF32 tolerance on the GPU: the fp32 model's GEMMs run TF32 there, cuBLAS's tiny ones do not)."""
    cfg = ModelConfig(name="tiny", **{**TINY, **options})
    ours = build_model(cfg, device=DEVICE)
    with torch.no_grad():  # learned mixing weights and gates away from their init
        for name, p in ours.named_parameters():
            if "value_mix" in name or "skip_gates" in name:
                p.copy_(torch.rand_like(p) + 0.25)
    assert [b.attn.window for b in ours.blocks] == [cfg.layer_window(i) for i in range(cfg.n_layers)]
    assert ours.num_params() == cfg.param_count()
    refs = []
    for dtype in (torch.float64, torch.float32):
        ref = ReferenceTransformer(cfg).to(device=DEVICE, dtype=dtype)
        ref.load_state_dict(ours.state_dict())
        refs.append(ref)
    idx = torch.randint(0, cfg.vocab_size, (2, 11), device=DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (2, 11), device=DEVICE)
    losses = [m(idx, targets) for m in (ours, *refs)]
    atol = gemm_atol(torch.float32)
    assert_close("loss", losses[0], losses[1], same=losses[2], atol=atol)
    for t in losses:
        t.backward()
    g64, g32 = (dict(r.named_parameters()) for r in refs)
    for name, p in ours.named_parameters():
        assert_close(f"grad {name}", p.grad, g64[name].grad, same=g32[name].grad, atol=atol)


def test_softcap_inference_logits_match_reference():
    """The inference path (forward without targets, a cached prefill and one decode step) caps the logits
    (TF32 tolerance for the fp32 model's GEMMs on the GPU)."""
    from tritonllm.models.transformer import KVCache

    cfg = ModelConfig(name="tiny", **TINY, logit_softcap=1.5)
    ours = build_model(cfg, device=DEVICE)
    ref = ReferenceTransformer(cfg).to(device=DEVICE, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 7), device=DEVICE)
    with torch.no_grad():
        want = ref(idx)
        assert want.abs().max() < 1.5
        atol = gemm_atol(torch.float32) or 1e-5
        assert_close("logits", ours(idx), want, atol=atol)
        cache = KVCache(cfg, 2, 7, device=DEVICE, dtype=torch.float32)
        ours(idx[:, :6], cache=cache)
        assert_close("decode logits", ours.decode_step(idx[:, 6:].contiguous(), cache), want[:, 6], atol=atol)


@pytest.mark.parametrize("options", [dict(value_embeddings=1, unet_skips=True, n_layers=2),
                                     dict(value_embeddings=1, value_embedding_layers=[None, 0, 0], unet_skips=True,
                                          n_layers=3, qk_norm=True)],
                         ids=["ve-ends-unet", "ve-placed-unet-qknorm"])
def test_value_embeddings_and_unet_in_cached_decoding(options):
    """The KV-cache prefill and the decode step mix the value embeddings and take the U-net skips as
    the full forward does. On the GPU both paths' fp32 GEMMs run TF32: an activation a rounding
    apart on the two paths can truncate to neighbouring TF32 values, so they agree to TF32, not fp32."""
    from tritonllm.models.transformer import KVCache

    cfg = ModelConfig(name="tiny", **{**TINY, **options})
    model = build_model(cfg, device=DEVICE)
    idx = torch.randint(0, cfg.vocab_size, (2, 7), device=DEVICE)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(cfg, 2, 7, device=DEVICE, dtype=torch.float32)
        prefill = model(idx[:, :5], cache=cache)
        steps = [model.decode_step(idx[:, t:t + 1].contiguous(), cache) for t in (5, 6)]
    atol = gemm_atol(torch.float32) or 1e-5
    assert_close("prefill logits", prefill, full[:, :5].double(), atol=atol)
    assert_close("decode logits", torch.stack(steps, 1), full[:, 5:].double(), atol=atol)


def test_value_embedding_placement_and_counts():
    cfg = ModelConfig(**{**TINY, "n_layers": 7}, value_embeddings=3)
    assert [cfg.layer_value_embedding(i) for i in range(7)] == [0, 1, 2, None, 0, 1, 2]
    model = build_model(ModelConfig(**{**TINY, "n_layers": 5}, value_embeddings=2, unet_skips=True), device=DEVICE)
    assert model.num_params() == model.cfg.param_count()
    tables = 2 * TINY["vocab_size"] * TINY["n_kv_heads"] * TINY["head_dim"]
    assert model.num_params(exclude_embedding=True) == model.cfg.param_count(exclude_embedding=True)
    assert model.num_params() - model.num_params(exclude_embedding=True) == tables + TINY["vocab_size"] * 48
    assert len(model.skip_gates) == 2 and sum(b.attn.value_mix is not None for b in model.blocks) == 4
    plain = build_model(ModelConfig(**TINY), device=DEVICE)
    assert not any("value" in n or "skip" in n for n, _ in plain.named_parameters())


def test_window_schedule_cycles_and_defaults_unchanged():
    cfg = ModelConfig(**{**TINY, "n_layers": 5}, window_schedule=[8, 8, None])
    assert [cfg.layer_window(i) for i in range(5)] == [8, 8, None, 8, 8]
    plain = ModelConfig(**TINY, window=4)
    assert plain.mlp_act == "swiglu" and plain.window_schedule is None
    assert [plain.layer_window(i) for i in range(2)] == [4, 4]


@pytest.mark.parametrize("bad, field", [
    (dict(window=4, window_schedule=[2]), "window_schedule"),
    (dict(window_schedule=[]), "window_schedule"),
    (dict(window_schedule=[0, None]), "window_schedule"),
    (dict(window_schedule=[True]), "window_schedule"),
    (dict(mlp_act="gelu"), "mlp_act"),
    (dict(logit_softcap=0.0), "logit_softcap"),
    (dict(value_embeddings=-1), "value_embeddings"),
    (dict(value_embeddings=2), "value_embeddings"),  # 2 tables at both ends need 4 layers
    (dict(value_embedding_layers=[0, None]), "value_embedding_layers"),  # no tables
    (dict(value_embeddings=1, value_embedding_layers=[0]), "value_embedding_layers"),
    (dict(value_embeddings=1, value_embedding_layers=[0, 1]), "value_embedding_layers"),
    (dict(value_embeddings=2, value_embedding_layers=[0, 0]), "value_embedding_layers"),  # table 1 unused
    (dict(logit_softcap=-3), "logit_softcap"),
    (dict(mlp_act="relu2", n_experts=4), "mlp_act"),
])
def test_bad_options_name_the_field(bad, field):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig(**{**TINY, **bad})
