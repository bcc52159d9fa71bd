"""The Iceberg output table of a stateful query, committed idempotently by batch id.

Tasks write their output rows as Parquet files in the table's data directory; the driver
adds them in one snapshot whose summary records the batch id (``icestate.batch-id``). A
batch that is replayed after a failure finds its id already committed and adds nothing,
so the table holds every batch's output exactly once, also with two drivers (or a zombie
resumed mid-batch): the batch check and the append are one commit, validated against the head
the check read, and a commit that lost a race checks again instead of appending on the new
head (the table's ``commit.retry.num-retries`` is set to 0 when it is opened).
"""

from __future__ import annotations

import contextlib
import time

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.io import load_file_io
from pyiceberg.table import Table, TableProperties

from catalog.fileio import refuse_code_from_metadata
from catalog.recovery import check_location_free, default_location
from catalog.task_view import io_properties
from statestore.errors import CommitConflictError, QueryMismatchError, SchemaMismatchError
from statestore.names import InvalidNameError, check_namespace, check_table_name
from statestore.stored_keys import OUTPUT_BATCH_ID, OUTPUT_QUERY_ID

COMMIT_ATTEMPTS = 8


class OutputTable:
    """An Iceberg table receiving a query's output rows, one snapshot per batch. It owns its
    catalog (closed by ``close``)."""

    def __init__(self, catalog: Catalog, table: Table):
        self._catalog = catalog
        self._table = table

    @classmethod
    def open(cls, catalog: Catalog, identifier: str, schema: pa.Schema) -> OutputTable:
        """Open the table ``namespace.name`` of ``catalog``, creating it with ``schema`` when
        missing. The table owns ``catalog`` from here on: closed with it, or when opening fails.

        Raises SchemaMismatchError when an existing table has other columns or types.
        """
        try:
            return cls(catalog, _opened(refuse_code_from_metadata(catalog), identifier, schema))
        except BaseException:
            _close(catalog)
            raise

    @property
    def table(self) -> Table:
        return self._table

    @property
    def data_location(self) -> str:
        return f"{self._table.location().rstrip('/')}/data"

    @property
    def io_properties(self) -> dict[str, str]:
        """The storage properties a task needs to write this table's data files."""
        return io_properties(self._table.io.properties)

    def delete_files(self, uris: list[str]) -> None:
        """Delete data files that no snapshot references (a replayed batch's spare copies)."""
        io = self._table.io
        for uri in uris:
            with contextlib.suppress(FileNotFoundError):
                io.delete(uri)

    def committed_batch(self) -> tuple[int, str | None] | None:
        """(batch id, query id) of the newest batch committed to the table (None when none)."""
        self._table = self._catalog.load_table(self._table.name())
        snapshot = self._table.current_snapshot()
        while snapshot is not None:
            props = snapshot.summary.additional_properties if snapshot.summary else {}
            if OUTPUT_BATCH_ID in props:
                return int(props[OUTPUT_BATCH_ID]), props.get(OUTPUT_QUERY_ID)
            parent = snapshot.parent_snapshot_id
            snapshot = self._table.snapshot_by_id(parent) if parent is not None else None
        return None

    def commit(self, batch_id: int, uris: list[str], query_id: str | None = None) -> bool:
        """Add ``uris`` as batch ``batch_id``'s rows; False (nothing done) when already committed.

        Raises QueryMismatchError when the table's batches come from another streaming query.
        """
        props = {OUTPUT_BATCH_ID: str(batch_id)}
        if query_id is not None:
            props[OUTPUT_QUERY_ID] = query_id
        for attempt in range(COMMIT_ATTEMPTS):
            committed = self.committed_batch()  # the head this append is validated against
            if committed is not None:
                if query_id is not None and committed[1] is not None and committed[1] != query_id:
                    raise QueryMismatchError(
                        f"output table {'.'.join(self._table.name())} receives the output of streaming query "
                        f"{committed[1]}, not of this query {query_id}: batch ids would not line up; use another "
                        "output table or the original checkpointLocation")
                if batch_id <= committed[0]:
                    return False
            if not uris:
                return False  # an empty batch adds nothing, replayed or not
            try:
                # The append's commit requires the head seen above (pyiceberg's snapshot producer
                # asserts its parent) and is never retried blindly on a newer head (the table's
                # commit retries are 0): the check and the append are one atomic step.
                self._table.add_files(uris, snapshot_properties=props)
                return True
            except CommitFailedException:
                time.sleep(min(0.05 * 2**attempt, 1.0))  # another writer committed: check again
        raise CommitConflictError(
            f"output table {'.'.join(self._table.name())} changed under each of {COMMIT_ATTEMPTS} attempts to "
            f"commit batch {batch_id}: another writer keeps committing to it; the batch is retried")

    def close(self) -> None:
        _close(self._catalog)


def _opened(catalog: Catalog, identifier: str, schema: pa.Schema) -> Table:
    parts = identifier.split(".") if isinstance(identifier, str) else []
    if len(parts) != 2:
        raise InvalidNameError(f"output table {identifier!r} must be 'namespace.name', e.g. results.sessions")
    namespace = check_namespace(parts[0])
    check_table_name(parts[1])
    catalog.create_namespace_if_not_exists(namespace)
    try:
        table = catalog.load_table(identifier)
    except NoSuchTableError:
        # A location holding a table's metadata is an output table whose catalog entry was lost.
        location = default_location(catalog, (namespace, parts[1]))
        check_location_free((namespace, parts[1]), location, load_file_io(catalog.properties, location),
                            state_table=False)
        table = catalog.create_table_if_not_exists(identifier, schema=schema)
    if table.properties.get(TableProperties.COMMIT_NUM_RETRIES) != "0":
        # pyiceberg retries a failed append on the new head, after our batch check: off.
        with table.transaction() as tx:
            tx.set_properties({TableProperties.COMMIT_NUM_RETRIES: "0"})
        table = catalog.load_table(identifier)
    existing = table.schema().as_arrow()
    want = [(f.name, f.type) for f in schema]
    have = [(f.name, f.type) for f in existing]
    if [n for n, _ in want] != [n for n, _ in have] or not all(
            _compatible(a, b) for (_, a), (_, b) in zip(want, have, strict=True)):
        raise SchemaMismatchError(
            f"output table {identifier} has schema {existing}, the query's output schema is {schema}; "
            "write to another table or migrate this one"
        )
    return table


def _close(catalog: Catalog) -> None:
    close = getattr(catalog, "close", None)
    if close is not None:
        close()


def _compatible(want: pa.DataType, have: pa.DataType) -> bool:
    if want == have:
        return True
    for kind in (pa.types.is_string, pa.types.is_binary):
        if kind(want) and (kind(have) or pa.types.is_large_string(have) or pa.types.is_large_binary(have)):
            return True
    return pa.types.is_timestamp(want) and pa.types.is_timestamp(have)
