"""The search space: genes, the model a genome describes, constraints, repair and mutation.

A *genome* is a dict ``{gene: value}``; every value is one of the gene's choices (``evolve.space``,
a list per gene; a gene left ``null`` is not searched and keeps the seed model's value). The seed's
own value is always one of the choices, so the seed itself is a genome of the space.

=============  ==============================================================================
gene           model field it sets
=============  ==============================================================================
n_layers       ``n_layers`` (a mutation step inserts or removes layers)
d_model        ``d_model`` (width of the residual stream)
n_heads        ``n_heads`` (a step adds or prunes query heads)
kv_ratio       ``n_kv_heads = n_heads // kv_ratio`` (GQA group size; 1 = multi-head)
head_dim       ``head_dim``
ffn_mult       ``d_ff = ffn_mult * d_model`` rounded to a multiple of ``multiple_of``; MoE
               experts get ``d_expert = d_ff * share / moe_top_k`` (rounded likewise), ``share``
               being the seed's ``d_expert * moe_top_k / d_ff`` (1 for a dense seed: the routed
               experts together as wide as the dense MLP)
window         ``window`` (sliding-window span; null = full causal)
qk_norm        ``qk_norm``
n_experts      ``n_experts`` (0 = dense MLP)
moe_top_k      ``moe_top_k``
lr             ``optim.lr`` of the candidate's run
=============  ==============================================================================

Constraints (:func:`violations`): ``n_kv_heads`` divides ``n_heads``; ``head_dim`` is one the flash
attention kernels support (``HEAD_DIMS``); ``d_model``, ``d_ff`` and ``d_expert`` are multiples
of ``multiple_of`` (the GEMMs' TMA path needs 16-byte aligned rows, 8 bf16 elements; the default
64 also fills whole 64-wide tiles); ``1 <= moe_top_k <= n_experts``; a window is shorter than the
training sequence; the parameter count is at most ``max_params``; and the weights, gradients and
AdamW state alone (a lower bound of the training memory: activations come on top) fit in
``memory_cap_gb``.

:func:`repair` turns a genome into a :class:`Candidate` or a :class:`Rejection` before any
training: choices that only clash with each other are repaired (the GQA ratio snapped to one that
divides the head count, ``moe_top_k`` clipped to the expert count, a window as long as the
sequence dropped); a candidate over a ceiling is rejected with the reason.
:func:`mutate` moves one to three genes one step along their sorted choices and repairs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass

from tritonllm.errors import ConfigError
from tritonllm.kernels.flash_attention import HEAD_DIMS
from tritonllm.models.config import ModelConfig, ModelConfigError

#: genes in a fixed order (Optuna parameter names); model field each one sets, lr aside
GENES = ("n_layers", "d_model", "n_heads", "kv_ratio", "head_dim", "ffn_mult", "window", "qk_norm", "n_experts",
         "moe_top_k", "lr")

#: bytes per parameter held for training besides activations: weights, gradient, two AdamW moments
#: (fp32: 4 + 4 + 8), and with bf16 weights 2 + 2 + 8 plus the fp32 master copy 4
STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True)
class Limits:
    """Ceilings and the tile multiple every candidate must respect."""

    multiple_of: int = 64  # d_model, d_ff and d_expert are multiples of this
    max_params: int | None = None  # total parameters (embedding included)
    memory_cap_gb: float | None = None  # training memory (GB); the parameter state alone must fit
    seq_len: int = 1024  # training sequence length (a window at least this long is no window)


@dataclass
class Candidate:
    """A genome (as drawn, each gene one of its choices), the valid model it repairs to and its learning rate."""

    genome: dict
    model: ModelConfig
    lr: float
    repairs: list[str] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> str:
        """Hash of the model (its name aside) and lr: two genomes that repair to the same run share it."""
        model = {k: v for k, v in self.model.to_dict().items() if k != "name"}
        blob = json.dumps({"model": model, "lr": self.lr}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]


class SpaceExhausted(ConfigError):
    """No valid candidate that was not evaluated already could be drawn."""


@dataclass
class Rejection:
    genome: dict
    reason: str


def _round_to(x: float, multiple: int) -> int:
    """The nearest positive multiple of ``multiple``."""
    return max(multiple, int(round(x / multiple)) * multiple)


def _sort_key(v):
    return (v is not None, v if v is not None else 0)


def seed_genome(seed: ModelConfig, lr: float) -> dict:
    """The seed model as a genome (all genes, searched or not)."""
    return {"n_layers": seed.n_layers, "d_model": seed.d_model, "n_heads": seed.n_heads,
            "kv_ratio": seed.n_heads // seed.kv_heads, "head_dim": seed.head_size,
            "ffn_mult": round(seed.d_ff / seed.d_model, 4), "window": seed.window, "qk_norm": seed.qk_norm,
            "n_experts": seed.n_experts, "moe_top_k": seed.moe_top_k, "lr": float(lr)}


class SearchSpace:
    """The choices of each searched gene around a seed model.

    ``choices``: ``{gene: list or None}`` (``evolve.space``); None (or a missing gene) fixes the
    gene at the seed's value. Each list is checked (values of the right kind, head dims the
    kernels support, widths multiples of ``limits.multiple_of``), the seed's value added, and sorted.
    """

    def __init__(self, seed: ModelConfig, lr: float, choices: dict, limits: Limits):
        unknown = sorted(set(choices) - set(GENES))
        if unknown:
            raise ConfigError(f"evolve.space: unknown gene(s) {unknown}; genes: {list(GENES)}")
        self.seed, self.limits = seed, limits
        # top_k experts together are this share of d_ff wide (the seed's; 1 for a dense seed)
        self.expert_share = seed.expert_width * seed.moe_top_k / seed.d_ff if seed.n_experts else 1.0
        self.seed_genome = seed_genome(seed, lr)
        self.choices: dict[str, list] = {}
        for gene in GENES:
            values = choices.get(gene)
            if values is None:
                continue
            if not isinstance(values, (list, tuple)) or not values:
                raise ConfigError(f"evolve.space.{gene} must be a non-empty list of choices or null, got {values!r}")
            for v in values:
                self._check_choice(gene, v)
            merged = set(values) | {self.seed_genome[gene]}
            self.choices[gene] = sorted(merged, key=_sort_key)
        if not self.choices:
            raise ConfigError("evolve.space searches no gene: give at least one a list of choices")

    def _check_choice(self, gene: str, v) -> None:
        m = self.limits.multiple_of
        positive_int = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        ok = {"n_layers": positive_int, "n_heads": positive_int, "kv_ratio": positive_int,
              "d_model": positive_int and v % m == 0,
              "head_dim": v in HEAD_DIMS and not isinstance(v, bool),
              "ffn_mult": isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
              "window": v is None or positive_int,
              "qk_norm": isinstance(v, bool),
              "n_experts": isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              "moe_top_k": positive_int,
              "lr": isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1}[gene]
        if not ok:
            need = {"d_model": f"a positive multiple of evolve.multiple_of={m}", "head_dim": f"one of {HEAD_DIMS}",
                    "ffn_mult": "a positive number", "window": "null or a positive int", "qk_norm": "true or false",
                    "n_experts": "an int >= 0", "lr": "a float in (0, 1)"}.get(gene, "a positive int")
            raise ConfigError(f"evolve.space.{gene}: choice {v!r} must be {need}")

    @property
    def genes(self) -> list[str]:
        """The searched genes, in :data:`GENES` order."""
        return [g for g in GENES if g in self.choices]

    def full(self, genome: dict) -> dict:
        """``genome`` completed with the seed's value of every gene it leaves out."""
        return {**self.seed_genome, **{g: genome[g] for g in self.genes if g in genome}}

    def random_genome(self, rng: random.Random) -> dict:
        return {g: rng.choice(self.choices[g]) for g in self.genes}

    def contains(self, genome: dict) -> bool:
        return all(genome.get(g) in self.choices[g] for g in self.genes)

    def repair(self, genome: dict) -> Candidate | Rejection:
        """The candidate ``genome`` describes, repaired where its choices clash, or why it is rejected."""
        g, lim, repairs = self.full(genome), self.limits, []
        n_heads = g["n_heads"]
        ratio = g["kv_ratio"]
        if n_heads % ratio:
            options = [r for r in self.choices.get("kv_ratio", [ratio]) if n_heads % r == 0 and r <= ratio]
            if not options:
                return Rejection(genome, f"no kv_ratio choice divides n_heads={n_heads}")
            repairs.append(f"kv_ratio {ratio} -> {options[-1]} (must divide n_heads={n_heads})")
            ratio = options[-1]
        window = g["window"]
        if window is not None and window >= lim.seq_len:
            repairs.append(f"window {window} -> null (>= seq_len {lim.seq_len}: full causal)")
            window = None
        n_experts, top_k = g["n_experts"], g["moe_top_k"]
        if n_experts and top_k > n_experts:
            repairs.append(f"moe_top_k {top_k} -> {n_experts} (at most n_experts)")
            top_k = n_experts
        if not n_experts:
            top_k = self.seed.moe_top_k  # unused by a dense model: one dense model, one key
        d_ff = _round_to(g["ffn_mult"] * g["d_model"], lim.multiple_of)
        d_expert = _round_to(d_ff * self.expert_share / top_k, lim.multiple_of) if n_experts else None
        fields = {**self.seed.to_dict(), "n_layers": g["n_layers"], "d_model": g["d_model"], "n_heads": n_heads,
                  "n_kv_heads": n_heads // ratio, "head_dim": g["head_dim"], "d_ff": d_ff, "window": window,
                  "qk_norm": g["qk_norm"], "n_experts": n_experts, "moe_top_k": top_k,
                  "d_expert": d_expert if n_experts else self.seed.d_expert}
        if not n_experts:
            fields["n_shared_experts"] = 0
        try:
            model = ModelConfig.from_dict(fields)
        except ModelConfigError as e:
            return Rejection(genome, f"invalid model: {e}")
        problems = violations(model, lim)
        if problems:
            return Rejection(genome, "; ".join(problems))
        return Candidate(dict(genome), model, float(g["lr"]), repairs)

    def mutate(self, genome: dict, rng: random.Random, avoid=frozenset(), max_genes: int = 3,
               tries: int = 50) -> Candidate:
        """A valid child of ``genome``: one to ``max_genes`` searched genes moved one step up or down
        their sorted choices (a layer inserted or removed, heads added or pruned, a width scaled, ...),
        repaired; drawn again, with longer steps as the draws go on, while the child is rejected,
        repairs to its parent's model or to one whose :attr:`Candidate.key` is in ``avoid``. Raises
        :class:`SpaceExhausted` when ``tries`` draws found none."""
        parent = self.repair(genome)
        if isinstance(parent, Candidate):
            avoid = set(avoid) | {parent.key}
        for attempt in range(tries):
            child = dict(genome)
            reach = 1 + attempt * 4 // tries  # steps of up to 4 choices once the near neighbours are used up
            for gene in rng.sample(self.genes, k=rng.randint(1, min(max_genes, len(self.genes)))):
                values = self.choices[gene]
                if len(values) < 2:
                    continue
                i = values.index(child[gene]) if child[gene] in values else 0
                j = i + rng.choice((-1, 1)) * rng.randint(1, reach)
                child[gene] = values[min(max(j if 0 <= j < len(values) else 2 * i - j, 0), len(values) - 1)]
            cand = self.repair(child)
            if isinstance(cand, Candidate) and cand.key not in avoid:
                return cand
        raise SpaceExhausted(f"no valid new mutation of {genome} in {tries} draws: widen evolve.space or raise "
                             f"the ceilings")


