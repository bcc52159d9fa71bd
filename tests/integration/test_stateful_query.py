"""Stateful streaming queries on the Iceberg state table, with a real local Spark session.

Spark's own transformWithState is the reference for the processor API: the same
processor class runs on both and must emit the same rows.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter, defaultdict
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQueryListener

from catalog import IcebergStateTable, connect, inspection
from catalog.defaults import default_catalog
from catalog.repair import Repair
from spark_integration import (
    Deduplicate,
    RunningAggregate,
    StateLocation,
    register,
    runner_of,
    start_stateful_query,
)
from statestore.errors import (
    QuerySourcesMismatchError,
    SchemaMismatchError,
    StateOutOfStepError,
    StateTableMismatchError,
    UnsupportedKeyTypeError,
)
from tests.hostile import forged_envelopes
from tests.integration.streaming_helpers import (
    PROFILE_OUTPUT,
    AsyncProfileProcessor,
    BadOutputProcessor,
    CountProcessor,
    FailingProcessor,
    ForgetfulCount,
    InitialCountProcessor,
    ProfileProcessor,
    TtlCountProcessor,
    counts,
    key_batches,
    run_to_end,
    spark_own_operator,
    stream,
    write_batches,
)


@pytest.fixture
def where(tmp_path: Path):
    def location(table: str = "state", parallelism: int = 2, max_parallelism: int = 16,
                 branch: str = "main") -> StateLocation:
        return StateLocation(table=table, warehouse=str(tmp_path / "wh"), parallelism=parallelism,
                             max_parallelism=max_parallelism, branch=branch)
    return location


def live_state(location: StateLocation, name: str) -> pl.DataFrame:
    table = IcebergStateTable.open_existing(warehouse=location.warehouse, table_name=location.table,
                                            branch=location.branch)
    try:
        return pl.from_arrow(connect(table).sql(f"SELECT * FROM state_{name}").to_arrow_table())
    finally:
        table.close()


def state_counts(location: StateLocation, name: str = "count") -> dict[str, int]:
    live = live_state(location, name)
    return {k: v["n"] for k, v in zip(live["key"].to_list(), live[f"v_{name}"].to_list(), strict=True)}


def output_rows(location: StateLocation, identifier: str) -> pa.Table:
    catalog = default_catalog(location.warehouse)
    try:
        return catalog.load_table(identifier).scan().to_arrow()
    finally:
        catalog.close()


def collector():
    rows: list[tuple] = []

    def collect(df, batch_id):
        rows.extend((batch_id, *r) for r in df.collect())
    return rows, collect


def test_same_processor_same_output_as_spark_transform_with_state(spark, tmp_path, where):
    input_dir = write_batches(tmp_path / "in", key_batches(3, 60, 23))
    spark_rows: list[tuple] = []
    with spark_own_operator(spark):
        out = stream(spark, input_dir).groupBy("key").transformWithState(ProfileProcessor(), PROFILE_OUTPUT,
                                                                          "Update", "None")
        q = (out.writeStream.foreachBatch(lambda df, b: spark_rows.extend((b, *r) for r in df.collect()))
             .option("checkpointLocation", str(tmp_path / "cp-spark")).trigger(availableNow=True).start())
        q.awaitTermination(300)
        assert q.exception() is None
    ours, collect = collector()
    run_to_end(spark, input_dir, ProfileProcessor(), PROFILE_OUTPUT, location=where(),
               checkpoint=str(tmp_path / "cp-ours"), foreach_batch=collect)
    assert len(spark_rows) > 50
    assert sorted(ours) == sorted(spark_rows)


def test_the_change_feed_per_batch_equals_spark_state_readers(spark, tmp_path, where):
    """Issue 15: option readChangeFeed with Spark's changeStartBatchId/changeEndBatchId gives, per
    batch, each key's new count: what Spark's own state reader's change feed gives for Spark's
    transformWithState on the same input (its rows are all updates: a count never deletes)."""
    input_dir = write_batches(tmp_path / "in", key_batches(4, 50, 17))
    changelog = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"
    with spark_own_operator(spark, **{changelog: "true"}):
        out = stream(spark, input_dir).groupBy("key").transformWithState(CountProcessor(), "key string, count long",
                                                                          "Update", "None")
        q = (out.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "cp-spark"))
             .trigger(availableNow=True).start())
        q.awaitTermination(300)
        assert q.exception() is None
        theirs = (spark.read.format("statestore").option("path", str(tmp_path / "cp-spark"))
                  .option("stateVarName", "count").option("readChangeFeed", "true").option("changeStartBatchId", 1)
                  .option("changeEndBatchId", 3).load()
                  .selectExpr("batch_id", "change_type", "key.key AS key", "value.n AS n").collect())
    loc = where()
    run_to_end(spark, input_dir, CountProcessor(), "key string, count long", location=loc,
               checkpoint=str(tmp_path / "cp-ours"))
    register(spark)
    ours = (spark.read.format("icestate").option("warehouse", loc.warehouse).option("table", loc.table)
            .option("state", "count").option("readChangeFeed", "true").option("changeStartBatchId", 1)
            .option("changeEndBatchId", 3).load())
    assert ours.columns[:3] == ["batch_id", "checkpoint_id", "change_type"]
    rows = ours.selectExpr("batch_id", "change_type", "key", "after.n AS n", "before.n AS was").collect()
    assert {r.batch_id for r in rows} == {1, 2, 3} and len(theirs) > 20
    assert sorted((r.batch_id, r.key, r.n) for r in rows) == sorted((r.batch_id, r.key, r.n) for r in theirs)
    assert {r.change_type for r in theirs} == {"update"}
    assert all((r.change_type == "insert") == (r.was is None) for r in rows)
    with pytest.raises(Exception, match="no retained checkpoint of batches 7 to the newest"):
        (spark.read.format("icestate").option("warehouse", loc.warehouse).option("table", loc.table)
         .option("readChangeFeed", "true").option("changeStartBatchId", 7).load().collect())


def test_state_and_outputs_after_several_batches(spark, tmp_path, where):
    batches = key_batches(3, 80, 31)
    loc = where()
    runner = run_to_end(spark, write_batches(tmp_path / "in", batches), CountProcessor(), "key string, count long",
                        location=loc, checkpoint=str(tmp_path / "cp"), output_table="out.counts")
    assert state_counts(loc) == counts(batches)
    out = output_rows(loc, "out.counts")
    finals = out.group_by("key").aggregate([("count", "max")])
    assert dict(zip(finals["key"].to_pylist(), finals["count_max"].to_pylist(), strict=True)) == counts(batches)
    assert out.num_rows == sum(len(set(b["key"].to_pylist())) for b in batches)
    reports = [r for r in runner.reports if not r.skipped]
    assert [r.batch_id for r in reports] == [0, 1, 2]
    assert [r.checkpoint_id for r in reports] == [1, 2, 3]
    table = IcebergStateTable.open_existing(warehouse=loc.warehouse, table_name=loc.table)
    try:
        assert [(c.batch_id, c.parallelism) for c in table.list_checkpoints()] == [(0, 2), (1, 2), (2, 2)]
        # The inspection table names the operator and the query that wrote each checkpoint.
        listed = inspection.checkpoints(table).to_pylist()
        assert {(r["operator"], r["query_id"]) for r in listed} == {(table.identifier, runner.query_id)}
    finally:
        table.close()


@pytest.mark.parametrize("agg", ["count", "sum", "min", "max"])
def test_vectorized_running_aggregates(spark, tmp_path, where, agg):
    batches = key_batches(3, 90, 17)
    rows, collect = collector()
    processor = RunningAggregate(agg, None if agg == "count" else "v")
    run_to_end(spark, write_batches(tmp_path / "in", batches), processor, None, location=where(),
               checkpoint=str(tmp_path / "cp"), foreach_batch=collect)
    expected = []
    seen = pl.DataFrame()
    for b, t in enumerate(batches):
        seen = pl.concat([seen, pl.from_arrow(t)]) if seen.height else pl.from_arrow(t)
        touched = set(t["key"].to_pylist())
        fn = {"count": pl.len(), "sum": pl.col("v").sum(), "min": pl.col("v").min(), "max": pl.col("v").max()}[agg]
        now = seen.group_by("key").agg(fn.alias("x")).filter(pl.col("key").is_in(touched))
        expected += [(b, k, x) for k, x in now.iter_rows()]
    assert sorted(rows) == sorted(expected)


def test_tasks_in_workers_that_never_ran_them_map_the_views_of_the_host(spark, tmp_path, where):
    """One copy of the state per host: in the batches whose workers forgot their task stores,
    every task maps the views another store of the host wrote at its commit, and reads only the
    segment committed since, never its whole state; the outputs and the state stay exact."""
    batches = key_batches(6, 90, 23)
    rows, collect = collector()
    loc = where(parallelism=4)
    runner = run_to_end(spark, write_batches(tmp_path / "in", batches), ForgetfulCount(), None, location=loc,
                        checkpoint=str(tmp_path / "cp"), foreach_batch=collect)
    reports = [r for r in runner.reports if not r.skipped]
    assert [r.checkpoint_id for r in reports] == [1, 2, 3, 4, 5, 6]
    assert all(t["views_published"] > 0 for t in reports[1].tasks.values())  # each store's first commit, or load
    for r in reports[2:]:
        # Spark moves tasks between its workers too: a task in a worker without its store maps
        # the host's views and reads only the checkpoints they are behind, fewer than the
        # segments of every checkpoint before (one a task: what a load reads; the views are
        # written again once StoreConfig.host_views_lag behind, a share of them a commit, by a store that
        # lives to commit again); one that kept its store reads nothing
        assert all((t["views_mapped"] > 0 and t["files_opened"] < r.checkpoint_id - 1)
                   or t["files_opened"] == 0
                   for t in r.tasks.values()), (r.checkpoint_id, {
            task: (t["views_mapped"], t["files_opened"]) for task, t in r.tasks.items()})
        if r.checkpoint_id % 2 == 1:  # on an even base: in workers that forgot every store
            assert all(t["views_mapped"] > 0 for t in r.tasks.values()), (r.checkpoint_id, r.tasks)
    live = live_state(loc, "count")
    assert dict(zip(live["key"].to_list(), live["v_count"].to_list(), strict=True)) == counts(batches)
    expected, seen = [], Counter()
    for b, t in enumerate(batches):
        seen.update(t["key"].to_pylist())
        expected += [(b, k, seen[k]) for k in set(t["key"].to_pylist())]
    assert sorted(rows) == sorted(expected)


def test_a_spark_worker_freezes_its_imports_before_its_first_store(spark):
    """In a Spark task, the worker's modules go to the collector's permanent generation once
    (``tasks._freeze_imports_once``): PySpark's daemon collects after every task of a reused
    worker, and would otherwise walk them all each time."""

    def probe(batches):
        import gc

        from spark_integration.tasks import _freeze_imports_once

        for _ in batches:
            pass
        _freeze_imports_once()
        frozen = gc.get_freeze_count()
        _freeze_imports_once()  # once: a second call freezes nothing more
        yield pa.RecordBatch.from_pydict({"frozen": [frozen], "again": [gc.get_freeze_count()]})

    rows = spark.range(0, 2, 1, 2).mapInArrow(probe, "frozen long, again long").collect()
    assert all(r["frozen"] > 10_000 and r["again"] == r["frozen"] for r in rows)


def test_vectorized_deduplicate(spark, tmp_path, where):
    batches = key_batches(3, 50, 40)
    rows, collect = collector()
    run_to_end(spark, write_batches(tmp_path / "in", batches), Deduplicate(), None, location=where(),
               checkpoint=str(tmp_path / "cp"), foreach_batch=collect)
    first: dict[str, tuple] = {}
    for b, t in enumerate(batches):
        for k, v in zip(t["key"].to_pylist(), t["v"].to_pylist(), strict=True):
            first.setdefault(k, (b, k, v))
    assert sorted(rows) == sorted(first.values())


def test_replayed_batch_is_not_applied_twice(spark, tmp_path, where):
    batches = key_batches(3, 70, 19)
    input_dir = write_batches(tmp_path / "in", batches)
    loc, cp = where(), tmp_path / "cp"
    run_to_end(spark, input_dir, ProfileProcessor(), PROFILE_OUTPUT, location=loc, checkpoint=str(cp),
               output_table="out.profile")
    before = output_rows(loc, "out.profile")
    # Spark replays a batch whose commit marker is missing: as after a driver crash.
    os.remove(cp / "commits" / "2")
    (cp / "commits" / ".2.crc").unlink(missing_ok=True)
    runner = run_to_end(spark, input_dir, ProfileProcessor(), PROFILE_OUTPUT, location=loc, checkpoint=str(cp),
                        output_table="out.profile")
    assert [(r.batch_id, r.skipped) for r in runner.reports] == [(2, True)]
    assert state_counts(loc) == counts(batches)
    after = output_rows(loc, "out.profile")
    assert sorted(after.to_pylist(), key=str) == sorted(before.to_pylist(), key=str)


def test_a_repair_while_the_query_is_stopped_is_where_the_resumed_stream_goes_on(spark, tmp_path, where):
    """Issue 15: a repair (a count fixed, a poisoned key deleted, a key bulk-loaded) committed
    while no query runs; the query resumes on the same checkpointLocation, its next batch builds
    on the repaired state and its outputs show it."""
    batches = key_batches(3, 40, 11)
    input_dir = tmp_path / "in"
    loc, cp = where(), str(tmp_path / "cp")
    write_batches(input_dir, batches[:2])
    run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc, checkpoint=cp)
    assert state_counts(loc) == counts(batches[:2])
    with IcebergStateTable.open_existing(warehouse=loc.warehouse, table_name=loc.table) as table, \
            Repair(table, reason="k0000 counted twice; k0001 is a bot") as repair:
        repair.put("count", pa.table({"key": ["k0000", "new"], "v_count": [{"n": 1000}, {"n": 5}]}))
        repair.delete_keys(pa.table({"key": ["k0001"]}))
        fixed = repair.commit()
    assert fixed.batch_id == 1
    write_batches(input_dir, batches)
    runner = run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc,
                        checkpoint=cp, output_table="out.counts")
    assert [r.batch_id for r in runner.reports] == [2]
    expected = counts(batches)
    late = counts(batches[2:])
    expected["k0000"] = 1000 + late.get("k0000", 0)
    expected.pop("k0001")
    if "k0001" in late:
        expected["k0001"] = late["k0001"]  # counted afresh after the delete
    expected["new"] = 5
    assert state_counts(loc) == expected
    emitted = {r["key"]: r["count"] for r in output_rows(loc, "out.counts").to_pylist()}
    assert emitted["k0000"] == expected["k0000"] and emitted.get("k0001") == late.get("k0001")


def test_a_state_table_out_of_step_with_its_query_refuses_to_run(spark, tmp_path, where):
    """Issue 14: the state table rolled back behind the batches Spark committed, or Spark's
    checkpoint rolled back behind the state, stops the query with a clear error instead of
    silently dropping or skipping batches' state."""
    batches = key_batches(5, 40, 11)
    input_dir, cp, loc = tmp_path / "in", tmp_path / "cp", where()
    write_batches(input_dir, batches[:1])
    run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc, checkpoint=str(cp))
    shutil.copytree(cp, tmp_path / "cp-after-batch-0")
    write_batches(input_dir, batches[:3])
    run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc, checkpoint=str(cp))
    assert state_counts(loc) == counts(batches[:3])

    # Ahead: Spark's checkpoint restored from the copy taken after batch 0; Spark runs batch 1.
    shutil.rmtree(cp)
    shutil.copytree(tmp_path / "cp-after-batch-0", cp)
    with pytest.raises(StateOutOfStepError, match=r"ahead of its query.*holds batch 2.*running batch 1"):
        run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc,
                   checkpoint=str(cp))
    assert state_counts(loc) == counts(batches[:3])

    # Behind: the table rolled back by hand to the checkpoint of batch 0 while Spark committed 0-2.
    shutil.rmtree(cp)
    run_cp = tmp_path / "cp-full"
    write_batches(input_dir, batches[:4])
    table = IcebergStateTable.open_existing(warehouse=loc.warehouse, table_name=loc.table)
    try:
        first = table.list_checkpoints()[0]
        table.iceberg_table.manage_snapshots().set_current_snapshot(snapshot_id=first.snapshot_id).commit()
    finally:
        table.close()
    fresh = where("fresh")
    run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=fresh,
               checkpoint=str(run_cp))  # batches 0-3 on a table of their own
    shutil.copytree(run_cp, cp)
    for marker in ("commits", "offsets"):  # Spark's log up to batch 2: batch 3 runs next
        for name in ("3", ".3.crc"):
            (cp / marker / name).unlink(missing_ok=True)
    (cp / "metadata").write_text((tmp_path / "cp-after-batch-0" / "metadata").read_text())
    with pytest.raises(StateOutOfStepError, match=r"behind its query.*batches 1 to 2 is missing"):
        run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc,
                   checkpoint=str(cp))


