"""The first batches after a restart on a large state: reads proportional to the keys touched.

The state: ``keys`` possible keys (20M), ``checkpoints`` (10)
checkpoints of ``events`` (3M) uniform count updates each, written by ``tasks`` (4) task
stores, about 15M live keys. A restarted query then runs ``batches`` (6) batches of
``batch_events`` (200k) uniform events: each task opens a fresh store on a fresh table object,
reads the counts of its keys (``get_batch``), writes the new ones (``update_batch``), and the
batch commits one checkpoint of every task's segments, as a streaming query does. Every variant
runs on its own fork of the built state (``IcebergStateTable.fork``), so each starts from the
same checkpoint; the same batches also run against an empty table (the floor: what a first
batch costs without state).

Variants: ``partial`` (the default: a key group's views fill with the keys read, from the row
groups that can hold them, until it is loaded whole after a few such reads) and ``whole``
(``view_partial_reads_max=0``: every key group read is loaded whole, the behaviour before).
A last run reads ``few_keys`` keys (a few per key group) once, both ways, and reports the bytes
read. With ``--s3-keys``, the same runs on a smaller state kept on moto's S3 server behind our
latency proxy (``--s3-latency-ms``), with the file cache on and emptied before each restart.

Prints a table, writes ``benchmarks/results/bench_restart_reads.json`` and a plot beside it.
Run: ``.venv/bin/python -m benchmarks.bench_restart_reads`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import typer
from rich.table import Table

from benchmarks.harness import (
    COUNT,
    console,
    count_layout,
    machine_info,
    owners,
    progress,
    pyplot,
    save_figure,
    user_keys,
    write_results,
)
from catalog import TableRef
from statestore import StateStore, StoreConfig
from statestore.file_cache import close_process_file_caches

STATE_TABLE = "restart_state"
EMPTY_TABLE = "restart_empty"
BUCKET = "icestate-bench"
VARIANTS = {"partial": {}, "whole": {"view_partial_reads_max": 0}}


@dataclass(frozen=True)
class Sizes:
    keys: int
    checkpoints: int
    events: int
    tasks: int
    batch_events: int
    batches: int
    few_keys: int


def build(ref: TableRef, sizes: Sizes, seed: int) -> None:
    """``checkpoints`` checkpoints of ``events`` uniform count updates each, by ``tasks`` stores."""
    rng = np.random.default_rng(seed)
    table = ref.open(count_layout())
    stores = [StateStore(table, task_index=t, parallelism=sizes.tasks) for t in range(sizes.tasks)]
    for _ in progress(range(sizes.checkpoints), f"building a {sizes.keys:,}-key state"):
        ids, counts = np.unique(rng.integers(0, sizes.keys, sizes.events), return_counts=True)
        keys = user_keys(ids)
        owner = owners(keys, sizes.tasks)
        checkpoint_id = table.next_checkpoint_id()
        segments = []
        for t, store in enumerate(stores):
            mine = owner == t
            store.get_state(COUNT).update_batch(keys.filter(pa.array(mine)), pa.array(counts[mine], pa.int64()))
            segments += store.flush(checkpoint_id)
        table.commit_checkpoint(checkpoint_id, segments, parallelism=sizes.tasks)
        for store in stores:
            store.checkpoint_complete(checkpoint_id)
    for store in stores:
        store.close()
    table.close()


def batches_of(sizes: Sizes, seed: int) -> list[list[tuple[pa.Table, np.ndarray]]]:
    """Per batch, per task: (its distinct keys, each key's events)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sizes.batches):
        ids, counts = np.unique(rng.integers(0, sizes.keys, sizes.batch_events), return_counts=True)
        keys = user_keys(ids)
        owner = owners(keys, sizes.tasks)
        out.append([(keys.filter(pa.array(owner == t)), counts[owner == t]) for t in range(sizes.tasks)])
    return out


def run_batches(ref: TableRef, sizes: Sizes, batches: list, config: StoreConfig, remote: bool) -> list[dict]:
    """The restarted query's batches: fresh table object and stores, each task's read and
    write of its keys, then one checkpoint per batch. Per batch: the tasks' read + write
    time (summed: one task after another), the checkpoint's time and the stores' counters."""
    if remote:
        close_process_file_caches()  # a restart on new hosts: nothing on local disk
    table = ref.open(count_layout())
    stores = [StateStore(table, task_index=t, parallelism=sizes.tasks, config=config) for t in range(sizes.tasks)]
    out = []
    for batch in batches:
        t0 = time.perf_counter()
        for store, (keys, counts) in zip(stores, batch, strict=True):
            state = store.get_state(COUNT)
            old = state.get_batch(keys)
            state.update_batch(keys, pc.add(pc.fill_null(old, 0), pa.array(counts, pa.int64())))
        t1 = time.perf_counter()
        checkpoint_id = table.next_checkpoint_id()
        segments = [s for store in stores for s in store.flush(checkpoint_id)]
        table.commit_checkpoint(checkpoint_id, segments, parallelism=sizes.tasks)
        for store in stores:
            store.checkpoint_complete(checkpoint_id)
        t2 = time.perf_counter()
        stats = [store.stats() for store in stores]
        out.append({"state_s": t1 - t0, "checkpoint_s": t2 - t1,
                    **{k: sum(s[k] for s in stats) for k in ("segment_bytes_read", "cache_misses",
                                                            "cache_partial_reads", "cache_size_bytes")}})
    for store in stores:
        store.close()
    table.close()
    return out


def few_keys_read(ref: TableRef, sizes: Sizes, config: StoreConfig, remote: bool) -> dict:
    """Task 0's first read of ``few_keys`` keys (a few per key group) on a fresh store."""
    if remote:
        close_process_file_caches()
    ids = np.random.default_rng(99).choice(sizes.keys, size=sizes.few_keys * sizes.tasks, replace=False)
    keys = user_keys(ids)
    mine = keys.filter(pa.array(owners(keys, sizes.tasks) == 0))
    table = ref.open(count_layout())
    store = StateStore(table, task_index=0, parallelism=sizes.tasks, config=config)
    t0 = time.perf_counter()
    store.get_state(COUNT).get_batch(mine)
    elapsed = time.perf_counter() - t0
    stats = store.stats()
    store.close()
    table.close()
    return {"keys": mine.num_rows, "read_s": elapsed, "segment_bytes_read": stats["segment_bytes_read"],
            "cache_size_bytes": stats["cache_size_bytes"]}


def measure(base: TableRef, empty: TableRef, sizes: Sizes, seed: int, remote: bool) -> dict:
    batches = batches_of(sizes, seed + 1)
    out: dict = {"sizes": sizes.__dict__, "variants": {}}
    source = base.open(count_layout())
    head = source.current_checkpoint()
    for name in VARIANTS:
        source.fork(f"bench-{name}", head.checkpoint_id)
    source.close()
    for name, options in VARIANTS.items():
        config = StoreConfig(**options)
        with console.status(f"{name}: {sizes.batches} batches after a restart"):
            per_batch = run_batches(TableRef(base.table, warehouse=base.warehouse, catalog_name=base.catalog_name,
                                             catalog_properties=base.catalog_properties, branch=f"bench-{name}"),
                                    sizes, batches, config, remote)
        with console.status(f"{name}: a read of a few keys per key group"):
            few = few_keys_read(base, sizes, config, remote)
        out["variants"][name] = {"store_options": options, "batches": per_batch, "few_keys": few}
        console.log(f"{name}: first batch {per_batch[0]['state_s']:.2f} s reading state, "
                    f"{per_batch[0]['segment_bytes_read'] / 2**20:.0f} MiB")
    with console.status("empty state: the same batches"):
        out["empty"] = {"batches": run_batches(empty, sizes, batches, StoreConfig(), remote)}
    floor = out["empty"]["batches"][0]["state_s"]
    for v in out["variants"].values():
        v["first_batch_over_empty_s"] = v["batches"][0]["state_s"] - floor
    return out


def _s3_refs(root: Path, latency_ms: float):
    from tests import s3_server
    from tests.net_proxy import NetProxy

    root.mkdir(parents=True, exist_ok=True)
    server = s3_server.start(root)
    proxy = NetProxy(server.endpoint).start()
    s3_server.create_bucket(server.endpoint, BUCKET)
    (root / "s3-catalog").mkdir(parents=True, exist_ok=True)
    properties = {"type": "sql", "uri": f"sqlite:///{root}/s3-catalog/catalog.db", "init_catalog_tables": "true",
                  "warehouse": f"s3://{BUCKET}/warehouse", **s3_server.properties(proxy.endpoint)}

    def ref(table: str) -> TableRef:
        return TableRef(table, catalog_name="restart_bench", catalog_properties=properties)
    return server, proxy, ref


def main(
    quick: bool = typer.Option(False, help="tiny sizes (the smoke test); results named bench_restart_reads_quick"),
    keys: int = typer.Option(20_000_000, help="possible keys of the local state"),
    checkpoints: int = typer.Option(10, help="checkpoints the state is written in"),
    events: int = typer.Option(3_000_000, help="uniform count updates per checkpoint of the local state"),
    tasks: int = typer.Option(4, help="tasks (stores) writing and reading the state"),
    batch_events: int = typer.Option(200_000, help="events per batch after the restart"),
    batches: int = typer.Option(6, help="batches after the restart"),
    few_keys: int = typer.Option(1_000, help="keys per task of the few-keys read"),
    s3_keys: int = typer.Option(2_000_000, help="possible keys of the S3 state (0: no S3 run); its events "
                                                "and batches scale with it"),
    s3_latency_ms: float = typer.Option(20, help="latency per request of the S3 proxy"),
    seed: int = typer.Option(7, help="seed of the state and the batches"),
) -> None:
    if quick:
        # key groups of about 4.7k entries locally: above view_partial_rows_min, so read partially
        keys, checkpoints, events, batch_events, batches = 1_000_000, 3, 200_000, 2_000, 3
        few_keys, s3_keys = 100, 20_000
    local = Sizes(keys, checkpoints, events, tasks, batch_events, batches, few_keys)
    root = Path(tempfile.mkdtemp(prefix="bench_restart_reads_"))
    results: dict = {"machine": machine_info()}
    t_start = time.perf_counter()
    try:
        warehouse = str(root / "local")
        base, empty = TableRef(STATE_TABLE, warehouse=warehouse), TableRef(EMPTY_TABLE, warehouse=warehouse)
        build(base, local, seed)
        results["local"] = measure(base, empty, local, seed, remote=False)
        if s3_keys:
            scale = s3_keys / keys
            remote = Sizes(s3_keys, checkpoints, max(1, int(events * scale)), tasks,
                           max(1, int(batch_events * scale)), batches, few_keys)
            server, proxy, ref = _s3_refs(root / "s3", 0)
            try:
                build(ref(STATE_TABLE), remote, seed)
                proxy.latency_s = s3_latency_ms / 1000
                results["s3"] = measure(ref(STATE_TABLE), ref(EMPTY_TABLE), remote, seed, remote=True)
                results["s3"]["latency_ms"] = s3_latency_ms
            finally:
                proxy.close()
                server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["total_s"] = time.perf_counter() - t_start
    stem = "bench_restart_reads_quick" if quick else "bench_restart_reads"
    path = write_results(f"{stem}.json", results)
    _plot(results, path.with_suffix(".png"))
    _report(results)
    console.log(f"total {results['total_s']:.0f} s; results in {path} and .png")


def _report(results: dict) -> None:
    for where in ("local", "s3"):
        r = results.get(where)
        if r is None:
            continue
        sizes = r["sizes"]
        table = Table(title=f"{where}: {sizes['keys']:,} possible keys, {sizes['checkpoints']} checkpoints of "
                            f"{sizes['events']:,} events; batches of {sizes['batch_events']:,} events after a restart "
                            f"({sizes['tasks']} tasks, one after another)")
        table.add_column("variant")
        for i in range(sizes["batches"]):
            table.add_column(f"batch {i + 1}: state s", justify="right")
        table.add_column("batch 1 MiB read", justify="right")
        table.add_column("batch 1 over empty, s", justify="right")
        table.add_column(f"{sizes['few_keys']} keys: ms / MiB", justify="right")
        for name, v in r["variants"].items():
            few = v["few_keys"]
            table.add_row(name, *[f"{b['state_s']:.2f}" for b in v["batches"]],
                          f"{v['batches'][0]['segment_bytes_read'] / 2**20:.0f}",
                          f"{v['first_batch_over_empty_s']:.2f}",
                          f"{few['read_s'] * 1e3:.0f} / {few['segment_bytes_read'] / 2**20:.1f}")
        table.add_row("empty state", *[f"{b['state_s']:.2f}" for b in r["empty"]["batches"]], "0", "", "")
        console.print(table)


def _plot(results: dict, path: Path) -> None:
    plt = pyplot()
    wheres = [w for w in ("local", "s3") if w in results]
    fig, axes = plt.subplots(1, len(wheres), figsize=(6 * len(wheres), 4), squeeze=False)
    for ax, where in zip(axes[0], wheres, strict=True):
        r = results[where]
        for name, v in r["variants"].items():
            ax.plot(range(1, len(v["batches"]) + 1), [b["state_s"] for b in v["batches"]], marker="o", label=name)
        ax.plot(range(1, len(r["empty"]["batches"]) + 1), [b["state_s"] for b in r["empty"]["batches"]],
                marker="x", linestyle="--", label="empty state")
        ax.set_xlabel("batch after the restart")
        ax.set_ylabel("state read + write, s (4 tasks)")
        ax.set_title(f"{where}: {r['sizes']['keys']:,}-key state")
        ax.legend()
    save_figure(fig, path, dpi=100)


if __name__ == "__main__":
    typer.run(main)
