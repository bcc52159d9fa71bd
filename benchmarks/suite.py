"""The benchmark suite: every benchmark of the project behind one command, in one of three modes,
with its results, plots and a headline table in one folder.

Steps, each a benchmark's own command line in a process of its own (so that one failing step
leaves the others' figures), in this order:

- ``store`` (``bench_store``): batched lookups warm and cold against a polars join of the same
  keys (the limit) and rocksdict, checkpoint and restore time against state size, commit time
  over a stream's life;
- ``rescale`` (``bench_rescale``): rescale as metadata against a copying rescale;
- ``compaction`` (``bench_compaction``): lookups before and after compaction, checkpoint p99
  beside the compactor, write amplification;
- ``processors`` (``bench_processors``): one task's micro-batch of Spark-API processors with
  value, list and map state, and of the vectorized count, replayed at store level as the state
  grows (does a batch cost its own keys or the state?);
- ``start`` (``bench_start``): a tiny ``availableNow`` query in fresh drivers, ours against
  Spark's ``groupBy().count()`` (to the first trigger) and ``transformWithState`` with the same
  processor (to the query's end);
- ``spark`` (``bench_spark``): inside Spark, on the same input in the same run: throughput of
  ours against Spark's stateless floor (the same keyed count of each batch with no state) and
  Spark's state stores; the state-size scenarios (checkpoint, restart, rescale and state on disk
  as the state grows, against Spark's RocksDB store; throughput with the view cache at 1x, 0.3x
  and 0.1x of the state).

Modes: ``tiny`` (the smallest sizes every code path runs at: what the test suite runs, so that the
suite cannot rot; the Spark step's jobs run in one driver process there, one after the other,
so its figures are not comparable), ``quick`` (about 15 minutes on a 2-core machine) and ``full`` (2M
events over 200k keys, states of 1M, 5M and 20M keys; over an hour). Results go to
``docs/benchmarks/<mode>/`` (``--out`` elsewhere): each step's JSON and plots, its log, and
``summary.json``, ``summary.md`` (the headline table, the machine, the commands) and
``headline.png``. Figures are ratios against a peer measured in the same run.

Run: ``.venv/bin/python -m benchmarks.suite --mode quick`` (``--steps store,spark`` for some steps;
``--summarize-only`` to redraw the summary of the results already in the folder).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich.table import Table

from benchmarks.harness import REPO, RESULTS_DIR_ENV, console, machine_info, pyplot, repo_env, save_figure

MODES = ("tiny", "quick", "full")
DOCS = REPO / "docs" / "benchmarks"


@dataclass(frozen=True)
class Step:
    name: str
    module: str
    args: dict[str, list[str]]  # per mode
    result: dict[str, str]  # the JSON the step writes, per mode


_SPARK_COMMON = ["--sink", "noop", "--results-name", "spark"]
STEPS = (
    Step("store", "benchmarks.bench_store",
         {"tiny": ["--big", "2000", "--small", "500", "--lookup", "1000", "--delta", "100", "--many", "16",
                   "--repeat", "1"],
          "quick": ["--big", "1000000", "--small", "50000", "--lookup", "500000", "--delta", "10000", "--many", "200",
                    "--repeat", "3"],
          "full": []},
         {"tiny": "bench_store.json", "quick": "bench_store.json", "full": "bench_store.json"}),
    Step("rescale", "benchmarks.bench_rescale",
         {"tiny": ["--small", "1000", "--big", "5000", "--probe", "50", "--repeat", "1"], "quick": ["--quick"],
          "full": []},
         {"tiny": "bench_rescale.json", "quick": "bench_rescale_quick.json", "full": "bench_rescale.json"}),
    Step("compaction", "benchmarks.bench_compaction",
         {"tiny": ["--keys", "2000", "--checkpoints", "16", "--delta", "100", "--probe", "50", "--repeat", "1",
                   "--interval", "0"],
          "quick": ["--quick"], "full": []},
         {m: "bench_compaction.json" for m in MODES}),
    Step("processors", "benchmarks.bench_processors",
         {"tiny": ["--sizes", "2000,10000", "--events", "2000", "--batches", "2"],
          "quick": ["--sizes", "1000000,5000000", "--batches", "3"], "full": []},
         {m: "bench_processors.json" for m in MODES}),
    Step("async", "benchmarks.bench_async",
         {"tiny": ["--tiny"], "quick": ["--quick"], "full": []},
         {m: "bench_async.json" for m in MODES}),
    Step("start", "benchmarks.bench_start",
         {"tiny": ["--repeat", "1", "--one-driver"], "quick": ["--repeat", "3"], "full": ["--repeat", "5"]},
         {m: "bench_start.json" for m in MODES}),
    Step("spark", "benchmarks.bench_spark",
         {"tiny": [*_SPARK_COMMON, "--workloads", "throughput,scaling,cache", "--datasets", "main",
                   "--only", "spark-floor-count,ours-vectorized", "--events", "20000",
                   "--keys", "2000", "--batches", "3", "--scaling-keys", "3000", "--state-batch-events", "2000",
                   "--state-batches", "2,1", "--small-restart-events", "50", "--cache-keys", "3000",
                   "--cache-fractions", "0.1",
                   "--reruns", "0", "--quiet-wait", "0", "--timeout", "300", "--one-driver"],
          "quick": [*_SPARK_COMMON, "--workloads", "throughput,scaling,cache", "--datasets", "main",
                    "--only", "spark-floor-count,spark-floor-repartition,spark-count-rocksdb,spark-count-hdfs,"
                              "ours-vectorized,ours-compat",
                    "--events", "1000000", "--keys", "100000", "--batches", "5", "--scaling-keys", "100000,500000",
                    "--state-batch-events", "100000", "--small-restart-events", "1000", "--cache-keys", "500000",
                    "--reruns", "0", "--quiet-wait", "60"],
          "full": [*_SPARK_COMMON, "--workloads", "throughput,scaling,cache",
                   "--only", "spark-floor-count,spark-floor-repartition,spark-count-rocksdb,spark-count-hdfs,"
                             "spark-tws-rows,spark-tws-pandas,ours-vectorized,ours-compat,ours-pandas"]},
         {m: "spark.json" for m in MODES}),
)


def _run_step(step: Step, mode: str, out: Path) -> dict:
    log = out / "logs" / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", step.module, *step.args[mode]]
    console.log(f"[bold]{step.name}[/bold]: {' '.join(command[1:])} (log: {log})")
    t0 = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**repo_env(), RESULTS_DIR_ENV: str(out), "COLUMNS": "200"}).returncode
    seconds = time.perf_counter() - t0
    result = out / step.result[mode]
    ok = code == 0 and result.exists()
    console.log(f"  {step.name}: {'done' if ok else '[red]FAILED[/red]'} in {seconds:.0f} s")
    return {"command": " ".join(["python", *command[1:]]), "exit_code": code, "seconds": seconds,
            "result": result.name if result.exists() else None, "log": str(log.relative_to(out)), "ok": ok}


# The headline: one row per performance target, ours against the peer measured in the same run.

def _get(d: dict | None, *path: str | int) -> object:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _row(measure: str, value: float | None, unit: str, target: str, met: bool | None, peer: str) -> dict:
    return {"measure": measure, "value": value, "unit": unit, "target": target, "met": met, "peer": peer}


def _ratio(a: object, b: object) -> float | None:
    return a / b if isinstance(a, float | int) and isinstance(b, float | int) and b else None


def _at_least(v: float | None, t: float) -> bool | None:
    return None if v is None else v >= t


def _at_most(v: float | None, t: float) -> bool | None:
    return None if v is None else v <= t


def headline(results: dict) -> list[dict]:
    rows: list[dict] = []
    spark = results.get("spark") or {}
    tp = {(r["impl"], r["dataset"]): r for r in spark.get("throughput", []) if r.get("status") == "ok"}
    for impl, label, target in (("ours-vectorized", "vectorized processor", 0.8),
                                ("ours-compat", "Spark-API processor (per-key Python)", 0.5)):
        r = tp.get((impl, "main"))
        for kind in ("steady", "overall"):
            v = _get(r, "ratios", "spark-floor-count", kind)
            rows.append(_row(f"{label}: events/s {kind} / stateless floor", v, "x", f">= {target}",
                             _at_least(v, target), "Spark foreachBatch groupBy(key).count(), no state"))
    for peer in ("spark-count-rocksdb", "spark-count-hdfs"):
        v = _get(tp.get(("ours-vectorized", "main")), "ratios", peer, "steady")
        rows.append(_row(f"vectorized: steady events/s / {peer}", v, "x", "> 1", _at_least(v, 1.0), peer))
        v = _get(tp.get((peer, "main")), "ratios", "spark-floor-count", "steady")
        rows.append(_row(f"{peer}: steady events/s / stateless floor", v, "x", "", None, "(Spark's own state path)"))
    v = _get(tp.get(("ours-compat", "small")), "ratios", "spark-tws-rows", "overall")
    if v is not None:
        rows.append(_row("Spark-API processor: events/s / transformWithState (small data set)", v, "x", ">= 10",
                         _at_least(v, 10), "spark-tws-rows"))
    lk = _get(results, "store", "lookup") or {}
    v = lk.get("warm_vs_polars_join")
    rows.append(_row("store: warm batched lookup / polars left join", v, "x", ">= 0.8", _at_least(v, 0.8),
                     "polars join against the state in one frame"))
    v = lk.get("warm_vs_rocksdict_multiget")
    rows.append(_row("store: warm batched lookup / rocksdict multi-get", v, "x", ">= 1", _at_least(v, 1), "rocksdict"))
    cache = spark.get("cache") or {}
    for name, run in (cache.get("runs") or {}).items():
        if name in ("1x", "rocksdb"):
            continue
        v = run.get("vs_1x")
        rows.append(_row(f"cache {name} of the state ({cache['keys']:,} keys): steady events/s / cache 1x", v, "x",
                         ">= 0.7", _at_least(v, 0.7), "ours with the whole state cached"))
        v = run.get("vs_rocksdb")
        rows.append(_row(f"cache {name}: steady events/s / RocksDB", v, "x", "> 1", _at_least(v, 1.0),
                         "spark-count-rocksdb"))
    scaling = spark.get("scaling") or {}
    ours = next((i for i in (scaling.get("spread") or {}) if i != "spark-count-rocksdb"), None)
    sizes = ", ".join(f"{int(k) / 1e6:g}M" for k in scaling.get("sizes", []))
    # Restart and rescale from the query's start (a fresh query's first batch not subtracted: ours
    # restarts faster than a fresh query starts, so the difference is about zero, not a ratio).
    for name, label in (("checkpoint_ms", "checkpoint time"),
                        ("restart_small_raw_s", "query start to first batch after a restart, small batch"),
                        ("restart_large_raw_s", "query start to first batch after a restart, large batch"),
                        ("rescale_raw_s", "rescale 4 -> 8 to its first batch")):
        v = _get(scaling, "spread", ours, name)
        peer = _get(scaling, "spread", "spark-count-rocksdb", name)
        rows.append(_row(f"state {sizes} keys: {label}, largest / smallest", v, "x", "<= 1.3", _at_most(v, 1.3),
                         f"RocksDB: {peer:.2f}x" if peer is not None else "RocksDB"))
    figures = scaling.get("figures") or {}
    if ours in figures and "spark-count-rocksdb" in figures:
        keys = max(figures[ours], key=int)
        for name, label, peer in (
                ("restart_small_raw_s", "restart, small first batch", "spark-count-rocksdb, restarted"),
                ("rescale_raw_s", "rescale 4 -> 8", "spark-count-rocksdb: offline repartition, then restarted")):
            v = _ratio(_get(figures, ours, keys, name), _get(figures, "spark-count-rocksdb", keys, name))
            rows.append(_row(f"{label} at {int(keys):,} keys, query start to first batch end / RocksDB's", v, "x",
                             "<= 1", _at_most(v, 1.0), peer))
    storage = scaling.get("storage_ratio") or {}
    if storage:
        keys = max(storage, key=int)
        v = storage[keys]
        rows.append(_row(f"state on disk at {int(keys):,} keys / Spark's RocksDB checkpoint", v, "x", "<= 0.3",
                         _at_most(v, 0.3), "spark-count-rocksdb, 10 versions retained by both"))
    rs = results.get("rescale") or {}
    v, peer = rs.get("ratio_big_over_small_8"), rs.get("peer_ratio_big_over_small_8")
    rows.append(_row("rescale 4 -> 8 (metadata), big / small state", v, "x", "<= 1.2", _at_most(v, 1.2),
                     f"copying rescale: {peer:.1f}x" if peer is not None else "copying rescale"))
    pr = results.get("processors") or {}
    sizes = pr.get("sizes") or []
    for kind, v in (pr.get("growth_largest") or {}).items():
        what = "vectorized processor, value state" if kind == "vectorized" else f"Spark-API processor, {kind} state"
        rows.append(_row(f"{what}: a batch at {sizes[-1]:,} / {sizes[0]:,} state keys", v,
                         "x", "<= 1.3", _at_most(v, 1.3), "the same batch at the smallest state"))
    start = (results.get("start") or {}).get("ratios") or {}
    v = start.get("first_trigger_ours_over_spark_count")
    rows.append(_row("tiny query in a fresh driver: start call to first trigger / Spark groupBy().count()", v, "x",
                     "<= 1.5", _at_most(v, 1.5), "spark-count-rocksdb, same input"))
    v = start.get("end_ours_over_spark_tws")
    rows.append(_row("tiny query in a fresh driver: start call to its end / Spark transformWithState", v, "x",
                     "<= 1", _at_most(v, 1.0), "spark-tws-rows, the same processor class"))
    ratios = (results.get("async") or {}).get("ratios") or {}
    for name, label, target, at_least, peer in (
            ("async_s3_over_local_cached", "async processor, state on S3 (20 ms/request, cache 0.1x): events/s / "
             "the same fully cached on local disk", 0.75, True, "ours, local disk, fully cached"),
            ("async_s3_over_sync_s3", "async processor on S3: events/s / the synchronous runner on S3", 3.0, True,
             "ours, api='row', same state and cache"),
            ("cpu_per_event_async_over_sync_cached", "async processor, fully cached: CPU per event / the "
             "synchronous runner's", 1.3, False, "ours, api='row'")):
        v = ratios.get(name)
        rows.append(_row(label, v, "x", f"{'>=' if at_least else '<='} {target}",
                         _at_least(v, target) if at_least else _at_most(v, target), peer))
    v = (results.get("compaction") or {}).get("p99_ratio_with_compactor")
    rows.append(_row("checkpoint p99 with the compactor / without", v, "x", "<= 1.5", _at_most(v, 1.5),
                     "ours without compaction"))
    return rows


def _fmt(v: object) -> str:
    return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def summarize(out: Path, mode: str, steps: dict) -> dict:
    results = {}
    for step in STEPS:
        path = out / step.result[mode]
        results[step.name] = json.loads(path.read_text()) if path.exists() else None
    rows = headline(results)
    summary = {"mode": mode, "machine": (results.get("spark") or {}).get("machine") or machine_info(),
               "written": datetime.now(UTC).isoformat(), "steps": steps, "headline": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _markdown(out, summary)
    _plot(out, rows)
    t = Table(title=f"performance targets, {mode} mode (ratios against the peer in the same run)")
    for col in ("measure", "value", "target", "met", "peer"):
        t.add_column(col, justify="right" if col in ("value", "target") else "left")
    for r in rows:
        met = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}[r["met"]]
        t.add_row(r["measure"], _fmt(r["value"]) + (r["unit"] if r["value"] is not None else ""), r["target"], met,
                  r["peer"])
    console.print(t)
    return summary


def _markdown(out: Path, summary: dict) -> None:
    m = summary["machine"]
    lines = [f"# Benchmark suite, {summary['mode']} mode", "",
             f"Written {summary['written']} by `python -m benchmarks.suite --mode {summary['mode']}`.", "",
             f"Machine: {m.get('cpus')} cores, Python {m.get('python')}, pyspark {m.get('pyspark', '-')}, "
             f"{m.get('java') or ''}, {m.get('platform')}.", "",
             "| measure | value | target | met | peer (same run) |", "|---|---|---|---|---|"]
    for r in summary["headline"]:
        met = {True: "yes", False: "**no**", None: ""}[r["met"]]
        value = "-" if r["value"] is None else f"{r['value']:.2f}{r['unit']}"
        lines.append(f"| {r['measure']} | {value} | {r['target']} | {met} | {r['peer']} |")
    lines += ["", "| step | command | seconds | ok |", "|---|---|---|---|"]
    for name, s in summary["steps"].items():
        lines.append(f"| {name} | `{s['command']}` | {s['seconds']:.0f} | {'yes' if s['ok'] else '**no**'} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def _plot(out: Path, rows: list[dict]) -> None:
    shown = [r for r in rows if r["value"] is not None and r["target"]]
    if not shown:
        return
    fig, ax = pyplot().subplots(figsize=(12, 0.45 * len(shown) + 1.5))
    y = range(len(shown))
    colors = ["C2" if r["met"] else "C3" for r in shown]
    ax.barh(list(y), [r["value"] for r in shown], color=colors)
    for i, r in enumerate(shown):
        ax.annotate(f"{r['value']:.2f} (target {r['target']})", (r["value"], i), va="center", fontsize=8,
                    xytext=(3, 0), textcoords="offset points")
    ax.set_yticks(list(y), [r["measure"] for r in shown], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", lw=0.6)
    ax.set_xscale("log")
    ticks = [t for t in (0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20) if min(r["value"] for r in shown) / 1.5 <= t
             <= max(r["value"] for r in shown) * 1.5]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter("")
    ax.set_xlim(right=max(r["value"] for r in shown) * 2.5)  # room for the last bar's label
    ax.set_xlabel("ratio against the peer in the same run (green: target met)")
    save_figure(fig, out / "headline.png", dpi=110)


def main(
    mode: str = typer.Option("quick", help="tiny (smoke), quick (~15 min) or full (2M events over 200k keys, states "
                                           "of 1M, 5M and 20M keys; > 1 hour)"),
    steps: str = typer.Option(",".join(s.name for s in STEPS), help="comma-separated steps to run"),
    out: Path | None = typer.Option(None, help="results folder (default docs/benchmarks/<mode>)"),
    summarize_only: bool = typer.Option(False, help="redraw the summary from the results in the folder"),
) -> None:
    if mode not in MODES:
        raise typer.BadParameter(f"mode {mode!r}: use one of {', '.join(MODES)}")
    chosen = [s.strip() for s in steps.split(",") if s.strip()]
    unknown = set(chosen) - {s.name for s in STEPS}
    if unknown:
        raise typer.BadParameter(f"unknown steps {sorted(unknown)}; known: {[s.name for s in STEPS]}")
    out = out or DOCS / mode
    out.mkdir(parents=True, exist_ok=True)
    status_path = out / "steps.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else {}
    if not summarize_only:
        for step in STEPS:
            if step.name in chosen:
                status[step.name] = _run_step(step, mode, out)
                status_path.write_text(json.dumps(status, indent=1))
    summarize(out, mode, status)
    failed = [n for n in chosen if not status.get(n, {}).get("ok")]
    if failed and not summarize_only:
        console.log(f"[red]steps failed[/red]: {failed} (their logs are in {out / 'logs'})")
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
