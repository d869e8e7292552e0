"""Run a loaded ``transformers`` Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or OLMoE model on tritonllm's
kernels, in place.

For people who stay in ``transformers`` (the Trainer, TRL, PEFT), as Liger-Kernel's
``apply_liger_kernel_to_llama`` does for its kernels::

    import tritonllm
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    tritonllm.patch(model)            # or tritonllm.patch.apply_tritonllm_kernels(model)
    model = get_peft_model(model, LoraConfig(...))   # before or after the patch, both work

Each part can be turned off by its keyword; on by default:

- ``rms_norm``: every RMSNorm module (the layers', the final one, the q/k norms: Qwen3's over each
  head, OLMoE's over all heads of a token) calls :func:`tritonllm.kernels.rms_norm`.
- ``linear``: the q/k/v/o and gate/up/down projections (``nn.Linear``, or the base layer under a
  PEFT adapter, whose low-rank update stays PEFT's) and the LM head call :func:`~tritonllm.kernels.linear`
  (bias included: Qwen2's q/k/v).
- ``mlp``: the dense MLP's ``silu(gate) * up`` is :func:`~tritonllm.kernels.swiglu`.
- ``moe``: the sparse MoE block (Mixtral, Qwen3-MoE, OLMoE) runs on tritonllm's MoE kernels. Its
  router module computes ``logits = x W_r^T`` with :func:`~tritonllm.kernels.linear` and routes with
  :func:`~tritonllm.kernels.moe_router` (softmax, the top ``num_experts_per_tok``, renormalised
  always for Mixtral and when ``norm_topk_prob`` for the others, as the module's own router does);
  it returns ``(logits, weights, experts)`` as transformers' router does, so ``output_router_logits``
  records the same logits the routing used. The experts are :func:`~tritonllm.kernels.moe_experts`
  (sort and gather by expert, the grouped GEMM with the SwiGLU epilogue, the grouped down GEMM,
  the weighted combine) reading the module's fused ``gate_up_proj [E, 2F, D]`` (gate rows then up
  rows) and ``down_proj [E, D, F]`` in place: no copy of the expert weights per step.
- ``rope``: the attention module's forward is replaced by one that rotates q and k with
  :func:`~tritonllm.kernels.rope` (tables of :func:`~tritonllm.kernels.rope_cos_sin` from the
  config's ``rope_theta`` and rope type, as :mod:`tritonllm.hf` reads them) and then calls the
  model's attention implementation as transformers' own forward does.
- ``attention``: the attention computation is :func:`~tritonllm.kernels.flash_attention` (causal,
  GQA without repeating k/v, the config's sliding window, the module's softmax scale), registered
  in transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` as ``"tritonllm"`` and
  set as the model's ``attn_implementation``.
- ``cross_entropy``: the causal-LM forward computes the loss with the fused
  :func:`~tritonllm.kernels.linear_cross_entropy` when ``labels`` are given (labels shifted by
  one, ``ignore_index`` -100, or the ``shift_labels`` and ``num_items_in_batch`` the Trainer may
  pass, as transformers' ``ForCausalLMLoss``), never materialising the logits: in training mode
  the output's ``logits`` are then None, as with Liger-Kernel; in eval mode they are computed too.
  For MoE models, with ``output_router_logits`` (the argument or the config's), the output holds
  ``router_logits`` and ``aux_loss`` (the model module's ``load_balancing_loss_func``), and the loss
  adds ``router_aux_loss_coef * aux_loss``, as transformers' forward does.

Refused, with an error naming the field (the checks of :func:`tritonllm.hf.config_from_hf`,
shared with the Hugging Face import): another architecture, rope types other than default,
linear, llama3 and yarn, attention or MLP biases other than Qwen2's q/k/v, dropout, per-layer
sliding windows, head dims flash attention lacks; for MoE models router jitter noise, OLMoE's
``clip_qkv``, dense layers between the MoE layers (``decoder_sparse_step``, ``mlp_only_layers``),
and (``moe`` on) expert weights stored otherwise than as fused ``[gate; up]`` rows without biases.

Inputs, with ``attention`` or ``rope`` on: ``attention_mask`` None or all ones (then the attention
is causal); a mask with zeros (padding) raises a ValueError: padded batches are not handled, pack
or batch equal lengths instead. ``position_ids`` None, or ``p + arange(T)`` with the same ``p`` in
every row (a KV cache's offset); positions that restart (packed documents) raise a ValueError.
Checking a given mask or given positions reads them on the host once per forward.

Under ``torch.autocast`` the patched GEMMs (projections, LM head and loss) compute in the autocast
dtype, as ``F.linear`` does.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from tritonllm.hf import HFConfigError, config_from_hf
from tritonllm.kernels import (flash_attention, linear, linear_cross_entropy, moe_experts, moe_router, rms_norm, rope,
                               rope_cos_sin, swiglu)

#: the name of tritonllm's attention in transformers' AttentionInterface / AttentionMaskInterface
ATTENTION = "tritonllm"
#: the projections patched by ``linear``: submodule -> its nn.Linear attributes
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
#: the sparse MoE block's submodules (in the layer's ``mlp``): the router and the fused experts
MOE_PARTS = ("gate", "experts")
#: the experts module's layout flags (transformers' ``use_experts_implementation``) that the grouped kernels read
EXPERTS_LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True}
PARTS = ("rms_norm", "linear", "mlp", "moe", "rope", "attention", "cross_entropy")


def _autocast(x: torch.Tensor, *tensors):
    """``x`` and ``tensors`` (None kept) in the autocast dtype when autocast is on for x's device."""
    if not torch.is_autocast_enabled(x.device.type):
        return (x, *tensors)
    dtype = torch.get_autocast_dtype(x.device.type)
    return tuple(t if t is None else t.to(dtype) for t in (x, *tensors))


