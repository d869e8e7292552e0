"""The kernels under torch.compile: a small model built only of tritonllm.kernels (a dense block, and one
with a Mixture-of-Experts layer) compiles with
``fullgraph=True`` (no graph break; aot_eager, and inductor, the default backend, also on the CPU), keeps every kernel in the graph as a ``torch.ops.tritonllm`` op, and
gives eager's loss and gradients; so do LoRA linears; an optimizer step (gradient clipping, also with a
reduce of the norm, AdamW, NorMuon), a decode step (the in-place KV-cache write, attention over the cache)
and orthogonalize compiled give eager's tensors; each registered op passes
``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT dispatch); the model works
inside FSDP2's ``fully_shard``."""

import os
import shutil
import socket

import pytest
import torch

from _checks import DEVICE, ON_GPU, randn

from tritonllm.kernels import (MoEPlan, MoERouting, add_fork, clip_grads_, cross_entropy, embedding, flash_attention,
                               fork, linear, linear_cross_entropy, linear_swiglu, moe, moe_router, moe_sort, orthogonalize,
                               relu2, rms_norm, rope, rope_cos_sin, softcap, split_heads, swiglu, weighted_add)
from tritonllm.kernels import custom_op
from tritonllm.kernels.flash_attention import flash_attention_decode
from tritonllm.kernels.kv_cache import kv_cache_write_
from tritonllm.kernels.lora import lora_linear
from tritonllm.kernels.split_heads import pack_heads_op
from tritonllm.models import ModelConfig, build_model
from tritonllm.optim import AdamW, Muon

#: the custom ops the kernel modules register (on import of tritonllm.kernels)
OPS = torch.ops.tritonllm
V, C, HQ, HKV, D, F = 64, 64, 2, 1, 32, 48  # vocab, width, query / key-value heads, head dim, MLP width
B, T = 2, 16


class TinyModel(torch.nn.Module):
    """One pre-norm GQA block and a fused LM-head loss, every op a tritonllm kernel."""

    def __init__(self):
        super().__init__()
        p = lambda *shape, scale=0.1: torch.nn.Parameter(randn(*shape, scale=scale))  # noqa: E731
        self.wte = p(V, C, scale=1.0)
        self.norm1, self.norm2, self.norm_f = (torch.nn.Parameter(1 + randn(C, scale=0.1)) for _ in range(3))
        self.qkv = p((HQ + 2 * HKV) * D, C)
        self.proj = p(C, HQ * D)
        self.w13 = p(2 * F, C)
        self.w2 = p(C, F)
        self.head = p(V, C)
        cos, sin = rope_cos_sin(T, D, device=DEVICE)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids, targets):
        x = embedding(ids, self.wte, validate=False)
        qkv = linear(rms_norm(x, self.norm1), self.qkv).view(B, T, HQ + 2 * HKV, D)
        q, k, v = split_heads(qkv, (HQ, HKV, HKV))
        q, k = rope(q, self.cos, self.sin), rope(k, self.cos, self.sin)
        o = flash_attention(q, k, v, causal=True)
        x = linear(o.view(B, T, HQ * D), self.proj, residual=x)
        h, x = rms_norm(x, self.norm2, residual=linear(linear_swiglu(x, self.w13), self.w2))
        return linear_cross_entropy(rms_norm(h, self.norm_f), self.head, targets)


E, FE, TOP_K = 4, 24, 2  # experts, expert MLP width, experts per token


class MoEModel(torch.nn.Module):
    """A pre-norm dropless top-2 MoE SwiGLU layer with a shared expert (``moe``: router, sort, gather,
    grouped GEMMs, combine) between the embedding and the fused LM-head loss; the router losses are
    added to the loss, so every expert weight and the router get gradients."""

    def __init__(self):
        super().__init__()
        p = lambda *shape, scale=0.2: torch.nn.Parameter(randn(*shape, scale=scale))  # noqa: E731
        self.wte = p(V, C, scale=1.0)
        self.norm, self.norm_f = (torch.nn.Parameter(1 + randn(C, scale=0.1)) for _ in range(2))
        self.router = p(E, C, scale=1.0)
        self.w13, self.w2 = p(E, 2 * FE, C), p(E, C, FE)
        self.shared_w13, self.shared_w2 = p(2 * FE, C), p(C, FE)
        self.head = p(V, C, scale=0.1)

    def forward(self, ids, targets):
        x = embedding(ids, self.wte, validate=False).view(B * T, C)
        y, routing = moe(rms_norm(x, self.norm), self.router, self.w13, self.w2, TOP_K, shared_w13=self.shared_w13,
                         shared_w2=self.shared_w2)
        h, _ = rms_norm(y, self.norm_f, residual=x)
        return linear_cross_entropy(h, self.head, targets.view(-1)) + 1e-2 * routing.aux_loss + 1e-3 * routing.z_loss


MODELS = {"dense": TinyModel, "moe": MoEModel}

#: per model, the custom ops its compiled graph must hold (forward ops; the backward ops run in the AOT graph)
MODEL_OPS = {"dense": {"embedding_fwd", "rms_norm_fwd", "linear_fwd", "rope_fwd", "flash_attention_fwd",
                       "linear_swiglu_fwd", "linear_cross_entropy_fwd"},
             "moe": {"embedding_fwd", "rms_norm_fwd", "linear_fwd", "moe_router_fwd", "moe_sort_fwd", "moe_gather_fwd",
                     "grouped_linear_swiglu_fwd", "grouped_linear_fwd", "moe_combine_fwd", "linear_swiglu_fwd",
                     "linear_cross_entropy_fwd"}}


def _batch():
    ids = torch.randint(0, V, (B, T), device=DEVICE)
    return ids, torch.randint(0, V, (B, T), device=DEVICE)


