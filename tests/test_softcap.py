"""softcap (logit soft-capping, cap * tanh(x / cap)) forward and backward against float64 PyTorch;
bad inputs."""

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, dtype_id, randn
from tritonllm.bench import reference_ops as ref
from tritonllm.kernels.softcap import softcap


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,cap", [((1,), 1.0), ((5, 17), 15.0), ((3, 1000), 2.5)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"cap{v}")
def test_softcap_forward_backward(shape, cap, dtype, poisoned_empty):
    x = randn(*shape, dtype=dtype, scale=2 * cap)  # well into the saturated range
    x.view(-1)[0] = 0.0
    x = x.requires_grad_(True)
    dy = randn(*shape, dtype=dtype)
    y = softcap(x, cap)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_(True)
    y64 = ref.softcap(x64, cap)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    xs = x.detach().clone().requires_grad_(True)
    ys = ref.softcap(xs, cap)
    (dxs,) = torch.autograd.grad(ys, xs, dy)
    assert_close("y", y, y64, ys)
    assert_close("dx", dx, dx64, dxs)


def test_softcap_saturates_without_overflow():
    x = torch.tensor([-1e30, -80.0, 0.0, 80.0, 1e30], device=DEVICE)
    y = softcap(x, 2.0)
    assert torch.equal(y, torch.tensor([-2.0, -2.0, 0.0, 2.0, 2.0], device=DEVICE))


def test_softcap_bad_inputs():
    with pytest.raises(ValueError, match="x"):
        softcap(randn(4, 6).t(), 1.0)
    with pytest.raises(TypeError, match="x"):
        softcap(torch.ones(3, dtype=torch.int64, device=DEVICE), 1.0)
    for cap in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="cap"):
            softcap(randn(3), cap)
    assert softcap(randn(0, 5), 1.0).shape == (0, 5)
