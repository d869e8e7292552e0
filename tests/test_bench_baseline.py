"""The training benchmark's strong PyTorch baseline (``tritonllm.bench.baseline_model``) against the
float64 reference model, and the benchmark's host-side bookkeeping (``tritonllm.bench.common``, ``tritonllm.bench.train``).

No kernel runs here: the tritonllm model is only built for its state_dict, which both the baseline
and the reference load."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _checks import DEVICE, assert_close
from reference_model import ReferenceTransformer
from tritonllm.bench import baseline_model
from tritonllm.bench.baseline_model import BaselineTransformer
from tritonllm.bench.common import (OUR_KERNEL, busy_ms, host_area, host_area_dirs, host_ms, host_profile,
                                    interleaved_ratio, parse_cpu_model, wall_ms)
from tritonllm.bench.train import _parse, with_speedup
from tritonllm.errors import ConfigError
from tritonllm.models import ModelConfig, build_model

#: void_tiny's features at toy size: odd vocabulary, widths and sequence length
TINY = dict(vocab_size=61, d_model=48, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=40, max_seq_len=24)
DENSE = {
    "tied": dict(),
    "gqa-qknorm-window-tied": dict(n_kv_heads=2, qk_norm=True, window=5),
    "mqa-untied-zloss": dict(n_kv_heads=1, tie_embeddings=False, z_loss_coef=1e-3),
}
MOE = {
    "softmax-top2": dict(n_experts=4, moe_top_k=2, d_expert=16, moe_z_loss_coef=1e-3),
    "sigmoid-top3-unnormalized-shared-qknorm-untied": dict(
        n_experts=5, moe_top_k=3, d_expert=12, n_shared_experts=1, moe_score="sigmoid", moe_normalize=False,
        moe_aux_loss_coef=0.1, qk_norm=True, tie_embeddings=False),
}


def tiny_cfg(**overrides) -> ModelConfig:
    return ModelConfig(name="tiny", **{**TINY, **overrides})


class RefMoE(nn.Module):
    """MoE layer in dense form (every expert on every token, combined through a ``[T, E]`` gate
    matrix): no sorting, so it checks the baseline's permutation. Sets ``aux_loss``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_expert
        self.router = nn.Linear(d, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        fs = cfg.n_shared_experts * f
        self.shared_w13 = nn.Linear(d, 2 * fs, bias=False) if fs else None
        self.shared_w2 = nn.Linear(fs, d, bias=False) if fs else None
        self.aux_loss = None

    def forward(self, x):
        cfg, f = self.cfg, self.cfg.d_expert
        xf = x.reshape(-1, x.shape[-1])
        logits = self.router(xf)
        p = logits.softmax(-1)
        s = logits.sigmoid() if cfg.moe_score == "sigmoid" else p
        idx = logits.topk(cfg.moe_top_k, dim=-1).indices
        w = s.gather(1, idx)
        if cfg.moe_normalize:
            w = w / w.sum(-1, keepdim=True)
        gates = torch.zeros_like(s).scatter(1, idx, w)
        h = F.silu(torch.einsum("td,efd->etf", xf, self.w13[:, :f])) * torch.einsum("td,efd->etf", xf, self.w13[:, f:])
        y = torch.einsum("te,etd->td", gates, torch.einsum("etf,edf->etd", h, self.w2))
        if self.shared_w13 is not None:
            gate, up = self.shared_w13(xf).chunk(2, -1)
            y = y + self.shared_w2(F.silu(gate) * up)
        frac = F.one_hot(idx, cfg.n_experts).sum((0, 1)).to(s.dtype) / idx.numel()
        q = s / s.sum(-1, keepdim=True) if cfg.moe_score == "sigmoid" else p
        aux = cfg.n_experts * (frac * q.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        self.aux_loss = cfg.moe_aux_loss_coef * aux + cfg.moe_z_loss_coef * z
        return y.view(x.shape)


def reference(cfg: ModelConfig, state: dict, dtype: torch.dtype) -> tuple[nn.Module, list[RefMoE]]:
    """``ReferenceTransformer`` in ``dtype`` (its MLPs replaced by :class:`RefMoE` for an MoE config)."""
    ref = ReferenceTransformer(dataclasses.replace(cfg, n_experts=0) if cfg.n_experts else cfg)
    moes = []
    if cfg.n_experts:
        for block in ref.blocks:
            block.mlp = RefMoE(cfg)
            moes.append(block.mlp)
    ref.load_state_dict(state)
    return ref.to(device=DEVICE, dtype=dtype), moes


def ref_loss(ref, moes, idx, targets):
    loss = ref(idx, targets)
    return loss + sum(m.aux_loss for m in moes) if moes else loss


def check_against_reference(cfg: ModelConfig, experts: str, atol: float | None = None, dtype=None):
    """The baseline (fp32) against the float64 reference, both loaded with a tritonllm model's
    weights: the loss and the gradients of the QKV and MLP (and router) weights, within twice the
    reference's own fp32 error (docs/architecture.md, "Tests")."""
    state = build_model(cfg).state_dict()
    base = BaselineTransformer(cfg, experts=experts).to(DEVICE)
    base.load_state_dict(state)  # strict: the parameter names and shapes are tritonllm's
    idx = torch.randint(0, cfg.vocab_size, (2, 19), device=DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (2, 19), device=DEVICE)
    targets[0, 3] = -100
    losses, grads = {}, {}
    names = ["blocks.0.attn.qkv.weight", "blocks.1.mlp.w13" if cfg.n_experts else "blocks.1.mlp.w13.weight"]
    names += ["blocks.1.mlp.router.weight"] if cfg.n_experts else []
    for key in ("base", torch.float64, torch.float32):
        model, moes = (base, []) if key == "base" else reference(cfg, state, key)
        losses[key] = ref_loss(model, moes, idx, targets)
        losses[key].backward()
        params = dict(model.named_parameters())
        grads[key] = {name: params[name].grad for name in names}
    assert_close("loss", losses["base"], losses[torch.float64], losses[torch.float32], atol=atol, dtype=dtype)
    for name in names:
        assert_close(f"grad {name}", grads["base"][name], grads[torch.float64][name], grads[torch.float32][name],
                     atol=atol, dtype=dtype)


@pytest.mark.parametrize("variant", DENSE)
def test_dense_matches_float64_reference(variant):
    check_against_reference(tiny_cfg(**DENSE[variant]), experts="loop")


@pytest.mark.parametrize("variant", MOE)
def test_moe_loop_matches_float64_reference(variant):
    check_against_reference(tiny_cfg(**MOE[variant]), experts="loop")


@pytest.mark.parametrize("variant", MOE)
def test_moe_with_bf16_weights_keeps_a_bf16_residual(variant):
    """bf16 weights without autocast, as FSDP2 gathers them (the multi-GPU bench's baseline): the MoE
    layer's fp32 routing weights must not turn the residual stream fp32 (the LM head's bf16 product
    then failed on 4 H200s). The loss matches the fp32 model's within bf16 rounding."""
    cfg = tiny_cfg(**MOE[variant])
    torch.manual_seed(0)
    base = BaselineTransformer(cfg, experts="loop").to(DEVICE)
    idx = torch.randint(0, cfg.vocab_size, (2, 19), device=DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (2, 19), device=DEVICE)
    want = base(idx, targets)
    base = base.to(torch.bfloat16)
    seen = []
    hooks = [block.register_forward_hook(lambda m, i, out: seen.append(out)) for block in base.blocks]
    loss = base(idx, targets)
    for h in hooks:
        h.remove()
    loss.backward()
    flat = [t for out in seen for t in (out if isinstance(out, tuple) else (out,)) if t.dim() == 3]
    assert flat and all(t.dtype == torch.bfloat16 for t in flat), [t.dtype for t in flat]
    assert abs(float(loss.detach()) - float(want.detach())) <= 2e-2 * float(want), (float(loss.detach()), float(want.detach()))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in base.parameters() if p.requires_grad)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is not in this PyTorch")
def test_moe_grouped_mm_matches_float64_reference():
    """The grouped path's expert GEMMs run in bf16 (its only dtype): bf16 tolerance."""
    cfg = tiny_cfg(**MOE["softmax-top2"])
    check_against_reference(cfg, experts="grouped_mm", atol=4e-2, dtype=torch.bfloat16)


def test_rope_tables_match_tritonllm_with_scaling():
    from tritonllm.kernels.rope import rope_cos_sin

    for scaling in (None, {"type": "ntk", "factor": 4.0},
                    {"type": "yarn", "factor": 8.0, "original_max_position": 16, "beta_fast": 32, "beta_slow": 1}):
        cfg = tiny_cfg(max_seq_len=40, rope_scaling=scaling)
        base = BaselineTransformer(cfg, experts="loop")
        cos, sin = rope_cos_sin(cfg.max_seq_len, cfg.head_dim, theta=cfg.rope_theta, scaling=scaling, device=DEVICE)
        assert_close(f"cos {scaling}", base.rope_cos, cos, atol=1e-5)
        assert_close(f"sin {scaling}", base.rope_sin, sin, atol=1e-5)


def test_rope_tables_are_built_once(monkeypatch):
    """Forward and backward only slice the cached tables: a rebuild in forward would fail here."""
    cfg = tiny_cfg()
    base = BaselineTransformer(cfg, experts="loop")
    assert "rope_cos" not in base.state_dict()  # non-persistent: load_state_dict from tritonllm works

    def rebuilt(*args):
        raise AssertionError("RoPE tables rebuilt inside forward")

    monkeypatch.setattr(baseline_model, "rope_inv_freq", rebuilt)
    monkeypatch.setattr(baseline_model, "rope_tables", rebuilt)
    base(torch.randint(0, cfg.vocab_size, (1, 7)), torch.randint(0, cfg.vocab_size, (1, 7))).backward()


@pytest.mark.parametrize("scaling", [{"type": "dynamic", "factor": 2.0}, {"type": "yarn", "factor": 2.0}],
                         ids=["unknown-type", "yarn-without-original-length"])
def test_unsupported_rope_scaling_names_the_field(scaling):
    cfg = tiny_cfg()
    cfg.rope_scaling = scaling  # past ModelConfig's own check
    with pytest.raises(ValueError, match="rope_scaling"):
        BaselineTransformer(cfg, experts="loop")


def test_bad_expert_impl_names_the_argument():
    with pytest.raises(ValueError, match="experts"):
        BaselineTransformer(tiny_cfg(**MOE["softmax-top2"]), experts="einsum")


# --- the benchmark's host-side bookkeeping ----------------------------------------------------------

LSCPU = """Architecture:                            x86_64
CPU(s):                                  16
Vendor ID:                               GenuineIntel
Model name:                              Intel(R) Xeon(R) Platinum 8480+
Thread(s) per core:                      2
"""
CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t\t: fpu\n"


@pytest.mark.parametrize("lscpu, cpuinfo, expected", [
    (LSCPU, CPUINFO, "Intel(R) Xeon(R) Platinum 8480+"),
    ("Architecture: aarch64\nModel name:            -\n", CPUINFO, "AMD EPYC 9654 96-Core Processor"),
    (None, CPUINFO, "AMD EPYC 9654 96-Core Processor"),
    ("Architecture: x86_64\n", "", "unknown"),
], ids=["lscpu", "lscpu-dash-falls-back", "no-lscpu", "neither"])
def test_parse_cpu_model(lscpu, cpuinfo, expected):
    assert parse_cpu_model(lscpu, cpuinfo) == expected


class FakeClock:
    """A host clock that only the fake calls below advance, by fixed amounts."""

    def __init__(self):
        self.now = 0.0

    def advance(self, seconds: float):
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def test_host_ms_times_the_step_call_alone_and_counts_calls_that_outlast_the_gpu_work():
    clock, log = FakeClock(), []
    costs = iter([0.002, 0.004, 0.003])
    outlasted = iter([False, True, False])  # the second call returned after the GPU ran out of work

    def step():
        log.append("step")
        clock.advance(next(costs))

    def busy():
        log.append("busy")
        clock.advance(0.5)  # enqueuing the spin kernel: outside the timed window
        finished = next(outlasted)
        return lambda: log.append("query") or finished

    def sync():
        log.append("sync")
        clock.advance(1.0)  # waiting for the GPU: outside the timed window

    ms, waited = host_ms(step, 3, busy, sync, clock)
    assert ms == pytest.approx(3.0) and waited == 1
    assert log == ["sync", "busy", "step", "query"] * 3 + ["sync"]


def test_wall_ms_counts_the_final_synchronisation():
    clock, log = FakeClock(), []

    def step():
        log.append("step")
        clock.advance(0.001)

    def sync():
        log.append("sync")
        clock.advance(0.010 if log.count("sync") > 1 else 5.0)  # the drain behind the last step counts

    assert wall_ms(step, 4, sync, clock) == pytest.approx((4 * 0.001 + 0.010) / 4 * 1e3)
    assert log == ["sync"] + ["step"] * 4 + ["sync"]


def test_parse_options():
    args, overrides = _parse(["+model=void125m", "--steps", "7", "--baselines", "compile,reduce-overhead",
                              "trainer.batch_size=4"])
    assert (args.steps, args.warmup, args.baselines) == (7, 5, ["compile", "reduce-overhead"])
    assert overrides == ["+model=void125m", "trainer.batch_size=4"]
    assert _parse([])[0].baselines == ["compile", "reduce-overhead", "max-autotune"]
    assert _parse(["--no-baseline"])[0].baselines == []
    assert (_parse([])[0].compiled, _parse(["--compiled"])[0].compiled) == (False, True)
    with pytest.raises(ConfigError, match="--warmup must be >= 3"):
        _parse(["--warmup", "2"])
    with pytest.raises(ConfigError, match="--baselines: unknown"):
        _parse(["--baselines", "compile,eager"])
    with pytest.raises(ConfigError, match="--ab-rounds must be >= 1"):
        _parse(["--compiled", "--ab-rounds", "0"])
    with pytest.raises(ConfigError, match="unrecognized arguments: --stepz"):  # not taken for a Hydra override
        _parse(["+model=void125m", "--stepz", "7"])


def test_interleaved_ratio_pairs_each_round_on_the_same_host():
    """The host slows down 3x halfway through: sequential timing would read B as 3x A, the paired rounds
    read B's true 1.5x; the order alternates, and each side gets one untimed step first."""
    clock, log = FakeClock(), []

    def side(name, ms):
        def step():
            log.append(name)
            clock.advance(ms / 1e3 * (3 if len(log) > 10 else 1))  # from round 2 on
        return step

    ab = interleaved_ratio(side("a", 2.0), side("b", 3.0), rounds=4, steps=2, sync=lambda: None, clock=clock)
    assert ab["ratio"] == pytest.approx(1.5) and ab["min"] == pytest.approx(1.5) and ab["max"] == pytest.approx(1.5)
    assert (ab["rounds"], ab["steps"]) == (4, 2)
    assert "".join(log) == "ab" + "aabb" + "bbaa" + "aabb" + "bbaa"


def test_host_profile_attributes_self_time_to_areas_and_functions(monkeypatch):
    from tritonllm.kernels.launch import next_pow2

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def step():
        for n in range(1, 2001):
            next_pow2(n)
        torch.zeros(8).sum()

    # every function (top=10**6): where next_pow2 ranks by self time depends on the machine's load
    prof = host_profile(step, 3, top=10**6)
    assert set(prof["areas"]) >= {"tritonllm", "other"} and sum(prof["areas"].values()) == pytest.approx(1, abs=0.01)
    assert prof["host_ms"] > 0 and len(prof["top"]) > 5
    assert [r["ms"] for r in prof["top"]] == sorted((r["ms"] for r in prof["top"]), reverse=True)
    pow2 = next(r for r in prof["top"] if "next_pow2" in r["fn"])
    assert pow2["calls"] == 2000 and "launch.py" in pow2["fn"]
    assert len(host_profile(step, 1, top=5)["top"]) == 5
    assert _parse(["--host-profile", "3"])[0].host_profile == 3 and _parse([])[0].host_profile == 0


def test_host_profile_areas_are_package_folders_not_names_in_the_path(monkeypatch, tmp_path):
    """A file in a folder that merely has a package's name (a clone into ``tritonllm/``, a user's
    ``triton/`` folder) is ``other``; the packages' own files are theirs, whatever folder holds them."""
    import importlib.util

    import triton

    import tritonllm
    from tritonllm.kernels import launch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    for folder in ("tritonllm", "kernels", "triton", "torch"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.py").write_text("def spin(n):\n    return sum(i * i for i in range(n))\n")
    spins = []
    for folder in ("tritonllm", "kernels", "triton", "torch"):
        spec = importlib.util.spec_from_file_location(f"_area_{folder}", tmp_path / folder / "x.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        spins.append(module.spin)
    dirs = host_area_dirs()
    for spin in spins:
        assert host_area(spin.__code__.co_filename, dirs) == "other"
    assert host_area(tritonllm.__file__, dirs) == "tritonllm" and host_area(launch.__file__, dirs) == "tritonllm"
    assert host_area(triton.__file__, dirs) == "triton" and host_area(torch.__file__, dirs) == "torch"
    assert host_area(torch._dynamo.__file__, dirs) == "dynamo" and host_area(torch.autograd.__file__, dirs) == "autograd"
    assert host_area("~", dirs) == "builtins"

    def step():
        for spin in spins:
            spin(20000)
        for n in range(1, 2001):
            launch.next_pow2(n)

    prof = host_profile(step, 2, top=10**6)
    outside = sum(r["ms"] for r in prof["top"] if str(tmp_path) in r["fn"])  # the four spins, counted as other
    assert outside > 0 and prof["areas"]["other"] * prof["host_ms"] >= 0.99 * outside
    assert prof["areas"]["tritonllm"] > 0


def test_speedup_is_against_the_fastest_baseline_that_ran():
    row = {"step_ms": 20.0, "speedup": None, "baselines": {
        "torch.compile": {"step_ms": 30.0}, "reduce-overhead": {"step_ms": 25.0},
        "max-autotune": {"error": "OutOfMemoryError: ..."}}}
    assert with_speedup(row)["speedup"] == 1.25 and row["fastest_baseline"] == "reduce-overhead"
    assert with_speedup({"step_ms": 20.0, "speedup": None, "baselines": {}})["speedup"] is None


def test_our_kernel_names():
    """triton_share counts tritonllm's Triton and Gluon kernels (by their bare names), not CUDA library
    kernels (a C++ signature) nor torch.compile's Triton kernels."""
    for name in ("_matmul_kernel", "ws_matmul_kernel", "_sm90_dq_kernel", "_rms_norm_fwd_kernel_0d1d"):
        assert OUR_KERNEL.match(name), name
    for name in ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<float> >(int)",
                 "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "triton_poi_fused_add_0", "triton_red_fused_kernel_1",
                 "Memset (Device)"):
        assert not OUR_KERNEL.match(name), name


def test_busy_time_counts_overlapping_kernels_once():
    """gpu_busy_ms: the union of the kernels' intervals (us) per step; kernels side by side count once, a kernel
    inside another adds nothing, gaps add nothing."""
    assert busy_ms([], 3) == 0.0
    assert busy_ms([(0.0, 1000.0)], 1) == 1.0
    # two streams: [0, 600) and [400, 1000) overlap by 200 us; [200, 300) lies inside the first; a gap, then [2000, 2500)
    intervals = [(400.0, 1000.0), (0.0, 600.0), (200.0, 300.0), (2000.0, 2500.0)]
    assert busy_ms(intervals, 2) == pytest.approx((1000.0 + 500.0) / 1e3 / 2)
