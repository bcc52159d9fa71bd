"""One call switches an existing ``transformWithState`` job to icestate.

After ``enable(spark, warehouse=...)`` (or with the settings as Spark conf keys, so that
``spark-submit --conf spark.icestate.warehouse=...`` works too), the job's own code::

    (df.groupBy("key")
       .transformWithState(MyProcessor(), "key string, count long", "Update", "None")
       .select(...).filter(...)                      # stateless operators: recorded
       .writeStream.queryName("counts").option("checkpointLocation", cp)
       .trigger(processingTime="10 seconds").foreachBatch(write).start())

runs on icestate: ``transformWithState`` / ``transformWithStateInPandas`` (on a session where
icestate is enabled) return a ``StatefulFrame``, which records the stateless operators chained
after the processor, and its ``writeStream`` a ``StatefulStreamWriter``, which records the
writer's settings; ``start()`` maps them onto ``start_stateful_query`` and applies the recorded
operators and the sink to each batch's output. What cannot be mapped fails at the call or at
``start()`` with what and why, never runs differently: a stateful operator after the processor
(an aggregation, a join, deduplication, a watermark, a limit: the error names the way that
works, a second query over a file sink's output), a sink of another format, ``complete``
output mode, a continuous trigger, an option the console, memory or callback sinks do not know.
Sinks: ``foreachBatch``, ``foreach`` (a function or a writer object), ``console``, ``memory``,
``noop``, the file sinks (``parquet``, ``json``, ``csv``, ``orc``, ``text``: exactly once with
Spark's ``_spark_metadata`` log, ``FileSink``) and ``toTable`` (an Iceberg table of the state
catalog, exactly once with the state), in classic and Spark Connect sessions.

Settings (an argument of ``enable`` wins over the conf key):

=================================  ==========================================================
``spark.icestate.warehouse``       directory of the embedded SQLite catalog and its tables
``spark.icestate.catalog``         name of an Iceberg catalog (``.pyiceberg.yaml``, environment)
``spark.icestate.catalog.<prop>``  a property of that catalog (``uri``, ``s3.endpoint``, ...)
``spark.icestate.namespace``       namespace of the state tables (default ``state``)
``spark.icestate.table``           state table of the queries started while it is set
``spark.icestate.maxParallelism``  key groups of a new state table (default 128)
``spark.icestate.parallelism``     tasks per batch (default ``spark.sql.shuffle.partitions``)
=================================  ==========================================================

A query's state table is named after its ``queryName`` (else its checkpoint directory) and a
digest of its checkpoint location: the checkpoint decides which state a query resumes, as it
does for Spark's state.

``disable(spark)`` gives the session back Spark's own operators (a running query is not
touched).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pyarrow import fs as pafs
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import StructType

from catalog.defaults import DEFAULT_NAMESPACE
from spark_integration.location import StateLocation
from statestore.keygroups import DEFAULT_MAX_PARALLELISM

CONF_PREFIX = "spark.icestate."
_SETTINGS = ("warehouse", "catalog", "namespace", "table", "maxParallelism", "parallelism")

# Operators that work row by row on a batch's output: recorded, then applied to each batch.
STATELESS = frozenset({
    "select", "selectExpr", "filter", "where", "withColumn", "withColumns", "withColumnRenamed",
    "withColumnsRenamed", "withMetadata", "drop", "toDF", "alias", "dropna", "fillna", "replace", "hint",
})
# Operators that keep state across batches (or order and cut the stream): Spark would run them
# after the processor in the same query; here they need a second query.
STATEFUL = frozenset({
    "groupBy", "groupby", "rollup", "cube", "groupingSets", "agg", "count", "distinct", "dropDuplicates",
    "drop_duplicates", "dropDuplicatesWithinWatermark", "join", "crossJoin", "lateralJoin", "union", "unionAll",
    "unionByName", "intersect", "intersectAll", "subtract", "exceptAll", "withWatermark", "limit", "offset", "sort",
    "orderBy", "sortWithinPartitions", "repartition", "repartitionByRange", "coalesce", "sample", "randomSplit",
    "observe", "transform",
})
_SECOND_QUERY = (
    "write this query's output with a file sink (.writeStream.format('parquet').option('path', p), exactly once, "
    "read by Spark as its own sink's output) and run the operator in a second query over it "
    "(spark.readStream.schema(...).parquet(p)...), or apply it to each batch inside .foreachBatch(...)")
_SINK_OPTIONS = {"console": {"numRows", "truncate"}, "memory": set(), "noop": set(), "foreachBatch": set(),
                 "foreach": set(), "toTable": set()}
# Spark's file sinks (FileStreamSink): their options go to the format's writer, as Spark's.
FILE_FORMATS = ("parquet", "json", "csv", "orc", "text")


class DropInError(ValueError):
    """A job that the switch cannot run as Spark would: what, why and what to do instead."""


# ---------------------------------------------------------------------------- enabling

@dataclass(frozen=True)
class _Enabled:
    """What ``enable`` was given for one session (secrets stay in this process, never in conf)."""

    settings: Mapping[str, str] = field(default_factory=dict)
    catalog_properties: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"_Enabled(settings={dict(self.settings)}, catalog_properties=<{len(self.catalog_properties)} keys>)"


_ENABLED: dict[str, _Enabled] = {}
_PATCH_LOCK = threading.Lock()
_ORIGINALS: dict[tuple[type, str], Callable] = {}


def _session_key(spark: SparkSession) -> str:
    session_id = getattr(spark, "session_id", None)  # Spark Connect
    if isinstance(session_id, str):
        return "connect:" + session_id
    return "classic:" + str(spark._jsparkSession.sessionUUID())


def enable(spark: SparkSession, *, warehouse: str | None = None, catalog: str | None = None,
           catalog_properties: Mapping[str, str] | None = None, namespace: str | None = None,
           max_parallelism: int | None = None, parallelism: int | None = None) -> None:
    """Run this session's ``transformWithState`` / ``transformWithStateInPandas`` queries on
    icestate, state in Iceberg tables of ``warehouse`` (the embedded SQLite catalog) or of the
    catalog ``catalog`` (with ``catalog_properties``). Arguments left out are read from the
    session's conf keys ``spark.icestate.*`` when a query starts (module docstring)."""
    given = {"warehouse": warehouse, "catalog": catalog, "namespace": namespace,
             "maxParallelism": max_parallelism, "parallelism": parallelism}
    settings = {k: str(v) for k, v in given.items() if v is not None}
    _install()
    _ENABLED[_session_key(spark)] = _Enabled(settings, dict(catalog_properties or {}))


