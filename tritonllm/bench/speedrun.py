"""``python -m tritonllm.bench speedrun +model=void125m [hydra overrides] [--target 2.5 --bin 'train_*.bin' ...]``

Time to a target validation loss, in one process run, for three sides trained on the same token
stream from the same seed:

- ``adamw``: tritonllm, the plain architecture of the model config, ``optim=adamw``;
- ``recipe``: tritonllm with modded-nanogpt's recipe: the model config plus :data:`RECIPE`
  (QK-norm, ReLU² MLP of 3/2 the SwiGLU width, so the same parameters, logit soft-cap 15, value
  embeddings at the first and last layers, U-net skips, short/long sliding windows) and
  ``optim=muon`` (Muon for the block matrices with the Newton-Schulz quintic, AdamW for the rest);
- ``torch``: the same recipe in plain PyTorch: :class:`~tritonllm.bench.baseline_model.BaselineTransformer`
  (FlexAttention for the windows) loaded with the recipe side's initial weights, fp32 parameters
  under ``torch.autocast(bfloat16)`` and ``torch.compile`` (``--torch-mode``),
  ``clip_grad_norm_(foreach=True)``, ``torch.optim.Muon`` (or :class:`NewtonSchulzMuon` where this
  PyTorch lacks it) on the matrices Muon gets on the recipe side and ``torch.optim.AdamW(fused=True)``
  on the rest, the same learning rates, schedule and hyper-parameters.

The tritonllm sides take one optimizer step as :class:`tritonllm.train.step.TrainStep` with
``cuda_graph=True``. Compilation, autotuning and the graph capture are kept out of the clock: each
side first runs ``--warmup`` steps at learning rate 0 (the weights do not move) and one
evaluation, then zeroes its optimizer state (moments, momentum, step counts) in place, so the
measured run starts from the initial weights with fresh state.

Data: llm.c / modded-nanogpt ``.bin`` shards with ``--bin`` (``--val-bin`` for validation, else the
last ``data.val_fraction`` of the shards), else the config's data (default: the embedded corpus,
the standard-library files of tritonllm's manifest this machine holds, tokenized by tritonllm).
Training batches are drawn in the same order by every side; validation is the mean loss over the
first ``--eval-batches`` validation batches, every ``--eval-every`` steps and after the last. The
row names the data, ``corpus``: its name, files, training tokens and content sha256
(:attr:`tritonllm.data.Corpus.identity`) and ``passes``, the tokens the step budget consumes over
those of the training split (:func:`corpus_block`). A budget of more than one pass is refused
before training unless ``--allow-repeat``: on data seen again the time to a validation loss
measures memorisation, and on the embedded corpus it would depend on the machine's standard library.

Per side: ``reached`` (the validation loss got to ``--target`` or below at an evaluation),
``steps`` / ``tokens`` / ``seconds`` to the first such evaluation (null when not reached within
``--max-steps`` steps or ``--max-seconds`` seconds of training), ``train_seconds`` (the whole run's
training wall clock: steps and data loading, evaluations excluded), ``tokens_per_s`` over it,
``final_val_loss`` and the validation ``curve``. ``time_ratio_recipe_vs_adamw`` and
``speedup_vs_torch`` compare the seconds to the target. Rows go to ``docs/perf/train-<gpu>.json``
with ``"pass": "speedrun"``, rewritten after every side.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from typing import Any, Callable

import torch

from tritonllm.runtime import ArgumentParser

SIDES = ("adamw", "recipe", "torch")
#: modded-nanogpt's architecture options on a tritonllm ModelConfig (d_ff and value_embeddings are
#: set from the base model by :func:`recipe_config`)
RECIPE = dict(qk_norm=True, mlp_act="relu2", logit_softcap=15.0, unet_skips=True, window_schedule=[None, 512, 512, 512])
#: value-embedding tables of the recipe (fewer on models of fewer than 6 layers)
RECIPE_VALUE_EMBEDDINGS = 3
#: the recipe's optimizer: optim=muon with the update torch.optim.Muon implements
RECIPE_OPTIM = ["optim=muon", "optim.muon.coefficients=newton_schulz", "optim.muon.normuon=false"]
#: --torch-mode -> torch.compile mode (eager: no torch.compile, for the CPU smoke test)
TORCH_MODES = {"compile": "default", "max-autotune": "max-autotune-no-cudagraphs", "eager": None}
#: optim.muon.adjust_lr -> torch.optim.Muon's adjust_lr_fn
TORCH_ADJUST_LR = {"original": "original", "match_rms_adamw": "match_rms_adamw"}
#: validation loss to reach: on the embedded corpus (8192-piece tokenizer) void125m at B16 x T1024 on an H100
#: got there in 1100 AdamW steps (31 s), 420 recipe steps (15 s)
DEFAULT_TARGET = 2.5


def recipe_config(base):
    """The recipe's ModelConfig from the plain ``base``: :data:`RECIPE`, a ReLU² width of 3/2 the
    SwiGLU one (the same MLP parameters) and min(3, n_layers / 2) value-embedding tables."""
    return dataclasses.replace(base, **RECIPE, d_ff=base.d_ff * 3 // 2,
                               value_embeddings=min(RECIPE_VALUE_EMBEDDINGS, base.n_layers // 2))


def first_reached(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first step of ``curve`` ([(step, validation loss)], in order) whose loss is <= ``target``."""
    return next((step for step, loss in curve if loss <= target), None)


