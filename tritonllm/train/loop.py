"""The training loop: :func:`train` takes the composed config (``conf/train.yaml`` and its groups)
and returns the final validation loss, the value sweepers minimize. ``python -m tritonllm.train``
(``__main__.py``) is a thin ``@hydra.main`` around it.

The loop, per optimizer step: the learning rate from ``conf/sched`` (warmup + cosine,
warmup-stable-decay or constant), ``trainer.grad_accum`` micro-batches of ``batch_size x seq_len``
tokens (``(x, y)``, or ``(x, y, documents)`` from packed SFT data, ``data.pack``: the model's
attention then stays inside each packed example, in training and validation), then one :class:`~tritonllm.train.step.TrainStep` call (forward, loss / grad_accum and
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
``keep_last`` of this run kept (a run id in each checkpoint: other runs' are never pruned, and a
fresh run refuses a ``ckpt_dir`` holding another run's checkpoints). ``ckpt_dir`` is created and
test-written at start, and leftovers of a killed save are removed. A non-finite validation loss
stops the run with an error instead of a checkpoint. ``trainer.resume=auto`` continues from the
newest checkpoint in ``ckpt_dir`` that verifies (checksums, finite weights; each one skipped is
logged), ``trainer.resume=latest_of_name`` also looks in the earlier runs of the same name
(``outputs/<name>/*/checkpoints``, outside multirun), ``trainer.resume=<path>`` from that
checkpoint or folder. A resume whose config differs from the checkpoint's in more than the
schedule length, logging and checkpointing keys (:data:`RESUME_FREE_KEYS`) lists the keys and
stops unless ``trainer.resume_force=true``. A resumed run restores weights, optimizer state, RNG
states and the data position, so its losses are those of the uninterrupted run (bit for bit in
fp32 on the CPU, and with the graph on a GPU); its ``metrics.jsonl`` drops the records after the
resumed step, so each step keeps one record.

Claim and stop: rank 0 holds ``ckpt_dir`` with a ``run.lock``
(:func:`~tritonllm.checkpoint.claim_ckpt_dir`) from before the data is read to the run's end,
however it ends, so a second run on the same folder is refused before it trains. SIGINT (Ctrl-C) or
SIGTERM during the loop is recorded (:class:`~tritonllm.runtime.SignalFlag`; more of them are
ignored) and acted on after the optimizer step (under torchrun at the next log step, all ranks
together): with ``trainer.checkpoint_on_signal`` a checkpoint of that step, the one the interval
would write, unless one was just written; then one line ``stopped by SIGTERM at step N: checkpoint
<path>`` and :class:`~tritonllm.runtime.Stopped` (exit status 130 / 143). ``trainer.resume=auto``
continues from there.

Studio (:mod:`tritonllm.studio.hooks`): at each log interval the loop reads ``control.json`` if it
changed (stop after a checkpoint, checkpoint now, learning-rate multiplier) and adds the GPU's NVML
figures to the ``kind: train`` record; every ``trainer.sample_interval`` steps it logs a generated
sample (``kind: sample``), and it ends ``metrics.jsonl`` with ``kind: end`` (finished, stopped, failed).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from tritonllm.checkpoint import (CONFIG_FILE, STATE_FILE, claim_ckpt_dir, list_checkpoints, load_checkpoint,
                                  load_first_valid, prepare_ckpt_dir, read_state, remove_leftovers, run_id_of, save_checkpoint,
                                  verify_checkpoint)
from tritonllm.conf.schema import check_config
from tritonllm.data import load_corpus
from tritonllm.errors import CheckpointError, ConfigError, TrainingError
from tritonllm.logging_utils import NullLogger, RunLogger, hydra_job, rewind_metrics
from tritonllm.runtime import SignalFlag, Stopped, config_dict, resolve_dtype
from tritonllm.schedule import check_schedule, lr_multiplier
from tritonllm.studio.hooks import RunHooks
from tritonllm.train.dist_checkpoint import is_sharded, load_full_into_shards, load_sharded, save_sharded
from tritonllm.train.parallel import (DistEnv, barrier, broadcast_object, init_distributed, max_over_ranks, parallelize,
                                      resolve_parallel, shutdown)
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


def _newest_first(ckpt_dir: str) -> list[str]:
    return [p for _, p in reversed(list_checkpoints(ckpt_dir))]


def resume_candidates(tr, out_dir: str) -> list[str]:
    """The checkpoints ``trainer.resume`` asks for, newest first: the run resumes from the first that
    loads (empty: start fresh). ``auto``: this run's ``ckpt_dir``; ``latest_of_name``: that, else the
    earlier run of the same name (``<out_dir>/../*/checkpoints``) whose newest checkpoint is the most
    recent; a path: that checkpoint alone, or the checkpoints of that folder."""
    if tr.resume is None:
        return []
    if tr.resume in ("auto", "latest_of_name"):
        found = _newest_first(tr.ckpt_dir)
        if not found and tr.resume == "latest_of_name":
            if hydra_job():
                raise ConfigError("trainer.resume=latest_of_name looks beside the run folder, which in a multirun "
                                  "holds the sweep's other jobs: give each job trainer.resume=<path> instead")
            runs = [c for d in glob.glob(os.path.join(os.path.dirname(os.path.abspath(out_dir)), "*", "checkpoints"))
                    if (c := _newest_first(d))]
            found = max(runs, key=lambda c: os.path.getmtime(os.path.join(c[0], STATE_FILE)), default=[])
        if not found:
            log.info("trainer.resume=%s: no checkpoint in %s, starting from scratch", tr.resume, tr.ckpt_dir)
        return found
    path = os.path.expanduser(str(tr.resume))
    if not os.path.exists(path):
        raise CheckpointError(f"trainer.resume={path!r} does not exist")
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return [path]
    found = _newest_first(path)
    if not found:
        raise CheckpointError(f"trainer.resume={path!r} holds no checkpoint (a step_* folder with state.json)")
    return found


#: config keys a resume may change: the schedule length, logging, checkpointing and where/how it runs
#: (the per-rank batch and accumulation too, as long as the tokens per step stay the same)
RESUME_FREE_KEYS = ("out_dir", "device", "logger.", "data.cache_dir", "trainer.max_steps", "trainer.resume",
                    "trainer.batch_size", "trainer.grad_accum",
                    "trainer.resume_force", "trainer.checkpoint_on_signal", "trainer.ckpt_dir", "trainer.ckpt_interval", "trainer.keep_last",
                    "trainer.log_interval", "trainer.eval_interval", "trainer.eval_batches", "trainer.progress",
                    "trainer.sample_", "trainer.gpu_telemetry", "trainer.control", "trainer.peak_flops",
                    "trainer.dist_timeout_s", "trainer.cuda_graph", "trainer.parallel", "trainer.precision",
                    "trainer.fp8_grad_dtype", "trainer.activation_checkpointing",
                    "trainer.gemm_")


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        return {k: v for key, val in node.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def config_differences(path: str, config: dict, tokens_per_step: int) -> list[str]:
    """``key: saved -> now`` for each key of the resolved run ``config`` that differs from the
    ``config.yaml`` of the checkpoint ``path`` (keys of :data:`RESUME_FREE_KEYS` excepted), and
    the global batch when ``tokens_per_step`` differs from the checkpoint's."""
    saved_tokens = read_state(path).get("tokens_per_step", tokens_per_step)
    batch = [f"tokens per step (batch_size x seq_len x grad_accum x ranks): {saved_tokens} -> {tokens_per_step}"
             ] if saved_tokens != tokens_per_step else []
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        return batch
    try:
        saved = _flat(OmegaConf.to_container(OmegaConf.load(file)))
    except Exception as e:  # a corrupt config.yaml: the checkpoint's checksums say which file
        raise CheckpointError(f"checkpoint {path} is unreadable: {CONFIG_FILE}: {e}") from None
    now = _flat(config)
    free = lambda k: any(k == f or (f.endswith((".", "_")) and k.startswith(f)) for f in RESUME_FREE_KEYS)  # noqa: E731
    return batch + [f"{k}: {saved.get(k, '<absent>')!r} -> {now.get(k, '<absent>')!r}"
                    for k in sorted(set(saved) | set(now))
                    if not free(k) and saved.get(k, "<absent>") != now.get(k, "<absent>")]


@torch.no_grad()
def evaluate(model, loader, n_batches: int, device, parallel=None) -> float:
    """Mean cross-entropy of the model over the first ``n_batches`` validation batches ``(x, y)`` or
    ``(x, y, documents)`` (with ``parallel``, each rank's share of them, averaged over the ranks)."""
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float32)
    for x, y, *documents in loader.batches(n_batches):
        kw = {"documents": documents[0].to(device)} if documents else {}
        total += model(x.to(device), y.to(device), return_losses=True, **kw)[1]["ce"]
    model.train()
    if parallel is not None:
        parallel.mean_(total)
    return total.item() / n_batches


def check_run_config(cfg):
    """The run's :class:`~tritonllm.models.ModelConfig` once the config's values are known to fit together
    (ranges and allowed values of the typed groups; the types were checked by Hydra)."""
    tr = cfg.trainer
    check_config(cfg)
    model_cfg = model_config(cfg)
    check_schedule(cfg.sched)
    if tr.seq_len > model_cfg.max_seq_len:
        raise ConfigError(f"trainer.seq_len={tr.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}")
    if tr.sample_interval and (tr.sample_interval % tr.log_interval or tr.sample_tokens < 1):
        raise ConfigError(f"trainer.sample_interval={tr.sample_interval} needs trainer.sample_tokens >= 1 and must be "
                          f"a multiple of trainer.log_interval={tr.log_interval}")
    return model_cfg


def run_folder(cfg, env: DistEnv) -> str:
    """The run folder (``out_dir``, rank 0's under torchrun: Hydra names one in every process), created."""
    try:
        out_dir = os.path.abspath(str(cfg.out_dir))
    except InterpolationResolutionError:
        raise ConfigError("out_dir is the Hydra run folder, which only exists under python -m tritonllm.train: "
                          "compose the config with out_dir=<folder> to call train(cfg) directly") from None
    if env.distributed:
        out_dir = broadcast_object(out_dir, env)
        with open_dict(cfg):
            cfg.out_dir = out_dir
    os.makedirs(out_dir, exist_ok=True)
    return out_dir


def claim_run_folder(ckpt_dir: str, out_dir: str, env: DistEnv, cleanup: contextlib.ExitStack) -> None:
    """Rank 0 creates, test-writes and claims ``ckpt_dir`` until ``cleanup`` closes; its error, if any,
    is raised on every rank."""
    error = None
    if env.main:
        try:
            prepare_ckpt_dir(ckpt_dir)
            cleanup.enter_context(claim_ckpt_dir(ckpt_dir, out_dir=out_dir))
        except CheckpointError as e:
            error = str(e)
    error = broadcast_object(error, env)
    if error:
        raise CheckpointError(error)


def load_run_data(cfg, env: DistEnv, model_cfg, out_dir: str):
    """``(corpus, tokenizer path or None)``: the corpus (rank 0 tokenizes and caches it first, the others
    then read the cache), the model's vocabulary set to the tokenizer's, and a SentencePiece model
    copied into the run folder to go with the checkpoints (data=sft reads the model folder's tokenizer.json)."""
    if not env.main:
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
    if corpus.tokenizer is not None and corpus.tokenizer.path.endswith(".model"):
        tok_path = os.path.join(out_dir, "tokenizer.model")
        if env.main:
            shutil.copyfile(corpus.tokenizer.path, tok_path)
    return corpus, tok_path


@dataclass
class Run:
    """A training run as :func:`build_run` sets it up; ``step``, ``tokens_seen``, ``guard`` and ``run_id``
    are those of the resumed checkpoint, and ``step`` and ``tokens_seen`` advance as it trains."""
    cfg: Any
    env: DistEnv
    out_dir: str
    model_cfg: Any
    corpus: Any
    tok_path: str | None
    dtype: torch.dtype
    cuda_graph: bool
    mode: str  # none | ddp | fsdp
    model: Any  # a tritonllm.models model
    parallel: Any
    optimizer: Any
    train_loader: Any
    val_loader: Any
    tokens_per_step: int  # the global batch
    guard: NonFiniteGuard
    run_id: str
    step: int = 0
    tokens_seen: int = 0
    run_log: Any = field(default_factory=NullLogger)

    @property
    def tr(self):
        return self.cfg.trainer

    @property
    def samples(self) -> bool:
        """Whether this process generates samples (rank 0, on a tokenized corpus, weights not sharded)."""
        return self.corpus.tokenizer is not None and self.env.main and self.mode != "fsdp"

    def checkpoint(self) -> str:
        """Save the checkpoint of the current step (sharded under torchrun); returns its path."""
        tr = self.tr
        state = {"data": self.train_loader.state_dict(), "model_config": self.model_cfg.to_dict(),
                 "tokens_seen": self.tokens_seen, "bad_steps": self.guard.consecutive,
                 "tokens_per_step": self.tokens_per_step}
        files = (self.optimizer, state, OmegaConf.to_yaml(self.cfg, resolve=True), self.tok_path, tr.keep_last,
                 self.run_id)
        if self.env.distributed:
            path = save_sharded(tr.ckpt_dir, self.step, self.env, self.model, *files)
        else:
            path = save_checkpoint(tr.ckpt_dir, self.step, self.model, *files)
        log.info("checkpoint %s", path)
        return path

    def validate(self) -> float:
        """The validation loss, logged; a TrainingError when it is not finite."""
        val = evaluate(self.model, self.val_loader, self.tr.eval_batches, self.env.device,
                       self.parallel if self.env.distributed else None)
        self.run_log.log({"kind": "val", "step": self.step, "val_loss": val, "tokens": self.tokens_seen})
        log.info("step %d: validation loss %.4f", self.step, val)
        if not math.isfinite(val):
            raise TrainingError(f"step {self.step}: the validation loss is {val}; stopping without a checkpoint, so "
                                f"the checkpoints in {self.tr.ckpt_dir} stay those of finite weights. Lower optim.lr, "
                                f"raise sched.warmup_steps or check the data")
        return val


def build_run(cfg, cleanup: contextlib.ExitStack) -> Run:
    """Check the config, claim the checkpoint folder (until ``cleanup`` closes), load the data, build the
    model and optimizer, and resume (``trainer.resume``)."""
    tr = cfg.trainer
    model_cfg = check_run_config(cfg)
    env = init_distributed(cfg.device, tr.dist_timeout_s)  # torchrun: this rank's GPU; else cfg.device
    dtype = resolve_dtype(tr.dtype, env.device)
    try:
        cuda_graph = resolve_cuda_graph(tr.cuda_graph, env.device)
    except ValueError as e:
        raise ConfigError(f"trainer.{e}") from None
    out_dir = run_folder(cfg, env)
    claim_run_folder(str(tr.ckpt_dir), out_dir, env, cleanup)
    corpus, tok_path = load_run_data(cfg, env, model_cfg, out_dir)

    from tritonllm.hf import init_run_model
    from tritonllm.models import build_model
    from tritonllm.nn.fp8 import apply_precision
    from tritonllm.nn.recompute import apply_activation_checkpointing

    torch.manual_seed(cfg.seed)
    mode = resolve_parallel(tr.parallel, env, model_cfg.param_count())
    # FSDP2 shards fp32 weights (the master weights) and gathers them in `dtype` for compute
    model = build_model(model_cfg, device=env.device, dtype=torch.float32 if mode == "fsdp" else dtype)
    init_run_model(model, cfg)  # Hugging Face weights (model.path), LoRA (+lora=...)
    apply_precision(model, tr.precision, tr.fp8_grad_dtype)  # fp8 linear layers (trainer.precision=fp8)
    apply_activation_checkpointing(model, tr.activation_checkpointing)
    parallel = parallelize(model, mode, env, compute_dtype=dtype, gemm_grid=tr.gemm_grid,
                           gemm_sm_margin=tr.gemm_sm_margin)
    master = cfg.optim.master_weights
    optimizer = build_optimizer(model, cfg.optim, dtype != torch.float32 if master == "auto" else bool(master))
    train_loader, val_loader = corpus.loaders(tr.batch_size, tr.seq_len, cfg.seed, model_cfg.vocab_size,
                                              env.rank, env.world_size)
    run = Run(cfg, env, out_dir, model_cfg, corpus, tok_path, dtype, cuda_graph, mode, model, parallel, optimizer,
              train_loader, val_loader, tokens_per_step=tr.batch_size * tr.seq_len * tr.grad_accum * env.world_size,
              guard=NonFiniteGuard(tr.max_bad_steps), run_id=broadcast_object(uuid.uuid4().hex[:12], env))
    log.info("model %s: %.2fM parameters (%.2fM active), %s on %s; %d tokens per step (%d rank%s x %d x %d x %d "
             "micro-batches, parallel=%s)", model_cfg.name, model.num_params() / 1e6, model.num_active_params() / 1e6,
             str(dtype).replace("torch.", ""), env.device, run.tokens_per_step, env.world_size,
             "s" if env.world_size > 1 else "", tr.batch_size, tr.seq_len, tr.grad_accum, mode)
    resume(run)
    return run


def load_for_resume(run: Run, ckpt: str, resolved: dict) -> dict:
    """Verify ``ckpt`` (on rank 0, which tells the others), compare its config with this run's
    (``resolved``), load it into the run's model and optimizer; returns its state."""
    env, tr = run.env, run.tr
    error = None
    if env.main:
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            error = str(e)
    error = broadcast_object(error, env)
    if error:
        raise CheckpointError(error)
    differences = config_differences(ckpt, resolved, run.tokens_per_step)
    if differences and not tr.resume_force:
        raise ConfigError(f"trainer.resume: this run's config differs from that of checkpoint {ckpt} in "
                          f"{len(differences)} key(s): {'; '.join(differences[:8])}; resume with the same "
                          f"settings, or add trainer.resume_force=true to resume anyway")
    if differences:
        log.warning("trainer.resume_force=true: resuming %s with %d config change(s): %s", ckpt,
                    len(differences), "; ".join(differences))
    into = dict(model_config=run.model_cfg.to_dict(), verified=True)
    if is_sharded(ckpt):
        return load_sharded(ckpt, env, run.model, run.optimizer, **into)
    if run.mode == "fsdp":  # a single-process checkpoint: every rank reads it whole and keeps its shards
        return load_full_into_shards(ckpt, env, run.model, run.optimizer, **into)
    return load_checkpoint(ckpt, run.model, run.optimizer, **into)


def resume(run: Run) -> None:
    """Continue from the first checkpoint ``trainer.resume`` names that loads (weights, optimizer, data
    position, step; the run keeps its id); refuse a ``ckpt_dir`` holding another run's checkpoints;
    remove what a killed save left."""
    tr, env = run.tr, run.env
    candidates = broadcast_object(resume_candidates(tr, run.out_dir), env)
    if candidates:
        resolved = config_dict(run.cfg)
        ckpt, state = load_first_valid(candidates, lambda path: load_for_resume(run, path, resolved))
        run.train_loader.load_state_dict(state["data"])
        run.step, run.tokens_seen, run.guard.consecutive = state["step"], state["tokens_seen"], state["bad_steps"]
        run.run_id = str(state.get("run_id", ""))
        log.info("resumed from %s at step %d", ckpt, run.step)
        if env.main:
            rewind_metrics(os.path.join(run.out_dir, "metrics.jsonl"), run.step)
    foreign = [p for _, p in list_checkpoints(tr.ckpt_dir) if run_id_of(p) not in (None, run.run_id)]
    if foreign:
        raise CheckpointError(f"trainer.ckpt_dir={tr.ckpt_dir!r} holds {len(foreign)} checkpoint(s) of another run "
                              f"({', '.join(map(os.path.basename, foreign[:3]))}): continue that run with "
                              f"trainer.resume=auto, or give this one its own trainer.ckpt_dir (nothing was changed)")
    if env.main:
        remove_leftovers(tr.ckpt_dir)


def train(cfg) -> float:
    """Train the model ``cfg`` describes; returns the final validation loss (mean cross-entropy).
    Stopped by SIGINT or SIGTERM: raises :class:`~tritonllm.runtime.Stopped` after the checkpoint."""
    with contextlib.ExitStack() as cleanup:  # the claim of trainer.ckpt_dir ends with the run, however it ends
        run = build_run(cfg, cleanup)
        return run_training(run)


def run_training(run: Run) -> float:
    """The loop of :func:`train_steps`, then the final validation and sample, with the run's log,
    Studio's hooks and the process group closed however it ends."""
    tr, env, device = run.tr, run.env, run.env.device
    # built after resuming: the optimizer's load_state_dict replaces the tensors a graph would hold
    train_step = TrainStep(run.model, run.optimizer, grad_clip=tr.grad_clip, grad_accum=tr.grad_accum,
                           cuda_graph=run.cuda_graph, parallel=run.parallel if env.distributed else None)
    if env.main:
        run.run_log = RunLogger(run.out_dir, run.cfg.name, config_dict(run.cfg), run.cfg.logger,
                                torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    studio = RunHooks(run.out_dir, run.run_log, run.model, device, telemetry=tr.gpu_telemetry, control=tr.control,
                      main=env.main, share=lambda obj: broadcast_object(obj, env))
    try:
        val_loss, stopped_by, saved = train_steps(run, train_step, studio)
        if not stopped_by:
            if val_loss is None:  # resumed at max_steps: nothing trained, still report the loss
                val_loss = run.validate()
            if tr.sample_tokens > 0 and run.samples:
                text = studio.sample(run.step, run.model, run.corpus.tokenizer, tr.sample_prompt, tr.sample_tokens)
                print(f"--- sample after {run.step} steps ---\n{tr.sample_prompt}{text}\n---", flush=True)
        studio.finish(run.step, "stopped" if run.step < tr.max_steps else "finished")
    except BaseException as e:
        studio.finish(run.step, "failed", e)
        raise
    finally:
        run.run_log.close()
    train_step.release()
    shutdown(env)
    if stopped_by:
        log.info("stopped by %s at step %d: %s", Stopped(stopped_by).name, run.step,
                 f"checkpoint {saved}" if saved else "no checkpoint (trainer.checkpoint_on_signal=false)")
        raise Stopped(stopped_by, reported=True)
    assert val_loss is not None  # validated at the last step, or after the loop
    log.info("done: validation loss %.4f; run folder %s", val_loss, run.out_dir)
    return val_loss


def train_record(run: Run, latest: dict, lr: float, tok_s: float) -> dict:
    """The ``kind: train`` record of the current step: ``latest`` (the newest metrics that reached the
    host), throughput ``tok_s`` and MFU per GPU, peak memory on CUDA."""
    record = {"kind": "train", "step": run.step, "loss": latest["loss"], "lr": lr, "grad_norm": latest["grad_norm"],
              "tokens": run.tokens_seen, "tokens_per_s": tok_s,
              "mfu": run.model.flops_per_token(run.tr.seq_len) * tok_s / (run.tr.peak_flops * run.env.world_size),
              **{k: v for k, v in latest.items() if k not in ("loss", "grad_norm", "skipped", "lr")}}
    if run.env.device.type == "cuda":
        record["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.env.device) / 1e9
    return record


def train_steps(run: Run, train_step: TrainStep, studio: RunHooks) -> tuple[float | None, int, str | None]:
    """Optimizer steps up to ``trainer.max_steps``, a Studio stop request or a stop signal; returns the
    last validation loss (None: none ran), the stop signal's number (0: none) and the checkpoint of
    the last step (None: none)."""
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    cfg, tr, env = run.cfg, run.tr, run.env
    metrics = MetricsQueue(lambda: train_step.metric_names, env.device)
    val_loss, stopped_by, saved = None, 0, None  # saved: the checkpoint of the current step
    window_tokens, window_time, t0 = 0, 0.0, time.perf_counter()
    latest: dict = {}  # metrics of the newest step whose values have reached the host
    with SignalFlag() as signals, logging_redirect_tqdm(), tqdm(
            total=tr.max_steps, initial=run.step, disable=not (tr.progress and env.main), dynamic_ncols=True,
            unit="step") as bar:
        while run.step < tr.max_steps:
            lr = float(cfg.optim.lr) * lr_multiplier(run.step, tr.max_steps, cfg.sched) * studio.lr_scale
            batches = [run.train_loader.next_batch() for _ in range(tr.grad_accum)]
            metrics.push(run.step, train_step(batches, lr), lr)
            run.step += 1
            run.tokens_seen += run.tokens_per_step
            window_tokens += run.tokens_per_step
            step = run.step
            log_now = step % tr.log_interval == 0 or step == tr.max_steps
            val_now = step % tr.eval_interval == 0 or step == tr.max_steps
            ckpt_now = bool(tr.ckpt_interval and step % tr.ckpt_interval == 0) or step == tr.max_steps
            consume(run, metrics.drain() if log_now or val_now or ckpt_now else metrics.ready(), latest)
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
                run.run_log.log({**train_record(run, latest, lr, tok_s), **studio.telemetry()})
                bar.set_postfix(loss=f"{latest['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
            if val_now:
                val_loss = run.validate()
            saved = run.checkpoint() if ckpt_now else None
            if log_now and tr.sample_interval and step % tr.sample_interval == 0 and run.samples:
                studio.sample(step, run.model, run.corpus.tokenizer, tr.sample_prompt, tr.sample_tokens)
            if "stop" in requested:
                log.info("step %d: stopped by a Studio request after a checkpoint", step)
                break
            # SIGINT / SIGTERM: every rank learns of it at the same step (at log steps under torchrun)
            stopped_by = max_over_ranks(signals.signum or 0, env) if log_now or not env.distributed else 0
            if stopped_by:
                if saved is None and tr.checkpoint_on_signal:
                    saved = run.checkpoint()
                break
            if log_now or val_now or ckpt_now:
                t0 = time.perf_counter()
    return val_loss, stopped_by, saved


def consume(run: Run, records, latest: dict) -> None:
    """Feed the metrics that reached the host to the guard (in step order) and into ``latest``."""
    for done, values, lr in records:  # `done` counts the steps before this one: it is step done + 1
        if not run.guard.observe(done + 1, values["skipped"] != 0, values["loss"], values["grad_norm"]):
            run.run_log.log({"kind": "skip", "step": done + 1, "loss": values["loss"], "grad_norm": values["grad_norm"]})
        latest.update(values, lr=lr)
