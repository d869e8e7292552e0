"""linear_cross_entropy against cross_entropy(linear(x, W), target) computed in float64 by PyTorch:
loss, z-loss term, dx and dW, with ignored rows, label smoothing, z-loss, every reduction and
chunk sizes that do and do not divide the token count; bad inputs."""

import functools
import importlib

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, assert_names_argument, dtype_id, gemm_atol, non_contiguous, randn
from tritonllm.bench.reference_ops import linear_cross_entropy as ref_linear_cross_entropy
from tritonllm.kernels import linear_cross_entropy

LCE = importlib.import_module("tritonllm.kernels.linear_cross_entropy")

IGNORE = -100
#: (loss, z-loss term) of the fp32 (or float64) logits by PyTorch ops
reference = functools.partial(ref_linear_cross_entropy, return_z_loss=True)


def targets(shape, V, every=5, ignore_index=IGNORE):
    t = torch.randint(0, V, shape, device=DEVICE)
    t.view(-1)[::every] = ignore_index
    return t


def check(x, w, t, dtype, **kw):
    loss, z = linear_cross_entropy(x, w, t, return_z_loss=True, **kw)
    kw.pop("chunk_size", None)
    dloss = randn(loss.numel(), dtype=torch.float32).view(loss.shape)
    dx, dw = torch.autograd.grad(loss, [x, w], dloss)
    ins64 = [x.detach().double().requires_grad_(), w.detach().double().requires_grad_()]
    ins_same = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
    loss64, z64 = reference(*ins64, t, **kw)
    loss_same, z_same = reference(*ins_same, t, **kw)
    atol = gemm_atol(dtype)
    assert loss.dtype == torch.float32 and loss.shape == loss64.shape
    assert_close("loss", loss, loss64, loss_same, atol=atol, dtype=dtype)
    assert_close("z_loss", z, z64, z_same, atol=atol, dtype=dtype)
    g64 = torch.autograd.grad(loss64, ins64, dloss.double())
    g_same = torch.autograd.grad(loss_same, ins_same, dloss)
    for name, got, ref, same, inp in zip(("dx", "dW"), (dx, dw), g64, g_same, (x, w)):
        assert got.shape == inp.shape and got.dtype == inp.dtype, name
        assert_close(name, got, ref, same, atol=atol)


# (x shape, V, chunk_size, reduction, label_smoothing, z_loss)
CASES = [
    ((37, 17), 100, 16, "mean", 0.0, 0.0),  # chunk not dividing the 37 tokens
    ((37, 17), 100, None, "sum", 0.1, 1e-3),  # one chunk
    ((2, 9, 100), 17, 5, "mean", 0.2, 1e-2),  # 3-D x, odd vocabulary
    ((23, 5), 257, 8, "none", 0.1, 1e-3),  # per-row losses: backward reruns the chunks
    ((1, 17), 1, None, "mean", 0.0, 0.0),  # a single token, a vocabulary of 1
]


def case_id(case):
    shape, V, chunk, red, ls, zl = case
    return f"{'x'.join(map(str, shape))}x{V}-chunk{chunk}-{red}-ls{ls}-z{zl}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_linear_cross_entropy(case, dtype, poisoned_empty):
    shape, V, chunk, reduction, ls, zl = case
    H = shape[-1]
    x = randn(*shape, dtype=dtype, requires_grad=True)
    w = randn(V, H, dtype=dtype, scale=H ** -0.5, requires_grad=True)
    t = targets(shape[:-1], V)
    check(x, w, t, dtype, label_smoothing=ls, z_loss=zl, reduction=reduction, chunk_size=chunk)


@pytest.mark.parametrize("chunk", [1, 4, 11, 64], ids=lambda c: f"chunk{c}")
def test_chunk_sizes(chunk):
    """Chunks of one token, several, exactly the tokens, more than the tokens; int32 targets,
    a custom ignore_index, a row-strided x."""
    x = non_contiguous(randn(11, 17, requires_grad=True))
    w = randn(50, 17, scale=0.3, requires_grad=True)
    t = targets((11,), 50, every=3, ignore_index=7).to(torch.int32)
    check(x, w, t, torch.float32, ignore_index=7, label_smoothing=0.05, chunk_size=chunk)


@pytest.mark.parametrize("T,V,budget", [(16384, 32000, 1 << 30), (16384, 50304, 1 << 30), (65536, 32000, 1 << 30),
                                         (1000, 100, 64), (37, 100, 1 << 30), (200, 1 << 20, 1 << 20),
                                         (16384, 32000, 5500 * 32000 * 2), (1, 7, 1)])
