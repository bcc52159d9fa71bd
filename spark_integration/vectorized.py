"""Vectorized processors: a task's micro-batch rows and their keys' state as Arrow, in one call.

A ``VectorizedProcessor`` sees all rows of one task's key-group range at once, together
with the current value of every declared value state for the distinct keys among them
(one batched lookup), and returns its outputs and the new state values as Arrow tables.
There is no per-key Python: a keyed running count over a micro-batch is one polars
group-by, one join and one batched write.

Ready-made operators: ``RunningAggregate`` (keyed running count, sum, min or max, emitting
each updated key's new value) and ``Deduplicate`` (emit the first row of each key ever
seen, optionally forgetting keys after a TTL).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

from statestore.descriptors import StateDescriptor, StateKind, TtlConfig, ValueStateDescriptor
from statestore.errors import StateNotDeclaredError
from statestore.operator_state import OperatorListState, OperatorStateDescriptor
from statestore.store import StateStore


@dataclass
class VectorizedBatch:
    """What a vectorized processor gets for one task and micro-batch.

    rows: the input rows of the task's key groups (with the key columns).
    keys: the distinct keys of ``rows``, in order of first appearance.
    state: ``keys`` plus one column per declared value state, named after it: the key's
        current value, or null when it has none.
    processing_time_ms, watermark_ms: the batch's times (watermark -1 outside event time).
    store: the task's store, for the batched list and map APIs.
    """

    rows: pa.Table
    keys: pa.Table
    state: pa.Table
    processing_time_ms: int
    watermark_ms: int
    store: StateStore

    def operator_state(self, name: str) -> OperatorListState:
        """The task's list of operator state variable ``name`` (``VectorizedProcessor.operator_state``
        declares it): the task's own list, checkpointed with the keyed state and redistributed by
        the variable's mode when the query restarts at another parallelism."""
        if self.store.operator_state is None:
            raise StateNotDeclaredError(f"operator state {name!r}: the processor declares no operator state "
                                        "(VectorizedProcessor.operator_state)")
        return self.store.operator_state.get_list_state(name)


@dataclass
class VectorizedResult:
    """What a vectorized processor returns.

    output: rows of the query's output schema (None for none).
    updates: key columns plus a column per value state to set; a null leaves that key's
        value unchanged.
    deletes: key columns of keys whose value states are all cleared.
    """

    output: pa.Table | None = None
    updates: pa.Table | None = None
    deletes: pa.Table | None = None


class VectorizedProcessor(abc.ABC):
    """Stateful logic over whole micro-batches, in Arrow."""

    @abc.abstractmethod
    def state_variables(self, input_schema: pa.Schema, keys: list[str]) -> list[StateDescriptor]:
        """The state variables (declared once, on the driver, before any state is written)."""

    def output_schema(self, input_schema: pa.Schema, keys: list[str]) -> pa.Schema | None:
        """The output schema when the processor knows it (then the query needs none)."""
        return None

    def input_columns(self, input_schema: pa.Schema, keys: list[str]) -> list[str] | None:
        """The input columns ``process`` reads (None: all); the others never leave the JVM."""
        return None

    def operator_state(self, input_schema: pa.Schema, keys: list[str]) -> list[OperatorStateDescriptor]:
        """Operator (non-keyed) state, FLIP-8's: list variables of each task
        (``VectorizedBatch.operator_state``), redistributed by their mode (split, union,
        broadcast) when the query restarts at another parallelism. None by default."""
        return []

    @abc.abstractmethod
    def process(self, batch: VectorizedBatch) -> VectorizedResult:
        """Outputs and state updates of one task's micro-batch."""


_AGGS = ("count", "sum", "min", "max")
_FIRST = "__icestate_first_row"  # a key's first row in a batch (run_vectorized)


class RunningAggregate(VectorizedProcessor):
    """Keyed running ``count`` (of rows) or ``sum``/``min``/``max`` (of ``value_column``).

    Emits, for every key updated in a micro-batch, the key and its new aggregate (column
    ``output_column``, by default the aggregate's name). The state variable is a value
    state named ``state_name`` (default: the aggregate's name).
    """

    def __init__(self, agg: str = "count", value_column: str | None = None, *, output_column: str | None = None,
                 state_name: str | None = None, ttl_ms: int | None = None):
        if agg not in _AGGS:
            raise ValueError(f"RunningAggregate: agg must be one of {_AGGS}, got {agg!r}")
        if agg != "count" and not value_column:
            raise ValueError(f"RunningAggregate({agg!r}) needs value_column=, the column to aggregate")
        self.agg = agg
        self.value_column = value_column
        self.output_column = output_column or agg
        self.state_name = state_name or agg
        self.ttl = TtlConfig(ttl_ms) if ttl_ms else None

    def _value_type(self, input_schema: pa.Schema) -> pa.DataType:
        if self.agg == "count":
            return pa.int64()
        if self.value_column not in input_schema.names:
            raise ValueError(f"RunningAggregate: value column {self.value_column!r} is not an input column "
                             f"{input_schema.names}")
        t = input_schema.field(self.value_column).type
        if self.agg == "sum":
            if pa.types.is_integer(t):
                return pa.int64()
            if pa.types.is_floating(t) or pa.types.is_decimal(t):
                return pa.float64() if pa.types.is_floating(t) else t
            raise TypeError(f"RunningAggregate('sum'): column {self.value_column!r} is {t}, not numeric")
        return t

    def state_variables(self, input_schema: pa.Schema, keys: list[str]) -> list[StateDescriptor]:
        return [ValueStateDescriptor(self.state_name, self._value_type(input_schema), ttl=self.ttl)]

    def output_schema(self, input_schema: pa.Schema, keys: list[str]) -> pa.Schema:
        fields = [input_schema.field(k) for k in keys]
        return pa.schema([*fields, pa.field(self.output_column, self._value_type(input_schema))])

    def input_columns(self, input_schema: pa.Schema, keys: list[str]) -> list[str]:
        return [*keys, *([self.value_column] if self.value_column else [])]

    def process(self, batch: VectorizedBatch) -> VectorizedResult:
        keys = batch.keys.column_names
        rows = pl.from_arrow(batch.rows)
        if self.agg == "count":
            delta = rows.group_by(keys, maintain_order=True).agg(pl.len().cast(pl.Int64).alias("_d"))
        else:
            fn = getattr(pl.col(self.value_column), self.agg)
            delta = rows.group_by(keys, maintain_order=True).agg(fn().alias("_d"))
        old = pl.from_arrow(batch.state).rename({self.state_name: "_o"})
        joined = delta.join(old, on=keys, how="left", maintain_order="left")
        if self.agg in ("count", "sum"):
            new = pl.col("_o").fill_null(0) + pl.col("_d")
        elif self.agg == "min":
            new = pl.min_horizontal("_o", "_d")
        else:
            new = pl.max_horizontal("_o", "_d")
        state_type = batch.state.schema.field(self.state_name).type
        result = joined.select(*keys, new.alias("_n")).to_arrow()
        value = result.column("_n").cast(state_type)
        key_table = result.select(keys).cast(batch.keys.schema)
        output = key_table.append_column(self.output_column, value)
        updates = key_table.append_column(self.state_name, value)
        return VectorizedResult(output=output, updates=updates)


