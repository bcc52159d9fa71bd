"""Running a stateful processor as a PySpark streaming query on the disaggregated store.

``start_stateful_query`` validates everything it can before any state is written (key
columns and types, the output schema, the state table's layout), then starts a
``foreachBatch`` query whose batch function (``StatefulRunner``) does, per micro-batch:

1. Skip the batch when the state table already holds a checkpoint of this batch id or a
   later one (a batch replayed after a driver crash): exactly-once state.
2. Route rows to tasks inside the JVM: ``pmod(xxhash64(keys), N)`` is the key group,
   ``key_group * p div N`` its task (Flink's ranges); no Python UDF routes.
3. ``repartition(p, part).mapInArrow(run_partition)``, partition i holding exactly task i's
   rows: each task runs the processor over its rows against its store and flushes new
   segments (``spark_integration.tasks``).
4. Commit the tasks' output files to the Iceberg output table (idempotent by batch id),
   call the user's ``foreach_batch(df, batch_id)``, then commit every task's segments as
   one state checkpoint stamped with the batch id. Without an output table, the callback's
   DataFrame is the tasks' output itself: its action runs the tasks (one Spark job per
   batch), whose reports come back through an accumulator.

The batch's processing time and watermark come from Spark's offset log, so a replayed
batch sees the same times (and the same TTL expiries) as its first run.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.stateful_processor import StatefulProcessor
from pyspark.sql.types import StructType

from catalog.compaction import CompactionPolicy
from catalog.compactor import CompactorProcess
from catalog.output_table import OutputTable
from catalog.task_view import CheckpointView, locations_of
from spark_integration.async_processor import AsyncOptions, check_async_processor, is_async_processor
from spark_integration.compaction_jobs import SparkCompactor, runs_on
from spark_integration.compat import ArrowBatching, check_nullable_for_avro, declare, spark_struct
from spark_integration.errors import ErrorKey, user_error
from spark_integration.location import StateLocation
from spark_integration.tasks import (
    HEARTBEAT,
    KG,
    PART,
    RESULT_ARROW,
    TASK,
    TOKENS_KEPT,
    BatchPlan,
    ReportParam,
    run_partition,
    segment_of,
)
from spark_integration.ticks import (
    Beacon,
    beacon_path,
    is_ticks_offset,
    read_beacon,
    restamp_beacon,
    sweep_beacons,
    ticks_frame,
    warm_planner,
    write_beacon,
)
from spark_integration.timers import normalize_time_mode, timers_descriptor
from spark_integration.vectorized import VectorizedProcessor
from statestore import stored_keys
from statestore.config import StoreConfig
from statestore.errors import (
    QueryCheckpointUnreadableError,
    QueryMismatchError,
    QuerySourcesMismatchError,
    SchemaMismatchError,
    StateOutOfStepError,
    TaskReportError,
    WorkerEnvironmentError,
)
from statestore.faults import kill_if_asked
from statestore.keygroups import check_key_type
from statestore.layout import StateLayout
from statestore.live_rows import Ledger
from statestore.operator_state import OperatorStateDescriptor, OperatorStateFile
from statestore.paths import SCRATCH_OUTPUTS_DIR

log = logging.getLogger(__name__)



# Batch reports a runner keeps (``StatefulRunner.reports``): the newest, as many as Spark keeps
# progress updates of the query (``recentProgress``), by the same setting and default.
RECENT_PROGRESS_CONF = "spark.sql.streaming.numRecentProgressUpdates"
# Spark's state encoding (unsaferow by default): with avro, state schemas must be nullable.
ENCODING_CONF = "spark.sql.streaming.stateStore.encodingFormat"
NO_DATA_CONF = "spark.sql.streaming.noDataMicroBatches.enabled"
# Spark's switch of its state store's row count (numRowsTotal); off, ours counts no live rows either.
TRACK_ROWS_CONF = "spark.sql.streaming.stateStore.rocksdb.trackTotalNumberOfRows"
REPORTS_KEPT = 100


def reports_kept(spark: SparkSession) -> int:
    """How many batch reports a runner of ``spark`` keeps: Spark's ``numRecentProgressUpdates``."""
    try:
        kept = int(spark.conf.get(RECENT_PROGRESS_CONF, str(REPORTS_KEPT)))
    except (TypeError, ValueError):
        return REPORTS_KEPT
    return max(1, kept)


@dataclass
class BatchReport:
    """What one micro-batch did (``StatefulRunner.reports``)."""

    batch_id: int
    skipped: bool
    checkpoint_id: int | None = None
    tasks: dict[int, dict] = field(default_factory=dict)
    segments: int = 0
    output_rows: int = 0
    duration_ms: float = 0.0
    plan_ms: float = 0.0      # checkpoint lookup, offset log, plan
    tasks_ms: float = 0.0     # the Spark job that runs the tasks
    callback_ms: float = 0.0  # the user's foreach_batch
    commit_ms: float = 0.0    # output table, callback and state checkpoint
    state: dict | None = None  # the state figures (StatefulRunner.state_figures)


def _to_arrow_schema(schema: Any, what: str) -> pa.Schema:
    if isinstance(schema, pa.Schema):
        return schema
    from pyspark.sql.pandas.types import to_arrow_schema

    struct = spark_struct(schema, what)
    return to_arrow_schema(struct, timezone="UTC")


def _struct_of(schema: pa.Schema) -> StructType:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no JVM on this side)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _read_checkpoint_file(spark: SparkSession, checkpoint_location: str, name: str) -> str:
    """A file of Spark's streaming checkpoint: on the driver's local disk read directly; else
    through Spark's own Hadoop filesystem (so any scheme Spark can use works: hdfs, s3a,
    abfss, dbfs...), with the JVM of a classic session or a text read under Spark Connect."""
    location = checkpoint_location.rstrip("/")
    local = f"{location[len('file:'):] if location.startswith('file:') else location}/{name}"
    # A path without a scheme is on Spark's default filesystem (HDFS on some clusters): read
    # directly only when it is on this host's disk.
    if location.startswith("file:") or ("://" not in location and os.path.exists(local)):
        with open(local, encoding="utf-8") as f:
            return f.read()
    if is_connect(spark):
        rows = spark.read.option("lineSep", "\n").text(f"{location}/{name}").collect()
        return "\n".join(r[0] for r in rows)
    jvm = spark._jvm
    path = jvm.org.apache.hadoop.fs.Path(f"{checkpoint_location.rstrip('/')}/{name}")
    fs = path.getFileSystem(spark._jsc.hadoopConfiguration())
    stream = fs.open(path)
    try:
        return jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
    finally:
        stream.close()


def _offset_metadata(spark: SparkSession, checkpoint_location: str, batch_id: int) -> dict:
    """Spark's offset-log entry of a batch: batchTimestampMs and batchWatermarkMs. Spark
    writes it before running the batch and reuses it when it replays the batch."""
    try:
        lines = _read_checkpoint_file(spark, checkpoint_location, f"offsets/{batch_id}").splitlines()
        return json.loads(lines[1])
    except Exception as e:
        raise QueryCheckpointUnreadableError(
            f"cannot read Spark's offset log entry {checkpoint_location}/offsets/{batch_id} for batch {batch_id}'s "
            f"timestamp and watermark ({e}); is {checkpoint_location!r} the query's checkpointLocation?"
        ) from e


