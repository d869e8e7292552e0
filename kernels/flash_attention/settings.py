"""The user's choices for flash attention: :class:`AttentionSettings`, the settings in force
(:func:`attention_settings`) and the one way to change them (:func:`configure_attention`, exported by
``tritonllm.kernels``)::

    from tritonllm.kernels import configure_attention

    with configure_attention(sm90_bwd={"dq": ()}):   # the portable dQ kernel for this block
        ...

The per-kernel fields are mappings keyed by kernel ("fwd", "dkdv", "dq"); ``configure_attention`` changes
only the kernels it names (``one_loop`` per kernel and mask kind). Every launch reads them, so a change
takes effect at the next call. The tile configs, thresholds and constants measured once stay in
:mod:`.tuning`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..settings import Settings, configure, in_force

#: the kernels the per-kernel settings name: the forward, the dK/dV and the dQ kernels of the backward
KERNELS = ("fwd", "dkdv", "dq")
#: the mask kinds of ``one_loop``: "causal" (every call without a window) and "window"
MASK_KINDS = ("causal", "window")


@dataclass(frozen=True)
class AttentionSettings(Settings):
    """Flash attention's switches with their measured defaults (scripts/tune_attention.py and
    scripts/attention_sm90.py time them on the GPU; docs/perf/history.md). Read-only: the mappings are
    frozen views."""

    #: per kernel: stream the K/V tiles (forward, dQ) or the Q/dO tiles and lse/delta rows (dK/dV) through
    #: tensor descriptors (TMA) where the device (sm90+), the dtype (16-bit) and the strides (16-byte
    #: aligned) allow, and the streamed length reaches ``tuning.TMA_MIN_ELEMS`` on the GPU.
    tma: Mapping[str, bool] = field(default_factory=lambda: dict.fromkeys(KERNELS, True))
    #: per kernel and mask kind: one pipelined loop whose edge tiles take a masking branch (True) instead of
    #: three loops with a pipeline prologue each (False); short loops (sliding window: ~9 tiles) should gain.
    #: One loop also needs fewer registers (Triton 3.6, sm90, first configs, TMA, D128: forward 232 -> 190,
    #: dQ 192 -> 179, dK/dV spills 336 -> 96 bytes).
    one_loop: Mapping[str, Mapping[str, bool]] = field(
        default_factory=lambda: {k: dict.fromkeys(MASK_KINDS, True) for k in KERNELS})
    #: per kernel: the order of the programs (:func:`masks.program_tile`): the (batch, head) pairs in groups of
    #: about this many waves of programs (x #SMs, whole pairs, at least one), and inside a group every pair's
    #: most expensive tile first (causal: the last query tile in the forward and dQ, the first key tile in
    #: dK/dV), then the next. None: all pairs in one group (the longest programs of the whole grid first);
    #: 0: one pair after another. H100, scripts/tune_attention.py, pairs per group 1 / 8 / all: dK/dV, whose
    #: programs are few and long (a KV head's query heads in one program), needs all: 0.442 / 0.302 / 0.304 ms
    #: at B4 Hq16/Hkv4 T2048 D128, 4.76 / 4.61 / 4.29 at B8 Hq32/Hkv8 T4096 D128, and 7.33 / - / 7.42 at B1
    #: Hq32/Hkv8 T16384 (equal). The forward and dQ, many short programs sharing K/V tiles in L2, want about
    #: two waves a group: forward 0.188 / 0.179 / 0.185, 2.53 / 2.47 / 2.74 and 4.05 / 4.40 / 4.54 ms
    #: (T16384: one pair is 256 programs, two waves); dQ 0.235 / 0.220 / 0.220, 2.98 / 2.98 / 3.25 and
    #: 5.23 / 5.11 / 5.02 ms at the same shapes.
    group_waves: Mapping[str, float | None] = field(default_factory=lambda: {"fwd": 2, "dkdv": None, "dq": 2})
    #: the head dims at which the forward on Hopper runs forward_sm90's Gluon kernel (wherever it applies,
    #: :func:`forward_sm90.supported`); the portable kernel runs every other forward, and everywhere with
    #: ``()``. On an H100 (CUDA graphs, 142f866) its persistent warp-specialized config ran the bench's D128
    #: shapes at 1.08x / 1.02x / 1.12x cuDNN (B4 Hq16/Hkv4 T2048, B8 Hq32/Hkv8 T4096, B1 T16384; 0.138 /
    #: 2.007 / 3.444 ms), and B16 Hq12 T1024 D64 at 0.0955 ms against the portable kernel's 0.1022 in one run
    #: (scripts/attention_sm90.py; autotuned in the bench 0.0984 against 0.0997; cuDNN 0.086).
    sm90_fwd: tuple[int, ...] = (64, 128)
    #: per gradient kernel of the deterministic backward ("dkdv", "dq"), the head dims at which it runs
    #: backward_sm90's Gluon kernel on Hopper (wherever they apply, :func:`backward_sm90.matrix_args`);
    #: ``()``: the portable kernel. Both give bitwise the same gradients. H100, each kernel alone in CUDA
    #: graphs (scripts/attention_sm90.py, docs/perf/attention-sm90-h100.json): the Gluon dK/dV (best config)
    #: ran 1.02x / 1.15x / 1.14x the portable one at B8 Hq32/Hkv8 T4096, B1 T16384, B4 Hq16/Hkv4 T2048 D128
    #: (4.26 / 7.11 / 0.262 ms), 0.88x at B16 Hq12 T1024 D64; the Gluon dQ's 64x64 4-warp tile (two programs
    #: an SM) 1.08x / 1.09x / 1.05x at those D128 shapes (2.83 / 4.99 / 0.214 ms), 0.91x at D64. The dQ made
    #: persistent (a01a1ec, 74286c6): 1.05x the portable one at D64 (0.112 against 0.117 ms, in both runs),
    #: 1.13x / 1.10x / 1.09x at the D128 shapes; dK/dV made persistent too ran 0.97x / 0.99x its one-item
    #: programs at T4096 / T2048 D128 (more spills) and 0.98x the portable kernel at D64: not kept.
    sm90_bwd: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: {"dkdv": (128,), "dq": (64, 128)})
    #: the head dims at which ``deterministic=False`` runs on Hopper as backward_sm90's dK/dV kernel with
    #: DQ_REDUCE (dQ added by a writer warp's TMA bulk reduces; FlashAttention-3's arrangement) instead of the
    #: portable fused kernel. Off until measured: the same kernel without the writer warp (each reduce between
    #: CTA barriers of the compute warps) ran 0.71x the deterministic Gluon pair at B8 Hq32/Hkv8 T4096 D128.
    sm90_fused: tuple[int, ...] = ()

    def __post_init__(self):
        expected = {"tma": KERNELS, "one_loop": KERNELS, "group_waves": KERNELS, "sm90_bwd": ("dkdv", "dq")}
        for name, keys in expected.items():
            value = getattr(self, name)
            if not isinstance(value, Mapping) or set(value) != set(keys):
                raise ValueError(f"AttentionSettings.{name} must map each of {', '.join(keys)}, got {value!r}")
        for kernel, kinds in self.one_loop.items():
            if not isinstance(kinds, Mapping) or set(kinds) != set(MASK_KINDS):
                raise ValueError(f"AttentionSettings.one_loop[{kernel!r}] must map each of {', '.join(MASK_KINDS)}, "
                                 f"got {kinds!r}")
        for name in ("sm90_fwd", "sm90_fused"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in expected:
            value = {k: MappingProxyType(dict(v)) if name == "one_loop" else v for k, v in getattr(self, name).items()}
            if name == "sm90_bwd":
                value = {k: tuple(v) for k, v in value.items()}
            object.__setattr__(self, name, MappingProxyType(value))

    def updated(self, **fields) -> AttentionSettings:
        """These settings with ``fields`` changed: a per-kernel field only at the kernels it names (``one_loop``
        only at the mask kinds it names)."""
        merged = dict(fields)
        for name in ("tma", "group_waves", "sm90_bwd", "one_loop"):
            if name in fields:
                old = getattr(self, name)
                unknown = sorted(set(fields[name]) - set(old))
                if unknown:
                    raise ValueError(f"AttentionSettings.{name}: unknown kernel(s) {', '.join(unknown)}; "
                                     f"expected some of {', '.join(old)}")
                merged[name] = {k: ({**old[k], **fields[name][k]} if name == "one_loop" else fields[name][k])
                                if k in fields[name] else old[k] for k in old}
        return dataclasses.replace(self, **merged)


def attention_settings() -> AttentionSettings:
    """The flash-attention settings in force."""
    return in_force(AttentionSettings)


def configure_attention(settings: AttentionSettings | None = None, /, **fields) -> AttentionSettings:
    """Put ``settings`` (default: those in force) with ``fields`` changed (per kernel: only the kernels named)
    in force for every attention call from now on; return the settings before the change. An unknown field,
    kernel or mask kind is refused by name. ``with configure_attention(...):`` restores the settings before
    it when the block ends."""
    return configure(AttentionSettings, settings, fields, "configure_attention")