def disable(spark: SparkSession) -> None:
    """Give the session back Spark's own stateful operators (queries already started keep running)."""
    _ENABLED.pop(_session_key(spark), None)


def is_enabled(spark: SparkSession) -> bool:
    return _session_key(spark) in _ENABLED


def _install() -> None:
    """Wrap ``transformWithState`` and ``transformWithStateInPandas`` of the classic and the
    Connect ``GroupedData`` once; the wrappers pass through on sessions not enabled."""
    with _PATCH_LOCK:
        classes = []
        from pyspark.sql.group import GroupedData

        classes.append(GroupedData)
        try:
            from pyspark.sql.connect.group import GroupedData as ConnectGroupedData
        except ImportError:  # Connect's client dependencies are not installed
            pass
        else:
            classes.append(ConnectGroupedData)
        for cls in classes:
            for name, api in (("transformWithState", "row"), ("transformWithStateInPandas", "pandas")):
                if (cls, name) in _ORIGINALS:
                    continue
                original = getattr(cls, name)
                _ORIGINALS[(cls, name)] = original
                setattr(cls, name, _wrapper(original, api))


def _wrapper(original: Callable, api: str) -> Callable:
    def transform_with_state(self, statefulProcessor, outputStructType, outputMode, timeMode,
                             initialState=None, eventTimeColumnName=""):
        spark = self._df.sparkSession
        if not is_enabled(spark):
            return original(self, statefulProcessor, outputStructType, outputMode, timeMode,
                            initialState=initialState, eventTimeColumnName=eventTimeColumnName)
        return StatefulFrame._of(self, statefulProcessor, outputStructType, outputMode, timeMode, initialState,
                                 eventTimeColumnName, api)

    transform_with_state.__name__ = original.__name__
    transform_with_state.__qualname__ = original.__qualname__
    transform_with_state.__doc__ = original.__doc__
    transform_with_state.__wrapped__ = original
    return transform_with_state


def _grouping_columns(grouped, what: str) -> list[str]:
    """The column names a ``GroupedData`` groups by: its count's columns but the last, each a
    column of its DataFrame (analysis only, nothing runs)."""
    kind = getattr(grouped, "_group_type", None)  # Connect
    if kind is None:
        text = str(grouped._jgd.toString())
        kind = "groupby" if "type: GroupBy" in text else text
    if kind != "groupby":
        raise DropInError(f"{what} is grouped by rollup, cube, pivot or grouping sets ({kind}): transformWithState "
                          "takes a plain groupBy of columns")
    names = grouped.count().columns[:-1]
    columns = grouped._df.columns
    computed = [n for n in names if n not in columns]
    if computed:
        raise DropInError(f"{what} is grouped by expression(s) {computed}, not by columns of the DataFrame "
                          f"({columns}): add them as columns with withColumn first, then groupBy their names")
    return names


# ---------------------------------------------------------------------------- the processor's output

@dataclass(frozen=True)
class _Plan:
    df: DataFrame
    keys: list[str]
    processor: Any
    output_schema: StructType
    output_mode: str
    time_mode: str
    initial: DataFrame | None
    event_time_output: str
    api: str
    ops: tuple[tuple[str, tuple, dict], ...] = ()


