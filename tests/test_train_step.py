"""The optimizer step as one object (tritonllm.train.step): the eager step against the same work
written out by hand, a non-finite loss skipped on the device, the metrics queue, the cuda_graph
setting; on a GPU the CUDA-graphed step against the eager one, bit for bit (dense and MoE,
grad_accum 1 and 4, packed documents, a learning rate that changes every step, a NaN injected under
replay, a training run resumed with graphs on)."""

import math

import numpy as np
import pytest
import torch
from _checks import DEVICE, ON_GPU
from omegaconf import OmegaConf

from tritonllm.data.sft import document_bounds
from tritonllm.errors import ConfigError, TrainingError
from tritonllm.models import ModelConfig, build_model
from tritonllm.optim import clip_grad_norm_
from tritonllm.train import MetricsQueue, NonFiniteGuard, TrainStep, build_optimizer, resolve_cuda_graph, train

DENSE = dict(name="tiny", vocab_size=97, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=96,
             max_seq_len=32)
MOE = dict(DENSE, name="tiny_moe", n_experts=4, moe_top_k=2, d_expert=32, n_shared_experts=1)
OPTIM = OmegaConf.create(dict(lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1))


class Scaled(torch.nn.Module):
    """``model(x, y) * scale`` with ``scale`` a device scalar: set it to NaN to poison one step."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.ones((), device=next(inner.parameters()).device))

    def forward(self, x, y, return_losses=False, **kw):
        loss, losses = self.inner(x, y, return_losses=True, **kw)
        return (loss * self.scale, losses) if return_losses else loss * self.scale


def _setup(cfg, dtype=None, seed=0):
    torch.manual_seed(seed)
    model = Scaled(build_model(ModelConfig(**cfg), device=DEVICE, dtype=dtype))
    optimizer = build_optimizer(model, OPTIM, master_weights=dtype == torch.bfloat16)
    return model, optimizer


def _batches(cfg, steps, accum, B=2, T=16, seed=1, documents=False):
    """Random micro-batches ``(x, y)``, or ``(x, y, documents)`` of 1 to 4 packed documents per row."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda: torch.randint(0, cfg["vocab_size"], (B, T), generator=g)  # noqa: E731

    def docs():
        cuts = torch.rand(B, T, generator=g) < 0.15  # a document starts after each cut
        return torch.from_numpy(document_bounds(np.cumsum(cuts.numpy(), axis=1)))

    return [[(draw(), draw(), docs()) if documents else (draw(), draw()) for _ in range(accum)]
            for _ in range(steps)]


def _state(model, optimizer):
    """Every tensor a step changes: weights and optimizer state (moments, masters, step counts)."""
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for k, v in optimizer.state[p].items():
            if torch.is_tensor(v):
                out[f"s{i}.{k}"] = v.detach().clone()
    return out


def _run(cfg, *, graph, accum=1, steps=10, dtype=None, nan_at=(), lr=lambda s: 1e-2 * (1 + s) / 10,
         documents=False):
    model, optimizer = _setup(cfg, dtype)
    step = TrainStep(model, optimizer, grad_clip=1.0, grad_accum=accum, cuda_graph=graph)
    metrics, states = [], []
    for s, batches in enumerate(_batches(cfg, steps, accum, documents=documents)):
        model.scale.fill_(math.nan if s in nan_at else 1.0)
        out = step(batches, lr(s))
        metrics.append(out.metrics.clone())
        states.append(_state(model, optimizer))
    return step, torch.stack(metrics), states


# ----------------------------------------------------------------------------- eager step, CPU and GPU

