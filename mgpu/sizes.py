"""One vocabulary for sizes: bytes (int), a fraction of device memory (float) or "40GB"."""

from __future__ import annotations

from dask.utils import format_bytes, parse_bytes

__all__ = ["format_bytes", "parse_size", "resolve_size"]

Size = int | float | str


def parse_size(value: Size, *, key: str) -> int | float:
    """Validate a size and normalise it to bytes (int) or a fraction (float in (0, 1]).

    Parameters
    ----------
    value
        ``4096`` (bytes), ``0.8`` (fraction of the device's memory) or ``"40GB"``.
    key
        The job key the value came from, named in the error.

    Raises
    ------
    ValueError
        If the value is none of those forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected bytes, a fraction or a size like '40GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{key}: a size in bytes must be positive, got {value}")
        return value
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{key}: a fraction of device memory must be in (0, 1], got {value}")
        return value
    if isinstance(value, str):
        try:
            nbytes = parse_bytes(value)
        except (ValueError, TypeError):
            raise ValueError(
                f"{key}: {value!r} is not a size; use bytes (4096), a fraction (0.8) "
                "or a string like '40GB' or '512MiB'"
            ) from None
        if nbytes <= 0:
            raise ValueError(f"{key}: a size must be positive, got {value!r}")
        return nbytes
    raise ValueError(f"{key}: expected bytes, a fraction or a size like '40GB', got {value!r}")


def resolve_size(size: int | float, total: int) -> int:
    """Turn a parsed size into bytes against a device of ``total`` bytes."""
    return int(size * total) if isinstance(size, float) else int(size)
