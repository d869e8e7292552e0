"""tritonllm.kernels: hand-written Triton kernels for LLM training, forward and backward.

Every op is a `torch.autograd.Function` whose forward and backward are Triton kernels.
Import what you need::

    from tritonllm.kernels import rms_norm, swiglu, rope, rope_cos_sin, embedding, cross_entropy

On a machine without a CUDA device the kernels run through Triton's interpreter on CPU
tensors: ``TRITON_INTERPRET=1`` is set here, before any kernel is compiled, unless the
environment already says otherwise.
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from ._common import interpreting  # noqa: E402

__all__ = ["interpreting"]
