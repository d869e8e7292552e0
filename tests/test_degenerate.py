"""Degenerate shapes of every kernel family (issue 11): programs whose loop runs zero times, tiles
with no valid row or key, splits past the end, experts with no rows. Each output a launcher
allocates comes from a NaN-poisoned ``torch.empty`` (``poisoned_empty``), so an element no
program writes fails the float64 comparison.

The original report: ``flash_attention`` on one-token sequences (T = S = 1, causal) seemed to
return garbage dq and dk. With one visible key the softmax is constant (p = 1), so the exact
gradients of q and k are zero (dS = p (dO.v - dO.o) = 0 since o = v) and dv = dO: what the
kernels return there is fp32 rounding noise (about 1e-7 |dO| |v|), which a *relative* error
against the exact zero turns into a huge number. The tests below check absolute errors scaled by
the reference's magnitude (``assert_close``), and that no program leaves an output unwritten.
"""

import importlib

import pytest
import torch

from _checks import DEVICE, assert_close, dtype_id, randn
from test_flash_attention import Case, _check_fwd_bwd, reference
from tritonllm.kernels.flash_attention import flash_attention
from tritonllm.kernels.split_heads import split_heads

fa = importlib.import_module("tritonllm.kernels.flash_attention")

#: the interpreter dots need fp32 or fp16 (bfloat16 on the GPU only, where the main suites run it)
CPU_DTYPES = [torch.float32, torch.float16]


# ------------------------------------------------------------------------------ flash attention

ONE_TOKEN = [Case("T1-S1-causal-B2-gqa2:1", 2, 4, 2, 1, 1, 32),
             Case("T1-S1-full-D64", 1, 2, 2, 1, 1, 64, causal=False),
             Case("T1-S1-window1-mqa", 1, 4, 1, 1, 1, 32, window=1)]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ONE_TOKEN, ids=lambda c: c.name)
def test_flash_attention_one_token(case, dtype, poisoned_empty):
    """The regression test of the report: T = S = 1 gives o = v, dv = dO (summed over the group)
    and dq = dk = 0 up to rounding, every element written."""
    _check_fwd_bwd(case, dtype)
    q, k, v = (randn(case.B, n, h, case.D, dtype=dtype, requires_grad=True)
               for n, h in ((1, case.Hq), (1, case.Hkv), (1, case.Hkv)))
    do = randn(case.B, 1, case.Hq, case.D, dtype=dtype)
    out = flash_attention(q, k, v, causal=case.causal, window=case.window)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    group = case.Hq // case.Hkv
    assert_close("out", out, v.detach().double().repeat_interleave(group, dim=2))
    assert_close("dv", dv, do.double().view(case.B, 1, case.Hkv, group, case.D).sum(3))
    scale = do.double().abs().max().item() * max(q.abs().max().item(), k.abs().max().item(), 1.0)
    for name, g in (("dq", dq), ("dk", dk)):
        err = g.double().abs().max().item()
        assert err <= 1e-5 * scale * (case.D ** 0.5), f"{name} of a one-key softmax must be ~0, got {err:.3e}"


@pytest.mark.parametrize("tma, one_loop", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["tma-one-loop", "pointers-one-loop", "tma-three-loops", "pointers-three-loops"])
def test_flash_attention_one_token_knobs(tma, one_loop, monkeypatch, poisoned_empty):
    """T = S = 1 through every setting of the TMA and ONE_LOOP knobs (float16: the TMA path)."""
    monkeypatch.setattr(fa, "TMA", dict.fromkeys(fa.TMA, tma))
    monkeypatch.setattr(fa, "ONE_LOOP", {name: dict.fromkeys(kinds, one_loop) for name, kinds in fa.ONE_LOOP.items()})
    _check_fwd_bwd(ONE_TOKEN[0], torch.float16)


#: tiles with nothing to visit under the interpreter's tiles (forward and dQ: 32 queries x 16 keys;
#: dK/dV: 32 keys x 16 queries; split-KV: 16 keys)
EMPTY_TILES = [
    # causal with T > S: query blocks 0 and 1 (rows 0..63) see no key at all (o = 0, dq = 0)
    Case("no-key-for-2-query-blocks-T70-S5", 1, 2, 1, 70, 5, 32),
    Case("no-key-for-2-query-blocks-T70-S1", 1, 2, 2, 70, 1, 32),
    # window: key blocks 0 and 1 are seen by no query (dk = dv = 0), decode-size T takes the split-KV forward
    Case("no-query-for-2-key-blocks-T5-S100-window3", 1, 4, 2, 5, 100, 32, window=3),
    Case("one-key-T1-S100-window1", 2, 2, 1, 1, 100, 32, window=1),
    # one-pass forward, a window that leaves whole key tiles out of each query block's loop
    Case("window2-T40-S100", 1, 2, 2, 40, 100, 32, window=2),
]


@pytest.mark.parametrize("case", EMPTY_TILES, ids=lambda c: c.name)
def test_flash_attention_empty_tiles(case, poisoned_empty):
    _check_fwd_bwd(case, torch.float32)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rope_path", [False, True], ids=["qkv-split", "qk-rope-split"])
def test_packed_qkv_one_token(rope_path, dtype, poisoned_empty):
    """T = S = 1 from a packed [B, 1, Hq + 2 Hkv, D] projection through split_heads (and RoPE, as the
    attention module does): the gradient of the packed tensor has dq = dk = 0 and dv = dO."""
    from tritonllm.kernels import rope, rope_cos_sin

    B, Hq, Hkv, D = 2, 4, 2, 32
    qkv = randn(B, 1, Hq + 2 * Hkv, D, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(4, D, device=DEVICE)
    if rope_path:
        qk, v = split_heads(qkv, (Hq + Hkv, Hkv))
        q, k = split_heads(rope(qk, cos, sin), (Hq, Hkv))
    else:
        q, k, v = split_heads(qkv, (Hq, Hkv, Hkv))
    do = randn(B, 1, Hq, D, dtype=dtype)
    out = flash_attention(q, k, v, causal=True)
    (dqkv,) = torch.autograd.grad(out, qkv, do)

    q64, k64, v64 = qkv.detach().double().requires_grad_().split([Hq, Hkv, Hkv], dim=2)
    out64, _ = reference(q64, k64, v64)
    assert_close("out", out, out64)
    dv64 = do.double().view(B, 1, Hkv, Hq // Hkv, D).sum(3)
    ref = torch.cat([torch.zeros(B, 1, Hq + Hkv, D, dtype=torch.float64), dv64], dim=2)
    assert_close("d(qkv)", dqkv, ref)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope-fused-qk", "qk-norm"])
def test_model_one_token_sequence(qk_norm, poisoned_empty):
    """A one-token batch through the model (attention module: packed qkv, split_heads, RoPE,
    flash_attention at T = S = 1): loss and every parameter gradient against the float64 reference."""
    from test_models import random_batch, tiny_cfg, twins

    cfg = tiny_cfg(qk_norm=qk_norm)
    ours, ref64, ref32 = twins(cfg)
    idx, targets = random_batch(cfg, 2, 1, ignore=False)
    losses = [m(idx, targets) for m in (ours, ref64, ref32)]
    assert_close("loss", losses[0], losses[1], same=losses[2])
    for loss in losses:
        loss.backward()
    g64, g32 = dict(ref64.named_parameters()), dict(ref32.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(f"grad {name}", p.grad, g64[name].grad, same=g32[name].grad)
