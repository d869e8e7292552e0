"""Shared helpers of the kernel modules: input checks, interpreter detection, launch sizes.

Nothing here launches a kernel; every check raises a ValueError or TypeError whose message
names the offending argument, so a user sees which input is wrong rather than a failure deep
inside a kernel.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

#: dtypes every kernel accepts for activations and weights.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: dtypes accepted for index tensors (token ids, targets).
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotuning() -> bool:
    """False while the environment sets ``TRITONLLM_NO_AUTOTUNE=1`` (tests/conftest.py does): kernels
    built with :func:`autotune` then run one pinned config each, unbenchmarked."""
    return os.environ.get("TRITONLLM_NO_AUTOTUNE", "0") != "1"


class _Autotuned:
    """A ``@triton.jit`` kernel autotuned by ``triton.autotune``, or, while :func:`autotuning` is off,
    launched directly with the first of its configs that the ``early_config_prune`` hook keeps: no
    benchmarking, one compile per specialization (what a test run wants). Launch as
    ``kernel[grid](*args, **kwargs)``. ``configs`` lists the candidates; the first is the pinned one.
    """

    def __init__(self, fn, configs, key, prune_configs_by=None, **kwargs):
        self.fn = fn
        self.autotuner = triton.autotune(configs, key=key, prune_configs_by=prune_configs_by, **kwargs)(fn)
        self.prune = (prune_configs_by or {}).get("early_config_prune")

    @property
    def configs(self) -> list:
        return self.autotuner.configs

    @configs.setter
    def configs(self, configs) -> None:
        self.autotuner.configs = list(configs)
        self.autotuner.cache.clear()

    def pinned_config(self, *args, **kwargs):
        """The config a launch with these arguments runs while autotuning is off."""
        configs = self.configs
        if self.prune is not None:
            configs = self.prune(configs, dict(zip(self.fn.arg_names, args)), **kwargs)
        return configs[0]

    def __getitem__(self, grid):
        if autotuning():
            return self.autotuner[grid]

        def launch(*args, **kwargs):
            config = self.pinned_config(*args, **kwargs)
            if config.pre_hook is not None:
                config.pre_hook({**dict(zip(self.fn.arg_names, args)), **kwargs, **config.all_kwargs()})
            return self.fn[grid](*args, **kwargs, **config.all_kwargs())
        return launch


def autotune(configs, key, prune_configs_by=None, **kwargs):
    """``triton.autotune`` that honours ``TRITONLLM_NO_AUTOTUNE=1`` (see :class:`_Autotuned`);
    same arguments."""
    return lambda fn: _Autotuned(fn, configs, key, prune_configs_by, **kwargs)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES, ndim=None, min_ndim=None) -> None:
    """Check that ``t`` is a tensor on a device the kernels can use, with an allowed dtype.

    A CUDA tensor is always accepted; a CPU tensor only under the interpreter.
    ``ndim`` fixes the rank, ``min_ndim`` bounds it from below.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{name} must be a CUDA tensor (CPU tensors only run with TRITON_INTERPRET=1), "
            f"got a tensor on {t.device}"
        )
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise a ValueError naming the tensors when they are not all on one device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on the same device: {listed}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Raise a TypeError naming the tensors when their dtypes differ."""
    dtypes = {name: t.dtype for name, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n} is {str(d).replace('torch.', '')}" for n, d in dtypes.items())
        raise TypeError(f"tensors must share one dtype: {listed}")


def rows_view(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, n]`` view whose last dimension is contiguous.

    Copies only when the last dimension is strided or the leading dimensions cannot be
    folded into one row stride (the kernels take the row stride as an argument).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, n)
    except RuntimeError:
        return x.reshape(-1, n).contiguous()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None = None) -> int:
    """Number of streaming multiprocessors of the current CUDA device (4 under the interpreter)."""
    if interpreting() or not torch.cuda.is_available():
        return 4
    idx = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_properties(idx).multi_processor_count


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (at least 1)."""
    return triton.next_power_of_2(max(int(n), 1))
