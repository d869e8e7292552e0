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

from _checks import DEVICE, assert_close, dtype_id, gemm_atol, randn
from test_flash_attention import Case, _check_fwd_bwd, reference
from tritonllm.kernels.flash_attention import flash_attention
from tritonllm.kernels.flash_attention.settings import KERNELS, MASK_KINDS, configure_attention
from tritonllm.kernels.split_heads import split_heads


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
def test_flash_attention_one_token_knobs(tma, one_loop, kernel_settings, poisoned_empty):
    """T = S = 1 through every value of the ``tma`` and ``one_loop`` settings (float16: the TMA path)."""
    configure_attention(tma=dict.fromkeys(KERNELS, tma),
                        one_loop={name: dict.fromkeys(MASK_KINDS, one_loop) for name in KERNELS})
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
    ref = torch.cat([torch.zeros(B, 1, Hq + Hkv, D, dtype=torch.float64, device=DEVICE), dv64], dim=2)
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
    atol = gemm_atol(torch.float32)  # TF32 GEMMs of the fp32 model on the GPU
    assert_close("loss", losses[0], losses[1], same=losses[2], atol=atol)
    for loss in losses:
        loss.backward()
    g64, g32 = dict(ref64.named_parameters()), dict(ref32.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(f"grad {name}", p.grad, g64[name].grad, same=g32[name].grad, atol=atol)


# ------------------------------------------------------------------------------ GEMM and linear

#: (M, K, N): a one-element product, K = 1 (one K step, mostly masked), M = 1 / N = 1 (one row or
#: column of a 16-wide tile)
TINY_GEMMS = [(1, 1, 1), (37, 1, 5), (1, 37, 1), (1, 1, 37), (5, 17, 1)]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", TINY_GEMMS, ids=lambda c: "x".join(map(str, c)))
def test_linear_tiny_dims(case, dtype, poisoned_empty):
    """y = x W^T + b and dx, dW, db (a one-row bias sum when M = 1) against float64."""
    from test_linear import check, ref_linear
    from tritonllm.kernels import linear

    M, K, N = case
    x = randn(M, K, dtype=dtype, requires_grad=True)
    w = randn(N, K, dtype=dtype, scale=K ** -0.5, requires_grad=True)
    b = randn(N, dtype=dtype, requires_grad=True)
    check(linear, ref_linear, [x, w, b], ["x", "weight", "bias"])


def test_linear_zero_rows(poisoned_empty):
    """x with no rows: y is [0, N]; dW (a GEMM over K = 0, no K step) and db (a sum of no rows) are zeros."""
    from tritonllm.kernels import linear

    x = randn(0, 8, requires_grad=True)
    w = randn(5, 8, requires_grad=True)
    b = randn(5, requires_grad=True)
    y = linear(x, w, b)
    assert y.shape == (0, 5)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), torch.ones_like(y))
    assert dx.shape == (0, 8)
    assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


@pytest.mark.parametrize("M,N,K,splits", [(3, 5, 1, 4), (1, 1, 300, 8), (17, 1, 20, 3)],
                         ids=["K1-4splits", "M1-N1-8splits", "N1-3splits"])
def test_gemm_split_k_empty_splits(M, N, K, splits, poisoned_empty):
    """Split-K where most splits get no K tile (the interpreter's BLOCK_K covers K = 1 and 20 in one
    step): their fp32 partials must be written as zeros before the fixed-order sum."""
    gemm_module = importlib.import_module("tritonllm.kernels.gemm")
    a, b = randn(M, K), randn(N, K).t()
    c = gemm_module.gemm(a, b, torch.empty(M, N, device=DEVICE), split_k=splits, allow_tf32=False)
    assert_close("c", c, a.double() @ b.double())


# ------------------------------------------------------------------------------ grouped GEMM and MoE

@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
def test_grouped_linear_no_rows_at_all(swiglu, poisoned_empty):
    """Every expert empty (M = 0, e.g. an expert-parallel rank that receives no token): y and dx
    have no rows and dW, whose programs loop over no row, is written as zeros."""
    from tritonllm.kernels import grouped_linear, grouped_linear_swiglu

    E, K, N = 3, 24, 20
    x = randn(0, K, requires_grad=True)
    w = randn(E, 2 * N if swiglu else N, K, requires_grad=True)
    y = (grouped_linear_swiglu if swiglu else grouped_linear)(x, w, torch.zeros(E + 1, dtype=torch.int32,
                                                                                   device=DEVICE))
    assert y.shape == (0, N)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert dx.shape == (0, K)
    assert torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=dtype_id)
