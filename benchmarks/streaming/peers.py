"""Spark's own implementations of the keyed running count, the peers of ours; and Spark's
``transformWithState`` in processing time, the peer of ours on the sessions workload."""

from __future__ import annotations

from typing import Any

from benchmarks.streaming.impl import OUTPUT_SCHEMA, Impl, RunContext, start_update_query
from benchmarks.streaming.processors import CountProcessor, PandasCountProcessor, SessionCountProcessor
from benchmarks.streaming.session import HDFS, ROCKSDB

# The peers ours is divided by in the report's ratio columns.
SPARK_PEERS = ("spark-count-rocksdb", "spark-count-hdfs", "spark-tws-rows", "spark-tws-pandas")


def _spark_count(source: Any, ctx: RunContext) -> Any:
    return start_update_query(source.groupBy("key").count(), ctx)


def _spark_tws_rows(source: Any, ctx: RunContext) -> Any:
    out = source.groupBy("key").transformWithState(CountProcessor(), OUTPUT_SCHEMA, outputMode="Update",
                                                   timeMode="None")
    return start_update_query(out, ctx)


def _spark_tws_pandas(source: Any, ctx: RunContext) -> Any:
    out = source.groupBy("key").transformWithStateInPandas(PandasCountProcessor(), OUTPUT_SCHEMA,
                                                           outputMode="Update", timeMode="None")
    return start_update_query(out, ctx)


def _spark_tws_sessions(source: Any, ctx: RunContext) -> Any:
    out = source.groupBy("key").transformWithState(SessionCountProcessor(ctx.gap_ms), OUTPUT_SCHEMA,
                                                   outputMode="Update", timeMode="ProcessingTime")
    return start_update_query(out, ctx)


PEERS = (
    Impl("spark-count-rocksdb", "Spark groupBy().count(), RocksDB store", _spark_count, ROCKSDB),
    Impl("spark-count-hdfs", "Spark groupBy().count(), HDFS-backed store", _spark_count, HDFS),
    Impl("spark-tws-rows", "Spark transformWithState (rows), RocksDB", _spark_tws_rows, ROCKSDB,
         per_key_jvm_calls=True),
    Impl("spark-tws-pandas", "Spark transformWithStateInPandas, RocksDB", _spark_tws_pandas, ROCKSDB,
         per_key_jvm_calls=True),
)

# The sessions workload (``benchmarks.streaming.sessions``): timers need the RocksDB provider.
SESSION_PEERS = (
    Impl("spark-tws-sessions", "Spark transformWithState (rows), ProcessingTime timers, RocksDB",
         _spark_tws_sessions, ROCKSDB, per_key_jvm_calls=True),
)
