"""What a search leaves in its run folder, rebuilt from the trial records after every trial.

- ``results.json``: every trial (evaluated, failed, rejected before training, duplicate), in order;
- ``results.csv``: the same as a table, one row per trial, the model's main fields spelled out;
- ``pareto.json``: the non-dominated candidates over ``evolve.objectives``;
- ``best.json``: the scalarised choice: the lowest validation loss among the candidates whose peak
  memory is within ``evolve.memory_cap_gb`` (every candidate when the cap is null), ties broken by
  tokens/s; null while none qualifies; ``vs_seed``: the best against the seed model at the same
  budget (:func:`seed_comparison`);
- the front and the best rank only candidates trained from scratch (:func:`ranked`): all of them
  trained for the same budget, while a warm child's loss includes its parents' training;
- ``pareto.png``: validation loss against training tokens/s, colour = peak memory, the front
  joined, the seed, the best and the warm-started children marked;
- ``model/<name>.yaml``: the front's and the best's models as ``conf/model`` files
  (``python -m tritonllm.train hydra.searchpath=[file://<run folder>] +model=<name> optim.lr=<lr>``;
  the lr each was trained with is in the file's header), the best also as ``model/best.yaml``.

``tokens_per_s`` and ``peak_mem_gb`` are what the evaluator measured where the candidate ran
(``device``: the GPU's name; ``peak_mem_kind``: ``cuda_allocated`` on a GPU, ``host_rss`` on the
CPU). ``warm`` / ``warm_from``: the candidate started from that trial's weights, grown
(``evolve.warm_start``); :func:`warm_comparison` sets warm children against cold ones.
"""

from __future__ import annotations

import csv
import json
import logging
import os

from omegaconf import OmegaConf

from tritonllm.errors import MissingExtraError, import_extra

log = logging.getLogger("tritonllm.evolve")

#: direction of each objective (True: larger is better)
MAXIMIZE = {"tokens_per_s"}
COLUMNS = ("trial", "generation", "origin", "parent", "warm", "warm_from", "status", "reason", "n_layers", "d_model",
           "n_heads", "n_kv_heads", "head_dim", "d_ff", "window", "qk_norm", "n_experts", "moe_top_k", "lr", "params",
           "active_params", "val_loss", "tokens_per_s", "peak_mem_gb", "peak_mem_kind", "device", "tokens", "epochs",
           "wall_s", "pareto")


def _dominates(a: dict, b: dict, objectives) -> bool:
    """``a`` is no worse than ``b`` in every objective and better in one."""
    better = False
    for o in objectives:
        x, y = (a[o], b[o]) if o not in MAXIMIZE else (-a[o], -b[o])
        if x > y:
            return False
        better |= x < y
    return better


def ranked(records: list[dict]) -> list[dict]:
    """The records the front and the best are chosen from: evaluated (``status: ok``) and trained from
    scratch. A warm child's validation loss includes its parents' training, so it is not at the equal
    budget the ranking compares; :func:`warm_comparison` sets warm children against cold ones instead."""
    return [r for r in records if r.get("status") == "ok" and not r.get("warm")]


def pareto_front(records: list[dict], objectives) -> list[dict]:
    """The :func:`ranked` records no other ranked record dominates, in trial order."""
    ok = ranked(records)
    return [r for r in ok if not any(_dominates(o, r, objectives) for o in ok if o is not r)]


def best_under_cap(records: list[dict], cap_gb: float | None) -> dict | None:
    """Lowest ``val_loss`` among the :func:`ranked` records with ``peak_mem_gb <= cap_gb`` (ties: higher tokens/s)."""
    ok = [r for r in ranked(records) if cap_gb is None or r["peak_mem_gb"] <= cap_gb]
    return min(ok, key=lambda r: (r["val_loss"], -r["tokens_per_s"]), default=None)


def warm_comparison(records: list[dict]) -> dict:
    """Warm-started against cold children (evaluated candidates other than the seed): per group
    ``{"n", "val_loss"}`` (mean) and ``"vs_parent"``: the mean of ``val_loss`` minus the parent's
    over the children with an evaluated parent (a warm child's is the trial it grew from, a cold
    mutant's its mutation parent; an NSGA-II proposal has none), with how many that mean is over."""
    ok = {r["trial"]: r for r in records if r.get("status") == "ok"}
    seed = next((r["trial"] for r in ok.values() if r["origin"] == "seed"), None)
    out = {}
    for group, warm in (("warm", True), ("cold", False)):
        children = [r for r in ok.values() if r["origin"] != "seed" and bool(r.get("warm")) == warm]
        deltas = []
        for r in children:
            parent = r.get("warm_from") if warm else (seed if r.get("parent") == "seed" else r.get("parent"))
            if parent in ok:
                deltas.append(r["val_loss"] - ok[parent]["val_loss"])
        out[group] = {"n": len(children),
                      "val_loss": sum(r["val_loss"] for r in children) / len(children) if children else None,
                      "vs_parent": sum(deltas) / len(deltas) if deltas else None, "with_parent": len(deltas)}
    return out


def seed_comparison(records: list[dict], best: dict | None) -> dict | None:
    """The best against the seed, both trained from scratch on the same budget: their ``val_loss``,
    ``tokens_per_s`` and ``peak_mem_gb``, and the best's minus the seed's (``delta``); None until both
    were evaluated."""
    seed = next((r for r in records if r.get("origin") == "seed" and r.get("status") == "ok"), None)
    if seed is None or best is None:
        return None
    keys = ("val_loss", "tokens_per_s", "peak_mem_gb")
    return {"seed_trial": seed["trial"], "best_trial": best["trial"], "seed": {k: seed[k] for k in keys},
            "best": {k: best[k] for k in keys}, "delta": {k: best[k] - seed[k] for k in keys}}


