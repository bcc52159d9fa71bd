"""A stopped Spark query's state brought over (``spark_integration.spark_import``): Spark runs the
first batches on its own store, the import moves the state and the progress, the same query
continues here; compared with Spark running the whole input without a switch, in the same test,
batch by batch (outputs and state figures) and by the final state. Spark's checkpoint is left as
it was: Spark can go back to it and continue as if nothing happened."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.streaming import StatefulProcessor

from catalog import connect
from catalog.table_ref import TableRef
from spark_integration import Deduplicate, RunningAggregate, StateLocation, enable, runner_of, start_stateful_query
from spark_integration.dropin import disable
from spark_integration.spark_import import SparkStateImportError, import_spark_state
from statestore.errors import SchemaMismatchError
from tests.integration import tws_processors as P
from tests.integration.replay_source import FORMAT as REPLAY
from tests.integration.replay_source import ReplaySource
from tests.integration.streaming_helpers import spark_own_operator, stream, write_batches
from tests.integration.test_spark_semantics import Run, key_rows, run_ours, run_spark

NO_DATA_BATCHES = "spark.sql.streaming.noDataMicroBatches.enabled"


@pytest.fixture
def no_data_batches_off(spark):
    """Batches only with input: Spark's availableNow in processing time would otherwise run
    batches without input for ever, and in event time runs some where the watermark moves (a
    switch between runs would move them)."""
    spark.conf.set(NO_DATA_BATCHES, "false")
    yield
    spark.conf.unset(NO_DATA_BATCHES)


def digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def live_rows_batches() -> list[pa.Table]:
    """Writes and removals of values, lists and map entries (``LiveRowsProcessor``'s ops), 7 keys."""
    kinds = [range(5), range(10), range(5, 9), range(5), range(10), range(5, 9)]
    batches = []
    for b, ops in enumerate(kinds):
        rows = [(f"k{(b * 5 + i * 3) % 7}", 100 * b + 10 * i + list(ops)[(i * 7 + b) % len(ops)]) for i in range(9)]
        batches.append(pa.table({"key": [k for k, _ in rows], "v": pa.array([v for _, v in rows], pa.int64())}))
    return batches


def spark_state(spark, checkpoint: str) -> dict:
    """The final state of ``LiveRowsProcessor``'s query on Spark's store, TTL expiries left out
    (each run's batches have their own times)."""
    def read(name: str, **options: str) -> list:
        reader = spark.read.format("statestore").option("stateVarName", name)
        for k, v in options.items():
            reader = reader.option(k, v)
        return reader.load(checkpoint).collect()

    return {
        "value": sorted((r.key.key, r.value.n) for r in read("value")),
        "items": sorted((r.key.key, [e.value.n for e in r.list_value])
                        for r in read("items", flattenCollectionTypes="false")),
        "entries": sorted((r.key.key, r.user_map_key.slot, r.user_map_value.value.n) for r in read("entries")),
    }


def our_state(table) -> dict:
    con = connect(table)
    try:
        items: dict[str, list[int]] = {}
        for key, n in con.sql("SELECT key, v_items.n FROM state_items ORDER BY key, list_position").fetchall():
            items.setdefault(key, []).append(n)
        return {
            "value": sorted(con.sql("SELECT key, v_value.n FROM state_value").fetchall()),
            "items": sorted(items.items()),
            "entries": sorted(con.sql("SELECT key, mk_entries.slot, v_entries.n FROM state_entries").fetchall()),
        }
    finally:
        con.close()


def test_the_same_job_continues_on_icestate_exactly_once_and_spark_can_go_back(spark, tmp_path, no_data_batches_off):
    """Value, list and map state (the list and map with a TTL), timers, in processing time; the
    job's own code, switched with ``enable`` after the import."""
    input_dir, batches = tmp_path / "in", live_rows_batches()
    figures: dict[str, dict[int, tuple]] = {"reference": {}, "back": {}, "ours": {}}
    outputs: dict[str, Run] = {name: Run() for name in figures}

    def job(checkpoint: str, run: Run):  # the job as written for Spark
        out = stream(spark, str(input_dir)).groupBy("key").transformWithState(
            P.LiveRowsProcessor(), P.LIVE_ROWS_OUTPUT, "Update", "ProcessingTime")
        return (out.writeStream.foreachBatch(run.collect).option("checkpointLocation", checkpoint)
                .trigger(availableNow=True).start())

    def on_spark(checkpoint: str, name: str) -> None:
        with spark_own_operator(spark):
            query = job(checkpoint, outputs[name])
            query.awaitTermination(240)
        assert query.exception() is None, query.exception()
        figures[name].update({p.batchId: (p.stateOperators[0].numRowsTotal, p.stateOperators[0].numRowsUpdated,
                                          p.stateOperators[0].numRowsRemoved) for p in query.recentProgress})

    cp_spark, cp_ours = tmp_path / "cp-spark", str(tmp_path / "cp-ours")
    write_batches(input_dir, batches[:3])
    on_spark(str(cp_spark), "back")
    before = digest(cp_spark)

    enable(spark, warehouse=str(tmp_path / "wh"))
    try:
        report = import_spark_state(spark, str(cp_spark), cp_ours, processor=P.LiveRowsProcessor())
        assert (report.checkpoint_id, report.batch_id, report.resumed) == (1, 2, False)
        assert report.rows["value"] > 0 and report.rows["items"] > 0 and report.rows["icestate_timers"] > 0
        assert digest(cp_spark) == before  # Spark's checkpoint is only read
        write_batches(input_dir, batches)
        query = job(cp_ours, outputs["ours"])
        query.awaitTermination(240)
        assert query.exception() is None, query.exception()
        runner = runner_of(query)
        figures["ours"] = {r.batch_id: (r.state["numRowsTotal"], r.state["numRowsUpdated"],
                                        r.state["numRowsRemoved"]) for r in runner.reports if not r.skipped}
        ours_state = our_state(runner.table)
    finally:
        disable(spark)

    on_spark(str(tmp_path / "cp-reference"), "reference")  # the whole input, no switch
    on_spark(str(cp_spark), "back")  # Spark goes on from its own checkpoint, untouched by the switch
    reference = outputs["reference"].batches
    assert sorted(reference) == list(range(6))
    assert outputs["ours"].batches == {b: reference[b] for b in (3, 4, 5)}
    assert outputs["back"].batches == reference
    assert figures["ours"] == {b: figures["reference"][b] for b in (3, 4, 5)}, figures
    assert ours_state == spark_state(spark, str(tmp_path / "cp-reference")) == spark_state(spark, str(cp_spark))


def test_event_time_state_and_timers_continue_from_a_replayable_source(spark, tmp_path, no_data_batches_off):
    """Event-time windows open at the switch (their timers registered on Spark's store) close on
    ours at the same watermark; the source's offsets continue where Spark's stopped."""
    spark.dataSource.register(ReplaySource)

    def events(total: int):
        return (spark.readStream.format(REPLAY).option("total", total).option("rows_per_batch", 8).load()
                .withWatermark("ts", "5 seconds"))

    processor, out = P.EventTimeWindowProcessor(), P.WINDOW_OUTPUT
    reference = run_spark(spark, events(64), processor, out, str(tmp_path / "cp-ref"), time_mode="EventTime")
    first = run_spark(spark, events(24), processor, out, str(tmp_path / "cp-spark"), time_mode="EventTime")
    location = StateLocation(table="windows", warehouse=str(tmp_path / "wh"), parallelism=3, max_parallelism=16)
    report = import_spark_state(spark, str(tmp_path / "cp-spark"), str(tmp_path / "cp-ours"), location=location)
    assert report.batch_id == 2 and report.rows["icestate_timers"] == 5  # every key's window open
    ours, _ = run_ours(spark, events(64), processor, out, str(tmp_path / "cp-ours"), location, time_mode="EventTime")
    assert sorted(reference.batches) == list(range(8)) and any(ours.batches.values())
    assert first.batches == {b: reference.batches[b] for b in range(3)}
    assert ours.batches == {b: reference.batches[b] for b in range(3, 8)}


def test_pending_processing_time_timers_fire_without_new_input_after_the_import(spark, tmp_path):
    """Sessions whose timers are due at the switch close in a batch without input, at once: the
    imported checkpoint says which timer is next."""
    input_dir = tmp_path / "in"
    write_batches(input_dir, key_rows(["aabc"]))
    first = run_spark(spark, stream(spark, str(input_dir)), P.SessionProcessor(1), P.SESSION_OUTPUT,
                      str(tmp_path / "cp-spark"), time_mode="ProcessingTime", trigger={"once": True})
    assert first.emitted() == [[("a", 2, False), ("b", 1, False), ("c", 1, False)]]
    location = StateLocation(table="sessions", warehouse=str(tmp_path / "wh"), parallelism=2, max_parallelism=16)
    import_spark_state(spark, str(tmp_path / "cp-spark"), str(tmp_path / "cp-ours"), location=location)
    ours, no_input = run_ours(spark, stream(spark, str(input_dir)), P.SessionProcessor(1), P.SESSION_OUTPUT,
                              str(tmp_path / "cp-ours"), location, time_mode="ProcessingTime",
                              until=lambda run: bool(run.emitted()))
    assert ours.emitted() == [[("a", 2, True), ("b", 1, True), ("c", 1, True)]]
    assert set(ours.batches) <= no_input | {b for b, rows in ours.batches.items() if not rows}


@pytest.mark.parametrize("operator", ["count", "sum", "dropDuplicates"])
def test_an_aggregation_or_deduplication_continues_as_a_vectorized_processor(spark, tmp_path, operator):
    """Spark's ``groupBy().count()``, ``agg(sum)`` (update mode) and ``dropDuplicates``: their state
    continues in ``RunningAggregate`` and ``Deduplicate``, whose outputs are Spark's."""
    from pyspark.sql import functions as F

    input_dir = tmp_path / "in"
    files = [pa.table({"key": list(s), "v": pa.array(range(len(s)), pa.int64())}) for s in ["aabc", "bd", "dae", "ab"]]

    def spark_job(checkpoint: str, run: Run):
        df = stream(spark, str(input_dir))
        out = {"count": lambda: df.groupBy("key").count(), "sum": lambda: df.groupBy("key").agg(F.sum("v")),
               "dropDuplicates": lambda: df.dropDuplicates(["key"])}[operator]()
        with spark_own_operator(spark):
            query = (out.writeStream.foreachBatch(run.collect).outputMode(
                "append" if operator == "dropDuplicates" else "update").option("checkpointLocation", checkpoint)
                .trigger(availableNow=True).start())
            query.awaitTermination(120)
        assert query.exception() is None, query.exception()

    processor = {"count": RunningAggregate("count"), "sum": RunningAggregate("sum", "v"),
                 "dropDuplicates": Deduplicate()}[operator]
    write_batches(input_dir, files[:2])
    first, reference, ours = Run(), Run(), Run()
    spark_job(str(tmp_path / "cp-spark"), first)
    location = StateLocation(table="agg", warehouse=str(tmp_path / "wh"), parallelism=2, max_parallelism=16)
    report = import_spark_state(spark, str(tmp_path / "cp-spark"), str(tmp_path / "cp-ours"), location=location,
                                processor=processor)
    assert report.batch_id == 1 and report.rows == {processor.state_name: 4}
    write_batches(input_dir, files)
    query = start_stateful_query(stream(spark, str(input_dir)), ["key"], processor, location=location,
                                 checkpoint_location=str(tmp_path / "cp-ours"), trigger={"availableNow": True},
                                 foreach_batch=ours.collect)
    query.awaitTermination(120)
    assert query.exception() is None, query.exception()
    spark_job(str(tmp_path / "cp-reference"), reference)
    assert sorted(reference.batches) == [0, 1, 2, 3]
    assert first.batches == {b: reference.batches[b] for b in (0, 1)}
    assert ours.batches == {b: reference.batches[b] for b in (2, 3)}


class CountAsText(StatefulProcessor):
    """``CountsProcessor``'s count declared with another type."""

    def init(self, handle) -> None:
        handle.getValueState("count", "n string")

    def handleInputRows(self, key, rows, timerValues):
        return iter([])

    def close(self) -> None:
        pass


def test_what_cannot_be_imported_fails_naming_it_and_a_failed_import_runs_again(spark, tmp_path):
    input_dir = tmp_path / "in"
    write_batches(input_dir, key_rows(["aab", "bc"]))
    with spark_own_operator(spark):
        query = (stream(spark, str(input_dir)).groupBy("key").count().writeStream.format("noop")
                 .outputMode("update").option("checkpointLocation", str(tmp_path / "cp-agg"))
                 .trigger(availableNow=True).start())
        query.awaitTermination(120)
    location = StateLocation(table="t", warehouse=str(tmp_path / "wh"), max_parallelism=16)
    with pytest.raises(SparkStateImportError, match=r"an aggregation's, of \['count'\]: give processor=RunningAgg"):
        import_spark_state(spark, str(tmp_path / "cp-agg"), str(tmp_path / "x"), location=location)
    with pytest.raises(SparkStateImportError, match=r"agg one of those"):
        import_spark_state(spark, str(tmp_path / "cp-agg"), str(tmp_path / "x"), location=location,
                           processor=RunningAggregate("sum", "v"))
    with pytest.raises(SparkStateImportError, match="not a streaming query's checkpoint"):
        import_spark_state(spark, str(tmp_path / "in"), str(tmp_path / "x"), location=location)

    run_spark(spark, stream(spark, str(input_dir)), P.CountsProcessor(), P.COUNTS_OUTPUT, str(tmp_path / "cp"))
    with pytest.raises(SchemaMismatchError, match="processor the query ran with"):
        import_spark_state(spark, str(tmp_path / "cp"), str(tmp_path / "to"), location=location,
                           processor=CountAsText())
    damaged = tmp_path / "cp-damaged"  # Spark's checkpoint with a truncated offset-log entry
    shutil.copytree(tmp_path / "cp", damaged)
    (damaged / "offsets" / ".1.crc").unlink(missing_ok=True)
    (damaged / "offsets" / "1").write_text("v1\n")
    with pytest.raises(SparkStateImportError, match=r"offsets/1 is not an entry of Spark's log"):
        import_spark_state(spark, str(damaged), str(tmp_path / "x"), location=location)
    assert not (tmp_path / "x").exists()
    os.makedirs(tmp_path / "busy")
    (tmp_path / "busy" / "f").write_text("x")
    with pytest.raises(SparkStateImportError, match="not empty"):
        import_spark_state(spark, str(tmp_path / "cp"), str(tmp_path / "busy"), location=location)
    with pytest.raises(SparkStateImportError, match="own checkpoint"):
        import_spark_state(spark, str(tmp_path / "cp"), str(tmp_path / "cp"), location=location)
    first = import_spark_state(spark, str(tmp_path / "cp"), str(tmp_path / "to"), location=location)
    again = import_spark_state(spark, str(tmp_path / "cp"), str(tmp_path / "to"), location=location)
    assert not first.resumed and again.resumed and again.checkpoint_id == first.checkpoint_id
    with TableRef("t", warehouse=str(tmp_path / "wh")).open() as table:
        assert [c.checkpoint_id for c in table.list_checkpoints()] == [first.checkpoint_id]
    run_spark(spark, stream(spark, str(input_dir)), P.CountsProcessor(), P.COUNTS_OUTPUT, str(tmp_path / "cp2"))
    with pytest.raises(SparkStateImportError, match="holds state already"):
        import_spark_state(spark, str(tmp_path / "cp2"), str(tmp_path / "to2"), location=location)


def test_the_command_imports_into_the_table_the_switch_opens(spark, tmp_path):
    from typer.testing import CliRunner

    from spark_integration.cli import app
    from spark_integration.dropin import state_table_name

    input_dir = tmp_path / "in"
    write_batches(input_dir, key_rows(["aab", "bcc"]))
    run_spark(spark, stream(spark, str(input_dir)), P.CountsProcessor(), P.COUNTS_OUTPUT, str(tmp_path / "cp"))
    to = str(tmp_path / "cp-icestate")
    result = CliRunner().invoke(app, ["import-spark-state", "--checkpoint", str(tmp_path / "cp"), "--to", to,
                                      "--query-name", "counts", "--warehouse", str(tmp_path / "wh")])
    assert result.exit_code == 0, result.output
    name = state_table_name("counts", to)
    assert f"batch 1 of the query as checkpoint 1 of state.{name}" in " ".join(result.output.split())
    with TableRef(name, warehouse=str(tmp_path / "wh")).open() as table:
        con = connect(table)
        assert sorted(con.sql("SELECT key, v_count.n FROM state_count").fetchall()) == [("a", 2), ("b", 2), ("c", 2)]
        con.close()
    again = CliRunner().invoke(app, ["import-spark-state", "--checkpoint", str(tmp_path / "in"), "--to", to,
                                     "--warehouse", str(tmp_path / "wh")])
    assert again.exit_code == 1 and "not a streaming query's checkpoint" in again.output

    with spark_own_operator(spark):  # an aggregation's state, continued by RunningAggregate("sum", "v")
        query = (stream(spark, str(input_dir)).groupBy("key").sum("v").writeStream.format("noop")
                 .outputMode("update").option("checkpointLocation", str(tmp_path / "cp-sum"))
                 .trigger(availableNow=True).start())
        query.awaitTermination(120)
    result = CliRunner().invoke(app, ["import-spark-state", "--checkpoint", str(tmp_path / "cp-sum"), "--to",
                                      str(tmp_path / "cp-sum-icestate"), "--table", "sums", "--aggregate", "sum:v",
                                      "--warehouse", str(tmp_path / "wh")])
    assert result.exit_code == 0, result.output
    with TableRef("sums", warehouse=str(tmp_path / "wh")).open() as table:
        con = connect(table)
        assert sorted(con.sql("SELECT key, v_sum FROM state_sum").fetchall()) == [("a", 1), ("b", 2), ("c", 3)]
        con.close()
