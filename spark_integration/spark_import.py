"""Bring a stopped Spark query's state over from Spark's own state store: ``import_spark_state``.

A query that ran ``transformWithState`` (or ``transformWithStateInPandas``), an aggregation
(``groupBy().agg()``) or ``dropDuplicates`` on Spark's state store keeps its state in its
checkpoint directory, which Spark's state data source reads (``format("statestore")``: one state
variable at a time, at a committed batch). The first continues with the same processor here, the
others with the vectorized processor that does their work (``RunningAggregate`` of one of the
aggregation's aggregates, ``Deduplicate``). The import:

1. reads the checkpoint (``read_spark_checkpoint``): the query's id (``metadata``), its last
   committed batch n (``commits``), its stateful operator (``format("state-metadata")``) with its
   time mode and state variables, and the watermarks of batch n;
2. copies the checkpoint's progress, everything but its ``state`` directory (the query id, the
   offset and commit logs, the sources' own logs), to a new checkpoint location: the same stream
   started there continues at batch n + 1 from Spark's offsets, so no input row is lost or read
   twice. With timers, each offset-log entry gets the ticks source's starting offset
   (``spark_integration.ticks``), the source a query with timers has here. Spark's checkpoint is
   only read: the query can go back to Spark's store;
3. loads every state variable into a new state table as its first checkpoint, the bulk load of
   ``catalog.repair``: values, lists (elements in order, each with its own TTL expiry), map
   entries and registered timers (an aggregate per key, a key seen), as of batch n, with the
   query's id and what is due next (the watermark, the earliest timer), so the stream's next
   batch plans on it as on the checkpoint its own batch n would have written. The live row
   count starts from the imported rows.

Running it again after a failure goes on where it stopped: the copy is repeated into a location
that holds the same query, and a table that holds this import and nothing after it is kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from catalog.repair import Repair
from spark_integration.compat import arrow_type, declare
from spark_integration.dropin import HadoopFiles, state_location
from spark_integration.query import is_connect
from spark_integration.ticks import is_ticks_offset
from spark_integration.timers import TIMERS_STATE, timers_descriptor
from spark_integration.vectorized import Deduplicate, RunningAggregate, VectorizedProcessor
from statestore import stored_keys
from statestore.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateDescriptor,
    StateKind,
    ValueStateDescriptor,
)
from statestore.errors import SchemaMismatchError, StateStoreError
from statestore.layout import EXPIRE_AT_MS, StateLayout

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StatefulProcessor

    from spark_integration.location import StateLocation

log = logging.getLogger(__name__)

# Spark's names: the stateful operators of transformWithState, the state variable kinds of its
# operator metadata, its time modes, and the columns of its state data source.
TWS_OPERATORS = ("transformWithStateExec", "transformWithStateInPySparkExec", "transformWithStateInPandasExec")
AGGREGATE, DEDUPLICATE = "stateStoreSave", "dedupe"  # groupBy().agg(), dropDuplicates()
_KINDS = {"ValueState": StateKind.VALUE, "ListState": StateKind.LIST, "MapState": StateKind.MAP}
_TIME_MODES = {"NoTime": "none", "ProcessingTime": "processingtime", "EventTime": "eventtime"}
_TTL_FIELD = "ttlExpirationMs"
#: The ticks source's offset before its first tick (``ticks._Reader.initialOffset``).
TICKS_START = json.dumps({"ticks": 0, "checkpoint": -1})
#: Recorded with the imported checkpoint: where its state came from.
SUMMARY_IMPORTED_FROM = "icestate.imported-from"


class SparkStateImportError(StateStoreError, ValueError):
    """A Spark checkpoint whose state cannot be brought over as asked (what and why in the
    message); nothing of the import was committed."""


@dataclasses.dataclass(frozen=True)
class SparkVariable:
    """A state variable of Spark's operator, as its metadata and state data source give it."""

    descriptor: StateDescriptor      # as a processor declaring it gets it (its kind, types)
    ttl: bool                        # Spark stores an expiry with each value

    @property
    def name(self) -> str:
        return self.descriptor.name


