"""Which conversions of keys and values the store makes, the same for every API.

A value or key is converted to the declared Arrow type only when nothing is lost: widening
within a family (int32 -> int64, string -> large_string, int -> float when exact) and Arrow's
safe casts (which refuse overflow and truncation). Parsing strings into numbers, formatting
numbers as strings, and storing a Python float in an integer are schema mismatches, whether
the value comes one key at a time or in a batch; so is a string that is not valid UTF-8.
"""

from __future__ import annotations

import datetime
import decimal
import math
import struct
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
    """Raise TypeError where pyarrow's conversion from Python would change a value of
    ``dtype`` without a word, at any depth of a nested value: a float landing in an integer
    (truncated: 1.9 -> 1), a finite float beyond a narrower float's range (an infinity), a
    string or bytes taken as a list (of characters or of byte values), a dict with keys that
    are not fields of its struct (dropped), a bool taken as a number, an int as a number of
    days or a datetime cut to its date."""
    if value is None:
        return
    if pa.types.is_integer(dtype):
        if isinstance(value, float | decimal.Decimal):
            raise TypeError(f"a {type(value).__name__} ({value!r}) cannot be stored in an integer of {dtype} (it "
                            "would be truncated); convert it explicitly (int(), round()) or declare a floating-point "
                            "type")
        return
    if isinstance(value, bool) and (pa.types.is_floating(dtype) or pa.types.is_decimal(dtype)):
        raise TypeError(f"a bool ({value!r}) cannot be stored in {dtype} (it would become {int(value)})")
    if pa.types.is_date(dtype):
        if not isinstance(value, datetime.date):
            raise TypeError(f"{type(value).__name__} {value!r} is not a date of {dtype}; pass a datetime.date")
        if isinstance(value, datetime.datetime) and (value.time() != datetime.time(0) or value.tzinfo is not None):
            raise TypeError(f"datetime {value!r} would lose its time of day as a {dtype}; pass its date()")
        return
    if pa.types.is_floating(dtype):
        if isinstance(value, float) and dtype.bit_width < 64 and not _fits_float(value, dtype.bit_width):
            raise TypeError(f"{value!r} is beyond the range of {dtype} (it would become an infinity); declare "
                            "a float64 type")
        return
    if pa.types.is_struct(dtype):
        if isinstance(value, dict):
            unknown = [k for k in value if not isinstance(k, str) or dtype.get_field_index(k) < 0]
            if unknown:
                raise TypeError(f"{unknown!r} are not fields of {dtype} (they would be dropped)")
            for f in dtype:
                check_no_truncation(value.get(f.name), f.type)
        elif isinstance(value, str | bytes | bytearray):
            raise TypeError(f"{type(value).__name__} {value!r} is not a struct {dtype}; pass a dict")
        elif isinstance(value, tuple | list):
            if len(value) != dtype.num_fields:
                raise TypeError(f"{len(value)} value(s) for the {dtype.num_fields} field(s) of {dtype} (missing "
                                "ones would become null, extra ones be dropped); pass one per field or a dict")
            for f, v in zip(dtype, value, strict=True):
                check_no_truncation(v, f.type)
        return
    if pa.types.is_map(dtype):
        items = value.items() if isinstance(value, dict) else value
        for k, v in items:
            check_no_truncation(k, dtype.key_type)
            check_no_truncation(v, dtype.item_type)
        return
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype):
        if isinstance(value, str | bytes | bytearray):
            raise TypeError(f"{type(value).__name__} {value!r} is not a list of {dtype.value_type} (it would be "
                            "stored as its characters or bytes); pass a list")
        if isinstance(value, list | tuple):
            for v in value:
                check_no_truncation(v, dtype.value_type)


def _fits_float(value: float, bits: int) -> bool:
    """Whether ``value`` stays finite (or not) as a float of ``bits`` (16 or 32)."""
    code = "e" if bits == 16 else "f"
    try:
        narrowed = struct.unpack(code, struct.pack(code, value))[0]
    except OverflowError:  # older Pythons refuse instead of rounding to an infinity
        return False
    return math.isinf(narrowed) == math.isinf(value)


def key_value_check(dtype: pa.DataType) -> tuple[type | tuple[type, ...], type | tuple[type, ...]]:
    """For a key column of ``dtype`` (one of the key types, ``keygroups.check_key_type``), the
    Python types a key value given one at a time (``StateStore.set_current_key``) must be, and
    those it must not be: the state is looked up by the value itself, so a value Arrow would
    convert (``1.0`` stored as ``1``, ``b"k"`` as ``"k"``, ``True`` as ``1``) would be written
    under one key and read under another."""
    if pa.types.is_boolean(dtype):
        return bool, ()
    if pa.types.is_integer(dtype):
        return int, bool
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype):
        return str, ()
    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype) or pa.types.is_binary_view(dtype):
        return bytes, ()
    if pa.types.is_date(dtype):
        return datetime.date, datetime.datetime
    if pa.types.is_timestamp(dtype):
        return datetime.datetime, ()
    return object, ()
