"""Async processors against the synchronous runner, with the state on S3 and a small cache.

A per-user processor keeps a map state per user (``--users`` users with ``--items`` entries
each); each event reads one entry and writes it back (``getValue`` then ``updateValue``). The
same logic runs as a processor with plain handlers (``compat.run_processor``, the runner of
``api="row"``: one batched read of every key of the batch before the first handler) and with
coroutine handlers (``async_processor.run_async_processor``: reads on demand, batched per
tick, read on I/O threads while other keys run). One task (parallelism 1) runs ``--batches``
micro-batches of ``--events`` events (users uniform) after ``--warmup`` unmeasured ones; each
batch is the runner, the output rows to Arrow and the checkpoint (flush and commit), as a
task and its driver do.

Variants, each runner on its own copy of the state (a fork of the built table: no byte copied):

- ``local, cached``: the table on local disk, the view cache unbounded and every key group
  loaded before the first batch (the fully cached run, and its CPU per event);
- ``local, small cache``: the same table on local disk with the S3 runs' view cache (below):
  what the small cache costs, apart from the storage;
- ``s3, small cache``: the table on moto's S3 server behind our proxy adding ``--latency-ms``
  per request; the view cache ``--cache-fraction`` of the resolved state, cold at the first
  batch, and the local file cache of whole segments (``--file-cache``): the store's default
  (``default``: 1 GiB, what a user gets), ``--cache-fraction`` of the table's segment bytes
  (``small``) or none (``off``: every read of a row group goes to S3).

Reported: events/s of the median batch, CPU seconds per 1k events, requests and bytes read per
batch, and the ratios of the targets: async on S3 / async local cached (Flink's figure for
ForSt: 0.75), async on S3 / sync on S3 (3), CPU per event async / sync when cached (1.3), and
async on S3 / async on local disk with the same small cache (what S3 itself costs).
Writes ``bench_async.json`` and ``bench_async.png`` to the results folder (``--out``).
Run: ``.venv/bin/python -m benchmarks.bench_async`` (``--quick``: 50k users).
"""

from __future__ import annotations

import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import typer
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, TimerValues
from pyspark.sql.types import IntegerType, LongType, StructField, StructType
from rich.table import Table

from benchmarks.harness import console, fmt, machine_info, progress, pyplot, results_path, save_figure, write_results
from catalog import IcebergStateTable, TableRef
from spark_integration.async_processor import AsyncOptions, ControllerStats, run_async_processor
from spark_integration.compat import declare, rows_to_arrow, run_processor
from statestore import StateLayout, StateStore, StoreConfig, assign_key_groups
from statestore.file_cache import close_process_file_caches
from tests import s3_server
from tests.net_proxy import NetProxy

MAX_PARALLELISM = 128
BUCKET = "icestate-async"
TABLE = "baskets"
KEY_SCHEMA = pa.schema([("user", pa.string())])
ITEM = StructType([StructField("item", IntegerType())])
COUNT = StructType([StructField("n", LongType())])
OUTPUT = pa.schema([("user", pa.string()), ("item", pa.int32()), ("n", pa.int64())])


class Items(StatefulProcessor):
    """Counts per (user, item) in a map state per user; emits each event's new count."""

    def init(self, handle) -> None:
        self.items = handle.getMapState("items", ITEM, COUNT)

    def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            old = self.items.getValue((row.item,))
            n = (old[0] if old else 0) + 1
            self.items.updateValue((row.item,), (n,))
            yield (key[0], row.item, n)

    def close(self) -> None:
        pass


class AsyncItems(Items):
    async def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            old = await self.items.getValue((row.item,))
            n = (old[0] if old else 0) + 1
            self.items.updateValue((row.item,), (n,))
            yield Row(user=key[0], item=row.item, n=n)


def layout() -> StateLayout:
    return StateLayout.of(KEY_SCHEMA, list(declare(Items()).descriptors), max_parallelism=MAX_PARALLELISM)


