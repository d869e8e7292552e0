"""Rotary position embedding (RoPE), half-split (GPT-NeoX / Llama) convention, and its cos/sin tables.

Forward, for ``x`` of shape ``[B, T, H, D]``, ``x1 = x[..., :D/2]``, ``x2 = x[..., D/2:]`` and the
table rows of position ``p = position_offset + t``: ``c = cos[p]``, ``s = sin[p]`` (``[D/2]`` each).
``position_offset`` is a Python int or a 0-d int32/int64 tensor on the device of ``x``, read by the
kernel (a decode step captured in a CUDA graph reads the KV cache's fill position from device memory;
rows whose position falls outside the tables read ``c = s = 0``, the host cannot check a device value)::

    out1 = x1 * c - x2 * s
    out2 = x2 * c + x1 * s

Backward: the map is a rotation by the angle whose cosine and sine are ``c`` and ``s``; its
transpose is the rotation by the opposite angle, so ``dx`` is ``dy`` rotated with ``s -> -s``::

    dx1 = dy1 * c + dy2 * s
    dx2 = dy2 * c - dy1 * s

The same kernel does both (``INVERSE`` negates ``s``). All math is in fp32; ``x`` may be any strided
view whose last dimension is contiguous (e.g. ``q``, or ``q`` and ``k`` together, sliced out of a
packed ``qkv`` projection): it is read in place, never copied. One program rotates a tile of
``BLOCK_R`` rows (flattened ``(b, t)``) by ``BLOCK_H`` heads, so each table row it needs is loaded
once per program; ``BLOCK_H`` is the largest power of two dividing ``H`` (no masked head lanes).

Tables (:func:`rope_cos_sin`), for ``i`` in ``[0, D/2)`` and position ``p``::

    inv_freq_i = theta ** (-2 i / D)
    cos[p, i] = mscale * cos(p * inv_freq_i),   sin[p, i] = mscale * sin(p * inv_freq_i)

with ``mscale = 1`` unless YaRN says otherwise. Scalings of ``inv_freq`` for context extension by
``factor`` f:

* NTK-aware: ``theta' = theta * f ** (D / (D - 2))`` in place of ``theta``.
* YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models"; as
  ``_compute_yarn_parameters`` in Hugging Face transformers), with original context ``L``::

      dim(r)  = D * ln(L / (2 pi r)) / (2 ln theta)       (frequency index completing r turns in L)
      low     = max(floor(dim(beta_fast)), 0),   high = min(ceil(dim(beta_slow)), D - 1)
      ramp_i  = clamp((i - low) / (high - low), 0, 1)      (high += 0.001 when equal)
      inv_freq_i = theta ** (-2 i / D) * ((1 - ramp_i) + ramp_i / f)
      mscale  = 0.1 * ln(f) + 1

  so high frequencies (short wavelengths, ``i < low``) are kept (extrapolated), low frequencies
  (``i > high``) are divided by ``f`` (interpolated), with a linear ramp between; ``mscale`` is the
  attention-temperature factor multiplied into both tables (``scaling["mscale"]`` overrides it).
  With ``truncate`` False (a Hugging Face option) ``low`` and ``high`` are not rounded to integers.
* Linear (position interpolation, Chen et al. 2023): ``inv_freq_i / f``.
* Llama 3 (as ``_compute_llama3_parameters`` in Hugging Face transformers), with original context
  ``L`` and ``low_freq_factor`` a, ``high_freq_factor`` b, wavelength ``w_i = 2 pi / inv_freq_i``::

      w_i < L / b:   inv_freq_i                         (short wavelengths kept)
      w_i > L / a:   inv_freq_i / f                     (long wavelengths interpolated)
      else:          (1 - s) inv_freq_i / f + s inv_freq_i,   s = (L / w_i - a) / (b - a)

``inv_freq`` (``D/2`` numbers) is computed on the host in float64; a Triton kernel fills the
tables. The angle is reduced to ``[-pi, pi)`` in float64 (``p * inv_freq / 2pi`` minus the nearest
integer) before the fp32 cosine and sine, so entries are accurate to fp32 rounding at any position
(an fp32 product ``p * inv_freq``, as most PyTorch code computes it, is off by up to
``p * 2**-24`` radians, about 1e-3 at p = 16384).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import torch
from torch import Tensor
import triton
import triton.language as tl

from ._interpreter import interpreting
from .checks import check_same_device, check_tensor
from .launch import next_pow2
from .custom_op import compilable, compiled, define, fake, register_formula

log = logging.getLogger(__name__)

#: A rope program's tile holds _ROPE_TILE elements of each half (rows x heads x D/2), rotated by
#: _ROPE_NUM_WARPS warps (fixed config: the autotuner's per-call key building cost host time on a
#: ~13 us launch).
_ROPE_TILE = 4096
_ROPE_NUM_WARPS = 8
#: Elements of the (rows x D/2) tile one table program fills.
_TABLE_TILE = 4096


@triton.jit
def _rope_kernel(
    x_ptr,  # [B, T, H, D] input (dy for the backward), any strides, last dim contiguous
    cos_ptr,  # [S, D/2] cosine table, last dim contiguous
    sin_ptr,  # [S, D/2] sine table, last dim contiguous
    out_ptr,  # [B, T, H, D] output, any strides, last dim contiguous (may be x itself: in place)
    R,  # rows B * T
    T,  # sequence length
    H,  # number of heads
    stride_xb,  # x stride between batch entries (elements)
    stride_xt,  # x stride between positions
    stride_xh,  # x stride between heads
    stride_ob, stride_ot, stride_oh,  # the same strides of out
    stride_cos,  # cos row stride
    stride_sin,  # sin row stride
    S,  # table rows
    position_offset,  # table row of position t = 0: an int, or a pointer to one with OFFSET_IN_MEMORY
    HALF: tl.constexpr,  # D / 2
    BLOCK_R: tl.constexpr,  # rows (flattened b, t) per program
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    INVERSE: tl.constexpr,  # rotate by the opposite angle (the backward)
    OFFSET_IN_MEMORY: tl.constexpr,  # position_offset points to a 0-d int32/int64 device tensor
):
    # tile axes: [rows, heads, half of the head dim]
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    b = row // T
    t = row - b * T
    row_mask = row < R
    d_mask = d < HALF
    if OFFSET_IN_MEMORY:
        offset = tl.load(position_offset).to(tl.int64)
    else:
        offset = position_offset
    pos = t.to(tl.int64) + offset
    table_mask = row_mask[:, None, None] & d_mask[None, None, :]
    table_ok = table_mask & ((pos >= 0) & (pos < S))[:, None, None]
    c = tl.load(cos_ptr + pos[:, None, None] * stride_cos + d[None, None, :], mask=table_ok, other=0.0)
    s = tl.load(sin_ptr + pos[:, None, None] * stride_sin + d[None, None, :], mask=table_ok, other=0.0)
    c = c.to(tl.float32)
    s = s.to(tl.float32)
    if INVERSE:
        s = -s

    mask = table_mask & (h < H)[None, :, None]
    x_offs = ((b.to(tl.int64) * stride_xb + t.to(tl.int64) * stride_xt)[:, None, None]
              + h.to(tl.int64)[None, :, None] * stride_xh + d[None, None, :])
    x1 = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_offs + HALF, mask=mask, other=0.0).to(tl.float32)

    out_offs = ((b.to(tl.int64) * stride_ob + t.to(tl.int64) * stride_ot)[:, None, None]
                + h.to(tl.int64)[None, :, None] * stride_oh + d[None, None, :])
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_offs, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(out_ptr + out_offs + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


@triton.jit
def _rope_cos_sin_kernel(
    turns_ptr,  # [D/2] float64: inv_freq / (2 pi), turns per position
    cos_ptr,  # [S, D/2] float32 output, contiguous
    sin_ptr,  # [S, D/2] float32 output, contiguous
    S,  # number of positions
    mscale,  # factor multiplied into both tables
    HALF: tl.constexpr,  # D / 2
    BLOCK_S: tl.constexpr,  # positions per program
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
):
    p = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    i = tl.arange(0, BLOCK_HALF)
    mask = (p < S)[:, None] & (i < HALF)[None, :]
    turns = p[:, None].to(tl.float64) * tl.load(turns_ptr + i, mask=i < HALF, other=0.0)[None, :]
    frac = turns - tl.floor(turns + 0.5)  # in [-0.5, 0.5): exact range reduction in float64
    angle = frac.to(tl.float32) * 6.283185307179586
    offs = p[:, None].to(tl.int64) * HALF + i[None, :]
    tl.store(cos_ptr + offs, tl.cos(angle) * mscale, mask=mask)
    tl.store(sin_ptr + offs, tl.sin(angle) * mscale, mask=mask)


def _check_rope_args(name: str, x, cos, sin, position_offset) -> None:
    """Validate rope inputs; ``name`` is what ``x`` is called in messages (``x`` or ``dy``)."""
    check_tensor(name, x, ndim=4)
    check_tensor("cos", cos, ndim=2)
    check_tensor("sin", sin, ndim=2)
    check_same_device(**{name: x}, cos=cos, sin=sin)
    D = x.shape[-1]
    if D == 0 or D % 2:
        raise ValueError(f"{name}: head dim (last dimension) must be even and > 0, got {D}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head dim) dimension, got strides {x.stride()}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.shape[1] != D // 2:
        raise ValueError(f"cos must have shape [S, head_dim // 2] = [S, {D // 2}], got {tuple(cos.shape)}")
    if isinstance(position_offset, torch.Tensor):
        if position_offset.dim() != 0 or position_offset.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"position_offset: a tensor offset must be 0-d int32/int64, got shape "
                             f"{tuple(position_offset.shape)} {position_offset.dtype}")
        check_same_device(**{name: x}, position_offset=position_offset)
        return  # read on the device: no host check of its value (positions past the tables read c = s = 0)
    if isinstance(position_offset, bool) or not isinstance(position_offset, int):
        raise TypeError(f"position_offset must be an int or a 0-d int tensor, got {type(position_offset).__name__}")
    if position_offset < 0:
        raise ValueError(f"position_offset must be >= 0, got {position_offset}")
    T = x.shape[1]
    if position_offset + T > cos.shape[0]:
        raise ValueError(
            f"cos/sin tables have {cos.shape[0]} rows but positions {position_offset}..{position_offset + T - 1} "
            f"are needed (T={T}, position_offset={position_offset})"
        )


@functools.lru_cache(maxsize=256)
def _plan(rows: int, heads: int, half: int, tile: int, num_warps: int) -> tuple[int, ...]:
    """``(BLOCK_R, BLOCK_H, BLOCK_HALF, row programs, head programs, num_warps)``: BLOCK_H is the
    largest power of two dividing ``heads`` that fits the tile, BLOCK_R fills the rest of it."""
    block_half = next_pow2(half)
    block_h = min(heads & -heads, next_pow2(max(1, tile // block_half)))
    block_r = min(next_pow2(rows), max(1, tile // (block_h * block_half)))
    return (block_r, block_h, block_half, triton.cdiv(rows, block_r), triton.cdiv(heads, block_h),
            1 if interpreting() else num_warps)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rope_launch(x, cos, sin, position_offset: int | torch.Tensor, inverse: bool, in_place: bool = False) -> torch.Tensor:
    """Unchecked launch: ``x`` (or ``dy``) ``[B, T, H, D]`` with unit last stride, tables with unit last
    stride, ``position_offset`` an int or a 0-d int tensor on the device. ``in_place``: the result
    overwrites ``x`` (each program reads its elements before it writes them) and ``x`` is returned."""
    B, T, H, D = x.shape
    out = x if in_place else torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_r, block_h, block_half, row_programs, head_programs, num_warps = _plan(
        B * T, H, D // 2, _ROPE_TILE, _ROPE_NUM_WARPS)
    sb, st, sh, _ = x.stride()
    _rope_kernel[(row_programs, head_programs)](
        x, cos, sin, out, B * T, T, H, sb, st, sh, *out.stride()[:3], cos.stride(0), sin.stride(0), cos.shape[0],
        position_offset,
        HALF=D // 2, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_HALF=block_half, INVERSE=inverse,
        OFFSET_IN_MEMORY=isinstance(position_offset, torch.Tensor), num_warps=num_warps,
    )
    return out


def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             position_offset: int | torch.Tensor = 0) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, H, D]`` by the table rows ``position_offset .. position_offset + T - 1``."""
    _check_rope_args("x", x, cos, sin, position_offset)
    return _rope_launch(x, _unit_last(cos), _unit_last(sin), position_offset, inverse=False)


