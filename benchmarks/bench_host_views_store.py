"""What the host's shared views cost a store that keeps its task, and what they save one that moves.

With the shared views (``statestore.host_views``) a store writes part of its key groups' views
to the host at each commit (``StoreConfig.host_views_lag``); a task that never
changes process pays that and gets nothing back but its own memory's move to the page cache,
while a task that moves opens by mapping instead of loading. This measures both at store level,
without Spark, one process:

- a state of ``keys`` running counts over ``tasks`` tasks (``build_count_state``; SQLite catalog,
  table on local disk), built again for each mode so every mode starts from the same state;
- a store of task 0 with views of whole key groups (``view_partial_reads_max=0``, as a
  long-running stream's), for each mode (the shared views off; on, written the default
  ``host_views_lag`` checkpoints behind; on, written ``--lag-other`` behind), runs
  ``checkpoints`` checkpoints of ``updates`` uniform random keys (the task's share of them): read
  them, write them, flush; commit; ``checkpoint_complete`` (where the views are written);
- then a second store of task 0 opened in the same process and its first read of one
  checkpoint's keys: a task picked up by another worker (with the shared views off, a load).

Per mode: the medians over the steady checkpoints (the first two, a load and the first write of
the views, left out) of read-and-write-and-flush, commit, complete, and their sum, its ratio to
the mode without the shared views; the moved store's open and first read. Prints a table,
writes ``bench_host_views_store.json`` to the results folder (``ICESTATE_BENCH_RESULTS_DIR``).
Run: ``.venv/bin/python -m benchmarks.bench_host_views_store`` (``--quick``: 400k keys).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import typer
from rich.table import Table

from benchmarks.harness import (
    COUNT,
    build_count_state,
    console,
    count_layout,
    fmt,
    machine_info,
    owners,
    ratio,
    user_keys,
    write_results,
)
from catalog import TableRef

CATALOG = "bench"
STEADY_FROM = 2  # the first checkpoint loads, the second writes every key group's views


def _mode(name: str, lag: int | None, keys: int, tasks: int, checkpoints: int, updates: int, scratch: Path) -> dict:
    from statestore import StateStore, StoreConfig

    work = scratch / name
    work.mkdir()
    props = {"type": "sql", "uri": f"sqlite:///{work}/catalog.db", "init_catalog_tables": "true",
             "warehouse": str(work / "warehouse")}
    config = StoreConfig(host_views=lag is not None, host_views_dir=str(work / "views"), view_partial_reads_max=0,
                         host_views_lag=lag or StoreConfig().host_views_lag)
    rng = np.random.default_rng(7)

    def task_keys() -> pa.Table:
        batch = user_keys(rng.integers(0, keys, updates))
        return batch.filter(pa.array(owners(batch, tasks) == 0))

    with TableRef("state", catalog_name=CATALOG, catalog_properties=props).open(
            count_layout(), retain_checkpoints=checkpoints + 10) as table:
        build_count_state(table, keys, 4, tasks, f"{name}: a state of {keys:,} keys")
        store = StateStore(table, task_index=0, parallelism=tasks, config=config)
        rows = []
        for _ in range(checkpoints):
            batch = task_keys()
            checkpoint_id = table.next_checkpoint_id()
            started = time.perf_counter()
            state = store.get_state(COUNT)
            counts = state.get_batch(batch)
            state.update_batch(batch, pc.add(pc.fill_null(counts, 0), 1))
            segments = store.flush(checkpoint_id)
            flushed = time.perf_counter()
            table.commit_checkpoint(checkpoint_id, segments, parallelism=tasks)
            committed = time.perf_counter()
            store.checkpoint_complete(checkpoint_id)
            completed = time.perf_counter()
            rows.append({"process_flush_s": flushed - started, "commit_s": committed - flushed,
                         "complete_s": completed - committed, "total_s": completed - started})
        stats = store.stats()
        batch = task_keys()
        started = time.perf_counter()
        moved = StateStore(table, task_index=0, parallelism=tasks, config=config)
        opened = time.perf_counter()
        moved.get_state(COUNT).get_batch(batch)
        read = time.perf_counter()
        moved_stats = moved.stats()
        moved.close()
        store.close()
    steady = rows[STEADY_FROM:]
    return {
        "mode": name, "host_views": lag is not None, "lag": lag, "checkpoints": rows,
        **{f"steady_{k}": statistics.median(r[k] for r in steady) for k in rows[0]},
        "views_written": stats["host_views_published"], "view_bytes": stats["cache_size_bytes"],
        "moved_open_s": opened - started, "moved_first_read_s": read - opened,
        "moved_views_mapped": moved_stats["host_views_mapped"],
    }


def main(
    quick: Annotated[bool, typer.Option(help="A small run (400k keys).")] = False,
    keys: Annotated[int, typer.Option(help="Keys of the state.")] = 10_000_000,
    tasks: Annotated[int, typer.Option(help="Tasks of the state (its parallelism); task 0 is measured.")] = 2,
    checkpoints: Annotated[int, typer.Option(help="Checkpoints of each mode.")] = 10,
    updates: Annotated[int, typer.Option(help="Random keys a checkpoint (the task gets its share).")] = 100_000,
    lag_other: Annotated[int, typer.Option(min=1, help="The other lag to compare.")] = 4,
) -> None:
    from statestore import StoreConfig

    if quick:
        keys, checkpoints, updates = 400_000, 6, 10_000
    scratch = Path(tempfile.mkdtemp(prefix="bench-host-views-store-"))
    try:
        lag = StoreConfig().host_views_lag
        modes = [("shared off", None), (f"shared on, lag {lag}", lag),
                 (f"shared on, lag {lag_other}", lag_other)]
        runs = [_mode(f"m{i}", lag, keys, tasks, checkpoints, updates, scratch) | {"mode": name}
                for i, (name, lag) in enumerate(modes)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for r in runs:
        r["steady_total_over_off"] = ratio(r["steady_total_s"], runs[0]["steady_total_s"])
    results = {"benchmark": "bench_host_views_store", "date": datetime.now(UTC).isoformat(timespec="seconds"),
               "machine": machine_info(), "quick": quick,
               "config": {"keys": keys, "tasks": tasks, "checkpoints": checkpoints, "updates": updates,
                          "steady_from": STEADY_FROM},
               "runs": runs}
    table = Table(title=f"One store of a {keys:,}-key state, {updates:,} random keys a checkpoint (its share of them)")
    for col in ("mode", "read+write+flush s", "commit s", "complete s", "a checkpoint s", "/ shared off",
                "moved: open s", "first read s", "key groups mapped"):
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(r["mode"], fmt(r["steady_process_flush_s"], ".3f"), fmt(r["steady_commit_s"], ".3f"),
                      fmt(r["steady_complete_s"], ".3f"), fmt(r["steady_total_s"], ".3f"),
                      fmt(r["steady_total_over_off"], ".2f"), fmt(r["moved_open_s"], ".3f"),
                      fmt(r["moved_first_read_s"], ".3f"), str(r["moved_views_mapped"]))
    console.print(table)
    write_results("bench_host_views_store" + ("_quick" if quick else "") + ".json", results, default=str)


if __name__ == "__main__":
    typer.run(main)