def _loss_and_grads(model, run, ids, targets):
    model.zero_grad(set_to_none=True)
    loss = run(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare(eager, compiled):
    (loss_e, grads_e), (loss_c, grads_c) = eager, compiled
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        assert grads_e[name] is not None, name
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


#: inductor, torch.compile's default backend, compiles C++ around the ops on the CPU
CPU_INDUCTOR = pytest.mark.skipif(not ON_GPU and shutil.which(os.environ.get("CXX", "g++")) is None,
                                  reason="inductor on the CPU needs a C++ compiler")


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=CPU_INDUCTOR)])
def test_compiled_model_matches_eager(backend, model_name):
    torch._dynamo.reset()
    model = MODELS[model_name]()
    ids, targets = _batch()
    eager = _loss_and_grads(model, model, ids, targets)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    _compare(eager, _loss_and_grads(model, compiled, ids, targets))
    _compare(eager, _loss_and_grads(model, compiled, ids, targets))  # the cached graph, second call


@pytest.mark.parametrize("model_name", list(MODELS))
def test_no_graph_break_and_kernels_stay_ops(model_name):
    torch._dynamo.reset()
    ops = _graph_ops(MODELS[model_name](), *_batch())
    assert MODEL_OPS[model_name] <= ops, MODEL_OPS[model_name] - ops


def _graph_ops(fn, *args) -> set[str]:
    """The tritonllm ops of ``fn``'s graph under torch.compile, checked to be one graph without a break."""
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    return {node.target._opname for graph in explained.graphs for node in graph.graph.nodes
            if node.op == "call_function" and getattr(node.target, "namespace", None) == "tritonllm"}


def _functionals(x, y, mix, one, norm, target):
    """The functionals TinyModel leaves out, chained into one differentiable loss."""
    a, b = fork(x)
    x2, y2, s = add_fork(a, y)
    h = swiglu(weighted_add(s, b, mix), weighted_add(x2, y2, one))  # [4, 16]
    h = softcap(relu2(swiglu(h)), 0.5)  # the packed form: [4, 8]
    return cross_entropy(rms_norm(h, norm), target, label_smoothing=0.1, z_loss=1e-3, return_z_loss=True)


def test_compiled_functionals_match_eager():
    torch._dynamo.reset()
    g = dict(requires_grad=True)
    params = [randn(4, 16, **g), randn(4, 16, **g), randn(2, **g), randn(1, **g), (1 + randn(8, scale=0.1)).requires_grad_()]
    target = torch.randint(0, 8, (4,), device=DEVICE)
    results = []
    for fn in (_functionals, torch.compile(_functionals, fullgraph=True, backend="aot_eager")):
        loss, z = fn(*params, target)
        loss.backward()
        assert not z.requires_grad
        results.append((torch.stack([loss, z]).detach(), {i: p.grad for i, p in enumerate(params)}))
        for p in params:
            p.grad = None
    _compare(*results)


def test_ops_are_inductor_fallbacks_before_inductor_lowers_them():
    """With inductor loaded, the first fake a compile runs registers every tritonllm op as an inductor
    fallback (inductor's own "implicit fallback", made ahead: torch 2.11 reaches that path through an eager
    formatting of the op's IR arguments, exponential in the graph's depth)."""
    lowering = pytest.importorskip("torch._inductor.lowering")
    torch._dynamo.reset()
    params = [randn(4, 16), randn(4, 16), randn(2), randn(1), 1 + randn(8, scale=0.1)]
    torch.compile(_functionals, fullgraph=True, backend="aot_eager")(*params, torch.randint(0, 8, (4,), device=DEVICE))
    assert len(custom_op._OP_NAMES) == len(set(custom_op._OP_NAMES)) > 40
    missing = [name for name in custom_op._OP_NAMES
               if getattr(torch.ops.tritonllm, name.split("::")[1]).default not in lowering.lowerings]
    assert not missing, missing