@dataclasses.dataclass(frozen=True)
class SparkCheckpoint:
    """What an import needs of a stopped query's checkpoint (``read_spark_checkpoint``)."""

    location: str
    query_id: str
    batch_id: int                    # the last committed batch
    operator_id: int
    operator: str
    time_mode: str                   # none, processingtime or eventtime
    key_schema: pa.Schema
    variables: tuple[SparkVariable, ...]
    watermark_ms: int                # batch n's watermark
    next_watermark_ms: int           # the one Spark gives batch n + 1 (its commit log)
    aggregates: pa.DataType | None = None  # an aggregation's buffer: a struct, a field per aggregate


@dataclasses.dataclass
class ImportReport:
    """What an import did."""

    table: str
    checkpoint_id: int
    batch_id: int
    to: str                          # the new checkpoint location
    rows: dict[str, int]             # rows read per state variable (a list's elements; timers)
    seconds: float
    resumed: bool = False            # the state was there already (an earlier run's)


# ---------------------------------------------------------------------------- reading Spark's checkpoint

def read_spark_checkpoint(spark: SparkSession, location: str, operator_id: int = 0) -> SparkCheckpoint:
    """Read what an import needs of the stopped query at ``location`` (its checkpointLocation).

    Raises:
        SparkStateImportError: not a query's checkpoint, no committed batch, or an operator whose
            state this cannot import (what and what to do in the message).
    """
    files = HadoopFiles(spark, location)
    root = files.root
    try:
        query_id = str(json.loads(files.read_text(files.join(root, "metadata")))["id"])
    except Exception as e:
        raise SparkStateImportError(f"{location} is not a streaming query's checkpoint (no readable metadata: {e}); "
                                    "give the checkpointLocation the query ran with") from None
    committed = [int(n) for n in files.names(files.join(root, "commits")) if n.isdigit()]
    if not committed:
        raise SparkStateImportError(f"the query of {location} committed no batch: there is no state to import; start "
                                    "the query on icestate from the beginning instead")
    batch = max(committed)
    rows = spark.read.format("state-metadata").load(root).collect()
    if not rows:
        raise SparkStateImportError(f"the query of {location} has no stateful operator: there is no state to import")
    ops = {r.operatorId: r for r in rows}
    if operator_id not in ops:
        raise SparkStateImportError(f"the query of {location} has no stateful operator {operator_id}; it has "
                                    f"{sorted(ops)}")
    op = ops[operator_id]
    position = dict(location=root, query_id=query_id, batch_id=batch, operator_id=operator_id, operator=op.operatorName,
                    **_watermarks(files, root, batch))
    if op.operatorName in (AGGREGATE, DEDUPLICATE):  # one state store of key -> value
        schema = _reader(spark, root, batch, operator_id).load(root).schema
        buffer = arrow_type(schema["value"].dataType) if op.operatorName == AGGREGATE else None
        return SparkCheckpoint(**position, time_mode="none", key_schema=_key_schema(schema), variables=(),
                               aggregates=buffer)
    if op.operatorName not in TWS_OPERATORS:
        raise SparkStateImportError(
            f"operator {operator_id} of {location} is Spark's {op.operatorName}: the import brings over the state of "
            f"transformWithState and transformWithStateInPandas ({', '.join(TWS_OPERATORS)}), of an aggregation "
            f"({AGGREGATE}) and of dropDuplicates ({DEDUPLICATE})"
            + (f"; the query's operators are {[r.operatorName for r in rows]}" if len(rows) > 1 else ""))
    try:
        props = json.loads(op.operatorProperties or "{}")
        declared = [(str(v["stateName"]), str(v["stateVariableType"]), bool(v.get("ttlEnabled")))
                    for v in props.get("stateVariables", [])]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise SparkStateImportError(f"the operator metadata of {location} does not read ({type(e).__name__}: {e}): "
                                    "the checkpoint is damaged; nothing was imported") from None
    mode = _TIME_MODES.get(props.get("timeMode"))
    if mode is None:
        raise SparkStateImportError(f"operator {operator_id} of {location} has time mode {props.get('timeMode')!r}, "
                                    f"which this version does not know (known: {sorted(_TIME_MODES)})")
    key_schema, variables = None, []
    for name, kind, ttl in declared:
        if name.startswith("$"):  # Spark's own: timers and TTL indexes (timers are read apart)
            continue
        if kind not in _KINDS:
            raise SparkStateImportError(f"state variable {name!r} of {location} is a {kind}, which this version does "
                                        f"not import (it imports {sorted(_KINDS)})")
        schema = _reader(spark, root, batch, operator_id, stateVarName=name,
                         flattenCollectionTypes="true").load(root).schema
        key_schema = _key_schema(schema)
        variables.append(_variable(name, _KINDS[kind], ttl, schema))
    if key_schema is None:  # no variable: the key schema is the timers'
        schema = _reader(spark, root, batch, operator_id, readRegisteredTimers="true").load(root).schema
        key_schema = _key_schema(schema)
    return SparkCheckpoint(**position, time_mode=mode, key_schema=key_schema, variables=tuple(variables))


