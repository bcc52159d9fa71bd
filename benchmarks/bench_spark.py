"""Streaming benchmark against the Spark peers (issue 4): a keyed running count.

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
- ``ours-compat`` and ``ours-vectorized``: ``spark_integration.start_stateful_query`` with the
  row processor above run unchanged, and with ``RunningAggregate("count")``; reported as not
  available while ``spark_integration.start_stateful_query`` cannot be imported.

The transformWithState peers make one JVM round trip per key and state call, so they run on a
smaller data set with the same events per key per batch (``--tws-main`` also runs the row-based
one on the main data set, about 8 minutes); ratios are only taken between runs on the same
data set. Every run's output is checked against the input: per batch the number of
emitted rows, the sum of the emitted counts and the sum of key-id x count, plus the final count
of a sample of keys.

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
minutes on a quiet 2-core machine). Run: ``.venv/bin/python benchmarks/bench_spark.py``;
``--quick`` for a smoke run of every code path (about 4 minutes, ``spark_bench_quick.*``);
``--report-from FILE.json`` to print the tables and redraw the plot of an earlier run.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import typer
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.types import LongType, StringType, StructField, StructType
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
PROVIDER_CONF = "spark.sql.streaming.stateStore.providerClass"
SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.catalogImplementation": "in-memory",
}
SOURCE_SCHEMA = StructType([StructField("key", StringType(), False), StructField("value", LongType(), False)])
OUTPUT_SCHEMA = StructType([StructField("key", StringType(), True), StructField("count", LongType(), True)])
COUNT_STATE_SCHEMA = StructType([StructField("count", LongType(), True)])
SPARK_PEERS = ("spark-count-rocksdb", "spark-count-hdfs", "spark-tws-rows")
SAMPLE_KEYS = 32
console = Console(width=None if Console().is_terminal else 200)


# --------------------------------------------------------------------------------------------
# CPU accounting: the machine is shared, so every job records how busy the others kept it.
# --------------------------------------------------------------------------------------------


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / tick, sum(fields) / tick


def machine_busy_fraction(interval_s: float) -> float:
    """The busy fraction of all cores over the next ``interval_s`` seconds."""
    b0, t0 = machine_cpu_s()
    time.sleep(interval_s)
    b1, t1 = machine_cpu_s()
    return (b1 - b0) / max(t1 - t0, 1e-9)


class CpuMeter:
    """CPU use of this process tree and of the rest of the machine between start and ``stop()``."""

    def __init__(self) -> None:
        self.t0, self.own0, self.machine0 = time.perf_counter(), process_tree_cpu_s(os.getpid()), machine_cpu_s()[0]

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        own = process_tree_cpu_s(os.getpid()) - self.own0
        others = max(machine_cpu_s()[0] - self.machine0 - own, 0.0)
        return {"own_cores": own / wall, "other_cores": others / wall}


def process_tree_cpu_s(root_pid: int) -> float:
    """CPU seconds used so far by ``root_pid`` and every live descendant (the JVM and its Python
    workers), plus the reaped children each of them has waited for."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # the fields after "pid (comm)"
        parents[int(entry.name)] = int(rest[1])
        times[int(entry.name)] = sum(int(v) for v in rest[11:15]) / tick  # utime stime cutime cstime
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier += children
    return sum(times.get(pid, 0.0) for pid in tree)


# --------------------------------------------------------------------------------------------
# The processors: module-level so that peer (c) and ours-compat run the very same class.
# --------------------------------------------------------------------------------------------


class CountProcessor(StatefulProcessor):
    """Row-based keyed running count for ``transformWithState``: one ValueState per key;
    emits (key, new count) for every key of the batch."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", COUNT_STATE_SCHEMA)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        n = sum(1 for _ in rows)
        current = self.count.get()  # one state call: get() returns None for a new key
        total = (current[0] if current else 0) + n
        self.count.update((total,))
        yield Row(key=key[0], count=total)

    def close(self) -> None:
        pass


class PandasCountProcessor(StatefulProcessor):
    """The same running count for ``transformWithStateInPandas``: rows arrive as pandas frames."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", COUNT_STATE_SCHEMA)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        import pandas as pd

        n = sum(len(frame) for frame in rows)
        current = self.count.get()
        total = (int(current[0]) if current else 0) + n
        self.count.update((total,))
        yield pd.DataFrame({"key": [key[0]], "count": [total]})

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# The implementations: a registry of named functions that start the query on a source.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunContext:
    """What a worker hands an implementation: where its checkpoint and state live, and the sink."""

    checkpoint: str
    warehouse: str
    table: str
    parallelism: int
    sink: Callable[[Any, int], None]


@dataclass(frozen=True)
class Impl:
    name: str
    label: str
    start: Callable[[Any, RunContext], Any]  # (source DataFrame, context) -> StreamingQuery
    provider: str | None  # state store provider class; None leaves Spark's default
    ours: bool = False
    per_key_jvm_calls: bool = False  # one JVM round trip per key: run on the small data set only