def test_compiled_moe_transformer_matches_eager():
    """tritonllm's Transformer with MoE layers (two blocks, top-2 of 4 experts and a shared one; its RoPE
    tables built inside the first, compiled, call) is one graph, and gives eager's loss, router losses
    and every gradient."""
    torch._dynamo.reset()
    cfg = ModelConfig(name="moe", vocab_size=V, d_model=48, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=40,
                      max_seq_len=T, n_experts=E, moe_top_k=TOP_K, d_expert=FE, n_shared_experts=1,
                      moe_aux_loss_coef=1e-2, moe_z_loss_coef=1e-3)
    ids, targets = _batch()
    assert {"moe_router_fwd", "grouped_linear_swiglu_fwd", "rope_cos_sin_fwd"} <= _graph_ops(
        build_model(cfg, device=DEVICE), ids, targets)
    model = build_model(cfg, device=DEVICE)
    results = []
    for run in (torch.compile(model, fullgraph=True, backend="aot_eager"), model):
        loss, losses = run(ids, targets, return_losses=True)
        loss.backward()
        results.append((torch.stack([loss.detach(), losses["moe_aux"], losses["moe_z"]]),
                        {n: p.grad for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    _compare(results[1], results[0])


def test_train_step_of_a_compiled_model_matches_eager():
    """TrainStep (clipping, AdamW) around torch.compile(model, fullgraph=True), as
    ``python -m tritonllm.bench train --compiled`` times it: eager's losses, norms and weights over three steps,
    from one compiled graph (no recompilation after the first step)."""
    from torch._dynamo.utils import counters

    from tritonllm.train.step import TrainStep

    cfg = ModelConfig(name="dense", vocab_size=V, d_model=C, n_layers=1, n_heads=HQ, n_kv_heads=HKV, head_dim=D,
                      d_ff=F, max_seq_len=T)
    batches = [_batch() for _ in range(3)]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(cfg, device=DEVICE)
        step = TrainStep(torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model,
                         AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), grad_clip=0.5, cuda_graph=False)
        counters.clear()
        outs = [step([batch], lr=1e-2) for batch in batches]
        assert counters["stats"]["unique_graphs"] == compiled
        results.append((torch.stack([torch.stack([o.loss, o.grad_norm]) for o in outs]),
                        {n: p.detach() for n, p in model.named_parameters()}))
    _compare(*results)


def test_compiled_transformer_attention_is_one_op_each_way():
    """The model's attention under torch.compile is one ``rope_flash_attention`` op forward and one
    backward per layer, whose backward writes the packed qkv gradient: no ``pack_heads`` copy and no
    separate RoPE or attention op in the forward or the backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    cfg = ModelConfig(name="dense", vocab_size=V, d_model=C, n_layers=2, n_heads=HQ, n_kv_heads=HKV, head_dim=D,
                      d_ff=F, max_seq_len=T)
    model = build_model(cfg, device=DEVICE)
    torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))(
        *_batch()).backward()
    ops = [node.target._opname for gm in graphs for node in gm.graph.nodes
           if node.op == "call_function" and getattr(node.target, "namespace", None) == "tritonllm"]
    assert ops.count("rope_flash_attention_fwd") == 2 and ops.count("rope_flash_attention_bwd") == 2, ops
    assert not {"pack_heads", "rope_fwd", "rope_bwd", "flash_attention_fwd", "flash_attention_bwd"} & set(ops), ops


def test_compiled_lora_model_matches_eager():
    """A Transformer with LoRA adapters (tritonllm.nn.lora.apply_lora, dropout on) is one graph with the
    LoRA ops in it, and gives eager's loss and adapter gradients (the same dropout masks: the seeds are
    drawn from the same generator state)."""
    from tritonllm.nn.lora import LoRAConfig, apply_lora

    cfg = ModelConfig(name="dense", vocab_size=V, d_model=C, n_layers=1, n_heads=HQ, n_kv_heads=HKV, head_dim=D,
                      d_ff=F, max_seq_len=T)
    model = apply_lora(build_model(cfg, device=DEVICE), LoRAConfig(rank=4, alpha=8.0, dropout=0.1))
    ids, targets = _batch()
    torch._dynamo.reset()
    assert "lora_linear_fwd" in _graph_ops(model, ids, targets)
    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = run(ids, targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    assert results[0][1] and all("lora" in n for n in results[0][1])
    _compare(*results)


def _routing(logits):
    return moe_router(logits, TOP_K, "sigmoid", False), moe_sort(moe_router(logits, TOP_K).indices, E)


def test_compiled_moe_functionals_return_named_tuples():
    """The compiled route of moe_router / moe_sort returns MoERouting / MoEPlan, equal to eager's."""
    torch._dynamo.reset()
    logits = randn(12, E)
    eager = _routing(logits)
    compiled = torch.compile(_routing, fullgraph=True, backend="aot_eager")(logits)
    assert type(compiled[0]) is MoERouting and type(compiled[1]) is MoEPlan
    for e, c in zip(eager, compiled):
        for name in type(e)._fields:
            torch.testing.assert_close(getattr(c, name), getattr(e, name), rtol=0, atol=0, msg=name)


def _optimizer_problem():
    """Weights and gradients (fp32 and fp16; vectors, a matrix, stacked expert matrices) for AdamW and NorMuon."""
    shapes = {"matrix": ((8, 12), torch.float32), "bias": ((12,), torch.float32),
              "experts": ((2, 6, 5), torch.float16), "norm": ((16,), torch.float16)}
    return {n: (randn(*s).to(dt), randn(*s).to(dt)) for n, (s, dt) in shapes.items()}


def _optimizers(problem):
    """Fresh parameters with their gradients, AdamW on the vectors and NorMuon on the matrices (fp16 ones
    with fp32 master copies)."""
    params = {n: torch.nn.Parameter(w.clone()) for n, (w, _) in problem.items()}
    for n, p in params.items():
        p.grad = problem[n][1].clone()
    adamw = AdamW([params["bias"], params["norm"]], lr=1e-2, weight_decay=0.1)
    muon = Muon([params["matrix"], params["experts"]], lr=0.02, weight_decay=0.01, normuon=True)
    return params, adamw, muon


def _optimizer_step(params, adamw, muon, flag=None, check=None):
    norm = clip_grads_([p.grad for p in params.values()], 1.0, found_inf=flag, check=check)
    adamw.step(found_inf=flag)
    muon.step(found_inf=flag)
    return norm


def _optimizer_run(problem, compiled):
    """Two steps of clip_grads_ (with the skip flag), AdamW and NorMuon, eager or compiled; the
    parameters, the optimizers' states, the norms and the flag after them."""
    params, adamw, muon = _optimizers(problem)
    flag, loss = torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.tensor(2.5, device=DEVICE)
    step = torch.compile(_optimizer_step, fullgraph=True, backend="aot_eager") if compiled else _optimizer_step
    norms = [step(params, adamw, muon, flag, loss) for _ in range(2)]
    states = {f"{n}.{k}": v for n, p in params.items() for opt in (adamw, muon) if p in opt.state
              for k, v in opt.state[p].items()}
    return {**{n: p.detach() for n, p in params.items()}, **states, "norms": torch.stack(norms), "flag": flag}


def test_compiled_optimizer_step_matches_eager():
    """clip_grads_, AdamW (fp16 with masters) and NorMuon (stacked fp16 experts with masters) compiled
    with fullgraph: one graph of the in-place ops, and eager's parameters, states and norms exactly."""
    torch._dynamo.reset()
    problem = _optimizer_problem()
    eager, compiled = _optimizer_run(problem, False), _optimizer_run(problem, True)
    assert eager.keys() == compiled.keys() and {"experts.master", "experts.second_moment", "norm.master"} <= eager.keys()
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=0, atol=0, msg=name)
    assert {"clip_grads", "adamw_step", "muon_step"} <= _graph_ops(_optimizer_step, *_optimizers(problem))


