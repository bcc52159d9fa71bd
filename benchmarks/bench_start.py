"""How fast a stateful query starts, as a new user meets it: a tiny ``availableNow`` query in a
fresh driver, ours against Spark's own.

Each measurement is a driver process of its own (a fresh JVM and fresh Python workers: the start
a user pays), on the same tiny input written before the clock starts (``rows`` rows over ``keys``
keys in one Parquet file), with the same keyed running count:

- ``spark-count-rocksdb``: Spark's ``groupBy(key).count()`` on its RocksDB state store (the
  start of a stateful query with no Python at all: the floor of any start);
- ``spark-tws-rows``: Spark's ``transformWithState`` with the benchmark's ``CountProcessor``;
- ``ours-compat``: ``start_stateful_query`` with the very same processor class.

Figures per run, from the query's start call (the driver's modules already imported, as in a
script whose imports ran; the import of ours is measured apart): to the first trigger (Spark's
progress ``timestamp`` of batch 0), to the end of the query (the last batch committed,
``awaitTermination`` returned). Medians over ``repeat`` runs, the implementations in turn in each
round; the ratios divide ours by Spark's medians of the same run.

``--one-driver`` (the suite's tiny mode, a smoke run of every code path) runs the three in one
driver process per round: only the first starts fresh, so its figures do not compare.

Prints a table, writes ``bench_start.json`` and ``bench_start.png`` to the results folder.
Run: ``.venv/bin/python -m benchmarks.bench_start`` (``--repeat 1`` for a smoke run).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from benchmarks.harness import (
    REPO,
    console,
    fmt,
    machine_info,
    progress,
    pyplot,
    ratio,
    repo_env,
    results_path,
    save_figure,
    write_results,
)

IMPLS = ("spark-count-rocksdb", "spark-tws-rows", "ours-compat")
FIGURES = ("start_to_first_trigger_s", "start_to_end_s")
_MARK = "bench-start-result: "


def _trigger_time(progress_json: dict) -> float:
    return datetime.strptime(progress_json["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def _job(impl: str, scratch: Path, rows: int, keys: int) -> dict:
    """One driver's run of ``impl``: its figures (the process prints them for the parent)."""
    from benchmarks.streaming.impl import OUTPUT_SCHEMA
    from benchmarks.streaming.processors import CountProcessor
    from benchmarks.streaming.session import ROCKSDB, spark_session

    spark = spark_session({"impl": impl, "driver_memory": "1g", "scratch": str(scratch)}, ROCKSDB)
    source = scratch / "input"
    spark.createDataFrame([(f"k{i % keys}", i) for i in range(rows)], "key string, value long") \
        .coalesce(1).write.parquet(str(source))
    checkpoint = str(scratch / "checkpoint")
    import_s = None
    t_import = time.time()
    if impl == "ours-compat":
        import spark_integration

        start = spark_integration.start_stateful_query  # the lazy exports bring in the query module
        import_s = time.time() - t_import
    time.sleep(0.5)  # the input's write job and the imports settled
    t0 = time.time()
    df = spark.readStream.schema("key string, value long").parquet(str(source))
    if impl == "spark-count-rocksdb":
        query = (df.groupBy("key").count().writeStream.outputMode("update").format("noop")
                 .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    elif impl == "spark-tws-rows":
        out = df.groupBy("key").transformWithState(CountProcessor(), OUTPUT_SCHEMA, outputMode="Update",
                                                   timeMode="None")
        query = (out.writeStream.outputMode("update").format("noop").option("checkpointLocation", checkpoint)
                 .trigger(availableNow=True).start())
    else:
        location = spark_integration.StateLocation(table="start_state", max_parallelism=128, parallelism=2,
                                                   warehouse=str(scratch / "warehouse"))
        query = start(df, keys=["key"], processor=CountProcessor(), output_schema=OUTPUT_SCHEMA, location=location,
                      checkpoint_location=checkpoint, trigger={"availableNow": True},
                      foreach_batch=lambda batch, batch_id: batch.write.format("noop").mode("append").save())
    start_call_s = time.time() - t0
    query.awaitTermination()
    end_s = time.time() - t0
    progress_events = query.recentProgress
    out = {"impl": impl, "start_call_s": start_call_s, "start_to_end_s": end_s, "import_s": import_s,
           "batches": len(progress_events),
           "start_to_first_trigger_s": _trigger_time(progress_events[0]) - t0 if progress_events else None,
           "first_batch_durations_ms": progress_events[0]["durationMs"] if progress_events else None}
    spark.stop()
    return out


def _run_jobs(impls: list[str], rows: int, keys: int, timeout: float) -> list[dict]:
    """One driver process running ``impls`` one after another (each a fresh SparkSession; only
    the first a fresh JVM and fresh Python workers); their figures, in order."""
    with tempfile.TemporaryDirectory(prefix="bench-start-") as scratch:
        command = [sys.executable, "-m", "benchmarks.bench_start", "--job", ",".join(impls), "--scratch", scratch,
                   "--rows", str(rows), "--keys", str(keys)]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=repo_env(),
                              timeout=timeout * len(impls))
    lines = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode != 0 or len(lines) != len(impls):
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"the {', '.join(impls)} driver failed (exit {done.returncode}):\n{tail}")
    return [json.loads(line[len(_MARK):]) for line in lines]


