"""Shared fixtures: the device tests run on and the dtypes checked there.

Without a CUDA device the kernels run through Triton's interpreter on CPU tensors: this file sets
``TRITON_INTERPRET=1`` before anything imports Triton (the test files' own ``@triton.jit`` kernels
need it too), unless the environment already chooses. The interpreter cannot do bfloat16
``tl.dot`` (triton issue 11584), so bfloat16 is checked only on the GPU.
Autotuned kernels run one pinned config each (``TRITONLLM_NO_AUTOTUNE=1``, unless the environment
says otherwise), so the GPU suite compiles each kernel variant once instead of once per config.
Under pytest-xdist (``make test``: ``-n 2`` on 2 cores) each process, the workers and what they start,
runs one OpenMP / OpenBLAS thread (``OMP_NUM_THREADS=1``, unless the environment chooses): the
interpreter's operations are tiny, and a pool of one thread per core per process only spins.
"""

import os
import sys
import zlib

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read once, when torch and numpy load their thread pools

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRITONLLM_NO_AUTOTUNE", "1")
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
if ON_GPU:
    # tritonllm's float32 GEMMs use TF32 tensor cores by default (allow_tf32=True); PyTorch's own
    # float32 result, the yardstick of the tolerance rule, is computed the same way.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` / ``torch.empty_like`` return NaN (int: max) filled memory while the test runs,
    so an output or partial-sum element that no kernel writes fails the comparison."""
    from _checks import poison_

    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))


def seed_of(nodeid: str) -> int:
    """The seed of the test ``nodeid``: a CRC-32 of its id, the same in every process and run (Python's
    ``hash`` of a string is randomised per process), so a failure replays with the same data."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture
def kernel_settings():
    """A test may change the kernels' settings (``configure_gemm``, ``configure_attention``): those in force
    before it come back after it."""
    from tritonllm.kernels import attention_settings, gemm_settings

    with gemm_settings(), attention_settings():  # settings put themselves back in force at the end of the block
        yield


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different, reproducible seed per test: fresh random data, replayable from the test id."""
    torch.manual_seed(seed_of(request.node.nodeid))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report names its seed (``torch.manual_seed`` before the test ran)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("seed", f"torch.manual_seed({seed_of(item.nodeid)}) for {item.nodeid}"))