IMPLS: dict[str, Impl] = {}


def register(name: str, label: str, provider: str | None = None, ours: bool = False,
             per_key_jvm_calls: bool = False) -> Callable:
    def wrap(fn: Callable[[Any, RunContext], Any]) -> Callable:
        IMPLS[name] = Impl(name, label, fn, provider, ours, per_key_jvm_calls)
        return fn
    return wrap


def _start_update_query(out: Any, ctx: RunContext) -> Any:
    return (out.writeStream.outputMode("update").foreachBatch(ctx.sink)
            .option("checkpointLocation", ctx.checkpoint).trigger(availableNow=True).start())


@register("spark-count-hdfs", "Spark groupBy().count(), HDFS-backed store", provider=HDFS)
@register("spark-count-rocksdb", "Spark groupBy().count(), RocksDB store", provider=ROCKSDB)
def _spark_count(source: Any, ctx: RunContext) -> Any:
    return _start_update_query(source.groupBy("key").count(), ctx)


@register("spark-tws-rows", "Spark transformWithState (rows), RocksDB", provider=ROCKSDB, per_key_jvm_calls=True)
def _spark_tws_rows(source: Any, ctx: RunContext) -> Any:
    out = source.groupBy("key").transformWithState(CountProcessor(), OUTPUT_SCHEMA, outputMode="Update",
                                                   timeMode="None")
    return _start_update_query(out, ctx)


@register("spark-tws-pandas", "Spark transformWithStateInPandas, RocksDB", provider=ROCKSDB,
          per_key_jvm_calls=True)
def _spark_tws_pandas(source: Any, ctx: RunContext) -> Any:
    out = source.groupBy("key").transformWithStateInPandas(PandasCountProcessor(), OUTPUT_SCHEMA,
                                                           outputMode="Update", timeMode="None")
    return _start_update_query(out, ctx)


def _start_ours(source: Any, ctx: RunContext, processor: Any) -> Any:
    """Ours, against the contract of ``spark_integration.start_stateful_query``."""
    import spark_integration

    location = spark_integration.StateLocation(warehouse=ctx.warehouse, table=ctx.table, max_parallelism=128,
                                               parallelism=ctx.parallelism)
    return spark_integration.start_stateful_query(
        source, keys=["key"], processor=processor, output_schema=OUTPUT_SCHEMA, location=location,
        checkpoint_location=ctx.checkpoint, trigger={"availableNow": True}, foreach_batch=ctx.sink)


@register("ours-compat", "ours, Spark-compatible processor API", ours=True)
def _ours_compat(source: Any, ctx: RunContext) -> Any:
    return _start_ours(source, ctx, CountProcessor())


@register("ours-vectorized", "ours, vectorized RunningAggregate", ours=True)
def _ours_vectorized(source: Any, ctx: RunContext) -> Any:
    import spark_integration

    return _start_ours(source, ctx, spark_integration.RunningAggregate("count"))


def ours_unavailable_reason() -> str | None:
    """None when ``spark_integration.start_stateful_query`` can be imported, else why not."""
    try:
        import spark_integration
    except Exception as exc:
        return f"import spark_integration failed: {type(exc).__name__}: {exc}"
    missing = [n for n in ("start_stateful_query", "StateLocation", "RunningAggregate")
               if not hasattr(spark_integration, n)]
    return f"spark_integration has no {', '.join(missing)}" if missing else None


# --------------------------------------------------------------------------------------------
# Input data and the expected output.
# --------------------------------------------------------------------------------------------


@dataclass
class DataSet:
    """Input files in micro-batch order (one file per batch) and the output they must produce."""

    name: str
    keys: int
    files: list[Path]
    events: int = 0
    expected: list[dict] | None = None  # per batch: rows, sum_count, sum_id_count
    sample: dict[str, int] | None = None  # final count of a few keys


def _key_strings(ids: np.ndarray, width: int) -> pa.Array:
    digits = pc.utf8_lpad(pc.cast(pa.array(ids, pa.int64()), pa.string()), width, "0")
    return pc.binary_join_element_wise("k", digits, "")


def _write_files(folder: Path, batches: list[np.ndarray], keys: int, rng: np.random.Generator,
                 first_index: int = 0, mtime_base: float | None = None) -> list[Path]:
    """One Parquet file per batch of key ids; modification times strictly increase with the
    index, because the file source orders the files it has not seen by modification time."""
    folder.mkdir(parents=True, exist_ok=True)
    width = max(6, len(str(keys - 1)))
    mtime_base = time.time() - 3600 if mtime_base is None else mtime_base
    paths = []
    for i, ids in enumerate(batches, start=first_index):
        path = folder / f"part-{i:05d}.parquet"
        table = pa.table({"key": _key_strings(ids, width), "value": pa.array(rng.integers(0, 1000, ids.size))})
        pq.write_table(table, path)
        os.utime(path, (mtime_base + i, mtime_base + i))
        paths.append(path)
    return paths


