"""What people look at to understand, compare and repair a state table, as Arrow tables.

One implementation behind every way of looking: the SQL views (``catalog.sql.connect``), the
``icestate`` commands, the state browser (``icestate ui``), notebooks and the repair's dry run,
so all of them show the same thing. Every function reads either the checkpoint the table is
opened at (``checkpoint_id=None``: the newest, a restored one, a savepoint or a fork's head, as
the table was opened) or a retained checkpoint of the table's line; none moves the table, and
none writes.

* ``checkpoints``: one row per retained checkpoint (and per savepoint off the line): id, batch,
  commit time, parallelism, snapshot, rows and bytes added and in all, how it was written;
* ``segments``: the files of a checkpoint: unit, key-group range, rows, bytes;
* ``key_groups``: rows and bytes per key group (skew), from the segments' Parquet footers alone
  (row groups are aligned to key groups; a row group spanning several is shared evenly);
* ``live_state``: the resolved state of one variable (the same rules as every reader,
  ``statestore.resolve``) with where each row came from: its key group, and the checkpoint and
  stream batch that wrote it (null when that checkpoint is no longer retained);
* ``key_state`` / ``key_history``: one key's state at a checkpoint / at every retained one,
  reading only the row groups that can hold the key;
* ``changes``: the change feed between two checkpoints, per key (and map user key) of one
  variable: inserted, updated or deleted, with the values before and after (a list compares
  as the whole list). On one line only the keys written after the older checkpoint are read
  (checkpoint ids grow along a line, and entries keep theirs through compaction); checkpoints
  of different lines (a fork and main) compare every key.

TTL is evaluated at ``now_ms`` (default: now), the same instant on both sides of a change feed,
so an entry that expires in between is no change (a restore at that instant sees the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from catalog import key_text
from catalog.retention import checkpoint_id_of, line, operator_files_of
from statestore import changes as changes_module
from statestore.descriptors import StateDescriptor
from statestore.entries import variable_entry_schema
from statestore.errors import CorruptSegmentError, StateNotDeclaredError
from statestore.keygroups import assign_key_groups
from statestore.layout import KEY_GROUP
from statestore.live_rows import Ledger
from statestore.paths import parse_compaction_name
from statestore.resolve import BATCH_ID, shown
from statestore.segment import SegmentReader
from statestore.stored_keys import QUERY_ID, QUERY_LIVE_ROWS
from statestore.table import CheckpointInfo, SegmentFile

if TYPE_CHECKING:
    from catalog.iceberg_table import IcebergStateTable

# The checkpoint a history row was read at (its own checkpoint_id says which one wrote it).
AT_CHECKPOINT, AT_BATCH, AT_TIME = "checkpoint_id_at", "batch_id_at", "committed_at"
# Operations a checkpoint's summary records (``operation`` of ``checkpoints``).
CHECKPOINT, REPAIR = "checkpoint", "repair"
# Who committed a repair, what it did and how many rows it wrote (``catalog.repair``).
SUMMARY_REPAIR_BY = "icestate.repair.by"
SUMMARY_REPAIR_REASON = "icestate.repair.reason"
SUMMARY_REPAIR_ROWS = "icestate.repair.rows"
# Segments whose footers are read at once (each is a round trip to an object store).
FOOTER_READERS = 16

CHECKPOINTS_SCHEMA = pa.schema([
    ("checkpoint_id", pa.int64()), (BATCH_ID, pa.int64()), (AT_TIME, pa.timestamp("ms", tz="UTC")),
    ("parallelism", pa.int32()), ("max_parallelism", pa.int32()), ("snapshot_id", pa.int64()),
    ("operation", pa.string()), ("rows_added", pa.int64()), ("bytes_added", pa.int64()), ("rows", pa.int64()),
    ("bytes", pa.int64()), ("files", pa.int64()), ("savepoints", pa.list_(pa.string())),
    ("on_line", pa.bool_()), ("repair_by", pa.string()), ("repair_reason", pa.string()),
    ("operator", pa.string()), ("query_id", pa.string()), ("operator_state_files", pa.int32()),
    ("live_rows", pa.int64()),
])
SEGMENTS_SCHEMA = pa.schema([
    ("file", pa.string()), ("checkpoint_id", pa.int64()), ("unit", pa.int32()), ("key_group_min", pa.int32()),
    ("key_group_max", pa.int32()), ("rows", pa.int64()), ("bytes", pa.int64()),
])
KEY_GROUPS_SCHEMA = pa.schema([
    (KEY_GROUP, pa.int32()), ("unit", pa.int32()), ("rows", pa.int64()), ("bytes", pa.int64()),
    ("segments", pa.int32()),
])


def sql_name(name: str) -> str:
    """A state variable's name as its SQL table and columns show it: a NUL (which Spark allows in
    a state name, and which no SQL name or Polars column can hold) as the two characters ``\\0``."""
    return name.replace("\x00", "\\0")


# --- checkpoints, segments, key groups ---------------------------------------------------

def checkpoints(table: IcebergStateTable) -> pa.Table:
    """One row per retained checkpoint of the table's line, oldest first, then one per savepoint
    whose checkpoint is no longer on it (``on_line`` false). Rows and bytes come from the
    checkpoint's Iceberg snapshot summary: ``rows_added``/``bytes_added`` what it wrote,
    ``rows``/``bytes``/``files`` the whole table at it; ``operator`` is the stateful operator
    (the state table), ``query_id`` the streaming query that wrote it (none for a checkpoint
    written outside a query), ``operator_state_files`` its non-keyed operator state files,
    ``live_rows`` the live state rows after it as Spark counts them (``numRowsTotal``;
    ``statestore.live_rows``), none where not counted."""
    metadata = table.iceberg_table.metadata
    on_line = {checkpoint_id_of(s): s for s in line(metadata, table.branch) if checkpoint_id_of(s) is not None}
    named: dict[int, list[str]] = {}
    savepoints = table.savepoints()
    for name, info in savepoints.items():
        named.setdefault(info.snapshot_id, []).append(name)
    infos = [(info, True) for info in table.list_checkpoints()]
    seen = {info.snapshot_id for info, _ in infos}
    for info in sorted(savepoints.values(), key=lambda i: i.checkpoint_id):
        if info.snapshot_id not in seen and on_line.get(info.checkpoint_id) is None:
            infos.append((info, False))
            seen.add(info.snapshot_id)
    rows = []
    for info, kept in infos:
        snapshot = metadata.snapshot_by_id(info.snapshot_id)
        summary = snapshot.summary.additional_properties if snapshot is not None and snapshot.summary else {}
        rows.append({
            "checkpoint_id": info.checkpoint_id, BATCH_ID: info.batch_id, AT_TIME: info.timestamp_ms,
            "parallelism": info.parallelism, "max_parallelism": info.max_parallelism,
            "snapshot_id": info.snapshot_id,
            "operation": REPAIR if SUMMARY_REPAIR_BY in info.properties else CHECKPOINT,
            "rows_added": _int(summary.get("added-records")), "bytes_added": _int(summary.get("added-files-size")),
            "rows": _int(summary.get("total-records")), "bytes": _int(summary.get("total-files-size")),
            "files": _int(summary.get("total-data-files")), "savepoints": sorted(named.get(info.snapshot_id, [])),
            "on_line": kept, "repair_by": info.properties.get(SUMMARY_REPAIR_BY),
            "repair_reason": info.properties.get(SUMMARY_REPAIR_REASON),
            "operator": table.identifier, "query_id": info.properties.get(QUERY_ID),
            "operator_state_files": len(operator_files_of(snapshot)) if snapshot is not None else 0,
            "live_rows": _live_rows(info.properties.get(QUERY_LIVE_ROWS)),
        })
    return pa.Table.from_pylist(rows, schema=CHECKPOINTS_SCHEMA)


def _live_rows(text: str | None) -> int | None:
    if text is None:
        return None
    return Ledger.decode(text).total()


def _int(value: str | None) -> int | None:
    return None if value is None else int(value)


def segments(table: IcebergStateTable, checkpoint_id: int | None = None) -> pa.Table:
    """The files of a checkpoint, oldest checkpoint first: each with the unit (partition) its
    key groups belong to, its key-group range, rows and bytes."""
    _, files = table.segments_at(checkpoint_id)
    return pa.Table.from_pylist([{
        "file": table.to_uri(s.path), "checkpoint_id": s.checkpoint_id, "unit": table.partition_of(s.key_group_min),
        "key_group_min": s.key_group_min, "key_group_max": s.key_group_max, "rows": s.record_count,
        "bytes": s.size_bytes} for s in files], schema=SEGMENTS_SCHEMA)


def key_groups(table: IcebergStateTable, checkpoint_id: int | None = None) -> pa.Table:
    """Rows and bytes per key group at a checkpoint (every key group, empty ones too): the skew
    of the state. Row groups are aligned to key groups, so most are counted from their footer
    statistics alone; the key-group column is read only of a row group holding several (small
    key groups share one), whose bytes are then shared by rows."""
    _, files = table.segments_at(checkpoint_id)
    n = table.layout.max_parallelism
    rows, size, count = np.zeros(n, np.int64), np.zeros(n, np.float64), np.zeros(n, np.int32)
    if files:
        with ThreadPoolExecutor(min(FOOTER_READERS, len(files))) as pool:
            spans = list(pool.map(lambda s: _key_group_spans(table, s, n), files))
        for seg, (seg_rows, seg_bytes) in zip(files, spans, strict=True):
            count[seg.key_group_min:seg.key_group_max + 1] += 1
            rows += seg_rows
            size += seg_bytes
    return pa.table({
        KEY_GROUP: pa.array(np.arange(n, dtype=np.int32)),
        "unit": pa.array([table.partition_of(k) for k in range(n)], pa.int32()),
        "rows": pa.array(rows), "bytes": pa.array(np.rint(size).astype(np.int64)), "segments": pa.array(count),
    }, schema=KEY_GROUPS_SCHEMA)


def _key_group_spans(table: IcebergStateTable, seg: SegmentFile, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows and compressed bytes per key group of one segment (``key_groups``)."""
    try:
        return _read_key_group_spans(table, seg, n)
    except (OSError, ValueError, pa.ArrowException) as e:
        raise CorruptSegmentError(
            f"segment {seg.path} of checkpoint {seg.checkpoint_id} cannot be read ({type(e).__name__}: {e}); "
            "the state it holds is unavailable: restore the file from a backup, or restore an older checkpoint "
            "that does not reference it") from e


