"""tritonllm.optim: optimizers and gradient utilities whose math runs in Triton kernels."""

from tritonllm.optim.adamw import AdamW, clip_grad_norm_
from tritonllm.optim.muon import CombinedOptimizer, Muon

__all__ = ["AdamW", "clip_grad_norm_", "Muon", "CombinedOptimizer"]
