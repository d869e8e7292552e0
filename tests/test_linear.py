"""linear (bias / residual epilogues) and linear_swiglu against float64 PyTorch references:
output and every gradient by name; the GEMM's TMA and pointer paths; bad inputs."""

import contextlib
import importlib

import pytest
import torch

from _checks import (DEVICE, DTYPES, ON_GPU, assert_close, assert_names_argument, dtype_id, gemm_atol, non_contiguous,
                     poison_, randn)
from tritonllm.bench.reference_ops import linear as ref_linear
from tritonllm.bench.reference_ops import linear_swiglu as ref_swiglu
from tritonllm.kernels import configure_gemm, linear, linear_swiglu
from tritonllm.kernels.device import smem_budget

gemm_module = importlib.import_module("tritonllm.kernels.gemm")

@contextlib.contextmanager
def torch_tf32(dtype):
    """PyTorch's same-dtype result under the precision our kernels use (TF32 for fp32 on the GPU)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = ON_GPU and dtype == torch.float32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def check(fn, ref_fn, inputs, names, chain=1):
    """``fn(*inputs)`` and its gradients vs ``ref_fn`` in float64 and in the inputs' dtype
    (``chain``: see _checks.gemm_atol)."""
    dtype = inputs[0].dtype
    y = fn(*inputs)
    dy = randn(*y.shape, dtype=y.dtype)
    wrt = [t for t in inputs if t is not None and t.requires_grad]
    got = torch.autograd.grad(y, wrt, dy)
    ins64 = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    ins_same = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    y64 = ref_fn(*ins64)
    with torch_tf32(dtype):
        y_same = ref_fn(*ins_same)
        ref_same = torch.autograd.grad(y_same, [t for t in ins_same if t is not None and t.requires_grad], dy)
    ref64 = torch.autograd.grad(y64, [t for t in ins64 if t is not None and t.requires_grad], dy.double())
    assert y.dtype == dtype
    assert_close("y", y, y64, y_same, atol=gemm_atol(dtype, chain))
    grad_names = [n for n, t in zip(names, inputs) if t is not None and t.requires_grad]
    for name, t, g, g64, gs in zip(grad_names, wrt, got, ref64, ref_same):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        assert_close("d" + name, g, g64, gs, atol=gemm_atol(dtype, chain))


# (M, K, N, bias): a sparse product of M in (1, 5, 123) and K, N in (1, 17, 100, 1000); M = 123 with
# N = 1 sums the bias gradient in two stages (partials of row groups, then their fixed-order sum)
LINEAR_CASES = [(1, 17, 100, True), (5, 1000, 17, False), (123, 100, 1000, True), (123, 1, 1, True)]


def case_id(case):
    M, K, N, bias = case
    return f"{M}x{K}x{N}" + ("-bias" if bias else "")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=case_id)
def test_linear(case, dtype, poisoned_empty):
    M, K, N, bias = case
    x = randn(M, K, dtype=dtype, requires_grad=True)
    w = randn(N, K, dtype=dtype, scale=K ** -0.5, requires_grad=True)
    b = randn(N, dtype=dtype, requires_grad=True) if bias else None
    check(linear, ref_linear, [x, w, b], ["x", "weight", "bias"])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_linear_3d_residual_bias(dtype, poisoned_empty):
    """The output-projection epilogue y = residual + x W^T + b on a [B, T, K] input."""
    x = randn(2, 3, 100, dtype=dtype, requires_grad=True)
    w = randn(17, 100, dtype=dtype, scale=0.1, requires_grad=True)
    b = randn(17, dtype=dtype, requires_grad=True)
    r = randn(2, 3, 17, dtype=dtype, requires_grad=True)
    check(linear, ref_linear, [x, w, b, r], ["x", "weight", "bias", "residual"])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_linear_strided_and_transposed_inputs(dtype, poisoned_empty):
    """Row-strided x and residual; the weight a .T view of a [K, N] tensor (read through strides)."""
    x = non_contiguous(randn(123, 17, dtype=dtype, requires_grad=True))
    w = randn(17, 100, dtype=dtype, requires_grad=True).detach().t().requires_grad_()
    r = non_contiguous(randn(123, 100, dtype=dtype))
    assert not x.is_contiguous() and w.stride(0) == 1
    check(linear, ref_linear, [x, w, None, r], ["x", "weight", "bias", "residual"])


def test_linear_transposed_x_3d_non_contiguous():
    """x a .T view (unit stride along M) and a 3-D view whose rows cannot be folded."""
    x = randn(100, 5, requires_grad=True).detach().t().requires_grad_()
    w = randn(17, 100, scale=0.1, requires_grad=True)
    check(linear, ref_linear, [x, w], ["x", "weight"])
    x3 = randn(3, 4, 34, requires_grad=True).detach()[:, :, ::2].requires_grad_()
    check(linear, ref_linear, [x3, randn(5, 17, requires_grad=True)], ["x", "weight"])


# (leading shape of x, K, F)
SWIGLU_CASES = [((1,), 17, 100), ((5,), 100, 17), ((2, 61), 17, 50), ((7,), 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", SWIGLU_CASES, ids=lambda c: "x".join(map(str, c[0] + c[1:])))
def test_linear_swiglu(case, dtype, poisoned_empty):
    lead, K, F_ = case
    x = randn(*lead, K, dtype=dtype, requires_grad=True)
    w13 = randn(2 * F_, K, dtype=dtype, scale=K ** -0.5, requires_grad=True)
    check(linear_swiglu, ref_swiglu, [x, w13], ["x", "w13"], chain=2)


def test_linear_swiglu_transposed_weight():
    """w13 a .T view of a [K, 2F] tensor: the gate and up tiles are read through strides."""
    x = non_contiguous(randn(33, 17, requires_grad=True))
    w13 = randn(17, 40, requires_grad=True).detach().t().requires_grad_()
    check(linear_swiglu, ref_swiglu, [x, w13], ["x", "w13"], chain=2)


@pytest.mark.skipif(not ON_GPU, reason="a second CUDA stream")
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("op", ["linear", "linear_swiglu"])
def test_backward_dw_beside_dx(op, dynamic, kernel_settings):
    """dW on a second stream beside dx (GemmSettings.overlap_dw): the same bits as one after the other, eagerly and
    replayed in a CUDA graph (the streams captured as parallel branches), with the WS kernel's tiles static
    and dynamic (GemmSettings.dynamic: each stream takes its own counter)."""
    configure_gemm(dynamic=dynamic)
    fn, rows = (linear, 1536) if op == "linear" else (linear_swiglu, 2 * 1536)
    x = randn(2048, 768, dtype=torch.bfloat16, requires_grad=True)
    w = randn(rows, 768, dtype=torch.bfloat16, scale=768 ** -0.5, requires_grad=True)
    dy = randn(2048, 1536, dtype=torch.bfloat16)
    grads = {}
    for overlap in (False, True):
        configure_gemm(overlap_dw=overlap)
        gemm_module._LAUNCH_CONFIGS.clear()
        grads[overlap] = torch.autograd.grad(fn(x, w), [x, w], dy)
    for name, one, beside in zip(("dx", "dw"), grads[False], grads[True]):
        assert torch.equal(one, beside), name
    stream = torch.cuda.Stream()  # the forward too: autograd runs each backward op on its forward's stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = fn(x, w)
        for _ in range(2):
            torch.autograd.grad(y, [x, w], dy, retain_graph=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = torch.autograd.grad(y, [x, w], dy, retain_graph=True)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for name, got, want in zip(("dx", "dw"), captured, grads[False]):
        assert torch.equal(got, want), name


# operand layouts for the GEMM paths: (name, A [M, K] maker, B [K, N] maker)
def _rows(r, c, dtype):
    return randn(r, c, dtype=dtype)


def _cols(r, c, dtype):
    return randn(c, r, dtype=dtype).t()


LAYOUTS = [("A_rows-B_rows", _rows, _rows), ("A_cols-B_cols", _cols, _cols), ("A_rows-B_cols", _rows, _cols)]


@pytest.mark.parametrize("tma_store", [False, True, "subtile"], ids=lambda s: f"tma_store={s}")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l[0])
def test_gemm_descriptor_path_matches_pointer_path(layout, tma_store, kernel_settings):
    """Both operand-load paths of the GEMM (tensor descriptors / masked pointers) on ragged tiles,
    with accumulate (beta = 1), the SwiGLU epilogue writing gate/up, and split-K; the descriptor
    path also with TMA stores (whole tiles or halves). The interpreter emulates descriptors."""
    if ON_GPU and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm90+")
    configure_gemm(tma_store=bool(tma_store), epilogue_subtile=tma_store == "subtile")
    _, make_a, make_b = layout
    dtype = torch.float16
    M, K, N = 72, 40, 24
    a, b = make_a(M, K, dtype), make_b(K, N, dtype)
    b2 = make_b(K, 2 * N, dtype)
    c0 = randn(M, N, dtype=torch.float32)
    outs = {}
    for use_tma in (True, False):
        plain = gemm_module.gemm(a, b, c0.clone(), accumulate=True, use_tma=use_tma)
        gu = poison_(torch.empty(M, 2 * N, dtype=dtype, device=DEVICE))
        h = gemm_module.gemm(a, b2, poison_(torch.empty(M, N, dtype=dtype, device=DEVICE)), gu=gu,
                               epilogue=gemm_module.SWIGLU_FWD, use_tma=use_tma)
        split = gemm_module.gemm(a, b, poison_(torch.empty(M, N, dtype=dtype, device=DEVICE)), use_tma=use_tma,
                                   split_k=3)
        outs[use_tma] = (plain, h, gu, split)
    a64, b64, b264 = a.double(), b.double(), b2.double()
    g, u = (a64 @ b264).chunk(2, dim=-1)
    refs = (c0.double() + a64 @ b64, g * torch.sigmoid(g) * u, a64 @ b264, a64 @ b64)
    for name, tma, ptr, ref in zip(("accumulate", "swiglu_h", "swiglu_gu", "split_k"), outs[True], outs[False], refs):
        assert_close(name + "[tma]", tma, ref, atol=2e-3)
        assert_close(name + "[pointer]", ptr, ref, atol=2e-3)


@pytest.mark.parametrize("M,N,K,splits", [(1, 17, 40, 2), (5, 100, 123, 4), (33, 8, 1000, 7)])
def test_gemm_split_k(M, N, K, splits, poisoned_empty):
    """Split-K on ragged sizes (some splits past the end of K): fp32 partials summed in order."""
    a = randn(M, K)
    b = randn(N, K).t()
    c = gemm_module.gemm(a, b, torch.empty(M, N, device=DEVICE), split_k=splits, allow_tf32=False)
    assert_close("c", c, a.double() @ b.double(), atol=1e-5)


@pytest.mark.parametrize("split_k", [1, 3], ids=["whole-K", "split-K"])
def test_gemm_grids_match(split_k, kernel_settings):
    """``GemmSettings.persistent`` off (one program per output tile instead of min(#SMs, tiles) programs
    looping over them) and ``sm_margin`` (a persistent grid of #SMs - margin programs) compute every tile
    the same way: bitwise the same C, with more tiles than SMs (4 under the interpreter)."""
    M, N, K = (600, 300, 40) if not ON_GPU else (4096, 4096, 256)
    a, b = randn(M, K), randn(N, K).t()
    out, programs = {}, {}
    for grid in ("persistent", "tile", "margin"):
        configure_gemm(persistent=grid != "tile", sm_margin=1 if grid == "margin" else 0)
        gemm_module._LAUNCH_CONFIGS.clear()
        for _ in range(2):  # planned, then from the plan
            out[grid] = gemm_module.gemm(a, b, poison_(torch.empty(M, N, device=DEVICE)), split_k=split_k,
                                         allow_tf32=False)
        (plan,) = gemm_module._LAUNCH_CONFIGS.values()
        programs[grid] = plan[0].grid[0]
    sms = gemm_module.num_sms()
    assert programs["margin"] == sms - 1 and programs["persistent"] == sms < programs["tile"], (programs, sms)
    assert torch.equal(out["persistent"], out["tile"]) and torch.equal(out["persistent"], out["margin"])
    assert_close("c", out["tile"], a.double() @ b.double(), atol=1e-5)


def test_split_k_heuristic():
    """Few output tiles and a long K split, as far as the fp32 partials' traffic pays; a product that
    fills the GPU, or a short K, does not (the expectations are for the measured constants)."""
    assert (gemm_module.SPLIT_K_MIN_K, gemm_module.SPLIT_K_MAX, gemm_module.SPLIT_K_STEP_BYTES) == (2048, 8, 760_000)
    split_k_for, split_cost = gemm_module.split_k_for, gemm_module.split_cost
    assert split_k_for(384, 768, 32000, 132) == 7  # 18 tiles of 128x128: 126 programs, one wave of 72 steps
    assert split_k_for(2048, 768, 32000, 132) == 4  # 96 tiles: 384 programs fill 3 waves of 132
    assert split_k_for(768, 768, 16384, 132) == 3  # 36 tiles: 108 programs, where 7 splits would fill better
    # 108 tiles: the best fill (6 splits, 0.98 of the SMs busy) ran 27% slower than unsplit on an H100
    assert split_k_for(2304, 768, 16384, 132) == 1
    assert split_cost(2304, 768, 16384, 6, 132) > split_cost(2304, 768, 16384, 1, 132) == 256
    assert split_k_for(16384, 768, 32000, 132) == 1
    assert split_k_for(384, 768, 3000, 132) == 1


def test_gemm_descriptor_path_rejects_unaligned_strides():
    a = randn(8, 17, dtype=torch.float16)  # row stride 34 bytes: not a multiple of 16
    with pytest.raises(ValueError, match="use_tma"):
        gemm_module.gemm(a, randn(17, 16, dtype=torch.float16),
                           torch.empty(8, 16, dtype=torch.float16, device=DEVICE), use_tma=True)


def _meta(*shape):
    return torch.empty(*shape, device="meta")


BAD_INPUTS = [
    ("K_mismatch", ValueError, "weight", lambda: linear(randn(4, 8), randn(3, 7))),
    ("int_x", TypeError, "x", lambda: linear(torch.ones(4, 8, dtype=torch.int64, device=DEVICE), randn(3, 8))),
    ("weight_1d", ValueError, "weight", lambda: linear(randn(4, 8), randn(8))),
    ("weight_on_meta", ValueError, "weight", lambda: linear(randn(4, 8), _meta(3, 8))),
    ("dtype_mismatch", TypeError, "weight", lambda: linear(randn(4, 8), randn(3, 8, dtype=torch.float16))),
    ("bias_shape", ValueError, "bias", lambda: linear(randn(4, 8), randn(3, 8), randn(4))),
    ("bias_dtype", TypeError, "bias", lambda: linear(randn(4, 8), randn(3, 8), randn(3, dtype=torch.float16))),
    ("residual_shape", ValueError, "residual", lambda: linear(randn(4, 8), randn(3, 8), None, randn(4, 4))),
    ("swiglu_odd_w13", ValueError, "w13", lambda: linear_swiglu(randn(4, 8), randn(5, 8))),
    ("swiglu_K_mismatch", ValueError, "w13", lambda: linear_swiglu(randn(4, 8), randn(6, 7))),
    ("swiglu_int_w13", TypeError, "w13",
     lambda: linear_swiglu(randn(4, 8), torch.ones(6, 8, dtype=torch.int32, device=DEVICE))),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c[0])
def test_bad_input(case):
    assert_names_argument(*case[1:])


@pytest.mark.gpu
def test_linear_bf16_4096_cube():
    x = randn(4096, 4096, dtype=torch.bfloat16, requires_grad=True)
    w = randn(4096, 4096, dtype=torch.bfloat16, scale=4096 ** -0.5, requires_grad=True)
    b = randn(4096, dtype=torch.bfloat16, requires_grad=True)
    check(linear, ref_linear, [x, w, b], ["x", "weight", "bias"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l[0])
def test_gemm_tma_vs_pointer_gpu(layout, dtype):
    """The TMA path and the pointer path agree on Hopper (ragged sizes, aligned strides)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors need sm90+")
    _, make_a, make_b = layout
    a, b = make_a(1000, 1512, dtype), make_b(1512, 2056, dtype)
    ref = a.double() @ b.double()
    tma = gemm_module.gemm(a, b, torch.empty(1000, 2056, dtype=dtype, device=DEVICE), use_tma=True)
    ptr = gemm_module.gemm(a, b, torch.empty(1000, 2056, dtype=dtype, device=DEVICE), use_tma=False)
    with torch_tf32(dtype):
        same = a @ b
    assert_close("tma", tma, ref, same, atol=gemm_atol(dtype))
    assert_close("pointer", ptr, ref, same, atol=gemm_atol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("pingpong", [False, True], ids=["cooperative", "ping-pong"])
@pytest.mark.parametrize("grid", ["persistent", "dynamic", "tile-per-program"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("layout", LAYOUTS + [("A_cols-B_rows", _cols, _rows)], ids=lambda l: l[0])
def test_gemm_sm90_warp_specialized(layout, residual, grid, pingpong, monkeypatch, kernel_settings):
    """gemm_sm90's warp-specialized kernel (GemmSettings.sm90_ws, on by default; the first config of each
    schedule) on ragged sizes (no dimension a multiple of a tile, K shorter than the ring and longer than
    it), every operand layout, with and without the residual epilogue, each grid (the persistent one with
    static or dynamic tiles): against float64 and the default kernel, and the plan really is the Gluon kernel."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized Gluon GEMM is for sm90 (H100, H200)")
    _, make_a, make_b = layout
    configure_gemm(persistent=grid != "tile-per-program", dynamic=grid == "dynamic")
    tuned = importlib.import_module("tritonllm.kernels.gemm_sm90").ws_matmul_kernel_tuned
    monkeypatch.setattr(tuned, "configs", [c for c in tuned.configs if c.kwargs["PINGPONG"] is pingpong][:1])
    monkeypatch.setattr(tuned, "cache", {})
    for M, K, N in ((1000, 1512, 2056), (312, 72, 520), (4096, 4096, 4096)):  # 16-byte aligned strides: TMA
        a, b = make_a(M, K, torch.bfloat16), make_b(K, N, torch.bfloat16)
        e = randn(M, N, dtype=torch.bfloat16) if residual else None
        ref = a.double() @ b.double() + (e.double() if residual else 0)
        got = {}
        for ws in (True, False):
            configure_gemm(sm90_ws=ws)
            gemm_module._LAUNCH_CONFIGS.clear()
            for _ in range(2):  # planned, then from the plan
                got[ws] = gemm_module.gemm(a, b, poison_(torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)),
                                           residual=e)
            (plan,) = gemm_module._LAUNCH_CONFIGS.values()
            assert (plan[0].fn.__name__ == "ws_matmul_kernel") is ws
        with torch_tf32(torch.bfloat16):
            same = a @ b + (e if residual else 0)
        assert_close("sm90_ws", got[True], ref, same, atol=gemm_atol(torch.bfloat16))
        assert_close("default", got[False], ref, same, atol=gemm_atol(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("pingpong", [False, True], ids=["cooperative", "ping-pong"])
def test_gemm_sm90_dynamic_tiles(pingpong, monkeypatch, kernel_settings):
    """GemmSettings.dynamic (programs take tiles from a global counter): the same bits as the static schedule (a
    tile is one program's whole K loop either way), eagerly and replayed from a CUDA graph captured on a
    stream the counters have not seen, and the counters are back at zero after every launch, so the
    next launch on the stream starts from tile 0. A counter already past the last tile leaves the
    output unwritten: the kernel really takes its tiles from it."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized Gluon GEMM is for sm90 (H100, H200)")
    scratch = importlib.import_module("tritonllm.kernels.scratch")
    tuned = importlib.import_module("tritonllm.kernels.gemm_sm90").ws_matmul_kernel_tuned
    monkeypatch.setattr(tuned, "configs", [c for c in tuned.configs if c.kwargs["PINGPONG"] is pingpong][:1])
    monkeypatch.setattr(tuned, "cache", {})
    M, K, N = 4000, 1000, 3000  # several tiles per program on any Hopper part
    a, b = randn(M, K, dtype=torch.bfloat16), randn(K, N, dtype=torch.bfloat16)
    out = {}
    for dynamic in (False, True):
        configure_gemm(dynamic=dynamic)
        gemm_module._LAUNCH_CONFIGS.clear()
        runs = [gemm_module.gemm(a, b, poison_(torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)))
                for _ in range(3)]
        (plan,) = gemm_module._LAUNCH_CONFIGS.values()
        assert plan[0].kwargs["DYNAMIC"] is dynamic
        assert all(torch.equal(r, runs[0]) for r in runs)
        out[dynamic] = runs[0]
    assert torch.equal(out[True], out[False])
    assert_close("dynamic", out[True], a.double() @ b.double(), a @ b, atol=gemm_atol(torch.bfloat16))
    counter = scratch.tile_counter()
    counter[0] = 2**30  # every program's first index is past the last tile
    skipped = gemm_module.gemm(a, b, poison_(torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)))
    assert torch.isnan(skipped).all() and counter.tolist() == [0, 0]
    c = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        gemm_module.gemm(a, b, c)
    for _ in range(3):
        poison_(c)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(c, out[False])
    assert all(pair.tolist() == [0, 0] for pair in scratch._TILE_COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS + [("A_cols-B_rows", _cols, _rows)], ids=lambda l: l[0])
def test_gemm_sm90_every_config(layout):
    """Every config of gemm_sm90 (the autotuner may pick any), launched through ``gemm(config=...)``,
    on a ragged problem in every operand layout, against float64; a WS config for a problem its
    kernel does not take (a bias) is refused by name."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized Gluon GEMM is for sm90 (H100, H200)")
    ws = importlib.import_module("tritonllm.kernels.gemm_sm90")
    _, make_a, make_b = layout
    M, K, N = 1000, 1512, 2056
    a, b = make_a(M, K, torch.bfloat16), make_b(K, N, torch.bfloat16)
    ref = a.double() @ b.double()
    with torch_tf32(torch.bfloat16):
        same = a @ b
    for config in ws.configs():
        got = gemm_module.gemm(a, b, poison_(torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)), config=config)
        assert_close(f"sm90_ws {config.kwargs}", got, ref, same, atol=gemm_atol(torch.bfloat16))
    with pytest.raises(ValueError, match="config"):
        gemm_module.gemm(a, b, torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE),
                         bias=torch.zeros(N, dtype=torch.bfloat16, device=DEVICE), config=ws.configs()[0])


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["persistent", "dynamic", "tile-per-program"])
@pytest.mark.parametrize("store_gu", [False, True], ids=["h", "h+gu"])
@pytest.mark.parametrize("layout", LAYOUTS + [("A_cols-B_rows", _cols, _rows)], ids=lambda l: l[0])
def test_gemm_sm90_gated(layout, store_gu, grid, kernel_settings):
    """The WS kernel's gated (SwiGLU) forward on each grid: every config of ``configs(gated=True)``
    through ``gemm(config=...)``, on a ragged problem in every operand layout, h = silu(gate) * up and
    the pre-activations in gu against float64; a plain config is refused for it. Then with
    ``GemmSettings.sm90_ws_gated`` on, linear_swiglu's forward and backward through the autotuner, against the
    _matmul_kernel's."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized Gluon GEMM is for sm90 (H100, H200)")
    configure_gemm(persistent=grid != "tile-per-program", dynamic=grid == "dynamic")
    ws = importlib.import_module("tritonllm.kernels.gemm_sm90")
    _, make_a, make_b = layout
    M, K, N = 1000, 1512, 1032  # 2N: gate columns [0, N), up columns [N, 2N)
    a, b = make_a(M, K, torch.bfloat16), make_b(K, 2 * N, torch.bfloat16)
    g, u = (a.double() @ b.double()).chunk(2, dim=-1)
    with torch_tf32(torch.bfloat16):
        g_same, u_same = (a @ b).chunk(2, dim=-1)
    for config in ws.configs(gated=True):
        gu = poison_(torch.empty(M, 2 * N, dtype=torch.bfloat16, device=DEVICE)) if store_gu else None
        h = gemm_module.gemm(a, b, poison_(torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)), gu=gu,
                             epilogue=gemm_module.SWIGLU_FWD, config=config)
        name = f"sm90_ws gated {config.kwargs}"
        assert_close(name, h, g * torch.sigmoid(g) * u, g_same * torch.sigmoid(g_same) * u_same,
                     atol=gemm_atol(torch.bfloat16, chain=2))
        if store_gu:
            assert_close(name + " gu", gu, torch.cat([g, u], -1), torch.cat([g_same, u_same], -1),
                         atol=gemm_atol(torch.bfloat16))
    with pytest.raises(ValueError, match="gated"):
        gemm_module.gemm(a, b, torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE), epilogue=gemm_module.SWIGLU_FWD,
                         config=ws.configs()[0])
    x = randn(3, 333, K, dtype=torch.bfloat16, requires_grad=True)
    w13 = randn(2 * N, K, dtype=torch.bfloat16, scale=K ** -0.5, requires_grad=True)
    dy = randn(3, 333, N, dtype=torch.bfloat16)
    got = {}
    for gated in (True, False):
        configure_gemm(sm90_ws_gated=gated)
        gemm_module._LAUNCH_CONFIGS.clear()
        y = linear_swiglu(x, w13)
        got[gated] = (y, *torch.autograd.grad(y, (x, w13), dy))
        kernels = {plan[0].fn.__name__ for plan in gemm_module._LAUNCH_CONFIGS.values()
                   if plan[0].kwargs["EPILOGUE"] == gemm_module.SWIGLU_FWD}
        assert kernels == {"ws_matmul_kernel" if gated else "_matmul_kernel"}
    for name, ws_t, default in zip(("y", "dx", "dw13"), got[True], got[False]):
        assert_close(name, ws_t, default.double())


def test_configs_follow_the_devices_shared_memory(monkeypatch):
    """On a GPU with less shared memory per block (99 KiB: most consumer cards), the pruning keeps
    only configs that fit it, and shrinks one when none does."""
    a = torch.empty(8, 8, dtype=torch.bfloat16)
    configs = [gemm_module._config(*cfg) for cfg in gemm_module.GPU_CONFIGS]
    args = {"a_ptr": a, "c_ptr": a, "EPILOGUE": gemm_module.PLAIN, "TMA_STORE": True, "HAS_RESIDUAL": False,
            "ACCUMULATE": False}
    h100 = gemm_module.prune_configs(configs, args)
    monkeypatch.setattr(gemm_module, "smem_budget", lambda reserve: 99 * 1024 - reserve)
    small = gemm_module.prune_configs(configs, args)
    assert small and len(small) < len(h100)
    assert all(gemm_module._config_smem(c, args) <= 99 * 1024 - gemm_module.SMEM_RESERVE for c in small)
    monkeypatch.setattr(gemm_module, "smem_budget", lambda reserve: 24 * 1024 - reserve)
    (shrunk,) = gemm_module.prune_configs(configs, args)
    assert gemm_module._config_smem(shrunk, args) <= 24 * 1024 - gemm_module.SMEM_RESERVE


def test_autotune_key_holds_every_flag():
    """The autotuner reuses a config for every launch of the same key, so the key holds each flag of
    the problem, every one the shared-memory pruning reads included. HAS_RESIDUAL was missing: a
    config tuned for a 5x24x32 fp32 GEMM without a residual was reused with one and overflowed an
    H100's shared memory (262,176 bytes; opcheck of lora_linear_fwd)."""
    flags = set(gemm_module._FLAG_ARGS) - {"FP8"}  # FP8: a kernel of its own (_matmul_kernel_fp8_tuned)
    assert flags <= set(gemm_module._AUTOTUNE_KEY) and {"M", "N", "K"} <= set(gemm_module._AUTOTUNE_KEY)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("epilogue", [gemm_module.PLAIN, gemm_module.SWIGLU_FWD], ids=["plain", "swiglu"])
def test_configs_fit_shared_memory(epilogue, dtype):
    """Every config the autotuner may launch fits the shared-memory budget (an H100's here), float32 with two gated B tiles and a
    TMA-store staging tile included (there every tuned config overflows and one is shrunk)."""
    a = torch.empty(8, 8, dtype=dtype)
    configs = [gemm_module._config(*cfg) for cfg in gemm_module.GPU_CONFIGS]
    for tma_store, residual, accumulate in ((True, False, False), (False, False, False), (True, True, False),
                                            (True, False, True)):
        args = {"a_ptr": a, "c_ptr": a, "EPILOGUE": epilogue, "TMA_STORE": tma_store, "HAS_RESIDUAL": residual,
                "ACCUMULATE": accumulate}
        kept = gemm_module.prune_configs(configs, args)
        budget = smem_budget(gemm_module.SMEM_RESERVE)
        assert kept and all(gemm_module._config_smem(c, args) <= budget for c in kept), args
        if epilogue == gemm_module.SWIGLU_FWD:  # two accumulators: at most 128x128 each
            assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128 for c in kept), args
        if dtype == torch.bfloat16:
            assert len(kept) > 1, args


