"""The machinery of the kernels' settings objects (:class:`gemm_settings.GemmSettings`,
:class:`flash_attention.settings.AttentionSettings`): each is a frozen dataclass of the choices a user
may make, one instance of it in force at a time, changed only through its module's ``configure_*``
function (which returns the settings before the change). An instance used as a context manager puts
itself back in force when the block ends, so ``with configure_gemm(...):`` changes the settings for
the block only."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

S = TypeVar("S", bound="Settings")

_IN_FORCE: dict[type, Any] = {}


class Settings:
    """Base of the settings dataclasses (``@dataclass(frozen=True)`` subclasses)."""

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc) -> None:
        _IN_FORCE[type(self)] = self

    def updated(self: S, **fields) -> S:
        """These settings with ``fields`` replaced (a subclass may merge a field with its old value)."""
        return dataclasses.replace(self, **fields)  # type: ignore[type-var]


def in_force(cls: type[S]) -> S:
    """The ``cls`` settings in force (the defaults until first changed)."""
    settings = _IN_FORCE.get(cls)
    if settings is None:
        settings = _IN_FORCE[cls] = cls()
    return settings


def configure(cls: type[S], settings: S | None, fields: dict, caller: str) -> S:
    """Put ``settings`` (None: those in force) with ``fields`` changed in force for ``cls``; return the
    settings before. An unknown field, or settings of another class, is refused naming ``caller``."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(fields) - names)
    if unknown:
        raise TypeError(f"{caller}: unknown setting(s) {', '.join(unknown)}; expected some of {', '.join(sorted(names))}")
    if settings is not None and not isinstance(settings, cls):
        raise TypeError(f"{caller}: settings must be a {cls.__name__}, got {type(settings).__name__}")
    previous = in_force(cls)
    _IN_FORCE[cls] = (previous if settings is None else settings).updated(**fields)
    return previous