def _uniform_batches(rng: np.random.Generator, events: int, keys: int, batches: int) -> list[np.ndarray]:
    ids = rng.integers(0, keys, events)
    return np.array_split(ids, batches)


def _expect(data: DataSet, rng: np.random.Generator) -> None:
    """The per-batch checksums and the final sample counts the files must produce (polars)."""
    import polars as pl

    frames = [pl.read_parquet(f, columns=["key"]).with_columns(pl.lit(i).alias("batch"))
              for i, f in enumerate(data.files)]
    events = pl.concat(frames).with_columns(pl.col("key").str.slice(1).cast(pl.Int64).alias("id"))
    per_key = (events.group_by(["id", "batch"]).len().sort(["id", "batch"])
               .with_columns(pl.col("len").cum_sum().over("id").alias("cum")))
    per_batch = (per_key.group_by("batch")
                 .agg(rows=pl.len(), sum_count=pl.col("cum").sum(), sum_id_count=(pl.col("id") * pl.col("cum")).sum())
                 .sort("batch"))
    data.events = events.height
    data.expected = per_batch.select("rows", "sum_count", "sum_id_count").to_dicts()
    final = per_key.group_by("id").agg(pl.col("cum").max())
    picked = final.sample(min(SAMPLE_KEYS, final.height), seed=int(rng.integers(1 << 31)))
    width = max(6, len(str(data.keys - 1)))
    data.sample = {f"k{i:0{width}d}": c for i, c in zip(picked["id"], picked["cum"], strict=True)}


def make_stream_data(root: Path, name: str, events: int, keys: int, batches: int, seed: int) -> DataSet:
    rng = np.random.default_rng(seed)
    data = DataSet(name, keys, _write_files(root / name, _uniform_batches(rng, events, keys, batches), keys, rng))
    _expect(data, rng)
    return data


@dataclass
class RestartData:
    """Files of the restart scenario: ``build`` files that insert every key once, ``steady``
    files of uniform updates over the full state, and one file for each later restart."""

    all: DataSet
    build: int
    steady: int


def make_restart_data(root: Path, keys: int, build: int, steady: int, after: int, batch_events: int,
                      seed: int) -> RestartData:
    rng = np.random.default_rng(seed)
    batches = np.array_split(rng.permutation(keys), build)
    batches += [rng.integers(0, keys, batch_events) for _ in range(steady + after)]
    data = DataSet("restart", keys, _write_files(root / "restart-files", batches, keys, rng))
    _expect(data, rng)
    return RestartData(data, build, steady)


def verify(sink: list[dict], data: DataSet, first: int = 0) -> dict:
    """Compare a run's per-batch sink checksums with those expected of files ``first``...
    (the counts are cumulative, so a restart that lost or doubled state shows); a run over all
    files also has its sample keys checked against their final counts."""
    expected = data.expected[first:first + len(sink)]
    problems = []
    if len(sink) != len(expected):
        problems.append(f"{len(sink)} output batches for {len(data.expected) - first} input files")
    for i, (got, want) in enumerate(zip(sink, expected, strict=False)):
        problems += [f"batch {first + i}: {field} {got[field]} != {want[field]}"
                     for field in ("rows", "sum_count", "sum_id_count") if got[field] != want[field]]
    if first == 0 and len(sink) == len(data.expected):
        seen: dict[str, int] = {}
        for batch in sink:
            seen.update(batch["sample"])
        problems += [f"key {k}: count {seen.get(k)} != {v}" for k, v in data.sample.items() if seen.get(k) != v]
    return {"ok": not problems, "problems": problems[:10]}


# --------------------------------------------------------------------------------------------
# The worker: one job in a fresh Python process with its own SparkSession.
# --------------------------------------------------------------------------------------------


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


def _session(job: dict, provider: str | None) -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    conf = {**SPARK_CONF, "spark.driver.memory": job["driver_memory"],
            "spark.sql.warehouse.dir": str(Path(job["scratch"]) / "spark-warehouse"),
            "spark.local.dir": str(Path(job["scratch"]) / "spark-local")}
    if provider:
        conf[PROVIDER_CONF] = provider
    builder = SparkSession.builder.master("local[2]").appName(f"bench-spark-{job['impl']}")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


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
    spark = _session(job, impl.provider)
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
    spark = _session(job, ROCKSDB)
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


def _worker(job_path: Path) -> None:
    job = json.loads(job_path.read_text())
    try:
        result = _run_repartition(job) if job["kind"] == "repartition" else _run_stream(job)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc)[:3000]}"}
    Path(job["result"]).write_text(json.dumps(result, indent=1, default=str))


# --------------------------------------------------------------------------------------------
# The driver: jobs in subprocesses, one at a time.
# --------------------------------------------------------------------------------------------


