"""Key values from text typed by people (the key lookup of ``icestate ui``, ``icestate key``),
one per key column.

A key column has one of the key types (``statestore.keygroups.check_key_type``): string,
binary, bool, integers, date or timestamp. The text becomes a Python value of exactly that
type, never a converted look-alike (``1.0`` for a long, ``True`` for an int), since state is
found by the key's own value; text that is not one is refused with what the column wants.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

_TRUE, _FALSE = ("true", "t", "yes", "1"), ("false", "f", "no", "0")


class KeyTextError(ValueError):
    """Typed text that is not a value of its key column's type."""


def parse_key(schema: pa.Schema, texts: Sequence[str]) -> dict[str, Any]:
    """The key ``{column: value}`` the texts of the form spell, one text per column of ``schema``.

    Raises:
        KeyTextError: a text is not a value of its column's type (the message says which
            column, what was typed and an example of what it takes).
    """
    if len(texts) != len(schema):
        raise KeyTextError(f"a key has {len(schema)} column(s), {schema.names}; {len(texts)} value(s) were given")
    return {f.name: parse_value(f, text) for f, text in zip(schema, texts, strict=True)}


def parse_value(field: pa.Field, text: str) -> Any:
    """The value of key column ``field`` that ``text`` spells (``parse_key``)."""
    parse = _parser(field.type)
    if parse is None:
        raise KeyTextError(f"key column {field.name!r} is of type {field.type}, which cannot be typed in the "
                           "browser; look the key up with the SQL box instead")
    try:
        value = parse(text)
        pa.array([value], field.type)  # out of the type's range (an int8 of 300, a date of year 0)
    except (ValueError, TypeError, OverflowError, pa.ArrowInvalid) as e:
        raise KeyTextError(f"key column {field.name!r} is {field.type}: {text!r} is not one ({e}); "
                           f"type it like {example(field.type)}") from None
    return value


def example(dtype: pa.DataType) -> str:
    """How a value of key type ``dtype`` is typed (the form's placeholder)."""
    if pa.types.is_boolean(dtype):
        return "true or false"
    if pa.types.is_integer(dtype):
        return "42"
    if pa.types.is_date(dtype):
        return "2024-05-01"
    if pa.types.is_timestamp(dtype):
        return "2024-05-01T12:30:00 (UTC unless an offset is given)" if dtype.tz else "2024-05-01T12:30:00"
    if _is_binary(dtype):
        return "text (its UTF-8 bytes)"
    return "text"


def _parser(dtype: pa.DataType) -> Callable[[str], Any] | None:
    if pa.types.is_boolean(dtype):
        return _bool
    if pa.types.is_integer(dtype):
        return lambda text: int(text.strip(), 10)
    if pa.types.is_date(dtype):
        return lambda text: datetime.date.fromisoformat(text.strip())
    if pa.types.is_timestamp(dtype):
        return lambda text: _timestamp(text, dtype)
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype):
        return str
    if _is_binary(dtype):
        return lambda text: text.encode()
    return None


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise ValueError("not true or false")


def _timestamp(text: str, dtype: pa.TimestampType) -> datetime.datetime:
    """An ISO 8601 time: for a column with a time zone, UTC when the text has no offset; for
    one without, a text with an offset is taken at UTC."""
    value = datetime.datetime.fromisoformat(text.strip())
    if dtype.tz is not None:
        return value if value.tzinfo is not None else value.replace(tzinfo=datetime.UTC)
    return value if value.tzinfo is None else value.astimezone(datetime.UTC).replace(tzinfo=None)


def _is_binary(dtype: pa.DataType) -> bool:
    return pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_binary_view(dtype)
