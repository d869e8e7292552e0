#!/usr/bin/env bash
# Hyperparameter sweeps with Hydra multirun: every job trains in its own folder
# (multirun/<model>/<time>/<job number>/) and, with logger=wandb, is its own W&B run grouped by the sweep.
set -euo pipefail
MODEL=${MODEL:-void_tiny}
# the interpreter of the environment `make install` built, unless PY names another one
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}

# 1. Grid: 3 learning rates x 2 schedules = 6 jobs, one after the other.
"$PY" -m tritonllm.train -m +model="$MODEL" experiment=cpu_smoke \
    optim.lr=1e-3,3e-3,1e-2 sched=cosine,wsd

# 2. Optuna (TPE) search over optim.lr and optim.weight_decay (conf/hparams_search/optuna.yaml):
#    train() returns the final validation loss, which the sweeper minimizes.
"$PY" -m tritonllm.train +model="$MODEL" experiment=cpu_smoke hparams_search=optuna \
    hydra.sweeper.n_trials=6

# 3. The same grid logged to Weights & Biases (offline; `wandb sync multirun/...` uploads later):
# "$PY" -m tritonllm.train -m +model="$MODEL" experiment=cpu_smoke logger=wandb optim.lr=1e-3,3e-3
