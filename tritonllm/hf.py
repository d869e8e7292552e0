"""Hugging Face checkpoints in and out of tritonllm: Llama, Mistral, Qwen2 and Qwen3.

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

Both use the half-split ("rotate_half") RoPE layout, so q and k rows are copied as they are.
RoPE: ``rope_theta`` and the ``default``, ``linear``, ``llama3`` and ``yarn`` rope types (the
config's ``rope_parameters``, or ``rope_theta`` + ``rope_scaling`` as transformers 4 wrote them).
Anything the Transformer cannot compute the same way (another architecture, an activation other
than SiLU, output-projection or MLP biases, a dynamic or partial RoPE, per-layer sliding windows,
a quantized checkpoint, a head width flash attention lacks) is an :class:`HFConfigError` naming
the config field.

Export (:func:`save_hf_model`) writes the inverse: ``config.json`` (LlamaForCausalLM, or
Qwen3ForCausalLM with QK-norm, Qwen2ForCausalLM with q/k/v biases, MistralForCausalLM with a
sliding window), ``model.safetensors`` and the tokenizer files of a source folder, which
``transformers.AutoModelForCausalLM.from_pretrained`` loads. A model with LoRA adapters
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
                 "qwen3": "Qwen3ForCausalLM"}
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
    if model_type in ("qwen2", "qwen3"):
        if hf.get("use_sliding_window"):
            raise HFConfigError("use_sliding_window=true: Qwen's per-layer sliding windows (max_window_layers) are "
                                "not supported")
        return None
    if model_type == "mistral":
        if layer_types and layer_types[0] == "full_attention":
            return None
        return hf.get("sliding_window")
    if layer_types and layer_types[0] != "full_attention":
        raise HFConfigError(f"layer_types={layer_types[0]!r}: only full attention is supported for {model_type}")
    return None


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
            rope_theta=theta, rope_scaling=scaling, qk_norm=model_type == "qwen3", qkv_bias=model_type == "qwen2",
            window=_window(hf, model_type), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
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
    return names


def state_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A Transformer state dict from Hugging Face tensors (q/k/v and gate/up concatenated by rows)."""
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
    return {tl: hf_state[src] if isinstance(src, str) else torch.cat([hf_state[s] for s in src])
            for tl, src in names.items()}


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
    if cfg.n_experts:
        raise HFConfigError("n_experts > 0: MoE models have no Hugging Face export")
    if cfg.qk_norm and cfg.qkv_bias:
        raise HFConfigError("qk_norm with qkv_bias matches no supported Hugging Face family")
    speedrun = {"mlp_act": cfg.mlp_act != "swiglu", "window_schedule": cfg.window_schedule is not None,
                "logit_softcap": cfg.logit_softcap is not None, "value_embeddings": cfg.value_embeddings > 0,
                "unet_skips": cfg.unet_skips}
    for field, on in speedrun.items():
        if on:
            raise HFConfigError(f"{field}={getattr(cfg, field)!r}: no supported Hugging Face family has it")
    auto = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "mistral" if cfg.window else "llama"
    model_type = architecture or auto
    if model_type not in ARCHITECTURES:
        raise HFConfigError(f"architecture={model_type!r}: expected one of {sorted(ARCHITECTURES)}")
    needs = {"qwen3": ("qk_norm", True), "qwen2": ("qkv_bias", True)}
    for mt, (field, value) in needs.items():
        if (model_type == mt) != (getattr(cfg, field) == value):
            raise HFConfigError(f"architecture={model_type!r} does not fit {field}={getattr(cfg, field)}")
    if cfg.window and model_type != "mistral":
        raise HFConfigError(f"window={cfg.window}: only the mistral architecture has one sliding window")
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
    if model_type == "mistral":
        out["sliding_window"] = cfg.window
    if model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    return out


def state_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from a Transformer state dict (packed rows split back)."""
    q, kv = cfg.n_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    splits = {"qkv": [q, kv, kv], "w13": [cfg.d_ff, cfg.d_ff]}
    out = {}
    for tl, src in _names(cfg).items():
        tensor = state[tl]
        if isinstance(src, str):
            out[src] = tensor.contiguous()
        else:
            parts = torch.split(tensor, splits["qkv" if ".qkv." in tl else "w13"])
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
