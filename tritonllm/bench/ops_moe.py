"""Benchmarks of the Mixture-of-Experts layer (``moe``) and of its routing alone (``moe_routing``).

Shapes read ``T8192 E64 k8 H2048 F1024``: T tokens, E experts, top-k, hidden H, expert width F
(``default``: the cudann_moe layer, ``large``: the OLMoE-shaped void_moe_1b7b layer). Inputs:
``x [T, H]``, router ``[E, H]``, ``w13 [E, 2F, H]``, ``w2 [E, H, F]``, all differentiated.

``moe``: router linear + softmax top-k (normalized) + dropless SwiGLU experts + weighted combine.
Baselines: ``torch loop`` (PyTorch eager: softmax/topk routing, then per expert ``torch.where``,
two ``F.linear`` on cuBLAS, ``F.silu`` and ``index_add_``), its ``torch.compile`` (data-dependent
per-expert shapes: expect graph breaks and recompiles), and ``liger`` (Liger-Kernel's
``LigerFusedMoEFunction`` grouped-GEMM experts behind the same PyTorch routing) when importable.
FLOPs: forward ``2 T k (3 H F) + 2 T H E`` (expert GEMMs + router), backward 2x forward.

The ``moe`` rows also split our kernels' GPU time (profiler): ``share.routing`` is the fraction
spent outside the expert GEMMs and their SwiGLU (router linear, ``moe_router``, sort, gather,
combine and their backward kernels), the share of the layer's work that routing costs.

``moe_routing``: router linear + ``moe_router`` + ``moe_sort`` + ``moe_gather`` + ``moe_combine``
with identity experts, i.e. the layer minus its expert GEMMs, to check that routing and
permutation stay under 10% of the layer's time. Baselines: the same in PyTorch (softmax/topk,
stable argsort, index, ``index_add_``) and its ``torch.compile``. Bytes (memory-bound): forward
reads x and writes y (``2 T H``) and writes then reads the ``T k`` sorted rows (``2 T k H``);
backward reads dy, writes dx (``2 T H``) and writes, reads back and reads for the weight gradient
the sorted rows (``3 T k H``); the router's ``T E`` logits are neglected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonllm.bench.harness import Case, compiled, liger_available
from tritonllm.kernels import linear, moe, moe_combine, moe_gather, moe_router, moe_sort

OPS = ["moe", "moe_routing"]

# (T, E, k, H, F)
SHAPES = {
    "default": [(8192, 16, 4, 768, 6144)],
    "large": [(8192, 64, 8, 2048, 1024)],
}


def _shape(T, E, k, H, F_) -> str:
    return f"T{T} E{E} k{k} H{H} F{F_}"


def _make_inputs(T, E, H, F_, dtype, experts=True):
    """x, router weight and (``experts``) w13, w2, scaled by fan-in like an initialised layer."""
    def make():
        def param(*shape, fan_in):
            return (torch.randn(*shape, device="cuda", dtype=dtype) * fan_in ** -0.5).requires_grad_()
        x = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
        router = param(E, H, fan_in=H)
        if not experts:
            return x, router
        return x, router, param(E, 2 * F_, H, fan_in=H), param(E, H, F_, fan_in=F_)
    return make


def _torch_routing(x, router_weight, k):
    """Softmax top-k routing in PyTorch: normalized fp32 weights and int64 indices, [T, k]."""
    probs = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
    w, idx = probs.topk(k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), idx


def _torch_loop(k):
    def layer(x, router_weight, w13, w2):
        w, idx = _torch_routing(x, router_weight, k)
        y = torch.zeros_like(x)
        for e in range(w13.shape[0]):
            tok, slot = torch.where(idx == e)
            g, u = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
            y.index_add_(0, tok, F.linear(F.silu(g) * u, w2[e]) * w[tok, slot, None].to(x.dtype))
        return y
    return layer


def _liger(k):
    def layer(x, router_weight, w13, w2):
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        w, idx = _torch_routing(x, router_weight, k)
        return LigerFusedMoEFunction.apply(x, w13, w2, idx.to(torch.int32), w)
    return layer


def _moe_baselines(k) -> dict:
    base = {"torch loop": _torch_loop(k), "torch.compile": compiled(_torch_loop(k))}
    if liger_available():
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction  # noqa: F401
        except ImportError:  # a Liger-Kernel without the fused MoE op (before 0.8)
            return base
        base["liger"] = _liger(k)
    return base


def _ours(k):
    def layer(x, router_weight, w13, w2):
        return moe(x, router_weight, w13, w2, k)[0]
    return layer


def _ours_routing(k):
    def routing(x, router_weight):
        r = moe_router(linear(x, router_weight), k)
        plan = moe_sort(r.indices, router_weight.shape[0])
        return moe_combine(moe_gather(x, plan), r.weights, plan)
    return routing


def _torch_routing_only(k):
    def routing(x, router_weight):
        w, idx = _torch_routing(x, router_weight, k)
        order = idx.flatten().argsort(stable=True)
        tok = order // k
        rows = x[tok] * w.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tok, rows)
    return routing


def _is_routing_kernel(name: str) -> bool:
    """Every kernel of the layer but the expert GEMMs (kernels.grouped_linear) and their SwiGLU."""
    return "grouped_linear" not in name and "swiglu" not in name


def cases(size: str, dtype: torch.dtype):
    elt = torch.finfo(dtype).bits // 8
    for T, E, k, H, F_ in SHAPES.get(size, []):
        fwd = 2.0 * T * k * 3 * H * F_ + 2.0 * T * H * E
        yield Case("moe", _shape(T, E, k, H, F_), dtype, _make_inputs(T, E, H, F_, dtype), ours=_ours(k),
                   baselines=_moe_baselines(k), flops={"fwd": fwd, "bwd": 2 * fwd, "fwd+bwd": 3 * fwd},
                   kernel_shares={"routing": _is_routing_kernel})
        yield Case("moe_routing", _shape(T, E, k, H, F_), dtype, _make_inputs(T, E, H, F_, dtype, experts=False),
                   ours=_ours_routing(k),
                   baselines={"torch": _torch_routing_only(k), "torch.compile": compiled(_torch_routing_only(k))},
                   bytes={"fwd": elt * (2 * T * H + 2 * T * k * H), "bwd": elt * (2 * T * H + 3 * T * k * H),
                          "fwd+bwd": elt * (4 * T * H + 5 * T * k * H)})
