"""Where the CPU of a streaming micro-batch goes, per process: Spark's JVM, the Python
workers, the driver's Python, our compactor (where our throughput falls short of its target,
measured).

Runs the workload of ``benchmarks.bench_spark`` (keyed running count, one Parquet file per batch,
local[2], 4 shuffle partitions) for one or more implementations, each in a fresh process,
and samples the CPU time of every process of the job's tree (``/proc``) after each batch's
sink call: the batch's CPU seconds by process kind, beside its wall time. On a 2-core
machine a batch cannot take less wall time than its CPU seconds / 2, so this says which
part of the stack a faster batch has to come from. For ours it also records our tasks'
own figures (``BatchReport``: elapsed, processing, flush and CPU per task).

Prints a table per implementation, writes ``benchmarks/results/bench_spark_cpu.json``.
Run: ``.venv/bin/python -m benchmarks.bench_spark_cpu [--impls ours-vectorized,spark-count-rocksdb]``
(about 1 minute per implementation on the default 2M events).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich.table import Table

from benchmarks.harness import REPO, console, repo_env, write_results
from benchmarks.streaming.cpu import cpu_by_kind
from benchmarks.streaming.data import make_stream_data
from benchmarks.streaming.impl import SOURCE_SCHEMA, RunContext
from benchmarks.streaming.registry import IMPLS
from benchmarks.streaming.session import spark_machine_info, spark_session
from benchmarks.streaming.sink import ChecksumSink


def _delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in now.items()}


def run_one(impl_name: str, source: str, work: str) -> dict:
    """In this (fresh) process: run ``impl_name`` over the files in ``source``."""
    impl = IMPLS[impl_name]
    job = {"impl": impl_name, "driver_memory": "3g", "scratch": work}
    root = os.getpid()
    t0 = time.perf_counter()
    spark = spark_session(job, impl.provider)
    session_s = time.perf_counter() - t0
    marks = [cpu_by_kind(root)]
    walls = [time.perf_counter()]

    class Sink(ChecksumSink):
        def __call__(self, df, batch_id):
            super().__call__(df, batch_id)
            marks.append(cpu_by_kind(root))
            walls.append(time.perf_counter())

    sink = Sink([])
    stream = spark.readStream.schema(SOURCE_SCHEMA).option("maxFilesPerTrigger", 1).parquet(source)
    ctx = RunContext(f"{work}/cp", f"{work}/wh", "state", 4, sink)
    started = time.perf_counter()
    query = impl.start(stream, ctx)
    query.awaitTermination()
    wall_s = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    tasks = []
    if impl.ours:
        from spark_integration.query import runner_of

        for r in runner_of(query).reports:
            tasks.append({"batch_id": r.batch_id, "duration_ms": r.duration_ms, "tasks_ms": r.tasks_ms,
                          "commit_ms": r.commit_ms,
                          "tasks": {t: {k: v for k, v in s.items() if k.endswith("_ms")} for t, s in r.tasks.items()}})
        compactor = runner_of(query).compactor
        if compactor is not None:
            compactor.close()  # waits for a compaction in flight: its CPU belongs to the run
    final = cpu_by_kind(root)
    spark.stop()
    batches = [{"batch": i, "wall_s": round(walls[i + 1] - walls[i], 3), "cpu_s": _delta(marks[i + 1], marks[i])}
               for i in range(len(marks) - 1)]
    return {"impl": impl_name, "label": impl.label, "session_s": session_s, "wall_s": wall_s,
            "session_cpu_s": marks[0], "batches": batches, "after_last_batch_cpu_s": _delta(final, marks[-1]),
            "total_cpu_s": final, "our_tasks": tasks}


def _report(result: dict, events: int) -> None:
    kinds = sorted({k for b in result["batches"] for k in b["cpu_s"]})
    table = Table(title=f"{result['label']}: {events / result['wall_s']:,.0f} events/s over {result['wall_s']:.1f} s "
                        f"(session {result['session_s']:.1f} s, not counted)")
    table.add_column("batch", justify="right")
    table.add_column("wall s", justify="right")
    for k in kinds:
        table.add_column(f"{k} CPU s", justify="right")
    table.add_column("CPU s / wall s", justify="right")
    for b in result["batches"]:
        cpu = sum(b["cpu_s"].values())
        table.add_row(str(b["batch"]), f"{b['wall_s']:.2f}", *[f"{b['cpu_s'].get(k, 0.0):.2f}" for k in kinds],
                      f"{cpu / b['wall_s']:.2f}" if b["wall_s"] else "")
    console.print(table)


def main(
    impls: str = typer.Option("ours-vectorized,spark-count-rocksdb,spark-count-hdfs",
                              help="comma-separated implementations of bench_spark.py"),
    events: int = typer.Option(2_000_000, help="events"),
    keys: int = typer.Option(200_000, help="keys"),
    batches: int = typer.Option(10, help="micro-batches (files)"),
    worker: str = typer.Option("", hidden=True, help="internal: impl,source,work,out"),
) -> None:
    if worker:
        impl, source, work, out = worker.split(",")
        Path(out).write_text(json.dumps(run_one(impl, source, work)))
        return
    names = [n.strip() for n in impls.split(",") if n.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        raise typer.BadParameter(f"unknown implementations {unknown}; known: {list(IMPLS)}")
    root = Path(tempfile.mkdtemp(prefix="bench_spark_cpu_"))
    results = {"started": datetime.now(UTC).isoformat(), "machine": spark_machine_info(),
               "sizes": {"events": events, "keys": keys, "batches": batches}, "runs": []}
    try:
        console.log(f"writing {events:,} events over {keys:,} keys in {batches} files")
        data = make_stream_data(root, "main", events, keys, batches, seed=1)
        for i, name in enumerate(names):  # a name may repeat (A/B/A/B runs)
            work = root / f"work-{i}-{name}"
            work.mkdir()
            out = root / f"{i}-{name}.json"
            console.log(f"running {name}")
            subprocess.run([sys.executable, "-m", "benchmarks.bench_spark_cpu", "--worker",
                            f"{name},{root / 'main'},{work},{out}"], check=True, cwd=REPO, env=repo_env())
            result = json.loads(out.read_text())
            result["events"] = data.events
            results["runs"].append(result)
            _report(result, data.events)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["finished"] = datetime.now(UTC).isoformat()
    path = write_results("bench_spark_cpu.json", results)
    console.log(f"results in {path}")


if __name__ == "__main__":
    typer.run(main)