def side_row(name: str, curve: list[tuple[int, float]], elapsed: list[float], target: float, tokens_per_step: int,
             stop: str) -> dict:
    """The row of one side from its validation ``curve`` [(steps done, loss)] and the training seconds
    ``elapsed`` at each of those evaluations."""
    steps = first_reached(curve, target)
    at = {s: t for (s, _), t in zip(curve, elapsed)}
    last_step, last_loss = curve[-1] if curve else (0, math.nan)
    train_s = elapsed[-1] if elapsed else 0.0
    return {"side": name, "target": target, "reached": steps is not None, "steps": steps,
            "tokens": None if steps is None else steps * tokens_per_step,
            "seconds": None if steps is None else round(at[steps], 3),
            "final_val_loss": round(last_loss, 4), "steps_run": last_step, "stop": stop,
            "train_seconds": round(train_s, 3),
            "tokens_per_s": round(last_step * tokens_per_step / train_s) if train_s > 0 else None,
            "curve": [[s, round(v, 4)] for s, v in curve]}


def compare(rows: dict) -> dict:
    """Ratios of the seconds to the target: recipe / adamw (``time_ratio_recipe_vs_adamw``, <= 0.7 is the
    goal) and torch / recipe (``speedup_vs_torch``, >= 1.15); null where a side did not reach it."""
    def secs(name):
        return rows.get(name, {}).get("seconds")

    out = {}
    if secs("recipe") and secs("adamw"):
        out["time_ratio_recipe_vs_adamw"] = round(secs("recipe") / secs("adamw"), 3)
    if secs("recipe") and secs("torch"):
        out["speedup_vs_torch"] = round(secs("torch") / secs("recipe"), 3)
    return out


def reset_optimizer_state(optimizer) -> None:
    """Zero every state tensor of ``optimizer`` in place (moments, momentum, step counts) but the fp32
    master copies: after warm-up steps at learning rate 0 the weights and masters are the initial
    ones, and the state is as before the first step (the tensors a captured graph reads are kept)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "master":
                value.zero_()


class NewtonSchulzMuon(torch.optim.Optimizer):
    """Muon in plain PyTorch where ``torch.optim.Muon`` is missing, with its semantics: momentum
    ``B = mu B + (1 - mu) G`` (``lerp``), update ``G + mu (B - G)`` with Nesterov else ``B``,
    orthogonalised by ``ns_steps`` Newton-Schulz quintic iterations in bf16 on the normalised
    matrix (transposed when tall), decoupled weight decay, ``lr * sqrt(max(1, rows / cols))``."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float, nesterov: bool, ns_steps: int = 5,
                 eps: float = 1e-7, coefficients=(3.4445, -4.775, 2.0315)):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_steps=ns_steps, eps=eps, coefficients=coefficients))

    @staticmethod
    def orthogonalize(g: torch.Tensor, steps: int, eps: float, coefficients) -> torch.Tensor:
        a, b, c = coefficients
        x = g.bfloat16()
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            s = x @ x.T
            x = a * x + (b * s + c * s @ s) @ x
        return x.T if tall else x

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                u = self.orthogonalize(update, group["ns_steps"], group["eps"], group["coefficients"])
                lr = group["lr"] * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(u.to(p.dtype), alpha=-lr)


