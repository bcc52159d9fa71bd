"""Spark's semantics, exactly: the same processor, the same input, Spark's own
``transformWithState`` (or ``transformWithStateInPandas``) and ours in the same test,
outputs compared batch by batch, the batches without input (no-data batches) included.

Spark runs batches that fire nothing where we run none (processing time: one at every
trigger; event time: one at every watermark advance): those are empty on Spark's side, so
the comparison is of the sequence of batches that emitted something, each batch's rows
sorted. Which of those batches had no input is compared too.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import IcebergStateTable, connect
from spark_integration import StateLocation, runner_of, start_stateful_query
from tests.integration import tws_processors as P
from tests.integration.streaming_helpers import spark_own_operator, stream, write_batches

SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
EVENTS = pa.schema([("key", pa.string()), ("v", pa.int64()), ("ts", pa.timestamp("us", tz="UTC"))])
EVENTS_DDL = "key string, v long, ts timestamp"


def at(seconds: float) -> dt.datetime:
    return dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=seconds)


def event_batches(rows: list[list[tuple]]) -> list[pa.Table]:
    return [pa.Table.from_pylist([dict(zip(EVENTS.names, r, strict=True)) for r in b], schema=EVENTS) for b in rows]


class Run:
    """One engine's run: rows per batch id, and which batches had input."""

    def __init__(self) -> None:
        self.batches: dict[int, list[tuple]] = {}
        self.rows_total: dict[int, int | None] = {}  # numRowsTotal after each batch

    def rows_total_with_input(self) -> dict[int, int | None]:
        """numRowsTotal after each batch that emitted (Spark runs batches without input too)."""
        return {b: n for b, n in self.rows_total.items() if self.batches.get(b)}

    def collect(self, df, batch_id: int) -> None:
        self.batches[batch_id] = sorted(tuple(r) for r in df.collect())

    def emitted(self) -> list[list[tuple]]:
        return [rows for _, rows in sorted(self.batches.items()) if rows]


def run_spark(spark, df, processor, output_schema: str, checkpoint: str, *, time_mode: str = "None",
              api: str = "row", initial=None, trigger: dict | None = None,
              until: Callable[[Run], bool] | None = None, timeout_s: float = 240) -> Run:
    """Spark's own operator over ``df`` grouped by ``key``, into a foreachBatch that records
    each batch; ``until`` stops a query that would not end by itself."""
    run = Run()
    with spark_own_operator(spark):
        grouped = df.groupBy("key")
        seed = None if initial is None else initial.groupBy("key")
        op = grouped.transformWithStateInPandas if api == "pandas" else grouped.transformWithState
        out = op(processor, output_schema, "Update", time_mode, initialState=seed)
        query = (out.writeStream.foreachBatch(run.collect).option("checkpointLocation", checkpoint)
                 .trigger(**(trigger or {"availableNow": True})).start())
        _wait(query, run, until, timeout_s)
    run.rows_total = {p.batchId: p.stateOperators[0].numRowsTotal for p in query.recentProgress if p.stateOperators}
    return run


def run_ours(spark, df, processor, output_schema: str, checkpoint: str, location: StateLocation, *,
             time_mode: str = "None", api: str = "row", initial=None, trigger: dict | None = None,
             until: Callable[[Run], bool] | None = None, timeout_s: float = 240) -> tuple[Run, set[int]]:
    """Ours over the same input; also returns the ids of the batches that had no input."""
    run = Run()
    query = start_stateful_query(df, ["key"], processor, output_schema, location=location,
                                 checkpoint_location=checkpoint, trigger=trigger or {"availableNow": True},
                                 foreach_batch=run.collect, time_mode=time_mode, api=api, initial_state=initial,
                                 compaction=None)
    _wait(query, run, until, timeout_s)
    reports = [r for r in runner_of(query).reports if not r.skipped]
    run.rows_total = {r.batch_id: r.state.get("numRowsTotal") for r in reports}
    no_input = {r.batch_id for r in reports if sum(t["rows_in"] for t in r.tasks.values()) == 0}
    return run, no_input


