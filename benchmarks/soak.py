"""Soak: a stateful streaming query for a long while (30 minutes by default), with a checkpoint
every few seconds, retention and compaction on; what must stay flat is sampled and plotted.

The query (local[2], this process is the driver): Spark's ``rate`` source at ``--rows-per-second``,
keyed by ``value % --keys`` (every key comes back every keys/rate seconds), through a Spark
``StatefulProcessor`` run unchanged by ``start_stateful_query`` in ProcessingTime mode: a value
state (the key's count) and a map state of per-minute counts with a 2-minute TTL, so the live
state is bounded while every batch writes, expires and tombstones entries. Trigger every
``--trigger-seconds``; each batch is one checkpoint; retention keeps the default 10 checkpoints;
the compactor process runs the default policy. The batch output goes to a ``foreach_batch``
that counts it.

Sampled every ``--sample-seconds``: resident memory and open file descriptors of the driver's
Python, its JVM, the Python workers and the compactor (from ``/proc``); the table's segment files
per unit (max and mean) and retained checkpoints; the files and bytes under the table's location;
the entries the state holds (the state figures of the newest batch report). Per batch: its duration and commit time.
After a warm-up (``--warmup-minutes``), the mean of each figure over the window after the
warm-up is compared with its mean over the last window of the same length: the ratio is the
drift (1.0: flat). Results: ``soak.json`` and ``soak.png`` (one panel per figure, against
minutes).

    python -m benchmarks.soak --minutes 30
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness

TABLE = "soak"
TTL_MS = 120_000
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

try:  # the processor: pyspark is there whenever the soak runs; the module imports without it
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

    class SoakProcessor(StatefulProcessor):
        """A key's count (value state) and its per-minute counts (map state, 2-minute TTL)."""

        def init(self, handle: StatefulProcessorHandle) -> None:
            self.count = handle.getValueState("count", "n long")
            self.minutes = handle.getMapState("minutes", "minute long", "n long", TTL_MS)

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
            n = sum(1 for _ in rows)
            total = (self.count.get()[0] if self.count.exists() else 0) + n
            self.count.update((total,))
            minute = timerValues.getCurrentProcessingTimeInMs() // 60_000
            before = self.minutes.getValue(Row(minute=minute)) if self.minutes.containsKey(Row(minute=minute)) else None
            self.minutes.updateValue(Row(minute=minute), Row(n=(before[0] if before else 0) + n))
            yield Row(key=key[0], count=total)
except ImportError:  # pragma: no cover
    SoakProcessor = None  # type: ignore[assignment,misc]


# --- /proc --------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss_and_fds(pid: int) -> tuple[int, int]:
    try:
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0, 0
    return rss, fds


def process_figures() -> dict[str, float]:
    """Resident MB and open files of the driver's Python, its JVM, the Python workers, the compactor."""
    groups: dict[str, list[int]] = {"driver": [os.getpid()], "jvm": [], "workers": [], "compactor": []}
    for pid in _descendants(os.getpid()):
        cmd = _cmdline(pid)
        if "java" in cmd.split(" ", 1)[0]:
            groups["jvm"].append(pid)
        elif "compactor" in cmd:
            groups["compactor"].append(pid)
        elif "python" in cmd:
            groups["workers"].append(pid)
    figures: dict[str, float] = {}
    for name, pids in groups.items():
        pairs = [_rss_and_fds(p) for p in pids]
        figures[f"{name}_rss_mb"] = round(sum(r for r, _ in pairs) / 2**20, 1)
        figures[f"{name}_fds"] = sum(f for _, f in pairs)
    figures["workers"] = len(groups["workers"])
    return figures


def table_figures(table: Any, location: Path) -> dict[str, float]:
    """Segment files per unit, retained checkpoints, and the files and bytes under the table."""
    from catalog.compaction import units

    table.restore()
    per_unit = [len(table.segments(u)) for u in units(table)] or [0]
    files = [p for p in location.rglob("*") if p.is_file()]
    return {"files_per_unit_max": max(per_unit), "files_per_unit_mean": round(statistics.mean(per_unit), 2),
            "checkpoints_retained": len(table.list_checkpoints()), "table_files": len(files),
            "table_mb": round(sum(p.stat().st_size for p in files if p.exists()) / 2**20, 2)}


