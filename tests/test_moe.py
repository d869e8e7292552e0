"""Mixture-of-Experts kernels against float64 PyTorch references that loop over experts: router
(indices, weights, aux and z losses and their gradients), sort/gather/combine, grouped GEMM
(+ SwiGLU), the MoE layer and module, and a short training run of void_moe_tiny."""

from __future__ import annotations

import types

import pytest
import torch

from _checks import DEVICE, DTYPES, ON_GPU, assert_close, dtype_id, gemm_atol, non_contiguous, randn
from tritonllm.bench.reference_ops import grouped_linear as ref_grouped
from tritonllm.bench.reference_ops import moe as ref_moe
from tritonllm.bench.reference_ops import moe_router as ref_router
from tritonllm.kernels import (configure_gemm, grouped_linear, grouped_linear_swiglu, moe, moe_combine, moe_gather,
                               moe_router, moe_sort)


def offsets_of(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def random_topk(T, E, k):
    """Distinct experts per token, as a router picks them."""
    return torch.rand(T, E).argsort(dim=1)[:, :k].to(torch.int32).to(DEVICE)


# ----------------------------------------------------------------------------------------- router


#: (T, E, k, score, normalize): odd T and E, a single token, k = E, every scoring variant
ROUTER_CASES = [(1, 4, 1, "softmax", True), (17, 5, 2, "sigmoid", True), (100, 7, 3, "softmax", False),
                (123, 64, 8, "softmax", True), (300, 16, 4, "sigmoid", False), (63, 5, 5, "sigmoid", True)]


def router_id(case):
    T, E, k, score, normalize = case
    return f"T{T}-E{E}-k{k}-{score}{'-norm' if normalize else ''}"


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", ROUTER_CASES, ids=router_id)
def test_router(case, dtype, poisoned_empty):
    T, E, k, score, normalize = case
    logits = randn(T, E, dtype=dtype, scale=2.0, requires_grad=True)
    r = moe_router(logits, k, score=score, normalize=normalize)
    assert r.indices.dtype == torch.int32 and r.indices.shape == (T, k)
    assert r.weights.dtype == torch.float32 and r.weights.shape == (T, k)
    # the chosen experts are distinct and hold the k largest logits, in decreasing order (ties in
    # fp16 may pick either index)
    assert (r.indices.sort(1).values.diff(dim=1) > 0).all()
    chosen = logits.detach().gather(1, r.indices.long())
    assert torch.equal(chosen, logits.detach().topk(k, dim=1).values)
    counts = torch.bincount(r.indices.long().flatten(), minlength=E)
    assert torch.equal(r.counts.long().cpu(), counts.cpu())
    assert r.max_load.item() == pytest.approx(counts.max().item() * E / (T * k))

    l64 = logits.detach().double().requires_grad_()
    w64, aux64, z64 = ref_router(l64, r.indices, score, normalize)
    l32 = logits.detach().float().requires_grad_()
    w32, aux32, z32 = ref_router(l32, r.indices, score, normalize)
    assert_close("weights", r.weights, w64, w32)
    assert_close("aux_loss", r.aux_loss, aux64, aux32)
    assert_close("z_loss", r.z_loss, z64, z32)
    dw = randn(T, k)
    for name, out, o64, o32, g in [("weights", r.weights, w64, w32, dw), ("aux_loss", r.aux_loss, aux64, aux32, None),
                                   ("z_loss", r.z_loss, z64, z32, None)]:
        (d,) = torch.autograd.grad(out, logits, g, retain_graph=True)
        (d64,) = torch.autograd.grad(o64, l64, None if g is None else g.double(), retain_graph=True)
        (d32,) = torch.autograd.grad(o32, l32, g, retain_graph=True)
        assert d.dtype == dtype
        assert_close(f"dlogits from {name}", d, d64, d32.to(dtype))


def test_router_all_gradients_at_once():
    """One backward through weights, aux_loss and z_loss together, logits a strided view."""
    logits = non_contiguous(randn(37, 6, requires_grad=True))
    r = moe_router(logits, 2)
    dw = randn(37, 2)
    (d,) = torch.autograd.grad((r.weights * dw).sum() + 0.3 * r.aux_loss + 0.7 * r.z_loss, logits)
    l64 = logits.detach().double().requires_grad_()
    w64, aux64, z64 = ref_router(l64, r.indices, "softmax", True)
    (d64,) = torch.autograd.grad((w64 * dw.double()).sum() + 0.3 * aux64 + 0.7 * z64, l64)
    assert_close("dlogits", d, d64)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(logits=randn(8)), ValueError, "logits"),
    (dict(logits=torch.ones(4, 3, dtype=torch.int64, device=DEVICE)), TypeError, "logits"),
    (dict(logits=randn(0, 4)), ValueError, "logits"),
    (dict(top_k=5), ValueError, "top_k"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(score="relu"), ValueError, "score"),
], ids=["1d-logits", "int-logits", "no-tokens", "top_k-above-E", "top_k-zero", "bad-score"])
def test_router_bad_inputs(kwargs, exc, match):
    args = {"logits": randn(8, 4), "top_k": 2, **kwargs}
    with pytest.raises(exc, match=match):
        moe_router(**args)


