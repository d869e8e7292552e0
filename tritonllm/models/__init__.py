"""tritonllm.models: the model config and the decoder-only Transformer built on tritonllm's kernels."""

from .config import ModelConfig, ModelConfigError
from .transformer import KVCache, Transformer, build_mlp, build_model, sample_next

__all__ = ["KVCache", "ModelConfig", "ModelConfigError", "Transformer", "build_mlp", "build_model", "sample_next"]
