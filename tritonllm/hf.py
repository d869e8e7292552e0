"""Hugging Face checkpoints in and out of tritonllm: Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE and OLMoE.

Import (:func:`load_hf_model`) reads a model folder (``config.json``; ``model.safetensors`` or
the shards named by ``model.safetensors.index.json``), maps its config onto a
:class:`~tritonllm.models.ModelConfig` (:func:`config_from_hf`) and its weights onto a
:class:`~tritonllm.models.Transformer` (:func:`state_from_hf`)::

    model.embed_tokens.weight                       -> embed.weight
    model.layers.{i}.input_layernorm.weight         -> blocks.{i}.attn_norm.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.weight  -> blocks.{i}.attn.qkv.weight   rows [q; k; v]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias    -> blocks.{i}.attn.qkv.bias     (Qwen2)
    model.layers.{i}.self_attn.{q,k}_norm.weight    -> blocks.{i}.attn.{q,k}_norm.weight (Qwen3)
    model.layers.{i}.self_attn.o_proj.weight        -> blocks.{i}.attn.proj.weight
    model.layers.{i}.post_attention_layernorm.weight-> blocks.{i}.mlp_norm.weight
    model.layers.{i}.mlp.{gate,up}_proj.weight      -> blocks.{i}.mlp.w13.weight    rows [gate; up]
    model.layers.{i}.mlp.down_proj.weight           -> blocks.{i}.mlp.w2.weight
    model.norm.weight                               -> norm.weight
    lm_head.weight                                  -> lm_head.weight (absent when tied)

MoE families (Mixtral: ``{moe}`` = ``block_sparse_moe``, ``{gate,up,down}`` = ``w1, w3, w2``;
Qwen3-MoE and OLMoE: ``{moe}`` = ``mlp``, ``{gate,up,down}`` = ``{gate,up,down}_proj``), E experts of
width F, in place of the two ``mlp`` rows::

    model.layers.{i}.{moe}.gate.weight              -> blocks.{i}.mlp.router.weight [E, D]
    model.layers.{i}.{moe}.experts.{e}.{gate,up}.weight -> blocks.{i}.mlp.w13[e]   [E, 2F, D], rows [gate; up]
    model.layers.{i}.{moe}.experts.{e}.{down}.weight  -> blocks.{i}.mlp.w2[e]      [E, D, F]

(the per-expert tensors ``save_pretrained`` writes; transformers fuses them into ``gate_up_proj``
``[E, 2F, D]`` and ``down_proj`` ``[E, D, F]`` in memory, the same layouts as tritonllm's). All
route as :func:`tritonllm.kernels.moe_router.moe_router` with ``score="softmax"``: softmax over the
E router logits, the top ``num_experts_per_tok``, renormalised to sum to 1 always for Mixtral and
when ``norm_topk_prob`` for Qwen3-MoE and OLMoE. OLMoE's QK-norm spans all heads of a token
(``q_norm.weight [Hq D]``, ``k_norm.weight [Hkv D]``: ``qk_norm_span="all"``), and its
``clip_qkv`` must be unset. Every layer must be an MoE layer (``decoder_sparse_step`` 1, no
``mlp_only_layers``) and the router noise-free (``router_jitter_noise`` 0).

Load balancing: transformers adds ``router_aux_loss_coef * E sum_i fbar_i Pbar_i`` when run with
``output_router_logits``, ``fbar_i`` the assignments to expert i per token (summing to k) and
``Pbar_i`` its mean router probability, both pooled over the L layers; tritonllm's training loss
always adds, per layer, ``moe_aux_loss_coef * E sum_i f_i P_i`` with ``f_i = c_i / (T k)`` (summing
to 1). Import sets ``moe_aux_loss_coef = router_aux_loss_coef * k / L``, export the inverse: the two
losses agree for one layer, and for L layers whose routing statistics are the same.

All use the half-split ("rotate_half") RoPE layout, so q and k rows are copied as they are.
RoPE: ``rope_theta`` and the ``default``, ``linear``, ``llama3`` and ``yarn`` rope types (the
config's ``rope_parameters``, or ``rope_theta`` + ``rope_scaling`` as transformers 4 wrote them).
Anything the Transformer cannot compute the same way (another architecture, an activation other
than SiLU, output-projection or MLP biases, a dynamic or partial RoPE, per-layer sliding windows,
a quantized checkpoint, a head width flash attention lacks) is an :class:`HFConfigError` naming
the config field.

Export (:func:`save_hf_model`) writes the inverse: ``config.json`` (LlamaForCausalLM, or
Qwen3ForCausalLM with QK-norm, Qwen2ForCausalLM with q/k/v biases, MistralForCausalLM with a
sliding window; with experts MixtralForCausalLM, or Qwen3MoeForCausalLM with per-head QK-norm,
OlmoeForCausalLM with QK-norm over all heads), ``model.safetensors`` and the tokenizer files of a
source folder, which ``transformers.AutoModelForCausalLM.from_pretrained`` loads. A model with LoRA adapters
(:mod:`tritonllm.nn.lora`) is exported with the adapters merged into the weights.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch

from tritonllm.errors import CheckpointError, ConfigError
from tritonllm.models.config import ModelConfig

#: model_type -> architecture name written on export
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM"}
#: MoE model_type -> (prefix of the MoE block in a layer, names of an expert's gate, up and down projections)
MOE_NAMES = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
             "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
             "olmoe": ("mlp.", ("gate_proj", "up_proj", "down_proj"))}
INDEX_FILE, WEIGHTS_FILE = "model.safetensors.index.json", "model.safetensors"


class HFConfigError(ConfigError, ValueError):
    """A Hugging Face config that tritonllm cannot reproduce exactly; the message names the field."""


def read_hf_config(path: str) -> dict:
    """``config.json`` of the model folder ``path`` as a dict."""
    path = os.path.expanduser(str(path))
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a Hugging Face model folder: no config.json")
    with open(file) as f:
        return json.load(f)


def _required(params: dict, key: str, field: str):
    """``params[key]``; an HFConfigError naming ``field.key`` when it is missing or null."""
    value = params.get(key)
    if value is None:
        raise HFConfigError(f"{field}.{key} is missing")
    return value


def _rope(hf: dict, head_dim: int) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of tritonllm from the config's RoPE fields."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if not params:
        params, field = hf.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, dict) or ("rope_type" not in params and "type" not in params
                                       and set(params) - {"rope_theta"}):
        raise HFConfigError(f"{field}: per-layer RoPE parameters are not supported, got {params!r}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFConfigError(f"partial_rotary_factor={partial}: only full-width RoPE is supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, {"type": "linear", "factor": float(_required(params, "factor", field))}
    if kind == "llama3":
        return theta, {"type": "llama3", "factor": float(_required(params, "factor", field)),
                       "original_max_position": int(_required(params, "original_max_position_embeddings", field)),
                       "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
                       "high_freq_factor": float(params.get("high_freq_factor", 4.0))}
    if kind == "yarn":
        factor, orig = params.get("factor"), params.get("original_max_position_embeddings")
        if orig is None:
            orig = _required(hf, "max_position_embeddings", "config")
        if factor is None:
            factor = hf["max_position_embeddings"] / orig
        mscale = params.get("attention_factor")
        if mscale is None:
            mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
            if params.get("mscale") and params.get("mscale_all_dim"):
                mscale = (0.1 * params["mscale"] * math.log(factor) + 1.0) / (
                    0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0)
        return theta, {"type": "yarn", "factor": float(factor), "original_max_position": int(orig),
                       "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
                       "mscale": float(mscale), "truncate": bool(params.get("truncate", True))}
    raise HFConfigError(f"{field}.rope_type={kind!r} is not supported (default, linear, llama3, yarn are)")


def _window(hf: dict, model_type: str) -> int | None:
    """The one sliding window every layer uses, None for full attention; per-layer layouts raise."""
    layer_types = hf.get("layer_types")
    if layer_types is not None and len(set(layer_types)) > 1:
        raise HFConfigError(f"layer_types={sorted(set(layer_types))}: mixed full and sliding-window layers are "
                            f"not supported")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if hf.get("use_sliding_window"):
            raise HFConfigError("use_sliding_window=true: Qwen's per-layer sliding windows (max_window_layers) are "
                                "not supported")
        return None
    if model_type in ("mistral", "mixtral"):
        if layer_types and layer_types[0] == "full_attention":
            return None
        return hf.get("sliding_window")
    if layer_types and layer_types[0] != "full_attention":
        raise HFConfigError(f"layer_types={layer_types[0]!r}: only full attention is supported for {model_type}")
    return None


def _moe(hf: dict, model_type: str) -> dict:
    """The MoE fields of :class:`ModelConfig` for an MoE family (none for a dense one); see the module
    docstring for the routing and the aux-loss coefficient."""
    if model_type not in MOE_NAMES:
        return {}
    n_experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not n_experts:
        raise HFConfigError(f"num_experts={n_experts!r}: a {model_type} model without experts is not supported")
    if hf.get("clip_qkv") is not None:
        raise HFConfigError(f"clip_qkv={hf['clip_qkv']}: clamping q, k and v is not supported")
    if hf.get("router_jitter_noise"):
        raise HFConfigError(f"router_jitter_noise={hf['router_jitter_noise']}: router noise is not supported")
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers")
    if step != 1 or dense:
        raise HFConfigError(f"decoder_sparse_step={step}, mlp_only_layers={dense}: dense MLP layers between the "
                            f"MoE layers are not supported")
    top_k = hf["num_experts_per_tok"]
    return dict(n_experts=n_experts, moe_top_k=top_k, moe_score="softmax",
                d_expert=hf["moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"],
                moe_normalize=model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
                moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)) * top_k / hf["num_hidden_layers"],
                moe_z_loss_coef=0.0)


def config_from_hf(hf: dict, max_seq_len: int | None = None, name: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json`` dict; ``max_seq_len`` overrides
    ``max_position_embeddings`` (the size of the RoPE tables and of the KV cache)."""
    from tritonllm.kernels.flash_attention import HEAD_DIMS

    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFConfigError(f"model_type={model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    if hf.get("quantization_config"):
        raise HFConfigError("quantization_config: quantized checkpoints are not supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act={act!r}: only silu (SwiGLU) is supported")
    if hf.get("mlp_bias"):
        raise HFConfigError("mlp_bias=true: MLP biases are not supported")
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise HFConfigError("attention_bias=true: biases on the attention projections are not supported "
                            "(Qwen2's q/k/v biases are)")
    for field in ("attention_dropout", "hidden_dropout"):
        if hf.get(field):
            raise HFConfigError(f"{field}={hf[field]}: dropout in the base model is not supported")
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    if head_dim not in HEAD_DIMS:
        raise HFConfigError(f"head_dim={head_dim}: flash attention supports head dims {HEAD_DIMS}")
    theta, scaling = _rope(hf, head_dim)
    try:
        return ModelConfig(
            name=name or os.path.basename(str(hf.get("_name_or_path", ""))) or model_type,
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
            d_ff=hf["intermediate_size"],
            max_seq_len=int(max_seq_len or hf.get("max_position_embeddings", 2048)),
            rope_theta=theta, rope_scaling=scaling, qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_span="all" if model_type == "olmoe" else "head",
            qkv_bias=model_type == "qwen2", window=_window(hf, model_type), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **_moe(hf, model_type))
    except KeyError as e:
        raise HFConfigError(f"config.json lacks the field {e.args[0]}") from None


def load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors weights (one file, or the shards of the index)."""
    from safetensors.torch import load_file

    path = os.path.expanduser(str(path))
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        files = [WEIGHTS_FILE]
    else:
        raise CheckpointError(f"{path} has neither {WEIGHTS_FILE} nor {INDEX_FILE} (only safetensors weights "
                              f"are read)")
    state = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{index} names {name}, which is missing")
        state.update(load_file(file))
    return state


def _layer_names(i: int) -> dict[str, str | list[str]]:
    """tritonllm parameter -> Hugging Face tensor name(s) of block ``i`` (packed ones list theirs)."""
    hf, tl = f"model.layers.{i}.", f"blocks.{i}."
    attn = hf + "self_attn."
    return {
        tl + "attn_norm.weight": hf + "input_layernorm.weight",
        tl + "attn.qkv.weight": [attn + f"{p}_proj.weight" for p in "qkv"],
        tl + "attn.qkv.bias": [attn + f"{p}_proj.bias" for p in "qkv"],
        tl + "attn.q_norm.weight": attn + "q_norm.weight",
        tl + "attn.k_norm.weight": attn + "k_norm.weight",
        tl + "attn.proj.weight": attn + "o_proj.weight",
        tl + "mlp_norm.weight": hf + "post_attention_layernorm.weight",
        tl + "mlp.w13.weight": [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
        tl + "mlp.w2.weight": hf + "mlp.down_proj.weight",
    }


def _moe_family(cfg: ModelConfig) -> str:
    """The Hugging Face MoE family of an MoE config: OLMoE with QK-norm over all heads, Qwen3-MoE with
    per-head QK-norm, else Mixtral."""
    if cfg.qk_norm:
        return "olmoe" if cfg.qk_norm_span == "all" else "qwen3_moe"
    return "mixtral"


def _moe_layer_names(i: int, cfg: ModelConfig) -> dict[str, str | list[str]]:
    """tritonllm parameter -> Hugging Face tensor names of the MoE block ``i``: the experts' tensors
    in expert order (gate, up of each for ``w13``), concatenated by rows then viewed ``[E, -1, D_in]``."""
    prefix, (gate, up, down) = MOE_NAMES[_moe_family(cfg)]
    hf = f"model.layers.{i}.{prefix}"
    experts = [f"{hf}experts.{e}." for e in range(cfg.n_experts)]
    return {f"blocks.{i}.mlp.router.weight": hf + "gate.weight",
            f"blocks.{i}.mlp.w13": [x + f"{p}.weight" for x in experts for p in (gate, up)],
            f"blocks.{i}.mlp.w2": [x + f"{down}.weight" for x in experts]}


def _names(cfg: ModelConfig) -> dict[str, str | list[str]]:
    """The whole name map of a model of config ``cfg`` (parameters it does not have left out)."""
    names: dict[str, str | list[str]] = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        names.update(_layer_names(i))
    for i in range(cfg.n_layers):
        if not cfg.qk_norm:
            del names[f"blocks.{i}.attn.q_norm.weight"], names[f"blocks.{i}.attn.k_norm.weight"]
        if not cfg.qkv_bias:
            del names[f"blocks.{i}.attn.qkv.bias"]
        if cfg.n_experts:
            del names[f"blocks.{i}.mlp.w13.weight"], names[f"blocks.{i}.mlp.w2.weight"]
            names.update(_moe_layer_names(i, cfg))
    return names


def state_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A Transformer state dict from Hugging Face tensors (q/k/v and gate/up concatenated by rows, the
    experts' tensors stacked into ``[E, rows, D_in]``)."""
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}
    names = _names(cfg)
    used = {n for v in names.values() for n in ([v] if isinstance(v, str) else v)}
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the head too: the embedding is the one read
    missing = sorted(n for n in used - set(hf_state) if n != "lm_head.weight")
    unexpected = sorted(set(hf_state) - used)
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint does not match its config: missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    state = {}
    for tl, src in names.items():
        state[tl] = hf_state[src] if isinstance(src, str) else torch.cat([hf_state[s] for s in src])
        if tl.endswith(("mlp.w13", "mlp.w2")):
            state[tl] = state[tl].view(cfg.n_experts, -1, state[tl].shape[-1])
    return state