# ------------------------------------------------------------------------------- sort, gather, combine


def ref_positions(indices):
    """Stable sort of the flat assignments by expert: sorted row of each assignment, [T, k]."""
    order = torch.sort(indices.long().flatten().cpu(), stable=True).indices
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel())
    return pos.view(indices.shape)


#: (T, k, E, skewed): skewed puts half of the tokens' every slot on the last expert
SORT_CASES = [(1, 1, 1, False), (5, 2, 5, False), (100, 3, 7, False), (123, 8, 64, False), (300, 4, 16, False),
              (257, 2, 3, True)]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("case", SORT_CASES, ids=lambda c: "T{}-k{}-E{}{}".format(*c[:3], "-skewed" if c[3] else ""))
def test_sort(case, index_dtype, poisoned_empty):
    T, k, E, skewed = case
    if skewed:
        indices = torch.randint(0, E, (T, k), device=DEVICE)
        indices[: T // 2] = E - 1
    else:
        indices = random_topk(T, E, k)
    plan = moe_sort(indices.to(index_dtype), E)
    counts = torch.bincount(indices.long().flatten().cpu(), minlength=E)
    assert torch.equal(plan.expert_offsets.cpu().long(), torch.cat([torch.zeros(1, dtype=torch.long),
                                                                     counts.cumsum(0)]))
    pos = ref_positions(indices)
    assert torch.equal(plan.positions.cpu().long(), pos)
    assert torch.equal(plan.slots.cpu().long()[pos.flatten()], torch.arange(T * k))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", [(1, 1, 3, 8, False), (17, 2, 5, 100, True), (100, 3, 7, 123, False),
                                  (33, 4, 16, 1000, True)],
                         ids=lambda c: "T{}-k{}-E{}-H{}{}".format(*c[:4], "-strided-rows" if c[4] else ""))
def test_gather_combine(case, dtype, poisoned_empty):
    T, k, E, H, strided = case
    indices = random_topk(T, E, k)
    plan = moe_sort(indices, E)
    pos = ref_positions(indices).to(DEVICE)
    x = randn(T, H, dtype=dtype, requires_grad=True)
    x = non_contiguous(x) if strided else x
    xs = moe_gather(x, plan)
    token_of_row = torch.empty(T * k, dtype=torch.long, device=DEVICE)
    token_of_row[pos.flatten()] = torch.arange(T, device=DEVICE).repeat_interleave(k)
    assert torch.equal(xs, x.detach()[token_of_row])
    dxs = randn(T * k, H, dtype=dtype)
    (dx,) = torch.autograd.grad(xs, x, dxs)
    assert_close("dx", dx, dxs.double()[pos].sum(1), dxs[pos].sum(1))

    o = randn(T * k, H, dtype=dtype, requires_grad=True)
    o = non_contiguous(o) if strided else o
    w = torch.rand(T, k, device=DEVICE, requires_grad=True)
    y = moe_combine(o, w, plan)
    dy = randn(T, H, dtype=dtype)
    do, dw = torch.autograd.grad(y, (o, w), dy)
    o64, w64 = o.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = (w64[..., None] * o64[pos]).sum(1)
    do64, dw64 = torch.autograd.grad(y64, (o64, w64), dy.double())
    o_s, w_s = o.detach().clone().requires_grad_(), w.detach().to(dtype).requires_grad_()
    y_s = (w_s[..., None] * o_s[pos]).sum(1)
    do_s, dw_s = torch.autograd.grad(y_s, (o_s, w_s), dy)
    assert_close("y", y, y64, y_s)
    assert_close("d_expert_out", do, do64, do_s)
    assert_close("d_weights", dw, dw64, dw_s.float(), dtype=dtype)


