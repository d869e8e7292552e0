"""A decoder-only transformer whose forward and backward run only tritonllm's Triton kernels.

    x = embedding(idx)
    for each block:  x = x + attention(rms_norm(x));  x = x + mlp(rms_norm(x))
    logits = rms_norm(x) @ W_head.T            (W_head = the embedding when tied)

Built from ``tritonllm.nn``: :class:`~tritonllm.nn.Attention` (one packed QKV GEMM split into strided
q, k, v views, optional QK-norm, RoPE, flash attention with GQA/MQA and an optional sliding window,
output GEMM), :class:`~tritonllm.nn.MLP` (SwiGLU with gate and up packed in one GEMM, or squared ReLU)
or :class:`~tritonllm.nn.MoE` (:func:`build_mlp`), :class:`~tritonllm.nn.RMSNorm`,
:class:`~tritonllm.nn.Embedding` and :class:`~tritonllm.nn.LMHeadLoss`. An MoE layer returns its
auxiliary loss and statistics (:class:`~tritonllm.nn.MoEOutput`); each block hands them up and
:meth:`Transformer.forward` adds the losses to the training loss (nothing is left on the modules).

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
import typing
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from tritonllm.kernels.residual_mix import add_fork, fork, weighted_add
from tritonllm.kernels.rope import rope_cos_sin
from tritonllm.models.config import ModelConfig
from tritonllm.nn import MLP, Attention, Embedding, Linear, LMHeadLoss, MoE, MoEOutput, RMSNorm
from tritonllm.nn.attention import KVCache as _KVCache


def _out_std(cfg: ModelConfig) -> float:
    """Init std of the projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


