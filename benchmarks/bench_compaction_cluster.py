"""Compaction on a cluster: as a Spark job on the executors against the local process.

One run starts moto's S3 server (``tests.s3_server``) behind our proxy (``tests.net_proxy``,
``latency_ms`` per request once the state is built) and a Spark standalone cluster of
``workers`` workers of ``slots`` task slots each on loopback (``tests.spark_cluster``; by
default 2 x 2 slots on this 2-core machine, so that a compaction task does not take a stream's
only slot); the catalog is SQLite on local disk, the state on S3. ``tasks`` task stores write a
state of ``keys`` running counts (``benchmarks.harness.build_count_state``) over ``checkpoints``
checkpoints, so each unit holds that many segments, and three forks of it share its files. Measured, in the same run:

1. *A compaction of the whole state*: as one Spark job of a session on the cluster (``compact(table,
   spark=session)``, on a fork) and in this process as the local compactor does (on main): wall
   time, the bytes the proxy served (every segment, whoever read it), and the bytes it served to
   the driver's processes (this Python process and the driver JVM: the proxy finds the process
   that holds each connection in ``/proc``): the local process reads every segment, the Spark
   job none;
2. *A stream beside its compactions*: the same ``RunningAggregate("count")`` query on the cluster
   (``start_stateful_query``, ``batches`` batches of ``batch_events`` random keys of the state, one
   input file each), once without compaction and once with its compactions as Spark jobs of its
   own session (``CompactionPolicy(runs_on="spark", min_segments=checkpoints, size_ratio=1e9)``:
   every unit merged whole once it holds that many segments, so the first checkpoint starts a
   compaction of the whole state, a task per unit, while the stream goes on, in the FAIR pool
   ``icestate-compaction``, its merges at ``SCHED_IDLE`` priority). Batch times after the
   first (which loads the state) of each run, p50 and p99 (with this few batches, p99 is the
   slowest), and those of the batches that overlapped a compaction. Target: p99 with compaction at most 1.5x without.

Prints tables, writes ``bench_compaction_cluster.json`` and a plot to the results folder
(``ICESTATE_BENCH_RESULTS_DIR``). Run: ``.venv/bin/python -m benchmarks.bench_compaction_cluster``
(``--quick`` for a small run). Linux only (``/proc``, Spark's bash launchers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pyarrow.parquet as pq
import typer
from rich.table import Table

from benchmarks.harness import (
    MAX_PARALLELISM,
    build_count_state,
    console,
    count_layout,
    fmt,
    machine_info,
    pyplot,
    ratio,
    results_path,
    save_figure,
    user_keys,
    write_results,
)
from catalog import TableRef
from catalog.compaction import CompactionPolicy, compact
from statestore.keygroups import KeyGroupRange
from tests import s3_server
from tests.net_proxy import NetProxy
from tests.spark_cluster import standalone_cluster

BUCKET = "bench-compaction"
CATALOG = "bench"


def _client_label(driver_pids: list[int]):
    """The proxy's ``client_label``: ``driver`` for a connection one of ``driver_pids`` holds
    (found by the client socket's inode, from ``/proc/net/tcp`` and the processes' descriptors),
    ``executors`` for any other."""
    def label(peer: tuple[str, int]) -> str:
        inode = None
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == peer[1]:
                inode = fields[9]
                break
        for pid in driver_pids:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                            return "driver"
        return "executors"
    return label


def _session(master: str, workers: int, slots: int, tasks: int, scratch: Path):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName("bench-compaction-cluster")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.memory", "2g").config("spark.executor.memory", "3g")
             .config("spark.executor.cores", str(slots)).config("spark.cores.max", str(workers * slots))
             .config("spark.scheduler.mode", "FAIR").config("spark.sql.shuffle.partitions", str(tasks))
             .config("spark.sql.adaptive.coalescePartitions.enabled", "false").config("spark.locality.wait", "0")
             .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
             .config("spark.local.dir", str(scratch / "driver-local")).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    deadline = time.monotonic() + 120
    while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < workers + 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {workers} executors registered after 120 s")
        time.sleep(0.2)
    return spark


def _compaction(label: str, run: Any, proxy: NetProxy) -> dict:
    proxy.reset()
    started = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - started
    traffic = proxy.snapshot()
    assert result is not None, f"{label}: nothing compacted"
    return {"seconds": seconds, "driver_read_bytes": traffic.bytes_to_client_by.get("driver", 0),
            "executors_read_bytes": traffic.bytes_to_client_by.get("executors", 0),
            "served_bytes": traffic.bytes_to_client, "requests": traffic.count, "files_in": result.files_in,
            "files_out": result.files_out, "bytes_in": result.bytes_in, "entries_in": result.entries_in,
            "processes": len(result.processes), "in_driver": os.getpid() in result.processes}


def _stream(spark: Any, props: dict, branch: str, scratch: Path, keys: int, batches: int, batch_events: int,
            tasks: int, compaction: CompactionPolicy | None) -> dict:
    from spark_integration import RunningAggregate, StateLocation, runner_of, start_stateful_query

    input_dir = scratch / f"input-{branch}"
    input_dir.mkdir()
    rng = np.random.default_rng(7)
    for b in range(batches):
        path = input_dir / f"part-{b:04d}.parquet"
        pq.write_table(user_keys(rng.integers(0, keys, batch_events)), path)
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))
    df = spark.readStream.schema("user string").option("maxFilesPerTrigger", 1).parquet(str(input_dir))
    location = StateLocation(table="state", catalog_name=CATALOG, catalog_properties=props, branch=branch,
                             parallelism=tasks, max_parallelism=MAX_PARALLELISM)
    query = start_stateful_query(df, ["user"], RunningAggregate("count"), location=location,
                                 checkpoint_location=str(scratch / f"cp-{branch}"), trigger={"availableNow": True},
                                 compaction=compaction, query_name=f"bench_{branch}")
    compactor = runner_of(query).compactor
    query.awaitTermination()
    if compactor is not None:
        compactor.close()  # a compaction under way finishes (and records its span) first
    reports = []
    for p in query.recentProgress:  # Spark's own record of each batch: when it started, how long it took
        started = datetime.fromisoformat(p.timestamp.replace("Z", "+00:00")).timestamp() * 1000
        took = p.durationMs.get("triggerExecution", 0)
        reports.append({"batch_id": p.batchId, "duration_ms": took, "ended_ms": started + took})
    windows = [(c["started_ms"], c["finished_ms"]) for c in getattr(compactor, "results", [])]
    steady = reports[1:]  # the first batch loads the state
    during = [r for r in steady if any(r["ended_ms"] - r["duration_ms"] < end and r["ended_ms"] > start
                                       for start, end in windows)]
    return {"batches": reports, "compactions": getattr(compactor, "results", []),
            "p50_ms": statistics.median(r["duration_ms"] for r in steady),
            "p99_ms": float(np.percentile([r["duration_ms"] for r in steady], 99)),
            "during_p99_ms": float(np.percentile([r["duration_ms"] for r in during], 99)) if during else None,
            "during_batches": len(during)}


def main(
    quick: Annotated[bool, typer.Option(help="A small run (200k keys).")] = False,
    keys: Annotated[int, typer.Option(help="Keys of the state.")] = 20_000_000,
    checkpoints: Annotated[int, typer.Option(help="Checkpoints that build it (segments per unit).")] = 8,
    tasks: Annotated[int, typer.Option(help="Tasks of the state (its parallelism).")] = 4,
    workers: Annotated[int, typer.Option(help="Spark workers (an executor each).")] = 2,
    slots: Annotated[int, typer.Option(help="Task slots of each executor.")] = 2,
    latency_ms: Annotated[float, typer.Option(help="Added to each S3 request once the state is built.")] = 20.0,
    batches: Annotated[int, typer.Option(help="Micro-batches of each stream.")] = 12,
    batch_events: Annotated[int, typer.Option(help="Events per micro-batch.")] = 100_000,
) -> None:
    if quick:
        keys, batches, batch_events = 200_000, 6, 5_000
    scratch = Path(tempfile.mkdtemp(prefix="bench-compaction-cluster-"))
    server = s3_server.start(scratch)
    try:
        s3_server.create_bucket(server.endpoint, BUCKET)
        driver = [os.getpid()]  # and the driver JVM, once started
        with NetProxy(server.endpoint, client_label=_client_label(driver)) as proxy, \
                standalone_cluster(scratch / "cluster", workers, "4g", slots) as cluster:
            props = {"type": "sql", "uri": f"sqlite:///{scratch}/catalog.db", "init_catalog_tables": "true",
                     "warehouse": f"s3://{BUCKET}/run", **s3_server.properties(proxy.endpoint)}
            ref = TableRef("state", catalog_name=CATALOG, catalog_properties=props)
            with ref.open(count_layout(), retain_checkpoints=checkpoints + 20) as table:
                build_count_state(table, keys, checkpoints, tasks, f"a state of {keys:,} keys on S3")
                for fork in ("spark", "plain", "compacting"):
                    table.fork(fork)
                state_bytes = sum(s.size_bytes for s in table.segments(KeyGroupRange.of(0, MAX_PARALLELISM - 1)))
            proxy.latency_s = latency_ms / 1000
            spark = _session(cluster.master_url, workers, slots, tasks, scratch)
            driver.append(int(spark.sparkContext._jvm.ProcessHandle.current().pid()))

            console.print("compaction as a Spark job ...")
            with TableRef("state", catalog_name=CATALOG, catalog_properties=props, branch="spark").open() as t:
                as_job = _compaction("spark", lambda: compact(t, spark=spark), proxy)
            console.print("compaction in this process ...")
            with ref.open() as t:
                local = _compaction("local", lambda: compact(t), proxy)

            console.print("a stream without compaction ...")
            plain = _stream(spark, props, "plain", scratch, keys, batches, batch_events, tasks, None)
            console.print("the stream with its compactions as Spark jobs ...")
            compacting = _stream(spark, props, "compacting", scratch, keys, batches, batch_events, tasks,
                                 CompactionPolicy(runs_on="spark", min_segments=checkpoints, size_ratio=1e9))
            spark.stop()
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    results = {
        "benchmark": "bench_compaction_cluster", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(), "quick": quick,
        "config": {"keys": keys, "checkpoints": checkpoints, "tasks": tasks, "workers": workers,
                   "latency_ms": latency_ms, "batches": batches, "batch_events": batch_events},
        "state_bytes": state_bytes,
        "compaction": {"spark_job": as_job, "local_process": local,
                       "spark_vs_local_time": ratio(as_job["seconds"], local["seconds"])},
        "stream": {"without": plain, "with_compaction": compacting,
                   "p99_ratio": ratio(compacting["p99_ms"], plain["p99_ms"]),
                   "during_p99_ratio": ratio(compacting["during_p99_ms"], plain["p99_ms"])},
    }
    _report(results)
    name = "bench_compaction_cluster" + ("_quick" if quick else "")
    write_results(f"{name}.json", results, default=str)
    _plot(results, results_path(f"{name}.png"))


def _report(results: dict) -> None:
    c, s = results["compaction"], results["stream"]
    table = Table(title=f"Compaction of {results['config']['keys']:,} keys on S3 ({results['state_bytes']:,} bytes of "
                        f"segments), {results['config']['latency_ms']:g} ms per request")
    for col in ("", "seconds", "bytes served by S3", "bytes read by the driver", "merged in"):
        table.add_column(col, justify="right")
    for label, r in (("Spark job", c["spark_job"]), ("local process", c["local_process"])):
        where = "the driver" if r["in_driver"] else f"{r['processes']} executor process(es)"
        table.add_row(label, fmt(r["seconds"], ".1f"), fmt(r["served_bytes"]), fmt(r["driver_read_bytes"]), where)
    console.print(table)
    table = Table(title="The stream's batch times (after its first)")
    for col in ("", "p50 ms", "p99 ms", "p99 ms during a compaction", "batches during"):
        table.add_column(col, justify="right")
    for label, r in (("without compaction", s["without"]), ("with compactions as Spark jobs", s["with_compaction"])):
        table.add_row(label, fmt(r["p50_ms"]), fmt(r["p99_ms"]), fmt(r["during_p99_ms"]), str(r["during_batches"]))
    console.print(table)
    console.print(f"p99 with / without: {fmt(s['p99_ratio'], '.2f')}x (target <= 1.5x); during a compaction: "
                  f"{fmt(s['during_p99_ratio'], '.2f')}x; Spark job / local process time: "
                  f"{fmt(c['spark_vs_local_time'], '.2f')}x")


def _plot(results: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    c = results["compaction"]
    labels = ["Spark job", "local process"]
    read = [c["spark_job"]["driver_read_bytes"] / 1e6, c["local_process"]["driver_read_bytes"] / 1e6]
    left.bar(labels, read, color=["tab:green", "tab:gray"])
    left.axhline(results["state_bytes"] / 1e6, color="tab:red", linestyle="--", label="the state's segments")
    left.set_ylabel("MB read by the driver's processes")
    left.set_title("Compaction: where the segments are read")
    left.legend()
    for label, r, color in (("without compaction", results["stream"]["without"], "tab:gray"),
                            ("with compactions (Spark jobs)", results["stream"]["with_compaction"], "tab:green")):
        batches = r["batches"][1:]
        right.plot([b["batch_id"] for b in batches], [b["duration_ms"] for b in batches], marker="o", label=label,
                   color=color)
    compacting = results["stream"]["with_compaction"]
    for start, end in ((c["started_ms"], c["finished_ms"]) for c in compacting["compactions"]):
        right.axvspan(*_batch_span(compacting["batches"], start, end), color="tab:green", alpha=0.1)
    right.set_xlabel("batch")
    right.set_ylabel("batch time (ms)")
    right.set_title("The stream beside its compactions")
    right.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _batch_span(batches: list[dict], start_ms: float, end_ms: float) -> tuple[float, float]:
    """The batch ids (fractional) a compaction's time span covers, for shading the plot."""
    ids = [b["batch_id"] for b in batches if b["ended_ms"] > start_ms and b["ended_ms"] - b["duration_ms"] < end_ms]
    return (min(ids) - 0.5, max(ids) + 0.5) if ids else (0.0, 0.0)


if __name__ == "__main__":
    typer.run(main)
