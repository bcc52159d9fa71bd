"""Spark's ``StatefulProcessor`` API on the disaggregated store.

A processor written for Spark's own ``transformWithState`` (a subclass of
``pyspark.sql.streaming.StatefulProcessor``) runs unchanged: its ``init`` receives a
``StoreHandle`` instead of Spark's ``StatefulProcessorHandle``, with the same methods,
and the state variables it gets back have the same methods as Spark's ``ValueState``,
``ListState`` and ``MapState``. Every call is served in the Python worker from the task's
store (memtable and cached key-group views), not by a socket round trip to the JVM; the
key groups a task will touch are loaded in one batched read before the first key.

Values cross the API as tuples in the order of the declared schema's fields, as in
Spark; they are stored as Arrow structs (readable as such with SQL).

Two handles exist: ``DeclaringHandle`` runs ``init`` on the driver to learn the state
variables (names, schemas, TTLs) before any state is written, and ``StoreHandle`` serves
the executors.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from pyspark.errors import PySparkException, PySparkRuntimeError
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, StatefulProcessor, TimerValues
from pyspark.sql.types import DataType, StructField, StructType

from spark_integration.timers import TIMERS_STATE, TimerService
from statestore.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateDescriptor,
    StateKind,
    TtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)
from statestore.errors import (
    NoCurrentKeyError,
    StateDescriptorMismatchError,
    StateNotDeclaredError,
    StateStoreError,
    StateVariableDeletedError,
    TimersDisabledError,
)
from statestore.names import check_state_name
from statestore.operator_state import OperatorListState, OperatorStateDescriptor, Redistribution
from statestore.state import fields_fit
from statestore.store import StateStore


def spark_struct(schema: StructType | DataType | str, what: str) -> StructType:
    """A state schema as a StructType: DDL strings are parsed (needs the driver's SparkContext);
    a non-struct type becomes a struct of one field ``value``."""
    if isinstance(schema, str):
        from pyspark.sql.types import _parse_datatype_string

        try:
            schema = _parse_datatype_string(schema)
        except Exception as e:
            raise ValueError(f"{what}: cannot parse schema {schema!r}: {e}") from e
    if not isinstance(schema, DataType):
        raise TypeError(f"{what}: schema must be a StructType or a DDL string, got {type(schema).__name__}")
    if not isinstance(schema, StructType):
        schema = StructType([StructField("value", schema)])
    return schema


def arrow_type(schema: StructType) -> pa.DataType:
    """The stored Arrow type of a state schema: Spark's conversion, with every field nullable
    at every depth. Spark's default state encoding stores a field declared not nullable as any
    other; here a value column sits beside other variables' in one entry row, null in their
    rows, and Arrow refuses a null parent over a child declared not nullable."""
    from pyspark.sql.pandas.types import to_arrow_type

    return _nullable(to_arrow_type(schema, timezone="UTC"))


def _nullable(t: pa.DataType) -> pa.DataType:
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _nullable(f.type), nullable=True, metadata=f.metadata) for f in t])
    if pa.types.is_large_list(t):
        return pa.large_list(pa.field(t.value_field.name, _nullable(t.value_type), nullable=True))
    if pa.types.is_list(t):
        return pa.list_(pa.field(t.value_field.name, _nullable(t.value_type), nullable=True))
    if pa.types.is_map(t):
        return pa.map_(t.key_type, pa.field(t.item_field.name, _nullable(t.item_type), nullable=True))
    return t


def _ttl(ttl_ms: int | None, name: str) -> TtlConfig | None:
    if ttl_ms is None or ttl_ms == 0:  # 0: no TTL, as Spark
        return None
    if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms < 0:
        raise ValueError(f"state {name!r}: ttlDurationMs must be a positive int of milliseconds (0: no TTL), "
                         f"got {ttl_ms!r}")
    return TtlConfig(ttl_ms)


class SchemaMustBeNullableError(StateStoreError, PySparkException):
    """Spark's ``TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE``: with Avro state encoding
    (``spark.sql.streaming.stateStore.encodingFormat=avro``) every field of a state schema must
    be nullable; raised at the query's start, with Spark's condition, SQLSTATE and text."""

    CONDITION = "TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE"

    def __init__(self, state_name: str, schema: StructType):
        parameters = {"columnFamilyName": state_name, "schema": scala_string(schema)}
        # Spark's text, its lines joined as Spark joins them.
        message = (f"If Avro encoding is enabled, all the fields in the schema for column family {state_name} must "
                   f"be nullable\nwhen using the TransformWithState operator.\nPlease make the schema nullable. "
                   f"Current schema: {parameters['schema']}")
        Exception.__init__(self, message)
        PySparkException.__init__(self, message=message, errorClass=self.CONDITION, messageParameters=parameters)
        self._state_name, self._schema = state_name, schema

    def __reduce__(self) -> tuple:
        return type(self), (self._state_name, self._schema)

    def getSqlState(self) -> str:
        return "XXKST"


def scala_string(schema: DataType) -> str:
    """A type as Spark's JVM prints it (``StructType(StructField(id,IntegerType,false))``,
    ``ArrayType(LongType,true)``), as Spark's messages show state schemas."""
    from pyspark.sql.types import ArrayType, MapType

    def flag(b: bool) -> str:
        return str(b).lower()

    if isinstance(schema, StructType):
        return "StructType(" + ",".join(f"StructField({f.name},{scala_string(f.dataType)},{flag(f.nullable)})"
                                        for f in schema.fields) + ")"
    if isinstance(schema, ArrayType):
        return f"ArrayType({scala_string(schema.elementType)},{flag(schema.containsNull)})"
    if isinstance(schema, MapType):
        return (f"MapType({scala_string(schema.keyType)},{scala_string(schema.valueType)},"
                f"{flag(schema.valueContainsNull)})")
    return repr(schema).replace("()", "")  # IntegerType() -> IntegerType; DecimalType(10,2), CharType(3) as they are