def test_failed_task_attempts_leave_no_duplicate_state(spark, tmp_path, where):
    batches = key_batches(2, 60, 13)
    input_dir = write_batches(tmp_path / "in", batches)
    clean = where("clean")
    run_to_end(spark, input_dir, ProfileProcessor(), PROFILE_OUTPUT, location=clean,
               checkpoint=str(tmp_path / "cp-clean"), output_table="out.clean")
    flag = Path(os.environ["ICESTATE_FAIL_FIRST_ATTEMPT"])
    flag.touch()
    try:
        # The same processor with coroutine handlers too: its failed attempts leave nothing either.
        for name, processor, api in (("failing", ProfileProcessor(), "row"),
                                     ("failing_async", AsyncProfileProcessor(), "async")):
            run_to_end(spark, input_dir, processor, PROFILE_OUTPUT, location=where(name),
                       checkpoint=str(tmp_path / f"cp-{name}"), output_table=f"out.{name}", api=api)
    finally:
        flag.unlink()
    key = lambda r: str(sorted(r.items()))  # noqa: E731
    for failing in ("failing", "failing_async"):
        for name in ("count", "recent", "totals"):
            got = live_state(where(failing), name).drop("expire_at_ms", "ord", strict=False).sort(pl.all())
            want = live_state(clean, name).drop("expire_at_ms", "ord", strict=False).sort(pl.all())
            assert got.equals(want), (failing, name)
        assert sorted(output_rows(where(failing), f"out.{failing}").to_pylist(), key=key) == \
            sorted(output_rows(clean, "out.clean").to_pylist(), key=key)


