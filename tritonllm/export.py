"""``python -m tritonllm.export ckpt=<run or checkpoint folder> out=<dir> [adapters_only=true] [dtype=bf16]``

Writes the newest checkpoint that loads (verified: checksums and finite weights) of a run, checkpoints
or checkpoint folder as a Hugging Face folder:

- by default a model ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads
  (:func:`tritonllm.hf.save_hf_model`: ``config.json`` + ``model.safetensors``). A ``+lora=...`` run is
  written with its adapters merged, ``W + (alpha / r) B A`` per adapted projection;
- with ``adapters_only=true`` the LoRA adapters alone as a PEFT adapter
  (:func:`tritonllm.nn.lora.save_adapter`: ``adapter_config.json`` with ``r``, ``lora_alpha`` and the
  Hugging Face ``target_modules``, ``adapter_model.safetensors`` with PEFT's names such as
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), which
  ``peft.PeftModel.from_pretrained(base, out)`` puts on the base model. ``base_model_name_or_path`` is
  the run's ``model.path`` (a ``+model=hf`` run), else null.

The tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
the chat template, ``generation_config.json``, ...) are copied along from the run's Hugging Face
folder: its ``data.tokenizer`` when that is a folder, else its ``model.path`` (a run with a
SentencePiece ``tokenizer.model`` has none to copy: the weights only).

``dtype`` (auto: the dtype the checkpoint stores its weights in; bf16, fp16, fp32) is the dtype of
the written tensors; the model is loaded and the adapters merged in fp32 on ``device``.
``architecture`` (llama, mistral, qwen2, qwen3) picks the Hugging Face family of the merged model;
null: the ``model_type`` of the run's ``model.path`` folder, else the family that has the model's
features. ``out`` must not exist or be empty, unless ``overwrite=true`` (then it is replaced, once the
new folder is complete). Config: ``conf/export.yaml``.
"""

from __future__ import annotations

import os
import shutil

import torch

from tritonllm.checkpoint import MODEL_FILE, load_first_valid
from tritonllm.conf.schema import check_config
from tritonllm.errors import CheckpointError, ConfigError
from tritonllm.generate import checkpoint_run_config, load_run_model, resolve_checkpoints
from tritonllm.runtime import DTYPES, hydra_app, resolve_device

#: dtype names of ``dtype=`` (the written tensors only: fp16 needs no kernel)
EXPORT_DTYPES = {**DTYPES, "fp16": torch.float16}
#: safetensors dtype code -> torch dtype of a checkpoint's stored weights (``dtype=auto``)
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
#: files of a Hugging Face folder copied with the export besides TOKENIZER_FILES (slow tokenizers' files)
EXTRA_TOKENIZER_FILES = ("vocab.json", "merges.txt", "added_tokens.json", "chat_template.json")


def _folder_option(run_cfg, key: str) -> str | None:
    """The run config's ``key`` as an expanded path when it names a folder, else None."""
    from omegaconf import OmegaConf

    value = OmegaConf.select(run_cfg, key, default=None)
    if value is None:
        return None
    path = os.path.abspath(os.path.expanduser(str(value)))
    return path if os.path.isdir(path) else None


def run_tokenizer_folder(run_cfg) -> str | None:
    """The Hugging Face folder of the run's tokenizer: ``data.tokenizer`` when it is a folder with a
    ``tokenizer.json``, else ``model.path`` when that has one; None for a SentencePiece run."""
    for key in ("data.tokenizer", "model.path"):
        folder = _folder_option(run_cfg, key)
        if folder is not None and os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return folder
    return None


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    """Copy the tokenizer, chat template and generation config files ``src`` has into ``dst``; their names."""
    from tritonllm.data.hf_tokenizer import TOKENIZER_FILES

    copied = [name for name in (*TOKENIZER_FILES, *EXTRA_TOKENIZER_FILES) if os.path.isfile(os.path.join(src, name))]
    for name in copied:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    return copied


def stored_dtype(path: str) -> torch.dtype:
    """The dtype the checkpoint ``path`` stores its weights in (that of its first tensor)."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, MODEL_FILE), framework="pt") as f:
        code = f.get_slice(next(iter(f.keys()))).get_dtype()
    if code not in STORED_DTYPES:
        raise CheckpointError(f"checkpoint {path}: weights of dtype {code}; give dtype=bf16, fp16 or fp32")
    return STORED_DTYPES[code]


def base_architecture(run_cfg) -> str | None:
    """The ``model_type`` of the run's ``model.path`` folder (a ``+model=hf`` run), None without one."""
    from tritonllm.hf import ARCHITECTURES, read_hf_config

    folder = _folder_option(run_cfg, "model.path")
    if folder is None or not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    model_type = read_hf_config(folder).get("model_type")
    return model_type if model_type in ARCHITECTURES else None


