"""Range checks on a config's fields: each error names the field and the value it got."""

from __future__ import annotations


def require_positive(config: object, *names: str) -> None:
    """Every named field of ``config`` is > 0 (NaN is not); a ValueError names the first one not."""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def require_at_least(config: object, minimum: int, *names: str) -> None:
    """Every named field of ``config`` is >= ``minimum``; a ValueError names the first one not."""
    for name in names:
        value = getattr(config, name)
        if not value >= minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