def _watermarks(files: HadoopFiles, root: str, batch: int) -> dict[str, int]:
    """Batch ``batch``'s watermark (its offset-log entry) and the one Spark gives the next batch
    (its commit-log entry), as Spark wrote them: JSON, read as data."""
    name = f"offsets/{batch}"
    try:
        watermark = int(json.loads(files.read_text(files.join(root, name)).splitlines()[1]).get("batchWatermarkMs")
                        or 0)
        name = f"commits/{batch}"
        lines = files.read_text(files.join(root, name)).splitlines()
        following = int(json.loads(lines[1]).get("nextBatchWatermarkMs") or 0) if len(lines) > 1 else 0
    except Exception as e:
        raise SparkStateImportError(f"{root}/{name} is not an entry of Spark's log ({type(e).__name__}: {e}): the "
                                    "checkpoint is damaged; nothing was imported") from None
    return {"watermark_ms": watermark, "next_watermark_ms": following}


def _reader(spark: SparkSession, root: str, batch: int, operator_id: int, **options: str) -> Any:
    reader = spark.read.format("statestore").option("batchId", batch).option("operatorId", operator_id)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader


def _key_schema(schema: Any) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema["key"].dataType, timezone="UTC")


def _variable(name: str, kind: StateKind, ttl: bool, schema: Any) -> SparkVariable:
    """The descriptor a processor declaring this variable gets (``compat.DeclaringHandle``), from
    the state data source's schema of it (flattened)."""
    def value(column: str) -> pa.DataType:
        t = schema[column].dataType
        return arrow_type(t["value"].dataType if ttl else t)

    if kind is StateKind.VALUE:
        desc: StateDescriptor = ValueStateDescriptor(name, value("value"))
    elif kind is StateKind.LIST:
        desc = ListStateDescriptor(name, value("list_element"))
    else:
        desc = MapStateDescriptor(name, key_type=arrow_type(schema["user_map_key"].dataType),
                                  value_type=value("user_map_value"))
    return SparkVariable(desc, ttl)


# ---------------------------------------------------------------------------- the import

