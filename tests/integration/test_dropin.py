"""One call switches an existing job (``spark_integration.dropin``): the job's own code, written
for Spark's ``transformWithState``, run by Spark and then on icestate after ``enable(spark, ...)``
in the same test, with the same input; outputs compared batch by batch, through each sink the
switch maps. What it cannot map fails with what to do, before anything runs."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_integration import runner_of
from spark_integration.dropin import DropInError, StatefulFrame, disable, enable, state_table_name
from tests.integration import tws_processors as P
from tests.integration.streaming_helpers import spark_own_operator, stream, write_batches


def count_batches(n: int, start: int = 0) -> list[pa.Table]:
    return [pa.table({"key": [f"k{(i * 7) % 11}" for i in range(b * 30, b * 30 + 30)],
                      "v": pa.array(range(b * 30, b * 30 + 30), pa.int64())}) for b in range(start, start + n)]


@pytest.fixture
def engines(spark, tmp_path):
    """Run a job on Spark's own operator (RocksDB, one shuffle partition) or on icestate; the
    session is left as it was."""

    def run(job, engine: str, **enable_args):
        if engine != "spark":
            enable(spark, **({"warehouse": str(tmp_path / "wh")} | enable_args))
        try:
            with spark_own_operator(spark) if engine == "spark" else contextlib.nullcontext():
                query = job()
                query.awaitTermination(240)
                if query.exception() is not None:
                    raise query.exception()
                return query
        finally:
            disable(spark)

    yield run
    disable(spark)


class Batches:
    def __init__(self) -> None:
        self.rows: dict[int, list[tuple]] = {}

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        self.rows[batch_id] = sorted(tuple(r) for r in df.collect())

    def emitted(self) -> list[list[tuple]]:
        return [rows for _, rows in sorted(self.rows.items()) if rows]


def counts_job(spark, input_dir: str, checkpoint: str, sink, *, api: str = "row", name: str | None = None):
    """A job as written for Spark: the processor, stateless operators after it, a writer."""
    grouped = stream(spark, input_dir).groupBy("key")
    if api == "pandas":
        out = grouped.transformWithStateInPandas(P.PandasCountsProcessor(), P.COUNTS_OUTPUT, "Update", "None")
    else:
        out = grouped.transformWithState(P.CountsProcessor(), P.COUNTS_OUTPUT, "Update", "None")
    out = (out.select("key", "count", "parity_keys").filter(F.col("count") > 3)
           .withColumn("twice", F.col("count") * 2).withColumnRenamed("parity_keys", "parities"))
    writer = out.writeStream.option("checkpointLocation", checkpoint).trigger(availableNow=True)
    if name:
        writer = writer.queryName(name)
    return sink(writer).start()


@pytest.mark.parametrize("api", ["row", "pandas"])
def test_an_existing_job_with_stateless_operators_and_foreach_batch_runs_as_on_spark(spark, tmp_path, engines, api):
    input_dir = write_batches(tmp_path / "in", count_batches(3))
    theirs, ours = Batches(), Batches()
    engines(lambda: counts_job(spark, input_dir, str(tmp_path / "cp-spark"), lambda w: w.foreachBatch(theirs),
                               api=api), "spark")
    query = engines(lambda: counts_job(spark, input_dir, str(tmp_path / "cp-ours"), lambda w: w.foreachBatch(ours),
                                       api=api), "icestate")
    assert len(theirs.emitted()) == 2  # the first batch's counts (2 or 3) are filtered out
    assert ours.emitted() == theirs.emitted()
    runner = runner_of(query)  # it ran on icestate: its state is in the table named after the checkpoint
    assert runner.table.identifier.endswith(state_table_name(None, str(tmp_path / "cp-ours")))
    assert runner.table.current_checkpoint() is not None


def test_memory_console_and_foreach_sinks_as_spark(spark, tmp_path, engines, capfd):
    """The memory and foreach sinks' rows against Spark's same sinks; the console's tables
    against Spark's batches (Spark's console sink prints from the JVM, whose output a test
    cannot capture; ours prints Spark's ``show`` of each batch under Spark's header)."""
    input_dir = write_batches(tmp_path / "in", count_batches(2))
    theirs = Batches()
    engines(lambda: counts_job(spark, input_dir, str(tmp_path / "cp-batches"), lambda w: w.foreachBatch(theirs)),
            "spark")
    for engine in ("spark", "icestate"):
        engines(lambda e=engine: counts_job(spark, input_dir, str(tmp_path / f"cp-mem-{e}"),
                                            lambda w: w.format("memory"), name=f"mem_{e}"), engine)
        written = tmp_path / f"foreach-{engine}"
        written.mkdir()
        engines(lambda e=engine, d=written: counts_job(spark, input_dir, str(tmp_path / f"cp-foreach-{e}"),
                                                       lambda w: w.foreach(RowFiles(str(d)))), engine)
    capfd.readouterr()
    engines(lambda: counts_job(spark, input_dir, str(tmp_path / "cp-console"),
                               lambda w: w.format("console").option("numRows", 50).option("truncate", False)),
            "icestate")
    shown = _console_batches(capfd.readouterr().out)
    memory = {e: sorted(tuple(r) for r in spark.table(f"mem_{e}").collect()) for e in ("spark", "icestate")}
    assert memory["spark"] and memory["icestate"] == memory["spark"]
    assert RowFiles.read(tmp_path / "foreach-icestate") == RowFiles.read(tmp_path / "foreach-spark") != []
    assert [rows for _, rows in sorted(shown.items()) if rows] == \
        [[tuple(str(v) for v in r) for r in rows] for rows in theirs.emitted()]


def _console_batches(text: str) -> dict[int, list[tuple[str, ...]]]:
    """The console sink's batches: each one's rows, read from its table (sorted)."""
    batches, current = {}, None
    for line in text.splitlines():
        if line.startswith("Batch: "):
            current = int(line.removeprefix("Batch: "))
            batches[current] = []
        elif current is not None and line.startswith("|"):
            batches[current].append(tuple(cell.strip() for cell in line.strip("|").split("|")))
    return {b: sorted(lines[1:]) for b, lines in batches.items()}  # the first line: the header


class RowFiles:
    """A ForeachWriter: one file per partition and epoch, the rows it processed as JSON lines."""

    def __init__(self, directory: str):
        self.directory = directory

    def open(self, partition_id: int, epoch_id: int) -> bool:
        self.path = os.path.join(self.directory, f"{epoch_id}-{partition_id}.jsonl")
        self.lines = []
        return True

    def process(self, row) -> None:
        self.lines.append(json.dumps(row.asDict(), sort_keys=True))

    def close(self, error) -> None:
        if error is None and self.lines:
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")

    @staticmethod
    def read(directory: Path) -> list[str]:
        return sorted(line for p in directory.iterdir() for line in p.read_text().splitlines())


def test_conf_keys_name_the_warehouse_and_a_restart_continues_the_state(spark, tmp_path, engines):
    input_dir = tmp_path / "in"
    write_batches(input_dir, count_batches(2))
    spark.conf.set("spark.icestate.warehouse", str(tmp_path / "wh-conf"))
    try:
        theirs, ours = Batches(), Batches()
        for batches in (2, 3):  # a restart on the same checkpoints, one more file of input
            write_batches(input_dir, count_batches(batches))
            engines(lambda: counts_job(spark, str(input_dir), str(tmp_path / "cp-spark"),
                                       lambda w: w.foreachBatch(theirs)), "spark")
            query = engines(lambda: counts_job(spark, str(input_dir), str(tmp_path / "cp-ours"),
                                               lambda w: w.foreachBatch(ours), name="counts"), "icestate",
                            warehouse=None)
        assert len(theirs.emitted()) == 2 and ours.emitted() == theirs.emitted()
        table = runner_of(query).table
        assert table.identifier.endswith("." + state_table_name("counts", str(tmp_path / "cp-ours")))
        assert table.identifier.split(".")[-1].startswith("counts_")
        assert str(tmp_path / "wh-conf") in runner_of(query).location.warehouse
    finally:
        spark.conf.unset("spark.icestate.warehouse")


def test_what_cannot_be_mapped_fails_with_what_to_do_and_disable_restores_spark(spark, tmp_path):
    input_dir = write_batches(tmp_path / "in", count_batches(1))
    enable(spark, warehouse=str(tmp_path / "wh"))
    try:
        out = stream(spark, input_dir).groupBy("key").transformWithState(P.CountsProcessor(), P.COUNTS_OUTPUT,
                                                                           "Update", "None")
        assert isinstance(out, StatefulFrame) and out.isStreaming
        assert out.columns == ["key", "count", "recent", "parity_keys"]
        with pytest.raises(DropInError, match="second query"):
            out.groupBy("key").count()
        with pytest.raises(DropInError, match="second query"):
            out.dropDuplicates(["key"])
        with pytest.raises(Exception, match="nope"):  # analysed at once, as Spark's operators are
            out.select("nope")
        writer = out.writeStream.option("checkpointLocation", str(tmp_path / "cp"))
        with pytest.raises(DropInError, match="the csv file sink needs a path"):
            writer.format("csv").start()
        with pytest.raises(DropInError, match="'kafka' sink is not mapped"):
            writer.format("kafka").start()
        with pytest.raises(DropInError, match="'complete'"):
            out.writeStream.outputMode("complete").option("checkpointLocation", str(tmp_path / "cp")) \
                .foreachBatch(lambda df, b: None).start()
        with pytest.raises(DropInError, match=r"option\(s\) \['kafka.bootstrap.servers'\]"):
            out.writeStream.format("console").option("kafka.bootstrap.servers", "x").start()
        with pytest.raises(DropInError, match="checkpointLocation must be specified"):
            out.writeStream.foreachBatch(lambda df, b: None).start()
        with pytest.raises(DropInError, match="toTable after stateless operators"):
            out.select("key").writeStream.option("checkpointLocation", str(tmp_path / "cp")).toTable("state.out")
        with pytest.raises(DropInError, match="continuous"):
            out.writeStream.trigger(continuous="1 second")
        assert not spark.streams.active
    finally:
        disable(spark)
    spark_out = stream(spark, input_dir).groupBy("key").transformWithState(P.CountsProcessor(), P.COUNTS_OUTPUT,
                                                                             "Update", "None")
    assert isinstance(spark_out, DataFrame) and not isinstance(spark_out, StatefulFrame)


def test_to_table_writes_the_output_table_exactly_once(spark, tmp_path, engines):
    input_dir = write_batches(tmp_path / "in", count_batches(2))
    theirs = Batches()
    engines(lambda: stream(spark, input_dir).groupBy("key")
            .transformWithState(P.CountsProcessor(), P.COUNTS_OUTPUT, "Update", "None")
            .writeStream.option("checkpointLocation", str(tmp_path / "cp-spark")).trigger(availableNow=True)
            .foreachBatch(theirs).start(), "spark")
    query = engines(lambda: stream(spark, input_dir).groupBy("key")
                    .transformWithState(P.CountsProcessor(), P.COUNTS_OUTPUT, "Update", "None")
                    .writeStream.option("checkpointLocation", str(tmp_path / "cp-ours")).trigger(availableNow=True)
                    .toTable("outputs.counts"), "icestate")
    catalog = runner_of(query).location.ref.catalog()
    try:
        written = catalog.load_table("outputs.counts").scan().to_arrow()
    finally:
        getattr(catalog, "close", lambda: None)()
    assert sorted(tuple(r.values()) for r in written.to_pylist()) == sorted(r for b in theirs.emitted() for r in b)


COMPACT_INTERVAL = "spark.sql.streaming.fileSink.log.compactInterval"


def test_a_file_sink_as_spark_read_by_a_second_stateful_query(spark, tmp_path, engines):
    """Spark's parquet sink and ours, over three batches with the sink's log compacted every
    second entry (as both write and read it): the same rows through Spark's reader of a sink's
    directory (its log); then the route for a stateful operator after the processor, a second
    query over the sink's directory, gives the same on both."""
    input_dir = write_batches(tmp_path / "in", count_batches(4))
    spark.conf.set(COMPACT_INTERVAL, "2")
    try:
        for engine in ("spark", "icestate"):
            engines(lambda e=engine: counts_job(spark, input_dir, str(tmp_path / f"cp-files-{e}"),
                                                lambda w: w.format("parquet").option("path", str(tmp_path / e))),
                    engine)
        def log(engine: str) -> list[str]:  # the entries (hidden files: the local filesystem's checksums)
            return sorted(p.name for p in (tmp_path / engine / "_spark_metadata").iterdir() if p.name[0] != ".")

        assert log("icestate") == log("spark") == ["0", "1.compact", "2", "3.compact"]
        rows = {e: sorted(tuple(r) for r in spark.read.parquet(str(tmp_path / e)).collect())
                for e in ("spark", "icestate")}
        assert rows["spark"] and rows["icestate"] == rows["spark"]
        second = {}
        for engine in ("spark", "icestate"):
            query = (spark.readStream.schema(spark.read.parquet(str(tmp_path / engine)).schema)
                     .parquet(str(tmp_path / engine)).groupBy("parities").agg(F.max("count").alias("most"))
                     .writeStream.format("memory").queryName(f"second_{engine}").outputMode("complete")
                     .option("checkpointLocation", str(tmp_path / f"cp-second-{engine}"))
                     .trigger(availableNow=True).start())
            query.awaitTermination(120)
            second[engine] = sorted(tuple(r) for r in spark.table(f"second_{engine}").collect())
        assert second["spark"] and second["icestate"] == second["spark"]
    finally:
        spark.conf.unset(COMPACT_INTERVAL)