def torch_optimizers(model, optim_cfg) -> list:
    """The torch side's optimizers for the recipe's ``optim_cfg`` (optim=muon): Muon on the parameters
    tritonllm's Muon gets (:func:`tritonllm.optim.muon.is_muon_param`), fused AdamW on the rest
    (weight decay on matrices only); each group remembers its peak ``lr`` as ``base_lr``."""
    from tritonllm.errors import ConfigError
    from tritonllm.optim.muon import is_muon_param

    mu = optim_cfg.muon
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_muon_param(n, p)]
    rest = [p for n, p in named if not is_muon_param(n, p)]
    muon_kw: dict[str, Any] = dict(lr=float(mu.lr), weight_decay=float(mu.weight_decay), momentum=float(mu.momentum),
                   nesterov=bool(mu.nesterov), ns_steps=int(mu.ns_steps))
    if str(mu.adjust_lr) not in TORCH_ADJUST_LR:
        raise ConfigError(f"optim.muon.adjust_lr={mu.adjust_lr!r}: the torch side has {', '.join(TORCH_ADJUST_LR)}")
    muon: torch.optim.Optimizer
    if hasattr(torch.optim, "Muon"):
        muon = torch.optim.Muon(matrices, adjust_lr_fn=TORCH_ADJUST_LR[str(mu.adjust_lr)], **muon_kw)
    else:
        muon = NewtonSchulzMuon(matrices, **muon_kw)
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": float(optim_cfg.weight_decay)},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=float(optim_cfg.lr),
                             betas=tuple(optim_cfg.betas), eps=float(optim_cfg.eps),
                             fused=next(model.parameters()).is_cuda)
    optimizers = [muon, adam]
    for opt in optimizers:
        for group in opt.param_groups:
            group["base_lr"] = group["lr"]
    return optimizers


# --- the loop -------------------------------------------------------------------------------------

def run_to_target(step: Callable[[object, float], object], evaluate: Callable[[], float], batches, lr_at,
                  args, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter):
    """Train until the validation loss reaches ``args.target`` or the budget ends.

    ``step(batch, multiplier)`` runs one optimizer step at ``multiplier`` times the peak learning
    rates, ``evaluate()`` returns the validation loss, ``batches()`` the next training batch,
    ``lr_at(i)`` the schedule's multiplier of step i. Only the steps (and the batches they are given)
    are timed, between ``sync()`` calls. Returns (curve [(steps, loss)], training seconds at each
    evaluation, why it stopped: "target", "max_steps" or "max_seconds")."""
    curve, elapsed, train_s = [], [], 0.0
    done, stop = 0, "max_steps"
    while done < args.max_steps:
        n = min(args.eval_every, args.max_steps - done)
        sync()
        t0 = clock()
        for i in range(done, done + n):
            step(batches(), lr_at(i))
        sync()
        train_s += clock() - t0
        done += n
        curve.append((done, evaluate()))
        elapsed.append(train_s)
        print(f"  step {done:6d}  val {curve[-1][1]:.4f}  train {train_s:8.2f} s", flush=True)
        if curve[-1][1] <= args.target:
            stop = "target"
            break
        if train_s >= args.max_seconds:
            stop = "max_seconds"
            break
    return curve, elapsed, stop