def _wait(query, run: Run, until: Callable[[Run], bool] | None, timeout_s: float) -> None:
    try:
        if until is None:
            query.awaitTermination(timeout_s)
        else:
            deadline = time.monotonic() + timeout_s
            while not until(run) and query.isActive and time.monotonic() < deadline:
                time.sleep(0.2)
            # the callback of the last batch ran; its progress (state figures) is posted after it
            last = max(run.batches, default=-1)
            settle = time.monotonic() + 30
            while query.isActive and time.monotonic() < settle and (
                    query.lastProgress is None or query.lastProgress.batchId < last):
                time.sleep(0.1)
        if query.exception() is not None:
            raise query.exception()
        assert until is None or until(run), f"the query did not reach its expected state in {timeout_s} s"
    finally:
        query.stop()


@pytest.fixture
def location(tmp_path):
    def make(parallelism: int = 2, table: str = "state") -> StateLocation:
        return StateLocation(table=table, warehouse=str(tmp_path / "wh"), parallelism=parallelism, max_parallelism=16)
    return make


def compare(spark_run: Run, ours: Run) -> None:
    assert ours.emitted() == spark_run.emitted()


def output_batches_without_input(run: Run, no_input: set[int]) -> list[list[tuple]]:
    return [rows for b, rows in sorted(run.batches.items()) if rows and b in no_input]


# ---------------------------------------------------------------------------- value, list and map state

@pytest.mark.parametrize("api", ["row", "pandas"])
def test_value_list_and_map_state_as_spark(spark, tmp_path, location, api):
    batches = [pa.table({"key": [f"k{(i * 7) % 11}" for i in range(b * 30, b * 30 + 30)],
                         "v": pa.array(range(b * 30, b * 30 + 30), pa.int64())}) for b in range(3)]
    input_dir = write_batches(tmp_path / "in", batches)
    processor = P.PandasCountsProcessor() if api == "pandas" else P.CountsProcessor()
    theirs = run_spark(spark, stream(spark, input_dir), processor, P.COUNTS_OUTPUT, str(tmp_path / "cp-spark"),
                       api=api)
    ours, _ = run_ours(spark, stream(spark, input_dir), processor, P.COUNTS_OUTPUT, str(tmp_path / "cp-ours"),
                       location(), api=api)
    assert len(theirs.emitted()) == 3
    compare(theirs, ours)


# ---------------------------------------------------------------------------- event time

# Out of order and late rows, a watermark 5 s behind, a window of 10 s from a key's first row.
# Batch 2's row of `a` at 3 s is older than batch 2's watermark (20 s) but not than batch 1's
# (0): Spark hands it to the processor. Batch 3's row of `g` at 4 s is older than batch 2's
# watermark: dropped. Timers of `d` and `e` fire after the input ends, in a batch without input.
WINDOW_ROWS = [
    [("a", 1, at(1)), ("b", 2, at(2))],
    [("a", 10, at(21)), ("c", 100, at(25)), ("b", 3, at(1.5))],
    [("a", 1000, at(3)), ("d", 5, at(40))],
    [("e", 7, at(41)), ("g", 9, at(4))],
    [("f", 1, at(70))],
]


@pytest.mark.parametrize("api", ["row", "pandas"])
def test_event_time_timers_late_rows_and_the_batch_after_the_input_as_spark(spark, tmp_path, location, api):
    input_dir = write_batches(tmp_path / "in", event_batches(WINDOW_ROWS))
    processor = P.PandasEventTimeWindowProcessor() if api == "pandas" else P.EventTimeWindowProcessor()

    def events():
        return stream(spark, input_dir, EVENTS_DDL).withWatermark("ts", "5 seconds")

    theirs = run_spark(spark, events(), processor, P.WINDOW_OUTPUT, str(tmp_path / "cp-spark"), time_mode="EventTime",
                       api=api)
    ours, no_input = run_ours(spark, events(), processor, P.WINDOW_OUTPUT, str(tmp_path / "cp-ours"), location(),
                              time_mode="EventTime", api=api)
    compare(theirs, ours)
    keys = [r[0] for rows in ours.emitted() for r in rows]
    assert sorted(keys) == ["a", "b", "c", "d", "e"]
    # d's and e's windows close after the input ends: in a batch without input, on both.
    assert [[r[0] for r in rows] for rows in output_batches_without_input(ours, no_input)] == [["d", "e"]]
    assert sorted(r[0] for r in theirs.batches[max(theirs.batches)]) == ["d", "e"]


# ---------------------------------------------------------------------------- processing time

