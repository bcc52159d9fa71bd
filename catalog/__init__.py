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

from statestore.exports import lazy_exports

# Exports load lazily: a Python worker running a task imports ``catalog.task_view`` only, and
# should not pay for the catalog client, DuckDB and the inspection modules (0.8 s a worker).
_EXPORTS = {
    "DEFAULT_NAMESPACE": "catalog.defaults",
    "DEFAULT_RETAIN_CHECKPOINTS": "catalog.iceberg_table",
    "IcebergStateTable": "catalog.iceberg_table",
    "TableRef": "catalog.table_ref",
    "connect": "catalog.sql",
    "default_catalog": "catalog.defaults",
    "entries_view": "catalog.sql",
    "inspection": "catalog.inspection",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
