"""Which partition spec for state tables: ``truncate(key_group, W)`` for several W.

For each width W (key groups per partition) this builds the same state with 4 tasks and
max parallelism 128, then runs ``checkpoints`` checkpoints of a ``delta``-key delta and
measures: files written per checkpoint, median checkpoint time (flush of every task +
one commit), reopen time, and time to the first lookup after reopening.

W = 128 is one partition (one file per task per checkpoint); W = 32 is one partition per
task; W = 1 behaves like identity partitioning on key_group (one file per touched key
group per task per checkpoint). Prints a table and writes
``benchmarks/results/bench_partitioning.json``.
Run: ``.venv/bin/python -m benchmarks.bench_partitioning``.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import typer
from rich.table import Table

from benchmarks.harness import COUNT, console, count_layout, owners, user_keys, write_results
from catalog import IcebergStateTable
from statestore import StateStore

LAYOUT = count_layout()
TASKS = 4


def _checkpoint(table: IcebergStateTable, stores: list[StateStore], ids: np.ndarray, value: int) -> int:
    keys = user_keys(ids)
    owner = owners(keys, TASKS)
    for i, store in enumerate(stores):
        mask = pa.array(owner == i)
        part = keys.filter(mask)
        store.get_state(COUNT).update_batch(part, pa.array(np.full(part.num_rows, value, dtype=np.int64)))
    cp = table.next_checkpoint_id()
    segments = [s for store in stores for s in store.flush(cp)]
    table.commit_checkpoint(cp, segments, parallelism=TASKS)
    for store in stores:
        store.checkpoint_complete(cp)
    return len(segments)


def run_width(warehouse: str, width: int, state_keys: int, delta: int, checkpoints: int) -> dict:
    name = f"width_{width}"
    table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=name, partition_width=width)
    stores = [StateStore(table, task_index=i, parallelism=TASKS) for i in range(TASKS)]
    _checkpoint(table, stores, np.arange(state_keys), 0)
    rng = np.random.default_rng(5)
    times, files = [], []
    for c in range(checkpoints):
        t0 = time.perf_counter()
        files.append(_checkpoint(table, stores, rng.choice(state_keys, delta, replace=False), c + 1))
        times.append(time.perf_counter() - t0)
    table.close()
    t0 = time.perf_counter()
    reopened = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=name)
    reopen = time.perf_counter() - t0
    store = StateStore(reopened, task_index=0, parallelism=TASKS)
    probe = next(i for i in range(state_keys) if owners(user_keys(np.array([i])), TASKS)[0] == 0)
    t0 = time.perf_counter()
    store.get_state(COUNT).get_batch(user_keys(np.array([probe])))
    first = time.perf_counter() - t0
    return {"width": width, "partitions": -(-128 // width), "files_per_checkpoint": statistics.median(files),
            "checkpoint_s_median": statistics.median(times), "reopen_s": reopen, "first_lookup_s": first}


def main(state_keys: int = typer.Option(500_000), delta: int = typer.Option(10_000),
         checkpoints: int = typer.Option(20)) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_part_"))
    try:
        rows = [run_width(str(tmp / "wh"), w, state_keys, delta, checkpoints) for w in (128, 32, 8, 1)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_results("bench_partitioning.json", rows)
    base = rows[0]["checkpoint_s_median"]
    t = Table(title=f"partition width: {state_keys:,}-key state, {delta:,}-key deltas, {TASKS} tasks, N=128")
    for col in ("W", "partitions", "files/checkpoint", "checkpoint ms", "vs W=128", "reopen ms", "first lookup ms"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["width"]), str(r["partitions"]), f"{r['files_per_checkpoint']:.0f}",
                  f"{r['checkpoint_s_median'] * 1e3:.0f}", f"{r['checkpoint_s_median'] / base:.2f}x",
                  f"{r['reopen_s'] * 1e3:.0f}", f"{r['first_lookup_s'] * 1e3:.0f}")
    console.print(t)


if __name__ == "__main__":
    typer.run(main)
