"""Parquet segments: writing a checkpoint's entries, reading the entries of key groups.

A segment holds the entries of one task, one checkpoint and one partition, sorted by
(key group, key columns, state, seq), with column statistics. Row groups end at key-group
boundaries (once they reach ``row_group_rows_min`` rows), so a reader that wants a few key
groups reads only their row groups: the footer's key_group min/max say which.

A segment is written once, whole: its Parquet bytes go to a buffer in memory, then to the
table's filesystem in one write (its size is the buffer's: no request to ask for it), and into
the local file cache (``file_cache.FileCache``) when there is one, so the writer's own
later reads need no fetch.

Readers cache footers (segments are immutable) and open each segment once per read: from the
file cache when there is one (one whole-file fetch per file, missing files fetched in
parallel), else from the table's filesystem. They turn any missing, truncated or unreadable
file into ``CorruptSegmentError`` naming the file and the way out; a cached copy that cannot
be read is dropped and fetched again first.
"""

from __future__ import annotations

import base64
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from statestore import faults
from statestore.errors import CorruptSegmentError, StorageUnavailableError
from statestore.faults import crash_point
from statestore.file_cache import FileCache, FileCacheCounters
from statestore.layout import CHECKPOINT_ID, KEY_GROUP, SEQ, STATE
from statestore.paths import needs_parent_directories
from statestore.table import SegmentFile, StateTable

PARQUET_COMPRESSION = "zstd"
# Key of the Parquet key-value metadata that holds a segment's own file name (``_check_identity``).
SEGMENT_NAME_KEY = "icestate.segment-file"
# Key types whose Parquet statistics compare with the Python values of a request exactly
# (str, bytes, int): a row group of one key group is pruned by its first key column's min/max.
_PRUNABLE_KEY = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary,
                 pa.types.is_integer)


# Per key group, the sorted values of the first key column a read wants (``SegmentReader.read``).
KeyRequest = Mapping[int, Sequence[Any]]


class _Footer(NamedTuple):
    """A segment's footer as the reader uses it: per row group the key-group bounds and, for
    row groups of a single key group, the first key column's bounds (None: unknown)."""

    metadata: pq.FileMetaData
    names: frozenset
    kg_min: np.ndarray
    kg_max: np.ndarray
    key_name: str | None  # the first key column, when its statistics prune
    key_bounds: list[tuple[Any, Any] | None]


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
    rows_min: int, rows_max: int, *, file_cache: FileCache | None = None,
    counters: FileCacheCounters | None = None, upload: Callable[[str, pa.Buffer], object] | None = None,
) -> list[SegmentFile]:
    """Write ``entries`` (entry schema, any order) as this task's segments of ``checkpoint_id``,
    one file per partition, each also put into ``file_cache`` (``counters``: the writer's
    share of its counters). Returns the files, not yet committed.

    With ``upload``, each file's bytes go to ``upload(path, data)`` instead of being stored
    here: ``StateStore.checkpoint`` starts them in the background on an object store
    (``IcebergStateTable.upload_segment``), and its commit waits for them."""
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
        files.append(_write_one(table.filesystem, path, part, kgs[lo:hi], checkpoint_id, rows_min, rows_max,
                                table.layout.key_names, file_cache, counters, upload))
        crash_point(faults.SEGMENT_WRITTEN)
    return files


def write_segment_file(table: StateTable, entries: pa.Table, path: str, rows_min: int = 4096,
                       rows_max: int = 32 * 1024) -> SegmentFile:
    """Write ``entries`` (entry schema, any order, key groups of one partition) as one file at
    ``path``, sorted and with row groups aligned to key groups like a segment (compaction's
    output: entries of many checkpoints, each keeping its own checkpoint id and seq)."""
    sort_keys = [KEY_GROUP, *table.layout.key_names, STATE, CHECKPOINT_ID, SEQ]
    entries = entries.sort_by([(c, "ascending") for c in sort_keys])
    entries = entries.select(table.file_schema().names).cast(table.file_schema())
    kgs = entries.column(KEY_GROUP).to_numpy()
    newest = int(pc.max(entries.column(CHECKPOINT_ID)).as_py())
    return _write_one(table.filesystem, path, entries, kgs, newest, rows_min, rows_max, table.layout.key_names)


