"""embedding against a float64 PyTorch reference: output and dW (repeated ids, segments longer than
a backward chunk, several id and column blocks, padding_idx, int32/int64 ids and sort keys, strided
weight and ids, validate=False), determinism and bad input."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from _checks import DEVICE, DTYPES, assert_close, dtype_id, non_contiguous, randn
from tritonllm.kernels import embedding

embedding_module = importlib.import_module("tritonllm.kernels.embedding")
CHUNK, BLOCK_D = embedding_module._BWD_CHUNK, embedding_module._BWD_BLOCK_D

# (V, D, ids shape): one-row vocabulary (every id the same: one segment over several backward chunks),
# D = 1, odd sizes, ids [3, 7], several chunks of sorted tokens per id block, several id blocks,
# several column blocks with a ragged last one
CASES = [(1, 17, (3, 7)), (100, 128, (5,)), (1000, 1, (3, 7)), (100, 17, (3 * CHUNK + 5,)), (1000, 128, (2, 150)),
         (300, 2 * BLOCK_D + 5, (40,))]


def case_id(case):
    V, D, shape = case
    return f"V{V}_D{D}_ids{'x'.join(map(str, shape))}"


def check(ids, weight, padding_idx=None, validate=True):
    """Compare the output and dW with float64 and same-dtype F.embedding on the same inputs."""
    out = embedding(ids, weight, padding_idx=padding_idx, validate=validate)
    dy = randn(*out.shape, dtype=out.dtype)
    (dw,) = torch.autograd.grad(out, [weight], dy)
    refs = {}
    for dtype in (torch.float64, weight.dtype):
        w = weight.detach().to(dtype).requires_grad_()
        ref = F.embedding(ids.long(), w, padding_idx=padding_idx)
        refs[dtype] = (ref, *torch.autograd.grad(ref, [w], dy.to(dtype)))
    (ref64, dw64), (same, dw_same) = refs[torch.float64], refs[weight.dtype]
    assert out.dtype == weight.dtype and dw.dtype == weight.dtype
    assert_close("out", out, ref64, same)
    assert_close("dweight", dw, dw64, dw_same)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_embedding(case, dtype, ids_dtype, poisoned_empty):
    V, D, shape = case
    ids = torch.randint(0, V, shape, dtype=ids_dtype, device=DEVICE)
    check(ids, randn(V, D, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_embedding_skewed_ids(dtype, poisoned_empty):
    """One id takes most tokens: its segment starts mid-chunk and runs across several chunks, next to
    short segments that start and end inside a chunk."""
    V, D, N = 50, 40, 5 * CHUNK + 3
    ids = torch.randint(0, V, (N,), device=DEVICE)
    ids[torch.rand(N, device=DEVICE) < 0.6] = 17
    check(ids, randn(V, D, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("padding_idx", [0, 3, -1], ids=lambda p: f"pad{p}")
def test_embedding_padding_idx(padding_idx, poisoned_empty):
    V = 10
    ids = torch.randint(0, V, (2 * CHUNK + 9,), device=DEVICE)
    ids[::3] = padding_idx % V
    check(ids, randn(V, 24, requires_grad=True), padding_idx=padding_idx)


def test_embedding_strided_inputs(poisoned_empty):
    """A weight with a padded row stride and non-contiguous ids."""
    weight = non_contiguous(randn(30, 19, requires_grad=True))
    ids = torch.randint(0, 30, (4, 40), device=DEVICE)[:, ::3]
    assert not ids.is_contiguous() and weight.stride(0) != 19
    check(ids, weight)


@pytest.mark.parametrize("view", ["last_column", "column"])
def test_embedding_ids_column_view(view, poisoned_empty):
    """A column of [B, T] ids (as in decoding, idx[:, -1:]): flattening it gives a strided view, not a copy."""
    idx = torch.randint(0, 50, (5, 9), device=DEVICE)
    ids = idx[:, -1:] if view == "last_column" else idx[:, 3]
    assert ids.reshape(-1).stride(0) == 9
    check(ids, randn(50, 24, requires_grad=True))


def test_embedding_no_validate(poisoned_empty):
    """validate=False skips the host-side range check and computes the same thing."""
    check(torch.randint(0, 100, (3, 50), device=DEVICE), randn(100, 40, requires_grad=True), validate=False)


def test_embedding_int32_sort_keys(monkeypatch, poisoned_empty):
    """The int32-key sort path (taken when V > 32768) on a small vocabulary."""
    monkeypatch.setattr(embedding_module, "_SORT_INT16", False)
    ids = torch.randint(0, 100, (3 * CHUNK + 7,), device=DEVICE)
    ids[::2] = 42
    check(ids, randn(100, 24, requires_grad=True), padding_idx=7)


def test_embedding_empty_ids():
    weight = randn(5, 8, requires_grad=True)
    out = embedding(torch.empty(0, 3, dtype=torch.int64, device=DEVICE), weight)
    assert out.shape == (0, 3, 8)
    (dw,) = torch.autograd.grad(out.sum(), [weight])
    assert torch.equal(dw, torch.zeros_like(dw))


def test_embedding_backward_deterministic():
    ids = torch.randint(0, 7, (3 * CHUNK,), device=DEVICE)
    weight = randn(7, 33, requires_grad=True)
    dy = randn(3 * CHUNK, 33)
    grads = [torch.autograd.grad(embedding(ids, weight), [weight], dy)[0] for _ in range(2)]
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("case,error,match", [
    ("float_ids", TypeError, "ids"),
    ("int_weight", TypeError, "weight"),
    ("weight_1d", ValueError, "weight"),
    ("id_too_large", ValueError, "ids"),
    ("negative_id", ValueError, "ids"),
    ("padding_out_of_range", ValueError, "padding_idx"),
    ("padding_not_int", TypeError, "padding_idx"),
    ("ids_wrong_device", ValueError, "ids"),
    ("ids_not_tensor", TypeError, "ids"),
])
def test_embedding_bad_input(case, error, match):
    ids = torch.randint(0, 10, (3, 4), device=DEVICE)
    weight = randn(10, 8)
    padding_idx = None
    if case == "float_ids":
        ids = ids.float()
    elif case == "int_weight":
        weight = weight.to(torch.int32)
    elif case == "weight_1d":
        weight = weight[0]
    elif case == "id_too_large":
        ids[1, 2] = 10
    elif case == "negative_id":
        ids[0, 0] = -1
    elif case == "padding_out_of_range":
        padding_idx = 10
    elif case == "padding_not_int":
        padding_idx = 1.0
    elif case == "ids_wrong_device":
        ids = ids.to("meta")
    elif case == "ids_not_tensor":
        ids = ids.tolist()
    with pytest.raises(error, match=match):
        embedding(ids, weight, padding_idx=padding_idx)


# ---- GPU: benchmark shape in bfloat16, Zipf-distributed ids ------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_embedding_large_zipf(dtype):
    """16384 tokens into 32000 x 768 with a Zipf-like id distribution (a few ids take thousands of
    tokens, most appear once or never)."""
    V, D, N = 32000, 768, 16384
    rank = torch.arange(1, V + 1, dtype=torch.float64, device=DEVICE)
    ids = torch.multinomial(1.0 / rank, N, replacement=True).view(8, 2048)
    check(ids, randn(V, D, dtype=dtype, requires_grad=True), padding_idx=0)


def test_embedding_launch_plans_follow_every_argument(poisoned_empty):
    """Cached launch plans: one table in turn with more ids, a strided id view, a strided table and
    another dtype (each planned, then from the plan) gives the right rows and gradient; under
    no_grad no autograd node is made."""
    weight = randn(50, 24, requires_grad=True)
    for _ in range(2):
        check(torch.randint(0, 50, (7,), device=DEVICE), weight)
        check(torch.randint(0, 50, (3, 9), device=DEVICE), weight)
        check(torch.randint(0, 50, (4, 6), device=DEVICE)[:, ::2], weight)
        check(torch.randint(0, 50, (7,), device=DEVICE), non_contiguous(randn(50, 24, requires_grad=True)))
        check(torch.randint(0, 50, (7,), device=DEVICE), randn(50, 24, dtype=torch.float16, requires_grad=True))
    ids = torch.randint(0, 50, (5,), device=DEVICE)
    with torch.no_grad():
        out = embedding(ids, weight)
    assert out.grad_fn is None
    assert torch.equal(out, weight.detach()[ids])
