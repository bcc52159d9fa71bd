"""The main job: a real PySpark streaming query whose state lives in an Iceberg table.

A stream of page views (``user``, ``page``, ``ts``) arrives as Parquet files. Two stateful
queries run on it with the embedded default (local Spark, a SQLite Iceberg catalog, a
local warehouse directory):

* ``UserActivity``, a processor written for Spark's own ``transformWithState`` (value, list
  and map state per user), running unchanged on the disaggregated store, with its output
  rows committed exactly once to the Iceberg table ``demo.user_activity``;
* the vectorized ``RunningAggregate("count")`` per page.

The job runs the first batches with 2 tasks, stops, and restarts with 4 tasks on more input
(a rescale: no state is copied), then checks every user's and page's state against an
independent tally of the input, reads the state back with ``spark.read.format("icestate")``
and with DuckDB SQL, and prints the checkpoints.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import Row, SparkSession
from pyspark.sql.streaming import StatefulProcessor
from rich.console import Console
from rich.table import Table

from catalog.sql import connect
from catalog.table_ref import TableRef
from spark_integration.location import StateLocation
from spark_integration.query import runner_of, start_stateful_query
from spark_integration.vectorized import RunningAggregate

USERS_TABLE = "demo_user_activity"
PAGES_TABLE = "demo_page_views"
OUTPUT_TABLE = "demo.user_activity"
INPUT_SCHEMA = "user string, page string, ts timestamp"
ACTIVITY_OUTPUT = "user string, events long, last_pages string, distinct_pages int, top_page string"


class UserActivity(StatefulProcessor):
    """Per user: events so far, the last 3 pages, and views per page (a Spark processor)."""

    def init(self, handle) -> None:
        self.events = handle.getValueState("events", "n long")
        self.recent = handle.getListState("recent_pages", "page string")
        self.pages = handle.getMapState("page_views", "page string", "views long")

    def handleInputRows(self, key, rows, timerValues):
        pages = [r.page for r in sorted(rows, key=lambda r: (r.ts, r.page))]
        old = self.events.get()
        events = (old[0] if old else 0) + len(pages)
        self.events.update((events,))
        self.recent.appendList([(p,) for p in pages])
        recent = [p for (p,) in self.recent.get()][-3:]
        self.recent.put([(p,) for p in recent])
        for p in pages:
            seen = self.pages.getValue((p,))
            self.pages.updateValue((p,), ((seen[0] if seen else 0) + 1,))
        views = {k[0]: v[0] for k, v in self.pages.iterator()}
        top = max(sorted(views), key=lambda p: views[p])
        yield Row(user=key[0], events=events, last_pages=",".join(recent), distinct_pages=len(views), top_page=top)

    def close(self) -> None:
        pass


@dataclass
class StreamDemoResult:
    batches: int
    events: int
    users_verified: int
    pages_verified: int
    seconds: float


def _write_input(directory: str, first: int, count: int, events: int, users: int, pages: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    start = np.datetime64("2026-11-01T00:00:00", "ms")
    for b in range(first, first + count):
        u = rng.zipf(1.3, events) % users
        p = rng.integers(0, pages, events)
        ts = start + np.arange(b * events, (b + 1) * events) * np.timedelta64(10, "ms")
        table = pa.table({"user": pa.array([f"user-{i:06d}" for i in u]),
                          "page": pa.array([f"/page/{i:03d}" for i in p]),
                          "ts": pa.array(ts, pa.timestamp("us"))})
        pq.write_table(table, os.path.join(directory, f"views-{b:05d}.parquet"))


def _session(console: Console) -> SparkSession:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    console.print("[dim]starting local Spark (local[2])...[/dim]")
    spark = (SparkSession.builder.master("local[2]").appName("icestate-main-job")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "4").config("spark.sql.session.timeZone", "UTC")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _fresh(warehouse: str, work: str) -> None:
    """The demo starts from nothing: drop its tables and its input and checkpoints."""
    shutil.rmtree(work, ignore_errors=True)
    catalog = TableRef(USERS_TABLE, warehouse=warehouse).catalog()  # the catalog of all three tables
    try:
        for identifier in (f"state.{USERS_TABLE}", f"state.{PAGES_TABLE}", OUTPUT_TABLE):
            if catalog.table_exists(identifier):
                location = catalog.load_table(identifier).location()
                catalog.drop_table(identifier)
                shutil.rmtree(location.removeprefix("file://"), ignore_errors=True)
    finally:
        catalog.close()


def run_stream_demo(warehouse: str, *, users: int = 20_000, pages: int = 200, events_per_batch: int = 100_000,
                    batches: tuple[int, int] = (3, 2), parallelism: tuple[int, int] = (2, 4),
                    max_parallelism: int = 128, console: Console | None = None) -> StreamDemoResult:
    console = console or Console()
    started = time.perf_counter()
    warehouse = os.path.abspath(warehouse)
    work = os.path.join(warehouse, "_demo")
    input_dir, checkpoints = os.path.join(work, "input"), os.path.join(work, "checkpoints")
    _fresh(warehouse, work)
    spark = _session(console)
    try:
        from spark_integration.datasource import register

        register(spark)
        os.makedirs(input_dir, exist_ok=True)
        stream = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).parquet(input_dir)
        phases = Table(title="micro-batches")
        for col in ("phase", "query", "tasks", "batches", "events", "seconds", "events/s"):
            phases.add_column(col, justify="right")
        written = 0
        for phase, (count, p) in enumerate(zip(batches, parallelism, strict=True), start=1):
            _write_input(input_dir, written, count, events_per_batch, users, pages, seed=written)
            written += count
            for name, processor, keys, table, extra in (
                ("UserActivity (Spark API)", UserActivity(), ["user"], USERS_TABLE,
                 {"output_schema": ACTIVITY_OUTPUT, "output_table": OUTPUT_TABLE}),
                ("RunningAggregate (vectorized)", RunningAggregate("count", output_column="views"), ["page"],
                 PAGES_TABLE, {}),
            ):
                location = StateLocation(table=table, warehouse=warehouse, parallelism=p,
                                         max_parallelism=max_parallelism)
                t0 = time.perf_counter()
                query = start_stateful_query(stream, keys, processor, location=location,
                                             checkpoint_location=os.path.join(checkpoints, table),
                                             trigger={"availableNow": True}, **extra)
                query.awaitTermination()
                if query.exception() is not None:
                    raise RuntimeError(f"{name} failed: {query.exception()}")
                seconds = time.perf_counter() - t0
                done = [r for r in runner_of(query).reports if not r.skipped]
                events = count * events_per_batch
                phases.add_row(str(phase), name, str(p), str(len(done)), f"{events:,}", f"{seconds:.1f}",
                               f"{events / seconds:,.0f}")
                runner_of(query).close()
            console.print(f"phase {phase}: {count} batch(es) with {p} tasks done"
                          + (" (rescaled: state not copied)" if phase > 1 else ""))
        console.print(phases)
        users_ok, pages_ok = _verify(spark, warehouse, input_dir, console)
        _show(spark, warehouse, console)
        total = sum(batches) * events_per_batch
        return StreamDemoResult(sum(batches), total, users_ok, pages_ok, time.perf_counter() - started)
    finally:
        spark.stop()


def _verify(spark: SparkSession, warehouse: str, input_dir: str, console: Console) -> tuple[int, int]:
    """Every user's and page's state against an independent tally of the input files."""
    views = pl.read_parquet(os.path.join(input_dir, "*.parquet"))
    want_users = dict(views.group_by("user").len().iter_rows())
    want_pages = dict(views.group_by("page").len().iter_rows())
    got_users = {r.user: r.v_events.n for r in spark.read.format("icestate").option("warehouse", warehouse)
                 .option("table", USERS_TABLE).option("state", "events").load().collect()}
    table = TableRef(PAGES_TABLE, warehouse=warehouse).open()
    try:
        got_pages = dict(connect(table).sql("SELECT page, v_count FROM state_count").fetchall())
    finally:
        table.close()
    if got_users != want_users:
        bad = [u for u in want_users if got_users.get(u) != want_users[u]][:5]
        raise AssertionError(f"user state differs from the input tally, e.g. {bad}")
    if got_pages != want_pages:
        raise AssertionError("page view counts differ from the input tally")
    catalog = TableRef(USERS_TABLE, warehouse=warehouse).catalog()  # the output table is in it too
    try:
        out = pl.from_arrow(catalog.load_table(OUTPUT_TABLE).scan().to_arrow())
    finally:
        catalog.close()
    final = dict(out.group_by("user").agg(pl.col("events").max()).iter_rows())
    if final != want_users:
        raise AssertionError("the output table's last counts differ from the input tally")
    console.print(f"[green]verified[/green]: {len(want_users):,} users (read with spark.read.format('icestate')), "
                  f"{len(want_pages):,} pages (DuckDB SQL), {out.height:,} output rows, each batch once")
    return len(want_users), len(want_pages)


def _show(spark: SparkSession, warehouse: str, console: Console) -> None:
    top = (spark.read.format("icestate").option("warehouse", warehouse).option("table", USERS_TABLE)
           .option("state", "events").load().orderBy("v_events.n", ascending=False).limit(5).collect())
    t = Table(title="top users (spark.read.format('icestate'))")
    t.add_column("user")
    t.add_column("events", justify="right")
    t.add_column("key group", justify="right")
    for r in top:
        t.add_row(r.user, f"{r.v_events.n:,}", str(r.key_group))
    console.print(t)
    table = TableRef(USERS_TABLE, warehouse=warehouse).open()
    try:
        c = Table(title=f"checkpoints of state.{USERS_TABLE} (Iceberg snapshots)")
        for col in ("checkpoint", "batch", "tasks", "snapshot"):
            c.add_column(col, justify="right")
        for info in table.list_checkpoints():
            c.add_row(str(info.checkpoint_id), str(info.batch_id), str(info.parallelism), str(info.snapshot_id))
        console.print(c)
    finally:
        table.close()
    console.print(f"inspect with SQL: .venv/bin/icestate sql --warehouse {warehouse} --table {USERS_TABLE} "
                  "\"SELECT user, v_events.n FROM state_events ORDER BY 2 DESC LIMIT 5\"")