@dataclass
class Runner:
    root: Path
    driver_memory: str
    timeout_s: float
    quiet_wait_s: float
    quiet_busy_max: float = 0.25
    jobs_run: int = 0

    def wait_for_quiet(self) -> dict:
        """Wait (at most ``quiet_wait_s``) until other processes keep the machine less than
        ``quiet_busy_max`` busy, so that a job does not start in the middle of someone's test run."""
        t0 = time.perf_counter()
        busy = machine_busy_fraction(2.0)
        while busy > self.quiet_busy_max and time.perf_counter() - t0 < self.quiet_wait_s:
            if time.perf_counter() - t0 < 3:
                console.log(f"  machine {busy:.0%} busy with other work: waiting up to {self.quiet_wait_s:.0f} s")
            busy = machine_busy_fraction(5.0)
        return {"busy_before": busy, "waited_s": time.perf_counter() - t0}

    def run(self, job: dict, title: str) -> dict:
        """Run one job in a fresh Python process; returns its result, or {"error": ...}."""
        self.jobs_run += 1
        name = f"job-{self.jobs_run:02d}-{job['impl']}-{job['kind']}"
        scratch = self.root / "scratch" / name
        scratch.mkdir(parents=True)
        job = {**job, "driver_memory": self.driver_memory, "scratch": str(scratch),
               "result": str(scratch / "result.json")}
        job_path = scratch / "job.json"
        job_path.write_text(json.dumps(job))
        log = scratch / "log.txt"
        quiet = self.wait_for_quiet()
        console.log(f"[bold]{title}[/bold] (log: {log})")
        t0 = time.perf_counter()
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(job_path)],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and the JVM it started
                proc.wait()
                return {"error": f"timed out after {self.timeout_s:.0f} s"}
        result_path = Path(job["result"])
        if not result_path.exists():
            return {"error": f"worker exited {proc.returncode} without a result: {log.read_text()[-1500:]}"}
        result = json.loads(result_path.read_text())
        result["process_s"] = time.perf_counter() - t0
        result["machine"] = quiet | result.pop("cpu", {})
        if "error" in result:
            console.log(f"  [red]failed[/red]: {result['error'][:300]}")
        elif result["machine"].get("other_cores", 0) > 0.3:
            console.log(f"  [yellow]other processes used {result['machine']['other_cores']:.1f} cores during the "
                        "measurement: treat its figures with care[/yellow]")
        return result


def _stream_job(impl: str, source: Path, root: Path, label: str, sample: dict[str, int],
                parallelism: int = 4) -> dict:
    return {"kind": "stream", "impl": impl, "source": str(source), "checkpoint": str(root / "checkpoints" / label),
            "warehouse": str(root / "warehouse"), "table": label.replace("-", "_"), "parallelism": parallelism,
            "sample_keys": sorted(sample)}


def _throughput(result: dict, data: DataSet) -> dict:
    """Events/s overall (query start to end) and steady (batches after the first, by their
    durations), the first batch, and the output check."""
    batches = result["batches"]
    steady = batches[1:]
    steady_ms = sum(b["batch_ms"] for b in steady)
    return {
        "events": data.events, "keys": data.keys, "batches": len(batches), "wall_s": result["wall_s"],
        "session_s": result["session_s"], "process_s": result["process_s"], "machine": result["machine"],
        "events_per_s": data.events / result["wall_s"],
        "steady_events_per_s": sum(b["input_rows"] for b in steady) / (steady_ms / 1e3) if steady_ms else None,
        "first_batch_s": batches[0]["batch_ms"] / 1e3 if batches else None,
        "steady_batch_s_median": statistics.median(b["batch_ms"] for b in steady) / 1e3 if steady else None,
        "sink_s_total": sum(b["sink_s"] for b in result["sink"]),
        "verified": verify(result["sink"], data), "per_batch": batches,
    }


def _least_disturbed_run(runner: Runner, name: str, data: DataSet, reruns: int) -> dict:
    """Run ``name`` on ``data``; while other processes used more than 0.3 cores during the run,
    run it again from scratch (at most ``reruns`` times) and keep the least disturbed run."""
    runs: list[dict] = []
    for attempt in range(reruns + 1):
        job = _stream_job(name, data.files[0].parent, runner.root, f"{name}-{data.name}-{attempt}", data.sample)
        runs.append(runner.run(job, f"{name} on {data.name}: {data.events:,} events, {data.keys:,} keys, "
                                    f"{len(data.files)} batches" + (f" (rerun {attempt})" if attempt else "")))
        if "error" in runs[-1] or runs[-1]["machine"].get("other_cores", 0) <= 0.3:
            break
    best = min(runs, key=lambda r: r.get("machine", {}).get("other_cores", 0))
    best["attempts"] = len(runs)
    return best


