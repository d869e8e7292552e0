"""Muon (and NorMuon) whose step runs in Triton kernels, and an optimizer that combines several.

``Muon`` updates weight matrices with their orthogonalised Nesterov momentum
(``tritonllm.kernels.muon``: momentum, Polar Express or Newton-Schulz iterations in bf16 with fp32
accumulation, optional NorMuon per-neuron normalisation, decoupled weight decay). It is meant for
the hidden matrices of the blocks; embeddings, the LM head, norms and scalars go to AdamW
(``build_optimizer`` in ``tritonllm.train.loop`` with ``optim=muon`` does the split and returns a
:class:`CombinedOptimizer` of both).

Made to be captured in a CUDA graph like :class:`tritonllm.optim.AdamW`: nothing in ``step()``
reads the device; a group's ``lr`` may be a 0-d fp32 device tensor (the training step points every
group at one), multiplied in the kernel by the group's float ``lr_scale`` (so Muon and AdamW can
follow one schedule at different peak rates); ``step(found_inf=flag)`` leaves everything untouched
when the int32 ``flag`` is non-zero.

State per parameter: ``momentum_buffer`` (fp32, the parameter's shape), with NorMuon
``second_moment`` (fp32, ``[..., max(m, n)]``), and for bf16/fp16 parameters (unless
``master_weights=False``) an fp32 ``master`` copy. ``state_dict()`` / ``load_state_dict()``
round-trip exactly (the fp32 state is restored in fp32).

Sharded parameters (FSDP2's ``fully_shard``: DTensors ``Shard(d)`` on a 1-D device mesh). Muon
orthogonalises whole matrices, so:

- sharded along a dimension that indexes matrices (``d < ndim - 2``, e.g. the experts of an MoE
  layer ``[E, m, n]`` sharded over ``E``): each rank holds whole matrices and updates its local shard,
  like AdamW;
- sharded along a matrix dimension (a ``[m, n]`` weight cut into row blocks): the gradient and the
  momentum buffer are all-gathered (``DTensor.full_tensor``), every rank runs the whole step on the
  full matrices (the same kernels on the same values: the same result on every rank) and keeps its
  own rows of the new weight and momentum. The weight is not gathered: the update of an element
  reads only that element of the weight, so the other ranks' rows are zeros in the full-size work
  buffer. Cost per step: two all-gathers of each such matrix in fp32 and the orthogonalisation
  repeated on every rank (instead of assigning matrices to ranks round-robin): no extra state, and
  the state keeps the parameter's layout, so sharded checkpoints reshard it like AdamW's. The
  gathered matrices go through the kernels in chunks of at most :data:`GATHER_ELEMENTS` elements,
  which bounds the transient memory.

The momentum buffer (and master copy) is sharded like the parameter; NorMuon's second moment
``[..., max(m, n)]`` is sharded like it along a matrix-indexing dimension, else replicated
(identical on every rank).
"""

from __future__ import annotations

import torch

from tritonllm.kernels.muon import ADJUST_LR, COEFFICIENTS, muon_step_
from tritonllm.optim._base import DeviceStateOptimizer
from tritonllm.optim.adamw import dtensor_type

#: elements of full matrices gathered per kernel call under FSDP2 (three fp32 work buffers -- weight,
#: gradient, momentum -- of at most 512 MiB each): a bound on the transient memory, not a speed setting
GATHER_ELEMENTS = 1 << 27


def _shard_dim(p: torch.Tensor, dtensor) -> int | None:
    """The dimension a DTensor ``p`` is sharded along (None for a plain tensor); a ValueError for
    layouts Muon does not handle (several mesh dimensions, a Partial or uneven placement)."""
    if dtensor is None or not isinstance(p, dtensor):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = p.placements
    if len(placements) != 1 or type(placements[0]) not in (Shard, Replicate):
        raise ValueError(f"params: Muon takes DTensors sharded on a 1-D mesh (FSDP2's Shard(dim)); got "
                         f"placements {placements}")
    return placements[0].dim if isinstance(placements[0], Shard) else None


