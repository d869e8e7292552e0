"""cross_entropy against a float64 PyTorch reference (F.cross_entropy plus the z-loss term)."""

import functools

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, dtype_id, non_contiguous, randn
from tritonllm.bench.reference_ops import cross_entropy as ref_cross_entropy
from tritonllm.kernels import cross_entropy

IGNORE = -100
#: (loss, z-loss term) by PyTorch ops in logits' dtype
reference = functools.partial(ref_cross_entropy, return_z_loss=True)


def make_target(shape, V, ignore_every=4, ignore_index=IGNORE, dtype=torch.int64):
    t = torch.randint(0, V, shape, device=DEVICE)
    if ignore_every:
        t.view(-1)[1::ignore_every] = ignore_index
    return t.to(dtype)


def check(logits, target, scale=1.7, **opts):
    """Loss and dlogits of cross_entropy(logits, target, **opts) vs float64, with PyTorch's error in
    logits' dtype as the yardstick."""
    loss = cross_entropy(logits, target, **opts)
    dloss = randn(*loss.shape, device=loss.device) if loss.dim() else torch.full((), scale, device=loss.device)
    (dx,) = torch.autograd.grad(loss, logits, dloss)
    grads = {}
    for name, x in (("ref64", logits.detach().double()), ("same", logits.detach().clone())):
        x.requires_grad_(True)
        out, _ = reference(x, target, **opts)
        grads[name] = (out, torch.autograd.grad(out, x, dloss.to(out.dtype))[0])
    assert loss.dtype == torch.float32
    assert_close("loss", loss, grads["ref64"][0], same=grads["same"][0], dtype=logits.dtype)
    assert_close("dlogits", dx, grads["ref64"][1], same=grads["same"][1])
    return loss, dx


SHAPES = [(n, v) for n in (1, 5, 123) for v in (2, 17, 1000, 3000)]
OPTS = {
    "mean": dict(reduction="mean"),
    "sum-ls0.1": dict(reduction="sum", label_smoothing=0.1),
    "none-z1e-4": dict(reduction="none", z_loss=1e-4),
    "mean-ls0.1-z1e-4": dict(reduction="mean", label_smoothing=0.1, z_loss=1e-4),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cross_entropy(shape, dtype):
    N, V = shape
    names = list(OPTS)
    opts = OPTS[names[(N + V) % len(names)]]
    logits = randn(N, V, dtype=dtype, scale=3.0, requires_grad=True)
    check(logits, make_target((N,), V, ignore_every=4 if N > 1 else 0), **opts)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("opts", list(OPTS.values()), ids=list(OPTS))
def test_options(opts, dtype):
    logits = randn(33, 1000, dtype=dtype, scale=3.0, requires_grad=True)
    check(logits, make_target((33,), 1000, ignore_every=3), **opts)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignore_index_inside_vocab(reduction):
    """A pad id inside [0, V) as ignore_index: those rows are skipped, others count."""
    logits = randn(21, 100, requires_grad=True)
    check(logits, make_target((21,), 100, ignore_every=2, ignore_index=0), ignore_index=0, reduction=reduction,
          label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction):
    logits = randn(6, 50, requires_grad=True)
    target = torch.full((6,), IGNORE, device=DEVICE)
    loss, z = cross_entropy(logits, target, reduction=reduction, z_loss=1e-3, return_z_loss=True)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(z, torch.zeros_like(z))
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_z_loss(reduction):
    logits = randn(40, 300, scale=4.0, requires_grad=True)
    target = make_target((40,), 300)
    opts = dict(reduction=reduction, z_loss=1e-3, label_smoothing=0.1)
    loss, z = cross_entropy(logits, target, return_z_loss=True, **opts)
    ref_loss, ref_z = reference(logits.detach().double(), target, **opts)
    assert not z.requires_grad and z.dtype == torch.float32
    assert_close("loss", loss, ref_loss, dtype=torch.float32)
    assert_close("z_loss", z, ref_z, dtype=torch.float32)


@pytest.mark.parametrize("layout", ["row-strided", "3d", "3d-transposed"])
def test_layouts(layout):
    """Leading dimensions are flattened; non-contiguous logits are read through their strides."""
    if layout == "row-strided":
        logits = non_contiguous(randn(37, 513))
        target = make_target((37,), 513)
    elif layout == "3d":
        logits = randn(3, 7, 129)
        target = make_target((3, 7), 129)
    else:
        logits = randn(7, 3, 129).transpose(0, 1)
        target = make_target((3, 7), 129)
    logits.requires_grad_(True)
    check(logits, target, reduction="none", label_smoothing=0.1)
    check(logits, target, reduction="mean", z_loss=1e-4)


def test_int32_target():
    logits = randn(50, 77, requires_grad=True)
    check(logits, make_target((50,), 77, dtype=torch.int32), label_smoothing=0.1, z_loss=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_inplace_backward(reduction):
    """inplace_backward=True returns the same gradient, written into the logits' own storage."""
    x = randn(29, 1500, scale=2.0)
    target = make_target((29,), 1500)
    opts = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-4)
    standard = x.clone().requires_grad_(True)
    loss_ref = cross_entropy(standard, target, **opts)
    loss_ref.sum().backward()
    inplace = x.clone().requires_grad_(True)
    loss = cross_entropy(inplace, target, inplace_backward=True, **opts)
    loss.sum().backward()
    assert torch.equal(loss, loss_ref)
    assert torch.equal(inplace.grad, standard.grad)
    assert inplace.grad.data_ptr() == inplace.data_ptr()


def test_bad_inputs():
    x = randn(4, 10)
    t = make_target((4,), 10, ignore_every=0)
    with pytest.raises(ValueError, match="logits"):
        cross_entropy(randn(10), t[:1])
    with pytest.raises(TypeError, match="logits"):
        cross_entropy(x.long(), t)
    with pytest.raises(TypeError, match="target"):
        cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="target"):
        cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, t, reduction="avg")
    for ls in (1.0, -0.1):
        with pytest.raises(ValueError, match="label_smoothing"):
            cross_entropy(x, t, label_smoothing=ls)
    with pytest.raises(ValueError, match="z_loss"):
        cross_entropy(x, t, z_loss=-1.0)
    for bad in (10, -5):
        t_bad = t.clone()
        t_bad[2] = bad
        with pytest.raises(ValueError, match="target"):
            cross_entropy(x, t_bad)


