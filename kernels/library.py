"""The public kernels as ``torch.library`` custom ops (namespace ``tritonllm``), for ``torch.compile``
and FSDP2.

Each op family registers an opaque forward op and backward op (``torch.ops.tritonllm.<op>_fwd`` /
``<op>_bwd``) built on the module's own launchers, a fake (meta) implementation giving the outputs'
shapes, dtypes and strides without launching anything, and an autograd formula
(``register_autograd``) whose backward calls the backward op. Under ``torch.compile`` the ops stay in
the graph as single nodes (no graph break, no tracing into Triton), so the launchers keep their
cached :class:`~kernels._common.Launch` path and their autotuning at run time.

The in-place functionals (``adamw_step_``, ``clip_grads_``, ``muon_step_``, ``kv_cache_write_``) are
single ops that name the tensors they update in ``mutates_args`` (torch.compile functionalizes them), with
no autograd; so are the integer ``moe_sort``, ``orthogonalize``, the RoPE tables and
``flash_attention_decode``. ``clip_grads_`` with ``reduce`` is two ops, the sum of squares and the
scaling, with the reduce (a collective, under FSDP2) traced between them.

Each family ends with a functional of the public signature, registered in ``COMPILED``;
``@compilable`` on the public functional (kernels/_common.py) routes a call to it while
``torch.compiler.is_compiling()``, and the eager path runs unchanged otherwise. ``split_heads``, ``fork``
and ``add_fork`` return views, which an op may not: they stay autograd Functions that torch.compile traces
(views forward, the pack / weighted_add ops backward). A custom op returns no None, so an output an op does not produce is a
0-element tensor (:func:`_absent`), turned back into None by the functional or the autograd formula.

Differences from eager, all memory rather than results (an op may neither mutate a tensor the graph
holds nor return aliases): ``cross_entropy(inplace_backward=True)`` and ``rope(in_place_backward=True)``
write their gradients into new tensors, ``linear_cross_entropy`` scales the gradients it computed in the
forward into new tensors, and flash_attention's dq, dk, dv are three tensors, not one packed buffer.
``rope_flash_attention`` (RoPE + attention over a packed qkv) is one op pair whose backward returns the
packed qkv gradient, rotated in place inside the op, so that path keeps eager's memory and copies nothing.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
from typing import Callable, Optional

import torch
from torch import Tensor
from torch._C import DispatchKey

from . import (adamw as _adamw, cross_entropy as _ce, embedding as _emb, flash_attention as _fa, grouped_linear as _gl,
               kv_cache as _kv, linear as _lin, linear_cross_entropy as _lce, lora as _lora, moe_permute as _perm, moe_router as _router,
               muon as _muon, relu2 as _relu2, residual_mix as _mix, rms_norm as _rms, rope as _rope, softcap as _cap,
               split_heads as _split, swiglu as _swiglu)
from ._common import COMPILED

log = logging.getLogger(__name__)

#: names (``tritonllm::<op>``) of every op defined below, for :func:`_inductor_fallbacks`
_OP_NAMES: list[str] = []
_fallbacks_registered = False
_LIB = torch.library.Library("tritonllm", "FRAGMENT")
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
#: raw dispatch key set below autograd -> whether only a backend (CPU, CUDA) is left in it
_PLAIN_KEYSETS: dict[int, bool] = {}


def _only_backend(below: torch._C.DispatchKeySet) -> bool:
    """Nothing but a device backend below autograd (no fake tensors, functionalization or dispatch
    mode, which must see the call): the op may run its implementation directly. Cached per key set."""
    raw = below.raw_repr()
    plain = _PLAIN_KEYSETS.get(raw)
    if plain is None:
        top = below.remove(DispatchKey.ADInplaceOrView).highestPriorityTypeId()
        plain = _PLAIN_KEYSETS[raw] = top in (DispatchKey.CPU, DispatchKey.CUDA)
    return plain


class Op:
    """A functional custom op ``tritonllm::<name>`` (mutates nothing) with lean dispatcher kernels,
    called like ``torch.library.custom_op``'s ops and registered the same way (``register_fake``,
    ``register_autograd``); ``overload`` is its ``torch.ops`` overload. ``library``: the
    ``torch.library.Library`` fragment of the name's namespace (tritonllm's by default).

    ``custom_op`` spends about 6 us of Python per call that the op does not need (a dynamo-disable
    wrapper, output-aliasing checks, metadata objects: 9.0 against 3.3 us per call on the development
    CPU, docs/perf/NOTES.md),
    and a compiled model pays it on every op call of its step. Here the Autograd kernel, when no input
    requires grad (every call of a compiled graph at run time), runs the implementation itself if only a
    device backend is left below autograd, and otherwise redispatches (fake tensors, functionalization
    and dispatch modes reach the CompositeExplicitAutograd kernel, the implementation, or the fake); with
    an input requiring grad it applies an autograd Function made of the registered formula, as
    ``custom_op`` does. opcheck tests (tests/test_compile.py) hold each op to the custom-op rules.
    """

    def __init__(self, name: str, fn, library: torch.library.Library = _LIB):
        self.name = name
        self._fn = fn
        self._library = library
        #: (setup_context, backward) once registered
        self._formula: Optional[tuple[Callable, Callable]] = None
        namespace, opname = name.split("::")
        library.define(opname + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
        self.overload = getattr(getattr(torch.ops, namespace), opname).default
        library.impl(opname, fn, "CompositeExplicitAutograd")
        library.impl(opname, self._autograd_kernel, "Autograd", with_keyset=True)
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        return self.overload(*args)

    def register_fake(self, fn):
        torch.library.register_fake(self.name, fn, lib=self._library)
        return fn

    def register_autograd(self, backward, *, setup_context) -> None:
        """``backward(ctx, *grads)`` and ``setup_context(ctx, inputs, output)`` as for ``custom_op``
        (tensor-list inputs are not differentiable here: refused)."""
        from torch._library.utils import is_tensorlist_like_type

        if any(is_tensorlist_like_type(arg.type) for arg in self.overload._schema.arguments):
            raise NotImplementedError(f"{self.name}: an autograd formula for an op with tensor-list inputs")
        self._formula = (setup_context, backward)

    def _autograd_kernel(self, keyset, *args):
        below = keyset & _AFTER_AUTOGRAD
        if torch.is_grad_enabled() and _requires_grad(args):
            if self._formula is None:
                raise RuntimeError(f"{self.name} has no autograd formula: call it on tensors that do not require "
                                   "grad or under torch.no_grad()")
            return _OpFunction.apply(*args, self.overload, self._formula, below)
        if _only_backend(below):
            return self._fn(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return self.overload.redispatch(below, *args)


def _requires_grad(args) -> bool:
    """An argument, or a tensor in a list argument, requires grad."""
    return any(a.requires_grad if isinstance(a, Tensor)
               else isinstance(a, list) and any(isinstance(t, Tensor) and t.requires_grad for t in a) for a in args)


class _OpFunction(torch.autograd.Function):
    """An :class:`Op` under autograd: its implementation below autograd, then its registered
    ``setup_context`` and ``backward``. Applied as ``(*inputs, overload, formula, key set)``, so that
    ``needs_input_grad[i]`` is input ``i``'s; the backward sees only the inputs' entries."""

    @staticmethod
    def forward(ctx, *args):
        *inputs, overload, (setup_context, ctx.formula_backward), below = args
        with torch._C._AutoDispatchBelowAutograd():
            output = overload.redispatch(below, *inputs)
        setup_context(ctx, tuple(inputs), output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[:-3]
        try:
            grads_in = ctx.formula_backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (*(grads_in if isinstance(grads_in, tuple) else (grads_in,)), None, None, None)


def _custom_op(name: str, *, mutates_args):
    """Register the decorated implementation as op ``name``: an :class:`Op`, or where it mutates
    arguments (optimizer steps, clipping, the KV-cache write: a few calls per step) torch's
    ``custom_op``, which also bumps the mutated tensors' versions."""
    _OP_NAMES.append(name)
    if mutates_args:
        return torch.library.custom_op(name, mutates_args=mutates_args)
    return functools.partial(Op, name)