def _tf32() -> bool:
    """float32 GEMMs use TF32 exactly when PyTorch's own matmuls would."""
    return torch.backends.cuda.matmul.allow_tf32


# --- module forwards (bound to each patched module) ------------------------------------------------

def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.variance_epsilon)


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    x, weight, bias = _autocast(x, self.weight, self.bias)
    return linear(x, weight, bias, allow_tf32=_tf32())


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _router_forward(self, x: torch.Tensor):
    """transformers' top-k router (Mixtral, Qwen3-MoE, OLMoE) by tritonllm's kernels:
    ``(logits [N, E], weights [N, k] fp32, experts [N, k])`` of the tokens ``x [..., D]``, N = their
    count. Mixtral's router has no ``norm_topk_prob``: it always renormalises. The weights stay fp32
    (Qwen3-MoE's and OLMoE's own routers round them to the logits' dtype, bf16 in a bf16 model)."""
    x, weight = _autocast(x.reshape(-1, x.shape[-1]), self.weight)
    logits = linear(x, weight, allow_tf32=_tf32())
    routing = moe_router(logits, self.top_k, "softmax", getattr(self, "norm_topk_prob", True))
    return logits, routing.weights, routing.indices


def _moe_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' sparse MoE block: the router module (so its logits are recorded), then the
    experts on the grouped kernels over the module's own ``gate_up_proj`` and ``down_proj``."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    _, weights, indices = self.gate(x)
    x, w13, w2 = _autocast(x, self.experts.gate_up_proj, self.experts.down_proj)
    return moe_experts(x, indices, weights, w13, w2).view(hidden_states.shape)


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                       cache=None, past_key_values=None, **kwargs):
    """transformers' attention forward (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, OLMoE) with
    RoPE by tritonllm's kernel. The q/k norms (Qwen3, Qwen3-MoE, OLMoE) normalise groups of their
    weight's width: one head (Qwen3's) or all heads of a token (OLMoE's).

    ``cache`` is the KV cache's name from transformers 5.2x on, ``past_key_values`` before."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    tables = self._tritonllm_rope
    B, T = hidden_states.shape[:2]
    shape = (B, T, -1, self.head_dim)
    q, k = self.q_proj(hidden_states), self.k_proj(hidden_states)
    if hasattr(self, "q_norm"):
        q = self.q_norm(q.view(B, T, -1, self.q_norm.weight.shape[-1]))
        k = self.k_norm(k.view(B, T, -1, self.k_norm.weight.shape[-1]))
    q, k, v = q.view(shape), k.view(shape), self.v_proj(hidden_states).view(shape)
    cos, sin = tables.get(q.device)
    positions = kwargs.get("position_ids")
    # a 0-d device view: the kernel reads the offset, the host never waits (rows checked by _checked_inputs)
    offset = positions[0, 0] if positions is not None else 0
    q = rope(q, cos, sin, position_offset=offset).transpose(1, 2)
    k = rope(k, cos, sin, position_offset=offset).transpose(1, 2)
    v = v.transpose(1, 2)
    kv_cache = cache if cache is not None else past_key_values
    if kv_cache is not None:
        k, v = kv_cache.update(k, v, self.layer_idx)
    impl = self.config._attn_implementation
    if impl in (None, "eager"):
        attend = sys.modules[type(self).__module__].eager_attention_forward
    else:
        attend = ALL_ATTENTION_FUNCTIONS[impl]
    out, weights = attend(self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
                          scaling=self.scaling, sliding_window=tables.window, **kwargs)
    return self.o_proj(out.reshape(B, T, -1)), weights


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                       logits_to_keep=0, **kwargs):
    """transformers' causal-LM forward with the loss of tritonllm's fused LM head + cross-entropy (for
    MoE models plus the router outputs and load-balancing loss, see :func:`_router_aux`)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)
    loss_kwargs = {k: kwargs.pop(k) for k in ("shift_labels", "num_items_in_batch", "ignore_index") if k in kwargs}
    moe = hasattr(self, "router_aux_loss_coef")
    if moe and kwargs.get("output_router_logits") is None:
        kwargs["output_router_logits"] = self.config.output_router_logits
    outputs = self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              inputs_embeds=inputs_embeds, **kwargs)
    hidden = outputs.last_hidden_state
    loss = logits = None
    if labels is not None or loss_kwargs.get("shift_labels") is not None:
        loss = causal_lm_loss(hidden, self.lm_head.weight, labels, **loss_kwargs)
    if loss is None or not self.training:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
    output = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
    cache_field = "cache" if "cache" in output.__dataclass_fields__ else "past_key_values"
    extra = {}
    if moe:
        loss, extra = _router_aux(self, outputs, attention_mask, loss, kwargs["output_router_logits"])
    out = output(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                 **{cache_field: getattr(outputs, cache_field, None)}, **extra)
    return out.to_tuple() if return_dict is False else out