def rope_bwd(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             position_offset: int | torch.Tensor = 0, in_place: bool = False) -> torch.Tensor:
    """Gradient of :func:`rope_fwd` with respect to ``x``, its arguments checked: :func:`rope_grad`.
    ``in_place``: ``dy`` itself is rotated and returned (it needs a unit last stride and must own its
    elements: no zero strides)."""
    check_tensor("dy", dy, ndim=4)
    if in_place and not _owns_elements(dy):
        raise ValueError(f"dy: in_place needs a unit last stride and no zero strides, got strides {dy.stride()}")
    dy = _unit_last(dy)  # a gradient may arrive in any layout (x itself is never copied)
    _check_rope_args("dy", dy, cos, sin, position_offset)
    return rope_grad(dy, cos, sin, *_split_offset(position_offset), in_place)


def _owns_elements(dy: Tensor) -> bool:
    """``dy`` can be rotated where it lies: a unit last stride and no element shared between rows (no
    zero stride, as the expanded gradient of a sum has)."""
    return dy.stride(-1) == 1 and 0 not in dy.stride()


@functools.lru_cache(maxsize=None)
def _say_not_in_place(strides: tuple[int, ...]) -> None:
    log.info("rope: in_place_backward asked for, but the gradient's strides %s share elements or have a strided "
             "last dimension: dx goes to a new buffer (logged once per layout)", strides)


