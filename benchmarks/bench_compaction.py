"""Compaction benchmark: many checkpoints of small deltas.

A job of 4 tasks (max parallelism 128, one partition: units are the tasks' key-group ranges)
loads a base state of ``keys`` keys (a value and a list per key), then commits
``checkpoints`` checkpoints of ``delta`` updated keys each (puts, list appends, a few clears),
one every ``interval`` seconds at most, as a stream's trigger paces them.
Measured, in the same run:

1. *Lookups and files.* After the deltas, without compaction: segments per unit, and the
   time of a task's first batched lookup of ``probe`` of its keys on a fresh table object
   (cold: footers and row groups read from disk; median of ``repeat``). Then one on-demand
   compaction (``compact``: whole units), and the same figures again.
2. *Checkpoint time beside compaction.* The same deltas on two fresh tables: one with no
   compaction at all, one with the compactor process the stream gets by default
   (``CompactorProcess``, default policy). p50/p99 of the checkpoint time (flush of the 4
   tasks + commit), and, for the run with the compactor, of the checkpoints that overlapped
   a compaction (from the compaction snapshots' start and commit times). Target: p99 within
   1.5x of the run without compaction.
3. *Write amplification.* Bytes written by checkpoints and by compactions over the run
   with the compactor (default, size-tiered policy) and over a third run whose policy merges
   every unit whole each time (``size_ratio`` huge), the leveled-to-one extreme.

Prints tables, writes ``benchmarks/results/bench_compaction.json`` and a plot
``bench_compaction.png``. Run: ``.venv/bin/python -m benchmarks.bench_compaction``
(``--quick`` for a smaller run).
"""

from __future__ import annotations

import os
import platform
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
    MAX_PARALLELISM,
    USER_KEY_SCHEMA,
    console,
    owners,
    progress,
    pyplot,
    results_path,
    save_figure,
    user_keys,
    write_results,
)
from catalog import IcebergStateTable
from catalog.compaction import CompactionPolicy, compact, units
from catalog.compactor import CompactorProcess
from catalog.table_ref import TableRef
from statestore import ListStateDescriptor, StateLayout, StateStore, ValueStateDescriptor

PARALLELISM = 4
LAYOUT = StateLayout.of(USER_KEY_SCHEMA,
                        [ValueStateDescriptor("count", pa.int64()), ListStateDescriptor("recent", pa.int64())],
                        max_parallelism=MAX_PARALLELISM)


