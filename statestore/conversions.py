"""Which conversions of keys and values the store makes, the same for every API.

A value or key is converted to the declared Arrow type only when nothing is lost: widening
within a family (int32 -> int64, string -> large_string, int -> float when exact) and Arrow's
safe casts (which refuse overflow and truncation). Parsing strings into numbers, formatting
numbers as strings, and storing a Python float in an integer are schema mismatches, whether
the value comes one key at a time or in a batch; so is a string that is not valid UTF-8.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa


def type_family(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t) \
            or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_dictionary(t):
        return type_family(t.value_type)
    return str(t.id)


def castable(source: pa.DataType, target: pa.DataType) -> bool:
    """Arrow casts that keep meaning: widening within a family (int32 -> int64, string ->
    large_string, nested types field by field). Parsing strings into numbers or
    formatting numbers as strings is a schema mismatch, not a conversion."""
    fs, ft = type_family(source), type_family(target)
    return fs == ft or (fs == "integer" and ft == "number") or pa.types.is_null(source)


def check_no_truncation(value: Any, dtype: pa.DataType) -> None:
    """Raise TypeError when a Python float would land in an integer of ``dtype`` (pyarrow's
    conversion from Python truncates it: 1.9 -> 1), at any depth of a nested value."""
    if value is None:
        return
    if pa.types.is_integer(dtype):
        if isinstance(value, float):
            raise TypeError(f"a float ({value!r}) cannot be stored in an integer of {dtype} (it would be "
                            "truncated); convert it explicitly (int(), round()) or declare a floating-point type")
        return
    if pa.types.is_struct(dtype):
        if isinstance(value, dict):
            for f in dtype:
                check_no_truncation(value.get(f.name), f.type)
        elif isinstance(value, tuple | list):
            for f, v in zip(dtype, value, strict=False):
                check_no_truncation(v, f.type)
        return
    if pa.types.is_map(dtype):
        items = value.items() if isinstance(value, dict) else value
        for k, v in items:
            check_no_truncation(k, dtype.key_type)
            check_no_truncation(v, dtype.item_type)
        return
    listed = pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype)
    if listed and isinstance(value, list | tuple):
        for v in value:
            check_no_truncation(v, dtype.value_type)
