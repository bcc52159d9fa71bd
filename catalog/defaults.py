"""The embedded default catalog: SQLite next to the warehouse, for one machine.

A state table needs some Iceberg catalog to switch its metadata pointer atomically.
Production deployments name their own (REST, Glue, Hive, SQL on Postgres...) in a
``TableRef`` (``catalog.table_ref``) or pass it to ``IcebergStateTable.open``; without one, a SQLite ``SqlCatalog`` in
``<warehouse>/catalog.db`` is created on first use. SQLite serializes writers with a file
lock, which is enough for one driver per table and concurrent readers on one host.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyiceberg.catalog.sql import SqlCatalog

# Catalog configuration keys (pyiceberg's names).
CATALOG_URI = "uri"
CATALOG_WAREHOUSE = "warehouse"
CATALOG_INIT_TABLES = "init_catalog_tables"

DEFAULT_CATALOG_NAME = "statestore"
DEFAULT_CATALOG_FILE = "catalog.db"
DEFAULT_NAMESPACE = "state"


def check_warehouse(warehouse: str) -> str:
    """``warehouse`` when it can hold the embedded catalog (a local directory path); else ValueError."""
    if not isinstance(warehouse, str) or not warehouse:
        raise ValueError(f"warehouse must be a non-empty local directory path, got {warehouse!r}")
    if "://" in warehouse:
        raise ValueError(
            f"the embedded catalog keeps its SQLite file on local disk; warehouse {warehouse!r} is a URI: "
            "pass a local directory, or name a pyiceberg catalog (catalog_name=, catalog_properties=) for "
            "remote storage"
        )
    return warehouse


def default_catalog(warehouse: str) -> SqlCatalog:
    """A SQLite SqlCatalog at ``<warehouse>/catalog.db`` with warehouse ``file://<abs warehouse>``.

    Creates the warehouse directory and the catalog's tables if missing. The caller owns
    the returned catalog and closes it (``catalog.close()``) when done.
    """
    from catalog.fileio import use_state_file_io
    from catalog.table_ref import checked_sql_catalog

    root = os.path.abspath(check_warehouse(warehouse))
    os.makedirs(root, exist_ok=True)
    uri = f"sqlite:///{os.path.join(root, DEFAULT_CATALOG_FILE)}"
    # A damaged, locked or unreadable catalog.db: an error naming it and what to do (table_ref).
    return use_state_file_io(checked_sql_catalog(lambda: embedded_catalog_class()(
        DEFAULT_CATALOG_NAME,
        **{
            CATALOG_URI: uri,
            CATALOG_WAREHOUSE: f"file://{root}",
            CATALOG_INIT_TABLES: "true",
        },
    ), uri, warehouse=root))


def embedded_catalog_class() -> type[SqlCatalog]:
    """pyiceberg's ``SqlCatalog``, imported when first asked: ``table_ref`` (and through it a
    Python worker's task path) needs this module's names, not SQLAlchemy and the Iceberg
    client (0.3 s a worker). The driver's side asks at its own import
    (``spark_integration.location``), so that a query's start does not pay it."""
    from pyiceberg.catalog.sql import SqlCatalog

    return SqlCatalog