def describe_warm(comparison: dict) -> str:
    """One line of :func:`warm_comparison`."""
    parts = []
    for group in ("warm", "cold"):
        c = comparison[group]
        if not c["n"]:
            parts.append(f"0 {group}")
            continue
        vs = f", {c['vs_parent']:+.4f} vs their parents ({c['with_parent']})" if c["vs_parent"] is not None else ""
        parts.append(f"{c['n']} {group}: mean val_loss {c['val_loss']:.4f}{vs}")
    return "; ".join(parts)


def _row(r: dict, on_front: set) -> dict:
    row = {k: r.get(k) for k in COLUMNS}
    row.update({k: v for k, v in (r.get("model") or {}).items() if k in COLUMNS})
    row["pareto"] = r.get("trial") in on_front
    return row


def model_yaml(record: dict) -> str:
    """A ``conf/model`` file for the record's model, its search results in the header."""
    from tritonllm.models.config import ModelConfig

    cfg = ModelConfig.from_dict(record["model"])
    head = (f"# {cfg.name}: found by tritonllm.evolve (trial {record['trial']}, generation {record['generation']}, "
            f"{record['origin']}); trained with optim.lr={record['lr']:.4g}\n"
            f"# val_loss {record['val_loss']:.4f} after {record.get('tokens', 0):,} tokens, "
            f"{record['tokens_per_s']:,.0f} tokens/s, peak memory {record['peak_mem_gb']:.2f} GB\n"
            f"# params: {cfg.param_count() / 1e6:.2f}M ({cfg.param_count(exclude_embedding=True) / 1e6:.2f}M "
            f"non-embedding)\n")
    return head + OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))


def plot(path: str, records: list[dict], front: list[dict], best: dict | None, cap_gb: float | None) -> None:
    """``pareto.png`` (see module docstring); a :class:`~tritonllm.errors.MissingExtraError` without
    matplotlib (the ``plot`` extra)."""
    matplotlib = import_extra("matplotlib", "plot", "the Pareto plot (pareto.png)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(7, 5))
    if ok:
        pts = ax.scatter([r["tokens_per_s"] for r in ok], [r["val_loss"] for r in ok],
                         c=[r["peak_mem_gb"] for r in ok], cmap="viridis", s=36, zorder=2)
        fig.colorbar(pts, ax=ax, label="peak memory (GB)")
        line = sorted(front, key=lambda r: r["tokens_per_s"])
        ax.plot([r["tokens_per_s"] for r in line], [r["val_loss"] for r in line], "--", color="gray", zorder=1,
                label="Pareto front (all objectives)")
        warm = [r for r in ok if r.get("warm")]
        if warm:
            ax.scatter([r["tokens_per_s"] for r in warm], [r["val_loss"] for r in warm], marker="^", s=90,
                       facecolors="none", edgecolors="tab:orange", zorder=3, label="warm start (grown parent)")
        for r in ok:
            if r["origin"] == "seed":
                ax.scatter([r["tokens_per_s"]], [r["val_loss"]], marker="s", s=110, facecolors="none",
                           edgecolors="black", zorder=3, label="seed")
        if best is not None:
            cap = f" <= {cap_gb:g} GB" if cap_gb is not None else ""
            ax.scatter([best["tokens_per_s"]], [best["val_loss"]], marker="*", s=260, color="red", zorder=4,
                       label=f"best{cap} (trial {best['trial']})")
        ax.legend(fontsize=8)
    failed = sum(r.get("status") == "failed" for r in records)
    ax.set_xlabel("training tokens/s")
    ax.set_ylabel("validation loss")
    ax.set_title(f"tritonllm.evolve: {len(ok)} evaluated, {failed} failed")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _dump(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def write_all(out_dir: str, records: list[dict], ev, seed) -> dict:
    """Write every output file; returns ``{"best", "front", "counts", "warm", "vs_seed"}`` (``warm``:
    :func:`warm_comparison`, ``vs_seed``: :func:`seed_comparison`)."""
    objectives = list(ev.objectives)
    front = pareto_front(records, objectives)
    best = best_under_cap(records, ev.memory_cap_gb)
    on_front = {r["trial"] for r in front}
    counts = {s: sum(r.get("status") == s for r in records) for s in ("ok", "failed", "rejected", "duplicate")}
    warm = warm_comparison(records)
    _dump(os.path.join(out_dir, "results.json"), records)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(_row(r, on_front) for r in records)
    _dump(os.path.join(out_dir, "pareto.json"), {"objectives": objectives, "front": front})
    vs_seed = seed_comparison(records, best)
    _dump(os.path.join(out_dir, "best.json"), {"memory_cap_gb": ev.memory_cap_gb, "seed_model": seed.name,
                                               "best": best, "vs_seed": vs_seed, "counts": counts, "warm_start": warm})
    model_dir = os.path.join(out_dir, "model")
    os.makedirs(model_dir, exist_ok=True)
    for old in os.listdir(model_dir):  # a model that left the front
        if old.endswith(".yaml"):
            os.remove(os.path.join(model_dir, old))
    for r in front + ([best] if best else []):
        with open(os.path.join(model_dir, f"{r['name']}.yaml"), "w") as f:
            f.write(model_yaml(r))
    if best is not None:
        with open(os.path.join(model_dir, "best.yaml"), "w") as f:
            f.write(model_yaml(best))
    try:
        plot(os.path.join(out_dir, "pareto.png"), records, front, best, ev.memory_cap_gb)
    except MissingExtraError as e:
        log.info("pareto.png not written: %s", e)
    return {"best": best, "front": front, "counts": counts, "warm": warm, "vs_seed": vs_seed}
