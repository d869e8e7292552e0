"""The model configuration: one typed dataclass, built from a dict or a Hydra ``DictConfig``.

``conf/model/<name>.yaml`` holds the fields of :class:`ModelConfig` (Hydra group ``model``:
``python -m tritonllm.train +model=void125m model.n_layers=4``). Invalid or unknown fields raise a
:class:`ModelConfigError` (both a :class:`tritonllm.errors.ConfigError` and a ``ValueError``) naming
the field. Every yaml states its parameter count in a ``# params: ...`` comment, which
``tests/test_models.py`` checks against :meth:`ModelConfig.param_count`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from tritonllm.containers import plain_container
from tritonllm.errors import ConfigError

MOE_SCORES = ("softmax", "sigmoid")
ROPE_SCALINGS = ("ntk", "yarn", "linear", "llama3")
MLP_ACTS = ("swiglu", "relu2")
QK_NORM_SPANS = ("head", "all")


class ModelConfigError(ConfigError, ValueError):
    """An unknown, mistyped or inconsistent model config field (also a ValueError for plain callers)."""


@dataclass
class ModelConfig:
    name: str = "custom"  # config name, used in logs and checkpoint folders
    vocab_size: int = 32000  # rows of the token embedding (and of the LM head)
    d_model: int = 768  # width of the residual stream
    n_layers: int = 12  # number of transformer blocks
    n_heads: int = 12  # query heads per attention layer
    n_kv_heads: int | None = None  # key/value heads (GQA; 1 = MQA); None = n_heads
    head_dim: int | None = None  # width of one head; None = d_model // n_heads
    d_ff: int = 2048  # hidden width of the dense SwiGLU MLP
    max_seq_len: int = 2048  # longest sequence: size of the RoPE tables and of the KV cache
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: dict | None = None  # None | {"type": "ntk"|"yarn"|"linear"|"llama3", "factor": f, ...} (rope_cos_sin)
    qk_norm: bool = False  # RMSNorm on queries and keys before RoPE
    qk_norm_span: str = "head"  # qk_norm over each head's head_dim ("head", Qwen3) or all heads of a token ("all", OLMoE)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    window: int | None = None  # sliding-window attention span in tokens; None = full causal
    window_schedule: list | None = None  # per-layer windows (int, or null: full causal), cycled over the layers
    mlp_act: str = "swiglu"  # dense MLP: swiglu (packed gate and up) or relu2 (relu(x W1^T)^2, one up projection)
    value_embeddings: int = 0  # extra token-embedding tables [vocab, n_kv_heads * head_dim] mixed into attention values
    value_embedding_layers: list | None = None  # table index (or null) per layer; None = table i at layers i and n_layers - value_embeddings + i
    unet_skips: bool = False  # U-net: block j's output stream, times a learned gate, into block n_layers - 1 - j's input
    norm_eps: float = 1e-6  # epsilon of every RMSNorm
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    init_std: float = 0.02  # std of the normal init; output projections get init_std / sqrt(2 * n_layers)
    logit_softcap: float | None = None  # cap c of the LM-head logits, c * tanh(logits / c); None = uncapped
    z_loss_coef: float = 0.0  # weight of the LM-head z-loss (mean logsumexp^2) added to the training loss
    lm_head_fp8: bool = False  # training loss's LM head on fp8 operands (e4m3 x, W; e5m2 dlogits; per-row scales; GPU)
    n_experts: int = 0  # routed experts per MoE layer; 0 = dense SwiGLU MLP
    moe_top_k: int = 2  # experts each token is routed to
    d_expert: int | None = None  # hidden width of one expert's SwiGLU; None = d_ff
    n_shared_experts: int = 0  # always-on experts (width d_expert) added to the routed ones
    moe_score: str = "softmax"  # router scoring function: "softmax" or "sigmoid"
    moe_normalize: bool = True  # renormalise the top-k routing weights to sum to 1
    moe_aux_loss_coef: float = 0.01  # weight of the load-balancing auxiliary loss
    moe_z_loss_coef: float = 0.0  # weight of the router z-loss

    def __post_init__(self):
        _check_types(self)
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, f) < 1:
                raise ModelConfigError(f"{f} must be >= 1, got {getattr(self, f)}")
        self.n_kv_heads = kv_heads = self.kv_heads
        if kv_heads < 1 or self.n_heads % kv_heads:
            raise ModelConfigError(f"n_kv_heads ({kv_heads}) must divide n_heads ({self.n_heads})")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ModelConfigError(f"d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads}); "
                                   "set head_dim explicitly")
        self.head_dim = head_dim = self.head_size
        if head_dim < 2 or head_dim % 2:
            raise ModelConfigError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
        if self.window is not None and self.window < 1:
            raise ModelConfigError(f"window must be None or >= 1, got {self.window}")
        if self.window_schedule is not None:
            if self.window is not None:
                raise ModelConfigError("window and window_schedule are both set: give one")
            if not self.window_schedule or any(
                    w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1)
                    for w in self.window_schedule):
                raise ModelConfigError(f"window_schedule must be a non-empty list of ints >= 1 or nulls, "
                                       f"got {self.window_schedule}")
        if self.qk_norm_span not in QK_NORM_SPANS:
            raise ModelConfigError(f"qk_norm_span must be one of {QK_NORM_SPANS}, got {self.qk_norm_span!r}")
        if self.mlp_act not in MLP_ACTS:
            raise ModelConfigError(f"mlp_act must be one of {MLP_ACTS}, got {self.mlp_act!r}")
        if self.mlp_act != "swiglu" and self.n_experts:
            raise ModelConfigError(f"mlp_act={self.mlp_act!r} is for the dense MLP; MoE experts are SwiGLU")
        self._check_value_embeddings()
        if self.logit_softcap is not None and not 0.0 < self.logit_softcap < float("inf"):
            raise ModelConfigError(f"logit_softcap must be None or a finite number > 0, got {self.logit_softcap}")
        if self.rope_scaling is not None and self.rope_scaling.get("type") not in ROPE_SCALINGS:
            raise ModelConfigError(f"rope_scaling must be None or a dict with type in {ROPE_SCALINGS}, "
                             f"got {self.rope_scaling}")
        self.d_expert = self.expert_width
        if self.n_experts < 0:
            raise ModelConfigError(f"n_experts must be >= 0, got {self.n_experts}")
        if self.n_experts and not 1 <= self.moe_top_k <= self.n_experts:
            raise ModelConfigError(f"moe_top_k must be in [1, n_experts={self.n_experts}], got {self.moe_top_k}")
        if self.moe_score not in MOE_SCORES:
            raise ModelConfigError(f"moe_score must be one of {MOE_SCORES}, got {self.moe_score!r}")

    # The fields that None defaults to another field's value, resolved (typed int): __post_init__ stores
    # these values in the fields, so after construction they equal n_kv_heads, head_dim and d_expert.
    @property
    def kv_heads(self) -> int:
        """``n_kv_heads``, or ``n_heads`` when it is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        """``head_dim``, or ``d_model // n_heads`` when it is None."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def expert_width(self) -> int:
        """``d_expert``, or ``d_ff`` when it is None."""
        return self.d_ff if self.d_expert is None else self.d_expert

    @classmethod
    def from_dict(cls, d) -> ModelConfig:
        """Build from a mapping or an OmegaConf ``DictConfig``; an unknown key is a ModelConfigError naming it."""
        d = plain_container(d)
        if not isinstance(d, Mapping):
            raise ModelConfigError(f"model config must be a mapping or DictConfig, got {type(d).__name__}")
        d = {k: plain_container(v) for k, v in d.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ModelConfigError(f"unknown model config key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**d)

    def _check_value_embeddings(self) -> None:
        k, layers = self.value_embeddings, self.value_embedding_layers
        if k < 0:
            raise ModelConfigError(f"value_embeddings must be >= 0, got {k}")
        if layers is None:
            if 2 * k > self.n_layers:
                raise ModelConfigError(f"value_embeddings={k} tables at the first and last {k} layers need "
                                       f"n_layers >= {2 * k}, got {self.n_layers}; or give value_embedding_layers")
            return
        if not k:
            raise ModelConfigError("value_embedding_layers is set but value_embeddings is 0")
        if len(layers) != self.n_layers or any(
                t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < k) for t in layers):
            raise ModelConfigError(f"value_embedding_layers must list, per layer ({self.n_layers}), a table index in "
                                   f"[0, {k}) or null, got {layers}")
        unused = sorted(set(range(k)) - set(layers))
        if unused:
            raise ModelConfigError(f"value_embedding_layers uses no layer for table(s) {unused}")

    def layer_value_embedding(self, layer: int) -> int | None:
        """Value-embedding table of block ``layer`` (None: none): ``value_embedding_layers[layer]`` when
        set, else table i at layers i and ``n_layers - value_embeddings + i`` (the first and last
        ``value_embeddings`` layers, as modded-nanogpt places them)."""
        if self.value_embedding_layers is not None:
            return self.value_embedding_layers[layer]
        k = self.value_embeddings
        if layer < k:
            return layer
        return layer - (self.n_layers - k) if layer >= self.n_layers - k else None

    def layer_window(self, layer: int) -> int | None:
        """Attention window of block ``layer``: ``window_schedule[layer % len]`` when set, else ``window``."""
        if self.window_schedule is not None:
            return self.window_schedule[layer % len(self.window_schedule)]
        return self.window

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def param_count(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Analytic parameter count of the Transformer this config builds (nothing is allocated).

        ``exclude_embedding`` drops the token-embedding table (the LM head of an untied model is
        kept: it is a matmul every token pays). ``active`` counts, in MoE layers, only the
        ``moe_top_k`` routed experts a token uses. MoE layers are counted as a router
        ``[n_experts, d_model]`` plus ``n_experts + n_shared_experts`` SwiGLU experts of width
        ``d_expert`` (three ``d_model x d_expert`` matrices each). Value-embedding tables are lookup
        tables like the token embedding (dropped by ``exclude_embedding``); each layer that mixes one in
        has 2 mixing weights; U-net skips add one gate per pair of blocks.
        """
        d, hd, kv = self.d_model, self.head_size, self.kv_heads
        attn = d * (self.n_heads + 2 * kv) * hd + self.n_heads * hd * d
        if self.qk_norm:
            attn += (self.n_heads + kv) * hd if self.qk_norm_span == "all" else 2 * hd
        attn += (self.n_heads + 2 * kv) * hd if self.qkv_bias else 0
        if self.n_experts:
            experts = self.moe_top_k if active else self.n_experts
            mlp = d * self.n_experts + (experts + self.n_shared_experts) * 3 * d * self.expert_width
        else:
            mlp = (2 if self.mlp_act == "relu2" else 3) * d * self.d_ff
        total = self.n_layers * (attn + mlp + 2 * d) + d
        total += 2 * sum(self.layer_value_embedding(i) is not None for i in range(self.n_layers))
        total += self.n_layers // 2 if self.unet_skips else 0
        embed = self.vocab_size * (d + self.value_embeddings * kv * hd)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        if exclude_embedding:
            return total + head
        return total + embed + head


def _check_types(cfg: ModelConfig) -> None:
    """Coerce int -> float where a float is declared; raise a ModelConfigError naming a mistyped field."""
    hints = typing.get_type_hints(ModelConfig)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        if value is None and type(None) in allowed:
            continue
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            setattr(cfg, f.name, float(value))
            continue
        ok = any(isinstance(value, t) and not (t is int and isinstance(value, bool)) for t in allowed
                 if t is not type(None))
        if not ok:
            names = " | ".join(getattr(t, "__name__", str(t)) for t in allowed)
            raise ModelConfigError(f"model config field {f.name} must be {names}, got {value!r}")