def test_rescale_at_restart_keeps_every_key(spark, tmp_path, where):
    batches = key_batches(4, 60, 29)
    input_dir = tmp_path / "in"
    cp = str(tmp_path / "cp")
    seen = []
    for parallelism, files in ((2, batches[:2]), (4, batches[2:3]), (1, batches[3:])):
        write_batches(input_dir, seen + files)
        seen += files
        loc = where(parallelism=parallelism)
        runner = run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc,
                            checkpoint=cp)
        assert state_counts(loc) == counts(seen)
        ran = {t for r in runner.reports for t in r.tasks}
        assert ran <= set(range(parallelism))
    table = IcebergStateTable.open_existing(warehouse=loc.warehouse, table_name=loc.table)
    try:
        assert [c.parallelism for c in table.list_checkpoints()] == [2, 2, 4, 1]
    finally:
        table.close()


def test_compaction_runs_beside_the_stream_in_its_own_process(spark, tmp_path, where):
    """Default-on compaction, with a policy that fires early: a compactor process compacts
    while the stream checkpoints (before and after a rescale 2 -> 3, so old segments span
    the new units); every batch commits, state and outputs are exact, and once the query
    stopped the compactor's last round leaves nothing its policy would merge."""
    from catalog.compaction import CompactionPolicy, compactions, needs_compaction, units

    batches = key_batches(8, 40, 37)
    input_dir, cp, seen = tmp_path / "in", str(tmp_path / "cp"), []
    policy = CompactionPolicy(min_segments=2)
    for parallelism, files in ((2, batches[:5]), (3, batches[5:])):
        write_batches(input_dir, seen + files)
        seen += files
        loc = where(parallelism=parallelism)
        runner = run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc,
                            checkpoint=cp, output_table="out.counts", compaction=policy)
        runner.compactor.close()  # wait for a compaction in flight
        assert runner.compactor.notified > 0
        assert state_counts(loc) == counts(seen)
    out = output_rows(loc, "out.counts")
    assert out.num_rows == sum(len(set(b["key"].to_pylist())) for b in batches)
    table = IcebergStateTable.open_existing(warehouse=loc.warehouse, table_name=loc.table)
    try:
        assert [c.batch_id for c in table.list_checkpoints()][-1] == 7
        assert compactions(table), "no compaction committed"
        assert not needs_compaction(table, policy)  # the compactor's last round saw the last checkpoint
        assert max(len(table.segments(u)) for u in units(table)) < 8  # 8 without compaction
    finally:
        table.close()


