"""The embedded default catalog: SQLite next to the warehouse, for one machine.

A state table needs some Iceberg catalog to switch its metadata pointer atomically.
Production deployments pass their own (REST, Glue, Hive, SQL on Postgres...) to
``IcebergStateTable.open``; without one, a SQLite ``SqlCatalog`` in
``<warehouse>/catalog.db`` is created on first use. SQLite serializes writers with a file
lock, which is enough for one driver per table and concurrent readers on one host.
"""

from __future__ import annotations

import os

from pyiceberg.catalog.sql import SqlCatalog

# Catalog configuration keys (pyiceberg's names).
CATALOG_URI = "uri"
CATALOG_WAREHOUSE = "warehouse"
CATALOG_INIT_TABLES = "init_catalog_tables"

DEFAULT_CATALOG_NAME = "statestore"
DEFAULT_CATALOG_FILE = "catalog.db"
DEFAULT_NAMESPACE = "state"


def default_catalog(warehouse: str) -> SqlCatalog:
    """A SQLite SqlCatalog at ``<warehouse>/catalog.db`` with warehouse ``file://<abs warehouse>``.

    Creates the warehouse directory and the catalog's tables if missing. The caller owns
    the returned catalog and closes it (``catalog.close()``) when done.
    """
    if not isinstance(warehouse, str) or not warehouse:
        raise ValueError(f"warehouse must be a non-empty local directory path, got {warehouse!r}")
    if "://" in warehouse:
        raise ValueError(
            f"the embedded catalog keeps its SQLite file on local disk; warehouse {warehouse!r} is a URI: "
            "pass a local directory, or open the table with your own catalog= for remote storage"
        )
    root = os.path.abspath(warehouse)
    os.makedirs(root, exist_ok=True)
    return SqlCatalog(
        DEFAULT_CATALOG_NAME,
        **{
            CATALOG_URI: f"sqlite:///{os.path.join(root, DEFAULT_CATALOG_FILE)}",
            CATALOG_WAREHOUSE: f"file://{root}",
            CATALOG_INIT_TABLES: "true",
        },
    )