def check_nullable_for_avro(handle: DeclaringHandle, encoding: str | None) -> None:
    """Refuse, as Spark does with Avro state encoding, a state whose value schema (a list's
    elements', a map's values') has a top-level field that is not nullable; Spark stores a
    value with a TTL inside a struct of its own, which it does not refuse, nor a map's user key."""
    if (encoding or "").lower() != "avro":
        return
    for name, schema in handle.value_schemas.items():
        if name not in handle.with_ttl and any(not f.nullable for f in schema.fields):
            raise SchemaMustBeNullableError(name, schema)


class DeclaringHandle:
    """Runs a processor's ``init`` on the driver and records the state variables it declares
    (and, by name, the Spark schemas of their values and which have a TTL)."""

    def __init__(self) -> None:
        self.descriptors: list[StateDescriptor] = []
        self.deleted: list[str] = []
        self.value_schemas: dict[str, StructType] = {}
        self.with_ttl: set[str] = set()
        self.operator_states: list[OperatorStateDescriptor] = []

    def _declare(self, desc: StateDescriptor) -> None:
        check_state_name(desc.name)
        if desc.name == TIMERS_STATE:
            raise ValueError(f"state name {TIMERS_STATE!r} is reserved for timers; choose another name")
        if any(d.name == desc.name for d in self.descriptors):
            raise ValueError(f"state variable {desc.name!r} is declared twice in init()")
        self.descriptors.append(desc)

    def _value(self, stateName: str, schema: Any, what: str, ttl: TtlConfig | None) -> pa.DataType:
        struct = spark_struct(schema, what)
        self.value_schemas[stateName] = struct
        if ttl is not None:
            self.with_ttl.add(stateName)
        return arrow_type(struct)

    def getValueState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> None:
        ttl = _ttl(ttlDurationMs, stateName)
        t = self._value(stateName, schema, f"value state {stateName!r}", ttl)
        self._declare(ValueStateDescriptor(stateName, t, ttl=ttl))

    def getListState(self, stateName: str, schema: Any, ttlDurationMs: int | None = None) -> None:
        ttl = _ttl(ttlDurationMs, stateName)
        t = self._value(stateName, schema, f"list state {stateName!r}", ttl)
        self._declare(ListStateDescriptor(stateName, t, ttl=ttl))

    def getMapState(self, stateName: str, userKeySchema: Any, valueSchema: Any,
                    ttlDurationMs: int | None = None) -> None:
        ttl = _ttl(ttlDurationMs, stateName)
        k = arrow_type(spark_struct(userKeySchema, f"map state {stateName!r} user key"))
        v = self._value(stateName, valueSchema, f"map state {stateName!r} value", ttl)
        self._declare(MapStateDescriptor(stateName, key_type=k, value_type=v, ttl=ttl))

    def getOperatorListState(self, stateName: str, schema: Any, mode: str = "split") -> None:
        if any(d.name == stateName for d in self.operator_states):
            raise ValueError(f"operator state {stateName!r} is declared twice in init()")
        t = arrow_type(spark_struct(schema, f"operator state {stateName!r}"))
        self.operator_states.append(OperatorStateDescriptor(stateName, t, Redistribution(str(mode).lower())))

    def registerTimer(self, expiryTimestampMs: int) -> None:
        raise NoCurrentKeyError("registerTimer needs a grouping key: call it from handleInputRows, not init()")

    deleteTimer = registerTimer

    def listTimers(self) -> Iterator[int]:
        raise NoCurrentKeyError("listTimers needs a grouping key: call it from handleInputRows, not init()")

    def deleteIfExists(self, stateName: str) -> None:
        self.deleted.append(stateName)


def declare(processor: StatefulProcessor) -> DeclaringHandle:
    """Run ``processor.init`` against a recording handle (driver side) and close it again."""
    handle = DeclaringHandle()
    processor.init(handle)
    processor.close()
    return handle


class _Struct:
    """Tuple <-> stored struct conversion of one schema: values cross the API as Spark's
    Python values (``Row``s for structs at every depth below the top-level tuple, lists,
    dicts for maps, naive local datetimes), and are stored as Arrow structs."""

    __slots__ = ("_read", "_row", "_write", "n", "names")

    def __init__(self, t: pa.DataType):
        self.names = [f.name for f in t]
        self.n = len(self.names)
        self._read = [_reader(f.type) for f in t]
        self._write = [_writer(f.type) for f in t]
        self._row = _row_maker(self.names)
        if not any(self._read):
            self._read = None
        if not any(self._write):
            self._write = None

    def to_store(self, value: Any, what: str) -> dict:
        if type(value) is tuple and len(value) == self.n:  # a plain tuple of the right size: the common case
            out = dict(zip(self.names, value, strict=False))
        else:
            out = self._named(value, what)
        if self._write is not None:
            for name, conv in zip(self.names, self._write, strict=True):
                if conv is not None:
                    out[name] = conv(out[name])
        return out

    def to_tuple(self, value: Any, what: str) -> tuple:
        """The value as a tuple of the schema's fields in order (``to_store`` without the
        conversions, for a schema that needs none)."""
        if type(value) is tuple and len(value) == self.n:
            return value
        return tuple(self._named(value, what).values())

    def _named(self, value: Any, what: str) -> dict:
        if isinstance(value, Row) and hasattr(value, "__fields__"):
            value = value.asDict()
        if isinstance(value, dict):
            # Named fields go by name, stored in schema order (reads return schema order).
            unknown = [k for k in value if k not in self.names]
            if unknown:
                raise ValueError(f"{what}: field(s) {unknown} are not in the declared schema {self.names}")
            return {n: value.get(n) for n in self.names}
        if not isinstance(value, (tuple, list)):
            value = (value,)
        if len(value) != len(self.names):
            raise ValueError(f"{what}: expected a tuple of {len(self.names)} field(s) {self.names}, got {value!r}")
        return dict(zip(self.names, value, strict=True))

    def from_store(self, value: dict | None) -> tuple | None:
        if value is None:
            return None
        if self._read is None:
            return tuple(value.values())
        return tuple(v if conv is None else conv(v) for v, conv in zip(value.values(), self._read, strict=True))

    def row_from_store(self, value: dict | None) -> Row | None:
        """The value as a ``Row`` of the schema's fields (``MapState.getValue``, as Spark)."""
        values = self.from_store(value)
        return None if values is None else self._row(values)


