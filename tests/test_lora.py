"""LoRA: the kernels (tritonllm.kernels.lora) against a float64 reference, and the adapters applied
to an imported Hugging Face model (tritonllm.nn.lora) against PEFT."""

import pytest
import torch

from _checks import DEVICE, DTYPES, assert_close, dtype_id, gemm_atol, randn
from tritonllm.kernels import lora as lora_module
from tritonllm.kernels.lora import dropout, lora_linear

# (M, K, N, segments, rank): odd widths, one row, one adapter or three, a segment in the middle
CASES = [
    pytest.param(17, 40, 72, [(0, 32), (32, 20), (52, 20)], 4, id="M17_qkv_r4"),
    pytest.param(1, 33, 50, [(10, 25)], 3, id="M1_middle_r3"),
    pytest.param(64, 64, 96, [(0, 48), (48, 48)], 8, id="M64_gateup_r8"),
]


def reference(x, w, bias, a, b, segments, scale, mask=None, p=0.0):
    """float64 y = x W^T + bias + scale * (x*mask/(1-p)) A_j^T B_j^T on each segment."""
    x64, w64, a64, b64 = (t.double() for t in (x, w, a, b))
    y = x64 @ w64.t() + (0 if bias is None else bias.double())
    xd = x64 if mask is None else x64 * mask.double() / (1 - p)
    row = 0
    parts = [y]
    for j, (start, size) in enumerate(segments):
        delta = torch.zeros_like(y)
        delta[..., start:start + size] = scale * (xd @ a64[j].t()) @ b64[row:row + size].t()
        parts.append(delta)
        row += size
    return sum(parts)


def _inputs(M, K, N, segments, rank, dtype, bias=True):
    x = randn(M, K, dtype=dtype, requires_grad=True)
    w = randn(N, K, dtype=dtype, scale=K ** -0.5)
    bvec = randn(N, dtype=dtype) if bias else None
    a = randn(len(segments), rank, K, dtype=dtype, scale=K ** -0.5, requires_grad=True)
    b = randn(sum(s for _, s in segments), rank, dtype=dtype, requires_grad=True)
    return x, w, bvec, a, b


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("M,K,N,segments,rank", CASES)
def test_lora_linear_matches_reference(M, K, N, segments, rank, dtype):
    x, w, bias, a, b = _inputs(M, K, N, segments, rank, dtype)
    scale = 2.5
    y = lora_linear(x, w, bias, a, b, segments, scale)
    dy = randn(M, N, dtype=dtype)
    dx, da, db = torch.autograd.grad(y, [x, a, b], dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, a, b)]
    ref = reference(leaves[0], w, bias, leaves[1], leaves[2], segments, scale)
    refs = torch.autograd.grad(ref, leaves, dy.double())
    # PyTorch in the same dtype: the rounding yardstick of the tolerance rule
    same = (x @ w.t() + bias).detach()
    row = 0
    for j, (start, n) in enumerate(segments):
        same[:, start:start + n] += scale * (x.detach() @ a[j].detach().t()) @ b[row:row + n].detach().t()
        row += n
    atol = gemm_atol(dtype, chain=2)
    assert_close("y", y, ref, same=same, atol=atol, dtype=dtype)
    for name, got, want in zip(("dx", "dA", "dB"), (dx, da, db), refs):
        assert_close(name, got, want, atol=atol, dtype=dtype)


def test_lora_linear_frozen_base_gets_no_grad_and_weight_grad_when_asked():
    x, w, bias, a, b = _inputs(5, 16, 24, [(0, 24)], 2, torch.float32)
    y = lora_linear(x, w, bias, a, b, [(0, 24)], 1.0)
    y.sum().backward()
    assert w.grad is None and a.grad is not None and b.grad is not None
    w.requires_grad_(True)
    bias.requires_grad_(True)
    y = lora_linear(x, w, bias, a, b, [(0, 24)], 1.0)
    dy = randn(5, 24)
    dw, dbias = torch.autograd.grad(y, [w, bias], dy)
    assert_close("dW", dw, dy.double().t() @ x.detach().double(), atol=gemm_atol(torch.float32))
    assert_close("dbias", dbias, dy.double().sum(0))


def test_lora_linear_no_grad_path_and_leading_dims():
    x, w, bias, a, b = _inputs(6, 16, 24, [(4, 8)], 2, torch.float32)
    with torch.no_grad():
        y = lora_linear(x.view(2, 3, 16), w, bias, a, b, [(4, 8)], 0.5)
    assert y.shape == (2, 3, 24)
    assert_close("y", y.view(6, 24), reference(x.detach(), w, bias, a.detach(), b.detach(), [(4, 8)], 0.5),
                 atol=gemm_atol(torch.float32, chain=2))


