"""weighted_add, fork and add_fork (kernels/residual_mix.py) against float64 PyTorch: outputs and
the gradients of x, y and the weights on odd shapes, strided rows, one row, empty; bad inputs."""

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, dtype_id, non_contiguous, randn
from tritonllm.bench.reference_ops import weighted_add as ref_weighted_add
from tritonllm.kernels.residual_mix import add_fork, fork, weighted_add

SHAPES = [(1, 1), (5, 17), (3, 7, 100), (2, 3, 2, 300)]


def _shape_id(s):
    return "x".join(map(str, s))


@pytest.mark.parametrize("n_weights", [1, 2], ids=["x+by", "ax+by"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_weighted_add(shape, dtype, n_weights, poisoned_empty):
    x = randn(*shape, dtype=dtype, requires_grad=True)
    y = randn(*shape, dtype=dtype, requires_grad=True)
    w = randn(n_weights, requires_grad=True)
    dout = randn(*shape, dtype=dtype)
    out = weighted_add(x, y, w)
    grads = torch.autograd.grad(out, [x, y, w], dout)

    ins64 = [t.detach().double().requires_grad_() for t in (x, y, w)]
    out64 = ref_weighted_add(*ins64)
    g64 = torch.autograd.grad(out64, ins64, dout.double())
    same = [t.detach().clone().requires_grad_() for t in (x, y)] + [w.detach().to(dtype).requires_grad_()]
    out_same = ref_weighted_add(*same)
    g_same = torch.autograd.grad(out_same, same, dout)
    assert out.is_contiguous() and out.dtype == dtype
    assert_close("out", out, out64, out_same)
    for name, g, r, s in zip(("dx", "dy", "dw"), grads, g64, g_same):
        assert_close(name, g, r, s, dtype=dtype)


def test_weighted_add_strided_head_slice_and_determinism():
    """y a head slice of a packed [B, T, heads, D] projection (strided rows), as the value mix
    reads v; the weight gradient reduced in a fixed order (bitwise equal on a rerun)."""
    packed = randn(2, 9, 5, 16, requires_grad=True)
    v = packed[:, :, 3:5]
    ve = randn(2, 9, 2, 16, requires_grad=True)
    w = torch.tensor([0.7, -0.4], device=DEVICE, requires_grad=True)
    dout = randn(2, 9, 2, 16)
    out = weighted_add(v, ve, w)
    first = torch.autograd.grad(out, [packed, ve, w], dout, retain_graph=True)
    second = torch.autograd.grad(out, [packed, ve, w], dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    ins64 = [t.detach().double().requires_grad_() for t in (packed, ve, w)]
    ref = ins64[2][0] * ins64[0][:, :, 3:5] + ins64[2][1] * ins64[1]
    assert_close("out", out, ref)
    for name, g, r in zip(("dpacked", "dve", "dw"), first, torch.autograd.grad(ref, ins64, dout.double())):
        assert_close(name, g, r)


def test_weighted_add_empty_and_no_grad():
    x, y = randn(0, 8, requires_grad=True), randn(0, 8, requires_grad=True)
    w = randn(2, requires_grad=True)
    out = weighted_add(x, y, w)
    dx, dy, dw = torch.autograd.grad(out, [x, y, w], torch.ones_like(out))
    assert out.shape == (0, 8) and dx.shape == (0, 8) and torch.equal(dw, torch.zeros_like(dw))
    with torch.no_grad():
        a, b = randn(3, 4), randn(3, 4)
        assert_close("no_grad", weighted_add(a, b, torch.tensor([2.0], device=DEVICE)), (a + 2 * b).double())


def test_fork_sums_gradients():
    x = non_contiguous(randn(6, 33, requires_grad=True))
    a, b = fork(x)
    assert a.data_ptr() == x.data_ptr() == b.data_ptr()
    ga, gb = randn(6, 33), randn(6, 33)
    (dx,) = torch.autograd.grad([a, b], [x], [ga, gb])
    assert_close("dx", dx, ga.double() + gb.double())
    a, _ = fork(x)  # one branch unused: its gradient is None
    (dx,) = torch.autograd.grad(a, [x], ga)
    assert_close("dx one branch", dx, ga.double())


def test_add_fork():
    x, y = randn(4, 3, 50, requires_grad=True), randn(4, 3, 50, requires_grad=True)
    x1, y1, s = add_fork(x, y)
    assert x1.data_ptr() == x.data_ptr() and y1.data_ptr() == y.data_ptr()
    assert_close("sum", s, x.double() + y.double())
    gx, gy, gs = randn(4, 3, 50), randn(4, 3, 50), randn(4, 3, 50)
    dx, dy = torch.autograd.grad([x1, y1, s], [x, y], [gx, gy, gs])
    assert_close("dx", dx, gx.double() + gs.double())
    assert_close("dy", dy, gy.double() + gs.double())


def test_bad_inputs():
    x = randn(3, 4)
    with pytest.raises(ValueError, match="y"):
        weighted_add(x, randn(3, 5), randn(1))
    with pytest.raises(TypeError, match="y"):
        weighted_add(x, randn(3, 4, dtype=torch.float16), randn(1))
    with pytest.raises(ValueError, match="weight"):
        weighted_add(x, randn(3, 4), randn(3))
    with pytest.raises(ValueError, match="weight"):
        weighted_add(x, randn(3, 4), randn(1, 1))
    with pytest.raises(TypeError, match="x"):
        fork(torch.ones(3, dtype=torch.int64, device=DEVICE))
