"""``python -m tritonllm.train +model=<name> [overrides]``: pretrain a tritonllm model.

A thin ``@hydra.main`` around :func:`train`, which takes the composed config (``conf/train.yaml``
and its groups) and returns the final validation loss, the value sweepers minimize.

The loop, per optimizer step: ``trainer.grad_accum`` micro-batches of ``batch_size x seq_len``
tokens (forward, loss / grad_accum, backward), global gradient norm clipped to ``grad_clip``
(``tritonllm.optim.clip_grad_norm_``), learning rate from ``conf/sched`` (warmup + cosine,
warmup-stable-decay or constant), then ``tritonllm.optim.AdamW``. On a GPU the model computes in
bf16 and AdamW keeps fp32 master weights; on the CPU (Triton interpreter) everything is fp32.
A step whose loss or gradient norm is not finite is skipped (logged as ``kind: skip``); after
``trainer.max_bad_steps`` such steps in a row training stops with an error.

Throughput: tokens/s over the steps since the last log line (validation and checkpoint time
excluded) and ``MFU = model.flops_per_token(seq_len) * tokens/s / trainer.peak_flops`` with
``flops_per_token = 6 N_active + 12 n_layers n_heads head_dim seq_len`` and ``peak_flops``
989e12 (H100/H200 dense bf16) by default.

Each ``kind: train`` record of ``metrics.jsonl`` (and W&B) also holds the loss parts of the step's
last micro-batch: ``z_loss``, ``aux`` (the MoE auxiliary losses as added to the loss) and, for
MoE models, ``moe_aux``, ``moe_z`` (unscaled, mean over layers) and ``moe_max_load``.

Checkpoints (``tritonllm.checkpoint``) every ``ckpt_interval`` steps and at the end, the last
``keep_last`` kept. ``trainer.resume=auto`` continues from the newest checkpoint in ``ckpt_dir``,
else (outside multirun) the newest one of the earlier runs of the same name
(``outputs/<name>/*/checkpoints``); ``trainer.resume=<path>`` from that checkpoint or folder. A
resumed run restores weights, optimizer state, RNG states and the data position, so its losses
are those of the uninterrupted run (bit for bit in fp32 on the CPU).
"""

from __future__ import annotations

import glob
import logging
import math
import os
import shutil
import time

import hydra
import torch
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from tritonllm.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from tritonllm.data import load_corpus
from tritonllm.errors import CheckpointError, ConfigError, TrainingError
from tritonllm.logging_utils import RunLogger, hydra_job
from tritonllm.runtime import exit_on_user_error, resolve_device, resolve_dtype
from tritonllm.schedule import check_schedule, lr_multiplier

log = logging.getLogger("tritonllm.train")


def available_models() -> list[str]:
    """Names of the model configs shipped in ``tritonllm.conf/model``."""
    from importlib.resources import files

    return sorted(p.name[:-5] for p in (files("tritonllm.conf") / "model").iterdir() if p.name.endswith(".yaml"))


def model_config(cfg):
    """The :class:`~tritonllm.models.ModelConfig` of the run (a ConfigError when there is none or it is invalid)."""
    from tritonllm.models.config import ModelConfig

    if cfg.get("model") is None:
        raise ConfigError(f"no model chosen: add +model=<name> to the command line, one of: "
                          f"{', '.join(available_models())}")
    try:
        return ModelConfig.from_dict(cfg.model)
    except (TypeError, ValueError, ConfigError) as e:
        raise ConfigError(f"model config ({cfg.model.get('name')}): {e}") from None


class NonFiniteGuard:
    """Decides whether a step may update the weights: its loss and gradient norm must be finite.

    ``check`` returns False for a step to skip; after ``max_consecutive`` skipped steps in a row it
    raises a TrainingError (the run has diverged or the data is broken).
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return True
        self.consecutive += 1
        log.warning("step %d: non-finite loss %s or gradient norm %s, update skipped (%d in a row)",
                    step, loss, grad_norm, self.consecutive)
        if self.consecutive >= self.max_consecutive:
            raise TrainingError(f"{self.consecutive} steps in a row had a non-finite loss or gradient norm "
                                f"(last: step {step}, loss {loss}, grad norm {grad_norm}); stopping. Lower "
                                f"optim.lr, raise sched.warmup_steps or check the data "
                                f"(trainer.max_bad_steps={self.max_consecutive})")
        return False


def build_optimizer(model: torch.nn.Module, optim_cfg, master_weights: bool):
    """tritonllm's AdamW; weight decay on matrices only (norm weights, biases and vectors get none)."""
    from tritonllm.optim import AdamW

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": float(optim_cfg.weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    return AdamW([g for g in groups if g["params"]], lr=float(optim_cfg.lr), betas=tuple(optim_cfg.betas),
                 eps=float(optim_cfg.eps), weight_decay=float(optim_cfg.weight_decay), master_weights=master_weights)


