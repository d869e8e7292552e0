"""Function-preserving growth: a trained parent's weights turned into a larger child's (warm starts).

Each operation maps a state dict of :class:`tritonllm.models.transformer.Transformer` for a
config ``cfg`` to one for a larger config such that the grown model computes the same logits as
the parent (exactly in real arithmetic; the float32 tests hold it to 1e-5). New parameters that
feed the residual stream start at zero; every other new parameter is drawn ``normal(0, init_std)``
like the model's own init, so the new units learn: a product whose both sides were zero would
get no gradient, but an output projection that is zero while its input is not gets one at the
first step, and the input side follows once it has moved.

- :func:`add_layers`: ``n_layers`` up. New blocks are identities: attention ``proj`` and MLP
  ``w2`` (MoE: every expert's ``w2`` and ``shared_w2``) zero, ``qkv`` / ``w13`` (``w1``, the
  router) random, norms ones. New block ``k`` of ``m`` goes right after parent block
  ``floor(k * n_layers / m)`` (spread over the depth). Refused for models whose layers depend on
  their index or count (``unet_skips``, ``value_embeddings``, ``window_schedule``).
- :func:`widen_ffn`: ``d_ff`` up (MoE: ``d_expert``). New hidden units: gate and up rows of the
  packed ``w13`` random (gate rows stay before up rows: ``[gate, gate_new, up, up_new]``), their
  ``w2`` columns zero; squared-ReLU ``w1`` rows likewise; shared experts the same.
- :func:`add_heads`: ``n_heads`` up and/or ``n_kv_heads`` changed, ``head_dim`` fixed. Query
  head ``h`` reads KV head ``h // (n_heads / n_kv_heads)`` (the attention kernels' grouping). New
  query heads get random ``qkv`` rows and zero ``proj`` columns; each KV head of the child is a
  copy of the parent KV head its parent query heads read (so a GQA model can become one with
  more KV heads, e.g. ratio 2 -> 1, exactly), or random when it serves only new query heads. A
  child KV head whose query heads read different parent KV heads (fewer KV heads: ratio 1 -> 2)
  is refused. QKV biases of new rows are zero (copied for copied KV heads); value-embedding
  tables follow their KV heads.
- :func:`widen_model`: ``d_model`` from ``d`` to ``d'``. The residual stream gets ``d' - d``
  extra coordinates that start at zero, and the old ones are scaled by ``c = sqrt(d' / d)``, so
  that every RMSNorm sees the same ``mean(x^2)`` over ``d'`` coordinates as before over ``d``
  (``eps`` included: zero padding alone would divide the mean by ``d'`` and change the norm by
  ``eps``). So: the token embedding's old columns times ``c``, new columns zero; the output
  projections (``proj``, ``w2``, experts' ``w2``, ``shared_w2``) old rows times ``c``, new rows
  zero (the new coordinates stay zero); every block norm's old weights divided by ``c`` (its
  output is then the parent's), new weights ones; the final norm's old weights divided by ``c``,
  or by ``c^2`` with tied embeddings (the LM head is the scaled embedding); the input columns for
  the new coordinates (``qkv``, ``w13``, ``w1``, router, experts' ``w13``, an untied LM head) are
  random: they multiply zeros, and pass gradients back to the new coordinates. U-net skip gates,
  value embeddings, QK-norm weights and value mixes do not depend on ``d_model`` and are kept.

Anything else that differs between parent and child (``head_dim``: RoPE frequencies and the
softmax scale change; ``qk_norm``, windows, vocabulary, expert count, ...) is not a growth:
:func:`growth_steps` raises :class:`GrowthError` naming it, and the child trains from scratch.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from tritonllm.models.config import ModelConfig

#: config fields a growth may change (``name`` aside); ``d_ff`` / ``d_expert`` only where the model uses it
GROWN_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "d_expert")

_NORMS = ("attn_norm.weight", "mlp_norm.weight")
_OUT_ROWS = ("attn.proj.weight", "mlp.w2.weight", "mlp.shared_w2.weight")  # [d_model, K]: write the stream
_IN_COLS = ("attn.qkv.weight", "mlp.w13.weight", "mlp.w1.weight", "mlp.router.weight",
            "mlp.shared_w13.weight")  # [N, d_model]: read the normed stream
_SAME_WIDTH = ("attn.qkv.bias", "attn.q_norm.weight", "attn.k_norm.weight", "attn.value_mix")
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


class GrowthError(ValueError):
    """The child is not a function-preserving growth of the parent (the message says why)."""


class NewValues:
    """The values of new parameters, float32: ``rand`` draws ``normal(0, std)`` from a generator seeded
    with ``seed``; ``zeros`` for those that write into the residual stream."""

    def __init__(self, std: float, seed: int):
        self.std = std
        self.gen = torch.Generator().manual_seed(seed)

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen) * self.std

    @staticmethod
    def zeros(*shape) -> torch.Tensor:
        return torch.zeros(shape)


def _split(key: str) -> tuple[int | None, str]:
    m = _BLOCK.match(key)
    return (int(m.group(1)), m.group(2)) if m else (None, key)


def _unknown(key: str, op: str) -> GrowthError:
    return GrowthError(f"{op}: no growth rule for parameter {key!r}")


def _kv_sources(parent: ModelConfig, n_heads: int, n_kv_heads: int) -> list[int | None]:
    """Per child KV head, the parent KV head it copies (None: a new one); GrowthError when its
    query heads read different parent KV heads."""
    group, new_group = parent.n_heads // parent.kv_heads, n_heads // n_kv_heads
    out = []
    for j in range(n_kv_heads):
        olds = {h // group for h in range(j * new_group, (j + 1) * new_group) if h < parent.n_heads}
        if len(olds) > 1:
            raise GrowthError(f"n_kv_heads {parent.n_kv_heads} -> {n_kv_heads} (n_heads {parent.n_heads} -> "
                              f"{n_heads}): child KV head {j} serves query heads that read parent KV heads "
                              f"{sorted(olds)}; KV heads can be split, not merged")
        out.append(olds.pop() if olds else None)
    return out


def growth_steps(parent: ModelConfig, child: ModelConfig) -> list[str]:
    """The growth from ``parent`` to ``child`` as readable steps (``["n_layers 2 -> 4", ...]``; empty:
    the same model); raises :class:`GrowthError` when ``child`` is not a function-preserving growth."""
    ffn = "d_expert" if parent.n_experts else "d_ff"  # the other one is unused by the model
    a, b = parent.to_dict(), child.to_dict()
    for field in a:
        if field != "name" and field not in GROWN_FIELDS and a[field] != b[field]:
            raise GrowthError(f"{field} {a[field]!r} -> {b[field]!r} is not a function-preserving growth")
    steps = []
    for field in ("n_layers", "d_model", "n_heads", ffn):
        if b[field] < a[field]:
            raise GrowthError(f"{field} {a[field]} -> {b[field]} shrinks the model")
        if b[field] > a[field]:
            steps.append(f"{field} {a[field]} -> {b[field]}")
    heads = (child.n_heads, child.kv_heads) != (parent.n_heads, parent.kv_heads)
    if heads and parent.qk_norm and parent.qk_norm_span == "all":
        raise GrowthError("n_heads / n_kv_heads change with qk_norm_span='all': the QK-norm's mean spans the heads, "
                          "new heads would change it")
    if child.n_kv_heads != parent.n_kv_heads:
        _kv_sources(parent, child.n_heads, child.kv_heads)
        steps.append(f"n_kv_heads {parent.n_kv_heads} -> {child.n_kv_heads}")
    if child.n_layers > parent.n_layers:
        for field, value in (("unet_skips", parent.unet_skips), ("value_embeddings", parent.value_embeddings),
                             ("window_schedule", parent.window_schedule)):
            if value:
                raise GrowthError(f"n_layers {parent.n_layers} -> {child.n_layers} with {field}={value!r}: the "
                                  f"layers depend on their index or count, an inserted layer would move them")
    return steps


def widen_model(state: dict, cfg: ModelConfig, d_model: int, init: NewValues) -> tuple[dict, ModelConfig]:
    """``d_model`` up (module docstring): the old coordinates scaled by ``sqrt(d_model / cfg.d_model)``, new ones zero."""
    d, p = cfg.d_model, d_model - cfg.d_model
    c = math.sqrt(d_model / d)
    out = {}
    for key, v in state.items():
        _, name = _split(key)
        if key == "embed.weight":
            out[key] = torch.cat([v * c, init.zeros(v.shape[0], p)], 1)
        elif key == "lm_head.weight":
            out[key] = torch.cat([v, init.rand(v.shape[0], p)], 1)
        elif key == "norm.weight":
            out[key] = torch.cat([v / (c * c if cfg.tie_embeddings else c), torch.ones(p)])
        elif name in _NORMS:
            out[key] = torch.cat([v / c, torch.ones(p)])
        elif name in _IN_COLS:
            out[key] = torch.cat([v, init.rand(v.shape[0], p)], 1)
        elif name == "mlp.w13":  # experts [E, 2F, d]
            out[key] = torch.cat([v, init.rand(*v.shape[:2], p)], 2)
        elif name in _OUT_ROWS:
            out[key] = torch.cat([v * c, init.zeros(p, v.shape[1])], 0)
        elif name == "mlp.w2":  # experts [E, d, F]
            out[key] = torch.cat([v * c, init.zeros(v.shape[0], p, v.shape[2])], 1)
        elif name in _SAME_WIDTH or key.startswith(("value_embeds.", "skip_gates.")):
            out[key] = v
        else:
            raise _unknown(key, "widen_model")
    return out, dataclasses.replace(cfg, d_model=d_model)


def add_heads(state: dict, cfg: ModelConfig, n_heads: int, n_kv_heads: int, init: NewValues) -> tuple[dict, ModelConfig]:
    """``n_heads`` up and/or ``n_kv_heads`` changed at the same ``head_dim`` (module docstring)."""
    D, hq, hkv = cfg.head_size, cfg.n_heads, cfg.kv_heads
    sources = _kv_sources(cfg, n_heads, n_kv_heads)
    new_q = (n_heads - hq) * D

    def kv_heads(t: torch.Tensor, fill) -> torch.Tensor:
        """``t [hkv * D, ...]`` -> ``[n_kv_heads * D, ...]``: each child head copied from its source or filled."""
        heads = t.reshape(hkv, D, *t.shape[1:])
        return torch.cat([heads[s] if s is not None else fill(D, *t.shape[1:]) for s in sources], 0)

    out = {}
    for key, v in state.items():
        _, name = _split(key)
        if name in ("attn.qkv.weight", "attn.qkv.bias"):
            fill = init.rand if name.endswith("weight") else init.zeros
            q, k, val = v.split([hq * D, hkv * D, hkv * D], 0)
            out[key] = torch.cat([q, fill(new_q, *v.shape[1:]), kv_heads(k, fill), kv_heads(val, fill)], 0)
        elif name == "attn.proj.weight":
            out[key] = torch.cat([v, init.zeros(v.shape[0], new_q)], 1)
        elif key.startswith("value_embeds."):  # [vocab, hkv * D]
            out[key] = kv_heads(v.t(), init.rand).t()
        else:
            out[key] = v
    return out, dataclasses.replace(cfg, n_heads=n_heads, n_kv_heads=n_kv_heads)


def _pad_hidden(t: torch.Tensor, packed: int, extra: int, dim: int, fill) -> torch.Tensor:
    """``t`` with ``extra`` hidden units appended along ``dim`` to each of its ``packed`` parts
    (2: SwiGLU's gate rows then up rows; 1: a plain hidden dimension)."""
    shape = list(t.shape)
    shape[dim] = extra
    parts = t.chunk(packed, dim)
    return torch.cat([x for part in parts for x in (part, fill(*shape))], dim)


def widen_ffn(state: dict, cfg: ModelConfig, width: int, init: NewValues) -> tuple[dict, ModelConfig]:
    """The MLP's hidden width up: ``d_ff`` of a dense MLP, ``d_expert`` of an MoE's experts (and its
    shared experts, ``n_shared_experts * d_expert`` wide). New units: random input rows, zero ``w2`` columns."""
    moe = bool(cfg.n_experts)
    extra = width - (cfg.expert_width if moe else cfg.d_ff)
    shared = cfg.n_shared_experts * extra
    out = {}
    for key, v in state.items():
        _, name = _split(key)
        if name == "mlp.w13.weight":
            out[key] = _pad_hidden(v, 2, extra, 0, init.rand)
        elif name == "mlp.w1.weight":
            out[key] = _pad_hidden(v, 1, extra, 0, init.rand)
        elif name == "mlp.w2.weight":
            out[key] = _pad_hidden(v, 1, extra, 1, init.zeros)
        elif name == "mlp.w13":  # experts [E, 2F, d]
            out[key] = _pad_hidden(v, 2, extra, 1, init.rand)
        elif name == "mlp.w2":  # experts [E, d, F]
            out[key] = _pad_hidden(v, 1, extra, 2, init.zeros)
        elif name == "mlp.shared_w13.weight":
            out[key] = _pad_hidden(v, 2, shared, 0, init.rand)
        elif name == "mlp.shared_w2.weight":
            out[key] = _pad_hidden(v, 1, shared, 1, init.zeros)
        else:
            out[key] = v
    return out, (dataclasses.replace(cfg, d_expert=width) if moe else dataclasses.replace(cfg, d_ff=width))


def _identity_block(template: dict, init: NewValues) -> dict:
    """A new block's parameters (names relative to the block) shaped like ``template``'s: output
    projections and biases zero, norms ones, the rest random."""
    out = {}
    for name, v in template.items():
        if name in _OUT_ROWS or name in ("mlp.w2", "attn.qkv.bias"):
            out[name] = init.zeros(*v.shape)
        elif name in _NORMS or name in ("attn.q_norm.weight", "attn.k_norm.weight"):
            out[name] = torch.ones(v.shape)
        elif name in _IN_COLS or name == "mlp.w13":
            out[name] = init.rand(*v.shape)
        else:
            raise _unknown(f"blocks.0.{name}", "add_layers")
    return out


def add_layers(state: dict, cfg: ModelConfig, n_layers: int, init: NewValues) -> tuple[dict, ModelConfig]:
    """``n_layers`` up by inserting identity blocks spread over the depth (module docstring)."""
    n, m = cfg.n_layers, n_layers - cfg.n_layers
    blocks: list[dict] = [{} for _ in range(n)]
    out = {}
    for key, v in state.items():
        i, name = _split(key)
        if i is None:
            out[key] = v
        else:
            blocks[i][name] = v
    after = [k * n // m for k in range(m)]  # parent block each new block follows
    order = [b for i in range(n) for b in [blocks[i]] + [_identity_block(blocks[0], init) for _ in range(after.count(i))]]
    for i, block in enumerate(order):
        out.update({f"blocks.{i}.{name}": v for name, v in block.items()})
    return out, dataclasses.replace(cfg, n_layers=n_layers)


def grow(state: dict, parent: ModelConfig, child: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of ``child`` grown from ``parent``'s ``state`` (float32; new values drawn from
    ``seed``): :func:`widen_model`, :func:`add_heads`, :func:`widen_ffn`, then :func:`add_layers`
    (new blocks at the child's widths), each only where the child is larger. Raises
    :class:`GrowthError` when the child is not a growth of the parent (:func:`growth_steps`)."""
    growth_steps(parent, child)
    init = NewValues(parent.init_std, seed)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in state.items()}
    cfg = parent
    if child.d_model > cfg.d_model:
        state, cfg = widen_model(state, cfg, child.d_model, init)
    if (child.n_heads, child.n_kv_heads) != (cfg.n_heads, cfg.n_kv_heads):
        state, cfg = add_heads(state, cfg, child.n_heads, child.kv_heads, init)
    width = child.expert_width if child.n_experts else child.d_ff
    if width > (cfg.expert_width if cfg.n_experts else cfg.d_ff):
        state, cfg = widen_ffn(state, cfg, width, init)
    if child.n_layers > cfg.n_layers:
        state, cfg = add_layers(state, cfg, child.n_layers, init)
    return {k: v.contiguous() for k, v in state.items()}


__all__ = ["GROWN_FIELDS", "GrowthError", "NewValues", "add_heads", "add_layers", "grow", "growth_steps", "widen_ffn",
           "widen_model"]