def _write_one(fs: pafs.FileSystem, path: str, part: pa.Table, kgs: np.ndarray, checkpoint_id: int,
               rows_min: int, rows_max: int, key_names: Sequence[str], file_cache: FileCache | None = None,
               counters: FileCacheCounters | None = None,
               upload: Callable[[str, pa.Buffer], object] | None = None) -> SegmentFile:
    sink = pa.BufferOutputStream()
    # Key columns are nearly unique and sorted, seq ascends: a dictionary only costs them time
    # to decode (plain keys, delta-coded seq: a third smaller and faster to read than all
    # dictionary-coded, measured in docs/decisions.md); the rest repeat and keep dictionaries.
    plain = {*key_names, SEQ}
    with pq.ParquetWriter(
        sink, part.schema, compression=PARQUET_COMPRESSION, write_statistics=True,
        store_schema=False, write_page_checksum=True,
        use_dictionary=[n for n in part.schema.names if n not in plain],
        column_encoding={SEQ: "DELTA_BINARY_PACKED"},
    ) as writer:
        for offset, length in _row_group_bounds(kgs, rows_min, rows_max):
            writer.write_table(part.slice(offset, length), row_group_size=length)
        # The file's own name in its footer: a reader knows it is the file the checkpoint
        # committed and not another valid segment copied over it.
        writer.add_key_value_metadata({SEGMENT_NAME_KEY: path.rsplit("/", 1)[-1]})
    data = sink.getvalue()
    if upload is not None:
        upload(path, data)
    else:
        store_file(fs, path, data)
    if file_cache is not None:
        file_cache.put(path, data, counters)
    return SegmentFile(
        path=path, checkpoint_id=checkpoint_id, key_group_min=int(kgs[0]), key_group_max=int(kgs[-1]),
        record_count=part.num_rows, size_bytes=data.size, footer=_footer_of(data),
    )


def store_file(fs: pafs.FileSystem, path: str, data: pa.Buffer) -> None:
    """Write ``data`` as the file ``path`` of ``fs`` (on an object store: one PUT)."""
    if needs_parent_directories(fs):
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(data)


def _footer_of(data: pa.Buffer) -> str:
    """A Parquet file's footer as ``SegmentFile.footer``: readable alone by ``pq.read_metadata``."""
    tail = memoryview(data)
    length = int.from_bytes(tail[-8:-4], "little")
    return base64.b64encode(b"PAR1" + bytes(tail[-(8 + length):])).decode("ascii")


class SegmentMismatch(OSError):
    """A segment file is not the one its checkpoint committed (another file in its place)."""


def _check_identity(seg: SegmentFile, md: pq.FileMetaData, size: int) -> None:
    """Raise ``SegmentMismatch`` unless the file at ``seg.path`` is the one the manifest
    records: its name in the footer (``SEGMENT_NAME_KEY``; files written before it had none),
    its size and its row count."""
    name = seg.path.rsplit("/", 1)[-1]
    written_as = (md.metadata or {}).get(SEGMENT_NAME_KEY.encode())
    if written_as is not None and written_as.decode(errors="replace") != name:
        raise SegmentMismatch(f"the file in its place was written as {written_as.decode(errors='replace')}, "
                              "another segment copied over it")
    if seg.size_bytes and size != seg.size_bytes:
        raise SegmentMismatch(f"it has {size} bytes where the checkpoint recorded {seg.size_bytes}")
    if seg.record_count and md.num_rows != seg.record_count:
        raise SegmentMismatch(f"it has {md.num_rows} rows where the checkpoint recorded {seg.record_count}")


class _ReadFailed(Exception):
    """A segment could not be read (the cause chained); ``cached``: from a cached copy."""

    def __init__(self, cached: bool):
        super().__init__()
        self.cached = cached