@pytest.mark.parametrize("connect", [False, True], ids=["hadoop", "pyarrow"])
def test_a_file_sink_batch_run_again_is_skipped_and_a_dead_attempts_files_are_never_read(spark, tmp_path, connect):
    """A batch whose state commit failed runs again with the same id: its files are listed in
    the sink's log already, so nothing is written twice. An attempt that died before its log
    entry leaves files that Spark's readers never see. The same through the driver's Hadoop
    filesystem (classic sessions) and through pyarrow's (Spark Connect sessions: the callback
    runs without a JVM, and travels pickled without its filesystem)."""
    import pickle

    from spark_integration.dropin import FileSink

    path = tmp_path / "files"
    sink = FileSink(spark, str(path), "parquet", {}, (), (), connect=connect)
    if connect:
        sink = pickle.loads(pickle.dumps(sink))
    batch = spark.createDataFrame([("a", 1), ("b", 2)], "key string, n long")
    sink(batch, 0)
    sink(batch, 0)  # run again after a failed commit
    dead = path / "_icestate_staging" / "1-dead"
    batch.write.parquet(str(dead))  # an attempt of batch 1 that died before it moved its files
    batch.write.mode("append").parquet(str(path))  # or after it moved them, before its log entry
    sink(spark.createDataFrame([("c", 3)], "key string, n long"), 1)
    assert sorted(tuple(r) for r in spark.read.parquet(str(path)).collect()) == [("a", 1), ("b", 2), ("c", 3)]
    assert sorted(p.name for p in (path / "_spark_metadata").iterdir() if p.name[0] != ".") == ["0", "1"]
    assert (path / "_spark_metadata" / "0").read_text().startswith("v1\n{\"path\":\"file:")
    # Partition directories whose values Spark escapes ("key=x%20y%25z"): the log names them as
    # URIs, and Spark's reader finds every file.
    parted = tmp_path / "parted"
    sink = FileSink(spark, str(parted), "parquet", {}, ("key",), (), connect=connect)
    sink(spark.createDataFrame([("x y%z", 1), ("a", 2)], "key string, n long"), 0)
    assert sorted(tuple(r) for r in spark.read.parquet(str(parted)).select("key", "n").collect()) == [
        ("a", 2), ("x y%z", 1)]