def key_rows(spec: list[str]) -> list[pa.Table]:
    """One batch per string, a row per letter (key), v the row's position."""
    return [pa.table({"key": list(s), "v": pa.array(range(len(s)), pa.int64())}) for s in spec]


SESSION_BATCHES = ["aab", "bc", "c", "aad"]


@pytest.mark.parametrize("api", ["row", "pandas", "async_pandas"])
def test_processing_time_sessions_close_in_the_next_batch_and_after_the_input_as_spark(spark, tmp_path, location,
                                                                                       api):
    """A session closes 1 ms after a key's last rows: in the next batch, which on both engines
    starts later; the last sessions close after the input ended, in a batch without input.
    Spark runs a batch at every trigger in processing time (forever, even under
    availableNow): its query is stopped once every session closed. ``async_pandas``: ours runs
    the pandas processor written with coroutine handlers, against Spark's pandas run."""
    input_dir = write_batches(tmp_path / "in", key_rows(SESSION_BATCHES))
    processor = P.PandasSessionProcessor(1) if api != "row" else P.SessionProcessor(1)
    mine = P.AsyncPandasSessionProcessor(1) if api == "async_pandas" else processor

    def all_closed(run: Run) -> bool:
        return sum(1 for rows in run.batches.values() for r in rows if r[2]) == 5

    theirs = run_spark(spark, stream(spark, input_dir), processor, P.SESSION_OUTPUT, str(tmp_path / "cp-spark"),
                       time_mode="ProcessingTime", api="pandas" if api != "row" else "row", until=all_closed)
    ours, no_input = run_ours(spark, stream(spark, input_dir), mine, P.SESSION_OUTPUT,
                              str(tmp_path / "cp-ours"), location(), time_mode="ProcessingTime", api=api)
    compare(theirs, ours)
    assert output_batches_without_input(ours, no_input) == [[("a", 2, True), ("d", 1, True)]]
    # No timer left: no batch ran after the last sessions closed.
    assert max(ours.batches) == len(SESSION_BATCHES)


NO_DATA_CONF = "spark.sql.streaming.noDataMicroBatches.enabled"


def test_without_no_data_batches_timers_fire_in_the_next_batch_with_input_as_spark(spark, tmp_path, location):
    """``spark.sql.streaming.noDataMicroBatches.enabled=false``: no batch runs without input on
    either engine; a due session timer fires in the next batch that has input, and the sessions
    still open when the input ends stay open (an availableNow run ends with the input)."""
    input_dir = write_batches(tmp_path / "in", key_rows(SESSION_BATCHES))
    spark.conf.set(NO_DATA_CONF, "false")
    try:
        theirs = run_spark(spark, stream(spark, input_dir), P.SessionProcessor(1), P.SESSION_OUTPUT,
                           str(tmp_path / "cp-spark"), time_mode="ProcessingTime")
        ours, no_input = run_ours(spark, stream(spark, input_dir), P.SessionProcessor(1), P.SESSION_OUTPUT,
                                  str(tmp_path / "cp-ours"), location(), time_mode="ProcessingTime")
    finally:
        spark.conf.unset(NO_DATA_CONF)
    compare(theirs, ours)
    assert no_input == set() and max(ours.batches) == len(SESSION_BATCHES) - 1
    # Each session closes in the next batch with input; the last ones (a, d) stay open.
    closed = [(b, r[0], r[1]) for b, rows in sorted(ours.batches.items()) for r in rows if r[2]]
    assert closed == [(1, "a", 2), (2, "b", 2), (3, "c", 2)], closed


# ---------------------------------------------------------------------------- initial state

@pytest.mark.parametrize("api", ["row", "pandas"])
def test_initial_state_as_spark(spark, tmp_path, location, api):
    input_dir = write_batches(tmp_path / "in", key_rows(["abca", "bd"]))
    # Several initial rows for one key, and a key (z) with initial state and no input.
    initial = spark.createDataFrame([("a", 10), ("a", 5), ("b", 7), ("z", 100)], "key string, seed long")
    processor = P.PandasInitialCountProcessor() if api == "pandas" else P.InitialCountProcessor()
    theirs = run_spark(spark, stream(spark, input_dir), processor, P.INITIAL_OUTPUT, str(tmp_path / "cp-spark"),
                       api=api, initial=initial)
    ours, _ = run_ours(spark, stream(spark, input_dir), processor, P.INITIAL_OUTPUT, str(tmp_path / "cp-ours"),
                       location(), api=api, initial=initial)
    assert theirs.emitted() == [[("a", 17), ("b", 8), ("c", 1)], [("b", 9), ("d", 1)]]
    compare(theirs, ours)