def _clip_two_holders(grads, other, flag, loss):
    """One holder's clip of its part of the gradients, the other holder's sum of squares ``other`` added
    by ``reduce`` (what an all-reduce over two ranks gives)."""
    return clip_grads_(grads, 1.0, found_inf=flag, check=loss, reduce=lambda total: total.add_(other))


def test_compiled_clip_grads_with_reduce_matches_eager():
    """clip_grads_(reduce=...) under torch.compile(fullgraph=True): the sum-of-squares op, the reduce
    traced as Python, the scaling op; eager's norm, clipped gradients and flag exactly."""
    torch._dynamo.reset()
    grads, other = [randn(4, 6), randn(7).half()], torch.tensor(30.0, device=DEVICE)
    compiled = torch.compile(_clip_two_holders, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (_clip_two_holders, compiled):
        gs, flag = [g.clone() for g in grads], torch.ones(1, dtype=torch.int32, device=DEVICE)
        results.append((fn(gs, other, flag, torch.tensor(2.5, device=DEVICE)), gs, flag))
    (norm_e, gs_e, flag_e), (norm_c, gs_c, flag_c) = results
    expected = (sum(g.double().pow(2).sum() for g in grads) + 30.0).sqrt()
    torch.testing.assert_close(norm_e.double(), expected, rtol=1e-5, atol=0)
    assert norm_c == norm_e and flag_c.item() == flag_e.item() == 0
    for c, e in zip(gs_c, gs_e):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    ops = _graph_ops(_clip_two_holders, grads, other, torch.zeros(1, dtype=torch.int32, device=DEVICE),
                     torch.tensor(2.5, device=DEVICE))
    assert {"grad_sq_norm", "clip_grads_by_sq_norm"} <= ops, ops


def _decode_and_polar(q, k, v, k_cache, v_cache, pos, tall, wide):
    """A decode step (the new keys written at ``pos``, attention over the filled cache), orthogonalize
    and the RoPE tables."""
    kv_cache_write_(k, v, k_cache, v_cache, pos)
    o = flash_attention_decode(q, k_cache, v_cache, pos + k.shape[1])
    yarn = dict(type="yarn", factor=4.0, original_max_position=8)
    return (o, orthogonalize(tall), orthogonalize(wide, coefficients="newton_schulz", steps=3),
            *rope_cos_sin(12, 16, device=k.device), *rope_cos_sin(12, 16, 500.0, yarn, device=k.device))


def test_compiled_decode_step_and_orthogonalize_match_eager():
    """kv_cache_write_ (in place, at a device position) then flash_attention_decode over the cache,
    orthogonalize (a tall matrix: a transposed view) and the RoPE tables (plain and YaRN, built inside
    the graph) compiled give eager's caches and outputs, strides included."""
    torch._dynamo.reset()
    q, k, v, tall, wide = randn(2, 3, 2, 32), randn(2, 3, 1, 32), randn(2, 3, 1, 32), randn(2, 9, 5), randn(4, 7)
    pos, caches = torch.tensor(2, device=DEVICE), (randn(2, 8, 1, 32), randn(2, 8, 1, 32))
    results = []
    for fn in (_decode_and_polar, torch.compile(_decode_and_polar, fullgraph=True, backend="aot_eager")):
        k_cache, v_cache = (c.clone() for c in caches)
        results.append((k_cache, v_cache, *fn(q, k, v, k_cache, v_cache, pos, tall, wide)))
    for e, c in zip(*results):
        assert e.stride() == c.stride()
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    torch.testing.assert_close(results[1][0][:, 2:5], k, rtol=0, atol=0)
    assert {"kv_cache_write", "flash_attention_decode"} <= _graph_ops(_decode_and_polar, q, k, v, *caches, pos, tall,
                                                                      wide)


def _lora_loss(x, weight, bias, a, b, residual, seed):
    """Two LoRA linears (q and v segments with dropout; one adapter without) and a squared loss."""
    h = lora_linear(x, weight, bias, a, b, [(0, 8), (16, 8)], 2.0, dropout_p=0.25, seed=seed, residual=residual)
    y = lora_linear(h, weight[:, :24].contiguous(), None, a[:1, :, :24], b[:8], [(4, 8)], 0.5)
    return (y * y).sum()


def test_compiled_lora_linear_matches_eager():
    """lora_linear under torch.compile(fullgraph=True): one op each way, eager's loss and the
    gradients of x, the adapters, the bias and the residual (the base weight frozen)."""
    torch._dynamo.reset()
    g = dict(requires_grad=True)
    inputs = (randn(2, 3, 32, **g), randn(24, 32, scale=0.2), randn(24, **g), randn(2, 4, 32, scale=0.2, **g),
              randn(16, 4, scale=0.2, **g), randn(2, 3, 24, **g), torch.tensor([7], dtype=torch.int64, device=DEVICE))
    results = []
    for fn in (_lora_loss, torch.compile(_lora_loss, fullgraph=True, backend="aot_eager")):
        loss = fn(*inputs)
        grads = torch.autograd.grad(loss, [t for t in inputs if t.requires_grad])
        results.append((loss, *grads))
    for e, c in zip(*results):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    assert "lora_linear_fwd" in _graph_ops(_lora_loss, *inputs)


def _lora_op_cases(g):
    """The opcheck cases of the LoRA ops: two adapters of rank 4 on columns 0-7 and 16-23 of 24."""
    x, w, bias = randn(5, 32, **g), randn(24, 32, scale=0.2, **g), randn(24, **g)
    a, b = randn(2, 4, 32, **g), randn(16, 4, **g)
    segments, seed = [0, 8, 16, 8], torch.tensor([3], dtype=torch.int64, device=DEVICE)
    _, xd, u = OPS.lora_linear_fwd(x, w, bias, None, a, b, segments, 0.5, 0.25, seed, True, False)
    saved = (x.detach(), xd.detach(), w.detach(), a.detach(), b.detach(), u.detach(), seed, segments, 0.5, 0.25, True)
    return {
        "lora_linear_fwd": (OPS.lora_linear_fwd, (x, w, bias, randn(5, 24, **g), a, b, segments, 0.5, 0.0, None, True,
                                                  False)),
        "lora_linear_fwd_dropout": (OPS.lora_linear_fwd, (x, w, bias, None, a, b, segments, 0.5, 0.25, seed, True, False)),
        "lora_linear_fwd_fp8": (OPS.lora_linear_fwd, (x, w, bias, None, a, b, segments, 0.5, 0.0, None, True, True)),
        "lora_linear_bwd": (OPS.lora_linear_bwd, (randn(5, 24), *saved, True, True, True, True, True, False)),
        "lora_linear_bwd_adapters": (OPS.lora_linear_bwd, (randn(5, 24), *saved, False, False, False, True, True,
                                                           False)),
        "lora_linear_bwd_fp8": (OPS.lora_linear_bwd, (randn(5, 24), *saved, True, False, False, True, True, True)),
    }


def _moe_op_cases(g):
    """The opcheck cases of the MoE ops: 6 tokens, 4 experts, top-2, width 8."""
    logits = randn(6, E, **g)
    *_, indices, counts = OPS.moe_router_fwd(logits, TOP_K, "softmax", True)
    plan = OPS.moe_sort_fwd(indices, E)
    offsets, positions, slots = plan
    x, rows, weights = randn(6, 8, **g), randn(12, 8, **g), randn(6, TOP_K, **g)
    w, w13 = randn(E, 10, 8, scale=0.3, **g), randn(E, 12, 8, scale=0.3, **g)
    scalar = lambda value: torch.tensor(value, device=DEVICE)  # noqa: E731
    return {
        "moe_router_fwd": (OPS.moe_router_fwd, (logits, TOP_K, "softmax", True)),
        "moe_router_fwd_sigmoid": (OPS.moe_router_fwd, (logits, 3, "sigmoid", False)),
        "moe_router_bwd": (OPS.moe_router_bwd, (logits.detach(), indices, counts, randn(6, TOP_K), scalar(0.5),
                                                scalar(0.1), "softmax", True)),
        "moe_router_bwd_weights_only": (OPS.moe_router_bwd, (logits.detach(), indices, counts, randn(6, TOP_K), None,
                                                             None, "sigmoid", False)),
        "moe_sort_fwd": (OPS.moe_sort_fwd, (indices, E)),
        "moe_gather_fwd": (OPS.moe_gather_fwd, (x, *plan)),
        "moe_gather_bwd": (OPS.moe_gather_bwd, (randn(12, 8), positions)),
        "moe_combine_fwd": (OPS.moe_combine_fwd, (rows, weights, *plan)),
        "moe_combine_bwd": (OPS.moe_combine_bwd, (randn(6, 8), rows.detach(), weights.detach(), slots, True)),
        "grouped_linear_fwd": (OPS.grouped_linear_fwd, (rows, w, offsets)),
        "grouped_linear_bwd": (OPS.grouped_linear_bwd, (randn(12, 10), rows.detach(), w.detach(), offsets, True, True)),
        "grouped_linear_swiglu_fwd": (OPS.grouped_linear_swiglu_fwd, (rows, w13, offsets)),
    }


def _in_place_op_cases():
    """The opcheck cases of the in-place ops (optimizer steps, clipping, KV-cache write) and orthogonalize."""
    pos = lambda *shape: randn(*shape).abs()  # noqa: E731  (second moments are >= 0)
    p16, m16 = randn(3, 5).half(), randn(3, 5)
    steps = [torch.zeros((), device=DEVICE) for _ in range(2)]
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    adamw = ([randn(4, 6), randn(7)], [randn(4, 6), randn(7)], [randn(4, 6), randn(7)], [pos(4, 6), pos(7)], [],
             [False, False], steps, 1e-2, None, 0.9, 0.99, 1e-8, 0.1, None)
    adamw_masters = ([p16.clone()], [randn(3, 5).half()], [randn(3, 5)], [pos(3, 5)], [m16.clone()], [True],
                     [steps[0].clone()], 0.0, torch.tensor(1e-2, device=DEVICE), 0.9, 0.99, 1e-8, 0.0, flag)
    muon = ([randn(2, 4, 6), p16], [randn(2, 4, 6), randn(3, 5).half()], [randn(2, 4, 6), randn(3, 5)], [m16],
            [False, True], [pos(2, 6), pos(5)], True, 0.02, None, 1.0, 0.95, True, 0.01, "polar_express", 2, 1e-7,
            "original", 0.95, None, None)
    return {
        "adamw_step": (OPS.adamw_step, adamw),
        "adamw_step_masters": (OPS.adamw_step, adamw_masters),
        "clip_grads": (OPS.clip_grads, ([randn(4, 6), randn(7)], 0.5, 1e-6, flag.clone(),
                                        torch.tensor(1.0, device=DEVICE))),
        "grad_sq_norm": (OPS.grad_sq_norm, ([randn(4, 6), randn(7).half()],)),
        "clip_grads_by_sq_norm": (OPS.clip_grads_by_sq_norm, ([randn(4, 6), randn(7)], torch.tensor(9.0, device=DEVICE),
                                                              0.5, 1e-6, flag.clone(), torch.tensor(1.0, device=DEVICE))),
        "muon_step": (OPS.muon_step, muon),
        "orthogonalize_fwd": (OPS.orthogonalize_fwd, (randn(2, 9, 5), "polar_express", 3, 1e-7, None)),
        "orthogonalize_fwd_wide": (OPS.orthogonalize_fwd, (randn(4, 7), "newton_schulz", 2, 1e-7, None)),
        "flash_attention_decode": (OPS.flash_attention_decode, (randn(2, 3, 2, 32), randn(2, 8, 1, 32),
                                                                   randn(2, 8, 1, 32), torch.tensor(5, device=DEVICE),
                                                                   True, None, None, None)),
        "kv_cache_write": (OPS.kv_cache_write, (randn(2, 3, 1, 8), randn(2, 3, 1, 8), randn(2, 6, 1, 8),
                                                randn(2, 6, 1, 8), torch.tensor(1, device=DEVICE))),
    }


def _op_cases():
    """(op, args) with tiny inputs for every registered op; forward ops get inputs that require
    gradients, backward ops the forward op's saved outputs."""
    g = dict(requires_grad=True)
    x, w = randn(5, 32, **g), (1 + randn(32, scale=0.1)).requires_grad_()
    y, _, rstd = OPS.rms_norm_fwd(x, w, 1e-6, None)
    wl, bias = randn(16, 32, scale=0.2, **g), randn(16, **g)
    w13 = randn(24, 32, scale=0.2, **g)
    _, gu = OPS.linear_swiglu_fwd(x, w13, True)
    gate, up, packed = randn(5, 12, **g), randn(5, 12, **g), randn(5, 24, **g)
    q, k, v = randn(2, 8, 2, 32, **g), randn(2, 8, 1, 32, **g), randn(2, 8, 1, 32, **g)
    o, lse = OPS.flash_attention_fwd(q, k, v, True, None, None, False, None)
    qkv = randn(2, 8, 4, 32, **g)  # 2 query heads, 1 KV head
    rfa = (2, 1, True, None, None, True)
    ro, rlse, rqk = OPS.rope_flash_attention_fwd(qkv, *rope_cos_sin(12, 32, device=DEVICE), *rfa, None)
    docs = torch.tensor([[[0, 3]] * 3 + [[3, 8]] * 5] * 2, dtype=torch.int32, device=DEVICE)
    cos, sin = rope_cos_sin(12, 32, device=DEVICE)
    ids, table = torch.randint(0, 10, (3, 4), device=DEVICE), randn(10, 32, **g)
    logits, target = randn(6, 10, **g), torch.randint(0, 10, (6,), device=DEVICE)
    _, _, ce_lse, count = OPS.cross_entropy_fwd(logits, target, -100, 0.0, 0.0, "mean", False, True)
    lce = (x, wl, torch.randint(0, 16, (5,), device=DEVICE), -100, 0.0, 1e-4)
    _, _, dx_l, dw_l, scale = OPS.linear_cross_entropy_fwd(*lce, "mean", None, True, True, True, None)
    dy, d4 = randn(5, 32), randn(2, 8, 2, 32)
    lce_opts = (None, True, True, True, None)
    kept = [t.detach() for t in OPS.fp8_linear_fwd(x, wl, None, None, torch.float8_e4m3fn, True, True)[1:]]
    kept13 = [t.detach() for t in OPS.fp8_linear_swiglu_fwd(x, w13, torch.float8_e4m3fn, True, True)[2:]]
    return {
        "rms_norm_fwd": (OPS.rms_norm_fwd, (x, w, 1e-6, None)),
        "rms_norm_fwd_residual": (OPS.rms_norm_fwd, (x, w, 1e-6, randn(5, 32, **g))),
        "rms_norm_bwd": (OPS.rms_norm_bwd, (dy, x.detach(), w.detach(), rstd.detach(), None)),
        "linear_fwd": (OPS.linear_fwd, (x, wl, bias, randn(5, 16, **g), True)),
        "linear_bwd": (OPS.linear_bwd, (randn(5, 16), x.detach(), wl.detach(), True, True, True, True)),
        "linear_swiglu_fwd": (OPS.linear_swiglu_fwd, (x, w13, True)),
        "linear_swiglu_bwd": (OPS.linear_swiglu_bwd, (randn(5, 12), x.detach(), w13.detach(), gu.detach(), True, True,
                                                      True)),
        "swiglu_fwd": (OPS.swiglu_fwd, (gate, up)),
        "swiglu_fwd_packed": (OPS.swiglu_fwd, (packed, None)),
        "swiglu_bwd": (OPS.swiglu_bwd, (randn(5, 12), gate.detach(), up.detach())),
        "swiglu_bwd_packed": (OPS.swiglu_bwd, (randn(5, 12), packed.detach(), None)),
        "fp8_linear_fwd": (OPS.fp8_linear_fwd, (x, wl, bias, randn(5, 16, **g), torch.float8_e4m3fn, True, True)),
        "fp8_linear_fwd_no_grad": (OPS.fp8_linear_fwd, (x.detach(), wl.detach(), None, None, torch.float8_e4m3fn, False,
                                                        False)),
        "fp8_linear_bwd": (OPS.fp8_linear_bwd, (randn(5, 16), *kept, True, True, True, torch.float8_e5m2,
                                                torch.float32)),
        "fp8_linear_swiglu_fwd": (OPS.fp8_linear_swiglu_fwd, (x, w13, torch.float8_e4m3fn, True, True)),
        "fp8_linear_swiglu_bwd": (OPS.fp8_linear_swiglu_bwd, (randn(5, 12), gu.detach(), *kept13, True, True,
                                                              torch.float8_e4m3fn, torch.float32)),
        "relu2_fwd": (OPS.relu2_fwd, (x,)),
        "relu2_bwd": (OPS.relu2_bwd, (x.detach(), dy)),
        "gelu_tanh_fwd": (OPS.gelu_tanh_fwd, (x,)),
        "gelu_tanh_bwd": (OPS.gelu_tanh_bwd, (x.detach(), dy)),
        "softcap_fwd": (OPS.softcap_fwd, (x, 2.0)),
        "softcap_bwd": (OPS.softcap_bwd, (y.detach(), dy, 30.0)),
        "rope_fwd": (OPS.rope_fwd, (q, cos, sin, 2, None)),
        "rope_fwd_tensor_offset": (OPS.rope_fwd, (q, cos, sin, 0, torch.tensor(3, device=DEVICE))),
        "rope_bwd": (OPS.rope_bwd, (d4, cos, sin, 1, None)),
        "rope_cos_sin_fwd": (OPS.rope_cos_sin_fwd, (torch.rand(16, dtype=torch.float64, device=DEVICE) / 7, 12, 1.1)),
        "embedding_fwd": (OPS.embedding_fwd, (ids, table, 0, True)),
        "embedding_bwd": (OPS.embedding_bwd, (randn(3, 4, 32), ids, 10, None)),
        "flash_attention_fwd": (OPS.flash_attention_fwd, (q, k, v, True, None, None, False, None)),
        "flash_attention_fwd_documents": (OPS.flash_attention_fwd, (q, k, v, True, None, None, True, docs)),
        "flash_attention_bwd": (OPS.flash_attention_bwd, (d4, q.detach(), k.detach(), v.detach(), o.detach(),
                                                          lse.detach(), True, None, None, False, None)),
        "rope_flash_attention_fwd": (OPS.rope_flash_attention_fwd, (qkv, cos, sin, *rfa, None)),
        "rope_flash_attention_fwd_window_documents": (OPS.rope_flash_attention_fwd,
                                                      (qkv, cos, sin, 2, 1, True, 3, 0.2, False, docs)),
        "rope_flash_attention_bwd": (OPS.rope_flash_attention_bwd, (randn(2, 8, 2, 32), rqk.detach(), qkv.detach(),
                                                                    ro.detach(), rlse.detach(), cos, sin, *rfa, None)),
        "pack_heads": (OPS.pack_heads, ([randn(2, 8, 2, 32), None], [2, 1], randn(2, 8, 3, 32))),
        "weighted_add_fwd": (OPS.weighted_add_fwd, (x, randn(5, 32, **g), randn(2, **g))),
        "weighted_add_bwd": (OPS.weighted_add_bwd, (dy, x.detach(), randn(5, 32), randn(1), True, True, True)),
        "cross_entropy_fwd": (OPS.cross_entropy_fwd, (logits, target, -100, 0.1, 1e-4, "mean", True, True)),
        "cross_entropy_fwd_none": (OPS.cross_entropy_fwd, (logits, target, -100, 0.0, 0.0, "none", False, True)),
        "cross_entropy_bwd": (OPS.cross_entropy_bwd, (torch.tensor(1.5, device=DEVICE), logits.detach(), target,
                                                      ce_lse.detach(), count.detach(), -100, 0.0, 0.0)),
        "linear_cross_entropy_fwd": (OPS.linear_cross_entropy_fwd, (*lce, "mean", *lce_opts)),
        "linear_cross_entropy_fwd_none": (OPS.linear_cross_entropy_fwd, (*lce, "none", *lce_opts)),
        "linear_cross_entropy_scale": (OPS.linear_cross_entropy_scale, (torch.tensor(2.0, device=DEVICE),
                                                                        dx_l.detach(), dw_l.detach(), scale.detach(),
                                                                        torch.float32)),
        "linear_cross_entropy_bwd": (OPS.linear_cross_entropy_bwd, (randn(5), *[t.detach() for t in lce[:3]],
                                                                    *lce[3:], *lce_opts)),
        **_lora_op_cases(g),
        **_moe_op_cases(g),
        **_in_place_op_cases(),
    }


@pytest.fixture(scope="module")
def op_cases():
    return _op_cases()


def test_every_registered_op_is_checked(op_cases):
    namespace = torch.ops.tritonllm
    registered = {n for n in dir(namespace) if isinstance(getattr(namespace, n), torch._ops.OpOverloadPacket)}
    assert {_overload(op)._opname for op, _ in op_cases.values()} == registered


def _overload(op) -> torch._ops.OpOverload:
    """The default overload of a ``torch.ops.tritonllm`` op."""
    return op.default


#: opcheck's checks; its schema check compares inputs and outputs with arithmetic that CUDA lacks for fp8
#: tensors ("mul_cuda" not implemented for 'Float8_e4m3fn'): :func:`_fp8_schema_check` does it for those ops
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]