def _own_rows(p, dim: int) -> tuple[int, int]:
    """``(start, length)`` along ``dim`` of this rank's shard of the DTensor ``p`` (``torch.chunk``'s
    split, as FSDP2 and DTensor cut ``Shard(dim)``)."""
    size, world = p.shape[dim], p.device_mesh.size()
    chunk = -(-size // world)
    start = min(p.device_mesh.get_local_rank() * chunk, size)
    length = p.to_local().shape[dim]
    if length != min(chunk, size - start):
        raise RuntimeError(f"a shard of {length} of {size} rows at {start} is not torch.chunk's split over {world} "
                           f"ranks")
    return start, length


class Muon(DeviceStateOptimizer):
    """Muon / NorMuon with Triton kernels, for parameters of at least 2 dims (the last two are the
    matrix; leading dims index independent matrices).

    Args:
        params: parameters or parameter groups (dicts).
        lr: learning rate (>= 0), times ``lr_scale``; may be a 0-d fp32 device tensor.
        momentum: ``mu`` in ``[0, 1)``; ``nesterov``: update with ``G + mu (M - G)`` instead of ``M``.
        weight_decay: decoupled, ``W *= 1 - lr * lr_scale * weight_decay``.
        coefficients: ``"polar_express"`` or ``"newton_schulz"``; ``ns_steps``: iterations (>= 1).
        normuon: per-neuron second-moment normalisation after the orthogonalisation (``beta2``).
        adjust_lr: ``"original"`` (``sqrt(max(1, m / n))``), ``"match_rms_adamw"`` or ``"none"``.
        eps: added to the scaled Frobenius norm of the normalisation.
        lr_scale: multiplies ``lr`` (a float).
        master_weights: None or True keeps an fp32 master copy of bf16/fp16 parameters.
        work_dtype: dtype of the iterations (None: bf16 on a GPU, fp32 under the interpreter).
    """

    FP32_STATE = ("momentum_buffer", "second_moment", "master")  # kept in fp32 whatever the parameter's dtype

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, coefficients: str = "polar_express", ns_steps: int = 5,
                 normuon: bool = False, beta2: float = 0.95, adjust_lr: str = "original", eps: float = 1e-7,
                 lr_scale: float = 1.0, master_weights: bool | None = None, work_dtype: torch.dtype | None = None):
        if not isinstance(lr, torch.Tensor) and not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if coefficients not in COEFFICIENTS:
            raise ValueError(f"coefficients must be one of {sorted(COEFFICIENTS)}, got {coefficients!r}")
        if not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"ns_steps must be an int >= 1, got {ns_steps!r}")
        if adjust_lr not in ADJUST_LR:
            raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")
        if not lr_scale >= 0.0:
            raise ValueError(f"lr_scale must be >= 0, got {lr_scale}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        coefficients=coefficients, ns_steps=ns_steps, normuon=normuon, beta2=beta2,
                        adjust_lr=adjust_lr, eps=eps, lr_scale=lr_scale, master_weights=master_weights,
                        work_dtype=work_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.dim() < 2:
                    raise ValueError(f"params: Muon updates matrices; parameter {i} of a group has shape "
                                     f"{tuple(p.shape)} (give vectors and scalars to AdamW)")

    def _init_state(self, group: dict, p: torch.Tensor, state: dict, use_master: bool) -> None:
        """Create the state a parameter lacks."""
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if group["normuon"] and "second_moment" not in state:
            shape = (*p.shape[:-2], max(p.shape[-2:]))
            dtensor = dtensor_type()
            if dtensor is not None and isinstance(p, dtensor):  # sharded with p's matrices, else replicated
                from torch.distributed.tensor import Replicate, zeros

                dim = _shard_dim(p, dtensor)
                placements = p.placements if dim is not None and dim < p.dim() - 2 else [Replicate()]
                state["second_moment"] = zeros(shape, dtype=torch.float32, device_mesh=p.device_mesh,
                                               placements=placements)
            else:
                state["second_moment"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        if use_master and "master" not in state:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)

    def _update(self, group: dict, items: list, found_inf) -> None:
        """``muon_step_`` over ``items`` (parameter, state, master or not): plain tensors and whole
        local matrices in one call, matrices cut by the sharding gathered in bounded chunks (see the
        module docstring)."""
        normuon = bool(group["normuon"])
        dtensor = dtensor_type()
        local = lambda t: t.to_local() if dtensor is not None and isinstance(t, dtensor) else t  # noqa: E731
        whole, cut = [], []
        for p, state, use_master in items:
            dim = _shard_dim(p, dtensor)
            tensors = (p, p.grad, state["momentum_buffer"], state["master"] if use_master else None,
                       state["second_moment"] if normuon else None)
            if dim is None or dim < p.dim() - 2:
                if local(p).numel():  # a rank may hold none of a few experts
                    whole.append([None if t is None else local(t) for t in tensors])
            else:
                cut.append((dim, tensors))
        if whole:
            self._kernel_step(group, whole, normuon, found_inf)
        while cut:
            n, size = 0, 0
            while n < len(cut) and (n == 0 or size + cut[n][1][0].numel() <= GATHER_ELEMENTS):
                size += cut[n][1][0].numel()
                n += 1
            chunk, cut = cut[:n], cut[n:]
            call, keep = [], []  # keep: (local shard, full buffer, dim, start, length)
            for dim, (p, g, buf, master, second) in chunk:
                start, length = _own_rows(p, dim)
                full = {}
                for key, t in (("p", p), ("master", master)):  # zeros but for this rank's rows
                    if t is not None:
                        full[key] = torch.zeros(t.shape, dtype=t.dtype, device=local(t).device)
                        full[key].narrow(dim, start, length).copy_(local(t))
                full["buf"] = buf.full_tensor()
                keep += [(local(t), full[key], dim, start, length)
                         for key, t in (("p", p), ("master", master), ("buf", buf)) if t is not None]
                call.append([full["p"], g.full_tensor(), full["buf"], full.get("master"),
                             None if second is None else local(second)])
            self._kernel_step(group, call, normuon, found_inf)
            for shard, full_t, dim, start, length in keep:
                shard.copy_(full_t.narrow(dim, start, length))

    @staticmethod
    def _kernel_step(group: dict, rows: list, normuon: bool, found_inf) -> None:
        """One ``muon_step_`` call; ``rows``: per matrix [weight, gradient, momentum, master or None,
        second moment or None], plain tensors."""
        params, grads, bufs, masters, seconds = (list(c) for c in zip(*rows))
        muon_step_(params, grads, bufs, masters, seconds if normuon else None, lr=group["lr"],
                   lr_scale=group["lr_scale"], momentum=group["momentum"], nesterov=group["nesterov"],
                   weight_decay=group["weight_decay"], coefficients=group["coefficients"], steps=group["ns_steps"],
                   eps=group["eps"], adjust_lr=group["adjust_lr"], beta2=group["beta2"], found_inf=found_inf,
                   work_dtype=group["work_dtype"])


class CombinedOptimizer:
    """Several optimizers stepped as one (e.g. Muon for the block matrices and AdamW for the rest).

    ``param_groups`` is the list of every optimizer's groups (the same dicts: setting a group's
    ``lr`` sets it in its optimizer); ``step(found_inf=...)``, ``zero_grad`` and ``state`` go to each;
    ``state_dict()`` holds one state dict per optimizer, in order.
    """

    def __init__(self, *optimizers):
        if not optimizers:
            raise ValueError("optimizers: give at least one")
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @torch.no_grad()
    def step(self, closure=None, *, found_inf: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step(found_inf=found_inf)
        return loss

    def init_state(self) -> None:
        """Every optimizer's ``init_state()`` (the state a sharded checkpoint is loaded into)."""
        for opt in self.optimizers:
            opt.init_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ValueError(f"state_dict: expected the state of {len(self.optimizers)} optimizers (a "
                             f"CombinedOptimizer's state_dict()), got "
                             f"{'none' if saved is None else len(saved) if isinstance(saved, list) else type(saved)}")
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Whether ``build_muon_adamw`` gives parameter ``name`` to Muon: a matrix (or a stack of
    matrices, e.g. experts) of a transformer block, not an MoE router."""
    return p.dim() >= 2 and name.startswith("blocks.") and ".router." not in name


def build_muon_adamw(model: torch.nn.Module, optim_cfg, master_weights: bool) -> CombinedOptimizer:
    """``optim=muon`` (``conf/optim/muon.yaml``): :class:`Muon` for the matrices of the blocks
    (:func:`is_muon_param`), AdamW for the rest (embeddings, LM head, norms, routers, scalars;
    weight decay ``optim_cfg.weight_decay`` on its matrices, none on vectors).

    ``optim_cfg.lr`` is AdamW's peak learning rate, the one the schedule scales; Muon's is
    ``optim_cfg.muon.lr`` (its groups get ``lr_scale = muon.lr / lr``, so both follow the schedule
    from one device learning rate). ``optim_cfg.muon`` also holds momentum, nesterov,
    weight_decay, coefficients, ns_steps, normuon, beta2 and adjust_lr.
    """
    from tritonllm.errors import ConfigError
    from tritonllm.optim.adamw import AdamW

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lr, mu = float(optim_cfg.lr), optim_cfg.muon
    if not lr > 0.0:
        raise ConfigError(f"optim.lr (AdamW's peak learning rate) must be > 0 with optim=muon, got {lr}")
    matrices = [p for n, p in named if is_muon_param(n, p)]
    if not matrices:
        raise ConfigError("optim=muon: the model has no block matrices for Muon (parameters named blocks.*)")
    rest = [(n, p) for n, p in named if not is_muon_param(n, p)]
    try:
        muon = Muon(matrices, lr=lr, lr_scale=float(mu.lr) / lr, momentum=float(mu.momentum),
                    nesterov=bool(mu.nesterov), weight_decay=float(mu.weight_decay),
                    coefficients=str(mu.coefficients), ns_steps=int(mu.ns_steps), normuon=bool(mu.normuon),
                    beta2=float(mu.beta2), adjust_lr=str(mu.adjust_lr), master_weights=master_weights)
    except ValueError as e:
        raise ConfigError(f"optim.muon: {e}") from None
    groups = [{"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": float(optim_cfg.weight_decay)},
              {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        return CombinedOptimizer(muon)
    adam = AdamW(groups, lr=lr, betas=tuple(optim_cfg.betas), eps=float(optim_cfg.eps),
                 weight_decay=float(optim_cfg.weight_decay), master_weights=master_weights)
    return CombinedOptimizer(muon, adam)
