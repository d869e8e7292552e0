"""tritonllm as a library: what importing it does to the process, and the optional extras."""

import os
import subprocess
import sys

import pytest

from tritonllm.errors import MissingExtraError, import_extra

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env_after_import(env: dict, first: str = "") -> str:
    """``TRITON_INTERPRET`` as a fresh interpreter sees it after ``first`` and importing the kernels."""
    code = f"{first}\nimport os, tritonllm.kernels\nprint(os.environ.get('TRITON_INTERPRET', '<unset>'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("explicit", ["0", "1"])
def test_import_honours_an_explicit_interpreter_choice(explicit):
    assert _env_after_import({**os.environ, "TRITON_INTERPRET": explicit}) == explicit


def test_import_leaves_environment_alone_once_triton_is_imported():
    """Triton imported first has fixed its mode: importing tritonllm's kernels changes nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert _env_after_import(env, first="import triton") == "<unset>"


def test_the_folder_imported_as_kernels_is_the_package_not_a_second_copy():
    """From the repository root ``import kernels`` finds the kernels/ folder (transformers' probe for the
    Hugging Face ``kernels`` package does that). It must be tritonllm.kernels itself: a second copy would
    register the custom ops again and free the first copy's, crashing torch.compile later."""
    code = ("import sys, torch, kernels, kernels.custom_op, tritonllm.kernels as k\n"
            "x = torch.randn(3, 8)\n"
            "y = torch.ops.tritonllm.rms_norm_fwd(x, torch.ones(8), 1e-6, None)[0]\n"
            "copies = [m for m, mod in sys.modules.items() if m.startswith('kernels')"
            " and mod is not sys.modules['tritonllm' + '.' + m]]\n"
            "print(kernels is k, kernels.custom_op is k.custom_op, copies,"
            " torch.allclose(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "[]", "True"], out.stdout + out.stderr


def test_missing_extra_names_the_pip_command(monkeypatch):
    from tritonllm.logging_utils import plot_losses

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(MissingExtraError, match=r"the loss plot needs the matplotlib package.*pip install 'tritonllm\[plot\]'"):
        plot_losses("metrics.jsonl", "loss.png")
    with pytest.raises(MissingExtraError, match=r"pip install 'tritonllm\[wandb\]'"):
        import_extra("tritonllm_no_such_module", "wandb", "logger.backend=wandb")