class StatefulFrame:
    """The output of ``transformWithState`` on an icestate-enabled session: a streaming
    DataFrame in all a job does with it (its schema and columns, stateless operators, its
    ``writeStream``), run by ``start_stateful_query`` when its writer starts."""

    def __init__(self, plan: _Plan):
        self._plan = plan
        self._template_df: DataFrame | None = None

    @classmethod
    def _of(cls, grouped, processor, output_schema, output_mode: str, time_mode: str, initial, event_time_output: str,
            api: str) -> StatefulFrame:
        df = grouped._df
        spark = df.sparkSession
        keys = _grouping_columns(grouped, "the input")
        if isinstance(output_schema, str):
            output_schema = _parse_ddl(spark, output_schema)
        if not isinstance(output_schema, StructType):
            raise TypeError("outputStructType must be a StructType or a DDL string, "
                            f"got {type(output_schema).__name__}")
        mode = str(output_mode).lower()
        if mode not in ("append", "update"):
            raise DropInError(f"outputMode {output_mode!r}: transformWithState runs in 'Append' or 'Update' mode")
        initial_df = None
        if initial is not None:
            initial_keys = _grouping_columns(initial, "initialState")
            if len(initial_keys) != len(keys):
                raise DropInError(f"initialState is grouped by {initial_keys}, the input by {keys}: group both by "
                                  "the same number of key columns")
            initial_df = initial._df
            for theirs, ours in zip(initial_keys, keys, strict=True):
                if theirs != ours:
                    initial_df = initial_df.withColumnRenamed(theirs, ours)
        if event_time_output and event_time_output not in output_schema.fieldNames():
            raise DropInError(f"eventTimeColumnName {event_time_output!r} is not a column of the output "
                              f"({output_schema.fieldNames()})")
        return cls(_Plan(df, keys, processor, output_schema, mode, time_mode, initial_df, event_time_output, api))

    # --- what a streaming DataFrame shows

    def _template(self) -> DataFrame:
        """An empty batch of the output with the recorded operators applied."""
        if self._template_df is None:
            spark = self._plan.df.sparkSession
            self._template_df = _apply(spark.createDataFrame([], self._plan.output_schema), self._plan.ops)
        return self._template_df

    @property
    def schema(self) -> StructType:
        return self._template().schema

    @property
    def columns(self) -> list[str]:
        return self._template().columns

    @property
    def dtypes(self) -> list[tuple[str, str]]:
        return self._template().dtypes

    @property
    def isStreaming(self) -> bool:
        return True

    @property
    def sparkSession(self) -> SparkSession:
        return self._plan.df.sparkSession

    def printSchema(self, level: int | None = None) -> None:
        self._template().printSchema(level)

    def __getitem__(self, item):
        from pyspark.sql import functions as F

        if isinstance(item, str):  # a column by name, resolved against each batch (not the template)
            self._template()[item]  # a wrong name fails here, as Spark's
            return F.col("`" + item.replace("`", "``") + "`")
        return self._template()[item]

    def __repr__(self) -> str:
        ops = "".join(f".{name}(...)" for name, _, _ in self._plan.ops)
        return (f"StatefulFrame[{type(self._plan.processor).__name__} by {self._plan.keys} on icestate{ops}: "
                f"{self.schema.simpleString()}]")

    @property
    def writeStream(self) -> StatefulStreamWriter:
        return StatefulStreamWriter(self._plan)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in STATELESS:
            def record(*args, **kwargs) -> StatefulFrame:
                ops = (*self._plan.ops, (name, args, kwargs))
                _apply(self._template(), ops[-1:])  # analysed now, as Spark would: a wrong column fails here
                return StatefulFrame(replace(self._plan, ops=ops))
            return record
        if name in STATEFUL:
            raise DropInError(f"{name}() after transformWithState: icestate runs the processor's query as a "
                              f"micro-batch loop of its own, so an operator that keeps state across batches (or "
                              f"orders or cuts the stream) cannot follow it in the same query. "
                              f"Instead, {_SECOND_QUERY}")
        if not hasattr(DataFrame, name) and name in self.columns:  # a column, where Spark's gives one
            return self[name]
        if hasattr(DataFrame, name):
            raise DropInError(f"{name} is not available on the output of transformWithState on icestate (a "
                              f"streaming DataFrame takes no actions; the stateless operators are "
                              f"{sorted(STATELESS)}); apply it to each batch inside .foreachBatch(...)")
        raise AttributeError(f"'StatefulFrame' object has no attribute {name!r}")


def _apply(df: DataFrame, ops) -> DataFrame:
    for name, args, kwargs in ops:
        df = getattr(df, name)(*args, **kwargs)
    return df


def _parse_ddl(spark: SparkSession, ddl: str) -> StructType:
    return spark.createDataFrame([], ddl).schema


# ---------------------------------------------------------------------------- the writer

@dataclass
class _Writer:
    sink: str | None = None  # "format:<name>", "foreachBatch", "foreach", "toTable"
    options: dict[str, str] = field(default_factory=dict)
    output_mode: str | None = None
    query_name: str | None = None
    trigger: dict[str, Any] | None = None
    function: Any = None
    table: str | None = None
    partition_by: tuple[str, ...] = ()


