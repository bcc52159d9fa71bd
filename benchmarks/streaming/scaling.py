"""The scenarios of state size: how checkpoint, restart and rescale grow with the
state, what the state costs on disk, and throughput when the state outgrows the in-memory cache.

**Scaling.** For each state size (keys), a query of Spark's RocksDB ``groupBy().count()`` and
one of ours build the state (``build`` insert batches that write every key once, then
``steady`` uniform update batches of ``batch_events``), then restart twice, first with a small
batch (``small_events``) and then with a full one, then rescale 4 -> ``rescale_to`` (Spark: its
experimental offline ``repartition`` and a restart; ours: a restart at the new parallelism) with
a full batch. Two fresh queries on an empty state (one per first-batch size, the same for
every state size) give what any new process pays whatever the state. Measured per size:

- checkpoint time: the median over the steady batches of the state's commit, summed over the
  tasks (Spark: ``stateOperators.commitTimeMs``; ours: the tasks' flush plus the driver's commit);
- restart: query start to the end of its first batch, minus the same of the fresh query with a
  first batch of the same size (ours can be below zero: a fresh query also creates its table),
  and the same not minus the fresh query (what a user waits; the headline's spread is of these);
- rescale: the same of the first batch at the new parallelism (Spark: plus the offline step);
- storage: the state's bytes on disk after the build (Spark's checkpoint ``state`` folder; our
  table's folder), with the same retention (10 versions, ``session.SPARK_CONF``).

**Cache.** One state of ``keys`` keys (uniform updates, so every batch touches most key
groups), built and updated by ours with the in-memory view cache holding the whole state (1x: unbounded)
and bound to 0.3x and 0.1x of it (the state's views measured at the end of the 1x run; the bound
is per task store, the state's share of one task),
and by Spark's RocksDB store on the same files: steady throughput of the update batches.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.table import Table

from benchmarks.harness import console, events_per_s, fmt, pyplot, ratio, save_figure
from benchmarks.streaming.data import RestartData, make_restart_data
from benchmarks.streaming.restart import (
    Feeder,
    build_step,
    ours_restart_and_rescale,
    spark_restart_and_rescale,
    stream_step,
)
from benchmarks.streaming.runner import Runner

SPARK = "spark-count-rocksdb"
RESTARTS = ("restart_small", "restart_large")
PARALLELISM = 4
UNBOUNDED = 1 << 40  # a cache bound no state of the benchmark reaches


def _checkpoint_ms(step: dict, first_steady: int) -> float | None:
    """Median over the steady batches of the state's commit time, summed over the tasks."""
    if "error" in step:
        return None
    if step.get("ours_batches"):
        times = [b["task_flush_ms"] + b["commit_ms"] for b in step["ours_batches"][first_steady:]]
    else:
        times = [b["state_commit_ms"] for b in step["per_batch"][first_steady:] if b["state_commit_ms"] is not None]
    return statistics.median(times) if times else None


def _start_to_first(step: dict | None) -> float | None:
    return None if not step or "error" in step else step.get("start_to_first_batch_end_s")


def _beyond(step: dict | None, base: dict | None) -> float | None:
    """How much longer ``step`` took from its query's start to its first batch's end than ``base``."""
    a, b = _start_to_first(step), _start_to_first(base)
    return a - b if a is not None and b is not None else None


def _fresh(runner: Runner, rd: RestartData, impl: str, index: int, name: str) -> dict:
    """A fresh query on an empty state whose only file is the data set's file ``index``."""
    label = f"{impl}-fresh-{name}"
    feeder = Feeder(runner.root / "sources" / label, [rd.all.files[index]])
    return stream_step(runner, feeder, impl, label, rd, 1, f"{impl}: a fresh query, first batch {name}",
                       check=False)


def run_scaling(runner: Runner, sizes: list[int], batch_events: int, small_events: int, rescale_to: int,
                ours_impl: str, ours_reason: str | None, build: int = 4, steady: int = 3) -> dict:
    out: dict = {"sizes": sizes, "batch_events": batch_events, "small_events": small_events,
                 "rescale_to": rescale_to, "build_batches": build, "steady_batches": steady,
                 "impls": [SPARK, ours_impl], "fresh": {}, "runs": {}}
    impls = [SPARK] + ([] if ours_reason else [ours_impl])
    if ours_reason:
        out["ours_unavailable_reason"] = ours_reason
    for i, keys in enumerate(sizes):
        rd = make_restart_data(runner.root, keys, build, steady, [small_events, batch_events, batch_events],
                               batch_events, seed=20 + i, name=f"scale-{keys}")
        if i == 0:  # what a fresh process pays whatever the state: the same for every size
            first_after = build + steady
            for impl in impls:
                out["fresh"][impl] = {"small": _fresh(runner, rd, impl, first_after, "small"),
                                      "large": _fresh(runner, rd, impl, first_after + 1, "large")}
        out["runs"][str(keys)] = {
            SPARK: spark_restart_and_rescale(runner, rd, rescale_to, RESTARTS, f"{SPARK}-scale-{keys}"),
            **({ours_impl: ours_restart_and_rescale(runner, rd, rescale_to, ours_impl, None, RESTARTS,
                                                    f"{ours_impl}-scale-{keys}")} if not ours_reason else {}),
        }
    derive_scaling(out)
    return out