def _fp8_schema_check(op, args) -> bool:
    """On CUDA, for an op that declares no mutation and takes or returns fp8 tensors, the schema check done
    byte for byte: no input changes, no output aliases an input. Whether it applied."""
    if not ON_GPU or any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
        return False
    inputs = _tensors(args)
    before = [_bytes(t).clone() for t in inputs]
    out = _tensors(op(*args))
    if not any(t.dtype in FP8_DTYPES for t in inputs + out):
        return False
    for i, (t, b) in enumerate(zip(inputs, before)):
        assert torch.equal(_bytes(t), b), f"input {i} was mutated"
    storages = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    assert not [o for o in out if o.numel() and o.untyped_storage().data_ptr() in storages], "an output aliases an input"
    return True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.uint8) if t.dtype in FP8_DTYPES else t.detach()


def test_opcheck(op_cases):
    """Schema (no mutation, no aliasing), fake tensors against real outputs, autograd registration and
    AOT dispatch with dynamic shapes, for every case; failures named together."""
    failures = {}
    for name, (op, args) in op_cases.items():
        try:
            utils = OPCHECK_UTILS[1:] if _fp8_schema_check(_overload(op), args) else OPCHECK_UTILS
            torch.library.opcheck(_overload(op), args, test_utils=utils)
        except Exception as e:  # noqa: BLE001 (collected, reported below with the case name)
            failures[name] = f"{type(e).__name__}: {str(e)[:2000]}"
    assert not failures, "\n".join(f"{n}: {m}" for n, m in failures.items())