def load_hf_model(path: str, device=None, dtype=None, max_seq_len: int | None = None):
    """A :class:`~tritonllm.models.Transformer` with the weights of the Hugging Face folder ``path``
    (``dtype`` None keeps fp32 parameters)."""
    from tritonllm.models import build_model

    cfg = config_from_hf(read_hf_config(path), max_seq_len=max_seq_len,
                         name=os.path.basename(os.path.normpath(str(path))))
    model = build_model(cfg, device=device, dtype=dtype)
    load_hf_weights(model, path)
    return model


@torch.no_grad()
def load_hf_weights(model, path: str) -> None:
    """Copy the weights of the Hugging Face folder ``path`` into ``model`` (a Transformer built from
    :func:`config_from_hf` of the same folder)."""
    state = state_from_hf(load_hf_state(path), model.cfg)
    params = dict(model.named_parameters())
    for name, tensor in state.items():
        if params[name].shape != tensor.shape:
            raise CheckpointError(f"{path}: tensor for {name} has shape {tuple(tensor.shape)}, the model's is "
                                  f"{tuple(params[name].shape)}")
        params[name].copy_(tensor)


def hf_config_from(cfg: ModelConfig, architecture: str | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """A Hugging Face ``config.json`` dict for a model of config ``cfg``. ``architecture`` (a
    model_type of :data:`ARCHITECTURES`) defaults to the family that has the model's features."""
    if cfg.qk_norm and cfg.qkv_bias:
        raise HFConfigError("qk_norm with qkv_bias matches no supported Hugging Face family")
    speedrun = {"mlp_act": cfg.mlp_act != "swiglu", "window_schedule": cfg.window_schedule is not None,
                "logit_softcap": cfg.logit_softcap is not None, "value_embeddings": cfg.value_embeddings > 0,
                "unet_skips": cfg.unet_skips}
    for field, on in speedrun.items():
        if on:
            raise HFConfigError(f"{field}={getattr(cfg, field)!r}: no supported Hugging Face family has it")
    if cfg.n_experts:
        auto = _moe_family(cfg)
    else:
        auto = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "mistral" if cfg.window else "llama"
    model_type = architecture or auto
    if model_type not in ARCHITECTURES:
        raise HFConfigError(f"architecture={model_type!r}: expected one of {sorted(ARCHITECTURES)}")
    needs = {"qk_norm": (cfg.qk_norm, ("qwen3", "qwen3_moe", "olmoe")), "qkv_bias": (cfg.qkv_bias, ("qwen2",)),
             "n_experts": (cfg.n_experts > 0, tuple(MOE_NAMES)),
             "qk_norm_span": (cfg.qk_norm and cfg.qk_norm_span == "all", ("olmoe",))}
    for field, (has, families) in needs.items():
        if (model_type in families) != has:
            raise HFConfigError(f"architecture={model_type!r} does not fit {field}={getattr(cfg, field)}")
    if cfg.window and model_type not in ("mistral", "mixtral"):
        raise HFConfigError(f"window={cfg.window}: only the mistral and mixtral architectures have one sliding "
                            f"window")
    moe_fits = {"n_shared_experts": cfg.n_shared_experts == 0, "moe_score": cfg.moe_score == "softmax",
                "moe_normalize": model_type != "mixtral" or cfg.moe_normalize}
    for field, fits in moe_fits.items():
        if cfg.n_experts and not fits:
            raise HFConfigError(f"{field}={getattr(cfg, field)!r}: the {model_type} architecture cannot express it")
    rope = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        s = dict(cfg.rope_scaling)
        kind = s.pop("type")
        if kind == "ntk":
            raise HFConfigError("rope_scaling type 'ntk' (static NTK) has no Hugging Face rope type")
        if "original_max_position" in s:
            s["original_max_position_embeddings"] = s.pop("original_max_position")
        if "mscale" in s:
            s["attention_factor"] = s.pop("mscale")
        rope = {"rope_type": kind, **s}
    out = {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "rope_theta": cfg.rope_theta, "rope_scaling": None if cfg.rope_scaling is None else rope,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    if model_type in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.window
    if model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if cfg.n_experts:
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.moe_top_k, output_router_logits=False,
                   router_aux_loss_coef=cfg.moe_aux_loss_coef * cfg.n_layers / cfg.moe_top_k)
    if model_type == "mixtral":
        out.update(intermediate_size=cfg.d_expert, router_jitter_noise=0.0)
    if model_type == "olmoe":
        out.update(intermediate_size=cfg.d_expert, norm_topk_prob=cfg.moe_normalize, clip_qkv=None)
    if model_type == "qwen3_moe":
        out.update(use_sliding_window=False, sliding_window=None, moe_intermediate_size=cfg.d_expert,
                   norm_topk_prob=cfg.moe_normalize, decoder_sparse_step=1, mlp_only_layers=[])
    return out


def state_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from a Transformer state dict (packed rows split back: q/k/v by their
    widths, the others, gate/up and the experts' stacks, into equal parts of their rows)."""
    q, kv = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    out = {}
    for tl, src in _names(cfg).items():
        tensor = state[tl]
        if isinstance(src, str):
            out[src] = tensor.contiguous()
        else:
            parts = (torch.split(tensor, [q, kv, kv]) if ".qkv." in tl
                     else tensor.reshape(-1, tensor.shape[-1]).chunk(len(src)))
            out.update({name: part.contiguous() for name, part in zip(src, parts)})
    return out


@torch.no_grad()
def save_hf_model(model, path: str, tokenizer_from: str | None = None, architecture: str | None = None,
                  dtype: torch.dtype | None = None) -> str:
    """Write ``model`` as a Hugging Face folder ``path`` (LoRA adapters merged); ``tokenizer_from``
    copies the tokenizer files of that folder along; ``dtype`` None keeps the weights' dtype."""
    from safetensors.torch import save_file

    from tritonllm.nn.lora import merged_state_dict

    cfg = model.cfg
    state = merged_state_dict(model)
    dtype = dtype or model.head_weight.dtype
    hf_cfg = hf_config_from(cfg, architecture, dtype)
    tensors = {k: v.detach().to(device="cpu", dtype=dtype) for k, v in state_to_hf(state, cfg).items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if tokenizer_from is not None:
        from tritonllm.data.hf_tokenizer import TOKENIZER_FILES

        for name in TOKENIZER_FILES:
            src = os.path.join(os.path.expanduser(str(tokenizer_from)), name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))
    return path


#: keys of conf/model/hf.yaml
RUN_KEYS = {"name", "path", "max_seq_len"}


def run_model_config(node) -> ModelConfig:
    """The ModelConfig of a ``+model=hf model.path=<folder>`` run (keys ``path``, ``max_seq_len``, ``name``)."""
    from tritonllm.containers import plain_container

    d = plain_container(node)
    unknown = sorted(set(d) - RUN_KEYS)
    if unknown:
        raise HFConfigError(f"unknown key(s) {unknown} for a Hugging Face model; valid: {sorted(RUN_KEYS)} "
                            f"(the architecture comes from the folder's config.json)")
    path = os.path.expanduser(str(d["path"]))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise HFConfigError(f"model.path={path!r} is not a Hugging Face model folder (no config.json)")
    name = d.get("name")
    if name in (None, "hf"):
        name = os.path.basename(os.path.normpath(path))
    return config_from_hf(read_hf_config(path), max_seq_len=d.get("max_seq_len"), name=name)


def init_run_model(model, cfg) -> None:
    """Set up a freshly built run model from the run config ``cfg``: the Hugging Face weights of
    ``cfg.model.path`` when given, then LoRA adapters when ``cfg.lora`` is set (``+lora=default``)."""
    if cfg.model.get("path"):
        load_hf_weights(model, os.path.expanduser(str(cfg.model.path)))
    if cfg.get("lora") is not None:
        from tritonllm.nn.lora import apply_lora

        apply_lora(model, cfg.lora)
