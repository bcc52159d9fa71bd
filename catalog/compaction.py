"""Compaction of a state table's segments, off the streaming critical path.

A checkpoint adds one segment per task and partition, so a unit of key groups gathers a
segment per checkpoint and a lookup opens every one of them. Compaction rewrites some of a
unit's segments into one file. The *unit* is a partition (``truncate(key_group, W)``) cut
at the key-group ranges of the newest checkpoint's tasks: the range one task reads, even
when the table has a single partition.

What to merge (``CompactionPolicy``), size-tiered as RocksDB's universal compaction: the
run of the newest segments, each older one joining while its bytes are at most
``size_ratio`` times the bytes merged so far; merged once that run holds ``min_segments``
segments (or the unit ``max_segments``). Equal deltas thus merge 8 at a time, and merged
files join when as many bytes of newer deltas gathered above them, like a binary counter:
a live entry is rewritten about log2(state / (8 deltas)) times, a large base only once the
deltas above it have grown to its size, and a unit holds about ``min_segments`` +
log2(state / delta) files.

What is kept (invariant 5: every reader resolves the output exactly as the inputs, since
entries keep their own ``checkpoint_id`` and ``seq``):

* when the merge holds every segment of the unit, the entries still visible
  (``resolve.survivors``): tombstones, hidden entries and entries expired at the newest
  checkpoint's commit time are dropped;
* otherwise, the entries no other merged entry hides (``resolve.newest_entries``):
  tombstones stay, since they hide entries in older segments left out.

The rewrite commits as one Iceberg overwrite of the branch's head that deletes exactly the
files it read and adds its outputs; its snapshot carries no checkpoint id, and the writer's
next checkpoint follows it (``catalog.commit.CheckpointCommitter._plan_parent``). When a checkpoint commits
in between, the catalog's compare-and-swap fails and the compaction commits the same
outputs again on the new head, provided every file it read is still live there (a
checkpoint only adds files; a restore or another compaction may have removed some: then it
re-plans). A file it read that the writer's retention removed meanwhile (a manifest list,
a manifest) is the same race: it plans again on the new head. It gives up after
``ATTEMPTS_MAX`` tries or once ``COMPACTION_GRACE_CHECKPOINTS``
checkpoints passed its plan, after which garbage collection may take its outputs. It never
blocks or fails a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io.pyarrow import parquet_file_to_data_file
from pyiceberg.table.refs import MAIN_BRANCH

from catalog.commit import StagedTransaction, before_catalog_switch
from catalog.iceberg_table import IcebergStateTable
from catalog.naming import commit_uuid
from catalog.retention import line, newest_checkpoint_id
from statestore import faults, stored_keys
from statestore.entries import read_entries
from statestore.errors import CorruptMetadataError
from statestore.faults import crash_point
from statestore.keygroups import KeyGroupRange, compute_key_group_range_for_task
from statestore.layout import KEY_GROUP, STATE
from statestore.paths import COMPACTION_GRACE_CHECKPOINTS
from statestore.resolve import ORD, newest_entries, survivors
from statestore.segment import SegmentReader, write_segment_file
from statestore.table import SegmentFile

log = logging.getLogger(__name__)

ATTEMPTS_MAX = 5
RUNS_ON = ("auto", "process", "spark")


@dataclass(frozen=True)
class CompactionPolicy:
    """When a unit needs compaction, and which of its segments to merge (module docstring).

    Args:
        min_segments: a unit with fewer segments is left alone.
        size_ratio: an older segment joins the merge when its bytes are at most this many
            times the bytes of the newer segments merged so far (larger: fewer files, more
            rewriting).
        max_merge: at most this many segments per unit in one merge (None: no limit), to
            bound the work of one compaction.
        max_segments: a unit with this many segments (None: 4 x ``min_segments``) is merged
            even when the size ratio finds no run of ``min_segments`` (very uneven sizes).
        runs_on: where a stream's compactions merge: ``process`` (a compactor process beside the
            driver), ``spark`` (Spark jobs of the stream's own session, a task per unit on the
            executors, in the scheduler pool ``icestate-compaction``), or ``auto`` (default:
            ``spark`` when the session's master is not ``local``, else ``process``).
        max_units: at most this many units (Spark tasks) per compaction, those with the most
            selected segments first (None: every unit that needs it), to bound what a round
            takes from the stream.
    """

    min_segments: int = 8
    size_ratio: float = 1.0
    max_merge: int | None = None
    max_segments: int | None = None
    runs_on: str = "auto"
    max_units: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_segments, int) or self.min_segments < 2:
            raise ValueError(f"CompactionPolicy.min_segments must be an int of at least 2, got {self.min_segments!r}")
        if not isinstance(self.size_ratio, int | float) or not self.size_ratio > 0:
            raise ValueError(f"CompactionPolicy.size_ratio must be a positive number, got {self.size_ratio!r}")
        if self.max_merge is not None and (not isinstance(self.max_merge, int) or self.max_merge < 2):
            raise ValueError(f"CompactionPolicy.max_merge must be None or an int of at least 2, got {self.max_merge!r}")
        if self.runs_on not in RUNS_ON:
            raise ValueError(f"CompactionPolicy.runs_on must be one of {RUNS_ON}, got {self.runs_on!r}")
        if self.max_units is not None and (not isinstance(self.max_units, int) or self.max_units < 1):
            raise ValueError(f"CompactionPolicy.max_units must be None or a positive int, got {self.max_units!r}")
        if self.max_segments is not None and (
                not isinstance(self.max_segments, int) or self.max_segments < self.min_segments):
            raise ValueError(f"CompactionPolicy.max_segments must be None or an int of at least min_segments, got "
                             f"{self.max_segments!r}")

    def select(self, segments: Sequence[SegmentFile]) -> list[SegmentFile]:
        """The segments of one unit to merge, oldest first; empty when it needs no compaction."""
        if len(segments) < self.min_segments:
            return []
        ordered = sorted(segments, key=_age)
        cap = self.max_merge or len(ordered)
        run, merged = [ordered[-1]], ordered[-1].size_bytes
        for s in reversed(ordered[:-1]):
            if s.size_bytes > self.size_ratio * merged or len(run) == cap:
                break
            run.append(s)
            merged += s.size_bytes
        if len(run) < min(self.min_segments, cap):
            if len(ordered) < (self.max_segments or 4 * self.min_segments):
                return []
            run = ordered[-cap:]  # too many files of uneven sizes: merge the newest regardless
        return sorted(run, key=_age)


@dataclass(frozen=True)
class CompactionResult:
    """One committed compaction (possibly of several units)."""

    units: tuple[KeyGroupRange, ...]
    full_units: int  # units whose every segment was merged (tombstones dropped)
    files_in: int
    bytes_in: int
    entries_in: int
    files_out: int
    bytes_out: int
    entries_out: int
    attempts: int
    snapshot_id: int | None
    seconds: float = 0.0
    partitions: tuple[int, ...] = field(default=())
    processes: tuple[int, ...] = field(default=())  # the processes that merged (a Spark job's workers)

    @property
    def rewrite_ratio(self) -> float:
        """Bytes written per byte read (below 1: the state shrank)."""
        return self.bytes_out / self.bytes_in if self.bytes_in else 0.0

    def summary(self) -> dict[str, int]:
        return {"units": len(self.units), "full_units": self.full_units, "files_in": self.files_in,
                "bytes_in": self.bytes_in, "entries_in": self.entries_in, "files_out": self.files_out,
                "bytes_out": self.bytes_out, "entries_out": self.entries_out}


def _epoch_ms() -> int:
    return int(time.time() * 1000)


def units(table: IcebergStateTable) -> list[KeyGroupRange]:
    """The table's compaction units: partitions cut at the key-group ranges of the tasks of
    the opened checkpoint (every partition whole when the table holds none)."""
    n = table.layout.max_parallelism
    info = table.current_checkpoint()
    parallelism = 1 if info is None else min(info.parallelism, n)
    found = []
    for task in range(parallelism):
        owned = compute_key_group_range_for_task(n, parallelism, task)
        for p in range(table.partition_of(owned.start), table.partition_of(owned.end) + 1):
            part = owned.intersection(table.partition_key_groups(p))
            if not part.is_empty():
                found.append(part)
    return found


def needs_compaction(table: IcebergStateTable, policy: CompactionPolicy) -> bool:
    """Whether any unit of the opened checkpoint needs compaction (metadata only, no I/O)."""
    return any(policy.select(table.segments(u)) for u in units(table))


def writer_needs_compaction(table: IcebergStateTable, policy: CompactionPolicy) -> bool:
    """``needs_compaction`` of a writer's table just committed, for its compactor: never raises
    (compaction is housekeeping; a table being closed or restored by its writer meanwhile is
    logged and reads as no)."""
    try:
        return needs_compaction(table, policy)
    except Exception as e:
        log.warning("compaction check of %s failed (%s)", table.identifier, e)
        return False


def compact(table: IcebergStateTable, *, policy: CompactionPolicy | None = None,
            key_groups: KeyGroupRange | None = None, now_ms: int | None = None,
            spark: Any = None) -> CompactionResult | None:
    """Compact ``table``'s branch at its newest state, in one commit.

    ``table`` is a table object of its own (a compaction runs in its own process or thread,
    never on the stream's). With a ``policy``, each unit merges what the policy selects;
    without one, every unit with two or more segments is merged whole. ``key_groups``
    limits the work to the units overlapping that range. With ``spark`` (a classic
    SparkSession), the merges run as one Spark job, a task per unit to merge, on the
    executors and through their file caches (``merge_on_executor``); this process plans and
    commits. Returns None when there is nothing to do (or every attempt lost its race with
    checkpoints).
    """
    started = time.perf_counter()
    planned: _Plan | None = None
    for attempt in range(1, ATTEMPTS_MAX + 1):
        seen = _branch_head_id(table)
        try:
            table.restore()  # the newest checkpoint, and the head snapshot above it
            if planned is not None and not planned.still_valid(table):
                planned.discard(table)
                planned = None
            if planned is None:
                planned = _plan_and_write(table, policy, key_groups, now_ms, spark)
                if planned is None:
                    return None
            snapshot_id = _commit(table, planned)
        except CommitFailedException as e:
            log.info("compaction of %s raced a checkpoint (%s); committing again on the new head",
                     table.identifier, e)
            time.sleep(0.02 * attempt)
            continue
        except FileNotFoundError as e:
            # The writer committed and its retention expired what this attempt read (a manifest
            # list, a manifest, a compacted segment past its grace): a race when the head moved,
            # damage when it did not.
            table.iceberg_table.refresh()
            if _branch_head_id(table) == seen:
                raise CorruptMetadataError(
                    f"compaction of state table {table.identifier} found a file of its head snapshot missing "
                    f"({e}): the table is damaged; restore an earlier checkpoint, or recover the table "
                    "(docs/reliability.md)") from e
            log.info("compaction of %s raced a checkpoint whose retention removed a file it read (%s); "
                     "planning again on the new head", table.identifier, e)
            continue
        return planned.result(table, attempt, snapshot_id, time.perf_counter() - started)
    if planned is not None:
        planned.discard(table)
    log.warning("compaction of %s gave up after %d races with checkpoints", table.identifier, ATTEMPTS_MAX)
    return None


def _branch_head_id(table: IcebergStateTable) -> int | None:
    """The snapshot id of the head of ``table``'s branch in the metadata it holds."""
    head = table.iceberg_table.metadata.snapshot_by_name(table.branch)
    return None if head is None else head.snapshot_id


def compact_partition(table: IcebergStateTable, partition: int = 0, *, now_ms: int | None = None,
                      policy: CompactionPolicy | None = None) -> CompactionResult | None:
    """``compact`` limited to one partition."""
    return compact(table, policy=policy, key_groups=table.partition_key_groups(partition), now_ms=now_ms)


# --- planning and writing ---------------------------------------------------------------------


@dataclass
class _Plan:
    base_checkpoint_id: int
    head_id: int
    inputs: list[SegmentFile]
    outputs: list[SegmentFile]
    units: list[KeyGroupRange]
    full_units: int
    entries_in: int
    partitions: list[int]
    started_ms: int = field(default_factory=_epoch_ms)
    processes: set[int] = field(default_factory=set)

    def still_valid(self, table: IcebergStateTable) -> bool:
        """Whether the outputs may commit on ``table``'s (refreshed) head: it still holds every
        input live, and not too many checkpoints passed (the outputs' grace)."""
        metadata = table.iceberg_table.metadata
        if table.snapshot is None or metadata.snapshot_by_name(table.branch).snapshot_id != table.snapshot.snapshot_id:
            return False
        if newest_checkpoint_id(metadata, table.branch) >= self.base_checkpoint_id + COMPACTION_GRACE_CHECKPOINTS:
            return False
        live = {s.path for s in table.segments(KeyGroupRange.of(0, table.layout.max_parallelism - 1))}
        return all(s.path in live for s in self.inputs)

    def discard(self, table: IcebergStateTable) -> None:
        for f in self.outputs:
            try:
                table.filesystem.delete_file(f.path)
            except OSError as e:  # an orphan then, which garbage collection takes later
                log.info("could not delete compaction output %s (%s)", f.path, e)

    def result(self, table: IcebergStateTable, attempts: int, snapshot_id: int, seconds: float) -> CompactionResult:
        return CompactionResult(
            units=tuple(self.units), full_units=self.full_units, files_in=len(self.inputs),
            bytes_in=sum(s.size_bytes for s in self.inputs), entries_in=self.entries_in,
            files_out=len(self.outputs), bytes_out=sum(s.size_bytes for s in self.outputs),
            entries_out=sum(s.record_count for s in self.outputs), attempts=attempts, snapshot_id=snapshot_id,
            seconds=seconds, partitions=tuple(self.partitions), processes=tuple(sorted(self.processes)))


def _age(s: SegmentFile) -> tuple[int, str]:
    return s.checkpoint_id, s.path


def _plan_and_write(table: IcebergStateTable, policy: CompactionPolicy | None, key_groups: KeyGroupRange | None,
                    now_ms: int | None, spark: Any = None) -> _Plan | None:
    """Select each unit's segments, then merge, per unit, the entries of every selected segment
    that fall in it (a segment written at another parallelism may span several units: its
    rows in a unit that selected nothing are rewritten there, merged with whatever else
    was selected of that unit, so no row is lost and no output spans two units)."""
    head = table.snapshot
    info = table.current_checkpoint()
    if head is None or info is None:
        return None
    every_unit = units(table)
    todo = [u for u in every_unit if key_groups is None or not u.intersection(key_groups).is_empty()]
    selected: dict[KeyGroupRange, list[SegmentFile]] = {}
    for u in todo:
        segments = table.segments(u)
        run = policy.select(segments) if policy is not None else (segments if len(segments) >= 2 else [])
        if run:
            selected[u] = run
    if policy is not None and policy.max_units is not None:
        selected = _within(selected, every_unit, policy.max_units)
    chosen = {s.path: s for run in selected.values() for s in run}
    if not chosen:
        return None
    inputs = sorted(chosen.values(), key=_age)
    base = newest_checkpoint_id(table.iceberg_table.metadata, table.branch)
    now = now_ms if now_ms is not None else info.timestamp_ms
    plan = _Plan(base_checkpoint_id=base, head_id=head.snapshot_id, inputs=inputs, outputs=[], units=[],
                 full_units=0, entries_in=0, partitions=[])
    # One work per unit any input overlaps: a segment written at another parallelism spans units,
    # and its rows in each of them are rewritten there.
    works = [work for work in (_merge_work(table, plan, u, now) for u in every_unit) if work is not None]
    for work in works:
        plan.units += [u for u, _, _ in work.units]
        plan.full_units += sum(full for _, full, _ in work.units)
    plan.partitions = sorted({work.partition for work in works})
    try:
        merged = [(*_merge(table, work), os.getpid()) for work in works] if spark is None else _merge_on_spark(
            spark, table, works)
        for entries_in, outputs, pid in merged:
            plan.entries_in += entries_in
            plan.outputs += outputs
            plan.processes.add(pid)
    except BaseException:
        for path in (path for w in works for _, _, path in w.units):  # whatever was written of them
            with contextlib.suppress(OSError):
                table.filesystem.delete_file(path)
        raise
    crash_point(faults.COMPACTION_OUTPUTS_WRITTEN)
    return plan


def _within(selected: dict[KeyGroupRange, list[SegmentFile]], every_unit: list[KeyGroupRange],
            max_units: int) -> dict[KeyGroupRange, list[SegmentFile]]:
    """The selections to merge, the units with the most segments first, while the units their
    segments touch (a segment of another parallelism spans several) stay within ``max_units``;
    the first always (a merge must be able to make progress)."""
    kept: dict[KeyGroupRange, list[SegmentFile]] = {}
    touched: set[KeyGroupRange] = set()
    for u in sorted(selected, key=lambda u: (-len(selected[u]), u.start)):
        reach = {v for v in every_unit for s in selected[u] if s.key_group_min <= v.end and s.key_group_max >= v.start}
        if kept and len(touched | reach) > max_units:
            continue
        kept[u] = selected[u]
        touched |= reach
    return kept


@dataclass(frozen=True)
class MergeWork:
    """One unit's merge, planned where the compaction commits and run anywhere (this process,
    or a Spark task): the inputs that overlap the unit's key groups, whether the merge holds all
    its segments and where its output goes."""

    partition: int
    key_groups: KeyGroupRange
    inputs: tuple[SegmentFile, ...]
    units: tuple[tuple[KeyGroupRange, bool, str], ...]  # (unit, full, output path)
    now_ms: int


def _merge_work(table: IcebergStateTable, plan: _Plan, unit: KeyGroupRange, now_ms: int) -> MergeWork | None:
    """The merge of ``unit``: the plan's inputs that overlap it (None when none does)."""
    merged = tuple(s for s in plan.inputs if s.key_group_min <= unit.end and s.key_group_max >= unit.start)
    if not merged:
        return None
    full = {s.path for s in table.segments(unit)} <= {s.path for s in merged}
    partition = table.partition_of(unit.start)
    return MergeWork(partition, unit, merged, ((unit, full, table.new_compaction_path(plan.base_checkpoint_id,
                                                                                       partition)),), now_ms)


def _merge(table: Any, work: MergeWork, file_cache: Any = None) -> tuple[int, list[SegmentFile]]:
    """Run ``work`` over ``table`` (a state table, or a task's view of one: its filesystem,
    layout and file schema): the entries it read and the outputs it wrote."""
    wanted = np.arange(work.key_groups.start, work.key_groups.end + 1, dtype=np.int64)
    # Every column of the table (those of variables the layout no longer declares too: the
    # outputs keep the table's file schema).
    entries = read_entries(SegmentReader(table.filesystem, file_cache=file_cache), work.inputs, wanted,
                           table.file_schema())
    outputs = []
    for u, full, path in work.units:
        kept = _kept(table, entries.filter(pl.col(KEY_GROUP).is_between(u.start, u.end)), work.now_ms, full)
        if kept.num_rows:
            outputs.append(write_segment_file(table, kept, path))
            crash_point(faults.COMPACTION_OUTPUT_WRITTEN)
    return entries.height, outputs


def merge_on_executor(view: Any, layout: Any, work: MergeWork) -> tuple[int, list[SegmentFile], int]:
    """A Spark task's merge (``compact(..., spark=...)``): over the table's checkpoint view (no
    catalog travels), reading through the executor's file cache; returns what ``_merge`` does
    and the process that ran it."""
    from catalog.task_view import TaskStateTable
    from statestore.config import StoreConfig
    from statestore.file_cache import file_cache_for

    table = TaskStateTable(view, layout)
    try:
        with idle_priority():
            entries_in, outputs = _merge(table, work, file_cache_for(StoreConfig(), table.filesystem))
    finally:
        table.close()
    return entries_in, outputs, os.getpid()


@contextlib.contextmanager
def idle_priority() -> Any:
    """Every thread of this process at Linux's ``SCHED_IDLE`` policy while the block runs, then
    back at ``SCHED_OTHER``: a merge in a Spark task (a Python worker runs one task at a time)
    takes only the CPU the stream's tasks leave, as the niced compactor process does beside a
    local stream. The threads Arrow and Polars start during the block are restored too. Only
    where the process may leave ``SCHED_IDLE`` again (``_idle_is_reversible``); elsewhere the
    merge runs at its usual priority."""
    if not _idle_is_reversible():
        yield
        return

    def every_thread(policy: int) -> None:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))

    every_thread(os.SCHED_IDLE)
    try:
        yield
    finally:
        every_thread(os.SCHED_OTHER)