class SegmentReader:
    """Reads the entries of given key groups from segments, pruning by row-group statistics.

    With a ``file_cache``, segments are read from their local copies (fetched whole on a miss,
    the missing files of one ``read`` in parallel); without, from ``fs``, one open per segment
    and read. Counters: ``files_opened`` (segment opens, local or remote), ``bytes_read``
    (compressed bytes of the column chunks read) and ``file_cache_counters`` (this reader's
    share of the file cache's).

    Thread safety: one reader per task thread (the footer cache is not locked); the file
    cache may be shared.
    """

    def __init__(self, fs: pafs.FileSystem, footer_cache_entries_max: int = 4096,
                 file_cache: FileCache | None = None):
        self._fs = fs
        self._footers: OrderedDict[str, _Footer] = OrderedDict()
        self._footers_max = footer_cache_entries_max
        self.file_cache = file_cache
        self.file_cache_counters = FileCacheCounters()
        self.bytes_read = 0
        self.files_opened = 0
        # Bytes of files fetched by this read's prefetch that the cache had no room for.
        self._staged: dict[str, pa.Buffer] = {}

    def footers_held(self) -> int:
        return len(self._footers)

    def keep_footers(self, paths: Collection[str]) -> None:
        """Forget the footers of every segment but ``paths``: a reader that follows a table
        (a task's store, batch after batch) would otherwise keep the footer of each segment it
        ever read, compacted and expired ones included, up to ``footer_cache_entries_max``."""
        for path in [p for p in self._footers if p not in paths]:
            del self._footers[path]

    def read(self, segments: Sequence[SegmentFile], key_groups: np.ndarray, columns: Sequence[str],
             keys: KeyRequest | None = None) -> list[pa.Table]:
        """Entries of the (sorted, unique) ``key_groups`` from each segment; ``columns`` that a
        segment lacks (state variables added after it was written) come back as nulls.

        With ``keys`` (per key group, the sorted first-key-column values wanted), a row group of
        a single key group is read only when one of its key group's wanted values lies within its
        statistics' bounds: a read of a few keys reads the row groups that can hold them. The
        rows read are not filtered by key (the caller joins them with its keys)."""
        chosen = []
        for seg in segments:
            lo = np.searchsorted(key_groups, seg.key_group_min, side="left")
            hi = np.searchsorted(key_groups, seg.key_group_max, side="right")
            if lo < hi:
                chosen.append((seg, key_groups[lo:hi]))
        if self.file_cache is not None:
            needed = [(seg.path, seg.size_bytes) for seg, wanted in chosen
                      if seg.path not in self._footers or self._row_groups(self._footers[seg.path], wanted, keys)]
            if len(needed) > 1:
                self._staged = self.file_cache.prefetch(self._fs, needed, self.file_cache_counters)
        tables = []
        values = None if keys is None else pa.array([v for vs in keys.values() for v in vs])
        try:
            for seg, wanted in chosen:
                t = self._read_one(seg, wanted, columns, keys, values)
                if t is not None and t.num_rows:
                    tables.append(t)
        finally:
            self._staged = {}
        return tables

    def _read_one(self, seg: SegmentFile, wanted: np.ndarray, columns: Sequence[str],
                  keys: KeyRequest | None, values: pa.Array | None) -> pa.Table | None:
        retry = self.file_cache is not None
        while True:
            try:
                t = self._read_groups(seg, wanted, columns, keys, values)
                break
            except _ReadFailed as failed:
                self._footers.pop(seg.path, None)
                if self.file_cache is not None:  # never keep bytes that did not read
                    self.file_cache.invalidate(seg.path, self.file_cache_counters, corrupt=failed.cached)
                if retry and failed.cached:  # a damaged cached copy: fetch the file once more
                    retry = False
                    continue
                e = failed.__cause__
                if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) and not failed.cached:
                    self._check_reachable(seg, e)
                raise CorruptSegmentError(
                    f"segment {seg.path} of checkpoint {seg.checkpoint_id} cannot be read ({type(e).__name__}: {e}); "
                    "the state it holds is unavailable: restore the file from a backup, or restore an older "
                    "checkpoint that does not reference it"
                ) from e
        if t is None:
            return None
        for c in columns:
            if c not in t.column_names:
                t = t.append_column(c, pa.nulls(t.num_rows))
        return t.select(list(columns))

    def _check_reachable(self, seg: SegmentFile, cause: OSError) -> None:
        """Raise ``StorageUnavailableError`` when the storage of ``seg`` does not answer even a
        look at the file: the read failed on the storage (after its client's bounded retries),
        not on the file, whose state is then intact. An answer means the file itself failed."""
        try:
            self._fs.get_file_info(seg.path)
        except OSError as probe:
            raise StorageUnavailableError(
                f"segment {seg.path} of checkpoint {seg.checkpoint_id} could not be read: its storage failed "
                f"({type(cause).__name__}: {cause}) and does not answer ({type(probe).__name__}); the state is "
                "intact: retry once the storage is reachable") from cause

    def _read_groups(self, seg: SegmentFile, wanted: np.ndarray, columns: Sequence[str],
                     keys: KeyRequest | None, values: pa.Array | None) -> pa.Table | None:
        """The rows of ``wanted`` key groups (and, with ``keys``, of rows whose first key column
        is one of ``values``) in the row groups of ``seg`` that can hold them (None: none can);
        opens the file at most once. Raises ``_ReadFailed`` when the file cannot be read."""
        footer = self._footers.get(seg.path)
        if footer is not None:
            self._footers.move_to_end(seg.path)
            if not self._row_groups(footer, wanted, keys):
                return None
        f, cached = self._open(seg)
        remote = not cached and not isinstance(f, pa.BufferReader)
        try:
            if footer is None:
                footer = self._read_footer(seg, f)
            groups = self._row_groups(footer, wanted, keys)
            if not groups:
                return None
            md, names = footer.metadata, footer.names
            present = [c for c in columns if c in names]
            # Read from the remote store itself (no local copy), the column chunks of the row
            # groups go as a few coalesced ranged reads, issued together, not one request after
            # another per chunk (on S3 without a file cache, an async batch's requests 482 -> 352).
            t = pq.ParquetFile(f, metadata=md, page_checksum_verification=True,
                               pre_buffer=remote).read_row_groups(groups, columns=present)
        except (OSError, ValueError, pa.ArrowException) as e:  # ValueError: a damaged footer's text (UTF-8)
            raise _ReadFailed(cached) from e
        finally:
            f.close()
        wanted_cols = set(present)
        for g in groups:  # the compressed bytes of the column chunks actually read
            rg = md.row_group(g)
            self.bytes_read += sum(rg.column(i).total_compressed_size for i in range(rg.num_columns)
                                   if rg.column(i).path_in_schema.split(".", 1)[0] in wanted_cols)
        if values is not None and footer.key_name in wanted_cols:  # first by key: it leaves few rows
            column = t.column(footer.key_name)
            t = t.filter(pc.is_in(column, value_set=values.cast(column.type)))
        lo, hi = footer.kg_min[groups], footer.kg_max[groups]
        inside = np.searchsorted(wanted, hi, side="right") - np.searchsorted(wanted, lo, side="left")
        if not np.array_equal(inside, hi - lo + 1):  # a row group holds key groups not wanted
            t = t.filter(pc.is_in(t.column(KEY_GROUP), value_set=pa.array(wanted, pa.int32())))
        return t

    def _open(self, seg: SegmentFile) -> tuple[pa.NativeFile, bool]:
        """The bytes of ``seg``, random access, and whether they came from a cached copy."""
        try:
            staged = self._staged.pop(seg.path, None)
            if staged is not None:
                f, cached = pa.BufferReader(staged), False
            elif self.file_cache is not None:
                f, cached = self.file_cache.open(self._fs, seg.path, seg.size_bytes, self.file_cache_counters)
            else:
                f, cached = self._fs.open_input_file(seg.path), False
        except (OSError, pa.ArrowException) as e:
            raise _ReadFailed(False) from e
        self.files_opened += 1
        return f, cached

    @staticmethod
    def _row_groups(footer: _Footer, wanted: np.ndarray, keys: KeyRequest | None = None) -> list[int]:
        first = np.searchsorted(wanted, footer.kg_min, side="left")
        last = np.searchsorted(wanted, footer.kg_max, side="right")
        groups = np.flatnonzero(last > first).tolist()
        if keys is None:
            return groups
        kept = []
        for g in groups:
            bounds = footer.key_bounds[g]
            values = keys.get(int(footer.kg_min[g])) if bounds is not None else None
            if values is None or bisect_right(values, bounds[1]) > bisect_left(values, bounds[0]):
                kept.append(g)
        return kept

    def _read_footer(self, seg: SegmentFile, f: pa.NativeFile) -> _Footer:
        md = pq.ParquetFile(f).metadata
        _check_identity(seg, md, f.size())
        for g in range(md.num_row_groups):  # decode every column chunk's path now (UTF-8), not mid-read
            rg = md.row_group(g)
            for i in range(rg.num_columns):
                rg.column(i).path_in_schema  # noqa: B018
        arrow_schema = md.schema.to_arrow_schema()
        names = frozenset(arrow_schema.names)
        idx = next(i for i in range(md.num_columns) if md.schema.column(i).path == KEY_GROUP)
        # The first key column follows the key group (the entry schema's order), if prunable.
        key_idx = idx + 1 if idx + 1 < md.num_columns and any(
            t(arrow_schema.field(md.schema.column(idx + 1).path).type) for t in _PRUNABLE_KEY) else None
        rg_min = np.empty(md.num_row_groups, dtype=np.int64)
        rg_max = np.empty(md.num_row_groups, dtype=np.int64)
        key_bounds: list[tuple[Any, Any] | None] = []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            stats = rg.column(idx).statistics
            if stats is None or not stats.has_min_max:
                rg_min[g], rg_max[g] = seg.key_group_min, seg.key_group_max
            else:
                rg_min[g], rg_max[g] = stats.min, stats.max
            key_bounds.append(_exact_bounds(rg.column(key_idx).statistics)
                              if key_idx is not None and rg_min[g] == rg_max[g] else None)
        key_name = None if key_idx is None else md.schema.column(key_idx).path
        footer = _Footer(md, names, rg_min, rg_max, key_name, key_bounds)
        self._footers[seg.path] = footer
        if len(self._footers) > self._footers_max:
            self._footers.popitem(last=False)
        return footer


def _exact_bounds(stats: pq.Statistics | None) -> tuple[Any, Any] | None:
    """A column chunk's (min, max) when both are exact values (a writer may truncate long
    strings' bounds), else None."""
    if stats is None or not stats.has_min_max:
        return None
    if not getattr(stats, "is_min_value_exact", True) or not getattr(stats, "is_max_value_exact", True):
        return None
    return stats.min, stats.max