def test_permutation_round_trip():
    """gather then combine with weights summing to 1 per token gives back x."""
    T, k, E, H = 57, 3, 7, 33
    plan = moe_sort(random_topk(T, E, k), E)
    x = randn(T, H)
    w = torch.softmax(randn(T, k), -1)
    assert_close("round trip", moe_combine(moe_gather(x, plan), w, plan), x.double())


def test_permute_bad_inputs():
    plan = moe_sort(random_topk(6, 4, 2), 4)
    with pytest.raises(TypeError, match="indices"):
        moe_sort(randn(6, 2), 4)
    with pytest.raises(ValueError, match="num_experts"):
        moe_sort(random_topk(6, 4, 2), 0)
    with pytest.raises(ValueError, match="x"):
        moe_gather(randn(5, 8), plan)
    with pytest.raises(ValueError, match="expert_out"):
        moe_combine(randn(11, 8), torch.rand(6, 2, device=DEVICE), plan)
    with pytest.raises(ValueError, match="weights"):
        moe_combine(randn(12, 8), torch.rand(6, 3, device=DEVICE), plan)
    with pytest.raises(TypeError, match="plan"):
        moe_gather(randn(6, 8), plan.positions)


# ------------------------------------------------------------------------------------- grouped GEMM

#: (expert row counts, K, N): empty experts, one expert with all rows, E not a power of two, a
#: single row; odd and power-of-two K and N
GROUPS = {"E5-empty-experts-K40-N70": ([0, 37, 1, 0, 33], 40, 70),
          "E7-one-expert-all-K40-N70": ([0, 0, 0, 70, 0, 0, 0], 40, 70),
          "E3-single-row-K40-N70": ([0, 1, 0], 40, 70),
          "E6-ragged-K64-N32": ([5, 17, 0, 40, 3, 9], 64, 32)}


@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", GROUPS.values(), ids=GROUPS.keys())
def test_grouped_linear(case, dtype, swiglu, poisoned_empty):
    counts, K, N = case
    E = len(counts)
    offsets = offsets_of(counts)
    x = randn(sum(counts), K, dtype=dtype, requires_grad=True)
    w = randn(E, 2 * N if swiglu else N, K, dtype=dtype, scale=K ** -0.5, requires_grad=True)
    fn = grouped_linear_swiglu if swiglu else grouped_linear
    y = fn(x, w, offsets)
    dy = randn(*y.shape, dtype=dtype)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    off = offsets.tolist()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = ref_grouped(x64, w64, off, swiglu)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    x_s, w_s = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_s = ref_grouped(x_s, w_s, off, swiglu)
    dx_s, dw_s = torch.autograd.grad(y_s, (x_s, w_s), dy)
    atol = gemm_atol(dtype, 2 if swiglu else 1)
    assert_close("y", y, y64, y_s, atol=atol)
    assert_close("dx", dx, dx64, dx_s, atol=atol)
    assert_close("w13.grad" if swiglu else "weight.grad", dw, dw64, dw_s, atol=atol)
    for e, c in enumerate(counts):
        if c == 0:
            assert (dw[e] == 0).all(), f"expert {e} has no rows but a non-zero weight gradient"


@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
def test_grouped_linear_one_program_per_tile_matches_persistent(swiglu):
    """``GemmSettings.persistent`` off (the grid beside NCCL: one program per possible tile, those past the
    device's tile count idle) gives the persistent grid's outputs bitwise, with more tiles than SMs and
    an empty expert."""
    counts, K, N = ([120, 0, 75, 200, 1], 40, 70) if not ON_GPU else ([3000, 0, 1500, 4000, 1], 512, 1024)
    offsets = offsets_of(counts)
    x = randn(sum(counts), K)
    w = randn(len(counts), 2 * N if swiglu else N, K, scale=K ** -0.5)
    fn = grouped_linear_swiglu if swiglu else grouped_linear
    out = {}
    for persistent in (True, False):
        with configure_gemm(persistent=persistent):
            out[persistent] = fn(x, w, offsets)
    assert torch.equal(out[True], out[False])