def _sync(device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def run_tritonllm(name: str, model_cfg, cfg, corpus, args, device, dtype) -> tuple[dict, dict]:
    """One tritonllm side; returns its row and its initial weights (on the CPU)."""
    from tritonllm.models import build_model
    from tritonllm.schedule import lr_multiplier
    from tritonllm.train import TrainStep, build_optimizer, evaluate

    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, device=device, dtype=dtype)
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model, cfg.optim, master_weights=dtype != torch.float32)
    train_step = TrainStep(model, optimizer, grad_clip=cfg.trainer.grad_clip, cuda_graph=args.cuda_graph)
    B, T = cfg.trainer.batch_size, cfg.trainer.seq_len
    train, val = corpus.loaders(B, T, cfg.seed, model_cfg.vocab_size)
    peak = float(cfg.optim.lr)
    warm = train.next_batch()
    for _ in range(args.warmup):
        train_step([warm], lr=0.0)
    evaluate(model, val, args.eval_batches, device)
    reset_optimizer_state(optimizer)
    train.load_state_dict({**train.state_dict(), "epoch": 0, "index": 0})
    print(f"{name}: {model.num_params() / 1e6:.1f}M parameters, optim={cfg.optim.name}, B{B} x T{T}, "
          f"CUDA graph {train_step.graphed}", flush=True)
    curve, elapsed, stop = run_to_target(
        lambda batch, m: train_step([batch], lr=peak * m), lambda: evaluate(model, val, args.eval_batches, device),
        train.next_batch, lambda i: lr_multiplier(i, args.max_steps, cfg.sched), args, _sync(device))
    row = side_row(name, curve, elapsed, args.target, B * T, stop)
    row.update(params_m=round(model.num_params() / 1e6, 2), cuda_graph=train_step.graphed, optim=cfg.optim.name)
    del train_step, optimizer, model
    return row, weights


def run_torch(model_cfg, cfg, corpus, weights, args, device) -> dict:
    """The torch side: the recipe in plain PyTorch (module docstring)."""
    from tritonllm.bench.baseline_model import BaselineTransformer
    from tritonllm.schedule import lr_multiplier

    B, T = cfg.trainer.batch_size, cfg.trainer.seq_len
    torch._dynamo.reset()
    with torch.device(device):
        model = BaselineTransformer(model_cfg, seq_len=T)
    model.load_state_dict(weights)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizers = torch_optimizers(model, cfg.optim)
    mode = TORCH_MODES[args.torch_mode]
    compiled = model if mode is None else torch.compile(model, mode=mode, dynamic=False)
    clip = cfg.trainer.grad_clip
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    train, val = corpus.loaders(B, T, cfg.seed, model_cfg.vocab_size)

    def step(batch, multiplier):
        x, y = (t.to(device, non_blocking=True) for t in batch)
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * multiplier
        with autocast:
            loss = compiled(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, float(clip), foreach=True)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate():
        total = torch.zeros((), device=device)
        for x, y in val.batches(args.eval_batches):
            with autocast:
                total += compiled(x.to(device), y.to(device)).float()
        return total.item() / args.eval_batches

    warm = train.next_batch()
    for _ in range(args.warmup):
        step(warm, 0.0)
    evaluate()
    for opt in optimizers:
        reset_optimizer_state(opt)
    train.load_state_dict({**train.state_dict(), "epoch": 0, "index": 0})
    muon = type(optimizers[0]).__module__ + "." + type(optimizers[0]).__name__
    print(f"torch: BaselineTransformer, torch.compile {args.torch_mode}, {muon} + torch.optim.AdamW", flush=True)
    curve, elapsed, stop = run_to_target(step, evaluate, train.next_batch,
                                         lambda i: lr_multiplier(i, args.max_steps, cfg.sched), args, _sync(device))
    row = side_row("torch", curve, elapsed, args.target, B * T, stop)
    row.update(torch_mode=args.torch_mode, muon=muon)
    del compiled, optimizers, model
    torch._dynamo.reset()
    return row