def _reader(t: pa.DataType) -> Callable[[Any], Any] | None:
    """Arrow's Python value of type ``t`` as pyspark's: a ``Row`` for a struct, a dict for a
    map, a naive datetime in the process's time zone for a timestamp; None when Arrow's
    value is already pyspark's."""
    if pa.types.is_struct(t):
        names = [f.name for f in t]
        subs = [_reader(f.type) for f in t]
        make = _row_maker(names)

        def struct(v: Any) -> Any:
            if v is None:
                return None
            return make(tuple(x if c is None else c(x) for x, c in zip(v.values(), subs, strict=True)))
        return struct
    if pa.types.is_map(t):
        key, item = _reader(t.key_type), _reader(t.item_type)
        return lambda v: None if v is None else {(k if key is None else key(k)): (x if item is None else item(x))
                                                for k, x in _pairs(v)}
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        sub = _reader(t.value_type)
        if sub is None:
            return None
        return lambda v: None if v is None else [sub(x) for x in v]
    if pa.types.is_timestamp(t) and t.tz is not None:
        return lambda v: None if v is None else v.astimezone(None).replace(tzinfo=None)
    return None


def _pairs(v: Any) -> Iterator[tuple[Any, Any]]:
    """A map's entries, whichever way it was read: a dict, Arrow's (key, value) tuples, or
    polars' {"key", "value"} structs."""
    if isinstance(v, dict):
        yield from v.items()
        return
    for entry in v:
        if isinstance(entry, dict):
            yield entry["key"], entry["value"]
        else:
            yield entry


def _writer(t: pa.DataType) -> Callable[[Any], Any] | None:
    """pyspark's Python value of type ``t`` as Arrow takes it: Rows and dicts of a struct by
    field name, a naive datetime read in the process's time zone (as pyspark does); None
    when no conversion is needed."""
    if pa.types.is_struct(t):
        names = [f.name for f in t]
        subs = [_writer(f.type) for f in t]

        def struct(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, Row) and hasattr(v, "__fields__"):
                v = v.asDict()
            if isinstance(v, dict):
                v = [v.get(n) for n in names]
            return {n: (x if c is None else c(x)) for n, x, c in zip(names, v, subs, strict=True)}
        return struct
    if pa.types.is_map(t):
        key, item = _writer(t.key_type), _writer(t.item_type)
        return lambda v: None if v is None else [((k if key is None else key(k)), (x if item is None else item(x)))
                                                 for k, x in _pairs(v)]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        sub = _writer(t.value_type)
        if sub is None:
            return None
        return lambda v: None if v is None else [sub(x) for x in v]
    if pa.types.is_timestamp(t) and t.tz is not None:
        return lambda v: v.astimezone() if isinstance(v, datetime.datetime) and v.tzinfo is None else v
    return None


class _BatchValues:
    """One batch's values of one value state, held in the worker: the values of the batch's
    keys come in one batched lookup before the first key (``load``), the per-key calls read
    and write a dict, and the batch's writes reach the store as one batched write at its end
    (``drain``), as Flink groups remote state access (FLIP-426). A key the lookup did not
    cover (a timer's, an initial state's) is read through the store once.

    Values are held as the API returns them (tuples of the schema's fields) when the schema
    needs no conversion (``simple``: plain fields, no struct, map or zoned timestamp to
    convert), else as the store holds them (a dict of the fields), converted at each read;
    either way a read after a write returns what the store's round trip would."""

    __slots__ = ("fits", "key_schema", "simple", "state", "struct", "values", "written")

    def __init__(self, store: StateStore, name: str, struct: _Struct):
        self.key_schema = store.layout.key_schema
        self.state = store.get_state(name)            # the store's value state
        self.struct = struct
        self.simple = struct._read is None and struct._write is None
        self.fits = fields_fit(self.state.descriptor.value_type) if self.simple else None
        self.values: dict[tuple, Any] = {}            # key -> held value, None: none
        self.written: dict[tuple, int] = {}           # key -> key group, of the keys written

    def held(self, stored: dict | None) -> Any:
        """A value read through the store, as held."""
        if stored is None or not self.simple:
            return stored
        return tuple(stored.values())

    def load(self, keys: pa.Table) -> None:
        """Read the values of ``keys`` (distinct; prepared by the store last, so not hashed
        again) in one lookup; a key already held (written in this batch) keeps its value."""
        column = self.state.get_batch(keys)
        if self.simple:  # tuples from the struct's field columns: no dict per value
            values = list(zip(*[column.field(i).to_pylist() for i in range(column.type.num_fields)], strict=True))
            if column.null_count:
                values = [v if ok else None for v, ok in zip(values, column.is_valid().to_pylist(), strict=True)]
        else:
            values = column.to_pylist()
        tuples = zip(*[c.to_pylist() for c in keys.columns], strict=True)
        if self.values:
            held = self.values
            for key, value in zip(tuples, values, strict=True):
                held.setdefault(key, value)
        else:
            self.values = dict(zip(tuples, values, strict=True))

    def drain(self) -> None:
        """Write the batch's writes to the store: a put per key with a value, a clear per key
        cleared (only the last write of a key counts, as in the store)."""
        written, self.written = self.written, {}
        if not written:
            return
        schema = self.key_schema
        keys = list(written)
        held = list(map(self.values.__getitem__, keys))  # one lookup of each written key's value
        kgs = list(written.values())
        puts: tuple[list, list, list] = (keys, kgs, held)     # keys, key groups, values
        clears: tuple[list, list, list] = ([], [], [])
        if None in held:  # some keys cleared: split (a held value is a tuple or dict, never equal to None)
            puts = ([], [], [])
            for key, kg, value in zip(keys, kgs, held, strict=True):
                into = clears if value is None else puts
                into[0].append(key)
                into[1].append(kg)
                into[2].append(value)
        for (keys, kgs, held), put in ((puts, True), (clears, False)):
            if not keys:
                continue
            columns = zip(*keys, strict=True)
            table = pa.table([pa.array(c, f.type) for c, f in zip(columns, schema, strict=True)], schema=schema)
            kgs = np.array(kgs, dtype=np.int64)
            if put:
                self.state.update_batch(table, self._column(held), kgs)
            else:
                self.state.clear_batch(table, kgs)

    def _column(self, values: list) -> pa.Array:
        """The held values as the state's Arrow column. Each passed the per-key write's check
        at its update(), so they go straight to Arrow."""
        t = self.state.descriptor.value_type
        if not self.simple:
            return pa.array(values, t)
        fields = list(t)
        columns = zip(*values, strict=True)
        return pa.StructArray.from_arrays([pa.array(c, f.type) for c, f in zip(columns, fields, strict=True)],
                                          fields=fields)


