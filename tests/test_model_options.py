"""The speedrun architecture options of ModelConfig: ``mlp_act: relu2`` (kernels/relu2.py) and
per-layer ``window_schedule``; the relu2 kernel and the model's loss and every gradient against the
float64 plain-PyTorch reference extended with the same options."""

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, dtype_id, randn
from reference_model import ReferenceTransformer
from tritonllm.kernels import relu2
from tritonllm.models import build_model
from tritonllm.models.config import ModelConfig, ModelConfigError

TINY = dict(vocab_size=61, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=40, max_seq_len=24)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1,), (5, 17), (3, 1000)], ids=lambda s: "x".join(map(str, s)))
def test_relu2_forward_backward(shape, dtype, poisoned_empty):
    x = randn(*shape, dtype=dtype)
    x.view(-1)[0] = 0.0  # the kink: gradient 0
    x = x.requires_grad_(True)
    dy = randn(*shape, dtype=dtype)
    y = relu2(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_(True)
    y64 = torch.relu(x64).square()
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    xs = x.detach().clone().requires_grad_(True)
    ys = torch.relu(xs).square()
    (dxs,) = torch.autograd.grad(ys, xs, dy)
    assert_close("y", y, y64, ys)
    assert_close("dx", dx, dx64, dxs)


def test_relu2_bad_inputs():
    with pytest.raises(ValueError, match="x"):
        relu2(randn(4, 6).t())
    with pytest.raises(TypeError, match="x"):
        relu2(torch.ones(3, dtype=torch.int64, device=DEVICE))
    assert relu2(randn(0, 5)).shape == (0, 5)


@pytest.mark.parametrize("options", [dict(mlp_act="relu2", window_schedule=[3, None]),
                                     dict(window_schedule=[None, 2], qk_norm=True, tie_embeddings=False),
                                     dict(logit_softcap=2.0, z_loss_coef=1e-2)],
                         ids=["relu2-short-long", "swiglu-long-short", "softcap"])
def test_model_matches_reference(options):
    """Loss and every parameter gradient, by name, against the float64 reference with the same options."""
    cfg = ModelConfig(name="tiny", **{**TINY, **options})
    ours = build_model(cfg, device=DEVICE)
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
    assert_close("loss", losses[0], losses[1], same=losses[2])
    for t in losses:
        t.backward()
    g64, g32 = (dict(r.named_parameters()) for r in refs)
    for name, p in ours.named_parameters():
        assert_close(f"grad {name}", p.grad, g64[name].grad, same=g32[name].grad)


def test_softcap_inference_logits_match_reference():
    """The inference path (forward without targets, a cached prefill and one decode step) caps the logits."""
    from tritonllm.models.transformer import KVCache

    cfg = ModelConfig(name="tiny", **TINY, logit_softcap=1.5)
    ours = build_model(cfg, device=DEVICE)
    ref = ReferenceTransformer(cfg).to(device=DEVICE, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 7), device=DEVICE)
    with torch.no_grad():
        want = ref(idx)
        assert want.abs().max() < 1.5
        assert_close("logits", ours(idx), want, atol=1e-5)
        cache = KVCache(cfg, 2, 7, device=DEVICE, dtype=torch.float32)
        ours(idx[:, :6], cache=cache)
        assert_close("decode logits", ours.decode_step(idx[:, 6:].contiguous(), cache), want[:, 6], atol=1e-5)


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
    (dict(logit_softcap=-3), "logit_softcap"),
    (dict(mlp_act="relu2", n_experts=4), "mlp_act"),
])
def test_bad_options_name_the_field(bad, field):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig(**{**TINY, **bad})
