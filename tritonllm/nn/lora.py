"""LoRA adapters applied to a :class:`~tritonllm.models.Transformer` from outside.

:func:`apply_lora` freezes every parameter of the model and replaces the linear layers named by
``targets`` with :class:`LoRALinear` modules that hold the same frozen weight plus trainable
low-rank adapters (Hu et al. 2021)::

    y = x W^T + (alpha / r) * dropout(x) A^T B^T        A [r, in] (Kaiming-uniform), B [out, r] (zeros)

so the adapted model computes what the base model computes until B moves. The Transformer packs
q, k and v in one projection and gate and up in another; a :class:`LoRALinear` over a packed
weight keeps one adapter per targeted segment of the output columns (``lora_A`` [S, r, in],
``lora_B`` the B_j stacked by rows), all applied by :func:`tritonllm.kernels.lora.lora_linear`
(Triton GEMMs, the base GEMM's output accumulated in place). Targets: ``q``, ``k``, ``v``
(``attn.qkv``), ``o`` (``attn.proj``), ``gate``, ``up`` (``mlp.w13``, followed by the SwiGLU
kernel), ``down`` (``mlp.w2``); in a MoE block ``gate``, ``up`` and ``down`` adapt its shared expert
(when it has one) and ``experts`` (not a default target) the routed experts: per expert adapters on the
fused ``w13`` and on ``w2`` (:class:`LoRAMoE`, :class:`tritonllm.kernels.moe.ExpertLoRA`), as PEFT's
``target_parameters`` on ``gate_up_proj`` / ``down_proj`` do.

The weights keep their state-dict names (``blocks.0.attn.qkv.weight``); the adapters add
``...qkv.lora_A`` and ``...qkv.lora_B``. :func:`save_adapter` writes them as a PEFT adapter
(``adapter_model.safetensors`` + ``adapter_config.json``, Hugging Face module names, which
``peft.PeftModel.from_pretrained`` loads onto the Hugging Face model), :func:`load_adapter` reads
one back, and :func:`merged_state_dict` gives the base state dict with ``W + s B A`` folded in.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tritonllm.containers import plain_container
from tritonllm.errors import CheckpointError, ConfigError
from tritonllm.kernels.grouped_linear import grouped_linear
from tritonllm.kernels.linear import linear
from tritonllm.kernels.lora import lora_linear
from tritonllm.kernels.moe import ExpertLoRA
from tritonllm.kernels.residual_mix import weighted_add
from tritonllm.kernels.swiglu import swiglu
from tritonllm.nn.linear import Linear, LinearSwiGLU
from tritonllm.nn.moe import MoE

if TYPE_CHECKING:  # for annotations only: tritonllm.models imports tritonllm.nn
    from tritonllm.models.transformer import Transformer

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
#: the routed experts of MoE blocks: a target to name, not among the defaults
EXPERTS = "experts"
#: target -> Hugging Face module name inside a decoder layer
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


@dataclass
class LoRAConfig:
    rank: int = 16  # r, the adapters' inner width
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input during training
    targets: list[str] = field(default_factory=lambda: list(TARGETS))  # subset of TARGETS and "experts"

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"lora.rank must be an int >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        self.targets = list(self.targets)
        unknown = [t for t in self.targets if t not in (*TARGETS, EXPERTS)]
        if unknown or not self.targets:
            raise ConfigError(f"lora.targets must be a non-empty subset of {[*TARGETS, EXPERTS]}, got {self.targets}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    @classmethod
    def from_dict(cls, d) -> LoRAConfig:
        d = dict(plain_container(d))
        unknown = sorted(set(d) - {"rank", "alpha", "dropout", "targets"})
        if unknown:
            raise ConfigError(f"unknown lora config key(s) {unknown}; valid: rank, alpha, dropout, targets")
        return cls(**d)


class LoRALinear(nn.Module):
    """A frozen linear layer (``weight`` [out, in], optional ``bias``) with LoRA adapters on the
    output column ranges ``segments`` (``(name, start, width)`` each); ``swiglu`` applies the SwiGLU
    to the packed [gate; up] output (the base was a ``LinearSwiGLU``). ``fp8`` (set by
    :func:`tritonllm.nn.fp8.convert_to_fp8`): the frozen layer's GEMMs on fp8 operands, the adapters' in bf16."""

    fp8: bool = False

    def __init__(self, base: Linear | LinearSwiGLU, segments: list[tuple[str, int, int]], cfg: LoRAConfig, swiglu: bool = False):
        super().__init__()
        self.weight = base.weight
        self.bias = getattr(base, "bias", None)
        self.segments = [(name, int(start), int(width)) for name, start, width in segments]
        self.rank, self.scale, self.dropout, self.swiglu = cfg.rank, cfg.scale, float(cfg.dropout), swiglu
        out_features, in_features = self.weight.shape
        w = self.weight
        self.lora_A = nn.Parameter(torch.empty(len(segments), cfg.rank, in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(sum(s[2] for s in segments), cfg.rank, device=w.device, dtype=w.dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A as PEFT initialises it (``kaiming_uniform_(a=sqrt(5))``: uniform in +-1/sqrt(in)), B zeros."""
        bound = 1.0 / math.sqrt(self.lora_A.shape[-1])
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound)
            self.lora_B.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        # the mask's seed is drawn on the device: a captured step draws a new one per replay
        seed = torch.randint(0, 2 ** 62, (1,), device=x.device) if p > 0 else None
        y = lora_linear(x, self.weight, self.bias, self.lora_A, self.lora_B, [s[1:] for s in self.segments],
                        self.scale, dropout_p=p, seed=seed, residual=residual, fp8=self.fp8)
        return swiglu(y) if self.swiglu else y

    def adapters(self):
        """``(name, A_j [r, in], B_j [width, r])`` per segment (views of the parameters)."""
        row = 0
        for j, (name, _, width) in enumerate(self.segments):
            yield name, self.lora_A[j], self.lora_B[row:row + width]
            row += width

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W`` with ``scale * B_j A_j`` added to each segment's rows (Triton GEMMs)."""
        w = self.weight.detach().clone()
        for (_, start, width), (_, a, b) in zip(self.segments, self.adapters()):
            w[start:start + width] = linear(b * self.scale, a.t(), residual=w[start:start + width])
        return w

    def extra_repr(self) -> str:
        names = ",".join(s[0] for s in self.segments)
        return (f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, targets={names}, rank={self.rank}, "
                f"scale={self.scale:g}, dropout={self.dropout:g}, swiglu={self.swiglu}" + (", fp8" if self.fp8 else ""))


