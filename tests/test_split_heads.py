"""split_heads: views forward, Triton-packed gradient backward, against PyTorch's split."""

import pytest
import torch

from _checks import DTYPES, dtype_id, randn
from tritonllm.kernels import split_heads


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,sizes", [((2, 5, 6, 64), (4, 1, 1)), ((1, 17, 12, 32), (6, 3, 3)),
                                         ((3, 1, 3, 2), (1, 1, 1)), ((1, 7, 10, 96), (8, 2))],
                         ids=lambda v: "x".join(map(str, v)))
def test_split_heads_matches_split(shape, sizes, dtype):
    x = randn(*shape, dtype=dtype, requires_grad=True)
    outs = split_heads(x, sizes)
    ref = x.detach().split(list(sizes), dim=2)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.data_ptr() == r.data_ptr() and o.shape == r.shape, f"group {i} is not a view"
    grads = [randn(*o.shape, dtype=dtype) for o in outs]
    (dx,) = torch.autograd.grad(outs, x, grads)
    assert torch.equal(dx, torch.cat(grads, dim=2)), "packed gradient differs from the concatenation"


def test_unused_group_gets_zero_gradient():
    x = randn(2, 3, 6, 8, requires_grad=True)
    q, k, v = split_heads(x, (4, 1, 1))
    g = randn(*q.shape)
    (dx,) = torch.autograd.grad(q, x, g)
    assert torch.equal(dx[:, :, :4], g) and not dx[:, :, 4:].any()


def test_bad_sizes_named():
    x = randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="sizes"):
        split_heads(x, (4, 1))
    with pytest.raises(ValueError, match="x must have 4"):
        split_heads(x[0], (4, 2))


def test_split_heads_no_grad_views_and_cached_plans():
    """Under no_grad the groups are plain views (no autograd node); with gradients, a second shape
    and another stride of the same shape each get their own pack plan and the right gradient."""
    x = randn(2, 3, 6, 8)
    with torch.no_grad():
        outs = split_heads(x.requires_grad_(), (4, 1, 1))
    assert all(o.grad_fn is None and o._base is x for o in outs)
    for shape in ((2, 3, 6, 8), (1, 5, 6, 8), (2, 3, 6, 8)):
        for base in (randn(*shape), randn(shape[0], shape[1] * 2, *shape[2:])[:, ::2]):
            x = base.requires_grad_() if base.is_leaf else base.detach().requires_grad_()
            outs = split_heads(x, (4, 1, 1))
            grads = [randn(*o.shape) for o in outs]
            (dx,) = torch.autograd.grad(outs, x, grads)
            assert torch.equal(dx, torch.cat(grads, dim=2))