def run_throughput(runner: Runner, impls: list[str], datasets: dict[str, DataSet], ours_reason: str | None,
                   reruns: int, tws_main: bool = False) -> list:
    rows = []
    for data in datasets.values():
        for name in impls:
            impl = IMPLS[name]
            if data.name == "main" and impl.per_key_jvm_calls and not (tws_main and name == "spark-tws-rows"):
                continue
            entry = {"impl": name, "label": impl.label, "dataset": data.name, "events": data.events,
                     "keys": data.keys, "batches": len(data.files)}
            if impl.ours and ours_reason:
                rows.append({**entry, "status": "not available", "reason": ours_reason})
                continue
            result = _least_disturbed_run(runner, name, data, reruns)
            if "error" in result:
                rows.append({**entry, "status": "failed", "reason": result["error"]})
                continue
            row = {**entry, "status": "ok", "attempts": result["attempts"], **_throughput(result, data)}
            console.log(f"  {row['events_per_s']:,.0f} events/s overall, {row['steady_events_per_s'] or 0:,.0f} "
                        f"steady; output {'verified' if row['verified']['ok'] else row['verified']['problems']}")
            rows.append(row)
    _derive(rows)
    return rows


def _derive(rows: list[dict]) -> None:
    """Events per CPU-second of each ok run (CPU of its process tree: robust to other work on a
    shared machine), and each ok run divided by each Spark peer's run on the same data set."""
    ok = {(r["impl"], r["dataset"]): r for r in rows if r["status"] == "ok"}
    for r in ok.values():
        r["cpu_s"] = r["machine"].get("own_cores", 0) * r["wall_s"]
        r["events_per_cpu_s"] = r["events"] / r["cpu_s"] if r["cpu_s"] else None
    for r in ok.values():
        r["ratios"] = {}
        for peer in SPARK_PEERS:
            p = ok.get((peer, r["dataset"]))
            if p:
                r["ratios"][peer] = {
                    "overall": r["events_per_s"] / p["events_per_s"],
                    "per_cpu_s": (r["events_per_cpu_s"] / p["events_per_cpu_s"]
                                  if r["events_per_cpu_s"] and p["events_per_cpu_s"] else None),
                    "steady": (r["steady_events_per_s"] / p["steady_events_per_s"]
                               if r["steady_events_per_s"] and p["steady_events_per_s"] else None)}


# --------------------------------------------------------------------------------------------
# Restart and rescale.
# --------------------------------------------------------------------------------------------


class _Feeder:
    """A source folder that the restart scenario fills file by file (copies keep the mtimes)."""

    def __init__(self, folder: Path, files: list[Path]) -> None:
        self.folder, self.files, self.next = folder, files, 0
        folder.mkdir(parents=True)

    def add(self, count: int) -> int:
        first = self.next
        for f in self.files[first:first + count]:
            shutil.copy2(f, self.folder / f.name)
        self.next += count
        return first


def _stream_step(runner: Runner, feeder: _Feeder, impl: str, label: str, rd: RestartData, files: int,
                 title: str, parallelism: int = 4) -> dict:
    first = feeder.add(files)
    job = _stream_job(impl, feeder.folder, runner.root, label, rd.all.sample, parallelism)
    result = runner.run(job, title)
    if "error" in result:
        return result
    batches = result["batches"]
    return {"session_s": result["session_s"], "import_s": result.get("import_s"), "wall_s": result["wall_s"],
            "process_s": result["process_s"],
            "machine": result["machine"],
            "first_batch_s": batches[0]["batch_ms"] / 1e3 if batches else None,
            "start_to_first_batch_end_s": result["start_to_first_batch_end_s"],
            "state_rows_total": batches[-1]["state_rows_total"] if batches else None,
            "state_store_instances": batches[-1]["state_store_instances"] if batches else None,
            "verified": verify(result["sink"], rd.all, first), "per_batch": batches}


def _build_step(runner: Runner, feeder: _Feeder, impl: str, label: str, rd: RestartData) -> dict:
    step = _stream_step(runner, feeder, impl, label, rd, rd.build + rd.steady,
                        f"{impl}: building a {rd.all.keys:,}-key state ({rd.build} insert + {rd.steady} update "
                        "batches)")
    if "error" not in step:
        steady = [b["batch_ms"] / 1e3 for b in step["per_batch"][rd.build:]]
        step["steady_batch_s_median"] = statistics.median(steady) if steady else None
        step["steady_batch_s_all"] = steady
    return step


