"""The model half of issue 5: configs, the Transformer against a plain-PyTorch twin, KV-cache
generation, and an audit that the training path calls no PyTorch math."""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _checks import DEVICE, ON_GPU, assert_close, gemm_atol, non_contiguous, poison_
from reference_model import ReferenceTransformer
from tritonllm.errors import ConfigError
from tritonllm.models import KVCache, ModelConfig, ModelConfigError, build_model, sample_next

CONF_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "model")
# hf.yaml names a Hugging Face folder whose config.json holds the architecture (tests/test_sft.py runs it)
YAMLS = sorted(p for p in glob.glob(os.path.join(CONF_MODEL, "*.yaml")) if os.path.basename(p) != "hf.yaml")
NAMES = [os.path.basename(p)[:-5] for p in YAMLS]

#: tiny model of the parity tests: odd vocabulary, widths and sequence lengths.
TINY = dict(vocab_size=61, d_model=48, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=40, max_seq_len=24)
#: every feature in two runs (the interpreter is slow): two blocks pass the residual stream between them.
VARIANTS = {
    "2layers-gqa-qknorm-window-tied": dict(n_layers=2, qk_norm=True, window=4, tie_embeddings=True),
    "mqa-untied-zloss": dict(n_kv_heads=1, tie_embeddings=False, z_loss_coef=1e-3),
}


def tiny_cfg(**overrides) -> ModelConfig:
    return ModelConfig(name="tiny", **{**TINY, **overrides})


def compose_model(name: str, *overrides: str):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="tritonllm.conf", version_base=None):
        return compose(config_name=None, overrides=[f"+model={name}", *overrides]).model


def stated_params(path: str) -> tuple[float, float | None]:
    """The counts in the yaml's ``# params: 109.53M`` or ``# params: 6.88B total, 1.79B active`` comment."""
    with open(path) as f:
        line = re.search(r"^#\s*params:(.*)$", f.read(), re.MULTILINE)
    assert line, f"{path} has no '# params: <count>[KMB]' comment"
    counts = re.findall(r"([0-9.]+)\s*([KMB])\b\s*(active)?", line.group(1))
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}
    total = float(counts[0][0]) * scale[counts[0][1]]
    active = [float(n) * scale[u] for n, u, is_active in counts if is_active]
    return total, (active[0] if active else None)


def shrunk(model_cfg) -> dict:
    """A model config's fields at toy size, keeping its features (GQA ratio, MQA, MoE, QK-norm, window)."""
    d = dict(model_cfg)
    n_heads = d.get("n_heads", 12)
    n_kv = d.get("n_kv_heads") or n_heads
    kv = 1 if n_kv == 1 else 2
    d.update(vocab_size=64, d_model=32, n_layers=1, n_kv_heads=kv, n_heads=kv * (2 if n_heads > n_kv else 1),
             head_dim=32, d_ff=48, max_seq_len=16)
    if d.get("window"):
        d["window"] = 3
    if d.get("n_experts"):
        d.update(n_experts=min(d["n_experts"], 4), moe_top_k=min(d.get("moe_top_k", 2), 2), d_expert=16,
                 n_shared_experts=min(d.get("n_shared_experts", 0), 1))
    return d


def random_batch(cfg: ModelConfig, B: int, T: int, ignore: bool = True):
    idx = torch.randint(0, cfg.vocab_size, (B, T), device=DEVICE)
    targets = torch.randint(0, cfg.vocab_size, (B, T), device=DEVICE)
    if ignore:
        targets[0, 1] = -100
    return idx, targets


def twins(cfg: ModelConfig):
    """Our model (fp32) and reference copies in float64 and float32 with the same weights."""
    ours = build_model(cfg, device=DEVICE)
    refs = []
    for dtype in (torch.float64, torch.float32):
        ref = ReferenceTransformer(cfg).to(device=DEVICE, dtype=dtype)
        ref.load_state_dict(ours.state_dict())
        refs.append(ref)
    return ours, refs[0], refs[1]


# --- configs -------------------------------------------------------------------------------------

def test_every_dense_config_is_shipped():
    assert {"void_tiny", "void125m", "void350m", "void1b", "void3b"} <= set(NAMES)


@pytest.mark.parametrize("path", YAMLS, ids=NAMES)
def test_stated_param_count_matches_analytic(path):
    from omegaconf import OmegaConf

    cfg = ModelConfig.from_dict(OmegaConf.load(path))
    total, active = stated_params(path)
    assert abs(cfg.param_count() - total) <= 0.01 * total, (cfg.param_count(), total)
    if active is not None:
        assert abs(cfg.param_count(active=True) - active) <= 0.01 * active, (cfg.param_count(active=True), active)