def check_out(out: str, ckpt: str, overwrite: bool) -> str:
    """``out`` as an absolute path, after checking that it may be written: no file there, no folder
    holding files unless ``overwrite``, and not the checkpoint's folder or one above it."""
    out = os.path.abspath(os.path.expanduser(str(out)))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"out={out!r} is a file; give a folder")
    source = os.path.realpath(os.path.expanduser(str(ckpt)))
    if os.path.commonpath([os.path.realpath(out), source]) == os.path.realpath(out):
        raise ConfigError(f"out={out!r} holds the checkpoint ckpt={ckpt!r}; give another folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ConfigError(f"out={out!r} exists and is not empty; pass overwrite=true to replace it")
    return out


def write_export(model, run_cfg, folder: str, adapters_only: bool, dtype: torch.dtype,
                 architecture: str | None) -> str:
    """Write ``model`` (loaded by :func:`~tritonllm.generate.load_run_model`) into ``folder``: merged,
    or its adapters alone; the tokenizer files of its run along. Returns what was written, in words."""
    from tritonllm.hf import save_hf_model
    from tritonllm.nn.lora import save_adapter

    lora = getattr(model, "lora_config", None)
    if adapters_only:
        if lora is None:
            raise ConfigError("adapters_only=true: the run has no LoRA adapters (its config.yaml has no lora "
                              "section); export the whole model without adapters_only")
        base = _folder_option(run_cfg, "model.path")
        save_adapter(model.to(dtype), folder, base_model=base)
        what = (f"PEFT LoRA adapter (r={lora.rank}, alpha={lora.alpha:g}, targets {','.join(lora.targets)}; "
                f"base {base or 'unknown: not a +model=hf run'})")
    else:
        save_hf_model(model, folder, architecture=architecture or base_architecture(run_cfg), dtype=dtype)
        what = "Hugging Face model" + (" (LoRA adapters merged)" if lora is not None else "")
    tokenizer = run_tokenizer_folder(run_cfg)
    if tokenizer is not None:
        copy_tokenizer_files(tokenizer, folder)
    return f"{what}, {str(dtype).removeprefix('torch.')}, " + (
        f"tokenizer from {tokenizer}" if tokenizer else "no tokenizer (the run has no Hugging Face tokenizer folder)")


def export(ckpt: str, out: str, adapters_only: bool = False, dtype: str = "auto", architecture: str | None = None,
           device: torch.device | None = None, overwrite: bool = False) -> tuple[str, str]:
    """Export the newest loadable checkpoint ``ckpt`` names into the folder ``out`` (see the module
    docstring); ``(checkpoint exported, what was written)``. The folder is written beside ``out`` and
    moved there once complete."""
    if adapters_only and architecture is not None:
        raise ConfigError(f"architecture={architecture!r} applies to the merged model; adapters_only=true "
                          f"writes the adapters alone (PEFT's module names fit every family)")
    out = check_out(out, ckpt, overwrite)
    device = device or torch.device("cpu")
    path, model = load_first_valid(resolve_checkpoints(ckpt), lambda c: load_run_model(c, device, torch.float32))
    run_cfg = checkpoint_run_config(path)
    out_dtype = stored_dtype(path) if dtype == "auto" else EXPORT_DTYPES[dtype]
    tmp = f"{out}.tmp-export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        what = write_export(model, run_cfg, tmp, adapters_only, out_dtype, architecture)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, what


@hydra_app("export")
def main(cfg) -> None:
    check_config(cfg)
    for key, what in (("ckpt", "a checkpoint, checkpoints or run folder"), ("out", "the folder to write")):
        if cfg[key] is None:
            raise ConfigError(f"give {key}=<{what}>")
    path, what = export(cfg.ckpt, cfg.out, cfg.adapters_only, cfg.dtype, cfg.architecture,
                        resolve_device(cfg.device), cfg.overwrite)
    print(f"exported {path} to {os.path.abspath(os.path.expanduser(str(cfg.out)))}: {what}", flush=True)


if __name__ == "__main__":
    main()
