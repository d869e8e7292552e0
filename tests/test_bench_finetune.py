"""python -m tritonllm.bench finetune: a CPU smoke run of every side's code path on a tiny model
(the interpreter's timings mean nothing); the GPU-size run is the lead's (see the module docstring)."""

import json

import pytest
import torch

from conftest import ON_GPU

pytest.importorskip("peft")

from tritonllm.bench import finetune  # noqa: E402
from tritonllm.bench.harness import git_commit  # noqa: E402
from tritonllm.errors import ConfigError  # noqa: E402


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_smoke_run_writes_a_row(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "CPU smoke")  # names train-<gpu>.json
    row = finetune.main(["--config", "tiny", "--dtype", "fp32", "--batch", "1", "--seq-len", "16", "--rank", "4",
                         "--steps", "1", "--warmup", "1", "--sides", "tritonllm,peft,patch+peft",
                         "--out", str(tmp_path)])
    written = json.loads((tmp_path / "train-cpu-smoke.json").read_text())["results"]
    assert written == [{**row, "commit": git_commit()}]  # each row records the commit it was measured at
    assert row["op"] == "finetune" and row["model"] == "tiny LoRA r4" and (row["batch"], row["seq_len"]) == (1, 16)
    for figures in (row, row["baselines"]["peft"], row["patch"]):
        assert figures["tokens_per_s"] > 0 and figures["step_ms"] > 0, figures
    assert row["speedup"] > 0 and row["patch_speedup"] > 0


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_activation_checkpointing_on_every_side(tmp_path, monkeypatch):
    """--activation-checkpointing full: tritonllm's blocks and transformers' layers recompute in the backward;
    the row names the setting (in its model name too, so that it does not replace the row without)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "CPU smoke")
    row = finetune.main(["--config", "tiny", "--dtype", "fp32", "--batch", "1", "--seq-len", "16", "--rank", "4",
                         "--steps", "1", "--warmup", "1", "--sides", "tritonllm,peft", "--activation-checkpointing",
                         "full", "--out", str(tmp_path)])
    assert row["model"] == "tiny LoRA r4 AC full" and row["activation_checkpointing"] == "full"
    assert row["tokens_per_s"] > 0 and row["baselines"]["peft"]["tokens_per_s"] > 0, row


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_fp8_base_on_tritonllm_side(tmp_path, monkeypatch):
    """--precision fp8: tritonllm's frozen base layers become FP8 ones (emulated on the CPU); the row says so."""
    from tritonllm.nn.fp8 import convert_to_fp8

    converted = []
    monkeypatch.setattr("tritonllm.nn.fp8.convert_to_fp8", lambda model, *a: converted.append(convert_to_fp8(model, *a)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "CPU smoke")
    row = finetune.main(["--config", "tiny", "--dtype", "fp32", "--batch", "1", "--seq-len", "16", "--rank", "4",
                         "--steps", "1", "--warmup", "1", "--sides", "tritonllm", "--precision", "fp8",
                         "--out", str(tmp_path)])
    assert row["model"] == "tiny LoRA r4 tritonllm fp8" and row["precision"] == "fp8" and row["tokens_per_s"] > 0
    assert converted == [8]  # 2 layers x (qkv, o, gate|up, down): every LoRA layer's frozen product


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_moe_config_adapts_attention_and_the_experts(tmp_path, monkeypatch):
    """A MoE shape: tritonllm and PEFT both adapt q, k, v, o and the routed experts (PEFT's target_parameters);
    patch + PEFT is reported as not run, saying why; --layers cuts the depth and names it in the row."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "CPU smoke")
    row = finetune.main(["--config", "tiny_moe", "--layers", "1", "--dtype", "fp32", "--batch", "1", "--seq-len", "16",
                         "--rank", "4", "--steps", "1", "--warmup", "1", "--sides", "tritonllm,peft,patch+peft",
                         "--out", str(tmp_path)])
    assert row["model"] == "tiny_moe (1 layers) LoRA r4"
    assert row["lora_targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]
    assert row["tokens_per_s"] > 0 and row["baselines"]["peft"]["tokens_per_s"] > 0, row
    assert "target_parameters" in row["patch"]["error"]
    with pytest.raises(ConfigError, match="--layers must be in"):
        finetune._parse(["--config", "tiny_moe", "--layers", "3"])


@pytest.mark.parametrize("config, billions", [("tinyllama", 1.10), ("llama3_8b", 8.03), ("qwen3_8b", 8.19),
                                              ("qwen3_30b_a3b", 30.53), ("olmoe_1b_7b", 6.92)])
def test_published_shapes(config, billions):
    """The configs are the published models' shapes: tritonllm's import of each gives its parameter count."""
    import transformers

    from tritonllm.hf import config_from_hf

    family, fields = finetune.CONFIGS[config]
    hf = getattr(transformers, finetune.FAMILIES[family][0])(**fields)
    assert round(config_from_hf(hf.to_dict(), max_seq_len=2048).param_count() / 1e9, 2) == billions


def test_bad_options_name_the_option():
    with pytest.raises(ConfigError, match=r"--sides: unknown \['nope'\]"):
        finetune._parse(["--sides", "tritonllm,nope"])
    with pytest.raises(ConfigError, match="--seq-len 128 exceeds the tiny config's max_position_embeddings"):
        finetune._parse(["--config", "tiny", "--seq-len", "128"])


def test_lora_flops_count_the_frozen_base_once_forward_once_backward():
    import transformers

    cfg = transformers.LlamaConfig(**finetune.CONFIGS["tiny"][1])
    assert finetune.lora_flops_per_token(cfg, 1000, 16) == 4 * 1000 + 12 * 2 * 2 * 32 * 16