def _check_rows(logits, target, rows, loss, dloss, dx):
    """Loss and dlogits of the given rows against float64 (each row depends on itself only)."""
    x64 = logits[rows].double().requires_grad_(True)
    ref, _ = reference(x64, target[rows], reduction="none")
    (ref_dx,) = torch.autograd.grad(ref, x64, dloss[rows].double())
    assert_close("loss", loss[rows], ref, dtype=logits.dtype)
    assert_close("dlogits", dx[rows], ref_dx, dtype=logits.dtype)


@pytest.mark.gpu
def test_vocab_131072():
    logits = randn(64, 131072, dtype=torch.bfloat16, scale=2.0, requires_grad=True)
    check(logits, make_target((64,), 131072), label_smoothing=0.1, z_loss=1e-4)


@pytest.mark.gpu
def test_more_than_2_pow_31_elements():
    N, V = 16400, 131072
    assert N * V > 2**31
    logits = torch.randn(N, V, dtype=torch.bfloat16, device=DEVICE)
    target = make_target((N,), V)
    logits.requires_grad_(True)
    loss = cross_entropy(logits, target, reduction="none")
    dloss = randn(N)
    (dx,) = torch.autograd.grad(loss, logits, dloss)
    rows = torch.tensor([0, 2, N // 2, 16384, N - 2, N - 1], device=DEVICE)
    _check_rows(logits.detach(), target, rows, loss.detach(), dloss, dx)


def test_unvalidated_targets_do_not_synchronise(monkeypatch):
    """validate=False reads no flag on the host (no .item()); an out-of-range target then adds 0,
    as its row would if ignored, and the valid rows are unchanged."""
    x = randn(6, 50, requires_grad=True)
    t = make_target((6,), 50, ignore_every=0)
    t[3] = 50
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("validate=False synchronised"))
    loss = cross_entropy(x, t, reduction="none", validate=False)
    monkeypatch.undo()
    t_ignored = t.clone()
    t_ignored[3] = IGNORE
    ref64, _ = reference(x.detach().double(), t_ignored, reduction="none")
    same, _ = reference(x.detach(), t_ignored, reduction="none")
    assert_close("loss", loss, ref64, same=same)


def test_launch_plans_follow_every_argument():
    """Cached launch plans: one problem in turn with another vocabulary, dtype, row stride,
    ignore_index, option and reduction (each planned, then from the plan) gives the right loss and
    gradient every time; under no_grad no autograd node is made."""
    for V, dtype, strided, opts in [(1000, torch.float32, False, {}), (17, torch.float16, False, {}),
                                    (1000, torch.float32, True, {}), (1000, torch.float32, False, {"ignore_index": 3}),
                                    (1000, torch.float32, False, {"label_smoothing": 0.1}),
                                    (1000, torch.float32, False, {"reduction": "sum"})]:
        for _ in range(2):
            logits = randn(9, V, dtype=dtype, requires_grad=True)
            if strided:
                logits = non_contiguous(logits)
            check(logits, make_target((9,), V, ignore_index=opts.get("ignore_index", IGNORE)), **opts)
    x = randn(9, 1000)
    t = make_target((9,), 1000)
    with torch.no_grad():
        loss = cross_entropy(x.requires_grad_(), t)
    assert loss.grad_fn is None
    assert_close("no_grad loss", loss, reference(x.detach().double(), t)[0], same=reference(x.detach(), t)[0])