class LoRAMoE(MoE):
    """A :class:`~tritonllm.nn.moe.MoE` whose routed experts carry LoRA adapters (frozen ``w13``, ``w2``):
    ``lora_A13 [E, r, D]``, ``lora_B13 [E, 2F, r]``, ``lora_A2 [E, r, F]``, ``lora_B2 [E, D, r]``, the
    update ``(alpha / r) B_e A_e`` of each expert's weight (module docstring of :mod:`tritonllm.kernels.moe`).
    Made from a MoE in place by :func:`adapt_experts`."""

    lora_A13: nn.Parameter
    lora_B13: nn.Parameter
    lora_A2: nn.Parameter
    lora_B2: nn.Parameter
    lora_scale: torch.Tensor

    def forward(self, x: torch.Tensor):
        return self.route(x, ExpertLoRA(self.lora_A13, self.lora_B13, self.lora_A2, self.lora_B2, self.lora_scale))

    @torch.no_grad()
    def merged_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)`` with ``scale * B_e A_e`` added to each expert's (grouped Triton GEMMs)."""
        out = []
        for w, a, b in ((self.w13, self.lora_A13, self.lora_B13), (self.w2, self.lora_A2, self.lora_B2)):
            E, n, k = w.shape
            offsets = torch.arange(0, (E + 1) * n, n, dtype=torch.int32, device=w.device)
            delta = grouped_linear(b.reshape(E * n, -1), a.transpose(1, 2).contiguous(), offsets)
            out.append(weighted_add(w.reshape(E * n, k), delta, self.lora_scale).view(E, n, k))
        return out[0], out[1]


