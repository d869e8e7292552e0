"""One optimizer step as one object, eager or replayed from a CUDA graph.

A step is: for each of ``grad_accum`` micro-batches ``(x, y)`` or ``(x, y, documents)`` (packed
sequences: ``model(x, y, documents=documents)``), the forward (the model returns the loss), ``loss / grad_accum`` and its backward (gradients accumulate in the kernels' outputs);
the mean loss; the global gradient norm, clipped to ``grad_clip`` (``tritonllm.optim.clip_grad_norm_``)
which also sets a device flag when the norm or the loss is not finite; ``AdamW.step(found_inf=flag)``,
which leaves weights, moments and step counts untouched when the flag is set; gradients set to None.

Everything that changes from step to step is in device memory: the input batches (every tensor of
a micro-batch copied into its static buffer), the learning rate (a 0-d fp32 tensor every parameter group points to), each
parameter's step count (the optimizer state), the clipping coefficient and the skip flag. Nothing
in the step waits for the host, so the whole of it can be captured in one CUDA graph and replayed:

- ``cuda_graph=False``: every call runs the step eagerly (a few hundred kernel launches).
- ``cuda_graph=True`` (``"auto"``: on CUDA devices): the first ``warmup`` calls run eagerly on a side
  stream (autotuning, compilation, optimizer state and launch tables are created then), the next
  call captures the step once (``capture_error_mode="relaxed"``: tables built during the capture
  are uploaded outside the graph) and replays it; every later call copies its batches into the
  static buffers and replays. If the capture fails, one warning names the error and the step
  stays eager for the rest of the run.

Eager and graphed steps run the same kernels on the same values: their results are equal bit for
bit (the kernels are deterministic). A call returns a :class:`StepOutput` of device tensors; with a
graph they are overwritten by the next replay, so read them (or copy them, as
:class:`MetricsQueue` does) before the next call. Do not load optimizer or model state into new
tensors after the capture (``load_state_dict`` of the model copies in place and is fine; an
optimizer's ``load_state_dict`` replaces its tensors): build the step after resuming.

On several ranks (``parallel``, a :class:`tritonllm.train.parallel.Parallel`) the step calls the
wrapped model, lets DDP all-reduce gradients only on the last micro-batch, and averages the loss over
the ranks before the clipping reads it (so every rank logs the global loss and skips the same steps).
A DDP step is captured like a single-device one, after :data:`~tritonllm.train.parallel.DDP_GRAPH_WARMUP`
eager steps, the NCCL all-reduces inside the graph, and every rank replays a graph or none does; an
FSDP2 step runs eagerly (one log line says so).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections import deque
from dataclasses import dataclass

import torch

from tritonllm.optim import clip_grad_norm_

log = logging.getLogger("tritonllm.train")


@dataclass
class StepOutput:
    """Device tensors of one step: ``loss`` (mean over micro-batches, fp32 0-d), ``grad_norm`` (before
    clipping), ``skipped`` (int32 0-d, 1 if the update was skipped) and ``metrics``, an fp32 vector
    ``[loss, grad_norm, skipped, *parts]`` with ``parts`` the last micro-batch's losses dict (what
    ``model(x, y, return_losses=True)`` returns) other than ``ce`` (named by :attr:`TrainStep.metric_names`)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor
    metrics: torch.Tensor


def resolve_cuda_graph(setting, device: torch.device) -> bool:
    """``trainer.cuda_graph``: ``"auto"`` (on for CUDA devices), True or False; True needs CUDA."""
    if setting == "auto" or setting is None:
        return device.type == "cuda"
    if isinstance(setting, str) and setting.lower() in ("true", "false"):
        setting = setting.lower() == "true"
    if not isinstance(setting, bool):
        raise ValueError(f"cuda_graph must be auto, true or false, got {setting!r}")
    if setting and device.type != "cuda":
        raise ValueError(f"cuda_graph=true needs a CUDA device, the model is on {device}")
    return setting


