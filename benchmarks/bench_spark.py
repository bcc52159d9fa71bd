"""Streaming benchmark against the Spark peers: a keyed running count.

Workload: N events uniform over K string keys ("k000123", plus a long value), written once as
B Parquet files, one per micro-batch. Every implementation reads the same files through a
streaming file source with ``maxFilesPerTrigger=1`` and ``trigger(availableNow=True)``, so each
run has exactly B micro-batches, and emits the new count of every key its batch updated
(local[2], 4 shuffle partitions). Implementations, each in a fresh Python subprocess with its
own SparkSession so that sessions and configurations cannot leak:

- ``spark-count-rocksdb``: ``groupBy(key).count()``, update mode, RocksDBStateStoreProvider;
- ``spark-count-hdfs``: the same on Spark's default HDFS-backed state store;
- ``spark-tws-rows``: ``transformWithState`` with a row-based StatefulProcessor (one ValueState);
- ``spark-tws-pandas``: ``transformWithStateInPandas`` with the same logic on pandas frames;
- ``ours-compat``, ``ours-pandas`` and ``ours-vectorized``: ``spark_integration.start_stateful_query``
  with the row processor above run unchanged, with the pandas processor above run unchanged
  (``api="pandas"``), and with ``RunningAggregate("count")``; reported as not available while
  ``spark_integration.start_stateful_query`` cannot be imported;
- ``ours-vectorized-uncounted``: the vectorized one without the live-row count behind
  ``numRowsTotal`` (``StoreConfig(count_live_rows=False)``), to measure what counting costs.

The transformWithState peers make one JVM round trip per key and state call, so they run on a
smaller data set with the same events per key per batch (``--tws-main`` also runs the row-based
one on the main data set, about 8 minutes); ratios are only taken between runs on the same
data set. Every run's output is checked against the input: per batch the number of
emitted rows, the sum of the emitted counts and the sum of key-id x count, plus the final count
of a sample of keys.

Processing-time sessions (``benchmarks.streaming.sessions``), on the small data set:
the same row processor counts a key's events and moves the key's one processing-time timer to
the batch's time + ``--session-gap-ms`` (1 ms: every session closes in the first later batch
without its key, the last ones after the input, in a batch without input); the timer emits
(key, count). ``spark-tws-sessions`` runs it on Spark's ``transformWithState`` (RocksDB), which
in processing time runs a no-data batch at every trigger forever (even under availableNow) and
is stopped once every session closed; ``ours-sessions`` on ours (``time_mode="ProcessingTime"``),
whose availableNow query ends by itself. Measured: time from the query start to the last
session close, events/s over it, batches and those without input; both runs' closes are
checked against the closes computed from the input, as a multiset and batch by batch.

Restart and rescale, on a state of ``restart_keys`` keys (2M by default) built by the RocksDB
``groupBy().count()`` query: the first batch after a restart of the stopped query against its
steady batch and against the first batch of a fresh query on an empty state (what any new
process pays); then Spark's experimental offline ``spark._streamingCheckpointManager
.repartition(checkpoint, 8)`` and the first batch after it. Ours, when available: restart with
parallelism 4, then with parallelism 8 on the same state (ours has no offline step).

Clocks start when the query is started, after the SparkSession and, for ours, after importing
``spark_integration`` (about 1-2 s, reported as ``import_s``): a program imports a library
once, as it does pyspark, not at every query restart.

The machine may be shared: each job waits (``--quiet-wait``) until other processes leave the
cores idle, records the CPU its own process tree and everyone else used meanwhile, and a
throughput job disturbed by more than 0.3 other cores runs again (``--reruns``). Events per
CPU-second of the job's own process tree are reported beside events/s, as the figure least
moved by other work.

Prints tables, writes ``benchmarks/results/spark_bench.json`` and a plot beside it (about 12
minutes on a quiet 2-core machine). Run: ``.venv/bin/python -m benchmarks.bench_spark``;
``--quick`` for a smoke run of every code path (about 4 minutes, ``spark_bench_quick.*``);
``--one-driver`` runs every job in one driver process (the suite's tiny mode: a smoke run whose
figures are not comparable); ``--report-from FILE.json`` to print the tables and redraw the plot of an earlier run;
``--workloads sessions`` (or ``throughput``, ``restart``, comma-separated) runs some of the three
scenarios, ``--only`` some of the implementations (of the throughput and sessions scenarios),
e.g. ``--workloads throughput,sessions --only spark-tws-pandas,ours-pandas,spark-tws-sessions,ours-sessions``.

The parts live in ``benchmarks.streaming`` (implementations, data, worker, runner, the two
scenarios, report); this module is the command line.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import typer

from benchmarks.harness import console, write_results
from benchmarks.streaming.data import make_restart_data, make_stream_data
from benchmarks.streaming.ours import ours_unavailable_reason
from benchmarks.streaming.registry import IMPLS, SESSION_IMPLS
from benchmarks.streaming.remote import RemoteState
from benchmarks.streaming.report import finish
from benchmarks.streaming.restart import derive_restart, ours_restart_and_rescale, spark_restart_and_rescale
from benchmarks.streaming.runner import Runner
from benchmarks.streaming.scaling import derive_cache, derive_scaling, run_cache, run_scaling
from benchmarks.streaming.session import spark_machine_info
from benchmarks.streaming.sessions import derive_sessions, run_sessions
from benchmarks.streaming.throughput import derive, run_throughput
from benchmarks.streaming.worker import run_job

WORKLOADS = ("throughput", "sessions", "restart", "scaling", "cache")


def main(
    quick: bool = typer.Option(False, help="smoke run (~4 minutes): small data set only, tiny restart state"),
    events: int = typer.Option(2_000_000, help="events of the main data set"),
    keys: int = typer.Option(200_000, help="keys of the main data set"),
    batches: int = typer.Option(10, help="micro-batches (files) of both throughput data sets"),
    small_events: int = typer.Option(200_000, help="events of the small data set (every implementation)"),
    small_keys: int = typer.Option(20_000, help="keys of the small data set"),
    restart_keys: int = typer.Option(2_000_000, help="keys of the restart / rescale state"),
    rescale_to: int = typer.Option(8, help="parallelism after the rescale"),
    only: str = typer.Option("", help="comma-separated implementations to run (default: all)"),
    workloads: str = typer.Option("throughput,sessions,restart",
                                  help="comma-separated scenarios to run: throughput, sessions, restart, scaling, "
                                       "cache (the last two: the state-size scenarios, "
                                       "benchmarks.streaming.scaling)"),
    skip_restart: bool = typer.Option(False, help="skip the restart / rescale scenario"),
    session_gap_ms: int = typer.Option(1, help="session gap of the processing-time sessions scenario"),
    datasets_: str = typer.Option("main,small", "--datasets",
                                  help="throughput data sets to run on (comma-separated: main, small)"),
    tws_main: bool = typer.Option(False, help="also run transformWithState (rows) on the main data set (~8 min)"),
    ours_restart_impl: str = typer.Option("ours-vectorized", help="which of ours runs the restart scenario"),
    driver_memory: str = typer.Option("3g", help="spark.driver.memory of each Spark process"),
    timeout: float = typer.Option(900, help="seconds before a Spark process is killed"),
    reruns: int = typer.Option(1, help="reruns of a throughput job during which other processes used > 0.3 cores"),
    quiet_wait: float = typer.Option(300, help="seconds each job may wait for other work on the machine to stop"),
    workdir: Path | None = typer.Option(None, help="work directory (default: a fresh temporary one)"),
    keep: bool = typer.Option(False, help="keep the work directory (input, checkpoints, logs)"),
    report_from: Path | None = typer.Option(None, help="print the tables and redraw the plot of a results JSON"),
    results_name: str = typer.Option("", help="name of the results JSON and plot in benchmarks/results (default "
                                              "spark_bench, spark_bench_quick with --quick): a partial run (--only, "
                                              "--restart-keys...) should not overwrite the recorded full run"),
    sink: str = typer.Option("checksum", help="what each batch's output goes to: checksum (checked against the "
                                              "input) or noop (computed and dropped, as the floor is defined)"),
    s3_latency_ms: float = typer.Option(20, help="latency per request of the S3 proxy (the -s3 implementations)"),
    scaling_keys: str = typer.Option("1000000,5000000,20000000",
                                     help="state sizes (keys, comma-separated) of the scaling scenario"),
    state_batch_events: int = typer.Option(200_000, help="events per update batch of the scaling and cache scenarios"),
    state_batches: str = typer.Option("", help="insert,update batches of the scaling and cache scenarios' state "
                                               "(default 4,3 for scaling and 4,5 for the cache)"),
    small_restart_events: int = typer.Option(1_000, help="events of the small first batch after a restart (scaling)"),
    cache_keys: int = typer.Option(20_000_000, help="keys of the state of the cache scenario"),
    cache_fractions: str = typer.Option("1,0.3,0.1", help="cache bounds of the cache scenario, as fractions of the "
                                                          "state's views (comma-separated)"),
    one_driver: bool = typer.Option(False, help="run every job in one driver process, one after the other (each "
                                                "with its own session on one JVM): a smoke run of the code paths in "
                                                "a fraction of the time; figures are not comparable"),
    worker: Path | None = typer.Option(None, hidden=True, help="internal: run one job file"),
) -> None:
    if worker is not None:
        run_job(worker)
        return
    if report_from is not None:
        results = json.loads(report_from.read_text())
        derive(results["throughput"])
        derive_restart(results)
        derive_sessions(results.get("sessions"))
        if results.get("scaling"):
            derive_scaling(results["scaling"])
        if results.get("cache"):
            derive_cache(results["cache"])
        report_from.write_text(json.dumps(results, indent=2, default=str))
        finish(results, report_from.with_suffix(".png"))
        return
    state_shape: dict[str, int] = {}  # batches of the scaling and cache scenarios' state
    if state_batches:
        try:
            build, steady = (int(n) for n in state_batches.split(","))
        except ValueError:
            raise typer.BadParameter(f"--state-batches {state_batches!r}: give two counts, e.g. 4,3") from None
        if build < 1 or steady < 1:
            raise typer.BadParameter(f"--state-batches {state_batches!r}: both counts must be at least 1")
        state_shape = {"build": build, "steady": steady}
    if quick:  # the small data set only, no reruns, short waits: a smoke run of every code path
        events, keys, batches, small_events, small_keys, restart_keys = 100_000, 10_000, 5, 20_000, 2_000, 100_000
        reruns, quiet_wait = 0, min(quiet_wait, 20)
        scaling_keys, cache_keys, state_batch_events, small_restart_events = "20000,100000", 100_000, 20_000, 200
    scenarios = {w.strip() for w in workloads.split(",") if w.strip()} - ({"restart"} if skip_restart else set())
    if scenarios - set(WORKLOADS):
        raise typer.BadParameter(f"unknown workloads {sorted(scenarios - set(WORKLOADS))}; known: {WORKLOADS}")
    chosen = [n.strip() for n in only.split(",") if n.strip()]
    unknown = set(chosen) - set(IMPLS) - set(SESSION_IMPLS)
    if unknown:
        raise typer.BadParameter(f"unknown implementations {sorted(unknown)}; known: {[*IMPLS, *SESSION_IMPLS]}")
    impls = ([n for n in chosen if n in IMPLS] if chosen else list(IMPLS)) if "throughput" in scenarios else []
    session_impls = ([n for n in chosen if n in SESSION_IMPLS] if chosen else list(SESSION_IMPLS)) \
        if "sessions" in scenarios else []
    root = Path(tempfile.mkdtemp(prefix="bench_spark_")) if workdir is None else workdir
    root.mkdir(parents=True, exist_ok=True)
    remote = RemoteState.start(root, s3_latency_ms) if any(IMPLS[n].remote for n in impls) else None
    ours_reason = ours_unavailable_reason()
    if ours_reason:
        console.log(f"ours: not available ({ours_reason}); the Spark peers run alone")
    started = datetime.now(UTC).isoformat()
    t_start = time.perf_counter()
    runner: Runner | None = None
    try:
        console.log(f"writing input under {root}")
        on = {d.strip() for d in datasets_.split(",")} - ({"main"} if quick else set())
        need_main = "main" in on and any(not IMPLS[n].per_key_jvm_calls or (tws_main and n == "spark-tws-rows")
                                         for n in impls)
        datasets = {"main": make_stream_data(root, "main", events, keys, batches, seed=1)} if need_main else {}
        if impls or session_impls:
            datasets["small"] = make_stream_data(root, "small", small_events, small_keys, batches, seed=2)
        runner = Runner(root, driver_memory, timeout, quiet_wait, one_driver=one_driver)
        results: dict = {
            "machine": spark_machine_info(), "started": started, "quick": quick,
            "sizes": {"main": None if quick else {"events": events, "keys": keys, "batches": batches},
                      "small": {"events": small_events, "keys": small_keys, "batches": batches,
                                "runs": "every implementation; the transformWithState peers run on this one only"},
                      "restart": {"keys": restart_keys}},
            "sink": sink, "ours_available": ours_reason is None, "ours_unavailable_reason": ours_reason,
            "workloads": sorted(scenarios),
            "throughput": run_throughput(runner, impls, {k: d for k, d in datasets.items() if k in on}, ours_reason,
                                         reruns, tws_main, sink),
        }
        if session_impls:
            results["sessions"] = run_sessions(runner, session_impls, datasets["small"], ours_reason, reruns,
                                               session_gap_ms)
        if "restart" in scenarios:
            batch_events = events // batches
            rd = make_restart_data(root, restart_keys, build=4 if not quick else 2, steady=3 if not quick else 2,
                                   after=2, batch_events=batch_events, seed=3)
            results["sizes"]["restart"] |= {"insert_batches": rd.build, "update_batches": rd.steady,
                                            "events_per_update_batch": batch_events}
            results["restart"] = {"spark": spark_restart_and_rescale(runner, rd, rescale_to)
                                  if not chosen or "spark-count-rocksdb" in chosen else None,
                                  "ours": ours_restart_and_rescale(runner, rd, rescale_to, ours_restart_impl,
                                                                   ours_reason)}
        if "scaling" in scenarios:
            sizes = [int(k) for k in scaling_keys.split(",") if k.strip()]
            results["scaling"] = run_scaling(runner, sizes, state_batch_events, small_restart_events, rescale_to,
                                             ours_restart_impl, ours_reason, **state_shape)
        if "cache" in scenarios:
            fractions = [float(f) for f in cache_fractions.split(",") if f.strip() and float(f) != 1]
            results["cache"] = run_cache(runner, cache_keys, state_batch_events, fractions, ours_restart_impl,
                                         ours_reason, **state_shape)
        results["finished"] = datetime.now(UTC).isoformat()
        results["total_s"] = time.perf_counter() - t_start
        if remote is not None:
            results["remote"] = {"latency_ms": s3_latency_ms, "requests": remote.proxy.snapshot().by_method}
    finally:
        if runner is not None:
            runner.close()
        if remote is not None:
            remote.close()
        if not keep and workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    derive_restart(results)
    name = results_name or ("spark_bench_quick" if quick else "spark_bench")
    path = write_results(f"{name}.json", results, default=str)
    finish(results, path.with_suffix(".png"))
    console.log(f"total {results['total_s']:.0f} s; results in {path} and .png")


if __name__ == "__main__":
    typer.run(main)