_IDLE_REVERSIBLE: list[bool] = []  # this process's answer, once found


def _idle_is_reversible() -> bool:
    """Whether this process may put its threads at ``SCHED_IDLE`` and back: tried once on a
    thread of its own. Leaving ``SCHED_IDLE`` needs ``CAP_SYS_NICE`` or a high enough
    ``RLIMIT_NICE`` (containers often have neither): a worker whose threads stayed idle would
    slow every later task it runs, so without the way back a merge runs at normal priority."""
    if not _IDLE_REVERSIBLE:
        answer: list[bool] = []
        if hasattr(os, "sched_setscheduler") and os.path.isdir("/proc/self/task"):
            def trial() -> None:
                try:
                    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
                    answer.append(True)
                except OSError:
                    answer.append(False)  # the trial thread ends here, idle or not

            thread = threading.Thread(target=trial, name="icestate-idle-trial")
            thread.start()
            thread.join()
        _IDLE_REVERSIBLE.append(bool(answer and answer[0]))
        if not _IDLE_REVERSIBLE[0]:
            log.info("merges run at normal priority: this process may not leave SCHED_IDLE again "
                     "(no CAP_SYS_NICE, RLIMIT_NICE below 20)")
    return _IDLE_REVERSIBLE[0]


def _merge_on_spark(spark: Any, table: IcebergStateTable, works: list[MergeWork]) -> list[tuple[int, list, int]]:
    view, layout = table.checkpoint_view(), table.layout
    return (spark.sparkContext.parallelize(works, len(works))
            .map(lambda work: merge_on_executor(view, layout, work)).collect())


