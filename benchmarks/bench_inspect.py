"""Inspection benchmark: "all live state of a variable" and "one key's state and history" on a
state of ``keys`` keys (2M by default) with about ``checkpoints`` segments per unit, ours against
Spark's own state reader, measured in one run.

The state: a value-state running count per string key ``user-<n>`` (``harness.count_layout``),
written in ``checkpoints`` checkpoints; checkpoint/batch b inserts the b-th ``1/checkpoints`` of the
keys (count 1) and increments a random ``--update-share`` of the keys inserted before it, and the
probe key ``user-1`` is incremented in every one, so that it has a history as long as the stream.

- Ours is written with the store API directly (no Spark): ``--tasks`` task stores, max parallelism
  ``harness.MAX_PARALLELISM``, one unit (partition) per task's key-group range, compaction off, every
  checkpoint retained: each unit ends with one segment per checkpoint (printed and recorded).
- Spark's peer is a streaming ``transformWithState`` query (row-based ``CountProcessor`` of
  ``benchmarks.streaming.processors``: one ValueState ``count`` per key), RocksDB state store provider
  with changelog checkpointing (so that its change feed can be read), local[2], 4 shuffle partitions,
  over the same events as one Parquet file per micro-batch (``maxFilesPerTrigger=1``): the same
  final counts, written in as many micro-batches as ours has checkpoints. It runs in a fresh
  Python process (its own SparkSession, ``benchmarks.streaming.session``) that then measures the
  reads of ``spark.read.format("statestore")`` on its checkpoint.

Measured (best of ``--repeat``; each figure's first run is recorded too):

* all live state (row count and sum of the counts): ours through the SQL views
  (``catalog.sql.connect``, which reads and resolves every entry, plus the query; and the query alone
  on an open connection), through ``catalog.inspection.live_state``, and through a ``StateStore``
  restored at the newest checkpoint (every key group's view: a fresh store, then the same store
  again; and ``StateStore.scan``, which reads without caching); Spark: count/sum over the reader.
* one key's state: ours through the entries view (``catalog.sql.entries_view`` made afresh, the
  key's newest entry), the live-state view of an open connection, ``catalog.inspection.key_state``
  and a batched lookup of one key in a fresh store, then in the same store again; Spark: the
  reader filtered to the key.
* one key's history: ours as every entry of the key in the entries view (each a change, like
  Spark's change feed), and ``catalog.inspection.key_history`` (the key's state at every retained
  checkpoint); Spark: its change feed (``readChangeFeed``) filtered to the key, and the reader at
  every retained batch (``batchId``) filtered to the key (run once: one read per batch).

Every figure is checked against the counts the input implies. Tables are opened before the
clocks start (the time to open ours is recorded apart), as the SparkSession is made before
Spark's. All files are on local disk and in the page cache on both sides.

Prints a table, writes ``benchmarks/results/bench_inspect.json`` and a plot beside it.
Run: ``.venv/bin/python -m benchmarks.bench_inspect`` (``--quick``: 20k keys, 10 checkpoints,
``bench_inspect_quick.*``; ``--skip-spark`` measures ours alone).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import typer
from rich.table import Table

from benchmarks.harness import (
    COUNT,
    MAX_PARALLELISM,
    REPO,
    console,
    count_layout,
    machine_info,
    owners,
    progress,
    pyplot,
    ratio,
    repo_env,
    results_path,
    save_figure,
    user_keys,
    write_results,
)
from benchmarks.streaming.cpu import machine_busy_fraction

PROBE = 1  # the id of the key whose state and history are read: "user-1"
TABLE_NAME = "inspect_state"
VARIABLE = COUNT.name
VALUE = f"v_{VARIABLE}"  # the value column of the SQL views and of catalog.inspection
CHANGELOG_CONF = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"
INSPECTION_FUNCTIONS = ("live_state", "key_state", "key_history")
NOT_AVAILABLE = "not available"

# The columns of the report: who reads.
COLUMNS = {"views": "ours: SQL views", "inspection": "ours: catalog.inspection", "store": "ours: store API",
           "spark": "Spark state reader"}
# The rows of the report, each with the Spark measure ours is compared with (Spark's reader has
# no cache: its best of N, on a warm JVM, is the peer of ours warm and cold alike).
ROWS = {
    "all": ("all live state (count, sum)", "spark_all"),
    "all_warm": ("all live state, warm (open connection / same store)", "spark_all"),
    "all_scan": ("all live state, store.scan (no cache)", "spark_all"),
    "key": ("one key: state", "spark_key"),
    "key_warm": ("one key: state, warm (open connection / same store)", "spark_key"),
    "history": ("one key: history (every change)", "spark_changefeed"),
    "history_warm": ("one key: history, warm (open connection)", "spark_changefeed"),
    "history_batches": ("one key: state at every retained checkpoint/batch", "spark_history_batches"),
}


# Input ------------------------------------------------------------------------------------


def make_batches(keys: int, checkpoints: int, update_share: float, seed: int) -> list[np.ndarray]:
    """The distinct key ids of each checkpoint/batch (module docstring): the batch's share of new
    keys, updates of keys inserted before it, and the probe key."""
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, keys, checkpoints + 1).astype(np.int64)
    updates = int(keys * update_share)
    batches = []
    for b in range(checkpoints):
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        parts = [np.arange(lo, hi), np.array([PROBE])]
        if lo and updates:
            parts.append(rng.integers(0, lo, updates))
        batches.append(np.unique(np.concatenate(parts)))
    return batches


def final_counts(keys: int, batches: list[np.ndarray]) -> np.ndarray:
    counts = np.zeros(keys, np.int64)
    for ids in batches:
        counts[ids] += 1
    return counts


# Ours: build ------------------------------------------------------------------------------


def build_ours(warehouse: str, batches: list[np.ndarray], keys: int, tasks: int) -> dict:
    """Ours: ``tasks`` task stores write one checkpoint per batch (each key's running count), one
    unit per task, every checkpoint retained, no compaction. Returns the build's figures and the
    segments per unit."""
    from catalog import IcebergStateTable
    from statestore import StateStore

    table = IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name=TABLE_NAME,
                                   partition_width=MAX_PARALLELISM // tasks, retain_checkpoints=len(batches))
    stores = [StateStore(table, task_index=t, parallelism=tasks) for t in range(tasks)]
    counts = np.zeros(keys, np.int64)
    t0 = time.perf_counter()
    for b in progress(range(len(batches)), f"ours: {len(batches)} checkpoints of a {keys:,}-key state"):
        ids = batches[b]
        counts[ids] += 1
        owner = owners(user_keys(ids), tasks)
        checkpoint_id = table.next_checkpoint_id()
        segments = []
        for t, store in enumerate(stores):
            mine = ids[owner == t]
            store.get_state(COUNT).update_batch(user_keys(mine), pa.array(counts[mine], pa.int64()))
            segments += store.flush(checkpoint_id)
        table.commit_checkpoint(checkpoint_id, segments, parallelism=tasks, batch_id=b)
        for store in stores:
            store.checkpoint_complete(checkpoint_id)
    build_s = time.perf_counter() - t0
    for store in stores:
        store.close()
    units = table.partition_count()
    per_unit = [len(table.segments(table.partition_key_groups(u))) for u in range(units)]
    _, every = table.segments_at()
    out = {"build_s": build_s, "units": units, "segments_per_unit": per_unit, "segments": len(every),
           "entries": sum(s.record_count for s in every), "bytes": sum(s.size_bytes for s in every),
           "checkpoints_retained": len(table.list_checkpoints())}
    table.close()
    return out


# Ours: measures ---------------------------------------------------------------------------


def _timed(fn: Callable[[], Any], repeat: int, warmup: bool = False) -> tuple[dict, Any]:
    """Run ``fn`` ``repeat`` times (after one untimed run with ``warmup``): its best, first and
    every time, and its last result."""
    if warmup:
        fn()
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return {"best_s": min(times), "first_s": times[0], "all_s": times}, out


def _record(measures: dict, name: str, row: str, column: str, how: str, run: Callable[[], tuple[dict, Any]],
            check: Callable[[Any], dict]) -> None:
    """Run one measure into ``measures[name]``; an exception is recorded as its result."""
    base = {"row": row, "column": column, "how": how}
    try:
        timing, out = run()
        checked = check(out)
        measures[name] = {**base, "status": "ok", **timing, **checked}
        if not checked.get("ok", True):
            console.log(f"[red]{name}: wrong result {checked}[/red]")
    except Exception as exc:
        traceback.print_exc()
        console.log(f"[red]{name} failed: {type(exc).__name__}: {exc}[/red]")
        measures[name] = {**base, "status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:500]}"}


def _unavailable(measures: dict, name: str, row: str, column: str, how: str, reason: str) -> None:
    measures[name] = {"row": row, "column": column, "how": how, "status": NOT_AVAILABLE, "reason": reason}


def inspection_module() -> tuple[Any, str | None]:
    """``catalog.inspection`` when it has the functions measured, else (None, why not)."""
    try:
        module = importlib.import_module("catalog.inspection")
    except ImportError as exc:
        return None, f"catalog.inspection cannot be imported ({exc})"
    missing = [f for f in INSPECTION_FUNCTIONS if not callable(getattr(module, f, None))]
    if missing:
        return None, f"catalog.inspection has no {missing}"
    return module, None


def _as_arrow(obj: Any) -> pa.Table:
    """A result (an Arrow table, or anything that converts to one) as an Arrow table."""
    if isinstance(obj, pa.Table):
        return obj
    if isinstance(obj, pa.RecordBatchReader):
        return obj.read_all()
    for method in ("to_arrow", "fetch_arrow_table", "arrow"):
        if hasattr(obj, method):
            return _as_arrow(getattr(obj, method)())
    return pa.table(obj)


def _variable_table(out: Any) -> pa.Table:
    """The count variable's table of a result that is per variable (a dict) or a table."""
    return _as_arrow(out[VARIABLE] if isinstance(out, dict) else out)


def measure_ours(warehouse: str, counts: np.ndarray, checkpoints: int, repeat: int) -> dict:
    from catalog import IcebergStateTable
    from catalog.sql import connect, entries_view
    from statestore import StateStore, StoreConfig

    keys, total, probe = len(counts), int(counts.sum()), f"user-{PROBE}"
    expected_probe = int(counts[PROBE])
    config = StoreConfig(cache_size_bytes_max=8 * 1024**3)

    def open_table() -> Any:
        return IcebergStateTable.open_existing(warehouse=warehouse, table_name=TABLE_NAME)

    open_s = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        table = open_table()
        open_s.append(time.perf_counter() - t0)
        if len(open_s) < repeat:
            table.close()
    out: dict = {"table_open": {"best_s": min(open_s), "first_s": open_s[0], "all_s": open_s}, "measures": {}}
    m = out["measures"]

    def check_all(row: Any) -> dict:
        n, s = int(row[0]), int(row[1])
        return {"rows": n, "sum": s, "ok": n == keys and s == total}

    def check_key(rows: list) -> dict:  # rows of the entries view or the state view, the value last
        value = rows[0][-1] if rows else None
        return {"rows": len(rows), "value": value, "ok": len(rows) == 1 and value == expected_probe}

    def check_lookup(values: list) -> dict:
        return {"rows": len(values), "value": values[0], "ok": values == [expected_probe]}

    def check_history(rows: list) -> dict:  # every entry of the key, oldest first: counts 1, 2, ...
        values = [r[-1] for r in rows]
        return {"rows": len(rows), "ok": values == list(range(1, expected_probe + 1))}

    # (a) SQL views ------------------------------------------------------------------------
    all_sql = f'SELECT count(*), sum({VALUE}) FROM state_{VARIABLE}'
    key_where = f"\"user\" = '{probe}' AND state = '{VARIABLE}'"
    columns = f'key_group, "user", state, op, checkpoint_id, seq, {VALUE}'
    key_sql = f"SELECT {columns} FROM entries WHERE {key_where} ORDER BY checkpoint_id DESC, seq DESC LIMIT 1"
    history_sql = f"SELECT {columns} FROM entries WHERE {key_where} ORDER BY checkpoint_id, seq"

    def connect_and_count() -> Any:
        con = connect(table)
        try:
            return con.execute(all_sql).fetchone()
        finally:
            con.close()

    _record(m, "views_all", "all", "views", f"connect(table) + {all_sql}",
            lambda: _timed(connect_and_count, repeat), check_all)
    con = connect(table)
    _record(m, "views_all_warm", "all_warm", "views", f"{all_sql} on an open connection",
            lambda: _timed(lambda: con.execute(all_sql).fetchone(), repeat, warmup=True), check_all)

    def fresh_entries(sql: str) -> Callable[[], list]:
        def run() -> list:
            # a fresh (confined) connection holding the entries view alone
            return entries_view(table, view_name="entries").query("q", sql).fetchall()
        return run

    _record(m, "views_key", "key", "views", f"entries_view(table) + {key_sql}",
            lambda: _timed(fresh_entries(key_sql), repeat), check_key)
    state_key_sql = f"SELECT \"user\", checkpoint_id, {VALUE} FROM state_{VARIABLE} WHERE \"user\" = '{probe}'"
    _record(m, "views_key_warm", "key_warm", "views", f"{state_key_sql} on an open connection",
            lambda: _timed(lambda: con.execute(state_key_sql).fetchall(), repeat, warmup=True), check_key)
    _record(m, "views_history", "history", "views", f"entries_view(table) + {history_sql}",
            lambda: _timed(fresh_entries(history_sql), repeat), check_history)
    _record(m, "views_history_warm", "history_warm", "views", f"{history_sql} on an open connection",
            lambda: _timed(lambda: con.execute(history_sql).fetchall(), repeat, warmup=True), check_history)
    con.close()

    # (a') catalog.inspection --------------------------------------------------------------
    inspection, reason = inspection_module()
    out["inspection_available"], out["inspection_reason"] = inspection is not None, reason
    how = {"all": f'live_state(table, "{VARIABLE}")', "key": f'key_state(table, {{"user": "{probe}"}})',
           "history_batches": f'key_history(table, {{"user": "{probe}"}})'}
    if inspection is None:
        console.log(f"[yellow]catalog.inspection: {NOT_AVAILABLE} ({reason})[/yellow]")
        for row, text in how.items():
            _unavailable(m, f"inspection_{row}", row, "inspection", text, reason)
    else:
        def check_live(result: Any) -> dict:
            t = _variable_table(result)
            s = int(pc.sum(t.column(VALUE)).as_py() or 0)
            return {"rows": t.num_rows, "sum": s, "ok": t.num_rows == keys and s == total}

        def check_key_state(result: Any) -> dict:
            t = _variable_table(result)
            value = t.column(VALUE)[0].as_py() if t.num_rows else None
            return {"rows": t.num_rows, "value": value, "ok": t.num_rows == 1 and value == expected_probe}

        def check_key_history(result: Any) -> dict:
            t = _variable_table(result)
            values = t.column(VALUE).to_pylist()
            # one row per retained checkpoint (all are retained), the probe's count at each
            return {"rows": t.num_rows, "ok": values == list(range(1, checkpoints + 1))}

        _record(m, "inspection_all", "all", "inspection", how["all"],
                lambda: _timed(lambda: inspection.live_state(table, VARIABLE), repeat), check_live)
        _record(m, "inspection_key", "key", "inspection", how["key"],
                lambda: _timed(lambda: inspection.key_state(table, {"user": probe}), repeat), check_key_state)
        _record(m, "inspection_history_batches", "history_batches", "inspection", how["history_batches"],
                lambda: _timed(lambda: inspection.key_history(table, {"user": probe}), repeat), check_key_history)

    # (b) the store's batched API ----------------------------------------------------------
    every_group = range(MAX_PARALLELISM)

    def store_count(store: Any) -> tuple[int, int]:
        view = store.live_view(VARIABLE, every_group)
        return view.height, int(view.get_column(COUNT.value_column).sum())

    stores: list = []

    def fresh_store_all() -> tuple[int, int]:
        stores[:] = [StateStore(table, config=config)]  # one task owning every key group
        return store_count(stores[0])

    _record(m, "store_all", "all", "store", "StateStore(table).live_view(count, every key group)",
            lambda: _timed(fresh_store_all, repeat), check_all)
    _record(m, "store_all_warm", "all_warm", "store", "the same store's live_view again",
            lambda: _timed(lambda: store_count(stores[0]), repeat), check_all)
    for store in stores:
        store.close()

    def scan() -> tuple[int, int]:
        view = StateStore(table, config=config).scan(VARIABLE)
        return view.height, int(view.get_column(COUNT.value_column).sum())

    _record(m, "store_all_scan", "all_scan", "store", "StateStore(table).scan(count)",
            lambda: _timed(scan, repeat), check_all)
    probe_keys = user_keys(np.array([PROBE]))

    def fresh_store_key() -> list:
        stores[:] = [StateStore(table, config=config)]
        return stores[0].get_state(COUNT).get_batch(probe_keys).to_pylist()

    _record(m, "store_key", "key", "store", "StateStore(table).get_state(count).get_batch(1 key)",
            lambda: _timed(fresh_store_key, repeat), check_lookup)
    _record(m, "store_key_warm", "key_warm", "store", "the same store's get_batch(1 key) again",
            lambda: _timed(lambda: stores[0].get_state(COUNT).get_batch(probe_keys).to_pylist(), repeat),
            check_lookup)
    for store in stores:
        store.close()
    _unavailable(m, "store_history", "history", "store", "-",
                 "the store reads the newest state only: it has no history API")
    table.close()
    return out


# Spark ------------------------------------------------------------------------------------


def write_spark_input(folder: Path, batches: list[np.ndarray]) -> None:
    """One Parquet file per batch (``benchmarks.streaming.impl.SOURCE_SCHEMA``: key, value), with
    strictly increasing modification times: the file source takes new files in that order."""
    folder.mkdir(parents=True)
    base = time.time() - 3600
    for b in progress(range(len(batches)), f"Spark input: {len(batches)} files"):
        ids = batches[b]
        path = folder / f"part-{b:05d}.parquet"
        pq.write_table(pa.table({"key": user_keys(ids).column("user"), "value": pa.array(ids, pa.int64())}), path)
        os.utime(path, (base + b, base + b))


def run_spark(root: Path, batches: list[np.ndarray], counts: np.ndarray, repeat: int, driver_memory: str,
              timeout_s: float, history_batches: bool) -> dict:
    """Build Spark's peer state and measure its reader in a fresh process (``--spark-job``)."""
    write_spark_input(root / "spark-input", batches)
    job = {"source": str(root / "spark-input"), "checkpoint": str(root / "spark-checkpoint"),
           "scratch": str(root / "spark-scratch"), "driver_memory": driver_memory, "repeat": repeat,
           "batches": len(batches), "probe": f"user-{PROBE}", "history_batches": history_batches,
           "result": str(root / "spark-result.json")}
    job_path = root / "spark-job.json"
    job_path.write_text(json.dumps(job))
    log = root / "spark-log.txt"
    console.log(f"Spark: transformWithState over {len(batches)} micro-batches, then its state reader (log: {log})")
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_inspect", "--spark-job", str(job_path)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=repo_env(),
                                start_new_session=True)
        try:
            for _ in progress(_committed_batches(proc, Path(job["checkpoint"]), len(batches), t0 + timeout_s),
                              f"Spark: {len(batches)} micro-batches"):
                pass
            console.log("Spark: measuring its state reader")
            proc.wait(timeout=max(1.0, t0 + timeout_s - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the job and the JVM it started
            proc.wait()
            return {"status": "error", "reason": f"timed out after {timeout_s:.0f} s", "log": str(log)}
    result_path = Path(job["result"])
    if not result_path.exists():
        return {"status": "error", "reason": f"exited {proc.returncode} without a result: {log.read_text()[-1500:]}"}
    result = json.loads(result_path.read_text())
    result["process_s"] = time.perf_counter() - t0
    if "error" in result:
        return {"status": "error", "reason": result["error"]}
    _check_spark(result, counts, len(batches))
    return {"status": "ok", **result}


def _committed_batches(proc: subprocess.Popen, checkpoint: Path, batches: int, deadline: float) -> Iterator[int]:
    """Yield each batch id as the query commits it (its file in ``commits/``), until every batch
    is committed, the job ends or the deadline passes."""
    for b in range(batches):
        while not (checkpoint / "commits" / str(b)).exists():
            if proc.poll() is not None or time.perf_counter() > deadline:
                return
            time.sleep(0.5)
        yield b


def _check_spark(result: dict, counts: np.ndarray, batches: int) -> None:
    """Mark each Spark measure ok when its result is what the input implies."""
    m = result["measures"]
    keys, total, expected = len(counts), int(counts.sum()), int(counts[PROBE])
    if "spark_all" in m:
        m["spark_all"]["ok"] = m["spark_all"]["rows"] == keys and m["spark_all"]["sum"] == total
    if "spark_key" in m:
        m["spark_key"]["ok"] = m["spark_key"]["value"] == expected
    if "spark_changefeed" in m:
        m["spark_changefeed"]["ok"] = m["spark_changefeed"]["values"] == list(range(1, expected + 1))
    if "spark_history_batches" in m:
        m["spark_history_batches"]["ok"] = m["spark_history_batches"]["values"] == list(range(1, batches + 1))
    for name, measure in m.items():
        if not measure.get("ok", True):
            console.log(f"[red]{name}: wrong result {measure}[/red]")


def spark_job(job_path: Path) -> None:
    """The Spark process: run the job in ``job_path``, write its result (an error is one too)."""
    job = json.loads(job_path.read_text())
    try:
        result = _spark_build_and_read(job)
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc)[:3000]}"}
    Path(job["result"]).write_text(json.dumps(result, indent=1, default=str))