class TrainStep:
    """``step(batches, lr) -> StepOutput``: one optimizer step (see the module docstring).

    Args:
        model: ``model(x, y, return_losses=True)`` returns the scalar training loss and a dict of
            detached 0-d tensors to log, as :class:`tritonllm.models.Transformer` does (which also
            takes ``documents=`` for micro-batches ``(x, y, documents)``).
        optimizer: :class:`tritonllm.optim.AdamW` (``step(found_inf=...)``, device ``lr``).
        grad_clip: max global gradient norm, or None (the norm is still computed).
        grad_accum: micro-batches per step.
        cuda_graph: True, False or ``"auto"``.
        warmup: eager calls before the capture (>= 1); None: 2, or what ``parallel`` needs.
        parallel: None (one process) or the :class:`~tritonllm.train.parallel.Parallel` that
            ``model`` was made ready with (``model`` is then its ``module``).
    """

    def __init__(self, model, optimizer, *, grad_clip: float | None, grad_accum: int = 1, cuda_graph="auto",
                 warmup: int | None = None, parallel=None):
        if warmup is None:
            warmup = 2 if parallel is None else parallel.graph_warmup
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup}")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {grad_clip}")
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.grad_clip = math.inf if grad_clip is None else float(grad_clip)
        self.grad_accum = grad_accum
        self.use_graph = resolve_cuda_graph(cuda_graph, self.device)
        self.parallel = parallel
        self.forward = model if parallel is None else parallel.wrapped
        if self.use_graph and parallel is not None and not parallel.capturable:
            log.info("%s: FSDP2's all-gathers and reduce-scatters are not captured in a CUDA graph; "
                     "the training step runs eagerly", parallel.mode)
            self.use_graph = False
        self.warmup = warmup
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.metric_names: list[str] | None = None
        self.lr = torch.zeros((), dtype=torch.float32, device=self.device)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        self.found_inf = torch.zeros((), dtype=torch.int32, device=self.device)
        self._static: list[tuple[torch.Tensor, ...]] = []  # the captured step's input buffers
        self._out: StepOutput | None = None  # the captured step's outputs

    @property
    def graphed(self) -> bool:
        """Whether calls now replay a captured graph."""
        return self.graph is not None

    def release(self) -> None:
        """Drop the captured graph and its memory pool; later calls run eagerly. Call it before a
        process group is destroyed: NCCL cannot destroy a communicator whose collectives a live CUDA
        graph still holds, and ``destroy_process_group`` then waits forever (pytorch issue 115388; seen
        with void125m's DDP step on 2 H100s)."""
        if self.graph is not None:
            self.graph.reset()
        self.graph, self._out, self._static, self.use_graph = None, None, [], False

    def _check(self, batches) -> None:
        if len(batches) != self.grad_accum:
            raise ValueError(f"batches: expected grad_accum={self.grad_accum} micro-batches, got {len(batches)}")

    def _run(self, batches) -> StepOutput:
        """The step's work on device-resident batches (what the graph captures)."""
        n = len(batches)
        losses = []
        for i, (x, y, *documents) in enumerate(batches):
            kw = {"documents": documents[0]} if documents else {}
            with contextlib.nullcontext() if self.parallel is None else self.parallel.micro_batch(i == n - 1):
                loss, named = self.forward(x, y, return_losses=True, **kw)
                (loss if n == 1 else loss / n).backward()
            losses.append(loss.detach().float())
        loss = losses[0] if n == 1 else torch.stack(losses).mean()
        if self.parallel is not None:
            loss = self.parallel.mean_(loss.clone())
        norm = clip_grad_norm_(self.params, self.grad_clip, found_inf=self.found_inf, check=loss)
        self.optimizer.step(found_inf=self.found_inf)
        self.optimizer.zero_grad(set_to_none=True)
        parts = {k: v for k, v in named.items() if k != "ce"}
        if self.metric_names is None:
            self.metric_names = ["loss", "grad_norm", "skipped", *parts]
        metrics = torch.stack([loss, norm.float(), self.found_inf.float(), *(v.float() for v in parts.values())])
        return StepOutput(loss, norm, self.found_inf, metrics)

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself, or for a CPU tensor bound for the GPU a contiguous pinned copy: a copy from
        pageable or strided host memory (a loader's ``rows[:, :-1]`` view) would wait for the
        stream to drain, a host synchronisation per step."""
        if t.device.type != "cpu" or self.device.type != "cuda":
            return t
        staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return staged.copy_(t)

    def _to_device(self, batches) -> list[tuple[torch.Tensor, ...]]:
        """Each micro-batch's tensors on the step's device."""
        return [tuple(self._staged(t).to(self.device, non_blocking=True) for t in batch) for batch in batches]

    def __call__(self, batches, lr: float) -> StepOutput:
        self._check(batches)
        self.lr.fill_(float(lr))
        self.calls += 1
        if not self.use_graph:
            return self._run(self._to_device(batches))
        if self.graph is not None and self._out is not None:
            self._load_static(batches)
            self.graph.replay()
            return self._out
        if self.calls <= self.warmup:
            return self._side_stream_step(self._to_device(batches))
        return self._capture(batches)

    def _side_stream_step(self, batches) -> StepOutput:
        """An eager step on a side stream (warm-up before a capture, as torch.cuda.graphs advises)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            out = self._run(batches)
        torch.cuda.current_stream(self.device).wait_stream(side)
        return out

    def _load_static(self, batches) -> None:
        for static, batch in zip(self._static, batches):
            if [t.shape for t in batch] != [t.shape for t in static]:
                raise ValueError(f"batches: shapes {[tuple(t.shape) for t in batch]} differ from the captured "
                                 f"{[tuple(t.shape) for t in static]}: a CUDA-graphed step needs fixed shapes "
                                 f"(and documents in every batch or none)")
            for s, t in zip(static, batch):
                s.copy_(self._staged(t), non_blocking=True)

    def _capture(self, batches) -> StepOutput:
        self._static = [tuple(torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in batch)
                        for batch in batches]
        self._load_static(batches)
        # the warm-up's activations are cached for the side stream; release them so that the graph's
        # private pool can use that memory (else a model that fits eagerly may not fit captured)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        failure: str | None
        try:
            with torch.cuda.graph(graph, capture_error_mode="relaxed"):
                out = self._run(self._static)
        except Exception as e:  # noqa: BLE001 -- any capture failure: said once, then eager
            failure = f"{type(e).__name__}: {e}"
        else:
            failure = None
        if self.parallel is not None and not self.parallel.agree(failure is None):
            failure = failure or "the capture failed on another rank"
        if failure is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self.use_graph, self._static = False, []
            del graph  # and its private memory pool, before the eager step allocates
            gc.collect()
            torch.cuda.empty_cache()
            log.warning("CUDA graph capture of the training step failed (%s); training eagerly", failure)
            return self._run(self._to_device(batches))
        self.graph, self._out = graph, out
        log.info("training step captured in a CUDA graph after %d eager warm-up steps", self.warmup)
        graph.replay()
        return out


class MetricsQueue:
    """Step metrics read without a per-step host synchronisation.

    ``push(step, out, info)`` copies ``out.metrics`` into a pinned host slot (non-blocking, on CUDA)
    and records an event; ``ready()`` returns, oldest first, the ``(step, {name: value}, info)`` of the
    steps whose copy has completed, without waiting; ``drain()`` waits for all of them. At most
    ``depth`` steps are in flight: a push beyond that waits for the oldest (bounding how far the
    host runs ahead). On the CPU the values are available at once.
    """

    def __init__(self, names_fn, device: torch.device, depth: int = 8):
        self._names = names_fn
        self.device = device
        self.depth = depth
        self._pending: deque = deque()

    def push(self, step: int, out: StepOutput, info=None) -> None:
        if self.device.type == "cuda":
            host = torch.empty(out.metrics.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(out.metrics, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        else:
            host, event = out.metrics.clone(), None
        self._pending.append((step, host, event, info))

    def _pop(self):
        step, host, event, info = self._pending.popleft()
        if event is not None:
            event.synchronize()
        return step, dict(zip(self._names(), host.tolist())), info

    def ready(self) -> list:
        done = []
        while self._pending:
            event = self._pending[0][2]
            if len(self._pending) <= self.depth and event is not None and not event.query():
                break
            done.append(self._pop())
        return done

    def drain(self) -> list:
        done = []
        while self._pending:
            done.append(self._pop())
        return done
