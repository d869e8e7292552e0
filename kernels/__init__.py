"""tritonllm.kernels: hand-written Triton kernels for LLM training, forward and backward.

Every op is a `torch.autograd.Function` whose forward and backward are Triton kernels.
Import what you need::

    from tritonllm.kernels import rms_norm, linear, flash_attention, cross_entropy

Choosing the interpreter. Triton runs kernels either compiled for a CUDA device or through its
CPU interpreter on CPU tensors (slow: for tests and small experiments). It reads which from
``TRITON_INTERPRET`` once, when Triton itself is imported (its own library functions are defined
then), so the choice cannot wait for a kernel launch: make it before importing Triton or tritonllm,
e.g. ``TRITON_INTERPRET=1 python train_mine.py``. An explicit value (``1`` or ``0``) is always
honoured. Left unset, this import sets ``TRITON_INTERPRET=1`` only where nothing else could run
the kernels (no CUDA device visible and Triton not imported yet) and logs a line on the
``tritonllm.kernels`` logger saying so; on a machine with a CUDA device, or with Triton already
imported, it changes nothing. ``interpreting()`` tells which mode is on, and a CPU tensor given to
a kernel while the interpreter is off is refused with an error naming the argument and the variable.
Every environment variable tritonllm reads is in the table of docs/environment.md.

Settings. The choices a user may make about how the kernels run (the GEMM's grid, its Hopper kernel,
TMA stores; attention's TMA, loop shape, program order, Hopper kernels) are frozen dataclasses with the
measured defaults, ``GemmSettings`` and ``AttentionSettings``, each changed only through its function::

    from tritonllm.kernels import configure_attention, configure_gemm

    previous = configure_gemm(persistent=False, dynamic=True)   # from now on; returns the settings before
    with configure_attention(sm90_bwd={"dq": ()}):              # for the block only
        ...

``gemm_settings()`` and ``attention_settings()`` return those in force. The GEMM's launch plans are keyed
on its settings, so a change takes effect at the next call. Training runs set the GEMM grid beside NCCL
from the config (``trainer.gemm_grid``, ``trainer.gemm_sm_margin``).

Under ``torch.compile`` and FSDP2. Every functional above (``rms_norm``, ``linear``, ``linear_swiglu``,
``swiglu``, ``relu2``, ``gelu_tanh``, ``softcap``, ``rope``, ``rope_cos_sin``, ``embedding``, ``flash_attention``, ``rope_flash_attention``, ``split_heads``,
``weighted_add``, ``fork``, ``add_fork``, ``cross_entropy``, ``linear_cross_entropy``, ``moe_router``,
``moe_sort``, ``moe_gather``, ``moe_combine``, ``grouped_linear``, ``grouped_linear_swiglu``) is also
registered as ``torch.library`` custom ops, ``torch.ops.tritonllm.<op>_fwd`` / ``<op>_bwd`` with fake (meta)
and autograd registrations (each op's module, with the machinery of ``kernels/custom_op.py``); ``moe`` and ``moe_experts`` are built of them. While
``torch.compiler.is_compiling()``, a call goes to
those ops, which the graph keeps as single opaque nodes: a model built of these kernels compiles with
``torch.compile(model, fullgraph=True)`` (any backend) without graph breaks, and works inside FSDP2's
``fully_shard``, compiled or not. Eager calls run the autograd Functions unchanged (the check costs
well under a microsecond). The in-place functionals ``adamw_step_``, ``clip_grads_``, ``muon_step_`` and
``kv_cache.kv_cache_write_`` are ops that name the tensors they update (``mutates_args``; no autograd), as
is ``orthogonalize``: a compiled optimizer step (``tritonllm.optim.AdamW`` / ``Muon``) is one graph.
``clip_grads_(reduce=...)`` (FSDP2's all-reduce of the sum of squares) compiles as two ops with the
reduce traced between them. ``flash_attention.flash_attention_decode`` and ``lora.lora_linear`` are
ops too.
"""

if __name__ != "tritonllm.kernels":
    # This folder imported under another name: from the repository root (on sys.path with `python -m`),
    # `import kernels` finds it, as transformers does when it probes for the Hugging Face `kernels` package.
    # A second copy of the modules would register the tritonllm:: custom ops again, which frees the first
    # copy's operator entries (torch.library allows the overwrite) and crashes dynamo later. The name
    # stands for tritonllm.kernels instead (its loaded modules too, so that `import kernels.custom_op` is
    # tritonllm.kernels.custom_op), and the relative imports below resolve to its modules.
    import importlib as _importlib
    import sys as _sys

    _sys.modules[__name__] = _importlib.import_module("tritonllm.kernels")
    for _name, _module in list(_sys.modules.items()):
        if _name.startswith("tritonllm.kernels."):
            _sys.modules[__name__ + _name[len("tritonllm.kernels"):]] = _module
    __package__ = "tritonllm.kernels"

from ._interpreter import choose_interpreter as _choose_interpreter  # noqa: E402

_choose_interpreter()

from ._interpreter import interpreting  # noqa: E402
from .gemm_settings import GemmSettings, configure_gemm, gemm_settings  # noqa: E402
# memory-bound ops
from .rms_norm import rms_norm  # noqa: E402
from .swiglu import swiglu  # noqa: E402
from .relu2 import relu2  # noqa: E402
from .gelu import gelu_tanh  # noqa: E402
from .softcap import softcap  # noqa: E402
from .residual_mix import add_fork, fork, weighted_add  # noqa: E402
from .rope import rope, rope_cos_sin  # noqa: E402
from .embedding import embedding  # noqa: E402
from .cross_entropy import cross_entropy  # noqa: E402
from .adamw import adamw_step_, clip_grads_  # noqa: E402
from .muon import muon_step_, orthogonalize  # noqa: E402
# matrix products
from .linear import linear, linear_swiglu  # noqa: E402
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402
from .fp8_linear import fp8_linear, fp8_linear_swiglu  # noqa: E402
# attention
from .flash_attention import flash_attention, flash_attention_bwd, flash_attention_fwd, rope_flash_attention  # noqa: E402
from .flash_attention.settings import AttentionSettings, attention_settings, configure_attention  # noqa: E402
from .split_heads import split_heads  # noqa: E402
# mixture of experts
from .moe_router import MoERouting, moe_router  # noqa: E402
from .moe_permute import MoEPlan, moe_combine, moe_gather, moe_sort  # noqa: E402
from .grouped_linear import grouped_linear, grouped_linear_swiglu  # noqa: E402
from .moe import moe, moe_experts  # noqa: E402
# modules of ops no functional above imports; imported for their custom-op registrations
from . import kv_cache, lora  # noqa: E402,F401

__all__ = [
    "interpreting", "GemmSettings", "configure_gemm", "gemm_settings",
    "rms_norm", "swiglu", "relu2", "gelu_tanh", "softcap", "rope", "rope_cos_sin", "embedding", "cross_entropy", "adamw_step_",
    "clip_grads_", "weighted_add", "fork", "add_fork",
    "muon_step_", "orthogonalize",
    "linear", "linear_swiglu", "linear_cross_entropy", "fp8_linear", "fp8_linear_swiglu",
    "flash_attention", "flash_attention_fwd", "flash_attention_bwd", "rope_flash_attention", "split_heads",
    "AttentionSettings", "attention_settings", "configure_attention",
    "MoERouting", "moe_router", "MoEPlan", "moe_sort", "moe_gather", "moe_combine",
    "grouped_linear", "grouped_linear_swiglu", "moe", "moe_experts",
]