class Job:
    """4 task stores on one table, committing checkpoints as a stream's driver does."""

    def __init__(self, warehouse: str, name: str, keys: int):
        self.table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=name, retain_checkpoints=10)
        self.stores = [StateStore(self.table, task_index=t, parallelism=PARALLELISM) for t in range(PARALLELISM)]
        self.owner = owners(user_keys(np.arange(keys)), PARALLELISM)
        self.bytes_written = 0

    def write(self, ids: np.ndarray, value: int, cleared: np.ndarray | None = None) -> None:
        for t, store in enumerate(self.stores):
            mine = ids[self.owner[ids] == t]
            if len(mine):
                store.get_state("count").update_batch(user_keys(mine), pa.array(np.full(len(mine), value)))
                store.get_state("recent").add_batch(user_keys(mine[: len(mine) // 4]), pa.array(
                    np.full(len(mine) // 4, value)))
            if cleared is not None:
                gone = cleared[self.owner[cleared] == t]
                if len(gone):
                    store.get_state("count").clear_batch(user_keys(gone))
                    store.get_state("recent").clear_batch(user_keys(gone))

    def checkpoint(self, batch_id: int) -> float:
        """Flush every task and commit; returns the seconds it took."""
        started = time.perf_counter()
        cp = self.table.next_checkpoint_id()
        segments = [seg for s in self.stores for seg in s.flush(cp)]
        self.table.commit_checkpoint(cp, segments, parallelism=PARALLELISM, batch_id=batch_id)
        for s in self.stores:
            s.checkpoint_complete(cp)
        self.bytes_written += sum(s.size_bytes for s in segments)
        return time.perf_counter() - started

    def close(self) -> None:
        for s in self.stores:
            s.close()
        self.table.close()


def _deltas(keys: int, checkpoints: int, delta: int, seed: int = 7):
    rng = np.random.default_rng(seed)
    for c in range(checkpoints):
        ids = np.unique(rng.integers(0, keys, delta))
        yield c, ids, ids[: max(1, len(ids) // 50)] if c % 5 == 4 else None


def _build(warehouse: str, name: str, keys: int) -> Job:
    job = Job(warehouse, name, keys)
    for lo in range(0, keys, 250_000):
        job.write(np.arange(lo, min(keys, lo + 250_000)), 0)
    job.checkpoint(batch_id=0)
    return job


def _run_deltas(job: Job, keys: int, checkpoints: int, delta: int, label: str, interval: float,
                compactor: CompactorProcess | None = None) -> list[tuple[float, float, float]]:
    """(start epoch s, end epoch s, seconds) of each checkpoint, one every ``interval`` seconds
    at most (a stream's trigger interval)."""
    times = []
    tick = time.monotonic()
    for c, ids, cleared in progress(list(_deltas(keys, checkpoints, delta)), label):
        tick += interval
        time.sleep(max(0.0, tick - time.monotonic()))
        job.write(ids, c + 1, cleared)
        t0 = time.time()
        seconds = job.checkpoint(batch_id=c + 1)
        times.append((t0, time.time(), seconds))
        if compactor is not None:
            compactor.checkpoint_committed(job.table)
    return times


def _lookup_seconds(warehouse: str, name: str, keys: int, probe: int, repeat: int) -> float:
    """Median time of a task's first batched lookup of ``probe`` of its keys, cold."""
    ids = np.arange(keys)
    mine = ids[owners(user_keys(ids), PARALLELISM) == 0]
    rng = np.random.default_rng(3)
    samples = []
    for _ in range(repeat):
        table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=name)
        store = StateStore(table, task_index=0, parallelism=PARALLELISM)
        wanted = user_keys(np.sort(rng.choice(mine, probe, replace=False)))
        t0 = time.perf_counter()
        store.get_state("count").get_batch(wanted)
        samples.append(time.perf_counter() - t0)
        store.close()
        table.close()
    return statistics.median(samples)


def _files_per_unit(warehouse: str, name: str) -> list[int]:
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=name) as table:
        return [len(table.segments(u)) for u in units(table)]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q)) if values else float("nan")


def main(
    keys: int = typer.Option(1_000_000, help="keys of the base state"),
    checkpoints: int = typer.Option(200, help="checkpoints of small deltas"),
    delta: int = typer.Option(2_000, help="keys updated per checkpoint"),
    probe: int = typer.Option(1_000, help="keys of the lookup"),
    repeat: int = typer.Option(5, help="repetitions of each lookup"),
    interval: float = typer.Option(0.5, help="seconds between checkpoint starts (a stream's trigger interval)"),
    quick: bool = typer.Option(False, help="a small run (100k keys, 60 checkpoints)"),
    plot: bool = typer.Option(True, help="write bench_compaction.png"),
) -> None:
    if quick:
        keys, checkpoints = 100_000, 60
    root = Path(tempfile.mkdtemp(prefix="bench_compaction_"))
    wh = str(root / "wh")
    results: dict = {"keys": keys, "checkpoints": checkpoints, "delta": delta, "probe": probe, "interval_s": interval,
                     "parallelism": PARALLELISM, "max_parallelism": MAX_PARALLELISM,
                     "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                     "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        # 1 + 2a: no compaction at all
        job = _build(wh, "plain", keys)
        plain = _run_deltas(job, keys, checkpoints, delta, "deltas, no compaction", interval)
        plain_bytes = job.bytes_written
        job.close()
        files_before = _files_per_unit(wh, "plain")
        lookup_before = _lookup_seconds(wh, "plain", keys, probe, repeat)
        with IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="plain") as table:
            t0 = time.perf_counter()
            once = compact(table)
            compact_seconds = time.perf_counter() - t0
        files_after = _files_per_unit(wh, "plain")
        lookup_after = _lookup_seconds(wh, "plain", keys, probe, repeat)
        results["lookups"] = {
            "files_per_unit_before": files_before, "files_per_unit_after": files_after,
            "lookup_ms_before": lookup_before * 1000, "lookup_ms_after": lookup_after * 1000,
            "speedup": lookup_before / lookup_after, "compaction_s": compact_seconds,
            "compaction": once.summary() if once else None}

        # 2b + 3: the compactor the stream gets by default, then whole merges every time
        runs = {}
        for name, policy in (("tiered", CompactionPolicy()),
                             ("whole", CompactionPolicy(size_ratio=1e12))):
            job = _build(wh, name, keys)
            base_bytes = job.bytes_written
            compactor = CompactorProcess(TableRef(name, warehouse=wh), policy)
            times = _run_deltas(job, keys, checkpoints, delta, f"deltas, compactor ({name})", interval, compactor)
            compactor.close()
            done = compactor.results  # every compaction (retention expires old snapshots' summaries)
            with IcebergStateTable.open(LAYOUT, warehouse=wh, table_name=name) as table:
                files = [len(table.segments(u)) for u in units(table)]
            spans = [(c["started_ms"] / 1000, c["finished_ms"] / 1000) for c in done]
            during = [s for a, b, s in times if any(a < e and b > st for st, e in spans)]
            delta_bytes = job.bytes_written - base_bytes
            compacted = sum(c["bytes_out"] for c in done)
            runs[name] = {
                "checkpoint_ms_p50": _pct([s for *_, s in times], 50),
                "checkpoint_ms_p99": _pct([s for *_, s in times], 99),
                "during_compaction_ms_p50": _pct(during, 50), "during_compaction_ms_p99": _pct(during, 99),
                "checkpoints_during_compaction": len(during), "compactions": len(done),
                "files_per_unit_end": files, "checkpoint_bytes": delta_bytes, "compaction_bytes": compacted,
                "write_amplification": (delta_bytes + compacted) / delta_bytes,
                "series_ms": [s * 1000 for *_, s in times], "spans": spans, "t0": times[0][0]}
            job.close()
        results["plain"] = {"checkpoint_ms_p50": _pct([s for *_, s in plain], 50),
                            "checkpoint_ms_p99": _pct([s for *_, s in plain], 99), "checkpoint_bytes": plain_bytes,
                            "series_ms": [s * 1000 for *_, s in plain]}
        results["runs"] = runs
        results["p99_ratio_with_compactor"] = runs["tiered"]["checkpoint_ms_p99"] / results["plain"][
            "checkpoint_ms_p99"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(results)
    write_results("bench_compaction.json", results, indent=1)
    if plot:
        _plot(results, results_path("bench_compaction.png"))


def _print(r: dict) -> None:
    lk = r["lookups"]
    t = Table(title=f"after {r['checkpoints']} checkpoints of {r['delta']:,} keys on {r['keys']:,} keys "
                    f"({r['parallelism']} tasks)")
    for col in ("", "files per unit (max)", f"cold lookup of {r['probe']:,} keys"):
        t.add_column(col)
    t.add_row("before compaction", str(max(lk["files_per_unit_before"])), f"{lk['lookup_ms_before']:.1f} ms")
    t.add_row("after compaction", str(max(lk["files_per_unit_after"])), f"{lk['lookup_ms_after']:.1f} ms")
    t.add_row("ratio", "", f"{lk['speedup']:.1f}x faster (compaction took {lk['compaction_s']:.1f} s)")
    console.print(t)
    t = Table(title="checkpoint time (flush of 4 tasks + commit)")
    for col in ("run", "p50 ms", "p99 ms", "p99 during a compaction", "compactions", "files/unit at end",
                "write amplification"):
        t.add_column(col)
    p = r["plain"]
    t.add_row("no compaction", f"{p['checkpoint_ms_p50']:.0f}", f"{p['checkpoint_ms_p99']:.0f}", "", "0", "", "1.00")
    for name, run in r["runs"].items():
        t.add_row(f"compactor, {name}", f"{run['checkpoint_ms_p50']:.0f}", f"{run['checkpoint_ms_p99']:.0f}",
                  f"{run['during_compaction_ms_p99']:.0f} ({run['checkpoints_during_compaction']} checkpoints)",
                  str(run["compactions"]), str(max(run["files_per_unit_end"])), f"{run['write_amplification']:.2f}")
    console.print(t)
    console.print(f"p99 with the default compactor / without compaction: {r['p99_ratio_with_compactor']:.2f}x "
                  "(target: at most 1.5x)")


def _plot(r: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(10, 4))
    ax.plot(r["plain"]["series_ms"], label="no compaction", lw=0.8)
    run = r["runs"]["tiered"]
    ax.plot(run["series_ms"], label="compactor (default policy)", lw=0.8)
    ax.set_xlabel("checkpoint")
    ax.set_ylabel("checkpoint time (ms)")
    ax.set_title(f"{r['checkpoints']} checkpoints of {r['delta']:,}-key deltas on {r['keys']:,} keys")
    ax.legend()
    save_figure(fig, path, dpi=120)
    console.print(f"plot: {path}")


if __name__ == "__main__":
    typer.run(main)
