"""rms_norm (and the fused residual add) against a float64 PyTorch reference: output, dx, dweight, dresidual."""

import importlib

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, dtype_id, non_contiguous, randn
from tritonllm.bench.reference_ops import rms_norm as ref_rms_norm
from tritonllm.kernels import rms_norm

# the module, not the function of the same name that tritonllm.kernels exports
rms_norm_module = importlib.import_module("tritonllm.kernels.rms_norm")

EPS = 1e-6
# 1 row, odd widths, 3-D input, N=1, several programs, and rows longer than one register block
# (20000 and 65536 take the two-pass loop).
SHAPES = [(1, 123), (5, 123), (17, 1000), (3, 3000), (4, 2, 64), (7, 1), (600, 100), (3, 20000), (2, 65536)]


def shape_id(shape):
    return "x".join(map(str, shape))


def reference(x, weight, residual=None, eps=EPS):
    """(y, h) of the shared reference in the inputs' dtype (h = x without a residual)."""
    out = ref_rms_norm(x, weight, eps, residual)
    return out if residual is not None else (out, x)


def leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).requires_grad_()


def check(x, weight, residual=None, use=("y", "h")):
    """Run the kernel and the float64 / same-dtype references on the same inputs, with random
    gradients on the outputs named in ``use``; compare the output(s) and every gradient by name."""
    names = ["x", "weight"] + (["residual"] if residual is not None else [])
    inputs = [x, weight] + ([residual] if residual is not None else [])
    out = rms_norm(x, weight, EPS, residual)
    outs = out if residual is not None else (out,)
    grads = [randn(*o.shape, dtype=o.dtype) for o in outs]
    keep = [i for i, n in enumerate(("y", "h")[:len(outs)]) if n in use]

    def run(tensors, result):
        ys = result if residual is not None else result[:1]
        return torch.autograd.grad([ys[i] for i in keep], tensors, [grads[i].to(ys[i].dtype) for i in keep],
                                   allow_unused=True, materialize_grads=True)

    got = run(inputs, outs)
    ins64 = [leaf(t, torch.float64) for t in inputs]
    ref64 = reference(*ins64[:2], ins64[2] if residual is not None else None)
    ins_same = [leaf(t) for t in inputs]
    same = reference(*ins_same[:2], ins_same[2] if residual is not None else None)
    assert_close("y", outs[0], ref64[0], same[0])
    if residual is not None:
        assert_close("h", outs[1], ref64[1], same[1])
    for name, g, g64, gs in zip(names, got, run(ins64, ref64), run(ins_same, same)):
        assert g.dtype == ({"weight": weight.dtype}.get(name, x.dtype))
        assert_close("d" + name, g, g64, gs)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_rms_norm(shape, dtype, residual, poisoned_empty):
    x = randn(*shape, dtype=dtype, requires_grad=True)
    weight = randn(shape[-1], dtype=dtype, scale=0.5).add(1.0).requires_grad_()
    r = randn(*shape, dtype=dtype, requires_grad=True) if residual else None
    check(x, weight, r)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rms_norm_non_contiguous_rows(dtype, residual, poisoned_empty):
    x = non_contiguous(randn(17, 1000, dtype=dtype, requires_grad=True))
    assert not x.is_contiguous()
    weight = randn(1000, dtype=dtype, scale=0.5).add(1.0).requires_grad_()
    r = non_contiguous(randn(17, 1000, dtype=dtype, requires_grad=True)) if residual else None
    check(x, weight, r)


@pytest.mark.parametrize("use", [("y",), ("h",)], ids=["only_y_used", "only_h_used"])
def test_rms_norm_residual_one_output_used(use, poisoned_empty):
    x = randn(5, 123, requires_grad=True)
    r = randn(5, 123, requires_grad=True)
    check(x, randn(123, requires_grad=True), r, use=use)


def test_rms_norm_float32_weight_half_input(poisoned_empty):
    check(randn(17, 100, dtype=torch.float16, requires_grad=True), randn(100, requires_grad=True))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_small_blocks(residual, monkeypatch, poisoned_empty):
    """Tiny register blocks on a small problem: the two-pass loop with a ragged last chunk, many
    persistent programs and a multi-step partial-dW reduction, all cheap under the interpreter."""
    monkeypatch.setattr(rms_norm_module, "_MAX_BLOCK_N", 128)
    monkeypatch.setattr(rms_norm_module, "_INTERP_TILE", 512)
    x = randn(37, 300, requires_grad=True)
    r = randn(37, 300, requires_grad=True) if residual else None
    check(x, randn(300, requires_grad=True), r)


@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_backward_tiles(prefetch, residual, monkeypatch, poisoned_empty):
    """Many row tiles per persistent backward program (4-row tiles, 51 of them, the last ragged,
    over 8 programs), with and without loading the next tile before the current tile's math."""
    monkeypatch.setattr(rms_norm_module, "_INTERP_TILE", 512)
    monkeypatch.setattr(rms_norm_module, "_BWD_PREFETCH", prefetch)
    x = randn(203, 100, requires_grad=True)
    r = randn(203, 100, requires_grad=True) if residual else None
    check(x, randn(100, requires_grad=True), r)


