"""python -m tritonllm.generate context=N (tritonllm.generate.extend_context): a model trained over L positions
attends over N > L with its RoPE stretched (YaRN, NTK, linear): the tables are rope_cos_sin's at the new length
and scaling, the weights are untouched, and greedy decoding from the KV cache past L equals decoding by full
forwards at the new length."""

import pytest
import torch

from _checks import DEVICE

from tritonllm.errors import ConfigError
from tritonllm.generate import extend_context
from tritonllm.kernels import rope_cos_sin
from tritonllm.models import ModelConfig, build_model


def tiny(**kw):
    torch.manual_seed(0)
    return build_model(ModelConfig(name="t", vocab_size=64, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=96,
                                   max_seq_len=32, **kw), device=torch.device(DEVICE), dtype=torch.float32)


@pytest.mark.parametrize("scaling", ["yarn", "ntk", "linear"])
def test_generates_past_the_trained_context(scaling):
    model = tiny()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model.rope_tables(DEVICE)  # the trained length's tables, cached: extending must replace them
    extend_context(model, 128, scaling)
    cfg = model.cfg
    assert cfg.max_seq_len == 128 and cfg.rope_scaling["type"] == scaling and cfg.rope_scaling["factor"] == 4.0
    assert cfg.rope_scaling.get("original_max_position") == (32 if scaling == "yarn" else None)
    cos, sin = model.rope_tables(DEVICE)
    ref = rope_cos_sin(128, cfg.head_size, theta=cfg.rope_theta, scaling=cfg.rope_scaling, device=DEVICE)
    assert torch.equal(cos, ref[0]) and torch.equal(sin, ref[1])
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    idx = torch.randint(0, 64, (1, 28), device=DEVICE)  # 28 + 8 positions: past the trained 32
    cached = model.generate(idx, 8, temperature=0.0, use_cache=True, cuda_graph=False)
    full = model.generate(idx, 8, temperature=0.0, use_cache=False, cuda_graph=False)
    assert cached.shape == (1, 36) and torch.equal(cached, full)


def test_within_the_context_nothing_changes_and_bad_requests_are_refused():
    model = tiny()
    cfg = model.cfg
    extend_context(model, 32)
    assert model.cfg is cfg
    with pytest.raises(ConfigError, match="rope_scaling must be one of"):
        extend_context(model, 64, "dynamic")
    scaled = tiny(rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match="already scaled"):
        extend_context(scaled, 64)