_MISS = object()


class ValueState:
    """Spark's ``ValueState`` over the store's value state of the current key; through the
    batch's ``_BatchValues`` when the runner gave one."""

    def __init__(self, store: StateStore, desc: StateDescriptor, batch: _BatchValues | None = None):
        self._store = store
        self._state = store.get_state(desc.name)
        self._struct = _Struct(desc.value_type) if batch is None else batch.struct
        self._what = f"value state {desc.name!r}"
        self._batch = batch

    def _held(self) -> Any:
        batch = self._batch
        key = self._store.current_key()[0]
        value = batch.values.get(key, _MISS)
        if value is _MISS:
            value = batch.values[key] = batch.held(self._state.get())
        return value

    def exists(self) -> bool:
        if self._batch is None:
            return self._state.exists()
        return self._held() is not None

    def get(self) -> tuple | None:
        batch = self._batch
        if batch is None:
            return self._struct.from_store(self._state.get())
        value = self._held()
        return value if batch.simple else self._struct.from_store(value)

    def update(self, newValue: tuple) -> None:
        batch = self._batch
        if batch is None:
            self._state.update(self._struct.to_store(newValue, self._what))
            self._store.api_rows_updated += 1
            return
        # The errors a per-key write would raise, at the user's call.
        if batch.simple:
            value = self._struct.to_tuple(newValue, self._what)
            if not batch.fits(value):
                self._state.check(self._struct.to_store(value, self._what))
        else:
            value = self._struct.to_store(newValue, self._what)
            self._state.check(value)
        key, kg = self._store.current_key()
        batch.values[key] = value
        batch.written[key] = kg
        self._store.api_rows_updated += 1

    def clear(self) -> None:
        self._store.api_rows_removed += 1
        batch = self._batch
        if batch is None:
            self._state.clear()
            return
        key, kg = self._store.current_key()
        batch.values[key] = None
        batch.written[key] = kg


class ListState:
    """Spark's ``ListState`` over the store's list state of the current key."""

    def __init__(self, store: StateStore, desc: StateDescriptor):
        self._store = store
        self._state = store.get_state(desc.name)
        self._struct = _Struct(desc.value_type)
        self._what = f"list state {desc.name!r}"

    def exists(self) -> bool:
        return self._state.exists()

    def get(self) -> Iterator[tuple]:
        return iter([self._struct.from_store(v) for v in self._state.get()])

    def put(self, newState: list[tuple]) -> None:
        values = [self._struct.to_store(v, self._what) for v in newState]
        self._state.update(values)
        self._store.api_rows_updated += len(values)

    def appendValue(self, newState: tuple) -> None:
        self._state.add(self._struct.to_store(newState, self._what))
        self._store.api_rows_updated += 1

    def appendList(self, newState: list[tuple]) -> None:
        values = [self._struct.to_store(v, self._what) for v in newState]
        self._state.add_all(values)
        self._store.api_rows_updated += len(values)

    def clear(self) -> None:
        self._store.api_rows_removed += self._state.size()  # Spark counts each element removed
        self._state.clear()


class OperatorListHandle:
    """An operator (non-keyed) list state of the task, with ``ListState``'s methods: what
    ``handle.getOperatorListState`` gives a Spark-API processor (an extension of Spark's handle,
    FLIP-8's operator state). Its elements belong to the task, whatever key is current."""

    def __init__(self, state: OperatorListState):
        self._state = state
        self._struct = _Struct(state.descriptor.value_type)
        self._what = f"operator state {state.descriptor.name!r}"

    def exists(self) -> bool:
        return bool(self._state.get())

    def get(self) -> Iterator[tuple]:
        return iter([self._struct.from_store(v) for v in self._state.get()])

    def put(self, newState: list[tuple]) -> None:
        self._state.update([self._struct.to_store(v, self._what) for v in newState])

    def appendValue(self, newState: tuple) -> None:
        self._state.add(self._struct.to_store(newState, self._what))

    def appendList(self, newState: list[tuple]) -> None:
        self._state.add_all([self._struct.to_store(v, self._what) for v in newState])

    def clear(self) -> None:
        self._state.clear()


class MapState:
    """Spark's ``MapState`` over the store's map state of the current key."""

    def __init__(self, store: StateStore, desc: StateDescriptor):
        self._store = store
        self._state = store.get_state(desc.name)
        self._keys = _Struct(desc.user_key_type)
        self._values = _Struct(desc.value_type)
        self._what = f"map state {desc.name!r}"

    def exists(self) -> bool:
        return self._state.exists()

    def getValue(self, key: tuple) -> Row | None:
        # A Row, where the map's other reads return tuples: as Spark's MapState.
        return self._values.row_from_store(self._state.get(self._keys.to_store(key, self._what + " user key")))

    def containsKey(self, key: tuple) -> bool:
        return self._state.contains(self._keys.to_store(key, self._what + " user key"))

    def updateValue(self, key: tuple, value: tuple) -> None:
        self._state.put(self._keys.to_store(key, self._what + " user key"),
                        self._values.to_store(value, self._what + " value"))
        self._store.api_rows_updated += 1

    def iterator(self) -> Iterator[tuple[tuple, tuple]]:
        return iter([(self._keys.from_store(k), self._values.from_store(v)) for k, v in self._state.items()])

    def keys(self) -> Iterator[tuple]:
        return iter([self._keys.from_store(k) for k in self._state.keys()])  # noqa: SIM118 (MapState, not dict)

    def values(self) -> Iterator[tuple]:
        return iter([self._values.from_store(v) for v in self._state.values()])

    def removeKey(self, key: tuple) -> None:
        self._state.remove(self._keys.to_store(key, self._what + " user key"))
        self._store.api_rows_removed += 1

    def clear(self) -> None:
        self._store.api_rows_removed += self._state.size()  # Spark counts each entry removed
        self._state.clear()