# ---------------------------------------------------------------------------- composite types

def test_nested_and_composite_types_read_back_as_spark_returns_them(spark, tmp_path, location):
    """Rows at every depth below the top-level tuple, lists of Rows, dicts of Rows; a map's
    getValue returns a Row where its other reads return tuples; written as tuples, Rows or
    dicts alike; read back after a checkpoint and in the batch that wrote them."""
    input_dir = write_batches(tmp_path / "in", key_rows(["ab", "a", "ba"]))
    theirs = run_spark(spark, stream(spark, input_dir), P.CompositeProcessor(), P.COMPOSITE_OUTPUT,
                       str(tmp_path / "cp-spark"))
    ours, _ = run_ours(spark, stream(spark, input_dir), P.CompositeProcessor(), P.COMPOSITE_OUTPUT,
                       str(tmp_path / "cp-ours"), location())
    assert "Row(a=int:1, inner=Row(x=str:'a', y=float:0.5))" in theirs.emitted()[0][0][1]
    compare(theirs, ours)


# ---------------------------------------------------------------------------- deleted state

def test_deleted_state_raises_through_an_old_handle_and_starts_empty_through_a_new_one(spark, tmp_path, location):
    input_dir = write_batches(tmp_path / "in", key_rows(["aab", "ab"]))
    theirs = run_spark(spark, stream(spark, input_dir), P.DeletedStateProcessor(), P.DELETED_OUTPUT,
                       str(tmp_path / "cp-spark"))
    ours, _ = run_ours(spark, stream(spark, input_dir), P.DeletedStateProcessor(), P.DELETED_OUTPUT,
                       str(tmp_path / "cp-ours"), location())
    assert [(k, fresh, kept) for k, _, fresh, kept in theirs.emitted()[1]] == [("a", "None", 3), ("b", "None", 2)]
    said = theirs.emitted()[1][0][1]
    assert ("value.get raised PySparkRuntimeError(Error getting value state: Value state stale is not initialized.)"
            in said), said
    compare(theirs, ours)


# ---------------------------------------------------------------------------- not nullable

ENCODING_CONF = "spark.sql.streaming.stateStore.encodingFormat"


def test_state_fields_declared_not_nullable_as_spark(spark, tmp_path, location):
    """Spark's default state encoding takes fields declared not nullable: the same state and
    outputs here. With Avro encoding Spark refuses them (``TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE``,
    the query fails): ours refuses them at the query's start, with Spark's condition and text."""
    input_dir = write_batches(tmp_path / "in", key_rows(["ab", "a", "ab", "b"]))
    theirs = run_spark(spark, stream(spark, input_dir), P.NotNullableProcessor(), P.NOT_NULLABLE_OUTPUT,
                       str(tmp_path / "cp-spark"))
    ours, _ = run_ours(spark, stream(spark, input_dir), P.NotNullableProcessor(), P.NOT_NULLABLE_OUTPUT,
                       str(tmp_path / "cp-ours"), location())
    compare(theirs, ours)

    from pyspark.errors import PySparkException

    spark.conf.set(ENCODING_CONF, "avro")
    try:
        with pytest.raises(Exception) as spark_raised:
            run_spark(spark, stream(spark, input_dir), P.NotNullableProcessor(), P.NOT_NULLABLE_OUTPUT,
                      str(tmp_path / "cp-spark-avro"))
        with pytest.raises(PySparkException) as ours_raised:
            run_ours(spark, stream(spark, input_dir), P.NotNullableProcessor(), P.NOT_NULLABLE_OUTPUT,
                     str(tmp_path / "cp-ours-avro"), location(table="avro"))
    finally:
        spark.conf.unset(ENCODING_CONF)
    assert "[TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE]" in str(spark_raised.value), spark_raised.value
    assert ours_raised.value.getCondition() == "TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE"
    assert ours_raised.value.getSqlState() == "XXKST"
    # The same text (Spark names whichever state it checks first: compared without the name).
    def text(error: BaseException) -> str:
        said = " ".join(str(error).split())
        start = said.index("If Avro encoding is enabled")
        return re.sub(r"column family \S+ ", "column family _ ", said[start:said.index("Current schema:", start)])

    assert text(ours_raised.value) == text(spark_raised.value), (ours_raised.value, spark_raised.value)


