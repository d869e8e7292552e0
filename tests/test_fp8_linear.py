"""FP8 linear layers (kernels.fp8_linear, tritonllm.nn.fp8, trainer.precision=fp8).

Each GEMM of the layer (forward y = x W^T, dx = dy W, dW = dy^T x) is checked against the float64
product of its dequantized operands: the operands are quantized by a float32 PyTorch twin of the
kernel's rounding steps and cast to fp8 by PyTorch (round to nearest even), so the only difference
left is the kernel's fp32 accumulation and the output's rounding. On the CPU the interpreter runs the
same math with the fp8 values held in float32 (kernels.fp8.fp8_round), on the GPU with fp8 tensors.
The whole layer against the unquantized float64 product: within the error e4m3 implies.
"""

import pytest
import torch

from _checks import DEVICE, ON_GPU, randn
from test_lm_head_fp8 import quantize_ref
from test_train import TINY, compose_train, data_overrides, read_metrics  # noqa: F401 (fixture)

from tritonllm.errors import ConfigError
from tritonllm.kernels.fp8 import FP8_MAX
from tritonllm.kernels.fp8_linear import E4M3, E5M2, fp8_linear, fp8_linear_swiglu, fp8_supported

needs_fp8 = pytest.mark.skipif(not fp8_supported(torch.device(DEVICE)), reason="needs fp8 tensor cores")
pytestmark = needs_fp8
#: bf16 in training on the GPU; float32 under the interpreter (no bf16 dots there)
DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def dequantized(x: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """x [R, C] quantized per row to ``fmt`` as the kernel does, back in float64."""
    q, s = quantize_ref(x, FP8_MAX[fmt])
    return q.to(fmt).double() * s.double()[:, None]


def check(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 accumulation of the same fp8 products, then the output dtype's rounding."""
    eps = torch.finfo(got.dtype).eps
    err = (got.double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 4 * eps * scale + 1e-12, f"{name}: max error {err:.3g} against max |ref| {scale:.3g}"


#: (M, K, N); the last, with every stride a multiple of 16 bytes, takes the warp-specialized Hopper kernel
SHAPES = [(1, 16, 8), (5, 70, 33), (37, 100, 23), (64, 130, 48), (3, 1, 5),
          pytest.param((384, 512, 320), marks=pytest.mark.gpu)]


@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("extras", ["plain", "bias+residual"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}K{}N{}".format(*s))
def test_each_gemm_is_the_product_of_its_dequantized_operands(shape, extras, grad_dtype):
    M, K, N = shape
    x = (randn(M, K) * 3).to(DTYPE).requires_grad_()
    w = (randn(N, K) * 0.05).to(DTYPE).requires_grad_()
    bias = randn(N).to(DTYPE).requires_grad_() if extras != "plain" else None
    residual = randn(M, N).to(DTYPE).requires_grad_() if extras != "plain" else None
    if M > 2:
        with torch.no_grad():
            x[1] = 0.0  # an all-zero row: scale 1, zeros
    y = fp8_linear(x, w, bias, residual, grad_dtype=grad_dtype)
    dy = randn(M, N).to(DTYPE)
    grads = torch.autograd.grad(y, [t for t in (x, w, bias, residual) if t is not None], dy)
    ref_y = dequantized(x.detach(), E4M3) @ dequantized(w.detach(), E4M3).t()
    if bias is not None:
        ref_y = ref_y + bias.double() + residual.double()
    check("y", y, ref_y)
    check("dx", grads[0], dequantized(dy, grad_dtype) @ dequantized(w.detach().t(), E4M3).t())
    check("dW", grads[1], dequantized(dy.t(), grad_dtype) @ dequantized(x.detach().t(), E4M3).t())
    if bias is not None:
        check("dbias", grads[2], dy.double().sum(0))
        assert torch.equal(grads[3], dy)


@pytest.mark.parametrize("trained", ["both", "x", "weight"])
def test_backward_keeps_the_fp8_copies_its_gradients_need(trained):
    """The layer keeps q(x^T) (for dW) and q(W^T) (for dx), one byte an element on the GPU, not x or W, and
    only those the gradients asked for need: a frozen weight keeps no q(x^T), an input without a gradient
    no q(W^T)."""
    x, w = randn(5, 70).to(DTYPE), (randn(33, 70) * 0.1).to(DTYPE)
    x.requires_grad_(trained in ("both", "x"))
    w.requires_grad_(trained in ("both", "weight"))
    y = fp8_linear(x, w)
    xt, sxt, wt, swt = y.grad_fn.saved_tensors
    assert xt.shape == ((70, 5) if w.requires_grad else (0,)) and sxt.numel() == (70 if w.requires_grad else 0)
    assert wt.shape == ((70, 33) if x.requires_grad else (0,)) and swt.numel() == (70 if x.requires_grad else 0)
    assert all(t.dtype == (E4M3 if ON_GPU else torch.float32) for t in (xt, wt) if t.numel())
    grads = torch.autograd.grad(y, [t for t in (x, w) if t.requires_grad], torch.ones_like(y))
    assert all(torch.isfinite(g).all() for g in grads)


def test_close_to_the_unquantized_layer():
    """The layer against float64 without quantization: e4m3 keeps 3 mantissa bits (relative rounding up to
    2^-4 per operand), which averages down over the K (or N, M) products of each output."""
    x, w = randn(4, 9, 256).to(DTYPE).requires_grad_(), (randn(192, 256) * 0.05).to(DTYPE).requires_grad_()
    y = fp8_linear(x, w)
    dy = randn(*y.shape).to(DTYPE)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    for name, got, ref in (("y", y, x64 @ w64.t()), ("dx", dx, dy64 @ w64),
                           ("dW", dw, dy64.reshape(-1, 192).t() @ x64.reshape(-1, 256))):
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < 0.04, f"{name}: relative error {rel:.3g}"


def test_swiglu_matches_its_parts():
    """fp8_linear_swiglu = swiglu of the fp8 product with the packed weight, forward and backward."""
    x, w13 = randn(3, 7, 48).to(DTYPE).requires_grad_(), (randn(2 * 40, 48) * 0.1).to(DTYPE).requires_grad_()
    h = fp8_linear_swiglu(x, w13)
    dh = randn(*h.shape).to(DTYPE)
    dx, dw = torch.autograd.grad(h, [x, w13], dh)
    x2, w2 = x.detach().clone().requires_grad_(), w13.detach().clone().requires_grad_()
    gu = fp8_linear(x2, w2)
    g, u = gu[..., :40].float(), gu[..., 40:].float()
    ref = (torch.nn.functional.silu(g) * u).to(DTYPE)
    rdx, rdw = torch.autograd.grad(ref, [x2, w2], dh)
    assert h.shape == (3, 7, 40)
    torch.testing.assert_close(h, ref, rtol=1e-2 if ON_GPU else 1e-5, atol=1e-2 if ON_GPU else 1e-6)
    for name, a, b in (("dx", dx, rdx), ("dW", dw, rdw)):
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert rel < (2e-2 if ON_GPU else 1e-5), f"{name}: {rel:.3g}"


def test_non_finite_input_is_not_finite_output():
    """An inf in x makes its row's scale inf: that row of y is not finite (the step's overflow check skips
    it), and no other row changes."""
    x, w = randn(4, 32).to(DTYPE), (randn(8, 32) * 0.1).to(DTYPE)
    clean = fp8_linear(x, w)
    x[2, 5] = float("inf")
    y = fp8_linear(x, w)
    assert not torch.isfinite(y[2]).any()
    assert torch.equal(y[[0, 1, 3]], clean[[0, 1, 3]])


def test_bad_input():
    x, w = randn(4, 32).to(DTYPE), randn(8, 32).to(DTYPE)
    with pytest.raises(TypeError, match="grad_dtype"):
        fp8_linear(x, w, grad_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        fp8_linear(x, randn(8, 31).to(DTYPE))
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, w, randn(7).to(DTYPE))
    with pytest.raises(ValueError, match="w13"):
        fp8_linear_swiglu(x, randn(9, 32).to(DTYPE))


def test_lora_with_an_fp8_base():
    """lora_linear(fp8=True): the frozen product is fp8_linear's (y and dx), the adapters' part and their
    gradients are those of the bf16 layer exactly (they read the same x and dy)."""
    from tritonllm.kernels.linear import linear
    from tritonllm.kernels.lora import lora_linear

    x = randn(6, 64).to(DTYPE).requires_grad_()
    w = (randn(40, 64) * 0.1).to(DTYPE)
    a = (randn(2, 4, 64) * 0.1).to(DTYPE).requires_grad_()
    b = (randn(24, 4) * 0.1).to(DTYPE).requires_grad_()
    segments = [(0, 16), (24, 8)]
    dy = randn(6, 40).to(DTYPE)
    out = {}
    for fp8 in (False, True):
        y = lora_linear(x, w, None, a, b, segments, 2.0, fp8=fp8)
        out[fp8] = (y, *torch.autograd.grad(y, [x, a, b], dy))
    base = {True: fp8_linear(x, w), False: linear(x, w)}
    base_dx = {fp8: torch.autograd.grad(base[fp8], [x], dy)[0] for fp8 in (False, True)}
    tol = 1e-5 if not ON_GPU else 2e-2
    for i, name in ((0, "y"), (1, "dx")):
        got = out[True][i] - (base[True] if i == 0 else base_dx[True])
        ref = out[False][i] - (base[False] if i == 0 else base_dx[False])
        assert (got - ref).abs().max().item() <= tol * ref.abs().max().item(), name
    assert torch.equal(out[True][2], out[False][2]) and torch.equal(out[True][3], out[False][3])


def test_convert_to_fp8_keeps_parameters_and_skips_the_head():
    from tritonllm.models import ModelConfig, build_model
    from tritonllm.nn.fp8 import Fp8Linear, Fp8LinearSwiGLU, apply_precision

    model = build_model(ModelConfig(name="t", vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                    d_ff=64, max_seq_len=16, tie_embeddings=False), device=torch.device(DEVICE),
                        dtype=DTYPE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_precision(model, "fp8")
    kinds = {type(m) for m in model.modules()}
    assert Fp8Linear in kinds and Fp8LinearSwiGLU in kinds
    assert type(model.lm_head) is not Fp8Linear
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match="trainer.precision"):
        apply_precision(model, "fp4")
    with pytest.raises(ConfigError, match="trainer.fp8_grad_dtype"):
        apply_precision(model, "fp8", "e3m4")
    e5m2 = build_model(ModelConfig(name="t", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                                   max_seq_len=16), device=torch.device(DEVICE), dtype=DTYPE)
    apply_precision(e5m2, "fp8", "e5m2")
    assert {m.grad_dtype for m in e5m2.modules() if isinstance(m, (Fp8Linear, Fp8LinearSwiGLU))} == {torch.float8_e5m2}
    from tritonllm.nn.lora import LoRAConfig, LoRALinear, apply_lora

    lora = apply_lora(build_model(ModelConfig(name="t", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                              d_ff=64, max_seq_len=16), device=torch.device(DEVICE), dtype=DTYPE),
                      LoRAConfig(rank=2, alpha=4.0))
    apply_precision(lora, "fp8")
    layers = [m for m in lora.modules() if isinstance(m, LoRALinear)]
    assert layers and all(m.fp8 for m in layers)


def test_training_in_fp8_lowers_the_loss(tmp_path, data_overrides):  # noqa: F811
    """trainer.precision=fp8 end to end (the interpreter's emulation on the CPU): the loss falls, and
    the run's checkpoint holds the weights in the model's dtype (nothing fp8 is saved)."""
    from tritonllm.train import train

    train(compose_train(*TINY, *data_overrides, "trainer.precision=fp8", f"out_dir={tmp_path}"))
    losses = [r["loss"] for r in read_metrics(str(tmp_path), "train")]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "linear_swiglu"])
def test_compiles_to_the_custom_ops_with_eager_values(swiglu):
    """Under torch.compile(fullgraph=True) the layer is its custom ops (no graph break), with eager's values and
    gradients: the same launchers behind both paths."""
    fn = (lambda a, b: fp8_linear_swiglu(a, b)) if swiglu else (lambda a, b: fp8_linear(a, b, grad_dtype=E5M2))
    x, w = randn(6, 32).to(DTYPE).requires_grad_(), (randn(48 if swiglu else 24, 32) * 0.1).to(DTYPE).requires_grad_()
    torch._dynamo.reset()
    outs = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        y = run(x, w)
        outs.append((y, *torch.autograd.grad(y, [x, w], torch.ones_like(y))))
    for name, a, b in zip(("y", "dx", "dW"), *outs):
        assert torch.equal(a, b), name


def test_parity_script_compares_the_validation_curves(tmp_path):
    """scripts/fp8_parity.py's summary of two runs' metrics.jsonl: the final ratio, the largest gap at a common
    step, and divergence (a non-finite loss, or the last validation loss above the first)."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("fp8_parity", Path(__file__).parents[1] / "scripts" / "fp8_parity.py")
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    curves = {}
    for name, vals in (("bf16", [5.0, 4.0, 3.0]), ("fp8", [5.1, 4.0, 3.015])):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step, v in zip((100, 200, 300), vals):
                f.write(json.dumps({"kind": "train", "step": step, "loss": v + 0.1}) + "\n")
                f.write(json.dumps({"kind": "val", "step": step, "val_loss": v}) + "\n")
        curves[name], train = parity.read_curves(tmp_path / name)
        assert train[0] == [100, vals[0] + 0.1]
    got = parity.summarize(curves)
    assert got["ratio"] == 1.005 and got["max_gap"] == 0.02 and got["within_1pct"] and not got["diverged"]
    curves["fp8"][-1][1] = float("nan")
    assert parity.summarize(curves)["diverged"]


def test_moe_shared_expert_runs_in_fp8():
    """trainer.precision=fp8 on a MoE layer: its shared expert's linears become FP8 ones and the layer runs them
    (the layer calls its shared-expert modules, not their weights), the routed experts stay as they are."""
    from tritonllm.nn import MoE
    from tritonllm.nn.fp8 import Fp8Linear, Fp8LinearSwiGLU, convert_to_fp8

    layer = MoE(64, 4, 2, 32, n_shared_experts=1).to(DEVICE)
    x = randn(9, 64)
    with torch.no_grad():
        before = layer(x).y
        assert convert_to_fp8(layer) == 2  # the shared expert's two linears; not the router
        after = layer(x).y
    assert isinstance(layer.shared_w13, Fp8LinearSwiGLU) and isinstance(layer.shared_w2, Fp8Linear)
    assert type(layer.router) is not Fp8Linear
    assert not torch.equal(before, after)
    assert (after - before).abs().max() <= 0.1 * before.abs().max()
