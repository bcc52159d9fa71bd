"""What an implementation of the benchmark's query is: a named function that starts a
streaming query on the source and writes every batch's output to the run's sink.

Every implementation reads ``SOURCE_SCHEMA`` files and emits ``OUTPUT_SCHEMA`` rows: (key, the
key's new count) for every key its batch updated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql.types import LongType, StringType, StructField, StructType

SOURCE_SCHEMA = StructType([StructField("key", StringType(), False), StructField("value", LongType(), False)])
OUTPUT_SCHEMA = StructType([StructField("key", StringType(), True), StructField("count", LongType(), True)])


@dataclass(frozen=True)
class RunContext:
    """What a worker hands an implementation: where its checkpoint and state live, and the sink."""

    checkpoint: str
    warehouse: str
    table: str
    parallelism: int
    sink: Callable[[Any, int], None]
    gap_ms: int = 1  # the session gap of the processing-time sessions workload
    store_config: dict | None = None  # ours: ``statestore.StoreConfig`` fields (the cache workload's bound)


@dataclass(frozen=True)
class Impl:
    name: str
    label: str
    start: Callable[[Any, RunContext], Any]  # (source DataFrame, context) -> StreamingQuery
    provider: str | None  # state store provider class; None leaves Spark's default
    ours: bool = False
    per_key_jvm_calls: bool = False  # one JVM round trip per key: run on the small data set only
    remote: bool = False  # state on S3 (moto behind our latency proxy, started by the bench process)
    # What its output is checked against: "running" counts (the stateful jobs), "per-batch" counts
    # (the stateless floor: the same keyed count of each batch alone), or None (rows not counted).
    verify: str | None = "running"


def start_update_query(out: Any, ctx: RunContext) -> Any:
    """Start ``out`` in update mode into the run's sink, over every file there is now."""
    return (out.writeStream.outputMode("update").foreachBatch(ctx.sink)
            .option("checkpointLocation", ctx.checkpoint).trigger(availableNow=True).start())