def test_rms_norm_weight_grad_deterministic():
    x = randn(600, 100, requires_grad=True)
    weight = randn(100, requires_grad=True)
    dy = randn(600, 100)
    first, second = (torch.autograd.grad(rms_norm(x, weight), weight, dy)[0] for _ in range(2))
    assert torch.equal(first, second)


def test_rms_norm_no_rows():
    x = randn(0, 64, requires_grad=True)
    weight = randn(64, requires_grad=True)
    y = rms_norm(x, weight)
    dx, dw = torch.autograd.grad(y, (x, weight), torch.empty_like(y))
    assert y.shape == (0, 64) and dx.shape == (0, 64)
    assert torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("case", ["x_not_tensor", "x_int", "x_float64", "weight_wrong_device", "weight_shape",
                                  "weight_2d", "residual_shape", "residual_dtype", "eps_negative"])
def test_rms_norm_bad_input(case):
    x, w, r, eps = randn(4, 8), randn(8), None, EPS
    error, name = ValueError, case.split("_")[0]
    if case == "x_not_tensor":
        x, error = x.tolist(), TypeError
    elif case == "x_int":
        x, error = torch.ones(4, 8, dtype=torch.int32, device=DEVICE), TypeError
    elif case == "x_float64":
        x, error = x.double(), TypeError
    elif case == "weight_wrong_device":
        w = torch.empty(8, device="meta")
    elif case == "weight_shape":
        w = randn(7)
    elif case == "weight_2d":
        w = randn(1, 8)
    elif case == "residual_shape":
        r = randn(4, 9)
    elif case == "residual_dtype":
        r, error = randn(4, 8, dtype=torch.float16), TypeError
    elif case == "eps_negative":
        eps = -1.0
    with pytest.raises(error, match=rf"\b{name}\b"):
        rms_norm(x, w, eps, r)


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_large_bf16(residual):
    x = randn(4096, 4096, dtype=torch.bfloat16, requires_grad=True)
    weight = randn(4096, dtype=torch.bfloat16, scale=0.5).add(1.0).requires_grad_()
    r = randn(4096, 4096, dtype=torch.bfloat16, requires_grad=True) if residual else None
    check(x, weight, r)


def test_rms_norm_launch_plans_follow_every_argument(poisoned_empty):
    """The cached launch plans: a second call with another shape, dtype, row stride, residual or eps
    gets a plan of its own (or none needed for eps, a runtime argument) and the right result; no
    autograd node is made when nothing needs a gradient."""
    rms_norm_module._FWD_PLANS.clear()
    x = randn(17, 1000, dtype=torch.float32)
    w = randn(1000, dtype=torch.float32, scale=0.5).add(1.0)
    xh = randn(5, 123, dtype=torch.float16)
    wh = randn(123, dtype=torch.float16, scale=0.5).add(1.0)
    strided = non_contiguous(x)
    r = randn(17, 1000, dtype=torch.float32)
    for name, args, eps in [("first", (x, w), EPS), ("other shape and dtype", (xh, wh), EPS),
                            ("row-strided", (strided, w), EPS), ("residual", (x, w, r), EPS),
                            ("first again", (x, w), EPS), ("another eps", (x, w), 0.5)]:
        out = rms_norm(args[0], args[1], eps, *args[2:])
        ins64 = [t.double() for t in args]
        ref64 = reference(*ins64[:2], ins64[2] if len(args) > 2 else None, eps=eps)
        same = reference(*args[:2], args[2] if len(args) > 2 else None, eps=eps)
        if len(args) > 2:
            assert_close(f"{name}: h", out[1], ref64[1], same[1])
            out = out[0]
        assert out.grad_fn is None, name
        assert_close(f"{name}: y", out, ref64[0], same[0])
    # first, other shape and dtype, row-strided (x's row stride 2000), residual; eps is no key
    assert len(rms_norm_module._FWD_PLANS) == 4
    # and the backward of a plan reused under autograd
    check(randn(17, 1000, requires_grad=True), w.clone().requires_grad_())


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_no_grad_allocates_only_outputs(residual, monkeypatch):
    """Without a backward to come the forward allocates y (and h) only: no rstd (host time)."""
    x, w = randn(5, 123), randn(123, scale=0.5).add(1.0)
    r = randn(5, 123) if residual else None
    empty, shapes = torch.empty, []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: shapes.append(tuple(a[0])) or empty(*a, **k))
    with torch.no_grad():
        out = rms_norm(x, w, EPS, r)
    monkeypatch.undo()
    assert shapes == [(5, 123)] * (2 if residual else 1)
    y, h = out if residual else (out, None)
    ins64 = [t.double() for t in (x, w)] + ([r.double()] if residual else [])
    ref64 = reference(*ins64[:2], ins64[2] if residual else None)
    same = reference(x, w, r)
    assert_close("y", y, ref64[0], same[0])
    if residual:
        assert_close("h", h, ref64[1], same[1])
