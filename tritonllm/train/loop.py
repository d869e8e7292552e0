"""The training loop: :func:`train` takes the composed config (``conf/train.yaml`` and its groups)
and returns the final validation loss, the value sweepers minimize. ``python -m tritonllm.train``
(``__main__.py``) is a thin ``@hydra.main`` around it.

The loop, per optimizer step: the learning rate from ``conf/sched`` (warmup + cosine,
warmup-stable-decay or constant), ``trainer.grad_accum`` micro-batches of ``batch_size x seq_len``
tokens, then one :class:`~tritonllm.train.step.TrainStep` call (forward, loss / grad_accum and
backward per micro-batch, global gradient norm clipped to ``grad_clip``, AdamW). On a GPU the
model computes in bf16 and AdamW keeps fp32 master weights, and the step is replayed from a CUDA
graph (``trainer.cuda_graph: auto``); on the CPU (Triton interpreter) everything is fp32 and eager.

No per-step host synchronisation: each step's metrics are copied to pinned host memory
(:class:`~tritonllm.train.step.MetricsQueue`) and read when their copy has landed; the loop waits
for them only at the log interval, before validation and before a checkpoint. A step whose loss or
gradient norm is not finite is skipped on the device (weights, moments and step counts untouched)
and logged as ``kind: skip`` when the host learns of it; after ``trainer.max_bad_steps`` such steps
in a row training stops with an error.

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
are those of the uninterrupted run (bit for bit in fp32 on the CPU, and with the graph on a GPU).

Studio (:mod:`tritonllm.studio.hooks`): at each log interval the loop reads ``control.json`` if it
changed (stop after a checkpoint, checkpoint now, learning-rate multiplier) and adds the GPU's NVML
figures to the ``kind: train`` record; every ``trainer.sample_interval`` steps it logs a generated
sample (``kind: sample``), and it ends ``metrics.jsonl`` with ``kind: end`` (finished, stopped, failed).
"""

from __future__ import annotations

import glob
import logging
import math
import os
import shutil
import time

import torch
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from tritonllm.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from tritonllm.data import load_corpus
from tritonllm.errors import CheckpointError, ConfigError, TrainingError
from tritonllm.logging_utils import NullLogger, RunLogger, hydra_job
from tritonllm.runtime import resolve_dtype
from tritonllm.schedule import check_schedule, lr_multiplier
from tritonllm.studio.hooks import RunHooks
from tritonllm.train.dist_checkpoint import is_sharded, load_sharded, save_sharded
from tritonllm.train.parallel import barrier, broadcast_object, init_distributed, parallelize, resolve_parallel, shutdown
from tritonllm.train.step import MetricsQueue, TrainStep, resolve_cuda_graph

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
        if cfg.model.get("path") is not None:  # +model=hf model.path=<Hugging Face folder>
            from tritonllm.hf import run_model_config

            return run_model_config(cfg.model)
        return ModelConfig.from_dict(cfg.model)
    except (TypeError, ValueError, ConfigError) as e:
        raise ConfigError(f"model config ({cfg.model.get('name')}): {e}") from None