@pytest.mark.parametrize("name", NAMES)
def test_config_composes_and_builds_shrunk(name):
    full = ModelConfig.from_dict(compose_model(name))
    assert full.name == name
    cfg = ModelConfig.from_dict(shrunk(compose_model(name)))
    model = build_model(cfg, device=DEVICE)
    assert model.num_params() == cfg.param_count()
    cos, sin = model.rope_tables(DEVICE)
    assert cos.shape == sin.shape == (cfg.max_seq_len, cfg.head_dim // 2)


@pytest.mark.parametrize("name", NAMES)
def test_config_head_dim_is_supported_by_flash_attention(name):
    from tritonllm.kernels.flash_attention import HEAD_DIMS

    assert ModelConfig.from_dict(compose_model(name)).head_dim in HEAD_DIMS


def test_known_shapes():
    c125 = ModelConfig.from_dict(compose_model("void125m"))
    assert (c125.d_model, c125.n_layers, c125.n_heads, c125.d_ff, c125.vocab_size, c125.max_seq_len,
            c125.rope_theta) == (768, 12, 12, 2048, 32000, 2048, 10000.0)
    c1b = ModelConfig.from_dict(compose_model("void1b"))
    assert (c1b.d_model, c1b.n_layers, c1b.n_heads, c1b.n_kv_heads) == (2048, 24, 16, 4)
    c3b = ModelConfig.from_dict(compose_model("void3b"))
    assert (c3b.d_model, c3b.n_layers, c3b.n_heads, c3b.n_kv_heads) == (3200, 26, 32, 8)
    tiny = ModelConfig.from_dict(compose_model("void_tiny"))
    assert (tiny.d_model, tiny.n_layers, tiny.n_heads) == (128, 4, 4)
    assert 4.5e6 <= tiny.param_count() <= 5.5e6


def test_every_config_field_has_a_type_and_a_comment():
    import inspect

    from tritonllm.models import config

    src = inspect.getsource(config.ModelConfig)
    for f in dataclasses.fields(ModelConfig):
        assert re.search(rf"^\s+{f.name}: [^=]+ = .+  # \S", src, re.MULTILINE), f.name


def test_from_dict_accepts_dictconfig_and_resolves_defaults():
    cfg = ModelConfig.from_dict(compose_model("void_tiny", "model.n_kv_heads=2", "model.head_dim=null"))
    assert cfg.n_kv_heads == 2 and cfg.head_dim == 32 and isinstance(cfg.rope_theta, float)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("bad, field", [
    (dict(n_layer=2), "n_layer"),
    (dict(n_layers="two"), "n_layers"),
    (dict(qk_norm=1), "qk_norm"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(d_model=100, head_dim=None, n_heads=3, n_kv_heads=1), "n_heads"),
    (dict(window=0), "window"),
    (dict(rope_scaling={"type": "dynamic"}), "rope_scaling"),
    (dict(moe_score="relu"), "moe_score"),
    (dict(qk_norm=True, qk_norm_span="token"), "qk_norm_span"),
    (dict(n_experts=4, moe_top_k=5), "moe_top_k"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_config_names_the_field(bad, field):
    assert issubclass(ModelConfigError, ConfigError) and issubclass(ModelConfigError, ValueError)
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_dict({**TINY, **bad})


# --- module structure (no kernel runs) -----------------------------------------------------------

def test_init_scales_output_projections():
    cfg = ModelConfig(d_model=128, n_layers=8, n_heads=4, d_ff=256, vocab_size=512, init_std=0.02)
    model = build_model(cfg)
    out_std = 0.02 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        if name.endswith(("proj.weight", "w2.weight")):
            expected = out_std
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        else:
            expected = 0.02
        assert abs(p.std().item() - expected) < 0.05 * expected, (name, p.std().item(), expected)


@pytest.mark.parametrize("span", ["head", "all"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_param_counts_and_flops(tied, span):
    cfg = tiny_cfg(tie_embeddings=tied, qk_norm=True, qk_norm_span=span)
    model = build_model(cfg)
    embed = cfg.vocab_size * cfg.d_model
    assert model.num_params() == cfg.param_count() == sum(p.numel() for p in model.parameters())
    assert model.num_params(exclude_embedding=True) == cfg.param_count(exclude_embedding=True)
    assert model.num_params() - model.num_params(exclude_embedding=True) == embed
    active = model.num_params() - (0 if tied else embed)
    assert model.num_active_params() == active
    assert model.flops_per_token(20) == 6 * active + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 20
    assert (model.lm_head is None) == tied


def test_meta_model_allocates_nothing_and_counts_the_same():
    """``build_model(device="meta")``: no weight drawn or stored (the multi-GPU bench reads a 6.9B MoE's
    FLOPs this way), the same parameter counts and FLOPs as the CPU model; on the CPU the weights are
    those of the model built without a device."""
    cfg = tiny_cfg(n_experts=4, moe_top_k=2, d_expert=16, tie_embeddings=False)
    meta, cpu = build_model(cfg, device="meta"), build_model(cfg)
    assert all(p.is_meta for p in meta.parameters())
    assert (meta.num_params(), meta.num_active_params(), meta.flops_per_token(20)) == (
        cpu.num_params(), cpu.num_active_params(), cpu.flops_per_token(20))
    torch.manual_seed(3)
    a = build_model(cfg, device="cpu")
    torch.manual_seed(3)
    b = build_model(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# --- sampling (PyTorch ops, no kernels) ----------------------------------------------------------

def test_sample_next_greedy_top_k_top_p():
    logits = torch.randn(1, 50).repeat(4000, 1)
    order = logits[0].argsort(descending=True)
    assert torch.equal(sample_next(logits, temperature=0.0)[:, 0], order[0].repeat(4000))
    assert torch.equal(sample_next(logits, temperature=1.0, top_k=1)[:, 0], order[0].repeat(4000))
    drawn = sample_next(logits, temperature=1.0, top_k=3)
    assert set(drawn.flatten().tolist()) == set(order[:3].tolist())
    probs = logits[0].softmax(-1)[order]
    n_nucleus = int((probs.cumsum(0) < 0.6).sum()) + 1
    drawn = sample_next(logits, temperature=1.0, top_p=0.6)
    assert set(drawn.flatten().tolist()) == set(order[:n_nucleus].tolist())
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, top_p=0.0)


# --- the model against the plain-PyTorch reference ----------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_training_matches_reference(variant):
    """Loss of 5 AdamW steps, every gradient of the first step and the final weights, by name
    (token ids and targets are strided views). On the GPU the fp32 GEMMs run TF32, whose noise in a
    near-zero gradient Adam turns into a full-size update: there the first step's loss and
    gradients are checked (TF32 tolerance), the 5 steps and final weights by the interpreter."""
    from tritonllm.optim import AdamW

    cfg = tiny_cfg(**VARIANTS[variant])
    ours, ref64, ref32 = twins(cfg)
    # Adam turns a gradient's rounding error into up to lr / eps of weight error: eps 1e-5 bounds
    # that, and the final weights get an absolute slack of 1% of one step (lr), still far below
    # what a wrong update rule would leave.
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
    opts = [AdamW(ours.parameters(), **hp), torch.optim.AdamW(ref64.parameters(), **hp),
            torch.optim.AdamW(ref32.parameters(), **hp)]
    atol = gemm_atol(torch.float32)
    steps = 1 if ON_GPU else 5
    for step in range(steps):
        idx, targets = map(non_contiguous, random_batch(cfg, 2, 7))
        loss, losses = ours(idx, targets, return_losses=True)
        loss64, loss32 = ref64(idx, targets), ref32(idx, targets)
        assert_close(f"loss step {step}", loss, loss64, same=loss32, atol=atol)
        for t in (loss, loss64, loss32):
            t.backward()
        if step == 0:
            assert set(losses) == {"ce", "z_loss", "aux"}
            g64, g32 = dict(ref64.named_parameters()), dict(ref32.named_parameters())
            for name, p in ours.named_parameters():
                assert_close(f"grad {name}", p.grad, g64[name].grad, same=g32[name].grad, atol=atol)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    if not ON_GPU:
        p64, p32 = dict(ref64.named_parameters()), dict(ref32.named_parameters())
        for name, p in ours.named_parameters():
            assert_close(f"weight {name} after 5 steps", p, p64[name], same=p32[name], atol=1e-2 * hp["lr"])


# --- generation ----------------------------------------------------------------------------------

def test_logits_match_reference_and_kv_cache_decode():
    """Full-sequence logits against the reference; then prefill + T=1 steps against the KV cache
    give the same logits position by position (sliding window shorter than the sequence)."""
    cfg = tiny_cfg(qk_norm=True, window=3)
    ours, ref64, ref32 = twins(cfg)
    idx, _ = random_batch(cfg, 2, 7)
    with torch.no_grad():
        full = ours(idx)
        assert_close("logits", full, ref64(idx), same=ref32(idx))
        cache = KVCache(cfg, 2, 7, device=DEVICE, dtype=torch.float32)
        for buf in cache.k + cache.v:
            poison_(buf)
        # contiguous step ids: kernels/embedding.py misreads a [B, 1] column view (ids.reshape(-1) keeps its stride)
        steps = [ours(idx[:, :4].contiguous(), cache=cache)]
        steps += [ours(idx[:, t:t + 1].contiguous(), cache=cache) for t in range(4, 7)]
    assert cache.pos == 7
    assert_close("cached logits", torch.cat(steps, dim=1), full, atol=1e-5)


def test_greedy_generation_same_with_and_without_cache():
    model = build_model(tiny_cfg(), device=DEVICE)
    prompt, _ = random_batch(model.cfg, 2, 3)
    with_cache = model.generate(prompt, 4, temperature=0.0, use_cache=True)
    without = model.generate(prompt, 4, top_k=1, use_cache=False)
    assert with_cache.shape == (2, 7) and torch.equal(with_cache[:, :3], prompt)
    assert torch.equal(with_cache, without)


def test_generation_errors_name_the_argument():
    cfg = tiny_cfg()
    model = build_model(cfg, device=DEVICE)
    prompt, _ = random_batch(cfg, 1, 20)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, 5, use_cache=True)
    with pytest.raises(ValueError, match="idx"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long, device=DEVICE))


# --- GPU: bfloat16 and real sizes ----------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_bf16_step_matches_reference():
    cfg = ModelConfig(vocab_size=1000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=683,
                      max_seq_len=512, qk_norm=True, window=128, tie_embeddings=False)
    ours = build_model(cfg, device=DEVICE, dtype=torch.bfloat16)
    refs = {}
    for dtype in (torch.float64, torch.bfloat16):
        refs[dtype] = ReferenceTransformer(cfg).to(device=DEVICE, dtype=dtype)
        refs[dtype].load_state_dict(ours.state_dict())
    idx, targets = random_batch(cfg, 4, 300)
    loss = ours(idx, targets)
    loss64, loss16 = refs[torch.float64](idx, targets), refs[torch.bfloat16](idx, targets)
    assert_close("loss", loss, loss64, same=loss16, dtype=torch.bfloat16)
    for t in (loss, loss64, loss16):
        t.backward()
    g64, g16 = dict(refs[torch.float64].named_parameters()), dict(refs[torch.bfloat16].named_parameters())
    for name, p in ours.named_parameters():
        assert_close(f"grad {name}", p.grad, g64[name].grad, same=g16[name].grad)


@pytest.mark.gpu
def test_gpu_void125m_step_and_cached_decode():
    cfg = ModelConfig.from_dict(compose_model("void125m"))
    model = build_model(cfg, device=DEVICE, dtype=torch.bfloat16)
    idx, targets = random_batch(cfg, 2, 512)
    loss = model(idx, targets)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5, loss.item()
    loss.backward()
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), name
    model = model.float()
    prompt = idx[:, :100].contiguous()
    new, _ = random_batch(cfg, 2, 8)
    with torch.no_grad():
        full = model(torch.cat([prompt, new], dim=1))[:, 99:]
        cache = KVCache(cfg, 2, 108, device=DEVICE, dtype=torch.float32)
        steps = [model(prompt, cache=cache)[:, -1:]]
        steps += [model(new[:, t:t + 1].contiguous(), cache=cache) for t in range(8)]
    assert_close("cached logits", torch.cat(steps, dim=1), full, atol=1e-2)


# --- audit: no PyTorch math in the training path -------------------------------------------------

#: aten ops that only allocate, view, move or copy storage (and autograd's own bookkeeping).
STORAGE_OPS = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "zero_", "fill_", "ones_like", "full", "scalar_tensor", "lift_fresh",
    "view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "split", "split_with_sizes", "unbind",
    "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "alias", "detach", "clone", "contiguous",
    "copy_", "_to_copy", "cat", "stack", "set_", "resize_",
}
#: aten ops that make the host wait for the device to read a value (``.item()``, ``bool(t)``, ``nonzero``)
#: or a data-dependent size: a training step must make none (it would stall the CPU each step and
#: break CUDA-graph capture).
HOST_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "nonzero_static", "equal", "allclose",
                 "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "_assert_async"}
#: Tensor methods that read values on the host without reaching the dispatcher (``.tolist()``,
#: ``.numpy()``) or through it (the rest), watched by :class:`HostReads`.
HOST_READ_METHODS = ("tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """Records every call of :data:`HOST_READ_METHODS` on a tensor while the block runs."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.calls = monkeypatch, []

    def _watch(self, name):
        method = getattr(torch.Tensor, name)

        def watched(t, *args, **kwargs):
            self.calls.append((name, tuple(t.shape)))
            return method(t, *args, **kwargs)
        self.monkeypatch.setattr(torch.Tensor, name, watched)

    def __enter__(self):
        for name in HOST_READ_METHODS:
            self._watch(name)
        return self

    def __exit__(self, *exc):
        self.monkeypatch.undo()


class OpRecorder(TorchDispatchMode):
    """Records every aten op reaching the dispatcher (forward and autograd's backward) with the
    shapes of its floating-point tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        floats = [tuple(a.shape) for a in flat if isinstance(a, torch.Tensor) and a.is_floating_point()]
        self.ops.append((func.overloadpacket.__name__, floats))
        return func(*args, **(kwargs or {}))


#: the modded-nanogpt options of ModelConfig, all on
SPEEDRUN = dict(n_layers=2, window=None, window_schedule=[4, None], mlp_act="relu2", logit_softcap=15.0,
                value_embeddings=1, unet_skips=True)


@pytest.mark.parametrize("tied, options", [(False, {}), (True, {}), (True, SPEEDRUN), (False, dict(qk_norm_span="all"))],
                         ids=["untied", "tied", "tied-speedrun-options", "untied-qknorm-all"])
def test_training_step_calls_no_pytorch_math(tied, options, monkeypatch):
    """Forward + backward with every feature on. PyTorch may only allocate, view and copy storage;
    beyond that it may touch integer tensors (the embedding's token-id checks and sort), 0-d floats
    (the loss bookkeeping) and, when tied, add the shared matrix's two gradients (autograd)."""
    cfg = tiny_cfg(**{"qk_norm": True, "window": 4, "tie_embeddings": tied, "z_loss_coef": 1e-3, **options})
    model = build_model(cfg, device=DEVICE)
    idx, targets = random_batch(cfg, 2, 5)
    model.rope_tables(DEVICE)
    with OpRecorder() as rec, HostReads(monkeypatch) as reads:
        model(idx, targets).backward()
    syncs = [op for op, _ in rec.ops if op in HOST_SYNC_OPS] + reads.calls
    assert not syncs, f"the training step synchronises with the device: {syncs}"
    math_ops = [(op, shapes) for op, shapes in rec.ops
                if op not in STORAGE_OPS and any(shape != () for shape in shapes)]
    embed = (cfg.vocab_size, cfg.d_model)
    assert math_ops == ([("add", [embed, embed])] if tied else []), math_ops


def test_audit_sees_host_syncs(monkeypatch):
    """The audit above is not blind to a synchronisation: ``.item()`` and ``bool(t)`` reach the
    dispatcher as HOST_SYNC_OPS, and the embedding's id range check (``validate``: one ``.tolist()``,
    which does not) is seen by :class:`HostReads`; without the check the embedding makes none."""
    from tritonllm.kernels import embedding

    x = torch.randn(3, device=DEVICE)
    with OpRecorder() as rec:
        x.sum().item()
        bool((x > 0).any())
    assert [op for op, _ in rec.ops if op in HOST_SYNC_OPS] == ["_local_scalar_dense", "_local_scalar_dense"]
    weight = torch.randn(11, 4, device=DEVICE)
    ids = torch.randint(0, 11, (2, 3), device=DEVICE)
    with HostReads(monkeypatch) as reads:
        embedding(ids, weight, validate=True)
    assert reads.calls == [("tolist", (2,))]
    with OpRecorder() as rec, HostReads(monkeypatch) as reads:
        embedding(ids, weight, validate=False)
    assert not reads.calls and not [op for op, _ in rec.ops if op in HOST_SYNC_OPS]


@pytest.mark.gpu
def test_gpu_training_step_makes_no_host_sync():
    """CUDA's own detector: forward + backward of the model with every feature on raise at any
    synchronising call (``torch.cuda.set_sync_debug_mode("error")``)."""
    cfg = tiny_cfg(qk_norm=True, window=4, z_loss_coef=1e-3)
    model = build_model(cfg, device=DEVICE)
    idx, targets = random_batch(cfg, 2, cfg.max_seq_len)
    model(idx, targets).backward()  # first call: compiles, builds plans and rope tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(idx, targets).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