def test_a_new_query_on_a_fork_starts_from_the_forked_state_and_leaves_main_alone(spark, tmp_path, where):
    """Fork the state of a running stream at a checkpoint; a new version of the job (its own
    checkpointLocation, another parallelism) runs on the fork while main goes on."""
    first, on_fork, on_main = key_batches(2, 40, 13), key_batches(2, 30, 13, offset=80), key_batches(1, 20, 13, 140)
    main_in = tmp_path / "in-main"
    write_batches(main_in, first)
    run_to_end(spark, str(main_in), CountProcessor(), "key string, count long", location=where(),
               checkpoint=str(tmp_path / "cp-main"))
    table = IcebergStateTable.open_existing(warehouse=where().warehouse, table_name="state")
    try:
        forked = table.fork("v2")
    finally:
        table.close()
    fork = where(parallelism=3, branch="v2")
    runner = run_to_end(spark, write_batches(tmp_path / "in-fork", on_fork), CountProcessor(),
                        "key string, count long", location=fork, checkpoint=str(tmp_path / "cp-fork"))
    assert [r.skipped for r in runner.reports] == [False, False]  # batch ids 0, 1 of a new query: not replays
    write_batches(main_in, first + on_main)
    run_to_end(spark, str(main_in), CountProcessor(), "key string, count long", location=where(),
               checkpoint=str(tmp_path / "cp-main"))
    assert state_counts(fork) == counts(first + on_fork)
    assert state_counts(where()) == counts(first + on_main)
    table = IcebergStateTable.open_existing(warehouse=where().warehouse, table_name="state", branch="v2")
    try:
        line = table.list_checkpoints()
        assert [c.checkpoint_id for c in line] == [1, 2, 3, 4] and line[1].snapshot_id == forked.snapshot_id
        assert [c.parallelism for c in line] == [2, 2, 3, 3]
    finally:
        table.close()


