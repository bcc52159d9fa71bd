"""SQL access to a state table at a checkpoint with DuckDB.

DuckDB runs with the Python package alone: no extension is loaded or downloaded (its
iceberg and httpfs extensions would be fetched from the internet at run time), and DuckDB is
never given storage credentials. The entries view reads the Parquet files the checkpoint's
snapshot plans (pyiceberg's file list):

* on local disk, with DuckDB's bundled Parquet reader (``read_parquet`` by path);
* on any other filesystem (S3, GCS, ADLS... whatever the table's pyiceberg FileIO reaches), as
  a pyarrow dataset over the table's own filesystem (``IcebergStateTable.filesystem``, so the
  catalog's endpoint and credentials apply), registered with DuckDB: read lazily, with
  DuckDB's projections and filters pushed into the scan.

Both give the same view: the columns of every file by name, in order of first appearance,
types widened where files differ (``read_parquet(..., union_by_name = true)``).

A connection made here is *confined* once its views exist (``confine``): DuckDB's external
access is off and its configuration locked, so a query can read the registered views and
tables and nothing else: no file by path (``read_parquet``, ``read_text``, ``glob``), no
``COPY ... TO`` (which could overwrite a committed segment), no ``ATTACH``, no extension, and
no setting that undoes it. Its entries view then reads local files as a dataset too (a view
by path would need file access at query time). A connection passed in is left as it is:
whoever made it decides what it may do. Entries are
raw: every put, append and tombstone of every segment. ``connect`` adds one table per state
variable with its live state: the same files read by the one entry reader
(``statestore.entries``, through the table's filesystem) and resolved by
``statestore.resolve`` (invariant 5: the same way as every other reader).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import duckdb
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table

from catalog import inspection
from catalog.iceberg_table import IcebergStateTable
from catalog.inspection import sql_name
from catalog.manifests import ManifestCache, unreadable_as_corrupt
from catalog.naming import Locations
from statestore.errors import CheckpointNotFoundError
from statestore.layout import KEY_GROUP
from statestore.paths import is_local_filesystem
from statestore.segment import SegmentReader

DEFAULT_VIEW_NAME = "state_entries"
ENTRIES_VIEW = "entries"
STATE_TABLE_PREFIX = "state_"
CHANGES_TABLE_PREFIX = "changes_"
# DuckDB settings of the connections made here: never download an extension at run time (a
# query naming s3:// would otherwise fetch httpfs from the internet); a clear error instead.
DUCKDB_CONFIG = {"autoinstall_known_extensions": False}


def connect(
    table: IcebergStateTable, connection: duckdb.DuckDBPyConnection | None = None, *,
    checkpoint_id: int | None = None, now_ms: int | None = None, changes_from: int | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection holding the views of a checkpoint of ``table`` (``catalog.inspection``
    documents their columns):

    * ``state_<name>`` per state variable: its live state at ``now_ms`` (default: now), one row
      per key (value, reducing, aggregating), per map entry or per list element, with the key
      group, checkpoint and batch that wrote it and its expiry, read once here (it reads every
      entry of the checkpoint: meant for inspection);
    * ``entries``: the raw entries of the checkpoint's files;
    * ``checkpoints`` (every retained checkpoint and savepoint), ``segments`` (the files of this
      checkpoint) and ``key_groups`` (rows and bytes per key group);
    * ``changes_<name>`` per state variable when ``changes_from`` is a checkpoint id: the change
      feed from it to this checkpoint.
    """
    con = connection if connection is not None else new_connection()
    snapshot_id = _snapshot_of(table, checkpoint_id)
    files = _data_files(table.iceberg_table, snapshot_id)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    reader = SegmentReader(table.filesystem)
    views = {}
    for desc in table.layout.descriptors:
        name = sql_name(desc.name)
        views[STATE_TABLE_PREFIX + name] = inspection.live_state(table, desc.name, checkpoint_id, now, reader=reader)
        if changes_from is not None:
            views[CHANGES_TABLE_PREFIX + name] = inspection.changes(table, desc.name, changes_from, checkpoint_id, now)
    # After the state: its reads checked every file (``CorruptSegmentError`` naming one missing,
    # damaged or not the file its checkpoint recorded).
    views.update(checkpoints=inspection.checkpoints(table), segments=inspection.segments(table, checkpoint_id),
                 key_groups=inspection.key_groups(table, checkpoint_id))
    for name, rows in views.items():
        con.execute(f"DROP VIEW IF EXISTS {_ident(name)}")
        con.register(name, rows)
    _create_entries_view(con, table.iceberg_table, files, ENTRIES_VIEW, by_path=connection is not None)
    if connection is None:
        confine(con)
    return con


