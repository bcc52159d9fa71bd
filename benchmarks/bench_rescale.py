"""Rescale benchmark (rescale as metadata): change the parallelism of a keyed state.

For a state of ``small`` and of ``big`` keys (a value state per key, written by 4 tasks in
4 checkpoints), rescale 4 -> 8 and 8 -> 3:

- ours: open the table at the newest checkpoint with the new parallelism and create every
  task's store (metadata only), then each task's first batched lookup of ``probe`` of its
  own keys. Reported: the time of each step, the bytes written (state copied) during the
  rescale, and the bytes and files each task read, against the whole state's size;
- the peer, in the same run on the same table: a copying rescale, what a local-state
  system (Spark's offline ``repartition``, a RocksDB restore with a new key partitioning)
  does: read every entry and write one new file per new task.

Target: zero bytes copied and a rescale time ratio big/small of at most 1.2.
Prints a table, writes ``benchmarks/results/bench_rescale.json``.
Run: ``.venv/bin/python -m benchmarks.bench_rescale`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import typer
from rich.table import Table

from benchmarks.harness import (
    COUNT,
    MAX_PARALLELISM,
    build_count_state,
    console,
    count_layout,
    machine_info,
    owners,
    user_keys,
    write_results,
)
from catalog import IcebergStateTable
from statestore import KeyGroupRange, StateStore, task_for_key_group

BUILD_PARALLELISM = 4


def build_state(warehouse: str, name: str, n_keys: int, checkpoints: int = 4) -> None:
    """``n_keys`` keys written by 4 tasks in ``checkpoints`` checkpoints."""
    table = IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name=name)
    build_count_state(table, n_keys, checkpoints, BUILD_PARALLELISM, f"building {n_keys:,}-key state")
    table.close()


def _data_files(warehouse: str) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in Path(warehouse).rglob("*.parquet")}


def ours(warehouse: str, name: str, n_keys: int, parallelism: int, probe: int) -> dict:
    """Rescale as metadata, then each task's first lookup of its own keys."""
    before = _data_files(warehouse)
    t0 = time.perf_counter()
    table = IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name=name)
    stores = [StateStore(table, task_index=t, parallelism=parallelism) for t in range(parallelism)]
    rescale_s = time.perf_counter() - t0
    after = _data_files(warehouse)
    rng = np.random.default_rng(parallelism)
    ids = rng.choice(n_keys, size=min(n_keys, probe * parallelism), replace=False)
    owner = owners(user_keys(ids), parallelism)
    tasks = []
    t1 = time.perf_counter()
    for t, store in enumerate(stores):
        mine = ids[owner == t][:probe]
        got = store.get_state(COUNT).get_batch(user_keys(mine))
        if got.to_pylist() != mine.tolist():
            raise AssertionError(f"task {t} read wrong values after the rescale to {parallelism}")
        stats = store.stats()
        r = store.key_group_range
        tasks.append({"task": t, "key_groups": [r.start, r.end], "bytes_read": stats["segment_bytes_read"],
                      "files_opened": stats["segment_files_opened"]})
    first_lookup_s = time.perf_counter() - t1
    state_bytes = sum(s.size_bytes for s in table.segments(KeyGroupRange.of(0, MAX_PARALLELISM - 1)))
    for store in stores:
        store.close()
    table.close()
    return {
        "parallelism": parallelism, "rescale_s": rescale_s, "first_lookups_s": first_lookup_s,
        "bytes_copied": sum(after[p] for p in set(after) - set(before)),
        "files_written": len(set(after) - set(before)), "state_bytes": state_bytes, "tasks": tasks,
        "max_task_read_share": max(t["bytes_read"] for t in tasks) / state_bytes if state_bytes else 0.0,
    }


