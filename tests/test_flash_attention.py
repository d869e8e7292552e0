"""flash_attention: forward output, lse and the gradients of q, k, v against a float64 reference.

The reference is an explicit softmax of ``q k^T * scale`` with the causal / window mask (bottom-right
aligned), GQA by repeating k and v heads in the reference only. Outputs the launchers allocate are
poisoned with NaN by ``torch.use_deterministic_algorithms`` (``fill_uninitialized_memory``), so an
element a kernel never writes fails the check.
"""

import functools
import importlib
from dataclasses import dataclass

import pytest
import torch

from _checks import DTYPES, assert_close, dtype_id, non_contiguous, randn
from tritonllm.bench import reference_ops as ref_ops
from tritonllm.kernels.flash_attention import flash_attention, flash_attention_bwd, flash_attention_fwd
from tritonllm.kernels.flash_attention.settings import KERNELS, MASK_KINDS, configure_attention
from tritonllm.kernels.split_heads import split_heads

fa_args = importlib.import_module("tritonllm.kernels.flash_attention.kernel_args")  # stream_flags and its device probes
fa_tuning = importlib.import_module("tritonllm.kernels.flash_attention.tuning")
fa_forward = importlib.import_module("tritonllm.kernels.flash_attention.forward")


@pytest.fixture(autouse=True)
def _poison_empty():
    """torch.empty returns NaN-filled memory while a test runs."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    Hq: int
    Hkv: int
    T: int
    S: int
    D: int
    causal: bool = True
    window: int | None = None
    scale: float | None = None


#: (out, lse) of the float64 reference (tritonllm.bench.reference_ops.attention)
reference = functools.partial(ref_ops.attention, return_lse=True)


def _inputs(c: Case, dtype, layout="contiguous"):
    """q, k, v requiring grad; ``packed``: slices of one [B, T, Hq + 2 Hkv, D] projection (T == S),
    ``strided-batch``: every other batch entry of a bigger buffer, ``strided-last-dim``: transposed
    [B, L, D, H] storage (copied by the launcher)."""
    if layout == "packed":
        qkv = randn(c.B, c.T, c.Hq + 2 * c.Hkv, c.D, dtype=dtype, requires_grad=True)
        return qkv.split([c.Hq, c.Hkv, c.Hkv], dim=2)
    if layout == "strided-last-dim":
        return tuple(randn(c.B, n, c.D, h, dtype=dtype).transpose(2, 3).requires_grad_()
                     for n, h in ((c.T, c.Hq), (c.S, c.Hkv), (c.S, c.Hkv)))
    q = randn(c.B, c.T, c.Hq, c.D, dtype=dtype, requires_grad=True)
    k = randn(c.B, c.S, c.Hkv, c.D, dtype=dtype, requires_grad=True)
    v = randn(c.B, c.S, c.Hkv, c.D, dtype=dtype, requires_grad=True)
    if layout == "strided-batch":
        return tuple(non_contiguous(t) for t in (q, k, v))
    return q, k, v


def _check_fwd_bwd(c: Case, dtype, layout="contiguous", strided_grad=False, deterministic=True):
    q, k, v = _inputs(c, dtype, layout)
    do = randn(c.B, c.T, c.Hq, c.D, dtype=dtype)
    if strided_grad:
        do = non_contiguous(do)
    out = flash_attention(q, k, v, causal=c.causal, window=c.window, softmax_scale=c.scale,
                          deterministic=deterministic)
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), do)

    def ref_in(t, ref_dtype):
        return t.detach().to(ref_dtype).requires_grad_()

    results = {}
    for ref_dtype in (torch.float64, dtype):
        qr, kr, vr = (ref_in(t, ref_dtype) for t in (q, k, v))
        ref_out, _ = reference(qr, kr, vr, c.causal, c.window, c.scale)
        results[ref_dtype] = (ref_out, *torch.autograd.grad(ref_out, (qr, kr, vr), do.to(ref_dtype)))
    ref64, same = results[torch.float64], results[dtype]
    for name, got, ref, own in zip(("out", "dq", "dk", "dv"), (out, *grads), ref64, same):
        assert_close(name, got, ref, same=own)


CASES = [
    Case("mha-causal-B2-T63", 2, 2, 2, 63, 63, 32),
    Case("mha-full-T100", 1, 2, 2, 100, 100, 64, causal=False),
    Case("gqa4:1-causal-T50", 1, 8, 2, 50, 50, 32),
    Case("mqa-causal-T17-S100", 1, 4, 1, 17, 100, 32),
    Case("mqa-full-B2-T7-S63", 2, 4, 1, 7, 63, 64, causal=False),
    Case("gqa2:1-window17-T63-S100", 1, 4, 2, 63, 100, 32, window=17),
    Case("mha-window40-T257", 1, 1, 1, 257, 257, 32, window=40),
    Case("gqa4:1-decode-T1-S257", 1, 8, 2, 1, 257, 64),
    Case("mqa-decode-window50-B2-T1-S100", 2, 4, 1, 1, 100, 32, window=50),
    Case("single-row-T1-S1", 1, 1, 1, 1, 1, 32),
    Case("scale0.3-T17", 1, 2, 1, 17, 17, 64, scale=0.3),
    Case("window1-T30", 1, 2, 2, 30, 30, 32, window=1),
    Case("empty-rows-T17-S5", 1, 2, 2, 17, 5, 32),
    Case("D96-T33", 1, 1, 1, 33, 33, 96),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_flash_attention(case, dtype):
    _check_fwd_bwd(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", ["packed", "strided-batch", "strided-last-dim"])
def test_flash_attention_strided_inputs(layout, dtype):
    _check_fwd_bwd(Case(layout, 2, 4, 2, 33, 33, 32), dtype, layout=layout, strided_grad=True)


@pytest.mark.parametrize("tma, one_loop", [(False, True), (True, False), (False, False)],
                         ids=["pointers-one-loop", "tma-three-loops", "pointers-three-loops"])
@pytest.mark.parametrize("case", [
    Case("gqa2:1-causal-T70-S100", 1, 4, 2, 70, 100, 32),
    Case("mha-window20-T100", 1, 2, 2, 100, 100, 32, window=20),
    Case("D96-full-T40", 1, 2, 1, 40, 40, 96, causal=False),
], ids=lambda c: c.name)
def test_flash_attention_knobs(case, tma, one_loop, kernel_settings):
    """The other values of the ``tma`` and ``one_loop`` settings (the defaults, both on, are covered above):
    float16, since fp32 never takes the tensor-descriptor path."""
    configure_attention(tma=dict.fromkeys(KERNELS, tma),
                        one_loop={name: dict.fromkeys(MASK_KINDS, one_loop) for name in KERNELS})
    _check_fwd_bwd(case, torch.float16)


@pytest.mark.parametrize("waves", [0, 3, None], ids=["one-pair-at-a-time", "groups-of-4-of-6", "all-pairs"])
def test_program_order(waves, kernel_settings):
    """The program order (``group_waves``: the (batch, head) pairs taken one, four (3 waves of the
    interpreter's 4 "SMs" over 3 tiles a pair) or all at a time, the last group short) visits every
    tile once: the reference holds, and every order gives the same bits (causal GQA, 3 query and 3
    key tiles per pair)."""
    case = Case("gqa3:1-causal-B2-T70", 2, 3, 1, 70, 70, 32)
    configure_attention(group_waves=dict.fromkeys(KERNELS, waves))
    _check_fwd_bwd(case, torch.float16)
    torch.manual_seed(0)
    q, k, v = _inputs(case, torch.float16)
    out = flash_attention(q, k, v)
    got = (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    configure_attention(group_waves=dict.fromkeys(KERNELS, 0))
    out = flash_attention(q, k, v)
    want = (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("L, D, tma", [(1024, 64, False), (1000, 64, False), (4096, 64, True), (1024, 128, True),
                                     (1000, 128, True), (8192, 32, True), (2048, 32, False)])
def test_tma_only_where_the_streamed_span_is_long_enough(L, D, tma, monkeypatch):
    """On the GPU a kernel streams through descriptors only from next_pow2(L) * D >= TMA_MIN_ELEMS;
    under the interpreter wherever the knob, dtype and alignment allow (tests' small shapes)."""
    t = torch.empty(1, L, 2, D, dtype=torch.float16)  # never launched: the flags only
    monkeypatch.setattr(fa_args, "tma_device", lambda device: True)
    monkeypatch.setattr(fa_args, "interpreting", lambda: True)
    assert fa_args.stream_flags("fwd", None, t, t)["USE_TMA"]
    monkeypatch.setattr(fa_args, "interpreting", lambda: False)
    monkeypatch.setattr(fa_args.triton, "set_allocator", lambda alloc: None)
    for kernel in KERNELS:
        assert fa_args.stream_flags(kernel, None, t, t)["USE_TMA"] is tma


@pytest.mark.parametrize("split_kv", [0, 1, 3], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("case", [
    Case("gqa2:1-causal-T40-S100", 1, 4, 2, 40, 100, 32),
    Case("gqa4:1-window9-T5-S70", 1, 4, 1, 5, 70, 64, window=9),
    Case("empty-rows-T9-S4", 1, 2, 1, 9, 4, 32),
], ids=lambda c: c.name)
def test_flash_attention_fwd_kernels(case, split_kv):
    """Each forward kernel (one-pass, split-KV with one or several splits) gives the same out and lse."""
    q, k, v = (t.detach() for t in _inputs(case, torch.float32))
    out, lse = flash_attention_fwd(q, k, v, case.causal, case.window, case.scale, split_kv=split_kv)
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), case.causal, case.window, case.scale)
    assert_close("out", out, ref_out)
    empty = torch.isinf(ref_lse)
    assert lse.dtype == torch.float32 and lse.shape == (case.B, case.Hq, case.T)
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly for rows that see no key"
    assert_close("lse", lse[~empty], ref_lse[~empty])


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5], CASES[9], CASES[12]], ids=lambda c: c.name)
def test_flash_attention_fused_backward(case):
    """deterministic=False (the fused backward, dQ by atomic adds) against the reference."""
    _check_fwd_bwd(case, torch.float32, deterministic=False)


