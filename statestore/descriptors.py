"""State variable descriptors: name, kind, Arrow types, TTL, and the functions of
reducing and aggregating state.

A descriptor is declared once per state variable of an operator and fixes the typed
columns of that variable in the state table (``v_<name>`` for values, ``mk_<name>`` for
the user keys of a map). Descriptors are immutable and thread safe.
"""

from __future__ import annotations

import abc
import enum
import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa


class StateKind(enum.Enum):
    # Stored in the state table's properties: do not rename.
    VALUE = "value"
    LIST = "list"
    MAP = "map"
    REDUCING = "reducing"
    AGGREGATING = "aggregating"


class TtlUpdateType(enum.Enum):
    """When the expiry time of an entry is pushed forward (Flink's StateTtlConfig.UpdateType)."""

    ON_CREATE_AND_WRITE = "on_create_and_write"
    ON_READ_AND_WRITE = "on_read_and_write"


@dataclass(frozen=True)
class TtlConfig:
    """Time to live in processing time. Expired values are never returned."""

    ttl_ms: int
    update_type: TtlUpdateType = TtlUpdateType.ON_CREATE_AND_WRITE

    def __post_init__(self) -> None:
        if not isinstance(self.ttl_ms, int) or self.ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be a positive int, got {self.ttl_ms!r}")


# A state name that is used as is in its column names; any other name (Spark accepts
# "ttl-state", "my state", "a.b", unicode...) gets a column stem of its safe characters and
# a digest of the name (``column_stem``).
_PLAIN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_]+")


@functools.lru_cache(maxsize=1024)
def column_stem(name: str) -> str:
    """The part of a state variable's column names (``v_<stem>``, ``mk_<stem>``) that comes
    from its name: the name itself when it is a plain identifier (letters, digits and
    underscores, a letter first, at most 63), else its safe characters and 8 hex digits of
    its SHA-256 (distinct names, distinct columns). Remembered: the per-key reads ask for a
    variable's columns at every call."""
    if _PLAIN_NAME.fullmatch(name):
        return name
    safe = _UNSAFE.sub("_", name).strip("_")[:40] or "s"
    if not safe[0].isalpha():
        safe = f"s_{safe}"
    return f"{safe}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


# Nesting levels (struct, list, map) a value type may have. Arrow's C data interface, which
# carries state between Polars, DuckDB and Arrow, refuses 64; Parquet's nested readers fail
# near 50 lists. A type deeper than this would be refused only when written or read back.
MAX_TYPE_DEPTH = 32


def type_depth(t: pa.DataType) -> int:
    """How many nested levels ``t`` has (0 for a primitive), iteratively: a hostile type's depth
    never exhausts Python's recursion limit."""
    deepest, todo = 0, [(t, 0)]
    while todo:
        t, depth = todo.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_TYPE_DEPTH:
            break
        if pa.types.is_dictionary(t):
            todo.append((t.value_type, depth))
        else:
            todo.extend((t.field(i).type, depth + 1) for i in range(t.num_fields))
    return deepest


def _as_type(t: pa.DataType | pa.Schema, what: str) -> pa.DataType:
    if isinstance(t, pa.Schema):
        t = pa.struct(list(t))
    if not isinstance(t, pa.DataType):
        raise TypeError(f"{what} must be a pyarrow DataType or Schema, got {type(t).__name__}")
    if type_depth(t) > MAX_TYPE_DEPTH:
        raise ValueError(
            f"{what} nests more than {MAX_TYPE_DEPTH} levels of structs, lists and maps, which Arrow and Parquet "
            "cannot carry: flatten it (a struct of its leaves), or store the deep part serialized as a string or "
            "binary")
    return t


class AggregateFunction(abc.ABC):
    """Flink-style aggregate function for ``AggregatingStateDescriptor``.

    The batched API (``add_batch``) groups the values of each key in one vectorized step
    and then calls ``add`` per value in Python: aggregate functions are user code.
    """

    accumulator_type: pa.DataType = pa.null()
    #: type of ``get_result``; None lets Arrow infer it from the results
    result_type: pa.DataType | None = None

    @abc.abstractmethod
    def create_accumulator(self) -> Any:
        """Defined by each aggregate function."""

    @abc.abstractmethod
    def add(self, value: Any, accumulator: Any) -> Any:
        """Defined by each aggregate function."""

    @abc.abstractmethod
    def merge(self, a: Any, b: Any) -> Any:
        """Defined by each aggregate function."""

    @abc.abstractmethod
    def get_result(self, accumulator: Any) -> Any:
        """Defined by each aggregate function."""