def _inductor_fallbacks() -> None:
    """Register every op as an inductor fallback (an extern kernel call), once, as soon as a fake runs
    while inductor is loaded (inside its compile, before it lowers the graph): the same registration,
    with the same layout constraint from the op's tags, that inductor makes itself at an op's first
    lowering ("implicit fallback"). Done ahead because torch 2.11's implicit path formats the op's IR
    arguments eagerly for an INFO log line, recursively through every producer in the graph: exponential
    in the depth, 200+ s of a void125m compile (docs/perf/NOTES.md). Later versions format lazily."""
    global _fallbacks_registered
    lowering = sys.modules.get("torch._inductor.lowering")
    if _fallbacks_registered or lowering is None:
        return
    _fallbacks_registered = True
    from torch._library.utils import get_layout_constraint_tag

    to_constraint = getattr(lowering, "tag_to_layout_constraint", None)
    if to_constraint is None:
        log.warning("torch %s: no torch._inductor.lowering.tag_to_layout_constraint; the tritonllm ops take "
                    "inductor's implicit-fallback path", torch.__version__)
        return
    for name in _OP_NAMES:
        op = getattr(getattr(torch.ops.tritonllm, name.split("::")[1]), "default")
        if op not in lowering.lowerings:
            lowering.make_fallback(op, layout_constraint=to_constraint(get_layout_constraint_tag(op, with_default=True)))


def _fake(op):
    """``@op.register_fake`` whose fake first runs :func:`_inductor_fallbacks`."""
    def register(fn):
        @functools.wraps(fn)
        def fake(*args, **kwargs):
            _inductor_fallbacks()
            return fn(*args, **kwargs)
        return op.register_fake(fake)
    return register


def _absent(like: Tensor) -> Tensor:
    """What an op returns for an output it does not produce: a 0-element tensor (custom ops return no None)."""
    return like.new_empty(0)


def _given(t: Tensor, produced: bool) -> Optional[Tensor]:
    """``t`` where the op ``produced`` it, else None (``t`` is then :func:`_absent`)."""
    return t if produced else None


def _rows(x: Tensor) -> int:
    """Rows of ``x [..., N]`` viewed as ``[rows, N]``."""
    return math.prod(x.shape[:-1])