def derive_scaling(out: dict) -> None:
    """Per size and implementation the four figures; per implementation their spread across
    sizes (largest over smallest: the target is at most 1.3 for ours)."""
    figures: dict = {}
    for keys, runs in out["runs"].items():
        for impl, run in runs.items():
            fresh = out["fresh"].get(impl, {})
            if run.get("status", "ok") != "ok" or "error" in run.get("build", {}):
                continue
            build = run["build"]
            rescale = run.get("after_repartition") or run.get("rescale")
            offline = (run.get("repartition") or {}).get("repartition_s", 0) if impl == SPARK else 0

            rescale_s = _beyond(rescale, fresh.get("large"))
            storage = (build.get("storage") or {}).get("state", {})
            checks = [st["verified"]["ok"] for st in run.values() if isinstance(st, dict) and "verified" in st]
            figures.setdefault(impl, {})[keys] = {
                "steady_batch_s": build.get("steady_batch_s_median"),
                "checkpoint_ms": _checkpoint_ms(build, out["build_batches"]),
                "restart_small_s": _beyond(run.get("restart_small"), fresh.get("small")),
                "restart_large_s": _beyond(run.get("restart_large"), fresh.get("large")),
                "rescale_s": None if rescale_s is None else rescale_s + offline,
                # The same from the query's start, fresh query not subtracted: what a user waits.
                "restart_small_raw_s": _start_to_first(run.get("restart_small")),
                "restart_large_raw_s": _start_to_first(run.get("restart_large")),
                "rescale_raw_s": None if _start_to_first(rescale) is None else _start_to_first(rescale) + offline,
                "storage_bytes": storage.get("bytes"), "storage_files": storage.get("files"),
                "verified": bool(checks) and all(checks),
            }
    out["figures"] = figures
    spread: dict = {}
    for impl, by_size in figures.items():
        spread[impl] = {}
        for name in ("checkpoint_ms", "restart_small_s", "restart_large_s", "rescale_s", "restart_small_raw_s",
                     "restart_large_raw_s", "rescale_raw_s"):
            values = [f[name] for f in by_size.values() if f[name] is not None]
            # Differences from a fresh query can be about zero or below: spread of the larger of
            # the figure and a tenth of a second, so that noise around zero is not a ratio.
            floor = 100.0 if name == "checkpoint_ms" else 0.1
            spread[impl][name] = max(max(v, floor) for v in values) / max(min(values), floor) if values else None
    out["spread"] = spread
    ours = next((i for i in figures if i != SPARK), None)
    out["storage_ratio"] = {keys: ratio(figures[ours][keys]["storage_bytes"], figures[SPARK][keys]["storage_bytes"])
                            for keys in figures.get(SPARK, {}) if ours and keys in figures[ours]}


def run_cache(runner: Runner, keys: int, batch_events: int, fractions: list[float], ours_impl: str,
              ours_reason: str | None, build: int = 4, steady: int = 5) -> dict:
    rd = make_restart_data(runner.root, keys, build, steady, 0, batch_events, seed=40, name=f"cache-{keys}")
    out: dict = {"keys": keys, "batch_events": batch_events, "fractions": fractions, "build_batches": build,
                 "steady_batches": steady, "runs": {}}

    def run(impl: str, name: str, store_config: dict | None, note: str) -> dict:
        label = f"{impl}-cache-{name.replace('.', '_')}"
        feeder = Feeder(runner.root / "sources" / label, rd.all.files)
        step = build_step(runner, feeder, impl, label, rd, store_config, note)
        out["runs"][name] = {"impl": impl, "store_config": store_config, **step}
        return step

    run(SPARK, "rocksdb", None, " on RocksDB")
    if ours_reason:
        out["ours_unavailable_reason"] = ours_reason
        return out
    ref = run(ours_impl, "1x", {"cache_size_bytes_max": UNBOUNDED}, ", cache unbounded (holds the whole state)")
    if "error" in ref:
        return out
    # The views' bytes of the whole state: every task's store after the last batch.
    out["state_view_bytes"] = state = ref["ours_batches"][-1]["cache_size_bytes"]
    for f in fractions:
        bound = max(1, int(f * state / PARALLELISM))
        run(ours_impl, f"{f:g}x", {"cache_size_bytes_max": bound}, f", cache {f:g}x the state ({bound:,} B per store)")
    derive_cache(out)
    return out


def derive_cache(out: dict) -> None:
    for run in out["runs"].values():
        if "error" in run:
            continue
        run["steady_events_per_s"] = events_per_s(run["per_batch"][out["build_batches"]:])
        if run.get("ours_batches"):
            run["steady_cache_evictions"] = sum(b["task_cache_evictions"] for b in
                                                run["ours_batches"][out["build_batches"]:])
            run["steady_bytes_read"] = sum(b["task_bytes_read"] for b in run["ours_batches"][out["build_batches"]:])
    runs = out["runs"]
    full = runs.get("1x", {}).get("steady_events_per_s")
    rocks = runs.get("rocksdb", {}).get("steady_events_per_s")
    for run in runs.values():
        rate = run.get("steady_events_per_s")
        run["vs_1x"] = ratio(rate, full)
        run["vs_rocksdb"] = ratio(rate, rocks)