def test_gemm_launch_plans_follow_every_argument(poisoned_empty):
    """Cached gemm plans: one problem in turn with a transposed operand, a bias, a residual, the
    accumulate flag, another dtype and split-K, each twice (planned, then from the plan), gives the
    right product every time; under no_grad linear makes no autograd node."""
    gemm_module._LAUNCH_CONFIGS.clear()
    M, K, N = 37, 64, 48
    a, b = randn(M, K), randn(K, N, scale=K ** -0.5)
    bias, res, c0 = randn(N), randn(M, N), randn(M, N)
    a64, b64 = a.double(), b.double()
    problems = [
        ("plain", dict(a=a, b=b), a64 @ b64, a @ b),
        ("b as a transposed view", dict(a=a, b=b.t().contiguous().t()), a64 @ b64, a @ b),
        ("bias", dict(a=a, b=b, bias=bias), a64 @ b64 + bias.double(), a @ b + bias),
        ("residual", dict(a=a, b=b, residual=res), a64 @ b64 + res.double(), a @ b + res),
        ("accumulate", dict(a=a, b=b, accumulate=True), c0.double() + a64 @ b64, c0 + a @ b),
        ("float16", dict(a=a.half(), b=b.half()), a64 @ b64, a.half() @ b.half()),
        ("split-K", dict(a=a, b=b, split_k=2), a64 @ b64, a @ b),
    ]
    for name, kw, ref64, same in problems:
        for call in ("planned", "from the plan"):
            a_, b_ = kw.pop("a"), kw.pop("b")
            c = (c0.clone().to(a_.dtype) if kw.get("accumulate")
                 else poison_(torch.empty(M, N, dtype=a_.dtype, device=DEVICE)))
            with torch_tf32(a_.dtype):
                assert_close(f"{name} ({call})", gemm_module.gemm(a_, b_, c, **kw), ref64, same,
                             atol=gemm_atol(a_.dtype))
            kw.update(a=a_, b=b_)
    assert len(gemm_module._LAUNCH_CONFIGS) == len(problems)
    with torch.no_grad():
        y = linear(a.requires_grad_(), b.t())
    assert y.grad_fn is None
    assert_close("no_grad linear", y, a64 @ b64, a.detach() @ b, atol=gemm_atol(a.dtype))