def _spark_build_and_read(job: dict) -> dict:
    from pyspark.sql import functions as F

    from benchmarks.streaming.impl import OUTPUT_SCHEMA, SOURCE_SCHEMA
    from benchmarks.streaming.processors import CountProcessor
    from benchmarks.streaming.session import PROVIDER_CONF, ROCKSDB, spark_machine_info, spark_session

    spark = spark_session({"impl": "inspect-tws-rows", "driver_memory": job["driver_memory"],
                           "scratch": job["scratch"]}, ROCKSDB)
    spark.conf.set(CHANGELOG_CONF, "true")
    checkpoint, probe, repeat = job["checkpoint"], job["probe"], job["repeat"]
    source = spark.readStream.schema(SOURCE_SCHEMA).option("maxFilesPerTrigger", 1).parquet(job["source"])
    out = source.groupBy("key").transformWithState(CountProcessor(), OUTPUT_SCHEMA, outputMode="Update",
                                                   timeMode="None")
    t0 = time.perf_counter()
    query = (out.writeStream.format("noop").outputMode("update").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    build_s = time.perf_counter() - t0
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    progress_batches = [p for p in query.recentProgress if p.numInputRows > 0]
    meta = spark.read.format("state-metadata").load(checkpoint).first()
    first_batch, last_batch = int(meta["minBatchId"]), int(meta["maxBatchId"])
    state_files = sum(len(files) for _, _, files in os.walk(Path(checkpoint) / "state"))

    def reader(**options: Any) -> Any:
        r = spark.read.format("statestore").option("path", checkpoint).option("stateVarName", VARIABLE)
        for k, v in options.items():
            r = r.option(k, v)
        return r.load()

    is_probe = F.col("key.key") == probe
    measures: dict = {}

    def run(name: str, row: str, how: str, fn: Callable[[], Any], times: int, digest: Callable[[Any], dict]) -> None:
        timing, result = _timed(fn, times)
        measures[name] = {"row": row, "column": "spark", "how": how, "status": "ok", **timing, **digest(result)}

    run("spark_all", "all", 'read.format("statestore").option("stateVarName", "count"): count(*), sum(value.count)',
        lambda: reader().agg(F.count(F.lit(1)).alias("n"), F.sum("value.count").alias("s")).first(), repeat,
        lambda r: {"rows": int(r["n"]), "sum": int(r["s"])})
    run("spark_key", "key", "the reader filtered to key.key",
        lambda: reader().filter(is_probe).collect(), repeat,
        lambda rows: {"rows": len(rows), "value": rows[0]["value"]["count"] if rows else None})
    run("spark_changefeed", "history",
        f"the reader with readChangeFeed, changeStartBatchId {first_batch}, filtered to key.key",
        lambda: reader(readChangeFeed="true", changeStartBatchId=first_batch).filter(is_probe)
        .orderBy("batch_id").collect(), repeat,
        lambda rows: {"rows": len(rows), "values": [r["value"]["count"] for r in rows]})
    if job["history_batches"]:
        run("spark_history_batches", "history_batches",
            f"the reader with batchId b filtered to key.key, for each b in [{first_batch}, {last_batch}] (run once)",
            lambda: [row for b in range(first_batch, last_batch + 1)
                     for row in reader(batchId=b).filter(is_probe).collect()], 1,
            lambda rows: {"rows": len(rows), "values": [r["value"]["count"] for r in rows],
                          "reads": last_batch - first_batch + 1})
    info = spark_machine_info()
    conf = {PROVIDER_CONF: ROCKSDB, CHANGELOG_CONF: spark.conf.get(CHANGELOG_CONF)}
    spark.stop()
    return {"machine": info, "conf": conf, "query": "transformWithState (rows), CountProcessor, ValueState count",
            "build_s": build_s, "batches": len(progress_batches), "retained_batches": [first_batch, last_batch],
            "partitions": int(meta["numPartitions"]), "state_files": state_files, "measures": measures}


# Report -----------------------------------------------------------------------------------


def derive(results: dict) -> list[dict]:
    """The report's rows: per row each column's measure and Spark's time over ours (speedup)."""
    measures = {**results["ours"]["measures"], **(results.get("spark") or {}).get("measures", {})}
    rows = []
    for row, (label, spark_ref) in ROWS.items():
        cells = {c: next((dict(name=n, **m) for n, m in measures.items() if m["row"] == row and m["column"] == c),
                         None) for c in COLUMNS}
        if not any(cells.values()):
            continue
        spark = measures.get(spark_ref, {}).get("best_s")
        speedup = {c: ratio(spark, cell.get("best_s")) for c, cell in cells.items()
                   if cell and c != "spark" and cell.get("best_s")}
        rows.append({"row": row, "label": label, "spark_reference": spark_ref, "cells": cells,
                     "spark_over_ours": speedup})
    return rows


def _seconds(cell: dict | None) -> str:
    if cell is None:
        return ""
    if cell.get("status") != "ok":
        return f"[yellow]{cell['status']}[/yellow]"
    s = cell["best_s"]
    text = f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"
    return text if cell.get("ok", True) else f"[red]{text} (wrong)[/red]"


def report(results: dict) -> None:
    ours = results["ours"]
    t = Table(title=f"inspection of a {results['config']['keys']:,}-key state, "
                    f"{ours['build']['segments_per_unit']} segments per unit "
                    f"(best of {results['config']['repeat']}; speedup = Spark's time / ours)")
    t.add_column("measure")
    for label in COLUMNS.values():
        t.add_column(label, justify="right")
    t.add_column("speedup vs Spark", justify="right")
    short = {"views": "views", "inspection": "insp.", "store": "store"}
    for r in results["rows"]:
        speedup = ", ".join(f"{short[c]} {v:.1f}x" for c, v in r["spark_over_ours"].items() if v)
        t.add_row(r["label"], *(_seconds(r["cells"][c]) for c in COLUMNS), speedup)
    console.print(t)
    console.print(f"ours: table open {ours['table_open']['best_s'] * 1e3:.0f} ms (not in the figures); build "
                  f"{ours['build']['build_s']:.1f} s, {ours['build']['segments']} segments, "
                  f"{ours['build']['entries']:,} entries")
    spark = results["spark"]
    if spark.get("status") == "ok":
        console.print(f"Spark: build {spark['build_s']:.1f} s over {spark['batches']} micro-batches, "
                      f"{spark['state_files']} files in its state folder, batches {spark['retained_batches']} retained")
    else:
        console.print(f"Spark: {spark.get('status')} ({spark.get('reason', '')[:300]})")
    for name, m in {**ours["measures"], **spark.get("measures", {})}.items():
        if m.get("status") not in ("ok", None):
            console.print(f"  {name}: {m['status']}: {m.get('reason', '')}")


def plot(results: dict, path: Path) -> None:
    bars = [(f"{r['label']}\n{COLUMNS[c]}", cell["best_s"], c)
            for r in results["rows"] for c, cell in r["cells"].items()
            if cell and cell.get("status") == "ok" and cell.get("best_s")]
    colors = {"views": "C0", "inspection": "C2", "store": "C1", "spark": "C3"}
    fig, ax = pyplot().subplots(figsize=(11, 0.42 * len(bars) + 1.6))
    y = np.arange(len(bars))[::-1]
    ax.barh(y, [b[1] for b in bars], color=[colors[b[2]] for b in bars])
    ax.set_yticks(y, [b[0] for b in bars], fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (best of N, log scale)")
    for yi, (_, seconds, _) in zip(y, bars, strict=True):
        ax.text(seconds, yi, f" {seconds * 1e3:,.1f} ms" if seconds < 1 else f" {seconds:,.2f} s",
                va="center", fontsize=7)
    ax.legend(handles=[pyplot().Rectangle((0, 0), 1, 1, color=colors[c]) for c in COLUMNS],
              labels=list(COLUMNS.values()), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4,
              frameon=False)
    ax.set_xlim(right=max(b[1] for b in bars) * 4)  # room for the labels
    cfg, build = results["config"], results["ours"]["build"]
    ax.set_title(f"inspection: {cfg['keys']:,} keys, {cfg['checkpoints']} checkpoints/batches, "
                 f"~{int(np.mean(build['segments_per_unit']))} segments per unit", fontsize=10, pad=24)
    save_figure(fig, path, dpi=110)


# Command line -----------------------------------------------------------------------------


def main(
    quick: bool = typer.Option(False, help="20k keys, 10 checkpoints"),
    keys: int = typer.Option(2_000_000, help="keys of the state"),
    checkpoints: int = typer.Option(50, help="checkpoints of ours, micro-batches of Spark's"),
    repeat: int = typer.Option(3, help="runs of each measure (the best is reported)"),
    tasks: int = typer.Option(4, help="task stores writing ours (one unit each)"),
    update_share: float = typer.Option(0.002, help="share of the keys updated by each checkpoint/batch"),
    skip_spark: bool = typer.Option(False, help="measure ours alone"),
    spark_history_batches: bool = typer.Option(True, help="also read Spark's state at every retained batch"),
    driver_memory: str = typer.Option("3g", help="spark.driver.memory"),
    spark_timeout: float = typer.Option(3600, help="seconds before the Spark process is killed"),
    seed: int = typer.Option(7),
    keep: bool = typer.Option(False, help="keep the work directory"),
    spark_job_path: Path | None = typer.Option(None, "--spark-job", hidden=True, help="internal: the Spark process"),
) -> None:
    if spark_job_path is not None:
        spark_job(spark_job_path)
        return
    if quick:
        keys, checkpoints = 20_000, 10
    root = Path(tempfile.mkdtemp(prefix="bench_inspect_"))
    batches = make_batches(keys, checkpoints, update_share, seed)
    counts = final_counts(keys, batches)
    config = {"keys": keys, "checkpoints": checkpoints, "repeat": repeat, "tasks": tasks,
              "max_parallelism": MAX_PARALLELISM, "update_share": update_share, "seed": seed,
              "probe_key": f"user-{PROBE}", "events": int(counts.sum()), "quick": quick}
    try:
        results: dict = {"machine": machine_info(), "config": config, "ours": {}}
        warehouse = str(root / "warehouse")
        build = build_ours(warehouse, batches, keys, tasks)
        console.log(f"ours: {build['units']} units, segments per unit {build['segments_per_unit']}")
        busy = machine_busy_fraction(1.0)
        results["ours"] = {"build": build, "machine_busy_before": busy,
                           **measure_ours(warehouse, counts, checkpoints, repeat)}
        if skip_spark:
            results["spark"] = {"status": "skipped", "reason": "--skip-spark"}
        else:
            results["spark"] = {"machine_busy_before": machine_busy_fraction(1.0),
                                **run_spark(root, batches, counts, repeat, driver_memory, spark_timeout,
                                            spark_history_batches)}
    finally:
        if keep:
            console.log(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    results["rows"] = derive(results)
    stem = "bench_inspect_quick" if quick else "bench_inspect"
    write_results(f"{stem}.json", results, default=str)
    plot(results, results_path(f"{stem}.png"))
    report(results)


if __name__ == "__main__":
    typer.run(main)
