"""The search: Optuna's NSGA-II over the genomes of :mod:`.space`, each candidate trained in a sandbox.

``evolve.population * evolve.generations`` candidates are evaluated, one *slot* at a time (slot
``s`` belongs to generation ``s // population``):

- slot 0 is the seed model itself (``evolve.include_seed``), the reference every other is judged by;
- the rest of generation 0 are mutants of the seed (:meth:`SearchSpace.mutate`: layers inserted or
  removed, heads added or pruned, widths and the FFN scaled, ...);
- in later generations a fraction ``evolve.mutants`` of the slots are mutants of a random member of
  the current Pareto front, the others are proposed by Optuna's NSGA-II sampler (crossover and
  mutation over the population, non-dominated sorting with crowding distance); a proposal that
  :meth:`SearchSpace.repair` rejects, or that repairs to a model already evaluated, is told to
  Optuna as such and costs no training (after ``evolve.max_proposals`` of them in a row a
  front mutant takes the slot).

Warm starts (``evolve.warm_start=true``): every evaluated candidate keeps its trained weights
(``candidates/<trial>/weights.safetensors``), and a child that is a function-preserving growth of
an evaluated candidate (:mod:`.grow`: layers inserted, FFN, heads or ``d_model`` widened; nothing
else changed) starts from that candidate's weights grown to its shape instead of from scratch: a
mutant from its mutation parent, an NSGA-II proposal from the evaluated candidate with the lowest
validation loss it grows from. Its record has ``warm: true``, ``warm_from`` (that trial) and
``growth``; ``results.csv`` has the ``warm`` column and the summary compares warm and cold children
(:func:`tritonllm.evolve.results.warm_comparison`). A warm child has trained longer than its budget
(its parent's tokens and its own): its loss says what growing buys, not what the architecture
reaches from scratch, so the Pareto front (from which mutants pick their parents) and the best under
the cap rank only the candidates trained from scratch (:func:`tritonllm.evolve.results.ranked`).

Data: every record has ``epochs``, the passes its training made over the training split. Past one
pass the validation loss rewards the slowest candidates (the fewest repeats, the least memorised)
rather than the best architecture; the search warns at start (token budget) and after each such
trial. The standard-library corpus holds about 3M tokens: ``data.packages=true`` adds the
installed packages' sources.

Every candidate runs in its own process (:func:`tritonllm.evolve.sandbox.run_sandboxed`) with a
wall-clock limit; one that fails (raises, diverges, runs out of memory, crashes, times out) is
recorded with its reason, its checkpoints are removed, and the search goes on.

State: each finished trial is appended to ``trials.jsonl`` in the run folder (flushed and synced)
before the next starts. A restarted search in the same folder (``hydra.run.dir=<run folder>``)
rebuilds the Optuna study from that journal (parameters, objective values, the sampler's
generation records) and continues at the first unfinished slot: no finished candidate runs again;
one that was interrupted runs again from scratch. Raising ``evolve.generations`` on restart
extends a finished search. The search definition (seed model, space, objectives, budget, data)
is kept in ``search.json`` and must match on restart.

Outputs (rewritten after every trial, :mod:`.results`): ``results.json`` / ``results.csv`` (every
trial), ``pareto.json``, ``best.json`` (the lowest validation loss under ``evolve.memory_cap_gb``),
``pareto.png``, and ``model/<name>.yaml`` for the front and the best, loadable by
``python -m tritonllm.train hydra.searchpath=[file://<run folder>] +model=<name>``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import math
import os
import random
import re
import shutil
import warnings

from omegaconf import OmegaConf, open_dict

from tritonllm.errors import ConfigError
from tritonllm.evolve import results
from tritonllm.evolve.evaluate import WEIGHTS
from tritonllm.evolve.grow import GrowthError, growth_steps
from tritonllm.evolve.sandbox import run_sandboxed
from tritonllm.evolve.space import GENES, Candidate, Limits, SearchSpace, SpaceExhausted
from tritonllm.models.config import ModelConfig
from tritonllm.runtime import config_dict

log = logging.getLogger("tritonllm.evolve")

#: objective -> Optuna direction
OBJECTIVES = {"val_loss": "minimize", "tokens_per_s": "maximize", "peak_mem_gb": "minimize",
              "params": "minimize", "active_params": "minimize"}
JOURNAL, DEFINITION, LOCK = "trials.jsonl", "search.json", "evolve.lock"
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}


def parse_budget(budget) -> tuple[str, float]:
    """``evolve.budget`` as ``("tokens", n)`` or ``("seconds", s)``: an int or ``"500k"``, ``"20M"``,
    ``"1B"`` tokens (``M`` is millions: minutes are ``min``); ``"90s"``, ``"5min"``, ``"1h"`` of
    training time per candidate."""
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0:
        return "tokens", float(budget)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(budget))
    if m and float(m.group(1)) > 0:
        value, unit = float(m.group(1)), m.group(2).lower()
        if unit in ("", "tok", "tokens"):
            return "tokens", value
        if unit in _SUFFIX:
            return "tokens", value * _SUFFIX[unit]
        seconds = {"s": 1, "sec": 1, "min": 60, "h": 3600}.get(unit)
        if seconds:
            return "seconds", value * seconds
    raise ConfigError(f"evolve.budget={budget!r}: give tokens (100000, 500k, 20M, 1B) or training time per "
                      f"candidate (90s, 5min, 1h)")


def _check_settings(ev) -> None:
    if ev.population < 2:
        raise ConfigError(f"evolve.population must be >= 2 (NSGA-II), got {ev.population}")
    if ev.generations < 1:
        raise ConfigError(f"evolve.generations must be >= 1, got {ev.generations}")
    if not 0.0 <= ev.mutants <= 1.0:
        raise ConfigError(f"evolve.mutants must be in [0, 1], got {ev.mutants}")
    bad = [o for o in ev.objectives if o not in OBJECTIVES]
    if bad or not ev.objectives:
        raise ConfigError(f"evolve.objectives: unknown {bad}; choose from {list(OBJECTIVES)}")
    if "val_loss" not in ev.objectives:
        raise ConfigError("evolve.objectives must include val_loss (the best-under-the-cap choice ranks by it)")


class Journal:
    """Finished trials, one JSON line each, appended and synced before the next trial starts."""

    def __init__(self, path: str):
        self.path = path

    def read(self) -> list[dict]:
        """The finished trials; a last line cut short by a kill (that trial did not finish) is
        dropped from the file, so the next append starts a line of its own."""
        if not os.path.exists(self.path):
            return []
        out, good = [], []
        with open(self.path) as f:
            lines = f.readlines()
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
            if not line.endswith("\n"):
                break
            good.append(line)
        if len(good) < len(lines) or (lines and not lines[-1].endswith("\n")):
            out = out[:len(good)]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(good)
            os.replace(tmp, self.path)
        return out

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


class Search:
    """One search in ``out_dir`` (see the module docstring); :meth:`run` returns the ``best.json`` record."""

    def __init__(self, cfg, out_dir: str):
        try:
            import optuna
        except ImportError:
            raise ConfigError("python -m tritonllm.evolve needs Optuna: pip install 'tritonllm[evolve]'") from None

        from tritonllm.data import load_corpus
        from tritonllm.train.loop import model_config

        self.cfg, self.ev, self.out_dir = cfg, cfg.evolve, out_dir
        _check_settings(self.ev)
        self.budget_kind, self.budget = parse_budget(self.ev.budget)
        timeout = self.ev.sandbox.timeout_s
        if self.budget_kind == "seconds" and timeout is not None and timeout <= self.budget:
            raise ConfigError(f"evolve.sandbox.timeout_s={timeout} must exceed the time budget {self.budget:g} s "
                              f"(data loading, compilation and validation come on top)")
        if self.budget_kind == "seconds" and "control" not in cfg.trainer:
            raise ConfigError("a time budget needs the trainer's Studio control file (trainer.control)")
        seed = model_config(cfg)
        corpus = load_corpus(cfg.data)  # tokenized and cached once here: the candidates read the cache
        if corpus.vocab_size:
            seed.vocab_size = corpus.vocab_size
        self.seed = seed
        tr = cfg.trainer
        train_loader, _ = corpus.loaders(int(tr.batch_size), int(tr.seq_len), int(cfg.seed), None)
        #: tokens of one pass over the training split (None: not known in advance, e.g. SFT data)
        self.epoch_tokens = getattr(train_loader, "epoch_tokens", None)
        if self.budget_kind == "tokens" and self.epoch_tokens and self.budget > self.epoch_tokens:
            log.warning("the budget of %.4g tokens is %.1f passes over the %.4g training tokens: the validation "
                        "loss will measure memorisation as much as the architecture. Use more data "
                        "(data.packages=true data.max_bytes=null, data=text or data=bin) or a smaller budget",
                        self.budget, self.budget / self.epoch_tokens, self.epoch_tokens)
        self.limits = Limits(multiple_of=int(self.ev.multiple_of), max_params=self.ev.max_params,
                             memory_cap_gb=self.ev.memory_cap_gb, seq_len=int(tr.seq_len))
        self.space = SearchSpace(seed, float(cfg.optim.lr), config_dict(self.ev.space), self.limits)
        self.directions = [OBJECTIVES[o] for o in self.ev.objectives]
        self.total = int(self.ev.population * self.ev.generations)
        self._optuna = optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        self.sampler = optuna.samplers.NSGAIISampler(
            population_size=int(self.ev.population), seed=int(self.ev.sampler.seed),
            crossover_prob=float(self.ev.sampler.crossover_prob), mutation_prob=self.ev.sampler.mutation_prob)
        self.study = optuna.create_study(directions=self.directions, sampler=self.sampler)
        self.journal = Journal(os.path.join(out_dir, JOURNAL))

    # ------------------------------------------------------------------ state

    def definition(self) -> dict:
        """What must not change when a search is resumed."""
        ev = config_dict(self.ev)
        return {"seed_model": self.seed.to_dict(), "space": self.space.choices, "objectives": ev["objectives"],
                "budget": ev["budget"], "multiple_of": ev["multiple_of"], "max_params": ev["max_params"],
                "memory_cap_gb": ev["memory_cap_gb"], "include_seed": ev["include_seed"],
                "data": config_dict(self.cfg.data),
                "trainer": {k: self.cfg.trainer[k] for k in ("batch_size", "seq_len", "grad_accum")},
                "seed": self.cfg.seed, **({"warm_start": True} if ev["warm_start"] else {})}

    def _restore(self) -> list[dict]:
        """Check ``search.json`` and rebuild the study from the journal; the finished trials' records."""
        from optuna.distributions import CategoricalDistribution
        from optuna.trial import TrialState, create_trial

        path = os.path.join(self.out_dir, DEFINITION)
        mine = json.loads(json.dumps(self.definition()))
        if os.path.exists(path):
            with open(path) as f:
                theirs = json.load(f)
            changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            if changed:
                raise ConfigError(f"{self.out_dir} holds a search with other settings ({', '.join(changed)} "
                                  f"differ): resume it with the same ones, or start a new run folder")
        else:
            with open(path, "w") as f:
                json.dump(mine, f, indent=1)
        records = self.journal.read()
        for r in records:
            dists = {g: CategoricalDistribution(self.space.choices[g]) for g in r["optuna_params"]}
            self.study.add_trial(create_trial(
                params=r["optuna_params"], distributions=dists, values=r.get("values"), state=TrialState[r["state"]],
                user_attrs={"record": r}, system_attrs=r.get("system_attrs", {})))
        return records

    # ------------------------------------------------------------------ proposals

    def _tell(self, trial, record: dict, values=None) -> dict:
        """Finish ``trial`` in the study and the journal with ``record`` (returned completed)."""
        from optuna.trial import TrialState

        state = TrialState.COMPLETE if values is not None else TrialState.FAIL
        self.study.tell(trial, values=values, state=state)
        frozen = self.study.trials[trial.number]
        record.update(trial=trial.number, state=state.name, values=values, optuna_params=frozen.params,
                      system_attrs={k: v for k, v in frozen.system_attrs.items() if k.startswith("nsga2:")})
        self.journal.append(record)
        return record

    def _ask(self, genome: dict | None):
        """A trial with ``genome`` fixed (enqueued), or NSGA-II's proposal when None; and its genome."""
        if genome is not None:
            self.study.enqueue_trial({g: genome[g] for g in self.space.genes})
        trial = self.study.ask()
        return trial, {g: trial.suggest_categorical(g, self.space.choices[g]) for g in self.space.genes}

    def _propose(self, slot: int, records: list[dict]) -> tuple:
        """``(trial, candidate, origin, parent)`` for ``slot``; rejected and duplicate proposals are told on the way."""
        rng = random.Random(f"{self.cfg.seed}:{slot}")
        done = {r["key"]: r for r in records if r.get("key") and r["status"] in ("ok", "failed")}
        if slot == 0 and self.ev.include_seed:
            genome = {g: self.space.seed_genome[g] for g in self.space.genes}
            cand = self.space.repair(genome)
            if not isinstance(cand, Candidate):
                raise ConfigError(f"the seed model breaks a constraint of the search: {cand.reason}")
            trial, _ = self._ask(genome)
            return trial, cand, "seed", None
        generation = slot // self.ev.population
        if generation > 0 and rng.random() >= self.ev.mutants:
            for _ in range(int(self.ev.max_proposals)):
                trial, genome = self._ask(None)
                cand = self.space.repair(genome)
                base = {"slot": None, "generation": generation, "origin": "nsga2", "genome": genome}
                if not isinstance(cand, Candidate):
                    log.info("NSGA-II proposal rejected before training: %s", cand.reason)
                    records.append(self._tell(trial, {**base, "status": "rejected", "reason": cand.reason}))
                elif cand.key in done:
                    twin = done[cand.key]
                    records.append(self._tell(trial, {**base, "status": "duplicate", "key": cand.key,
                                                      "reason": f"same model and lr as trial {twin['trial']}"},
                                              twin["values"] if twin["status"] == "ok" else None))
                else:
                    return trial, cand, "nsga2", None
            log.info("%d NSGA-II proposals in a row were rejected or duplicates: a front mutant takes slot %d",
                     self.ev.max_proposals, slot)
        front = [r for r in results.pareto_front(records, self.ev.objectives)] if generation > 0 else []
        parent = rng.choice(front) if front else None
        parent_genome = parent["genome"] if parent else {g: self.space.seed_genome[g] for g in self.space.genes}
        cand = self.space.mutate(parent_genome, rng, avoid=set(done))
        trial, _ = self._ask(cand.genome)
        return trial, cand, "mutant", (parent["trial"] if parent else "seed")

    # ------------------------------------------------------------------ evaluation

    def _warm_source(self, cand: Candidate, parent, records: list[dict]) -> tuple[dict, list[str]] | None:
        """``(record, growth steps)`` of the evaluated candidate whose weights ``cand`` grows from
        (module docstring), or None: ``cand`` starts from scratch."""
        if not self.ev.warm_start:
            return None
        sources = [r for r in records if r.get("status") == "ok"
                   and os.path.exists(os.path.join(self.out_dir, r["folder"], WEIGHTS))]
        if parent is not None:
            sources = [r for r in sources if r["trial"] == parent or (parent == "seed" and r["origin"] == "seed")]
        for r in sorted(sources, key=lambda r: r["val_loss"]):
            try:
                steps = growth_steps(ModelConfig.from_dict(r["model"]), cand.model)
            except GrowthError:
                continue
            if steps:
                return r, steps
        return None

    def _payload(self, cand: Candidate, run_dir: str, name: str, warm: tuple | None) -> dict:
        cfg = OmegaConf.create(config_dict(self.cfg, resolve=False))
        tr = cfg.trainer
        with open_dict(cfg):
            del cfg["evolve"]
            cfg.model = cand.model.to_dict()
            cfg.name = name
            cfg.optim.lr = cand.lr
            cfg.out_dir = run_dir
            tokens_per_step = tr.batch_size * tr.seq_len * tr.grad_accum
            if self.budget_kind == "tokens":
                tr.max_steps = max(1, math.ceil(self.budget / tokens_per_step))
            tr.eval_interval = tr.max_steps  # validate once, at the end (or when a time budget stops it)
            tr.ckpt_interval = None
            tr.keep_last = 1
            tr.resume = None
            tr.progress = False
            tr.sample_tokens = 0
            if "sample_interval" in tr:
                tr.sample_interval = None
            if self.budget_kind == "seconds":
                tr.control = True
        source = warm[0] if warm else None
        return {"config": config_dict(cfg),
                "budget_s": self.budget if self.budget_kind == "seconds" else None,
                "gpu_memory_gb": self.ev.memory_cap_gb if self.ev.sandbox.enforce_memory_cap else None,
                "save_weights": bool(self.ev.warm_start),
                "warm_start": {"weights": os.path.join(self.out_dir, source["folder"], WEIGHTS),
                               "parent_model": source["model"], "parent_trial": source["trial"]} if source else None}

    def _evaluate(self, slot: int, trial, cand: Candidate, origin: str, parent, records: list[dict]) -> dict:
        generation = slot // self.ev.population
        folder = os.path.join(self.out_dir, "candidates", f"{trial.number:04d}")
        if os.path.exists(folder):  # left by an interrupted earlier attempt at this trial
            shutil.rmtree(folder)
        name = f"{self.seed.name}_evo{trial.number:04d}"
        m = cand.model = dataclasses.replace(cand.model, name=name)
        warm = self._warm_source(cand, parent, records)
        log.info("generation %d/%d, candidate %d/%d (trial %d, %s%s): %d layers, d_model %d, heads %d/%d x %d, "
                 "d_ff %d%s%s%s, lr %.2e, %.2fM params%s", generation + 1, self.ev.generations,
                 slot % self.ev.population + 1, self.ev.population, trial.number, origin,
                 f" of trial {parent}" if parent is not None else "", m.n_layers, m.d_model, m.n_heads,
                 m.n_kv_heads, m.head_dim, m.d_ff, f", window {m.window}" if m.window else "",
                 ", qk_norm" if m.qk_norm else "", f", {m.n_experts} experts top-{m.moe_top_k}" if m.n_experts else "",
                 cand.lr, m.param_count() / 1e6,
                 f"; warm start from trial {warm[0]['trial']} ({', '.join(warm[1])})" if warm else "")
        out = run_sandboxed(self.ev.evaluator, self._payload(cand, os.path.join(folder, "run"), name, warm), folder,
                            self.ev.sandbox.timeout_s, self.ev.sandbox.host_memory_gb)
        record = {"slot": slot, "generation": generation, "origin": origin, "parent": parent,
                  "warm": warm is not None, "warm_from": warm[0]["trial"] if warm else None,
                  "growth": warm[1] if warm else None, "genome": cand.genome,
                  "key": cand.key, "name": name, "model": m.to_dict(), "lr": cand.lr, "repairs": cand.repairs,
                  "wall_s": out.wall_s, "folder": os.path.relpath(folder, self.out_dir)}
        values = None
        metrics = out.result  # the evaluator's result: set when out.status is "ok"
        if metrics is not None:
            missing = [o for o in self.ev.objectives if not isinstance(metrics.get(o), (int, float))
                       or not math.isfinite(metrics[o])]
            if missing:
                out.status, out.reason = "failed", f"evaluator returned no finite {missing}"
            else:
                values = [float(metrics[o]) for o in self.ev.objectives]
                record.update(metrics)
                if self.epoch_tokens and metrics.get("tokens"):
                    record["epochs"] = metrics["tokens"] / self.epoch_tokens
        if values is None:
            record.update(status="failed", reason=out.reason)
            shutil.rmtree(os.path.join(folder, "run", "checkpoints"), ignore_errors=True)  # rollback
            if os.path.exists(os.path.join(folder, WEIGHTS)):
                os.remove(os.path.join(folder, WEIGHTS))
            log.warning("trial %d failed (%s); the search goes on. Log: %s", trial.number, out.reason,
                        os.path.join(folder, "log.txt"))
        else:
            record["status"] = "ok"
            if not self.ev.keep_checkpoints:
                shutil.rmtree(os.path.join(folder, "run", "checkpoints"), ignore_errors=True)
            log.info("trial %d: %s (%.0f s)", trial.number,
                     ", ".join(f"{o} {v:.4g}" for o, v in zip(self.ev.objectives, values)), out.wall_s)
            if record.get("epochs", 0) > 1:
                log.warning("trial %d trained %.1f passes over the training split: its validation loss measures "
                            "memorisation as much as the architecture (more data or a smaller evolve.budget)",
                            trial.number, record["epochs"])
        return self._tell(trial, record, values)

    def run(self) -> dict:
        """Evaluate the remaining slots; write and return the results (``best.json``'s record)."""
        records = self._restore()
        slots = {r["slot"] for r in records if r.get("slot") is not None}
        start = len(slots)
        if start:
            log.info("resuming %s: %d of %d candidates done", self.out_dir, start, self.total)
        for slot in range(start, self.total):
            try:
                trial, cand, origin, parent = self._propose(slot, records)
            except SpaceExhausted as e:
                log.warning("search ends after %d of %d candidates: %s", slot, self.total, e)
                break
            records.append(self._evaluate(slot, trial, cand, origin, parent, records))
            summary = results.write_all(self.out_dir, records, self.ev, self.seed)
            if summary["best"] is not None:
                b = summary["best"]
                log.info("best so far under the cap: trial %d, val_loss %.4f, %.0f tokens/s, %.2f GB",
                         b["trial"], b["val_loss"], b["tokens_per_s"], b["peak_mem_gb"])
        return results.write_all(self.out_dir, records, self.ev, self.seed)


def run_search(cfg) -> dict:
    """Run (or resume) the search ``cfg.evolve`` describes in ``cfg.out_dir``; returns the summary
    (``{"best": record or None, "front": [records], "counts": {...}}``)."""
    out_dir = os.path.abspath(str(cfg.out_dir))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, LOCK), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another evolve process is running in {out_dir}") from None
        return Search(cfg, out_dir).run()


__all__ = ["GENES", "OBJECTIVES", "Search", "parse_budget", "run_search"]