def resume_path(tr, out_dir: str) -> str | None:
    """The checkpoint ``trainer.resume`` asks for (None: start fresh)."""
    if tr.resume is None:
        return None
    if tr.resume == "auto":
        found = find_checkpoint(tr.ckpt_dir)
        if found is None and not hydra_job():
            earlier = [c for d in glob.glob(os.path.join(os.path.dirname(os.path.abspath(out_dir)), "*", "checkpoints"))
                       if (c := find_checkpoint(d))]
            found = max(earlier, key=lambda c: os.path.getmtime(os.path.join(c, "state.json")), default=None)
        if found is None:
            log.info("trainer.resume=auto: no checkpoint found, starting from scratch")
        return found
    path = os.path.expanduser(str(tr.resume))
    if not os.path.exists(path):
        raise CheckpointError(f"trainer.resume={path!r} does not exist")
    found = find_checkpoint(path)
    if found is None:
        raise CheckpointError(f"trainer.resume={path!r} holds no checkpoint (a step_* folder with state.json)")
    return found


def forward_backward(model, params, batches, grad_clip, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the mean loss over the micro-batches ``[(x, y), ...]``, clipped to global norm
    ``grad_clip`` (None: not clipped). Returns the mean loss and the norm before clipping as 0-d
    device tensors (no host synchronisation)."""
    from tritonllm.optim import clip_grad_norm_

    losses = []
    for x, y in batches:
        loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        (loss if len(batches) == 1 else loss / len(batches)).backward()
        losses.append(loss.detach().float())
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    return loss, clip_grad_norm_(params, math.inf if grad_clip is None else float(grad_clip))


@torch.no_grad()
def evaluate(model, loader, n_batches: int, device) -> float:
    """Mean cross-entropy of the model over the first ``n_batches`` validation batches."""
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float32)
    for x, y in loader.batches(n_batches):
        model(x.to(device), y.to(device))
        total += model.last_losses["ce"]
    model.train()
    return total.item() / n_batches


def train(cfg) -> float:
    """Train the model ``cfg`` describes; returns the final validation loss (mean cross-entropy)."""
    tr = cfg.trainer
    model_cfg = model_config(cfg)
    check_schedule(cfg.sched)
    if tr.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"trainer.seq_len={tr.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}")
    for key in ("max_steps", "batch_size", "seq_len", "grad_accum", "log_interval", "eval_interval", "eval_batches",
                "max_bad_steps"):
        if tr[key] < 1:
            raise ConfigError(f"trainer.{key} must be >= 1, got {tr[key]}")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(tr.dtype, device)
    try:
        out_dir = os.path.abspath(str(cfg.out_dir))
    except InterpolationResolutionError:
        raise ConfigError("out_dir is the Hydra run folder, which only exists under python -m tritonllm.train: "
                          "compose the config with out_dir=<folder> to call train(cfg) directly") from None
    os.makedirs(out_dir, exist_ok=True)

    corpus = load_corpus(cfg.data)
    log.info("data: %s", corpus.description)
    if corpus.vocab_size and corpus.vocab_size != model_cfg.vocab_size:
        log.info("model.vocab_size %d -> %d (the tokenizer's)", model_cfg.vocab_size, corpus.vocab_size)
        model_cfg.vocab_size = corpus.vocab_size
    with open_dict(cfg):
        cfg.model.vocab_size = model_cfg.vocab_size
    tok_path = None
    if corpus.tokenizer is not None:
        tok_path = os.path.join(out_dir, "tokenizer.model")
        shutil.copyfile(corpus.tokenizer.path, tok_path)

    from tritonllm.models import build_model

    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device=device, dtype=dtype)
    master = cfg.optim.master_weights
    optimizer = build_optimizer(model, cfg.optim, dtype != torch.float32 if master == "auto" else bool(master))
    params = [p for p in model.parameters() if p.requires_grad]
    train_loader, val_loader = corpus.loaders(tr.batch_size, tr.seq_len, cfg.seed, model_cfg.vocab_size)
    tokens_per_step = tr.batch_size * tr.seq_len * tr.grad_accum
    flops_per_token = model.flops_per_token(tr.seq_len)
    log.info("model %s: %.2fM parameters (%.2fM active), %s on %s; %d tokens per step",
             model_cfg.name, model.num_params() / 1e6, model.num_active_params() / 1e6,
             str(dtype).replace("torch.", ""), device, tokens_per_step)

    step, tokens_seen = 0, 0
    guard = NonFiniteGuard(tr.max_bad_steps)
    ckpt = resume_path(tr, out_dir)
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, optimizer, model_config=model_cfg.to_dict())
        train_loader.load_state_dict(state["data"])
        step, tokens_seen, guard.consecutive = state["step"], state["tokens_seen"], state["bad_steps"]
        log.info("resumed from %s at step %d", ckpt, step)

    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    run_log = RunLogger(out_dir, cfg.name, OmegaConf.to_container(cfg, resolve=True), cfg.logger,
                        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")

    def checkpoint():
        state = {"data": train_loader.state_dict(), "model_config": model_cfg.to_dict(), "tokens_seen": tokens_seen,
                 "bad_steps": guard.consecutive}
        path = save_checkpoint(tr.ckpt_dir, step, model, optimizer, state, config_yaml, tok_path, tr.keep_last)
        log.info("checkpoint %s", path)

    def validate() -> float:
        val = evaluate(model, val_loader, tr.eval_batches, device)
        run_log.log({"kind": "val", "step": step, "val_loss": val, "tokens": tokens_seen})
        log.info("step %d: validation loss %.4f", step, val)
        return val

    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    val_loss = None
    window_tokens, window_time = 0, 0.0
    try:
        with logging_redirect_tqdm(), tqdm(total=tr.max_steps, initial=step, disable=not tr.progress,
                                           dynamic_ncols=True, unit="step") as bar:
            while step < tr.max_steps:
                t0 = time.perf_counter()
                lr = float(cfg.optim.lr) * lr_multiplier(step, tr.max_steps, cfg.sched)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                batches = [train_loader.next_batch() for _ in range(tr.grad_accum)]
                loss, norm = forward_backward(model, params, batches, tr.grad_clip, device)
                # one host sync per step: the loss, the norm and the last micro-batch's loss parts
                parts = {k: v for k, v in model.last_losses.items() if k != "ce"}
                loss_val, norm_val, *part_vals = torch.stack([loss, norm.float(), *parts.values()]).tolist()
                if guard.check(step, loss_val, norm_val):
                    optimizer.step()
                else:
                    run_log.log({"kind": "skip", "step": step, "loss": loss_val, "grad_norm": norm_val})
                optimizer.zero_grad(set_to_none=True)
                step += 1
                tokens_seen += tokens_per_step
                window_tokens += tokens_per_step
                window_time += time.perf_counter() - t0
                tok_s = window_tokens / max(window_time, 1e-9)
                bar.set_postfix(loss=f"{loss_val:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
                bar.update(1)
                if step % tr.log_interval == 0 or step == tr.max_steps:
                    record = {"kind": "train", "step": step, "loss": loss_val, "lr": lr, "grad_norm": norm_val,
                              "tokens": tokens_seen, "tokens_per_s": tok_s,
                              "mfu": flops_per_token * tok_s / tr.peak_flops, **dict(zip(parts, part_vals))}
                    if device.type == "cuda":
                        record["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                    run_log.log(record)
                    window_tokens, window_time = 0, 0.0
                if step % tr.eval_interval == 0 or step == tr.max_steps:
                    val_loss = validate()
                if (tr.ckpt_interval and step % tr.ckpt_interval == 0) or step == tr.max_steps:
                    checkpoint()
        if val_loss is None:  # resumed at max_steps: nothing trained, still report the loss
            val_loss = validate()
        if tr.sample_tokens > 0 and corpus.tokenizer is not None:
            from tritonllm.generate import generate_text

            text = generate_text(model, corpus.tokenizer, tr.sample_prompt, tr.sample_tokens)
            print(f"--- sample after {step} steps ---\n{tr.sample_prompt}{text}\n---", flush=True)
    finally:
        run_log.close()
    log.info("done: validation loss %.4f; run folder %s", val_loss, out_dir)
    return val_loss


@hydra.main(version_base="1.3", config_path="pkg://tritonllm.conf", config_name="train")
@exit_on_user_error
def main(cfg) -> float:
    return train(cfg)


if __name__ == "__main__":
    main()