def test_settings_precedence_option_case_and_columns_as_spark(spark, tmp_path):
    """An argument of enable() wins over the conf keys (a conf catalog does not take the state
    away from the warehouse given); option keys ignore case, as Spark's; the output's columns
    are reachable as Spark's (``out["c"]``, ``out.c``); enabling one session leaves another alone."""
    from spark_integration.dropin import _ENABLED, _location, _session_key

    input_dir = write_batches(tmp_path / "in", count_batches(1))
    spark.conf.set("spark.icestate.catalog", "production")
    enable(spark, warehouse=str(tmp_path / "wh"))
    try:
        location = _location(spark, _ENABLED[_session_key(spark)], "q", str(tmp_path / "cp"))
        assert location.catalog_name is None and location.warehouse == str(tmp_path / "wh")
        assert location.table == state_table_name("q", str(tmp_path / "cp")) != state_table_name("q", "/other")
        out = stream(spark, input_dir).groupBy("key").transformWithState(P.CountsProcessor(), P.COUNTS_OUTPUT,
                                                                           "Update", "None")
        assert str(out.filter(out["count"] > 1).filter(out.parity_keys > 0).columns) == str(out.columns)
        with pytest.raises(Exception, match="nope"):
            out["nope"]
        writer = out.writeStream.option("CHECKPOINTLOCATION", str(tmp_path / "cp")).option("NumRows", 5)
        assert writer._w.options == {"checkpointLocation": str(tmp_path / "cp"), "numRows": "5"}
        other = spark.newSession()
        assert not isinstance(stream(other, input_dir).groupBy("key").transformWithState(
            P.CountsProcessor(), P.COUNTS_OUTPUT, "Update", "None"), StatefulFrame)
    finally:
        disable(spark)
        spark.conf.unset("spark.icestate.catalog")


