"""The FP8 LM head: kernels.fp8's per-row quantization, the GEMM's scale epilogue and
``linear_cross_entropy(fp8=True)``.

The interpreter has no fp8 (its conversions are wrong), so on the CPU the quantization kernel
writes float32 (the scale math, exactly) and the GEMM's scale epilogue runs on float32 operands;
the fp8 paths run on the GPU only, against a float64 reference of the same quantized math: x and
W quantized per row to e4m3, W^T per row (columns of W), the per-row gradient dloss/dlogits to
e5m2, each by a float32 PyTorch twin of the kernel's rounding steps, then everything else in
float64. The tolerance yardstick ("same") is the same quantized math in PyTorch with the kernel's
roundings: logits and dx in bf16, the fp32 gradient of the bf16 logits.
"""

import pytest
import torch

from _checks import DEVICE, ON_GPU, assert_close, randn
from tritonllm.kernels import linear_cross_entropy
from tritonllm.kernels.fp8 import FP8_MAX, quantize, quantize_into
from tritonllm.kernels.gemm import gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
IGNORE = -100


def quantize_ref(x: torch.Tensor, fp8_max: float):
    """The kernel's rounding steps in float32 PyTorch: (x * (F / amax) clamped to +-F, amax / F) per
    row; the fp8 cast is left to the caller."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    big = torch.full_like(safe, fp8_max)  # tensor / tensor: IEEE division (a scalar one may multiply by a reciprocal)
    inv = torch.where(amax > 0, big / safe, torch.ones_like(amax))
    scale = torch.where(amax > 0, safe / big, torch.ones_like(amax))
    return (x * inv[:, None]).clamp(-fp8_max, fp8_max), scale


def dequantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x quantized per row to ``dtype`` and scaled back, in float64."""
    q, s = quantize_ref(x, FP8_MAX[dtype])
    return q.to(dtype).double() * s.double()[:, None]


SHAPES = [(1, 5), (5, 70), (37, 300), (64, 33)]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("layout", ["rows", "transposed", "strided"])
def test_quantize_scale_math(shape, fmt, layout, poisoned_empty):
    """float32 output: q = clamp(x F / amax) and s = amax / F exactly, per row and (qt, x^T's rows) per
    column; an all-zero row or column gets s = 1 and q = 0; a transposed view quantizes W^T's rows."""
    R, N = shape
    src = randn(N, R) if layout == "transposed" else randn(R, 2 * N if layout == "strided" else N) * 3
    x = {"rows": src, "transposed": src.t(), "strided": src[:, ::2]}[layout]
    if R > 2:
        x[1] = 0.0
    if N > 3:
        x[:, 2] = 0.0
    q, qt = torch.empty(R, N, device=DEVICE), torch.empty(N, R, device=DEVICE)
    s, st = torch.empty(R, device=DEVICE), torch.empty(N, device=DEVICE)
    quantize_into(x, FP8_MAX[fmt], q, s, qt, st)
    for name, got, scale, src_rows in (("rows", q, s, x), ("columns", qt, st, x.t())):
        q_ref, s_ref = quantize_ref(src_rows, FP8_MAX[fmt])
        assert torch.equal(scale, s_ref) and torch.equal(got, q_ref), name
        top = got.abs().amax(dim=1)[src_rows.abs().amax(dim=1) > 0]  # each row's largest value lands on F (to an ulp)
        assert ((top <= FP8_MAX[fmt]) & (top >= FP8_MAX[fmt] * (1 - 2 ** -22))).all(), name


def test_quantize_one_layout_leaves_the_other():
    """rows only or columns only: the same values as both at once, None for the layout not asked for."""
    x = randn(37, 70)
    both = quantize(x, E4M3, rows=True, cols=True)
    rows, cols = quantize(x, E4M3, rows=True, cols=False), quantize(x, E4M3, rows=False, cols=True)
    assert rows[2] is None and rows[3] is None and cols[0] is None and cols[1] is None
    assert all(torch.equal(a, b) for a, b in zip(both, rows[:2] + cols[2:]))


def test_quantize_non_finite_scales():
    """A row (and column) holding NaN gets a NaN scale and one holding inf an infinite scale, so the GEMM's
    output there is not finite; the other rows' scales are untouched."""
    x = randn(6, 40)
    clean = quantize(x, E4M3, cols=True)
    x[1, 3], x[4, 7] = float("nan"), float("inf")
    _, s, _, st = quantize(x, E4M3, cols=True)
    assert s[1].isnan() and s[4].isinf() and st[3].isnan() and st[7].isinf()
    keep_r, keep_c = [0, 2, 3, 5], [c for c in range(40) if c not in (3, 7)]
    assert torch.equal(s[keep_r], clean[1][keep_r]) and torch.equal(st[keep_c], clean[3][keep_c])


@pytest.mark.parametrize("shape", [(1, 17, 9), (37, 100, 23), (64, 48, 130)], ids=lambda s: "x".join(map(str, s)))
def test_gemm_scale_epilogue(shape, poisoned_empty):
    """c = a_scale[m] b_scale[n] (a @ b) on float32 operands (the epilogue the fp8 GEMMs use), a
    transposed B as the LM head passes it."""
    M, K, N = shape
    a, b = randn(M, K), randn(N, K)
    sa, sb = torch.rand(M, device=DEVICE) + 0.5, torch.rand(N, device=DEVICE) + 0.5
    c = torch.empty(M, N, device=DEVICE)
    gemm(a, b.t(), c, a_scale=sa, b_scale=sb, allow_tf32=False)
    ref = sa.double()[:, None] * (a.double() @ b.double().t()) * sb.double()[None, :]
    same = sa[:, None] * (a @ b.t()) * sb[None, :]
    assert_close("c", c, ref, same)


