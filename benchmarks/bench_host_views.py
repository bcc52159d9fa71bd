"""One copy of the state per host: a stream whose tasks move between Python workers.

Spark hands a task to whichever idle Python worker comes first. Without the host's shared
views (``statestore.host_views``) each worker that picks a task up for the first time loads the
task's whole state again, and keeps its own copy of it; with them, a worker maps the views
another worker of the host wrote and reads only what was committed since.

One run: a state of ``keys`` running counts (``benchmarks.harness.build_count_state``, SQLite
catalog and table on local disk, parallelism ``tasks``), forked once per stream below so every
stream starts from the same state; the same input (``batches`` files of ``batch_events``
uniform random keys) read by the same ``RunningAggregate("count")`` query
(``start_stateful_query``, ``maxFilesPerTrigger=1``, availableNow; views of whole key groups from
the first batch on, as a long-running stream's are) in a local Spark session of
``local[W]`` (W task slots, so up to W Python workers) for each W of ``--workers``, with the
shared views off and on (``StoreConfig(host_views=...)``, each run with a directory of its own).
Measured per stream:

- each batch's duration (Spark's ``triggerExecution``) and its tasks' segment reads, views mapped
  from the host and processes (pids): the first batch loads the state; after it, the steady
  batches' median, their slowest and slowest / median (target with the shared views at most 1.3:
  no batch pays a worker's load), events/s over the steady batches;
- memory: the proportional set size (``Pss`` in ``/proc/<pid>/smaps_rollup``: shared pages
  split between the processes that map them) of all of the session's Python workers together,
  sampled every 0.25 s: its peak over the steady batches, and its settled level (the median over
  the second half of the steady batches) less the workers' own footprint, against one copy of
  the cached state (the tasks' views, ``cache_size_bytes`` summed over the tasks); target at most
  1.3x with the shared views. The workers' own footprint is what they hold after the same query
  ran one batch of the same input over an empty state in the same session (the runner's modules,
  pandas, which pyarrow imports at its first array, a batch's work); the footprint of workers
  that only imported the task runner is reported beside it;
- per worker after the stream: anonymous (its own heap) and file-backed memory (the mapped views,
  libraries), its kept stores' views and of them its own bytes (runs merged since the host's
  views were written), and its anonymous memory once its stores are closed.

Prints tables, writes ``bench_host_views.json`` and a plot to the results folder
(``ICESTATE_BENCH_RESULTS_DIR``). Run: ``.venv/bin/python -m benchmarks.bench_host_views``
(``--quick`` for a small run). Linux only (``/proc``).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
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

CATALOG = "bench"
SAMPLE_S = 0.25


def _python_workers(root_pid: int) -> list[int]:
    """The pids of the Python processes under ``root_pid`` (the driver JVM): PySpark's daemon and
    the workers it forks."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"pyspark" in f.read():
                        out.append(child)
            except OSError:
                continue
    return out


def _rollup(pid: str = "self") -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def _memory(pids: list[int]) -> tuple[int, int, int]:
    """(Pss, Rss, Pss of file-backed pages: the mapped views among them) of ``pids`` together, in bytes."""
    pss = rss = pss_file = 0
    for pid in pids:
        try:
            rollup = _rollup(str(pid))
        except OSError:
            continue
        pss += rollup.get("Pss", 0)
        rss += rollup.get("Rss", 0)
        pss_file += rollup.get("Pss_File", 0)
    return pss, rss, pss_file


class Sampler:
    """Samples the workers' memory every ``SAMPLE_S`` seconds on a thread of its own."""

    def __init__(self, jvm_pid: int) -> None:
        self.jvm_pid = jvm_pid
        self.samples: list[tuple[float, int, int, int, int]] = []  # (epoch ms, pss, rss, processes, pss of files)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = _python_workers(self.jvm_pid)
            pss, rss, pss_file = _memory(pids)
            self.samples.append((time.time() * 1000, pss, rss, len(pids), pss_file))
            self._stop.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start_ms: float, end_ms: float = float("inf")) -> tuple[int, int]:
        inside = [s for s in self.samples if start_ms <= s[0] <= end_ms] or self.samples[-1:]
        return max(s[1] for s in inside), max(s[2] for s in inside)


def _session(workers: int, tasks: int, scratch: Path):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{workers}]").appName("bench-host-views")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "6g").config("spark.sql.shuffle.partitions", str(tasks))
             .config("spark.sql.adaptive.coalescePartitions.enabled", "false").config("spark.locality.wait", "0")
             .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
             .config("spark.local.dir", str(scratch / "spark-local")).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _baseline(spark: Any, workers: int) -> int:
    """The Pss of the session's Python workers once each imported the task runner, no state held."""
    def touch(batches):
        import spark_integration.tasks  # noqa: F401

        time.sleep(1.0)  # every slot busy at once: one worker each
        yield from batches

    spark.range(workers, numPartitions=workers).mapInArrow(touch, "id long").collect()
    jvm = int(spark.sparkContext._jvm.ProcessHandle.current().pid())
    return _memory(_python_workers(jvm))[0]  # Pss


