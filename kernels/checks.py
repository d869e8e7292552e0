"""Input checks of the kernel launchers, and the row views they launch on.

Every check raises a ValueError or TypeError whose message names the offending argument, so a user
sees which input is wrong rather than a failure deep inside a kernel. Checks read only tensor
metadata: they never allocate or synchronise with the device.
"""

from __future__ import annotations

import torch

from ._interpreter import interpreting

#: dtypes every kernel accepts for activations and weights.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: dtypes accepted for index tensors (token ids, targets).
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES, ndim=None, min_ndim=None) -> None:
    """Check that ``t`` is a tensor on a device the kernels can use, with an allowed dtype.

    A CUDA tensor is always accepted; a CPU tensor only under the interpreter.
    ``ndim`` fixes the rank, ``min_ndim`` bounds it from below.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{name} must be a CUDA tensor (CPU tensors only run under Triton's interpreter: TRITON_INTERPRET=1 "
            "set before Triton is imported), "
            f"got a tensor on {t.device}"
        )
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")


def check_dot_dtype(name: str, t: torch.Tensor) -> None:
    """A TypeError naming ``name`` for a bfloat16 CPU tensor given to a kernel whose math runs through
    ``tl.dot``: Triton's interpreter multiplies bfloat16 operands' raw bit patterns (triton issue
    11584), so the result would be off by orders of magnitude, not merely imprecise."""
    if t.dtype == torch.bfloat16 and t.device.type == "cpu":
        raise TypeError(f"{name} is bfloat16 on the CPU: Triton's interpreter computes bfloat16 tl.dot wrongly "
                        f"(triton issue 11584); use float32 or float16 there, bfloat16 on a CUDA device")


def _differ(tensors: dict, attr: str) -> bool:
    """True when the non-None tensors' ``attr`` (device or dtype) is not the same for all."""
    first = None
    for t in tensors.values():
        if t is not None:
            value = getattr(t, attr)
            if first is None:
                first = value
            elif value != first:
                return True
    return False


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise a ValueError naming the tensors when they are not all on one device."""
    if _differ(tensors, "device"):
        listed = ", ".join(f"{n} on {t.device}" for n, t in tensors.items() if t is not None)
        raise ValueError(f"tensors must be on the same device: {listed}")


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    """Raise a TypeError naming the tensors when their dtypes differ."""
    if _differ(tensors, "dtype"):
        listed = ", ".join(f"{n} is {str(t.dtype).replace('torch.', '')}" for n, t in tensors.items()
                           if t is not None)
        raise TypeError(f"tensors must share one dtype: {listed}")


def needs_grad(*tensors) -> bool:
    """True when autograd records: grad mode is on and one of ``tensors`` (None and non-tensors
    allowed, the input checks come later) requires a gradient. Ops skip their autograd Function
    otherwise (its node costs host time and saves tensors for nothing)."""
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def rows_view(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, n]`` view whose last dimension is contiguous.

    Copies only when the last dimension is strided or the leading dimensions cannot be
    folded into one row stride (the kernels take the row stride as an argument).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2 and x.shape[1] == n:
        return x
    try:
        return x.view(-1, n)
    except RuntimeError:
        return x.reshape(-1, n).contiguous()


def check_lr(lr, device: torch.device) -> bool:
    """Check an optimizer kernel's ``lr``: a float >= 0, or a one-element fp32 tensor on ``device``
    (read by the kernel, so a CUDA graph replays its current value). Returns whether it is a tensor."""
    if isinstance(lr, torch.Tensor):
        if lr.dtype != torch.float32 or lr.numel() != 1 or lr.device != device:
            raise TypeError(f"lr must be a float or a one-element fp32 tensor on {device}")
        return True
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    return False


def check_flag(name: str, flag, device: torch.device) -> None:
    """A skip flag (e.g. ``found_inf``): None or a one-element int32 tensor on ``device``."""
    if flag is not None and (not isinstance(flag, torch.Tensor) or flag.dtype != torch.int32 or flag.numel() != 1
                             or flag.device != device):
        raise TypeError(f"{name} must be None or a one-element int32 tensor on {device}")