def _public(fn):
    """Register ``fn`` as the compiled version of the public functional of the same name."""
    COMPILED[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------------------- rms_norm

@_custom_op("tritonllm::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h or absent, rstd)`` of :func:`kernels.rms_norm.rms_norm_fwd`."""
    y, h, rstd = _rms.rms_norm_fwd(x, weight, eps, residual)
    return y, (h if h is not None else _absent(x)), rstd


@_fake(rms_norm_fwd)
def _(x, weight, eps, residual):
    h = x.new_empty(x.shape) if residual is not None else _absent(x)
    return x.new_empty(x.shape), h, x.new_empty(_rows(x), dtype=torch.float32)


@_custom_op("tritonllm::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, dh: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of :func:`kernels.rms_norm.rms_norm_bwd` (``x`` the normalized tensor)."""
    return _rms.rms_norm_bwd(dy, x, weight, rstd, dh)


@_fake(rms_norm_bwd)
def _(dy, x, weight, rstd, dh):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, residual = inputs
    _, h, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(h if ctx.has_residual else x, weight, rstd)


def _rms_norm_backward(ctx, dy, dh, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(dy, x, weight, rstd, dh if ctx.has_residual else None)
    return dx, dw, None, (dx if ctx.has_residual else None)


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


@_public
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Tensor | None = None):
    y, h, _ = rms_norm_fwd(x, weight, eps, residual)
    return (y, h) if residual is not None else y


# ----------------------------------------------------------------------------- linear

@_custom_op("tritonllm::linear_fwd", mutates_args=())
def linear_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
               allow_tf32: bool) -> Tensor:
    """``x @ weight.T (+ bias) (+ residual)``: :func:`kernels.linear.linear_fwd`."""
    return _lin.linear_fwd(x, weight, bias, residual, allow_tf32)


@_fake(linear_fwd)
def _(x, weight, bias, residual, allow_tf32):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_custom_op("tritonllm::linear_bwd", mutates_args=())
def linear_bwd(dy: Tensor, x: Tensor, weight: Tensor, need_dx: bool, need_dw: bool, need_db: bool,
               allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` of :func:`kernels.linear.linear_bwd`, absent where not needed."""
    grads = _lin.linear_bwd(dy, x, weight, need_dx, need_dw, need_db, allow_tf32)
    dx, dw, db = (g if g is not None else _absent(x) for g in grads)
    return dx, dw, db


@_fake(linear_bwd)
def _(dy, x, weight, need_dx, need_dw, need_db, allow_tf32):
    return (x.new_empty(x.shape) if need_dx else _absent(x), weight.new_empty(weight.shape) if need_dw else _absent(x),
            weight.new_empty(weight.shape[0]) if need_db else _absent(x))


def _linear_setup(ctx, inputs, output):
    x, weight, _, _, allow_tf32 = inputs
    ctx.allow_tf32 = allow_tf32
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db, need_dr = ctx.needs_input_grad[:4]
    dx, dw, db = linear_bwd(dy, x, weight, need_dx, need_dw, need_db, ctx.allow_tf32)
    return _given(dx, need_dx), _given(dw, need_dw), _given(db, need_db), (dy if need_dr else None), None


linear_fwd.register_autograd(_linear_backward, setup_context=_linear_setup)


@_public
def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, *,
           allow_tf32: bool = True) -> Tensor:
    return linear_fwd(x, weight, bias, residual, allow_tf32)


@_custom_op("tritonllm::linear_swiglu_fwd", mutates_args=())
def linear_swiglu_fwd(x: Tensor, w13: Tensor, allow_tf32: bool) -> tuple[Tensor, Tensor]:
    """``(h, gu)``: :func:`kernels.linear.linear_swiglu_fwd` with the pre-activations stored."""
    return _lin.linear_swiglu_fwd(x, w13, allow_tf32, store_gu=True)


@_fake(linear_swiglu_fwd)
def _(x, w13, allow_tf32):
    two_f = w13.shape[0]
    return x.new_empty((*x.shape[:-1], two_f // 2)), x.new_empty((_rows(x), two_f))


@_custom_op("tritonllm::linear_swiglu_bwd", mutates_args=())
def linear_swiglu_bwd(dh: Tensor, x: Tensor, w13: Tensor, gu: Tensor, need_dx: bool, need_dw: bool,
                      allow_tf32: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dw13)`` of :func:`kernels.linear.linear_swiglu_bwd`, absent where not needed."""
    dx, dw = _lin.linear_swiglu_bwd(dh, x, w13, gu, need_dx, need_dw, allow_tf32)
    return (dx if dx is not None else _absent(x)), (dw if dw is not None else _absent(x))


@_fake(linear_swiglu_bwd)
def _(dh, x, w13, gu, need_dx, need_dw, allow_tf32):
    return x.new_empty(x.shape) if need_dx else _absent(x), w13.new_empty(w13.shape) if need_dw else _absent(x)


def _linear_swiglu_setup(ctx, inputs, output):
    x, w13, allow_tf32 = inputs
    ctx.allow_tf32 = allow_tf32
    ctx.save_for_backward(x, w13, output[1])


def _linear_swiglu_backward(ctx, dh, _dgu):
    x, w13, gu = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = linear_swiglu_bwd(dh, x, w13, gu, need_dx, need_dw, ctx.allow_tf32)
    return _given(dx, need_dx), _given(dw, need_dw), None


linear_swiglu_fwd.register_autograd(_linear_swiglu_backward, setup_context=_linear_swiglu_setup)


@_public
def linear_swiglu(x: Tensor, w13: Tensor, *, allow_tf32: bool = True) -> Tensor:
    return linear_swiglu_fwd(x, w13, allow_tf32)[0]


# ----------------------------------------------------------------------------- swiglu, relu2, softcap

@_custom_op("tritonllm::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: Tensor, up: Optional[Tensor]) -> Tensor:
    """:func:`kernels.swiglu.swiglu_fwd` (``up`` None: the packed ``[..., 2F]`` form)."""
    return _swiglu.swiglu_fwd(gate, up)


@_fake(swiglu_fwd)
def _(gate, up):
    f = gate.shape[-1] // 2 if up is None else gate.shape[-1]
    return gate.new_empty((*gate.shape[:-1], f))


@_custom_op("tritonllm::swiglu_bwd", mutates_args=())
def swiglu_bwd(dy: Tensor, gate: Tensor, up: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(dgate, dup)``, or ``(dgate_up, absent)`` in the packed form: :func:`kernels.swiglu.swiglu_bwd`."""
    if up is None:
        return _swiglu.swiglu_bwd(dy, gate), _absent(gate)
    return _swiglu.swiglu_bwd(dy, gate, up)


@_fake(swiglu_bwd)
def _(dy, gate, up):
    return gate.new_empty(gate.shape), (_absent(gate) if up is None else gate.new_empty(gate.shape))


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dgate, dup = swiglu_bwd(dy, gate, up)
    return dgate, (None if up is None else dup)


swiglu_fwd.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


@_public
def swiglu(gate: Tensor, up: Tensor | None = None) -> Tensor:
    return swiglu_fwd(gate, up)


@_custom_op("tritonllm::relu2_fwd", mutates_args=())
def relu2_fwd(x: Tensor) -> Tensor:
    """:func:`kernels.relu2.relu2_fwd`."""
    return _relu2.relu2_fwd(x)


@_custom_op("tritonllm::relu2_bwd", mutates_args=())
def relu2_bwd(x: Tensor, dy: Tensor) -> Tensor:
    """:func:`kernels.relu2.relu2_bwd`."""
    return _relu2.relu2_bwd(x, dy)


@_custom_op("tritonllm::softcap_fwd", mutates_args=())
def softcap_fwd(x: Tensor, cap: float) -> Tensor:
    """:func:`kernels.softcap.softcap_fwd`."""
    return _cap.softcap_fwd(x, cap)


@_custom_op("tritonllm::softcap_bwd", mutates_args=())
def softcap_bwd(y: Tensor, dy: Tensor, cap: float) -> Tensor:
    """:func:`kernels.softcap.softcap_bwd` (from the forward's output ``y``)."""
    return _cap.softcap_bwd(y, dy, cap)


for _op in (relu2_fwd, relu2_bwd, softcap_fwd, softcap_bwd):
    _fake(_op)(lambda x, *args: x.new_empty(x.shape))


def _relu2_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _relu2_backward(ctx, dy):
    return relu2_bwd(ctx.saved_tensors[0], dy)


def _softcap_setup(ctx, inputs, output):
    ctx.cap = inputs[1]
    ctx.save_for_backward(output)


def _softcap_backward(ctx, dy):
    return softcap_bwd(ctx.saved_tensors[0], dy, ctx.cap), None


relu2_fwd.register_autograd(_relu2_backward, setup_context=_relu2_setup)
softcap_fwd.register_autograd(_softcap_backward, setup_context=_softcap_setup)


@_public
def relu2(x: Tensor) -> Tensor:
    return relu2_fwd(x)


@_public
def softcap(x: Tensor, cap: float) -> Tensor:
    return softcap_fwd(x, cap)


# ----------------------------------------------------------------------------- rope, embedding

@_custom_op("tritonllm::rope_fwd", mutates_args=())
def rope_fwd(x: Tensor, cos: Tensor, sin: Tensor, position_offset: int, offset: Optional[Tensor]) -> Tensor:
    """:func:`kernels.rope.rope_fwd` at ``offset`` (a 0-d int tensor read on the device) or else
    ``position_offset``."""
    return _rope.rope_fwd(x, cos, sin, offset if offset is not None else position_offset)


@_custom_op("tritonllm::rope_bwd", mutates_args=())
def rope_bwd(dy: Tensor, cos: Tensor, sin: Tensor, position_offset: int, offset: Optional[Tensor]) -> Tensor:
    """:func:`kernels.rope.rope_bwd`, offsets as :func:`rope_fwd`."""
    return _rope.rope_bwd(dy, cos, sin, offset if offset is not None else position_offset)


for _op in (rope_fwd, rope_bwd):
    _fake(_op)(lambda x, cos, sin, position_offset, offset: x.new_empty(x.shape))


def _rope_setup(ctx, inputs, output):
    _, cos, sin, ctx.position_offset, offset = inputs
    ctx.save_for_backward(cos, sin, offset)


def _rope_backward(ctx, dy):
    cos, sin, offset = ctx.saved_tensors
    return rope_bwd(dy, cos, sin, ctx.position_offset, offset), None, None, None, None


rope_fwd.register_autograd(_rope_backward, setup_context=_rope_setup)


@_public
def rope(x: Tensor, cos: Tensor, sin: Tensor, *, position_offset: int | Tensor = 0,
         in_place_backward: bool = False) -> Tensor:
    # in_place_backward is not honoured: an op may not overwrite the gradient the graph hands it
    if isinstance(position_offset, Tensor):
        return rope_fwd(x, cos, sin, 0, position_offset)
    return rope_fwd(x, cos, sin, position_offset, None)


@_custom_op("tritonllm::rope_cos_sin_fwd", mutates_args=())
def rope_cos_sin_fwd(turns: Tensor, seq_len: int, mscale: float) -> tuple[Tensor, Tensor]:
    """:func:`kernels.rope.rope_cos_sin_fwd`: the tables from the frequencies (no gradient)."""
    return _rope.rope_cos_sin_fwd(turns, seq_len, mscale)


@_fake(rope_cos_sin_fwd)
def _(turns, seq_len, mscale):
    return tuple(turns.new_empty((seq_len, turns.shape[0]), dtype=torch.float32) for _ in range(2))


@_public
def rope_cos_sin(seq_len: int, head_dim: int, theta: float = 10000.0, scaling: dict | None = None,
                 device=None) -> tuple[Tensor, Tensor]:
    turns, mscale = _rope.rope_turns(seq_len, head_dim, theta, scaling, device)
    return rope_cos_sin_fwd(turns, seq_len, mscale)


@_custom_op("tritonllm::embedding_fwd", mutates_args=())
def embedding_fwd(ids: Tensor, weight: Tensor, padding_idx: Optional[int], validate: bool) -> Tensor:
    """:func:`kernels.embedding.embedding_fwd`, ``padding_idx`` checked as :func:`kernels.embedding.embedding`."""
    _emb.padding_index(padding_idx, weight.shape[0])
    return _emb.embedding_fwd(ids, weight, validate)


@_fake(embedding_fwd)
def _(ids, weight, padding_idx, validate):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@_custom_op("tritonllm::embedding_bwd", mutates_args=())
def embedding_bwd(dy: Tensor, ids: Tensor, num_embeddings: int, padding_idx: Optional[int]) -> Tensor:
    """:func:`kernels.embedding.embedding_bwd`: the weight gradient."""
    return _emb.embedding_bwd(dy, ids, num_embeddings, padding_idx)


@_fake(embedding_bwd)
def _(dy, ids, num_embeddings, padding_idx):
    return dy.new_empty((num_embeddings, dy.shape[-1]))


def _embedding_setup(ctx, inputs, output):
    ids, weight, ctx.padding_idx, _ = inputs
    ctx.num_embeddings = weight.shape[0]
    ctx.save_for_backward(ids)


def _embedding_backward(ctx, dy):
    return None, embedding_bwd(dy, ctx.saved_tensors[0], ctx.num_embeddings, ctx.padding_idx), None, None


embedding_fwd.register_autograd(_embedding_backward, setup_context=_embedding_setup)


@_public
def embedding(ids: Tensor, weight: Tensor, padding_idx: int | None = None, validate: bool = True) -> Tensor:
    return embedding_fwd(ids, weight, padding_idx, validate)


# ----------------------------------------------------------------------------- LoRA

def _segment_pairs(segments: list[int]) -> tuple[tuple[int, int], ...]:
    """``(start, width)`` pairs from their flattened list (an op's schema holds ``int[]``)."""
    return tuple(zip(segments[::2], segments[1::2]))


@_custom_op("tritonllm::lora_linear_fwd", mutates_args=())
def lora_linear_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], lora_a: Tensor,
                    lora_b: Tensor, segments: list[int], scale: float, dropout_p: float, seed: Optional[Tensor],
                    allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, xd, u)`` of :func:`kernels.lora.lora_linear`'s forward: the output, the dropped-out input
    ``[M, K]`` (absent without dropout) and the scaled down projection ``[M, S r]`` the backward reads;
    ``segments`` is the flattened list of ``(start, width)`` pairs."""
    x2 = _lora.as_matrix(x, weight.shape[1])
    y, xd, u = _lora.lora_forward(x2, weight, bias, residual, lora_a, lora_b, _segment_pairs(segments), scale, dropout_p,
                              seed, allow_tf32)
    return y.view(*x.shape[:-1], weight.shape[0]), (xd if dropout_p > 0 else _absent(x)), u


@_fake(lora_linear_fwd)
def _(x, weight, bias, residual, lora_a, lora_b, segments, scale, dropout_p, seed, allow_tf32):
    (S, r, K), M = lora_a.shape, _rows(x)
    return (x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((M, K)) if dropout_p > 0 else _absent(x),
            x.new_empty((M, S * r)))


@_custom_op("tritonllm::lora_linear_bwd", mutates_args=())
def lora_linear_bwd(dy: Tensor, x: Tensor, xd: Optional[Tensor], weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                    u: Tensor, seed: Optional[Tensor], segments: list[int], scale: float, dropout_p: float,
                    allow_tf32: bool, need_x: bool, need_w: bool, need_bias: bool, need_a: bool,
                    need_b: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias, dlora_a, dlora_b)`` of :func:`kernels.lora.lora_linear`, absent where not needed."""
    x2 = _lora.as_matrix(x, weight.shape[1])
    dx, *rest = _lora.lora_backward(dy, x2, x2 if xd is None else xd, weight, lora_a, lora_b, u, seed,
                                _segment_pairs(segments), scale, dropout_p, allow_tf32,
                                (need_x, need_w, need_bias, need_a, need_b))
    grads = (None if dx is None else dx.view(x.shape), *rest)
    dx, dw, db, da, dlb = (g if g is not None else _absent(x) for g in grads)
    return dx, dw, db, da, dlb


@_fake(lora_linear_bwd)
def _(dy, x, xd, weight, lora_a, lora_b, u, seed, segments, scale, dropout_p, allow_tf32, need_x, need_w, need_bias,
      need_a, need_b):
    like = ((x, x.shape, need_x), (weight, weight.shape, need_w), (weight, weight.shape[:1], need_bias),
            (lora_a, lora_a.shape, need_a), (lora_b, lora_b.shape, need_b))
    return tuple(t.new_empty(shape) if needed else _absent(x) for t, shape, needed in like)


def _lora_setup(ctx, inputs, output):
    x, weight, _, _, a, b, segments, scale, p, seed, allow_tf32 = inputs
    ctx.options = (segments, scale, p, allow_tf32)
    _, xd, u = output
    ctx.save_for_backward(x, xd if p > 0 else None, weight, a, b, u, seed if p > 0 else None)


def _lora_backward(ctx, dy, _dxd, _du):
    x, xd, weight, a, b, u, seed = ctx.saved_tensors
    segments, scale, p, allow_tf32 = ctx.options
    need_x, need_w, need_bias, need_res, need_a, need_b = ctx.needs_input_grad[:6]
    dx, dw, dbias, da, db = lora_linear_bwd(dy, x, xd, weight, a, b, u, seed, segments, scale, p, allow_tf32, need_x,
                                            need_w, need_bias, need_a, need_b)
    return (_given(dx, need_x), _given(dw, need_w), _given(dbias, need_bias), (dy if need_res else None),
            _given(da, need_a), _given(db, need_b), None, None, None, None, None)


lora_linear_fwd.register_autograd(_lora_backward, setup_context=_lora_setup)


@_public
def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, segments,
                scale: float, *, dropout_p: float = 0.0, seed: Tensor | None = None, residual: Tensor | None = None,
                allow_tf32: bool = True) -> Tensor:
    pairs = tuple((int(s), int(n)) for s, n in segments)
    _lora.check_lora_args(x, weight, bias, lora_a, lora_b, pairs, scale, float(dropout_p), seed, residual)
    return lora_linear_fwd(x, weight, bias, residual, lora_a, lora_b, [v for pair in pairs for v in pair],
                           float(scale), float(dropout_p), seed, allow_tf32)[0]


# ----------------------------------------------------------------------------- attention

@_custom_op("tritonllm::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, window: Optional[int],
                        softmax_scale: Optional[float], deterministic: bool,
                        documents: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """``(o, lse)`` of :func:`kernels.flash_attention.flash_attention_fwd`; ``deterministic`` is the
    backward's switch, carried here for the autograd formula."""
    return _fa.flash_attention_fwd(q, k, v, causal, window, softmax_scale, documents=documents)


@_fake(flash_attention_fwd)
def _(q, k, v, causal, window, softmax_scale, deterministic, documents):
    B, T, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, T), dtype=torch.float32)


@_custom_op("tritonllm::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                        window: Optional[int], softmax_scale: Optional[float],
                        deterministic: bool, documents: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`kernels.flash_attention.flash_attention_bwd`, each in a tensor of its
    own (not its ``packed`` form: an op's outputs may not alias one another)."""
    return _fa.flash_attention_bwd(do, q, k, v, o, lse, causal, window, softmax_scale, deterministic=deterministic,
                                   documents=documents)


@_fake(flash_attention_bwd)
def _(do, q, k, v, o, lse, causal, window, softmax_scale, deterministic, documents):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_attention_setup(ctx, inputs, output):
    q, k, v, *ctx.options, documents = inputs
    ctx.save_for_backward(q, k, v, *output, documents)


def _flash_attention_backward(ctx, do, _dlse):
    *saved, documents = ctx.saved_tensors
    dq, dk, dv = flash_attention_bwd(do, *saved, *ctx.options, documents)
    return dq, dk, dv, None, None, None, None, None


flash_attention_fwd.register_autograd(_flash_attention_backward, setup_context=_flash_attention_setup)


@_public
def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, window: int | None = None,
                    softmax_scale: float | None = None, deterministic: bool = True,
                    documents: Tensor | None = None) -> Tensor:
    return flash_attention_fwd(q, k, v, causal, window, softmax_scale, deterministic, documents)[0]


@_custom_op("tritonllm::rope_flash_attention_fwd", mutates_args=())
def rope_flash_attention_fwd(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int, causal: bool,
                             window: Optional[int], softmax_scale: Optional[float], deterministic: bool,
                             documents: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(o, lse, qk)`` of :func:`kernels.flash_attention.rope_flash_attention`: ``qk`` the rotated query
    and key heads ``[B, T, n_heads + n_kv_heads, D]``, kept for the backward."""
    qk = _rope.rope_fwd(qkv[:, :, :n_heads + n_kv_heads], cos, sin)
    q, k = qk.split((n_heads, n_kv_heads), dim=2)
    o, lse = _fa.flash_attention_fwd(q, k, qkv[:, :, n_heads + n_kv_heads:], causal, window, softmax_scale,
                                     documents=documents)
    return o, lse, qk


@_fake(rope_flash_attention_fwd)
def _(qkv, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale, deterministic, documents):
    B, T, _, D = qkv.shape
    return (qkv.new_empty((B, T, n_heads, D)), qkv.new_empty((B, n_heads, T), dtype=torch.float32),
            qkv.new_empty((B, T, n_heads + n_kv_heads, D)))


@_custom_op("tritonllm::rope_flash_attention_bwd", mutates_args=())
def rope_flash_attention_bwd(do: Tensor, qk: Tensor, qkv: Tensor, o: Tensor, lse: Tensor, cos: Tensor, sin: Tensor,
                             n_heads: int, n_kv_heads: int, causal: bool, window: Optional[int],
                             softmax_scale: Optional[float], deterministic: bool,
                             documents: Optional[Tensor]) -> Tensor:
    """The gradient of ``qkv``: the attention backward into one packed buffer, its query and key heads
    then rotated back in place (:func:`kernels.flash_attention.flash_attention_bwd_packed`,
    :func:`kernels.rope.rope_bwd`)."""
    q, k = qk.split((n_heads, n_kv_heads), dim=2)
    dqkv = _fa.flash_attention_bwd_packed(do, q, k, qkv[:, :, n_heads + n_kv_heads:], o, lse, causal, window,
                                          softmax_scale, deterministic, documents)
    _rope.rope_bwd(dqkv[:, :, :n_heads + n_kv_heads], cos, sin, in_place=True)
    return dqkv


@_fake(rope_flash_attention_bwd)
def _(do, qk, qkv, o, lse, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale, deterministic, documents):
    return qkv.new_empty(qkv.shape)


def _rope_flash_attention_setup(ctx, inputs, output):
    qkv, cos, sin, *ctx.options, documents = inputs
    o, lse, qk = output
    ctx.save_for_backward(qk, qkv, o, lse, cos, sin, documents)


def _rope_flash_attention_backward(ctx, do, _dlse, _dqk):
    *saved, documents = ctx.saved_tensors
    return (rope_flash_attention_bwd(do, *saved, *ctx.options, documents),) + (None,) * 9


rope_flash_attention_fwd.register_autograd(_rope_flash_attention_backward, setup_context=_rope_flash_attention_setup)


@_public
def rope_flash_attention(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, n_kv_heads: int, causal: bool = True,
                         window: int | None = None, softmax_scale: float | None = None, deterministic: bool = True,
                         documents: Tensor | None = None) -> Tensor:
    _fa.check_packed_heads(qkv, n_heads, n_kv_heads)
    return rope_flash_attention_fwd(qkv, cos, sin, n_heads, n_kv_heads, causal, window, softmax_scale, deterministic,
                                    documents)[0]


@_custom_op("tritonllm::flash_attention_decode", mutates_args=())
def flash_attention_decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_len: Tensor, causal: bool,
                              window: Optional[int], softmax_scale: Optional[float], split_kv: Optional[int]) -> Tensor:
    """:func:`kernels.flash_attention.flash_attention_decode` (forward only)."""
    return _eager(_fa.flash_attention_decode)(q, k_cache, v_cache, kv_len, causal, window, softmax_scale, split_kv)


@_fake(flash_attention_decode_op)
def _(q, k_cache, v_cache, kv_len, causal, window, softmax_scale, split_kv):
    return q.new_empty(q.shape)


@_public
def flash_attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_len: Tensor, causal: bool = True,
                           window: int | None = None, softmax_scale: float | None = None,
                           split_kv: int | None = None) -> Tensor:
    return flash_attention_decode_op(q, k_cache, v_cache, kv_len, causal, window, softmax_scale, split_kv)


@_custom_op("tritonllm::pack_heads", mutates_args=())
def pack_heads(grads: list[Optional[Tensor]], sizes: list[int], like: Tensor) -> Tensor:
    """:func:`kernels.split_heads.pack_heads` into a tensor of ``like``'s shape, dtype and device."""
    return _split.pack_heads(grads, sizes, like.shape, like.dtype, like.device)


@_fake(pack_heads)
def _(grads, sizes, like):
    return like.new_empty(like.shape)


class _SplitHeads(torch.autograd.Function):
    """Views forward (traced as views), the pack op backward."""

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.sizes = sizes
        ctx.save_for_backward(x)
        return tuple(x.split(sizes, dim=2))

    @staticmethod
    def backward(ctx, *grads):
        return pack_heads(list(grads), list(ctx.sizes), ctx.saved_tensors[0]), None


@_public
def split_heads(x: Tensor, sizes) -> tuple[Tensor, ...]:
    return _SplitHeads.apply(x, tuple(int(s) for s in sizes))


# ----------------------------------------------------------------------------- residual mixing

@_custom_op("tritonllm::weighted_add_fwd", mutates_args=())
def weighted_add_fwd(x: Tensor, y: Tensor, weight: Optional[Tensor]) -> Tensor:
    """:func:`kernels.residual_mix.weighted_add_fwd`."""
    return _mix.weighted_add_fwd(x, y, weight)


@_fake(weighted_add_fwd)
def _(x, y, weight):
    return x.new_empty(x.shape)


@_custom_op("tritonllm::weighted_add_bwd", mutates_args=())
def weighted_add_bwd(dout: Tensor, x: Tensor, y: Tensor, weight: Tensor, need_dx: bool, need_dy: bool,
                     need_dw: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dy, dweight)`` of :func:`kernels.residual_mix.weighted_add_bwd`, absent where not needed;
    dx is absent for a one-weight sum too (it is ``dout`` itself, which an op may not return)."""
    dx, dy, dw = _mix.weighted_add_bwd(dout, x, y, weight, need_dx and weight.numel() == 2, need_dy, need_dw)
    dx, dy, dw = (g if g is not None else _absent(x) for g in (dx, dy, dw))
    return dx, dy, dw


@_fake(weighted_add_bwd)
def _(dout, x, y, weight, need_dx, need_dy, need_dw):
    return (x.new_empty(x.shape) if need_dx and weight.numel() == 2 else _absent(x),
            y.new_empty(y.shape) if need_dy else _absent(x), weight.new_empty(weight.shape) if need_dw else _absent(x))


def _weighted_add_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _weighted_add_backward(ctx, dout):
    x, y, weight = ctx.saved_tensors
    need_dx, need_dy, need_dw = ctx.needs_input_grad
    dx, dy, dw = weighted_add_bwd(dout, x, y, weight, need_dx, need_dy, need_dw)
    if need_dx and weight.numel() == 1:
        dx = dout
    return _given(dx, need_dx), _given(dy, need_dy), _given(dw, need_dw)


weighted_add_fwd.register_autograd(_weighted_add_backward, setup_context=_weighted_add_setup)


@_public
def weighted_add(x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
    return weighted_add_fwd(x, y, weight)


class _Fork(_mix.ForkFunction):
    """ForkFunction (aliases forward, traced as views) with its gradients summed by the weighted_add op."""

    @staticmethod
    def backward(ctx, g1, g2):
        return _mix.sum_grads(g1, g2, weighted_add_fwd)


class _AddFork(_mix.AddForkFunction):
    """AddForkFunction with its sum and its gradients' sums by the weighted_add op."""

    @staticmethod
    def forward(ctx, x, y):
        return x.view_as(x), y.view_as(y), weighted_add_fwd(x, y, None)

    @staticmethod
    def backward(ctx, gx, gy, gs):
        return _mix.sum_grads(gx, gs, weighted_add_fwd), _mix.sum_grads(gy, gs, weighted_add_fwd)


@_public
def fork(x: Tensor) -> tuple[Tensor, Tensor]:
    return _Fork.apply(x)


@_public
def add_fork(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _AddFork.apply(x, y)


# ----------------------------------------------------------------------------- losses

@_custom_op("tritonllm::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
                      reduction: str, return_z_loss: bool, validate: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z or absent, lse, count or absent)`` of :func:`kernels.cross_entropy.cross_entropy_fwd`."""
    loss, z, lse, count, _, _ = _ce.cross_entropy_fwd(logits, target, ignore_index, label_smoothing, z_loss,
                                                      reduction, return_z_loss, validate)
    return loss, (z if z is not None else _absent(lse)), lse, (count if count is not None else _absent(lse))


@_fake(cross_entropy_fwd)
def _(logits, target, ignore_index, label_smoothing, z_loss, reduction, return_z_loss, validate):
    f32 = dict(dtype=torch.float32)
    shape = target.shape if reduction == "none" else ()
    return (logits.new_empty(shape, **f32), logits.new_empty(shape if return_z_loss else 0, **f32),
            logits.new_empty(_rows(logits), **f32), logits.new_empty(() if reduction == "mean" else 0, **f32))


@_custom_op("tritonllm::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Optional[Tensor],
                      ignore_index: int, label_smoothing: float, z_loss: float) -> Tensor:
    """dlogits (logits' shape) of :func:`kernels.cross_entropy.cross_entropy_bwd`."""
    V = logits.shape[-1]
    dx = _ce.cross_entropy_bwd(dloss, _ce.rows_view(logits, V), target.reshape(-1).contiguous(), lse, count,
                               ignore_index, label_smoothing, z_loss)
    return dx.view(logits.shape)


@_fake(cross_entropy_bwd)
def _(dloss, logits, target, lse, count, ignore_index, label_smoothing, z_loss):
    return logits.new_empty(logits.shape)


def _cross_entropy_setup(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, z_loss, reduction, _, _ = inputs
    ctx.args, ctx.mean = (ignore_index, label_smoothing, z_loss), reduction == "mean"
    ctx.save_for_backward(logits, target, output[2], output[3])


def _cross_entropy_backward(ctx, dloss, _dz, _dlse, _dcount):
    logits, target, lse, count = ctx.saved_tensors
    dx = cross_entropy_bwd(dloss, logits, target, lse, count if ctx.mean else None, *ctx.args)
    return dx, None, None, None, None, None, None, None


cross_entropy_fwd.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)


@_public
def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                  z_loss: float = 0.0, reduction: str = "mean", return_z_loss: bool = False,
                  inplace_backward: bool = False, validate: bool = True):
    loss, z, _, _ = cross_entropy_fwd(logits, target, ignore_index, float(label_smoothing), float(z_loss), reduction,
                                      return_z_loss, validate)
    return (loss, z.detach()) if return_z_loss else loss


@_custom_op("tritonllm::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, label_smoothing: float,
                             z_loss: float, reduction: str, chunk_size: Optional[int], need_dx: bool, need_dw: bool,
                             allow_tf32: bool, softcap: Optional[float]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, z, dx, dw, scale)`` of :func:`kernels.linear_cross_entropy.linear_cross_entropy_fwd`, absent
    where it gives None (the gradients and the scale for ``reduction="none"``)."""
    out = _lce.linear_cross_entropy_fwd(x, weight, target, ignore_index, label_smoothing, z_loss, reduction,
                                        chunk_size, need_dx, need_dw, allow_tf32, softcap)
    loss, z, dx, dw, scale = (t if t is not None else _absent(x) for t in out)
    return loss, z, dx, dw, scale


@_fake(linear_cross_entropy_fwd)
def _(x, weight, target, ignore_index, label_smoothing, z_loss, reduction, chunk_size, need_dx, need_dw,
      allow_tf32, softcap):
    f32 = dict(dtype=torch.float32)
    if reduction == "none":
        return (x.new_empty(target.shape, **f32), x.new_empty(target.shape, **f32), _absent(x), _absent(x),
                _absent(x))
    dw_dtype = torch.float32 if _lce.DW_FP32 else weight.dtype
    return (x.new_empty((), **f32), x.new_empty((), **f32),
            x.new_empty((_rows(x), x.shape[-1])) if need_dx else _absent(x),
            weight.new_empty(weight.shape, dtype=dw_dtype) if need_dw else _absent(x), x.new_empty(1, **f32))


@_custom_op("tritonllm::linear_cross_entropy_scale", mutates_args=())
def linear_cross_entropy_scale(dloss: Tensor, dx: Optional[Tensor], dw: Optional[Tensor], scale: Tensor,
                               weight_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of a ``mean``/``sum`` loss: the forward's gradients times ``dloss * scale`` into new
    tensors (:func:`kernels.linear_cross_entropy.scale_stored_grads`), absent where not given."""
    dx, dw, _ = _lce.scale_stored_grads(dloss, dx, dw, scale, weight_dtype, in_place=False)
    return (dx if dx is not None else _absent(scale)), (dw if dw is not None else _absent(scale))


@_fake(linear_cross_entropy_scale)
def _(dloss, dx, dw, scale, weight_dtype):
    return (_absent(scale) if dx is None else dx.new_empty(dx.shape),
            _absent(scale) if dw is None else dw.new_empty(dw.shape, dtype=weight_dtype))


@_custom_op("tritonllm::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(dloss: Tensor, x: Tensor, weight: Tensor, target: Tensor, ignore_index: int,
                             label_smoothing: float, z_loss: float, chunk_size: Optional[int], need_dx: bool,
                             need_dw: bool, allow_tf32: bool, softcap: Optional[float]) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of a ``none`` loss: :func:`kernels.linear_cross_entropy.linear_cross_entropy_bwd`."""
    dx, dw = _lce.linear_cross_entropy_bwd(dloss, x, weight, target, ignore_index, label_smoothing, z_loss,
                                           chunk_size, need_dx, need_dw, allow_tf32, softcap)
    return (dx if dx is not None else _absent(x)), (dw if dw is not None else _absent(x))


@_fake(linear_cross_entropy_bwd)
def _(dloss, x, weight, target, ignore_index, label_smoothing, z_loss, chunk_size, need_dx, need_dw, allow_tf32,
      softcap):
    return x.new_empty(x.shape) if need_dx else _absent(x), weight.new_empty(weight.shape) if need_dw else _absent(x)


def _linear_cross_entropy_setup(ctx, inputs, output):
    x, weight, target, *args = inputs
    ctx.none, ctx.x_shape, ctx.weight_dtype = args[3] == "none", x.shape, weight.dtype
    ctx.need_dx, ctx.need_dw = args[5], args[6]
    ctx.args = (*args[:3], *args[4:])  # the options but the reduction, as linear_cross_entropy_bwd takes them
    if ctx.none:
        ctx.save_for_backward(x, weight, target)
    else:
        ctx.save_for_backward(*output[2:])


def _linear_cross_entropy_backward(ctx, dloss, _dz, _ddx, _ddw, _dscale):
    if ctx.none:
        dx, dw = linear_cross_entropy_bwd(dloss, *ctx.saved_tensors, *ctx.args)
    else:
        dx, dw, scale = ctx.saved_tensors
        dx, dw = linear_cross_entropy_scale(dloss, _given(dx, ctx.need_dx), _given(dw, ctx.need_dw), scale,
                                            ctx.weight_dtype)
        if ctx.need_dx:
            dx = dx.view(ctx.x_shape)
    return (_given(dx, ctx.need_dx), _given(dw, ctx.need_dw)) + (None,) * 10


linear_cross_entropy_fwd.register_autograd(_linear_cross_entropy_backward, setup_context=_linear_cross_entropy_setup)


@_public
def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
                         chunk_size: int | None = None, return_z_loss: bool = False, *, allow_tf32: bool = True,
                         softcap: float | None = None):
    grad = torch.is_grad_enabled()
    loss, z, *_ = linear_cross_entropy_fwd(x, weight, target, ignore_index, float(label_smoothing), float(z_loss),
                                           reduction, chunk_size, grad and x.requires_grad,
                                           grad and weight.requires_grad, allow_tf32,
                                           None if softcap is None else float(softcap))
    return (loss, z.detach()) if return_z_loss else loss


# ----------------------------------------------------------------------------- mixture of experts

def _eager(fn):
    """The undecorated body of a ``@compilable`` functional that is its own launcher (an op's
    implementation runs it; it never routes back to the op)."""
    return fn.__wrapped__


@_custom_op("tritonllm::moe_router_fwd", mutates_args=())
def moe_router_fwd(logits: Tensor, top_k: int, score: str,
                   normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(weights, aux_loss, z_loss, max_load, indices, counts)`` of :func:`kernels.moe_router.moe_router_fwd`:
    the float outputs first (opcheck's AOT check sums the outputs into the first one's dtype)."""
    indices, weights, aux, z, counts, max_load = _router.moe_router_fwd(logits, top_k, score, normalize)
    return weights, aux, z, max_load, indices, counts


@_fake(moe_router_fwd)
def _(logits, top_k, score, normalize):
    _router.check_router_args(logits, top_k, score)
    T, E = logits.shape
    i32, f32 = dict(dtype=torch.int32), dict(dtype=torch.float32)
    return (logits.new_empty((T, top_k), **f32), logits.new_empty((), **f32), logits.new_empty((), **f32),
            logits.new_empty((), **f32), logits.new_empty((T, top_k), **i32), logits.new_empty(E, **i32))


@_custom_op("tritonllm::moe_router_bwd", mutates_args=())
def moe_router_bwd(logits: Tensor, indices: Tensor, counts: Tensor, d_weights: Optional[Tensor],
                   d_aux: Optional[Tensor], d_z: Optional[Tensor], score: str, normalize: bool) -> Tensor:
    """The logits' gradient of :func:`kernels.moe_router.moe_router_bwd` (each given gradient may be None)."""
    return _router.moe_router_bwd(logits, indices, counts, d_weights, d_aux, d_z, score, normalize)


@_fake(moe_router_bwd)
def _(logits, indices, counts, d_weights, d_aux, d_z, score, normalize):
    return logits.new_empty(logits.shape)


def _moe_router_setup(ctx, inputs, output):
    logits, _, ctx.score, ctx.normalize = inputs
    _, _, _, max_load, indices, counts = output
    ctx.save_for_backward(logits, indices, counts)
    ctx.mark_non_differentiable(indices, counts, max_load)
    ctx.set_materialize_grads(False)


def _moe_router_backward(ctx, d_weights, d_aux, d_z, _d_max_load, _d_indices, _d_counts):
    if d_weights is None and d_aux is None and d_z is None:
        return None, None, None, None
    logits, indices, counts = ctx.saved_tensors
    return moe_router_bwd(logits, indices, counts, d_weights, d_aux, d_z, ctx.score, ctx.normalize), None, None, None


moe_router_fwd.register_autograd(_moe_router_backward, setup_context=_moe_router_setup)


@_public
def moe_router(logits: Tensor, top_k: int, score: str = "softmax", normalize: bool = True) -> _router.MoERouting:
    weights, aux, z, max_load, indices, counts = moe_router_fwd(logits, top_k, score, normalize)
    return _router.MoERouting(indices, weights, aux, z, counts, max_load)


@_custom_op("tritonllm::moe_sort_fwd", mutates_args=())
def moe_sort_fwd(indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(expert_offsets, positions, slots)`` of :func:`kernels.moe_permute.moe_sort` (integers: no gradient)."""
    return tuple(_eager(_perm.moe_sort)(indices, num_experts))


@_fake(moe_sort_fwd)
def _(indices, num_experts):
    T, k = indices.shape
    i32 = dict(dtype=torch.int32)
    return indices.new_empty(num_experts + 1, **i32), indices.new_empty((T, k), **i32), indices.new_empty(T * k, **i32)


@_public
def moe_sort(indices: Tensor, num_experts: int) -> _perm.MoEPlan:
    return _perm.MoEPlan(*moe_sort_fwd(indices, num_experts))


@_custom_op("tritonllm::moe_gather_fwd", mutates_args=())
def moe_gather_fwd(x: Tensor, expert_offsets: Tensor, positions: Tensor, slots: Tensor) -> Tensor:
    """:func:`kernels.moe_permute.moe_gather_fwd` of the plan ``(expert_offsets, positions, slots)``."""
    return _perm.moe_gather_fwd(x, _perm.MoEPlan(expert_offsets, positions, slots))


@_fake(moe_gather_fwd)
def _(x, expert_offsets, positions, slots):
    return x.new_empty((slots.shape[0], x.shape[1]))


@_custom_op("tritonllm::moe_gather_bwd", mutates_args=())
def moe_gather_bwd(d_sorted: Tensor, positions: Tensor) -> Tensor:
    """:func:`kernels.moe_permute.moe_gather_bwd`: each token's k row gradients summed."""
    return _perm.moe_gather_bwd(d_sorted, positions)


@_fake(moe_gather_bwd)
def _(d_sorted, positions):
    return d_sorted.new_empty((positions.shape[0], d_sorted.shape[1]))


def _moe_gather_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _moe_gather_backward(ctx, d_sorted):
    return moe_gather_bwd(d_sorted, ctx.saved_tensors[0]), None, None, None


moe_gather_fwd.register_autograd(_moe_gather_backward, setup_context=_moe_gather_setup)


@_public
def moe_gather(x: Tensor, plan: _perm.MoEPlan) -> Tensor:
    _perm.check_plan(plan)
    return moe_gather_fwd(x, *plan)


@_custom_op("tritonllm::moe_combine_fwd", mutates_args=())
def moe_combine_fwd(expert_out: Tensor, weights: Tensor, expert_offsets: Tensor, positions: Tensor,
                    slots: Tensor) -> Tensor:
    """:func:`kernels.moe_permute.moe_combine_fwd` of the plan ``(expert_offsets, positions, slots)``."""
    return _perm.moe_combine_fwd(expert_out, weights, _perm.MoEPlan(expert_offsets, positions, slots))


@_fake(moe_combine_fwd)
def _(expert_out, weights, expert_offsets, positions, slots):
    return expert_out.new_empty((positions.shape[0], expert_out.shape[1]))


@_custom_op("tritonllm::moe_combine_bwd", mutates_args=())
def moe_combine_bwd(dy: Tensor, expert_out: Tensor, weights: Tensor, slots: Tensor,
                    need_dw: bool) -> tuple[Tensor, Tensor]:
    """``(d_expert_out, d_weights or absent)`` of :func:`kernels.moe_permute.moe_combine_bwd`."""
    d_out, dw = _perm.moe_combine_bwd(dy, expert_out, weights.contiguous(), slots, need_dw)
    return d_out, (dw if dw is not None else _absent(dy))


@_fake(moe_combine_bwd)
def _(dy, expert_out, weights, slots, need_dw):
    return dy.new_empty((slots.shape[0], dy.shape[1])), (weights.new_empty(weights.shape) if need_dw else _absent(dy))


def _moe_combine_setup(ctx, inputs, output):
    expert_out, weights, _, _, slots = inputs
    ctx.save_for_backward(expert_out, weights, slots)


def _moe_combine_backward(ctx, dy):
    need_dw = ctx.needs_input_grad[1]
    d_out, dw = moe_combine_bwd(dy, *ctx.saved_tensors, need_dw)
    return d_out, _given(dw, need_dw), None, None, None


moe_combine_fwd.register_autograd(_moe_combine_backward, setup_context=_moe_combine_setup)


@_public
def moe_combine(expert_out: Tensor, weights: Tensor, plan: _perm.MoEPlan) -> Tensor:
    _perm.check_plan(plan)
    return moe_combine_fwd(expert_out, weights, *plan)


@_custom_op("tritonllm::grouped_linear_fwd", mutates_args=())
def grouped_linear_fwd(x: Tensor, weight: Tensor, expert_offsets: Tensor) -> Tensor:
    """:func:`kernels.grouped_linear.grouped_linear_fwd`."""
    return _gl.grouped_linear_fwd(x, weight, expert_offsets)


@_fake(grouped_linear_fwd)
def _(x, weight, expert_offsets):
    return x.new_empty((x.shape[0], weight.shape[1]))


@_custom_op("tritonllm::grouped_linear_bwd", mutates_args=())
def grouped_linear_bwd(dy: Tensor, x: Tensor, weight: Tensor, expert_offsets: Tensor, need_dx: bool,
                       need_dw: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of :func:`kernels.grouped_linear.grouped_linear_bwd`, absent where not needed."""
    dx, dw = _gl.grouped_linear_bwd(dy, x, weight, expert_offsets, need_dx, need_dw)
    return (dx if dx is not None else _absent(x)), (dw if dw is not None else _absent(x))


@_fake(grouped_linear_bwd)
def _(dy, x, weight, expert_offsets, need_dx, need_dw):
    return (dy.new_empty((dy.shape[0], weight.shape[2])) if need_dx else _absent(x),
            weight.new_empty(weight.shape) if need_dw else _absent(x))


def _grouped_linear_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_grads(ctx, dy, x, weight, offsets):
    """``(dx, dweight, None)`` from the gradient ``dy`` of the grouped GEMM's output."""
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = grouped_linear_bwd(dy, x, weight, offsets, need_dx, need_dw)
    return _given(dx, need_dx), _given(dw, need_dw), None


def _grouped_linear_backward(ctx, dy):
    return _grouped_grads(ctx, dy, *ctx.saved_tensors)


grouped_linear_fwd.register_autograd(_grouped_linear_backward, setup_context=_grouped_linear_setup)


@_public
def grouped_linear(x: Tensor, weight: Tensor, expert_offsets: Tensor) -> Tensor:
    return grouped_linear_fwd(x, weight, expert_offsets)


@_custom_op("tritonllm::grouped_linear_swiglu_fwd", mutates_args=())
def grouped_linear_swiglu_fwd(x: Tensor, w13: Tensor, expert_offsets: Tensor) -> tuple[Tensor, Tensor]:
    """``(h, gu)`` of :func:`kernels.grouped_linear.grouped_linear_swiglu_fwd` (the backward is the packed
    swiglu_bwd op, then grouped_linear_bwd)."""
    return _gl.grouped_linear_swiglu_fwd(x, w13, expert_offsets)


@_fake(grouped_linear_swiglu_fwd)
def _(x, w13, expert_offsets):
    M, two_f = x.shape[0], w13.shape[1]
    return x.new_empty((M, two_f // 2)), x.new_empty((M, two_f))


def _grouped_linear_swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])


def _grouped_linear_swiglu_backward(ctx, dh, _dgu):
    x, w13, offsets, gu = ctx.saved_tensors
    dgu, _ = swiglu_bwd(dh, gu, None)
    return _grouped_grads(ctx, dgu, x, w13, offsets)


grouped_linear_swiglu_fwd.register_autograd(_grouped_linear_swiglu_backward, setup_context=_grouped_linear_swiglu_setup)


@_public
def grouped_linear_swiglu(x: Tensor, w13: Tensor, expert_offsets: Tensor) -> Tensor:
    return grouped_linear_swiglu_fwd(x, w13, expert_offsets)[0]


# ----------------------------------------------------------------------------- in place: optimizers, KV cache
# These ops update tensors in place and name them in mutates_args (torch.compile functionalizes
# them); they have no autograd. A list an op mutates may hold no None (auto-functionalization cannot
# carry one), so the optional master copies travel as the list of those given plus one flag per
# parameter (:func:`_present`, :func:`_spread`).

def _present(tensors, n: int) -> tuple[list[Tensor], list[bool]]:
    """``(the tensors given, one flag per entry: given or not)`` of a list with None entries (or None: ``n`` absent)."""
    if tensors is None:
        return [], [False] * n
    tensors = list(tensors)
    return [t for t in tensors if t is not None], [t is not None for t in tensors]


def _spread(tensors: list[Tensor], given: list[bool]) -> list[Optional[Tensor]]:
    """The list :func:`_present` took apart: ``tensors`` in order where ``given``, None elsewhere."""
    rest = iter(tensors)
    return [next(rest) if g else None for g in given]


def _lr(lr) -> tuple[float, Optional[Tensor]]:
    """An optimizer's ``lr`` (a float or a device tensor) as the ops' pair ``(float, tensor or None)``."""
    return (0.0, lr) if isinstance(lr, Tensor) else (float(lr), None)


@_custom_op("tritonllm::adamw_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "masters", "steps"))
def adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               masters: list[Tensor], has_master: list[bool], steps: list[Tensor], lr: float,
               lr_tensor: Optional[Tensor], beta1: float, beta2: float, eps: float, weight_decay: float,
               found_inf: Optional[Tensor]) -> None:
    """:func:`kernels.adamw.adamw_step_` (``lr_tensor``, when given, is the learning rate)."""
    _eager(_adamw.adamw_step_)(params, grads, exp_avgs, exp_avg_sqs, _spread(masters, has_master), steps=steps,
                               lr=lr if lr_tensor is None else lr_tensor, betas=(beta1, beta2), eps=eps,
                               weight_decay=weight_decay, found_inf=found_inf)


@_fake(adamw_step)
def _(*args):
    return None


@_public
def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, masters=None, *, steps, lr, betas=(0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.0, found_inf: Tensor | None = None) -> None:
    params = list(params)
    present, given = _present(masters, len(params))
    adamw_step(params, list(grads), list(exp_avgs), list(exp_avg_sqs), present, given, list(steps), *_lr(lr),
               float(betas[0]), float(betas[1]), float(eps), float(weight_decay), found_inf)


@_custom_op("tritonllm::clip_grads", mutates_args=("grads", "found_inf"))
def clip_grads(grads: list[Tensor], max_norm: float, eps: float, found_inf: Optional[Tensor],
               check: Optional[Tensor]) -> Tensor:
    """:func:`kernels.adamw.clip_grads_` without ``reduce``: the norm before clipping."""
    return _eager(_adamw.clip_grads_)(grads, max_norm, eps, found_inf=found_inf, check=check)


@_fake(clip_grads)
def _(grads, max_norm, eps, found_inf, check):
    return grads[0].new_empty((), dtype=torch.float32)


@_custom_op("tritonllm::grad_sq_norm", mutates_args=())
def grad_sq_norm(grads: list[Tensor]) -> Tensor:
    """:func:`kernels.adamw.grad_sq_norm`: the 0-d fp32 sum of squares, the first stage of a reduced clip."""
    return _adamw.grad_sq_norm(grads)


@_fake(grad_sq_norm)
def _(grads):
    return grads[0].new_empty((), dtype=torch.float32)


@_custom_op("tritonllm::clip_grads_by_sq_norm", mutates_args=("grads", "found_inf"))
def clip_grads_by_sq_norm(grads: list[Tensor], sq_norm: Tensor, max_norm: float, eps: float,
                          found_inf: Optional[Tensor], check: Optional[Tensor]) -> Tensor:
    """:func:`kernels.adamw.clip_grads_by_sq_norm_`: the second stage, from the reduced sum of squares."""
    return _adamw.clip_grads_by_sq_norm_(grads, sq_norm, max_norm, eps, found_inf=found_inf, check=check)


@_fake(clip_grads_by_sq_norm)
def _(grads, sq_norm, max_norm, eps, found_inf, check):
    return sq_norm.new_empty(())


@_public
def clip_grads_(grads, max_norm: float, eps: float = 1e-6, *, found_inf: Tensor | None = None,
                check: Tensor | None = None, reduce=None) -> Tensor:
    """With ``reduce`` (e.g. FSDP2's all-reduce of the sum of squares), three steps the graph keeps: the
    sum-of-squares op, ``reduce`` traced as Python (a collective becomes a functional collective), and the
    scaling op; without, one op."""
    grads = list(grads)
    if reduce is not None:
        if not grads:
            raise ValueError("grads is empty: with reduce, every holder must pass its (possibly empty) tensors")
        total = grad_sq_norm(grads)
        reduce(total)
        return clip_grads_by_sq_norm(grads, total, float(max_norm), float(eps), found_inf, check)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return clip_grads(grads, float(max_norm), float(eps), found_inf, check)


@_custom_op("tritonllm::muon_step", mutates_args=("params", "momentum_bufs", "masters", "second_moments"))
def muon_step(params: list[Tensor], grads: list[Tensor], momentum_bufs: list[Tensor], masters: list[Tensor],
              has_master: list[bool], second_moments: list[Tensor], normuon: bool, lr: float,
              lr_tensor: Optional[Tensor], lr_scale: float, momentum: float, nesterov: bool, weight_decay: float,
              coefficients: str, steps: int, eps: float, adjust_lr: str, beta2: float, found_inf: Optional[Tensor],
              work_dtype: Optional[torch.dtype]) -> None:
    """:func:`kernels.muon.muon_step_` (``second_moments`` used when ``normuon``; ``lr_tensor``, when
    given, is the learning rate)."""
    _eager(_muon.muon_step_)(params, grads, momentum_bufs, _spread(masters, has_master),
                             second_moments if normuon else None, lr=lr if lr_tensor is None else lr_tensor,
                             lr_scale=lr_scale, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                             coefficients=coefficients, steps=steps, eps=eps, adjust_lr=adjust_lr, beta2=beta2,
                             found_inf=found_inf, work_dtype=work_dtype)


@_fake(muon_step)
def _(*args):
    return None


@_public
def muon_step_(params, grads, momentum_bufs, masters=None, second_moments=None, *, lr, lr_scale: float = 1.0,
               momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0,
               coefficients: str = "polar_express", steps: int = 5, eps: float = 1e-7, adjust_lr: str = "original",
               beta2: float = 0.95, found_inf: Tensor | None = None, work_dtype: torch.dtype | None = None) -> None:
    params = list(params)
    present, given = _present(masters, len(params))
    muon_step(params, list(grads), list(momentum_bufs), present, given, list(second_moments or []),
              second_moments is not None, *_lr(lr), float(lr_scale), float(momentum), bool(nesterov),
              float(weight_decay), coefficients, int(steps), float(eps), adjust_lr, float(beta2), found_inf,
              work_dtype)


@_custom_op("tritonllm::orthogonalize_fwd", mutates_args=())
def orthogonalize_fwd(x: Tensor, coefficients: str, steps: int, eps: float,
                      work_dtype: Optional[torch.dtype]) -> Tensor:
    """:func:`kernels.muon.orthogonalize` (no gradient)."""
    return _eager(_muon.orthogonalize)(x, coefficients=coefficients, steps=steps, eps=eps, work_dtype=work_dtype)


@_fake(orthogonalize_fwd)
def _(x, coefficients, steps, eps, work_dtype):
    work = _muon.muon_work_dtype(work_dtype)
    m, n = x.shape[-2:]
    if x.numel() == 0:
        return x.new_empty(x.shape, dtype=work)
    out = x.new_empty((*x.shape[:-2], min(m, n), max(m, n)), dtype=work)
    return out.transpose(-1, -2) if m >= n else out


@_public
def orthogonalize(x: Tensor, *, coefficients: str = "polar_express", steps: int = 5, eps: float = 1e-7,
                  work_dtype: torch.dtype | None = None) -> Tensor:
    return orthogonalize_fwd(x, coefficients, int(steps), float(eps), work_dtype)


@_custom_op("tritonllm::kv_cache_write", mutates_args=("k_cache", "v_cache"))
def kv_cache_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor) -> None:
    """:func:`kernels.kv_cache.kv_cache_write_`."""
    _eager(_kv.kv_cache_write_)(k, v, k_cache, v_cache, pos)


@_fake(kv_cache_write)
def _(k, v, k_cache, v_cache, pos):
    return None


@_public
def kv_cache_write_(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor) -> None:
    kv_cache_write(k, v, k_cache, v_cache, pos)