def corpus_block(args, cfg, corpus) -> dict:
    """The row's ``corpus``: ``name``, ``files``, ``train_tokens`` and ``sha256`` of the corpus's
    identity and ``passes`` = ``max_steps * B * T`` / the tokens of one pass over the training
    windows (the training split less under one window). A DataError when passes > 1 and not
    ``args.allow_repeat``, saying what the budget needs and how to get it."""
    from tritonllm.data import Corpus
    from tritonllm.errors import ConfigError, DataError

    if not isinstance(corpus, Corpus):
        raise ConfigError(f"data.kind={cfg.data.kind!r}: the speedrun trains on token data, data=stdlib, text or bin")
    B, T = cfg.trainer.batch_size, cfg.trainer.seq_len
    train, _ = corpus.loaders(B, T, cfg.seed, None)
    need = args.max_steps * B * T
    passes = need / train.epoch_tokens
    identity = corpus.identity
    if passes > 1 and not args.allow_repeat:
        raise DataError(
            f"the step budget (--max-steps {args.max_steps} x B{B} x T{T}) trains on {need:,} tokens, but the "
            f"data ({corpus.description}) holds {train.epoch_tokens:,} in whole training windows: {passes:.2f} "
            f"passes, so the time to the target would measure memorisation; give it at least {need:,} training "
            f"tokens (--bin '<FineWeb .bin shards>', e.g. modded-nanogpt's fineweb_train_*.bin, or data=text "
            f"data.files='<a larger tree>/**/*.txt'), --max-steps {train.n_windows // B} or fewer, or "
            f"--allow-repeat to run anyway")
    return {**{k: identity[k] for k in ("name", "files", "train_tokens", "sha256")}, "passes": round(passes, 4)}


# --- command line ---------------------------------------------------------------------------------

