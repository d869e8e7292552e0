"""The cached launch path of ``kernels.launch``: :class:`Launch` (direct launch of compiled kernels),
:class:`Plans` and ``_Autotuned.launch`` (per-problem plans without the autotuner).

The direct path needs compiled kernels, which the interpreter does not make: it is driven here by a
stand-in for a ``@triton.jit`` function that records what it is asked to do, and on the GPU by every
kernel test (the launchers all go through Launch).
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
import triton
import triton.language as tl

from _checks import DEVICE, assert_close, randn
from tritonllm.kernels import checks, scratch
from tritonllm.kernels import launch as launching


class _Param:
    def __init__(self, name, constexpr, default=None, has_default=False):
        self.name, self.is_constexpr, self.default, self.has_default = name, constexpr, default, has_default


class _Compiled:
    """A compiled kernel's launch interface: ``run`` records its arguments."""

    def __init__(self):
        self.function, self.packed_metadata, self.calls = object(), object(), []

    def run(self, *args):
        self.calls.append(args)


class _FakeJit:
    """Stands for a JITFunction: ``fn[grid](*args, **kwargs)`` records the dispatch and returns the
    compiled kernel of this specialization (one per dtype tuple and alignment, like Triton's cache)."""

    def __init__(self, params):
        self.params, self.dispatches, self.compiled = params, [], {}

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.dispatches.append((grid, args, kwargs))
            spec = tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args if isinstance(a, torch.Tensor))
            return self.compiled.setdefault(spec, _Compiled())
        return dispatch


@pytest.fixture
def direct(monkeypatch):
    """Direct launches on: device 0, stream 77, no launch hooks (the runtime knobs as a namespace)."""
    knobs = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(launching, "direct_launch", lambda: True)
    monkeypatch.setattr(launching, "triton_runtime", lambda: (lambda: 0, lambda device: 77, knobs))
    return knobs


def _kernel():
    return _FakeJit([_Param("X", False), _Param("n", False), _Param("eps", False), _Param("BLOCK", True),
                     _Param("FLAG", True, default=True, has_default=True)])


def test_launch_dispatches_once_then_calls_the_compiled_kernel(direct):
    fn = _kernel()
    launch = launching.Launch(fn, (3,), BLOCK=64, num_warps=4)
    x = torch.randn(32)
    launch(x, 32, 1e-6)
    assert len(fn.dispatches) == 1
    assert fn.dispatches[0] == ((3, 1, 1), (x, 32, 1e-6), {"BLOCK": 64, "num_warps": 4})
    y = torch.randn(32)
    launch(y, 32, 0.5)  # another tensor of the same dtype and alignment, another float: no dispatch
    assert len(fn.dispatches) == 1
    compiled = next(iter(fn.compiled.values()))
    # grid, stream, function, metadata, launch metadata and hooks, the arguments, then the constexprs
    # in signature order (FLAG from its default)
    assert compiled.calls == [(3, 1, 1, 77, compiled.function, compiled.packed_metadata, None, None, None,
                               y.data_ptr(), 32, 0.5, 64, True)]


def test_launch_new_dtype_or_alignment_is_a_new_specialization(direct):
    fn = _kernel()
    launch = launching.Launch(fn, (1,), BLOCK=16)
    base = torch.randn(40)
    launch(base[:32], 32, 1e-6)
    launch(base[:32].half(), 32, 1e-6)  # another dtype: Triton compiles another kernel
    launch(base[1:33], 32, 1e-6)  # 4 bytes off a 16-byte boundary: the unaligned specialization
    assert len(fn.dispatches) == 3
    assert len(fn.compiled) == 3
    launch(base[1:33], 32, 1e-6)
    launch(base[:32].half(), 32, 1e-6)
    assert len(fn.dispatches) == 3
    assert sum(len(c.calls) for c in fn.compiled.values()) == 2


@pytest.mark.parametrize("hook", ["enter", "exit"])
def test_launch_with_a_hook_always_dispatches(direct, hook):
    """Triton 3.6+ keeps the hooks in chains that are empty, not None, when nobody listens."""
    from triton.knobs import HookChain

    direct.launch_enter_hook, direct.launch_exit_hook = HookChain(), HookChain(reversed=True)
    fn = _kernel()
    launch = launching.Launch(fn, (1,), BLOCK=16)
    x = torch.randn(16)
    launch(x, 16, 1e-6)
    launch(x, 16, 1e-6)  # empty chains: the direct launch
    assert len(fn.dispatches) == 1
    getattr(direct, f"launch_{hook}_hook").add(lambda metadata: None)  # a profiler wants launch metadata
    launch(x, 16, 1e-6)
    launch(x, 16, 1e-6)
    assert len(fn.dispatches) == 3


def test_launch_constexpr_before_runtime_argument_always_dispatches(direct):
    fn = _FakeJit([_Param("X", False), _Param("BLOCK", True), _Param("n", False)])
    launch = launching.Launch(fn, (1,), BLOCK=16)
    assert launch.tail is None
    x = torch.randn(16)
    launch(x, 16)
    launch(x, 16)
    assert len(fn.dispatches) == 2


