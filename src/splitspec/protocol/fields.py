"""Validators for the fields of a decoded frame header (sans-I/O).

Every message decoder in :mod:`splitspec.protocol` reads its header through these: each checks
the JSON type and range of one field and raises :class:`~splitspec.exceptions.MalformedFrame`
(or :class:`~splitspec.exceptions.BadTensor` for a tensor) naming the field, never ``assert``.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch

from splitspec.exceptions import BadTensor, MalformedFrame
from splitspec.protocol.frames import Frame

__all__ = ["bool_field", "choice_field", "int_field", "number_field", "str_field", "tensor_field"]

Option = TypeVar("Option", bound=str)


MAX_INT = 2**63 - 1  # largest integer any header field may hold


def int_field(
    header: dict[str, Any], key: str, *, minimum: int = 0, maximum: int = MAX_INT, optional: bool = False
) -> Any:
    """An int in [``minimum``, ``maximum``] (bools refused); None when absent and ``optional``."""
    value = header.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise MalformedFrame(f"field {key!r} must be an int in [{minimum}, {maximum}], got {value!r:.80}")
    return value


def number_field(header: dict[str, Any], key: str, *, optional: bool = False, upper: float | None = None) -> Any:
    """A finite number in [0, ``upper``] as a float (bools refused); None when absent and ``optional``."""
    value = header.get(key)
    if value is None and optional:
        return None
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
        or (upper is not None and value > upper)
    ):
        raise MalformedFrame(f"field {key!r} must be a finite number in [0, {upper}], got {value!r}")
    return float(value)


def str_field(header: dict[str, Any], key: str, *, optional: bool = False, max_len: int = 4096) -> Any:
    """A string of at most ``max_len`` characters; None when absent and ``optional``."""
    value = header.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise MalformedFrame(f"field {key!r} must be a string of <= {max_len} chars, got {value!r:.80}")
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:  # JSON can spell a lone surrogate ("\ud800"); UTF-8 cannot
            raise MalformedFrame(f"field {key!r} is not valid Unicode") from None
    return value


def choice_field(header: dict[str, Any], key: str, options: tuple[Option, ...]) -> Option:
    """One of ``options`` (short strings), typed as the option it equals."""
    value = str_field(header, key, max_len=16)
    for option in options:
        if value == option:
            return option
    raise MalformedFrame(f"{key} must be one of {options}, got {value!r}")


def bool_field(header: dict[str, Any], key: str) -> bool:
    """A JSON boolean; False when absent."""
    value = header.get(key, False)
    if not isinstance(value, bool):
        raise MalformedFrame(f"field {key!r} must be a boolean, got {value!r}")
    return value


def tensor_field(frame: Frame, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The frame's tensor ``name``, of ``dtype`` when given."""
    tensor = frame.tensors.get(name)
    if tensor is None:
        raise BadTensor(f"message lacks tensor {name!r}")
    if dtype is not None and tensor.dtype != dtype:
        raise BadTensor(f"tensor {name!r} must be {dtype}, got {tensor.dtype}")
    return tensor