def parse(argv: list[str]):
    p = ArgumentParser(prog="python -m tritonllm.bench speedrun",
                       description="Hydra overrides as for python -m tritonllm.train, plus:")
    p.add_argument("--target", type=float, default=DEFAULT_TARGET, help="validation loss to reach")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of: {', '.join(SIDES)}")
    p.add_argument("--bin", default=None, help="llm.c / modded-nanogpt training shards (glob); default: data config")
    p.add_argument("--val-bin", default=None, help="validation shards (glob); default: the end of --bin's tokens")
    p.add_argument("--max-steps", type=int, default=3000, help="step budget per side (also the schedule's length)")
    p.add_argument("--max-seconds", type=float, default=150.0, help="training-time budget per side")
    p.add_argument("--eval-every", type=int, default=25, help="steps between validations")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at lr 0 (compile, autotune, capture)")
    p.add_argument("--torch-mode", default="compile", choices=sorted(TORCH_MODES), help="torch side's torch.compile")
    p.add_argument("--cuda-graph", default="auto", help="tritonllm sides' trainer.cuda_graph: auto, true, false")
    p.add_argument("--out", default="docs/perf", help="folder for train-<gpu>.json")
    p.add_argument("--allow-repeat", action="store_true",
                   help="run even when the step budget passes over the training tokens more than once")
    args, overrides = p.parse_with_overrides(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown:
        p.error(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    for name in ("max_steps", "eval_every", "eval_batches", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_seconds <= 0:
        p.error(f"--max-seconds must be > 0, got {args.max_seconds}")
    return args, overrides


def compose(args, overrides: list[str], recipe: bool):
    """The config of a side: train.yaml composed with the overrides (B16 x T1024 unless given),
    ``data=bin`` over ``--bin`` when given, the recipe's optimizer for the recipe sides."""
    from tritonllm.bench.common import compose_bench_config

    data = []
    if args.bin:
        data = ["data=bin", f"data.files={args.bin}"] + ([f"data.val_files={args.val_bin}"] if args.val_bin else [])
    return compose_bench_config(overrides, (*data, *(RECIPE_OPTIM if recipe else ["optim=adamw"]),
                                            f"trainer.max_steps={args.max_steps}"))


def configs(args, overrides: list[str]):
    """(plain config, recipe config, plain ModelConfig, recipe ModelConfig, corpus); the models'
    vocabulary is the data's when it says (a tokenizer, ``data.vocab_size``). A DataError when the
    step budget would repeat the data (:func:`corpus_block`), before any model is built."""
    from omegaconf import open_dict

    from tritonllm.data import load_corpus
    from tritonllm.errors import ConfigError
    from tritonllm.train import model_config

    cfg, rcfg = compose(args, overrides, False), compose(args, overrides, True)
    if cfg.get("model") is None:
        raise ConfigError("no model chosen: add +model=<name> (e.g. +model=void125m)")
    corpus = load_corpus(cfg.data)
    corpus_block(args, cfg, corpus)
    for c in (cfg, rcfg):
        with open_dict(c):
            c.model.vocab_size = corpus.vocab_size or c.model.vocab_size
    return cfg, rcfg, model_config(cfg), recipe_config(model_config(rcfg)), corpus


def main(argv: list[str]) -> None:
    from tritonllm.bench.common import host_cpu_model
    from tritonllm.bench.harness import write_results
    from tritonllm.errors import TritonLLMError
    from tritonllm.train import model_config

    args, overrides = parse(argv)
    logging.basicConfig(format="%(message)s")  # tritonllm's INFO lines (the data's: files left out, a new epoch)
    logging.getLogger("tritonllm").setLevel(logging.INFO)
    model_config(compose(args, overrides, False))  # config errors first, also on a machine without a GPU
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        raise TritonLLMError("python -m tritonllm.bench speedrun needs a CUDA GPU (the arguments are valid; "
                             "tests/test_speedrun.py runs it on the CPU)")
    host = host_cpu_model()
    try:
        cfg, rcfg, plain, recipe, corpus = configs(args, overrides)
        print(f"{torch.cuda.get_device_name()}, host {host}, torch {torch.__version__}; data {corpus.description}; "
              f"target val loss {args.target}", flush=True)
        row = run_all(args, cfg, rcfg, plain, recipe, corpus, device, torch.bfloat16,
                      lambda r: write_results("train", [r], args.out, extra={"host_cpu": host}))
    except TritonLLMError as e:
        sys.exit(f"tritonllm: error: {e}")
    print(f"wrote {args.out}/train-*.json: " + ", ".join(f"{k} {v}" for k, v in row.items() if k.startswith(
        ("time_ratio", "speedup"))))


def run_all(args, cfg, rcfg, plain, recipe, corpus, device, dtype, write: Callable[[dict], object]) -> dict:
    """Every side of ``args.sides`` in turn, the row written (``write``) after each; returns the row."""
    B, T = cfg.trainer.batch_size, cfg.trainer.seq_len
    row = {"model": plain.name, "pass": "speedrun", "batch": B, "seq_len": T, "target": args.target,
           "data": corpus.description, "corpus": corpus_block(args, cfg, corpus),
           "max_steps": args.max_steps, "max_seconds": args.max_seconds,
           "eval_every": args.eval_every, "eval_batches": args.eval_batches,
           "recipe": {k: getattr(recipe, k) for k in (*RECIPE, "d_ff", "value_embeddings")},
           "recipe_optim": RECIPE_OPTIM, "sides": {}}
    weights = None
    for name in args.sides:
        if name == "adamw":
            row["sides"][name], _ = run_tritonllm(name, plain, cfg, corpus, args, device, dtype)
        elif name == "recipe":
            row["sides"][name], weights = run_tritonllm(name, recipe, rcfg, corpus, args, device, dtype)
        else:
            if weights is None:
                from tritonllm.models import build_model

                torch.manual_seed(rcfg.seed)
                weights = build_model(recipe).state_dict()
            row["sides"][name] = run_torch(recipe, rcfg, corpus, weights, args, device)
        side = row["sides"][name]
        print(f"{name}: {'reached' if side['reached'] else 'did NOT reach'} {args.target} "
              f"({side['steps']} steps, {side['tokens']} tokens, {side['seconds']} s); "
              f"{side['tokens_per_s']} tokens/s, final val {side['final_val_loss']}", flush=True)
        row.update(compare(row["sides"]))
        write(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row
