"""Resolution of LSM entries into the live state of one state variable (polars, vectorized).

Input: entries of one variable with columns ``<keys>, op, ord, expire_at_ms, [mk_<name>],
v_<name>``, where ``ord`` totally orders the entries of a key (greater is newer). Output, a
*view*:

* value, reducing, aggregating: one row per live key: ``<keys>, v, expire_at_ms``;
* map: one row per live entry: ``<keys>, mk, v, expire_at_ms``;
* list: one row per live element, ordered by ``ord``: ``<keys>, v, expire_at_ms, ord``.

Rules (invariant 5, identical for every reader): the newest entry wins; a tombstone hides
older entries (a tombstone without a map user key hides the key's whole map or list);
entries expired at ``now_ms`` are invisible and dropped. A view can be turned back into
entries (``view_as_entries``) older than anything new, so views merge with fresh writes.
"""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl
import pyarrow as pa

from statestore.descriptors import StateDescriptor, StateKind
from statestore.layout import CHECKPOINT_ID, EXPIRE_AT_MS, KEY_GROUP, OP, OP_APPEND, OP_DELETE, OP_PUT

ORD = "ord"
CLEAR_ORD = "_clear_ord"


def make_ord(checkpoint_id: pl.Expr, seq: pl.Expr) -> pl.Expr:
    """(checkpoint id, seq) as one int64: checkpoint ids stay below 2^31, seq below 2^32 per flush."""
    return (checkpoint_id.cast(pl.Int64) * (1 << 32) + seq.cast(pl.Int64)).alias(ORD)


def live_rows(df: pl.DataFrame, now_ms: int) -> pl.DataFrame:
    """The rows not expired at ``now_ms``: ``df`` itself when none has an expiry (state without
    TTL, empty views), which spares a query per read."""
    if df.get_column(EXPIRE_AT_MS).null_count() == df.height:
        return df
    return df.filter(pl.col(EXPIRE_AT_MS).is_null() | (pl.col(EXPIRE_AT_MS) > now_ms))


def _after_clear(entries: pl.DataFrame, keys: list[str], clear_mask: pl.Expr) -> pl.DataFrame:
    """Entries newer than their key's newest whole-key tombstone (and not that tombstone)."""
    clears = entries.filter(clear_mask).group_by(keys).agg(pl.col(ORD).max().alias(CLEAR_ORD))
    if clears.height == 0:
        return entries.filter(~clear_mask)
    joined = entries.filter(~clear_mask).join(clears, on=keys, how="left", nulls_equal=True)
    return joined.filter(pl.col(CLEAR_ORD).is_null() | (pl.col(ORD) > pl.col(CLEAR_ORD))).drop(CLEAR_ORD)


def _newest(entries: pl.DataFrame, by: list[str]) -> pl.DataFrame:
    """The newest entry of each group. A window max is a hash aggregation: measured 0.53 s
    against 0.77 s for sort + unique on 2M string keys (ords are unique per key)."""
    return entries.filter(pl.col(ORD) == pl.col(ORD).max().over(by))


def resolve(entries: pl.DataFrame, desc: StateDescriptor, keys: list[str], now_ms: int) -> pl.DataFrame:
    """The view of ``desc`` over ``entries`` (see the module docstring)."""
    v = desc.value_column
    if desc.kind is StateKind.LIST:
        return survivors(entries, desc, keys, now_ms).select([*keys, v, EXPIRE_AT_MS, ORD])
    if desc.kind is StateKind.MAP:
        return survivors(entries, desc, keys, now_ms).select([*keys, desc.user_key_column, v, EXPIRE_AT_MS])
    return survivors(entries, desc, keys, now_ms).select([*keys, v, EXPIRE_AT_MS])


