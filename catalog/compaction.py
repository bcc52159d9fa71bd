"""Compaction of a state table's segments, off the streaming critical path (issue 3; work in
progress on this branch).

``compact_partition`` rewrites every segment of one partition (``truncate(key_group, W)``)
into one file per partition holding only the entries that are still visible: the newest
entry per key (and map user key), the live list elements after the last whole-key clear;
tombstones and entries whose TTL passed are dropped. The kept entries keep their own
``checkpoint_id`` and ``seq``, so every reader resolves them exactly as before (invariant 5).
The output is named ``cmp-...parquet`` (not a segment name), so no orphan sweep mistakes an
output in flight for a crashed checkpoint's file.

The rewrite commits as one Iceberg overwrite on main's head that deletes exactly the files
it read and adds its output; the snapshot carries no checkpoint id, and the stream's next
checkpoint follows it (``IcebergStateTable._plan_parent``). When a checkpoint commits in
between, the catalog's compare-and-swap fails: the compaction re-plans on the new head and
retries, bounded; it never blocks or fails a checkpoint.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io.pyarrow import parquet_file_to_data_file
from pyiceberg.table.refs import MAIN_BRANCH

from catalog.iceberg_table import IcebergStateTable
from statestore.keygroups import KeyGroupRange
from statestore.layout import CHECKPOINT_ID, KEY_GROUP, SEQ, STATE
from statestore.resolve import ORD, make_ord, survivors
from statestore.segment import SegmentReader, write_segment_file

log = logging.getLogger(__name__)

SUMMARY_COMPACTION = "statestore.compaction"
ATTEMPTS_MAX = 5


@dataclass(frozen=True)
class CompactionPolicy:
    """When a partition needs compaction: at least ``min_segments`` segments, or, with at least
    two, a share of shadowed entries (entries a newer one hides) of ``min_shadowed_ratio``."""

    min_segments: int = 8
    min_shadowed_ratio: float = 0.5


@dataclass(frozen=True)
class CompactionResult:
    partition: int
    key_groups: KeyGroupRange
    files_in: int
    bytes_in: int
    entries_in: int
    files_out: int
    bytes_out: int
    entries_out: int
    attempts: int
    snapshot_id: int | None

    @property
    def rewrite_ratio(self) -> float:
        """Bytes written per byte read (below 1: the partition shrank)."""
        return self.bytes_out / self.bytes_in if self.bytes_in else 0.0


def compact_partition(table: IcebergStateTable, partition: int = 0, *, now_ms: int | None = None,
                      policy: CompactionPolicy | None = None) -> CompactionResult | None:
    """Compact one partition of ``table`` (its own table object: a compaction runs in its own
    process or thread, never on the stream's). Returns None when there is nothing to do (or
    the policy says it is not needed)."""
    for attempt in range(1, ATTEMPTS_MAX + 1):
        table.restore()  # main's newest checkpoint, and the head snapshot above it
        head = table.iceberg_table.metadata.snapshot_by_name(MAIN_BRANCH)
        if head is None:
            return None
        kgs = table.partition_key_groups(partition)
        inputs = [s for s in table.segments(kgs) if table.partition_of(s.key_group_min) == partition]
        if len(inputs) < 2:
            return None
        entries = _read_all(table, inputs, kgs)
        kept = _survivors(table, entries, _now(table, now_ms))
        if policy is not None and not _needed(policy, len(inputs), entries.height, kept.num_rows):
            return None
        out = _write(table, kept, partition)
        try:
            snapshot_id = _commit(table, head.snapshot_id, inputs, out)
        except CommitFailedException as e:
            log.info("compaction of partition %d lost a race to a checkpoint (%s); re-planning", partition, e)
            for f in out:
                table.filesystem.delete_file(f)
            time.sleep(0.05 * attempt)
            continue
        return CompactionResult(
            partition=partition, key_groups=kgs, files_in=len(inputs), bytes_in=sum(s.size_bytes for s in inputs),
            entries_in=entries.height, files_out=len(out),
            bytes_out=sum(table.filesystem.get_file_info(f).size for f in out), entries_out=kept.num_rows,
            attempts=attempt, snapshot_id=snapshot_id)
    log.warning("compaction of partition %d gave up after %d races with checkpoints", partition, ATTEMPTS_MAX)
    return None


def _now(table: IcebergStateTable, now_ms: int | None) -> int:
    """Entries expired before the newest checkpoint's commit are invisible to every later batch."""
    if now_ms is not None:
        return now_ms
    info = table.current_checkpoint()
    return info.timestamp_ms if info is not None else 0


def _read_all(table: IcebergStateTable, inputs, kgs: KeyGroupRange) -> pl.DataFrame:
    reader = SegmentReader(table.filesystem)
    wanted = np.arange(kgs.start, kgs.end + 1, dtype=np.int64)
    names = table.file_schema().names
    tables = reader.read(inputs, wanted, names)
    data = pa.concat_tables(tables, promote_options="permissive")
    return pl.from_arrow(data).with_columns(make_ord(pl.col(CHECKPOINT_ID), pl.col(SEQ)))


def _survivors(table: IcebergStateTable, entries: pl.DataFrame, now_ms: int) -> pa.Table:
    keys = [KEY_GROUP, *table.layout.key_names]
    parts = [survivors(entries.filter(pl.col(STATE) == d.name), d, keys, now_ms) for d in table.layout.descriptors]
    parts = [p for p in parts if p.height]
    frame = pl.concat(parts, how="vertical") if parts else entries.clear()
    return frame.drop(ORD).to_arrow()


def _needed(policy: CompactionPolicy, n_segments: int, entries: int, live: int) -> bool:
    if n_segments >= policy.min_segments:
        return True
    return entries > 0 and (entries - live) / entries >= policy.min_shadowed_ratio


def _write(table: IcebergStateTable, kept: pa.Table, partition: int) -> list[str]:
    if kept.num_rows == 0:
        return []
    path = table.data_path(f"cmp-p{partition:05d}-{uuid.uuid4().hex[:12]}.parquet")
    return [write_segment_file(table, kept, path).path]


def _commit(table: IcebergStateTable, head_id: int, inputs, out: list[str]) -> int:
    """One overwrite on main's head: delete exactly ``inputs``, add ``out``."""
    ice = table.iceberg_table
    by_path = {task.file.file_path: task.file for task in ice.scan(snapshot_id=head_id).plan_files()}
    tx = ice.transaction()
    with tx.update_snapshot(snapshot_properties={SUMMARY_COMPACTION: "rewrite"}).overwrite() as ow:
        for s in inputs:
            ow.delete_data_file(by_path[table.to_uri(s.path)])
        for f in out:
            ow.append_data_file(parquet_file_to_data_file(ice.io, ice.metadata, table.to_uri(f)))
    tx.commit_transaction()
    return ice.metadata.snapshot_by_name(MAIN_BRANCH).snapshot_id