class StatefulStreamWriter:
    """``writeStream`` of a ``StatefulFrame``: Spark's ``DataStreamWriter`` settings, mapped
    onto ``start_stateful_query`` at ``start()`` / ``toTable()``."""

    def __init__(self, plan: _Plan):
        self._plan = plan
        self._w = _Writer()

    def format(self, source: str) -> StatefulStreamWriter:
        self._w.sink = "format:" + str(source).lower()
        return self

    def option(self, key: str, value) -> StatefulStreamWriter:
        key = _KNOWN_OPTIONS.get(str(key).lower(), str(key))  # Spark's option keys ignore case
        self._w.options[key] = _option_text(value)
        return self

    def options(self, **options) -> StatefulStreamWriter:
        for k, v in options.items():
            self.option(k, v)
        return self

    def outputMode(self, outputMode: str) -> StatefulStreamWriter:
        self._w.output_mode = str(outputMode).lower()
        return self

    def queryName(self, queryName: str) -> StatefulStreamWriter:
        self._w.query_name = queryName
        return self

    def partitionBy(self, *cols) -> StatefulStreamWriter:
        self._w.partition_by = tuple(c for group in cols for c in ([group] if isinstance(group, str) else group))
        return self

    def trigger(self, *, processingTime: str | None = None, once: bool | None = None,
                continuous: str | None = None, availableNow: bool | None = None) -> StatefulStreamWriter:
        given = {k: v for k, v in (("processingTime", processingTime), ("once", once), ("continuous", continuous),
                                   ("availableNow", availableNow)) if v is not None}
        if given.get("once") is False or given.get("availableNow") is False:
            raise ValueError("trigger(once=...) and trigger(availableNow=...) take True only (as Spark)")
        if len(given) != 1:
            raise ValueError("trigger takes exactly one of processingTime, once, continuous, availableNow; "
                             f"got {given}")
        if "continuous" in given:
            raise DropInError("a continuous trigger: Spark runs no stateful operator in continuous mode, nor does "
                              "icestate; use processingTime or availableNow")
        self._w.trigger = given
        return self

    def foreachBatch(self, func: Callable[[DataFrame, int], None]) -> StatefulStreamWriter:
        self._w.sink, self._w.function = "foreachBatch", func
        return self

    def foreach(self, f) -> StatefulStreamWriter:
        if not callable(f) and not callable(getattr(f, "process", None)):
            raise TypeError("foreach takes a function of a row, or an object with a process(row) method")
        self._w.sink, self._w.function = "foreach", f
        return self

    def start(self, path: str | None = None, format: str | None = None, outputMode: str | None = None,
              partitionBy=None, queryName: str | None = None, **options) -> StreamingQuery:
        if format is not None:
            self.format(format)
        if outputMode is not None:
            self.outputMode(outputMode)
        if partitionBy is not None:
            self.partitionBy(partitionBy)
        if queryName is not None:
            self.queryName(queryName)
        self.options(**options)
        if path is not None:
            self._w.options["path"] = path
        return _start(self._plan, self._w)

    def toTable(self, tableName: str, format: str | None = None, outputMode: str | None = None,
                partitionBy=None, queryName: str | None = None, **options) -> StreamingQuery:
        if format is not None and str(format).lower() != "iceberg":
            raise DropInError(f"toTable(format={format!r}): on icestate toTable writes an Iceberg table of the "
                              "state catalog; use foreachBatch to write another format")
        if self._w.sink not in (None, "format:iceberg"):
            raise DropInError(f"toTable after .format({self._w.sink.removeprefix('format:')!r}): on icestate toTable "
                              "writes an Iceberg table of the state catalog")
        self._w.sink, self._w.table = "toTable", tableName
        return self.start(outputMode=outputMode, partitionBy=partitionBy, queryName=queryName, **options)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise DropInError(f"writeStream.{name} is not mapped onto icestate; the writer takes "
                          "format, option(s), outputMode, queryName, trigger, foreachBatch, foreach, start and toTable")


_KNOWN_OPTIONS = {k.lower(): k for k in ("checkpointLocation", "path", "numRows", "truncate")}


def _option_text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


# ---------------------------------------------------------------------------- start

def _start(plan: _Plan, w: _Writer) -> StreamingQuery:
    from spark_integration.query import start_stateful_query

    spark = plan.df.sparkSession
    enabled = _ENABLED.get(_session_key(spark))
    if enabled is None:
        raise DropInError("icestate was disabled on this session after transformWithState was called; call it again")
    sink = _sink_name(w, spark)
    mode = w.output_mode or "append"  # the query's mode: the writer's, Spark's default append
    if mode == "complete":
        raise DropInError("outputMode 'complete': transformWithState runs in 'Append' or 'Update' mode (as Spark)")
    if mode not in ("append", "update"):
        raise DropInError(f"outputMode {mode!r}: use 'append' or 'update'")
    options = dict(w.options)
    checkpoint = options.pop("checkpointLocation", None)
    path = options.pop("path", None)
    if sink in FILE_FORMATS:
        if mode != "append":
            raise DropInError(f"outputMode {mode!r} with the {sink} file sink: file sinks take 'append' only (as "
                              "Spark)")
        if path is None:
            raise DropInError(f"the {sink} file sink needs a path: start(path) or option('path', ...) (as Spark)")
    else:
        unknown = sorted(set(options) - _SINK_OPTIONS[sink])
        if unknown:
            raise DropInError(f"option(s) {unknown} of the {sink} sink are not mapped onto icestate (it takes "
                              f"{sorted(_SINK_OPTIONS[sink]) or 'none'} besides checkpointLocation)")
        if path is not None:
            raise DropInError(f"a path for the {sink} sink, which writes no files")
        if w.partition_by and sink != "toTable":
            raise DropInError(f"partitionBy for the {sink} sink, which writes no files")
    if sink == "memory" and not w.query_name:
        raise DropInError("the memory sink needs a queryName: it is the name of the table it fills (as Spark)")
    checkpoint = checkpoint or _default_checkpoint(spark, w.query_name, sink)
    location = _location(spark, enabled, w.query_name, checkpoint)
    output_table = None
    if sink == "toTable":
        if plan.ops:
            raise DropInError("toTable after stateless operators: the output table receives the processor's rows "
                              "exactly once, with the state, as the processor emits them; apply the operators when "
                              "reading the table, or write with foreachBatch")
        if w.partition_by:
            raise DropInError("toTable with partitionBy: the output table is created unpartitioned; partition it "
                              "with Iceberg's tools after its creation")
        output_table = w.table if "." in w.table else f"{location.namespace}.{w.table}"
    if sink in FILE_FORMATS:
        callback = FileSink(spark, path, sink, options, w.partition_by, plan.ops)
    else:
        callback = None if sink == "toTable" else _batch_callback(plan, w, sink, spark)
    return start_stateful_query(
        plan.df, plan.keys, plan.processor, plan.output_schema, location=location, checkpoint_location=checkpoint,
        trigger=w.trigger, foreach_batch=callback, output_table=output_table, time_mode=plan.time_mode,
        initial_state=plan.initial, query_name=w.query_name, api=plan.api)