class Deduplicate(VectorizedProcessor):
    """Emit the first row of every key never seen before (Spark's ``dropDuplicates`` on the
    key columns), remembering keys in a value state, for ``ttl_ms`` when given."""

    def __init__(self, *, ttl_ms: int | None = None, state_name: str = "seen"):
        self.state_name = state_name
        self.ttl = TtlConfig(ttl_ms) if ttl_ms else None

    def state_variables(self, input_schema: pa.Schema, keys: list[str]) -> list[StateDescriptor]:
        return [ValueStateDescriptor(self.state_name, pa.bool_(), ttl=self.ttl)]

    def output_schema(self, input_schema: pa.Schema, keys: list[str]) -> pa.Schema:
        return input_schema

    def process(self, batch: VectorizedBatch) -> VectorizedResult:
        keys = batch.keys.column_names
        rows = pl.from_arrow(batch.rows)
        first = rows.unique(subset=keys, keep="first", maintain_order=True)
        seen = pl.from_arrow(batch.state).filter(pl.col(self.state_name).is_not_null()).select(keys)
        fresh = first.join(seen, on=keys, how="anti", maintain_order="left")
        out = fresh.to_arrow().cast(batch.rows.schema)
        updates = out.select(keys).cast(batch.keys.schema)
        updates = updates.append_column(self.state_name, pa.array([True] * updates.num_rows, pa.bool_()))
        return VectorizedResult(output=out, updates=updates)


def value_states(store: StateStore) -> list[StateDescriptor]:
    return [d for d in store.layout.descriptors if d.kind is StateKind.VALUE]


def run_vectorized(processor: VectorizedProcessor, store: StateStore, rows: pa.Table,
                   processing_time_ms: int, watermark_ms: int,
                   key_groups: np.ndarray | None = None) -> pa.Table | None:
    """One task's micro-batch through ``processor``: batched lookup, process, batched writes.

    ``key_groups``: each row's key group when the rows carry it (routed by Spark, which
    computed it with the same hash); the keys are then not hashed again."""
    names = store.key_names
    key_rows = pl.from_arrow(rows.select(names))
    if key_groups is None:
        keys, _ = store.prepare_keys(key_rows.unique(maintain_order=True).to_arrow())
    else:
        first = key_rows.with_row_index(_FIRST).unique(subset=names, keep="first", maintain_order=True)
        keys, _ = store.prepare_keys(first.drop(_FIRST).to_arrow(),
                                     key_groups=np.asarray(key_groups)[first.get_column(_FIRST).to_numpy()])
    state = keys
    for desc in value_states(store):
        state = state.append_column(desc.name, store.get_state(desc.name).get_batch(keys))
    result = processor.process(VectorizedBatch(rows, keys, state, processing_time_ms, watermark_ms, store))
    if not isinstance(result, VectorizedResult):
        raise TypeError(f"{type(processor).__name__}.process must return a VectorizedResult, got "
                        f"{type(result).__name__}")
    if result.deletes is not None and result.deletes.num_rows:
        deletes = result.deletes.select(names)
        for desc in value_states(store):
            store.get_state(desc.name).clear_batch(deletes)
    if result.updates is not None and result.updates.num_rows:
        apply_updates(store, result.updates)
    return result.output


def apply_updates(store: StateStore, updates: pa.Table) -> None:
    """Set value states from ``updates`` (key columns + one column per value state; null = unchanged)."""
    names = store.key_names
    declared = {d.name for d in value_states(store)}
    unknown = [c for c in updates.column_names if c not in names and c not in declared]
    if unknown:
        raise ValueError(f"state updates have column(s) {unknown} that are neither key columns {names} nor "
                         f"declared value states {sorted(declared)}")
    for name in updates.column_names:
        if name in names:
            continue
        col = updates.column(name)
        if col.null_count:
            mask = col.is_valid()
            part = updates.filter(mask)
            store.get_state(name).update_batch(part.select(names), part.column(name))
        else:
            store.get_state(name).update_batch(updates.select(names), col)