def _summary(runs: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for name in (*FIGURES, "start_call_s", "import_s"):
        values = [r[name] for r in runs if r.get(name) is not None]
        if values:
            out[name] = {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}
    return out


def _plot(results: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    labels = {"start_to_first_trigger_s": "start call to first trigger", "start_to_end_s": "start call to query end"}
    width = 0.8 / len(IMPLS)
    for i, impl in enumerate(IMPLS):
        summary = results["impls"].get(impl, {})
        medians = [summary.get(f, {}).get("median", 0.0) for f in FIGURES]
        errs = [[m - summary.get(f, {}).get("min", m) for f, m in zip(FIGURES, medians, strict=True)],
                [summary.get(f, {}).get("max", m) - m for f, m in zip(FIGURES, medians, strict=True)]]
        ax.bar([x + i * width for x in range(len(FIGURES))], medians, width, yerr=errs, capsize=3, label=impl)
    ax.set_xticks([x + width * (len(IMPLS) - 1) / 2 for x in range(len(FIGURES))], [labels[f] for f in FIGURES])
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title(f"A tiny availableNow query in a fresh driver ({results['config']['rows']} rows), "
                 f"{results['config']['repeat']} runs each", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def main(
    repeat: Annotated[int, typer.Option(help="Runs of each implementation (fresh drivers, in turn).")] = 5,
    rows: Annotated[int, typer.Option(help="Input rows (one Parquet file).")] = 200,
    keys: Annotated[int, typer.Option(help="Distinct keys of the input.")] = 50,
    timeout: Annotated[float, typer.Option(help="Seconds a driver may take.")] = 600.0,
    one_driver: Annotated[bool, typer.Option(help="Smoke run: the implementations one after another in one "
                                                  "driver process per round (only the first starts fresh: the "
                                                  "figures do not compare).")] = False,
    job: Annotated[str | None, typer.Option(hidden=True, help="Run jobs in this driver (internal).")] = None,
    scratch: Annotated[Path | None, typer.Option(hidden=True)] = None,
) -> None:
    """A tiny stateful query's start in a fresh driver, ours against Spark's own."""
    if job is not None:
        jobs = job.split(",")
        if not set(jobs) <= set(IMPLS) or scratch is None:
            raise typer.BadParameter(f"--job takes implementations of {IMPLS}, with --scratch")
        for impl in jobs:
            (scratch / impl).mkdir()
            print(_MARK + json.dumps(_job(impl, scratch / impl, rows, keys)), flush=True)
        return
    runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    order = list(IMPLS)
    for _ in progress(range(repeat), "drivers" if one_driver else "fresh drivers"):
        if one_driver:
            for impl, run in zip(order, _run_jobs(order, rows, keys, timeout), strict=True):
                runs[impl].append(run)
        else:
            for impl in order:
                runs[impl].append(_run_jobs([impl], rows, keys, timeout)[0])
        order = order[1:] + order[:1]  # a different implementation first in each round
    impls = {impl: _summary(r) for impl, r in runs.items()}

    def med(impl: str, figure: str) -> float | None:
        return impls[impl].get(figure, {}).get("median")

    results = {
        "config": {"repeat": repeat, "rows": rows, "keys": keys, "one_driver": one_driver},
        "machine": machine_info(),
        "impls": impls, "runs": runs,
        "ratios": {
            "first_trigger_ours_over_spark_count": ratio(med("ours-compat", "start_to_first_trigger_s"),
                                                          med("spark-count-rocksdb", "start_to_first_trigger_s")),
            "end_ours_over_spark_tws": ratio(med("ours-compat", "start_to_end_s"),
                                             med("spark-tws-rows", "start_to_end_s")),
            "end_ours_over_spark_count": ratio(med("ours-compat", "start_to_end_s"),
                                               med("spark-count-rocksdb", "start_to_end_s")),
        },
    }
    path = write_results("bench_start.json", results)
    _plot(results, results_path("bench_start.png"))
    table = Table(title="a tiny availableNow query in a fresh driver: medians (min-max), s")
    for column in ("implementation", "start call", "to first trigger", "to end", "import of ours"):
        table.add_column(column)
    for impl in IMPLS:
        s = impls[impl]

        def cell(name: str, s: dict = s) -> str:
            f = s.get(name)
            return "-" if f is None else f"{f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f})"

        table.add_row(impl, cell("start_call_s"), cell("start_to_first_trigger_s"), cell("start_to_end_s"),
                      cell("import_s"))
    console.print(table)
    r = results["ratios"]
    first, end = r["first_trigger_ours_over_spark_count"], r["end_ours_over_spark_tws"]
    console.print(f"ours / Spark groupBy().count(), to first trigger: {fmt(first, '.2f', 'x')}; "
                  f"ours / Spark transformWithState, to end: {fmt(end, '.2f', 'x')}")
    console.print(f"results: {path}")


if __name__ == "__main__":
    typer.run(main)
