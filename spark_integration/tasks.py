"""The executor side of a stateful micro-batch: one task's key-group range against its store.

Spark calls ``run_task`` once per task of a batch (a group of the routed rows, inside a
Python worker). The task brings its store to the batch's base checkpoint, runs the
processor, flushes the memtable as new segments of the batch's checkpoint, writes its
output rows as Parquet, and returns only metadata (segment and output file descriptions,
statistics) to the driver: state never passes through the driver.

Tasks never open the catalog: the plan carries the batch's base checkpoint as the driver
sees it (``catalog.task_view.CheckpointView``: segments, storage properties), so executors on
any host work whatever catalog the driver uses, and only the driver commits.

Stores live across batches in the Python worker (``_STORES``, keyed by run and task), so
their caches stay warm. Each batch's plan says which flush of each task the driver
committed (a token per attempt): a store whose last flush was committed completes it and
keeps its cache; any other store (a failed or superseded attempt, a batch replayed after
a driver crash, a task that ran in another worker meanwhile) drops what it holds and
restores the base checkpoint, which reads only metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.accumulators import AccumulatorParam

from catalog.task_view import CheckpointView, TaskStateTable, locations_of
from spark_integration.errors import ErrorKey, processor_error
from spark_integration.timers import TIMERS_STATE, TimerService
from statestore import memory
from statestore.config import StoreConfig
from statestore.faults import fail_if_first_attempt
from statestore.host_views import host_views_for
from statestore.layout import StateLayout
from statestore.operator_state import OperatorStateDescriptor, OperatorStateStore
from statestore.paths import output_file_name
from statestore.store import StateStore
from statestore.table import SegmentFile

KG = "__icestate_kg"
TASK = "__icestate_task"
HEARTBEAT = "__icestate_hb"
PART = "__icestate_part"
# A task's report: rows (task, kind, payload) with kind "task" (statistics and the attempt's
# token), "segment" (a flushed segment) or "output" (an output file); payloads are JSON.
# Returned as the task's result rows, or, when the output rows are the task's result (the
# callback's DataFrame), sent through a Spark accumulator (``Reports``).
R_TASK = "__icestate_r_task"
R_KIND = "__icestate_r_kind"
R_PAYLOAD = "__icestate_r_payload"
# The store's file cache counters a task reports (``statestore.file_cache``).
FILE_CACHE_STATS = ("file_cache_hits", "file_cache_misses", "file_cache_bytes_fetched", "file_cache_bytes_written",
                    "file_cache_evictions", "file_cache_refetched")
RESULT_ARROW = pa.schema([(R_TASK, pa.int32()), (R_KIND, pa.string()), (R_PAYLOAD, pa.string())])
# Committed tokens of each task a plan carries (``BatchPlan.task_history``): a store whose
# last flush is older than these restores instead of catching up.
TOKENS_KEPT = 32


class ReportParam(AccumulatorParam):
    """Accumulates task reports: a list of (batch_id, task, report rows), one per successful
    task attempt."""

    def zero(self, value: list) -> list:
        return []

    def addInPlace(self, value1: list, value2: list) -> list:
        value1.extend(value2)
        return value1


@dataclass(frozen=True)
class BatchPlan:
    """Everything a task needs for one micro-batch; pickled into the task closure.

    ``view`` is the base checkpoint (``base_checkpoint_id``) as the driver holds it; ``table``
    says which table and line (``TableRef.identity``: no secret); no catalog travels."""

    run_id: str
    table: tuple
    parallelism: int
    view: CheckpointView
    layout: StateLayout
    processor: Any
    input_columns: tuple[str, ...]
    output_schema: pa.Schema
    batch_id: int
    checkpoint_id: int
    base_checkpoint_id: int | None
    task_tokens: dict[int, tuple[int, str]]
    processing_time_ms: int
    watermark_ms: int          # this batch's: evicts state, fires event-time timers
    late_watermark_ms: int     # the previous batch's: drops late input rows
    time_mode: str
    event_time_column: str | None
    output_dir: str | None
    output_io: dict[str, str] = field(default_factory=dict, repr=False)  # the output table's storage
    store_config: StoreConfig = field(default_factory=StoreConfig)
    inline_outputs: bool = False  # the output rows are the tasks' result; reports go to an accumulator
    # Each task's committed tokens of the run, oldest first, ending with ``task_tokens``' (at
    # most ``TOKENS_KEPT``): which flushes of a worker's store the driver committed.
    task_history: dict[int, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    api: str = "row"              # a StatefulProcessor's: "row", "pandas", "async" or "async_pandas"
    timezone: str = "UTC"         # the session's, for pandas timestamps
    batching: Any = None          # how pandas DataFrames are cut (compat.ArrowBatching; None: Spark's defaults)
    async_options: Any = None     # an async processor's controller bounds (AsyncOptions; None: defaults)
    # The processor's operator (non-keyed) state variables: every task writes its lists at each batch.
    operator_state: tuple[OperatorStateDescriptor, ...] = ()
    # Signs a processor's exception for the driver (``spark_integration.errors``); never shown.
    error_key: ErrorKey = field(default_factory=ErrorKey, repr=False)

    @property
    def compat(self) -> bool:
        from spark_integration.vectorized import VectorizedProcessor

        return not isinstance(self.processor, VectorizedProcessor)

    @property
    def fire_upto_ms(self) -> int | None:
        if self.time_mode == "processingtime":
            return self.processing_time_ms
        if self.time_mode == "eventtime":
            return self.watermark_ms
        return None


class _Clock:
    """The store's processing-time clock: the batch's timestamp, so TTLs replay identically."""

    def __init__(self) -> None:
        self.now_ms = 0

    def __call__(self) -> int:
        return self.now_ms


@dataclass
class _TaskStore:
    store: StateStore
    clock: _Clock
    timers: TimerService | None
    token: tuple[int, str] | None          # the committed flush the store's content includes
    location: tuple = ()                    # StateLocation.identity of the table
    pending: tuple[int, str] | None = None  # flushed, not known to be committed
    dirty: bool = False                     # an attempt started and did not finish
    operator_at: int | None = None          # the checkpoint whose operator state the store's lists hold


_STORES: dict[tuple[str, int], _TaskStore] = {}


def _open(plan: BatchPlan, task: int) -> _TaskStore:
    clock = _Clock()
    clock.now_ms = plan.processing_time_ms  # the host's shared views resolved later than this are not this batch's
    config = dataclasses.replace(plan.store_config, clock_ms=clock)
    if config.count_live_rows is None:  # Spark's numRowsTotal (``statestore.live_rows``)
        config = dataclasses.replace(config, count_live_rows=True)
    if config.host_views is None:  # one copy of a task's views per host, whichever worker runs it
        config = dataclasses.replace(config, host_views=True)
    table = TaskStateTable(plan.view, plan.layout)
    store = StateStore(table, task_index=task, parallelism=plan.parallelism, config=config)
    timers = TimerService(store) if plan.time_mode != "none" else None
    return _TaskStore(store, clock, timers, plan.task_tokens.get(task), plan.table)


def _reset(ts: _TaskStore, plan: BatchPlan, task: int) -> None:
    ts.clock.now_ms = plan.processing_time_ms
    ts.store.table.advance(plan.view)
    ts.store.restore(plan.base_checkpoint_id)
    ts.token = plan.task_tokens.get(task)
    ts.timers = TimerService(ts.store) if ts.timers is not None else None
    ts.operator_at = None


def task_store(plan: BatchPlan, task: int) -> _TaskStore:
    """The task's store, holding exactly the state of the plan's base checkpoint."""
    _evict(plan)
    key = (plan.run_id, task)
    ts = _STORES.get(key)
    if ts is not None and ts.dirty:
        _drop(key)
        ts = None
    if ts is None:
        ts = _STORES[key] = _open(plan, task)
        return ts
    try:
        _reconcile(ts, plan, task)
    except BaseException:
        _drop(key)  # never reuse a store whose reconciliation failed half-way
        raise
    return ts


def _reconcile(ts: _TaskStore, plan: BatchPlan, task: int) -> None:
    committed = plan.task_tokens.get(task)
    history = plan.task_history.get(task, ())
    current = ts.token
    pending, ts.pending = ts.pending, None
    # The batch's base checkpoint, as the driver shipped it. Only this task writes its key
    # groups during a run: newer checkpoints hold other tasks' segments (or compactions of
    # the same entries), so moving forward keeps every cached view valid.
    ts.store.table.advance(plan.view)
    if pending is not None:
        if pending == committed or pending in history:
            ts.store.checkpoint_complete(pending[0])
            current = ts.token = pending
        else:
            ts.store.checkpoint_aborted(pending[0])
            current = None  # its memtable holds a batch that was not committed
    if current is not None and current != committed and current in history and ts.store.catch_up():
        # The task ran in other workers since this store's last committed flush (Spark
        # gives a task to any idle worker): their committed flushes are the only writes of
        # its key groups since, so reading those segments brings the cache up to date.
        current = ts.token = committed
        ts.timers = TimerService(ts.store) if ts.timers is not None else None
    if current is None or current != committed:
        _reset(ts, plan, task)


def _evict(plan: BatchPlan) -> None:
    """Close stores this worker no longer needs: those of other runs (a restarted query) and
    those of this run whose flush is older than the plan's history of their task (they
    would restore rather than catch up). A store whose task ran in another worker since
    stays, to catch up when its task comes back, unless it shares the host's views: then the
    task's store, wherever it comes back, maps those (as cheap as catching up), and the copies
    this one holds of its own (merged runs, pending entries, indexes) are freed now."""
    for key, ts in list(_STORES.items()):
        run, task = key
        if run != plan.run_id:
            if ts.location == plan.table:
                _drop(key)  # a finished run of the same query (another query's stores stay)
        elif ts.pending is not None and ts.pending[0] >= plan.checkpoint_id:
            continue  # flushed in this batch: its commit is still to come
        elif not ts.dirty and (latest := ts.pending or ts.token) != plan.task_tokens.get(task) \
                and (latest not in plan.task_history.get(task, ()) or ts.store.config.host_views):
            _drop(key)


# This worker as the host's task claims name it (``HostViews.claim``); None: its pid. Tests
# that simulate several workers in one process give each its own.
_HOLDER: str | None = None


def _holder() -> str:
    return _HOLDER if _HOLDER is not None else str(os.getpid())


def _claimed_task(plan: BatchPlan, task: int) -> str:
    return repr((plan.table, plan.parallelism, task))


def _claim(plan: BatchPlan, task: int, store: StateStore) -> None:
    """With the host's shared views: tell the host's other workers that this one runs ``task``
    for the plan's checkpoint (``_drop_moved``)."""
    host = host_views_for(store.config)
    if host is not None:
        host.claim(_claimed_task(plan, task), _holder(), plan.checkpoint_id)