@pytest.mark.parametrize("shape", [(2, 4, 2, 70, 70, 32), (1, 8, 2, 300, 300, 64)], ids=["gqa-T70", "gqa-T300"])
def test_flash_attention_deterministic(shape):
    """deterministic=True (the default) is bitwise reproducible; the fused backward (dQ by atomics in
    a varying order) agrees with it within rounding."""
    B, Hq, Hkv, T, S, D = shape
    c = Case("gqa", B, Hq, Hkv, T, S, D)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    q, k, v = (t.detach() for t in _inputs(c, dtype))
    do = randn(B, T, Hq, D, dtype=dtype)
    out, lse = flash_attention_fwd(q, k, v)
    first = flash_attention_bwd(do, q, k, v, out, lse, deterministic=True)
    second = flash_attention_bwd(do, q, k, v, out, lse, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two identical backward calls"
    # the fused backward against the float64 reference, with PyTorch in the inputs' dtype as the yardstick
    fused = flash_attention_bwd(do, q, k, v, out, lse, deterministic=False)
    refs = {}
    for ref_dtype in (torch.float64, dtype):
        qr, kr, vr = (t.to(ref_dtype).requires_grad_() for t in (q, k, v))
        refs[ref_dtype] = torch.autograd.grad(reference(qr, kr, vr)[0], (qr, kr, vr), do.to(ref_dtype))
    for name, got, ref, own in zip(("dq", "dk", "dv"), fused, refs[torch.float64], refs[dtype]):
        assert_close(name, got, ref, same=own)


def test_flash_attention_packed_gradient():
    """With T == S, dq, dk, dv are head slices of one [B, T, Hq + 2 Hkv, D] buffer, and the model's
    chain (split_heads, RoPE with its in-place backward, split_heads) hands it on as the gradient of
    the packed qkv projection without a pack kernel or a copy."""
    from tritonllm.kernels.rope import rope, rope_cos_sin

    B, T, Hq, Hkv, D = 2, 19, 4, 2, 32
    q, k, v = (t.detach() for t in _inputs(Case("gqa", B, Hq, Hkv, T, T, D), torch.float32))
    out, lse = flash_attention_fwd(q, k, v)
    dq, dk, dv = flash_attention_bwd(randn(B, T, Hq, D), q, k, v, out, lse, packed=True)
    base = dq.data_ptr()
    assert dq.stride() == dk.stride() == dv.stride() == (T * (Hq + 2 * Hkv) * D, (Hq + 2 * Hkv) * D, D, 1)
    assert dk.data_ptr() == base + Hq * D * 4 and dv.data_ptr() == base + (Hq + Hkv) * D * 4

    cos, sin = rope_cos_sin(T, D)
    qkv = randn(B, T, Hq + 2 * Hkv, D, requires_grad=True)
    qkv64 = qkv.detach().double().requires_grad_()
    qk, v = split_heads(qkv, (Hq + Hkv, Hkv))
    q, k = split_heads(rope(qk, cos, sin, in_place_backward=True), (Hq, Hkv))
    out = flash_attention(q, k, v)
    do = randn(B, T, Hq, D)

    class NoPacking(dict):
        def get(self, key):
            raise AssertionError("split_heads launched a pack kernel for adjacent gradients")

    sh_module = importlib.import_module("tritonllm.kernels.split_heads")
    saved = sh_module._PLANS
    sh_module._PLANS = NoPacking()
    try:
        (dqkv,) = torch.autograd.grad(out, qkv, do)
    finally:
        sh_module._PLANS = saved
    # the reference: rope in float64 as plain tensor ops, then attention
    c64, s64 = cos.double(), sin.double()
    x1, x2 = qkv64[:, :, :Hq + Hkv].chunk(2, dim=-1)
    cc, ss = c64[None, :, None], s64[None, :, None]
    rot = torch.cat([x1 * cc - x2 * ss, x2 * cc + x1 * ss], dim=-1)
    ref_out, _ = reference(rot[:, :, :Hq], rot[:, :, Hq:], qkv64[:, :, Hq + Hkv:])
    (ref,) = torch.autograd.grad(ref_out, qkv64, do.double())
    assert_close("dqkv", dqkv, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("B, T, Hq, Hkv, D, window, lengths", [
    (2, 19, 4, 2, 32, None, None), (1, 33, 2, 2, 64, 7, None), (1, 1, 4, 1, 32, None, None),
    (2, 24, 4, 2, 32, None, [5, 1, 18])], ids=["gqa", "mha-window7", "one-token", "documents"])
def test_rope_flash_attention(B, T, Hq, Hkv, D, window, lengths, dtype):
    """RoPE + attention over a packed qkv against the float64 reference, eagerly (its autograd Function) and
    as the op pair torch.compile calls, with the same setup/backward pair (one buffer for the qkv gradient,
    rotated back in place): both the reference's values, and bitwise equal to each other."""
    from tritonllm.data.sft import document_bounds
    from tritonllm.kernels.custom_op import COMPILED
    from tritonllm.kernels.flash_attention import rope_flash_attention
    from tritonllm.kernels.rope import rope_cos_sin

    cos, sin = rope_cos_sin(T + 3, D)
    qkv = randn(B, T, Hq + 2 * Hkv, D, dtype=dtype, requires_grad=True)
    do = randn(B, T, Hq, D, dtype=dtype)
    documents = doc_ids = None
    if lengths is not None:
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(B, T).contiguous()
        documents = torch.from_numpy(document_bounds(doc_ids.numpy())).to(qkv.device)
        doc_ids = doc_ids.to(qkv.device)
    results = []
    for fn in (rope_flash_attention, COMPILED["rope_flash_attention"]):
        out = fn(qkv, cos, sin, Hq, Hkv, window=window, documents=documents)
        results.append((out, *torch.autograd.grad(out, qkv, do)))
    for got, eager in zip(results[1], results[0]):
        assert torch.equal(got, eager)
    expected = {}
    for ref_dtype in (torch.float64, dtype):
        x = qkv.detach().to(ref_dtype).requires_grad_()
        qk = ref_ops.rope(x[:, :, :Hq + Hkv], cos.to(ref_dtype), sin.to(ref_dtype))
        out, _ = reference(qk[:, :, :Hq], qk[:, :, Hq:], x[:, :, Hq + Hkv:], True, window, doc_ids=doc_ids)
        expected[ref_dtype] = (out, *torch.autograd.grad(out, x, do.to(ref_dtype)))
    for name, got, ref, own in zip(("out", "dqkv"), results[0], expected[torch.float64], expected[dtype]):
        assert_close(name, got, ref, same=own)


@pytest.mark.parametrize("heads, n_heads, n_kv_heads, match", [
    (8, 4, 1, r"qkv: 8 heads, expected n_heads \+ 2 n_kv_heads = 6"),
    (8, 3, 2, r"n_heads: 3 must be a positive multiple of n_kv_heads \(2\)"),
    (8, 4, 0, r"n_heads: 4 must be a positive multiple of n_kv_heads \(0\)")])
def test_rope_flash_attention_bad_heads(heads, n_heads, n_kv_heads, match):
    from tritonllm.kernels.custom_op import COMPILED
    from tritonllm.kernels.flash_attention import rope_flash_attention
    from tritonllm.kernels.rope import rope_cos_sin

    cos, sin = rope_cos_sin(8, 32)
    for fn in (rope_flash_attention, COMPILED["rope_flash_attention"]):
        with pytest.raises(ValueError, match=match):
            fn(randn(1, 8, heads, 32), cos, sin, n_heads, n_kv_heads)


def _qkv(B=1, T=8, Hq=4, Hkv=2, D=32, S=None, dtype=torch.float32):
    S = T if S is None else S
    return randn(B, T, Hq, D, dtype=dtype), randn(B, S, Hkv, D, dtype=dtype), randn(B, S, Hkv, D, dtype=dtype)


@pytest.mark.parametrize("make, kwargs, error, match", [
    (lambda: _qkv(Hq=6, Hkv=4), {}, ValueError, "Hq=6 heads of q"),
    (lambda: _qkv(D=48), {}, ValueError, "head dim D=48 of q, k, v"),
    (lambda: (randn(2, 8, 4, 32),) + _qkv()[1:], {}, ValueError, "q and k, v must have the same batch"),
    (lambda: (randn(1, 8, 4, 64),) + _qkv()[1:], {}, ValueError, "q and k, v must have the same head dim"),
    (lambda: _qkv()[:2] + (randn(1, 9, 2, 32),), {}, ValueError, "k and v must have the same shape"),
    (lambda: _qkv()[:2] + (randn(1, 8, 2, 32, dtype=torch.float16),), {}, TypeError, "v is float16"),
    (lambda: (randn(8, 4, 32),) + _qkv()[1:], {}, ValueError, "q must have 4 dimensions"),
    (lambda: _qkv()[:1] + (randn(1, 8, 2, 32, 1),) + _qkv()[2:], {}, ValueError, "k must have 4 dimensions"),
    (lambda: (_qkv()[0].tolist(),) + _qkv()[1:], {}, TypeError, "q must be a torch.Tensor"),
    (lambda: _qkv(), {"window": 0}, ValueError, "window must be >= 1"),
    (lambda: _qkv(), {"window": 4, "causal": False}, ValueError, "window requires causal=True"),
    (lambda: _qkv(), {"window": 2.5}, TypeError, "window must be an int"),
    (lambda: _qkv(), {"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
    (lambda: _qkv(S=0), {}, ValueError, "q and k, v must be non-empty"),
], ids=["heads-not-multiple", "head-dim-48", "batch-mismatch", "head-dim-mismatch", "kv-shape-mismatch",
        "dtype-mismatch", "q-rank-3", "k-rank-5", "q-not-tensor", "window-0", "window-not-causal", "window-float",
        "scale-nan", "empty-keys"])
def test_flash_attention_bad_input(make, kwargs, error, match):
    q, k, v = make()
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **kwargs)


def test_flash_attention_bad_split_kv():
    with pytest.raises(ValueError, match="split_kv"):
        flash_attention_fwd(*_qkv(), split_kv=-1)


def test_flash_attention_bwd_bad_lse():
    q, k, v = _qkv()
    out, lse = flash_attention_fwd(q, k, v)
    with pytest.raises(ValueError, match="lse must have shape"):
        flash_attention_bwd(torch.ones_like(out), q, k, v, out, lse[:, :, :4])
    with pytest.raises(ValueError, match="do and o must have the shape of q"):
        flash_attention_bwd(torch.ones_like(out)[:, :4], q, k, v, out, lse)


# ----------------------------------------------------------------------------- GPU only (bf16, large)
# Kept few: each (head dim, mask kind, dtype) compiles its kernels on first use (one pinned config
# each under tests/conftest.py's TRITONLLM_NO_AUTOTUNE=1, every config when autotuning).

@pytest.mark.gpu
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_flash_attention_gpu_head_dims(D):
    _check_fwd_bwd(Case("gqa4:1-causal-B2-T1000", 2, 8, 2, 1000, 1000, D), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("case, dtype", [
    (Case("gqa4:1-causal-T8192-D128", 1, 8, 2, 8192, 8192, 128), torch.bfloat16),
    (Case("gqa4:1-causal-T8192-D128", 1, 8, 2, 8192, 8192, 128), torch.float16),
    (Case("mqa-window1024-T8192-D64", 1, 4, 1, 8192, 8192, 64, window=1024), torch.bfloat16),
    (Case("gqa2:1-window256-T3000-D256", 1, 4, 2, 3000, 3000, 256, window=256), torch.bfloat16),
    (Case("mha-full-T777-S1500-D128", 1, 4, 4, 777, 1500, 128, causal=False), torch.bfloat16),
], ids=lambda x: x.name if isinstance(x, Case) else dtype_id(x))
def test_flash_attention_gpu_long(case, dtype):
    _check_fwd_bwd(case, dtype)


#: the Gluon kernels' GPU cases: GQA with ragged T, full attention with T != S, MQA, rows that see no key, one token
SM90_CASES = [
    Case("gqa4:1-causal-B2-T1000-D128", 2, 8, 2, 1000, 1000, 128),
    Case("mha-full-T777-S1500-D128", 1, 4, 4, 777, 1500, 128, causal=False),
    Case("gqa3:1-causal-B2-T1000-D64", 2, 6, 2, 1000, 1000, 64),
    Case("mqa-causal-T257-S300-D128", 2, 8, 1, 257, 300, 128),
    Case("empty-rows-T17-S5-D128", 1, 2, 1, 17, 5, 128),
    Case("single-row-T1-S1-D64", 1, 2, 2, 1, 1, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: c.name)
def test_flash_attention_sm90_forward(case, kernel_settings):
    """The Hopper forward (forward_sm90, at the head dims of the sm90_fwd setting, here both) against the
    reference, its output and lse beside the portable kernel's, and the backward from its lse."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward is for sm90 (H100, H200)")
    configure_attention(sm90_fwd=(64, 128))
    _check_fwd_bwd(case, torch.bfloat16)
    q, k, v = (t.detach() for t in _inputs(case, torch.bfloat16, "packed" if case.T == case.S else "contiguous"))
    assert fa_forward.forward_sm90.supported(q, k, v, None, None)
    out, lse = flash_attention_fwd(q, k, v, case.causal, split_kv=0)  # one pass: short T would take split-KV
    configure_attention(sm90_fwd=())
    ref_out, ref_lse = flash_attention_fwd(q, k, v, case.causal, split_kv=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert_close("out", out, ref_out.double())
    assert_close("lse", lse[~torch.isneginf(lse)], ref_lse[~torch.isneginf(ref_lse)].double(), atol=1e-4)


@pytest.mark.parametrize("B,Hq,T,S,causal,programs", [(2, 3, 1000, 1000, True, 7), (1, 2, 1, 1, True, 132),
                                                       (3, 4, 777, 1500, False, 5), (4, 16, 2048, 2048, True, 132)])
def test_sm90_forward_schedule(B, Hq, T, S, causal, programs):
    """forward_sm90.schedule: every query tile exactly once, the counts in column 0, loads balanced as a greedy
    list schedule balances them (no program above the mean load by more than the longest tile), and the same
    table when computed again."""
    fwd = fa_forward.forward_sm90
    group = fa_tuning.group_programs("fwd")
    table = fwd.schedule(B, Hq, T, S, causal, programs, group, torch.device("cpu"))
    n_tiles = -(-T // fwd.SCHED_BLOCK_M)
    assert table.dtype == torch.int32 and table.shape[0] == min(programs, n_tiles * B * Hq)
    codes = [c for row in table.tolist() for c in row[1:1 + row[0]]]
    assert sorted(codes) == list(range(n_tiles * B * Hq))

    def cost(code):
        m0 = (n_tiles - 1 - code % n_tiles) * fwd.SCHED_BLOCK_M
        keys = min(min(m0 + fwd.SCHED_BLOCK_M, T) + S - T, S) if causal else S
        return max(keys, 1) / fwd.SCHED_BLOCK_M + fwd.SCHED_TILE_COST

    loads = [sum(cost(c) for c in row[1:1 + row[0]]) for row in table.tolist()]
    assert max(loads) <= sum(loads) / len(loads) + max(cost(c) for c in codes) + 1e-9
    assert torch.equal(table, fwd.schedule.__wrapped__(B, Hq, T, S, causal, programs, group, torch.device("cpu")))


def test_sm90_backward_head_rows():
    """backward_sm90._head_rows: the TMA matrix of one batch entry for each layout the Gluon backward reads,
    None for the others (which keep the portable kernel)."""
    rows = importlib.import_module("tritonllm.kernels.flash_attention.backward_sm90")._head_rows
    B, L, H, D = 2, 40, 3, 64
    base = torch.zeros(B, L, H + 2, D, dtype=torch.bfloat16)
    assert rows(base[:, :, :H]) == (L, H * D, 0, D)  # packed qkv slice: heads side by side
    assert rows(torch.zeros(B, L, H, D, dtype=torch.bfloat16)) == (L, H * D, 0, D)
    assert rows(torch.zeros(B, H, L, D, dtype=torch.bfloat16).transpose(1, 2)) == (H * L, D, L, 0)
    assert rows(torch.zeros(B, L, D, H, dtype=torch.bfloat16).transpose(2, 3)) is None  # last dim strided
    assert rows(torch.zeros(B, L, H, D + 4, dtype=torch.bfloat16)[..., :D]) is None  # 136-byte head stride: no TMA
    assert rows(torch.zeros(B, L, 1, D, dtype=torch.bfloat16)) == (L, D, 0, D)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("config", range(4), ids=lambda i: f"config{i}")
def test_flash_attention_sm90_backward(case, config, monkeypatch, kernel_settings):
    """The Hopper backward (backward_sm90's dK/dV and dQ, at the head dims of the sm90_bwd setting, here both;
    each of their configs) against the float64 reference, beside the portable kernels' gradients, and
    bitwise the same in a second run (the deterministic backward), for both head layouts."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is for sm90 (H100, H200)")
    sm90 = importlib.import_module("tritonllm.kernels.flash_attention.backward_sm90")
    configure_attention(sm90_bwd={"dkdv": (64, 128), "dq": (64, 128)})
    for tuned in (sm90._dkdv_kernel, sm90._dq_kernel):  # the i-th config of each (the i-th modulo their number)
        monkeypatch.setattr(tuned, "configs", [tuned.configs[config % len(tuned.configs)]])
    _check_fwd_bwd(case, torch.bfloat16)
    layout = "packed" if case.T == case.S else "contiguous"
    side_by_side = [t.detach() for t in _inputs(case, torch.bfloat16, layout)]
    # [B, H, L, D] storage seen as [B, L, H, D] (the benchmark's inputs): heads are row blocks
    head_major = [randn(case.B, h, n, case.D, dtype=torch.bfloat16).transpose(1, 2)
                  for n, h in ((case.T, case.Hq), (case.S, case.Hkv), (case.S, case.Hkv))]
    for q, k, v in (side_by_side, head_major):
        do = randn(case.B, case.T, case.Hq, case.D, dtype=torch.bfloat16)
        assert sm90.matrix_args(q, k, v, do, None, None) is not None
        out, lse = flash_attention_fwd(q, k, v, case.causal)
        configure_attention(sm90_bwd={"dkdv": (64, 128), "dq": (64, 128)})
        grads = flash_attention_bwd(do, q, k, v, out, lse, case.causal)
        again = flash_attention_bwd(do, q, k, v, out, lse, case.causal)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))
        configure_attention(sm90_bwd={"dkdv": (), "dq": ()})
        ref = flash_attention_bwd(do, q, k, v, out, lse, case.causal)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            assert_close(name, got, want.double())


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("config", range(3), ids=lambda i: f"config{i}")
def test_flash_attention_sm90_fused_backward(case, config, monkeypatch, kernel_settings):
    """deterministic=False on Hopper: backward_sm90's dK/dV kernel with DQ_REDUCE (a writer warp adding dQ by
    TMA bulk reduces into the fp32 accumulator), each of its configs, against the float64 reference, and
    within rounding of the deterministic backward (the adds' order varies, so not bitwise)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is for sm90 (H100, H200)")
    sm90 = importlib.import_module("tritonllm.kernels.flash_attention.backward_sm90")
    configure_attention(sm90_bwd={"dkdv": (64, 128), "dq": (64, 128)})
    configure_attention(sm90_fused=(64, 128))
    monkeypatch.setattr(sm90._dkdv_reduce_kernel, "configs", [sm90._dkdv_reduce_kernel.configs[config]])
    _check_fwd_bwd(case, torch.bfloat16, deterministic=False)
    q, k, v = (t.detach() for t in _inputs(case, torch.bfloat16, "contiguous"))
    do = randn(case.B, case.T, case.Hq, case.D, dtype=torch.bfloat16)
    out, lse = flash_attention_fwd(q, k, v, case.causal)
    fused = flash_attention_bwd(do, q, k, v, out, lse, case.causal, deterministic=False)
    exact = flash_attention_bwd(do, q, k, v, out, lse, case.causal)
    for name, got, want in zip(("dq", "dk", "dv"), fused, exact):
        assert_close(name, got, want.double())


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    Case("decode-gqa4:1-B8-T1-S4096", 8, 32, 8, 1, 4096, 128),
    Case("decode-mqa-B4-T4-S3001", 4, 8, 1, 4, 3001, 64),
    Case("decode-window512-B2-T1-S5000", 2, 16, 4, 1, 5000, 128, window=512),
    Case("chunk-gqa4:1-T64-S8192", 1, 8, 2, 64, 8192, 128),
], ids=lambda c: c.name)
def test_flash_attention_gpu_decode(case):
    _check_fwd_bwd(case, torch.bfloat16)


def test_launch_plans_follow_every_argument():
    """Cached launch plans of the training kernels: one shape in turn with another window, no causal
    mask, another scale, a strided batch, another dtype, and again as first (planned, then from the
    plan) gives the right output and gradients every time; under no_grad no autograd node is made."""
    fa_forward._fwd_kernel.plans.clear()
    base = Case("plans", 1, 4, 2, 40, 40, 32)
    variants = [(base, torch.float32, "contiguous"), (Case("window", 1, 4, 2, 40, 40, 32, window=7), torch.float32,
                                                     "contiguous"),
                (Case("full", 1, 4, 2, 40, 40, 32, causal=False), torch.float32, "contiguous"),
                (Case("scale", 1, 4, 2, 40, 40, 32, scale=0.3), torch.float32, "contiguous"),
                (base, torch.float32, "strided-batch"), (base, torch.float16, "contiguous"),
                (base, torch.float32, "contiguous")]
    for c, dtype, layout in variants:
        _check_fwd_bwd(c, dtype, layout)
    # the scale is a runtime argument, and the last call repeats the first: five plans
    assert len(fa_forward._fwd_kernel.plans) == 5
    q, k, v = _inputs(base, torch.float32)
    with torch.no_grad():
        out = flash_attention(q, k, v)
    assert out.grad_fn is None
    assert_close("no_grad out", out, reference(q.double(), k.double(), v.double())[0],
                 same=reference(q.detach(), k.detach(), v.detach())[0])


@pytest.mark.parametrize("window", [None, 4], ids=["causal", "window4"])
@pytest.mark.parametrize("T", [1, 2], ids=lambda t: f"T{t}")
def test_flash_attention_decode_device_length(T, window):
    """flash_attention_decode over a static cache of 40 rows, the valid length read from a device
    tensor, equals the float64 reference over the first n rows, for n = 1 (with T = 1), 5, 17 and the
    whole cache; the split grid is sized for the cache (4 splits), so the splits past n do no work."""
    from tritonllm.kernels.flash_attention import flash_attention_decode

    B, Hq, Hkv, D, S_max = 2, 4, 2, 32, 40
    k_cache, v_cache = randn(B, S_max, Hkv, D), randn(B, S_max, Hkv, D)
    q = randn(B, T, Hq, D)
    for n in (1, 5, 17, S_max):
        if n < T:
            continue
        for dtype in (torch.int32, torch.int64):
            out = flash_attention_decode(q, k_cache, v_cache, torch.tensor(n, dtype=dtype, device=q.device),
                                         window=window, split_kv=4)
            ref64, _ = reference(*(t.double() for t in (q, k_cache[:, :n], v_cache[:, :n])), window=window)
            same, _ = reference(q, k_cache[:, :n], v_cache[:, :n], window=window)
            assert_close(f"decode n={n}", out, ref64, same=same)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kv_len": 5}, ValueError, "kv_len"),
    ({"kv_len": torch.tensor([5])}, ValueError, "kv_len"),
    ({"kv_len": torch.tensor(5.0)}, ValueError, "kv_len"),
    ({"split_kv": 0}, ValueError, "split_kv"),
    ({"window": 0}, ValueError, "window"),
], ids=["int", "1d", "float", "split0", "window0"])
def test_flash_attention_decode_bad_input(kwargs, error, match):
    from tritonllm.kernels.flash_attention import flash_attention_decode

    q, k, v = _qkv(T=1, S=8)
    args = {"kv_len": torch.tensor(5, device=q.device), **kwargs}
    if isinstance(args["kv_len"], torch.Tensor):
        args["kv_len"] = args["kv_len"].to(q.device)
    with pytest.raises(error, match=match):
        flash_attention_decode(q, k, v, **args)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fused"])
@pytest.mark.parametrize("case, lengths", [
    (Case("gqa2:1-docs-T70", 2, 4, 2, 70, 70, 32), [[20, 1, 49], [70]]),
    (Case("mha-docs-window9-T50", 1, 2, 2, 50, 50, 32, window=9), [[13, 30, 7]]),
    (Case("mqa-docs-full-T40", 1, 4, 1, 40, 40, 64, causal=False), [[17, 23]]),
], ids=lambda x: x.name if isinstance(x, Case) else "")
def test_flash_attention_documents(case, lengths, deterministic):
    """Packed documents: each position attends only within its own document (block-diagonal mask,
    causal and window inside it); out and every gradient against the float64 reference."""
    from tritonllm.data.sft import document_bounds

    B, T = case.B, case.T
    ids = torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in lengths] * (B // len(lengths)))
    q, k, v = _inputs(case, torch.float32)
    docs = torch.from_numpy(document_bounds(ids.numpy())).to(q.device)
    ids = ids.to(q.device)
    do = randn(B, T, case.Hq, case.D)
    out = flash_attention(q, k, v, causal=case.causal, window=case.window, deterministic=deterministic,
                          documents=docs)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = ref_ops.attention(q64, k64, v64, case.causal, case.window, doc_ids=ids)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert_close(name, got, want)


def test_flash_attention_documents_bad_input():
    q, k, v = _qkv(T=8)
    with pytest.raises(TypeError, match="documents"):
        flash_attention(q, k, v, documents=torch.zeros(1, 8, 2, dtype=torch.int64, device=q.device))
    with pytest.raises(ValueError, match=r"documents must have shape \(1, 8, 2\)"):
        flash_attention(q, k, v, documents=torch.zeros(1, 8, 3, dtype=torch.int32, device=q.device))
    q, k, v = _qkv(T=4, S=8)
    with pytest.raises(ValueError, match="as many keys as queries"):
        flash_attention(q, k, v, documents=torch.zeros(1, 4, 2, dtype=torch.int32, device=q.device))