def test_ttl_expires_state_between_batches(spark, tmp_path, where):
    batches = key_batches(3, 40, 7)
    input_dir = write_batches(tmp_path / "in", batches)
    short, collect = collector()
    run_to_end(spark, input_dir, TtlCountProcessor(1), "key string, count long", location=where("short"),
               checkpoint=str(tmp_path / "cp-short"), foreach_batch=collect, time_mode="ProcessingTime")
    per_batch = {(b, k): n for b, t in enumerate(batches) for k, n in Counter(t["key"].to_pylist()).items()}
    assert {(b, k): n for b, k, n in short} == per_batch
    long_rows, collect = collector()
    run_to_end(spark, input_dir, TtlCountProcessor(3_600_000), "key string, count long", location=where("long"),
               checkpoint=str(tmp_path / "cp-long"), foreach_batch=collect, time_mode="ProcessingTime")
    with pytest.raises(ValueError, match=r"declares a TTL.*needs time_mode='ProcessingTime'"):
        run_to_end(spark, input_dir, TtlCountProcessor(5), "key string, count long", location=where("none"),
                   checkpoint=str(tmp_path / "cp-none"))
    assert {k: n for b, k, n in long_rows if b == 2} == {k: counts(batches)[k] for k in per_batch_keys(batches[2])}


def per_batch_keys(t: pa.Table) -> set:
    return set(t["key"].to_pylist())


def test_initial_state_seeds_the_first_batch(spark, tmp_path, where):
    batches = key_batches(2, 30, 6)
    input_dir = write_batches(tmp_path / "in", batches)
    seed = {"k0000": 100, "k0001": 200, "zzz": 5}
    initial = spark.createDataFrame(list(seed.items()), "key string, n long")
    loc = where("compat")
    run_to_end(spark, input_dir, InitialCountProcessor(), "key string, count long", location=loc,
               checkpoint=str(tmp_path / "cp"), initial_state=initial)
    expected = defaultdict(int, seed)
    for k, n in counts(batches).items():
        expected[k] += n
    assert state_counts(loc) == dict(expected)
    vec = where("vec")
    initial = spark.createDataFrame(list(seed.items()), "key string, count long")
    run_to_end(spark, input_dir, RunningAggregate("count"), None, location=vec, checkpoint=str(tmp_path / "cp-v"),
               initial_state=initial)
    live = live_state(vec, "count")
    assert dict(zip(live["key"].to_list(), live["v_count"].to_list(), strict=True)) == dict(expected)


def test_foreach_batch_gets_each_batch_output_once(spark, tmp_path, where):
    batches = key_batches(3, 20, 5)
    seen: dict[int, int] = {}
    loc = where()

    def callback(df, batch_id):
        assert batch_id not in seen
        seen[batch_id] = df.count()
    run_to_end(spark, write_batches(tmp_path / "in", batches), CountProcessor(), "key string, count long",
               location=loc, checkpoint=str(tmp_path / "cp"), foreach_batch=callback)
    assert seen == {b: len(set(t["key"].to_pylist())) for b, t in enumerate(batches)}
    staging = Path(loc.warehouse) / "state" / "state" / "outputs"
    assert not any(p.is_file() for p in staging.rglob("*")) if staging.exists() else True


