"""The sink every run writes to: a checksum of each batch's output, not the output itself."""

from __future__ import annotations

import time
from typing import Any


class ChecksumSink:
    """foreachBatch sink: one aggregate per batch over the emitted (key, count) rows (rows, sum of
    counts, sum of key id x count, the counts of the sample keys), so that checking a 2M-event run
    costs one small job per batch and no output is collected."""

    def __init__(self, sample_keys: list[str]) -> None:
        self.sample_keys = sample_keys
        self.batches: list[dict] = []

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        from pyspark.sql import functions as F

        t0 = time.perf_counter()
        key_id = F.substring("key", 2, 30).cast("long")
        in_sample = F.col("key").isin(self.sample_keys)
        row = batch_df.agg(
            F.count(F.lit(1)).alias("rows"), F.sum("count").alias("sum_count"),
            F.sum(key_id * F.col("count")).alias("sum_id_count"),
            F.collect_list(F.when(in_sample, F.struct("key", "count"))).alias("sample"),
        ).first()
        self.batches.append({
            "batch_id": batch_id, "rows": row["rows"], "sum_count": row["sum_count"] or 0,
            "sum_id_count": row["sum_id_count"] or 0, "sample": {r["key"]: r["count"] for r in row["sample"]},
            "sink_s": time.perf_counter() - t0,
        })


class NoopSink:
    """foreachBatch sink that computes the batch's output and drops it (Spark's ``noop``
    format): the floor as the performance targets define it. Records only the time per batch;
    the runs with ``ChecksumSink`` are the ones whose output is checked."""

    def __init__(self, sample_keys: list[str] | None = None) -> None:
        self.batches: list[dict] = []

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        t0 = time.perf_counter()
        batch_df.write.format("noop").mode("overwrite").save()
        self.batches.append({"batch_id": batch_id, "sink_s": time.perf_counter() - t0})


SINKS = {"checksum": ChecksumSink, "noop": NoopSink}