@pytest.mark.parametrize("documents", [False, True], ids=["xy", "packed"])
def test_eager_step_is_the_written_out_step(documents):
    """Two micro-batches: the step's loss, norm and weights equal forward/backward/clip/AdamW by hand;
    micro-batches ``(x, y, documents)`` reach the model as ``documents=`` (the loss is not that of
    the batch without them)."""
    model, optimizer = _setup(DENSE)
    ref_model, ref_opt = _setup(DENSE)
    (batches,) = _batches(DENSE, 1, 2, documents=documents)
    if documents:
        with torch.no_grad():
            whole = torch.stack([model(x.to(DEVICE), y.to(DEVICE)) for x, y, _ in batches]).mean()
    out = TrainStep(model, optimizer, grad_clip=0.5, grad_accum=2, cuda_graph=False)(batches, 3e-3)
    if documents:
        assert not torch.allclose(out.loss, whole, rtol=1e-5)  # at init both are near ln(97)

    losses = []
    for x, y, *docs in batches:
        loss = ref_model(x.to(DEVICE), y.to(DEVICE), **({"documents": docs[0].to(DEVICE)} if docs else {}))
        (loss / 2).backward()
        losses.append(loss.detach())
    norm = clip_grad_norm_([p for p in ref_model.parameters()], 0.5)
    for group in ref_opt.param_groups:
        group["lr"] = 3e-3
    ref_opt.step()
    assert torch.equal(out.loss, torch.stack(losses).mean()) and torch.equal(out.grad_norm, norm)
    assert out.skipped.item() == 0 and out.metrics[2].item() == 0
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
        assert p.grad is None, f"{name}: gradients are zeroed (set to None) after the step"


def test_non_finite_loss_is_skipped_on_the_device():
    """A NaN loss at step 1: weights, moments and step counts stay as after step 0, the skip flag
    reads 1, and the next finite step updates again."""
    model, optimizer = _setup(DENSE)
    step = TrainStep(model, optimizer, grad_clip=1.0, cuda_graph=False)
    batches = _batches(DENSE, 3, 1)
    step(batches[0], 1e-2)
    before = _state(model, optimizer)
    model.scale.fill_(math.nan)
    out = step(batches[1], 1e-2)
    assert out.skipped.item() == 1 and math.isnan(out.loss.item())
    after = _state(model, optimizer)
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]
    model.scale.fill_(1.0)
    assert step(batches[2], 1e-2).skipped.item() == 0
    assert not torch.equal(_state(model, optimizer)["p.inner.embed.weight"], after["p.inner.embed.weight"])


def test_step_argument_errors():
    model, optimizer = _setup(DENSE)
    with pytest.raises(ValueError, match="grad_accum must be >= 1"):
        TrainStep(model, optimizer, grad_clip=1.0, grad_accum=0)
    with pytest.raises(ValueError, match="grad_clip must be > 0"):
        TrainStep(model, optimizer, grad_clip=0.0)
    step = TrainStep(model, optimizer, grad_clip=None, grad_accum=2, cuda_graph=False)
    with pytest.raises(ValueError, match="expected grad_accum=2 micro-batches, got 1"):
        step(_batches(DENSE, 1, 1)[0], 1e-3)


def test_release_resets_the_graph_and_steps_eagerly():
    """release() resets a captured graph (one holding NCCL collectives keeps destroy_process_group
    waiting) exactly once, and the step then runs eagerly: a stand-in graph here, a real one in
    test_release_then_eager_continues_the_run on the GPU."""
    class Graph:
        resets = 0

        def reset(self):
            self.resets += 1

    model, optimizer = _setup(DENSE)
    step = TrainStep(model, optimizer, grad_clip=1.0, cuda_graph=False)
    graph = Graph()
    step.graph, step.use_graph = graph, True
    assert step.graphed
    step.release()
    step.release()
    assert graph.resets == 1 and not step.graphed and step.graph is None
    assert step(_batches(DENSE, 1, 1)[0], 1e-2).skipped.item() == 0


def test_resolve_cuda_graph():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_cuda_graph("auto", cpu) is False and resolve_cuda_graph("auto", cuda) is True
    assert resolve_cuda_graph(False, cuda) is False and resolve_cuda_graph("false", cuda) is False
    assert resolve_cuda_graph(True, cuda) is True
    with pytest.raises(ValueError, match="cuda_graph=true needs a CUDA device"):
        resolve_cuda_graph(True, cpu)
    with pytest.raises(ValueError, match="cuda_graph must be auto, true or false, got 'sometimes'"):
        resolve_cuda_graph("sometimes", cuda)