_WRAPPERS = {StateKind.VALUE: ValueState, StateKind.LIST: ListState, StateKind.MAP: MapState}
_KINDS = {wrapper: kind for kind, wrapper in _WRAPPERS.items()}


class DeletedStateVariableError(StateVariableDeletedError, PySparkRuntimeError):
    """A call through a state variable handle obtained before ``deleteIfExists`` deleted the
    variable: Spark's ``PySparkRuntimeError`` with Spark's text, which processors written for
    Spark catch (and the store's ``StateVariableDeletedError``)."""

    def __init__(self, message: str, hint: str | None = None):
        Exception.__init__(self, message)  # args: (message,), so that it unpickles (its notes travel with it)
        PySparkRuntimeError.__init__(self, message=message)
        if hint:
            self.add_note(hint)


# What Spark's Python client says when a call reaches a deleted variable, by the kind of state
# and the store method the handle calls ("<the client's text>: <Kind> state <name> is not
# initialized."); None: Spark's iterators read nothing (the client ends them on any error).
# ``size``: read by a list or map clear first (Spark counts the rows it removes).
_DELETED_TEXT: dict[StateKind, dict[str, str | None]] = {
    StateKind.VALUE: {"exists": "Error checking value state exists", "get": "Error getting value state",
                      "update": "Error updating value state", "check": "Error updating value state",
                      "clear": "Error clearing value state"},
    StateKind.LIST: {"exists": "Error checking value state exists", "get": None,
                     "update": "Error updating value state", "add": "Error updating value state",
                     "add_all": "Error updating value state", "clear": "Error clearing value state",
                     "size": "Error clearing value state"},
    StateKind.MAP: {"exists": "Error checking map state exists", "get": "Error getting value",
                    "contains": "Error checking if map state contains key", "put": "Error updating map state value",
                    "items": None, "keys": None, "values": None, "remove": "Error removing key from map state",
                    "clear": "Error clearing map state", "size": "Error clearing map state"},
}


class _Deleted:
    """What a state variable handle reads and writes through after ``deleteIfExists``: every
    call fails as on Spark (``DeletedStateVariableError``), an iteration reads nothing."""

    def __init__(self, name: str, kind: StateKind):
        self._name = name
        self._kind = kind

    def __getattr__(self, method: str) -> Callable[..., Any]:
        texts = _DELETED_TEXT[self._kind]
        if method in texts and texts[method] is None:
            return lambda *args: []
        text = texts.get(method, "Error calling the state")

        def fail(*args: Any) -> Any:
            raise DeletedStateVariableError(
                f"{text}: {self._kind.value.capitalize()} state {self._name} is not initialized.",
                f"deleteIfExists({self._name!r}) deleted the variable after this handle was obtained; call "
                f"get...State({self._name!r}) again after the delete to use the variable")

        return fail


class StoreHandle:
    """Spark's ``StatefulProcessorHandle`` over one task's store (executor side)."""

    def __init__(self, store: StateStore, timers: TimerService | None, batched: bool = False):
        self._store = store
        self._timers = timers
        self._given: dict[str, list] = {}  # the state variables handed out, by name
        # Value states served through a _BatchValues each (``batched``: a runner's handle,
        # which loads and drains them), shared by every handle of one variable.
        self._batched = batched
        self._batches: dict[str, _BatchValues] = {}

    def _get(self, name: str, kind: StateKind) -> Any:
        try:
            desc = self._store.layout.descriptor(name)
        except KeyError:
            raise StateNotDeclaredError(
                f"state variable {name!r} was not declared when the query started; init() must declare the "
                "same state variables on every call (it runs on the driver first to learn them)"
            ) from None
        if desc.kind is not kind:
            raise StateDescriptorMismatchError(
                f"state variable {name!r} is a {desc.kind.value} state, requested as {kind.value}")
        if kind is StateKind.VALUE and self._batched and not (
                desc.ttl is not None and desc.ttl.update_type is TtlUpdateType.ON_READ_AND_WRITE):
            batch = self._batches.get(name)
            if batch is None:
                batch = self._batches[name] = _BatchValues(self._store, name, _Struct(desc.value_type))
            state = ValueState(self._store, desc, batch)
        else:
            state = _WRAPPERS[kind](self._store, desc)
        self._given.setdefault(name, []).append(state)
        return state

    def load(self, keys: pa.Table) -> None:
        """Read the batched value states of ``keys`` (distinct, just prepared by the store)."""
        for batch in self._batches.values():
            batch.load(keys)

    def drain(self) -> None:
        """Write the batched value states' writes to the store (the runner, at a batch's end)."""
        for batch in self._batches.values():
            batch.drain()

    def getValueState(self, stateName: str, schema: Any = None, ttlDurationMs: int | None = None) -> ValueState:
        return self._get(stateName, StateKind.VALUE)

    def getListState(self, stateName: str, schema: Any = None, ttlDurationMs: int | None = None) -> ListState:
        return self._get(stateName, StateKind.LIST)

    def getMapState(self, stateName: str, userKeySchema: Any = None, valueSchema: Any = None,
                    ttlDurationMs: int | None = None) -> MapState:
        return self._get(stateName, StateKind.MAP)

    def getOperatorListState(self, stateName: str, schema: Any = None, mode: str | None = None
                             ) -> OperatorListHandle:
        """The task's operator list state ``stateName`` (declared in ``init``; an extension of
        Spark's handle): the task's own list, checkpointed with the keyed state and redistributed
        by its mode (split, union, broadcast) when the query restarts at another parallelism."""
        operator = self._store.operator_state
        if operator is None:
            raise StateNotDeclaredError(f"operator state {stateName!r} was not declared when the query started: "
                                        "declare it in init() with handle.getOperatorListState(name, schema, mode)")
        return OperatorListHandle(operator.get_list_state(stateName))

    def _timer_service(self) -> TimerService:
        if self._timers is None:
            raise TimersDisabledError("timers need time_mode='ProcessingTime' or 'EventTime' when the query starts")
        return self._timers

    def registerTimer(self, expiryTimestampMs: int) -> None:
        self._timer_service().register(expiryTimestampMs)

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        self._timer_service().delete(expiryTimestampMs)

    def listTimers(self) -> Iterator[int]:
        return iter(self._timer_service().list())

    def deleteIfExists(self, stateName: str) -> None:
        """Purge a state variable for every key of this task, as Spark does on every call
        (processors call it from ``init``, so at every batch). Reads the whole variable.
        A handle of the variable obtained before the delete raises from then on, as on
        Spark; one obtained after it works (on a variable now empty)."""
        self._batches.pop(stateName, None)  # this batch's writes so far: purged with the rest
        for state in self._given.pop(stateName, ()):
            state._state = _Deleted(stateName, _KINDS[type(state)])
            if isinstance(state, ValueState):
                state._batch = None
        try:
            self._store.layout.descriptor(stateName)
        except KeyError:
            return  # never declared in this table: nothing to purge
        store = self._store
        live = store.scan(stateName)
        if live.height:
            keys = live.select(store.key_names).unique(maintain_order=True).to_arrow()
            store.get_state(stateName).clear_batch(keys.cast(store.layout.key_schema))