def spark_restart_and_rescale(runner: Runner, rd: RestartData, partitions: int) -> dict:
    """RocksDB ``groupBy().count()``: build, restart with one more file, offline repartition to
    ``partitions``, restart with one more file."""
    impl, label = "spark-count-rocksdb", "spark-count-rocksdb-restart"
    feeder = _Feeder(runner.root / "sources" / label, rd.all.files)
    out: dict = {"impl": impl, "state_keys": rd.all.keys}
    out["build"] = _build_step(runner, feeder, impl, label, rd)
    if "error" in out["build"]:
        return out
    out["restart"] = _stream_step(runner, feeder, impl, label, rd, 1, f"{impl}: restart, one more batch")
    checkpoint = str(runner.root / "checkpoints" / label)
    out["repartition"] = runner.run({"kind": "repartition", "impl": impl, "checkpoint": checkpoint,
                                     "partitions": partitions},
                                    f"spark._streamingCheckpointManager.repartition(checkpoint, {partitions})")
    if "error" not in out["repartition"]:
        out["after_repartition"] = _stream_step(runner, feeder, impl, label, rd, 1,
                                                f"{impl}: restart after the repartition, one more batch")
    return out


def ours_restart_and_rescale(runner: Runner, rd: RestartData, partitions: int, impl: str,
                             ours_reason: str | None) -> dict:
    """Ours: build with parallelism 4, restart with parallelism 4, then restart with
    ``partitions`` on the same state (no offline step: the first batch is the rescale)."""
    if ours_reason:
        return {"impl": impl, "status": "not available", "reason": ours_reason}
    label = f"{impl}-restart"
    feeder = _Feeder(runner.root / "sources" / label, rd.all.files)
    out: dict = {"impl": impl, "state_keys": rd.all.keys, "status": "ok"}
    out["build"] = _build_step(runner, feeder, impl, label, rd)
    if "error" in out["build"]:
        return out
    out["restart"] = _stream_step(runner, feeder, impl, label, rd, 1, f"{impl}: restart, one more batch")
    out["rescale"] = _stream_step(runner, feeder, impl, label, rd, 1,
                                  f"{impl}: restart with parallelism {partitions}, one more batch",
                                  parallelism=partitions)
    return out


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str = ",.0f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _report_throughput(rows: list[dict]) -> None:
    t = Table(title="keyed running count (data set: events/keys/batches). Ratios: this row over the peer on the "
                    "same data set, events/s overall / steady / per CPU-second. Other cores: CPU that other processes "
                    "used during the run")
    for col in ("implementation", "data set", "wall s", "events/s", "steady ev/s", "events/CPU-s", "1st batch s",
                "vs RocksDB count", "vs HDFS count", "vs transformWithState", "other cores", "output"):
        t.add_column(col, justify="left" if col in ("implementation", "data set", "output") else "right")
    reasons: set[str] = set()
    for r in rows:
        size = f"{r['dataset']} {r['events'] / 1e6:g}M/{r['keys'] / 1e3:g}k/{r['batches']}"
        if r["status"] != "ok":
            t.add_row(r["impl"], size, "", "", "", "", "", "", "", "", "", r["status"])
            reasons.add(f"{r['impl']}: {r['status']}: {r['reason']}")
            continue
        ratios = [r["ratios"].get(p) for p in SPARK_PEERS]
        cells = ["-" if q is None else " / ".join(_fmt(q[k], ".2f") for k in ("overall", "steady", "per_cpu_s"))
                 for q in ratios]
        t.add_row(r["impl"], size, f"{r['wall_s']:.1f}", _fmt(r["events_per_s"]), _fmt(r["steady_events_per_s"]),
                  _fmt(r["events_per_cpu_s"]), _fmt(r["first_batch_s"], ".2f"), *cells,
                  _fmt(r["machine"].get("other_cores"), ".2f"),
                  "verified" if r["verified"]["ok"] else f"[red]WRONG[/red] {r['verified']['problems'][:2]}")
    t.caption = "\n".join(sorted(reasons)) or None
    console.print(t)


def _step_cell(step: dict | None, field: str) -> str:
    if step is None:
        return "-"
    if "error" in step:
        return f"error: {step['error'][:70]}"
    return _fmt(step.get(field), ".2f", " s")


def _derive_restart(results: dict) -> None:
    """Give each restart scenario the first batch of a fresh query of the same implementation on
    an empty state with the same batch size (the main data set's first batch): the share of a
    first batch after a restart that any fresh process pays (JIT, Python workers, code
    generation) whatever the state."""
    first = {r["impl"]: r["first_batch_s"] for r in results["throughput"]
             if r["status"] == "ok" and r["dataset"] == "main"}
    for scenario in (results.get("restart") or {}).values():
        if scenario and scenario.get("impl") in first:
            scenario["fresh_query_first_batch_s"] = first[scenario["impl"]]