def _router_aux(model, outputs, attention_mask, loss, output_router_logits: bool):
    """``(loss, {aux_loss, router_logits})`` of an MoE causal LM as transformers' forward makes them:
    with ``output_router_logits``, ``aux_loss`` is the model module's ``load_balancing_loss_func`` of
    the L layers' router logits (``E sum_i fbar_i Pbar_i``, see :mod:`tritonllm.hf`), and a loss
    given gains ``router_aux_loss_coef * aux_loss``; without, both fields are None."""
    aux_loss = None
    if output_router_logits:
        balance = sys.modules[type(model).__module__].load_balancing_loss_func
        aux_loss = balance(outputs.router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
        if loss is not None:
            loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
    return loss, {"aux_loss": aux_loss, "router_logits": outputs.router_logits}


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                   shift_labels: torch.Tensor | None = None, num_items_in_batch=None,
                   ignore_index: int = -100) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of the logits ``hidden @ weight.T`` by the fused kernel:
    position t predicts ``labels[t + 1]`` (the last position, and ``ignore_index`` labels, count for
    nothing; ``shift_labels`` given instead are used as they are); the mean over counted positions,
    or their sum divided by ``num_items_in_batch`` when given (gradient accumulation in the Trainer)."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss: labels or shift_labels must be given")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden, weight = _autocast(hidden, weight)
    target = shift_labels.to(hidden.device).contiguous()
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, weight, target, ignore_index=ignore_index, allow_tf32=_tf32())
    total = linear_cross_entropy(hidden, weight, target, ignore_index=ignore_index, reduction="sum",
                                 allow_tf32=_tf32())
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


# --- attention interface --------------------------------------------------------------------------

