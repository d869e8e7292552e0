"""How the kernels are launched: the cached direct launch path (:class:`Launch`, the plans that hold
launches per problem, :class:`Plans`), autotuning that a test run can pin (:func:`autotune`), and the
host-built launch tables of the multi-tensor kernels (:func:`cached`, :func:`upload`).
"""

from __future__ import annotations

from collections import OrderedDict
import functools
import inspect
import logging
import os

import torch
import triton
import triton.language as tl

from ._interpreter import env_flag, interpreting

_log = logging.getLogger("tritonllm.kernels")


def autotuning() -> bool:
    """False while the environment sets ``TRITONLLM_NO_AUTOTUNE=1`` (tests/conftest.py does): kernels
    built with :func:`autotune` then run one pinned config each, unbenchmarked."""
    return os.environ.get("TRITONLLM_NO_AUTOTUNE", "0") != "1"


#: ``triton.autotune``'s on-disk cache of its choices (Triton >= 3.3): a later process on the same
#: machine runs the configs the first one chose without timing them again (about 2 s of a void125m
#: run's first step on an H100; the rest of its 40 s is compilation, which Triton's own kernel cache
#: already keeps), so the same tiles and split-K choices, the same rounding, run after run. Kept with
#: Triton's compiled kernels (``TRITON_CACHE_DIR``, default ``~/.triton/cache``),
#: keyed on the Triton version, the GPU architecture, the kernel's source, the tuning key and the
#: configs, so a changed kernel or config list tunes again. ``TRITONLLM_AUTOTUNE_CACHE=0`` (read at
#: import) turns it off, e.g. to retune after a driver change.
DISK_CACHE = ({"cache_results": True} if env_flag(os.environ.get("TRITONLLM_AUTOTUNE_CACHE", "1"))
              and "cache_results" in inspect.signature(triton.autotune).parameters else {})


class _Autotuned:
    """A ``@triton.jit`` kernel autotuned by ``triton.autotune``, or, while :func:`autotuning` is off,
    launched directly with the first of its configs that the ``early_config_prune`` hook keeps: no
    benchmarking, one compile per specialization (what a test run wants). Launch as
    ``kernel[grid](*args, **kwargs)``. ``configs`` lists the candidates; the first is the pinned one.
    """

    def __init__(self, fn, configs, key, prune_configs_by=None, **kwargs):
        if any(c.pre_hook is not None for c in configs):
            raise ValueError("configs with a pre_hook are not supported: a cached Launch cannot replay it")
        self.fn = fn
        self.autotuner = triton.autotune(configs, key=key, prune_configs_by=prune_configs_by,
                                         **{**DISK_CACHE, **kwargs})(fn)
        self.prune = (prune_configs_by or {}).get("early_config_prune")
        #: problem key -> Launch with the config chosen for it (see :meth:`launch`)
        self.plans = Plans()

    @property
    def configs(self) -> list:
        return self.autotuner.configs

    @configs.setter
    def configs(self, configs) -> None:
        self.autotuner.configs = list(configs)
        self.autotuner.cache.clear()
        self.plans.clear()

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

    def chosen_config(self, *args, **kwargs):
        """The config the last launch with these arguments ran: the autotuner's choice (its
        ``best_config``) while autotuning, else :meth:`pinned_config`."""
        return self.autotuner.best_config if autotuning() else self.pinned_config(*args, **kwargs)

    def launch(self, key, grid, *args, **kwargs) -> None:
        """``self[grid](*args, **kwargs)`` for the problem ``key``, without the autotuner after the
        first launch: that one tunes (or picks the pinned config) and keeps a :class:`Launch` with
        the chosen config and the grid resolved for it, which later launches with ``key`` call.

        ``key`` must determine every non-tensor argument, the constexprs and the grid (the shapes,
        strides and flags they come from); the Launch itself tells tensor dtypes and 16-byte
        alignment apart. ``args`` are the kernel's runtime arguments, positional, in its order.
        """
        plan = self.plans.get(key)
        if plan is not None:
            plan(*args)
            return
        self[grid](*args, **kwargs)
        config = self.chosen_config(*args, **kwargs)
        meta = {**kwargs, **config.all_kwargs()}
        self.plans.add(key, Launch(self.fn, grid(meta) if callable(grid) else grid, **meta))