# Report -------------------------------------------------------------------------------------

def report_scaling(out: dict | None) -> None:
    if not out or not out.get("figures"):
        return
    t = Table(title=f"state size: checkpoint, restart and rescale ({out['batch_events']:,}-event batches; restart "
                    f"and rescale: query start to first batch end minus a fresh query's; small first batch "
                    f"{out['small_events']:,} events)")
    for col in ("implementation", "state keys", "steady batch s", "checkpoint ms", "restart small s",
                "restart large s", f"rescale 4->{out['rescale_to']} s", "from query start: restart small / large / "
                "rescale s", "state on disk MB", "files", "verified"):
        t.add_column(col, justify="left" if col == "implementation" else "right")
    for impl, by_size in out["figures"].items():
        for keys, f in by_size.items():
            t.add_row(impl, f"{int(keys):,}", fmt(f["steady_batch_s"], ".2f"), fmt(f["checkpoint_ms"], ".0f"),
                      fmt(f["restart_small_s"], ".2f"), fmt(f["restart_large_s"], ".2f"), fmt(f["rescale_s"], ".2f"),
                      " / ".join(fmt(f[k], ".2f") for k in ("restart_small_raw_s", "restart_large_raw_s",
                                                             "rescale_raw_s")),
                      fmt(None if f["storage_bytes"] is None else f["storage_bytes"] / 1e6, ".1f"),
                      str(f["storage_files"]), "yes" if f["verified"] else "[red]NO[/red]")
    lines = [f"{impl}: largest / smallest across sizes: " + ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in s.items())
             for impl, s in out["spread"].items()]
    lines += [f"ours / Spark's RocksDB on disk at {int(k):,} keys: {fmt(v, '.2f')}x"
              for k, v in out["storage_ratio"].items()]
    t.caption = "\n".join(lines)
    console.print(t)


def report_cache(out: dict | None) -> None:
    if not out or not out.get("runs"):
        return
    t = Table(title=f"state larger than the cache: {out['keys']:,} keys, {out['batch_events']:,}-event uniform "
                    f"update batches (views of the whole state: {out.get('state_view_bytes', 0) / 1e6:,.0f} MB)")
    for col in ("run", "steady events/s", "vs cache 1x", "vs RocksDB", "evictions", "MB read", "verified"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for name, run in out["runs"].items():
        if "error" in run:
            t.add_row(name, f"error: {run['error'][:80]}", *[""] * 5)
            continue
        t.add_row(f"{run['impl']} {name}", fmt(run.get("steady_events_per_s"), ",.0f"),
                  fmt(run.get("vs_1x"), ".2f"), fmt(run.get("vs_rocksdb"), ".2f"),
                  fmt(run.get("steady_cache_evictions"), ",.0f"),
                  fmt(None if run.get("steady_bytes_read") is None else run["steady_bytes_read"] / 1e6, ",.0f"),
                  "yes" if run["verified"]["ok"] else "[red]NO[/red]")
    console.print(t)


def plot_state_size(results: dict, path: Path) -> bool:
    """The scaling figures per size and the cache runs, side by side; False when neither ran."""
    scaling, cache = results.get("scaling"), results.get("cache")
    panels = []
    if scaling and scaling.get("figures"):
        panels += ["checkpoint_ms", "restart_small_raw_s", "rescale_raw_s", "storage_bytes"]
    if cache and cache.get("runs"):
        panels.append("cache")
    if not panels:
        return False
    fig, axes = pyplot().subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    titles = {"checkpoint_ms": "checkpoint (ms, summed over tasks)",
              "restart_small_raw_s": "restart, small batch: start to 1st batch end (s)",
              "rescale_raw_s": "rescale 4 -> 8: start to 1st batch end (s)", "storage_bytes": "state on disk (MB)"}
    for ax, name in zip(axes[0], panels, strict=True):
        if name == "cache":
            runs = {k: r for k, r in cache["runs"].items() if r.get("steady_events_per_s")}
            ax.bar(list(runs), [r["steady_events_per_s"] / 1e3 for r in runs.values()],
                   color=["C3" if r["impl"] == SPARK else "C2" for r in runs.values()])
            ax.set_title(f"steady ev/s (k), {cache['keys']:,} keys, cache bound")
            continue
        for impl, by_size in scaling["figures"].items():
            xs = [int(k) for k in by_size]
            ys = [by_size[k][name] for k in by_size]
            ys = [None if y is None else (y / 1e6 if name == "storage_bytes" else y) for y in ys]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=impl,
                    color="C3" if impl == SPARK else "C2")
        ax.set_xscale("log")
        ax.set_xlabel("state keys")
        ax.set_title(titles[name])
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)
    return True