def _sink_name(w: _Writer, spark: SparkSession) -> str:
    if w.sink is None:  # Spark's default: the file sink of spark.sql.sources.default
        w.sink = "format:" + spark.conf.get("spark.sql.sources.default", "parquet").lower()
    if w.sink.startswith("format:"):
        name = w.sink.removeprefix("format:")
        if name in ("console", "memory", "noop"):
            return name
        if name in FILE_FORMATS:
            return name
        raise DropInError(f"the {name!r} sink is not mapped onto icestate: use foreachBatch, foreach, console, memory, "
                          f"noop, toTable or a file sink ({', '.join(FILE_FORMATS)})")
    return w.sink


def _default_checkpoint(spark: SparkSession, query_name: str | None, sink: str) -> str:
    """Where Spark would put the checkpoint without the option: under
    ``spark.sql.streaming.checkpointLocation`` by query name (else a fresh directory);
    a console or memory query with neither gets a temporary one, as Spark gives it."""
    import os
    import tempfile
    import uuid

    root = spark.conf.get("spark.sql.streaming.checkpointLocation", None)
    if root:
        return os.path.join(root, query_name or str(uuid.uuid4()))
    if sink in ("console", "memory", "noop"):
        return tempfile.mkdtemp(prefix="icestate-temporary-checkpoint-")
    raise DropInError('checkpointLocation must be specified either through option("checkpointLocation", ...) or '
                      'SparkSession.conf.set("spark.sql.streaming.checkpointLocation", ...): it holds the '
                      "query's progress; its state goes to the state table")


def _setting(spark: SparkSession, enabled: _Enabled, name: str) -> str | None:
    if name in enabled.settings:
        return enabled.settings[name]
    if name in ("warehouse", "catalog") and ({"warehouse", "catalog"} & set(enabled.settings)):
        return None  # enable() said where the state lives: neither conf key overrides it
    value = spark.conf.get(CONF_PREFIX + name, None)
    return value or None


def _catalog_properties(spark: SparkSession, enabled: _Enabled) -> dict[str, str]:
    """``spark.icestate.catalog.<prop>`` keys of the session's conf (``spark-submit --conf``
    ones included), then what ``enable`` was given."""
    prefix = CONF_PREFIX + "catalog."
    props = {k.removeprefix(prefix): v for k, v in spark.conf.getAll.items() if k.startswith(prefix)}
    props.update(enabled.catalog_properties)
    return props


def _location(spark: SparkSession, enabled: _Enabled, query_name: str | None, checkpoint: str) -> StateLocation:
    warehouse = _setting(spark, enabled, "warehouse")
    catalog = _setting(spark, enabled, "catalog")
    if warehouse is None and catalog is None:
        raise DropInError("icestate needs where its state tables live: enable(spark, warehouse=...) or "
                          "enable(spark, catalog=...), or the conf key spark.icestate.warehouse or "
                          "spark.icestate.catalog")
    max_parallelism = int(_setting(spark, enabled, "maxParallelism") or DEFAULT_MAX_PARALLELISM)
    parallelism = _setting(spark, enabled, "parallelism") or spark.conf.get("spark.sql.shuffle.partitions", "200")
    parallelism = max(1, min(int(parallelism), max_parallelism))
    table = _setting(spark, enabled, "table") or state_table_name(query_name, checkpoint)
    return StateLocation(table=table, warehouse=None if catalog else warehouse,
                         namespace=_setting(spark, enabled, "namespace") or DEFAULT_NAMESPACE,
                         max_parallelism=max_parallelism, parallelism=parallelism, catalog_name=catalog,
                         catalog_properties=_catalog_properties(spark, enabled) if catalog else {})


def state_location(spark: SparkSession, query_name: str | None, checkpoint: str) -> StateLocation:
    """Where an enabled session keeps the state of a query started with ``query_name`` on
    ``checkpoint``: the table its ``start()`` opens.

    Raises:
        DropInError: the session is not enabled, or says nowhere where state tables live.
    """
    enabled = _ENABLED.get(_session_key(spark))
    if enabled is None:
        raise DropInError("the session is not enabled for icestate: call spark_integration.enable(spark, ...) first")
    return _location(spark, enabled, query_name, checkpoint)


def state_table_name(query_name: str | None, checkpoint: str) -> str:
    """The state table of a query: its name (else its checkpoint directory's name) and a digest
    of its checkpoint's path. The checkpoint decides, as it decides for Spark's state: a restart
    on the same checkpoint finds the same table whatever the query is called, and a query on a
    new checkpoint starts with new state even under an old name."""
    digest = hashlib.sha256(checkpoint.rstrip("/").encode()).hexdigest()[:10]
    stem = _identifier(query_name or "") or _identifier(checkpoint.rstrip("/").rsplit("/", 1)[-1]) or "query"
    return f"{stem}_{digest}"


