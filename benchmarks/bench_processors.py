"""Processors against state size, at store level: does a micro-batch cost its own
keys, or the state it is kept in?

One task's share of a micro-batch (task 0 of 4, max parallelism 128) replayed through the
runner Spark's tasks use (``spark_integration.compat.run_processor``, then the output rows to
Arrow and the store's flush, with the cyclic garbage collector paused as in a task), on a
store whose views hold the whole state (the default cache bound is above every size here), for
a processor of each kind of state (``benchmarks.streaming.processors``):

- ``value``: ``CountProcessor`` (one ``ValueState`` per key; the runner batches its reads and
  writes per micro-batch);
- ``list``: ``RecentValuesProcessor`` (a ``ListState`` per key, read and replaced);
- ``map``: ``BucketCountProcessor`` (a ``MapState`` per key, a get and a put per event);
- ``vectorized``: ``RunningAggregate("count")`` through ``run_vectorized`` (one batched lookup
  and one batched update of a value state per micro-batch), the rows carrying their key groups
  as Spark's routed rows do.

Each state of ``--sizes`` keys (over the 4 tasks; the task holds about a quarter) is written
with the store's batched API and committed, then ``--batches`` micro-batches of ``--events``
events (the task gets about a quarter) with keys uniform over the state are timed. Reported:
the median batch (processing and flush) per kind and size and its growth against the smallest
size (1.0: a batch costs its keys only; from 1M keys on, a batch of 200k events touches
nearly as many distinct keys at every size, so the growth is the state's). Prints a table,
writes ``bench_processors.json`` and ``bench_processors.png`` to the results folder.
``--live-rows both`` measures each kind and size also with the live-row count the Spark runner
keeps (``statestore.live_rows``, Spark's ``numRowsTotal``) and reports its cost as a ratio.
Run: ``.venv/bin/python -m benchmarks.bench_processors`` (``--sizes``, ``--events``, ``--batches``,
``--live-rows``).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import typer
from pyspark.sql.streaming.stateful_processor import TimerValues
from rich.table import Table

from benchmarks.harness import console, fmt, machine_info, progress, pyplot, results_path, save_figure, write_results
from benchmarks.streaming.processors import BucketCountProcessor, CountProcessor, RecentValuesProcessor
from spark_integration.compat import declare, rows_to_arrow, run_processor
from spark_integration.vectorized import RunningAggregate, run_vectorized
from statestore import (
    DirectoryStateTable,
    StateLayout,
    StateStore,
    StoreConfig,
    assign_key_groups,
    task_for_key_group,
)

MAX_PARALLELISM = 128
TASKS = 4
TASK = 0
KEY_SCHEMA = pa.schema([("key", pa.string())])
OUTPUT_SCHEMA = pa.schema([("key", pa.string()), ("count", pa.int64())])
PROCESSORS = {"value": CountProcessor, "list": RecentValuesProcessor, "map": BucketCountProcessor,
              "vectorized": lambda: RunningAggregate("count")}
NO_TIME = TimerValues(-1, -1)


def _task_keys(total: int) -> tuple[pa.Array, np.ndarray]:
    """The keys ``k<id>`` of ``total`` that task ``TASK`` owns, and their key groups."""
    keys = pa.array(np.char.add("k", np.arange(total).astype(str)))
    kgs = np.asarray(assign_key_groups(pa.table({"key": keys}), MAX_PARALLELISM), dtype=np.int64)
    mine = np.flatnonzero(task_for_key_group(MAX_PARALLELISM, TASKS, kgs) == TASK)
    return keys.take(pa.array(mine)), kgs[mine]


def _build(store: StateStore, kind: str, name: str, keys: pa.Array) -> None:
    """Every key's state as a batch of the processor would leave it, through the batched API."""
    table = pa.table({"key": keys})
    n = len(keys)
    state = store.get_state(name)
    if kind == "vectorized":
        state.update_batch(table, pa.array(np.ones(n, np.int64)))
    elif kind == "value":
        state.update_batch(table, pa.StructArray.from_arrays([pa.array(np.ones(n, np.int64))], ["count"]))
    elif kind == "list":
        state.add_batch(table, pa.StructArray.from_arrays([pa.array(np.arange(n, dtype=np.int64))], ["value"]))
    else:
        state.put_batch(table, pa.StructArray.from_arrays([pa.array(np.arange(n, dtype=np.int64) % 4)], ["bucket"]),
                        pa.StructArray.from_arrays([pa.array(np.ones(n, np.int64))], ["count"]))
    store.checkpoint()
    # Whole views from the start: the batches then measure a warm store, not the partial
    # reads of the first batches and the whole loads that follow them.
    r = store.reader.key_group_range
    store.views(name, range(r.start, r.end + 1))


