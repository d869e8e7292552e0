"""trainer.activation_checkpointing (tritonllm.nn.recompute): ``full`` recomputes each block's forward in the
backward with the same deterministic kernels, so the loss and every gradient are bitwise those of ``none``:
dense, MoE (routing recomputed), LoRA with adapter dropout (the RNG state replayed); the state dict keeps
its names; a bad setting is one ConfigError."""

import pytest
import torch

from _checks import DEVICE, ON_GPU
from test_train import TINY, compose_train, data_overrides, read_metrics  # noqa: F401 (fixture)

from tritonllm.errors import ConfigError
from tritonllm.models import ModelConfig, build_model
from tritonllm.nn.lora import LoRAConfig, apply_lora
from tritonllm.nn.recompute import apply_activation_checkpointing

DTYPE = torch.bfloat16 if ON_GPU else torch.float32


def tiny(kind: str) -> torch.nn.Module:
    moe = dict(n_experts=4, moe_top_k=2, d_expert=32, n_shared_experts=1) if kind == "moe" else {}
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="t", vocab_size=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=96,
                                    max_seq_len=32, tie_embeddings=False, **moe), device=torch.device(DEVICE),
                        dtype=DTYPE)
    if kind == "lora":
        model = apply_lora(model, LoRAConfig(rank=4, alpha=8.0, dropout=0.25))
        with torch.no_grad():  # nonzero adapters, so their gradients flow through the recomputed blocks
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


def loss_and_grads(model, idx, seed: int = 1):
    torch.manual_seed(seed)  # the LoRA dropout's masks
    loss = model(idx, idx)
    loss = loss[0] if isinstance(loss, tuple) else loss
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in params])
    return loss.detach(), dict(zip((n for n, _ in params), grads))


@pytest.mark.parametrize("kind", ["dense", "moe", "lora"])
def test_full_gives_the_loss_and_gradients_of_none(kind):
    idx = torch.randint(0, 64, (2, 32), device=DEVICE)
    ref_model, model = tiny(kind), tiny(kind)
    model.load_state_dict(ref_model.state_dict())
    keys = list(model.state_dict())
    assert apply_activation_checkpointing(model, "full") == 2
    assert list(model.state_dict()) == keys
    ref_loss, ref_grads = loss_and_grads(ref_model, idx)
    loss, grads = loss_and_grads(model, idx)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


def test_none_and_bad_settings():
    model = tiny("dense")
    assert apply_activation_checkpointing(model, "none") == 0
    with pytest.raises(ConfigError, match="trainer.activation_checkpointing"):
        apply_activation_checkpointing(model, "selectiv")
    with pytest.raises(ConfigError, match="has no blocks"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")


def test_training_with_full_checkpointing_matches_none(tmp_path, data_overrides):  # noqa: F811
    """The trainer's setting end to end: the same losses as a run without it (one block recomputed per step)."""
    from tritonllm.train import train

    losses = {}
    for mode in ("none", "full"):
        out = tmp_path / mode
        train(compose_train(*TINY, *data_overrides, f"trainer.activation_checkpointing={mode}", f"out_dir={out}"))
        losses[mode] = [r["loss"] for r in read_metrics(str(out), "train")]
    assert losses["full"] == losses["none"] and len(losses["none"]) == 4