class NonFiniteGuard:
    """Counts the steps skipped for a non-finite loss or gradient norm.

    ``observe`` takes the device's decision (a skipped step) and returns whether the step updated
    the weights; ``check`` makes that decision from the values (both finite: not skipped). After
    ``max_consecutive`` skipped steps in a row it raises a TrainingError (the run has diverged or
    the data is broken).
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        return self.observe(step, not (math.isfinite(loss) and math.isfinite(grad_norm)), loss, grad_norm)

    def observe(self, step: int, skipped: bool, loss: float, grad_norm: float) -> bool:
        if not skipped:
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
    """tritonllm's AdamW; weight decay on matrices only (norm weights, biases and vectors get none).
    ``optim=muon`` (``optim_cfg.name``): Muon for the block matrices, AdamW for the rest
    (:func:`tritonllm.optim.muon.build_muon_adamw`)."""
    from tritonllm.optim import AdamW

    if optim_cfg.get("name", "adamw") == "muon":
        from tritonllm.optim.muon import build_muon_adamw

        return build_muon_adamw(model, optim_cfg, master_weights)

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


@torch.no_grad()
def evaluate(model, loader, n_batches: int, device, parallel=None) -> float:
    """Mean cross-entropy of the model over the first ``n_batches`` validation batches (with
    ``parallel``, each rank's share of them, averaged over the ranks)."""
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float32)
    for x, y in loader.batches(n_batches):
        model(x.to(device), y.to(device))
        total += model.last_losses["ce"]
    model.train()
    if parallel is not None:
        parallel.mean_(total)
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
    if tr.sample_interval and (tr.sample_interval % tr.log_interval or tr.sample_tokens < 1):
        raise ConfigError(f"trainer.sample_interval={tr.sample_interval} needs trainer.sample_tokens >= 1 and must be "
                          f"a multiple of trainer.log_interval={tr.log_interval}")
    env = init_distributed(cfg.device, tr.dist_timeout_s)  # torchrun: this rank's GPU; else cfg.device
    device = env.device
    dtype = resolve_dtype(tr.dtype, device)
    try:
        cuda_graph = resolve_cuda_graph(tr.cuda_graph, device)
    except ValueError as e:
        raise ConfigError(f"trainer.{e}") from None
    try:
        out_dir = os.path.abspath(str(cfg.out_dir))
    except InterpolationResolutionError:
        raise ConfigError("out_dir is the Hydra run folder, which only exists under python -m tritonllm.train: "
                          "compose the config with out_dir=<folder> to call train(cfg) directly") from None
    if env.distributed:  # Hydra names a run folder in every process: rank 0's is the run's
        out_dir = broadcast_object(out_dir, env)
        with open_dict(cfg):
            cfg.out_dir = out_dir
    os.makedirs(out_dir, exist_ok=True)

    if not env.main:  # rank 0 tokenizes and caches the corpus first, the others then read the cache
        barrier(env)
    corpus = load_corpus(cfg.data)
    if env.main:
        barrier(env)
    log.info("data: %s", corpus.description)
    if corpus.vocab_size and corpus.vocab_size != model_cfg.vocab_size:
        log.info("model.vocab_size %d -> %d (the tokenizer's)", model_cfg.vocab_size, corpus.vocab_size)
        model_cfg.vocab_size = corpus.vocab_size
    with open_dict(cfg):
        cfg.model.vocab_size = model_cfg.vocab_size
    tok_path = None
    # a SentencePiece model goes with the checkpoints (data=sft reads the model folder's tokenizer.json)
    if corpus.tokenizer is not None and corpus.tokenizer.path.endswith(".model"):
        tok_path = os.path.join(out_dir, "tokenizer.model")
        if env.main:
            shutil.copyfile(corpus.tokenizer.path, tok_path)

    from tritonllm.hf import init_run_model
    from tritonllm.models import build_model

    torch.manual_seed(cfg.seed)
    mode = resolve_parallel(tr.parallel, env, model_cfg.param_count())
    # FSDP2 shards fp32 weights (the master weights) and gathers them in `dtype` for compute
    model = build_model(model_cfg, device=device, dtype=torch.float32 if mode == "fsdp" else dtype)
    init_run_model(model, cfg)  # Hugging Face weights (model.path), LoRA (+lora=...)
    parallel = parallelize(model, mode, env, compute_dtype=dtype)
    master = cfg.optim.master_weights
    optimizer = build_optimizer(model, cfg.optim, dtype != torch.float32 if master == "auto" else bool(master))
    train_loader, val_loader = corpus.loaders(tr.batch_size, tr.seq_len, cfg.seed, model_cfg.vocab_size,
                                              env.rank, env.world_size)
    tokens_per_step = tr.batch_size * tr.seq_len * tr.grad_accum * env.world_size  # the global batch
    flops_per_token = model.flops_per_token(tr.seq_len)
    log.info("model %s: %.2fM parameters (%.2fM active), %s on %s; %d tokens per step (%d rank%s x %d x %d x %d "
             "micro-batches, parallel=%s)", model_cfg.name, model.num_params() / 1e6, model.num_active_params() / 1e6,
             str(dtype).replace("torch.", ""), device, tokens_per_step, env.world_size,
             "s" if env.world_size > 1 else "", tr.batch_size, tr.seq_len, tr.grad_accum, mode)

    step, tokens_seen = 0, 0
    guard = NonFiniteGuard(tr.max_bad_steps)
    ckpt = broadcast_object(resume_path(tr, out_dir), env)
    if ckpt is not None:
        if is_sharded(ckpt):
            state = load_sharded(ckpt, env, model, optimizer, model_config=model_cfg.to_dict())
        elif mode == "fsdp":
            raise CheckpointError(f"checkpoint {ckpt} was written by a single-process run: resume it with "
                                  f"trainer.parallel=ddp (or none), whose checkpoints FSDP2 runs can load")
        else:
            state = load_checkpoint(ckpt, model, optimizer, model_config=model_cfg.to_dict())
        train_loader.load_state_dict(state["data"])
        step, tokens_seen, guard.consecutive = state["step"], state["tokens_seen"], state["bad_steps"]
        log.info("resumed from %s at step %d", ckpt, step)
    # built after resuming: the optimizer's load_state_dict replaces the tensors a graph would hold
    train_step = TrainStep(model, optimizer, grad_clip=tr.grad_clip, grad_accum=tr.grad_accum, cuda_graph=cuda_graph,
                           parallel=parallel if env.distributed else None)
    metrics = MetricsQueue(lambda: train_step.metric_names, device)

    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    run_log = RunLogger(out_dir, cfg.name, OmegaConf.to_container(cfg, resolve=True), cfg.logger,
                        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu") if env.main else NullLogger()
    studio = RunHooks(out_dir, run_log, model, device, telemetry=tr.gpu_telemetry, control=tr.control, main=env.main,
                      share=lambda obj: broadcast_object(obj, env))

    def checkpoint():
        state = {"data": train_loader.state_dict(), "model_config": model_cfg.to_dict(), "tokens_seen": tokens_seen,
                 "bad_steps": guard.consecutive}
        if env.distributed:
            path = save_sharded(tr.ckpt_dir, step, env, model, optimizer, state, config_yaml, tok_path, tr.keep_last)
        else:
            path = save_checkpoint(tr.ckpt_dir, step, model, optimizer, state, config_yaml, tok_path, tr.keep_last)
        log.info("checkpoint %s", path)

    def validate() -> float:
        val = evaluate(model, val_loader, tr.eval_batches, device, parallel if env.distributed else None)
        run_log.log({"kind": "val", "step": step, "val_loss": val, "tokens": tokens_seen})
        log.info("step %d: validation loss %.4f", step, val)
        return val

    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    val_loss = None
    window_tokens, window_time, t0 = 0, 0.0, time.perf_counter()
    latest: dict = {}  # metrics of the newest step whose values have reached the host

    def consume(records) -> None:
        """Feed the metrics that reached the host to the guard (in step order) and the progress bar."""
        for done, values, lr in records:
            if not guard.observe(done, values["skipped"] != 0, values["loss"], values["grad_norm"]):
                run_log.log({"kind": "skip", "step": done, "loss": values["loss"], "grad_norm": values["grad_norm"]})
            latest.update(values, lr=lr)

    try:
        with logging_redirect_tqdm(), tqdm(total=tr.max_steps, initial=step, disable=not (tr.progress and env.main),
                                           dynamic_ncols=True, unit="step") as bar:
            while step < tr.max_steps:
                lr = float(cfg.optim.lr) * lr_multiplier(step, tr.max_steps, cfg.sched) * studio.lr_scale
                batches = [train_loader.next_batch() for _ in range(tr.grad_accum)]
                metrics.push(step, train_step(batches, lr), lr)
                step += 1
                tokens_seen += tokens_per_step
                window_tokens += tokens_per_step
                log_now = step % tr.log_interval == 0 or step == tr.max_steps
                val_now = step % tr.eval_interval == 0 or step == tr.max_steps
                ckpt_now = bool(tr.ckpt_interval and step % tr.ckpt_interval == 0) or step == tr.max_steps
                consume(metrics.drain() if log_now or val_now or ckpt_now else metrics.ready())
                requested = studio.poll(step) if log_now else set()  # Studio: stop / checkpoint now / lr
                ckpt_now = ckpt_now or bool(requested)
                if latest:
                    bar.set_postfix(loss=f"{latest['loss']:.4f}", lr=f"{latest['lr']:.2e}", refresh=False)
                bar.update(1)
                if log_now or val_now or ckpt_now:
                    window_time += time.perf_counter() - t0
                if log_now:
                    tok_s = window_tokens / max(window_time, 1e-9)
                    window_tokens, window_time = 0, 0.0
                    record = {"kind": "train", "step": step, "loss": latest["loss"], "lr": lr,
                              "grad_norm": latest["grad_norm"], "tokens": tokens_seen, "tokens_per_s": tok_s,
                              "mfu": flops_per_token * tok_s / (tr.peak_flops * env.world_size),  # per GPU
                              **{k: v for k, v in latest.items() if k not in ("loss", "grad_norm", "skipped", "lr")}}
                    if device.type == "cuda":
                        record["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                    run_log.log({**record, **studio.telemetry()})
                    bar.set_postfix(loss=f"{latest['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
                if val_now:
                    val_loss = validate()
                if ckpt_now:
                    checkpoint()
                if (log_now and tr.sample_interval and step % tr.sample_interval == 0 and corpus.tokenizer is not None
                        and env.main and mode != "fsdp"):
                    studio.sample(step, model, corpus.tokenizer, tr.sample_prompt, tr.sample_tokens)
                if "stop" in requested:
                    log.info("step %d: stopped by a Studio request after a checkpoint", step)
                    break
                if log_now or val_now or ckpt_now:
                    t0 = time.perf_counter()
        if val_loss is None:  # resumed at max_steps: nothing trained, still report the loss
            val_loss = validate()
        if tr.sample_tokens > 0 and corpus.tokenizer is not None and env.main and mode != "fsdp":
            text = studio.sample(step, model, corpus.tokenizer, tr.sample_prompt, tr.sample_tokens)
            print(f"--- sample after {step} steps ---\n{tr.sample_prompt}{text}\n---", flush=True)
        studio.finish(step, "stopped" if step < tr.max_steps else "finished")
    except BaseException as e:
        studio.finish(step, "failed", e)
        raise
    finally:
        run_log.close()
    log.info("done: validation loss %.4f; run folder %s", val_loss, out_dir)
    shutdown(env)
    return val_loss