def _row_maker(columns: list[str]) -> Callable[[tuple], Row]:
    """``Row(*columns)(*values)`` without its per-row overhead: a tuple of a ``Row`` subclass
    whose class holds ``__fields__``. pyspark's ``Row`` reads its fields through attribute
    lookup, so these rows answer every ``Row`` method (attributes, ``asDict``, ``repr``,
    pickling to a plain ``Row``) as Spark's do; making one is ``tuple.__new__`` alone, with
    no Python frame per row (50k rows of 3 columns: 10 against 45 ms)."""
    row_class = type("Row", (Row,), {"__fields__": list(columns), "__module__": Row.__module__})
    return functools.partial(tuple.__new__, row_class)


def run_processor(processor: StatefulProcessor, store: StateStore, timers: TimerService | None,
                  rows: pa.Table, key_groups: list[int], timer_values: TimerValues,
                  fire_upto_ms: int | None, initial: pa.Table | None = None) -> list[tuple]:
    """Run ``processor`` over one task's rows (and expired timers); return the output rows.

    ``rows`` holds the input columns; ``key_groups`` the key group of each row (computed by
    Spark's routing). Keys are processed in order of first appearance; each key's rows are
    handed to ``handleInputRows`` as ``pyspark.sql.Row`` objects, as Spark's ``transformWithState``
    does.
    """
    out: list[tuple] = []
    _drive(processor, store, timers, rows, key_groups, timer_values, fire_upto_ms, initial,
           _row_groups, out.extend)
    return out


def run_pandas_processor(processor: StatefulProcessor, store: StateStore, timers: TimerService | None,
                         rows: pa.Table, key_groups: list[int], timer_values: TimerValues,
                         fire_upto_ms: int | None, output_schema: pa.Schema, initial: pa.Table | None = None,
                         timezone: str = "UTC", batching: ArrowBatching | None = None) -> pa.Table:
    """``run_processor`` for a processor written for Spark's ``transformWithStateInPandas``:
    each key's rows arrive as ``pandas.DataFrame``s (in an iterator, index from 0; one unless
    ``batching`` cuts them, as Spark's Arrow batches do), the initial state's rows of a key the
    same way, and the handlers yield DataFrames, whose columns are matched to ``output_schema``
    by name (by position when they are not named)."""
    frames: list = []
    _drive(processor, store, timers, rows, key_groups, timer_values, fire_upto_ms, initial,
           lambda r, k, s, o, b: _pandas_groups(r, k, s, timezone, o, b, batching), frames.extend,
           initial_groups=lambda t, s: _pandas_groups(t, None, s, timezone, batching=batching))
    return frames_to_arrow(frames, output_schema, timezone)


def _drive(processor: StatefulProcessor, store: StateStore, timers: TimerService | None, rows: pa.Table,
           key_groups: list[int], timer_values: TimerValues, fire_upto_ms: int | None, initial: pa.Table | None,
           groups: Callable, emit: Callable, initial_groups: Callable | None = None) -> None:
    """Spark's order within a task: ``init``; the initial state (first batch); each key's
    rows (``groups`` yields (key, key group, handler input) in order of first appearance);
    the expired timers in time order; ``close``."""
    handle = StoreHandle(store, timers, batched=True)
    processor.init(handle)
    try:
        names = store.key_names
        if initial is not None and initial.num_rows:
            if initial_groups is None:
                _feed_initial(processor, store, initial, timer_values)
            else:
                for key, _, frames in initial_groups(initial, store):
                    store.set_current_key(key)
                    for frame in frames:
                        try:
                            processor.handleInitialState(key, frame, timer_values)
                        except Exception as e:
                            _note(e, processor, "handleInitialState", key)
                            raise
        keys, kgs = rows.select(names), np.asarray(key_groups, dtype=np.int64)
        store.check_routed_keys(keys, kgs)
        order = bounds = None
        if rows.num_rows:
            order, bounds = _key_order(keys)
            if store.layout.descriptors:
                # One batched read of every distinct key's state (routed: not hashed again).
                first = order[bounds[:-1]]
                distinct = keys.take(first)
                store.prefetch(distinct, kgs[first])
                handle.load(distinct)
        select_key = store.select_key
        for key, kg, key_rows in groups(rows, kgs, store, order, bounds):
            select_key(key, kg)
            try:
                result = processor.handleInputRows(key, key_rows, timer_values)
                if result is not None:
                    emit(result)  # a generator's body runs here
            except Exception as e:
                _note(e, processor, "handleInputRows", key)
                raise
        if timers is not None and fire_upto_ms is not None:
            # As Spark: timers expired when the batch started, in time order; each is deleted
            # after its handler ran (a handler sees it in listTimers, and re-registering the
            # same time does not make it fire again).
            expired = timers.expired(fire_upto_ms)
            if expired and store.layout.descriptors:
                schema = store.layout.key_schema
                expired_keys = pa.table([pa.array([key[i] for _, key in expired], f.type)
                                         for i, f in enumerate(schema)], schema=schema)
                order, bounds = _key_order(expired_keys)
                expired_keys = expired_keys.take(order[bounds[:-1]])
                store.prefetch(expired_keys)
                handle.load(expired_keys)
            for ts, key in expired:
                store.set_current_key(key)
                if ts not in timers.list():
                    continue  # deleted by an earlier handler of this batch
                timers.fired += 1
                try:
                    result = processor.handleExpiredTimer(key, timer_values, ExpiredTimerInfo(ts))
                    if result is not None:
                        emit(result)
                except Exception as e:
                    _note(e, processor, f"handleExpiredTimer (timer {ts})", key)
                    raise
                timers.delete(ts)
    finally:
        processor.close()
    handle.drain()  # a batch that raised writes nothing: its task's store is dropped