def _identifier(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]+", "_", text).strip("_").lower()[:64]


# ---------------------------------------------------------------------------- sinks, per batch

def _batch_callback(plan: _Plan, w: _Writer, sink: str, spark: SparkSession) -> Callable[[DataFrame, int], None]:
    ops = plan.ops
    if sink == "foreachBatch":
        func = w.function

        def each(df: DataFrame, batch_id: int) -> None:
            func(_apply(df, ops), batch_id)
        return each
    if sink == "foreach":
        return _foreach(w.function, ops)
    if sink == "console":
        rows = int(w.options.get("numRows", "20"))
        truncate = w.options.get("truncate", "true").lower() != "false"

        def show(df: DataFrame, batch_id: int) -> None:
            print("-------------------------------------------")
            print(f"Batch: {batch_id}")
            print("-------------------------------------------")
            _apply(df, ops).show(rows, truncate)
        return show
    if sink == "noop":
        def nothing(df: DataFrame, batch_id: int) -> None:
            _apply(df, ops).write.format("noop").mode("overwrite").save()
        return nothing
    if sink == "memory":
        return _MemorySink(spark, w.query_name, ops, StatefulFrame(plan).schema)
    raise AssertionError(sink)


def _foreach(writer, ops) -> Callable[[DataFrame, int], None]:
    if callable(writer):  # a function of a row (Spark's test: callable first)
        def each_row(df: DataFrame, batch_id: int) -> None:
            _apply(df, ops).foreach(writer)
        return each_row

    def each_partition(df: DataFrame, batch_id: int) -> None:
        def run(rows) -> None:
            from pyspark import TaskContext

            partition = TaskContext.get().partitionId()
            opened = writer.open(partition, batch_id) if hasattr(writer, "open") else True
            error = None
            try:
                if opened:
                    for row in rows:
                        writer.process(row)
            except BaseException as e:
                error = e
                raise
            finally:
                if hasattr(writer, "close"):
                    writer.close(error)

        _apply(df, ops).foreachPartition(run)
    return each_partition


class _MemorySink:
    """Spark's memory sink: every batch's rows appended to a table named after the query,
    readable with ``spark.table(name)`` / ``spark.sql``; kept in the driver (for tests and
    notebooks, as Spark's)."""

    def __init__(self, spark: SparkSession, name: str, ops, schema: StructType):
        self._name, self._ops = name, ops
        self._batches: dict[int, Any] = {}
        # Under Spark Connect the callback runs in a Python process of the server, on a clone of
        # the client's session: the view goes to the client's own session (its id) instead.
        self._session_id: str | None = getattr(spark, "session_id", None)
        # A classic session's callback runs in this process, on the stream's clone of the
        # session: the views go to the starter's session itself.
        self._session: Any = spark if self._session_id is None else None
        spark.createDataFrame([], schema).createOrReplaceTempView(name)  # queryable at once, as Spark's

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_session": None}

    def _views(self, df: DataFrame) -> Any:
        """The session whose temporary views the query's starter sees."""
        if self._session is not None:
            return self._session
        if getattr(df.sparkSession, "session_id", None) == self._session_id:
            return df.sparkSession
        import os

        from pyspark.sql.connect.session import SparkSession as ConnectSession

        url = os.environ.get("SPARK_CONNECT_LOCAL_URL")  # set by Spark for its foreachBatch process
        if url is None:
            raise DropInError("the memory sink under Spark Connect found no SPARK_CONNECT_LOCAL_URL in the "
                              "server's Python process: use foreachBatch or toTable with this Spark version")
        self._session = ConnectSession.builder.remote(f"{url};session_id={self._session_id}").create()
        return self._session

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        import pyarrow as pa

        rows = _apply(df, self._ops)
        table = rows.toArrow()
        self._batches[batch_id] = table  # a batch run again replaces its rows
        whole = pa.concat_tables([self._batches[b] for b in sorted(self._batches)])
        self._views(df).createDataFrame(whole, schema=rows.schema).createOrReplaceTempView(self._name)