@pytest.mark.parametrize("use", ["ignore", "twice", "limit"])
def test_callback_reading_its_dataframe_any_way_commits_state_once(spark, tmp_path, where, use):
    """The callback's DataFrame is the tasks' output: its action runs the tasks. A callback that
    never reads it, reads it twice (each read runs the tasks again) or reads only part of it
    still commits each batch's state exactly once."""
    batches = key_batches(3, 40, 9)
    seen: dict[int, list] = defaultdict(list)

    def callback(df, batch_id):
        if use == "twice":
            seen[batch_id].append(sorted(tuple(r) for r in df.collect()))
            seen[batch_id].append(sorted(tuple(r) for r in df.collect()))
        elif use == "limit":
            seen[batch_id].append(df.limit(1).collect())
    loc = where(parallelism=3)
    runner = run_to_end(spark, write_batches(tmp_path / "in", batches), CountProcessor(), "key string, count long",
                        location=loc, checkpoint=str(tmp_path / "cp"), foreach_batch=callback)
    assert state_counts(loc) == counts(batches)
    reports = [r for r in runner.reports if not r.skipped]
    assert [sorted(r.tasks) for r in reports] == [[0, 1, 2]] * 3
    if use == "twice":
        totals: Counter = Counter()
        for b, batch in enumerate(batches):
            first, second = seen[b]
            assert first == second  # both runs of the tasks emit the same rows
            totals.update(batch["key"].to_pylist())
            assert dict(first) == {k: totals[k] for k in set(batch["key"].to_pylist())}


def test_routing_values_match_spark_hash_partitioning(spark):
    """Task i's rows carry a value that Spark's hash partitioning sends to partition i: the
    values are computed in Python, so they must agree with Spark's own murmur3."""
    from spark_integration.query import _murmur3_int, partition_values

    ints = [0, 1, -1, 7, 42, 2**31 - 1, -(2**31), 123456789]
    got = spark.createDataFrame([(v,) for v in ints], "v int").select(F.hash("v").alias("h")).collect()
    assert [r.h for r in got] == [_murmur3_int(v) for v in ints]
    for p in range(1, 17):
        values = partition_values(p)
        df = spark.createDataFrame([(v,) for v in values], "v int").repartition(p, "v")
        placed = df.select("v", F.spark_partition_id().alias("part")).collect()
        assert {r.v: r.part for r in placed} == {v: i for i, v in enumerate(values)}


# ---------------------------------------------------------------------------------- bad input


def test_missing_key_column_fails_before_any_state(spark, tmp_path, where):
    df = stream(spark, write_batches(tmp_path / "in", key_batches(1, 5, 3)))
    with pytest.raises(SchemaMismatchError, match="nokey"):
        from spark_integration import start_stateful_query

        start_stateful_query(df, ["nokey"], CountProcessor(), "key string, count long", location=where(),
                             checkpoint_location=str(tmp_path / "cp"))
    assert not (tmp_path / "wh").exists() or not any((tmp_path / "wh").rglob("*.parquet"))


def test_an_api_that_does_not_fit_the_processors_handlers_fails_before_any_state(spark, tmp_path, where):
    from spark_integration import start_stateful_query
    from tests.integration.streaming_helpers import AsyncCountProcessor

    df = stream(spark, write_batches(tmp_path / "in", key_batches(1, 5, 3)))
    common = {"location": where(), "checkpoint_location": str(tmp_path / "cp")}
    with pytest.raises(TypeError, match=r"api='async' needs a processor whose handleInputRows is 'async def'"):
        start_stateful_query(df, ["key"], CountProcessor(), "key string, count long", api="async", **common)
    with pytest.raises(TypeError, match=r"AsyncCountProcessor.handleInputRows is 'async def': start it with "
                                        r"api='async'"):
        start_stateful_query(df, ["key"], AsyncCountProcessor(), "key string, count long", **common)
    with pytest.raises(ValueError, match=r"api must be 'row' .* 'async' or 'async_pandas'"):
        start_stateful_query(df, ["key"], AsyncCountProcessor(), "key string, count long", api="asyncio", **common)
    assert not (tmp_path / "wh").exists() or not any((tmp_path / "wh").rglob("*.parquet"))


def test_unsupported_key_type_fails_before_any_state(spark, tmp_path, where):
    from spark_integration import start_stateful_query

    df = stream(spark, write_batches(tmp_path / "in", key_batches(1, 5, 3))).withColumn("tags", F.array("key"))
    with pytest.raises(UnsupportedKeyTypeError, match="tags"):
        start_stateful_query(df, ["tags"], CountProcessor(), "key string, count long", location=where(),
                             checkpoint_location=str(tmp_path / "cp"))


def test_state_table_of_another_key_schema_is_refused(spark, tmp_path, where):
    from spark_integration import start_stateful_query

    batches = key_batches(1, 10, 3)
    loc = where()
    run_to_end(spark, write_batches(tmp_path / "in", batches), CountProcessor(), "key string, count long",
               location=loc, checkpoint=str(tmp_path / "cp"))
    df = stream(spark, str(tmp_path / "in")).withColumn("key", F.col("v"))
    with pytest.raises(StateTableMismatchError):
        start_stateful_query(df, ["key"], CountProcessor(), "key long, count long", location=loc,
                             checkpoint_location=str(tmp_path / "cp2"))
    assert state_counts(loc) == counts(batches)


def test_output_not_matching_the_schema_fails_the_batch_and_keeps_state(spark, tmp_path, where):
    batches = key_batches(2, 10, 3)
    input_dir = tmp_path / "in"
    write_batches(input_dir, batches[:1])
    loc = where()
    cp = str(tmp_path / "cp")
    run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc, checkpoint=cp)
    write_batches(input_dir, batches)
    with pytest.raises(TypeError, match=r"^processor output: column 'count' does not match") as failed:
        run_to_end(spark, str(input_dir), BadOutputProcessor(), "key string, count long", location=loc,
                   checkpoint=cp)
    # The processor's own error, Spark's wrapping of the task's failure chained as its cause.
    assert type(failed.value.__cause__).__name__ == "StreamingQueryException"
    assert state_counts(loc) == counts(batches[:1])
    run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=loc, checkpoint=cp)
    assert state_counts(loc) == counts(batches)


