"""tritonllm.nn modules built from plain arguments: output and every gradient (input and each
parameter, by name) against float64 references composed from tritonllm.bench.reference_ops; the KV
cache (prefill, then a decode step) against the full forward; a model of the modules under
torch.compile(fullgraph=True); extra_repr; bad arguments."""

import pytest
import torch

from _checks import DEVICE, ON_GPU, assert_close, gemm_atol, randn
from tritonllm.bench import reference_ops as ref
from tritonllm.kernels import rope_cos_sin
from tritonllm.nn import MLP, Attention, Embedding, KVCache, Linear, LinearSwiGLU, LMHeadLoss, MoE, MoEOutput, RMSNorm


def check_module(module, ref_fn, inputs: dict, chain: int = 1):
    """``module(**inputs)`` and the gradients of the floating inputs and of every parameter vs
    ``ref_fn(inputs, params)`` in float64 and in float32 (the yardstick)."""
    out = module(**inputs)
    dy = randn(*out.shape)
    params = dict(module.named_parameters())
    wrt = {k: t for k, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad} | params
    got = dict(zip(wrt, torch.autograd.grad(out, list(wrt.values()), dy)))
    refs = {}
    for dtype in (torch.float64, torch.float32):
        cast = {k: t.detach().to(dtype).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                and t.is_floating_point() else t for k, t in inputs.items()}
        p = {k: t.detach().to(dtype).requires_grad_() for k, t in params.items()}
        y = ref_fn(cast, p)
        leaves = {k: t for k, t in cast.items() if k in wrt} | p
        refs[dtype] = y, dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy.to(dtype))))
    (y64, g64), (y32, g32) = refs[torch.float64], refs[torch.float32]
    atol = gemm_atol(torch.float32, chain)
    assert_close("out", out, y64, y32, atol=atol)
    for name, g in got.items():
        assert_close(f"d{name}", g, g64[name], g32[name], atol=atol)


def attention_reference(m: Attention, cos, sin):
    """The float64 composition of :class:`Attention`'s forward from the reference ops."""
    def fn(inputs, p):
        x, ve = inputs["x"], inputs.get("ve")
        B, T, _ = x.shape
        qkv = ref.linear(x, p["qkv.weight"], p.get("qkv.bias")).view(B, T, -1, m.head_dim)
        q, k, v = qkv.split([m.n_heads, m.n_kv_heads, m.n_kv_heads], dim=2)
        if m.q_norm is not None:  # span "all": over each token's heads together
            flat = (lambda t: t.flatten(2)) if m.qk_norm_span == "all" else (lambda t: t)
            q = ref.rms_norm(flat(q), p["q_norm.weight"], m.q_norm.eps).view(q.shape)
            k = ref.rms_norm(flat(k), p["k_norm.weight"], m.k_norm.eps).view(k.shape)
        q, k = ref.rope(q, cos, sin), ref.rope(k, cos, sin)
        if ve is not None:
            v = ref.weighted_add(v, ve.view(v.shape), p["value_mix"])
        y = ref.attention(q, k, v, causal=m.causal, window=m.window)
        return ref.linear(y.reshape(B, T, -1), p["proj.weight"])
    return fn


ATTENTION = {"mha": dict(n_heads=2, n_kv_heads=None, head_dim=None),
             "gqa-qknorm-bias-window": dict(n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True, qkv_bias=True,
                                            window=3),
             "gqa-qknorm-all": dict(n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True, qk_norm_span="all"),
             "mqa-value-mix": dict(n_heads=2, n_kv_heads=1, head_dim=32, value_mix=True)}


@pytest.mark.parametrize("opts", ATTENTION.values(), ids=ATTENTION.keys())
def test_attention_matches_reference(opts):
    torch.manual_seed(0)
    m = Attention(64, init_std=0.2, **opts).to(DEVICE)
    if m.q_norm is not None:  # not all ones, so that a missing norm weight shows
        with torch.no_grad():
            m.q_norm.weight.uniform_(0.5, 1.5)
            m.k_norm.weight.uniform_(0.5, 1.5)
    cos, sin = rope_cos_sin(16, m.head_dim, device=DEVICE)
    inputs = {"x": randn(2, 7, 64, requires_grad=True), "cos": cos, "sin": sin}
    if m.value_mix is not None:
        inputs["ve"] = randn(2, 7, m.n_kv_heads * m.head_dim, requires_grad=True)
    check_module(m, attention_reference(m, cos, sin), inputs)