def _read_key_group_spans(table: IcebergStateTable, seg: SegmentFile, n: int) -> tuple[np.ndarray, np.ndarray]:
    rows, size = np.zeros(n, np.int64), np.zeros(n, np.float64)
    with table.filesystem.open_input_file(seg.path) as f:
        parquet = pq.ParquetFile(f)
        md = parquet.metadata
        column = md.schema.names.index(KEY_GROUP)
        for i in range(md.num_row_groups):
            group = md.row_group(i)
            stats = group.column(column).statistics
            compressed = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
            if stats is not None and stats.has_min_max and stats.min == stats.max:
                rows[stats.min] += group.num_rows
                size[stats.min] += compressed
                continue
            counts = np.bincount(parquet.read_row_group(i, columns=[KEY_GROUP]).column(0).to_numpy(), minlength=n)
            rows += counts
            size += compressed * counts / max(group.num_rows, 1)
    return rows, size


# --- live state ---------------------------------------------------------------------------

def live_state(table: IcebergStateTable, variable: str, checkpoint_id: int | None = None,
               now_ms: int | None = None, *, keys: pl.DataFrame | None = None,
               reader: SegmentReader | None = None) -> pa.Table:
    """The live state of ``variable`` at a checkpoint: one row per key (value, reducing,
    aggregating), per map entry, or per list element, with the columns of the SQL view
    ``state_<variable>``: the key columns, ``mk_<variable>`` (maps), ``v_<variable>``,
    ``list_position`` and ``ord`` (lists), ``key_group``, ``checkpoint_id`` and ``batch_id`` (which
    checkpoint and stream batch wrote the row) and ``expire_at_ms``.

    ``keys``: only these keys (a frame of ``key_group`` and the key columns, ``key_frame``); their
    row groups alone are read.
    """
    desc = descriptor(table, variable)
    info, files = table.segments_at(checkpoint_id)
    frame = _live(table, desc, files, _now(now_ms), keys, reader or SegmentReader(table.filesystem))
    return _shown(frame, desc, table.layout.key_names, _batches(table, info))