def violations(model: ModelConfig, limits: Limits) -> list[str]:
    """Every constraint ``model`` breaks (empty: a valid candidate)."""
    m, out = limits.multiple_of, []
    if model.n_heads % model.kv_heads:
        out.append(f"n_kv_heads={model.kv_heads} does not divide n_heads={model.n_heads}")
    if model.head_dim not in HEAD_DIMS:
        out.append(f"head_dim={model.head_dim} is not one of the attention kernels' {HEAD_DIMS}")
    for name in ("d_model", "d_ff") + (("d_expert",) if model.n_experts else ()):
        if getattr(model, name) % m:
            out.append(f"{name}={getattr(model, name)} is not a multiple of {m}")
    if model.n_experts and not 1 <= model.moe_top_k <= model.n_experts:
        out.append(f"moe_top_k={model.moe_top_k} not in [1, n_experts={model.n_experts}]")
    if model.window is not None and model.window >= limits.seq_len:
        out.append(f"window={model.window} >= seq_len={limits.seq_len}")
    params = model.param_count()
    if limits.max_params is not None and params > limits.max_params:
        out.append(f"{params / 1e6:.2f}M parameters > max_params {limits.max_params / 1e6:.2f}M")
    if limits.memory_cap_gb is not None and params * STATE_BYTES_PER_PARAM / 1e9 > limits.memory_cap_gb:
        out.append(f"parameter state {params * STATE_BYTES_PER_PARAM / 1e9:.2f} GB (weights, gradients, AdamW) "
                   f"> memory_cap_gb {limits.memory_cap_gb}")
    return out