def test_attention_kv_cache_prefill_and_decode():
    """Prefill 4 positions into a cache, a cache forward of 2 more, then one decode step: each
    equals the full forward's rows."""
    torch.manual_seed(0)
    m = Attention(64, 4, 2, 32, qk_norm=True, layer_idx=1, init_std=0.2).to(DEVICE)
    cos, sin = rope_cos_sin(16, 32, device=DEVICE)
    x = randn(2, 7, 64)
    with torch.no_grad():
        full = m(x, cos, sin)
        cache = KVCache(2, 2, 8, 2, 32, device=DEVICE, dtype=torch.float32)
        parts = []
        for a, b in ((0, 4), (4, 6)):
            parts.append(m(x[:, a:b], cos, sin, cache))
            cache.advance(b - a)
        parts.append(m.decode(x[:, 6:7].contiguous(), cos, sin, cache, cache.pos + 1))
    assert_close("cached", torch.cat(parts, 1), full.double(), atol=gemm_atol(torch.float32))
    with pytest.raises(ValueError, match="max_len 8"):
        m(x[:, :3], cos, sin, cache)


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_mlp_matches_reference(act):
    m = MLP(48, 40, act, init_std=0.2, out_std=0.1).to(DEVICE)
    assert (set(dict(m.named_parameters())) ==
            {"w13.weight" if act == "swiglu" else "w1.weight", "w2.weight"})

    def fn(inputs, p):
        x = inputs["x"]
        h = ref.linear_swiglu(x, p["w13.weight"]) if act == "swiglu" else ref.relu2(ref.linear(x, p["w1.weight"]))
        return ref.linear(h, p["w2.weight"])
    check_module(m, fn, {"x": randn(2, 5, 48, requires_grad=True)}, chain=2)


def test_lm_head_loss_matches_reference():
    """Loss with soft-capped logits, z-loss and ignored targets; the logits for sampling."""
    head = LMHeadLoss(softcap=3.0, z_loss=1e-2)
    h = randn(2, 5, 32, requires_grad=True)
    w = randn(50, 32, scale=0.5, requires_grad=True)
    t = torch.randint(0, 50, (2, 5), device=DEVICE)
    t[0, 1] = -100
    loss, z = head(h, w, t)
    dh, dw = torch.autograd.grad(loss, [h, w])
    outs = {}
    for dtype in (torch.float64, torch.float32):
        hr, wr = (a.detach().to(dtype).requires_grad_() for a in (h, w))
        lr, zr = ref.linear_cross_entropy(hr, wr, t, z_loss=1e-2, softcap=3.0, return_z_loss=True)
        outs[dtype] = (lr, zr, *torch.autograd.grad(lr, [hr, wr]))
    atol = gemm_atol(torch.float32)
    for name, got, r64, r32 in zip(("loss", "z", "dh", "dw"), (loss, z, dh, dw), outs[torch.float64],
                                   outs[torch.float32]):
        assert_close(name, got, r64, r32, atol=atol, dtype=torch.float32)
    logits = head.logits(h.detach(), w.detach())
    want = ref.softcap(ref.linear(h.detach().double(), w.detach().double()), 3.0)
    assert_close("logits", logits, want, atol=atol)


def test_moe_returns_its_losses():
    """Plain arguments; forward returns (y, scaled aux loss, detached stats), nothing kept on the module."""
    m = MoE(32, 4, 2, 24, n_shared_experts=1, score="sigmoid", aux_loss_coef=0.1, z_loss_coef=0.01).to(DEVICE)
    out = m(randn(2, 3, 32))
    assert isinstance(out, MoEOutput) and out.y.shape == (2, 3, 32)
    want = 0.1 * out.stats["moe_aux"] + 0.01 * out.stats["moe_z"]
    assert_close("aux_loss", out.aux_loss, want.double())
    assert out.aux_loss.requires_grad and set(out.stats) == {"moe_aux", "moe_z", "moe_max_load"}
    assert not any(isinstance(v, torch.Tensor) for k, v in vars(m).items() if not k.startswith("_"))