def _flash_attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                               sliding_window=None, **kwargs):
    """transformers' attention-function signature (q [B, Hq, T, D], k, v [B, Hkv, S, D]) over
    :func:`flash_attention` ([B, T, H, D] views of the same memory: no copies); returns
    ``(out [B, T, Hq, D], None)``."""
    if attention_mask is not None:
        raise ValueError("attention_mask: tritonllm's attention is causal only; got a mask tensor (a 4-D mask "
                         "or a static cache): use attention_mask=None or all ones and a dynamic cache")
    if dropout:
        raise ValueError(f"attention dropout={dropout}: tritonllm's attention has no dropout")
    out = flash_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=True,
                          window=sliding_window, softmax_scale=scaling)
    return out, None


def _causal_mask_interface(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                           attention_mask=None, **kwargs):
    """transformers' mask-function signature: None (causal) for no mask or an all-ones one; a
    ValueError for padding."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.shape[-1] == kv_length and bool(mask.all()):
        return None
    raise ValueError("attention_mask has zeros (padding): tritonllm.patch's attention is causal only and does not "
                     "handle padded batches; pack the examples or batch sequences of equal length")


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _flash_attention_interface)
    AttentionMaskInterface.register(ATTENTION, _causal_mask_interface)


# --- per-model state --------------------------------------------------------------------------------

class RopeTables:
    """The cos/sin tables of one patched model, per device, long enough for every position seen."""

    def __init__(self, cfg) -> None:
        self.head_dim, self.theta, self.scaling, self.window = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.window
        self.length = cfg.max_seq_len
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cover(self, end: int) -> None:
        """Make the tables hold positions up to ``end`` (exclusive), doubling their length as needed."""
        if end > self.length:
            while self.length < end:
                self.length *= 2
            self._tables.clear()

    def get(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            self._tables[device] = rope_cos_sin(self.length, self.head_dim, self.theta, self.scaling, device=device)
        return self._tables[device]


def _first_position(position_ids: torch.Tensor, T: int) -> int:
    """``p`` of position_ids that are ``p + arange(T)`` in every row; a ValueError otherwise."""
    first = position_ids[..., :1]
    steps = torch.arange(T, device=position_ids.device)
    consecutive = ((position_ids == first + steps).all() & (first == first.reshape(-1)[0]).all()).long()
    ok, start = torch.stack([consecutive, first.reshape(-1)[0].long()]).tolist()
    if not ok:
        raise ValueError("position_ids: tritonllm.patch needs positions p + arange(T), the same p in every row; "
                         "positions that restart (packed documents) or differ by row (left padding) are not "
                         "supported")
    return start


def _checked_inputs(forward, tables: RopeTables | None):
    """The base model's ``forward`` preceded by the check of ``position_ids`` and the growth of the
    RoPE tables to the last position."""
    signature = inspect.signature(forward)

    def checked(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        given = {**bound.pop("kwargs", {}), **bound}
        tokens = given.get("input_ids") if given.get("input_ids") is not None else given.get("inputs_embeds")
        T = tokens.shape[1]
        if given.get("position_ids") is not None:
            start = _first_position(given["position_ids"], T)
        else:
            kv_cache = given.get("cache", given.get("past_key_values"))
            start = kv_cache.get_seq_length() if kv_cache is not None else 0
        if tables is not None:
            tables.cover(int(start) + T)
        return forward(*args, **kwargs)

    return checked


# --- patch --------------------------------------------------------------------------------------------

def _bind(module: nn.Module, fn) -> None:
    module.forward = types.MethodType(fn, module)


def _plain_linear(module: nn.Module) -> nn.Linear | None:
    """``module`` itself, or the layer under a PEFT adapter, when it is a plain ``nn.Linear``."""
    get_base_layer = getattr(module, "get_base_layer", None)
    base = module if get_base_layer is None else get_base_layer()
    return base if type(base) is nn.Linear else None


def _hf_model(model):
    """The transformers model inside ``model`` (itself, or the one a PEFT wrapper holds)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(model, "base_model"):
        raise TypeError(f"model must be a transformers PreTrainedModel (or a PEFT model over one), got "
                        f"{type(model).__name__}")
    return model


def _layer_projections(cfg) -> dict[str, tuple[str, ...]]:
    """The submodules every decoder layer must have: :data:`PROJECTIONS`, the MLP's replaced by
    :data:`MOE_PARTS` for an MoE model."""
    return {**PROJECTIONS, "mlp": MOE_PARTS} if cfg.n_experts else PROJECTIONS