def _mapped_views(views_dir: str, pid: str = "self") -> dict[str, int]:
    """Pss of the shared views' files that ``pid`` maps: those whose file (inode) is still in the
    host's views and those that a newer write replaced (their pages this process's alone)."""
    current = set()
    for root, _, files in os.walk(views_dir):
        for name in files:
            try:
                current.add(os.stat(os.path.join(root, name)).st_ino)
            except OSError:
                continue
    out = {"current_pss": 0, "replaced_pss": 0, "current_maps": 0, "replaced_maps": 0}
    kind = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's first line
                path = head[5].strip() if len(head) == 6 else ""
                kind = None if not path.startswith(views_dir) else (
                    "current" if int(head[4]) in current else "replaced")
                if kind:
                    out[f"{kind}_maps"] += 1
            elif kind and line.startswith("Pss:"):
                out[f"{kind}_pss"] += int(line.split()[1]) * 1024
    return out


def _breakdown(spark: Any, workers: int, views_dir: str) -> list[dict]:
    """Per Python worker after the stream: its anonymous memory (its own heap) and file-backed
    memory (the mapped views, libraries), what its kept stores hold (views' bytes, of them this
    process's own), Arrow's pool; then the same with its stores closed and its allocators
    trimmed (what stays in a worker without state)."""
    def look(batches):
        import pyarrow as pa

        from spark_integration import tasks
        from statestore import memory

        time.sleep(1.0)  # every slot busy at once: one worker each
        stores = []
        for (_, task), ts in tasks._STORES.items():
            cache = ts.store.reader._cache
            views = [v for kg in cache.key_groups() for v in cache.peek(kg).views.values()]
            stores.append({"task": task, "view_bytes": cache.size_bytes,
                           "private_bytes": sum(v.private_bytes() for v in views)})
        held = _rollup()
        views = _mapped_views(views_dir)
        for key in list(tasks._STORES):
            tasks._drop(key)
        gc.collect()
        memory.return_freed_memory()
        time.sleep(1.5)  # polars' allocator hands pages back after a second
        bare = _rollup()
        row = {"pid": os.getpid(), "stores": stores, "arrow_pool": pa.default_memory_pool().backend_name,
               "pss_anon": held.get("Pss_Anon"), "pss_file": held.get("Pss_File"), "mapped_views": views,
               "pss_anon_without_stores": bare.get("Pss_Anon")}
        yield pa.RecordBatch.from_pylist([{"json": json.dumps(row)}])

    rows = spark.range(workers, numPartitions=workers).mapInArrow(look, "json string").collect()
    return [json.loads(r.json) for r in rows]


def _query(spark: Any, props: dict, table: str, branch: str, scratch: Path, input_dir: Path, tasks: int,
           host_views: bool) -> Any:
    """The stream (``RunningAggregate("count")`` over ``input_dir``, availableNow) on ``table``'s
    ``branch``, to its end."""
    from spark_integration import RunningAggregate, StateLocation, start_stateful_query
    from statestore import StoreConfig

    df = spark.readStream.schema("user string").option("maxFilesPerTrigger", 1).parquet(str(input_dir))
    location = StateLocation(table=table, catalog_name=CATALOG, catalog_properties=props, branch=branch,
                             parallelism=tasks, max_parallelism=MAX_PARALLELISM)
    # Views of whole key groups from the first batch on, as a long-running stream's are once its
    # key groups were read often enough (``StoreConfig.view_partial_reads_max``)
    config = StoreConfig(host_views=host_views, host_views_dir=str(scratch / f"views-{table}-{branch}"),
                         view_partial_reads_max=0)
    query = start_stateful_query(df, ["user"], RunningAggregate("count"), location=location,
                                 checkpoint_location=str(scratch / f"cp-{table}-{branch}"),
                                 trigger={"availableNow": True}, compaction=None, store_config=config,
                                 query_name=f"bench_{table}_{branch}")
    query.awaitTermination()
    return query


