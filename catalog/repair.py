"""Offline repair and migration of a state table: change state outside the stream and commit the
change as a new checkpoint that the stream resumes from.

A repair (``Repair``) builds on the newest checkpoint of the table's line, its *base*. It takes
rows (an Arrow table or a Polars frame, or the rows of a SQL query over the base's views): puts
that set a key's value (a list's whole list, a map's entries), appends of list elements, deletes
of keys or of map entries, deletes of keys in every variable. On a table without checkpoints it
is a bulk load, whose checkpoint may carry a stream position (``commit``): how state imported
from Spark's own store continues (``spark_integration.spark_import``). ``dry_run`` shows the
change feed the repair would produce (``catalog.inspection.changes`` over its own uncommitted
segments); ``commit`` writes it as one checkpoint:

* with the base's stream batch and checkpoint properties (the query's watermark and timers), so
  the stream's next batch builds on it as it would have on the base (``spark_integration.query``
  checks that the state is one batch behind Spark's: a repair keeps it so);
* recorded in its snapshot summary: who (``icestate.repair.by``), why (``icestate.repair.reason``),
  the base (``icestate.repair.base``) and the rows put and deleted per variable
  (``icestate.repair.rows``, JSON);
* refused (``RepairConflictError``, nothing committed) if anything was committed after the base:
  a stream that ran on in the meantime, or another repair. Run repairs while the query is
  stopped.

Entries are written as the stream writes them: stamped with the new checkpoint, expiring after
the variable's TTL from now (or at the rows' own ``expire_at_ms``).

Migration (``migrate``) changes the type of a state variable's values the way Iceberg evolves a
schema, without rewriting a file: a struct value gains fields, an integer or float widens
(int -> long, float -> double), recursively inside structs, lists and maps. Old entries read
with the new type (new fields null); the stream resumes with the new declaration.
"""

from __future__ import annotations

import getpass
import json
import time
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import pyarrow as pa

from catalog import inspection
from catalog.schema import canonical_arrow_type, evolution_problem
from statestore import stored_keys
from statestore.descriptors import StateDescriptor, StateKind, column_stem
from statestore.errors import CommitConflictError, SchemaMismatchError
from statestore.keygroups import assign_key_groups
from statestore.layout import EXPIRE_AT_MS, OP, OP_APPEND, OP_DELETE, OP_PUT
from statestore.live_rows import Ledger
from statestore.names import TIMERS_STATE
from statestore.store import StateStore, StoreConfig
from statestore.table import CheckpointInfo

if TYPE_CHECKING:
    from catalog.iceberg_table import IcebergStateTable

SUMMARY_REPAIR_BASE = "icestate.repair.base"
PUT, APPEND, DELETE = "put", "append", "delete"


class RepairConflictError(CommitConflictError):
    """A repair whose base is no longer the newest checkpoint (a stream or another repair
    committed after it): nothing was committed."""


