"""AdamW whose step is a multi-tensor Triton kernel, and global-norm gradient clipping.

``AdamW.step()`` updates every parameter of a group in one launch per (parameter dtype, gradient
dtype, master copy, alignment) bucket -- normally one per group -- through
``tritonllm.kernels.adamw.adamw_step_``. The math is ``torch.optim.AdamW``'s (decoupled weight
decay, bias correction, fp32 moments). bf16/fp16 parameters get an fp32 master copy in the
optimizer state (unless ``master_weights=False``): the kernel updates the master and writes it,
rounded, into the parameter.

State per parameter: ``step`` (a 0-d fp32 tensor on the parameter's device, as in
``torch.optim.AdamW(capturable=True)``), ``exp_avg`` and ``exp_avg_sq`` (fp32, the parameter's
shape) and, with a master copy, ``master`` (fp32). ``state_dict()`` / ``load_state_dict()``
round-trip exactly: the fp32 state is restored in fp32 whatever the parameters' dtype.

Made to be captured in a CUDA graph (``tritonllm.train.step``): nothing in ``step()`` reads the
device; a group's ``lr`` may be a 0-d fp32 device tensor (its current value is read by the kernel
at replay), and ``step(found_inf=flag)`` skips the whole update on the device when the int32
``flag`` is non-zero (see ``tritonllm.kernels.adamw.clip_grads_``).

Sharded parameters (``torch.distributed`` DTensors, as FSDP2's ``fully_shard`` makes them): the
state is created in the parameter's layout (DTensors sharded like it, so with fp32 sharded
parameters the parameters are the sharded master weights) and the kernels update each rank's
local shards; ``clip_grad_norm_`` sums the squared norm of the local shards over the ranks.
"""

from __future__ import annotations

import torch

from tritonllm.kernels.adamw import adamw_step_, clip_grads_
from tritonllm.optim._base import DeviceStateOptimizer


def dtensor_type():
    """``torch.distributed.tensor.DTensor``, or None when this PyTorch build has no torch.distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _local(t: torch.Tensor, dtensor) -> torch.Tensor:
    """The rank's own part of ``t``: its local shard when ``t`` is a DTensor, else ``t``."""
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


class AdamW(DeviceStateOptimizer):
    """AdamW with a Triton multi-tensor step.

    Args:
        params: parameters or parameter groups (dicts), as for any ``torch.optim.Optimizer``.
        lr: learning rate (>= 0); may change between steps without recompiling.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay (>= 0): ``p -= lr * weight_decay * p``.
        master_weights: None or True keeps an fp32 master copy of every bf16/fp16 parameter;
            False updates such parameters directly (fp32 math, rounded on store).
    """

    FP32_STATE = ("exp_avg", "exp_avg_sq", "master")  # kept in fp32 whatever the parameter's dtype

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, master_weights: bool | None = None):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two values in [0, 1), got {tuple(betas)}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, master_weights=master_weights)
        super().__init__(params, defaults)

    def _init_state(self, group: dict, p: torch.Tensor, state: dict, use_master: bool) -> None:
        """Create the state a parameter lacks (all of it on its first step; only the master copy
        when the state was loaded from an optimizer without masters)."""
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if use_master and "master" not in state:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)

    def _update(self, group: dict, items: list, found_inf: torch.Tensor | None) -> None:
        """One ``adamw_step_`` launch over ``items`` (parameter, state, master or not): their local shards."""
        dt = dtensor_type()
        adamw_step_([_local(p, dt) for p, _, _ in items], [_local(p.grad, dt) for p, _, _ in items],
                    [_local(s["exp_avg"], dt) for _, s, _ in items],
                    [_local(s["exp_avg_sq"], dt) for _, s, _ in items],
                    [_local(s["master"], dt) if m else None for _, s, m in items],
                    steps=[s["step"] for _, s, _ in items], lr=group["lr"], betas=group["betas"],
                    eps=group["eps"], weight_decay=group["weight_decay"], found_inf=found_inf)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` (of this class, or of ``torch.optim.AdamW``: groups get this
        optimizer's defaults for the keys they lack); moments and master copies come back in fp32
        and each step count as a 0-d fp32 tensor on the parameter's device."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _restore(self, state: dict, saved: dict, p: torch.Tensor) -> None:
        state["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32, device=p.device)


def clip_grad_norm_(params, max_norm: float, eps: float = 1e-6, *, found_inf: torch.Tensor | None = None,
                    check: torch.Tensor | None = None) -> torch.Tensor:
    """Scale the gradients of ``params`` (a tensor or an iterable of tensors) in place so that
    their global L2 norm is at most ``max_norm``, like ``torch.nn.utils.clip_grad_norm_``:
    ``g *= min(1, max_norm / (norm + eps))``. Returns the total norm before clipping as a 0-d fp32
    tensor, computed in Triton (fp32, deterministic) without a host synchronisation.
    ``found_inf`` / ``check``: see :func:`tritonllm.kernels.adamw.clip_grads_` (sets the int32 flag
    when the norm or ``check``, e.g. the loss, is not finite).

    Gradients that are DTensors sharded over a 1-D device mesh (FSDP2) are clipped by the norm of
    the whole gradient: each rank sums the squares of its local shards and the sums are
    all-reduced over the mesh's process group (the one collective here; capturable with NCCL)."""
    if isinstance(params, torch.Tensor):
        params = [params]
    grads = [p.grad for p in params if p.grad is not None]
    dt = dtensor_type()
    sharded = [g for g in grads if dt is not None and isinstance(g, dt)]
    reduce = None
    if sharded:
        mesh = sharded[0].device_mesh
        is_shard = [any(pl.is_shard() for pl in g.placements) for g in sharded]
        if len(sharded) != len(grads) or any(is_shard) != all(is_shard):
            raise ValueError("params: some gradients are sharded and some are not: one norm over both is "
                             "not supported")
        if mesh.ndim != 1 or any(g.device_mesh != mesh for g in sharded):
            raise ValueError("params: sharded gradients must all live on one 1-D device mesh")
        if all(is_shard):
            group = mesh.get_group()

            def reduce(total):
                torch.distributed.all_reduce(total, group=group)
        grads = [g.to_local() for g in sharded]
    return clip_grads_(grads, max_norm, eps, found_inf=found_inf, check=check, reduce=reduce)
