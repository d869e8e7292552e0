"""``python -m tritonllm.generate ckpt=<dir> prompt="..." max_new_tokens=200 temperature=0.8 top_k=200 top_p=0.95``

Loads a training checkpoint (the newest one that verifies, checksums and finite weights, when
given a run or checkpoints folder) with the tokenizer saved next to it, samples a continuation
of ``prompt`` with the KV cache and prints it (on a GPU each new token is one replay of a CUDA
graph of the decode step: ``Transformer.generate``).

The model and its tokenizer come from one of:

- ``ckpt=<dir>``: a tritonllm checkpoint. Its tokenizer is the SentencePiece ``tokenizer.model``
  saved with it, else the Hugging Face folder its run read (``data.tokenizer`` of its
  ``config.yaml``: a ``+model=hf ... data=sft`` run). A ``+lora=...`` run's checkpoint gets the
  adapters its ``config.yaml`` describes (``lora``) before its weights (base and adapters) are read.
- ``hf=<dir>``: a Hugging Face model folder (:func:`tritonllm.hf.load_hf_model`) with its
  ``tokenizer.json`` (:class:`~tritonllm.data.hf_tokenizer.HFTokenizer`).

``tokenizer=<path>`` replaces either's tokenizer (a folder with ``tokenizer.json``, or a
SentencePiece ``.model`` file). A Hugging Face tokenizer encodes a plain prompt with its special
tokens (BOS where its ``tokenizer.json`` adds one, as ``transformers`` does); ``chat=true``
renders the prompt as one user message with the model's chat template and the assistant's
generation prompt, and prints only the reply. Generation stops at the tokenizer's EOS token and at
the ``eos_token_id`` of the folder's ``generation_config.json``.
Config: ``conf/generate.yaml``.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from tritonllm.checkpoint import (CONFIG_FILE, STATE_FILE, TOKENIZER_FILE, list_checkpoints, load_checkpoint,
                                  load_first_valid, read_state)
from tritonllm.conf.schema import check_config
from tritonllm.data import Tokenizer
from tritonllm.data.hf_tokenizer import HFTokenizer
from tritonllm.errors import CheckpointError, ConfigError, TritonLLMError
from tritonllm.runtime import hydra_app, resolve_device, resolve_dtype

log = logging.getLogger(__name__)

#: how the RoPE is stretched past the trained context (``rope_scaling=``): kernels.rope.rope_cos_sin's types
CONTEXT_SCALINGS = ("yarn", "ntk", "linear")


def resolve_checkpoints(path: str) -> list[str]:
    """The checkpoints ``path`` names, newest first: itself, or those inside it or its ``checkpoints/``."""
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"ckpt={path!r} does not exist")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return [path]
    found = list_checkpoints(path) or list_checkpoints(os.path.join(path, "checkpoints"))
    if not found:
        raise CheckpointError(f"ckpt={path!r} holds no checkpoint (a step_* folder with state.json)")
    return [p for _, p in reversed(found)]


def load_newest_for_generation(path: str, device: torch.device, dtype: torch.dtype, tokenizer: str | None = None):
    """``(checkpoint, model, tokenizer)`` of the newest checkpoint ``path`` names that loads (verified);
    an older one is taken, with a log line, only when ``path`` is a folder of checkpoints."""
    ckpt, (model, tok) = load_first_valid(resolve_checkpoints(path),
                                          lambda c: load_for_generation(c, device, dtype, tokenizer))
    return ckpt, model, tok


def open_tokenizer(path: str, field: str = "tokenizer"):
    """The tokenizer at ``path``: a Hugging Face folder (``tokenizer.json``) or a SentencePiece
    ``.model`` file; a ConfigError naming ``field`` when it is neither."""
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        try:
            return HFTokenizer(path)
        except TritonLLMError as e:
            raise ConfigError(f"{field}={path!r}: {e}") from None
    if not os.path.isfile(path):
        raise ConfigError(f"{field}={path!r} does not exist (a Hugging Face model folder or a SentencePiece .model)")
    return Tokenizer(path)


def checkpoint_run_config(path: str):
    """The run's ``config.yaml`` saved in the checkpoint ``path`` (an empty config when absent)."""
    from omegaconf import OmegaConf

    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        return OmegaConf.create({})
    try:
        return OmegaConf.load(file)
    except Exception as e:  # a YAML or OmegaConf error
        raise CheckpointError(f"checkpoint {path}: {CONFIG_FILE} is unreadable: {e}") from None


