"""A decoder-only transformer whose forward and backward run only tritonllm's Triton kernels.

    x = embedding(idx)
    for each block:  x = x + attention(rms_norm(x));  x = x + mlp(rms_norm(x))
    logits = rms_norm(x) @ W_head.T            (W_head = the embedding when tied)

Attention: one packed QKV GEMM, viewed as ``[B, T, Hq + 2 Hkv, D]`` and split into strided q, k,
v views (no copies); optional QK-norm (RMSNorm over D); RoPE on q and k; flash attention (GQA/MQA,
causal, optional sliding window); output GEMM. MLP: SwiGLU with gate and up packed in one GEMM
(``linear_swiglu``), then the down GEMM; or an MoE layer (:func:`build_mlp`).

Residual adds are fused into the RMSNorm kernels: ``rms_norm(delta, w, residual=x)`` returns
``(norm(x + delta) * w, x + delta)``. Each residual-stream tensor is then consumed exactly once,
so the backward pass has no autograd-side gradient accumulation (which would be a PyTorch add
kernel); adding in the output GEMM's epilogue (``linear(..., residual=x)``) instead would fork
the stream into the next norm and its residual, and cost that extra add. So a block receives the
stream and the previous block's MLP output not yet added; the first block adds the embedding to a
zero stream, the final norm adds the last MLP output.

Options of the modded-nanogpt recipe (off by default): ``value_embeddings`` extra embedding tables
whose lookups are mixed into the attention values of their layers, ``v = a v + b ve`` with learned
``value_mix = [a, b]`` (init 0.5, 0.5); ``unet_skips``: the stream after block j, times a learned
gate (init 1), is added to the input of block ``n_layers - 1 - j`` for j < n_layers / 2 (into the
pending delta, so the norm's fused add still consumes each stream tensor once; the skip itself is
materialised by ``add_fork``). Both through ``kernels.residual_mix``; a lookup used by two layers is
``fork``-ed so its gradients are summed in Triton.

Init (GPT-2): every weight matrix ``normal(0, init_std)``, the two output projections of each
block (attention ``proj`` and MLP ``w2``) ``normal(0, init_std / sqrt(2 * n_layers))`` so the
residual stream's variance does not grow with depth; RMSNorm weights ones.
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from tritonllm.kernels.flash_attention import flash_attention, flash_attention_decode
from tritonllm.kernels.kv_cache import kv_cache_write_
from tritonllm.kernels.linear import linear
from tritonllm.kernels.linear_cross_entropy import linear_cross_entropy
from tritonllm.kernels.relu2 import relu2
from tritonllm.kernels.residual_mix import add_fork, fork, weighted_add
from tritonllm.kernels.rope import rope, rope_cos_sin
from tritonllm.kernels.softcap import softcap
from tritonllm.kernels.split_heads import split_heads
from tritonllm.models.config import ModelConfig
from tritonllm.nn import Embedding, Linear, LinearSwiGLU, RMSNorm


def _out_std(cfg: ModelConfig) -> float:
    """Init std of the projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


class KVCache:
    """Static keys and values, ``[B, max_len, Hkv, D]`` per layer, and how many positions are filled.

    ``pos`` is the fill position as a 0-d int32 tensor on the cache's device. The kernels read it
    from device memory (the RoPE offset, the row :func:`kv_cache_write_` writes, the number of keys
    :func:`flash_attention_decode` attends to), so one decode step (:meth:`Transformer.decode_step`)
    has fixed shapes and can be captured in a CUDA graph and replayed while ``pos`` advances.
    ``length`` is the same count as the host knows it: a forward with a cache (the prompt's prefill,
    whose key views need host shapes) attends to the cached positions plus its own and advances
    both (:meth:`advance`); a decode step advances ``pos`` alone, on the device.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device=None, dtype=None):
        shape = (batch_size, max_len, cfg.n_kv_heads, cfg.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.max_len = max_len
        self.pos = torch.zeros((), dtype=torch.int32, device=device)
        self.length = 0

    def reset(self) -> None:
        """Empty the cache (``pos`` and ``length`` 0; the buffers keep their addresses)."""
        self.pos.zero_()
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write ``k, v [B, T, Hkv, D]`` at positions ``pos .. pos+T-1`` (read on the device); return
        views of the ``length + T`` filled positions."""
        end = self.length + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache of max_len {self.max_len} cannot hold {end} positions")
        kv_cache_write_(k, v, self.k[layer], self.v[layer], self.pos)
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def advance(self, n: int) -> None:
        """Count ``n`` more filled positions, on the device and on the host."""
        self.pos += n
        self.length += n


