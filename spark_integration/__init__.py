"""Stateful PySpark Structured Streaming on the disaggregated store.

Public surface:

* ``enable(spark, warehouse=...)`` / ``disable(spark)``: an existing job's own
  ``groupBy(...).transformWithState(...)...writeStream...start()`` runs on icestate
  (``spark_integration.dropin``);
* ``start_stateful_query``: run a processor per key over a streaming DataFrame, state in an
  Iceberg state table (``StateLocation``), exactly-once, rescalable at every restart;
* processors: any ``pyspark.sql.streaming.StatefulProcessor`` (Spark's row API, unchanged),
  one whose handlers are coroutines with awaitable state reads (``api="async"``, tuned by
  ``AsyncOptions``), or a ``VectorizedProcessor`` (Arrow batches) such as ``RunningAggregate``
  and ``Deduplicate``;
* ``import_spark_state(spark, checkpoint, to)``: a stopped query's state brought over from
  Spark's own state store, to continue where Spark stopped (``spark_integration.spark_import``);
* ``runner_of(query)``: batch reports and the state table of a running query;
* ``IcestateDataSource`` / ``register(spark)``: ``spark.read.format("icestate")`` over the
  resolved state of a variable at any retained checkpoint, with key and key-group pushdown.

Module guide: ``query`` (driver: routing, commits), ``tasks`` (executors: one task's key
groups), ``compat`` (Spark's handle and state variables), ``async_processor`` (coroutine
handlers and their execution controller), ``vectorized``, ``timers``,
``location`` (a query's state table: its ``catalog.TableRef`` and parallelism), ``datasource``.
Everything Iceberg (opening tables and catalogs, the exactly-once output table
``catalog.output_table``) lives in ``catalog``: this package never imports the Iceberg client.
"""

from statestore.exports import lazy_exports

# Exports load lazily: a Python worker that only reads state (the data source) or runs a
# task should not import the driver side (pyspark DataFrame APIs, catalogs) it never uses.
_EXPORTS = {
    "StateLocation": "spark_integration.location",
    "AsyncOptions": "spark_integration.async_processor",
    "BatchReport": "spark_integration.query",
    "StatefulRunner": "spark_integration.query",
    "runner_of": "spark_integration.query",
    "start_stateful_query": "spark_integration.query",
    "Deduplicate": "spark_integration.vectorized",
    "RunningAggregate": "spark_integration.vectorized",
    "VectorizedBatch": "spark_integration.vectorized",
    "VectorizedProcessor": "spark_integration.vectorized",
    "VectorizedResult": "spark_integration.vectorized",
    "enable": "spark_integration.dropin",
    "import_spark_state": "spark_integration.spark_import",
    "disable": "spark_integration.dropin",
    "DropInError": "spark_integration.dropin",
    "IcestateDataSource": "spark_integration.datasource",
    "register": "spark_integration.datasource",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
