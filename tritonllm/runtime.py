"""Helpers shared by the command-line apps (train, generate, bench train): device and dtype
choice, and printing a :class:`~tritonllm.errors.TritonLLMError` as one clear line."""

from __future__ import annotations

import functools
import os
import sys

import torch

from tritonllm.errors import ConfigError, TritonLLMError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; anything else as given (checked)."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"device={spec!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={spec!r} but no CUDA device is available")
    return device


def resolve_dtype(spec: str, device: torch.device, key: str = "trainer.dtype") -> torch.dtype:
    """``auto`` -> bf16 on CUDA, fp32 on CPU. bf16 on the CPU is a ConfigError naming ``key``: the
    kernels run there in Triton's interpreter, which has no bfloat16 ``tl.dot`` (it multiplies the
    raw bit patterns, triton issue 11584: a first loss of 1e10, not a slow run)."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec not in DTYPES:
        raise ConfigError(f"{key}={spec!r} is not one of auto, {', '.join(DTYPES)}")
    if DTYPES[spec] == torch.bfloat16 and device.type != "cuda":
        raise ConfigError(f"{key}={spec} cannot be computed on {device}: the kernels run there in Triton's interpreter, "
                          f"whose bfloat16 matrix products are wrong (triton issue 11584); use {key}=fp32 (or auto) "
                          f"on the CPU, bf16 on a CUDA GPU")
    return DTYPES[spec]


def exit_on_user_error(fn):
    """Run ``fn``; a TritonLLMError is printed as ``tritonllm: error: <message>`` (``tritonllm: error on
    rank <r>: ...`` in a multi-process torchrun run) and exits with status 1."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TritonLLMError as e:
            where = f" on rank {os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
            print(f"tritonllm: error{where}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
    return wrapper