def _checkpoint_tokenizer(path: str, run_cfg):
    """The tokenizer of the checkpoint ``path``: its ``tokenizer.model``, else the Hugging Face
    folder of its run's ``data.tokenizer``."""
    from omegaconf import OmegaConf

    sp = os.path.join(path, TOKENIZER_FILE)
    if os.path.isfile(sp):
        return Tokenizer(sp)
    folder = OmegaConf.select(run_cfg, "data.tokenizer", default=None)
    if folder is None:
        raise CheckpointError(f"checkpoint {path} has no {TOKENIZER_FILE} and its {CONFIG_FILE} names no "
                              f"data.tokenizer: generation needs the run's tokenizer (with data=bin, train with "
                              f"data.tokenizer=<model>; or pass tokenizer=<path>)")
    folder = os.path.expanduser(str(folder))
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise CheckpointError(f"checkpoint {path}: its run's data.tokenizer={folder!r} ({CONFIG_FILE}) has no "
                              f"tokenizer.json; pass tokenizer=<Hugging Face model folder>")
    return HFTokenizer(folder)


def load_for_generation(path: str, device: torch.device, dtype: torch.dtype, tokenizer: str | None = None):
    """``(model, tokenizer)`` from the checkpoint folder ``path``, the model in eval mode, with the
    LoRA adapters of its run's ``lora`` config; ``tokenizer`` replaces the checkpoint's tokenizer."""
    run_cfg = checkpoint_run_config(path)
    tok = open_tokenizer(tokenizer) if tokenizer is not None else _checkpoint_tokenizer(path, run_cfg)
    return load_run_model(path, device, dtype, run_cfg), tok


def load_run_model(path: str, device: torch.device, dtype: torch.dtype, run_cfg=None):
    """The model of the checkpoint folder ``path`` in eval mode, with the LoRA adapters of its run's
    ``lora`` config (``run_cfg``: its ``config.yaml``, read when None) and its weights (base and adapters)."""
    from tritonllm.models import ModelConfig, build_model
    from tritonllm.nn.lora import apply_lora

    state = read_state(path)
    run_cfg = checkpoint_run_config(path) if run_cfg is None else run_cfg
    try:
        model_cfg = ModelConfig.from_dict(state["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has no usable model config in state.json: {e}") from None
    model = build_model(model_cfg, device=device, dtype=dtype)
    if run_cfg.get("lora") is not None:
        try:
            apply_lora(model, run_cfg.lora)
        except ConfigError as e:
            raise CheckpointError(f"checkpoint {path}: the lora section of its {CONFIG_FILE}: {e}") from None
    load_checkpoint(path, model, restore_rng=False, model_config=model_cfg.to_dict())
    return model.eval()


def load_hf_for_generation(path: str, device: torch.device, dtype: torch.dtype, tokenizer: str | None = None):
    """``(model, tokenizer)`` of the Hugging Face model folder ``path`` (``hf=<dir>``), in eval mode."""
    from tritonllm.hf import load_hf_model

    path = os.path.expanduser(str(path))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"hf={path!r} is not a Hugging Face model folder (no config.json)")
    tok = open_tokenizer(tokenizer if tokenizer is not None else path, "tokenizer" if tokenizer is not None else "hf")
    return load_hf_model(path, device=device, dtype=dtype).eval(), tok