@dataclass(frozen=True)
class StateDescriptor:
    """Common part of every descriptor. ``value_type`` is the type of one stored value:
    the value of a value state, one element of a list, one map value, the accumulator
    of a reducing or aggregating state."""

    name: str
    value_type: pa.DataType
    ttl: TtlConfig | None = None
    kind: StateKind = field(init=False, default=StateKind.VALUE)
    user_key_type: pa.DataType | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"state name {self.name!r} is invalid: use a non-blank string")
        object.__setattr__(self, "value_type", _as_type(self.value_type, f"value type of state {self.name!r}"))
        if self.ttl is not None and not isinstance(self.ttl, TtlConfig):
            raise TypeError(f"ttl of state {self.name!r} must be a TtlConfig, got {type(self.ttl).__name__}")

    @property
    def value_column(self) -> str:
        return f"v_{column_stem(self.name)}"

    @property
    def user_key_column(self) -> str | None:
        return f"mk_{column_stem(self.name)}" if self.kind is StateKind.MAP else None

    def display_columns(self) -> dict[str, str]:
        """Stored column name -> the name shown to people (SQL tables, the data source):
        ``v_<name>`` and ``mk_<name>`` with the variable's own name."""
        shown = {self.value_column: f"v_{self.name}"}
        if self.user_key_column is not None:
            shown[self.user_key_column] = f"mk_{self.name}"
        return shown


@dataclass(frozen=True)
class ValueStateDescriptor(StateDescriptor):
    kind: StateKind = field(init=False, default=StateKind.VALUE)


@dataclass(frozen=True)
class ListStateDescriptor(StateDescriptor):
    """``value_type`` is the type of one list element."""

    kind: StateKind = field(init=False, default=StateKind.LIST)


@dataclass(frozen=True, kw_only=True)
class MapStateDescriptor(StateDescriptor):
    key_type: pa.DataType | pa.Schema
    kind: StateKind = field(init=False, default=StateKind.MAP)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "user_key_type", _as_type(self.key_type, f"user key type of map {self.name!r}"))
        object.__setattr__(self, "key_type", self.user_key_type)


# polars aggregation names usable as a vectorized reduce (associative and commutative)
VECTORIZED_REDUCERS = ("sum", "min", "max")


@dataclass(frozen=True, kw_only=True)
class ReducingStateDescriptor(StateDescriptor):
    """``reduce_fn(a, b)`` combines two values of ``value_type``. ``vectorized`` names an
    equivalent column aggregation ("sum", "min" or "max") for the batched API."""

    reduce_fn: Callable[[Any, Any], Any]
    vectorized: str | None = None
    kind: StateKind = field(init=False, default=StateKind.REDUCING)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not callable(self.reduce_fn):
            raise TypeError(f"reduce_fn of state {self.name!r} must be callable")
        if self.vectorized is not None and self.vectorized not in VECTORIZED_REDUCERS:
            raise ValueError(f"vectorized of state {self.name!r} must be one of {VECTORIZED_REDUCERS}")


@dataclass(frozen=True, kw_only=True)
class AggregatingStateDescriptor(StateDescriptor):
    """``value_type`` is the accumulator type (defaults to the function's)."""

    agg_fn: AggregateFunction
    value_type: pa.DataType = None  # type: ignore[assignment]
    kind: StateKind = field(init=False, default=StateKind.AGGREGATING)

    def __post_init__(self) -> None:
        if not isinstance(self.agg_fn, AggregateFunction):
            raise TypeError(f"agg_fn of state {self.name!r} must be an AggregateFunction")
        if self.value_type is None:
            object.__setattr__(self, "value_type", self.agg_fn.accumulator_type)
        super().__post_init__()


class AverageAggregate(AggregateFunction):
    """Running mean of float64 values; the accumulator is (sum, count)."""

    accumulator_type = pa.struct([("sum", pa.float64()), ("count", pa.int64())])
    result_type = pa.float64()

    def create_accumulator(self) -> dict:
        return {"sum": 0.0, "count": 0}

    def add(self, value: float, accumulator: dict) -> dict:
        return {"sum": accumulator["sum"] + value, "count": accumulator["count"] + 1}

    def merge(self, a: dict, b: dict) -> dict:
        return {"sum": a["sum"] + b["sum"], "count": a["count"] + b["count"]}

    def get_result(self, accumulator: dict) -> float | None:
        return accumulator["sum"] / accumulator["count"] if accumulator["count"] else None