def _kept(table: Any, entries: pl.DataFrame, now_ms: int, full: bool) -> pa.Table:
    keys = [KEY_GROUP, *table.layout.key_names]
    parts = []
    for d in table.layout.descriptors:
        of_d = entries.filter(pl.col(STATE) == d.name)
        if of_d.height:
            parts.append(survivors(of_d, d, keys, now_ms) if full else newest_entries(of_d, d, keys))
    parts = [p for p in parts if p.height]
    frame = pl.concat(parts, how="vertical") if parts else entries.clear()
    return frame.drop(ORD).to_arrow()


def _commit(table: IcebergStateTable, plan: _Plan) -> int:
    """One overwrite on the branch's head: delete exactly the inputs, add the outputs."""
    ice = table.iceberg_table
    head = ice.metadata.snapshot_by_name(table.branch)
    by_path = {task.file.file_path: task.file for task in ice.scan(snapshot_id=head.snapshot_id).plan_files()}
    # started_ms: when its planning began (with the snapshot's timestamp, the span it ran)
    figures = {**plan.result(table, 0, 0, 0.0).summary(), "started_ms": plan.started_ms}
    summary = {stored_keys.SUMMARY_COMPACTION: json.dumps(figures)}
    tx = StagedTransaction(ice)
    # Its manifests and manifest list carry the planned-on checkpoint, so the leftovers of an
    # attempt that crashed or lost its race are garbage collection's once it can no longer commit.
    tagged = commit_uuid(plan.base_checkpoint_id, fork=table.branch != MAIN_BRANCH, compaction=True)
    with tx.update_snapshot(snapshot_properties=summary, branch=table.branch).overwrite(tagged) as ow:
        for s in plan.inputs:
            ow.delete_data_file(by_path[table.to_uri(s.path)])
        for f in plan.outputs:
            ow.append_data_file(parquet_file_to_data_file(ice.io, ice.metadata, table.to_uri(f.path)))
    with before_catalog_switch(ice, point=faults.COMPACTION_COMMIT_METADATA_WRITTEN):
        tx.commit_transaction()
    crash_point(faults.COMPACTION_COMMITTED)
    return ice.metadata.snapshot_by_name(table.branch).snapshot_id


def compactions(table: IcebergStateTable) -> list[dict]:
    """The compactions committed on the table's branch line, oldest first: the figures of each
    (``CompactionResult.summary``) with ``snapshot_id`` and ``timestamp_ms``."""
    found = []
    for s in reversed(line(table.iceberg_table.metadata, table.branch)):
        value = stored_keys.get(s.summary.additional_properties, stored_keys.SUMMARY_COMPACTION) if s.summary else None
        if value:
            figures = json.loads(value) if value.startswith("{") else {}
            found.append({**figures, "snapshot_id": s.snapshot_id, "timestamp_ms": s.timestamp_ms})
    return found
