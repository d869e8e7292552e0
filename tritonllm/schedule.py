"""Learning-rate schedules (``conf/sched/*.yaml``): the multiplier of ``optim.lr`` at each step.

All start with a linear warmup over ``warmup_steps`` (step 0 gets ``1 / warmup_steps``), then

- ``cosine``:   ``m + (1 - m) * (1 + cos(pi * p)) / 2`` with ``p`` the progress after warmup in
  [0, 1] and ``m = min_lr_ratio``;
- ``wsd``:      1 until the last ``decay_fraction`` of the steps, then down to ``m`` following
  ``decay_shape`` (``linear``: 1 - p, ``sqrt``: 1 - sqrt(p), ``cosine``: (1 + cos(pi p)) / 2);
- ``constant``: 1.
"""

from __future__ import annotations

import math

from tritonllm.errors import ConfigError

SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def check_schedule(sched) -> None:
    """A ConfigError naming the key when ``sched`` (the ``sched`` config group) is invalid."""
    if sched.name not in SCHEDULES:
        raise ConfigError(f"sched.name={sched.name!r} is not one of {', '.join(SCHEDULES)}")
    if sched.name == "wsd" and sched.decay_shape not in DECAY_SHAPES:
        raise ConfigError(f"sched.decay_shape={sched.decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}")
    if sched.warmup_steps < 0:
        raise ConfigError(f"sched.warmup_steps must be >= 0, got {sched.warmup_steps}")


def lr_multiplier(step: int, max_steps: int, sched) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based) of ``max_steps``."""
    warmup = int(sched.warmup_steps)
    if step < warmup:
        return (step + 1) / warmup
    if sched.name == "constant":
        return 1.0
    m = float(sched.min_lr_ratio)
    if sched.name == "cosine":
        p = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return m + (1.0 - m) * DECAY_SHAPES["cosine"](p)
    decay_steps = max(1, int(round(float(sched.decay_fraction) * max_steps)))
    decay_start = max(warmup, max_steps - decay_steps)
    if step < decay_start:
        return 1.0
    p = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return m + (1.0 - m) * DECAY_SHAPES[sched.decay_shape](p)
