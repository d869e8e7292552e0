"""The choice between compiled kernels and Triton's CPU interpreter, made before Triton is imported
(it reads ``TRITON_INTERPRET`` then). Imports nothing of Triton; see ``tritonllm.kernels``."""

from __future__ import annotations

import logging
import os
import sys

import torch

_log = logging.getLogger("tritonllm.kernels")


def env_flag(value: str) -> bool:
    """A boolean environment value as Triton reads one (``1``, ``true``, ``on``, ``yes``, ``y``)."""
    return value.strip().lower() in ("1", "true", "on", "yes", "y")


def choose_interpreter() -> bool:
    """Set ``TRITON_INTERPRET=1`` where it is the only way the kernels can run: the environment does
    not set it, no CUDA device is visible, and Triton is not imported yet (a log line says so).
    Changes nothing otherwise. Returns True when it set the variable."""
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules or torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    _log.info("no CUDA device: tritonllm's kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1 set "
              "for this process; set TRITON_INTERPRET before importing tritonllm to choose yourself)")
    return True


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET``, read by Triton
    when it was imported; see ``tritonllm.kernels``): the kernels then take CPU tensors."""
    return env_flag(os.environ.get("TRITON_INTERPRET", "0"))