class Repair:
    """One repair of ``table`` at its newest checkpoint (module docstring).

    Args:
        table: the state table, opened at its newest checkpoint (``IcebergStateTable.open_existing``
            or ``TableRef.open``); the repair moves it to the checkpoint it commits.
        reason: what the repair does and why, recorded with it.
        by: who repairs, recorded with it; default the operating system's user name.
        now_ms: the time entries are written at (TTL), default now.

    Raises:
        RepairConflictError: the table is opened at an older checkpoint than its newest.
    """

    def __init__(self, table: IcebergStateTable, *, reason: str, by: str | None = None, now_ms: int | None = None):
        if not reason or not reason.strip():
            raise ValueError("say what the repair does and why (reason): it is recorded with the checkpoint")
        opened = table.current_checkpoint()
        newest = table.restore()  # the catalog's newest, re-read: a stream may have committed since opening
        if opened is not None and (newest is None or newest.checkpoint_id != opened.checkpoint_id):
            raise RepairConflictError(
                f"state table {table.identifier} was opened at checkpoint {opened.checkpoint_id}, but its newest "
                f"checkpoint is {None if newest is None else newest.checkpoint_id}: a repair builds on the newest "
                "checkpoint (restore an older one first with a fork or savepoint, or repair the newest)")
        self.table = table
        self.base = newest
        self.reason = reason
        self.by = by if by is not None else _user()
        self.now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        # Counting live rows (``statestore.live_rows``): the stream's count goes on after the repair.
        self._store = StateStore(table, config=StoreConfig(clock_ms=lambda: self.now_ms, count_live_rows=True))
        self._rows: dict[str, dict[str, int]] = {}

    # --- changes ------------------------------------------------------------------------------

    def put(self, variable: str, rows: pa.Table | pl.DataFrame) -> None:
        """Set state: ``rows`` hold the key columns and ``v_<variable>`` (the value; a list's whole
        list, which replaces it), ``mk_<variable>`` for a map's user key, and optionally
        ``expire_at_ms``. A key (with its map user key) may appear once."""
        desc = inspection.descriptor(self.table, variable)
        frame = self._frame(rows, desc, with_value=True)
        keys, kgs = self._keys(frame)
        mk = _mk(desc)
        self._check_unique(frame, keys.column_names + ([mk] if mk else []), variable)
        expire = self._expire(frame, desc)
        if desc.kind is StateKind.LIST:
            self._write(desc, kgs, keys, OP_DELETE, None, None, pa.nulls(len(kgs), pa.int64()))
            lists = frame.get_column(desc.value_column)
            lengths = lists.list.len().fill_null(0).to_numpy()
            repeat = np.repeat(np.arange(len(kgs)), lengths)
            elements = lists.explode().drop_nulls().to_arrow()
            self._write(desc, kgs[repeat], keys.take(repeat), OP_APPEND, elements, None, expire.take(repeat))
        else:
            user_keys = frame.get_column(mk).to_arrow() if mk else None
            self._write(desc, kgs, keys, OP_PUT, frame.get_column(desc.value_column).to_arrow(), user_keys, expire)
        self._count(variable, PUT, frame.height)

    def append(self, variable: str, rows: pa.Table | pl.DataFrame) -> None:
        """Append to list state: ``rows`` hold the key columns, ``v_<variable>`` (one element per
        row) and optionally ``expire_at_ms`` (each element's own); a key's elements go after its
        list, in the rows' order."""
        desc = inspection.descriptor(self.table, variable)
        if desc.kind is not StateKind.LIST:
            raise ValueError(f"state {variable!r} is a {desc.kind.value} state: append takes a list state's elements; "
                             "put sets the others")
        frame = self._frame(rows, desc, with_value=True, element=True)
        keys, kgs = self._keys(frame)
        self._write(desc, kgs, keys, OP_APPEND, frame.get_column(desc.value_column).to_arrow(), None,
                    self._expire(frame, desc))
        self._count(variable, APPEND, frame.height)

    def delete(self, variable: str, rows: pa.Table | pl.DataFrame) -> None:
        """Delete state: ``rows`` hold the key columns (the key's whole state in ``variable``) and,
        for a map, optionally ``mk_<variable>`` (only that entry where it is not null)."""
        desc = inspection.descriptor(self.table, variable)
        frame = self._frame(rows, desc, with_value=False)
        keys, kgs = self._keys(frame)
        mk = _mk(desc)
        user_keys = frame.get_column(mk).to_arrow() if mk and mk in frame.columns else None
        self._write(desc, kgs, keys, OP_DELETE, None, user_keys, pa.nulls(len(kgs), pa.int64()))
        self._count(variable, DELETE, frame.height)

    def delete_keys(self, rows: pa.Table | pl.DataFrame) -> None:
        """Delete the state of the keys of ``rows`` (key columns) in every state variable: a
        poisoned key, gone."""
        for desc in self.table.layout.descriptors:
            self.delete(desc.name, _polars(rows).select(self.table.layout.key_names))

    def sql(self, query: str) -> pa.Table:
        """The rows of a SQL query over the base checkpoint's views (``catalog.sql.connect``:
        ``state_<variable>``, ``entries``, ...), e.g. to put what it selects."""
        from catalog.sql import connect

        con = connect(self.table, checkpoint_id=None if self.base is None else self.base.checkpoint_id,
                      now_ms=self.now_ms)
        try:
            return con.sql(query).to_arrow_table()
        finally:
            con.close()

    # --- dry run and commit ---------------------------------------------------------------------

    def dry_run(self) -> dict[str, pa.Table]:
        """The change feed the repair would produce, per variable it touches (``inspection.changes``'s
        columns), computed over its segments written and then removed: nothing is committed."""
        base_id = 0 if self.base is None else self.base.checkpoint_id
        cp = self.table.next_checkpoint_id()
        written = self._store.flush(cp)
        try:
            _, base_files = self.table.segments_at()
            return {name: inspection.files_changes(self.table, inspection.descriptor(self.table, name), base_files,
                                                   [*base_files, *written], base_id, self.now_ms)
                    for name in self._rows}
        finally:
            self._store.checkpoint_aborted(cp)
            for segment in written:
                self.table.filesystem.delete_file(segment.path)

    def _live_rows(self, base: CheckpointInfo | None, checkpoint_id: int) -> dict[str, str]:
        """The base's live row count (``statestore.live_rows``) with the repair's change, for the
        stream to go on counting from; none when the base has none."""
        text = None if base is None else base.properties.get(stored_keys.QUERY_LIVE_ROWS)
        change = self._store.live_row_change(checkpoint_id)
        if (base is not None and text is None) or change is None:
            return {}
        ledger = Ledger() if text is None else Ledger.decode(text)
        ledger.add({name: rows for name, rows in change.items() if name != TIMERS_STATE})  # Spark counts no timer
        return {stored_keys.QUERY_LIVE_ROWS: ledger.encode()}

    def commit(self, *, batch_id: int | None = None, stream: dict[str, str] | None = None) -> CheckpointInfo:
        """Commit the repair as the table's next checkpoint (module docstring).

        Args:
            batch_id, stream: only for a table's first checkpoint (a bulk load, such as state
                imported from elsewhere): the stream batch it holds and the stream's checkpoint
                properties (``stored_keys.QUERY_*``), which a repair otherwise keeps from its base.

        Raises:
            RepairConflictError: a checkpoint was committed after the base; nothing was committed.
            ValueError: the repair changes nothing, or gives a stream position on top of a base.
        """
        base = self.base
        if not self._rows and (base is not None or batch_id is None):  # a first stream position is a change
            raise ValueError("the repair changes nothing: put or delete rows first")
        if base is not None and (batch_id is not None or stream):
            raise ValueError("only a table's first checkpoint takes a stream batch and properties: a repair keeps "
                             f"those of its base (checkpoint {base.checkpoint_id})")
        cp = self.table.next_checkpoint_id()
        segments = self._store.flush(cp)
        properties = {**(dict(stream or {}) if base is None else base.properties),
                      inspection.SUMMARY_REPAIR_BY: self.by, inspection.SUMMARY_REPAIR_REASON: self.reason,
                      inspection.SUMMARY_REPAIR_ROWS: json.dumps(self._rows, sort_keys=True),
                      SUMMARY_REPAIR_BASE: "none" if base is None else str(base.checkpoint_id)}
        properties.pop(stored_keys.QUERY_LIVE_ROWS, None)  # the base's: the repair changed the rows
        properties.update(self._live_rows(base, cp))
        try:
            info = self.table.commit_checkpoint(
                cp, segments, parallelism=1 if base is None else base.parallelism,
                batch_id=batch_id if base is None else base.batch_id, properties=properties)
        except CommitConflictError as e:
            self._store.checkpoint_aborted(cp)
            raise RepairConflictError(
                f"state table {self.table.identifier} has a checkpoint newer than the repair's base "
                f"{None if base is None else base.checkpoint_id} (a stream or another repair committed): nothing was "
                f"committed. Stop the query, open the table again and repeat the repair on its newest checkpoint "
                f"({e})") from e
        except BaseException:
            self._store.checkpoint_aborted(cp)
            raise
        self._store.checkpoint_complete(cp)
        self.base = info
        self._rows = {}
        return info

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> Repair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing -------------------------------------------------------------------------------

    def _frame(self, rows: pa.Table | pl.DataFrame, desc: StateDescriptor, with_value: bool,
               element: bool = False) -> pl.DataFrame:
        """``rows`` with the stored column names, checked and cast to the variable's types (a
        list's element type for ``element``, else its whole list's)."""
        frame = _polars(rows)
        value_type = desc.value_type if element else _value_type(desc)
        shown = desc.display_columns()  # stored -> shown (v_<name>, mk_<name>)
        frame = frame.rename({name: stored for stored, name in shown.items() if name in frame.columns})
        layout = self.table.layout
        wanted = [*layout.key_names]
        mk = _mk(desc)
        if with_value:
            wanted += ([mk] if mk else []) + [desc.value_column]
        missing = [c for c in wanted if c not in frame.columns]
        if missing:
            named = [shown.get(c, c) for c in missing]
            raise SchemaMismatchError(
                f"rows for state {desc.name!r} lack column(s) {named}: give the key columns {layout.key_names}"
                + (f", {shown.get(mk, mk)}" if mk and with_value else "")
                + (f" and {shown[desc.value_column]} ({value_type})" if with_value else ""))
        if with_value and mk and frame.get_column(mk).null_count():
            raise ValueError(f"rows for state {desc.name!r} have null map keys in {shown[mk]}: a map entry needs "
                             "its user key")
        if with_value and frame.get_column(desc.value_column).null_count():
            raise ValueError(f"rows for state {desc.name!r} have null values in {shown[desc.value_column]}: "
                             "delete those keys instead")
        types = {desc.value_column: value_type}
        if mk:
            types[mk] = desc.user_key_type
        casts = {}
        for column, dtype in types.items():
            if column in frame.columns:
                try:
                    casts[column] = pl.from_arrow(frame.get_column(column).to_arrow().cast(dtype))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                    raise SchemaMismatchError(
                        f"column {shown.get(column, column)} of the rows for state {desc.name!r} does not convert to "
                        f"{dtype}: {e}") from None
        return frame.with_columns(*(series.alias(c) for c, series in casts.items()))

    def _keys(self, frame: pl.DataFrame) -> tuple[pa.Table, np.ndarray]:
        layout = self.table.layout
        keys = layout.check_keys(frame.select(layout.key_names).to_arrow())
        return keys, assign_key_groups(keys, layout.max_parallelism)

    def _check_unique(self, frame: pl.DataFrame, columns: list[str], variable: str) -> None:
        repeated = frame.select(columns).is_duplicated()
        if repeated.any():
            first = frame.filter(repeated).row(0, named=True)
            raise ValueError(f"rows for state {variable!r} give key {first} more than once: give each key once")

    def _expire(self, frame: pl.DataFrame, desc: StateDescriptor) -> pa.Array:
        if EXPIRE_AT_MS in frame.columns:
            return frame.get_column(EXPIRE_AT_MS).cast(pl.Int64).to_arrow()
        if desc.ttl is None:
            return pa.nulls(frame.height, pa.int64())
        return pa.array(np.full(frame.height, self.now_ms + desc.ttl.ttl_ms, dtype=np.int64))

    def _write(self, desc: StateDescriptor, kgs: np.ndarray, keys: pa.Table, op: int, values: pa.Array | None,
               user_keys: pa.Array | None, expire: pa.Array) -> None:
        n = keys.num_rows
        cols = {name: keys.column(name) for name in keys.column_names}
        cols[OP] = pa.array(np.full(n, op, dtype=np.int8))
        cols[EXPIRE_AT_MS] = expire
        if desc.kind is StateKind.MAP:
            cols[desc.user_key_column] = user_keys if user_keys is not None else pa.nulls(n, desc.user_key_type)
        cols[desc.value_column] = values if values is not None else pa.nulls(n, desc.value_type)
        self._store.write(desc.name, kgs.astype(np.int32), pl.from_arrow(pa.table(cols)))

    def _count(self, variable: str, what: str, rows: int) -> None:
        counts = self._rows.setdefault(variable, {PUT: 0, DELETE: 0})
        counts[what] = counts.get(what, 0) + rows