def _note(error: Exception, processor: StatefulProcessor, method: str, key: tuple) -> None:
    """Say on the user's exception where it was raised (shown under its message)."""
    error.add_note(f"raised by {type(processor).__name__}.{method} for key {key!r}")


def _row_groups(rows: pa.Table, key_groups: np.ndarray, store: StateStore, order: np.ndarray | None,
                bounds: np.ndarray | None) -> Iterator[tuple[tuple, int, Any]]:
    """Each key's rows as ``Row`` objects, keys in order of first appearance: the rows are
    taken in key order (``_key_order``) and made as ``Row``s in one pass without a Python
    frame per row, then handed out as slices."""
    if rows.num_rows == 0:
        return
    ordered = rows.take(order)
    columns = [c.to_pylist() for c in ordered.columns]
    all_rows = list(map(_row_maker(rows.column_names), zip(*columns, strict=True)))
    starts = bounds[:-1]
    # Each key's tuple from its first row's values (Row.__getitem__ is a Python call).
    key_columns = [columns[rows.column_names.index(n)] for n in store.key_names]
    firsts = starts.tolist()
    keys = zip(*[[c[i] for i in firsts] for c in key_columns], strict=True)
    kgs = key_groups[order[starts]].tolist()
    for key, start, end, kg in zip(keys, firsts, bounds[1:].tolist(), kgs, strict=True):
        yield key, kg, iter(all_rows[start:end])


