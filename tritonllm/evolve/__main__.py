"""``python -m tritonllm.evolve +model=<seed> [space=<preset>] evolve.budget=... [overrides]``: architecture
search (see :mod:`tritonllm.evolve.search`). Resume a run: the same command with ``hydra.run.dir=<its folder>``."""

import logging

from tritonllm.runtime import hydra_app


@hydra_app("evolve")
def main(cfg) -> float | None:
    from tritonllm.evolve.results import describe_warm
    from tritonllm.evolve.search import run_search

    summary = run_search(cfg)
    best = summary["best"]
    c = summary["counts"]
    log = logging.getLogger("tritonllm.evolve")
    log.info("done: %d evaluated, %d failed, %d rejected before training, %d duplicates; Pareto front of %d",
             c["ok"], c["failed"], c["rejected"], c["duplicate"], len(summary["front"]))
    if cfg.evolve.warm_start:
        log.info("warm starts: %s", describe_warm(summary["warm"]))
    if best is None:
        log.info("no candidate fits the memory cap")
        return None
    log.info("best under the cap: trial %d (%s), val_loss %.4f, %.0f tokens/s, %.2f GB; train it with "
             "python -m tritonllm.train hydra.searchpath=[file://%s] +model=best optim.lr=%.4g",
             best["trial"], best["name"], best["val_loss"], best["tokens_per_s"], best["peak_mem_gb"], cfg.out_dir,
             best["lr"])
    vs = summary["vs_seed"]
    if vs is not None:
        log.info("against the seed at the same budget: val_loss %.4f vs %.4f (%+.4f), %.0f vs %.0f tokens/s, "
                 "%.2f vs %.2f GB", vs["best"]["val_loss"], vs["seed"]["val_loss"], vs["delta"]["val_loss"],
                 vs["best"]["tokens_per_s"], vs["seed"]["tokens_per_s"], vs["best"]["peak_mem_gb"],
                 vs["seed"]["peak_mem_gb"])
    return best["val_loss"]


if __name__ == "__main__":
    main()