@pytest.mark.skipif(ON_GPU, reason="the error is for machines without CUDA")
def test_cuda_graph_true_on_cpu_is_a_config_error(tmp_path):
    from hydra import compose, initialize_config_module

    with initialize_config_module("tritonllm.conf", version_base="1.3"):
        cfg = compose("train", overrides=["+model=void_tiny", "device=cpu", "trainer.cuda_graph=true",
                                          f"out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="trainer.cuda_graph=true needs a CUDA device"):
        train(cfg)


# ----------------------------------------------------------------------------- host-side bookkeeping

def test_metrics_queue_in_step_order():
    """The queue hands back each step's metrics by name, oldest first, copied at push time (a
    graph's outputs are overwritten by the next replay)."""
    names = ["loss", "grad_norm", "skipped", "aux"]
    queue = MetricsQueue(lambda: names, torch.device(DEVICE), depth=2)
    shared = torch.zeros(4, device=DEVICE)

    class Out:
        metrics = shared

    for s in range(5):
        shared.copy_(torch.tensor([2.0 + s, 0.5, float(s == 3), -1.0]))
        queue.push(s, Out, s * 1e-3)
    done = queue.ready() + queue.drain()
    assert [d[0] for d in done] == [0, 1, 2, 3, 4] and queue.drain() == []
    assert [d[1]["loss"] for d in done] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert [d[1]["skipped"] for d in done] == [0, 0, 0, 1, 0]
    assert done[4][1]["aux"] == -1.0 and done[4][2] == 4e-3


def test_guard_observes_the_device_decision():
    guard = NonFiniteGuard(2)
    assert guard.observe(0, False, 2.0, 1.0)
    assert not guard.observe(1, True, math.nan, 1.0) and guard.consecutive == 1
    assert guard.observe(2, False, 2.0, 1.0) and guard.consecutive == 0
    assert not guard.observe(3, True, 2.0, math.inf)
    with pytest.raises(TrainingError, match="2 steps in a row"):
        guard.observe(4, True, math.nan, math.nan)


# ----------------------------------------------------------------------------- CUDA graphs (GPU)

def _assert_equal_runs(a, b):
    (_, ma, sa), (_, mb, sb) = a, b
    assert torch.equal(ma.nan_to_num(7.0), mb.nan_to_num(7.0)), (ma[:, 0], mb[:, 0])
    for s, (x, y) in enumerate(zip(sa, sb)):
        bad = [k for k in x if not torch.equal(x[k], y[k])]
        assert not bad, f"step {s}: {bad[:5]} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("accum", [1, 4])
def test_graphed_equals_eager(cfg, accum):
    """10 steps in bf16 with fp32 masters and a learning rate that changes every step: the replayed
    graph and the eager step give the same losses, norms, weights and optimizer state bit for bit."""
    graphed = _run(cfg, graph=True, accum=accum, dtype=torch.bfloat16)
    assert graphed[0].graphed, "the step was not captured"
    _assert_equal_runs(graphed, _run(cfg, graph=False, accum=accum, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_release_then_eager_continues_the_run():
    """Three replayed steps, release(), then one eager step: the same weights and optimizer state bit
    for bit as four eager steps."""
    model, optimizer = _setup(DENSE, torch.bfloat16)
    step = TrainStep(model, optimizer, grad_clip=1.0, cuda_graph=True)
    batches = _batches(DENSE, 6, 1)
    for s in range(5):
        step(batches[s], 1e-2)
    assert step.graphed, "the step was not captured"
    step.release()
    assert not step.graphed
    step(batches[5], 1e-2)
    eager = _run(DENSE, graph=False, steps=6, dtype=torch.bfloat16, lr=lambda s: 1e-2)[2][-1]
    got = _state(model, optimizer)
    assert all(torch.equal(got[k], eager[k]) for k in eager), [k for k in eager if not torch.equal(got[k], eager[k])]


@pytest.mark.gpu
@pytest.mark.parametrize("accum", [1, 2])
def test_graphed_equals_eager_with_documents(accum):
    """Packed micro-batches ``(x, y, documents)``, new document bounds every step: the documents are
    a third static buffer of the graph, and the replays equal the eager steps bit for bit."""
    graphed = _run(DENSE, graph=True, accum=accum, dtype=torch.bfloat16, documents=True)
    assert graphed[0].graphed and len(graphed[0]._static[0]) == 3
    _assert_equal_runs(graphed, _run(DENSE, graph=False, accum=accum, dtype=torch.bfloat16, documents=True))


@pytest.mark.gpu
def test_learning_rate_change_takes_effect_under_replay():
    """lr 0 at replayed steps 5 and 6 leaves the weights as they were (decoupled decay scales with lr too)."""
    step, metrics, states = _run(DENSE, graph=True, steps=8, dtype=torch.bfloat16,
                                 lr=lambda s: 0.0 if s in (5, 6) else 1e-2)
    assert step.graphed
    weights = lambda st: {k: v for k, v in st.items() if k.startswith("p.")}  # noqa: E731
    assert all(torch.equal(weights(states[4])[k], weights(states[6])[k]) for k in weights(states[4]))
    assert not torch.equal(states[7]["p.inner.embed.weight"], states[6]["p.inner.embed.weight"])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_nan_under_replay_is_skipped_and_counted(cfg):
    """A NaN loss at replayed step 5: skipped on the device (state equal to step 4's), flagged in the
    metrics, and the run goes on; the graphed and eager runs agree."""
    graphed = _run(cfg, graph=True, dtype=torch.bfloat16, nan_at=(5,))
    step, metrics, states = graphed
    assert step.graphed
    assert metrics[:, 2].tolist() == [0.0] * 5 + [1.0] + [0.0] * 4
    assert all(torch.equal(states[4][k], states[5][k]) for k in states[4])
    _assert_equal_runs(graphed, _run(cfg, graph=False, dtype=torch.bfloat16, nan_at=(5,)))


@pytest.mark.gpu
def test_resume_with_graphs_matches_the_straight_run(tmp_path):
    """train() on the GPU (graph on, bf16): 8 steps straight, and 4 + a resumed 4 (warm-up, capture and
    replays again after the resume) log the same losses bit for bit."""
    import json
    import os

    from hydra import compose, initialize_config_module

    text = tmp_path / "corpus.txt"
    text.write_text(open(os.path.join(os.path.dirname(__file__), "..", "tritonllm", "train", "loop.py")).read() * 4)
    common = ["+model=void_tiny", "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=2",
              "model.d_ff=128", "model.max_seq_len=64", "data=text", f"data.files={text}", "data.vocab_size=512",
              f"data.cache_dir={tmp_path / 'cache'}", "device=cuda", "trainer.batch_size=2", "trainer.seq_len=32",
              "trainer.max_steps=8", "trainer.eval_interval=4", "trainer.eval_batches=1", "trainer.log_interval=1",
              "trainer.ckpt_interval=4", "trainer.progress=false", "trainer.cuda_graph=true", "optim.lr=2e-2",
              "sched.warmup_steps=2"]

    def run(out, *extra):
        with initialize_config_module("tritonllm.conf", version_base="1.3"):
            train(compose("train", overrides=[*common, f"out_dir={out}", *extra]))
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}

    straight = run(tmp_path / "straight")
    resumed = run(tmp_path / "resumed", f"trainer.resume={tmp_path / 'straight' / 'checkpoints' / 'step_00000004'}")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[s] == straight[s] for s in resumed), (straight, resumed)


@pytest.mark.gpu
def test_replayed_steps_do_not_synchronise():
    """After the capture, steps fed strided CPU batches (as the loader's x = rows[:, :-1]) and their
    metrics pushed to the queue run with CUDA's sync debug mode set to error: no host sync."""
    model, optimizer = _setup(DENSE, torch.bfloat16)
    step = TrainStep(model, optimizer, grad_clip=1.0)
    queue = MetricsQueue(lambda: step.metric_names, torch.device(DEVICE))
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, DENSE["vocab_size"], (2, 17), generator=g) for _ in range(6)]
    for s in range(3):
        queue.push(s, step([(rows[s][:, :-1], rows[s][:, 1:])], 1e-3))
    assert step.graphed
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(3, 6):
            queue.push(s, step([(rows[s][:, :-1], rows[s][:, 1:])], 1e-3))
            queue.ready()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [d[0] for d in queue.drain()][-1] == 5