def _restart_cells(d: dict, offline_step: bool) -> list[str]:
    """One column of the restart table: the figures of one scenario (empty when it did not run)."""
    if not d:
        return ["-"] * 12
    build, restart = d.get("build") or {}, d.get("restart") or {}
    rescale = d.get("after_repartition") or d.get("rescale")
    steady, fresh = build.get("steady_batch_s_median"), d.get("fresh_query_first_batch_s")
    first = restart.get("first_batch_s")
    steps = [st for st in d.values() if isinstance(st, dict)]
    others = [st["machine"].get("other_cores", 0) for st in steps if "machine" in st]
    checks = [st["verified"]["ok"] for st in steps if "verified" in st]
    return [
        _step_cell(build, "steady_batch_s_median"),
        _fmt(fresh, ".2f", " s"),
        _step_cell(restart, "first_batch_s"),
        _fmt(first / steady if first and steady else None, ".1f", "x"),
        _fmt(first - fresh if first and fresh else None, ".2f", " s"),
        _step_cell(restart, "start_to_first_batch_end_s"),
        _step_cell(restart, "import_s"),
        _step_cell(d.get("repartition"), "repartition_s") if offline_step else "none needed",
        _step_cell(d.get("repartition"), "session_s") if offline_step else "",
        _step_cell(rescale, "first_batch_s"),
        f"{max(others):.2f}" if others else "-",
        "yes" if checks and all(checks) else "[red]NO[/red]",
    ]


def _report_restart(spark: dict | None, ours: dict | None) -> None:
    if spark is None and ours is None:
        return
    keys = (spark or ours or {}).get("state_keys", 0)
    t = Table(title=f"restart and rescale on a {keys:,}-key state (batches of the same size throughout)")
    t.add_column("measure")
    t.add_column("Spark groupBy().count(), RocksDB", justify="right")
    t.add_column(f"ours ({(ours or {}).get('impl', '')})", justify="right")
    labels = ["steady batch (median)", "first batch of a fresh query on an empty state", "first batch after restart",
              "  over the steady batch", "  minus the fresh query's first batch", "  query start to its end",
              "  library import, before the query start",
              "offline repartition 4 -> 8 (session excluded)", "  its session start",
              "first batch at parallelism 8", "most cores other processes used in a step",
              "output of every step verified"]
    o = ours if ours and ours.get("status") == "ok" else {}
    for label, sc, oc in zip(labels, _restart_cells(spark or {}, True), _restart_cells(o, False), strict=True):
        t.add_row(label, sc, oc)
    if ours and ours.get("status") != "ok":
        t.caption = f"ours: {ours['status']}: {ours.get('reason', '')}"
    console.print(t)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["throughput"] if r["status"] == "ok"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets) + 1, figsize=(6 * (len(datasets) + 1), 4.5))
    for ax, ds in zip(axes, datasets, strict=False):
        sub = [r for r in rows if r["dataset"] == ds]
        x = np.arange(len(sub))
        ax.bar(x - 0.2, [r["events_per_s"] / 1e3 for r in sub], 0.4, label="overall")
        ax.bar(x + 0.2, [(r["steady_events_per_s"] or 0) / 1e3 for r in sub], 0.4, label="steady (after batch 1)")
        ax.set_xticks(x, [r["impl"] for r in sub], rotation=25, ha="right")
        rates = [r["events_per_s"] for r in sub]
        log = max(rates) / min(rates) > 10  # log scale only when the bars span more than a decade
        if log:
            ax.set_yscale("log")
        ax.set_ylabel("thousand events/s" + (" (log scale)" if log else ""))
        ax.set_title(f"{ds}: {sub[0]['events']:,} events, {sub[0]['keys']:,} keys, {sub[0]['batches']} batches")
        ax.legend(fontsize=8)
    ax = axes[-1]
    spark = results.get("restart", {}).get("spark") or {}
    bars = {"steady batch": spark.get("build", {}).get("steady_batch_s_median"),
            "fresh query 1st batch": spark.get("fresh_query_first_batch_s"),
            "1st batch after restart": spark.get("restart", {}).get("first_batch_s"),
            "offline repartition 4->8": spark.get("repartition", {}).get("repartition_s"),
            "1st batch after repartition": spark.get("after_repartition", {}).get("first_batch_s")}
    ours = results.get("restart", {}).get("ours") or {}
    if ours.get("status") == "ok":
        bars |= {"ours steady batch": ours.get("build", {}).get("steady_batch_s_median"),
                 "ours fresh query 1st batch": ours.get("fresh_query_first_batch_s"),
                 "ours 1st batch after restart": ours.get("restart", {}).get("first_batch_s"),
                 "ours 1st batch at p=8": ours.get("rescale", {}).get("first_batch_s")}
    bars = {k: v for k, v in bars.items() if v is not None}
    ax.bar(list(bars), list(bars.values()), color=["C2" if k.startswith("ours") else "C3" for k in bars])
    ax.set_ylabel("s")
    ax.set_title(f"restart / rescale, {spark.get('state_keys', ours.get('state_keys', 0)):,}-key state")
    ax.tick_params(axis="x", rotation=25)
    for label in ax.get_xticklabels():
        label.set_ha("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _machine() -> dict:
    import pyspark

    java = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None)
    return {"python": platform.python_version(), "pyspark": pyspark.__version__, "java": java[0] if java else None,
            "cpus": os.cpu_count(), "mem_total_kib": int(mem) if mem else None, "platform": platform.platform(),
            "spark_conf": {**SPARK_CONF, "master": "local[2]"}}