def _fsdp_rank(rank: int, world: int, port: int, backend: str) -> None:
    """One rank: eager loss and gradients of the whole model, then the same model under fully_shard,
    compiled with fullgraph, on the same batch (every rank the same, so the averaged gradients are the
    single model's)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    if ON_GPU:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if ON_GPU else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyModel()
        ids, targets = _batch()
        eager = _loss_and_grads(model, model, ids, targets)
        fully_shard(model)
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        loss, grads = _loss_and_grads(model, compiled, ids, targets)
        _compare(eager, (loss, {n: g.full_tensor() for n, g in grads.items()}))
        # FSDP2's clip: each rank's shards, the sums of squares all-reduced inside the compiled graph
        clip = torch.compile(lambda gs: clip_grads_(gs, 0.5, reduce=dist.all_reduce), fullgraph=True, backend=backend)
        shards = [g.to_local().clone() for g in grads.values()]
        norm = clip(shards)
        full = list(eager[1].values())  # clipped in place below: the single model's clip
        torch.testing.assert_close(norm, clip_grads_(full, 0.5), rtol=1e-5, atol=0)
        for shard, g, whole in zip(shards, grads.values(), full):
            mine = distribute_tensor(whole, g.device_mesh, g.placements).to_local()
            torch.testing.assert_close(shard, mine, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fsdp2_compiled_model_matches_eager(monkeypatch):
    """Two ranks (gloo on the CPU, NCCL on two GPUs) of fully_shard + torch.compile(fullgraph=True)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the ranks share the cores
    torch.multiprocessing.spawn(_fsdp_rank, args=(2, port, "inductor" if ON_GPU else "aot_eager"), nprocs=2)


