"""Spark's own implementations of the keyed running count, the peers of ours; Spark's stateless
floor (the same keyed count of each micro-batch alone, no state at all: what any state path is
measured against); and Spark's ``transformWithState`` in processing time, the peer of ours on
the sessions workload."""

from __future__ import annotations

from typing import Any

from benchmarks.streaming.impl import OUTPUT_SCHEMA, Impl, RunContext, start_update_query
from benchmarks.streaming.processors import CountProcessor, PandasCountProcessor, SessionCountProcessor
from benchmarks.streaming.session import HDFS, ROCKSDB

# The peers ours is divided by in the report's ratio columns; the floor first.
FLOOR = "spark-floor-count"
SPARK_PEERS = (FLOOR, "spark-count-rocksdb", "spark-count-hdfs", "spark-tws-rows", "spark-tws-pandas")


def _stateless(source: Any, ctx: RunContext, frame_of: Any) -> Any:
    """A ``foreachBatch`` query over every file there is now that hands the run's sink
    ``frame_of(the batch's DataFrame)``: no state store, no stateful operator."""
    def batch(df: Any, batch_id: int) -> None:
        ctx.sink(frame_of(df), batch_id)

    return (source.writeStream.foreachBatch(batch).option("checkpointLocation", ctx.checkpoint)
            .trigger(availableNow=True).start())


def _floor_count(source: Any, ctx: RunContext) -> Any:
    return _stateless(source, ctx, lambda df: df.groupBy("key").count())


def _floor_repartition(source: Any, ctx: RunContext) -> Any:
    # The scan and the routing exchange alone: each event as (key, 1), hash-partitioned by key.
    from pyspark.sql import functions as F

    return _stateless(source, ctx, lambda df: df.repartition(4, "key").select("key", F.lit(1).cast("long")
                                                                                      .alias("count")))


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
    Impl(FLOOR, "Spark stateless: foreachBatch, groupBy(key).count() of each batch (the floor)", _floor_count,
         None, verify="per-batch"),
    Impl("spark-floor-repartition", "Spark stateless: foreachBatch, repartition(4, key) of each batch",
         _floor_repartition, None, verify=None),
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
