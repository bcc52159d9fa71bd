"""One job of the streaming benchmark, in a fresh Python process with its own SparkSession, so
that sessions and configurations cannot leak between implementations (or, with ``--serve``, the
jobs named on standard input one after the other in one process: ``Runner(one_driver=True)``).

A job is a JSON file written by ``runner.Runner``: a stream run (``kind: stream``), a run of the
processing-time sessions workload (``kind: sessions``) or Spark's offline repartition
(``kind: repartition``). Its result, or ``{"error": ...}``, goes to the
file named by the job's ``result``. Run: ``python -m benchmarks.streaming.worker JOB.json`` (or ``--serve``).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.streaming.cpu import CpuMeter
from benchmarks.streaming.impl import SOURCE_SCHEMA, RunContext
from benchmarks.streaming.registry import IMPLS, SESSION_IMPLS
from benchmarks.streaming.session import ROCKSDB, spark_session
from benchmarks.streaming.sessions import SessionSink, digest
from benchmarks.streaming.sink import SINKS


def _batch_record(p: dict) -> dict:
    ops = p.get("stateOperators") or [{}]
    op = ops[0]
    return {"batch_id": p["batchId"], "input_rows": p["numInputRows"], "batch_ms": p["batchDuration"],
            "timestamp": p["timestamp"], "duration_ms": p["durationMs"],
            "state_rows_total": op.get("numRowsTotal"), "state_rows_updated": op.get("numRowsUpdated"),
            "state_commit_ms": op.get("commitTimeMs"), "state_memory_bytes": op.get("memoryUsedBytes"),
            "state_shuffle_partitions": op.get("numShufflePartitions"),
            "state_store_instances": op.get("numStateStoreInstances")}


def _ours_breakdown(query: Any) -> list[dict]:
    """Where each of our batches' time went (``BatchReport``): the driver's plan, the Spark job
    of the tasks (with the callback), the commit; per task its open, processing, flush, output
    and CPU milliseconds (tasks run two at a time on local[2])."""
    from spark_integration import runner_of

    out = []
    for r in runner_of(query).reports:
        if r.skipped:
            continue
        tasks = list(r.tasks.values())
        out.append({"batch_id": r.batch_id, "duration_ms": r.duration_ms, "plan_ms": r.plan_ms,
                    "tasks_ms": r.tasks_ms, "callback_ms": r.callback_ms, "commit_ms": r.commit_ms,
                    "state_commit_ms": (r.state or {}).get("commitTimeMs"),
                    **{f"task_{k}": sum(t.get(k, 0) for t in tasks)
                       for k in ("elapsed_ms", "open_ms", "process_ms", "flush_ms", "output_ms", "cpu_ms",
                                 "bytes_read", "files_opened", "cache_evictions")},
                    # The views the task stores hold after the batch (each store within its bound).
                    "cache_size_bytes": sum(t.get("cache_size_bytes", 0) for t in tasks),
                    "task_pids": {task: t.get("pid") for task, t in sorted(r.tasks.items())}})
    return out


def _tree(path: Path) -> dict:
    """Bytes and files under ``path`` (nothing when it does not exist)."""
    files = [f for f in path.rglob("*") if f.is_file()] if path.exists() else []
    return {"bytes": sum(f.stat().st_size for f in files), "files": len(files)}


def _storage(job: dict, impl: Any) -> dict:
    """What the run left on disk for its state, after the query stopped. Spark: the state
    folder of its checkpoint (every retained version of every partition's store). Ours: the
    state table's folder (segments and Iceberg metadata). ``checkpoint`` is the whole Spark
    checkpoint folder (offsets, commits and, for Spark's stores, the state)."""
    checkpoint = Path(job["checkpoint"])
    if impl.ours:
        tables = [d for d in Path(job["warehouse"]).glob(f"*/{job['table']}") if d.is_dir()]
        state = {"bytes": 0, "files": 0}
        for d in tables:
            state = {k: state[k] + v for k, v in _tree(d).items()}
    else:
        state = _tree(checkpoint / "state")
    return {"state": state, "checkpoint": _tree(checkpoint)}


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _session_and_import(job: dict, impl: Any) -> tuple[Any, float, float | None]:
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
    return spark, session_s, import_s


def _run_stream(job: dict) -> dict:
    impl = IMPLS[job["impl"]]
    spark, session_s, import_s = _session_and_import(job, impl)
    source = spark.readStream.schema(SOURCE_SCHEMA).option("maxFilesPerTrigger", 1).parquet(job["source"])
    sink = SINKS[job.get("sink", "checksum")](job["sample_keys"])
    ctx = RunContext(job["checkpoint"], job["warehouse"], job["table"], job["parallelism"], sink,
                     store_config=job.get("store_config"))
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
    ours = _ours_breakdown(query) if impl.ours else None
    spark.stop()
    storage = _storage(job, impl)
    first_end = _epoch(batches[0]["timestamp"]) + batches[0]["batch_ms"] / 1e3 if batches else None
    return {"session_s": session_s, "import_s": import_s, "wall_s": wall_s, "batches": batches, "sink": sink.batches,
            "cpu": cpu, "ours_batches": ours, "storage": storage,
            "start_to_first_batch_end_s": first_end - start_epoch if first_end else None}


def _run_sessions(job: dict) -> dict:
    """The sessions workload: run until the sink has every expected session close; ours must
    then end by itself (availableNow), Spark's never does in processing time and is stopped."""
    impl = SESSION_IMPLS[job["impl"]]
    spark, session_s, import_s = _session_and_import(job, impl)
    # Spark's query runs a no-data batch at every trigger until stopped: keep every batch's progress.
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "100000")
    source = spark.readStream.schema(SOURCE_SCHEMA).option("maxFilesPerTrigger", 1).parquet(job["source"])
    sink = SessionSink()
    ctx = RunContext(job["checkpoint"], job["warehouse"], job["table"], job["parallelism"], sink, job["gap_ms"])
    meter = CpuMeter()
    t0 = time.perf_counter()
    sink.t0 = t0
    query = impl.start(source, ctx)
    deadline = t0 + job["poll_timeout_s"]
    while query.isActive and len(sink.pairs) < job["expected_closes"] and time.perf_counter() < deadline:
        time.sleep(0.02)
    if impl.ours and query.isActive:
        query.awaitTermination(60)  # ours ends by itself once no timer is left
    elif query.isActive and sink.batches:
        # Spark's runs on: its progress of the batch of the last closes comes after the sink call.
        last_id, wait_until = sink.batches[-1]["batch_id"], time.perf_counter() + 10
        while query.isActive and time.perf_counter() < wait_until and not any(
                p.batchId >= last_id for p in query.recentProgress):
            time.sleep(0.02)
    ended_by_itself = not query.isActive
    if not ended_by_itself:
        query.stop()
    wall_s = time.perf_counter() - t0
    cpu = meter.stop()
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    batches = [_batch_record(json.loads(p.json)) for p in query.recentProgress]
    extra = None
    if impl.ours:
        from spark_integration import runner_of

        reports = [r for r in runner_of(query).reports if not r.skipped]
        extra = {"batches": len(reports),
                 "without_input": sum(1 for r in reports if sum(t["rows_in"] for t in r.tasks.values()) == 0),
                 "tasks_ms": sum(r.tasks_ms for r in reports), "commit_ms": sum(r.commit_ms for r in reports),
                 "plan_ms": sum(r.plan_ms for r in reports), "callback_ms": sum(r.callback_ms for r in reports)}
    spark.stop()
    closing = [b for b in sink.batches if b["rows"]]
    return {"session_s": session_s, "import_s": import_s, "wall_s": wall_s, "ended_by_itself": ended_by_itself,
            "last_close_s": closing[-1]["at_s"] if closing else None,
            "last_close_batch_id": closing[-1]["batch_id"] if closing else None,
            "closes": len(sink.pairs), "closes_digest": digest(sink.pairs),
            "batches": batches, "sink": sink.batches, "ours_reports": extra, "cpu": cpu}


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
        run = {"repartition": _run_repartition, "sessions": _run_sessions}.get(job["kind"], _run_stream)
        result = run(job)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc)[:3000]}"}
    out = Path(job["result"])
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(result, indent=1, default=str))
    partial.replace(out)  # whole or absent: a serving runner waits for the file


def serve() -> None:
    """Run the jobs whose paths come on standard input, one per line, one after the other, in
    this process (``Runner(one_driver=True)``): each job builds and stops its own session on the
    JVM the first one started; a session a failed job left open is stopped before the next."""
    for line in sys.stdin:
        if line.strip():
            run_job(Path(line.strip()))
            _stop_leftover_session()
    _stop_leftover_session()


def _stop_leftover_session() -> None:
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is not None:
        session.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        run_job(Path(sys.argv[1]))