def survivors(entries: pl.DataFrame, desc: StateDescriptor, keys: list[str], now_ms: int) -> pl.DataFrame:
    """The entries of ``desc`` that are visible at ``now_ms``, whole (every column kept): what
    ``resolve`` turns into the view, and what compaction keeps when it holds every entry of
    these keys. Tombstones, hidden and expired entries are not among them."""
    if desc.kind is StateKind.LIST:
        live = _after_clear(entries, keys, pl.col(OP) == OP_DELETE)
        return live_rows(live.filter(pl.col(OP) == OP_APPEND).sort(ORD), now_ms)
    if desc.kind is StateKind.MAP:
        mk = desc.user_key_column
        live = _after_clear(entries, keys, (pl.col(OP) == OP_DELETE) & pl.col(mk).is_null())
        return live_rows(_newest(live, [*keys, mk]).filter(pl.col(OP) == OP_PUT), now_ms)
    return live_rows(_newest(entries, keys).filter(pl.col(OP) == OP_PUT), now_ms)


def newest_entries(entries: pl.DataFrame, desc: StateDescriptor, keys: list[str]) -> pl.DataFrame:
    """The entries of ``desc`` that no other entry among ``entries`` hides, whole, tombstones and
    expired entries included: what a compaction of *some* of a key group's segments keeps.
    Older entries may sit in segments it did not read, so the tombstones that hide them must
    stay, and so must expired entries (which, TTL settings having changed, might otherwise
    uncover an older one that expires later)."""
    if desc.kind is StateKind.LIST:
        return _from_newest_clear(entries, keys, pl.col(OP) == OP_DELETE).sort(ORD)
    if desc.kind is StateKind.MAP:
        mk = desc.user_key_column
        clear = (pl.col(OP) == OP_DELETE) & pl.col(mk).is_null()
        kept = _from_newest_clear(entries, keys, clear)
        return pl.concat([kept.filter(clear), _newest(kept.filter(~clear), [*keys, mk])], how="vertical")
    return _newest(entries, keys)


def _from_newest_clear(entries: pl.DataFrame, keys: list[str], clear_mask: pl.Expr) -> pl.DataFrame:
    """Each key's newest whole-key tombstone and the entries newer than it (all entries of a
    key without one)."""
    clears = entries.filter(clear_mask).group_by(keys).agg(pl.col(ORD).max().alias(CLEAR_ORD))
    if clears.height == 0:
        return entries
    joined = entries.join(clears, on=keys, how="left", nulls_equal=True)
    return joined.filter(pl.col(CLEAR_ORD).is_null() | (pl.col(ORD) >= pl.col(CLEAR_ORD))).drop(CLEAR_ORD)


def view_as_entries(view: pl.DataFrame, desc: StateDescriptor) -> pl.DataFrame:
    """A view as entries older than any real entry (``ord`` < 0; list order kept)."""
    if desc.kind is StateKind.LIST:
        # Keep the element order while moving every element below ord 0.
        n = view.height
        return view.with_columns(
            pl.lit(OP_APPEND, dtype=pl.Int8).alias(OP),
            (pl.int_range(0, n, dtype=pl.Int64) - n).alias(ORD),
        )
    return view.with_columns(pl.lit(OP_PUT, dtype=pl.Int8).alias(OP), pl.lit(-1, dtype=pl.Int64).alias(ORD))


def merge(view: pl.DataFrame | None, new_entries: list[pl.DataFrame], desc: StateDescriptor,
          keys: list[str], now_ms: int, entry_schema: pl.Schema) -> pl.DataFrame:
    """The view after applying ``new_entries`` (each with ``ord``) on top of ``view``.

    ``entry_schema`` is the polars schema of the variable's entries (``entry_columns``);
    ``keys`` may lead with a key-group column to merge the views of many key groups at once.
    """
    cols = entry_columns(desc, keys)
    parts = [] if view is None else [view_as_entries(view, desc).select(cols)]
    if new_entries:
        # One select and cast over all new parts: per part, they would cost more than the merge.
        parts.append(pl.concat(new_entries, how="diagonal_relaxed").select(cols).cast(entry_schema))
    if not parts:
        return empty_view(desc, keys, entry_schema)
    return resolve(pl.concat(parts, how="vertical"), desc, keys, now_ms)