def _live(table: IcebergStateTable, desc: StateDescriptor, files: list[SegmentFile], now: int,
          keys: pl.DataFrame | None, reader: SegmentReader) -> pl.DataFrame:
    """The surviving entries of ``desc`` (every column, ``statestore.resolve.survivors``)."""
    layout = table.layout
    every = np.arange(layout.max_parallelism, dtype=np.int64)
    return changes_module.live_entries(reader, variable_entry_schema(layout, desc), desc, layout.key_names, files,
                                       every, now, keys)


def _shown(live: pl.DataFrame, desc: StateDescriptor, keys: list[str], batches: dict[int, int | None]) -> pa.Table:
    """Surviving entries as the view shows them (``live_state``)."""
    names = {column: sql_name(name) for column, name in desc.display_columns().items()}
    return shown(live, desc, keys, batches).rename(names).to_arrow()


def _batches(table: IcebergStateTable, info: CheckpointInfo | None) -> dict[int, int | None]:
    """Checkpoint id -> stream batch id of the checkpoints of the table's line (and of ``info``)."""
    found = {c.checkpoint_id: c.batch_id for c in table.list_checkpoints()}
    if info is not None:
        found.setdefault(info.checkpoint_id, info.batch_id)
    return found


def descriptor(table: IcebergStateTable, variable: str) -> StateDescriptor:
    try:
        return table.layout.descriptor(variable)
    except KeyError:
        raise StateNotDeclaredError(
            f"state table {table.identifier} has no state variable {variable!r}; it has "
            f"{[d.name for d in table.layout.descriptors]}") from None