def test_grouped_linear_strided_inputs():
    """x with strided rows, weight a transposed view ([E, K, N] storage)."""
    counts = [9, 0, 23, 4, 1]
    offsets = offsets_of(counts).long()
    x = non_contiguous(randn(sum(counts), 33, requires_grad=True))
    w = randn(5, 33, 45, requires_grad=True)
    y = grouped_linear(x, w.transpose(1, 2), offsets)
    dy = randn(*y.shape)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = ref_grouped(x64, w64.transpose(1, 2), offsets.tolist(), False)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    assert_close("y", y, y64, atol=gemm_atol(torch.float32))
    assert_close("dx", dx, dx64, atol=gemm_atol(torch.float32))
    assert_close("weight.grad", dw, dw64, atol=gemm_atol(torch.float32))


def test_grouped_linear_bad_inputs():
    x, w, off = randn(10, 8), randn(3, 4, 8), offsets_of([3, 3, 4])
    with pytest.raises(ValueError, match="weight"):
        grouped_linear(x, w[0], off)
    with pytest.raises(ValueError, match="x"):
        grouped_linear(randn(10, 7), w, off)
    with pytest.raises(ValueError, match="expert_offsets"):
        grouped_linear(x, w, off[:3])
    with pytest.raises(TypeError, match="expert_offsets"):
        grouped_linear(x, w, off.float())
    with pytest.raises(TypeError, match="weight"):
        grouped_linear(x, w.half(), off)
    with pytest.raises(ValueError, match="w13"):
        grouped_linear_swiglu(x, randn(3, 5, 8), off)


# ------------------------------------------------------------------------------------ MoE layer