class TinyLM(torch.nn.Module):
    """One pre-norm block (QK-norm GQA attention, SwiGLU MLP) and a tied, soft-capped LM-head loss."""

    def __init__(self):
        super().__init__()
        self.embed = Embedding(64, 64, validate=False)
        self.attn_norm, self.mlp_norm, self.norm = RMSNorm(64), RMSNorm(64), RMSNorm(64)
        self.attn = Attention(64, 2, 1, 32, qk_norm=True)
        self.mlp = MLP(64, 48)
        self.head_loss = LMHeadLoss(softcap=15.0, z_loss=1e-4)

    def forward(self, idx, targets, cos, sin):
        x = self.embed(idx)
        h, x = self.mlp_norm(self.attn(self.attn_norm(x), cos, sin), residual=x)
        h, _ = self.norm(self.mlp(h), residual=x)
        return self.head_loss(h, self.embed.weight, targets)[0]


def test_modules_compile_fullgraph():
    """The model compiles with no graph break (aot_eager on the CPU, inductor on the GPU) and gives
    eager's loss and gradients."""
    torch.manual_seed(0)
    model = TinyLM().to(DEVICE)
    cos, sin = rope_cos_sin(16, 32, device=DEVICE)
    idx, targets = (torch.randint(0, 64, (2, 16), device=DEVICE) for _ in range(2))
    params = list(model.parameters())
    eager = model(idx, targets, cos, sin)
    g_eager = torch.autograd.grad(eager, params)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    loss = compiled(idx, targets, cos, sin)
    g = torch.autograd.grad(loss, params)
    assert_close("loss", loss, eager.double(), atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), g, g_eager):
        assert_close(f"d{name}", a, b.double(), atol=1e-6)


def test_extra_repr_names_the_arguments():
    reprs = {
        RMSNorm(64, eps=1e-5): ["64", "eps=1e-05"],
        Linear(8, 16, bias=True): ["in_features=8", "out_features=16", "bias=True"],
        LinearSwiGLU(8, 12): ["in_features=8", "hidden_features=12"],
        Attention(64, 4, 2, 32, qk_norm=True, window=5): ["d_model=64", "n_heads=4", "n_kv_heads=2", "head_dim=32",
                                                          "window=5", "qk_norm=True", "causal=True"],
        MLP(16, 40, "relu2"): ["d_model=16", "d_ff=40", "act=relu2"],
        MoE(16, 8, 2, 12, 1): ["d_model=16", "n_experts=8", "top_k=2", "d_expert=12", "n_shared_experts=1"],
        LMHeadLoss(softcap=15.0, z_loss=1e-4, fp8=True): ["softcap=15.0", "z_loss=0.0001", "ignore_index=-100",
                                                          "fp8=True"],
    }
    for module, parts in reprs.items():
        text = module.extra_repr()
        assert all(p in text for p in parts), (type(module).__name__, text)


@pytest.mark.skipif(ON_GPU, reason="the interpreter refuses fp8; the GPU path is tests/test_lm_head_fp8.py's")
def test_lm_head_loss_fp8_reaches_the_kernel():
    """LMHeadLoss(fp8=True), and the model's with ModelConfig.lm_head_fp8, call the fp8 head."""
    from tritonllm.models import ModelConfig, build_model

    head = LMHeadLoss(fp8=True)
    with pytest.raises(ValueError, match="fp8"):
        head(randn(4, 32), randn(50, 32), torch.randint(0, 50, (4,), device=DEVICE))
    model = build_model(ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8,
                                    lm_head_fp8=True), device=DEVICE)
    assert model.head_loss.fp8
    idx = torch.randint(0, 64, (1, 8), device=DEVICE)
    with pytest.raises(ValueError, match="fp8"):
        model(idx, idx)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_kv_heads"):
        Attention(64, 4, 3, 16)
    with pytest.raises(ValueError, match="d_model"):
        Attention(60, 8)
    with pytest.raises(ValueError, match="head_dim"):
        Attention(64, 2, head_dim=15)
    with pytest.raises(ValueError, match="qk_norm_span"):
        Attention(64, 2, qk_norm=True, qk_norm_span="token")
    with pytest.raises(ValueError, match="act"):
        MLP(8, 16, "gelu")
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 4, 5, 16)