def rope_grad(dy: Tensor, cos: Tensor, sin: Tensor, position_offset: int, offset: Optional[Tensor],
              in_place: bool = False) -> Tensor:
    """The backward launcher of :func:`rope` (its autograd Function's and its custom op's): ``dx [B, T, H, D]``,
    ``dy`` rotated by the opposite angle at ``offset`` (a 0-d int device tensor) or else ``position_offset``.
    Unchecked: ``dy`` has the forward output's shape, dtype and device (autograd sees to it) and the
    forward checked the tables and the offset; ``dy`` or a table without a unit last stride is copied to
    one. ``in_place`` (eager only: an op may not overwrite its input): ``dy`` is rotated where it lies and
    returned, its layout kept, when :func:`_owns_elements` allows it; otherwise into a new buffer, said
    once per layout in a log line."""
    if in_place and not _owns_elements(dy):
        _say_not_in_place(tuple(dy.stride()))
        in_place = False
    return _rope_launch(_unit_last(dy), _unit_last(cos), _unit_last(sin),
                        offset if offset is not None else position_offset, inverse=True, in_place=in_place)


def _split_offset(position_offset: int | Tensor) -> tuple[int, Optional[Tensor]]:
    """``position_offset`` as the ops' pair ``(int, 0-d tensor or None)``."""
    if isinstance(position_offset, Tensor):
        return 0, position_offset
    return position_offset, None


