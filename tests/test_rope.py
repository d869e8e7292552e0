"""rope (output and dx, strided views, position_offset) and rope_cos_sin (plain, NTK, YaRN) against
float64 PyTorch references of the formulas."""

import importlib
import math

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, dtype_id, randn
from tritonllm.bench.reference_ops import rope as reference
from tritonllm.kernels import rope, rope_cos_sin

# the module, not the function of the same name that tritonllm.kernels exports
rope_module = importlib.import_module("tritonllm.kernels.rope")

# (B, T, H, D): a single row and head with D = 2, odd T and H, D/2 not a power of two
SHAPES = [(1, 1, 1, 2), (2, 5, 3, 64), (1, 17, 4, 128), (1, 123, 2, 32), (3, 7, 5, 6)]


def shape_id(shape):
    return "B{}_T{}_H{}_D{}".format(*shape)


def tables(rows, half):
    """Random fp32 cos/sin tables (cos^2 + sin^2 = 1) with ``rows`` rows."""
    angle = torch.rand(rows, half, dtype=torch.float64) * 2 * math.pi
    return torch.cos(angle).float().to(DEVICE), torch.sin(angle).float().to(DEVICE)


def leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).requires_grad_()


def reference_run(source, views, cos, sin, offset, grads, dtype):
    """The reference outputs and the gradient of ``source`` computed in ``dtype``."""
    src = leaf(source, dtype)
    outs = [reference(v, cos, sin, offset) for v in views(src)]
    (grad,) = torch.autograd.grad(outs, [src], [g.to(dtype) for g in grads])
    return outs, grad