def _measure(kind: str, total: int, events: int, batches: int, seed: int, count_live_rows: bool = False) -> dict:
    processor = PROCESSORS[kind]()
    if kind == "vectorized":
        descriptors = processor.state_variables(pa.schema([("key", pa.string()), ("value", pa.int64())]), ["key"])
    else:
        descriptors = declare(processor).descriptors
    layout = StateLayout.of(KEY_SCHEMA, descriptors, MAX_PARALLELISM)
    keys, kgs = _task_keys(total)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        table = DirectoryStateTable(Path(tmp), layout)
        store = StateStore(table, task_index=TASK, parallelism=TASKS,
                           config=StoreConfig(count_live_rows=count_live_rows))
        _build(store, kind, descriptors[0].name, keys)
        process_ms, flush_ms, distinct = [], [], []
        for _ in range(batches + 1):  # the first batch is not counted (the runner's first use)
            ids = rng.integers(0, len(keys), max(1, events // TASKS))
            rows = pa.table({"key": keys.take(pa.array(ids)), "value": pa.array(rng.integers(0, 1000, ids.size))})
            gc.disable()
            try:
                t0 = time.perf_counter()
                if kind == "vectorized":
                    run_vectorized(processor, store, rows, 0, 0, key_groups=kgs[ids])
                else:
                    out = run_processor(processor, store, None, rows, kgs[ids].tolist(), NO_TIME, None)
                    rows_to_arrow(out, OUTPUT_SCHEMA)
                t1 = time.perf_counter()
                checkpoint_id = table.next_checkpoint_id()
                segments = store.flush(checkpoint_id)
                t2 = time.perf_counter()
            finally:
                gc.enable()
            table.commit_checkpoint(checkpoint_id, segments, parallelism=TASKS)
            store.checkpoint_complete(checkpoint_id)
            distinct.append(len(np.unique(ids)))
            process_ms.append((t1 - t0) * 1e3)
            flush_ms.append((t2 - t1) * 1e3)
        store.close()
    batch = [p + f for p, f in zip(process_ms[1:], flush_ms[1:], strict=True)]
    keys_per_batch = statistics.median(distinct[1:])
    return {"kind": kind, "count_live_rows": count_live_rows,
            "state_keys": total, "task_keys": len(keys), "task_events": max(1, events // TASKS),
            "batch_keys_median": keys_per_batch,
            "us_per_batch_key": statistics.median(batch) * 1e3 / keys_per_batch,
            "process_ms": process_ms[1:], "flush_ms": flush_ms[1:], "batch_ms_median": statistics.median(batch),
            "events_per_s": max(1, events // TASKS) / (statistics.median(batch) / 1e3)}


def _plot(runs: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for kind in PROCESSORS:
        mine = sorted((r for r in runs if r["kind"] == kind), key=lambda r: r["state_keys"])
        if mine:
            ax.plot([r["state_keys"] for r in mine], [r["batch_ms_median"] for r in mine], marker="o",
                    label=f"{kind} state")
    ax.set_xscale("log")
    ax.set_xlabel("state keys (4 tasks)")
    ax.set_ylabel("one task's batch, median ms")
    ax.set_ylim(bottom=0)
    ax.set_title("Processors: a batch of the same size as the state grows")
    ax.legend()
    save_figure(fig, path, dpi=110)


def main(
    sizes: str = typer.Option("1000000,5000000,20000000", help="state sizes in keys (over 4 tasks), comma-separated"),
    events: int = typer.Option(200_000, help="events per micro-batch (over 4 tasks)"),
    batches: int = typer.Option(5, help="measured micro-batches per kind and size"),
    kinds: str = typer.Option(",".join(PROCESSORS), help="processors: value, list, map"),
    seed: int = typer.Option(1),
    live_rows: str = typer.Option("off", help="count live rows as the Spark runner does (numRowsTotal): off, on, "
                                             "or both (each kind and size twice, the cost of counting as a ratio)"),
) -> None:
    chosen = [k.strip() for k in kinds.split(",") if k.strip()]
    unknown = sorted(set(chosen) - set(PROCESSORS))
    if unknown:
        raise typer.BadParameter(f"unknown kinds {unknown}; known: {list(PROCESSORS)}")
    if live_rows not in ("off", "on", "both"):
        raise typer.BadParameter(f"--live-rows must be off, on or both, got {live_rows!r}")
    counting = {"off": [False], "on": [True], "both": [False, True]}[live_rows]
    state_sizes = sorted(int(s) for s in sizes.split(","))
    measured = [_measure(kind, total, events, batches, seed, count)
                for kind, total, count in progress([(k, s, c) for k in chosen for s in state_sizes for c in counting],
                                                   "kinds x state sizes")]
    runs = [r for r in measured if r["count_live_rows"] == counting[0]]
    smallest = {k: next(r["batch_ms_median"] for r in runs if r["kind"] == k) for k in chosen}
    for r in runs:
        r["growth_vs_smallest"] = r["batch_ms_median"] / smallest[r["kind"]]
    if live_rows == "both":
        for r, c in zip(runs, [r for r in measured if r["count_live_rows"]], strict=True):
            r["with_live_rows_ms_median"] = c["batch_ms_median"]
            r["live_rows_cost"] = c["batch_ms_median"] / r["batch_ms_median"]
    t = Table(title=f"one task's micro-batch of {events:,} events / {TASKS} tasks, whole-cached state")
    for col in ("state", "state keys", "task keys", "batch keys", "batch ms (median)", "us per batch key", "events/s",
                "growth vs smallest", *(["counting live rows ms", "counting's cost"] if live_rows == "both" else [])):
        t.add_column(col, justify="right")
    for r in runs:
        extra = ([fmt(r["with_live_rows_ms_median"]), fmt(r["live_rows_cost"], ".2f", "x")]
                 if live_rows == "both" else [])
        t.add_row(r["kind"], f"{r['state_keys']:,}", f"{r['task_keys']:,}", fmt(r["batch_keys_median"]),
                  fmt(r["batch_ms_median"]), fmt(r["us_per_batch_key"], ".1f"),
                  fmt(r["events_per_s"]), fmt(r["growth_vs_smallest"], ".2f", "x"), *extra)
    console.print(t)
    _plot(runs, results_path("bench_processors.png"))
    path = write_results("bench_processors.json", {
        "machine": machine_info(), "events": events, "batches": batches, "sizes": state_sizes, "live_rows": live_rows,
        "runs": runs,
        "growth_largest": {k: max(r["growth_vs_smallest"] for r in runs if r["kind"] == k) for k in chosen}})
    console.print(f"results: {path}")


if __name__ == "__main__":
    typer.run(main)