def _check_experts(experts: nn.Module) -> None:
    """An HFConfigError naming the flag when the experts' weights are not fused ``[gate; up]`` rows
    ``gate_up_proj [E, 2F, D]`` and ``down_proj [E, D, F]`` without biases (what the grouped kernels read)."""
    for flag, value in EXPERTS_LAYOUT.items():
        if getattr(experts, flag, value) != value:
            raise HFConfigError(f"{type(experts).__name__}.{flag}={getattr(experts, flag)}: tritonllm's grouped "
                                f"kernels need {flag}={value}")
    gate_up, down = (tuple(p.shape) if isinstance(p, torch.Tensor) else None
                     for p in (experts.gate_up_proj, experts.down_proj))
    if gate_up is None or len(gate_up) != 3 or down != (gate_up[0], gate_up[2], gate_up[1] // 2):
        raise HFConfigError(f"{type(experts).__name__}: gate_up_proj {gate_up} and down_proj {down} are not "
                            f"[E, 2F, D] and [E, D, F] tensors")


def patch(model, *, rms_norm: bool = True, linear: bool = True, mlp: bool = True, moe: bool = True,
          rope: bool = True, attention: bool = True, cross_entropy: bool = True):
    """Swap ``model``'s layers for tritonllm's kernels in place (see the module docstring); returns
    ``model``. ``model``: a transformers Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or OLMoE
    model (``*ForCausalLM`` or the bare ``*Model``), possibly inside a PEFT wrapper. Raises
    :class:`tritonllm.hf.HFConfigError` naming the config field it cannot reproduce, a ValueError
    when the model was patched already."""
    hf = _hf_model(model)
    cfg = config_from_hf(hf.config.to_dict())
    if getattr(hf, "tritonllm_patched", None) is not None:
        raise ValueError(f"model: already patched by tritonllm ({hf.tritonllm_patched})")
    base = hf.base_model
    layers = getattr(base, "layers", None)
    projections = _layer_projections(cfg)
    if layers is None or any(not hasattr(getattr(layer, part, None), name)
                             for layer in layers for part, names in projections.items() for name in names):
        raise HFConfigError(f"{type(hf).__name__}: expected decoder layers with "
                            + " and ".join(f"{part}.{{{','.join(names)}}}" for part, names in projections.items()))
    if moe and cfg.n_experts:
        for layer in layers:
            _check_experts(layer.mlp.experts)
    options = {"rms_norm": rms_norm, "linear": linear, "mlp": mlp, "moe": moe, "rope": rope, "attention": attention,
               "cross_entropy": cross_entropy}

    if rms_norm:
        for module in hf.modules():
            if type(module).__name__.endswith("RMSNorm"):
                _bind(module, _rms_norm_forward)
    if linear:
        heads = [hf.lm_head] if hasattr(hf, "lm_head") else []
        for module in heads + [getattr(getattr(layer, part), name) for layer in layers
                               for part, names in projections.items() for name in names]:
            plain = _plain_linear(module)
            if plain is not None:
                _bind(plain, _linear_forward)
    if mlp and not cfg.n_experts:
        for layer in layers:
            _bind(layer.mlp, _mlp_forward)
    if moe and cfg.n_experts:
        for layer in layers:
            _bind(layer.mlp.gate, _router_forward)
            _bind(layer.mlp, _moe_forward)
    tables = RopeTables(cfg) if rope else None
    if rope:
        for layer in layers:
            layer.self_attn._tritonllm_rope = tables
            _bind(layer.self_attn, _attention_forward)
    if attention:
        _register_attention()
        if hasattr(hf, "set_attn_implementation"):
            hf.set_attn_implementation(ATTENTION)
        else:
            hf.config._attn_implementation = ATTENTION
    if rope or attention:
        base.forward = _checked_inputs(base.forward, tables)
    if cross_entropy and hasattr(hf, "lm_head"):
        _bind(hf, _causal_lm_forward)
    hf.tritonllm_patched = options
    return model


apply_tritonllm_kernels = patch


class _CallableModule(types.ModuleType):
    """``tritonllm.patch(model)``: the module is callable as its :func:`patch`."""

    def __call__(self, model, **options):
        return patch(model, **options)


sys.modules[__name__].__class__ = _CallableModule