def _polars(rows: pa.Table | pl.DataFrame) -> pl.DataFrame:
    if isinstance(rows, pl.DataFrame):
        return rows
    if isinstance(rows, pa.Table | pa.RecordBatch):
        return pl.from_arrow(rows)
    raise TypeError(f"rows must be a pyarrow Table or a polars DataFrame, got {type(rows).__name__}")


def _mk(desc: StateDescriptor) -> str | None:
    return desc.user_key_column if desc.kind is StateKind.MAP else None


def _value_type(desc: StateDescriptor) -> pa.DataType:
    """The type of a put's value column: a list variable's whole list."""
    return pa.list_(desc.value_type) if desc.kind is StateKind.LIST else desc.value_type


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name in the environment or the password database
        return "unknown"


# --- migration ----------------------------------------------------------------------------------

def migrate(table: IcebergStateTable, variable: str, value_type: pa.DataType) -> None:
    """Change the value type of ``variable`` to ``value_type`` by Iceberg schema evolution (module
    docstring): the table's column evolves in one metadata commit, no file is rewritten. Reopen
    the table (and resume the stream with the new declaration) to read with the new type.

    Raises:
        SchemaMismatchError: ``value_type`` is not a widening of the current type (it names what
            differs).
    """
    desc = inspection.descriptor(table, variable)
    old = canonical_arrow_type(desc.value_type)
    new = canonical_arrow_type(value_type)
    problem = evolution_problem(old, new, "the value", drops=False)
    if problem:
        raise SchemaMismatchError(
            f"state {variable!r} of {table.identifier} holds {desc.value_type}; {value_type} is not a migration of it: "
            f"{problem}. A migration adds struct fields or widens int to long and float to double; anything else "
            "needs a new state variable")
    iceberg = table.iceberg_table
    column = f"v_{column_stem(variable)}"
    recorded = json.loads(stored_keys.upgraded(iceberg.properties)[stored_keys.LAYOUT])
    for state in recorded["states"]:
        if state["name"] == variable:
            state["value_type"] = str(value_type)
    with iceberg.transaction() as tx:
        with tx.update_schema() as update:
            update.union_by_name(pa.schema([pa.field(column, value_type)]))
        tx.set_properties({stored_keys.LAYOUT: json.dumps(recorded, sort_keys=True)})