def test_launch_missing_constexpr_always_dispatches(direct):
    fn = _kernel()
    launch = launching.Launch(fn, (1,))  # BLOCK has no value and no default
    assert launch.tail is None


def test_direct_launch_off_for_unverified_triton(monkeypatch, caplog):
    monkeypatch.setattr(launching, "interpreting", lambda: False)
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    launching.direct_launch.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tritonllm.kernels"):
            assert launching.direct_launch() is False
        assert "3.2.0" in caplog.text and "JIT dispatcher" in caplog.text
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        launching.direct_launch.cache_clear()
        monkeypatch.setenv("TRITONLLM_DIRECT_LAUNCH", "0")
        assert launching.direct_launch() is False
        monkeypatch.delenv("TRITONLLM_DIRECT_LAUNCH")
        launching.direct_launch.cache_clear()
        assert launching.direct_launch() is True
    finally:
        launching.direct_launch.cache_clear()


def test_triton_version_parses_suffixes(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.6.0+git1234")
    assert launching.triton_version() == (3, 6)
    monkeypatch.setattr(triton, "__version__", "3.10.0rc1")
    assert launching.triton_version() == (3, 10)


def test_plans_are_bounded():
    plans = launching.Plans(limit=3)
    for i in range(3):
        assert plans.add(i, f"plan {i}") == f"plan {i}"
    plans[1] = "again"  # replacing a key does not clear
    assert len(plans) == 3
    plans.add(3, "plan 3")  # a new key at the limit starts over
    assert dict(plans) == {3: "plan 3"}


@triton.jit
def _scale_kernel(X, Y, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask) * scale, mask=mask)


def _scaled(kernel, x, scale):
    y = torch.full_like(x, float("nan"))
    n = x.numel()
    kernel.launch((n, x.dtype), lambda meta: (triton.cdiv(n, meta["BLOCK"]),), x, y, n, scale)
    return y


def test_autotuned_launch_plans_per_key():
    kernel = launching.autotune([triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"])(_scale_kernel)
    for n, dtype in ((100, torch.float32), (37, torch.float16), (100, torch.float32)):
        x = randn(n, dtype=dtype)
        scale = float(torch.rand(()) + 0.5)
        assert_close(f"n={n}", _scaled(kernel, x, scale), x.double() * scale, same=x * scale)
    assert set(kernel.plans) == {(100, torch.float32), (37, torch.float16)}
    # the plan holds the pinned config (TRITONLLM_NO_AUTOTUNE=1 in the tests) and its grid
    plan = kernel.plans[(100, torch.float32)]
    assert plan.kwargs["BLOCK"] == 16 and plan.grid == (7, 1, 1)
    kernel.configs = [triton.Config({"BLOCK": 64})]  # new configs: no plan made with the old ones survives
    assert not kernel.plans
    x = randn(100, device=DEVICE)
    assert_close("after new configs", _scaled(kernel, x, 2.0), x.double() * 2.0)
    assert kernel.plans[(100, torch.float32)].grid == (2, 1, 1)


def test_autotune_rejects_config_pre_hooks():
    with pytest.raises(ValueError, match="pre_hook"):
        launching.autotune([triton.Config({"BLOCK": 16}, pre_hook=lambda args: None)], key=["n"])(_scale_kernel)


def test_checks_name_the_mismatch():
    a, b = torch.randn(2), torch.randn(2, dtype=torch.float64)
    with pytest.raises(TypeError, match="a is float32, b is float64"):
        checks.check_same_dtype(a=a, b=b, c=None)
    checks.check_same_device(a=a, b=b, c=None)
    assert not checks.needs_grad(a, None, 3)
    assert checks.needs_grad(a.requires_grad_(), None)
    with torch.no_grad():
        assert not checks.needs_grad(a)


def test_tma_scratch_grows_without_freeing(monkeypatch):
    """The descriptor scratch grows per (device, stream); the buffer it outgrows stays allocated (a
    kernel captured in a CUDA graph writes its descriptors there at every replay)."""
    import weakref

    empty = torch.empty
    monkeypatch.setattr(scratch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(scratch.torch, "empty", lambda n, device, dtype: empty(n, dtype=dtype))
    monkeypatch.setattr(scratch, "_TMA_SCRATCH", {})
    monkeypatch.setattr(scratch, "_TMA_SCRATCH_OUTGROWN", [])
    small = scratch.tma_scratch(128, 128, 7)
    assert small.numel() == 1 << 16 and scratch.tma_scratch(1 << 16, 128, 7) is small
    assert scratch.tma_scratch(64, 128, 8) is not small  # another stream, another buffer
    outgrown = weakref.ref(small)
    del small
    big = scratch.tma_scratch((1 << 16) + 1, 128, 7)
    assert big.numel() == (1 << 16) + 1 and scratch.tma_scratch(4096, 128, 7) is big
    assert outgrown() is not None and scratch._TMA_SCRATCH_OUTGROWN == [outgrown()]