def entries_view(
    table: IcebergStateTable | Table, *, checkpoint_id: int | None = None, snapshot_id: int | None = None,
    connection: duckdb.DuckDBPyConnection | None = None, view_name: str = DEFAULT_VIEW_NAME,
) -> duckdb.DuckDBPyRelation:
    """Create (or replace) the view ``view_name`` of a checkpoint's raw entries; return it as a relation.

    Args:
        table: a state table (its opened checkpoint by default) or a pyiceberg table (its
            current snapshot by default).
        checkpoint_id: a retained checkpoint of a state table to read instead.
        snapshot_id: an Iceberg snapshot to read instead.
        connection: where to create the view; a new in-memory connection when None.

    Raises:
        CheckpointNotFoundError: ``checkpoint_id`` is not retained.
    """
    if checkpoint_id is not None and snapshot_id is not None:
        raise ValueError("pass checkpoint_id or snapshot_id, not both")
    iceberg = table.iceberg_table if isinstance(table, IcebergStateTable) else table
    if isinstance(table, IcebergStateTable):
        snapshot_id = snapshot_id if snapshot_id is not None else _snapshot_of(table, checkpoint_id)
    elif checkpoint_id is not None:
        raise TypeError("checkpoint_id needs an IcebergStateTable; pass snapshot_id for a plain Iceberg table")
    con = connection if connection is not None else new_connection()
    _create_entries_view(con, iceberg, _data_files(iceberg, snapshot_id), view_name, by_path=connection is not None)
    if connection is None:
        confine(con)
    return con.table(view_name)


def new_connection() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection that never downloads an extension (``DUCKDB_CONFIG``)."""
    return duckdb.connect(config=DUCKDB_CONFIG)


def confine(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """Turn off ``con``'s access to anything but what is registered in it, for good (module
    docstring)."""
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def _create_entries_view(con: duckdb.DuckDBPyConnection, iceberg: Table, files: list[DataFile], name: str,
                         by_path: bool = True) -> None:
    """(Re)create view ``name`` over the entries of ``files`` (module docstring: local files by
    path when ``by_path``, others and a confined connection's as a pyarrow dataset over the
    table's filesystem)."""
    locations = Locations.of(iceberg.location(), iceberg.io)
    con.execute(f"DROP VIEW IF EXISTS {_ident(name)}")
    if not files:
        # Neither reader takes an empty file list: an empty table of the schema stands in.
        con.register(name, schema_to_pyarrow(iceberg.schema(), include_field_ids=False).empty_table())
        return
    paths = [locations.to_path(f.file_path) for f in files]
    if by_path and is_local_filesystem(locations.filesystem):
        source = f"read_parquet({_sql_list(paths)}, union_by_name = true)"
        con.execute(f"CREATE OR REPLACE VIEW {_ident(name)} AS SELECT * FROM {source}")
    else:
        con.register(name, _dataset(locations.filesystem, paths))


def _dataset(fs: pafs.FileSystem, paths: list[str]) -> pads.Dataset:
    """The Parquet files ``paths`` of ``fs`` as one lazy dataset whose schema is the union of
    theirs by name, as ``read_parquet(..., union_by_name = true)`` makes it: columns in order of
    first appearance, a column missing from a file null there, types widened (int -> bigint)."""
    with ThreadPoolExecutor(min(inspection.FOOTER_READERS, len(paths))) as pool:
        schemas = list(pool.map(lambda p: _plain(pq.read_schema(p, filesystem=fs)), paths))
    schema = pa.unify_schemas(schemas, promote_options="permissive")
    return pads.dataset(paths, schema=schema, format="parquet", filesystem=fs)


def _plain(schema: pa.Schema) -> pa.Schema:
    """``schema`` without metadata (Parquet field ids, pandas/Arrow annotations): files are
    joined by column name, as DuckDB does."""
    return pa.schema([f.remove_metadata() for f in schema]).remove_metadata()


def _snapshot_of(table: IcebergStateTable, checkpoint_id: int | None) -> int | None:
    if checkpoint_id is None:
        current = table.current_checkpoint()
        return None if current is None else current.snapshot_id
    for info in table.list_checkpoints():
        if info.checkpoint_id == checkpoint_id:
            return info.snapshot_id
    raise CheckpointNotFoundError(
        f"checkpoint {checkpoint_id} is not retained in state table {table.identifier} "
        f"(retained: {[c.checkpoint_id for c in table.list_checkpoints()]})"
    )


def _data_files(iceberg: Table, snapshot_id: int | None) -> list[DataFile]:
    """The data files ``snapshot_id`` (or the current snapshot) holds. Its manifest list and
    manifests are read through a ``ManifestCache`` first, so that a damaged or missing one is
    a ``CorruptMetadataError`` naming it (pyiceberg's planning raises EOFError and the like)."""
    snapshot = iceberg.current_snapshot() if snapshot_id is None else iceberg.snapshot_by_id(snapshot_id)
    if snapshot is None:
        return []
    ManifestCache(iceberg.io, iceberg.schema().find_field(KEY_GROUP).field_id).live_files(snapshot)
    with unreadable_as_corrupt("manifests of the manifest list", snapshot.manifest_list):
        return [task.file for task in iceberg.scan(snapshot_id=snapshot.snapshot_id).plan_files()]


def _sql_list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