def test_fp8_refused_without_fp8_tensor_cores():
    if ON_GPU and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has fp8 tensor cores")
    x = randn(4, 16, requires_grad=True)
    w = randn(10, 16, requires_grad=True)
    with pytest.raises(ValueError, match="fp8=True"):
        linear_cross_entropy(x, w, torch.zeros(4, dtype=torch.int64, device=DEVICE), fp8=True)


def test_quantize_bad_dtype():
    with pytest.raises(TypeError, match="dtype"):
        quantize(randn(3, 4), torch.float16)


# ----------------------------------------------------------------------------- GPU: fp8


def fp8_capable() -> bool:
    return ON_GPU and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not fp8_capable(), reason="needs a GPU with fp8 tensor cores")


@pytest.mark.gpu
@needs_fp8
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_quantize_fp8_bits(fmt, transposed):
    """fp8 output, per row and per column: the same bits as PyTorch's round-to-nearest-even cast of the
    float32 math."""
    src = randn(300, 1000, dtype=torch.bfloat16) * 5
    x = src.t() if transposed else src
    q, s, qt, st = quantize(x, fmt, cols=True)
    for got, scale, rows in ((q, s, x), (qt, st, x.t())):
        q_ref, s_ref = quantize_ref(rows, FP8_MAX[fmt])
        assert got.dtype == fmt and got.is_contiguous() and torch.equal(scale, s_ref)
        assert torch.equal(got.view(torch.uint8), q_ref.to(fmt).view(torch.uint8))


def row_losses(logits, t, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """Per-row loss of the fused op (its docstring's formula) from ``logits`` [T, V]; 0 on ignored rows."""
    V = logits.shape[1]
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    lse = torch.logsumexp(z, dim=1)
    z_t = z.gather(1, t.clamp(min=0)[:, None])[:, 0]
    loss = lse - (1 - label_smoothing) * z_t - label_smoothing / V * z.sum(dim=1) + z_loss * lse ** 2
    return torch.where(t != IGNORE, loss, torch.zeros_like(loss))


def quantized_reference(x, w, t, double: bool, **kw):
    """(loss, dx, dW) of the FP8 head's math, reduction mean, upstream gradient 1: float64 when
    ``double``, else PyTorch with the kernel's roundings (bf16 logits, dx and dW)."""
    dt = torch.float64 if double else torch.float32
    logits = dequantized(x, E4M3).to(dt) @ dequantized(w, E4M3).to(dt).t()
    if not double:
        logits = logits.to(torch.bfloat16).float()
    logits.requires_grad_(True)
    rows = row_losses(logits, t, **kw)
    g = torch.autograd.grad(rows.sum(), logits)[0]  # per-row dloss/dlogits, unscaled, as the kernel quantizes it
    valid = (t != IGNORE).sum().clamp(min=1)
    dx = dequantized(g, E5M2).to(dt) @ dequantized(w.t(), E4M3).t().to(dt) / valid
    g_w = g if double else g.to(torch.bfloat16).float()
    dw = g_w.t() @ x.to(dt) / valid
    if not double:
        dx, dw = dx.to(torch.bfloat16), dw.to(torch.bfloat16)
    return rows.sum() / valid, dx, dw


CASES = [  # (tokens, H, V, chunk_size, label_smoothing, z_loss, softcap)
    (1000, 256, 4000, 256, 0.0, 0.0, None),
    (777, 192, 5003, None, 0.1, 1e-3, None),  # odd vocabulary: padded fp8 row strides
    (512, 128, 40000, 300, 0.0, 0.0, 15.0),  # rows longer than the row kernel's registers: the two-pass path
]


@pytest.mark.gpu
@needs_fp8
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-V{c[2]}-chunk{c[3]}-ls{c[4]}-z{c[5]}-cap{c[6]}")
def test_linear_cross_entropy_fp8(case):
    T, H, V, chunk, ls, zl, cap = case
    x = randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    w = randn(V, H, dtype=torch.bfloat16, scale=H ** -0.5, requires_grad=True)
    t = torch.randint(0, V, (T,), device=DEVICE)
    t[::7] = IGNORE
    kw = dict(label_smoothing=ls, z_loss=zl, softcap=cap)
    loss = linear_cross_entropy(x, w, t, chunk_size=chunk, fp8=True, **kw)
    dx, dw = torch.autograd.grad(loss, [x, w])
    ref = quantized_reference(x.detach(), w.detach(), t, True, **kw)
    same = quantized_reference(x.detach(), w.detach(), t, False, **kw)
    for name, got, r, s in zip(("loss", "dx", "dW"), (loss, dx, dw), ref, same):
        assert_close(name, got, r, s, dtype=torch.bfloat16)


@pytest.mark.gpu
@needs_fp8
def test_linear_cross_entropy_fp8_close_to_bf16():
    """At void125m's width the FP8 head's loss is within 1% of the bf16 head's, its gradients within
    10% in norm (the quantization error, not a bug's)."""
    x = randn(2048, 768, dtype=torch.bfloat16, requires_grad=True)
    w = randn(32000, 768, dtype=torch.bfloat16, scale=0.02, requires_grad=True)
    t = torch.randint(0, 32000, (2048,), device=DEVICE)
    out = {}
    for fp8 in (False, True):
        loss = linear_cross_entropy(x, w, t, fp8=fp8)
        out[fp8] = (loss, *torch.autograd.grad(loss, [x, w]))
    assert abs(out[True][0].item() - out[False][0].item()) <= 0.01 * out[False][0].item()
    for i in (1, 2):
        rel = (out[True][i].float() - out[False][i].float()).norm() / out[False][i].float().norm()
        assert rel <= 0.1, (i, rel.item())
