"""How fast a stopped Spark query's state comes over (``spark_integration.spark_import``).

One driver, local[2]. Spark's ``transformWithState`` with the benchmark's ``CountProcessor``
builds a state of ``keys`` keys on its RocksDB store (one batch, every key once); then, on that
checkpoint:

- ``spark_state_read_s``: Spark's state data source reads the variable into Arrow on the driver
  (``format("statestore")``, ``toArrow``): the read every import needs, its floor;
- ``import_s``: ``import_spark_state`` whole (the checkpoint read, the progress copied, every
  variable read, loaded and committed as the new table's first checkpoint);
- ``replay_s``: the other road, without an import: the same input replayed through the same
  processor on icestate from empty state (``start_stateful_query``, to the query's end), when
  the input is still there at all.

The imported state is checked key by key against Spark's. Prints a table, writes
``bench_import.json`` and ``bench_import.png`` to the results folder.
Run: ``.venv/bin/python -m benchmarks.bench_import`` (``--keys 2000`` for a smoke run).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import typer
from rich.table import Table

from benchmarks.harness import console, fmt, machine_info, pyplot, ratio, results_path, save_figure, write_results

OUTPUT_SCHEMA = "key string, count long"


def _session(scratch: Path, partitions: int):
    import os
    import sys

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master("local[2]").appName("bench-import")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.memory", "6g").config("spark.driver.maxResultSize", "4g")
               .config("spark.sql.shuffle.partitions", str(partitions))
               .config("spark.sql.streaming.stateStore.providerClass",
                       "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
               .config("spark.local.dir", str(scratch / "spark-local")))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main(
    keys: Annotated[int, typer.Option(help="Keys of the state Spark builds.")] = 5_000_000,
    partitions: Annotated[int, typer.Option(help="Spark's state partitions.")] = 4,
    replay: Annotated[bool, typer.Option(help="Also replay the input on icestate (the road without import).")] = True,
) -> None:
    from benchmarks.streaming.processors import CountProcessor
    from spark_integration import StateLocation, import_spark_state, start_stateful_query

    scratch = Path(tempfile.mkdtemp(prefix="bench-import-"))
    try:
        ids = np.arange(keys)
        pq.write_table(pa.table({"key": pa.array(np.char.add("u", ids.astype(str)).astype(object)),
                                 "v": pa.array(ids, pa.int64())}), scratch / "in.parquet")
        (scratch / "input").mkdir()
        shutil.move(scratch / "in.parquet", scratch / "input" / "part-0.parquet")
        spark = _session(scratch, partitions)
        figures: dict[str, float] = {}

        def stream():
            return spark.readStream.schema("key string, v long").parquet(str(scratch / "input"))

        console.print(f"Spark builds a state of {keys:,} keys on RocksDB ...")
        started = time.perf_counter()
        query = (stream().groupBy("key").transformWithState(CountProcessor(), OUTPUT_SCHEMA, "Update", "None")
                 .writeStream.format("noop").option("checkpointLocation", str(scratch / "cp-spark"))
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        figures["spark_build_s"] = time.perf_counter() - started

        started = time.perf_counter()
        theirs = (spark.read.format("statestore").option("stateVarName", "count").load(str(scratch / "cp-spark"))
                  .toArrow())
        figures["spark_state_read_s"] = time.perf_counter() - started
        assert theirs.num_rows == keys, theirs.num_rows

        console.print("import ...")
        location = StateLocation(table="imported", warehouse=str(scratch / "wh"), parallelism=2)
        report = import_spark_state(spark, str(scratch / "cp-spark"), str(scratch / "cp-ours"), location=location)
        figures["import_s"] = report.seconds
        with location.ref.open() as table:
            from catalog import connect

            con = connect(table)
            n, total = con.sql("SELECT count(*), sum(v_count.count) FROM state_count").fetchall()[0]
            con.close()
        assert (n, total) == (keys, keys), (n, total)  # every key, each counted once

        if replay:
            console.print("replay of the input on icestate ...")
            replayed = StateLocation(table="replayed", warehouse=str(scratch / "wh"), parallelism=2)
            started = time.perf_counter()
            query = start_stateful_query(stream(), ["key"], CountProcessor(), OUTPUT_SCHEMA, location=replayed,
                                         checkpoint_location=str(scratch / "cp-replay"),
                                         trigger={"availableNow": True}, compaction=None)
            query.awaitTermination()
            figures["replay_s"] = time.perf_counter() - started
        spark.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    results = {
        "benchmark": "bench_import", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(), "keys": keys, "partitions": partitions, "figures": figures,
        "import_keys_per_s": keys / figures["import_s"],
        "import_vs_spark_state_read": ratio(figures["import_s"], figures["spark_state_read_s"]),
        "import_vs_replay": ratio(figures["import_s"], figures.get("replay_s")),
    }
    path = write_results("bench_import.json", results)
    table = Table(title=f"bringing a {keys:,}-key state over from Spark's RocksDB store")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for name, seconds in figures.items():
        table.add_row(name, fmt(seconds, ",.1f"))
    table.add_row("import: keys/s", fmt(results["import_keys_per_s"]))
    table.add_row("import / Spark's state read", fmt(results["import_vs_spark_state_read"], ".2f", "x"))
    table.add_row("import / replay on icestate", fmt(results["import_vs_replay"], ".2f", "x"))
    console.print(table)
    _plot(results, results_path("bench_import.png"))
    console.print(f"results: {path}")


def _plot(results: dict, path: Path) -> None:
    plt = pyplot()
    names = {"spark_build_s": "Spark builds it\n(transformWithState)",
             "spark_state_read_s": "Spark reads it\n(state source)", "import_s": "import",
             "replay_s": "replay of the input\non icestate"}
    shown = [(label, results["figures"][k]) for k, label in names.items() if k in results["figures"]]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.barh([label for label, _ in shown], [s for _, s in shown], color=["#999", "#999", "#2a7", "#c84"][:len(shown)])
    ax.invert_yaxis()
    ax.set_xscale("log")  # Spark's own build of the state dwarfs the rest
    for y, (_, seconds) in enumerate(shown):
        ax.text(seconds, y, f" {seconds:,.1f} s", va="center")
    ax.set_xlim(right=max(s for _, s in shown) * 4)
    ax.set_xlabel("seconds (log scale)")
    ax.set_title(f"A {results['keys']:,}-key state from Spark's RocksDB store ({results['date'][:10]})")
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    typer.run(main)
