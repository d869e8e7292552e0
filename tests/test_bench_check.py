"""The kernel benchmark's correctness check (harness.check_case): ours' forward against the case's
float64 reference from tritonllm.bench.reference_ops, PyTorch in the case's dtype as the yardstick; and how
write_results merges new rows into a results file."""

import json

import torch

from _checks import DEVICE, randn
from tritonllm.bench import reference_ops as ref
from tritonllm.bench import harness
from tritonllm.bench.harness import Case, check_case
from tritonllm.kernels import rms_norm, rope, rope_cos_sin


def _rms_norm_case(ours, reference=lambda x, w: ref.rms_norm(x, w, 1e-6)):
    return Case("rms_norm", "5x123", torch.float32, lambda: (randn(5, 123), randn(123, scale=0.5).add(1.0)),
                ours=ours, reference=reference)


def test_check_case_passes_the_kernel_and_fails_a_wrong_one():
    good = check_case(_rms_norm_case(lambda x, w: rms_norm(x, w, 1e-6)))
    assert good["correct"] and good["max_err"] < 1e-5 and good["reference_max_err"] < 1e-5
    bad = check_case(_rms_norm_case(lambda x, w: rms_norm(x, w * 1.01, 1e-6)))
    assert not bad["correct"] and bad["max_err"] > 5e-3
    assert check_case(_rms_norm_case(lambda x, w: rms_norm(x, w, 1e-6), reference=None)) == {}


def test_check_case_on_ours_inputs():
    """A case whose ours takes other inputs than the baselines (rope on a packed q|k view) is checked
    on ours' inputs."""
    cos, sin = rope_cos_sin(7, 32, device=DEVICE)

    def packed(inputs):
        q, k = inputs[:2]
        return torch.cat((q, k), dim=2), cos, sin

    case = Case("rope", "B2 T7", torch.float32, lambda: (randn(2, 7, 4, 32), randn(2, 7, 2, 32)),
                ours=lambda qk, c, s: rope(qk, c, s), ours_inputs=packed, reference=ref.rope)
    out = check_case(case)
    assert out["correct"] and out["max_err"] < 1e-5


def test_sdpa_backend_is_named_from_its_kernels():
    from tritonllm.bench.ops_attention import sdpa_backend

    assert sdpa_backend(["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128", "Memset"]) == \
        "FlashAttention-2"
    assert sdpa_backend(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]) == "cuDNN"
    assert sdpa_backend(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention"]) == "memory-efficient"
    assert sdpa_backend(["ampere_bf16_s16816gemm_bf16_128x64", "softmax_warp_forward"]) == "math"


def test_write_results_replaces_only_rows_of_the_same_run(tmp_path, monkeypatch):
    """A one-GPU training row replaces the model's earlier one-GPU row and leaves its FSDP and DDP rows, and
    the kernel rows of other shapes, alone."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(harness, "git_commit", lambda: "abc1234")
    old = [{"model": "void1b", "batch": 16, "seq_len": 1024, "nproc": 1, "parallel": "none", "step_ms": 9.0},
           {"model": "void1b", "batch": 4, "seq_len": 2048, "nproc": 4, "parallel": "fsdp", "step_ms": 5.0},
           {"model": "void1b", "batch": 4, "seq_len": 2048, "nproc": 2, "parallel": "ddp", "step_ms": 6.0},
           {"op": "linear", "shape": "8x8x8", "dtype": "bf16", "pass": "fwd", "ms": 1.0}]
    (tmp_path / "train-h100.json").write_text(json.dumps({"results": old}))
    new = {"model": "void1b", "batch": 16, "seq_len": 1024, "nproc": 1, "parallel": "none", "step_ms": 8.0}
    path = harness.write_results("train", [new], str(tmp_path))
    rows = json.load(open(path))["results"]
    assert [r["step_ms"] for r in rows if "model" in r] == [5.0, 6.0, 8.0]
    assert rows[-1]["commit"] == "abc1234" and any(r.get("op") == "linear" for r in rows)


def test_git_commit_from_the_environment(monkeypatch):
    """Results name the commit they are of: TRITONLLM_COMMIT when set (a tree copied to a GPU machine with
    stale git metadata would otherwise read as an old commit, "-dirty"), else git's answer."""
    monkeypatch.setenv("TRITONLLM_COMMIT", "c0ffee1")
    assert harness.git_commit() == "c0ffee1"
    monkeypatch.delenv("TRITONLLM_COMMIT")
    assert harness.git_commit() != "c0ffee1" and harness.git_commit()
