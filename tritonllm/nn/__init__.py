"""tritonllm.nn: thin ``torch.nn.Module`` wrappers over the Triton kernels of ``tritonllm.kernels``.

Each module takes plain arguments (widths, heads, eps), holds its parameters and their init, and
its forward calls the kernel functionals; ``tritonllm.models.Transformer`` is built from them.
"""

from .attention import Attention, KVCache
from .embedding import Embedding
from .linear import Linear, LinearSwiGLU
from .lm_head import LMHeadLoss
from .mlp import MLP
from .moe import MoE, MoEOutput
from .norm import RMSNorm

__all__ = ["Attention", "Embedding", "KVCache", "LMHeadLoss", "Linear", "LinearSwiGLU", "MLP", "MoE", "MoEOutput",
           "RMSNorm"]
