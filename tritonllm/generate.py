"""``python -m tritonllm.generate ckpt=<dir> prompt="..." max_new_tokens=200 temperature=0.8 top_k=200 top_p=0.95``

Loads a training checkpoint (the newest one that verifies, checksums and finite weights, when
given a run or checkpoints folder) with the tokenizer saved next to it, samples a continuation
of ``prompt`` with the KV cache and prints it (on a GPU each new token is one replay of a CUDA
graph of the decode step: ``Transformer.generate``).
Config: ``conf/generate.yaml``.
"""

from __future__ import annotations

import os

import torch

from tritonllm.checkpoint import (STATE_FILE, TOKENIZER_FILE, list_checkpoints, load_checkpoint, load_first_valid,
                                  read_state)
from tritonllm.conf.schema import check_config
from tritonllm.data import Tokenizer
from tritonllm.errors import CheckpointError
from tritonllm.runtime import hydra_app, resolve_device, resolve_dtype


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


def load_newest_for_generation(path: str, device: torch.device, dtype: torch.dtype):
    """``(checkpoint, model, tokenizer)`` of the newest checkpoint ``path`` names that loads (verified);
    an older one is taken, with a log line, only when ``path`` is a folder of checkpoints."""
    ckpt, (model, tokenizer) = load_first_valid(resolve_checkpoints(path),
                                                lambda c: load_for_generation(c, device, dtype))
    return ckpt, model, tokenizer


def load_for_generation(path: str, device: torch.device, dtype: torch.dtype):
    """``(model, tokenizer)`` from the checkpoint folder ``path``, the model in eval mode."""
    from tritonllm.models import ModelConfig, build_model

    state = read_state(path)
    tok_path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(tok_path):
        raise CheckpointError(f"checkpoint {path} has no {TOKENIZER_FILE}: generation needs the run's "
                              f"SentencePiece tokenizer (with data=bin, train with data.tokenizer=<model>)")
    try:
        model_cfg = ModelConfig.from_dict(state["model_config"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has no usable model config in state.json: {e}") from None
    model = build_model(model_cfg, device=device, dtype=dtype)
    load_checkpoint(path, model, restore_rng=False, model_config=model_cfg.to_dict())
    return model.eval(), Tokenizer(tok_path)


def generate_text(model, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                  top_k: int | None = 200, top_p: float | None = None) -> str:
    """The sampled continuation of ``prompt`` (up to ``max_new_tokens`` tokens, cut at end-of-document)."""
    device = next(model.parameters()).device
    limit = model.cfg.max_seq_len
    ids = (tokenizer.encode(prompt) if prompt else [tokenizer.eos_id])[-limit:]
    idx = torch.tensor([ids], dtype=torch.int64, device=device)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         use_cache=len(ids) + max_new_tokens <= limit)
    new = out[0, len(ids):].tolist()
    if tokenizer.eos_id in new:
        new = new[:new.index(tokenizer.eos_id)]
    return tokenizer.decode(new)


@hydra_app("generate")
def main(cfg) -> None:
    check_config(cfg)  # sampling options in range before the checkpoint is read
    device = resolve_device(cfg.device)
    _, model, tokenizer = load_newest_for_generation(cfg.ckpt, device, resolve_dtype(cfg.dtype, device, "dtype"))
    torch.manual_seed(cfg.seed)
    for i in range(cfg.num_samples):
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        text = generate_text(model, tokenizer, cfg.prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
        print(cfg.prompt + text, flush=True)


if __name__ == "__main__":
    main()