def adapt_experts(moe: MoE, cfg: LoRAConfig) -> LoRAMoE:
    """``moe`` made a :class:`LoRAMoE` in place, adapters of rank ``cfg.rank``: A as PEFT initialises it
    (uniform in +-1/sqrt(in)), B zeros (so the layer computes what it did)."""
    E, F2, D = moe.w13.shape
    device, dtype = moe.w13.device, moe.w13.dtype
    moe.__class__ = LoRAMoE
    for name, shape, fan_in in (("lora_A13", (E, cfg.rank, D), D), ("lora_B13", (E, F2, cfg.rank), 0),
                                ("lora_A2", (E, cfg.rank, F2 // 2), F2 // 2), ("lora_B2", (E, D, cfg.rank), 0)):
        p = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))
        if fan_in:
            with torch.no_grad():
                p.uniform_(-1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))
        moe.register_parameter(name, p)
    moe.register_buffer("lora_scale", torch.tensor([cfg.scale], dtype=torch.float32, device=device),
                        persistent=False)
    return moe  # type: ignore[return-value]


def _slots(cfg_model, moe: bool) -> list[tuple[str, list[tuple[str, int, int]], bool]]:
    """``(attribute path, [(target, start, width)], swiglu)`` of each adaptable linear of a block (a MoE
    block's MLP linears are its shared expert's, when it has one)."""
    q, kv = cfg_model.n_heads * cfg_model.head_dim, cfg_model.n_kv_heads * cfg_model.head_dim
    f = cfg_model.n_shared_experts * cfg_model.d_expert if moe else cfg_model.d_ff
    w13, w2 = ("mlp.shared_w13", "mlp.shared_w2") if moe else ("mlp.w13", "mlp.w2")
    return [("attn.qkv", [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)], False),
            ("attn.proj", [("o", 0, cfg_model.d_model)], False),
            (w13, [("gate", 0, f), ("up", f, f)], True),
            (w2, [("down", 0, cfg_model.d_model)], False)]