def test_a_processor_exception_surfaces_as_itself_with_where_it_was_raised(spark, tmp_path, where):
    batches = key_batches(2, 12, 4)
    loc, cp = where(), str(tmp_path / "cp")
    input_dir = write_batches(tmp_path / "in", batches)
    with pytest.raises(KeyError, match="no profile for k0001") as failed:
        run_to_end(spark, input_dir, FailingProcessor("k0001"), "key string, count long", location=loc,
                   checkpoint=cp)
    notes = failed.value.__notes__
    assert notes[0] == "raised by FailingProcessor.handleInputRows for key ('k0001',)"
    assert type(failed.value.__cause__).__name__ == "StreamingQueryException"
    assert "(in batch 0, task" in str(failed.value.__cause__)
    with pytest.raises(KeyError):
        raise failed.value
    table = IcebergStateTable.open_existing(warehouse=loc.warehouse, table_name=loc.table)
    try:
        assert table.current_checkpoint() is None  # nothing committed
    finally:
        table.close()


def test_a_hostile_input_value_in_a_processor_message_runs_no_code_on_the_driver(spark, tmp_path, where):
    """A processor that quotes its input in its exception (``raise KeyError(f"no profile for
    {key}")``) with an input value shaped like the exception envelope, in each forged form: the
    driver loads none of them (their pickle would create ``marker``) and the processor's own
    exception still comes out as itself."""
    marker = tmp_path / "pwned"
    hostile = " ".join(forged_envelopes(marker))
    input_dir = write_batches(tmp_path / "in", [pa.table({"key": ["a", hostile, "b"], "v": [1, 2, 3]})])
    with pytest.raises(KeyError) as failed:
        run_to_end(spark, input_dir, FailingProcessor(hostile), "key string, count long", location=where(),
                   checkpoint=str(tmp_path / "cp"))
    assert not marker.exists()
    assert failed.value.args == (f"no profile for {hostile}",)
    assert type(failed.value.__cause__).__name__ == "StreamingQueryException"


def test_a_runner_keeps_as_many_batch_reports_as_spark_keeps_progress_updates(spark, tmp_path, where):
    """The runner's reports are bounded as Spark bounds a query's recent progress
    (``spark.sql.streaming.numRecentProgressUpdates``, 100 by default): the newest stay."""
    input_dir = write_batches(tmp_path / "in", key_batches(3, 12, 4))
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "2")
    try:
        runner = run_to_end(spark, input_dir, CountProcessor(), "key string, count long", location=where(),
                            checkpoint=str(tmp_path / "cp"))
    finally:
        spark.conf.unset("spark.sql.streaming.numRecentProgressUpdates")
    assert [r.batch_id for r in runner.reports] == [1, 2]


class ProgressListener(StreamingQueryListener):
    """The progress events of the queries started after it was added, as a listener of Spark's
    gets them. The bus delivers asynchronously, so a late event of a query stopped before the
    listener was added can still arrive: it is left out by the query's id."""

    def __init__(self) -> None:
        self.started: set[str] = set()
        self.progress: list = []

    def onQueryStarted(self, event) -> None:
        self.started.add(str(event.id))

    def onQueryProgress(self, event) -> None:
        if str(event.progress.id) in self.started:
            self.progress.append(event.progress)

    def onQueryIdle(self, event) -> None:
        pass

    def onQueryTerminated(self, event) -> None:
        pass


def test_the_ticks_source_reads_as_an_empty_batch_beside_a_query(spark, tmp_path, where):
    """The ticks source is read once as a batch beside the workers' warm-up (it starts Spark's
    planners of the source): that read has no row, and the query runs its batches as before."""
    from spark_integration.ticks import FORMAT, OPTION_BEACON

    batches = key_batches(2, 30, 7)
    query = start_stateful_query(stream(spark, write_batches(tmp_path / "in", batches)), ["key"], CountProcessor(),
                                 "key string, count long", location=where(), checkpoint_location=str(tmp_path / "cp"),
                                 trigger={"availableNow": True}, foreach_batch=lambda df, b: df.count(),
                                 progress_figures=True)
    try:
        runner = runner_of(query)
        assert spark.read.format(FORMAT).option(OPTION_BEACON, runner.beacon).load().count() == 0
        query.awaitTermination(300)
        assert query.exception() is None
    finally:
        query.stop()
    assert [r.batch_id for r in runner.reports if not r.skipped] == [0, 1]


def _source_descriptions(query) -> list[list[str]]:
    return [[source["description"] for source in progress["sources"]] for progress in query.recentProgress]


def test_a_query_without_timers_runs_on_its_input_alone(spark, tmp_path, where):
    """Without timers and without ``progress_figures``, the query has no Python data source
    (whose processes Spark would start one after another before its first batch): its progress
    lists the input's source alone, no beacon is written, and its state is the input's tally."""
    from spark_integration.ticks import beacon_path

    batches = key_batches(3, 30, 7)
    location = where()
    checkpoint = str(tmp_path / "cp")
    query = start_stateful_query(stream(spark, write_batches(tmp_path / "in", batches)), ["key"], CountProcessor(),
                                 "key string, count long", location=location, checkpoint_location=checkpoint,
                                 trigger={"availableNow": True}, foreach_batch=lambda df, b: df.count())
    try:
        query.awaitTermination(300)
        assert query.exception() is None
    finally:
        query.stop()
    runner = runner_of(query)
    assert runner.beacon is None and not os.path.exists(beacon_path(checkpoint, location.identity))
    described = _source_descriptions(query)
    assert len(described) == 3 and all(len(d) == 1 and "FileStreamSource" in d[0] for d in described), described
    assert state_counts(location) == counts(batches)