def import_spark_state(
    spark: SparkSession,
    checkpoint: str,
    to: str,
    *,
    location: StateLocation | None = None,
    query_name: str | None = None,
    processor: StatefulProcessor | VectorizedProcessor | None = None,
    operator_id: int = 0,
    progress: Callable[[Iterable[Any], str, int], Iterable[Any]] | None = None,
) -> ImportReport:
    """Bring the state of the stopped query at ``checkpoint`` over (module docstring): its
    progress copied to the new checkpoint location ``to``, its state loaded into a new state
    table. Start the same query on ``to`` afterwards: it continues at the batch after Spark's last.

    Args:
        spark: a classic session (the checkpoint is read and copied through its Hadoop filesystem).
        checkpoint: the query's checkpointLocation on Spark's store; only read.
        to: the checkpoint location the query continues on; must be new (or an earlier attempt's).
        location: the state table (``StateLocation``). Default: the table that ``enable(spark)``'s
            switch gives a query named ``query_name`` on checkpoint ``to``.
        query_name: the query's ``queryName``, for the default ``location``.
        processor: the query's processor: its declarations are checked against Spark's state (and
            give the state variables' TTL durations, which Spark does not record). For an
            aggregation's state a ``RunningAggregate`` of one of its aggregates, for
            ``dropDuplicates``'s a ``Deduplicate``: the vectorized processor the query continues with.
        operator_id: which stateful operator of the query (Spark's operatorId).
        progress: wraps the steps (an iterable, a description, their number), e.g. a progress bar.

    Raises:
        SparkStateImportError: what cannot be imported, or ``to`` / the table hold something else.
        SchemaMismatchError: the processor declares state that Spark's does not match.
    """
    if is_connect(spark):
        raise SparkStateImportError("the import reads and copies Spark's checkpoint through the JVM: run it with a "
                                    "classic SparkSession (or the icestate import-spark-state command)")
    started = time.perf_counter()
    source = read_spark_checkpoint(spark, checkpoint, operator_id)
    if location is None:
        location = state_location(spark, query_name, to)
    descriptors = _vectorized(source, processor) if source.operator in (AGGREGATE, DEDUPLICATE) else _declared(
        source, processor)
    if source.time_mode != "none":
        descriptors.append(timers_descriptor())
    layout = StateLayout.of(source.key_schema, descriptors, location.max_parallelism)
    copy_progress(spark, source, to)
    table = location.open(layout)
    try:
        info = table.current_checkpoint()
        if info is not None:
            if _is_this_import(info, source):
                return ImportReport(table=location.identifier, checkpoint_id=info.checkpoint_id,
                                    batch_id=source.batch_id, to=to, rows={}, resumed=True,
                                    seconds=time.perf_counter() - started)
            raise SparkStateImportError(
                f"state table {location.identifier} holds state already (checkpoint {info.checkpoint_id}): import into "
                "a new table (another location or query name), or drop this one first")
        aggregate = processor.agg if source.operator == AGGREGATE else None
        rows = _load(spark, table, source, layout, progress, aggregate)
        return ImportReport(table=location.identifier, checkpoint_id=table.current_checkpoint().checkpoint_id,
                            batch_id=source.batch_id, to=to, rows=rows, seconds=time.perf_counter() - started)
    finally:
        table.close()


def _declared(source: SparkCheckpoint, processor: StatefulProcessor | None) -> list[StateDescriptor]:
    """Spark's variables as descriptors; with the processor's TTL durations when it is given,
    after checking that it declares each as Spark stores it."""
    imported = [v.descriptor for v in source.variables]
    if processor is None:
        return imported
    declared = {d.name: d for d in declare(processor).descriptors}
    for v in source.variables:
        d = declared.get(v.name)
        if d is None:
            continue  # a variable the processor no longer declares: kept, as Spark keeps it
        theirs, ours = v.descriptor, d
        if (theirs.kind, str(theirs.value_type), str(theirs.user_key_type)) != (
                ours.kind, str(ours.value_type), str(ours.user_key_type)):
            raise SchemaMismatchError(
                f"state {v.name!r}: Spark's checkpoint stores a {theirs.kind.value} state of "
                f"{theirs.value_type}" + (f" by {theirs.user_key_type}" if theirs.kind is StateKind.MAP else "")
                + f", the processor declares a {ours.kind.value} state of {ours.value_type}"
                + (f" by {ours.user_key_type}" if ours.kind is StateKind.MAP else "")
                + ": import with the processor the query ran with")
        if (ours.ttl is not None) != v.ttl:
            raise SchemaMismatchError(
                f"state {v.name!r} has {'a' if v.ttl else 'no'} TTL in Spark's checkpoint, but the processor declares "
                f"{'one' if ours.ttl is not None else 'none'}: import with the processor the query ran with")
    return [declared.get(v.name, v.descriptor) for v in source.variables]


def _vectorized(source: SparkCheckpoint, processor: Any) -> list[StateDescriptor]:
    """The state variable of the vectorized processor that continues an aggregation (one of its
    aggregates: ``RunningAggregate``) or a ``dropDuplicates`` (``Deduplicate``)."""
    keys = source.key_schema.names
    if source.operator == DEDUPLICATE:
        if not isinstance(processor, Deduplicate):
            raise SparkStateImportError("the query's state is dropDuplicates': give processor=Deduplicate(), the "
                                        "vectorized processor that continues it")
        return processor.state_variables(source.key_schema, keys)
    aggregates = {f.name: f.type for f in source.aggregates}
    if not isinstance(processor, RunningAggregate) or processor.agg not in aggregates:
        raise SparkStateImportError(
            f"the query's state is an aggregation's, of {sorted(aggregates)}: give processor=RunningAggregate(agg, "
            "value_column), with agg one of those, the vectorized processor that continues it")
    fields = list(source.key_schema)
    if processor.value_column:
        fields.append(pa.field(processor.value_column, aggregates[processor.agg]))
    return processor.state_variables(pa.schema(fields), keys)


