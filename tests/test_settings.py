"""The kernels' settings objects and their one way of change: ``configure_gemm`` / ``configure_attention``
return the settings before, restore them at the end of a ``with`` block, refuse unknown or mistyped
settings by name; the attention settings change per kernel and cannot be changed in place; a GEMM problem
is planned again under other settings."""

import importlib

import pytest
import torch

from _checks import DEVICE, randn
from tritonllm.kernels import (AttentionSettings, GemmSettings, attention_settings, configure_attention,
                               configure_gemm, gemm_settings)


def test_configure_gemm_returns_the_settings_before_and_restores_them(kernel_settings):
    before = gemm_settings()
    assert before == GemmSettings()  # the measured defaults, nothing changed them
    with configure_gemm(persistent=False, sm_margin=4) as previous:
        assert previous is before
        assert (gemm_settings().persistent, gemm_settings().sm_margin) == (False, 4)
        assert gemm_settings().flatten is before.flatten  # the others kept
        configure_gemm(dynamic=True)
    assert gemm_settings() is before
    configure_gemm(GemmSettings(tma_store=False), dynamic=True)  # whole settings, then a change on them
    assert gemm_settings() == GemmSettings(tma_store=False, dynamic=True)


def test_configure_gemm_refuses_bad_settings(kernel_settings):
    before = gemm_settings()
    with pytest.raises(TypeError, match="configure_gemm: unknown setting.*persistant"):
        configure_gemm(persistant=False)
    with pytest.raises(TypeError, match="GemmSettings.dynamic must be a bool"):
        configure_gemm(dynamic=1)
    with pytest.raises(ValueError, match="sm_margin"):
        configure_gemm(sm_margin=-1)
    with pytest.raises(TypeError, match="must be a GemmSettings"):
        configure_gemm(AttentionSettings())
    assert gemm_settings() is before


def test_a_gemm_problem_is_planned_again_under_other_settings(kernel_settings):
    """The settings are part of the launch plans' key: two plans for one problem, the same result."""
    gemm_module = importlib.import_module("tritonllm.kernels.gemm")
    a, b = randn(40, 24), randn(24, 32)
    gemm_module._LAUNCH_CONFIGS.clear()
    first = gemm_module.gemm(a, b, torch.empty(40, 32, device=DEVICE), allow_tf32=False)
    configure_gemm(persistent=False)
    second = gemm_module.gemm(a, b, torch.empty(40, 32, device=DEVICE), allow_tf32=False)
    assert len(gemm_module._LAUNCH_CONFIGS) == 2
    assert torch.equal(first, second)


def test_configure_attention_changes_only_the_kernels_named(kernel_settings):
    before = attention_settings()
    with configure_attention(one_loop={"dq": {"window": False}}, sm90_bwd={"dq": ()}):
        now = attention_settings()
        assert now.one_loop["dq"] == {"causal": True, "window": False}
        assert now.one_loop["fwd"] == before.one_loop["fwd"]
        assert now.sm90_bwd == {"dkdv": before.sm90_bwd["dkdv"], "dq": ()}
    assert attention_settings() is before
    with pytest.raises(TypeError):
        attention_settings().tma["fwd"] = False  # type: ignore[index]  (a read-only view)
    with pytest.raises(ValueError, match="tma: unknown kernel"):
        configure_attention(tma={"bwd": False})
    with pytest.raises(ValueError, match=r"one_loop\['fwd'\]"):
        configure_attention(one_loop={"fwd": {"sliding": True}})
    with pytest.raises(TypeError, match="configure_attention: unknown setting"):
        configure_attention(sm90_forward=())
    assert attention_settings() is before