# --------------------------------------------------------------------------------------------
# CLI.
# --------------------------------------------------------------------------------------------


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
    skip_restart: bool = typer.Option(False, help="skip the restart / rescale scenario"),
    tws_main: bool = typer.Option(False, help="also run transformWithState (rows) on the main data set (~8 min)"),
    ours_restart_impl: str = typer.Option("ours-vectorized", help="which of ours runs the restart scenario"),
    driver_memory: str = typer.Option("3g", help="spark.driver.memory of each Spark process"),
    timeout: float = typer.Option(900, help="seconds before a Spark process is killed"),
    reruns: int = typer.Option(1, help="reruns of a throughput job during which other processes used > 0.3 cores"),
    quiet_wait: float = typer.Option(300, help="seconds each job may wait for other work on the machine to stop"),
    workdir: Path | None = typer.Option(None, help="work directory (default: a fresh temporary one)"),
    keep: bool = typer.Option(False, help="keep the work directory (input, checkpoints, logs)"),
    report_from: Path | None = typer.Option(None, help="print the tables and redraw the plot of a results JSON"),
    worker: Path | None = typer.Option(None, hidden=True, help="internal: run one job file"),
) -> None:
    if worker is not None:
        _worker(worker)
        return
    if report_from is not None:
        results = json.loads(report_from.read_text())
        _derive(results["throughput"])
        _derive_restart(results)
        report_from.write_text(json.dumps(results, indent=2, default=str))
        _finish(results, report_from.with_suffix(".png"))
        return
    if quick:  # the small data set only, no reruns, short waits: a smoke run of every code path
        events, keys, batches, small_events, small_keys, restart_keys = 100_000, 10_000, 5, 20_000, 2_000, 100_000
        reruns, quiet_wait = 0, min(quiet_wait, 20)
    impls = [n.strip() for n in only.split(",") if n.strip()] or list(IMPLS)
    unknown = set(impls) - set(IMPLS)
    if unknown:
        raise typer.BadParameter(f"unknown implementations {sorted(unknown)}; known: {list(IMPLS)}")
    root = Path(tempfile.mkdtemp(prefix="bench_spark_")) if workdir is None else workdir
    root.mkdir(parents=True, exist_ok=True)
    ours_reason = ours_unavailable_reason()
    if ours_reason:
        console.log(f"ours: not available ({ours_reason}); the Spark peers run alone")
    started = datetime.now(UTC).isoformat()
    t_start = time.perf_counter()
    try:
        console.log(f"writing input under {root}")
        datasets = {} if quick else {"main": make_stream_data(root, "main", events, keys, batches, seed=1)}
        datasets["small"] = make_stream_data(root, "small", small_events, small_keys, batches, seed=2)
        runner = Runner(root, driver_memory, timeout, quiet_wait)
        results: dict = {
            "machine": _machine(), "started": started, "quick": quick,
            "sizes": {"main": None if quick else {"events": events, "keys": keys, "batches": batches},
                      "small": {"events": small_events, "keys": small_keys, "batches": batches,
                                "runs": "every implementation; the transformWithState peers run on this one only"},
                      "restart": {"keys": restart_keys}},
            "ours_available": ours_reason is None, "ours_unavailable_reason": ours_reason,
            "throughput": run_throughput(runner, impls, datasets, ours_reason, reruns, tws_main),
        }
        if not skip_restart:
            batch_events = events // batches
            rd = make_restart_data(root, restart_keys, build=4 if not quick else 2, steady=3 if not quick else 2,
                                   after=2, batch_events=batch_events, seed=3)
            results["sizes"]["restart"] |= {"insert_batches": rd.build, "update_batches": rd.steady,
                                            "events_per_update_batch": batch_events}
            results["restart"] = {"spark": spark_restart_and_rescale(runner, rd, rescale_to)
                                  if "spark-count-rocksdb" in impls else None,
                                  "ours": ours_restart_and_rescale(runner, rd, rescale_to, ours_restart_impl,
                                                                   ours_reason)}
        results["finished"] = datetime.now(UTC).isoformat()
        results["total_s"] = time.perf_counter() - t_start
    finally:
        if not keep and workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    _derive_restart(results)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("spark_bench_quick.json" if quick else "spark_bench.json")
    path.write_text(json.dumps(results, indent=2, default=str))
    _finish(results, path.with_suffix(".png"))
    console.log(f"total {results['total_s']:.0f} s; results in {path} and .png")


def _finish(results: dict, plot_path: Path) -> None:
    _plot(results, plot_path)
    _report_throughput(results["throughput"])
    restart = results.get("restart", {})
    _report_restart(restart.get("spark"), restart.get("ours"))


if __name__ == "__main__":
    typer.run(main)