class FileSink:
    """Spark's file sink (``FileStreamSink``), exactly once as Spark's: a batch's files are
    written under a staging directory of the sink's (``_icestate_staging``: a name Spark's
    readers skip), moved into the sink's directory, then listed in the batch's entry of the
    sink's log ``_spark_metadata``, in Spark's format; a batch the log holds already (run again
    after its state commit failed) is skipped. Spark's readers (``spark.read``,
    ``spark.readStream`` of the directory, a second query) read only the files the log lists,
    so files of an attempt that died before its entry are never read. Every
    ``spark.sql.streaming.fileSink.log.compactInterval``-th entry is a compaction of the log
    (``<id>.compact``: every entry so far), as Spark writes and reads it.

    The files are moved and the log written through the driver's Hadoop filesystem in a
    classic session (``HadoopFiles``: every scheme the session's Hadoop configuration knows),
    and through pyarrow's filesystems in a Spark Connect session (``_ArrowFiles``: the callback
    runs in a Python process of the Connect server, which has no JVM to call; local paths and
    the object stores pyarrow opens, with the server's own credentials)."""

    def __init__(self, spark: SparkSession, path: str, fmt: str, options: Mapping[str, str],
                 partition_by: tuple[str, ...], ops, connect: bool | None = None):
        self._fmt, self._options, self._partition_by, self._ops = fmt, dict(options), partition_by, ops
        if connect is None:  # the session decides: its callbacks run where it runs them
            connect = getattr(spark, "session_id", None) is not None
        self._files: HadoopFiles | _ArrowFiles = _ArrowFiles(path) if connect else HadoopFiles(spark, path)
        self._root = self._files.root
        self._log = self._files.join(self._root, "_spark_metadata")
        self._interval = int(spark.conf.get("spark.sql.streaming.fileSink.log.compactInterval", "10"))

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        files = self._files
        latest, compacted = self._latest()
        if latest is not None and batch_id <= latest:
            return  # this batch's files are in the log already (Spark's FileStreamSink.addBatch)
        if compacted is not None and (compacted + 1) % self._interval:
            raise DropInError(f"the sink log {self._log} was compacted at batch {compacted}, which does not fit "
                              f"spark.sql.streaming.fileSink.log.compactInterval={self._interval}: set it to the "
                              "interval the log was written with")
        staging = files.join(self._root, f"_icestate_staging/{batch_id}-{uuid.uuid4().hex}")
        writer = _apply(df, self._ops).write.format(self._fmt).options(**self._options).mode("error")
        if self._partition_by:
            writer = writer.partitionBy(*self._partition_by)
        writer.save(staging)
        moves = []
        for source, relative in files.walk(staging):
            if any(part.startswith(".") or (part.startswith("_") and "=" not in part)
                   for part in relative.split("/")):
                continue  # _SUCCESS, checksums (Spark's rule for hidden files: a partition's "_k=v" is not)
            moves.append((source, files.join(self._root, relative)))
        entries = []
        for source, target in moves:
            if files.exists(target):
                raise OSError(f"the file sink's file {target} exists already: another query writes this sink")
            files.move(source, target)
            entries.append({**files.status(target), "isDir": False, "action": "add"})
        if (batch_id + 1) % self._interval == 0:
            entries = self._all_entries(batch_id, compacted) + entries
            name = f"{batch_id}.compact"
        else:
            name = str(batch_id)
        self._write_entry(name, entries)
        files.delete(staging)

    def _latest(self) -> tuple[int | None, int | None]:
        """The newest batch id of the log and its newest compaction's."""
        ids, compacts = [], []
        for name in self._files.names(self._log):
            stem = name.removesuffix(".compact")
            if stem.isdigit():
                ids.append(int(stem))
                if name.endswith(".compact"):
                    compacts.append(int(stem))
        return (max(ids) if ids else None), (max(compacts) if compacts else None)

    def _all_entries(self, batch_id: int, compacted: int | None) -> list[dict]:
        """Every entry before ``batch_id``: the newest compaction's (``compacted``), then the
        batches after it."""
        entries = [] if compacted is None else self._read_entry(f"{compacted}.compact")
        for b in range(0 if compacted is None else compacted + 1, batch_id):
            entries += self._read_entry(str(b))
        return entries

    def _read_entry(self, name: str) -> list[dict]:
        lines = self._files.read_text(self._files.join(self._log, name)).splitlines()
        if not lines or lines[0] != "v1":
            raise DropInError(f"the sink log entry {self._log}/{name} is not of Spark's version 1 (it starts with "
                              f"{lines[:1]}): this sink's directory was written by another Spark version")
        return [json.loads(line) for line in lines[1:] if line.strip()]

    def _write_entry(self, name: str, entries: list[dict]) -> None:
        """Write the entry under a temporary name, then rename it: a reader sees it whole or not at all;
        a rename onto an existing entry fails (another writer)."""
        files = self._files
        temporary = files.join(self._log, f".{name}.{uuid.uuid4().hex}.tmp")
        files.write_text(temporary, "v1" + "".join("\n" + json.dumps(e, separators=(",", ":")) for e in entries))
        entry = files.join(self._log, name)
        if files.exists(entry) or not files.move(temporary, entry):
            files.delete(temporary)
            raise OSError(f"the sink log entry {self._log}/{name} exists already: another query writes this sink")