def apply_lora(model: Transformer, cfg) -> Transformer:
    """Freeze ``model`` and put LoRA adapters on ``cfg.targets`` (a :class:`LoRAConfig`, dict or
    DictConfig); returns the model, changed in place."""
    if not isinstance(cfg, LoRAConfig):
        cfg = LoRAConfig.from_dict(cfg)
    if EXPERTS in cfg.targets and not model.cfg.n_experts:
        raise ConfigError(f"lora.targets: {EXPERTS!r} adapts the routed experts, and {model.cfg.name} has none")
    if EXPERTS in cfg.targets and cfg.dropout:
        raise ConfigError(f"lora.dropout={cfg.dropout}: the routed experts' adapters take no dropout (as PEFT's "
                          f"target_parameters); set lora.dropout=0 or leave {EXPERTS!r} out of lora.targets")
    if any(isinstance(m, (LoRALinear, LoRAMoE)) for m in model.modules()):
        raise ConfigError("lora: the model already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        mlp = block.mlp
        moe = isinstance(mlp, MoE)
        for path, segments, is_swiglu in _slots(model.cfg, moe):
            chosen = [s for s in segments if s[0] in cfg.targets]
            parent_name, attr = path.split(".")
            parent = getattr(block, parent_name)
            if not chosen or getattr(parent, attr) is None:  # a MoE block without a shared expert
                continue
            setattr(parent, attr, LoRALinear(getattr(parent, attr), chosen, cfg, swiglu=is_swiglu))
        if isinstance(mlp, MoE) and EXPERTS in cfg.targets:
            adapt_experts(mlp, cfg)
    model.lora_config = cfg
    return model


def lora_layers(model: Transformer):
    """``(layer index, LoRALinear)`` of every adapted linear of ``model``."""
    for i, block in enumerate(model.blocks):
        for m in block.modules():
            if isinstance(m, LoRALinear):
                yield i, m


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every LoRA update merged into its weight and the adapters left
    out (the plain state dict for a model without adapters)."""
    state = model.state_dict()
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            state[name + ".weight"] = m.merged_weight()
            del state[name + ".lora_A"], state[name + ".lora_B"]
        elif isinstance(m, LoRAMoE):
            state[name + ".w13"], state[name + ".w2"] = m.merged_weights()
            for p in ("A13", "B13", "A2", "B2"):
                del state[f"{name}.lora_{p}"]
    return state


def _peft_name(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{HF_MODULES[target]}.lora_{which}.weight"


def save_adapter(model: Transformer, path: str, base_model: str | None = None) -> str:
    """Write the adapters as a PEFT LoRA adapter folder ``path`` (for the Hugging Face export of
    the base model, ``base_model`` its name or folder)."""
    from safetensors.torch import save_file

    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise ConfigError("save_adapter: the model has no LoRA adapters (apply_lora first)")
    mlp_targets = sorted(set(cfg.targets) - {"q", "k", "v", "o"})
    if model.cfg.n_experts and mlp_targets:
        raise ConfigError(f"save_adapter: adapters of a MoE model's {', '.join(mlp_targets)} are not written as a "
                          f"PEFT adapter (only q, k, v, o are); export the model with them merged instead")
    tensors = {}
    for i, m in lora_layers(model):
        for target, a, b in m.adapters():
            tensors[_peft_name(i, target, "A")] = a.detach().to("cpu").contiguous()
            tensors[_peft_name(i, target, "B")] = b.detach().to("cpu").contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
              "lora_dropout": cfg.dropout, "target_modules": sorted(HF_MODULES[t].split(".")[1] for t in cfg.targets),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base_model}
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return path


@torch.no_grad()
def load_adapter(model: Transformer, path: str) -> Transformer:
    """Apply the PEFT LoRA adapter in folder ``path`` to ``model`` (plain or already adapted with
    the same settings) and copy its weights in."""
    from safetensors.torch import load_file

    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        pc = json.load(f)
    for key, ok in (("peft_type", "LORA"), ("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False)):
        if pc.get(key, ok) != ok:
            raise CheckpointError(f"{path}: adapter_config {key}={pc.get(key)!r} is not supported")
    by_hf = {HF_MODULES[t].split(".")[1]: t for t in TARGETS}
    modules = pc["target_modules"]
    modules = [modules] if isinstance(modules, str) else modules
    unknown = [m for m in modules if m not in by_hf]
    if unknown:
        raise CheckpointError(f"{path}: target_modules {unknown} are not LoRA targets of tritonllm "
                              f"({sorted(by_hf)})")
    cfg = LoRAConfig(rank=int(pc["r"]), alpha=float(pc["lora_alpha"]), dropout=float(pc.get("lora_dropout", 0.0)),
                     targets=[by_hf[m] for m in modules])
    adapted = getattr(model, "lora_config", None)
    if adapted is None:
        apply_lora(model, cfg)
    elif (adapted.rank, adapted.scale, sorted(adapted.targets)) != (
            cfg.rank, cfg.scale, sorted(cfg.targets)):
        raise CheckpointError(f"{path}: adapter rank/alpha/targets {cfg.rank}/{cfg.alpha}/{cfg.targets} differ "
                              f"from the model's")
    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    for i, m in lora_layers(model):
        for target, a, b in m.adapters():
            for which, dst in (("A", a), ("B", b)):
                name = _peft_name(i, target, which)
                src = tensors.get(name, tensors.get(name.replace(".weight", ".default.weight")))
                if src is None:
                    raise CheckpointError(f"{path}: {ADAPTER_WEIGHTS} lacks {name}")
                if src.shape != dst.shape:
                    raise CheckpointError(f"{path}: {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(src)
    return model
