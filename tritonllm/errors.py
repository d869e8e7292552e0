"""User-facing errors of the framework.

Everything a user can get wrong before or during a run (a config key, a data path, a token shard,
a checkpoint, a run whose loss keeps diverging) raises a :class:`TritonLLMError` whose message
names the path or key involved. ``python -m tritonllm.train`` / ``tritonllm.generate`` print that
message alone, without a traceback.
"""


class TritonLLMError(Exception):
    """Base class: a problem with the user's config, data or files, not a bug in tritonllm."""


class ConfigError(TritonLLMError):
    """A missing, unknown or inconsistent configuration value."""


class DataError(TritonLLMError):
    """A missing, unreadable or malformed data file."""


class CheckpointError(TritonLLMError):
    """A missing, unreadable or incompatible checkpoint."""


class TrainingError(TritonLLMError):
    """Training cannot go on (for example, too many non-finite losses in a row)."""
