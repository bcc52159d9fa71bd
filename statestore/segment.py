"""Parquet segments: writing a checkpoint's entries, reading the entries of key groups.

A segment holds the entries of one task, one checkpoint and one partition, sorted by
(key group, key columns, state, seq), with column statistics. Row groups end at key-group
boundaries (once they reach ``row_group_rows_min`` rows), so a reader that wants a few key
groups reads only their row groups: the footer's key_group min/max say which.

Readers cache footers (segments are immutable) and turn any missing, truncated or
unreadable file into ``CorruptSegmentError`` naming the file and the way out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from statestore import faults
from statestore.errors import CorruptSegmentError
from statestore.faults import crash_point
from statestore.layout import CHECKPOINT_ID, KEY_GROUP, SEQ, STATE
from statestore.table import SegmentFile, StateTable

PARQUET_COMPRESSION = "zstd"
# metadata, top-level column names, key_group min and max per row group
_Footer = tuple[pq.FileMetaData, frozenset, np.ndarray, np.ndarray]


def _row_group_bounds(key_groups: np.ndarray, rows_min: int, rows_max: int) -> list[tuple[int, int]]:
    """(offset, length) of row groups over rows sorted by key group: cut at key-group
    boundaries once a group holds ``rows_min`` rows, and at ``rows_max`` rows regardless."""
    n = len(key_groups)
    boundaries = np.flatnonzero(np.diff(key_groups)) + 1
    cuts, start = [], 0
    for b in [*boundaries.tolist(), n]:
        while b - start > rows_max:
            cuts.append((start, rows_max))
            start += rows_max
        if b - start >= rows_min or b == n:
            if b > start:
                cuts.append((start, b - start))
            start = b
    return cuts


def write_segments(
    table: StateTable, entries: pa.Table, checkpoint_id: int, task_index: int,
    rows_min: int, rows_max: int,
) -> list[SegmentFile]:
    """Write ``entries`` (entry schema, any order) as this task's segments of ``checkpoint_id``,
    one file per partition. Returns the files, not yet committed."""
    if entries.num_rows == 0:
        return []
    file_schema = table.file_schema()
    sort_keys = [KEY_GROUP, *table.layout.key_names, STATE, SEQ]
    entries = entries.sort_by([(c, "ascending") for c in sort_keys])
    entries = entries.select(file_schema.names).cast(file_schema)
    kgs = entries.column(KEY_GROUP).to_numpy()
    partitions = np.fromiter((table.partition_of(int(k)) for k in range(int(kgs[-1]) + 1)), dtype=np.int64)[kgs]
    bounds = np.flatnonzero(np.diff(partitions)) + 1
    files = []
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(kgs)], strict=True):
        part = entries.slice(lo, hi - lo)
        path = table.new_segment_path(checkpoint_id, task_index, int(partitions[lo]))
        files.append(_write_one(table.filesystem, path, part, kgs[lo:hi], checkpoint_id, rows_min, rows_max))
        crash_point(faults.SEGMENT_WRITTEN)
    return files


def write_segment_file(table: StateTable, entries: pa.Table, path: str, rows_min: int = 4096,
                       rows_max: int = 128 * 1024) -> SegmentFile:
    """Write ``entries`` (entry schema, any order, key groups of one partition) as one file at
    ``path``, sorted and with row groups aligned to key groups like a segment (compaction's
    output: entries of many checkpoints, each keeping its own checkpoint id and seq)."""
    sort_keys = [KEY_GROUP, *table.layout.key_names, STATE, CHECKPOINT_ID, SEQ]
    entries = entries.sort_by([(c, "ascending") for c in sort_keys])
    entries = entries.select(table.file_schema().names).cast(table.file_schema())
    kgs = entries.column(KEY_GROUP).to_numpy()
    newest = int(pc.max(entries.column(CHECKPOINT_ID)).as_py())
    return _write_one(table.filesystem, path, entries, kgs, newest, rows_min, rows_max)


def _write_one(fs: pafs.FileSystem, path: str, part: pa.Table, kgs: np.ndarray, checkpoint_id: int,
               rows_min: int, rows_max: int) -> SegmentFile:
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    with fs.open_output_stream(path) as out, pq.ParquetWriter(
        out, part.schema, compression=PARQUET_COMPRESSION, write_statistics=True,
        store_schema=False, write_page_checksum=True,
    ) as writer:
        for offset, length in _row_group_bounds(kgs, rows_min, rows_max):
            writer.write_table(part.slice(offset, length), row_group_size=length)
    size = fs.get_file_info(path).size
    return SegmentFile(
        path=path, checkpoint_id=checkpoint_id, key_group_min=int(kgs[0]), key_group_max=int(kgs[-1]),
        record_count=part.num_rows, size_bytes=int(size),
    )


class SegmentReader:
    """Reads the entries of given key groups from segments, pruning by row-group statistics.

    Thread safe for concurrent reads only if the footer cache is not shared across
    threads; one reader per task thread.
    """

    def __init__(self, fs: pafs.FileSystem, footer_cache_entries_max: int = 4096):
        self._fs = fs
        self._footers: OrderedDict[str, _Footer] = OrderedDict()
        self._footers_max = footer_cache_entries_max
        self.bytes_read = 0
        self.files_opened = 0

    def read(self, segments: Sequence[SegmentFile], key_groups: np.ndarray, columns: Sequence[str]) -> list[pa.Table]:
        """Entries of the (sorted, unique) ``key_groups`` from each segment; ``columns`` that a
        segment lacks (state variables added after it was written) come back as nulls."""
        tables = []
        for seg in segments:
            lo = np.searchsorted(key_groups, seg.key_group_min, side="left")
            hi = np.searchsorted(key_groups, seg.key_group_max, side="right")
            if lo < hi:
                t = self._read_one(seg, key_groups[lo:hi], columns)
                if t is not None and t.num_rows:
                    tables.append(t)
        return tables

    def _read_one(self, seg: SegmentFile, wanted: np.ndarray, columns: Sequence[str]) -> pa.Table | None:
        try:
            md, names, rg_min, rg_max = self._footer(seg)
            first = np.searchsorted(wanted, rg_min, side="left")
            last = np.searchsorted(wanted, rg_max, side="right")
            groups = np.flatnonzero(last > first).tolist()
            if not groups:
                return None
            present = [c for c in columns if c in names]
            with self._fs.open_input_file(seg.path) as f:
                self.files_opened += 1
                t = pq.ParquetFile(f, metadata=md, page_checksum_verification=True).read_row_groups(
                    groups, columns=present)
            wanted_cols = set(present)
            for g in groups:  # the compressed bytes of the column chunks actually read
                rg = md.row_group(g)
                self.bytes_read += sum(rg.column(i).total_compressed_size for i in range(rg.num_columns)
                                       if rg.column(i).path_in_schema.split(".", 1)[0] in wanted_cols)
        except (OSError, pa.ArrowException) as e:
            self._footers.pop(seg.path, None)
            raise CorruptSegmentError(
                f"segment {seg.path} of checkpoint {seg.checkpoint_id} cannot be read ({type(e).__name__}: {e}); "
                "the state it holds is unavailable: restore the file from a backup, or restore an older "
                "checkpoint that does not reference it"
            ) from e
        t = t.filter(pc.is_in(t.column(KEY_GROUP), value_set=pa.array(wanted, pa.int32())))
        for c in columns:
            if c not in present:
                t = t.append_column(c, pa.nulls(t.num_rows))
        return t.select(list(columns))

    def _footer(self, seg: SegmentFile) -> _Footer:
        hit = self._footers.get(seg.path)
        if hit is not None:
            self._footers.move_to_end(seg.path)
            return hit
        with self._fs.open_input_file(seg.path) as f:
            self.files_opened += 1
            md = pq.ParquetFile(f).metadata
        names = frozenset(md.schema.to_arrow_schema().names)
        idx = next(i for i in range(md.num_columns) if md.schema.column(i).path == KEY_GROUP)
        rg_min = np.empty(md.num_row_groups, dtype=np.int64)
        rg_max = np.empty(md.num_row_groups, dtype=np.int64)
        for g in range(md.num_row_groups):
            stats = md.row_group(g).column(idx).statistics
            if stats is None or not stats.has_min_max:
                rg_min[g], rg_max[g] = seg.key_group_min, seg.key_group_max
            else:
                rg_min[g], rg_max[g] = stats.min, stats.max
        footer = (md, names, rg_min, rg_max)
        self._footers[seg.path] = footer
        if len(self._footers) > self._footers_max:
            self._footers.popitem(last=False)
        return footer
