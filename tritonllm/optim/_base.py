"""What tritonllm's optimizers share: a learning rate that may be a 0-d device tensor (read by the
kernels under a CUDA graph), state kept in fp32 whatever the parameter's dtype, and the step that
gathers a group's parameters with gradients and hands them to the subclass's kernels."""

from __future__ import annotations

import torch


def _use_master(group: dict, p: torch.Tensor) -> bool:
    """Whether ``p`` is updated through an fp32 master copy: a bf16/fp16 parameter unless its group
    says ``master_weights=False``."""
    return group["master_weights"] is not False and p.dtype != torch.float32


class DeviceStateOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose ``state_dict`` saves a device-tensor ``lr`` as a float and whose
    ``load_state_dict`` puts the state keys named in ``FP32_STATE`` back in fp32 on the parameter's
    device (``torch.optim.Optimizer.load_state_dict`` casts floating-point state to the parameter's
    dtype). ``_restore(state, saved, p)`` lets a subclass restore more per parameter.

    ``step`` and ``init_state`` are shared: a subclass, whose groups have ``master_weights`` (False: no
    fp32 master copy of bf16/fp16 parameters), defines ``_init_state`` and ``_update``."""

    FP32_STATE: tuple[str, ...] = ()

    @torch.no_grad()
    def step(self, closure=None, *, found_inf: torch.Tensor | None = None):
        """One update of every parameter that has a gradient; returns ``closure()``'s loss.

        ``found_inf``: None or a one-element int32 device tensor; when it holds a non-zero value at
        the time the kernels run, nothing changes (weights, state, step counts)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            items = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"params: {type(self).__name__} does not support sparse gradients")
                state, use_master = self.state[p], _use_master(group, p)
                self._init_state(group, p, state, use_master)
                items.append((p, state, use_master))
            if items:
                self._update(group, items, found_inf)
        return loss

    @torch.no_grad()
    def init_state(self) -> None:
        """Create every parameter's state (zero moments, step counts, master copies) without an
        update: the tensors a sharded checkpoint is loaded into in place."""
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(group, p, self.state[p], _use_master(group, p))

    def _init_state(self, group: dict, p: torch.Tensor, state: dict, use_master: bool) -> None:
        """Create the state ``p`` of ``group`` lacks (a master copy where ``use_master``)."""
        raise NotImplementedError

    def _update(self, group: dict, items: list, found_inf: torch.Tensor | None) -> None:
        """Update ``items``, the ``(p, state, use_master)`` of the parameters of ``group`` that have a
        gradient, in the subclass's kernels."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """As ``torch.optim.Optimizer.state_dict``, with a group's device-tensor ``lr`` saved as a float."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"] = float(group["lr"])
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()``; the ``FP32_STATE`` tensors are put back in fp32 on the parameter's device."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if not saved:
                continue
            state = self.state[p]
            self._restore(state, saved, p)
            for key in self.FP32_STATE:
                if key in saved:
                    state[key] = saved[key].to(device=p.device, dtype=torch.float32, copy=True).contiguous()

    def _restore(self, state: dict, saved: dict, p: torch.Tensor) -> None:
        """Per-parameter state beyond ``FP32_STATE`` (none by default)."""
