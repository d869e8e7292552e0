"""tritonllm: an LLM training framework in which every op of the training step is a Triton kernel.

Layers of the package, imports flowing one way:
``tritonllm.kernels`` -> ``tritonllm.nn`` -> ``tritonllm.models`` -> ``tritonllm.train``.
"""

__version__ = "0.1.0"
