"""The registration machinery of the ``torch.library`` custom ops (namespace ``tritonllm``), for
``torch.compile`` and FSDP2. Each op module registers its own ops with it, right after its autograd
Function, when it is imported; this module imports no op module.

An op family registers an opaque forward op and backward op (``torch.ops.tritonllm.<op>_fwd`` /
``<op>_bwd``, :func:`define`) built on the module's own launchers, a fake (meta) implementation giving
the outputs' shapes, dtypes and strides without launching anything (:func:`fake`), and an autograd
formula whose backward calls the backward op. Where the module's eager autograd Function computes the
same thing, the formula is that Function's own setup/backward pair with the backward op in place of the
launcher (:func:`register_formula`), so the backward is written once. Under ``torch.compile`` the ops
stay in the graph as single nodes (no graph break, no tracing into Triton), so the launchers keep their
cached :class:`~kernels.launch.Launch` path and their autotuning at run time.

The in-place functionals (``adamw_step_``, ``clip_grads_``, ``muon_step_``, ``kv_cache_write_``) are
single ops that name the tensors they update in ``mutates_args`` (torch.compile functionalizes them), with
no autograd; so are the integer ``moe_sort``, ``orthogonalize``, the RoPE tables and
``flash_attention_decode``. ``clip_grads_`` with ``reduce`` is two ops, the sum of squares and the
scaling, with the reduce (a collective, under FSDP2) traced between them.

Each family ends with a functional of the public signature, registered in ``COMPILED`` by
:func:`compiled`; :func:`compilable` on the public functional routes a call to it while
``torch.compiler.is_compiling()``, and the eager path runs unchanged otherwise. ``split_heads``, ``fork``
and ``add_fork`` return views, which an op may not: they stay autograd Functions that torch.compile traces
(views forward, the pack / weighted_add ops backward). A custom op returns no None, so an output an op does
not produce is a 0-element tensor (:func:`absent`), turned back into None by the functional or the
autograd formula.

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

log = logging.getLogger(__name__)

#: names (``tritonllm::<op>``) of every op :func:`define` registered, for :func:`_inductor_fallbacks`
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


def define(name: str, *, mutates_args=()):
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


def fake(op):
    """``@op.register_fake`` whose fake first runs :func:`_inductor_fallbacks`."""
    def register(fn):
        @functools.wraps(fn)
        def with_fallbacks(*args, **kwargs):
            _inductor_fallbacks()
            return fn(*args, **kwargs)
        return op.register_fake(with_fallbacks)
    return register


def register_formula(fwd_op, setup_context, backward, **ops) -> None:
    """Register ``fwd_op``'s autograd formula: ``setup_context(ctx, inputs, output)`` and
    ``backward(ctx, *grads, **launchers)``, the pair the op module's eager autograd Function calls with
    its launchers (the keyword defaults of ``backward``), here with those launchers replaced by the
    backward ``ops`` (same arguments, an absent output where the launcher gives None). One pair serves
    both paths, so a change to an op's backward is made once."""
    fwd_op.register_autograd(functools.partial(backward, **ops), setup_context=setup_context)


def formula_function(name: str, fwd, setup_context, backward, *, first: bool = False) -> type[torch.autograd.Function]:
    """The eager autograd Function ``name`` of an op registered with the pair ``(setup_context, backward)``
    (:func:`register_formula`): its forward runs the launcher ``fwd(*inputs)`` and ``setup_context(ctx,
    inputs, output)``, its backward ``backward(ctx, *grads)`` with the launchers of its keyword defaults.
    ``first``: the Function returns only the first of the launcher's outputs (the others, kept for the
    backward as the op returns them, get no gradient buffer), and the backward sees that one's gradient."""
    def forward(ctx, *inputs):
        output = fwd(*inputs)
        setup_context(ctx, inputs, output)
        return output[0] if first else output

    def backward_(ctx, *grads):
        return backward(ctx, *grads)

    doc = f"``{fwd.__name__}`` with the pair the custom op's formula has too."
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward_),
                                                   "__doc__": doc})


def absent(like: Tensor) -> Tensor:
    """What an op returns for an output it does not produce: a 0-element tensor (custom ops return no None)."""
    return like.new_empty(0)


def given(t: Tensor, produced: bool) -> Optional[Tensor]:
    """``t`` where the op ``produced`` it, else None (``t`` is then :func:`absent`)."""
    return t if produced else None


def n_rows(x: Tensor) -> int:
    """Rows of ``x [..., N]`` viewed as ``[rows, N]``."""
    return math.prod(x.shape[:-1])


def eager(fn):
    """The undecorated body of a ``@compilable`` functional that is its own launcher (an op's
    implementation runs it; it never routes back to the op)."""
    return fn.__wrapped__


# The in-place ops update tensors and name them in mutates_args (torch.compile functionalizes them);
# they have no autograd. A list an op mutates may hold no None (auto-functionalization cannot carry
# one), so optional tensors (an optimizer's master copies) travel as the list of those given plus one
# flag per entry (:func:`present`, :func:`spread`).

def present(tensors, n: int) -> tuple[list[Tensor], list[bool]]:
    """``(the tensors given, one flag per entry: given or not)`` of a list with None entries (or None: ``n`` absent)."""
    if tensors is None:
        return [], [False] * n
    tensors = list(tensors)
    return [t for t in tensors if t is not None], [t is not None for t in tensors]


def spread(tensors: list[Tensor], flags: list[bool]) -> list[Optional[Tensor]]:
    """The list :func:`present` took apart: ``tensors`` in order where ``flags``, None elsewhere."""
    rest = iter(tensors)
    return [next(rest) if g else None for g in flags]


def split_lr(lr) -> tuple[float, Optional[Tensor]]:
    """An optimizer's ``lr`` (a float or a device tensor) as the ops' pair ``(float, tensor or None)``."""
    return (0.0, lr) if isinstance(lr, Tensor) else (float(lr), None)


#: public functional name -> its version over the ``torch.ops.tritonllm`` custom ops, filled by
#: :func:`compiled` as the op modules are imported and called by :func:`compilable` under torch.compile
COMPILED: dict = {}
_is_compiling = torch.compiler.is_compiling


def compiled(name: str):
    """Register the decorated function as the compiled version of the public functional ``name``."""
    def register(fn):
        COMPILED[name] = fn
        return fn
    return register


def compilable(fn):
    """Decorator of a public functional: while ``torch.compile`` (or ``torch.export``) traces it, a
    call goes to ``COMPILED[fn.__name__]``, built on custom ops the graph keeps as single nodes;
    otherwise ``fn`` runs unchanged (the check and the extra call: 0.15 to 0.3 us on an idle CPU)."""
    name = fn.__name__

    @functools.wraps(fn)
    def functional(*args, **kwargs):
        if _is_compiling():
            return COMPILED[name](*args, **kwargs)
        return fn(*args, **kwargs)
    return functional
