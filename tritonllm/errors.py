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


class MissingExtraError(TritonLLMError):
    """An optional package a chosen feature needs is not installed; the message gives the pip command."""


def import_extra(module: str, extra: str, feature: str):
    """``importlib.import_module(module)``, or a :class:`MissingExtraError` naming ``feature``, the
    package and the command that installs tritonllm's optional ``extra`` (``pip install 'tritonllm[extra]'``)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"{feature} needs the {module.split('.')[0]} package, which is not installed: "
                                f"pip install 'tritonllm[{extra}]'") from e
