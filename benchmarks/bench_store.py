"""Benchmark of the keyed state store on Iceberg.

Measures, on this machine, in one run:

1. batched lookup throughput (keys/s): ``lookup`` keys against a ``big``-key value state,
   warm cache and cold cache, beside rocksdict (RocksDB's Python binding) reading the same
   keys from the same data, both with its multi-get and with a per-key loop, and beside the
   limit: a polars left join of the same keys against the same state in one in-memory frame;
2. checkpoint time of the same ``delta``-key delta on a ``small``-key and a ``big``-key state;
3. time from restore to the first successful lookup on both states;
4. commit time after ``many`` checkpoints versus after 10, with retention on.

Prints a table, writes ``benchmarks/results/bench_store.json`` and a plot beside it.
Run: ``.venv/bin/python -m benchmarks.bench_store`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import typer
from rich.table import Table

from benchmarks.harness import (
    COUNT,
    best_of,
    console,
    count_layout,
    machine_info,
    progress,
    pyplot,
    results_path,
    save_figure,
    user_keys,
    write_results,
)
from catalog import IcebergStateTable
from statestore import StateStore, StoreConfig


def _build_state(warehouse: str, name: str, n_keys: int, checkpoints: int = 4) -> IcebergStateTable:
    """A table whose newest checkpoint holds ``n_keys`` keys, written in ``checkpoints``
    checkpoints whatever the size, so that states of different sizes differ only in size."""
    chunk = -(-n_keys // checkpoints)
    table = IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name=name)
    store = StateStore(table)
    state = store.get_state(COUNT)
    for lo in progress(range(0, n_keys, chunk), f"building {n_keys:,}-key state"):
        ids = np.arange(lo, min(lo + chunk, n_keys))
        state.update_batch(user_keys(ids), pa.array(ids, pa.int64()))
        store.checkpoint()
    store.close()
    return table


def bench_lookup(warehouse: str, big: int, lookup: int, tmp: Path) -> dict:
    table = _build_state(warehouse, "lookup_state", big)
    rng = np.random.default_rng(1)
    ids = rng.choice(big, size=lookup, replace=False)
    keys = user_keys(ids)
    config = StoreConfig(cache_size_bytes_max=4 * 1024**3)

    cold_store = StateStore(IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name="lookup_state"),
                            config=config)
    t0 = time.perf_counter()
    got = cold_store.get_state(COUNT).get_batch(keys)
    cold = time.perf_counter() - t0
    if got.to_numpy().tolist() != ids.tolist():
        raise AssertionError("cold lookup returned wrong values")
    # Each warm lookup asks the keys in another order: a store remembers the keys it prepared
    # last (equal keys are not hashed again), and a real batch's keys are not the last batch's.
    orders = itertools.cycle([keys.take(np.random.default_rng(seed).permutation(lookup)) for seed in range(3)])
    warm = best_of(lambda: cold_store.get_state(COUNT).get_batch(next(orders)), repeat=3)

    # The limit of a batched lookup: a plain polars left join of the same keys against the same
    # state held in one in-memory frame (no key groups, no files, no versions).
    import polars as pl

    all_ids = np.arange(big)
    frame = pl.DataFrame({"user": np.char.add("user-", all_ids.astype(str)), "count": all_ids})
    probe = pl.from_arrow(keys)

    def polars_join() -> pl.DataFrame:
        return probe.join(frame, on="user", how="left", maintain_order="left")

    joined = best_of(polars_join, repeat=3)
    if polars_join()["count"].to_list() != ids.tolist():
        raise AssertionError("the polars join returned wrong values")


    import rocksdict

    opts = rocksdict.Options(raw_mode=True)
    db = rocksdict.Rdict(str(tmp / "rocks"), opts)
    wb_keys = [f"user-{i}".encode() for i in all_ids]
    for k, v in zip(wb_keys, all_ids.tolist(), strict=True):
        db[k] = v.to_bytes(8, "little", signed=True)
    db.flush()
    look = [f"user-{i}".encode() for i in ids]
    multi = best_of(lambda: db.get(look), repeat=3)
    loop = best_of(lambda: [db.get(k) for k in look], repeat=3)
    if int.from_bytes(db.get(look[0]), "little") != ids[0]:
        raise AssertionError("rocksdict returned a wrong value")
    db.close()
    del table
    return {
        "state_keys": big, "lookup_keys": lookup,
        "ours_warm_keys_per_s": lookup / warm, "ours_cold_keys_per_s": lookup / cold,
        "rocksdict_multiget_keys_per_s": lookup / multi, "rocksdict_loop_keys_per_s": lookup / loop,
        "warm_vs_rocksdict_multiget": multi / warm, "warm_vs_rocksdict_loop": loop / warm,
        "cold_vs_rocksdict_multiget": multi / cold,
        "polars_join_keys_per_s": lookup / joined, "warm_vs_polars_join": joined / warm,
        "cache_stats": cold_store.stats(),
    }


def bench_checkpoint_and_restore(warehouse: str, small: int, big: int, delta: int, repeat: int) -> dict:
    out: dict = {}
    for label, n in (("small", small), ("big", big)):
        name = f"cp_state_{label}"
        _build_state(warehouse, name, n)
        rng = np.random.default_rng(2)
        table = IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name=name)
        store = StateStore(table)
        state = store.get_state(COUNT)
        times = []
        for r in range(repeat):
            ids = rng.choice(n, size=delta, replace=False)
            state.update_batch(user_keys(ids), pa.array(np.full(delta, r, dtype=np.int64)))
            t0 = time.perf_counter()
            store.checkpoint()
            times.append(time.perf_counter() - t0)
        store.close()
        restore_times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fresh = StateStore(IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name=name))
            v = fresh.get_state(COUNT).get_batch(user_keys(np.array([n // 2])))
            restore_times.append(time.perf_counter() - t0)
            if v[0].as_py() is None:
                raise AssertionError("restored lookup found nothing")
        out[label] = {"state_keys": n, "delta_keys": delta, "checkpoint_s_median": statistics.median(times),
                      "checkpoint_s_all": times, "restore_to_first_lookup_s_median": statistics.median(restore_times),
                      "restore_s_all": restore_times}
    out["checkpoint_ratio_big_over_small"] = out["big"]["checkpoint_s_median"] / out["small"]["checkpoint_s_median"]
    out["restore_ratio_big_over_small"] = (out["big"]["restore_to_first_lookup_s_median"]
                                           / out["small"]["restore_to_first_lookup_s_median"])
    return out


def bench_commit_growth(warehouse: str, many: int, delta: int = 100) -> dict:
    table = IcebergStateTable.open(count_layout(), warehouse=warehouse, table_name="commit_growth",
                                   retain_checkpoints=10)
    store = StateStore(table)
    state = store.get_state(COUNT)
    rng = np.random.default_rng(3)
    commit_s = []
    for _ in progress(range(many), f"{many} checkpoints"):
        ids = rng.integers(0, 100_000, delta)
        state.update_batch(user_keys(ids), pa.array(ids, pa.int64()))
        segments = store.flush(table.next_checkpoint_id())
        t0 = time.perf_counter()
        table.commit_checkpoint(segments[0].checkpoint_id, segments, parallelism=1)
        commit_s.append(time.perf_counter() - t0)
        store.checkpoint_complete(segments[0].checkpoint_id)
    early = statistics.median(commit_s[5:15])
    late = statistics.median(commit_s[-10:])
    return {"checkpoints": many, "commit_s_median_at_10": early, f"commit_s_median_at_{many}": late,
            "ratio_late_over_early": late / early, "retained": len(table.list_checkpoints()),
            "commit_s_all": commit_s}


def _plot(results: dict, path: Path) -> None:
    fig, axes = pyplot().subplots(1, 3, figsize=(15, 4))
    lk = results["lookup"]
    names = ["ours warm", "ours cold", "polars join", "rocksdict multi-get", "rocksdict loop"]
    vals = [lk["ours_warm_keys_per_s"], lk["ours_cold_keys_per_s"], lk["polars_join_keys_per_s"],
            lk["rocksdict_multiget_keys_per_s"], lk["rocksdict_loop_keys_per_s"]]
    axes[0].bar(names, [v / 1e6 for v in vals], color=["C0", "C0", "C2", "C1", "C1"])
    axes[0].set_ylabel("million keys/s")
    axes[0].set_title(f"batched lookup, {lk['lookup_keys']:,} of {lk['state_keys']:,} keys")
    axes[0].tick_params(axis="x", rotation=20)
    cr = results["checkpoint_restore"]
    x = [f"{cr['small']['state_keys']:,}", f"{cr['big']['state_keys']:,}"]
    axes[1].bar([f"checkpoint\n{s}" for s in x],
                [cr["small"]["checkpoint_s_median"] * 1e3, cr["big"]["checkpoint_s_median"] * 1e3], color="C2")
    axes[1].bar([f"restore\n{s}" for s in x],
                [cr["small"]["restore_to_first_lookup_s_median"] * 1e3,
                 cr["big"]["restore_to_first_lookup_s_median"] * 1e3], color="C3")
    axes[1].set_ylabel("ms")
    axes[1].set_title(f"{cr['small']['delta_keys']:,}-key delta checkpoint; restore to first lookup")
    cg = results["commit_growth"]
    axes[2].plot(np.array(cg["commit_s_all"]) * 1e3, lw=0.6)
    axes[2].set_xlabel("checkpoint")
    axes[2].set_ylabel("commit ms")
    axes[2].set_title("commit time over a stream's life (retention 10)")
    save_figure(fig, path, dpi=110)


def main(
    quick: bool = typer.Option(False, help="small sizes, for a smoke run"),
    big: int = typer.Option(2_000_000), small: int = typer.Option(100_000), lookup: int = typer.Option(1_000_000),
    delta: int = typer.Option(10_000), many: int = typer.Option(1000), repeat: int = typer.Option(5),
) -> None:
    if quick:
        big, small, lookup, delta, many, repeat = 200_000, 20_000, 100_000, 2_000, 60, 3
    tmp = Path(tempfile.mkdtemp(prefix="bench_store_"))
    warehouse = str(tmp / "warehouse")
    try:
        results = {
            "machine": machine_info(),
            "lookup": bench_lookup(warehouse, big, lookup, tmp),
            "checkpoint_restore": bench_checkpoint_and_restore(warehouse, small, big, delta, repeat),
            "commit_growth": bench_commit_growth(warehouse, many),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stem = "bench_store_quick" if quick else "bench_store"
    write_results(f"{stem}.json", results)
    _plot(results, results_path(f"{stem}.png"))
    _report(results)


def _report(r: dict) -> None:
    t = Table(title="state store benchmark (ratios against the peer measured in the same run)")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("target", justify="right")
    lk, cr, cg = r["lookup"], r["checkpoint_restore"], r["commit_growth"]
    t.add_row("warm batched lookup, keys/s", f"{lk['ours_warm_keys_per_s']:,.0f}", "")
    t.add_row("cold batched lookup, keys/s", f"{lk['ours_cold_keys_per_s']:,.0f}", "")
    t.add_row("rocksdict multi-get, keys/s", f"{lk['rocksdict_multiget_keys_per_s']:,.0f}", "")
    t.add_row("rocksdict get loop, keys/s", f"{lk['rocksdict_loop_keys_per_s']:,.0f}", "")
    t.add_row("polars left join (state in one frame), keys/s", f"{lk['polars_join_keys_per_s']:,.0f}", "")
    t.add_row("warm / rocksdict multi-get", f"{lk['warm_vs_rocksdict_multiget']:.2f}x", ">= 1")
    t.add_row("warm / polars join", f"{lk['warm_vs_polars_join']:.2f}x", ">= 0.8")
    t.add_row("checkpoint ms, small / big state",
              f"{cr['small']['checkpoint_s_median'] * 1e3:.0f} / {cr['big']['checkpoint_s_median'] * 1e3:.0f}", "")
    t.add_row("checkpoint ratio big/small", f"{cr['checkpoint_ratio_big_over_small']:.2f}", "<= 1.3")
    t.add_row("restore-to-first-lookup ms, small / big",
              f"{cr['small']['restore_to_first_lookup_s_median'] * 1e3:.0f} / "
              f"{cr['big']['restore_to_first_lookup_s_median'] * 1e3:.0f}", "")
    t.add_row("restore ratio big/small", f"{cr['restore_ratio_big_over_small']:.2f}", "<= 1.3")
    late_key = f"commit_s_median_at_{cg['checkpoints']}"
    t.add_row(f"commit ms at 10 / at {cg['checkpoints']}",
              f"{cg['commit_s_median_at_10'] * 1e3:.1f} / {cg[late_key] * 1e3:.1f}", "")
    t.add_row("commit ratio late/early", f"{cg['ratio_late_over_early']:.2f}", "<= 1.5")
    console.print(t)


if __name__ == "__main__":
    typer.run(main)
