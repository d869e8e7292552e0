"""The tritonllm Transformer written for speed in plain PyTorch: the training benchmark's baseline.

What a PyTorch expert would write for the architecture of ``tritonllm.models.Transformer`` (same
parameter names and shapes, so ``load_state_dict`` from a tritonllm model works), to run with fp32
parameters under ``torch.autocast("cuda", torch.bfloat16)`` and ``torch.compile``:

    x = embed[idx]                                           (fp32 residual stream)
    per block i:
        x    = x + gate_j x_j                                 (U-net skips: j = n_layers - 1 - i < n_layers / 2,
                                                               x_j the stream after block j)
        qkv  = rms_norm(x) @ W_qkv^T  -> [B, Hq + 2 Hkv, T, D] (one packed GEMM, heads transposed)
        v    = a v + b value_embed_t[idx]                     (value embeddings: the layer's table t)
        q, k = rope(q_norm(q)), rope(k_norm(k))               (QK-norm when configured)
        y    = SDPA(q, k, v, is_causal=True, enable_gqa)      (contiguous [B, H, T, D]; the layer's
                                                               sliding window through FlexAttention
                                                               with a block mask built once for
                                                               ``seq_len`` on CUDA, else SDPA with
                                                               a boolean mask)
        x    = x + y @ W_proj^T
        x    = x + mlp(rms_norm(x))                           (SwiGLU over the packed gate/up weight,
                                                               relu(x W1^T)^2 W2^T with mlp_act relu2,
                                                               or the MoE layer below)
    loss = cross_entropy(rms_norm(x) @ W_head^T, targets)     (logits capped to c tanh(l / c) in fp32
                                                               with logit_softcap c; + z_loss_coef * mean lse^2,
                                                               + the MoE layers' aux losses)

RMSNorm is ``F.rms_norm``. RoPE is the half-split (GPT-NeoX / Llama) rotation
``[x1 c - x2 s, x2 c + x1 s]`` as plain tensor ops in fp32 (fused into one kernel by
torch.compile), its ``cos, sin [max_seq_len, D/2]`` tables built once in ``__init__`` (non-persistent
buffers) from the same frequencies as tritonllm's tables (NTK and YaRN ``rope_scaling`` included).

MoE (``n_experts > 0``), the semantics of ``tritonllm.kernels.moe``: router logits in fp32,
``p = softmax(l)``, scores ``s = p`` (or ``sigmoid(l)``), the top-k experts by score, weights
``s[idx]`` (renormalised to sum 1 when ``moe_normalize``); assignments sorted by expert (stable),
tokens gathered into that order, the expert SwiGLUs run either through ``torch._grouped_mm`` (bf16,
int32 end offsets: one GEMM per projection for all experts) or a loop over experts (host-read
group sizes: one synchronisation per layer), the outputs put back in (token, slot) order and
summed with the routing weights. Losses: ``aux = E sum_i f_i P_i`` (``f_i`` the fraction of
assignments to expert i, ``P_i`` the mean of ``p``, or of ``s / sum s`` for sigmoid) and
``z = mean logsumexp(l)^2``, added as ``moe_aux_loss_coef * aux + moe_z_loss_coef * z``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# the one definition of the RoPE frequencies (NTK / YaRN formulas): CPU float64 torch code, no kernel
from tritonllm.kernels.rope import rope_inv_freq

EXPERT_IMPLS = ("grouped_mm", "loop")


def grouped_mm_available(device) -> bool:
    """Whether ``torch._grouped_mm`` (bf16 CUTLASS grouped GEMM) can run the experts on ``device``."""
    return hasattr(torch, "_grouped_mm") and torch.device(device).type == "cuda"


def default_expert_impl(device) -> str:
    """``grouped_mm`` where available, else ``loop``. The grouped path needs no host synchronisation
    and runs each projection as one grouped GEMM over all experts, not one GEMM per expert: on an H200 (torch 2.11,
    torch.compile default) it trained void_moe_1b7b's shape cut to 2 layers (B8 x T1024) at 205K
    tokens/s (40.0 ms per step, GPU kernels 38.9 ms); the loop's timing was cut off by that run's
    time limit, so the two are not compared yet."""
    return "grouped_mm" if grouped_mm_available(device) else "loop"


def rope_tables(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin [max_seq_len, head_dim / 2]``: ``mscale * cos(p * inv_freq_i)`` as tritonllm's.

    An invalid ``rope_scaling`` raises a ValueError naming the field."""
    try:
        inv_freq, mscale = rope_inv_freq(cfg.head_dim, float(cfg.rope_theta), cfg.rope_scaling)
    except (TypeError, ValueError) as e:
        raise ValueError(f"rope_scaling={cfg.rope_scaling!r} is not supported by the baseline: {e}") from None
    angles = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (mscale * angles.cos()).float(), (mscale * angles.sin()).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` by the tables' rows ``cos, sin [T, D/2]`` (math in their fp32); the
    result is a new contiguous tensor of ``dtype``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


class _Weight(nn.Module):
    """A parameter holder, so that names match tritonllm's ``<module>.weight``."""

    def __init__(self, *shape: int, std: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))
        if std is None:
            nn.init.ones_(self.weight)
        else:
            nn.init.normal_(self.weight, mean=0.0, std=std)


class _Linear(nn.Linear):
    """A bias-free ``nn.Linear`` ``[out, in]`` initialised from ``normal(0, std)``: the dense projections, so
    that ``torchao.float8.convert_to_float8_training`` finds them (the FP8 baseline)."""

    def __init__(self, out_features: int, in_features: int, std: float):
        super().__init__(in_features, out_features, bias=False)
        nn.init.normal_(self.weight, mean=0.0, std=std)


def sliding_window_mask(window: int, seq_len: int, device):
    """FlexAttention block mask of causal attention where query t sees keys t - window < s <= t."""
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, q, k):
        return (k <= q) & (q - k < window)

    return create_block_mask(keep, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)


class Attention(nn.Module):
    def __init__(self, cfg, layer: int = 0, block_mask=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window, self.eps = cfg.layer_window(layer), cfg.norm_eps
        self.block_mask = block_mask  # FlexAttention mask of the window at the training length, or None
        self.qkv = _Linear((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.d_model, std=cfg.init_std)
        if cfg.qk_norm and cfg.qk_norm_span != "head":
            raise ValueError(f"qk_norm_span={cfg.qk_norm_span!r} is not supported by the baseline (only 'head')")
        self.q_norm = _Weight(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _Weight(cfg.head_dim) if cfg.qk_norm else None
        self.proj = _Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
        if cfg.layer_value_embedding(layer) is not None:
            self.value_mix = nn.Parameter(torch.full((2,), 0.5))  # [a, b]: v = a v + b ve

    def forward(self, x, cos, sin, ve=None):
        B, T, _ = x.shape
        Hq, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x)
        dtype = qkv.dtype
        q, k, v = qkv.view(B, T, Hq + 2 * Hkv, D).transpose(1, 2).split([Hq, Hkv, Hkv], dim=1)
        if ve is not None:
            v = self.value_mix[0] * v + self.value_mix[1] * ve.view(B, T, Hkv, D).transpose(1, 2)
        if self.q_norm is not None:
            q = F.rms_norm(q, (D,), self.q_norm.weight.to(q.dtype), self.eps)  # bf16 in and out under autocast
            k = F.rms_norm(k, (D,), self.k_norm.weight.to(k.dtype), self.eps)
        q, k, v = apply_rope(q, cos, sin, dtype), apply_rope(k, cos, sin, dtype), v.contiguous()
        if self.window is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv)
        elif self.block_mask is not None and self.block_mask.shape[-2] == T:
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(q, k, v, block_mask=self.block_mask, enable_gqa=Hq != Hkv)
        else:  # query t sees keys t - window < s <= t
            pos = torch.arange(T, device=x.device)
            lag = pos[:, None] - pos[None, :]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=(lag >= 0) & (lag < self.window),
                                               enable_gqa=Hq != Hkv)
        return self.proj(y.transpose(1, 2).reshape(B, T, Hq * D))


class ReLU2MLP(nn.Module):
    """Dense squared-ReLU MLP (``mlp_act: relu2``): ``relu(x W1^T)^2 W2^T``. Returns ``(y, None)``."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = _Linear(cfg.d_ff, cfg.d_model, std=cfg.init_std)
        self.w2 = _Linear(cfg.d_model, cfg.d_ff, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)).square()), None


class MLP(nn.Module):
    """Dense SwiGLU over the packed ``w13 [2F, D]`` (gate rows, then up rows). Returns ``(y, None)``."""

    def __init__(self, cfg):
        super().__init__()
        self.w13 = _Linear(2 * cfg.d_ff, cfg.d_model, std=cfg.init_std)
        self.w2 = _Linear(cfg.d_model, cfg.d_ff, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up), None


@torch.compiler.disable
def _experts_loop(xs: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU expert e on its rows of ``xs`` (sorted by expert, ``counts[e]`` rows each), one expert at a
    time. Eager: its group sizes are read on the host (a synchronisation), which torch.compile would
    otherwise specialise on and recompile for every new routing."""
    outs = []
    for e, rows in enumerate(xs.split(counts.tolist())):
        gate, up = F.linear(rows, w13[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w2[e]))
    return torch.cat(outs)


def _experts_grouped(xs: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same through two ``torch._grouped_mm`` calls in bf16 (its only dtype), groups given by the
    int32 end offsets ``cumsum(counts)``; no host synchronisation."""
    offs = counts.cumsum(0).to(torch.int32)
    bf16 = torch.bfloat16
    gate, up = torch._grouped_mm(xs.to(bf16), w13.to(bf16).transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.to(bf16).transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    """Dropless top-k MoE of SwiGLU experts (+ shared experts). Returns ``(y, aux_loss)``."""

    def __init__(self, cfg, experts: str):
        super().__init__()
        if experts not in EXPERT_IMPLS:
            raise ValueError(f"experts must be one of {EXPERT_IMPLS}, got {experts!r}")
        d, e, f = cfg.d_model, cfg.n_experts, cfg.d_expert
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.n_experts, self.top_k, self.experts = e, cfg.moe_top_k, experts
        self.sigmoid, self.normalize = cfg.moe_score == "sigmoid", cfg.moe_normalize
        self.aux_loss_coef, self.z_loss_coef = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef
        self.router = _Weight(e, d, std=cfg.init_std)
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d).normal_(0.0, cfg.init_std))
        self.w2 = nn.Parameter(torch.empty(e, d, f).normal_(0.0, out_std))
        fs = cfg.n_shared_experts * f
        self.shared_w13 = _Weight(2 * fs, d, std=cfg.init_std) if fs else None
        self.shared_w2 = _Weight(d, fs, std=out_std) if fs else None

    def route(self, logits: torch.Tensor):
        """fp32 ``logits [N, E]`` -> weights ``[N, k]``, experts ``[N, k]``, assignments per expert ``[E]``
        and the scaled router loss (0-d)."""
        N, E, k = logits.shape[0], self.n_experts, self.top_k
        p = logits.softmax(dim=-1)
        s = logits.sigmoid() if self.sigmoid else p
        weights, indices = s.topk(k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = indices.reshape(-1)
        counts = torch.zeros(E, dtype=torch.int64, device=logits.device).scatter_add_(0, flat, torch.ones_like(flat))
        q = s / s.sum(dim=-1, keepdim=True) if self.sigmoid else p
        aux = E * (counts.to(q.dtype) / (N * k) * q.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        return weights, indices, counts, self.aux_loss_coef * aux + self.z_loss_coef * z

    def forward(self, x):
        shape, k = x.shape, self.top_k
        x = x.reshape(-1, shape[-1])
        weights, indices, counts, aux_loss = self.route(F.linear(x, self.router.weight).float())
        order = indices.reshape(-1).argsort(stable=True)  # sorted row r holds assignment order[r] = t k + j
        experts = _experts_grouped if self.experts == "grouped_mm" else _experts_loop
        out = experts(x[order // k], counts, self.w13, self.w2)
        slot_row = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        # combined in fp32, returned in the activations' dtype: a bf16 residual stream stays bf16 where
        # the weights are bf16 without autocast (FSDP2's gathered weights)
        y = (out[slot_row].view(-1, k, shape[-1]) * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        if self.shared_w13 is not None:
            gate, up = F.linear(x, self.shared_w13.weight).chunk(2, dim=-1)
            y = y + F.linear(F.silu(gate) * up, self.shared_w2.weight)
        return y.view(shape), aux_loss


class Block(nn.Module):
    def __init__(self, cfg, experts: str, layer: int = 0, block_mask=None):
        super().__init__()
        self.eps, self.dim = cfg.norm_eps, (cfg.d_model,)
        self.attn_norm, self.mlp_norm = _Weight(cfg.d_model), _Weight(cfg.d_model)
        self.attn = Attention(cfg, layer, block_mask)
        self.mlp: nn.Module
        if cfg.n_experts:
            self.mlp = MoE(cfg, experts)
        else:
            self.mlp = ReLU2MLP(cfg) if cfg.mlp_act == "relu2" else MLP(cfg)

    def forward(self, x, cos, sin, ve=None):
        x = x + self.attn(F.rms_norm(x, self.dim, self.attn_norm.weight, self.eps), cos, sin, ve)
        y, aux_loss = self.mlp(F.rms_norm(x, self.dim, self.mlp_norm.weight, self.eps))
        return x + y, aux_loss


class BaselineTransformer(nn.Module):
    """Plain-PyTorch twin of ``tritonllm.models.Transformer`` written for speed (see the module docstring).

    ``experts`` (MoE models): ``"grouped_mm"`` or ``"loop"``; None picks :func:`default_expert_impl`
    of the current device (the CUDA one when there is one). ``seq_len``: the training length, for
    which the sliding-window layers get FlexAttention block masks (built once, on CUDA; other
    lengths and the CPU use SDPA with a boolean mask).
    """

    rope_cos: torch.Tensor  # buffers [max_seq_len, head_dim / 2], registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, cfg, experts: str | None = None, seq_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        cuda = torch.cuda.is_available()
        if experts is None:
            experts = default_expert_impl("cuda" if cuda else "cpu")
        windows = {cfg.layer_window(i) for i in range(cfg.n_layers)} - {None}
        masks = {w: sliding_window_mask(w, seq_len, "cuda") for w in windows} if seq_len and cuda else {}
        self.embed = _Weight(cfg.vocab_size, cfg.d_model, std=cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg, experts, i, masks.get(cfg.layer_window(i)))
                                    for i in range(cfg.n_layers))
        self.norm = _Weight(cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else _Weight(cfg.vocab_size, cfg.d_model, std=cfg.init_std)
        kv = cfg.n_kv_heads * cfg.head_dim
        self.value_embeds = nn.ModuleList(_Weight(cfg.vocab_size, kv, std=cfg.init_std)
                                          for _ in range(cfg.value_embeddings)) if cfg.value_embeddings else None
        self.skip_gates = nn.ParameterList(nn.Parameter(torch.ones(1)) for _ in range(cfg.n_layers // 2)) \
            if cfg.unet_skips else None
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``idx [B, T]`` -> logits ``[B, T, V]``, or with ``targets [B, T]`` the training loss: mean
        cross-entropy over the targets that are not -100, + ``z_loss_coef`` * their mean
        logsumexp^2, + the MoE layers' aux losses."""
        cfg = self.cfg
        T = idx.shape[1]
        if T > cfg.max_seq_len:
            raise ValueError(f"idx: sequence of {T} positions exceeds max_seq_len {cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = F.embedding(idx, self.embed.weight)
        aux_loss = None
        tables = [F.embedding(idx, w) for w in self.value_embeds.parameters()] if self.value_embeds is not None else []
        n = cfg.n_layers
        skips: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            t = cfg.layer_value_embedding(i)
            if self.skip_gates is not None and i >= n - n // 2:  # U-net: block j's output, gated, into block n-1-j
                x = x + self.skip_gates[n - 1 - i] * skips.pop()
            x, aux = block(x, cos, sin, None if t is None else tables[t])
            if self.skip_gates is not None and i < n // 2:
                skips.append(x)
            if aux is not None:
                aux_loss = aux if aux_loss is None else aux_loss + aux
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(F.rms_norm(x, (cfg.d_model,), self.norm.weight, cfg.norm_eps), head)
        if cfg.logit_softcap is not None:
            logits = cfg.logit_softcap * torch.tanh(logits.float() / cfg.logit_softcap)
        if targets is None:
            return logits
        logits, targets = logits.view(-1, logits.shape[-1]), targets.reshape(-1)
        loss = F.cross_entropy(logits, targets)
        if cfg.z_loss_coef:
            valid = targets != -100
            lse = torch.logsumexp(logits.float(), dim=-1)
            loss = loss + cfg.z_loss_coef * (lse.square() * valid).sum() / valid.sum()
        return loss if aux_loss is None else loss + aux_loss
