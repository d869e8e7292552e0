"""tritonllm.nn: thin ``torch.nn.Module`` wrappers over the Triton kernels of ``tritonllm.kernels``.

Each module holds its parameters and their init; its forward calls one kernel functional.
"""

from .embedding import Embedding
from .linear import Linear, LinearSwiGLU
from .norm import RMSNorm

__all__ = ["Embedding", "Linear", "LinearSwiGLU", "RMSNorm"]

from .moe import MoE  # noqa: E402

__all__ += ["MoE"]