def _stream(spark: Any, props: dict, branch: str, scratch: Path, input_dir: Path, tasks: int, workers: int,
            host_views: bool, batch_events: int) -> dict:
    from spark_integration import runner_of

    jvm_pid = int(spark.sparkContext._jvm.ProcessHandle.current().pid())
    imports_pss = _baseline(spark, workers)
    # The workers' own footprint: the same query over an empty state, one batch of the same input
    _query(spark, props, f"empty_{branch}", "main", scratch, scratch / "input-first", tasks, host_views)
    time.sleep(1.5)  # polars' allocator hands pages back after a second
    baseline = _memory(_python_workers(jvm_pid))[0]
    sampler = Sampler(jvm_pid)
    try:
        query = _query(spark, props, "state", branch, scratch, input_dir, tasks, host_views)
    finally:
        sampler.stop()
    breakdown = _breakdown(spark, workers, str(scratch / f"views-state-{branch}"))
    reports = {r.batch_id: r for r in runner_of(query).reports if not r.skipped}
    batches = []
    for p in query.recentProgress:
        started = datetime.fromisoformat(p.timestamp.replace("Z", "+00:00")).timestamp() * 1000
        took = p.durationMs.get("triggerExecution", 0)
        tasks_of = reports[p.batchId].tasks if p.batchId in reports else {}
        batches.append({
            "batch_id": p.batchId, "duration_ms": took, "started_ms": started, "rows": p.numInputRows,
            "bytes_read": sum(t.get("bytes_read", 0) for t in tasks_of.values()),
            "views_mapped": sum(t.get("views_mapped", 0) for t in tasks_of.values()),
            "views_published": sum(t.get("views_published", 0) for t in tasks_of.values()),
            "cache_size_bytes": sum(t.get("cache_size_bytes", 0) for t in tasks_of.values()),
            # per task: opening its store (mapping, catching up), processing, flushing
            "task_ms": {task: [t.get("open_ms"), t.get("process_ms"), t.get("flush_ms"), t.get("views_mapped")]
                        for task, t in sorted(tasks_of.items())},
            "pids": sorted({t.get("pid") for t in tasks_of.values()}),
        })
    steady = batches[1:]
    durations = [b["duration_ms"] for b in steady]
    median = statistics.median(durations)
    pss, rss = sampler.peak(steady[0]["started_ms"])
    # settled: the median over the second half of the steady batches (the peak is the first
    # batches' loads: segments decoded and resolved, transient)
    half = steady[len(steady) // 2]["started_ms"]
    late = [s for s in sampler.samples if s[0] >= half] or sampler.samples[-1:]
    settled = int(statistics.median(s[1] for s in late))
    settled_file = int(statistics.median(s[4] for s in late))  # of it, file-backed (the mapped views, libraries)
    state_bytes = batches[-1]["cache_size_bytes"]
    return {
        "workers": workers, "host_views": host_views, "batches": batches, "baseline_pss": baseline,
        "imports_pss": imports_pss, "settled_less_imports_over_state": ratio(settled - imports_pss, state_bytes),
        "workers_after": breakdown,
        "first_ms": batches[0]["duration_ms"], "steady_median_ms": median, "steady_max_ms": max(durations),
        "max_over_median": max(durations) / median,
        "steady_events_per_s": batch_events * len(steady) / (sum(durations) / 1000),
        "processes": len({pid for b in batches for pid in b["pids"]}),
        "peak_pss": pss, "peak_rss": rss, "settled_pss": settled, "settled_pss_file": settled_file,
        "state_view_bytes": state_bytes,
        "pss_over_state": ratio(pss, state_bytes), "pss_less_baseline_over_state": ratio(pss - baseline, state_bytes),
        "settled_less_baseline_over_state": ratio(settled - baseline, state_bytes),
        "memory_samples": sampler.samples,
    }


def main(
    quick: Annotated[bool, typer.Option(help="A small run (400k keys).")] = False,
    keys: Annotated[int, typer.Option(help="Keys of the state.")] = 20_000_000,
    checkpoints: Annotated[int, typer.Option(help="Checkpoints that build it.")] = 4,
    tasks: Annotated[int, typer.Option(help="Tasks of the state (its parallelism).")] = 4,
    workers: Annotated[str, typer.Option(help="Task slots (Python workers) of each run, comma-separated.")] = "2,4",
    batches: Annotated[int, typer.Option(help="Micro-batches of each stream.")] = 10,
    batch_events: Annotated[int, typer.Option(help="Events per micro-batch.")] = 200_000,
    private: Annotated[bool, typer.Option(help="Also run each with the shared views off (the comparison).")] = True,
) -> None:
    if quick:
        keys, batches, batch_events = 400_000, 6, 20_000
    slots = [int(w) for w in workers.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="bench-host-views-"))
    runs: list[dict] = []
    try:
        props = {"type": "sql", "uri": f"sqlite:///{scratch}/catalog.db", "init_catalog_tables": "true",
                 "warehouse": str(scratch / "warehouse")}
        names = [f"w{w}_{'shared' if on else 'private'}" for w in slots for on in (False, True)]
        with TableRef("state", catalog_name=CATALOG, catalog_properties=props).open(
                count_layout(), retain_checkpoints=checkpoints + 2 * batches + 10) as table:
            build_count_state(table, keys, checkpoints, tasks, f"a state of {keys:,} keys")
            for name in names:
                table.fork(name)
        input_dir = scratch / "input"
        input_dir.mkdir()
        rng = np.random.default_rng(11)
        for b in range(batches):
            path = input_dir / f"part-{b:04d}.parquet"
            pq.write_table(user_keys(rng.integers(0, keys, batch_events)), path)
            os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))
        (scratch / "input-first").mkdir()
        os.link(input_dir / "part-0000.parquet", scratch / "input-first" / "part-0000.parquet")
        for i, w in enumerate(slots):
            modes = (False, True) if i % 2 == 0 else (True, False)  # alternating: neither always first
            for on in modes if private else (True,):
                name = f"w{w}_{'shared' if on else 'private'}"
                console.print(f"local[{w}], shared views {'on' if on else 'off'} ...")
                spark = _session(w, tasks, scratch)
                try:
                    runs.append(_stream(spark, props, name, scratch, input_dir, tasks, w, on, batch_events))
                finally:
                    spark.stop()
                for views in scratch.glob(f"views-*-{name}"):
                    shutil.rmtree(views, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    by = {(r["workers"], r["host_views"]): r for r in runs}
    results = {
        "benchmark": "bench_host_views", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(), "quick": quick,
        "config": {"keys": keys, "checkpoints": checkpoints, "tasks": tasks, "workers": slots, "batches": batches,
                   "batch_events": batch_events},
        "runs": runs,
        "ratios": {f"w{w}": {
            "events_per_s_shared_over_private": ratio(by[(w, True)]["steady_events_per_s"],
                                                      by[(w, False)]["steady_events_per_s"]),
            "peak_pss_shared_over_private": ratio(by[(w, True)]["peak_pss"], by[(w, False)]["peak_pss"]),
            "settled_pss_shared_over_private": ratio(by[(w, True)]["settled_pss"], by[(w, False)]["settled_pss"]),
        } for w in slots if (w, False) in by},
    }
    _report(results)
    name = "bench_host_views" + ("_quick" if quick else "")
    write_results(f"{name}.json", results, default=str)
    _plot(results, results_path(f"{name}.png"))


def _report(results: dict) -> None:
    table = Table(title=f"A stream whose tasks move between Python workers ({results['config']['keys']:,} keys, "
                        f"{results['config']['batch_events']:,} events a batch)")
    for col in ("run", "processes", "first batch s", "steady median s", "slowest / median", "events/s",
                "workers' Pss MB: peak", "settled", "of it files", "less their own", "one copy MB",
                "settled less own / copy", "less imports only / copy"):
        table.add_column(col, justify="right")
    for r in results["runs"]:
        table.add_row(f"local[{r['workers']}], shared {'on' if r['host_views'] else 'off'}", str(r["processes"]),
                      fmt(r["first_ms"] / 1000, ".1f"), fmt(r["steady_median_ms"] / 1000, ".2f"),
                      fmt(r["max_over_median"], ".2f"), fmt(r["steady_events_per_s"]),
                      fmt(r["peak_pss"] / 1e6), fmt(r["settled_pss"] / 1e6), fmt(r["settled_pss_file"] / 1e6),
                      fmt((r["settled_pss"] - r["baseline_pss"]) / 1e6), fmt(r["state_view_bytes"] / 1e6),
                      fmt(r["settled_less_baseline_over_state"], ".2f"),
                      fmt(r["settled_less_imports_over_state"], ".2f"))
    console.print(table)


def _plot(results: dict, path: Path) -> None:
    plt = pyplot()
    runs = results["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        label = f"local[{r['workers']}], shared {'on' if r['host_views'] else 'off'}"
        left.plot([b["batch_id"] for b in r["batches"]], [b["duration_ms"] / 1000 for b in r["batches"]],
                  marker="o", label=label)
        t0 = r["batches"][0]["started_ms"]
        right.plot([(s[0] - t0) / 1000 for s in r["memory_samples"]], [s[1] / 1e9 for s in r["memory_samples"]],
                   label=label)
    state = max(r["state_view_bytes"] for r in runs) / 1e9
    right.axhline(state, color="grey", linestyle="--", label="one copy of the cached state")
    left.set(xlabel="batch", ylabel="seconds", title="batch durations")
    right.set(xlabel="seconds since the first batch", ylabel="GB", title="Python workers' Pss together")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    save_figure(fig, path, 110)


if __name__ == "__main__":
    typer.run(main)