def prompt_ids(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """The token ids generation starts from: ``prompt`` encoded (``""``: one end-of-document token
    for a SentencePiece tokenizer), or with ``chat`` rendered as a user message by the chat template."""
    if chat:
        if not isinstance(tokenizer, HFTokenizer):
            raise ConfigError(f"chat=true needs a Hugging Face tokenizer with a chat template; {tokenizer.path} "
                              f"is a SentencePiece model")
        if tokenizer.chat_template is None:
            raise ConfigError(f"chat=true: the tokenizer in {tokenizer.folder} has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return tokenizer.encode(text)
    if not isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
    ids = tokenizer.tok.encode(prompt, add_special_tokens=True).ids
    if not ids:
        start = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        if start is None:
            raise ConfigError(f"prompt=\"\": the tokenizer in {tokenizer.folder} has neither a BOS nor an EOS token "
                              f"to start from; give a prompt")
        ids = [start]
    return ids


def stop_ids(tokenizer) -> set[int]:
    """Token ids that end the generated text: the tokenizer's EOS and, for a Hugging Face folder,
    the ``eos_token_id`` (one or a list) of its ``generation_config.json``."""
    stops = {tokenizer.eos_id} - {None}
    file = os.path.join(tokenizer.folder, "generation_config.json") if isinstance(tokenizer, HFTokenizer) else None
    if file is not None and os.path.isfile(file):
        import json

        with open(file) as f:
            eos = json.load(f).get("eos_token_id")
        stops |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return stops


def extend_context(model, context: int, scaling: str = "yarn") -> None:
    """Let ``model`` (trained over ``L = model.cfg.max_seq_len`` positions) attend over ``context > L``
    positions: its RoPE stretched by ``factor = context / L`` (``yarn``: YaRN's per-frequency ramp around ``L``
    and its attention temperature ``0.1 ln(factor) + 1``; ``ntk``: NTK-aware base ``theta f^(D / (D - 2))``;
    ``linear``: position interpolation), the weights unchanged, the RoPE tables rebuilt at the next call. A
    context within L changes nothing; a model whose RoPE is already scaled is refused."""
    cfg = model.cfg
    if context <= cfg.max_seq_len:
        return
    if scaling not in CONTEXT_SCALINGS:
        raise ConfigError(f"rope_scaling must be one of {CONTEXT_SCALINGS}, got {scaling!r}")
    if cfg.rope_scaling is not None:
        raise ConfigError(f"context={context}: the model's RoPE is already scaled ({cfg.rope_scaling}) for "
                          f"{cfg.max_seq_len} positions; it cannot be stretched again")
    factor = context / cfg.max_seq_len
    rope = {"type": scaling, "factor": factor, **({"original_max_position": cfg.max_seq_len} if scaling == "yarn"
                                                  else {})}
    model.cfg = dataclasses.replace(cfg, max_seq_len=context, rope_scaling=rope)
    log.info("context %d positions: the model's %d stretched by %s RoPE scaling, factor %.4g", context,
             cfg.max_seq_len, scaling, factor)


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                  top_k: int | None = 200, top_p: float | None = None, chat: bool = False) -> str:
    """The sampled continuation of ``prompt`` (up to ``max_new_tokens`` tokens, cut at the first stop
    token: :func:`stop_ids`); with ``chat`` the assistant's reply to ``prompt`` (:func:`prompt_ids`)."""
    device = next(model.parameters()).device
    limit = model.cfg.max_seq_len
    ids = prompt_ids(tokenizer, prompt, chat)[-limit:]
    idx = torch.tensor([ids], dtype=torch.int64, device=device)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         use_cache=len(ids) + max_new_tokens <= limit)
    new = out[0, len(ids):].tolist()
    stops = stop_ids(tokenizer)
    ends = [i for i, t in enumerate(new) if t in stops]
    return tokenizer.decode(new[:ends[0]] if ends else new)


@hydra_app("generate")
def main(cfg) -> None:
    check_config(cfg)  # sampling options in range before the checkpoint is read
    if (cfg.ckpt is None) == (cfg.hf is None):
        raise ConfigError("give one of ckpt=<checkpoint, checkpoints or run folder> and hf=<Hugging Face model "
                          "folder>" + (f", not both (ckpt={cfg.ckpt!r}, hf={cfg.hf!r})" if cfg.ckpt else ""))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, "dtype")
    if cfg.hf is not None:
        model, tokenizer = load_hf_for_generation(cfg.hf, device, dtype, cfg.tokenizer)
    else:
        _, model, tokenizer = load_newest_for_generation(cfg.ckpt, device, dtype, cfg.tokenizer)
    if cfg.context is not None:
        extend_context(model, cfg.context, cfg.rope_scaling)
    prompt_ids(tokenizer, cfg.prompt, cfg.chat)  # a chat template or prompt error before any sampling
    torch.manual_seed(cfg.seed)
    for i in range(cfg.num_samples):
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        text = generate_text(model, tokenizer, cfg.prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                             cfg.chat)
        print(text if cfg.chat else cfg.prompt + text, flush=True)


if __name__ == "__main__":
    main()