def _query_id(spark: SparkSession, checkpoint_location: str) -> str:
    """The persistent id of the streaming query (``<checkpointLocation>/metadata``)."""
    try:
        return json.loads(_read_checkpoint_file(spark, checkpoint_location, "metadata"))["id"]
    except Exception as e:
        raise QueryCheckpointUnreadableError(f"cannot read the query id in {checkpoint_location}/metadata: {e}") from e


def _murmur3_int(value: int, seed: int = 42) -> int:
    """Spark's ``Murmur3_x86_32.hashInt`` (the hash of ``hash(col)`` and of hash partitioning)."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    k1 = rotl((value & mask) * 0xCC9E2D51 & mask, 15) * 0x1B873593 & mask
    h1 = (rotl(seed ^ k1, 13) * 5 + 0xE6546B64) & mask
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & mask
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & mask
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1


def partition_values(parallelism: int) -> list[int]:
    """For each partition i of ``repartition(parallelism, col)``, the smallest int that Spark's
    hash partitioning (``pmod(murmur3(col, 42), parallelism)``) sends to partition i."""
    first: dict[int, int] = {}
    v = 0
    while len(first) < parallelism:
        first.setdefault(_murmur3_int(v) % parallelism, v)
        v += 1
    return [first[i] for i in range(parallelism)]


class StatefulRunner:
    """The ``foreachBatch`` function of a stateful query (driver side)."""

    def __init__(self, spark: SparkSession, *, keys: list[str], processor: Any, input_schema: pa.Schema,
                 output_schema: pa.Schema, layout: StateLayout, location: StateLocation, checkpoint_location: str,
                 foreach_batch: Callable[[DataFrame, int], None] | None, output: OutputTable | None,
                 time_mode: str, event_time_column: str | None, initial_state: DataFrame | None,
                 store_config: StoreConfig, compaction: CompactionPolicy | None = None,
                 beacon: str | None = None, watermark_delay_ms: int | None = None, api: str = "row",
                 output_table: str | None = None, async_options: AsyncOptions | None = None,
                 operator_state: Sequence[OperatorStateDescriptor] = ()):
        self.spark = spark
        self.operator_state = tuple(operator_state)
        self.keys = keys
        self.processor = processor
        self.input_schema = input_schema
        self.output_schema = output_schema
        self.layout = layout
        self.location = location
        self.checkpoint_location = checkpoint_location
        self.foreach_batch = foreach_batch
        self.output = output
        self.output_table = output_table  # its identifier, to reopen it (``_revive``)
        self.time_mode = time_mode
        self.event_time_column = event_time_column
        self.initial_state = initial_state
        if store_config.count_live_rows is None and (
                spark.conf.get(TRACK_ROWS_CONF, None) or "true").strip().lower() == "false":
            store_config = dataclasses.replace(store_config, count_live_rows=False)
        self.store_config = store_config
        self.api = api
        self.async_options = async_options
        self.failure: BaseException | None = None  # what the last failed batch raised
        # Why the query was stopped before its first batch could run (``WorkerEnvironmentError``
        # from the warm-up beside its start); the query's failure.
        self.setup_failure: BaseException | None = None
        self.warm_thread: threading.Thread | None = None  # the warm-up beside the start (``_warm_beside``)
        self.timezone = spark.conf.get("spark.sql.session.timeZone") or "UTC"
        # Spark reads it when a query starts; off: no batch without input (due timers wait for input).
        self.no_data_batches = (spark.conf.get(NO_DATA_CONF, None) or "true").strip().lower() != "false"
        # How a pandas processor's DataFrames are cut, as Spark's Arrow batches (read at start).
        self.batching = ArrowBatching.of_session(spark.conf.get) if api in ("pandas", "async_pandas") else None
        # What is due next and the state figures, for the ticks source; None for a query without it.
        self.beacon = beacon
        self.watermark_delay_ms = watermark_delay_ms
        self.run_id = uuid.uuid4().hex
        # Authenticates the processor exceptions its tasks send back (``spark_integration.errors``).
        self.error_key = ErrorKey()
        self.query_id: str | None = None  # Spark's persistent query id, read at the first batch
        self.connect = is_connect(spark)
        self.table = location.open(layout)
        self.task_tokens: dict[int, tuple[int, str]] = {}
        # Each task's committed tokens of this run, newest last (``tasks.TOKENS_KEPT``): a
        # worker whose store's flush is among them catches up instead of restoring.
        self.task_history: dict[int, tuple[tuple[int, str], ...]] = {}
        # Routing, built once (a runner's parallelism and columns never change).
        self._part_values = partition_values(location.parallelism)
        self._beats_frame: DataFrame | None = None
        self._projections: dict[tuple, tuple[list, Any]] = {}
        # Reports of tasks whose output rows are the callback's DataFrame: an accumulator, which
        # only a classic session has (under Spark Connect outputs go through files instead).
        self._reports = None if self.connect else spark.sparkContext.accumulator([], ReportParam())
        # The newest batches' reports: bounded as Spark bounds a query's recent progress, so a
        # query that runs for weeks does not grow (the soak's driver grew with one report per
        # batch, and by 5 % until 1,000 reports were kept).
        self.reports: collections.deque[BatchReport] = collections.deque(maxlen=reports_kept(spark))
        # Compaction beside the stream, in a process of its own started when a unit needs it.
        self.compaction = compaction
        self.compactor = _compactor(spark, location, compaction)

    def __getstate__(self) -> dict:
        """What Spark Connect ships to the server's Python process that runs the batches: the
        plain values; the session, the open tables, the compactor and the routing columns are
        made again there (``_revive``), from the batch's own session."""
        state = dict(self.__dict__)
        for name in ("spark", "table", "output", "compactor", "_reports", "_beats_frame", "warm_thread"):
            state[name] = None
        state["_projections"] = {}
        return state

    def _revive(self, spark: SparkSession) -> None:
        """Reopen what ``__getstate__`` left behind (a runner unpickled by Spark Connect)."""
        self.spark = spark
        if self.table is None:
            self.table = self.location.open(self.layout)
            if self.output_table is not None:
                self.output = OutputTable.open(self.location.ref.catalog(), self.output_table, self.output_schema)
            self.compactor = _compactor(spark, self.location, self.compaction)

    # ------------------------------------------------------------------ the batch function

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        try:
            self._batch(batch_df, batch_id)
        except Exception as e:
            # A processor's own exception, carried by its task's failure, is what the query
            # failed of (``StatefulQuery.exception``), Spark's error chained as its cause.
            original = user_error(e, self.error_key)
            self.failure = e if original is None else original
            if original is None:
                raise
            raise original from e

    def _batch(self, batch_df: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        self._revive(batch_df.sparkSession)
        info = self.table.current_checkpoint()
        adopted = self._check_same_query(info)
        if not adopted:
            self._check_in_step(info, batch_id)
        if not adopted and info is not None and info.batch_id is not None and batch_id <= info.batch_id:
            log.info("batch %d is already in state checkpoint %d: skipped", batch_id, info.checkpoint_id)
            self.reports.append(BatchReport(batch_id, skipped=True, checkpoint_id=info.checkpoint_id))
            return
        plan = self._plan(batch_id, info)
        report = BatchReport(batch_id, skipped=False, checkpoint_id=plan.checkpoint_id,
                             plan_ms=(time.perf_counter() - started) * 1000)
        if plan.inline_outputs:
            self._run_with_callback(batch_df, plan, report)
        else:
            ran = time.perf_counter()
            rows = self._task_frame(batch_df, plan).collect()
            report.tasks_ms = (time.perf_counter() - ran) * 1000
            self._commit(plan, [(r[0], r[1], r[2]) for r in rows], report)
        report.duration_ms = (time.perf_counter() - started) * 1000
        self.reports.append(report)

    def _run_with_callback(self, batch_df: DataFrame, plan: BatchPlan, report: BatchReport) -> None:
        """Only the callback reads the outputs: its DataFrame is the tasks' output rows, so the
        callback's own action runs the tasks (one Spark job per batch, as Spark's own
        ``foreachBatch`` of a stateful query), and the tasks' reports come back through an
        accumulator. Tasks that did not report (a callback that read part of its DataFrame,
        or none) run again in a job of ours; a task that ran several times (several actions)
        has its last report committed: each attempt flushed a complete, equivalent state."""
        self._reports.value = []
        frame = self._task_frame(batch_df, plan, self._reports)
        started = time.perf_counter()
        self.foreach_batch(frame, plan.batch_id)
        report.callback_ms = (time.perf_counter() - started) * 1000
        rows = self._reported(plan)
        if rows is None:
            log.info("batch %d: the callback did not run every task; running them", plan.batch_id)
            frame.write.format("noop").mode("overwrite").save()
            rows = self._reported(plan)
            if rows is None:
                raise TaskReportError(f"batch {plan.batch_id}: tasks did not report after a full run; nothing "
                                      "committed")
        report.tasks_ms = (time.perf_counter() - started) * 1000
        self._reports.value = []
        self._commit(plan, rows, report)

    def _reported(self, plan: BatchPlan) -> list[tuple] | None:
        """The report rows of every task of the batch (the last attempt of each), or None when
        a task has not reported."""
        last: dict[int, list] = {}
        for batch_id, task, rows in self._reports.value:
            if batch_id == plan.batch_id:
                last[task] = rows
        if set(last) != set(range(self.location.parallelism)):
            return None
        return [row for task in sorted(last) for row in last[task]]

    def _commit(self, plan: BatchPlan, rows: list[tuple], report: BatchReport) -> None:
        batch_id = plan.batch_id
        segments, uris, operator_files = [], [], []
        for task, kind, payload in rows:
            if kind == "task":
                if task in report.tasks:
                    raise TaskReportError(f"task {task} reported twice in batch {batch_id}; nothing committed")
                report.tasks[task] = json.loads(payload)
            elif kind == "segment":
                segments.append(segment_of(payload))
            elif kind == "operator_state":
                operator_files.append(OperatorStateFile(**json.loads(payload)))
            else:
                out = json.loads(payload)
                uris.append(out["uri"])
                report.output_rows += out["rows"]
        if plan.inline_outputs:
            report.output_rows = sum(t["rows_out"] for t in report.tasks.values())
        report.segments = len(segments)
        kill_if_asked("tasks_done", batch_id)
        commit_started = time.perf_counter()
        # A replay of a batch whose outputs are already committed wrote spare copies: they serve
        # the callback, then go.
        # Without an output table the files only serve the callback (Spark Connect), then go.
        spare = self.output is None or not self.output.commit(batch_id, uris, self.query_id)
        kill_if_asked("outputs_committed", batch_id)
        if self.foreach_batch is not None and not plan.inline_outputs:
            called = time.perf_counter()
            self.foreach_batch(self._output_frame(uris), batch_id)
            report.callback_ms = (time.perf_counter() - called) * 1000
        beacon = self._beacon(plan, report)  # what the new state needs next: summary and beacon file
        ledger, expired = self._ledger(plan, report)
        properties = self._properties(plan, report, beacon)
        if ledger is not None:
            properties[stored_keys.QUERY_LIVE_ROWS] = ledger.encode()
        state_commit = time.perf_counter()
        self.table.commit_checkpoint(plan.checkpoint_id, segments, parallelism=self.location.parallelism,
                                     batch_id=batch_id, properties=properties, operator_state=operator_files)
        state_commit_ms = (time.perf_counter() - state_commit) * 1000
        for task, stats in report.tasks.items():
            self.task_tokens[task] = token = (plan.checkpoint_id, stats["token"])
            self.task_history[task] = (*self.task_history.get(task, ())[1 - TOKENS_KEPT:], token)
        report.state = self.state_figures(plan, report, state_commit_ms, ledger, expired)
        if self.beacon is not None:
            write_beacon(self.beacon, dataclasses.replace(beacon, state=report.state))
        kill_if_asked("state_committed", batch_id)
        if self.compactor is not None:
            self.compactor.checkpoint_committed(self.table)
        if spare and uris:
            self._delete_files(uris)
        report.commit_ms = (time.perf_counter() - commit_started) * 1000

    # ------------------------------------------------------------------ steps

    def _check_same_query(self, info: Any) -> bool:
        """Batch ids only mean something within one streaming query: refuse to continue a state
        table that another query (another checkpointLocation) wrote, which would skip its batches.
        A fork at the checkpoint it was forked from is the exception: a new query adopts that
        state as its starting point (True: no batch of it is a replay)."""
        if self.query_id is None:
            self.query_id = _query_id(self.spark, self.checkpoint_location)
        owner = None if info is None else info.properties.get(stored_keys.QUERY_ID)
        if owner is not None and owner != self.query_id:
            if self.table.at_fork_point():
                log.info("fork %s of %s: this query starts from checkpoint %d of query %s", self.table.branch,
                         self.table.identifier, info.checkpoint_id, owner)
                return True
            raise QueryMismatchError(
                f"state table {self.table.identifier} holds the state of streaming query {owner}, but this query "
                f"({self.checkpoint_location}) is {self.query_id}: its batch ids would not line up with the "
                "checkpoints. Restart with the original checkpointLocation, give this query its own state table, "
                "or fork the state (IcebergStateTable.fork) and run this query on the fork"
            )
        return False

    def _check_in_step(self, info: Any, batch_id: int) -> None:
        """Spark runs batch n after committing n-1 (its ``commits`` log), and the state of a
        batch commits before Spark's record of it: so the state table's newest checkpoint is of
        batch n-1, or of n when this is the replay of a batch whose state committed. Anything
        else means the state table was rolled back or restored by hand (behind), or Spark's
        checkpoint was (ahead): running on would silently drop the missing batches' state."""
        if info is not None and info.batch_id is None:
            return  # state written outside a query (the store's API, an initial load): no batches to match
        done = -1 if info is None else info.batch_id
        if done < batch_id - 1:
            missing = f"batch {batch_id - 1}" if done == batch_id - 2 else f"batches {done + 1} to {batch_id - 1}"
            raise StateOutOfStepError(
                f"state table {self.table.identifier} is behind its query: Spark committed batches up to "
                f"{batch_id - 1} ({self.checkpoint_location}), the table's newest checkpoint "
                + ("is none" if info is None else f"{info.checkpoint_id} holds batch {done}")
                + f", so the state of {missing} is missing (the table was rolled back, restored to an older "
                "checkpoint or savepoint, or replaced). Restore the checkpoint of batch "
                f"{batch_id - 1} if it is retained, or start the query on a new checkpointLocation")
        if done > batch_id:
            raise StateOutOfStepError(
                f"state table {self.table.identifier} is ahead of its query: its newest checkpoint "
                f"{info.checkpoint_id} holds batch {done}, but Spark is running batch {batch_id} "
                f"({self.checkpoint_location} was rolled back or restored from an older copy), so batches "
                f"{batch_id + 1} to {done} would be planned again on state that already has them. Restore the "
                f"state table to the checkpoint of batch {batch_id - 1} (icestate checkpoints lists them), or "
                "use the checkpointLocation that ran it")

    def _plan(self, batch_id: int, info: Any) -> BatchPlan:
        meta = _offset_metadata(self.spark, self.checkpoint_location, batch_id)
        processing_time = int(meta["batchTimestampMs"])
        watermark = late_watermark = -1
        if self.time_mode != "none":
            # TimerValues' watermark: Spark's in both time modes (0 before any, and in
            # ProcessingTime mode without a watermark); -1 only without a time mode.
            watermark = int(meta.get("batchWatermarkMs") or 0)
        if self.time_mode == "eventtime":
            # The watermark's two roles, as Spark's stateful operators: this batch's evicts state
            # and fires timers; the previous batch's drops late input (Spark's
            # eventTimeWatermarkForLateEvents), so a row is never dropped by a watermark that
            # its own batch's input moved.
            late_watermark = 0 if batch_id == 0 else int(
                _offset_metadata(self.spark, self.checkpoint_location, batch_id - 1).get("batchWatermarkMs") or 0)
        # Outputs go to the output table as data files; when only the callback reads them, they
        # are the rows of the tasks' DataFrame that the callback gets.
        output_dir = self.output.data_location if self.output is not None else None
        inline = self.output is None and self.foreach_batch is not None and self._reports is not None
        if self.output is None and self.foreach_batch is not None and not inline:
            output_dir = self._scratch_dir()  # the callback's rows as files, deleted after it
        return BatchPlan(
            run_id=self.run_id, table=self.location.identity, parallelism=self.location.parallelism,
            view=self.table.checkpoint_view(), layout=self.layout, processor=self.processor,
            input_columns=tuple(self.input_schema.names), output_schema=self.output_schema, batch_id=batch_id,
            checkpoint_id=self.table.next_checkpoint_id(),
            base_checkpoint_id=None if info is None else info.checkpoint_id,
            task_tokens=dict(self.task_tokens), task_history=dict(self.task_history),
            processing_time_ms=processing_time, watermark_ms=watermark,
            late_watermark_ms=late_watermark,
            time_mode=self.time_mode, event_time_column=self.event_time_column, output_dir=output_dir,
            output_io=self.table.checkpoint_view().io if self.output is None else self.output.io_properties,
            store_config=self.store_config, inline_outputs=inline, api=self.api, timezone=self.timezone,
            batching=self.batching,
            error_key=self.error_key, async_options=self.async_options, operator_state=self.operator_state,
        )

    def _routed(self, df: DataFrame, columns: Sequence[str], heartbeat: bool = False) -> DataFrame:
        """``df``'s ``columns`` with each row's key group, task (and with ``heartbeat`` a false
        heartbeat flag) and partition value, partitioned so that Spark partition i holds our task i.

        One projection and one repartition, of column expressions built once: each DataFrame
        and column call is a Py4J round trip (a micro-batch's plan took 245 of them, 50-100 ms),
        and each DataFrame call an analysis of the whole plan on the driver.
        """
        p = self.location.parallelism
        key = (tuple(columns), heartbeat)
        if key not in self._projections:
            n = self.layout.max_parallelism
            kg = F.pmod(F.xxhash64(*[F.col(k) for k in self.keys]), F.lit(n)).cast("int")
            # Flink's range of a key group, key_group * p div n; exact in doubles (kg * p < 2^31).
            task = F.floor(kg * F.lit(p) / F.lit(n)).cast("int")
            marks = [F.lit(False).alias(HEARTBEAT)] if heartbeat else []
            self._projections[key] = ([F.col(c) for c in columns] + [kg.alias(KG), task.alias(TASK), *marks,
                                                                     self._part_of(task).alias(PART)], F.col(PART))
        projection, part = self._projections[key]
        routed = df.select(*projection)
        if heartbeat:
            routed = routed.union(self._beats(df, columns))
        return routed.repartition(p, part)

    def _part_of(self, task: Any) -> Any:
        # repartition(p, PART) hashes PART into p partitions; PART is a value chosen per task so
        # that task i lands in partition i: p Spark tasks with one of ours each, never merged
        # by adaptive execution (it keeps a repartition's explicit number), and the groupBy on
        # PART needs no second shuffle.
        return F.element_at(F.array(*[F.lit(v) for v in self._part_values]), task + 1)

    def _beats(self, df: DataFrame, columns: Sequence[str]) -> DataFrame:
        """One heartbeat row per task (the same for every batch: built once), so that every task
        runs in every batch, with or without rows: its timers fire, and it reports. Only the
        batch's own rows (always the same ``columns``) get heartbeats."""
        if self._beats_frame is None:
            types = {f.name: f.dataType for f in df.schema.fields}
            task = F.col("id").cast("int")
            self._beats_frame = self.spark.range(0, self.location.parallelism, 1, 1).select(
                *[F.lit(None).cast(types[c]).alias(c) for c in columns], F.lit(None).cast("int").alias(KG),
                task.alias(TASK), F.lit(True).alias(HEARTBEAT), self._part_of(task).alias(PART))
        return self._beats_frame

    def _task_frame(self, batch_df: DataFrame, plan: BatchPlan, reports: Any = None) -> DataFrame:
        """The batch's tasks as a DataFrame (lazy): their report rows, or with inline outputs
        their output rows (reports then go to the ``reports`` accumulator)."""
        # Every task runs (a heartbeat row each) where one without input still has work: timers
        # to fire, its share of the callback's outputs, operator state to write.
        routed = self._routed(batch_df, self.input_schema.names,
                              heartbeat=self.time_mode != "none" or plan.inline_outputs or bool(plan.operator_state))
        schema = _struct_of(self.output_schema if plan.inline_outputs else RESULT_ARROW)
        # Plain closures, not functools.partial: pyspark's eval-type inference fails on partials.
        initial = self.initial_state if plan.base_checkpoint_id is None else None
        if initial is not None:
            from spark_integration.tasks import run_task_with_initial

            def with_initial(key, rows, initial_rows):
                return run_task_with_initial(plan, key, rows, initial_rows, reports)

            seeded = self._routed(initial, initial.columns)
            return routed.groupBy(PART).cogroup(seeded.groupBy(PART)).applyInArrow(with_initial, schema)

        def task(batches):
            yield from run_partition(plan, batches, reports)

        # Each partition is exactly one task's rows: mapInArrow, no grouping sort (the tasks
        # ignore the partition value column).
        return routed.mapInArrow(task, schema)

    def _output_frame(self, uris: Sequence[str]) -> DataFrame:
        """The batch's output files as a DataFrame read on the executors. Local files go
        through Spark's own Parquet reader; files elsewhere (an object store, which Spark's
        Hadoop filesystems would need extra jars and their own credentials to read) through
        pyarrow with the output table's storage properties, one Spark task per file."""
        struct = _struct_of(self.output_schema)
        if not uris:
            return self.spark.createDataFrame([], struct)
        if all(u.startswith("file:") or "://" not in u for u in uris):
            return self.spark.read.schema(struct).parquet(*uris)
        io = self.output.io_properties if self.output is not None else self.table.checkpoint_view().io
        schema = self.output_schema

        def read(batches):
            from spark_integration.tasks import read_output_files

            yield from read_output_files(batches, io, schema)

        names = self.spark.createDataFrame([(u,) for u in uris], "uri string").repartition(len(uris))
        return names.mapInArrow(read, struct)

    def _properties(self, plan: BatchPlan, report: BatchReport, beacon: Beacon) -> dict[str, str]:
        props = {stored_keys.QUERY_RUN_ID: self.run_id, stored_keys.QUERY_ID: self.query_id}
        if plan.watermark_ms >= 0:
            props[stored_keys.QUERY_WATERMARK_MS] = str(plan.watermark_ms)
        events = _max_event_ms(report)
        if events is not None:
            props[stored_keys.QUERY_MAX_EVENT_TIME_MS] = str(events)
        if self.time_mode != "none":
            if beacon.next_timer_ms is not None:
                props[stored_keys.QUERY_NEXT_TIMER_MS] = str(beacon.next_timer_ms)
            if beacon.next_watermark_ms >= 0:
                props[stored_keys.QUERY_NEXT_WATERMARK_MS] = str(beacon.next_watermark_ms)
        return props

    def _ledger(self, plan: BatchPlan, report: BatchReport) -> tuple[Ledger | None, int]:
        """The live rows after the batch (``statestore.live_rows``): the base checkpoint's ledger
        plus every task's change, without the rows expired at the batch's time; and how many
        expired. None when unknown: a base checkpoint without a ledger (state written outside a
        query, or by an older version), or a task that did not count."""
        base = self.table.current_checkpoint()  # the batch's base: only this driver commits checkpoints
        if base is None:
            ledger = Ledger()
        else:
            text = base.properties.get(stored_keys.QUERY_LIVE_ROWS)
            if text is None:
                return None, 0
            ledger = Ledger.decode(text)
        for task in report.tasks.values():
            change = task.get("live_rows", None)
            if change is None:
                return None, 0
            ledger.add({name: dict(pairs) for name, pairs in change.items()})
        return ledger, ledger.expire(plan.processing_time_ms)

    def state_figures(self, plan: BatchPlan, report: BatchReport, commit_ms: float, ledger: Ledger | None = None,
                      expired: int = 0) -> dict:
        """The batch's state figures, named as Spark's state operator progress where there is
        one: what the ticks source shows in the query's progress, and ``BatchReport.state``.
        ``ledger``: the live rows after the batch (``_ledger``), whose total is ``numRowsTotal``
        (absent when unknown); ``expired``: the rows its TTL removed, in ``numRowsRemoved`` as on Spark."""
        tasks = report.tasks.values()

        def total(name: str) -> int:
            return int(sum(t.get(name) or 0 for t in tasks))

        segments = self.table.checkpoint_view().segments  # the committed checkpoint's, in memory
        live = {} if ledger is None else {"numRowsTotal": ledger.total()}  # timers are not in it
        return {
            "batchId": plan.batch_id, "checkpointId": plan.checkpoint_id, "numTasks": len(report.tasks), **live,
            "numRowsUpdated": total("state_rows_updated"), "numRowsRemoved": total("state_rows_removed") + expired,
            "numEntriesTotal": int(sum(s.record_count for s in segments)),
            "stateBytes": int(sum(s.size_bytes for s in segments)), "numSegmentsTotal": len(segments),
            "segmentsWritten": report.segments, "segmentBytesWritten": total("segment_bytes"),
            "commitTimeMs": round(commit_ms), "numRowsDroppedByWatermark": total("rows_late"),
            "fileCacheHits": total("file_cache_hits"), "fileCacheMisses": total("file_cache_misses"),
            "timersFired": total("timers_fired"), "numRegisteredTimers": total("timers"),
        }

    def _beacon(self, plan: BatchPlan, report: BatchReport) -> Beacon:
        """What the state committed by this batch needs next (``spark_integration.ticks``)."""
        timers = [t["next_timer_ms"] for t in report.tasks.values() if t.get("next_timer_ms") is not None]
        next_watermark = plan.watermark_ms
        events = _max_event_ms(report)
        if self.time_mode == "eventtime" and events is not None and self.watermark_delay_ms is not None:
            # Spark's rule (WatermarkTracker): the batch's max event time minus the delay, if ahead.
            next_watermark = max(plan.watermark_ms, events - self.watermark_delay_ms)
        return Beacon(checkpoint_id=plan.checkpoint_id, time_mode=self.time_mode,
                      next_timer_ms=min(timers) if timers else None, watermark_ms=plan.watermark_ms,
                      next_watermark_ms=next_watermark, no_data_batches=self.no_data_batches)

    def _delete_files(self, uris: Sequence[str]) -> None:
        if self.output is not None:
            self.output.delete_files(list(uris))
            return
        where = locations_of(uris[0], self.table.checkpoint_view().io)
        for uri in uris:
            with contextlib.suppress(FileNotFoundError):
                where.filesystem.delete_file(where.to_path(uri))

    def _scratch_dir(self) -> str:
        """Where the tasks write the callback's rows when they cannot be its DataFrame."""
        return f"{self.table.checkpoint_view().location.rstrip('/')}/{SCRATCH_OUTPUTS_DIR}/{self.run_id}"

    def close(self) -> None:
        """Release the state table and output table, and stop the compactor (after the
        compaction it may be running). Called when the query terminates."""
        if self.compactor is not None:
            self.compactor.close()
        self.table.close()
        if self.output is not None:
            self.output.close()


def _compactor(spark: Any, location: StateLocation, policy: CompactionPolicy | None
               ) -> CompactorProcess | SparkCompactor | None:
    """A stream's compactor: a process beside the driver, or Spark jobs of the stream's session
    (``CompactionPolicy.runs_on``; ``auto``: Spark jobs on a master that is not local)."""
    if policy is None:
        return None
    if runs_on(policy, str(spark.conf.get("spark.master", "local"))) == "spark":
        return SparkCompactor(spark, location.ref, policy)
    return CompactorProcess(location.ref, policy)


def _max_event_ms(report: BatchReport) -> int | None:
    events = [t["max_event_ms"] for t in report.tasks.values() if t.get("max_event_ms") is not None]
    return max(events) if events else None


_RUNNERS: dict[str, StatefulRunner] = {}
# The metadata key of a column marked by withWatermark (Spark's EventTimeWatermark.delayKey).
WATERMARK_DELAY_KEY = "spark.watermarkDelayMs"
DEFAULT_COMPACTION = CompactionPolicy()


def runner_of(query: StreamingQuery) -> StatefulRunner:
    """The runner (batch reports, state table) of a query started by ``start_stateful_query``."""
    return _RUNNERS[query.id]


def _check_keys(df: DataFrame, keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str):
        keys = [keys]
    keys = list(keys)
    if not keys:
        raise ValueError("keys must name at least one column of the input")
    columns = df.columns
    missing = [k for k in keys if k not in columns]
    if missing:
        raise SchemaMismatchError(f"key column(s) {missing} are not in the input; its columns are {columns}")
    reserved = [c for c in columns if c.startswith("__icestate")]
    if reserved:
        raise ValueError(f"input column(s) {reserved} use the reserved prefix '__icestate'; rename them")
    return keys


def _conform_initial(initial: DataFrame, df: DataFrame, keys: list[str]) -> DataFrame:
    """The initial state's key columns cast to the stream's key types: Spark hashes an int and
    a long differently, so an uncast key would be routed to another key group."""
    missing = [k for k in keys if k not in initial.columns]
    if missing:
        raise SchemaMismatchError(f"initial_state lacks key column(s) {missing}; its columns are {initial.columns}")
    types = {f.name: f.dataType for f in df.schema.fields}
    for k in keys:
        if initial.schema[k].dataType != types[k]:
            initial = initial.withColumn(k, F.col(k).cast(types[k]))
    return initial


def _watermark_of(df: DataFrame) -> tuple[str, int] | None:
    """The input's watermark (``withWatermark``): its column and delay in ms, from the mark
    Spark puts in the column's metadata; None without one."""
    for f in df.schema.fields:
        delay = (f.metadata or {}).get(WATERMARK_DELAY_KEY)
        if delay is not None:
            return f.name, int(delay)
    return None


def _warm_workers(spark: SparkSession, location: StateLocation, view: CheckpointView, layout: StateLayout) -> None:
    """Start a Python worker per executor core (up to the query's parallelism), with the
    store's modules imported and the state table opened once: a cold worker spends seconds
    importing pyarrow, polars and the Iceberg client, which the first batch would otherwise
    wait for. Also the check that the workers can import the library at all: a worker that
    runs another interpreter than the driver (``PYSPARK_PYTHON`` unset) fails here, with a
    message that says so, instead of in the first batch with a ``ModuleNotFoundError``."""
    cores = location.parallelism if is_connect(spark) else spark.sparkContext.defaultParallelism
    workers = max(1, min(cores, location.parallelism))

    def warm(batches):
        from spark_integration.tasks import warm_worker

        for _ in batches:
            pass
        warm_worker(view, layout)
        yield pa.RecordBatch.from_pydict({"pid": [os.getpid()]}, schema=pa.schema([("pid", pa.int64())]))

    try:
        with _described(spark, "icestate: warm Python workers"):
            spark.range(0, workers, 1, workers).mapInArrow(warm, "pid long").collect()
    except Exception as e:
        failure = _environment_error(spark, str(e))
        if failure is not None:
            raise failure from None
        log.warning("warming Python workers failed (the first batch starts them): %s", e)


def _environment_error(spark: Any, text: str) -> WorkerEnvironmentError | None:
    """The error that says what to do when Spark's ``text`` (a failed job's) shows that a Python
    worker could not import a module."""
    missing = _import_failure(text)
    if missing is None:
        return None
    python = (None if is_connect(spark) else getattr(spark.sparkContext, "pythonExec", None)) or os.environ.get(
        "PYSPARK_PYTHON") or "python3"
    return WorkerEnvironmentError(
        f"Spark's Python workers cannot import icestate ({missing}): they run {python!r}, this driver runs "
        f"{sys.executable!r}. Set PYSPARK_PYTHON={sys.executable} before the SparkSession starts (on a "
        "cluster: an interpreter with icestate and its dependencies on every executor)")


@contextlib.contextmanager
def _described(spark: SparkSession, description: str):
    """Spark's jobs started by this thread inside show ``description`` in the UI (classic
    sessions: a Connect client has no SparkContext)."""
    sc = None if is_connect(spark) else spark.sparkContext
    if sc is not None:
        sc.setLocalProperty("spark.job.description", description)
    try:
        yield
    finally:
        if sc is not None:
            sc.setLocalProperty("spark.job.description", None)


def _warm_ticks_planner(spark: SparkSession, beacon: str) -> None:
    with _described(spark, "icestate: start the ticks source's planners"):
        warm_planner(spark, beacon)


def _import_failure(text: str) -> str | None:
    """The import error in a failed Python worker's traceback, if that is why it failed."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(("ModuleNotFoundError:", "ImportError:")):
            return line
    return None


def start_stateful_query(
    df: DataFrame, keys: Sequence[str] | str, processor: StatefulProcessor | VectorizedProcessor,
    output_schema: StructType | str | pa.Schema | None = None, *, location: StateLocation,
    checkpoint_location: str, trigger: dict[str, Any] | None = None,
    foreach_batch: Callable[[DataFrame, int], None] | None = None, output_table: str | None = None,
    time_mode: str = "None", event_time_column: str | None = None, initial_state: DataFrame | None = None,
    query_name: str | None = None, store_config: StoreConfig | None = None, warm_workers: bool = True,
    compaction: CompactionPolicy | None = DEFAULT_COMPACTION, api: str = "row", progress_figures: bool = False,
    async_options: AsyncOptions | None = None,
) -> StreamingQuery:
    """Start a streaming query that runs ``processor`` per key with state in an Iceberg table.

    Args:
        df: the streaming input.
        keys: the grouping key column(s).
        processor: a ``pyspark.sql.streaming.StatefulProcessor`` subclass instance (Spark's
            row API, run unchanged) or a ``VectorizedProcessor`` (Arrow batches).
        output_schema: schema of the processor's output rows (StructType, DDL string or
            Arrow schema); optional for ready-made vectorized operators.
        location: the state table (catalog, name, max parallelism, this run's parallelism).
        checkpoint_location: Spark's streaming checkpoint directory (source offsets).
        trigger: ``DataStreamWriter.trigger`` keyword arguments, e.g. ``{"availableNow": True}``.
        foreach_batch: called with each batch's output rows as a DataFrame and the batch id,
            before that batch's state is committed (at least once; use the batch id to dedupe).
            Without ``output_table`` the DataFrame computes the batch when read, as Spark's
            own ``foreachBatch`` DataFrame of a stateful query does: each action on it runs
            the tasks again (same rows); cache it to read it several times.
        output_table: ``namespace.name`` of an Iceberg table in the state table's catalog that
            receives the output rows exactly once (created when missing).
        time_mode: "None", "ProcessingTime" or "EventTime" (timers fire on the batch's
            processing time or on the query's watermark, from ``withWatermark``).
        event_time_column: the event-time column; in EventTime mode, rows older than the
            watermark are dropped as late, as Spark's stateful operators do.
        initial_state: rows to seed state in the first batch: for a StatefulProcessor, fed
            to ``handleInitialState`` per row; for a vectorized one, key columns plus one
            column per value state.
        warm_workers: beside the query's start (the stream does not wait for it), run a
            small job that starts Python workers on the executors, imports the store's modules
            in them and opens the state table, so the first batch's tasks find warm workers
            (Spark reuses them), and read the ticks source once (when the query has it) so that
            Spark's planners of it are started; a worker that cannot import the library fails
            the query with ``WorkerEnvironmentError`` (from ``awaitTermination`` and
            ``exception``), before any state is written.
        api: for a ``StatefulProcessor``, the API it is written for: ``"row"`` (Spark's
            ``transformWithState``: ``Row``s in, ``Row``s out) or ``"pandas"`` (Spark's
            ``transformWithStateInPandas``: a key's rows as a pandas DataFrame, DataFrames out);
            ``"async"`` or ``"async_pandas"`` for a processor whose handlers are coroutines
            (``async def handleInputRows``) with awaitable state reads, rows or a DataFrame in
            (``spark_integration.async_processor``): many keys in flight per task, each key's
            calls in order, the waiting keys' state read in batches on demand.
        async_options: the bounds of an async processor's execution controller
            (``AsyncOptions``: keys in flight, keys per batched read, how long a read may wait).
        compaction: the policy of the compaction that runs beside the query, in a process
            of its own started when a unit of the state table needs it and stopped with the
            query (``catalog.compactor``); None turns it off (``icestate compact`` then
            compacts on demand).
        progress_figures: show the state figures of the last committed batch in Spark's
            progress (``lastProgress``, every ``StreamingQueryListener``) under the
            ``icestate_ticks`` source's ``latestOffset``, also without timers. A query with
            timers has that source anyway (it runs the batches without input when a timer is
            due) and always shows them; without timers the source is left out unless asked for
            here, because it is a Python data source that Spark starts Python processes for,
            one after another, before the first batch. Fixed for the life of a checkpoint
            location (Spark's checkpoint records its sources).

    Raises (before any state is written): SchemaMismatchError for missing key columns or
    an output that does not fit, UnsupportedKeyTypeError, StateTableMismatchError when the
    table holds state of another key schema or max parallelism, QuerySourcesMismatchError
    when timers or ``progress_figures`` need the ticks source in a checkpoint started without
    it.
    """
    from pyspark.sql.pandas.types import to_arrow_schema

    if not df.isStreaming:
        raise ValueError("start_stateful_query needs a streaming DataFrame (spark.readStream...)")
    if not isinstance(location, StateLocation):
        raise TypeError(f"location must be a StateLocation, got {type(location).__name__}")
    keys = _check_keys(df, keys)
    input_schema = to_arrow_schema(df.schema, timezone="UTC")
    key_schema = pa.schema([input_schema.field(k) for k in keys])
    for f in key_schema:
        check_key_type(f.name, f.type)
    mode = normalize_time_mode(time_mode)
    if event_time_column is not None and event_time_column not in df.columns:
        raise SchemaMismatchError(f"event_time_column {event_time_column!r} is not an input column {df.columns}")
    watermark = _watermark_of(df)
    if event_time_column is None and watermark is not None:
        event_time_column = watermark[0]  # Spark's stateful operators use the watermark's column
    run_schema = input_schema  # the columns the tasks get
    declared = None  # a StatefulProcessor's declarations (compat.DeclaringHandle)
    if isinstance(processor, VectorizedProcessor):
        descriptors = list(processor.state_variables(input_schema, keys))
        operator_state = list(processor.operator_state(input_schema, keys))
        if output_schema is None:
            output_schema = processor.output_schema(input_schema, keys)
        wanted = processor.input_columns(input_schema, keys)
        if wanted is not None:
            wanted = list(dict.fromkeys([*keys, *wanted, *([event_time_column] if event_time_column else [])]))
            missing = [c for c in wanted if c not in input_schema.names]
            if missing:
                raise SchemaMismatchError(f"{type(processor).__name__} reads column(s) {missing} that the input "
                                          f"lacks; its columns are {input_schema.names}")
            run_schema = pa.schema([input_schema.field(c) for c in wanted])
    elif isinstance(processor, StatefulProcessor):
        if api not in ("row", "pandas", "async", "async_pandas"):
            raise ValueError(f"api must be 'row' (Spark's transformWithState), 'pandas' "
                             f"(transformWithStateInPandas), 'async' or 'async_pandas' (coroutine handlers), "
                             f"got {api!r}")
        if api.startswith("async"):
            check_async_processor(processor)
        elif is_async_processor(processor):
            raise TypeError(f"{type(processor).__name__}.handleInputRows is 'async def': start it with "
                            f"api='async' (rows) or api='async_pandas' (DataFrames)")
        declared = declare(processor)
        descriptors = list(declared.descriptors)
        operator_state = declared.operator_states
        with_ttl = [d.name for d in descriptors if d.ttl is not None]
        if with_ttl and mode != "processingtime":
            raise ValueError(f"state {with_ttl} declares a TTL (ttlDurationMs), which needs "
                             f"time_mode='ProcessingTime' (TTL is processing time), not {time_mode!r}; as Spark")
    else:
        raise TypeError("processor must be a pyspark StatefulProcessor or a spark_integration VectorizedProcessor, "
                        f"got {type(processor).__name__}")
    if output_schema is None:
        raise ValueError("output_schema is required for this processor")
    out_schema = _to_arrow_schema(output_schema, "output_schema")
    if mode != "none":
        descriptors.append(timers_descriptor())
    layout = StateLayout.of(key_schema, descriptors, location.max_parallelism)
    if initial_state is not None:
        initial_state = _conform_initial(initial_state, df, keys)
    spark = df.sparkSession
    output = None
    if output_table is not None:  # in the state table's catalog
        output = OutputTable.open(location.ref.catalog(), output_table, out_schema)
    runner = StatefulRunner(
        spark, keys=keys, processor=processor, input_schema=run_schema, output_schema=out_schema, layout=layout,
        location=location, checkpoint_location=checkpoint_location, foreach_batch=foreach_batch, output=output,
        time_mode=mode, event_time_column=event_time_column, initial_state=initial_state,
        store_config=store_config or StoreConfig(), compaction=compaction,
        beacon=beacon_path(checkpoint_location, location.identity), api=api, output_table=output_table,
        async_options=async_options, operator_state=operator_state,
        watermark_delay_ms=None if watermark is None or watermark[0] != event_time_column else watermark[1],
    )
    # The ticks source is a Python data source: Spark starts Python processes for it one after
    # another before the first batch (the lookup of data sources, its creation, the stream's own
    # reader). Only a query that needs it has it: one with timers (batches without input when a
    # timer is due), one that shows the state figures in its progress, and one whose checkpoint
    # already has it (Spark refuses a checkpoint whose sources changed).
    try:
        # Spark's offset log, read once: the sources and the settings the checkpoint was started with.
        offsets = _checkpoint_offsets(spark, checkpoint_location, runner.table.current_checkpoint())
        if declared is not None:
            check_nullable_for_avro(declared, _state_encoding(spark, offsets))
        ticks = _with_ticks(checkpoint_location, offsets, needed=mode != "none", asked=progress_figures)
    except BaseException:
        runner.close()
        raise
    if ticks:
        # Batches without input when a timer is due, as Spark's, and the state figures in the
        # query's progress.
        sweep_beacons(keep=runner.beacon)
        _recover_beacon(runner)
        restamp_beacon(runner.beacon, runner.no_data_batches)
        source = ticks_frame(df, runner.beacon)
        if warm_workers:
            threading.Thread(target=_warm_ticks_planner, args=(spark, runner.beacon),
                             name="icestate-warm-ticks-planner", daemon=True).start()
    else:
        runner.beacon = None
        source = df
    view = runner.table.checkpoint_view()  # taken before the stream's first batch moves the table on
    writer = source.writeStream.foreachBatch(runner).option("checkpointLocation", checkpoint_location)
    if query_name:
        writer = writer.queryName(query_name)
    if trigger:
        writer = writer.trigger(**trigger)
    query = writer.start()
    query.__class__ = _stateful_query_class(type(query))
    query._icestate_runner = runner
    _RUNNERS[query.id] = runner
    threading.Thread(target=_close_when_terminated, args=(query, runner), name="icestate-query-watch",
                     daemon=True).start()
    if warm_workers:
        # The stream does not wait for the warm-up: its first batch plans meanwhile, and its
        # tasks take the warmed workers. With the ticks source the warm-up waits until the
        # stream has started the source's own Python process, which must connect back to Spark
        # within a fixed 10 s (on a loaded machine, started beside the warm-up's workers, it
        # once missed them and the query failed).
        runner.warm_thread = threading.Thread(target=_warm_beside, args=(query, runner, view, ticks),
                                              name="icestate-warm-workers", daemon=True)
        runner.warm_thread.start()
    return query


def _with_ticks(checkpoint_location: str, offsets: list[str] | None, needed: bool, asked: bool) -> bool:
    """Whether the query runs with the ticks source: as its checkpoint was started (``offsets``:
    ``_checkpoint_offsets``), or, for a new checkpoint, when timers need it or the figures are
    asked for."""
    existing = None if offsets is None else any(is_ticks_offset(line) for line in offsets[2:])
    if existing is None:
        return needed or asked
    if not existing and (needed or asked):
        why = "its processor has timers (time_mode)" if needed else "progress_figures=True asks for the state figures"
        raise QuerySourcesMismatchError(
            f"the query's checkpoint {checkpoint_location} was started without the icestate_ticks source, but "
            f"{why}, which needs it; Spark refuses a checkpoint whose sources changed. Start the query on a new "
            "checkpointLocation (and a new state table, or a fork of this one: IcebergStateTable.fork), or keep "
            "the query as it was started")
    return existing


def _recover_beacon(runner: StatefulRunner) -> None:
    """Where the last run's beacon is missing (the query restarted on another driver host, or its
    state was imported from Spark's store), write the one its newest checkpoint's properties
    describe, so a timer already due fires without waiting for input."""
    info = runner.table.current_checkpoint()
    if info is None or runner.time_mode == "none" or read_beacon(runner.beacon) is not None:
        return
    props = info.properties

    def ms(key: str, missing: int | None = -1) -> int | None:
        return int(props[key]) if key in props else missing

    write_beacon(runner.beacon, Beacon(
        checkpoint_id=info.checkpoint_id, time_mode=runner.time_mode,
        next_timer_ms=ms(stored_keys.QUERY_NEXT_TIMER_MS, None), watermark_ms=ms(stored_keys.QUERY_WATERMARK_MS),
        next_watermark_ms=ms(stored_keys.QUERY_NEXT_WATERMARK_MS), no_data_batches=runner.no_data_batches))


def _checkpoint_offsets(spark: SparkSession, checkpoint_location: str, info: Any) -> list[str] | None:
    """The lines of an entry of Spark's offset log of this query (the version, the batch
    metadata with the settings Spark keeps for the query's life, one line per source); None
    when Spark has recorded no batch there yet. The entry read is that of the state table's
    newest batch when this query wrote it (Spark keeps its recent entries), else batch 0's."""
    try:
        query_id = _query_id(spark, checkpoint_location)
    except QueryCheckpointUnreadableError:
        return None  # a new checkpoint location
    batch = 0
    if info is not None and info.batch_id is not None and info.properties.get(stored_keys.QUERY_ID) == query_id:
        batch = info.batch_id
    try:
        return _read_checkpoint_file(spark, checkpoint_location, f"offsets/{batch}").splitlines()
    except Exception:  # none written yet (a query stopped before its first batch)
        return None


def _state_encoding(spark: SparkSession, lines: list[str] | None) -> str | None:
    """Spark's state encoding of the query: the one its checkpoint recorded when it first ran
    (``lines``: ``_checkpoint_offsets``; Spark keeps it for the query's life, whatever the
    session says later), else the session's."""
    if lines is not None and len(lines) > 1:
        with contextlib.suppress(ValueError, AttributeError):
            recorded = (json.loads(lines[1]).get("conf") or {}).get(ENCODING_CONF)
            if recorded:
                return recorded
    return spark.conf.get(ENCODING_CONF, None)


def _warm_beside(query: StreamingQuery, runner: StatefulRunner, view: CheckpointView, after_sources: bool) -> None:
    """The warm-up of a started query (``_warm_workers``); a worker environment that cannot run
    the library stops the query with ``WorkerEnvironmentError`` as its failure."""
    try:
        if after_sources:
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline and query.isActive and query.status.get("message", "").startswith(
                    "Initializing"):
                time.sleep(0.05)
        # A query that failed meanwhile (the ticks source's process, run by the same interpreter
        # as the workers, failed to connect back) is diagnosed all the same; one stopped is not.
        if not query.isActive and type(query).__bases__[0].exception(query) is None:
            return
        _warm_workers(runner.spark, runner.location, view, runner.layout)
    except WorkerEnvironmentError as e:
        runner.setup_failure = e
        with contextlib.suppress(Exception):
            query.stop()
    except Exception as e:  # a query stopped meanwhile; the first batch starts the workers
        log.debug("warming Python workers beside the query's start: %s", e)


_QUERY_CLASSES: dict[type, type] = {}


def _stateful_query_class(base: type) -> type:
    """Spark's query class (classic or Connect) whose failure is the processor's own exception:
    ``exception()`` returns it and ``awaitTermination()`` raises it, Spark's error (the
    ``StreamingQueryException`` wrapping the task's failure) chained as its cause."""
    if base not in _QUERY_CLASSES:
        def exception(self):
            spark_error = base.exception(self)
            return _setup_failure(self) if spark_error is None else _user_failure(self, spark_error)

        def awaitTermination(self, timeout=None):
            try:
                ended = base.awaitTermination(self, timeout)
            except Exception as spark_error:
                failure = _user_failure(self, spark_error)
                if failure is spark_error:
                    raise
                raise failure from spark_error
            failure = _setup_failure(self)
            if failure is not None:
                raise failure
            return ended

        _QUERY_CLASSES[base] = type(f"Stateful{base.__name__}", (base,), {
            "exception": exception, "awaitTermination": awaitTermination,
            "__doc__": "A streaming query of start_stateful_query (Spark's, with the processor's own failure).",
        })
    return _QUERY_CLASSES[base]


def _setup_failure(query: Any) -> BaseException | None:
    runner = getattr(query, "_icestate_runner", None)
    return None if runner is None else runner.setup_failure


def _user_failure(query: Any, spark_error: BaseException) -> BaseException:
    runner = getattr(query, "_icestate_runner", None)
    failure = None if runner is None else runner.failure
    if failure is None and runner is not None:
        failure = user_error(spark_error, runner.error_key)  # a runner in another process (Spark Connect)
    if (failure is None or failure is spark_error) and runner is not None:
        # The workers' environment cannot run the library: the warm-up beside the start says so
        # (waited for: the stream may fail first, e.g. when the ticks source's process, run by
        # the same interpreter, cannot connect back), or the first batch's tasks did.
        warm = runner.warm_thread
        if warm is not None and warm is not threading.current_thread():
            warm.join(timeout=120)
        failure = runner.setup_failure or _environment_error(runner.spark, str(spark_error)) or failure
    if failure is None:
        return spark_error
    if failure.__cause__ is None:
        failure.__cause__ = spark_error
    return failure


def _close_when_terminated(query: StreamingQuery, runner: StatefulRunner) -> None:
    """Stop the runner's compactor when the query stops (a stopped query commits no more)."""
    with contextlib.suppress(Exception):  # a failed query raises here: it is terminated too
        query.awaitTermination()
    if runner.compactor is not None:
        runner.compactor.close()
