"""One job of the streaming benchmark, in a fresh Python process with its own SparkSession, so
that sessions and configurations cannot leak between implementations.

A job is a JSON file written by ``runner.Runner``: a stream run (``kind: stream``) or Spark's
offline repartition (``kind: repartition``). Its result, or ``{"error": ...}``, goes to the
file named by the job's ``result``. Run: ``python -m benchmarks.streaming.worker JOB.json``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

from benchmarks.streaming.cpu import CpuMeter
from benchmarks.streaming.impl import SOURCE_SCHEMA, RunContext
from benchmarks.streaming.registry import IMPLS
from benchmarks.streaming.session import ROCKSDB, spark_session
from benchmarks.streaming.sink import ChecksumSink


def _batch_record(p: dict) -> dict:
    ops = p.get("stateOperators") or [{}]
    op = ops[0]
    return {"batch_id": p["batchId"], "input_rows": p["numInputRows"], "batch_ms": p["batchDuration"],
            "timestamp": p["timestamp"], "duration_ms": p["durationMs"],
            "state_rows_total": op.get("numRowsTotal"), "state_rows_updated": op.get("numRowsUpdated"),
            "state_commit_ms": op.get("commitTimeMs"), "state_memory_bytes": op.get("memoryUsedBytes"),
            "state_shuffle_partitions": op.get("numShufflePartitions"),
            "state_store_instances": op.get("numStateStoreInstances")}


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _run_stream(job: dict) -> dict:
    impl = IMPLS[job["impl"]]
    t0 = time.perf_counter()
    spark = spark_session(job, impl.provider)
    session_s = time.perf_counter() - t0
    import_s = None
    if impl.ours:
        # Our library is imported before the query's clock starts, as pyspark's own modules are
        # with the session: a program imports it once, not at every query (re)start. Reported.
        t0 = time.perf_counter()
        import spark_integration.query
        import spark_integration.vectorized  # noqa: F401
        import_s = time.perf_counter() - t0
    source = spark.readStream.schema(SOURCE_SCHEMA).option("maxFilesPerTrigger", 1).parquet(job["source"])
    sink = ChecksumSink(job["sample_keys"])
    ctx = RunContext(job["checkpoint"], job["warehouse"], job["table"], job["parallelism"], sink)
    meter = CpuMeter()
    start_epoch, t0 = time.time(), time.perf_counter()
    query = impl.start(source, ctx)
    query.awaitTermination()
    wall_s = time.perf_counter() - t0
    cpu = meter.stop()
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    batches = [_batch_record(json.loads(p.json)) for p in query.recentProgress]
    batches = [b for b in batches if b["input_rows"] > 0]
    spark.stop()
    first_end = _epoch(batches[0]["timestamp"]) + batches[0]["batch_ms"] / 1e3 if batches else None
    return {"session_s": session_s, "import_s": import_s, "wall_s": wall_s, "batches": batches, "sink": sink.batches,
            "cpu": cpu,
            "start_to_first_batch_end_s": first_end - start_epoch if first_end else None}


def _run_repartition(job: dict) -> dict:
    t0 = time.perf_counter()
    spark = spark_session(job, ROCKSDB)
    session_s = time.perf_counter() - t0
    manager = spark._streamingCheckpointManager
    meter = CpuMeter()
    t0 = time.perf_counter()
    manager.repartition(job["checkpoint"], job["partitions"])
    repartition_s = time.perf_counter() - t0
    cpu = meter.stop()
    spark.stop()
    return {"session_s": session_s, "repartition_s": repartition_s, "cpu": cpu,
            "api": f"{type(manager).__module__}.{type(manager).__qualname__}.repartition"}


def run_job(job_path: Path) -> None:
    """Run the job in ``job_path`` and write its result (an error is a result too)."""
    job = json.loads(job_path.read_text())
    try:
        result = _run_repartition(job) if job["kind"] == "repartition" else _run_stream(job)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc)[:3000]}"}
    Path(job["result"]).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    run_job(Path(sys.argv[1]))