def copying_peer(warehouse: str, name: str, parallelism: int, out: Path) -> dict:
    """What a local-state system does: read all state, write it out again per new task."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    table = IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name=name)
    segments = table.segments(KeyGroupRange.of(0, MAX_PARALLELISM - 1))
    data = pa.concat_tables([pq.read_table(s.path, filesystem=table.filesystem) for s in segments])
    kgs = data.column("key_group").to_numpy().astype(np.int64)
    owner = task_for_key_group(MAX_PARALLELISM, parallelism, kgs)
    written = 0
    for t in range(parallelism):
        path = out / f"task-{t}.parquet"
        pq.write_table(data.filter(pa.array(owner == t)), path, compression="zstd")
        written += path.stat().st_size
    table.close()
    return {"parallelism": parallelism, "rescale_s": time.perf_counter() - t0, "bytes_copied": written}


def main(
    quick: bool = typer.Option(False, help="small sizes, for a smoke run"),
    small: int = typer.Option(100_000, help="keys of the small state"),
    big: int = typer.Option(2_000_000, help="keys of the big state"),
    probe: int = typer.Option(1_000, help="keys each task looks up after the rescale"),
    repeat: int = typer.Option(3, help="runs of each rescale (the fastest is reported)"),
) -> None:
    if quick:
        small, big, probe, repeat = 10_000, 100_000, 200, 2
    tmp = Path(tempfile.mkdtemp(prefix="bench_rescale_"))
    warehouse = str(tmp / "warehouse")
    results: dict = {"machine": machine_info(),
                     "sizes": {"small": small, "big": big, "probe": probe}, "runs": {}}
    try:
        for label, n in (("small", small), ("big", big)):
            build_state(warehouse, label, n)
            for p in (8, 3):
                runs = [ours(warehouse, label, n, p, probe) for _ in range(repeat)]
                best = min(runs, key=lambda r: r["rescale_s"])
                peer = min((copying_peer(warehouse, label, p, tmp / f"copy-{label}-{p}") for _ in range(repeat)),
                           key=lambda r: r["rescale_s"])
                results["runs"][f"{label}-{p}"] = {"keys": n, "ours": best, "copying_peer": peer}
                console.log(f"{n:,} keys, 4 -> {p}: ours {best['rescale_s'] * 1e3:.1f} ms, "
                            f"{best['bytes_copied']} bytes copied; copying peer {peer['rescale_s']:.2f} s, "
                            f"{peer['bytes_copied']:,} bytes")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for p in (8, 3):
        s, b = results["runs"][f"small-{p}"], results["runs"][f"big-{p}"]
        results[f"ratio_big_over_small_{p}"] = b["ours"]["rescale_s"] / s["ours"]["rescale_s"]
        results[f"peer_ratio_big_over_small_{p}"] = b["copying_peer"]["rescale_s"] / s["copying_peer"]["rescale_s"]
    write_results("bench_rescale_quick.json" if quick else "bench_rescale.json", results)
    _report(results)


def _report(r: dict) -> None:
    t = Table(title="rescale of a keyed state (4 tasks -> p), ours against a copying rescale in the same run")
    for col in ("state", "to p", "ours: rescale ms", "first lookups ms", "bytes copied", "max task read share",
                "copying peer s", "peer bytes written", "peer / ours"):
        t.add_column(col, justify="right")
    for run in r["runs"].values():
        o, c = run["ours"], run["copying_peer"]
        t.add_row(f"{run['keys']:,}", str(o["parallelism"]), f"{o['rescale_s'] * 1e3:.1f}",
                  f"{o['first_lookups_s'] * 1e3:.0f}", str(o["bytes_copied"]), f"{o['max_task_read_share']:.1%}",
                  f"{c['rescale_s']:.2f}", f"{c['bytes_copied']:,}", f"{c['rescale_s'] / o['rescale_s']:.0f}x")
    console.print(t)
    for p in (8, 3):
        console.print(f"4 -> {p}: rescale time big/small: ours {r[f'ratio_big_over_small_{p}']:.2f} (target <= 1.2), "
                      f"copying peer {r[f'peer_ratio_big_over_small_{p}']:.1f}")


if __name__ == "__main__":
    typer.run(main)