@pytest.mark.parametrize("shared,score,normalize", [(False, "softmax", True), (True, "sigmoid", False)],
                         ids=["routed-softmax-norm", "shared-expert-sigmoid"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_moe_layer(dtype, shared, score, normalize):
    T, D, E, k, F_ = 37, 24, 5, 2, 20
    x = randn(T, D, dtype=dtype, requires_grad=True)
    params = {"router_weight": randn(E, D, dtype=dtype, scale=0.5, requires_grad=True),
              "w13": randn(E, 2 * F_, D, dtype=dtype, scale=D ** -0.5, requires_grad=True),
              "w2": randn(E, D, F_, dtype=dtype, scale=F_ ** -0.5, requires_grad=True)}
    if shared:
        params["shared_w13"] = randn(2 * F_, D, dtype=dtype, scale=D ** -0.5, requires_grad=True)
        params["shared_w2"] = randn(D, F_, dtype=dtype, scale=F_ ** -0.5, requires_grad=True)
    y, r = moe(x, top_k=k, score=score, normalize=normalize, **params)
    # the kernel's choice is a top-k of the exact logits up to rounding of near-ties
    l64 = x.detach().double() @ params["router_weight"].detach().double().T
    kth = l64.topk(k, dim=1).values[:, -1:]
    assert (l64.gather(1, r.indices.long()) >= kth - (1e-2 if dtype != torch.float32 else 1e-5)).all()
    dy = randn(T, D, dtype=dtype)
    c_aux, c_z = 0.3, 0.05
    names = ["x", *params]
    inputs = [x, *params.values()]
    loss = (y.float() * dy.float()).sum() + c_aux * r.aux_loss + c_z * r.z_loss
    grads = torch.autograd.grad(loss, inputs)

    def run(cast):
        ins = [t.detach().to(cast).requires_grad_() for t in inputs]
        p = dict(zip(names[1:], ins[1:]))
        sh = (p["shared_w13"], p["shared_w2"]) if shared else None
        y_r, aux_r, z_r = ref_moe(ins[0], p["router_weight"], p["w13"], p["w2"], r.indices, score, normalize, sh)
        loss_r = (y_r * dy.to(cast)).sum() + c_aux * aux_r + c_z * z_r
        return y_r, aux_r, z_r, torch.autograd.grad(loss_r, ins)

    y64, aux64, z64, g64 = run(torch.float64)
    y_s, aux_s, z_s, g_s = run(dtype)
    atol = gemm_atol(dtype)
    assert_close("y", y, y64, y_s, atol=atol)
    # the fp32 losses come from logits rounded to the input dtype: that dtype's tolerance
    assert_close("aux_loss", r.aux_loss, aux64, aux_s.float(), atol=atol, dtype=dtype)
    assert_close("z_loss", r.z_loss, z64, z_s.float(), atol=atol, dtype=dtype)
    for name, g, r64, rs in zip(names, grads, g64, g_s):
        assert_close(f"{name}.grad", g, r64, rs, atol=atol)


@pytest.mark.parametrize("T", [37, 1], ids=["T37", "one-token"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_moe_layer_with_expert_lora(dtype, T):
    """LoRA on the routed experts against the float64 layer with the merged weights W + s B A: output and the
    gradients of x, the router and all four adapters (the frozen expert weights get none); experts without
    rows (one token routes to 2 of 5) included."""
    from tritonllm.kernels.moe import ExpertLoRA

    D, E, k, F_, r, s = 24, 5, 2, 20, 4, 2.5
    x = randn(T, D, dtype=dtype, requires_grad=True)
    router = randn(E, D, dtype=dtype, scale=0.5, requires_grad=True)
    w13, w2 = randn(E, 2 * F_, D, dtype=dtype, scale=D ** -0.5), randn(E, D, F_, dtype=dtype, scale=F_ ** -0.5)
    adapters = [randn(E, r, D, dtype=dtype, scale=D ** -0.5, requires_grad=True),
                randn(E, 2 * F_, r, dtype=dtype, scale=0.1, requires_grad=True),
                randn(E, r, F_, dtype=dtype, scale=F_ ** -0.5, requires_grad=True),
                randn(E, D, r, dtype=dtype, scale=0.1, requires_grad=True)]
    scale = torch.tensor([s], device=DEVICE)
    y, routing = moe(x, router, w13, w2, k, lora=ExpertLoRA(*adapters, scale))
    dy = randn(T, D, dtype=dtype)
    inputs = [x, router, *adapters]
    grads = torch.autograd.grad((y.float() * dy.float()).sum(), inputs)

    def run(cast):
        ins = [t.detach().to(cast).requires_grad_() for t in inputs]
        a13, b13, a2, b2 = ins[2:]
        m13, m2 = w13.to(cast) + s * (b13 @ a13), w2.to(cast) + s * (b2 @ a2)
        y_r = ref_moe(ins[0], ins[1], m13, m2, routing.indices, "softmax", True, None)[0]
        return y_r, torch.autograd.grad((y_r * dy.to(cast)).sum(), ins)

    (y64, g64), (y_s, g_s) = run(torch.float64), run(dtype)
    atol = gemm_atol(dtype)
    assert_close("y", y, y64, y_s, atol=atol)
    for name, g, r64, rs in zip(["x", "router", "a13", "b13", "a2", "b2"], grads, g64, g_s):
        assert_close(f"{name}.grad", g, r64, rs, atol=atol)
    with pytest.raises(ValueError, match="lora.b2"):
        moe(x, router, w13, w2, k, lora=ExpertLoRA(*adapters[:3], adapters[3][:, :, :2], scale))


def moe_cfg(**overrides):
    cfg = dict(d_model=32, n_layers=2, init_std=0.02, n_experts=6, moe_top_k=2, d_expert=24, n_shared_experts=1,
               moe_score="softmax", moe_normalize=True, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
    return types.SimpleNamespace(**{**cfg, **overrides})


def test_moe_module():
    from tritonllm.nn import MoE

    cfg = moe_cfg()
    layer = MoE(cfg.d_model, cfg.n_experts, cfg.moe_top_k, cfg.d_expert, cfg.n_shared_experts,
                aux_loss_coef=cfg.moe_aux_loss_coef, z_loss_coef=cfg.moe_z_loss_coef).to(DEVICE)
    n = cfg.n_experts * cfg.d_model * (1 + 3 * cfg.d_expert) + 3 * cfg.d_model * cfg.d_expert
    assert sum(p.numel() for p in layer.parameters()) == n
    x = randn(2, 7, cfg.d_model, requires_grad=True)
    y, aux_loss, stats = layer(x)
    assert y.shape == x.shape
    y_f, r = moe(x.view(-1, cfg.d_model), layer.router.weight, layer.w13, layer.w2, cfg.moe_top_k,
                 shared_w13=layer.shared_w13.weight, shared_w2=layer.shared_w2.weight)
    assert torch.equal(y.view(-1, cfg.d_model), y_f)
    assert_close("aux_loss", aux_loss, (0.01 * r.aux_loss + 0.001 * r.z_loss).double())
    assert set(stats) == {"moe_aux", "moe_z", "moe_max_load"}
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())
    (y.square().sum() + aux_loss).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ------------------------------------------------------------------------------------ GPU-only


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 64, 8, 1024, 512), (4096, 16, 4, 768, 1536)],
                         ids=lambda s: "T{}-E{}-k{}-H{}-F{}".format(*s))
def test_moe_layer_large_bf16(shape):
    T, E, k, D, F_ = shape
    dtype = torch.bfloat16
    x = randn(T, D, dtype=dtype, requires_grad=True)
    params = [randn(E, D, dtype=dtype, scale=0.5, requires_grad=True),
              randn(E, 2 * F_, D, dtype=dtype, scale=D ** -0.5, requires_grad=True),
              randn(E, D, F_, dtype=dtype, scale=F_ ** -0.5, requires_grad=True)]
    y, r = moe(x, *params, k)
    dy = randn(T, D, dtype=dtype)
    grads = torch.autograd.grad(y, [x, *params[1:]], dy)
    again = torch.autograd.grad(moe(x, *params, k)[0], [x, *params[1:]], dy)
    for g, g2 in zip(grads, again):
        assert torch.equal(g, g2), "MoE backward is not deterministic"

    def run(cast):
        ins = [t.detach().to(cast).requires_grad_() for t in [x, *params]]
        y_r = ref_moe(*ins, r.indices, "softmax", True)[0]
        return y_r, torch.autograd.grad(y_r, [ins[0], *ins[2:]], dy.to(cast))

    y64, g64 = run(torch.float64)
    y_s, g_s = run(dtype)
    assert_close("y", y, y64, y_s)
    for name, g, r64, rs in zip(["x", "w13", "w2"], grads, g64, g_s):
        assert_close(f"{name}.grad", g, r64, rs)


# ------------------------------------------------------------------------------------ training


@pytest.mark.slow
def test_train_void_moe_tiny_loss_falls(tmp_path):
    """``python -m tritonllm.train +model=void_moe_tiny`` (shrunk for the interpreter, on text files
    written here): a few steps lower the loss; every train record logs the router's losses and load."""
    import json
    import os

    from hydra import compose, initialize_config_module

    from tritonllm.train import train

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "moe.py")) as f:
        text = f.read()
    for i in range(4):
        (tmp_path / f"part{i}.txt").write_text(text[i * 500:] + text[:i * 500])
    overrides = ["+model=void_moe_tiny", "model.d_model=64", "model.n_layers=1", "model.n_heads=2",
                 "model.n_kv_heads=2", "model.d_expert=32", "model.n_experts=4", "model.max_seq_len=32", "data=text",
                 "data.vocab_size=512", f"data.files={tmp_path}/*.txt", f"data.cache_dir={tmp_path}/cache",
                 f"device={DEVICE}", "trainer.batch_size=4", "trainer.seq_len=16", "trainer.max_steps=5",
                 "trainer.eval_interval=5", "trainer.eval_batches=1", "trainer.log_interval=1",
                 "trainer.ckpt_interval=0", "trainer.progress=false", "trainer.sample_tokens=0", "optim.lr=1e-2",
                 "sched.warmup_steps=1", f"out_dir={tmp_path}/run"]
    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    train(cfg)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "train"]
    losses = [r["loss"] for r in records]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.3, losses
    for r in records:
        # aux = E sum_i f_i P_i >= 1 (equality when balanced), z >= 0, load >= 1 (balanced: 1)
        assert r["moe_aux"] >= 1 - 1e-4 and r["moe_z"] >= 0 and 1 <= r["moe_max_load"] <= 4, r
        expected = cfg.model.moe_aux_loss_coef * r["moe_aux"] + cfg.model.moe_z_loss_coef * r["moe_z"]
        assert abs(r["aux"] - expected) <= 1e-5 * max(1.0, expected), r