def test_dropout_mask_reproducible_and_gradients():
    M, K, N, segments, rank, p = 9, 40, 30, [(0, 30)], 4, 0.4
    x, w, bias, a, b = _inputs(M, K, N, segments, rank, torch.float32)
    seed = torch.tensor([1234], dtype=torch.int64, device=DEVICE)
    mask = dropout(torch.ones(M, K, device=DEVICE), p, seed) != 0
    assert torch.equal(mask, dropout(torch.ones(M, K, device=DEVICE), p, seed) != 0)
    assert 0.2 < 1 - mask.double().mean().item() < 0.6  # about p of 360 elements dropped
    other = dropout(torch.ones(M, K, device=DEVICE), p, torch.tensor([99], dtype=torch.int64, device=DEVICE)) != 0
    assert not torch.equal(mask, other)
    y = lora_linear(x, w, bias, a, b, segments, 2.0, dropout_p=p, seed=seed)
    dy = randn(M, N)
    grads = torch.autograd.grad(y, [x, a, b], dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, a, b)]
    ref = reference(leaves[0], w, bias, leaves[1], leaves[2], segments, 2.0, mask=mask, p=p)
    refs = torch.autograd.grad(ref, leaves, dy.double())
    assert_close("y", y, ref, atol=gemm_atol(torch.float32, chain=2))
    for name, got, want in zip(("dx", "dA", "dB"), grads, refs):
        assert_close(name, got, want, atol=gemm_atol(torch.float32, chain=2))


@pytest.mark.parametrize("budget_kib", [227, 99])
def test_lora_down_pipeline_fits_shared_memory(monkeypatch, budget_kib):
    """lora_down's fixed tiles pipeline as many K stages as fit the device's shared memory: fp32 at the
    widest output (R = 256) needs 240 KiB in 3 stages, more than an H100 has (227 KiB)."""
    monkeypatch.setattr(lora_module, "smem_budget", lambda reserve: budget_kib * 1024 - reserve)
    budget = budget_kib * 1024 - lora_module.SMEM_RESERVE
    for block_m, block_r in ((128, 16), (128, 128), (64, 256)):
        for element_size in (2, 4):
            stages = lora_module.lora_down_stages(block_m, 64, block_r, element_size)
            assert 1 <= stages <= 3 and stages * (block_m + block_r) * 64 * element_size <= budget
    assert lora_module.lora_down_stages(128, 64, 128, 2) == (3 if budget_kib == 227 else 2)
    assert lora_module.lora_down_stages(64, 64, 256, 4) == (2 if budget_kib == 227 else 1)


@pytest.mark.parametrize("change,match", [
    (dict(segments=[(0, 30)]), "segments"),
    (dict(segments=[(0, 8), (8, 8)]), "lora_a"),
    (dict(b_rows=7), "lora_b"),
    (dict(p=1.0), "dropout"),
    (dict(p=0.5), "seed"),
    (dict(a_dtype=torch.float16), "dtype"),
], ids=["segment_out_of_range", "adapter_count", "b_rows", "p1", "no_seed", "dtype"])
def test_lora_linear_bad_inputs(change, match):
    x, w, bias, a, b = _inputs(4, 16, 24, [(0, 24)], 2, torch.float32)
    segments = change.get("segments", [(0, 24)])
    if "b_rows" in change:
        b = randn(change["b_rows"], 2)
    if "a_dtype" in change:
        a = a.detach().to(change["a_dtype"])
    with pytest.raises((ValueError, TypeError), match=match):
        lora_linear(x, w, bias, a, b, segments, 1.0, dropout_p=change.get("p", 0.0))


# ---- adapters on an imported model, against PEFT ------------------------------------------------

import peft  # noqa: E402  (test dependencies: pyproject [test])
import transformers  # noqa: E402

from tritonllm.hf import load_hf_model, save_hf_model  # noqa: E402
from tritonllm.nn.lora import LoRAConfig, LoRALinear, apply_lora, load_adapter, merged_state_dict, save_adapter  # noqa: E402


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    torch.manual_seed(5)
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                   max_position_embeddings=64)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return str(path)


#: our fp32 model (TF32 GEMMs on a GPU) against transformers / PEFT in fp32 on the CPU: the slack of a
#: few chained products on a GPU, 1e-5 on the CPU
HF_ATOL = gemm_atol(torch.float32, chain=4) or 1e-5


def _adapted(path, targets=("q", "k", "v", "o", "gate", "up", "down")):
    model = apply_lora(load_hf_model(path, device=DEVICE), LoRAConfig(rank=4, alpha=8.0, targets=list(targets)))
    return model


def _ids(seed=0):
    """Token ids on the CPU (the transformers references run there); ``.to(DEVICE)`` for our model."""
    return torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(seed))


def test_zero_b_equals_base_and_only_adapters_train(qwen2_folder):
    base = load_hf_model(qwen2_folder, device=DEVICE)
    model = _adapted(qwen2_folder)
    idx = _ids().to(DEVICE)
    with torch.no_grad():
        assert_close("logits", model(idx), base(idx).double(), atol=1e-6)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in trainable)
    from tritonllm.train.loop import build_optimizer
    from omegaconf import OmegaConf

    opt = build_optimizer(model, OmegaConf.create(dict(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)),
                          master_weights=False)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in model.parameters() if p.requires_grad}


def _perturb(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)


