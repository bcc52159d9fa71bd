"""The change feed of a state variable between two sets of segments (two checkpoints).

Per key (and map user key) what the newer state has that the older has not: ``insert`` (no
live value before), ``update`` (another value), ``delete`` (no live value after), with the value
``before`` and ``after`` (a list compares as the whole list) and the checkpoint that wrote each.
Both sides are resolved by the rules of every reader (``statestore.resolve``) at one instant,
so an entry expiring in between is no change: what two restores at that instant would read.

When the newer segments are the older ones plus segments of later checkpoints (one line of
checkpoints: ids grow, and entries keep theirs through compaction), only the keys that entries
newer than the older checkpoint wrote can differ, and only they are read (``written_after``).
Pure Arrow and Polars over a ``SegmentReader``: the SQL views, the commands and the Spark data
source's executors compute the feed with it alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl
import pyarrow as pa

from statestore.descriptors import StateDescriptor, StateKind
from statestore.entries import read_entries
from statestore.layout import CHECKPOINT_ID, KEY_GROUP
from statestore.resolve import ORD, survivors
from statestore.segment import SegmentReader
from statestore.table import SegmentFile

CHANGE_TYPE = "change_type"
INSERT, UPDATE, DELETE = "insert", "update", "delete"
BEFORE, AFTER = "before", "after"
BEFORE_CHECKPOINT, AFTER_CHECKPOINT = f"{BEFORE}_{CHECKPOINT_ID}", f"{AFTER}_{CHECKPOINT_ID}"


def live_entries(reader: SegmentReader, schema: pa.Schema, desc: StateDescriptor, keys: list[str],
                 files: Sequence[SegmentFile], key_groups: np.ndarray, now_ms: int,
                 only: pl.DataFrame | None = None) -> pl.DataFrame:
    """The surviving entries of ``desc`` in ``key_groups`` (every column, ``resolve.survivors``);
    ``only``: just these keys (``key_group`` and the key columns), their row groups alone read."""
    if only is not None:
        key_groups = np.intersect1d(key_groups, only.get_column(KEY_GROUP).to_numpy().astype(np.int64))
    entries = read_entries(reader, files, key_groups, schema, state=desc.name, keys=only)
    return survivors(entries, desc, [KEY_GROUP, *keys], now_ms)


def written_after(reader: SegmentReader, schema: pa.Schema, desc: StateDescriptor, keys: list[str],
                  files: Sequence[SegmentFile], key_groups: np.ndarray, checkpoint_id: int) -> pl.DataFrame:
    """The keys (``key_group`` and key columns) of ``desc`` that entries newer than
    ``checkpoint_id`` wrote. A segment (or compaction output) holds no entry newer than the
    checkpoint it is named after, so only newer segments are read."""
    newer = [s for s in files if s.checkpoint_id > checkpoint_id]
    entries = read_entries(reader, newer, key_groups, schema, state=desc.name)
    return entries.filter(pl.col(CHECKPOINT_ID) > checkpoint_id).select(KEY_GROUP, *keys).unique()


def changes_between(reader: SegmentReader, schema: pa.Schema, desc: StateDescriptor, keys: list[str],
                    old_files: Sequence[SegmentFile], new_files: Sequence[SegmentFile], key_groups: np.ndarray,
                    now_ms: int, after_checkpoint: int | None = None) -> pl.DataFrame:
    """The change feed of ``desc`` in ``key_groups`` from ``old_files`` to ``new_files`` (module
    docstring), sorted by key group and key: ``change_type``, the key columns, the map user key
    (stored name), ``key_group``, ``before``, ``after``, ``before_checkpoint_id`` and
    ``after_checkpoint_id``. With ``after_checkpoint``, the new files are the old ones plus
    segments of later checkpoints, and only the keys those wrote are read."""
    touched = None if after_checkpoint is None else \
        written_after(reader, schema, desc, keys, new_files, key_groups, after_checkpoint)
    before = live_entries(reader, schema, desc, keys, old_files, key_groups, now_ms, touched)
    after = live_entries(reader, schema, desc, keys, new_files, key_groups, now_ms, touched)
    return diff(before, after, desc, keys)


def diff(before: pl.DataFrame, after: pl.DataFrame, desc: StateDescriptor, keys: list[str]) -> pl.DataFrame:
    """The change feed of two sides' surviving entries (``changes_between``)."""
    v = desc.value_column
    by = [KEY_GROUP, *keys]
    if desc.kind is StateKind.LIST:
        before, after = (frame.sort(ORD).group_by(by, maintain_order=True).agg(
            pl.col(v), pl.col(CHECKPOINT_ID).max()) for frame in (before, after))
    elif desc.kind is StateKind.MAP:
        by.append(desc.user_key_column)
    sides = [frame.select(*by, pl.col(v).alias(side), pl.col(CHECKPOINT_ID).cast(pl.Int64).alias(written),
                          pl.lit(True).alias(f"_{side}"))
             for frame, side, written in ((before, BEFORE, BEFORE_CHECKPOINT), (after, AFTER, AFTER_CHECKPOINT))]
    joined = sides[0].join(sides[1], on=by, how="full", coalesce=True, nulls_equal=True)
    was, now = pl.col(f"_{BEFORE}").fill_null(False), pl.col(f"_{AFTER}").fill_null(False)
    kind = pl.when(~was).then(pl.lit(INSERT)).when(~now).then(pl.lit(DELETE)).otherwise(pl.lit(UPDATE))
    changed = joined.filter(~(was & now) | ~pl.col(BEFORE).eq_missing(pl.col(AFTER)))
    columns = [CHANGE_TYPE, *keys, *([desc.user_key_column] if desc.kind is StateKind.MAP else []), KEY_GROUP,
               BEFORE, AFTER, BEFORE_CHECKPOINT, AFTER_CHECKPOINT]
    return changed.with_columns(kind.alias(CHANGE_TYPE)).sort(by).select(columns)


def change_types(desc: StateDescriptor, key_schema: pa.Schema) -> pa.Schema:
    """The Arrow schema of ``changes_between`` (stored names)."""
    value = pa.list_(desc.value_type) if desc.kind is StateKind.LIST else desc.value_type
    mk = [pa.field(desc.user_key_column, desc.user_key_type)] if desc.kind is StateKind.MAP else []
    return pa.schema([pa.field(CHANGE_TYPE, pa.string()), *key_schema, *mk, pa.field(KEY_GROUP, pa.int32()),
                      pa.field(BEFORE, value), pa.field(AFTER, value), pa.field(BEFORE_CHECKPOINT, pa.int64()),
                      pa.field(AFTER_CHECKPOINT, pa.int64())])
