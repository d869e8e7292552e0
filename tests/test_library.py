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


def test_missing_extra_names_the_pip_command(monkeypatch):
    from tritonllm.logging_utils import plot_losses

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(MissingExtraError, match=r"the loss plot needs the matplotlib package.*pip install 'tritonllm\[plot\]'"):
        plot_losses("metrics.jsonl", "loss.png")
    with pytest.raises(MissingExtraError, match=r"pip install 'tritonllm\[wandb\]'"):
        import_extra("tritonllm_no_such_module", "wandb", "logger.backend=wandb")
