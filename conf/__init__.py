"""Hydra configs shipped with tritonllm (train.yaml and its groups)."""