def _is_this_import(info: Any, source: SparkCheckpoint) -> bool:
    props = info.properties
    return (props.get(SUMMARY_IMPORTED_FROM) == source.location and info.batch_id == source.batch_id
            and props.get(stored_keys.QUERY_ID) == source.query_id)


# ---------------------------------------------------------------------------- the progress

def copy_progress(spark: SparkSession, source: SparkCheckpoint, to: str) -> int:
    """Copy the query's progress (everything but ``state/``) from its checkpoint to ``to``, with
    the ticks source's starting offset in each offset-log entry when the query has timers; returns
    the files copied.

    Raises:
        SparkStateImportError: ``to`` holds another query's checkpoint, or is the source itself.
    """
    src = HadoopFiles(spark, source.location)
    dst = HadoopFiles(spark, to)
    if dst.root.rstrip("/") == src.root.rstrip("/"):
        raise SparkStateImportError(f"{to} is the query's own checkpoint: give a new location (Spark's stays as it "
                                    "is, so the query can go back to Spark's store)")
    if dst.exists(dst.root) and dst.names(dst.root):
        try:
            there = json.loads(dst.read_text(dst.join(dst.root, "metadata")))["id"]
        except Exception:
            there = None
        if there != source.query_id:
            raise SparkStateImportError(f"{to} is not empty and holds no earlier import of this query: give a new "
                                        "checkpoint location")
    copied = 0
    for path, relative in src.walk(src.root):
        if relative.split("/", 1)[0] == "state":
            continue
        target = dst.join(dst.root, relative)
        top, _, name = relative.partition("/")
        if top == "offsets" and name.isdigit() and source.time_mode != "none":
            dst.write_text(target, _with_ticks(src.read_text(path)), overwrite=True)
        else:
            src.copy(path, dst, target)
        copied += 1
    return copied


def _with_ticks(entry: str) -> str:
    """An offset-log entry (``v1``, the batch's metadata, one offset per source) with the ticks
    source's offset last: a query with timers reads its input unioned with the ticks source."""
    lines = entry.rstrip("\n").split("\n")
    if any(is_ticks_offset(line) for line in lines[2:]):
        return entry
    return "\n".join([*lines, TICKS_START])


# ---------------------------------------------------------------------------- the state

def _load(spark: SparkSession, table: Any, source: SparkCheckpoint, layout: StateLayout,
          progress: Callable[[Iterable[Any], str, int], Iterable[Any]] | None,
          aggregate: str | None) -> dict[str, int]:
    """Read each variable and the timers into one bulk load, committed as the table's first
    checkpoint at Spark's last batch (of an aggregation, the ``aggregate`` field of its buffer).
    Spark's reader takes a variable whole (its ``partitionId`` option does not select a state
    partition of ``transformWithState``'s). Returns the rows read per variable."""
    if source.operator in (AGGREGATE, DEDUPLICATE):
        steps = [layout.descriptors[0].name]  # the one store: key -> value
    else:
        steps = [v.name for v in source.variables] + ([TIMERS_STATE] if source.time_mode != "none" else [])
    if progress is not None:
        steps = progress(steps, "importing state", len(steps))
    variables = {v.name: v for v in source.variables}
    key_names = layout.key_names
    counts: dict[str, int] = {}
    stream = {stored_keys.QUERY_ID: source.query_id, SUMMARY_IMPORTED_FROM: source.location}
    if source.time_mode != "none":
        stream[stored_keys.QUERY_WATERMARK_MS] = str(source.watermark_ms)
        stream[stored_keys.QUERY_NEXT_WATERMARK_MS] = str(source.next_watermark_ms)
    with Repair(table, reason=f"imported from Spark's checkpoint {source.location} at batch {source.batch_id}") as load:
        for name in steps:
            if name in variables:
                counts[name] = _load_variable(spark, load, source, variables[name], key_names)
            elif name == TIMERS_STATE:
                counts[name], earliest = _load_timers(spark, load, source, key_names)
                if earliest is not None:
                    stream[stored_keys.QUERY_NEXT_TIMER_MS] = str(earliest)
            else:
                counts[name] = _load_store(spark, load, source, layout.descriptor(name), key_names, aggregate)
        load.commit(batch_id=source.batch_id, stream=stream)
    return counts


