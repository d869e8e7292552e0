"""Architecture search: ``python -m tritonllm.evolve +model=<seed> evolve.budget=<tokens or time>``.

Mutates a seed model (layers, width, heads and the GQA ratio, head dim, FFN width, window, QK-norm,
MoE experts and top-k, learning rate), trains each candidate for a fixed token or time budget in
its own process, and keeps the Pareto front over validation loss, tokens/s and peak memory with
Optuna's NSGA-II sampler; the best model under a memory cap is written as a ``conf/model`` file.

- :mod:`.space`: genes, constraints, repair and mutation;
- :mod:`.sandbox`: one evaluation in a child process with time and memory limits;
- :mod:`.evaluate`: the default evaluator (``tritonllm.train.train`` with the budget);
- :mod:`.search`: the NSGA-II search, its journal and resume;
- :mod:`.results`: Pareto front, best under the cap, JSON/CSV/PNG/YAML outputs.

This package imports nothing heavy at import time: the sandbox's child process starts through it.
"""

_LAZY = {"run_search": "search", "parse_budget": "search", "Search": "search", "SearchSpace": "space",
         "Limits": "space", "Candidate": "space", "Rejection": "space", "violations": "space",
         "run_sandboxed": "sandbox", "pareto_front": "results", "best_under_cap": "results"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
