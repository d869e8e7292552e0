"""What tritonllm's optimizers share: a learning rate that may be a 0-d device tensor (read by the
kernels under a CUDA graph) and state kept in fp32 whatever the parameter's dtype."""

from __future__ import annotations

import torch


class DeviceStateOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose ``state_dict`` saves a device-tensor ``lr`` as a float and whose
    ``load_state_dict`` puts the state keys named in ``FP32_STATE`` back in fp32 on the parameter's
    device (``torch.optim.Optimizer.load_state_dict`` casts floating-point state to the parameter's
    dtype). ``_restore(state, saved, p)`` lets a subclass restore more per parameter."""

    FP32_STATE: tuple[str, ...] = ()

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