def _key_order(keys: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Row indices ordered by key (keys in order of first appearance, each key's rows in
    their order) and the bounds of each key's run in that order."""
    index = pl.from_arrow(keys).with_row_index("__i")
    grouped = index.group_by(keys.column_names, maintain_order=True).agg(pl.col("__i"))
    order = grouped.get_column("__i").explode().to_numpy()
    sizes = grouped.get_column("__i").list.len().to_numpy()
    return order, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


UNLIMITED_BYTES = 2**31 - 1  # Spark's default for maxBytesPerBatch: no limit, and no size counted
_BYTE_UNITS = {"b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
               "t": 1 << 40, "tb": 1 << 40, "p": 1 << 50, "pb": 1 << 50}


def byte_size(text: str) -> int:
    """A size as Spark's byte settings take it (``64k``, ``1m``, ``256MB``; a plain number is bytes)."""
    match = re.fullmatch(r"\s*(-?\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in ("", *_BYTE_UNITS):
        raise ValueError(f"not a size in bytes: {text!r}")
    return int(match.group(1)) * _BYTE_UNITS.get(match.group(2).lower(), 1)


@dataclass(frozen=True)
class ArrowBatching:
    """How Spark cuts a key's rows into the DataFrames a pandas processor gets (Spark's Python
    worker, ``transformWithStateInPandas``): a DataFrame ends once it holds ``max_records`` rows
    (``spark.sql.execution.arrow.maxRecordsPerBatch``; 0 or less: no limit) or its rows times
    the task's average Arrow bytes per row reach ``max_bytes``
    (``spark.sql.execution.arrow.maxBytesPerBatch``; counted only when it is set)."""

    max_records: int = 10_000
    max_bytes: int = UNLIMITED_BYTES

    RECORDS_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"
    BYTES_CONF = "spark.sql.execution.arrow.maxBytesPerBatch"

    @classmethod
    def of_session(cls, conf_get: Callable[[str], str | None]) -> ArrowBatching:
        """The session's settings (Spark's defaults where it has none or one that is not a number)."""
        values: dict[str, int] = {}
        for name, key, parse in (("max_records", cls.RECORDS_CONF, int), ("max_bytes", cls.BYTES_CONF, byte_size)):
            try:
                value = conf_get(key)
            except Exception:  # unknown to this Spark and unset
                value = None
            try:
                values[name] = parse(str(value).strip()) if value is not None else getattr(cls, name)
            except ValueError:
                values[name] = getattr(cls, name)
        return cls(**values)

    def rows_per_frame(self, average_row_bytes: float) -> int:
        """Rows in each DataFrame of a key (the last may hold fewer), given the task's average
        Arrow bytes per row."""
        most = self.max_records if self.max_records > 0 else UNLIMITED_BYTES
        if self.max_bytes != UNLIMITED_BYTES and average_row_bytes > 0:
            by_bytes = 1 if self.max_bytes <= 0 else math.ceil(self.max_bytes / average_row_bytes)
            most = min(most, by_bytes)
        return max(1, most)


def _pandas_groups(rows: pa.Table, key_groups: np.ndarray | None, store: StateStore, timezone: str,
                   order: np.ndarray | None = None, bounds: np.ndarray | None = None,
                   batching: ArrowBatching | None = None) -> Iterator[tuple[tuple, int, Any]]:
    """Each key's rows as pandas DataFrames (index from 0; more than one when ``batching``
    cuts them, as Spark's), keys in order of first appearance: the task's rows are ordered
    by key (``_key_order``, computed here when not given) and converted once, then sliced."""
    import pandas as pd

    if rows.num_rows == 0:
        return
    names = store.key_names
    if order is None:
        order, bounds = _key_order(rows.select(names))
    ordered = rows.take(order)
    frame = arrow_to_pandas(ordered, timezone)
    firsts = order[bounds[:-1]]
    keys = list(zip(*[c.to_pylist() for c in rows.select(names).take(firsts).columns], strict=True))
    kgs = key_groups[firsts] if key_groups is not None else None
    batching = batching or ArrowBatching()
    # As Spark's worker: the size per row is the task's average, counted only under a byte limit.
    row_bytes = ordered.nbytes / ordered.num_rows if batching.max_bytes != UNLIMITED_BYTES else 0.0
    step = batching.rows_per_frame(row_bytes)
    cut = step < int(np.max(np.diff(bounds)))  # else every key fits one DataFrame
    for j, key in enumerate(keys):
        start, end = int(bounds[j]), int(bounds[j + 1])
        if not cut:
            part = frame.iloc[start:end]
            part.index = pd.RangeIndex(len(part))  # from 0, as Spark's; cheaper than reset_index
            yield key, -1 if kgs is None else int(kgs[j]), iter([part])
            continue
        parts = []
        for at in range(start, end, step):
            part = frame.iloc[at:min(at + step, end)]
            part.index = pd.RangeIndex(len(part))
            parts.append(part)
        yield key, -1 if kgs is None else int(kgs[j]), iter(parts)


def arrow_to_pandas(table: pa.Table, timezone: str = "UTC") -> Any:
    """Arrow rows as the pandas DataFrame Spark's pandas UDFs get: timestamps as naive
    ``datetime64[ns]`` in the session's time zone, dates as ``datetime.date``, structs as dicts."""
    frame = table.to_pandas(coerce_temporal_nanoseconds=True, date_as_object=True, maps_as_pydicts="strict")
    for f in table.schema:
        if pa.types.is_timestamp(f.type) and f.type.tz is not None:
            frame[f.name] = frame[f.name].dt.tz_convert(timezone).dt.tz_localize(None)
    return frame


def frames_to_arrow(frames: list, schema: pa.Schema, timezone: str = "UTC", what: str = "processor output",
                    ) -> pa.Table:
    """pandas DataFrames yielded by a processor as an Arrow table of ``schema``: columns by
    name (by position when the frame's columns are not strings, as Spark), naive timestamps
    read in the session's time zone; a clear error when a frame does not fit."""
    import pandas as pd

    if not frames:
        return schema.empty_table()
    names = schema.names
    parts = []
    for frame in frames:
        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"{what}: handlers of a pandas processor must yield pandas.DataFrames, got "
                            f"{type(frame).__name__}")
        if list(frame.columns) == names:  # the schema's columns in its order: as it is
            parts.append(frame)
            continue
        if all(isinstance(c, str) for c in frame.columns):
            missing = [n for n in names if n not in frame.columns]
            if missing:
                raise ValueError(f"{what}: DataFrame lacks column(s) {missing} of the declared output schema "
                                 f"{names}; it has {list(frame.columns)}")
            frame = frame[names]
        elif len(frame.columns) != len(names):
            raise ValueError(f"{what}: DataFrame has {len(frame.columns)} column(s); the declared output schema "
                             f"has {len(names)}: {names}")
        else:
            frame = frame.set_axis(names, axis=1)
        parts.append(frame)
    # One concatenation; a frame's columns are selected only when they differ from the schema's
    # (a selection costs more than a one-row frame's whole conversion).
    frame = pd.concat(parts, ignore_index=True, copy=False) if len(parts) > 1 else parts[0]
    arrays = []
    for f in schema:
        col = frame[f.name]
        if pa.types.is_timestamp(f.type) and f.type.tz is not None and pd.api.types.is_datetime64_dtype(col) \
                and getattr(col.dt, "tz", None) is None:
            col = col.dt.tz_localize(timezone)
        try:
            arrays.append(pa.array(col, type=f.type, from_pandas=True))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError, ValueError) as e:
            raise TypeError(f"{what}: column {f.name!r} does not match the declared type {f.type}: {e}") from e
    return pa.Table.from_arrays(arrays, schema=schema)


def _feed_initial(processor: StatefulProcessor, store: StateStore, initial: pa.Table, timer_values: TimerValues,
                  ) -> None:
    columns = initial.column_names
    key_idx = [columns.index(n) for n in store.key_names]
    row = _row_maker(columns)
    for values in zip(*[c.to_pylist() for c in initial.columns], strict=True):
        key = tuple(values[i] for i in key_idx)
        store.set_current_key(key)
        processor.handleInitialState(key, row(values), timer_values)


def rows_to_arrow(rows: list, schema: pa.Schema, what: str = "processor output") -> pa.Table:
    """Output rows (Rows, tuples or dicts) as an Arrow table of ``schema``; a clear error when
    a row does not match it."""
    if not rows:
        return schema.empty_table()
    names = schema.names
    tuples = []
    for r in rows:
        if isinstance(r, Row) and hasattr(r, "__fields__"):
            if r.__fields__ == names:  # named in the schema's order: the Row is that tuple
                tuples.append(r)
                continue
            r = r.asDict()  # a named Row matches by name, as Spark's worker does
        if isinstance(r, dict):
            extra = [k for k in r if k not in names]
            if extra:
                raise ValueError(f"{what}: row has field(s) {extra} that the declared output schema {names} lacks")
            r = tuple(r.get(n) for n in names)
        elif not isinstance(r, (tuple, list)):
            raise TypeError(f"{what}: rows must be Row, tuple or dict, got {type(r).__name__} ({r!r})")
        if len(r) != len(names):
            raise ValueError(f"{what}: row {r!r} has {len(r)} field(s); the declared output schema has "
                             f"{len(names)}: {names}")
        tuples.append(r)
    arrays = []
    for col, f in zip(zip(*tuples, strict=True), schema, strict=True):  # one transposition in C
        try:
            arrays.append(pa.array(col, type=f.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            raise TypeError(f"{what}: column {f.name!r} does not match the declared type {f.type}: {e}") from e
    return pa.Table.from_arrays(arrays, schema=schema)