# ---------------------------------------------------------------------------- schema evolution

def test_a_value_schema_changed_between_runs_evolves_as_spark_evolves_it(spark, tmp_path, location):
    """Spark (Avro state encoding, where it evolves state schemas) and ours restarted three times
    on the same checkpoints, the value state declared anew each time: int widened to long and a
    field added, then fields reordered and one dropped. Old values read with the new schema
    alike. (Spark's default encoding refuses any change; ours evolves there too.)"""
    where = location()
    outputs = []
    spark.conf.set(ENCODING_CONF, "avro")
    try:
        input_dir = tmp_path / "in"
        input_dir.mkdir()
        for version, batch in enumerate(key_rows(["aab", "ac", "abc"])):
            pq.write_table(batch, input_dir / f"part-{version:04d}.parquet")  # one new file per run
            theirs = run_spark(spark, stream(spark, str(input_dir)), P.EvolvingProcessor(version), P.EVOLVING_OUTPUT,
                               str(tmp_path / "cp-spark"))
            ours, _ = run_ours(spark, stream(spark, str(input_dir)), P.EvolvingProcessor(version), P.EVOLVING_OUTPUT,
                               str(tmp_path / "cp-ours"), where)
            outputs.append((theirs.emitted(), ours.emitted()))
    finally:
        spark.conf.unset(ENCODING_CONF)
    assert [theirs for theirs, _ in outputs] == [
        [[("a", "NoneType:None"), ("b", "NoneType:None")]],
        [[("a", "(int:2, str:'a', NoneType:None)"), ("c", "NoneType:None")]],      # widened, count added
        [[("a", "(str:'a1', int:10)"), ("b", "(str:'b', int:1)"), ("c", "(str:'c1', int:10)")]],  # reordered
    ], outputs
    for theirs, ours in outputs:
        assert ours == theirs


# ---------------------------------------------------------------------------- arrow batches

@pytest.mark.parametrize("conf", [{"spark.sql.execution.arrow.maxRecordsPerBatch": "2"},
                                  {"spark.sql.execution.arrow.maxBytesPerBatch": "2"}], ids=["records", "bytes"])
def test_a_pandas_processor_gets_a_keys_rows_in_the_dataframes_spark_cuts(spark, tmp_path, location, conf):
    input_dir = write_batches(tmp_path / "in", key_rows(["aaaaab", "aab"]))
    for key, value in conf.items():
        spark.conf.set(key, value)
    try:
        theirs = run_spark(spark, stream(spark, input_dir), P.PandasChunksProcessor(), P.CHUNKS_OUTPUT,
                           str(tmp_path / "cp-spark"), api="pandas")
        ours, _ = run_ours(spark, stream(spark, input_dir), P.PandasChunksProcessor(), P.CHUNKS_OUTPUT,
                           str(tmp_path / "cp-ours"), location(), api="pandas")
    finally:
        for key in conf:
            spark.conf.unset(key)
    assert len(theirs.emitted()[0][0][1].split(",")) > 1, theirs.emitted()  # Spark did cut a's rows
    compare(theirs, ours)


# ---------------------------------------------------------------------------- state names

def test_state_names_that_are_not_identifiers_as_spark_and_shown_by_their_name_in_sql(spark, tmp_path, location):
    input_dir = write_batches(tmp_path / "in", key_rows(["aab", "ab"]))
    theirs = run_spark(spark, stream(spark, input_dir), P.OddNamesProcessor(), P.NAMES_OUTPUT,
                       str(tmp_path / "cp-spark"))
    where = location()
    ours, _ = run_ours(spark, stream(spark, input_dir), P.OddNamesProcessor(), P.NAMES_OUTPUT,
                       str(tmp_path / "cp-ours"), where)
    compare(theirs, ours)
    table = IcebergStateTable.open_existing(warehouse=where.warehouse, table_name=where.table)
    try:
        con = connect(table)
        assert con.sql('SELECT key, "v_ttl-state".n FROM "state_ttl-state" ORDER BY key').fetchall() == [
            ("a", 3), ("b", 2)]
        assert con.sql('SELECT count(*) FROM "state_my state"').fetchall() == [(5,)]
        assert con.sql("""SELECT "mk_a.b".k FROM "state_a.b" WHERE key = 'a' ORDER BY 1""").fetchall() == [
            ("n2",), ("n3",)]
    finally:
        table.close()


