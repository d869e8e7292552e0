"""Reference-comparison helpers used by every kernel test.

Tolerance rule (docs/architecture.md, "Tests", from flash-attention's tests): the kernel's error against a
float64 reference may be at most twice PyTorch's own error in the same dtype, plus a small
absolute term scaled by the reference's magnitude.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import DEVICE, DTYPES, ON_GPU  # noqa: F401  (re-exported for tests)

#: absolute slack of a float32 matrix product on the GPU, relative to max(1, max|ref|): Triton's
#: TF32 tensor-core dots drop the 13 low mantissa bits of both operands (truncation, up to 2^-10
#: relative each), so a product term is off by up to 2^-9; with a short K nothing averages out
#: (and cuBLAS keeps such tiny products in fp32, so PyTorch's own error is no yardstick)
TF32_ATOL = 2.0 ** -9


def gemm_atol(dtype: torch.dtype, chain: int = 1) -> float | None:
    """The ``atol`` for results of matrix products: TF32_ATOL for float32 on the GPU, times
    ``chain`` for products of two GEMM outputs (SwiGLU: 2); None (the dtype's ATOL) otherwise."""
    return chain * TF32_ATOL if (ON_GPU and dtype == torch.float32) else None

#: absolute slack per dtype, relative to max(1, max|ref|)
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}


def child_env(*paths: str, **extra: str) -> dict[str, str]:
    """``os.environ`` for a child Python process that also imports from ``paths``, plus ``extra``
    variables: ``paths`` go in front of the inherited PYTHONPATH, never in its place (it may be what
    makes the test dependencies importable, as on the GPU machines: hydra, transformers, ...)."""
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join([*paths, *inherited])}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def assert_close(name: str, out: torch.Tensor, ref64: torch.Tensor, same: torch.Tensor | None = None,
                 atol: float | None = None, dtype: torch.dtype | None = None) -> None:
    """Check ``out`` against the float64 reference ``ref64``.

    ``same`` is PyTorch's result computed in the kernel's dtype; when given the allowed error is
    ``2 * max|same - ref64| + atol``, else ``atol``. NaN or inf anywhere fails. float32 on the GPU
    doubles the factor to 4: both sides' matrix products run TF32, which cuBLAS rounds to nearest
    while Triton's tensor-core dots truncate (twice the rounding error bound).
    """
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}"
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref64.detach().to(torch.float64).cpu()
    assert torch.isfinite(out64).all(), f"{name}: {(~torch.isfinite(out64)).sum().item()} non-finite values"
    dtype = dtype or out.dtype
    scale = max(1.0, ref64.abs().max().item()) if ref64.numel() else 1.0
    tol = (ATOL[dtype] if atol is None else atol) * scale
    if same is not None:
        factor = 4 if (ON_GPU and dtype == torch.float32) else 2
        tol += factor * (same.detach().to(torch.float64).cpu() - ref64).abs().max().item()
    err = (out64 - ref64).abs().max().item() if ref64.numel() else 0.0
    assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.3e} ({dtype_id(dtype)})"


def assert_names_argument(error: type[Exception], name: str, call) -> None:
    """``call()`` raises ``error`` whose message names the argument ``name`` (as a whole word): a bad-input case."""
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (or the int max) so that an element a kernel never writes fails the check."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def randn(*shape, dtype=torch.float32, device=DEVICE, scale=1.0, requires_grad=False) -> torch.Tensor:
    """Fresh standard-normal data (never zeros) in ``dtype``."""
    t = (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a view whose rows are strided (every other row of a bigger buffer)."""
    big = torch.empty((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    poison_(big)
    big[::2] = t.detach()
    view = big[::2]
    return view.requires_grad_(t.requires_grad) if view.is_leaf else view


def check_unary_op(fn, reference, x: torch.Tensor, dy: torch.Tensor) -> None:
    """``fn(x)`` and its input gradient for ``dy`` against ``reference`` in float64 (the yardstick: the reference
    in x's dtype), by :func:`assert_close`."""
    x = x.requires_grad_(True)
    (dx,) = torch.autograd.grad(y := fn(x), x, dy)
    x64 = x.detach().double().requires_grad_(True)
    (dx64,) = torch.autograd.grad(y64 := reference(x64), x64, dy.double())
    xs = x.detach().clone().requires_grad_(True)
    (dxs,) = torch.autograd.grad(ys := reference(xs), xs, dy)
    assert_close("y", y, y64, ys)
    assert_close("dx", dx, dx64, dxs)