def user_names(ids: np.ndarray) -> pa.Array:
    return pa.array(np.char.add("u", ids.astype(str)))


def build(table: IcebergStateTable, users: int, items: int, checkpoints: int) -> None:
    """Every user's map of ``items`` entries (item i holds i), over ``checkpoints`` checkpoints."""
    store = StateStore(table, config=StoreConfig(file_cache_mode="off"))
    state = store.get_state("items")
    chunk = -(-users // checkpoints)
    for lo in progress(range(0, users, chunk), f"building {users:,} users x {items} items"):
        ids = np.repeat(np.arange(lo, min(lo + chunk, users)), items)
        item = np.tile(np.arange(items, dtype=np.int32), len(ids) // items)
        state.put_batch(pa.table({"user": user_names(ids)}),
                        pa.StructArray.from_arrays([pa.array(item, pa.int32())], names=["item"]),
                        pa.StructArray.from_arrays([pa.array(item.astype(np.int64), pa.int64())], names=["n"]))
        store.checkpoint()
    store.close()


def events(rng: np.random.Generator, users: int, items: int, n: int) -> tuple[pa.Table, np.ndarray]:
    ids = rng.integers(0, users, n)
    rows = pa.table({"user": user_names(ids), "item": pa.array(rng.integers(0, items, n), pa.int32())})
    return rows, assign_key_groups(rows.select(["user"]), MAX_PARALLELISM).astype(np.int64)


def run_variant(ref: TableRef, config: StoreConfig, runner: str, *, users: int, items: int, events_n: int,
                batches: int, warmup: int, proxy: NetProxy | None, preload: bool, options: AsyncOptions) -> dict:
    """One runner's batches on the table ``ref``, a fresh store; per-batch figures."""
    table = ref.open(layout())
    store = StateStore(table, config=config)
    if preload:  # every key group's views in the cache: the fully cached run
        store.views("items", range(MAX_PARALLELISM))
    rng = np.random.default_rng(7)
    out: list[dict] = []
    stats = ControllerStats()
    gc.disable()  # as in a task (``tasks._freeze_imports_once``: collections paused while a processor runs)
    try:
        for b in progress(range(warmup + batches), f"{ref.branch}: {runner}"):
            rows, kgs = events(rng, users, items, events_n)
            before = store.stats()
            if proxy is not None:
                proxy.reset()
            c0, t0 = time.process_time(), time.perf_counter()
            if runner == "async":
                result = run_async_processor(AsyncItems(), store, None, rows, kgs, TimerValues(-1, -1), None,
                                             options=options, stats=stats)
            else:
                result = run_processor(Items(), store, None, rows, kgs.tolist(), TimerValues(-1, -1), None)
            output = rows_to_arrow(result, OUTPUT)
            t1 = time.perf_counter()
            store.checkpoint(batch_id=b)
            t2, c2 = time.perf_counter(), time.process_time()
            after = store.stats()
            assert output.num_rows == events_n
            if b >= warmup:
                traffic = proxy.snapshot() if proxy is not None else None
                out.append({"process_s": t1 - t0, "checkpoint_s": t2 - t1, "batch_s": t2 - t0, "cpu_s": c2 - c0,
                            "requests": 0 if traffic is None else traffic.count,
                            "requests_by_method": {} if traffic is None else dict(traffic.by_method),
                            "bytes_read": after["segment_bytes_read"] - before["segment_bytes_read"],
                            "cache_bytes": after["cache_size_bytes"],
                            "file_cache_misses": after["file_cache_misses"] - before["file_cache_misses"]})
            gc.collect()
    finally:
        gc.enable()
        views = store.stats()["cache_size_bytes"]
        store.close()
        table.close()
    med = statistics.median(r["batch_s"] for r in out)
    return {"runner": runner, "batches": out, "events_per_s": events_n / med,
            "process_events_per_s": events_n / statistics.median(r["process_s"] for r in out),
            "cpu_s_per_1k_events": 1000 * statistics.median(r["cpu_s"] for r in out) / events_n,
            "requests_per_batch": statistics.median(r["requests"] for r in out),
            "bytes_read_per_batch": statistics.median(r["bytes_read"] for r in out),
            "views_bytes": views, "controller": stats.__dict__ if runner == "async" else None}


def main(
    users: int = typer.Option(1_000_000, help="users (keys), each with a map state"),
    items: int = typer.Option(20, help="map entries per user"),
    checkpoints: int = typer.Option(8, help="checkpoints the state is built in"),
    events_n: int = typer.Option(20_000, "--events", help="events per micro-batch"),
    batches: int = typer.Option(5, help="measured micro-batches per run"),
    warmup: int = typer.Option(1, help="unmeasured micro-batches first"),
    latency_ms: float = typer.Option(20.0, help="the proxy's latency per S3 request"),
    cache_fraction: float = typer.Option(0.1, help="view and file cache of the S3 runs, as a fraction of the state"),
    quick: bool = typer.Option(False, help="50k users, 5k events per batch"),
    tiny: bool = typer.Option(False, help="2k users (the smoke test)"),
    out: str = typer.Option("bench_async", help="name of the results (.json, .png) in the results folder"),
    max_in_flight_keys: int = typer.Option(AsyncOptions.max_in_flight_keys, help="AsyncOptions of the async runs"),
    max_pending_keys: int = typer.Option(AsyncOptions.max_pending_keys, help="AsyncOptions of the async runs"),
    max_reads_in_flight: int = typer.Option(AsyncOptions.max_reads_in_flight, help="AsyncOptions of the async runs"),
    file_cache: str = typer.Option("default", help="the S3 runs' local file cache: 'small' (--cache-fraction of the "
                                                 "segment bytes), 'default' (StoreConfig's) or 'off'"),
) -> None:
    if quick:
        users, events_n, checkpoints = 50_000, 5_000, 4
    if tiny:
        users, items, events_n, checkpoints, batches, warmup = 2_000, 5, 500, 2, 2, 1
    options = AsyncOptions(max_in_flight_keys=max_in_flight_keys, max_pending_keys=max_pending_keys,
                           max_reads_in_flight=max_reads_in_flight)
    root = Path(tempfile.mkdtemp(prefix="bench_async_"))
    server = s3_server.start(root)
    proxy = NetProxy(server.endpoint).start()
    results: dict[str, Any] = {"machine": machine_info(), "params": {
        "users": users, "items": items, "entries": users * items, "checkpoints": checkpoints, "events": events_n,
        "batches": batches, "warmup": warmup, "latency_ms": latency_ms, "cache_fraction": cache_fraction,
        "async_options": options.__dict__, "file_cache": file_cache}, "runs": {}}
    t_start = time.perf_counter()
    try:
        s3_server.create_bucket(server.endpoint, BUCKET)
        catalog_dir = root / "s3-catalog"
        catalog_dir.mkdir()
        s3_props = {"type": "sql", "uri": f"sqlite:///{catalog_dir}/catalog.db", "init_catalog_tables": "true",
                    "warehouse": f"s3://{BUCKET}/warehouse", **s3_server.properties(proxy.endpoint)}
        refs = {"local": TableRef(TABLE, warehouse=str(root / "local")),
                "s3": TableRef(TABLE, catalog_name="bench_async", catalog_properties=s3_props)}
        for where, ref in refs.items():
            proxy.latency_s = 0.0
            table = ref.open(layout())
            build(table, users, items, checkpoints)
            for runner in ("sync", "async"):
                table.fork(runner)
                table.fork(f"{runner}-small")
            results[f"{where}_segment_bytes"] = sum(s.size_bytes for s in table.segments_at()[1])
            table.close()
        # The fully cached runs first: their views' size sets the small cache.
        for runner in ("sync", "async"):
            close_process_file_caches()
            results["runs"][f"local cached, {runner}"] = run_variant(
                TableRef(TABLE, warehouse=str(root / "local"), branch=runner),
                StoreConfig(cache_size_bytes_max=64 * 1024**3), runner, users=users, items=items, events_n=events_n,
                batches=batches, warmup=warmup, proxy=None, preload=True, options=options)
        views = max(r["views_bytes"] for r in results["runs"].values())
        files = {"small": {"file_cache_bytes_max": max(1, int(results["s3_segment_bytes"] * cache_fraction))},
                 "default": {}, "off": {"file_cache_mode": "off"}}[file_cache]
        small = StoreConfig(cache_size_bytes_max=max(1, int(views * cache_fraction)),
                            file_cache_dir=str(root / "file-cache"), **files)
        # The same small cache on local disk: what the cache's size costs, apart from S3's.
        for runner in ("sync", "async"):
            close_process_file_caches()
            results["runs"][f"local small cache, {runner}"] = run_variant(
                TableRef(TABLE, warehouse=str(root / "local"), branch=f"{runner}-small"), small, runner, users=users,
                items=items, events_n=events_n, batches=batches, warmup=warmup, proxy=None, preload=False,
                options=options)
        proxy.latency_s = latency_ms / 1000
        for runner in ("sync", "async"):
            close_process_file_caches()
            results["runs"][f"s3 small cache, {runner}"] = run_variant(
                TableRef(TABLE, catalog_name="bench_async", catalog_properties=s3_props, branch=runner), small,
                runner, users=users, items=items, events_n=events_n, batches=batches, warmup=warmup, proxy=proxy,
                preload=False, options=options)
        results["views_bytes_full"] = views
        results["small_cache"] = {"views_bytes": small.cache_size_bytes_max, "file_bytes": small.file_cache_bytes_max}
    finally:
        close_process_file_caches()
        proxy.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    runs = results["runs"]

    def rate(name: str) -> float:
        return runs[name]["events_per_s"]

    results["ratios"] = {
        "async_s3_over_local_cached": rate("s3 small cache, async") / rate("local cached, async"),
        "async_s3_over_sync_s3": rate("s3 small cache, async") / rate("s3 small cache, sync"),
        "async_s3_over_local_small_cache": rate("s3 small cache, async") / rate("local small cache, async"),
        "cpu_per_event_async_over_sync_cached": runs["local cached, async"]["cpu_s_per_1k_events"]
        / runs["local cached, sync"]["cpu_s_per_1k_events"],
    }
    results["total_s"] = time.perf_counter() - t_start
    path = write_results(f"{out}.json", results)
    _report(results)
    _plot(results, results_path(f"{out}.png"))
    console.log(f"results in {path}")


def _report(results: dict) -> None:
    t = Table(title=f"async vs sync processors: {results['params']['entries']:,} map entries, "
                    f"{results['params']['events']:,} events per batch")
    for c in ("run", "events/s", "of which processing", "CPU s / 1k events", "requests / batch", "MB read / batch"):
        t.add_column(c, justify="right" if c != "run" else "left")
    for name, r in results["runs"].items():
        t.add_row(name, fmt(r["events_per_s"]), fmt(r["process_events_per_s"]), fmt(r["cpu_s_per_1k_events"], ".3f"),
                  fmt(r["requests_per_batch"]), fmt(r["bytes_read_per_batch"] / 1e6, ".1f"))
    console.print(t)
    for k, v in results["ratios"].items():
        console.print(f"{k}: {v:.2f}")


def _plot(results: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results["runs"])
    axes[0].barh(names, [results["runs"][n]["events_per_s"] for n in names], color="#4878a8")
    axes[0].set_xlabel("events/s (median batch, checkpoint included)")
    axes[1].barh(names, [results["runs"][n]["cpu_s_per_1k_events"] for n in names], color="#a86448")
    axes[1].set_xlabel("CPU s per 1k events")
    fig.suptitle(f"map state of {results['params']['entries']:,} entries; S3 at "
                 f"{results['params']['latency_ms']:g} ms/request, cache {results['params']['cache_fraction']:g}x")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    typer.run(main)