def _now(now_ms: int | None) -> int:
    return int(time.time() * 1000) if now_ms is None else int(now_ms)


# --- one key ------------------------------------------------------------------------------

def key_frame(table: IcebergStateTable, key: Mapping[str, Any]) -> pl.DataFrame:
    """One key as a frame of its key group and key columns (``live_state(keys=...)``).

    Raises:
        ValueError: ``key`` does not name exactly the table's key columns, or a value does not
            convert to its column's type.
    """
    schema = table.layout.key_schema
    if set(key) != set(schema.names):
        raise ValueError(f"a key of state table {table.identifier} has the columns {schema.names}; "
                         f"got {sorted(key)}")
    columns = {}
    for f in schema:
        try:
            columns[f.name] = pa.array([key[f.name]], type=f.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"key column {f.name!r} is {f.type}: {key[f.name]!r} is not one ({e})") from None
    keys = pa.table(columns)
    kgs = assign_key_groups(keys, table.layout.max_parallelism)
    return pl.from_arrow(keys).with_columns(pl.Series(KEY_GROUP, kgs, dtype=pl.Int32))


def parse_key(table: IcebergStateTable, texts: Mapping[str, str]) -> dict[str, Any]:
    """A key typed as text, by key column name, as values of the key columns' own types
    (``catalog.key_text``).

    Raises:
        ValueError: ``texts`` does not name exactly the key columns, or a text is not a value of
            its column's type.
    """
    schema = table.layout.key_schema
    if set(texts) != set(schema.names):
        raise ValueError(f"a key of state table {table.identifier} has the columns {schema.names}; "
                         f"got {sorted(texts)}")
    return key_text.parse_key(schema, [texts[name] for name in schema.names])


def key_state(table: IcebergStateTable, key: Mapping[str, Any], checkpoint_id: int | None = None,
              now_ms: int | None = None, *, reader: SegmentReader | None = None) -> dict[str, pa.Table]:
    """One key's live state at a checkpoint: per variable its rows of ``live_state`` (none when
    the key has no state in it)."""
    keys = key_frame(table, key)
    info, files = table.segments_at(checkpoint_id)
    reader = reader or SegmentReader(table.filesystem)
    now, batches = _now(now_ms), _batches(table, info)
    names = table.layout.key_names
    return {d.name: _shown(_live(table, d, files, now, keys, reader), d, names, batches)
            for d in table.layout.descriptors}