# ----------------------------------------------------------------------------- the lean op kernels

def _probe_op():
    """A ``custom_op.Op`` ``y = scale x + w`` whose implementation records its calls, registered once in a
    namespace of its own (``tritonllm_test``)."""
    if not hasattr(_probe_op, "op"):
        calls = []

        def probe_op(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
            calls.append(x.device.type)
            return x * scale + w

        _probe_op.library = torch.library.Library("tritonllm_test", "FRAGMENT")
        op = custom_op.Op("tritonllm_test::probe", probe_op, _probe_op.library)
        op.register_fake(lambda x, w, scale: torch.empty_like(x))

        def setup(ctx, inputs, output):
            ctx.needs = ctx.needs_input_grad
            ctx.scale = inputs[2]

        def backward(ctx, dy):
            return dy * ctx.scale if ctx.needs[0] else None, dy if ctx.needs[1] else None, None

        op.register_autograd(backward, setup_context=setup)
        _probe_op.op, _probe_op.calls = op, calls
    _probe_op.calls.clear()
    return _probe_op.op, _probe_op.calls


def test_op_runs_its_implementation_directly_without_grad_and_through_fakes_under_a_mode():
    op, calls = _probe_op()
    x, w = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(op(x, w, 2.0), 2 * x + w)
    with torch.no_grad():
        op(x.requires_grad_(), w, 2.0)
    assert calls == ["cpu", "cpu"]
    with torch._subclasses.FakeTensorMode() as mode:
        y = op(mode.from_tensor(x), mode.from_tensor(w), 2.0)
    assert isinstance(y, torch._subclasses.FakeTensor) and y.shape == (3,) and calls == ["cpu", "cpu"]


def test_op_gradients_come_from_its_formula_with_the_ops_own_needs_input_grad():
    op, _ = _probe_op()
    x, w = torch.randn(3, requires_grad=True), torch.randn(3)
    y = op(x, w, 3.0)
    assert y.requires_grad
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, torch.full((3,), 3.0))
    (dw,) = torch.autograd.grad(op(x.detach(), w.requires_grad_(), 3.0).sum(), w)
    torch.testing.assert_close(dw, torch.ones(3))


def test_op_without_a_formula_refuses_inputs_that_require_grad():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="tritonllm::rope_cos_sin_fwd has no autograd formula"):
        OPS.rope_cos_sin_fwd(x, 8, 1.0)
    with pytest.raises(RuntimeError, match="tritonllm::grad_sq_norm has no autograd formula"):
        OPS.grad_sq_norm([torch.randn(3), x])  # a tensor inside a list argument counts too


def test_op_with_tensor_list_inputs_takes_no_formula():
    with pytest.raises(NotImplementedError, match="tritonllm::pack_heads: an autograd formula for an op with"):
        pack_heads_op.register_autograd(lambda ctx, g: g, setup_context=lambda ctx, inputs, output: None)
