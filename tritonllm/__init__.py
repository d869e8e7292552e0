"""tritonllm: an LLM training framework in which every op of the training step is a Triton kernel.

Layers of the package, imports flowing one way:
``tritonllm.kernels`` -> ``tritonllm.nn`` -> ``tritonllm.models`` -> ``tritonllm.train``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``tritonllm.patch(model)`` and ``tritonllm.apply_tritonllm_kernels(model)`` (:mod:`tritonllm.patch`),
    imported on first use so that ``import tritonllm`` stays light."""
    if name in ("patch", "apply_tritonllm_kernels"):
        import importlib

        module = importlib.import_module("tritonllm.patch")
        return module if name == "patch" else module.apply_tritonllm_kernels
    raise AttributeError(f"module 'tritonllm' has no attribute {name!r}")