def _rope_setup(ctx, inputs, output):
    """Of the forward op's inputs ``(x, cos, sin, position_offset, offset)``: saves the tables and the
    tensor offset, keeps the int one."""
    _, cos, sin, ctx.position_offset, offset = inputs
    ctx.save_for_backward(cos, sin, offset)


def _rope_backward(ctx, dy, *, bwd=rope_grad):
    """``(dx, None x 4)`` by ``bwd``: :func:`rope_grad` eagerly (the Function binds its ``in_place``), the
    backward op under torch.compile."""
    cos, sin, offset = ctx.saved_tensors
    return bwd(dy, cos, sin, ctx.position_offset, offset), None, None, None, None


class RopeFunction(torch.autograd.Function):
    """:func:`rope_fwd` with :func:`_rope_setup` and :func:`_rope_backward`, the custom op's formula too
    (no gradient for the tables); ``in_place_backward`` (not an op input) reaches the backward launcher.
    The forward checks the inputs and passes the tables on with a unit last stride, so that the
    backward launcher copies nothing."""

    @staticmethod
    def forward(ctx, x, cos, sin, position_offset, offset, in_place_backward):
        at = offset if offset is not None else position_offset
        _check_rope_args("x", x, cos, sin, at)
        cos, sin = _unit_last(cos), _unit_last(sin)
        out = _rope_launch(x, cos, sin, at, inverse=False)
        _rope_setup(ctx, (x, cos, sin, position_offset, offset), out)
        ctx.in_place = in_place_backward
        return out

    @staticmethod
    def backward(ctx, dy):
        bwd = functools.partial(rope_grad, in_place=ctx.in_place)
        return *_rope_backward(ctx, dy, bwd=bwd), None  # None for in_place_backward


# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The ops a compiled graph keeps as single nodes, with their fakes and autograd formulas (kernels/custom_op.py);
# @compilable sends the public functional to the function registered by @compiled while torch.compile traces.

@define("tritonllm::rope_fwd", mutates_args=())
def rope_fwd_op(x: Tensor, cos: Tensor, sin: Tensor, position_offset: int, offset: Optional[Tensor]) -> Tensor:
    """:func:`kernels.rope.rope_fwd` at ``offset`` (a 0-d int tensor read on the device) or else
    ``position_offset``."""
    return rope_fwd(x, cos, sin, offset if offset is not None else position_offset)


@define("tritonllm::rope_bwd", mutates_args=())
def rope_bwd_op(dy: Tensor, cos: Tensor, sin: Tensor, position_offset: int, offset: Optional[Tensor]) -> Tensor:
    """:func:`kernels.rope.rope_grad` (into a new tensor), offsets as :func:`rope_fwd_op`."""
    return rope_grad(dy, cos, sin, position_offset, offset)


for _op in (rope_fwd_op, rope_bwd_op):
    fake(_op)(lambda x, cos, sin, position_offset, offset: x.new_empty(x.shape))


register_formula(rope_fwd_op, _rope_setup, _rope_backward, bwd=rope_bwd_op)


@compiled("rope")
def _compiled_rope(x: Tensor, cos: Tensor, sin: Tensor, *, position_offset: int | Tensor = 0,
                   in_place_backward: bool = False) -> Tensor:
    # in_place_backward is not honoured: an op may not overwrite the gradient the graph hands it
    return rope_fwd_op(x, cos, sin, *_split_offset(position_offset))


@define("tritonllm::rope_cos_sin_fwd", mutates_args=())
def rope_cos_sin_fwd_op(turns: Tensor, seq_len: int, mscale: float) -> tuple[Tensor, Tensor]:
    """:func:`kernels.rope.rope_cos_sin_fwd`: the tables from the frequencies (no gradient)."""
    return rope_cos_sin_fwd(turns, seq_len, mscale)


@fake(rope_cos_sin_fwd_op)
def _(turns, seq_len, mscale):
    return tuple(turns.new_empty((seq_len, turns.shape[0]), dtype=torch.float32) for _ in range(2))


@compiled("rope_cos_sin")
def _compiled_rope_cos_sin(seq_len: int, head_dim: int, theta: float = 10000.0, scaling: dict | None = None,
                           device=None) -> tuple[Tensor, Tensor]:
    turns, mscale = rope_turns(seq_len, head_dim, theta, scaling, device)
    return rope_cos_sin_fwd_op(turns, seq_len, mscale)