def test_adapters_match_peft_logits_and_grads(qwen2_folder, tmp_path):
    model = _adapted(qwen2_folder, targets=("q", "v", "o", "up", "down"))
    _perturb(model)
    save_adapter(model, str(tmp_path), base_model=qwen2_folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen2_folder)
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path), is_trainable=True)
    idx, tgt = _ids(1), _ids(2)
    loss = model(idx.to(DEVICE), tgt.to(DEVICE))
    loss.backward()
    ref = torch.nn.functional.cross_entropy(pm(idx).logits.reshape(-1, 96), tgt.reshape(-1))
    ref.backward()
    assert abs(loss.item() - ref.item()) < HF_ATOL
    grads = {n: p.grad for n, p in pm.named_parameters() if p.grad is not None}
    attn = model.blocks[0].attn.qkv  # segments q (rows 0..63), v (rows 64..95)
    pre = "base_model.model.model.layers.0."
    for name, got, want in (("dA_q", attn.lora_A.grad[0], "self_attn.q_proj.lora_A"),
                            ("dB_v", attn.lora_B.grad[64:], "self_attn.v_proj.lora_B"),
                            ("dB_down", model.blocks[0].mlp.w2.lora_B.grad, "mlp.down_proj.lora_B")):
        assert_close(name, got.cpu(), grads[pre + want + ".default.weight"].double(), atol=gemm_atol(torch.float32, 4))


def test_adapter_reload_and_merged_export(qwen2_folder, tmp_path):
    model = _adapted(qwen2_folder)
    _perturb(model)
    idx = _ids(3).to(DEVICE)
    with torch.no_grad():
        want = model(idx)
    save_adapter(model, str(tmp_path / "adapter"))
    again = load_adapter(load_hf_model(qwen2_folder, device=DEVICE), str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(again(idx), want)
    assert not any(k.endswith(("lora_A", "lora_B")) for k in merged_state_dict(model))
    save_hf_model(model, str(tmp_path / "merged"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert_close("merged logits", hf(idx.cpu()).logits, want.double().cpu(), atol=HF_ATOL)


def test_lora_config_errors():
    from tritonllm.errors import ConfigError

    for bad, match in ((dict(rank=0), "rank"), (dict(targets=["qkv"]), "targets"), (dict(dropout=1.0), "dropout"),
                       (dict(alpha=-1), "alpha")):
        with pytest.raises(ConfigError, match=match):
            LoRAConfig(**bad)
    with pytest.raises(ConfigError, match="unknown lora"):
        LoRAConfig.from_dict({"rank": 4, "scaling": 2})


def test_moe_model_adapters_train_merge_and_refuse_peft_export(tmp_path):
    """A MoE model (routed + shared experts): q, the shared expert's gate and down, and the routed experts
    adapted; the model equals the base until B moves, only adapters train, each gets a gradient, and the
    merged state dict in a plain model gives the adapted model's logits. The PEFT adapter writer refuses
    what it cannot name; ``experts`` on a dense model is refused."""
    import copy

    from tritonllm.errors import ConfigError
    from tritonllm.models import ModelConfig, build_model
    from tritonllm.nn.lora import LoRAMoE

    cfg = ModelConfig(name="moe_t", vocab_size=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=48,
                      max_seq_len=16, n_experts=4, moe_top_k=2, d_expert=24, n_shared_experts=1)
    base = build_model(cfg, device=torch.device(DEVICE), dtype=torch.float32)
    model = apply_lora(copy.deepcopy(base), LoRAConfig(rank=4, alpha=8.0, targets=["q", "gate", "down", "experts"]))
    idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        assert_close("logits at B = 0", model(idx), base(idx).double(), atol=gemm_atol(torch.float32, chain=4) or 1e-5)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(n.rsplit(".", 1)[-1].startswith("lora_") for n in trainable)
    assert all(isinstance(b.mlp, LoRAMoE) and isinstance(b.mlp.shared_w13, LoRALinear) for b in model.blocks)
    _perturb(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("lora_B13", "lora_B2")):
                p.normal_(0, 0.1)
    model(idx, idx).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
    plain = build_model(cfg, device=torch.device(DEVICE), dtype=torch.float32)
    plain.load_state_dict(merged_state_dict(model))
    with torch.no_grad():
        assert_close("merged logits", plain(idx), model(idx).double(), atol=gemm_atol(torch.float32, chain=4) or 1e-5)
    with pytest.raises(ConfigError, match="MoE model"):
        save_adapter(model, str(tmp_path))
    dense = build_model(ModelConfig(name="dense_t", vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1,
                                    d_ff=48, max_seq_len=16), device=torch.device(DEVICE), dtype=torch.float32)
    with pytest.raises(ConfigError, match="routed experts"):
        apply_lora(dense, LoRAConfig(targets=["experts"]))
    with pytest.raises(ConfigError, match="lora.dropout=0.1: the routed experts"):
        apply_lora(build_model(cfg, device=torch.device(DEVICE), dtype=torch.float32),
                   LoRAConfig(targets=["q", "experts"], dropout=0.1))