def _drop_moved(plan: BatchPlan, task: int) -> bool:
    """After a task, with the host's shared views: close this worker's stores of the run's other
    tasks that another worker of the host has claimed for this batch or a later one (the task
    runs there now). Wherever the task comes back it maps the host's views; what such a store
    holds of its own (runs merged since the views were written, the pages of views replaced
    since) is freed now rather than at this worker's next task (``_evict``). A store whose task
    has not started elsewhere stays: it may be this worker's next task. Whether any closed."""
    dropped = False
    for key, ts in list(_STORES.items()):
        run, other = key
        if run != plan.run_id or other == task or ts.dirty or (
                ts.pending is not None and ts.pending[0] >= plan.checkpoint_id):
            continue
        host = host_views_for(ts.store.config)
        if host is not None and host.ran_elsewhere(_claimed_task(plan, other), _holder(), plan.checkpoint_id):
            _drop(key)
            dropped = True
    return dropped


def _drop(key: tuple[str, int]) -> None:
    ts = _STORES.pop(key, None)
    if ts is not None:
        try:
            ts.store.close()
        finally:
            ts.store.table.close()


def run_partition(plan: BatchPlan, batches: Iterator[pa.RecordBatch], reports: Any = None,
                  ) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` entry point: a partition holds exactly one task's rows (or none)."""
    batches = list(batches)
    rows = pa.Table.from_batches(batches) if batches else None
    if rows is None or rows.num_rows == 0:
        return
    yield from _result(plan, reports, *_run(plan, _task_of(rows), rows, None)).to_batches()


def run_task(plan: BatchPlan, group_key: tuple, rows: pa.Table, reports: Any = None) -> pa.Table:
    """``applyInArrow`` entry point: process one task's rows of the batch (a group of one task)."""
    return _result(plan, reports, *_run(plan, _task_of(rows), rows, None))


def run_task_with_initial(plan: BatchPlan, group_key: tuple, rows: pa.Table, initial: pa.Table,
                          reports: Any = None) -> pa.Table:
    """Cogrouped ``applyInArrow`` entry point of a first batch with initial state."""
    task = _task_of(rows if rows.num_rows else initial)
    initial = initial.drop_columns([c for c in (KG, TASK, PART) if c in initial.column_names])
    return _result(plan, reports, *_run(plan, task, rows, initial))


def _result(plan: BatchPlan, reports: Any, report: list[tuple], output: pa.Table | None) -> pa.Table:
    """The task's result: its report rows, or with inline outputs its output rows (the report
    then goes to the ``reports`` accumulator, delivered when the task succeeds)."""
    if not plan.inline_outputs:
        cols = list(zip(*report, strict=True))
        return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(cols, RESULT_ARROW, strict=True)],
                                    schema=RESULT_ARROW)
    reports.add([(plan.batch_id, report[0][0], report)])
    if output is None:
        return plan.output_schema.empty_table()
    return output


def _task_of(rows: pa.Table) -> int:
    tasks = pc.unique(rows.column(TASK))
    if len(tasks) != 1:
        raise RuntimeError(f"a task group holds rows of tasks {tasks.to_pylist()}: routing is broken")
    return int(tasks[0].as_py())


def _run(plan: BatchPlan, task: int, rows: pa.Table, initial: pa.Table | None,
         ) -> tuple[list[tuple], pa.Table | None]:
    started, cpu_started = time.perf_counter(), time.process_time()
    _freeze_imports_once()
    _pin_mmap_threshold()
    kept = _STORES.get((plan.run_id, task))
    before = None if kept is None else kept.store.stats()  # what bringing it up to date reads counts too
    ts = task_store(plan, task)
    _claim(plan, task, ts.store)
    opened = time.perf_counter()
    ts.dirty = True
    store = ts.store
    ts.clock.now_ms = plan.processing_time_ms
    token = uuid.uuid4().hex
    if ts is not kept:  # a new store: what its opening read (mapping the host's views, catching up) counts
        before = dict.fromkeys(store.stats(), 0)
    fired_before = ts.timers.fired if ts.timers is not None else 0
    if plan.operator_state:
        _operator_state(ts, plan, task)

    if HEARTBEAT in rows.column_names:
        rows = rows.filter(pc.invert(rows.column(HEARTBEAT)))
    rows_in = rows.num_rows
    max_event_ms, late = _event_time(plan, rows)
    if late is not None:
        rows = rows.filter(pc.invert(late))
    kgs = rows.column(KG).to_numpy().astype(np.int64, copy=False) if rows.num_rows else np.empty(0, np.int64)
    data = rows.select(list(plan.input_columns))

    # A Spark-API processor allocates per row and per key, up to the flush's seal.
    with _no_cyclic_gc() if plan.compat else contextlib.nullcontext():
        try:
            output = _process(plan, ts, data, kgs, initial)
        except Exception as e:
            raise processor_error(e, plan.batch_id, task, plan.error_key) from e
        processed = time.perf_counter()
        segments = store.flush(plan.checkpoint_id)
        operator_file = None
        if store.operator_state is not None:
            operator_file = store.operator_state.flush(plan.checkpoint_id)
            ts.operator_at = plan.checkpoint_id
    ts.pending = (plan.checkpoint_id, token)
    fail_if_first_attempt(_attempt_number)
    flushed = time.perf_counter()
    outputs = _write_output(plan, task, token, output)
    after = store.stats()
    ts.dirty = False
    updated, removed = (("api_rows_updated", "api_rows_removed") if plan.compat else
                        ("entries_flushed_updated", "entries_flushed_removed"))
    stats = {
        "token": token, "checkpoint_id": plan.checkpoint_id, "rows_in": rows_in,
        "rows_late": rows_in - rows.num_rows, "rows_out": 0 if output is None else output.num_rows,
        "max_event_ms": max_event_ms, "pid": os.getpid(),
        "bytes_read": after["segment_bytes_read"] - before["segment_bytes_read"],
        "files_opened": after["segment_files_opened"] - before["segment_files_opened"],
        "cache_size_bytes": after["cache_size_bytes"],
        "cache_evictions": after["cache_evictions"] - before["cache_evictions"],
        # key groups mapped from the host's shared views (``statestore.host_views``) and written there
        "views_mapped": after["host_views_mapped"] - before["host_views_mapped"],
        "views_published": after["host_views_published"] - before["host_views_published"],
        **{name: after[name] - before[name] for name in FILE_CACHE_STATS},
        "segments": len(segments), "segment_bytes": sum(s.size_bytes for s in segments),
        "timers": ts.timers.count() if ts.timers is not None else 0,
        "timers_fired": ts.timers.fired - fired_before if ts.timers is not None else 0,
        # Spark-API processors: rows as Spark's state API counts them; vectorized ones: entries written
        "state_rows_updated": after[updated] - before[updated],
        "state_rows_removed": after[removed] - before[removed],
        "next_timer_ms": ts.timers.next_expiry() if ts.timers is not None else None,
        "live_rows": _live_rows(store.live_row_change(plan.checkpoint_id)),
        "elapsed_ms": _ms(started), "open_ms": _ms(started, opened), "process_ms": _ms(opened, processed),
        "flush_ms": _ms(processed, flushed), "output_ms": _ms(flushed),
        "cpu_ms": round((time.process_time() - cpu_started) * 1000, 1),  # the worker's, all its threads
    }
    # A batch that wrote views to the host's shared views has just swapped its own copies for
    # the host's pages, or closed stores whose tasks moved: what it freed goes back at once, not
    # at the next minute's trim.
    moved = _drop_moved(plan, task)
    trimmed = _return_freed_memory(now=stats["views_published"] > 0 or moved)
    if trimmed is not None:
        stats["trimmed_mb"] = trimmed
    report = [(task, "task", json.dumps(stats))]
    report += [(task, "segment", json.dumps(dataclasses.asdict(s))) for s in segments]
    report += [(task, "output", json.dumps(o)) for o in outputs]
    if operator_file is not None:
        report.append((task, "operator_state", json.dumps(operator_file.to_json())))
    return report, output


def _operator_state(ts: _TaskStore, plan: BatchPlan, task: int) -> None:
    """Give the task's store its operator state as of the plan's base checkpoint: the lists it
    flushed last when that flush is the base (same parallelism), else its own lists read from the
    base's files, redistributed by their modes only when the parallelism changed."""
    held = ts.store.operator_state
    if held is None or ts.operator_at is None or ts.operator_at != plan.base_checkpoint_id \
            or held.parallelism != plan.parallelism:
        ts.store.operator_state = OperatorStateStore(ts.store.table, plan.operator_state, task_index=task,
                                                     parallelism=plan.parallelism, redistribute_on_rescale_only=True)
    ts.operator_at = None  # until this batch's flush: the lists change


def _live_rows(change: dict | None) -> dict | None:
    """A store's live row change as JSON: {variable: [[expiry or None, rows], ...]}, timers left
    out (Spark's ``numRowsTotal`` does not count them)."""
    if change is None:
        return None
    return {name: [[e, n] for e, n in h.items()] for name, h in change.items() if name != TIMERS_STATE}


def _ms(start: float, end: float | None = None) -> float:
    return round(((time.perf_counter() if end is None else end) - start) * 1000, 1)


def _process(plan: BatchPlan, ts: _TaskStore, data: pa.Table, kgs: np.ndarray,
             initial: pa.Table | None) -> pa.Table | None:
    """The processor's output for the task's rows; its state changes go to the store."""
    if plan.compat:
        return _run_compat(plan, ts, data, kgs, initial)
    from spark_integration.vectorized import apply_updates, run_vectorized

    if initial is not None and initial.num_rows:
        apply_updates(ts.store, initial)
    if not data.num_rows:
        return None
    output = run_vectorized(plan.processor, ts.store, data, plan.processing_time_ms, plan.watermark_ms, kgs)
    return None if output is None else _conform(output, plan.output_schema)


def _run_compat(plan: BatchPlan, ts: _TaskStore, data: pa.Table, kgs: np.ndarray,
                initial: pa.Table | None) -> pa.Table:
    from pyspark.sql.streaming.stateful_processor import TimerValues

    from spark_integration.compat import rows_to_arrow, run_pandas_processor, run_processor

    timer_values = TimerValues(*((-1, -1) if plan.time_mode == "none" else
                                 (plan.processing_time_ms, plan.watermark_ms)))
    if plan.api in ("async", "async_pandas"):
        from spark_integration.async_processor import run_async_pandas_processor, run_async_processor

        if plan.api == "async_pandas":
            return run_async_pandas_processor(plan.processor, ts.store, ts.timers, data, kgs, timer_values,
                                              plan.fire_upto_ms, plan.output_schema, initial, plan.timezone,
                                              options=plan.async_options, batching=plan.batching)
        out = run_async_processor(plan.processor, ts.store, ts.timers, data, kgs, timer_values, plan.fire_upto_ms,
                                  initial, options=plan.async_options)
        return rows_to_arrow(out, plan.output_schema)
    if plan.api == "pandas":
        return run_pandas_processor(plan.processor, ts.store, ts.timers, data, kgs.tolist(), timer_values,
                                    plan.fire_upto_ms, plan.output_schema, initial, plan.timezone, plan.batching)
    out = run_processor(plan.processor, ts.store, ts.timers, data, kgs.tolist(), timer_values,
                        plan.fire_upto_ms, initial)
    return rows_to_arrow(out, plan.output_schema)


_FROZEN = False
# How often a worker hands the C allocator's free pages back to the system (``_return_freed_memory``).
TRIM_EVERY_S = 60.0
_trimmed_at = time.monotonic()


def _return_freed_memory(now: bool = False) -> float | None:
    """Once a minute (or at once, ``now``), after a task, hand the memory the worker's allocators hold free back to
    the system (``statestore.memory.return_freed_memory``) and return the megabytes the worker's
    RSS fell by. A reused worker allocates and frees per task (Arrow buffers, decoded pages,
    per-row Python objects) from several threads' arenas, and glibc gives back only the top of
    each heap: over a 90-minute run the task workers' RSS grew 0.2-0.3 MB a minute while their
    Python objects, caches and Arrow pool stayed flat. None where it did not run (not due yet,
    or not glibc)."""
    global _trimmed_at
    if not now and time.monotonic() - _trimmed_at < TRIM_EVERY_S:
        return None
    freed = memory.return_freed_memory()
    _trimmed_at = time.monotonic()
    return freed


def _pin_mmap_threshold() -> bool:
    """At a worker's first task: glibc's mmap threshold stays at its start
    (``statestore.memory.pin_mmap_threshold``), and Arrow's new buffers come from glibc's
    allocator unless the deployment chose a pool (``statestore.memory.arrow_on_system_pool``)."""
    memory.arrow_on_system_pool()  # Arrow's buffers where the trim reaches them
    return memory.pin_mmap_threshold()


def _freeze_imports_once() -> None:
    """In a PySpark worker, move what the worker holds before its first store (the modules
    of pyspark, pyarrow, polars, the Iceberg client, SQLAlchemy, ours: about 170k objects) to the
    collector's permanent generation, once. PySpark's daemon runs a full ``gc.collect()``
    after every task of a reused worker, and each walked all of them: about 80 ms per task,
    a third of a vectorized batch's Python time. Stores are opened after the freeze, so
    dropping one (cycles with its state handles) still frees it. Outside a Spark task
    (tests, the driver) nothing is frozen."""
    global _FROZEN
    if _FROZEN:
        return
    from pyspark import TaskContext

    if TaskContext.get() is None:
        return
    _FROZEN = True
    gc.collect()  # nothing collectable goes to the permanent generation
    gc.freeze()


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a processor runs key by key. The loop
    allocates a Row per input row and tuples per key and call, so the collector's
    generation-2 passes, each walking the worker's whole heap (the store's caches), ran
    dozens of times per task: 80% of the grouping loop's time (measured: 462 -> 77 ms for a
    50k-row task). Reference counting still frees everything that is not a cycle; the
    cycles a processor makes are collected when the collector resumes, after the task."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _event_time(plan: BatchPlan, rows: pa.Table) -> tuple[int | None, pa.Array | None]:
    """The batch's max event time (ms) and the mask of late rows (older than the watermark)."""
    col = plan.event_time_column
    if not col or rows.num_rows == 0:
        return None, None
    us = pc.cast(rows.column(col).cast(pa.timestamp("us", tz="UTC"), safe=False), pa.int64())
    top = pc.max(us).as_py()
    late = None
    if plan.time_mode == "eventtime" and plan.late_watermark_ms > 0:
        # Spark's stateful operators drop rows at or before the previous batch's watermark.
        late = pc.fill_null(pc.less_equal(us, plan.late_watermark_ms * 1000), False)
    return None if top is None else top // 1000, late


def _conform(output: pa.Table, schema: pa.Schema) -> pa.Table:
    from statestore.errors import SchemaMismatchError

    missing = [n for n in schema.names if n not in output.column_names]
    if missing:
        raise SchemaMismatchError(f"processor output lacks column(s) {missing} of the declared output schema "
                                  f"{schema}; it has {output.column_names}")
    try:
        return output.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
        raise SchemaMismatchError(f"processor output {output.schema} does not match the declared output schema "
                                  f"{schema}: {e}") from e


def _write_output(plan: BatchPlan, task: int, token: str, output: pa.Table | None) -> list[dict]:
    if plan.output_dir is None or output is None or output.num_rows == 0:
        return []
    # The output table's storage, with its own properties (an S3 endpoint, credentials).
    where = locations_of(plan.output_dir, plan.output_io)
    root = where.to_path(plan.output_dir.rstrip("/"))
    where.filesystem.create_dir(root, recursive=True)
    name = output_file_name(plan.batch_id, task, token)
    pq.write_table(output, f"{root}/{name}", filesystem=where.filesystem, compression="zstd")
    return [{"uri": f"{plan.output_dir.rstrip('/')}/{name}", "rows": output.num_rows}]


def read_output_files(batches: Iterator[pa.RecordBatch], io: dict[str, str], schema: pa.Schema,
                      ) -> Iterator[pa.RecordBatch]:
    """The rows of the output files named in ``batches`` (column ``uri``), read through pyarrow
    with the output table's storage properties (``StatefulRunner._output_frame``)."""
    for batch in batches:
        for uri in batch.column(0).to_pylist():
            where = locations_of(uri, io)
            yield from pq.read_table(where.to_path(uri), filesystem=where.filesystem, schema=schema).to_batches()


def _attempt_number() -> int | None:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return None if ctx is None else ctx.attemptNumber()


def segment_of(payload: str) -> SegmentFile:
    return SegmentFile(**json.loads(payload))


def warm_worker(view: CheckpointView, layout: StateLayout) -> None:
    """Import what a task needs and make the state table's filesystem once
    (``query._warm_workers``); like a task, without the catalog."""
    import spark_integration.compat
    import spark_integration.vectorized  # noqa: F401

    TaskStateTable(view, layout).close()
    _freeze_imports_once()


def forget_run(run_id: str) -> None:
    """Drop this worker's stores of a finished run."""
    for key in [k for k in _STORES if k[0] == run_id]:
        _drop(key)


__all__ = [
    "HEARTBEAT",
    "KG",
    "R_KIND",
    "R_PAYLOAD",
    "R_TASK",
    "TASK",
    "BatchPlan",
    "ReportParam",
    "run_partition",
    "run_task",
    "run_task_with_initial",
    "segment_of",
]