# --- the run ------------------------------------------------------------------------------------


def run(minutes: float, rows_per_second: int, keys: int, trigger_seconds: float, sample_seconds: float,
        warmup_minutes: float, root: Path) -> dict:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(harness.REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import spark_integration
    from catalog import IcebergStateTable
    from spark_integration.query import runner_of

    spark = (SparkSession.builder.master("local[2]").appName("icestate-soak")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "1g")
             .config("spark.local.dir", str(root / "spark-local")).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    source = (spark.readStream.format("rate").option("rowsPerSecond", rows_per_second).load()
              .select(F.concat(F.lit("k"), (F.col("value") % keys).cast("string")).alias("key"), "value"))
    warehouse = root / "warehouse"
    location = spark_integration.StateLocation(table=TABLE, warehouse=str(warehouse), max_parallelism=64,
                                               parallelism=2)
    emitted = [0]

    def count_output(df: Any, batch_id: int) -> None:
        emitted[0] += df.count()

    query = spark_integration.start_stateful_query(
        source, keys=["key"], processor=SoakProcessor(), output_schema="key string, count long", location=location,
        checkpoint_location=str(root / "checkpoint"), trigger={"processingTime": f"{trigger_seconds} seconds"},
        foreach_batch=count_output, time_mode="ProcessingTime")
    runner = runner_of(query)
    started = time.monotonic()
    samples: list[dict] = []
    deadline = started + minutes * 60
    table = None
    batches: list[dict] = []  # collected as they come: the runner keeps only its newest reports

    def collect(minute: float) -> None:
        seen = batches[-1]["batch_id"] if batches else -1
        for r in list(runner.reports):
            if not r.skipped and r.batch_id > seen:
                batches.append({"batch_id": r.batch_id, "minute": minute, "duration_ms": round(r.duration_ms, 1),
                                "commit_ms": round(r.commit_ms, 1), "tasks_ms": round(r.tasks_ms, 1)})

    try:
        with harness.console.status("soaking") as status:
            while time.monotonic() < deadline and query.isActive:
                if table is None and runner.reports:
                    table = IcebergStateTable.open_existing(warehouse=str(warehouse), table_name=TABLE)
                sample = {"minute": round((time.monotonic() - started) / 60, 3), **process_figures()}
                if table is not None:
                    sample.update(table_figures(table, warehouse / "state" / TABLE))
                figures = next((r.state for r in reversed(runner.reports) if r.state), None) or {}
                sample["entries"] = figures.get("numEntriesTotal")
                collect(sample["minute"])
                sample["batches"] = len(batches)
                samples.append(sample)
                status.update(f"soaking: minute {sample['minute']:.1f} of {minutes}, {sample['batches']} batches, "
                              f"{sample.get('table_files', 0)} files, {sample.get('files_per_unit_max', 0)} per unit")
                time.sleep(sample_seconds)
        if not query.isActive:
            raise RuntimeError(f"the query stopped: {query.exception()}")
    finally:
        query.stop()
        if table is not None:
            table.close()
    collect(round((time.monotonic() - started) / 60, 3))
    spark.stop()
    return {"samples": samples, "batches": batches, "emitted_rows": emitted[0]}


FIGURES = ("driver_rss_mb", "jvm_rss_mb", "workers_rss_mb", "compactor_rss_mb", "driver_fds", "jvm_fds",
           "workers_fds", "compactor_fds", "files_per_unit_max", "files_per_unit_mean", "table_files", "table_mb",
           "checkpoints_retained", "entries")


def drift(samples: list[dict], batches: list[dict], warmup_minutes: float) -> dict[str, dict]:
    """Per figure: its mean over the window after the warm-up and over the last window of the
    same length, and their ratio (1.0: flat)."""
    end = samples[-1]["minute"] if samples else 0.0
    window = max(1.0, min(5.0, (end - warmup_minutes) / 3))
    early = lambda m: warmup_minutes <= m < warmup_minutes + window  # noqa: E731
    late = lambda m: m >= end - window  # noqa: E731
    out = {}
    for name in FIGURES:
        a = [s[name] for s in samples if early(s["minute"]) and s.get(name) is not None]
        b = [s[name] for s in samples if late(s["minute"]) and s.get(name) is not None]
        if a and b:
            out[name] = {"early": round(statistics.mean(a), 2), "late": round(statistics.mean(b), 2),
                         "ratio": round(statistics.mean(b) / statistics.mean(a), 3) if statistics.mean(a) else None}
    n = len(batches)
    for name in ("duration_ms", "commit_ms"):
        if n >= 6:
            third = n // 3
            a = statistics.median(x[name] for x in batches[third:2 * third])
            b = statistics.median(x[name] for x in batches[-third:])
            out[f"batch_{name}_median"] = {"early": a, "late": b, "ratio": round(b / a, 3) if a else None}
    return out


def plot(result: dict, path: Path) -> None:
    plt = harness.pyplot()
    samples = result["samples"]
    minutes = [s["minute"] for s in samples]
    panels = [("resident memory (MB)", ["driver_rss_mb", "jvm_rss_mb", "workers_rss_mb", "compactor_rss_mb"]),
              ("open files", ["driver_fds", "jvm_fds", "workers_fds", "compactor_fds"]),
              ("segment files per unit", ["files_per_unit_max", "files_per_unit_mean"]),
              ("files under the table", ["table_files"]), ("table MB", ["table_mb"]),
              ("entry rows in segments", ["entries"])]
    fig, axes = plt.subplots(4, 2, figsize=(11, 12))
    for ax, (title, names) in zip(axes.flat, panels, strict=False):
        for name in names:
            ax.plot(minutes, [s.get(name) for s in samples], label=name.replace("_", " "))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minutes")
        ax.legend(fontsize=7)
    batches = result["batches"]
    span = minutes[-1] if minutes else 1.0
    for ax, name, title in ((axes.flat[6], "commit_ms", "commit time per batch (ms)"),
                            (axes.flat[7], "duration_ms", "batch duration (ms)")):
        ax.plot([b["minute"] for b in batches], [b[name] for b in batches], ".", markersize=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minutes (when sampled)")
    fig.suptitle(f"soak: {span:.0f} minutes, {len(batches)} checkpoints, retention and compaction on", fontsize=11)
    harness.save_figure(fig, path, dpi=100)


def main(
    minutes: Annotated[float, typer.Option(help="How long the query runs.")] = 30.0,
    rows_per_second: Annotated[int, typer.Option(help="Rows of the rate source per second.")] = 2000,
    keys: Annotated[int, typer.Option(help="Distinct keys (value % keys).")] = 20_000,
    trigger_seconds: Annotated[float, typer.Option(help="Seconds between micro-batches (checkpoints).")] = 3.0,
    sample_seconds: Annotated[float, typer.Option(help="Seconds between samples.")] = 15.0,
    warmup_minutes: Annotated[float, typer.Option(help="Minutes left out of the drift figures.")] = 5.0,
    workdir: Annotated[Path | None, typer.Option(
        help="Where the warehouse goes (default: a temporary folder).")] = None,
) -> None:
    """Run a stateful query for a long while and check that what must stay flat does."""
    root = workdir or Path(tempfile.mkdtemp(prefix="icestate-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        result = run(minutes, rows_per_second, keys, trigger_seconds, sample_seconds, warmup_minutes, root)
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    result["drift"] = drift(result["samples"], result["batches"], warmup_minutes)
    result["config"] = {"minutes": minutes, "rows_per_second": rows_per_second, "keys": keys,
                        "trigger_seconds": trigger_seconds, "sample_seconds": sample_seconds,
                        "warmup_minutes": warmup_minutes, "ttl_ms": TTL_MS, "started": started,
                        "machine": harness.machine_info()}
    harness.write_results("soak.json", result)
    plot(result, harness.results_path("soak.png"))
    from rich.table import Table

    table = Table(title=f"soak: drift after {warmup_minutes:g} min warm-up (late / early; 1.0 is flat)")
    for column in ("figure", "early", "late", "ratio"):
        table.add_column(column)
    for name, d in result["drift"].items():
        table.add_row(name, str(d["early"]), str(d["late"]), str(d["ratio"]))
    harness.console.print(table)
    harness.console.print(f"{len(result['batches'])} batches, {result['emitted_rows']:,} output rows; "
                          f"results in {harness.results_path('soak.json')}")


if __name__ == "__main__":
    typer.run(main)
