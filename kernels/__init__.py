"""tritonllm.kernels: hand-written Triton kernels for LLM training, forward and backward.

Every op is a `torch.autograd.Function` whose forward and backward are Triton kernels.
Import what you need::

    from tritonllm.kernels import rms_norm, linear, flash_attention, cross_entropy

On a machine without a CUDA device the kernels run through Triton's interpreter on CPU
tensors: ``TRITON_INTERPRET=1`` is set here, before any kernel is compiled, unless the
environment already says otherwise.
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from ._common import interpreting  # noqa: E402
# memory-bound ops
from .rms_norm import rms_norm  # noqa: E402
from .swiglu import swiglu  # noqa: E402
from .relu2 import relu2  # noqa: E402
from .rope import rope, rope_cos_sin  # noqa: E402
from .embedding import embedding  # noqa: E402
from .cross_entropy import cross_entropy  # noqa: E402
from .adamw import adamw_step_, clip_grads_  # noqa: E402
from .muon import muon_step_, orthogonalize  # noqa: E402
# matrix products
from .linear import linear, linear_swiglu  # noqa: E402
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402
# attention
from .flash_attention import flash_attention, flash_attention_bwd, flash_attention_fwd  # noqa: E402
from .split_heads import split_heads  # noqa: E402
# mixture of experts
from .moe_router import MoERouting, moe_router  # noqa: E402
from .moe_permute import MoEPlan, moe_combine, moe_gather, moe_sort  # noqa: E402
from .grouped_linear import grouped_linear, grouped_linear_swiglu  # noqa: E402
from .moe import moe  # noqa: E402

__all__ = [
    "interpreting",
    "rms_norm", "swiglu", "relu2", "rope", "rope_cos_sin", "embedding", "cross_entropy", "adamw_step_", "clip_grads_",
    "muon_step_", "orthogonalize",
    "linear", "linear_swiglu", "linear_cross_entropy",
    "flash_attention", "flash_attention_fwd", "flash_attention_bwd", "split_heads",
    "MoERouting", "moe_router", "MoEPlan", "moe_sort", "moe_gather", "moe_combine",
    "grouped_linear", "grouped_linear_swiglu", "moe",
]
