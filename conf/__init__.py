"""Hydra configs shipped with tritonllm (train.yaml and its groups); importing this package registers
the groups' typed schemas (:mod:`.schema`) in Hydra's ConfigStore."""

from . import schema

schema.register()