def test_state_rows_are_counted_as_spark_counts_them_across_a_restart(spark, tmp_path, engines):
    """``numRowsTotal``, ``numRowsUpdated`` and ``numRowsRemoved`` of each batch, Spark's in its
    progress, ours in the batch figures: values, non-empty lists and map entries written and
    removed in every way, timers that are not counted, and a restart in the middle (the count
    goes on from the checkpoint)."""
    # batches of writes (ops 0-4), of removals (5-8) and of both, on 7 keys
    kinds = [range(5), range(10), range(5, 9), range(5), range(5, 9), range(10)]
    batches = []
    for b, ops in enumerate(kinds):
        rows = [(f"k{(b * 5 + i * 3) % 7}", 100 * b + 10 * i + list(ops)[(i * 7 + b) % len(ops)]) for i in range(9)]
        batches.append(pa.table({"key": [k for k, _ in rows], "v": pa.array([v for _, v in rows], pa.int64())}))
    input_dir = tmp_path / "in"

    def job(checkpoint: str):
        out = stream(spark, str(input_dir)).groupBy("key").transformWithState(
            P.LiveRowsProcessor(), P.LIVE_ROWS_OUTPUT, "Update", "ProcessingTime")
        return (out.writeStream.format("noop").option("checkpointLocation", checkpoint)
                .trigger(availableNow=True).start())

    theirs, ours = {}, {}
    # Spark's availableNow in processing time would run batches without input for ever
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    try:
        for n in (3, 6):
            write_batches(input_dir, batches[:n])
            query = engines(lambda: job(str(tmp_path / "cp-spark")), "spark")
            theirs.update({p.batchId: (p.stateOperators[0].numRowsTotal, p.stateOperators[0].numRowsUpdated,
                                       p.stateOperators[0].numRowsRemoved)
                           for p in query.recentProgress if p.stateOperators})
            query = engines(lambda: job(str(tmp_path / "cp-ours")), "icestate")
            ours.update({r.batch_id: (r.state["numRowsTotal"], r.state["numRowsUpdated"], r.state["numRowsRemoved"])
                         for r in runner_of(query).reports if not r.skipped})
    finally:
        spark.conf.unset("spark.sql.streaming.noDataMicroBatches.enabled")
    assert sorted(theirs) == list(range(6)) and any(theirs[b][0] < theirs[b - 1][0] for b in (2, 4))  # up and down
    assert ours == theirs, (ours, theirs)
