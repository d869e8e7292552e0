"""Config nodes as plain Python, for the modules of every layer that take a config section (a model's,
LoRA's) either from Hydra (an OmegaConf node) or as a plain dict."""

from __future__ import annotations


def plain_container(value):
    """An OmegaConf container as plain Python (resolved); anything else unchanged."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value
