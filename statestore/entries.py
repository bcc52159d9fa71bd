"""Reading entries out of segments: the one reader every resolution starts from.

Every reader of a state table's entries (a task's store loading key groups, the Spark data
source, compaction, SQL inspection) reads them with ``read_entries`` and then resolves them
with ``resolve.py``: invariant 5 (every reader resolves entries the same way) holds because
there is one way to read them and one set of rules to resolve them.

``read_entries`` reads the entries of some key groups from a list of segments (pruned by
row-group statistics, ``segment.SegmentReader``), optionally of one state variable only,
casts them to the entry schema asked for (a column that a segment lacks, of a variable
declared after it was written, comes back null; a stored type is cast to the declared one)
and adds the ``ord`` column (``resolve.make_ord``) that orders them.

Thread safety: stateless; the ``SegmentReader`` passed in holds the footer cache and the
read counters, one per thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from statestore.descriptors import StateDescriptor, StateKind
from statestore.layout import CHECKPOINT_ID, EXPIRE_AT_MS, KEY_GROUP, OP, SEQ, STATE, StateLayout
from statestore.resolve import make_ord
from statestore.segment import SegmentReader
from statestore.table import SegmentFile


def variable_entry_schema(layout: StateLayout, desc: StateDescriptor) -> pa.Schema:
    """The columns of ``layout.entry_schema`` that entries of ``desc`` use: the system and key
    columns, its map user key (maps only) and its value; what a reader of one variable reads."""
    names = [KEY_GROUP, *layout.key_names, STATE, OP, CHECKPOINT_ID, SEQ, EXPIRE_AT_MS]
    if desc.kind is StateKind.MAP:
        names.append(desc.user_key_column)
    names.append(desc.value_column)
    schema = layout.entry_schema
    return pa.schema([schema.field(n) for n in names])


def read_entries(reader: SegmentReader, segments: Sequence[SegmentFile], key_groups: np.ndarray,
                 schema: pa.Schema, *, state: str | None = None, keys: pl.DataFrame | None = None,
                 ) -> pl.DataFrame:
    """The entries of the sorted, unique ``key_groups`` in ``segments``, with their ``ord``.

    Args:
        reader: reads (and counts) the row groups of those key groups.
        segments: the segments to read, in any order (``ord`` orders the entries).
        key_groups: sorted, unique key groups (int64).
        schema: the entry columns to read and their types: ``layout.entry_schema``, or a
            subset of it holding at least the system and key columns
            (``variable_entry_schema`` for one variable's).
        state: only the entries of this state variable; every variable's when None.
        keys: only the entries of these keys: a frame of the key group (``key_group``, Int32)
            and the key columns, one row per key. The reader then reads only the row groups
            whose statistics can hold one of them.

    Returns:
        A frame of ``schema``'s columns and types plus ``ord``, empty when there are no
        entries; in segment order, not sorted.
    """
    # Nullable as read: a cast does not check what the writer already guaranteed.
    target = pa.schema([f.with_nullable(True) for f in schema])
    request = None if keys is None else _key_request(keys, schema.names[1])
    tables = [t.cast(target) for t in reader.read(segments, key_groups, schema.names, request)]
    table = pa.concat_tables(tables) if tables else target.empty_table()
    if state is not None:
        table = table.filter(pc.equal(table.column(STATE), state))
    entries = pl.from_arrow(table)
    if keys is not None:
        entries = entries.join(keys, on=keys.columns, how="semi")
    return entries.with_columns(make_ord(pl.col(CHECKPOINT_ID), pl.col(SEQ)))


def _key_request(keys: pl.DataFrame, first_key: str) -> dict[int, list]:
    """{key group: sorted values of the first key column} of ``keys`` (``SegmentReader.read``)."""
    firsts = keys.select(KEY_GROUP, first_key).unique().sort(KEY_GROUP, first_key)
    kgs = firsts.get_column(KEY_GROUP).to_numpy()
    values = firsts.get_column(first_key).to_list()
    cuts = np.flatnonzero(np.diff(kgs)) + 1
    return {int(kgs[lo]): values[lo:hi]
            for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(kgs)], strict=True)} if len(kgs) else {}