def _load_timers(spark: SparkSession, load: Repair, source: SparkCheckpoint,
                 key_names: list[str]) -> tuple[int, int | None]:
    """The registered timers, into the timers' map state: how many, and the earliest."""
    rows = _read(spark, source, readRegisteredTimers="true")
    if not rows.num_rows:
        return 0, None
    timers = rows.column("expiration_timestamp_ms")
    desc = timers_descriptor()
    load.put(TIMERS_STATE, _with_columns(_keys(rows, key_names), {
        desc.user_key_column: timers, desc.value_column: pa.array(np.ones(rows.num_rows, bool))}))
    return rows.num_rows, pc.min(timers).as_py()


def _load_store(spark: SparkSession, load: Repair, source: SparkCheckpoint, desc: StateDescriptor,
                key_names: list[str], aggregate: str | None) -> int:
    """An aggregation's or a deduplication's one store (key -> buffer, key -> nothing) into the
    value state of the vectorized processor that continues it: the ``aggregate`` field of the
    buffer, or that the key was seen."""
    rows = _read(spark, source)
    if aggregate is not None:
        value = rows.column("value").combine_chunks().field(aggregate)
    else:
        value = pa.array(np.ones(rows.num_rows, bool))
    load.put(desc.name, _with_columns(_keys(rows, key_names), {desc.value_column: value}))
    return rows.num_rows


def _load_variable(spark: SparkSession, load: Repair, source: SparkCheckpoint, variable: SparkVariable,
                   key_names: list[str]) -> int:
    """One ``transformWithState`` variable: its values, list elements or map entries read."""
    desc = variable.descriptor
    if desc.kind is StateKind.LIST:
        # Unflattened, a key's list comes whole and in order.
        rows = _read(spark, source, stateVarName=variable.name, flattenCollectionTypes="false")
        if not rows.num_rows:
            return 0
        lists = rows.column("list_value").combine_chunks()
        parents = pc.list_parent_indices(lists)
        elements = pc.list_flatten(lists)
        keys = _keys(rows, key_names).take(parents)
        value, expire = _value_and_expiry(elements, variable.ttl)
        load.append(desc.name, _with_columns(keys, {desc.value_column: value, EXPIRE_AT_MS: expire}))
        return len(elements)
    rows = _read(spark, source, stateVarName=variable.name, flattenCollectionTypes="true")
    if not rows.num_rows:
        return 0
    keys = _keys(rows, key_names)
    columns = {}
    if desc.kind is StateKind.MAP:
        columns[desc.user_key_column] = rows.column("user_map_key").combine_chunks()
        stored = rows.column("user_map_value").combine_chunks()
    else:
        stored = rows.column("value").combine_chunks()
    columns[desc.value_column], columns[EXPIRE_AT_MS] = _value_and_expiry(stored, variable.ttl)
    load.put(desc.name, _with_columns(keys, columns))
    return rows.num_rows


def _read(spark: SparkSession, source: SparkCheckpoint, **options: str) -> pa.Table:
    reader = _reader(spark, source.location, source.batch_id, source.operator_id, **options)
    return reader.load(source.location).toArrow()


def _keys(rows: pa.Table, names: list[str]) -> pa.Table:
    key = rows.column("key").combine_chunks()
    return pa.table({name: key.field(name) for name in names})


def _value_and_expiry(stored: pa.Array, ttl: bool) -> tuple[pa.Array, pa.Array]:
    """A value as Spark's state data source gives it: the value struct, or with a TTL the value
    and its expiry (``{value, ttlExpirationMs}``)."""
    if not ttl:
        return stored, pa.nulls(len(stored), pa.int64())
    return stored.field("value"), stored.field(_TTL_FIELD).cast(pa.int64())


def _with_columns(table: pa.Table, columns: dict[str, pa.Array]) -> pa.Table:
    for name, column in columns.items():
        table = table.append_column(name, column)
    return table