def test_moe_all_tokens_one_expert(dtype, poisoned_empty):
    """Every token routed to expert 2 of 4 (top-1): sort, gather, grouped SwiGLU, grouped down
    projection and combine against float64; the other experts' weight gradients are exact zeros."""
    import torch.nn.functional as F

    from tritonllm.kernels import grouped_linear, grouped_linear_swiglu, moe_combine, moe_gather, moe_sort

    T, E, D, Fd, hot = 9, 4, 16, 24, 2
    plan = moe_sort(torch.full((T, 1), hot, dtype=torch.int32, device=DEVICE), E)
    assert plan.expert_offsets.tolist() == [0, 0, 0, T, T]
    x = randn(T, D, dtype=dtype, requires_grad=True)
    w13 = randn(E, 2 * Fd, D, dtype=dtype, scale=D ** -0.5, requires_grad=True)
    w2 = randn(E, D, Fd, dtype=dtype, scale=Fd ** -0.5, requires_grad=True)
    gate = torch.rand(T, 1, device=DEVICE, requires_grad=True)
    h = grouped_linear_swiglu(moe_gather(x, plan), w13, plan.expert_offsets)
    y = moe_combine(grouped_linear(h, w2, plan.expert_offsets), gate, plan)
    dy = randn(T, D, dtype=dtype)
    grads = torch.autograd.grad(y, (x, w13, w2, gate), dy)

    def ref(x, w13, w2, gate):
        g, u = (x @ w13[hot].T).chunk(2, dim=-1)
        return (F.silu(g) * u) @ w2[hot].T * gate

    ins64 = [t.detach().double().requires_grad_() for t in (x, w13, w2, gate)]
    y64 = ref(*ins64)
    ins_same = [t.detach().clone().requires_grad_() for t in (x, w13, w2, gate)]
    y_same = ref(*ins_same)
    atol = gemm_atol(dtype, 2)  # two chained GEMMs, TF32 for fp32 on the GPU
    assert_close("y", y, y64, y_same, atol=atol)
    refs64 = torch.autograd.grad(y64, ins64, dy.double())
    refs_same = torch.autograd.grad(y_same, ins_same, dy)
    for name, g, g64, gs in zip(("dx", "dw13", "dw2", "dgate"), grads, refs64, refs_same):
        assert_close(name, g, g64, gs.float() if name == "dgate" else gs, atol=atol, dtype=dtype)
    for name, g in (("dw13", grads[1]), ("dw2", grads[2])):
        cold = [e for e in range(E) if e != hot]
        assert torch.equal(g[cold], torch.zeros_like(g[cold])), f"{name} of the experts without rows must be 0"


# ------------------------------------------------------------------------------ embedding, optimizer

def test_embedding_one_token(poisoned_empty):
    """One token: the backward program of the other ids' block walks no token and writes zeros."""
    from tritonllm.kernels import embedding

    V, D = 70, 24
    w = randn(V, D, requires_grad=True)
    ids = torch.tensor([3], device=DEVICE)
    out = embedding(ids, w)
    dy = randn(1, D)
    (dw,) = torch.autograd.grad(out, w, dy)
    ref = torch.zeros(V, D, dtype=torch.float64, device=DEVICE)
    ref[3] = dy.double()[0]
    assert_close("out", out, w.detach().double()[ids])
    # every row written (the poison fails the check); not bitwise: on the GPU the one-hot product of
    # float32 dy runs tf32x3 (relative error about 2^-22)
    assert_close("dw", dw, ref)


def test_clip_grads_of_empty_tensors(poisoned_empty):
    """Gradients with no elements: no chunk, no partial sum (the poisoned partials buffer is never
    read); the norm is 0 and nothing is scaled."""
    from tritonllm.kernels import clip_grads_

    grads = [torch.empty(0, device=DEVICE), torch.empty(0, 3, device=DEVICE)]
    norm = clip_grads_(grads, 1.0)
    assert norm.item() == 0.0
    g = randn(5)
    assert_close("norm", clip_grads_([torch.empty(0, device=DEVICE), g], 1e9), g.double().norm())


def _zero_rows_weight_grad(op: str):
    """(weight, its gradient) of ``op`` applied to a batch of no rows (x [0, 8])."""
    import tritonllm.kernels as K

    x = randn(0, 8, requires_grad=True)
    if op == "rms_norm":
        w = randn(8, requires_grad=True)
        y = K.rms_norm(x, w).sum()
    elif op == "linear_swiglu":
        w = randn(10, 8, requires_grad=True)
        y = K.linear_swiglu(x, w).sum()
    elif op == "embedding":
        w = randn(10, 8, requires_grad=True)
        y = K.embedding(torch.zeros(0, dtype=torch.long, device=DEVICE), w).sum()
    else:
        w = randn(10, 8, requires_grad=True)
        y = K.linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long, device=DEVICE), reduction="sum")
    return w, torch.autograd.grad(y, w)[0]


@pytest.mark.parametrize("op", ["rms_norm", "linear_swiglu", "embedding", "linear_cross_entropy"])
def test_weight_grad_of_no_rows(op, poisoned_empty):
    """A batch with no rows: the weight gradient (per-program partials over no rows, a GEMM over
    K = 0, a segment sum over no token) is written as zeros."""
    w, dw = _zero_rows_weight_grad(op)
    assert torch.equal(dw, torch.zeros_like(w)), f"{op}: weight gradient of no rows must be 0"