#: Triton versions whose ``CompiledKernel.run`` takes ``(grid_0, grid_1, grid_2, stream, function,
#: packed_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, *every_argument)``, as
#: ``JITFunction.run`` calls it (read in the 3.6 and 3.9 sources).
DIRECT_LAUNCH_VERSIONS = ((3, 6), (3, 7), (3, 8), (3, 9))


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.lru_cache(maxsize=None)
def direct_launch() -> bool:
    """True when :class:`Launch` hands arguments straight to compiled kernels: on a GPU, with a
    Triton of ``DIRECT_LAUNCH_VERSIONS``, unless ``TRITONLLM_DIRECT_LAUNCH=0``. Otherwise every
    launch goes through Triton's JIT dispatcher (logged once). Read once per process."""
    if interpreting():
        return False
    if os.environ.get("TRITONLLM_DIRECT_LAUNCH", "1") == "0":
        _log.info("TRITONLLM_DIRECT_LAUNCH=0: kernels launch through Triton's JIT dispatcher")
        return False
    if triton_version() not in DIRECT_LAUNCH_VERSIONS:
        _log.warning("Triton %s: kernels launch through Triton's JIT dispatcher (the direct launch path "
                     "is verified on Triton %s)", triton.__version__,
                     ", ".join(f"{a}.{b}" for a, b in DIRECT_LAUNCH_VERSIONS))
        return False
    return True


@functools.lru_cache(maxsize=None)
def triton_runtime():
    """(current device, current stream, runtime knobs) accessors of the active Triton driver."""
    from triton import knobs
    from triton.runtime.driver import driver

    return driver.active.get_current_device, driver.active.get_current_stream, knobs.runtime


