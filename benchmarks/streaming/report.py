"""The report of a streaming benchmark run: the throughput, sessions and restart tables, and the plot.
Reads only the results dict, so that ``--report-from`` redraws an earlier run's report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from benchmarks.harness import console, fmt, pyplot, ratio, save_figure
from benchmarks.streaming.peers import SPARK_PEERS
from benchmarks.streaming.scaling import plot_state_size, report_cache, report_scaling

PEER_COLUMNS = {"spark-floor-count": "vs stateless floor",
                "spark-count-rocksdb": "vs RocksDB count", "spark-count-hdfs": "vs HDFS count",
                "spark-tws-rows": "vs transformWithState", "spark-tws-pandas": "vs transformWithStateInPandas"}


def _checked(verified: dict) -> str:
    if not verified.get("checked", True):
        return "not checked"
    return "verified" if verified["ok"] else f"[red]WRONG[/red] {verified['problems'][:2]}"


def _report_throughput(rows: list[dict]) -> None:
    if not rows:
        return
    t = Table(title="keyed running count (data set: events/keys/batches). Ratios: this row over the peer on the "
                    "same data set, events/s overall / steady / per CPU-second. Other cores: CPU that other processes "
                    "used during the run")
    for col in ("implementation", "data set", "wall s", "events/s", "steady ev/s", "events/CPU-s", "1st batch s",
                *(PEER_COLUMNS[p] for p in SPARK_PEERS), "other cores", "output"):
        t.add_column(col, justify="left" if col in ("implementation", "data set", "output") else "right")
    reasons: set[str] = set()
    for r in rows:
        size = f"{r['dataset']} {r['events'] / 1e6:g}M/{r['keys'] / 1e3:g}k/{r['batches']}"
        if r["status"] != "ok":
            t.add_row(r["impl"], size, *[""] * (7 + len(SPARK_PEERS)), r["status"])
            reasons.add(f"{r['impl']}: {r['status']}: {r['reason']}")
            continue
        ratios = [r["ratios"].get(p) for p in SPARK_PEERS]
        cells = ["-" if q is None else " / ".join(fmt(q[k], ".2f") for k in ("overall", "steady", "per_cpu_s"))
                 for q in ratios]
        t.add_row(r["impl"], size, f"{r['wall_s']:.1f}", fmt(r["events_per_s"]), fmt(r["steady_events_per_s"]),
                  fmt(r["events_per_cpu_s"]), fmt(r["first_batch_s"], ".2f"), *cells,
                  fmt(r["machine"].get("other_cores"), ".2f"),
                  _checked(r["verified"]))
    lines = []  # ours over the Spark peer that runs the very same processor
    for o, p in (("ours-pandas", "spark-tws-pandas"), ("ours-compat", "spark-tws-rows")):
        for r in rows:
            q = r.get("ratios", {}).get(p) if r["impl"] == o and r["status"] == "ok" else None
            if q:
                lines.append(f"{o} / {p} on {r['dataset']}: {q['overall']:.1f}x events/s, "
                             f"{fmt(q['steady'], '.1f')}x steady, {fmt(q['per_cpu_s'], '.1f')}x per CPU-second"
                             + (" (target: at least 10x)" if o == "ours-pandas" else ""))
    t.caption = "\n".join([*lines, *sorted(reasons)]) or None
    console.print(t)


def _report_sessions(sessions: dict | None) -> None:
    if not sessions:
        return
    t = Table(title=f"processing-time sessions, gap {sessions['gap_ms']} ms ({sessions['dataset']}: "
                    f"{sessions['events']:,} events, {sessions['keys']:,} keys, {sessions['input_batches']} files; "
                    f"{sessions['expected']['closes']:,} session closes expected). Time: query start to the last "
                    "session close")
    for col in ("implementation", "to last close s", "events/s", "events/CPU-s", "batches", "without input",
                "run after the last close", "ended by itself", "closes", "other cores", "output"):
        t.add_column(col, justify="left" if col in ("implementation", "output") else "right")
    reasons = []
    for r in sessions["rows"]:
        if r["status"] != "ok":
            t.add_row(r["impl"], *[""] * 9, r["status"])
            reasons.append(f"{r['impl']}: {r['status']}: {r['reason']}")
            continue
        t.add_row(r["impl"], f"{r['last_close_s']:.1f}", fmt(r["events_per_s"]), fmt(r.get("events_per_cpu_s")),
                  str(r["batches"]), str(r["batches_without_input"]), str(r["batches_after_last_close"]),
                  "yes" if r["ended_by_itself"] else "no (stopped)", f"{r['closes']:,}",
                  fmt(r["machine"].get("other_cores"), ".2f"),
                  "verified" if r["verified"]["ok"] else f"[red]WRONG[/red] {r['verified']['problems'][:2]}")
    q = sessions.get("ours_vs_spark")
    if q:
        reasons.insert(0, f"ours / Spark: {fmt(q['events_per_s'], '.1f')}x events/s, "
                          f"{fmt(q['events_per_cpu_s'], '.1f')}x per CPU-second; same multiset of closes: "
                          f"{'yes' if q['same_closes'] else '[red]NO[/red]'}")
    t.caption = "\n".join(reasons) or None
    console.print(t)


def _step_cell(step: dict | None, field: str) -> str:
    if step is None:
        return "-"
    if "error" in step:
        return f"error: {step['error'][:70]}"
    return fmt(step.get(field), ".2f", " s")


def _restart_cells(d: dict, offline_step: bool) -> list[str]:
    """One column of the restart table: the figures of one scenario (empty when it did not run)."""
    if not d:
        return ["-"] * 12
    build, restart = d.get("build") or {}, d.get("restart") or {}
    rescale = d.get("after_repartition") or d.get("rescale")
    steady, fresh = build.get("steady_batch_s_median"), d.get("fresh_query_first_batch_s")
    first = restart.get("first_batch_s")
    steps = [st for st in d.values() if isinstance(st, dict)]
    others = [st["machine"].get("other_cores", 0) for st in steps if "machine" in st]
    checks = [st["verified"]["ok"] for st in steps if "verified" in st]
    return [
        _step_cell(build, "steady_batch_s_median"),
        fmt(fresh, ".2f", " s"),
        _step_cell(restart, "first_batch_s"),
        fmt(ratio(first, steady), ".1f", "x"),
        fmt(first - fresh if first and fresh else None, ".2f", " s"),
        _step_cell(restart, "start_to_first_batch_end_s"),
        _step_cell(restart, "import_s"),
        _step_cell(d.get("repartition"), "repartition_s") if offline_step else "none needed",
        _step_cell(d.get("repartition"), "session_s") if offline_step else "",
        _step_cell(rescale, "first_batch_s"),
        f"{max(others):.2f}" if others else "-",
        "yes" if checks and all(checks) else "[red]NO[/red]",
    ]


def _report_restart(spark: dict | None, ours: dict | None) -> None:
    if spark is None and ours is None:
        return
    keys = (spark or ours or {}).get("state_keys", 0)
    t = Table(title=f"restart and rescale on a {keys:,}-key state (batches of the same size throughout)")
    t.add_column("measure")
    t.add_column("Spark groupBy().count(), RocksDB", justify="right")
    t.add_column(f"ours ({(ours or {}).get('impl', '')})", justify="right")
    labels = ["steady batch (median)", "first batch of a fresh query on an empty state", "first batch after restart",
              "  over the steady batch", "  minus the fresh query's first batch", "  query start to its end",
              "  library import, before the query start",
              "offline repartition 4 -> 8 (session excluded)", "  its session start",
              "first batch at parallelism 8", "most cores other processes used in a step",
              "output of every step verified"]
    o = ours if ours and ours.get("status") == "ok" else {}
    for label, sc, oc in zip(labels, _restart_cells(spark or {}, True), _restart_cells(o, False), strict=True):
        t.add_row(label, sc, oc)
    if ours and ours.get("status") != "ok":
        t.caption = f"ours: {ours['status']}: {ours.get('reason', '')}"
    console.print(t)


def _plot(results: dict, path: Path) -> None:
    rows = [r for r in results["throughput"] if r["status"] == "ok"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    sessions = [r for r in (results.get("sessions") or {}).get("rows", []) if r["status"] == "ok"]
    restart = bool(results.get("restart"))
    panels = len(datasets) + bool(sessions) + restart
    if not panels:
        return
    fig, axes = pyplot().subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    axes = list(axes[0])
    for ax, ds in zip(axes, datasets, strict=False):
        sub = [r for r in rows if r["dataset"] == ds]
        x = np.arange(len(sub))
        ax.bar(x - 0.2, [r["events_per_s"] / 1e3 for r in sub], 0.4, label="overall")
        ax.bar(x + 0.2, [(r["steady_events_per_s"] or 0) / 1e3 for r in sub], 0.4, label="steady (after batch 1)")
        ax.set_xticks(x, [r["impl"] for r in sub], rotation=25, ha="right")
        rates = [r["events_per_s"] for r in sub]
        log = max(rates) / min(rates) > 10  # log scale only when the bars span more than a decade
        if log:
            ax.set_yscale("log")
        ax.set_ylabel("thousand events/s" + (" (log scale)" if log else ""))
        ax.set_title(f"{ds}: {sub[0]['events']:,} events, {sub[0]['keys']:,} keys, {sub[0]['batches']} batches")
        ax.legend(fontsize=8)
    if sessions:
        ax = axes[len(datasets)]
        info = results["sessions"]
        x = np.arange(len(sessions))
        ax.bar(x, [r["events_per_s"] / 1e3 for r in sessions], 0.5,
               color=["C2" if r["impl"].startswith("ours") else "C3" for r in sessions])
        for i, r in enumerate(sessions):
            ax.annotate(f"{r['last_close_s']:.1f} s, {r['batches']} batches\n({r['batches_without_input']} without "
                        "input)", (i, r["events_per_s"] / 1e3), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, [r["impl"] for r in sessions])
        ax.margins(y=0.2)
        ax.set_ylabel("thousand events/s (query start to last session close)")
        ax.set_title(f"processing-time sessions, gap {info['gap_ms']} ms: {info['events']:,} events, "
                     f"{info['keys']:,} keys", fontsize=10)
    if restart:
        _plot_restart(axes[-1], results)
    save_figure(fig, path, dpi=110)


def _plot_restart(ax: Any, results: dict) -> None:
    spark = results.get("restart", {}).get("spark") or {}
    bars = {"steady batch": spark.get("build", {}).get("steady_batch_s_median"),
            "fresh query 1st batch": spark.get("fresh_query_first_batch_s"),
            "1st batch after restart": spark.get("restart", {}).get("first_batch_s"),
            "offline repartition 4->8": spark.get("repartition", {}).get("repartition_s"),
            "1st batch after repartition": spark.get("after_repartition", {}).get("first_batch_s")}
    ours = results.get("restart", {}).get("ours") or {}
    if ours.get("status") == "ok":
        bars |= {"ours steady batch": ours.get("build", {}).get("steady_batch_s_median"),
                 "ours fresh query 1st batch": ours.get("fresh_query_first_batch_s"),
                 "ours 1st batch after restart": ours.get("restart", {}).get("first_batch_s"),
                 "ours 1st batch at p=8": ours.get("rescale", {}).get("first_batch_s")}
    bars = {k: v for k, v in bars.items() if v is not None}
    ax.bar(list(bars), list(bars.values()), color=["C2" if k.startswith("ours") else "C3" for k in bars])
    ax.set_ylabel("s")
    ax.set_title(f"restart / rescale, {spark.get('state_keys', ours.get('state_keys', 0)):,}-key state")
    ax.tick_params(axis="x", rotation=25)
    for label in ax.get_xticklabels():
        label.set_ha("right")


def finish(results: dict, plot_path: Path) -> None:
    """Draw the plot to ``plot_path`` (the state-size scenarios' beside it, ``*_state.png``) and
    print the tables."""
    _plot(results, plot_path)
    _report_throughput(results["throughput"])
    _report_sessions(results.get("sessions"))
    restart = results.get("restart", {})
    _report_restart(restart.get("spark"), restart.get("ours"))
    report_scaling(results.get("scaling"))
    report_cache(results.get("cache"))
    plot_state_size(results, plot_path.with_name(plot_path.stem + "_state.png"))

