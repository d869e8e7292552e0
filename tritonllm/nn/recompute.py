"""Activation checkpointing (``trainer.activation_checkpointing``), applied to a built model from outside,
as torchtitan's ``apply_ac`` does: the model's code stays as it is.

- ``none`` (the default): the forward keeps every activation its backward reads.
- ``full``: each transformer block keeps only its inputs (the residual stream and the pending delta, a few
  values a token); its forward runs again inside the backward (``torch.utils.checkpoint``, non-reentrant),
  so the activations of one block at a time are alive there. A dense block otherwise keeps about 10 d_model
  values a token plus its MLP's pre-activations (2 d_ff) and output (d_ff); the price is one more forward
  of every block, about a third more GEMM work a step.

The recomputation runs the same kernels on the same inputs: with the deterministic kernels (the default) the
loss and every gradient are bitwise those of ``none``. The state dict is unchanged (the blocks keep their
names: the forward of each block instance is replaced, no wrapper module is inserted).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tritonllm.errors import ConfigError

log = logging.getLogger(__name__)

#: the settings of ``trainer.activation_checkpointing``
MODES = ("none", "full")


class _Recomputed:
    """A block's forward run under non-reentrant checkpointing: only its inputs are kept for the backward."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation and generation: nothing to keep, nothing to recompute
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """``trainer.activation_checkpointing`` on ``model`` (a :class:`~tritonllm.models.Transformer`): ``full``
    recomputes each block of ``model.blocks`` in the backward; returns how many blocks it applies to."""
    if mode not in MODES:
        raise ConfigError(f"trainer.activation_checkpointing must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return 0
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ConfigError(f"trainer.activation_checkpointing={mode}: {type(model).__name__} has no blocks")
    for block in blocks:
        if not isinstance(block.forward, _Recomputed):
            block.forward = _Recomputed(block.forward)
    log.info("activation checkpointing %s: %d blocks recompute their forward in the backward", mode, len(blocks))
    return len(blocks)