def entry_columns(desc: StateDescriptor, keys: list[str]) -> list[str]:
    mk = [desc.user_key_column] if desc.kind is StateKind.MAP else []
    return [*keys, OP, ORD, EXPIRE_AT_MS, *mk, desc.value_column]


def view_columns(desc: StateDescriptor, keys: list[str]) -> list[str]:
    if desc.kind is StateKind.LIST:
        return [*keys, desc.value_column, EXPIRE_AT_MS, ORD]
    if desc.kind is StateKind.MAP:
        return [*keys, desc.user_key_column, desc.value_column, EXPIRE_AT_MS]
    return [*keys, desc.value_column, EXPIRE_AT_MS]


def empty_view(desc: StateDescriptor, keys: list[str], entry_schema: pl.Schema) -> pl.DataFrame:
    """A view of ``desc`` without rows (``entry_schema``: its entries' polars schema), made
    from the schema alone: a ``select`` of an empty frame would be a query of its own."""
    return pl.DataFrame(schema={c: entry_schema[c] for c in view_columns(desc, keys)})


# --- live state as people see it (SQL views, the data source, the state browser) -------------

LIST_POSITION = "list_position"
BATCH_ID = "batch_id"
# Where a row came from: its key group, and the checkpoint and stream batch that wrote it.
PROVENANCE_COLUMNS = (KEY_GROUP, CHECKPOINT_ID, BATCH_ID, EXPIRE_AT_MS)


def shown_columns(desc: StateDescriptor, keys: list[str]) -> list[str]:
    """The columns of ``shown`` (stored names): the keys, the map user key, the value, a list
    element's position and ``ord``, then ``PROVENANCE_COLUMNS``."""
    middle = [desc.user_key_column] if desc.kind is StateKind.MAP else []
    middle.append(desc.value_column)
    if desc.kind is StateKind.LIST:
        middle += [LIST_POSITION, ORD]
    return [*keys, *middle, *PROVENANCE_COLUMNS]


def shown_types(desc: StateDescriptor, key_schema: pa.Schema) -> pa.Schema:
    """The Arrow schema of ``shown`` (stored names; keys, key group and checkpoint non-null)."""
    types = {LIST_POSITION: pa.int64(), ORD: pa.int64(), KEY_GROUP: pa.int32(), CHECKPOINT_ID: pa.int64(),
             BATCH_ID: pa.int64(), EXPIRE_AT_MS: pa.int64(), desc.value_column: desc.value_type}
    if desc.kind is StateKind.MAP:
        types[desc.user_key_column] = desc.user_key_type
    keys = [pa.field(f.name, f.type, nullable=False) for f in key_schema]
    rest = shown_columns(desc, key_schema.names)[len(keys):]
    return pa.schema([*keys, *(pa.field(c, types[c], nullable=c not in (KEY_GROUP, CHECKPOINT_ID)) for c in rest)])


def shown(survived: pl.DataFrame, desc: StateDescriptor, keys: list[str],
          batches: Mapping[int, int | None]) -> pl.DataFrame:
    """``survivors`` (resolved with the key group among the keys) as the views show them: one
    row per key, map entry or list element, in ``shown_columns``; ``list_position`` numbers a
    list's elements from 0, ``batch_id`` is the stream batch of the writing checkpoint
    (``batches``; null for a checkpoint not in it)."""
    if desc.kind is StateKind.LIST:
        survived = survived.sort(ORD).with_columns(
            (pl.col(ORD).rank("ordinal").over([KEY_GROUP, *keys]) - 1).cast(pl.Int64).alias(LIST_POSITION))
    survived = survived.with_columns(
        pl.col(CHECKPOINT_ID).cast(pl.Int64),
        pl.col(CHECKPOINT_ID).replace_strict(dict(batches), default=None, return_dtype=pl.Int64).alias(BATCH_ID))
    return survived.select(shown_columns(desc, keys))
