"""The main job until the Spark integration lands: a keyed running count driven directly
against the store, with several tasks, several checkpoints, a crash and a restore.

Each micro-batch draws events over ``keys`` user ids, routes them to tasks by key group
(exactly as Spark will: ``pmod(xxhash64(user), N)``), lets each task update its state with
the batched API, and commits every task's segments as one Iceberg snapshot. Then it drops
every in-memory object (a crash), restores from the newest checkpoint and checks every
key's count against an independent tally, and finally restores an older checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.table import Table

from catalog.iceberg_table import IcebergStateTable
from statestore import (
    ListStateDescriptor,
    StateLayout,
    StateStore,
    ValueStateDescriptor,
    assign_key_groups,
    task_for_key_group,
)

KEY_SCHEMA = pa.schema([("user", pa.string())])
COUNT = ValueStateDescriptor("count", pa.int64())
LAST_SEEN = ValueStateDescriptor("last_seen", pa.int64())
RECENT = ListStateDescriptor("recent_pages", pa.string())


@dataclass
class DemoResult:
    checkpoints: int
    keys_with_state: int
    events: int
    verified_keys: int
    seconds: float


def demo_layout(max_parallelism: int) -> StateLayout:
    return StateLayout.of(KEY_SCHEMA, [COUNT, LAST_SEEN, RECENT], max_parallelism)


def _events(rng: np.random.Generator, keys: int, n: int, batch: int) -> pa.Table:
    users = pa.array(np.char.add("user-", rng.integers(0, keys, n).astype(str)))
    pages = pa.array(np.char.add("/page/", rng.integers(0, 50, n).astype(str)))
    return pa.table({"user": users, "page": pages, "ts": pa.array(np.full(n, batch, dtype=np.int64))})


def _process(store: StateStore, events: pa.Table) -> None:
    """One task's share of a micro-batch, all through the batched API."""
    users = events.select(["user"])
    # "last" is an ordered aggregation, which Arrow runs single-threaded only.
    per_user = events.group_by("user", use_threads=False).aggregate(
        [("user", "count"), ("ts", "max"), ("page", "last")]
    )
    keys = per_user.select(["user"])
    count = store.get_state(COUNT)
    old = count.get_batch(keys)
    new = pc.add(pc.fill_null(old, 0), per_user.column("user_count"))
    count.update_batch(keys, new)
    store.get_state(LAST_SEEN).update_batch(keys, per_user.column("ts_max"))
    store.get_state(RECENT).add_batch(users, events.column("page"))


def _commit(table: IcebergStateTable, stores: list[StateStore], batch_id: int) -> int:
    checkpoint_id = table.next_checkpoint_id()
    segments = [s for store in stores for s in store.flush(checkpoint_id)]
    try:
        table.commit_checkpoint(checkpoint_id, segments, parallelism=len(stores), batch_id=batch_id)
    except BaseException:
        for store in stores:
            store.checkpoint_aborted(checkpoint_id)
        raise
    for store in stores:
        store.checkpoint_complete(checkpoint_id)
    return checkpoint_id