# ---------------------------------------------------------------------------- restart with pending timers

def test_pending_timers_fire_after_a_restart_and_a_rescale_as_spark(spark, tmp_path, location):
    """A first run stops after one batch with every session's timer pending; the second run
    (on ours with another parallelism: the timers move with their key groups) fires them in
    its first batch, as Spark does, and the rest after the input ends; the same processor
    written with coroutine handlers (``api="async"``) too."""
    files = key_rows(["aabc", "bd", "d", "ce"])

    def closed(run: Run) -> int:
        return sum(1 for rows in run.batches.values() for r in rows if r[2])

    runs = {}
    for engine in ("spark", "ours", "async"):
        cp, input_dir = str(tmp_path / f"cp-{engine}"), tmp_path / f"in-{engine}"
        write_batches(input_dir, files[:1])
        for step, (trigger, parallelism, until) in enumerate([({"once": True}, 2, None),
                                                              ({"availableNow": True}, 3, lambda r: closed(r) == 6)]):
            if step == 1:
                write_batches(input_dir, files)
            if engine == "spark":
                run = run_spark(spark, stream(spark, str(input_dir)), P.SessionProcessor(1), P.SESSION_OUTPUT, cp,
                                time_mode="ProcessingTime", trigger=trigger, until=until)
            else:  # ours, and the same logic as an async processor
                processor, api = (P.SessionProcessor(1), "row") if engine == "ours" else (
                    P.AsyncSessionProcessor(1), "async")
                run, _ = run_ours(spark, stream(spark, str(input_dir)), processor, P.SESSION_OUTPUT, cp,
                                  location(parallelism, table=f"state_{engine}"), time_mode="ProcessingTime",
                                  trigger=trigger, api=api)
            runs.setdefault(engine, Run()).batches.update(run.batches)
    assert runs["spark"].emitted()[:2] == [
        [("a", 2, False), ("b", 1, False), ("c", 1, False)],
        [("a", 2, True), ("b", 2, False), ("c", 1, True), ("d", 1, False)]]
    compare(runs["spark"], runs["ours"])
    compare(runs["spark"], runs["async"])


# ---------------------------------------------------------------------------- TTL

@pytest.mark.parametrize("ttl_ms", [1, 3_600_000])
def test_ttl_as_spark(spark, tmp_path, location, ttl_ms):
    """A value written with a TTL of 1 ms has expired by the next batch (its time is later);
    one of an hour lives on. Spark's operator in ProcessingTime mode never ends its
    availableNow run: it is stopped once the three batches with input emitted."""
    input_dir = write_batches(tmp_path / "in", key_rows(["aab", "ab", "bc"]))

    def three(run: Run) -> bool:
        return len(run.emitted()) == 3

    theirs = run_spark(spark, stream(spark, input_dir), P.TtlProcessor(ttl_ms), P.TTL_OUTPUT,
                       str(tmp_path / "cp-spark"), time_mode="ProcessingTime", until=three)
    ours, _ = run_ours(spark, stream(spark, input_dir), P.TtlProcessor(ttl_ms), P.TTL_OUTPUT,
                       str(tmp_path / "cp-ours"), location(), time_mode="ProcessingTime")
    expected = {1: [[("a", 2), ("b", 1)], [("a", 1), ("b", 1)], [("b", 1), ("c", 1)]],
                3_600_000: [[("a", 2), ("b", 1)], [("a", 3), ("b", 2)], [("b", 3), ("c", 1)]]}
    assert theirs.emitted() == expected[ttl_ms]
    compare(theirs, ours)
    # the live rows after each batch: a 1 ms TTL leaves only the batch's own keys
    assert theirs.rows_total_with_input() == {1: {0: 2, 1: 2, 2: 2}, 3_600_000: {0: 2, 1: 2, 2: 3}}[ttl_ms]
    assert ours.rows_total_with_input() == theirs.rows_total_with_input()