class HadoopFiles:
    """``FileSink``'s files through the driver's Hadoop filesystem (classic sessions). Paths are
    qualified URIs as text."""

    def __init__(self, spark: SparkSession, path: str):
        self._jvm = spark.sparkContext._jvm
        root = self._jvm.org.apache.hadoop.fs.Path(path)
        self._fs = root.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        self.root = self._fs.makeQualified(root).toString()

    def _path(self, path: str):
        return self._jvm.org.apache.hadoop.fs.Path(path)

    def join(self, parent: str, child: str) -> str:
        return self._jvm.org.apache.hadoop.fs.Path(self._path(parent), child).toString()

    def exists(self, path: str) -> bool:
        return bool(self._fs.exists(self._path(path)))

    def names(self, directory: str) -> list[str]:
        if not self.exists(directory):
            return []
        return [status.getPath().getName() for status in self._fs.listStatus(self._path(directory))]

    def walk(self, directory: str) -> list[tuple[str, str]]:
        """(path, path relative to ``directory``) of every file under it."""
        prefix = self._path(directory).toUri().getPath().rstrip("/") + "/"
        found, files = [], self._fs.listFiles(self._path(directory), True)
        while files.hasNext():
            path = files.next().getPath()
            found.append((path.toString(), path.toUri().getPath().removeprefix(prefix)))
        return found

    def move(self, source: str, target: str) -> bool:
        self._fs.mkdirs(self._path(target).getParent())
        if not self._fs.rename(self._path(source), self._path(target)):
            raise OSError(f"the file sink could not move {source} to {target}")
        return True

    def status(self, path: str) -> dict:
        """The fields of a file's entry in Spark's sink log."""
        moved = self._fs.getFileStatus(self._path(path))
        return {"path": moved.getPath().toUri().toString(), "size": moved.getLen(),
                "modificationTime": moved.getModificationTime(), "blockReplication": moved.getReplication(),
                "blockSize": moved.getBlockSize()}

    def read_text(self, path: str) -> str:
        stream = self._fs.open(self._path(path))
        try:
            return str(self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
        finally:
            stream.close()

    def write_text(self, path: str, text: str, overwrite: bool = False) -> None:
        self._fs.mkdirs(self._path(path).getParent())
        out = self._fs.create(self._path(path), overwrite)
        try:
            out.write(bytearray(text.encode()))
        finally:
            out.close()

    def copy(self, source: str, into: HadoopFiles, target: str) -> None:
        """Copy file ``source`` to ``target`` of ``into``'s filesystem, replacing it."""
        if not self._jvm.org.apache.hadoop.fs.FileUtil.copy(self._fs, self._path(source), into._fs,
                                                             self._path(target), False, True, self._fs.getConf()):
            raise OSError(f"could not copy {source} to {target}")

    def delete(self, path: str) -> None:
        self._fs.delete(self._path(path), True)


# What Hadoop's local and object-store filesystems report for a file's block size and replication.
HADOOP_BLOCK_SIZE = 32 * 1024 * 1024
# The characters a URI's path holds unencoded (RFC 3986's pchar and "/").
URI_PATH_SAFE = "/:@!$&'()*+,;=~"


class _ArrowFiles:
    """``FileSink``'s files through pyarrow's filesystems (Spark Connect sessions: the callback
    runs in the server's Python process, without a JVM). Paths are URIs as text (``file:/...``
    for local paths, as Hadoop writes them into the log); the filesystem is opened where it is used, from the
    URI and that process's environment, and never travels with the callback."""

    def __init__(self, path: str):
        import os

        if path.startswith("file://"):
            path = path.removeprefix("file://")
        if ":" not in path.split("/", 1)[0]:  # a local path: as Hadoop writes it into the log
            path = "file:" + os.path.abspath(path.removeprefix("file:"))
        self.root = path.rstrip("/")
        self._filesystem: Any = None

    def __getstate__(self) -> dict:
        return {"root": self.root, "_filesystem": None}

    def _fs(self):
        if self._filesystem is None:
            self._filesystem = pafs.FileSystem.from_uri(self.root)[0]
        return self._filesystem

    def _local(self, path: str) -> str:
        """The filesystem's own path of ``path``: the text without its scheme (and for an object
        store, with its bucket). Paths are plain text, as Hadoop's ``Path(String)`` takes them:
        a ``%`` is a character of the name (Spark writes partition values escaped that way)."""
        scheme, rest = path.split(":", 1)
        return rest if scheme == "file" else rest.removeprefix("//")

    def join(self, parent: str, child: str) -> str:
        return parent.rstrip("/") + "/" + child

    def _info(self, path: str):
        return self._fs().get_file_info(self._local(path))

    def exists(self, path: str) -> bool:
        return self._info(path).type != pafs.FileType.NotFound

    def names(self, directory: str) -> list[str]:
        if not self.exists(directory):
            return []
        return [i.base_name for i in self._fs().get_file_info(pafs.FileSelector(self._local(directory)))]

    def walk(self, directory: str) -> list[tuple[str, str]]:
        base = self._local(directory).rstrip("/") + "/"
        infos = self._fs().get_file_info(pafs.FileSelector(self._local(directory), recursive=True))
        return [(self.join(directory, i.path.removeprefix(base)), i.path.removeprefix(base))
                for i in infos if i.type == pafs.FileType.File]

    def move(self, source: str, target: str) -> bool:
        self._fs().create_dir(self._local(target).rsplit("/", 1)[0], recursive=True)
        self._fs().move(self._local(source), self._local(target))
        return True

    def status(self, path: str) -> dict:
        from urllib.parse import quote

        info = self._info(path)
        scheme, rest = path.split(":", 1)  # the log holds URIs: each name encoded, as Hadoop's toUri()
        return {"path": f"{scheme}:{quote(rest, safe=URI_PATH_SAFE)}", "size": info.size,
                "modificationTime": info.mtime_ns // 1_000_000,
                "blockReplication": 1, "blockSize": HADOOP_BLOCK_SIZE}

    def read_text(self, path: str) -> str:
        with self._fs().open_input_stream(self._local(path)) as f:
            return f.read().decode()

    def write_text(self, path: str, text: str) -> None:
        self._fs().create_dir(self._local(path).rsplit("/", 1)[0], recursive=True)
        with self._fs().open_output_stream(self._local(path)) as f:
            f.write(text.encode())

    def delete(self, path: str) -> None:
        info = self._info(path)
        if info.type == pafs.FileType.Directory:
            self._fs().delete_dir(self._local(path))
        elif info.type == pafs.FileType.File:
            self._fs().delete_file(self._local(path))