def run_demo(warehouse: str, *, keys: int = 100_000, batches: int = 5, events_per_batch: int = 200_000,
             parallelism: int = 2, max_parallelism: int = 128, table_name: str = "demo_running_count",
             console: Console | None = None) -> DemoResult:
    console = console or Console()
    started = time.perf_counter()
    layout = demo_layout(max_parallelism)
    table = IcebergStateTable.open(layout, warehouse=warehouse, table_name=table_name, retain_checkpoints=3)
    if table.current_checkpoint() is not None:
        console.print(f"[yellow]table {table_name} already has checkpoints; continuing after "
                      f"checkpoint {table.current_checkpoint().checkpoint_id}[/yellow]")
    stores = [StateStore(table, task_index=i, parallelism=parallelism) for i in range(parallelism)]
    rng = np.random.default_rng(7)
    tally: dict[str, int] = {}
    counts_at: dict[int, dict[str, int]] = {}
    base = _current_counts(table, parallelism) if table.current_checkpoint() else {}
    tally.update(base)
    for batch in range(batches):
        t0 = time.perf_counter()
        events = _events(rng, keys, events_per_batch, batch)
        owner = _owners(events, max_parallelism, parallelism)
        for i, store in enumerate(stores):
            _process(store, events.filter(pa.array(owner == i)))
        t1 = time.perf_counter()
        cp = _commit(table, stores, batch)
        for user, n in zip(*np.unique(events.column("user").to_numpy(zero_copy_only=False), return_counts=True),
                           strict=True):
            tally[user] = tally.get(user, 0) + int(n)
        counts_at[cp] = dict(tally)
        commit_ms = (time.perf_counter() - t1) * 1e3
        console.print(f"batch {batch}: {events_per_batch:,} events over {parallelism} tasks in "
                      f"{(t1 - t0) * 1e3:.0f} ms, checkpoint {cp} committed in {commit_ms:.0f} ms")
    _print_checkpoints(console, table)

    console.print("[bold]crash:[/bold] dropping every store and table object; restoring from the catalog")
    del stores, table
    t0 = time.perf_counter()
    table = IcebergStateTable.open(layout, warehouse=warehouse, table_name=table_name, retain_checkpoints=3)
    newest = table.current_checkpoint().checkpoint_id
    restored = _current_counts(table, parallelism)
    console.print(f"restored checkpoint {newest}: {len(restored):,} keys read back in "
                  f"{(time.perf_counter() - t0) * 1e3:.0f} ms (state is read lazily, key group by key group)")
    if restored != tally:
        raise AssertionError("restored counts differ from the independent tally")
    console.print(f"[green]verified[/green]: every one of {len(tally):,} keys has the count it should")

    retained = [c.checkpoint_id for c in table.list_checkpoints()]
    older = retained[0]
    table.restore(older)
    at_older = _current_counts(table, parallelism)
    expected = counts_at.get(older)
    if expected is not None and at_older != expected:
        raise AssertionError(f"counts at checkpoint {older} differ from the tally at that checkpoint")
    console.print(f"time travel: checkpoint {older} holds {sum(at_older.values()):,} events "
                  f"(newest holds {sum(tally.values()):,})")
    _print_top(console, restored)
    return DemoResult(len(counts_at), len(restored), sum(tally.values()) - sum(base.values()), len(tally),
                      time.perf_counter() - started)


def _owners(events: pa.Table, max_parallelism: int, parallelism: int) -> np.ndarray:
    kgs = assign_key_groups(events.select(["user"]), max_parallelism).astype(np.int64)
    return task_for_key_group(max_parallelism, parallelism, kgs)


def _current_counts(table: IcebergStateTable, parallelism: int) -> dict[str, int]:
    """Every key's count at the table's current checkpoint, read through fresh stores."""
    out: dict[str, int] = {}
    for i in range(parallelism):
        store = StateStore(table, task_index=i, parallelism=parallelism)
        kgs = store.key_group_range
        view = store.views(COUNT.name, range(kgs.start, kgs.end + 1))
        for v in view:
            out.update(zip(v.get_column("user").to_list(), v.get_column(COUNT.value_column).to_list(), strict=True))
    return out


def _print_checkpoints(console: Console, table: IcebergStateTable) -> None:
    t = Table(title=f"retained checkpoints of {table.identifier}")
    for col in ("checkpoint", "batch", "parallelism", "snapshot"):
        t.add_column(col)
    for c in table.list_checkpoints():
        t.add_row(str(c.checkpoint_id), str(c.batch_id), str(c.parallelism), str(c.snapshot_id))
    console.print(t)


def _print_top(console: Console, counts: dict[str, int]) -> None:
    t = Table(title="busiest users")
    t.add_column("user")
    t.add_column("count", justify="right")
    for user, n in sorted(counts.items(), key=lambda kv: -kv[1])[:5]:
        t.add_row(user, f"{n:,}")
    console.print(t)