def check(source, views, cos, sin, offset=0):
    """``views(t)`` picks the tensors to rotate out of ``source`` (a leaf): rotate each, then compare
    every output and the gradient of ``source`` with the float64 and same-dtype references."""
    outs = [rope(v, cos, sin, position_offset=offset) for v in views(source)]
    grads = [randn(*o.shape, dtype=o.dtype) for o in outs]
    (got,) = torch.autograd.grad(outs, [source], grads)
    ref64, g64 = reference_run(source, views, cos, sin, offset, grads, torch.float64)
    same, gsame = reference_run(source, views, cos, sin, offset, grads, source.dtype)
    for i, (o, r, s) in enumerate(zip(outs, ref64, same)):
        assert o.dtype == source.dtype and o.is_contiguous()
        assert_close(f"out{i}", o, r, s)
    assert_close("dx", got, g64, gsame)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_rope(shape, dtype, poisoned_empty):
    B, T, H, D = shape
    cos, sin = tables(T + 3, D // 2)  # a longer table: the first T rows are used
    check(randn(*shape, dtype=dtype, requires_grad=True), lambda x: [x], cos, sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rope_packed_qkv_views(dtype, poisoned_empty):
    """q and k sliced out of a packed [B, T, Hq + 2 Hkv, D] projection are read in place, GQA 6:2."""
    B, T, hq, hkv, D = 2, 9, 6, 2, 32
    qkv = randn(B, T, hq + 2 * hkv, D, dtype=dtype, requires_grad=True)
    cos, sin = tables(T, D // 2)
    check(qkv, lambda t: [t[:, :, :hq], t[:, :, hq:hq + hkv]], cos, sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rope_packed_qk_one_call(dtype, monkeypatch, poisoned_empty):
    """q and k rotated in one call as the slice qkv[:, :, :Hq + Hkv] (GQA 8:4, 12 heads); a 64-element
    tile gives 2 rows x 4 heads per program: 9 row programs x 3 head programs."""
    monkeypatch.setattr(rope_module, "_ROPE_TILE", 64)
    B, T, hq, hkv, D = 2, 9, 8, 4, 16
    qkv = randn(B, T, hq + 2 * hkv, D, dtype=dtype, requires_grad=True)
    cos, sin = tables(T, D // 2)
    check(qkv, lambda t: [t[:, :, :hq + hkv]], cos, sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rope_transposed_view(dtype, poisoned_empty):
    """x as [B, T, H, D] view of a [B, H, T, D] buffer (strides of every dim differ from contiguous)."""
    cos, sin = tables(11, 16)
    check(randn(2, 3, 11, 32, dtype=dtype, requires_grad=True), lambda t: [t.transpose(1, 2)], cos, sin)


@pytest.mark.parametrize("offset", [1, 37], ids=lambda o: f"offset{o}")
def test_rope_position_offset(offset, poisoned_empty):
    T = 5
    cos, sin = tables(offset + T + 2, 32)
    check(randn(2, T, 3, 64, requires_grad=True), lambda x: [x], cos, sin, offset)


def test_rope_decode_matches_prefill():
    """Rotating position p alone with position_offset=p equals row p of the whole sequence."""
    cos, sin = rope_cos_sin(16, 64, device=DEVICE)
    x = randn(1, 16, 2, 64)
    full = rope(x, cos, sin)
    for p in (0, 7, 15):
        # equal up to fp32 rounding: on the GPU the two launch shapes may contract multiply-adds differently
        torch.testing.assert_close(rope(x[:, p:p + 1], cos, sin, position_offset=p), full[:, p:p + 1],
                                   rtol=1e-6, atol=1e-6)


def test_rope_strided_gradient(poisoned_empty):
    """A gradient whose last dimension is strided is accepted."""
    x = randn(2, 3, 2, 8, requires_grad=True)
    cos, sin = tables(3, 4)
    dy = randn(2, 3, 2, 16)[..., ::2]
    (dx,) = torch.autograd.grad(rope(x, cos, sin), [x], dy)
    x64 = leaf(x, torch.float64)
    (g64,) = torch.autograd.grad(reference(x64, cos, sin), [x64], dy.double())
    assert_close("dx", dx, g64)


def test_rope_bwd_in_place(poisoned_empty):
    """rope_bwd(in_place=True) rotates a slice of a bigger buffer where it lies (the packed qkv gradient
    of rope_flash_attention), leaves the rest of the buffer alone, and refuses memory it cannot own."""
    from tritonllm.kernels.rope import rope_bwd

    cos, sin = tables(5, 8)
    buf = randn(2, 5, 4, 16)
    before = buf.clone()
    x64 = leaf(randn(2, 5, 3, 16), torch.float64)
    (g64,) = torch.autograd.grad(reference(x64, cos, sin), [x64], before[:, :, :3].double())
    out = rope_bwd(buf[:, :, :3], cos, sin, in_place=True)
    assert out.data_ptr() == buf.data_ptr() and out.stride() == buf.stride()
    assert_close("dx", buf[:, :, :3], g64)
    assert torch.equal(buf[:, :, 3], before[:, :, 3])
    for dy in (randn(2, 5, 3, 32)[..., ::2], randn(1, 5, 3, 16).expand(2, 5, 3, 16)):
        with pytest.raises(ValueError, match="dy: in_place needs a unit last stride and no zero strides"):
            rope_bwd(dy, cos, sin, in_place=True)


def test_rope_in_place_backward(caplog, poisoned_empty):
    """rope(in_place_backward=True) gives the reference dx both ways: rotating the gradient it is handed where
    it lies, and, for a gradient that shares elements (the expanded one of out.sum()), into a new buffer,
    said in a log line."""
    cos, sin = tables(5, 8)
    x = randn(2, 5, 3, 16, requires_grad=True)
    x64 = leaf(x, torch.float64)
    dy = randn(2, 5, 3, 16)
    (g64,) = torch.autograd.grad(reference(x64, cos, sin), [x64], dy.double())
    (dx,) = torch.autograd.grad(rope(x, cos, sin, in_place_backward=True), [x], dy.clone())
    assert_close("dx", dx, g64)
    (g64,) = torch.autograd.grad(reference(x64, cos, sin).sum(), [x64])
    rope_module._say_not_in_place.cache_clear()
    with caplog.at_level("INFO", logger="tritonllm.kernels.rope"):
        (dx,) = torch.autograd.grad(rope(x, cos, sin, in_place_backward=True).sum(), [x])
    assert_close("dx of a sum", dx, g64)
    assert "dx goes to a new buffer" in caplog.text


# ---- rope_cos_sin -------------------------------------------------------------------------------

def inv_freq_reference(D, theta, scaling):
    """float64 inv_freq and mscale written out from the formulas (YaRN as in HF transformers)."""
    i = torch.arange(D // 2, dtype=torch.float64)
    base = theta ** (-2 * i / D)
    if scaling is None:
        return base, 1.0
    f = scaling["factor"]
    if scaling["type"] == "ntk":
        return (theta * f ** (D / (D - 2))) ** (-2 * i / D), 1.0
    if scaling["type"] == "linear":
        return base / f, 1.0
    L = scaling["original_max_position"]
    if scaling["type"] == "llama3":
        a, b = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        out = []
        for freq in base.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < L / b:
                out.append(freq)
            elif wavelen > L / a:
                out.append(freq / f)
            else:
                s = (L / wavelen - a) / (b - a)
                out.append((1 - s) * freq / f + s * freq)
        return torch.tensor(out, dtype=torch.float64), 1.0

    def dim(rot):
        return D * math.log(L / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim(scaling.get("beta_fast", 32)), dim(scaling.get("beta_slow", 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    ramp = torch.clamp((i - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv = base / f * (1 - extrapolation_weight) + base * extrapolation_weight
    return inv, scaling.get("mscale") or 0.1 * math.log(f) + 1


SCALINGS = {
    "plain": None,
    "ntk": {"type": "ntk", "factor": 4.0},
    "yarn": {"type": "yarn", "factor": 8.0, "original_max_position": 256},
    "yarn_betas_mscale": {"type": "yarn", "factor": 4, "original_max_position": 512, "beta_fast": 16,
                          "beta_slow": 2, "mscale": 1.3},
    "yarn_untruncated": {"type": "yarn", "factor": 4.0, "original_max_position": 300, "truncate": False},
    "linear": {"type": "linear", "factor": 3.0},
    "llama3": {"type": "llama3", "factor": 8.0, "original_max_position": 64, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0},
}


TABLE_SHAPES = [(1, 2, 10000.0), (1000, 64, 10000.0), (123, 128, 500000.0)]  # (seq_len, head_dim, theta)


@pytest.mark.parametrize("kind,seq_len,head_dim,theta", [
    pytest.param(kind, *shape, id=f"{kind}-S{shape[0]}_D{shape[1]}_theta{shape[2]:g}")
    for kind in SCALINGS for shape in TABLE_SHAPES if not (kind == "ntk" and shape[1] == 2)  # NTK needs D > 2
])
def test_rope_cos_sin(kind, seq_len, head_dim, theta):
    scaling = SCALINGS[kind]
    cos, sin = rope_cos_sin(seq_len, head_dim, theta=theta, scaling=scaling, device=DEVICE)
    inv, mscale = inv_freq_reference(head_dim, theta, scaling)
    angle = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv[None, :]
    for name, got, ref in (("cos", cos, torch.cos(angle) * mscale), ("sin", sin, torch.sin(angle) * mscale)):
        assert got.dtype == torch.float32 and got.shape == (seq_len, head_dim // 2)
        assert_close(name, got, ref)


def test_rope_cos_sin_yarn_ramp():
    """YaRN keeps the highest frequency, divides the lowest by the factor and scales by mscale."""
    cos, sin = rope_cos_sin(2, 64, scaling={"type": "yarn", "factor": 16.0, "original_max_position": 64},
                            device=DEVICE)
    mscale = 0.1 * math.log(16.0) + 1
    angle = torch.atan2(sin[1].double(), cos[1].double())
    assert abs(angle[0].item() - 1.0) < 1e-6
    assert abs(angle[-1].item() - 10000.0 ** (-62 / 64) / 16) < 1e-9
    assert abs(math.hypot(cos[1, 0].item(), sin[1, 0].item()) - mscale) < 1e-6


# ---- bad input ----------------------------------------------------------------------------------

def _good():
    return randn(2, 4, 3, 8), *tables(4, 4)


@pytest.mark.parametrize("case,error,match", [
    ("x_3d", ValueError, "x"),
    ("odd_head_dim", ValueError, "head dim"),
    ("int_x", TypeError, "x"),
    ("int_cos", TypeError, "cos"),
    ("cos_width", ValueError, "cos"),
    ("sin_shape", ValueError, "sin"),
    ("table_too_short", ValueError, "cos"),
    ("offset_past_table", ValueError, "position_offset"),
    ("negative_offset", ValueError, "position_offset"),
    ("float_offset", TypeError, "position_offset"),
    ("strided_head_dim", ValueError, "x"),
    ("cos_wrong_device", ValueError, "cos"),
    ("x_not_tensor", TypeError, "x"),
])
def test_rope_bad_input(case, error, match):
    x, cos, sin = _good()
    kwargs = {}
    if case == "x_3d":
        x = x[0]
    elif case == "odd_head_dim":
        x = randn(2, 4, 3, 7)
    elif case == "int_x":
        x = x.to(torch.int32)
    elif case == "int_cos":
        cos = cos.to(torch.int64)
    elif case == "cos_width":
        cos, sin = tables(4, 5)
    elif case == "sin_shape":
        sin = tables(5, 4)[1]
    elif case == "table_too_short":
        cos, sin = tables(3, 4)
    elif case == "offset_past_table":
        kwargs["position_offset"] = 1
    elif case == "negative_offset":
        kwargs["position_offset"] = -1
    elif case == "float_offset":
        kwargs["position_offset"] = 1.0
    elif case == "strided_head_dim":
        x = randn(2, 4, 3, 16)[..., ::2]
    elif case == "cos_wrong_device":
        cos = cos.to("meta")
    elif case == "x_not_tensor":
        x = x.tolist()
    with pytest.raises(error, match=match):
        rope(x, cos, sin, **kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(seq_len=0, head_dim=8), ValueError, "seq_len"),
    (dict(seq_len=4, head_dim=7), ValueError, "head_dim"),
    (dict(seq_len=4, head_dim=0), ValueError, "head_dim"),
    (dict(seq_len=4, head_dim=8, theta=1.0), ValueError, "theta"),
    (dict(seq_len=4, head_dim=8, scaling={"type": "dynamic", "factor": 2.0}), ValueError, "scaling"),
    (dict(seq_len=4, head_dim=8, scaling={"factor": 2.0}), ValueError, "scaling"),
    (dict(seq_len=4, head_dim=8, scaling=2.0), TypeError, "scaling"),
    (dict(seq_len=4, head_dim=8, scaling={"type": "ntk", "factor": 0.5}), ValueError, "scaling"),
    (dict(seq_len=4, head_dim=8, scaling={"type": "ntk", "factor": 2.0, "beta_fast": 3}), ValueError, "scaling"),
    (dict(seq_len=4, head_dim=8, scaling={"type": "yarn", "factor": 2.0}), ValueError, "scaling"),
    (dict(seq_len=4, head_dim=8, scaling={"type": "yarn", "factor": 2.0, "original_max_position": 0}),
     ValueError, "scaling"),
    (dict(seq_len=4, head_dim=2, scaling={"type": "ntk", "factor": 2.0}), ValueError, "head_dim"),
    (dict(seq_len=4, head_dim=8, scaling={"type": "llama3", "factor": 8.0}), ValueError, "original_max_position"),
    (dict(seq_len=4, head_dim=8, scaling={"type": "llama3", "factor": 8.0, "original_max_position": 64,
                                          "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     ValueError, "high_freq_factor"),
    (dict(seq_len=4, head_dim=8, device="meta"), ValueError, "device"),
], ids=["seq_len0", "odd_head_dim", "head_dim0", "theta1", "unknown_type", "no_type", "not_dict", "factor_below_1",
        "unknown_key", "yarn_no_original", "yarn_original0", "ntk_head_dim2", "llama3_no_original",
        "llama3_factors_swapped", "bad_device"])
def test_rope_cos_sin_bad_input(kwargs, error, match):
    kwargs.setdefault("device", DEVICE)
    with pytest.raises(error, match=match):
        rope_cos_sin(**kwargs)


# ---- GPU: bfloat16 at benchmark shapes, long tables ------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rope_large_gqa(dtype):
    B, T, hq, hkv, D = 2, 4096, 32, 8, 128
    qkv = randn(B, T, hq + 2 * hkv, D, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(T, D, theta=500000.0, device=DEVICE)
    check(qkv, lambda t: [t[:, :, :hq], t[:, :, hq:hq + hkv]], cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_cos_sin_long(kind):
    """131072 positions: the range reduction keeps large angles accurate on the GPU."""
    scaling = SCALINGS[kind]
    cos, sin = rope_cos_sin(131072, 128, theta=500000.0, scaling=scaling, device=DEVICE)
    inv, mscale = inv_freq_reference(128, 500000.0, scaling)
    angle = torch.arange(131072, dtype=torch.float64)[:, None] * inv[None, :]
    assert_close("cos", cos, torch.cos(angle) * mscale)
    assert_close("sin", sin, torch.sin(angle) * mscale)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("offset", [0, 9], ids=lambda o: f"offset{o}")
def test_rope_device_tensor_offset(offset, dtype, poisoned_empty):
    """A 0-d int tensor offset (read by the kernel) gives the int offset's result and the float64
    reference's, output and gradient."""
    T = 3
    cos, sin = tables(offset + T + 1, 16)
    x = randn(2, T, 3, 32, requires_grad=True)
    check(x, lambda t: [t], cos, sin, torch.tensor(offset, dtype=dtype, device=DEVICE))
    with torch.no_grad():
        torch.testing.assert_close(rope(x, cos, sin, position_offset=torch.tensor(offset, dtype=dtype, device=DEVICE)),
                                   rope(x, cos, sin, position_offset=offset), rtol=0, atol=0)


@pytest.mark.parametrize("offset, error", [
    (torch.tensor([1]), "0-d"),
    (torch.tensor(1.0), "int32/int64"),
], ids=["1d", "float"])
def test_rope_bad_tensor_offset(offset, error):
    cos, sin = tables(8, 4)
    with pytest.raises(ValueError, match=f"position_offset.*{error}"):
        rope(randn(1, 2, 1, 8), cos, sin, position_offset=offset.to(DEVICE))
