"""gelu_tanh (GELU with the tanh approximation) forward and backward against float64 PyTorch, eagerly and
under torch.compile (one op each way); bad inputs."""

import pytest
import torch

from _checks import DEVICE, DTYPES, check_unary_op, dtype_id, randn
from tritonllm.bench import reference_ops as ref
from tritonllm.kernels import gelu_tanh
from tritonllm.kernels.gelu import gelu_tanh_bwd


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(1,), (1, 37), (5, 17), (3, 1000)], ids=lambda s: "x".join(map(str, s)))
def test_gelu_tanh_forward_backward(shape, dtype, poisoned_empty):
    x = randn(*shape, dtype=dtype, scale=3.0)  # both tails and the curved middle
    x.view(-1)[0] = 0.0
    check_unary_op(gelu_tanh, ref.gelu_tanh, x, randn(*shape, dtype=dtype))


# the interpreter computes in numpy, which warns on the overflowing x^3 that the kernels leave unused
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_gelu_tanh_tails_without_overflow():
    """Far out the approximation is x (right) and 0 (left), its slope 1 and 0; no inf or NaN on the way."""
    x = torch.tensor([-1e30, -80.0, 0.0, 80.0, 1e30], device=DEVICE, requires_grad=True)
    y = gelu_tanh(x)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(y.detach(), torch.tensor([0.0, 0.0, 0.0, 80.0, 1e30], device=DEVICE))
    assert torch.equal(dx, torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0], device=DEVICE))


def test_gelu_tanh_compiles_to_one_op_each_way():
    """Under torch.compile (fullgraph) the forward and backward are the two custom ops, with eager's values."""
    x = randn(4, 24, requires_grad=True)
    dy = randn(4, 24)
    graphs = []
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(gelu_tanh, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    y = compiled(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    y_eager = gelu_tanh(x)
    (dx_eager,) = torch.autograd.grad(y_eager, x, dy)
    assert torch.equal(y, y_eager) and torch.equal(dx, dx_eager)
    ops = [node.target._opname for gm in graphs for node in gm.graph.nodes
           if node.op == "call_function" and hasattr(node.target, "_opname")]
    assert ops.count("gelu_tanh_fwd") == 1 and ops.count("gelu_tanh_bwd") == 1, ops


def test_gelu_tanh_opcheck():
    x = randn(5, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.tritonllm.gelu_tanh_fwd.default, (x,))
    torch.library.opcheck(torch.ops.tritonllm.gelu_tanh_bwd.default, (x.detach(), randn(5, 16)))


def test_gelu_tanh_bad_inputs():
    with pytest.raises(ValueError, match="x must be contiguous"):
        gelu_tanh(randn(4, 6).t())
    with pytest.raises(TypeError, match="x has dtype int64"):
        gelu_tanh(torch.ones(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        gelu_tanh([1.0, 2.0])
    with pytest.raises(ValueError, match=r"dy has shape \(3, 4\) but x has \(4, 3\)"):
        gelu_tanh_bwd(randn(4, 3), randn(3, 4))
    assert gelu_tanh(randn(0, 5)).shape == (0, 5)
