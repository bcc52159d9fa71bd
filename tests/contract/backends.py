"""The storage backends the contract suite runs against: one small factory per ``StateTable``
implementation.

A ``Backend`` opens tables of one implementation in one place (``location``, a fresh
directory per test) and looks at them from the storage side, the way a reader that does not
trust the table object would: it lists the files under a table, damages one, and reads the
record of what is committed. Every method but ``_open``, ``root``, ``name_in_errors`` and
``commit_record`` goes through the table's own ``filesystem`` (pyarrow), so a backend on an
object store gets them for free.

``BACKENDS`` maps a backend's id (the pytest parameter id) to its class; a child process
(the crash tests) rebuilds the same backend from the id and the location.
"""

from __future__ import annotations

import abc
import hashlib
import os
from pathlib import Path
from typing import Any, ClassVar

import pyarrow.fs as pafs

from catalog.fileio import wait_for_deletes
from statestore.directory_table import CHECKPOINT_DIR, HEAD, DirectoryStateTable
from statestore.layout import StateLayout
from statestore.table import StateTable
from tests import pg_server, s3_server
from tests.contract.helpers import LAYOUT

DEFAULT_RETAIN_CHECKPOINTS = 10


class Backend(abc.ABC):
    """Opens, reopens and inspects the state tables of one implementation under ``location``.

    Each ``open`` returns a fresh table object, as a restarted process would get; tables are
    closed by ``close_all`` (the fixture's teardown). Not thread safe.
    """

    id: ClassVar[str]

    def __init__(self, location: str):
        self.location = location
        self._opened: list[StateTable] = []

    def open(self, layout: StateLayout = LAYOUT, *, checkpoint_id: int | None = None,
             retain_checkpoints: int = DEFAULT_RETAIN_CHECKPOINTS,
             key_groups_per_partition: int | None = None) -> StateTable:
        """Open (creating if needed) the backend's one table at a checkpoint (None: the newest).

        ``key_groups_per_partition`` asks for several partitions where the implementation
        has them; others keep their own partitioning (``partition_of`` is the contract)."""
        table = self._open(layout, checkpoint_id=checkpoint_id, retain_checkpoints=retain_checkpoints,
                           key_groups_per_partition=key_groups_per_partition)
        self._opened.append(table)
        return table

    def close_all(self) -> None:
        for table in self._opened:
            table.close()

    # -- to define per backend

    @abc.abstractmethod
    def _open(self, layout: StateLayout, **options: Any) -> StateTable:
        """A new table object of this implementation at ``self.location``."""

    @abc.abstractmethod
    def root(self, table: StateTable) -> str:
        """The table's root as a path of ``table.filesystem``: every file of the table is below it."""

    @abc.abstractmethod
    def name_in_errors(self, table: StateTable) -> str:
        """How the table's error messages name it."""

    @abc.abstractmethod
    def commit_record(self, table: StateTable) -> object:
        """What a new reader of the storage takes as committed (compared before and after a
        failed commit: equal means nothing was committed)."""

    # -- the storage side, through the table's filesystem

    def files(self, table: StateTable) -> set[str]:
        """Paths of every file under the table's root (once the garbage deletes under way, which
        run in the background after a commit, are done)."""
        wait_for_deletes()
        selector = pafs.FileSelector(self.root(table), recursive=True, allow_not_found=True)
        return {i.path for i in table.filesystem.get_file_info(selector) if i.type == pafs.FileType.File}

    def exists(self, table: StateTable, path: str) -> bool:
        wait_for_deletes()
        return table.filesystem.get_file_info(path).type == pafs.FileType.File

    def size_bytes(self, table: StateTable, path: str) -> int:
        return table.filesystem.get_file_info(path).size

    def write_bytes(self, table: StateTable, path: str, data: bytes) -> None:
        with table.filesystem.open_output_stream(path) as out:
            out.write(data)

    def damage(self, table: StateTable, path: str, how: str) -> None:
        """Damage a file as storage can: ``delete`` it, ``truncate`` it to half, ``append`` a
        byte (the file changed after it was written), or overwrite it with ``garbage``."""
        fs = table.filesystem
        if how == "delete":
            fs.delete_file(path)
            return
        with fs.open_input_stream(path) as f:
            data = f.read()
        damaged = {"truncate": data[: len(data) // 2], "append": data + b"x", "garbage": bytes(len(data))}[how]
        self.write_bytes(table, path, damaged)


class DirectoryBackend(Backend):
    """``DirectoryStateTable`` in a plain local directory."""

    id = "directory"

    def _open(self, layout: StateLayout, *, checkpoint_id: int | None, retain_checkpoints: int,
              key_groups_per_partition: int | None) -> StateTable:
        return DirectoryStateTable(self.location, layout, retain_checkpoints=retain_checkpoints,
                                   checkpoint_id=checkpoint_id)

    def root(self, table: StateTable) -> str:
        return table.location

    def name_in_errors(self, table: StateTable) -> str:
        return table.location

    def commit_record(self, table: StateTable) -> object:
        checkpoints = Path(table.location) / CHECKPOINT_DIR
        head = checkpoints / HEAD
        return (head.read_text() if head.exists() else None, sorted(p.name for p in checkpoints.glob("cp-*.json")))


class IcebergSqliteBackend(Backend):
    """``IcebergStateTable`` on an embedded SQLite catalog in a local warehouse."""

    id = "iceberg-sqlite"
    TABLE_NAME = "op"

    def _open(self, layout: StateLayout, *, checkpoint_id: int | None, retain_checkpoints: int,
              key_groups_per_partition: int | None) -> StateTable:
        # Imported here so that a child process of the directory backend never loads pyiceberg.
        from catalog import IcebergStateTable

        return IcebergStateTable.open(layout, warehouse=self.location, table_name=self.TABLE_NAME,
                                      checkpoint_id=checkpoint_id, retain_checkpoints=retain_checkpoints,
                                      partition_width=key_groups_per_partition)

    def root(self, table: StateTable) -> str:
        return table.location.removeprefix("file://")

    def name_in_errors(self, table: StateTable) -> str:
        return table.identifier

    def commit_record(self, table: StateTable) -> object:
        return table.iceberg_table.refresh().metadata_location


class IcebergCatalogBackend(IcebergSqliteBackend):
    """``IcebergStateTable`` on a pyiceberg catalog named by properties, as any deployment
    names one (``TableRef(catalog_name=..., catalog_properties=...)``)."""

    catalog_name = "contract"

    @abc.abstractmethod
    def properties(self) -> dict[str, str]:
        """The catalog's properties (``load_catalog``) for the tables at ``self.location``."""

    def ref(self):
        from catalog import TableRef

        return TableRef(self.TABLE_NAME, catalog_name=self.catalog_name, catalog_properties=self.properties())

    def _open(self, layout: StateLayout, *, checkpoint_id: int | None, retain_checkpoints: int,
              key_groups_per_partition: int | None) -> StateTable:
        return self.ref().open(layout, checkpoint_id=checkpoint_id, retain_checkpoints=retain_checkpoints,
                               partition_width=key_groups_per_partition)


class IcebergS3Backend(IcebergCatalogBackend):
    """``IcebergStateTable`` whose files live on S3 (moto's server, ``tests.s3_server``), with
    a SQLite catalog named by properties as any pyiceberg catalog is (``TableRef``). The
    server's endpoint comes from ``s3_server.ENDPOINT_ENV``, so a child process finds it."""

    id = "iceberg-s3"
    BUCKET = "icestate-contract"

    def __init__(self, location: str):
        super().__init__(location)
        self._endpoint = os.environ[s3_server.ENDPOINT_ENV]
        # One prefix of the bucket per location: tests share the server, never a table.
        self._prefix = hashlib.sha256(location.encode()).hexdigest()[:16]

    def properties(self) -> dict[str, str]:
        os.makedirs(self.location, exist_ok=True)
        return {
            "type": "sql",
            "uri": f"sqlite:///{self.location}/catalog.db",
            "init_catalog_tables": "true",
            "warehouse": f"s3://{self.BUCKET}/{self._prefix}",
            **s3_server.properties(self._endpoint),
        }

    def root(self, table: StateTable) -> str:
        return table.location.removeprefix("s3://")


class IcebergPostgresBackend(IcebergCatalogBackend):
    """``IcebergStateTable`` on pyiceberg's SQL catalog in a real PostgreSQL server
    (``tests.pg_server``), as a team shares one catalog; files in a local warehouse. The
    server's URI (with its password) comes from ``pg_server.URI_ENV``, so a child process finds
    it and no command line shows it. Tests share the server's one database, never a table:
    each location is a catalog name of its own (the SQL catalog's rows are keyed by it)."""

    id = "iceberg-postgres"

    def __init__(self, location: str):
        super().__init__(location)
        self._uri = os.environ[pg_server.URI_ENV]
        self.catalog_name = "contract_" + hashlib.sha256(location.encode()).hexdigest()[:16]

    def properties(self) -> dict[str, str]:
        os.makedirs(self.location, exist_ok=True)
        # The catalog's tables exist already (the session fixture made them): none is created
        # here, so processes that open their first table at once never race to create them.
        return {"type": "sql", "uri": self._uri, "init_catalog_tables": "false",
                "warehouse": f"file://{self.location}"}


BACKENDS: dict[str, type[Backend]] = {
    b.id: b for b in (DirectoryBackend, IcebergSqliteBackend, IcebergS3Backend, IcebergPostgresBackend)}
# Backends that need a server, and the fixture that starts it.
SERVERS: dict[str, str] = {IcebergS3Backend.id: "s3_endpoint", IcebergPostgresBackend.id: "pg_uri"}