def test_a_checkpoint_keeps_the_sources_it_was_started_with(spark, tmp_path, where):
    """Spark refuses a checkpoint whose sources changed. A query started with the ticks source
    keeps it when restarted without asking (and its progress goes on showing the figures); one
    started without it cannot gain it: asking for the figures then is refused, with what to do,
    before anything runs, and the query restarts as it was started."""
    batches = key_batches(4, 30, 7)
    inputs = {name: tmp_path / f"in-{name}" for name in ("with", "without")}
    for name in inputs:
        write_batches(inputs[name], batches[:2])
    for name, figures in (("with", True), ("without", False)):
        run_to_end(spark, str(inputs[name]), CountProcessor(), "key string, count long", location=where(name),
                   checkpoint=str(tmp_path / f"cp-{name}"), progress_figures=figures)
        write_batches(inputs[name], batches)  # two more files

    with_ticks = start_stateful_query(stream(spark, str(inputs["with"])), ["key"], CountProcessor(),
                                      "key string, count long", location=where("with"),
                                      checkpoint_location=str(tmp_path / "cp-with"), trigger={"availableNow": True})
    try:
        with_ticks.awaitTermination(300)
        assert with_ticks.exception() is None
    finally:
        with_ticks.stop()
    assert [len(d) for d in _source_descriptions(with_ticks)] == [2, 2]
    assert json.loads(with_ticks.recentProgress[-1]["sources"][1]["latestOffset"])["icestate"]["batchId"] == 2

    before = IcebergStateTable.open_existing(warehouse=where("without").warehouse, table_name="without")
    try:
        newest = before.current_checkpoint().checkpoint_id
    finally:
        before.close()
    with pytest.raises(QuerySourcesMismatchError, match="new checkpointLocation"):
        start_stateful_query(stream(spark, str(inputs["without"])), ["key"], CountProcessor(), "key string, count long",
                             location=where("without"), checkpoint_location=str(tmp_path / "cp-without"),
                             trigger={"availableNow": True}, progress_figures=True)
    assert not spark.streams.active
    runner = run_to_end(spark, str(inputs["without"]), CountProcessor(), "key string, count long",
                        location=where("without"), checkpoint=str(tmp_path / "cp-without"))
    assert [r.checkpoint_id for r in runner.reports if not r.skipped] == [newest + 1, newest + 2]
    assert state_counts(where("without")) == counts(batches)


def test_state_figures_reach_a_streaming_query_listener(spark, tmp_path, where):
    """The state figures of the last committed batch are in every progress event, under the
    ticks source's ``latestOffset``; they agree with the runner's reports."""
    batches = key_batches(4, 30, 7)
    listener = ProgressListener()
    spark.streams.addListener(listener)
    try:
        runner = run_to_end(spark, write_batches(tmp_path / "in", batches), CountProcessor(), "key string, count long",
                            location=where(), checkpoint=str(tmp_path / "cp"), foreach_batch=lambda df, b: df.count(),
                            progress_figures=True)
        deadline = time.monotonic() + 30
        while len(listener.progress) < len(batches) and time.monotonic() < deadline:
            time.sleep(0.2)  # the listener bus delivers asynchronously
    finally:
        spark.streams.removeListener(listener)
    seen = {}
    for progress in listener.progress:
        for source in progress.sources:
            try:
                offset = json.loads(source.latestOffset)
            except (TypeError, ValueError):
                continue  # the file source's: None
            if isinstance(offset, dict) and offset.get("icestate"):
                seen[offset["icestate"]["batchId"]] = (progress.batchId, offset["icestate"])
    states = {r.batch_id: r.state for r in runner.reports if not r.skipped}
    # Spark asks a source when it plans a batch: batch n's progress holds batch n-1's figures.
    assert {b: p for b, (p, _) in seen.items()} == {b: b + 1 for b in range(len(batches) - 1)}
    assert {b: figures for b, (_, figures) in seen.items()} == {b: states[b] for b in seen}
    first = states[0]
    assert first["numRowsUpdated"] == len(set(batches[0]["key"].to_pylist()))
    assert first["numEntriesTotal"] == first["numRowsUpdated"] and first["stateBytes"] > 0
    assert first["segmentsWritten"] >= 1 and first["commitTimeMs"] >= 0 and first["numTasks"] == 2
    assert states[3]["numEntriesTotal"] == sum(s["numRowsUpdated"] for s in states.values())
    # Spark's live rows: one per key of the value state, however many entries it took
    keys = [len(set(pa.concat_tables(batches[:b + 1])["key"].to_pylist())) for b in range(4)]
    assert [states[b]["numRowsTotal"] for b in range(4)] == keys
    assert states[3]["numEntriesTotal"] > keys[3]  # entries: every batch's put of a key, until compaction
    table = IcebergStateTable.open_existing(warehouse=where().warehouse, table_name=where().table)
    try:
        assert inspection.checkpoints(table).column("live_rows").to_pylist()[-1] == keys[3]
    finally:
        table.close()