def test_chunk_for(T, V, budget):
    """CHUNK_BYTES's chunk: T in the fewest chunks of one size (a multiple of 64 tokens, else all T) whose
    [chunk, V] bf16 buffer fits the budget, also where rounding T / chunks up to 64 tokens would overflow it
    (the seventh case: 5500 tokens fit, so three chunks, but of 5504: four of 4096); 64 tokens when not even
    those fit."""
    def size(chunks):  # T / chunks rounded up, then up to a multiple of 64 tokens
        per_chunk = -(-T // chunks)
        return min(T, max(64, -(-per_chunk // 64) * 64))
    chunk = LCE.chunk_for(T, V, 2, budget)
    chunks = -(-T // chunk)
    assert 1 <= chunk <= T and (chunk % 64 == 0 or chunk == T)
    if 64 * V * 2 > budget:
        assert chunk == min(64, T)
        return
    assert chunk == size(chunks) and chunk * V * 2 <= budget
    assert chunks == 1 or size(chunks - 1) * V * 2 > budget  # the fewest


def test_chunk_bytes_default(monkeypatch):
    """chunk_size None takes CHUNK_BYTES's chunks (here several, the last one partial) or, with
    CHUNK_BYTES None, Liger-Kernel's memory (default_chunk)."""
    x = randn(150, 17, requires_grad=True)
    w = randn(50, 17, scale=0.3, requires_grad=True)
    t = targets((150,), 50)
    for budget in (64 * 50 * 4, None):
        monkeypatch.setattr(LCE, "CHUNK_BYTES", budget)
        check(x, w, t, torch.float32, label_smoothing=0.05)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(reduction, poisoned_empty):
    x = randn(6, 17, requires_grad=True)
    w = randn(40, 17, requires_grad=True)
    t = torch.full((6,), IGNORE, device=DEVICE)
    loss = linear_cross_entropy(x, w, t, z_loss=1e-3, reduction=reduction, chunk_size=4)
    dx, dw = torch.autograd.grad(loss.sum(), [x, w])
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(dx, torch.zeros_like(dx)) and torch.equal(dw, torch.zeros_like(dw))


def test_matches_tritonllm_cross_entropy_of_linear():
    """The fused op equals the unfused pair of tritonllm kernels, loss and gradients."""
    ce = importlib.import_module("tritonllm.kernels.cross_entropy").cross_entropy
    from tritonllm.kernels import linear

    x = randn(29, 33, requires_grad=True)
    w = randn(70, 33, scale=0.2, requires_grad=True)
    t = targets((29,), 70)
    kw = dict(ignore_index=IGNORE, label_smoothing=0.1, z_loss=1e-3, reduction="mean")
    fused = linear_cross_entropy(x, w, t, chunk_size=8, **kw)
    unfused = ce(linear(x, w), t, **kw)
    got = torch.autograd.grad(fused, [x, w])
    want = torch.autograd.grad(unfused, [x, w])
    assert_close("loss", fused, unfused.double(), atol=gemm_atol(torch.float32))
    for name, g, r in zip(("dx", "dW"), got, want):
        assert_close(name, g, r.double(), atol=gemm_atol(torch.float32))


def test_no_grad_and_repeated_backward():
    """No gradient work under no_grad; backward twice (retain_graph) gives the same gradients."""
    x = randn(9, 17, requires_grad=True)
    w = randn(30, 17, requires_grad=True)
    t = targets((9,), 30)
    with torch.no_grad():
        loss_ng = linear_cross_entropy(x, w, t)
    loss = linear_cross_entropy(x, w, t)
    assert loss_ng.grad_fn is None and torch.equal(loss_ng, loss.detach())
    first = torch.autograd.grad(loss, [x, w], retain_graph=True)
    second = torch.autograd.grad(loss, [x, w])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


KNOB_CASES = [(dtype, False, True) for dtype in DTYPES] + [(torch.float32, True, True), (torch.float32, False, False)]


@pytest.mark.parametrize("dtype,dw_fp32,in_place", KNOB_CASES,
                         ids=[f"{dtype_id(d)}-dw_fp32={f}-in_place={i}" for d, f, i in KNOB_CASES])
def test_long_vocabulary_knobs_and_rescaled_backward(dtype, dw_fp32, in_place, monkeypatch):
    """A vocabulary over the interpreter's single-pass row limit (blocked two-sweep row kernel) and
    over two split-K minimums (the dx GEMM splits along V); dW accumulated in W's dtype or fp32,
    gradients scaled in place or copied; a retained graph's second backward with another dloss."""
    monkeypatch.setattr(LCE, "DW_FP32", dw_fp32)
    monkeypatch.setattr(LCE, "GRAD_IN_PLACE", in_place)
    x = randn(8, 16, dtype=dtype, requires_grad=True)
    w = randn(4100, 16, dtype=dtype, scale=0.25, requires_grad=True)
    t = targets((8,), 4100)
    check(x, w, t, dtype, label_smoothing=0.1)
    loss = linear_cross_entropy(x, w, t)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference(x64, w64, t)[0]
    for dloss in (2.0, -0.5):
        got = [g.clone() for g in torch.autograd.grad(loss, [x, w], torch.tensor(dloss, device=DEVICE),
                                                      retain_graph=True)]
        want = torch.autograd.grad(ref, [x64, w64], torch.tensor(dloss, dtype=torch.float64), retain_graph=True)
        for name, g, r in zip(("dx", "dW"), got, want):
            assert_close(name, g, r, dtype=dtype, atol=gemm_atol(dtype))


SOFTCAP_CASES = [
    ((37, 17), 100, 16, "mean", 0.0, 0.0),  # chunk not dividing the tokens
    ((2, 9, 33), 17, 5, "sum", 0.2, 1e-2),  # 3-D x, odd vocabulary, smoothing and z-loss
    ((23, 5), 257, 8, "none", 0.1, 1e-3),  # per-row losses: backward reruns the chunks
    ((1, 17), 1, None, "mean", 0.0, 0.0),  # a single token, a vocabulary of 1
    ((6, 16), 1500, None, "mean", 0.1, 1e-3),  # over the interpreter's single-pass row: blocked sweeps
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=case_id)
def test_softcap(case, dtype, poisoned_empty):
    """Logit soft-capping fused into the row kernel: loss, z-loss, dx and dW against float64, with
    logits large enough (x5) that the cap of 3 bends them well past the linear range."""
    shape, V, chunk, reduction, ls, zl = case
    H = shape[-1]
    x = randn(*shape, dtype=dtype, scale=5.0, requires_grad=True)
    w = randn(V, H, dtype=dtype, scale=H ** -0.5, requires_grad=True)
    t = targets(shape[:-1], V)
    check(x, w, t, dtype, label_smoothing=ls, z_loss=zl, reduction=reduction, chunk_size=chunk, softcap=3.0)


def test_softcap_matches_capped_logits_and_no_grad():
    """The fused op equals tritonllm's softcap of linear followed by cross_entropy; no_grad path alike."""
    from tritonllm.kernels.cross_entropy import cross_entropy
    from tritonllm.kernels.linear import linear
    from tritonllm.kernels.softcap import softcap

    x = randn(13, 24, scale=4.0, requires_grad=True)
    w = randn(70, 24, scale=0.3, requires_grad=True)
    t = targets((13,), 70)
    fused = linear_cross_entropy(x, w, t, chunk_size=4, softcap=5)
    unfused = cross_entropy(softcap(linear(x, w), 5.0), t)
    for name, g, r in zip(("dx", "dW"), torch.autograd.grad(fused, [x, w]), torch.autograd.grad(unfused, [x, w])):
        assert_close(name, g, r.double(), atol=gemm_atol(torch.float32))
    with torch.no_grad():
        assert_close("loss", linear_cross_entropy(x, w, t, softcap=5.0), unfused.double(),
                     atol=gemm_atol(torch.float32))


def _meta(*shape):
    return torch.empty(*shape, device="meta")


BAD_INPUTS = [
    ("K_mismatch", ValueError, "weight", lambda: linear_cross_entropy(randn(4, 8), randn(10, 7), targets((4,), 10))),
    ("int_x", TypeError, "x", lambda: linear_cross_entropy(torch.ones(4, 8, dtype=torch.int64, device=DEVICE),
                                                          randn(10, 8), targets((4,), 10))),
    ("weight_on_meta", ValueError, "weight",
     lambda: linear_cross_entropy(randn(4, 8), _meta(10, 8), targets((4,), 10))),
    ("target_shape", ValueError, "target", lambda: linear_cross_entropy(randn(4, 8), randn(10, 8), targets((5,), 10))),
    ("float_target", TypeError, "target", lambda: linear_cross_entropy(randn(4, 8), randn(10, 8), randn(4))),
    ("reduction", ValueError, "reduction",
     lambda: linear_cross_entropy(randn(4, 8), randn(10, 8), targets((4,), 10), reduction="avg")),
    ("chunk_size", ValueError, "chunk_size",
     lambda: linear_cross_entropy(randn(4, 8), randn(10, 8), targets((4,), 10), chunk_size=0)),
    ("softcap_zero", ValueError, "softcap",
     lambda: linear_cross_entropy(randn(4, 8), randn(10, 8), targets((4,), 10), softcap=0.0)),
    ("softcap_inf", ValueError, "softcap",
     lambda: linear_cross_entropy(randn(4, 8), randn(10, 8), targets((4,), 10), softcap=float("inf"))),
    ("label_smoothing", ValueError, "label_smoothing",
     lambda: linear_cross_entropy(randn(4, 8), randn(10, 8), targets((4,), 10), label_smoothing=1.5)),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c[0])
def test_bad_input(case):
    assert_names_argument(*case[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_bf16_large(reduction):
    """bf16 at an LM-head-like shape with several chunks (one partial)."""
    x = randn(4100, 768, dtype=torch.bfloat16, requires_grad=True)
    w = randn(32000, 768, dtype=torch.bfloat16, scale=768 ** -0.5, requires_grad=True)
    t = targets((4100,), 32000)
    check(x, w, t, torch.bfloat16, label_smoothing=0.1, z_loss=1e-4, reduction=reduction, chunk_size=1024)