class Attention(nn.Module):
    """Causal self-attention with GQA/MQA, RoPE, optional QK-norm and optional sliding window."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.layer_window(layer_idx)
        self.qkv = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias,
                          init_std=cfg.init_std)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.proj = Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, init_std=_out_std(cfg))
        has_ve = cfg.layer_value_embedding(layer_idx) is not None
        self.value_mix = nn.Parameter(torch.full((2,), 0.5)) if has_ve else None  # [a, b]: v = a v + b ve

    def mix_value(self, v: torch.Tensor, ve: torch.Tensor | None) -> torch.Tensor:
        """``v [B, T, Hkv, D]`` mixed with the layer's value embedding ``ve [B, T, Hkv * D]`` (None: v)."""
        if ve is None:
            return v
        return weighted_add(v, ve.view(v.shape), self.value_mix)

    def forward(self, x, cos, sin, cache: KVCache | None = None, ve: torch.Tensor | None = None):
        B, T, _ = x.shape
        Hq, Hkv = self.n_heads, self.n_kv_heads
        qkv = self.qkv(x).view(B, T, Hq + 2 * Hkv, self.head_dim)
        pos = 0 if cache is None else cache.pos
        if self.q_norm is None:  # q and k are adjacent heads: one RoPE launch rotates both
            qk, v = split_heads(qkv, (Hq + Hkv, Hkv))
            q, k = split_heads(rope(qk, cos, sin, position_offset=pos), (Hq, Hkv))
        else:
            q, k, v = split_heads(qkv, (Hq, Hkv, Hkv))
            q = rope(self.q_norm(q), cos, sin, position_offset=pos)
            k = rope(self.k_norm(k), cos, sin, position_offset=pos)
        v = self.mix_value(v, ve)
        if cache is not None:
            k, v = cache.append(self.layer_idx, k, v)
        y = flash_attention(q, k, v, causal=True, window=self.window)
        return self.proj(y.reshape(B, T, self.n_heads * self.head_dim))

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, window={self.window}"


class MLP(nn.Module):
    """Dense SwiGLU MLP: ``w2(silu(x W_gate^T) * (x W_up^T))``, gate and up in one packed GEMM."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = LinearSwiGLU(cfg.d_model, cfg.d_ff, init_std=cfg.init_std)
        self.w2 = Linear(cfg.d_ff, cfg.d_model, init_std=_out_std(cfg))

    def forward(self, x):
        return self.w2(self.w13(x))


class ReLU2MLP(nn.Module):
    """Dense squared-ReLU MLP (``mlp_act: relu2``): ``w2(relu(x W1^T)^2)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.d_model, cfg.d_ff, init_std=cfg.init_std)
        self.w2 = Linear(cfg.d_ff, cfg.d_model, init_std=_out_std(cfg))

    def forward(self, x):
        return self.w2(relu2(self.w1(x)))


def build_mlp(cfg: ModelConfig) -> nn.Module:
    """The MLP slot of a block: dense SwiGLU (or squared ReLU, ``cfg.mlp_act``) when
    ``cfg.n_experts == 0``, else ``tritonllm.nn.moe.MoE``.

    An MLP module maps ``[B, T, d_model] -> [B, T, d_model]`` (the block adds the residual) and may
    set, during forward, ``self.aux_loss`` (0-d fp32, already scaled by its coefficient,
    differentiable: added to the training loss) and ``self.stats`` (dict of detached floats to log).
    """
    if cfg.n_experts == 0:
        return ReLU2MLP(cfg) if cfg.mlp_act == "relu2" else MLP(cfg)
    from tritonllm.nn.moe import MoE

    return MoE(cfg)