def key_history(table: IcebergStateTable, key: Mapping[str, Any], now_ms: int | None = None,
                progress: Callable[[Iterable[CheckpointInfo]], Iterable[CheckpointInfo]] = iter,
                ) -> dict[str, pa.Table]:
    """One key's state at every retained checkpoint of the table's line, oldest first: per
    variable the rows of ``key_state`` at each, led by the checkpoint read (``checkpoint_id_at``,
    ``batch_id_at``, ``committed_at``). A checkpoint where the key has no state adds no row.
    ``progress`` wraps the iteration over the checkpoints (a progress bar's ``track``)."""
    reader = SegmentReader(table.filesystem)
    now = _now(now_ms)
    parts: dict[str, list[pa.Table]] = {d.name: [] for d in table.layout.descriptors}
    for info in progress(table.list_checkpoints()):
        for name, rows in key_state(table, key, info.checkpoint_id, now, reader=reader).items():
            at = {AT_CHECKPOINT: pa.array([info.checkpoint_id] * rows.num_rows, pa.int64()),
                  AT_BATCH: pa.array([info.batch_id] * rows.num_rows, pa.int64()),
                  AT_TIME: pa.array([info.timestamp_ms] * rows.num_rows, pa.timestamp("ms", tz="UTC"))}
            parts[name].append(pa.table({**at, **{c: rows.column(c) for c in rows.column_names}}))
    return {name: pa.concat_tables(tables) if tables else _empty_history(table, name)
            for name, tables in parts.items()}


def _empty_history(table: IcebergStateTable, variable: str) -> pa.Table:
    empty = live_state(table, variable, keys=pl.DataFrame(schema={KEY_GROUP: pl.Int32, **{
        f.name: pl.from_arrow(pa.array([], f.type)).dtype for f in table.layout.key_schema}}))
    head = pa.schema([(AT_CHECKPOINT, pa.int64()), (AT_BATCH, pa.int64()), (AT_TIME, pa.timestamp("ms", tz="UTC"))])
    return pa.schema([*head, *empty.schema]).empty_table()


# --- the change feed ----------------------------------------------------------------------

def changes(table: IcebergStateTable, variable: str, from_checkpoint: int, to_checkpoint: int | None = None,
            now_ms: int | None = None) -> pa.Table:
    """What changed in ``variable`` from checkpoint ``from_checkpoint`` to ``to_checkpoint`` (the
    opened checkpoint when None), per key (and map user key): ``change_type`` (insert, update,
    delete), the key columns, ``mk_<variable>`` (maps), ``key_group``, ``before`` and ``after``
    (the value; for a list the whole list) and ``before_checkpoint_id``/``after_checkpoint_id``
    (the checkpoint that wrote each side). Sorted by key group and key.

    Raises:
        CheckpointNotFoundError: a checkpoint is not retained on the table's line.
    """
    desc = descriptor(table, variable)
    _, old_files = table.segments_at(from_checkpoint)
    new_info, new_files = table.segments_at(to_checkpoint)
    descends = new_info is not None and _descends(table, new_info, from_checkpoint)
    # A compaction planned after ``from_checkpoint`` may have dropped tombstones written after it
    # (a whole unit merged keeps survivors only): the keys they deleted left no newer entry.
    compacted = any(parse_compaction_name(s.path) is not None and s.checkpoint_id > from_checkpoint
                    for s in new_files)
    descends = descends and not compacted
    # Checkpoints of different lines compare every key.
    return files_changes(table, desc, old_files, new_files, from_checkpoint if descends else None, _now(now_ms))


def files_changes(table: IcebergStateTable, desc: StateDescriptor, old_files: list[SegmentFile],
                  new_files: list[SegmentFile], written_after: int | None, now_ms: int) -> pa.Table:
    """``changes`` between two sets of segments (``statestore.changes.changes_between``): with
    ``written_after``, the new files are the old ones plus segments of later checkpoints, and
    only the keys those wrote are compared (a repair's dry run compares its own uncommitted
    segments so)."""
    layout = table.layout
    feed = changes_module.changes_between(
        SegmentReader(table.filesystem), variable_entry_schema(layout, desc), desc, layout.key_names, old_files,
        new_files, np.arange(layout.max_parallelism, dtype=np.int64), now_ms, written_after)
    shown = {c: sql_name(n) for c, n in desc.display_columns().items() if c != desc.value_column}
    return feed.rename(shown).to_arrow()


def _descends(table: IcebergStateTable, info: CheckpointInfo, from_checkpoint: int) -> bool:
    """Whether checkpoint ``from_checkpoint`` of the table's line is ``info``'s or an ancestor of it."""
    metadata = table.iceberg_table.metadata
    snapshot = metadata.snapshot_by_id(info.snapshot_id)
    while snapshot is not None:
        cp = checkpoint_id_of(snapshot)
        if cp is not None and cp <= from_checkpoint:
            return cp == from_checkpoint
        parent = snapshot.parent_snapshot_id
        snapshot = None if parent is None else metadata.snapshot_by_id(parent)
    return False