def _hooked(hook) -> bool:
    """True when a launch hook is installed: a non-empty ``HookChain`` (Triton 3.6+, where the knob
    is never None and the dispatcher calls the empty chain on every launch), or any other value."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launch:
    """One launch of a ``@triton.jit`` kernel with all but its runtime arguments fixed: the grid,
    the constexprs and the launch options (``num_warps``, ...). ``launch(*args)`` runs
    ``fn[grid](*args, **kwargs)``.

    Built once per problem (the launchers keep them in dicts keyed by shape, strides, dtype and
    flags), a Launch skips Triton's per-call dispatch: the first call per device and per tensor
    specialization (dtype, 16-byte alignment of each tensor argument) goes through the JIT
    dispatcher, which compiles if needed, and keeps the compiled kernel; later calls pass the
    arguments to its launcher directly (:func:`direct_launch`), with no argument binding, cache-key
    string or global-value check. Non-tensor arguments must be the same on every call except for
    floats and bools, which Triton does not specialize on (the plan's key covers the rest).
    Under the interpreter, with a launch hook installed (a profiler) or with
    ``TRITONLLM_DIRECT_LAUNCH=0``, every call uses the dispatcher.
    """

    __slots__ = ("fn", "grid", "kwargs", "tensors", "tail", "kernels")

    def __init__(self, fn, grid, **kwargs) -> None:
        self.fn = fn
        grid = tuple(grid)
        self.grid = grid + (1,) * (3 - len(grid))
        self.kwargs = kwargs
        self.tensors = None  # positions of the tensor arguments, from the first call
        self.tail = self._constexpr_tail(fn, kwargs)
        self.kernels: dict = {}

    @staticmethod
    def _constexpr_tail(fn, kwargs):
        """Values of ``fn``'s constexpr parameters, which must all follow its runtime ones (the
        arguments a compiled kernel's launcher takes after them); None when they do not, or when
        one has neither a value in ``kwargs`` nor a default: such a Launch always dispatches."""
        params = getattr(fn, "params", None)
        if params is None:
            return None
        flags = [p.is_constexpr for p in params]
        first = flags.index(True) if True in flags else len(flags)
        if not all(flags[first:]):
            return None
        tail = []
        for p in params[first:]:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return None
        return tuple(tail)

    def __call__(self, *args):
        if self.tail is None or not direct_launch():
            self.fn[self.grid](*args, **self.kwargs)
            return
        get_device, get_stream, knobs = triton_runtime()
        if _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook):  # they want launch metadata
            self.fn[self.grid](*args, **self.kwargs)
            return
        if self.tensors is None:
            self.tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        device = get_device()
        # tensors go to the launcher as addresses: it then skips a data_ptr() call and a driver
        # pointer query per tensor. A tensor off the GPU (an unchecked internal call) keys a
        # specialization that is never stored: the dispatcher's pointer check raises for it.
        flat = list(args)
        key = [device]
        for i in self.tensors:
            t = args[i]
            flat[i] = ptr = t.data_ptr()
            key.append((t.dtype, ptr % 16 == 0, t.is_cuda))
        entry = self.kernels.get(tuple(key))
        if entry is None:
            kernel = self.fn[self.grid](*args, **self.kwargs)
            self.kernels[tuple(key)] = (kernel.run, kernel.function, kernel.packed_metadata)
            return
        run, function, metadata = entry
        g0, g1, g2 = self.grid
        run(g0, g1, g2, get_stream(device), function, metadata, None, None, None, *flat, *self.tail)


class Plans(dict):
    """Launch plans per problem key, emptied when ``limit`` entries are reached, so that a workload
    of ever new shapes (generation at growing lengths) does not grow it without bound."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, plan):
        if len(self) >= self.limit and key not in self:
            self.clear()
        super().__setitem__(key, plan)

    def add(self, key, plan):
        """Store ``plan`` under ``key`` and return it."""
        self[key] = plan
        return plan


def autotune(configs, key, prune_configs_by=None, **kwargs):
    """``triton.autotune`` that honours ``TRITONLLM_NO_AUTOTUNE=1`` (see :class:`_Autotuned`);
    same arguments."""
    return lambda fn: _Autotuned(fn, configs, key, prune_configs_by, **kwargs)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (at least 1)."""
    return triton.next_power_of_2(max(int(n), 1))


#: how many launch tables :func:`cached` keeps (one per bucket and parameter set).
_CACHE_SIZE = 64

#: triton.language dtype of each floating torch dtype
TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

#: launch tables of :func:`cached`, least recently used first
_TABLES: OrderedDict = OrderedDict()

#: tables built while a CUDA graph was being captured: the graph reads them at every replay, so
#: they are never evicted (a few kB per captured parameter set)
_KEPT: dict = {}

_SIDE_STREAMS: dict = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def cached(key, build):
    """``build()``, cached under ``key`` (whose second item is the device): the host-built launch tables
    of the multi-tensor kernels (AdamW, Muon). Up to _CACHE_SIZE are kept, least recently used
    evicted, except those built during a CUDA graph capture, which the graph reads at every replay."""
    hit = _TABLES.get(key) or _KEPT.get(key)
    if hit is None:
        if _capturing(key[1]):
            hit = _KEPT[key] = build()
        else:
            hit = _TABLES[key] = build()
            if len(_TABLES) > _CACHE_SIZE:
                _TABLES.popitem(last=False)
    elif key in _TABLES:
        _TABLES.move_to_end(key)
    return hit


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` copied to ``device``. During a CUDA graph capture (which must use
    ``capture_error_mode="relaxed"``) the copy runs on a side stream outside the graph and is
    waited for, so the table is in device memory before the graph's first replay reads it."""
    if not _capturing(device):
        return host.to(device, non_blocking=True)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        out = host.to(device)
    side.synchronize()
    return out