class Block(nn.Module):
    """Pre-norm block. Takes the residual stream ``x`` and ``delta``, the previous block's MLP output
    not yet added, and returns ``(x + delta + attn, mlp(...))``: each add is fused into the norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = build_mlp(cfg)

    def forward(self, x, delta, cos, sin, cache: KVCache | None = None, ve: torch.Tensor | None = None):
        h, x = self.attn_norm(delta, residual=x)
        h, x = self.mlp_norm(self.attn(h, cos, sin, cache, ve), residual=x)
        return x, self.mlp(h)


class Transformer(nn.Module):
    """Decoder-only language model built from a :class:`ModelConfig`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # ids come from a tokenizer or a loader that rejects out-of-vocabulary batches: no per-step sync
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std, validate=False)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size, init_std=cfg.init_std)
        self.value_embeds = nn.ModuleList(
            Embedding(cfg.vocab_size, cfg.n_kv_heads * cfg.head_dim, init_std=cfg.init_std, validate=False)
            for _ in range(cfg.value_embeddings)) if cfg.value_embeddings else None
        self.skip_gates = nn.ParameterList(
            nn.Parameter(torch.ones(1)) for _ in range(cfg.n_layers // 2)) if cfg.unet_skips else None
        self.last_losses: dict[str, torch.Tensor] = {}
        self._rope = None

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head ``[vocab_size, d_model]``: the embedding matrix when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 RoPE ``cos, sin [max_seq_len, head_dim / 2]`` on ``device``, built once per device
        (kept out of the module's buffers so that ``.to(bfloat16)`` leaves them in fp32)."""
        device = torch.device(device)
        if self._rope is None or self._rope[0].device != device:
            cfg = self.cfg
            self._rope = rope_cos_sin(cfg.max_seq_len, cfg.head_dim, theta=cfg.rope_theta,
                                      scaling=cfg.rope_scaling, device=device)
        return self._rope

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, d_model]`` of token ids ``idx [B, T]``."""
        T = idx.shape[1]
        start = 0 if cache is None else cache.length
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"idx: sequence of {start + T} positions exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_tables(idx.device)
        delta = self.embed(idx)
        x = torch.zeros_like(delta)
        ves, skips = self.layer_value_embeds(idx), []
        for i, block in enumerate(self.blocks):
            delta = self._skip_in(i, delta, skips)
            x, delta = block(x, delta, cos, sin, cache, ves[i])
            x, delta = self._skip_out(i, x, delta, skips)
        if cache is not None:
            cache.advance(T)
        h, _ = self.norm(delta, residual=x)
        return h

    def layer_value_embeds(self, idx: torch.Tensor) -> list:
        """Per block, its value embedding ``[B, T, n_kv_heads * head_dim]`` of ``idx`` or None: one lookup
        per table, ``fork``-ed to each further layer that uses it."""
        cfg = self.cfg
        out = [None] * cfg.n_layers
        for t, table in enumerate(self.value_embeds or ()):
            layers = [i for i in range(cfg.n_layers) if cfg.layer_value_embedding(i) == t]
            ve = table(idx)
            for i in layers[:-1]:
                out[i], ve = fork(ve)
            out[layers[-1]] = ve
        return out

    def _skip_in(self, i: int, delta: torch.Tensor, skips: list) -> torch.Tensor:
        """U-net decoder side: block ``i = n_layers - 1 - j`` (j < n_layers / 2) takes ``gate_j`` times
        the stream after block j into its pending delta."""
        n = self.cfg.n_layers
        if self.skip_gates is None or i < n - len(self.skip_gates):
            return delta
        return weighted_add(delta, skips.pop(), self.skip_gates[n - 1 - i])

    def _skip_out(self, i: int, x: torch.Tensor, delta: torch.Tensor, skips: list):
        """U-net encoder side: after block ``i < n_layers / 2`` the stream ``x + delta`` is materialised
        and kept for block ``n_layers - 1 - i``."""
        if self.skip_gates is None or i >= len(self.skip_gates):
            return x, delta
        x, delta, stream = add_fork(x, delta)
        skips.append(stream)
        return x, delta

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None):
        """``idx [B, T]`` int64 -> logits ``[B, T, V]``, or with ``targets [B, T]`` the scalar training
        loss: mean cross-entropy (fused with the LM head, logits never stored) + z-loss + the MLPs'
        ``aux_loss``. Sets ``self.last_losses`` (detached 0-d tensors, no host synchronisation):
        ``ce``, ``z_loss``, ``aux`` (the MLPs' scaled auxiliary losses summed) and, for MoE models,
        ``moe_aux`` and ``moe_z`` (the unscaled router losses averaged over the layers) and
        ``moe_max_load`` (the busiest expert's load over a balanced one's, worst layer)."""
        h = self.hidden(idx, cache)
        if targets is None:
            return self.logits(h)
        loss, z_loss = linear_cross_entropy(h.view(-1, h.shape[-1]), self.head_weight, targets.reshape(-1),
                                            z_loss=self.cfg.z_loss_coef, return_z_loss=True,
                                            softcap=self.cfg.logit_softcap)
        # 0-d bookkeeping only (PyTorch scalar ops): the logged CE without its z-loss part, and
        # the MLPs' auxiliary losses summed into the training loss.
        ce = loss.detach() - z_loss if self.cfg.z_loss_coef else loss.detach()
        aux = torch.zeros((), device=loss.device)
        stats = []
        for m in self.modules():
            if getattr(m, "aux_loss", None) is not None:
                loss = loss + m.aux_loss
                aux = aux + m.aux_loss.detach()
                m.aux_loss = None  # consumed: kept, it would hold the step's autograd graph past the backward
            if getattr(m, "stats", None):
                stats.append(m.stats)
        self.last_losses = {"ce": ce, "z_loss": z_loss.detach(), "aux": aux}
        if stats:
            per_layer = {k: torch.stack([s[k].float() for s in stats]) for k in stats[0]}
            self.last_losses.update(moe_aux=per_layer["moe_aux"].mean(), moe_z=per_layer["moe_z"].mean(),
                                    moe_max_load=per_layer["moe_max_load"].max())
        return loss

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM-head logits ``[..., V]`` of final-norm hidden states ``h [..., d_model]``, soft-capped to
        ``c * tanh(logits / c)`` when ``cfg.logit_softcap`` is c (the loss caps them inside the fused
        LM-head cross-entropy instead)."""
        logits = linear(h, self.head_weight)
        return logits if self.cfg.logit_softcap is None else softcap(logits, self.cfg.logit_softcap)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters held (a tied matrix once); ``exclude_embedding`` drops the token-embedding table
        and the value-embedding tables."""
        n = sum(p.numel() for p in self.parameters())
        tables = [self.embed.weight] + [t.weight for t in self.value_embeds or ()]
        return n - sum(t.numel() for t in tables) if exclude_embedding else n

    def num_active_params(self) -> int:
        """Parameters one token's forward multiplies with: all but the embedding lookup tables (a tied
        matrix counts, as the LM head) and, in MoE layers, the experts it is not routed to."""
        cfg = self.cfg
        inactive = cfg.param_count() - cfg.param_count(active=True)
        if cfg.tie_embeddings:  # the token table counts as the head; the value tables are lookups only
            inactive += sum(t.weight.numel() for t in self.value_embeds or ())
        return self.num_params(exclude_embedding=not cfg.tie_embeddings) - inactive

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): ``6 N_active + 12 n_layers n_heads head_dim seq_len``."""
        cfg = self.cfg
        return 6 * self.num_active_params() + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, V]`` of ``tokens [B, 1]`` (contiguous int64) at the cache's device position
        ``p = cache.pos``: every layer writes its key and value at row ``p`` and attends to rows
        ``0 .. p``; then ``cache.pos`` becomes ``p + 1`` (``cache.length`` is left alone). Nothing
        here reads a device value on the host and no shape depends on ``p``: the step can be captured
        in a CUDA graph. The caller guarantees ``p < cache.max_len``."""
        cos, sin = self.rope_tables(tokens.device)
        kv_len = cache.pos + 1
        delta = self.embed(tokens)
        x = torch.zeros_like(delta)
        ves, skips = self.layer_value_embeds(tokens), []
        for i, block in enumerate(self.blocks):
            delta = self._skip_in(i, delta, skips)
            h, x = block.attn_norm(delta, residual=x)
            h, x = block.mlp_norm(_decode_attention(block.attn, h, cos, sin, cache, kv_len, ves[i]), residual=x)
            delta = block.mlp(h)
            x, delta = self._skip_out(i, x, delta, skips)
        h, _ = self.norm(delta, residual=x)
        cache.pos.copy_(kv_len)
        return self.logits(h[:, -1])

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, use_cache: bool = True, cuda_graph: bool | str = "auto") -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx [B, T]``; returns ``[B, T + max_new_tokens]``.

        ``temperature`` 0 is greedy; sampling as :func:`sample_next` (seeded by ``torch.manual_seed``).
        With ``use_cache`` the prompt is run once (prefill, eager) into a static :class:`KVCache` and
        each further token is one :meth:`decode_step` (the prompt plus new tokens must fit in
        ``max_seq_len``); without, every step re-runs the last ``max_seq_len`` tokens.

        ``cuda_graph``: ``True`` captures one decode step (all layers, the LM head, sampling) as a
        CUDA graph and replays it per token; ``False`` runs the same step eagerly; ``"auto"`` is
        ``True`` for a dense model on a CUDA device. The cache, the token buffer and the graph are
        kept per ``(batch, max_len, sampling settings)`` (``max_len``: prompt + new tokens rounded up
        to a multiple of 256, at most ``max_seq_len``) and reused by later calls with other prompts.
        Greedy decoding gives the same tokens with and without the graph.
        """
        if cuda_graph not in ("auto", True, False):
            raise ValueError(f"cuda_graph must be 'auto', True or False, got {cuda_graph!r}")
        _check_sampling(temperature, top_k, top_p)
        if not use_cache:
            if cuda_graph is True:
                raise ValueError("cuda_graph=True needs use_cache=True (the graph replays a step against the KV cache)")
            for _ in range(max_new_tokens):
                h = self.hidden(idx[:, -self.cfg.max_seq_len:])
                idx = torch.cat([idx, sample_next(self.logits(h[:, -1]), temperature, top_k, top_p)], 1)
            return idx
        B, T = idx.shape
        total = T + max_new_tokens
        if total > self.cfg.max_seq_len:
            raise ValueError(f"max_new_tokens: prompt + new tokens = {total} exceeds max_seq_len "
                             f"{self.cfg.max_seq_len}; use use_cache=False to slide the context")
        if max_new_tokens == 0:
            return idx
        if cuda_graph is True and idx.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs a CUDA device, got idx on {idx.device}")
        graphed = cuda_graph is True or (cuda_graph == "auto" and idx.device.type == "cuda" and not self.cfg.n_experts)
        max_len = min(-(-total // _DECODE_LEN_ALIGN) * _DECODE_LEN_ALIGN, self.cfg.max_seq_len)
        sampling = (float(temperature), top_k, top_p)
        weights = tuple(p.data_ptr() for p in self.parameters())
        key = (B, max_len, sampling, idx.device, self.head_weight.dtype, graphed, weights)
        decoders = _DECODERS.setdefault(self, {})
        decoder = decoders.pop(key, None) or _Decoder(self, B, max_len, idx.device, sampling, graphed)
        decoders[key] = decoder  # most recently used last; keep a few
        while len(decoders) > _MAX_DECODERS:
            decoders.pop(next(iter(decoders)))
        return decoder.run(self, idx, max_new_tokens)


#: decode caches are sized for prompt + new tokens rounded up to this (so that calls share graphs)
_DECODE_LEN_ALIGN = 256
#: decoders (cache + token buffer + graph) a model keeps, least recently used dropped first
_MAX_DECODERS = 4
#: model -> {key: _Decoder}, outside the module (a deep copy or state_dict of the model never sees a
#: CUDA graph) and gone with the model
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def release_decoders(model: Transformer) -> None:
    """Free the KV caches, token buffers and CUDA graphs that :meth:`Transformer.generate` keeps for ``model``."""
    _DECODERS.pop(model, None)


def _decode_attention(attn: Attention, x: torch.Tensor, cos, sin, cache: KVCache, kv_len: torch.Tensor,
                      ve: torch.Tensor | None = None):
    """:class:`Attention` for ``x [B, 1, d_model]`` at the cache's device position: RoPE at
    ``cache.pos``, key and value written at that row (:func:`kv_cache_write_`), split-KV attention over
    the cache's first ``kv_len`` rows (:func:`flash_attention_decode`); fixed shapes."""
    B = x.shape[0]
    Hq, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    qkv = attn.qkv(x).view(B, 1, Hq + 2 * Hkv, D)
    if attn.q_norm is None:  # q and k are adjacent heads: one RoPE launch rotates both
        qk, v = split_heads(qkv, (Hq + Hkv, Hkv))
        q, k = split_heads(rope(qk, cos, sin, position_offset=cache.pos), (Hq, Hkv))
    else:
        q, k, v = split_heads(qkv, (Hq, Hkv, Hkv))
        q = rope(attn.q_norm(q), cos, sin, position_offset=cache.pos)
        k = rope(attn.k_norm(k), cos, sin, position_offset=cache.pos)
    v = attn.mix_value(v, ve)
    k_cache, v_cache = cache.k[attn.layer_idx], cache.v[attn.layer_idx]
    kv_cache_write_(k, v, k_cache, v_cache, cache.pos)
    y = flash_attention_decode(q, k_cache, v_cache, kv_len, causal=True, window=attn.window)
    return attn.proj(y.reshape(B, 1, Hq * D))


class _Decoder:
    """The static state of :meth:`Transformer.generate` for one (batch, max_len, sampling) key: a
    :class:`KVCache`, a token buffer ``[B, max_len + 1]`` (prompt, then the tokens drawn) and, when
    ``graphed``, the CUDA graph of :meth:`step`, captured on the first call that decodes."""

    def __init__(self, model: Transformer, batch: int, max_len: int, device, sampling: tuple, graphed: bool):
        self.sampling, self.graphed = sampling, graphed  # no reference to the model: it keys _DECODERS weakly
        self.cache = KVCache(model.cfg, batch, max_len, device=device, dtype=model.head_weight.dtype)
        self.tokens = torch.zeros((batch, max_len + 1), dtype=torch.int64, device=device)
        self.graph = None

    def step(self, model: Transformer) -> None:
        """Token at column ``p = cache.pos`` -> :meth:`Transformer.decode_step` -> the sampled token
        written at column ``p + 1``; ``cache.pos`` becomes ``p + 1``. Device-side indices only."""
        col = self.cache.pos.to(torch.int64).expand(self.tokens.shape[0], 1)
        nxt = col + 1
        logits = model.decode_step(self.tokens.gather(1, col), self.cache)
        self.tokens.scatter_(1, nxt, sample_next(logits, *self.sampling))

    def _capture(self, model: Transformer) -> None:
        """Warm up (compilation, autotuning) on a side stream, then capture :meth:`step`; the
        warm-up's writes past the fill position are overwritten by the replays, and the random
        numbers it drew are given back (a seeded call draws the same with or without a capture)."""
        pos = self.cache.pos.clone()
        rng = torch.cuda.get_rng_state(self.tokens.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.cache.pos.copy_(pos)
                self.step(model)
        torch.cuda.current_stream().wait_stream(stream)
        self.cache.pos.copy_(pos)
        torch.cuda.set_rng_state(rng, self.tokens.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step(model)
        self.graph = graph

    def run(self, model: Transformer, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Prefill ``idx [B, T]`` eagerly, draw the first token from its last position, then
        ``max_new_tokens - 1`` decode steps (graph replays or eager calls)."""
        T = idx.shape[1]
        self.tokens[:, :T].copy_(idx)
        self.cache.reset()
        h = model.hidden(idx, self.cache)
        self.tokens[:, T:T + 1].copy_(sample_next(model.logits(h[:, -1]), *self.sampling))
        if max_new_tokens > 1 and self.graphed and self.graph is None:
            self._capture(model)
        for _ in range(max_new_tokens - 1):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step(model)
        return self.tokens[:, :T + max_new_tokens].clone()


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> torch.Tensor:
    """Sample one token per row of ``logits [B, V]`` -> ``[B, 1]`` int64, with PyTorch ops only.

    ``temperature`` 0 (or ``top_k`` 1) is argmax; ``top_k`` keeps the k largest logits; ``top_p``
    keeps the smallest set of tokens whose probability reaches p (nucleus sampling). The draw is an
    exponential race, ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` i.i.d. (the Gumbel-max trick in
    another form: token i wins with probability ``p_i``, as ``torch.multinomial(p, 1)``), from the
    default generator of the logits' device: no host synchronisation and no data-dependent shape,
    so it runs inside a captured CUDA graph (whose replays advance the generator's offset) and is
    reproducible under ``torch.manual_seed``.
    """
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1, keepdim=True)  # in the logits' dtype: the same index as in fp32
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1, keepdim=True)


def build_model(cfg, device=None, dtype=None) -> Transformer:
    """A :class:`Transformer` from a :class:`ModelConfig`, a dict or a Hydra ``DictConfig``,
    moved to ``device`` / ``dtype`` when given."""
    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.from_dict(cfg)
    return Transformer(cfg).to(device=device, dtype=dtype)
