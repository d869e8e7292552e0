"""swiglu, two-tensor and packed forms, against a float64 PyTorch reference: output, dgate, dup / dgate_up."""

import importlib

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, dtype_id, non_contiguous, randn
from tritonllm.bench.reference_ops import swiglu as reference
from tritonllm.kernels import swiglu

# the module, not the function of the same name that tritonllm.kernels exports
swiglu_module = importlib.import_module("tritonllm.kernels.swiglu")

# shapes of y ([..., F]); the packed input is [..., 2F]
SHAPES = [(1, 123), (5, 123), (17, 1000), (3, 3000), (4, 2, 64), (7, 1)]


def shape_id(shape):
    return "x".join(map(str, shape))


def check(*inputs):
    """Kernel vs float64 and same-dtype references on the same inputs and the same random dy."""
    names = ["gate", "up"] if len(inputs) == 2 else ["gate_up"]
    y = swiglu(*inputs)
    dy = randn(*y.shape, dtype=y.dtype)
    got = torch.autograd.grad(y, inputs, dy)
    ins64 = [t.detach().double().requires_grad_() for t in inputs]
    ins_same = [t.detach().clone().requires_grad_() for t in inputs]
    y64, y_same = reference(*ins64), reference(*ins_same)
    assert_close("y", y, y64, y_same)
    ref64 = torch.autograd.grad(y64, ins64, dy.double())
    ref_same = torch.autograd.grad(y_same, ins_same, dy)
    for name, t, g, g64, gs in zip(names, inputs, got, ref64, ref_same):
        assert g.shape == t.shape and g.dtype == t.dtype
        assert_close("d" + name, g, g64, gs)


@pytest.mark.parametrize("packed", [False, True], ids=["gate_up_pair", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_swiglu(shape, dtype, packed, poisoned_empty):
    if packed:
        check(randn(*shape[:-1], 2 * shape[-1], dtype=dtype, requires_grad=True))
    else:
        check(randn(*shape, dtype=dtype, requires_grad=True), randn(*shape, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("packed", [False, True], ids=["gate_up_pair", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_swiglu_non_contiguous_rows(dtype, packed, poisoned_empty):
    if packed:
        x = non_contiguous(randn(17, 2000, dtype=dtype, requires_grad=True))
        assert not x.is_contiguous()
        check(x)
    else:
        gate = non_contiguous(randn(17, 1000, dtype=dtype, requires_grad=True))
        assert not gate.is_contiguous()
        check(gate, randn(17, 1000, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("packed", [False, True], ids=["gate_up_pair", "packed"])
def test_swiglu_small_tiles(packed, monkeypatch, poisoned_empty):
    """Tiny tiles: many programs, ragged row and column blocks in both the flat and strided paths."""
    monkeypatch.setattr(swiglu_module, "_INTERP_TILE", 64)
    if packed:
        check(randn(13, 2, 2 * 37, requires_grad=True))
    else:
        check(randn(13, 2, 37, requires_grad=True), randn(13, 2, 37, requires_grad=True))


def test_swiglu_no_rows():
    x = randn(0, 16, requires_grad=True)
    y = swiglu(x)
    (dx,) = torch.autograd.grad(y, x, torch.empty_like(y))
    assert y.shape == (0, 8) and dx.shape == (0, 16)


@pytest.mark.parametrize("case", ["gate_not_tensor", "gate_int", "gate_float64", "up_wrong_device", "up_shape",
                                  "up_dtype", "gate_up_odd", "gate_up_int"])
def test_swiglu_bad_input(case):
    gate, up, error = randn(4, 8), randn(4, 8), ValueError
    name = "gate_up" if case.startswith("gate_up") else case.split("_")[0]
    if case == "gate_not_tensor":
        gate, error = gate.tolist(), TypeError
    elif case == "gate_int":
        gate, error = torch.ones(4, 8, dtype=torch.int32, device=DEVICE), TypeError
    elif case == "gate_float64":
        gate, error = gate.double(), TypeError
    elif case == "up_wrong_device":
        up = torch.empty(4, 8, device="meta")
    elif case == "up_shape":
        up = randn(4, 9)
    elif case == "up_dtype":
        up, error = randn(4, 8, dtype=torch.float16), TypeError
    elif case == "gate_up_odd":
        gate, up = randn(4, 9), None
    elif case == "gate_up_int":
        gate, up, error = torch.ones(4, 8, dtype=torch.int64, device=DEVICE), None, TypeError
    with pytest.raises(error, match=rf"\b{name}\b"):
        swiglu(gate, up)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["gate_up_pair", "packed"])
def test_swiglu_large_bf16(packed):
    if packed:
        check(randn(4096, 2 * 4096, dtype=torch.bfloat16, requires_grad=True))
    else:
        check(randn(4096, 4096, dtype=torch.bfloat16, requires_grad=True),
              randn(4096, 4096, dtype=torch.bfloat16, requires_grad=True))


def test_swiglu_launch_plans_follow_every_argument(poisoned_empty):
    """Cached launch plans: one shape in turn as two tensors, packed, row-strided and in another
    dtype (each planned, then from the plan) gives the right output and gradients; under no_grad no
    autograd node is made."""
    swiglu_module._PLANS.clear()
    for _ in range(2):
        check(randn(17, 100, requires_grad=True), randn(17, 100, requires_grad=True))
        check(randn(17, 200, requires_grad=True))
        check(non_contiguous(randn(17, 100, requires_grad=True)), randn(17, 100, requires_grad=True))
        check(randn(17, 100, dtype=torch.float16, requires_grad=True),
              randn(17, 100, dtype=torch.float16, requires_grad=True))
    # forward and backward of the two-tensor form, the packed form and the strided rows (fp16 shares
    # the fp32 plans: the dtype is the Launch's business)
    assert len(swiglu_module._PLANS) == 6
    gate, up = randn(5, 33), randn(5, 33)
    with torch.no_grad():
        y = swiglu(gate.requires_grad_(), up)
    assert y.grad_fn is None
    assert_close("no_grad y", y, reference(gate.detach().double(), up.double()), reference(gate.detach(), up))