@compilable
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         position_offset: int | torch.Tensor = 0, in_place_backward: bool = False) -> torch.Tensor:
    """Rotary position embedding, half-split convention.

    Args:
        x: ``[B, T, H, D]`` float32/float16/bfloat16, ``D`` even; any strides as long as the last
            dimension is contiguous. A slice of a packed ``[B, T, Hq + 2 Hkv, D]`` qkv is read in
            place; ``q`` and ``k`` rotate in one launch as the slice ``qkv[:, :, :Hq + Hkv]``.
        cos, sin: ``[S, D // 2]`` tables (float32 recommended, see :func:`rope_cos_sin`), ``S >= position_offset + T``.
        position_offset: table row of position ``t = 0`` (decoding at position ``p`` uses rows ``p .. p + T - 1``):
            an int >= 0 (checked against ``S``), or a 0-d int32/int64 tensor on the device of ``x`` that
            the kernel reads (no host synchronisation, so the call can be captured in a CUDA graph and
            replayed as the value changes; rows past the tables are not checked and rotate by ``c = s = 0``).
        in_place_backward: the backward rotates the incoming gradient in place and returns it as the
            gradient of ``x`` (no new buffer, and its layout kept: a slice of the attention backward's
            packed ``[B, T, Hq + 2 Hkv, D]`` gradient stays one, so the qkv gradient needs no copy). Only
            for a caller that knows nothing else reads the output's gradient (no hook or ``retain_grad``
            on it): the model's attention does.

    Returns:
        ``[B, T, H, D]`` contiguous, dtype of ``x``: with ``c, s = cos[p + t], sin[p + t]``,
        ``out[..., :D/2] = x1 c - x2 s`` and ``out[..., D/2:] = x2 c + x1 s`` (fp32 math).
        Differentiable in ``x``; the tables get no gradient.
    """
    return RopeFunction.apply(x, cos, sin, *_split_offset(position_offset), in_place_backward)


_SCALING_KEYS = {
    "ntk": {"type", "factor"},
    "linear": {"type", "factor"},
    "yarn": {"type", "factor", "original_max_position", "beta_fast", "beta_slow", "mscale", "truncate"},
    "llama3": {"type", "factor", "original_max_position", "low_freq_factor", "high_freq_factor"},
}


def _check_number(name: str, value, *, low: float = 0, inclusive: bool = False, integer: bool = False) -> float:
    """``value``; a ValueError naming ``name`` unless it is a number (an int with ``integer``)
    above ``low`` (or equal to it with ``inclusive``)."""
    kinds = (int,) if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, kinds) and (value >= low if inclusive else value > low)
    if not ok:
        bound = f"{'>=' if inclusive else '>'} {low:g}"
        raise ValueError(f"{name} must be {'an int' if integer else 'a number'} {bound}, got {value!r}")
    return value


