"""The Iceberg side of the state store: one Iceberg table per stateful operator.

Public surface:

* ``IcebergStateTable``: a ``statestore.table.StateTable`` whose checkpoints are Iceberg
  snapshots (open, commit, restore, retention and garbage collection);
* ``TableRef``: where a state table is (catalog, namespace, table, line); every opener of a
  state table goes through one (``TableRef.open``);
* ``default_catalog``: the embedded SQLite catalog used when none is given;
* ``entries_view``, ``connect``: a checkpoint in DuckDB (raw entries, live state per variable,
  checkpoints, segments, key groups, change feeds); ``inspection``: the same as Arrow tables;
* ``repair.Repair``, ``repair.migrate``: change state outside the stream, widen a value type.

Only this package imports pyiceberg. Module guide: ``iceberg_table`` (the table facade),
``table_ref`` (where a table is: the one door to a table), ``commit`` (validate and commit a
checkpoint, retries), ``refs`` (savepoints and forks), ``gc`` (expire and delete files),
``retention`` (what to expire and delete: pure planning), ``output_table`` (a query's
exactly-once output table), ``creation`` (create / validate / evolve), ``schema`` (layout <->
Iceberg schema), ``manifests`` (manifest cache), ``naming`` (URIs and tagged commit files),
``properties`` (Iceberg configuration; the stored keys are ``statestore.stored_keys``),
``compaction`` and ``compactor``, ``defaults``, ``inspection`` (what people look at) and ``sql``
(it in DuckDB), ``repair``, ``key_text`` (typed keys); ``cli`` holds the state-table commands of
the ``icestate`` program and ``ui`` the state browser.
"""

from catalog import inspection
from catalog.defaults import DEFAULT_NAMESPACE, default_catalog
from catalog.iceberg_table import DEFAULT_RETAIN_CHECKPOINTS, IcebergStateTable
from catalog.sql import connect, entries_view
from catalog.table_ref import TableRef

__all__ = [
    "DEFAULT_NAMESPACE",
    "DEFAULT_RETAIN_CHECKPOINTS",
    "IcebergStateTable",
    "TableRef",
    "connect",
    "default_catalog",
    "entries_view",
    "inspection",
]