class KVCache(_KVCache):
    """The :class:`tritonllm.nn.KVCache` of a model: ``cfg.n_layers`` layers of ``[batch_size, max_len,
    cfg.n_kv_heads, cfg.head_dim]`` keys and values."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device=None, dtype=None):
        super().__init__(cfg.n_layers, batch_size, max_len, cfg.kv_heads, cfg.head_size, device=device, dtype=dtype)


def build_attention(cfg: ModelConfig, layer_idx: int) -> Attention:
    """Block ``layer_idx``'s :class:`tritonllm.nn.Attention`: its window (``cfg.layer_window``) and, when
    the layer mixes in a value embedding, ``value_mix``."""
    return Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_size, qkv_bias=cfg.qkv_bias,
                     qk_norm=cfg.qk_norm, qk_norm_span=cfg.qk_norm_span, eps=cfg.norm_eps, window=cfg.layer_window(layer_idx),
                     value_mix=cfg.layer_value_embedding(layer_idx) is not None, layer_idx=layer_idx,
                     init_std=cfg.init_std, out_std=_out_std(cfg))


def build_mlp(cfg) -> nn.Module:
    """The MLP slot of a block: :class:`tritonllm.nn.MLP` (``cfg.mlp_act``: SwiGLU or squared ReLU) when
    ``cfg.n_experts == 0``, else :class:`tritonllm.nn.MoE`, whose forward returns a
    :class:`tritonllm.nn.MoEOutput` (output, scaled auxiliary loss, statistics)."""
    if cfg.n_experts == 0:
        return MLP(cfg.d_model, cfg.d_ff, cfg.mlp_act, init_std=cfg.init_std, out_std=_out_std(cfg))
    return MoE(cfg.d_model, cfg.n_experts, cfg.moe_top_k, cfg.d_expert, cfg.n_shared_experts, score=cfg.moe_score,
               normalize=cfg.moe_normalize, aux_loss_coef=cfg.moe_aux_loss_coef, z_loss_coef=cfg.moe_z_loss_coef,
               init_std=cfg.init_std, out_std=_out_std(cfg))


class Block(nn.Module):
    """Pre-norm block. Takes the residual stream ``x`` and ``delta``, the previous block's MLP output
    not yet added, and returns ``(x + delta + attn, mlp(...), moe)``: each add is fused into the norm;
    ``moe`` is the MoE layer's :class:`MoEOutput` (its auxiliary loss and statistics), None for a
    dense MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = build_attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = build_mlp(cfg)

    def _mlp(self, h: torch.Tensor):
        out = self.mlp(h)
        return (out.y, out) if isinstance(out, MoEOutput) else (out, None)

    def forward(self, x, delta, cos, sin, cache: KVCache | None = None, ve: torch.Tensor | None = None,
                documents: torch.Tensor | None = None):
        h, x = self.attn_norm(delta, residual=x)
        h, x = self.mlp_norm(self.attn(h, cos, sin, cache, ve, documents), residual=x)
        return x, *self._mlp(h)

    def decode(self, x, delta, cos, sin, cache: KVCache, kv_len: torch.Tensor, ve: torch.Tensor | None = None):
        """:meth:`forward` of one token at the cache's device position (:meth:`Attention.decode`)."""
        h, x = self.attn_norm(delta, residual=x)
        h, x = self.mlp_norm(self.attn.decode(h, cos, sin, cache, kv_len, ve), residual=x)
        return x, self._mlp(h)[0]


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
            Embedding(cfg.vocab_size, cfg.kv_heads * cfg.head_size, init_std=cfg.init_std, validate=False)
            for _ in range(cfg.value_embeddings)) if cfg.value_embeddings else None
        self.skip_gates = nn.ParameterList(
            nn.Parameter(torch.ones(1)) for _ in range(cfg.n_layers // 2)) if cfg.unet_skips else None
        self.head_loss = LMHeadLoss(softcap=cfg.logit_softcap, z_loss=cfg.z_loss_coef, fp8=cfg.lm_head_fp8)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head ``[vocab_size, d_model]``: the embedding matrix when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 RoPE ``cos, sin [max_seq_len, head_dim / 2]`` on ``device``, built once per device and
        context length (kept out of the module's buffers so that ``.to(bfloat16)`` leaves them in fp32;
        a new ``cfg``, as ``tritonllm.generate.extend_context`` sets, builds them again). Under
        torch.compile they are built inside the graph (one small kernel a step) instead: filling the
        cache while tracing would make the graph's guards fail on the next call and compile it again."""
        device = torch.device(device)
        compiling = torch.compiler.is_compiling()
        if (compiling or self._rope is None or self._rope[0].device != device
                or self._rope[0].shape[0] != self.cfg.max_seq_len):
            cfg = self.cfg
            tables = rope_cos_sin(cfg.max_seq_len, cfg.head_size, theta=cfg.rope_theta, scaling=cfg.rope_scaling,
                                  device=device)
            if compiling:
                return tables
            self._rope = tables
        return self._rope

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, d_model]`` of token ids ``idx [B, T]``."""
        return self._hidden(idx, cache)[0]

    def _hidden(self, idx: torch.Tensor, cache: KVCache | None = None, documents: torch.Tensor | None = None):
        """:meth:`hidden`, and the :class:`MoEOutput` of every MoE layer in block order; ``documents``:
        see :meth:`forward`."""
        T = idx.shape[1]
        start = 0 if cache is None else cache.length
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"idx: sequence of {start + T} positions exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_tables(idx.device)
        delta = self.embed(idx)
        x = torch.zeros_like(delta)
        ves = self.layer_value_embeds(idx)
        skips: list[torch.Tensor] = []
        moe: list[MoEOutput] = []
        for i, block in enumerate(self.blocks):
            delta = self._skip_in(i, delta, skips)
            x, delta, out = block(x, delta, cos, sin, cache, ves[i], documents)
            if out is not None:
                moe.append(out)
            x, delta = self._skip_out(i, x, delta, skips)
        if cache is not None:
            cache.advance(T)
        h, _ = self.norm(delta, residual=x)
        return h, moe

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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                return_losses: bool = False, documents: torch.Tensor | None = None):
        """``idx [B, T]`` int64 -> logits ``[B, T, V]``, or with ``targets [B, T]`` the scalar training
        loss: mean cross-entropy (fused with the LM head, logits never stored) + z-loss + the MoE
        layers' auxiliary losses.

        With ``return_losses`` (and ``targets``) returns ``(loss, losses)``, ``losses`` a dict of
        detached 0-d tensors (no host synchronisation): ``ce``, ``z_loss``, ``aux`` (the MoE layers'
        scaled auxiliary losses summed) and, for MoE models, ``moe_aux`` and ``moe_z`` (the unscaled
        router losses averaged over the layers) and ``moe_max_load`` (the busiest expert's load over
        a balanced one's, worst layer).

        ``documents``: packed sequences, int32 ``[B, T, 2]`` on ``idx``'s device, for each position the
        first position of its document and one past its last (``tritonllm.data.sft.document_bounds``):
        attention stays inside each document (``flash_attention(documents=...)``); positions are not
        restarted, RoPE scores depend only on query-key distances."""
        h, moe = self._hidden(idx, cache, documents)
        if targets is None:
            return self.logits(h)
        loss, z_loss = self.head_loss(h, self.head_weight, targets)
        # 0-d bookkeeping only (PyTorch scalar ops): the logged CE without its z-loss part, and
        # the MoE layers' auxiliary losses summed into the training loss.
        ce = loss.detach() - z_loss if self.cfg.z_loss_coef else loss.detach()
        aux = torch.zeros((), device=loss.device)
        for out in moe:
            loss = loss + out.aux_loss
            aux = aux + out.aux_loss.detach()
        if not return_losses:
            return loss
        losses = {"ce": ce, "z_loss": z_loss.detach(), "aux": aux}
        if moe:
            per_layer = {k: torch.stack([out.stats[k].float() for out in moe]) for k in moe[0].stats}
            losses.update(moe_aux=per_layer["moe_aux"].mean(), moe_z=per_layer["moe_z"].mean(),
                          moe_max_load=per_layer["moe_max_load"].max())
        return loss, losses

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM-head logits ``[..., V]`` of final-norm hidden states ``h [..., d_model]``, soft-capped to
        ``c * tanh(logits / c)`` when ``cfg.logit_softcap`` is c (the loss caps them inside the fused
        LM-head cross-entropy instead)."""
        return self.head_loss.logits(h, self.head_weight)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters held (a tied matrix once); ``exclude_embedding`` drops the token-embedding table
        and the value-embedding tables."""
        n = sum(p.numel() for p in self.parameters())
        tables = [self.embed.weight, *self._value_tables()]
        return n - sum(t.numel() for t in tables) if exclude_embedding else n

    def _value_tables(self) -> list[torch.Tensor]:
        """The weights of the value-embedding tables (none without ``cfg.value_embeddings``)."""
        return [] if self.value_embeds is None else list(self.value_embeds.parameters())

    def num_active_params(self) -> int:
        """Parameters one token's forward multiplies with: all but the embedding lookup tables (a tied
        matrix counts, as the LM head) and, in MoE layers, the experts it is not routed to."""
        cfg = self.cfg
        inactive = cfg.param_count() - cfg.param_count(active=True)
        if cfg.tie_embeddings:  # the token table counts as the head; the value tables are lookups only
            inactive += sum(t.numel() for t in self._value_tables())
        return self.num_params(exclude_embedding=not cfg.tie_embeddings) - inactive

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): ``6 N_active + 12 n_layers n_heads head_dim seq_len``."""
        cfg = self.cfg
        return 6 * self.num_active_params() + 12 * cfg.n_layers * cfg.n_heads * cfg.head_size * seq_len

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
        ves = self.layer_value_embeds(tokens)
        skips: list[torch.Tensor] = []
        for i, block in enumerate(typing.cast("Iterable[Block]", self.blocks)):  # nn.ModuleList is untyped
            delta = self._skip_in(i, delta, skips)
            x, delta = block.decode(x, delta, cos, sin, cache, kv_len, ves[i])
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


class _Decoder:
    """The static state of :meth:`Transformer.generate` for one (batch, max_len, sampling) key: a
    :class:`KVCache`, a token buffer ``[B, max_len + 1]`` (prompt, then the tokens drawn) and, when
    ``graphed``, the CUDA graph of :meth:`step`, captured on the first call that decodes."""

    def __init__(self, model: Transformer, batch: int, max_len: int, device, sampling: tuple, graphed: bool):
        self.sampling, self.graphed = sampling, graphed  # no reference to the model: it keys _DECODERS weakly
        self.cache = KVCache(model.cfg, batch, max_len, device=device, dtype=model.head_weight.dtype)
        self.tokens = torch.zeros((batch, max_len + 1), dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

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
    moved to ``device`` / ``dtype`` when given. The weights are drawn on the CPU (the same weights
    whatever the device), except on ``meta``, where nothing is allocated or drawn (shapes, parameter
    counts and FLOPs of a model of any size)."""
    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.from_dict(cfg)
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return Transformer(cfg).to(dtype=dtype)
    return Transformer(cfg).to(device=device, dtype=dtype)
