"""Stateful PySpark Structured Streaming on the disaggregated store.

Public surface:

* ``start_stateful_query``: run a processor per key over a streaming DataFrame, state in an
  Iceberg state table (``StateLocation``), exactly-once, rescalable at every restart;
* processors: any ``pyspark.sql.streaming.StatefulProcessor`` (Spark's row API, unchanged),
  or a ``VectorizedProcessor`` (Arrow batches) such as ``RunningAggregate`` and ``Deduplicate``;
* ``runner_of(query)``: batch reports and the state table of a running query.

Module guide: ``query`` (driver: routing, commits), ``tasks`` (executors: one task's key
groups), ``compat`` (Spark's handle and state variables), ``vectorized``, ``timers``,
``outputs`` (the exactly-once output table), ``location``.
"""

from spark_integration.location import StateLocation
from spark_integration.query import BatchReport, StatefulRunner, runner_of, start_stateful_query
from spark_integration.vectorized import (
    Deduplicate,
    RunningAggregate,
    VectorizedBatch,
    VectorizedProcessor,
    VectorizedResult,
)

__all__ = [
    "BatchReport",
    "Deduplicate",
    "RunningAggregate",
    "StateLocation",
    "StatefulRunner",
    "VectorizedBatch",
    "VectorizedProcessor",
    "VectorizedResult",
    "runner_of",
    "start_stateful_query",
]
