"""Benchmarks of ``cross_entropy`` and the ``AdamW`` step.

cross_entropy: "default" = 16384x32000, "large" = 8192x131072 (rows x vocab), logits in the
requested dtype, mean reduction, against torch eager (``F.cross_entropy`` on ``logits.float()``, as
PyTorch training code does), torch.compile of it and Liger-Kernel's ``LigerCrossEntropyLoss``.
Liger computes the gradient in the forward, in place into the logits, so after its runs the shared
logits hold gradient values: finite numbers, which do not change the timings.
Bytes: fwd = read logits and targets, write the loss; bwd = read logits, targets and lse (fp32),
write dlogits.

adamw ("default" only): one ``step`` over the parameters of GPT-2 124M (148 fp32 tensors,
124.4M elements) with gradients set, against ``torch.optim.AdamW(foreach=True)`` and
``torch.optim.AdamW(fused=True)``. Bytes: per element read p, g, m, v and write p, m, v (28 fp32 bytes).

muon ("default" only): one ``tritonllm.optim.Muon`` step (Newton-Schulz coefficients, 5 steps, bf16
iterations, Nesterov, weight decay) over void125m's 48 block matrices (fp32; qkv 2304x768, proj
768x768, w13 4096x768, w2 768x2048 per layer), against ``torch.optim.Muon`` with the same settings
(one matrix at a time, bf16) and against the same update in plain PyTorch with the same-shape
matrices stacked and batched, under ``torch.compile`` (:class:`StackedMuon`). FLOPs: per matrix
with ``S = min(m, n)``, ``L = max(m, n)``, per iteration ``2 S^2 L`` (X X^T, counted in full) +
``2 S^3`` (A A) + ``2 S^2 L`` (B X).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tritonllm.bench import reference_ops as ref
from tritonllm.bench.harness import Case, compiled, liger_available, with_host
from tritonllm.kernels import cross_entropy
from tritonllm.kernels.muon import NEWTON_SCHULZ_COEFFS, lr_adjustment
from tritonllm.optim import AdamW, Muon

OPS = ["cross_entropy", "adamw", "muon"]

#: [rows, vocab] of the cross-entropy per size.
CE_SHAPES = {"default": (16384, 32000), "large": (8192, 131072)}
#: rows x vocab at which the host time of one call is measured (size "default")
CE_HOST_SHAPE = (8, 32000)

#: GPT-2 124M: token and position embeddings, 12 blocks (ln1, qkv, attention proj, ln2, fc, fc2;
#: weights [out, in] with biases), final norm.
_GPT2_BLOCK = [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,), (768,), (768,), (3072, 768), (3072,),
               (768, 3072), (768,)]
GPT2_SHAPES = [(50257, 768), (1024, 768)] + _GPT2_BLOCK * 12 + [(768,), (768,)]
ADAMW_HPARAMS: dict[str, Any] = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _ce_torch(logits, target):
    return F.cross_entropy(logits.float(), target)


def _ce_ours(logits, target):
    # validate=False: F.cross_entropy checks the targets on the device, with no host synchronisation
    # (ours reads its out-of-range flag on the host unless told not to, which no CUDA graph captures)
    return cross_entropy(logits, target, validate=False)


def _cross_entropy_case(n: int, v: int, dtype: torch.dtype) -> Case:
    def make_inputs():
        logits = torch.randn(n, v, device="cuda", dtype=dtype, requires_grad=True)
        target = torch.randint(0, v, (n,), device="cuda")
        return logits, target

    baselines = {"torch": _ce_torch, "torch.compile": compiled(_ce_torch)}
    if liger_available():
        from liger_kernel.transformers import LigerCrossEntropyLoss

        baselines["liger"] = LigerCrossEntropyLoss()
    es = torch.finfo(dtype).bits // 8
    fwd = n * v * es + 8 * n + 4                           # read logits, targets; write the loss
    bwd = 2 * n * v * es + 8 * n + 4 * n                   # read logits, targets, lse; write dlogits
    return Case("cross_entropy", f"{n}x{v}", dtype, make_inputs, ours=_ce_ours, baselines=baselines,
                bytes={"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}, reference=ref.cross_entropy)


def _stepper(make_optimizer):
    """``step(params)``: one optimizer step over ``params``, the optimizer built on the first call."""
    built = {}

    def step(params):
        key = id(params)
        if key not in built:
            built[key] = (params, make_optimizer(params))
        built[key][1].step()

    return step


def _adamw_case() -> Case:
    numel = sum(torch.Size(s).numel() for s in GPT2_SHAPES)

    def make_inputs():
        params = [torch.randn(s, device="cuda") for s in GPT2_SHAPES]
        for p in params:
            p.grad = 1e-3 * torch.randn_like(p)
        return (params,)

    baselines = {
        "torch foreach": _stepper(lambda ps: torch.optim.AdamW(ps, foreach=True, **ADAMW_HPARAMS)),
        "torch fused": _stepper(lambda ps: torch.optim.AdamW(ps, fused=True, **ADAMW_HPARAMS)),
    }
    return Case("adamw", f"{round(numel / 1e6)}M params/{len(GPT2_SHAPES)} tensors", torch.float32, make_inputs,
                ours=_stepper(lambda ps: AdamW(ps, **ADAMW_HPARAMS)), baselines=baselines,
                bytes={"step": 28 * numel}, passes=("step",))


#: void125m's block matrices: qkv, attention proj, fused SwiGLU w13, w2; 12 layers
VOID125M_MATRICES = [(2304, 768), (768, 768), (4096, 768), (768, 2048)] * 12
MUON_HPARAMS: dict[str, Any] = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
MUON_NS_STEPS = 5


@torch.compile(fullgraph=True, dynamic=False)
def _stacked_muon_update(p, g, buf, lr: float, adjust: float, weight_decay: float, momentum: float):
    """One Muon update of stacked same-shape matrices ``p``/``g``/``buf`` ([B, m, n]) in plain PyTorch."""
    buf.lerp_(g, 1 - momentum)
    u = g.lerp(buf, momentum)
    a, b, c = NEWTON_SCHULZ_COEFFS[0]
    x = u.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(MUON_NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return p * (1 - lr * weight_decay) - (lr * adjust) * x.float()


class StackedMuon:
    """The strong plain-PyTorch Muon: per shape, gradients stacked, one compiled batched update,
    the weights copied back (``torch._foreach_copy_``)."""

    def __init__(self, params, lr, weight_decay, momentum, nesterov) -> None:
        if not nesterov:
            raise ValueError("StackedMuon implements the Nesterov update only")
        self.hp = dict(lr=lr, weight_decay=weight_decay, momentum=momentum)
        by_shape: dict = {}
        for p in params:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        self.groups = [(ps, torch.zeros(len(ps), *shape, device=ps[0].device)) for shape, ps in by_shape.items()]

    @torch.no_grad()
    def step(self):
        for ps, buf in self.groups:
            new = _stacked_muon_update(torch.stack(ps), torch.stack([p.grad for p in ps]), buf,
                                       adjust=lr_adjustment("original", *ps[0].shape), **self.hp)
            torch._foreach_copy_(ps, list(new.unbind(0)))


def _muon_case() -> Case:
    shapes = VOID125M_MATRICES
    numel = sum(m * n for m, n in shapes)
    flops = sum(MUON_NS_STEPS * (4 * min(m, n) ** 2 * max(m, n) + 2 * min(m, n) ** 3) for m, n in shapes)

    def make_inputs():
        params = [0.02 * torch.randn(s, device="cuda") for s in shapes]
        for p in params:
            p.grad = 1e-3 * torch.randn_like(p)
        return (params,)

    baselines = {"torch.optim.Muon": _stepper(lambda ps: torch.optim.Muon(ps, ns_steps=MUON_NS_STEPS, **MUON_HPARAMS)),
                 "torch.compile stacked": _stepper(lambda ps: StackedMuon(ps, **MUON_HPARAMS))}
    ours = _stepper(lambda ps: Muon(ps, coefficients="newton_schulz", ns_steps=MUON_NS_STEPS, **MUON_HPARAMS))
    return Case("muon", f"{round(numel / 1e6)}M params/{len(shapes)} matrices", torch.float32, make_inputs,
                ours=ours, baselines=baselines, flops={"step": flops}, passes=("step",))


def cases(size: str, dtype: torch.dtype):
    n, v = CE_SHAPES[size]
    case = _cross_entropy_case(n, v, dtype)
    if size == "default":
        with_host(case, _cross_entropy_case(*CE_HOST_SHAPE, dtype), "torch")
    yield case
    if size == "default":
        yield _adamw_case()
        yield _muon_case()