def rope_inv_freq(head_dim: int, theta: float, scaling) -> tuple[torch.Tensor, float]:
    """float64 ``inv_freq`` ``[head_dim // 2]`` on the CPU and the table factor ``mscale``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    if scaling is None:
        return theta ** -exponents, 1.0
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None or a dict, got {type(scaling).__name__}")
    kind = scaling.get("type")
    if kind not in _SCALING_KEYS:
        raise ValueError(f"scaling: unknown type {kind!r}; expected one of {sorted(_SCALING_KEYS)}")
    unknown = set(scaling) - _SCALING_KEYS[kind]
    if unknown:
        raise ValueError(f"scaling: unknown keys {sorted(unknown)} for type {kind!r}")
    factor = _check_number("scaling['factor']", scaling.get("factor"), low=1, inclusive=True)
    if kind == "ntk":
        if head_dim <= 2:
            raise ValueError(f"head_dim must be > 2 for NTK scaling (theta * f ** (D / (D - 2))), got {head_dim}")
        return (theta * factor ** (head_dim / (head_dim - 2))) ** -exponents, 1.0
    if kind == "linear":
        return theta ** -exponents / factor, 1.0

    if "original_max_position" not in scaling:
        raise ValueError(f"scaling['original_max_position'] is required for {kind!r} scaling")
    orig = scaling["original_max_position"]
    if kind == "llama3":
        _check_number("scaling['original_max_position']", orig, integer=True)
        low_ff, high_ff = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        _check_number("scaling['low_freq_factor']", low_ff)
        _check_number("scaling['high_freq_factor']", high_ff, low=low_ff)
        inv_freq = theta ** -exponents
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > orig / low_ff, inv_freq / factor, inv_freq)
        return torch.where((wavelen >= orig / high_ff) & (wavelen <= orig / low_ff), mid, inv_freq), 1.0
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
    _check_number("scaling['original_max_position']", orig, integer=True)
    _check_number("scaling['beta_fast']", beta_fast)
    _check_number("scaling['beta_slow']", beta_slow)
    mscale = scaling.get("mscale")
    if mscale is None:
        mscale = 0.1 * math.log(factor) + 1.0
    _check_number("scaling['mscale']", mscale)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = theta ** -exponents
    return extrapolation * (1 - ramp) + extrapolation / factor * ramp, float(mscale)


def rope_turns(seq_len: int, head_dim: int, theta: float, scaling: dict | None, device) -> tuple[torch.Tensor, float]:
    """``(inv_freq / 2 pi`` on the device, ``mscale)`` of :func:`rope_cos_sin`'s tables, its arguments checked."""
    _check_number("seq_len", seq_len, integer=True)
    _check_number("head_dim", head_dim, integer=True)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    _check_number("theta", theta, low=1)
    inv_freq, mscale = rope_inv_freq(head_dim, float(theta), scaling)
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise ValueError(f"device must be a CUDA device (the CPU only with TRITON_INTERPRET=1), got {device}")
    return (inv_freq / (2 * math.pi)).to(device), mscale


def rope_cos_sin_fwd(turns: torch.Tensor, seq_len: int, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the table kernel: ``cos, sin [seq_len, len(turns)]`` float32 from ``turns`` (:func:`rope_turns`)."""
    half = turns.shape[0]
    cos = torch.empty((seq_len, half), dtype=torch.float32, device=turns.device)
    sin = torch.empty_like(cos)
    block_half = next_pow2(half)
    block_s = min(next_pow2(seq_len), max(1, _TABLE_TILE // block_half))
    _rope_cos_sin_kernel[(triton.cdiv(seq_len, block_s),)](
        turns, cos, sin, seq_len, mscale, HALF=half, BLOCK_S=block_s, BLOCK_HALF=block_half,
    )
    return cos, sin


@compilable
def rope_cos_sin(seq_len: int, head_dim: int, theta: float = 10000.0, scaling: dict | None = None,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables ``cos, sin``, float32 ``[seq_len, head_dim // 2]``, for :func:`rope`.

    ``cos[p, i] = mscale * cos(p * inv_freq_i)`` (``sin`` likewise) with
    ``inv_freq_i = theta ** (-2 i / head_dim)``, optionally rescaled for context extension:

    * ``scaling=None``: plain RoPE, ``mscale = 1``.
    * ``{"type": "ntk", "factor": f}``: NTK-aware, ``theta' = theta * f ** (D / (D - 2))``.
    * ``{"type": "yarn", "factor": f, "original_max_position": L, "beta_fast": 32, "beta_slow": 1,
      "mscale": None}``: YaRN per-frequency ramp between keeping ``inv_freq`` (wavelengths much
      shorter than ``L``) and dividing it by ``f`` (wavelengths longer than ``L``), and the
      attention-temperature factor ``mscale = 0.1 ln f + 1`` (or the given ``mscale``) applied to
      both tables (``"truncate": False`` keeps the ramp's ends unrounded).
    * ``{"type": "linear", "factor": f}``: position interpolation, ``inv_freq / f``.
    * ``{"type": "llama3", "factor": f, "original_max_position": L, "low_freq_factor": 1,
      "high_freq_factor": 4}``: Llama 3.1's per-wavelength blend of ``inv_freq`` and ``inv_freq / f``.

    The formulas are in this module's docstring.

    ``device`` defaults to CUDA when available (else the CPU, for the interpreter).
    """
    turns, mscale = rope_turns(seq_len, head_dim, theta, scaling, device)
    return rope_cos_sin_fwd(turns, seq_len, mscale)
