"""The executor side of a micro-batch (``spark_integration.tasks``) without Spark.

A test driver does what ``StatefulRunner.__call__`` does around Spark: it builds each
batch's ``BatchPlan`` (base checkpoint, next checkpoint id, the committed token of every
task), calls ``tasks.run_task`` once per task that has rows (the rows carry the routing
columns Spark adds), commits the returned segments on its own ``IcebergStateTable`` and
records each task's token. Python workers are simulated by swapping ``tasks._STORES``
(the per-worker store registry) between separate dicts. State is checked against a
model through a fresh store and through SQL over the Iceberg table.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor

from catalog import IcebergStateTable
from catalog.sql import connect
from spark_integration import tasks
from spark_integration.compat import declare
from spark_integration.location import StateLocation
from spark_integration.tasks import HEARTBEAT, KG, PART, TASK, BatchPlan
from spark_integration.timers import timers_descriptor
from spark_integration.vectorized import RunningAggregate
from statestore import StateLayout, StateStore, StoreConfig
from tests.spark_integration.si_helpers import VALUE, keys_of_task, routed, split_by_task

N = 16  # max parallelism
P = 2  # parallelism of the run
INPUT = pa.schema([("k", pa.string()), ("v", pa.int64())])
KEY_SCHEMA = pa.schema([("k", pa.string())])
COUNT_OUT = pa.schema([("k", pa.string()), ("count", pa.int64())])
KEYS = {t: keys_of_task(t, P, 3, prefix=f"t{t}-", max_parallelism=N) for t in range(P)}


# ---------------------------------------------------------------------------- the simulated driver

class Driver:
    """The driver's part of ``StatefulRunner``: plans, commits, records the task tokens."""

    def __init__(self, location: StateLocation, processor: Any, *, run_id: str = "run-1",
                 time_mode: str = "none", output_dir: str | None = None, output_schema: pa.Schema = COUNT_OUT,
                 input_schema: pa.Schema = INPUT, event_time_column: str | None = None,
                 store_config: StoreConfig | None = None):
        self.location = location
        self.store_config = store_config or StoreConfig()
        self.input_schema = input_schema
        self.event_time_column = event_time_column
        self.processor = processor
        if isinstance(processor, StatefulProcessor):
            descriptors = list(declare(processor).descriptors)
        else:
            descriptors = list(processor.state_variables(input_schema, ["k"]))
        if time_mode != "none":
            descriptors.append(timers_descriptor())
        self.layout = StateLayout.of(KEY_SCHEMA, descriptors, location.max_parallelism)
        self.run_id = run_id
        self.time_mode = time_mode
        self.output_dir = output_dir
        self.output_schema = output_schema
        self.table = location.open(self.layout)
        info = self.table.current_checkpoint()
        self.batch_id = 0 if info is None else info.batch_id + 1
        self.tokens: dict[int, tuple[int, str]] = {}
        self.history: dict[int, tuple[tuple[int, str], ...]] = {}

    def plan(self, processing_time_ms: int = 0, watermark_ms: int = -1, late_watermark_ms: int | None = None,
             ) -> BatchPlan:
        info = self.table.current_checkpoint()
        return BatchPlan(
            run_id=self.run_id, table=self.location.identity, parallelism=self.location.parallelism,
            view=self.table.checkpoint_view(), layout=self.layout, processor=self.processor,
            input_columns=tuple(self.input_schema.names), output_schema=self.output_schema, batch_id=self.batch_id,
            checkpoint_id=self.table.next_checkpoint_id(),
            base_checkpoint_id=None if info is None else info.checkpoint_id,
            task_tokens=dict(self.tokens), task_history=dict(self.history), processing_time_ms=processing_time_ms,
            watermark_ms=watermark_ms,
            late_watermark_ms=watermark_ms if late_watermark_ms is None else late_watermark_ms,
            time_mode=self.time_mode, event_time_column=self.event_time_column,
            output_dir=self.output_dir, store_config=self.store_config,
        )

    def commit(self, plan: BatchPlan, results: list[pa.Table]) -> dict[int, dict]:
        stats: dict[int, dict] = {}
        segments, self.last_outputs = [], []
        for row in pa.concat_tables(results).to_pylist() if results else []:
            task, kind, payload = row[tasks.R_TASK], row[tasks.R_KIND], row[tasks.R_PAYLOAD]
            if kind == "task":
                assert task not in stats, "a task reported twice"
                stats[task] = json.loads(payload)
            elif kind == "segment":
                segments.append(tasks.segment_of(payload))
            else:
                assert kind == "output"
                self.last_outputs.append(json.loads(payload))
        self.table.commit_checkpoint(plan.checkpoint_id, segments, parallelism=self.location.parallelism,
                                     batch_id=plan.batch_id)
        for task, s in stats.items():
            self.tokens[task] = token = (plan.checkpoint_id, s["token"])
            self.history[task] = (*self.history.get(task, ())[1 - tasks.TOKENS_KEPT:], token)
        self.batch_id += 1
        return stats


class Workers:
    """Python workers: each has its own ``tasks._STORES``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int):
        self._mp = monkeypatch
        self.stores: list[dict] = [{} for _ in range(count)]

    def use(self, worker: int) -> dict:
        self._mp.setattr(tasks, "_STORES", self.stores[worker])
        self._mp.setattr(tasks, "_HOLDER", f"worker{worker}")  # as the host's task claims name it
        return self.stores[worker]

    def run(self, worker: int, plan: BatchPlan, task: int, rows: pa.Table) -> pa.Table:
        self.use(worker)
        return tasks.run_task(plan, (task,), rows)

    def close(self) -> None:
        for worker in range(len(self.stores)):
            self.use(worker)
            for key in list(self.stores[worker]):
                tasks._drop(key)


@pytest.fixture
def workers(monkeypatch) -> Iterator[Workers]:
    w = Workers(monkeypatch, 2)
    yield w
    w.close()


@pytest.fixture
def drivers() -> Iterator[Callable[..., Driver]]:
    made: list[Driver] = []

    def make(*args, **kwargs) -> Driver:
        d = Driver(*args, **kwargs)
        made.append(d)
        return d

    yield make
    for d in made:
        d.table.close()


@pytest.fixture
def location(tmp_path: Path) -> StateLocation:
    return StateLocation(table="op", warehouse=str(tmp_path / "warehouse"), parallelism=P, max_parallelism=N)


def input_rows(keys: list[str], values: list[int] | None = None) -> pa.Table:
    values = values if values is not None else [1] * len(keys)
    return routed({"k": keys, "v": values}, parallelism=P, max_parallelism=N, schema=INPUT)


def run_batch(driver: Driver, workers: Workers, keys: list[str], worker_of: Callable[[int], int] = lambda t: 0,
              processing_time_ms: int = 0) -> dict[int, dict]:
    plan = driver.plan(processing_time_ms)
    results = [workers.run(worker_of(task), plan, task, rows)
               for task, rows in split_by_task(input_rows(keys)).items()]
    return driver.commit(plan, results)


def outputs(driver: Driver) -> list[dict]:
    rows = []
    for out in driver.last_outputs:
        table = pq.read_table(out["uri"])
        assert table.num_rows == out["rows"]
        rows += table.to_pylist()
    return sorted(rows, key=lambda r: r["k"])


def state_counts(location: StateLocation, layout: StateLayout, keys: list[str]) -> list:
    """Counts from a fresh single-task store over the newest checkpoint."""
    table = location.open(layout)
    try:
        store = StateStore(table, parallelism=1)
        values = store.get_state("count").get_batch(pa.table({"k": keys})).to_pylist()
        store.close()
    finally:
        table.close()
    return [v["n"] if isinstance(v, dict) else v for v in values]


def sql_counts(location: StateLocation) -> dict[str, int]:
    """Counts read back with SQL over the Iceberg table (layout recorded in the table)."""
    table = IcebergStateTable.open_existing(warehouse=location.warehouse, table_name=location.table)
    try:
        con = connect(table)
        rows = con.sql("SELECT k, v_count FROM state_count").fetchall()
        con.close()
    finally:
        table.close()
    return {k: v["n"] if isinstance(v, dict) else v for k, v in rows}


def all_keys() -> list[str]:
    return KEYS[0] + KEYS[1]


# ---------------------------------------------------------------------------- (a) workers alternate

def test_a_task_alternating_between_workers_keeps_exact_state(location, workers, drivers, tmp_path):
    driver = drivers(location, RunningAggregate("count"), output_dir=str(tmp_path / "out"))
    model: Counter[str] = Counter()
    batches = [all_keys(), KEYS[0][:2] + KEYS[1][:1] * 2, all_keys() * 2, [KEYS[0][2], KEYS[1][2]], all_keys()]
    for b, keys in enumerate(batches):
        stats = run_batch(driver, workers, keys, worker_of=lambda t, b=b: (b + t) % 2)
        model.update(keys)
        assert outputs(driver) == sorted(({"k": k, "count": model[k]} for k in set(keys)), key=lambda r: r["k"])
        assert {t: s["rows_in"] for t, s in stats.items()} == Counter(tasks_of(keys))
        assert all(s["checkpoint_id"] == b + 1 and s["segments"] >= 1 for s in stats.values())
    assert state_counts(location, driver.layout, all_keys()) == [model[k] for k in all_keys()]
    assert sql_counts(location) == dict(model)


def tasks_of(keys: list[str]) -> list[int]:
    return [0 if k in KEYS[0] else 1 for k in keys]


def test_a_task_staying_in_its_worker_keeps_its_store_and_cache(location, workers, drivers):
    driver = drivers(location, RunningAggregate("count"))
    run_batch(driver, workers, all_keys(), worker_of=lambda t: 0)
    stats = run_batch(driver, workers, all_keys(), worker_of=lambda t: 1)  # a fresh worker reads the segments
    assert all(s["bytes_read"] > 0 and s["files_opened"] > 0 for s in stats.values())
    kept = dict(workers.use(1))
    assert set(kept) == {("run-1", 0), ("run-1", 1)}
    for _ in range(2):
        stats = run_batch(driver, workers, all_keys(), worker_of=lambda t: 1)
        assert {k: id(v) for k, v in workers.use(1).items()} == {k: id(v) for k, v in kept.items()}
        assert all(s["bytes_read"] == 0 and s["files_opened"] == 0 for s in stats.values())  # served from cache
    assert state_counts(location, driver.layout, all_keys()) == [4] * 6


def test_a_task_in_a_fresh_worker_maps_the_views_another_worker_committed(location, drivers, monkeypatch):
    """One copy of the state per host: a store's first commit writes its views to the host's
    shared views, and a worker that never ran the task maps them and reads only the segments
    committed since (not the task's whole state); a third worker too, and the state stays exact."""
    workers = Workers(monkeypatch, 3)
    try:
        driver = drivers(location, RunningAggregate("count"))
        stats = [run_batch(driver, workers, all_keys(), worker_of=lambda t: 0) for _ in range(3)]
        assert all(s["views_published"] > 0 for s in stats[1].values()), stats  # the first commit, at the second
        stats = run_batch(driver, workers, all_keys(), worker_of=lambda t: 1)
        assert all(s["views_mapped"] > 0 and s["files_opened"] == 2 for s in stats.values()), stats
        stats = run_batch(driver, workers, all_keys(), worker_of=lambda t: 2)
        assert all(s["views_mapped"] > 0 and s["files_opened"] == 3 for s in stats.values()), stats
        assert set(workers.use(0)) == {("run-1", 0), ("run-1", 1)}
        stats = run_batch(driver, workers, all_keys(), worker_of=lambda t: 0)
        # back: worker 0 dropped its stores once their tasks ran elsewhere (the host's views make
        # them unneeded, and what they held of their own is freed); the tasks map again
        assert all(s["views_mapped"] > 0 and s["files_opened"] <= 4 for s in stats.values()), stats
        assert state_counts(location, driver.layout, all_keys()) == [6] * 6
        assert sql_counts(location) == dict.fromkeys(all_keys(), 6)
    finally:
        workers.close()


def test_a_worker_closes_a_store_once_another_worker_of_the_host_runs_its_task(location, workers, drivers):
    """With the host's shared views, a worker that ends a task closes its stores of the run's
    other tasks that another worker has claimed for the batch (their own bytes are a second
    copy, and the task maps the host's views wherever it comes back); a store whose task has not
    started elsewhere stays, as it may be the worker's next task."""
    driver = drivers(location, RunningAggregate("count"))

    def batch(order: list[tuple[int, int]]) -> dict[int, dict]:
        plan, rows = driver.plan(), split_by_task(input_rows(all_keys()))
        results = {task: workers.run(worker, plan, task, rows[task]) for worker, task in order}
        return driver.commit(plan, list(results.values()))

    batch([(0, 0), (0, 1)])
    batch([(0, 0), (0, 1)])  # commits the first: the views are the host's
    stats = batch([(0, 1), (0, 0)])  # task 0 has not started elsewhere: kept, reused
    assert stats[0]["views_mapped"] == 0 and stats[0]["files_opened"] == 0, stats
    assert set(workers.use(0)) == {("run-1", 0), ("run-1", 1)}
    stats = batch([(1, 0), (0, 1)])  # task 0 claimed by worker 1 before task 1 ends in worker 0
    assert set(workers.use(0)) == {("run-1", 1)} and set(workers.use(1)) == {("run-1", 0)}
    stats = batch([(0, 0), (0, 1)])  # back in worker 0: maps the host's views
    assert stats[0]["views_mapped"] > 0 and stats[1]["views_mapped"] == 0, stats
    assert state_counts(location, driver.layout, all_keys()) == [5] * 6
    assert sql_counts(location) == dict.fromkeys(all_keys(), 5)


def test_a_store_completing_an_older_flush_after_a_compaction_shares_no_views_behind_the_table(location, drivers,
                                                                                               monkeypatch):
    """A worker whose store's last flush was committed, but is not its task's newest (the task
    ran in another worker since), completes it with the table already further: its views then
    hold the older checkpoint, and must not be written to the host's shared views as the newer
    one. With a compaction since, the store cannot catch up and restores, mapping what the host
    has: a snapshot labelled with the wrong checkpoint would lose the other worker's batch."""
    from catalog.compaction import compact

    workers = Workers(monkeypatch, 3)
    try:
        driver = drivers(location, RunningAggregate("count"))
        run_batch(driver, workers, all_keys(), worker_of=lambda t: 0)
        run_batch(driver, workers, all_keys(), worker_of=lambda t: 0)  # commits the first: published there
        run_batch(driver, workers, all_keys(), worker_of=lambda t: 1)
        with location.open(driver.layout) as table:
            assert compact(table) is not None
        driver.table.restore()  # the driver sees the compaction, as a stream's next plan does
        run_batch(driver, workers, all_keys(), worker_of=lambda t: 0)
        run_batch(driver, workers, all_keys(), worker_of=lambda t: 2)  # a fresh worker maps the host's views
        assert state_counts(location, driver.layout, all_keys()) == [5] * 6
        assert sql_counts(location) == dict.fromkeys(all_keys(), 5)
    finally:
        workers.close()


def test_a_task_back_in_a_worker_reads_only_the_segments_written_since(location, workers, drivers):
    """Spark gives a task to any idle worker: a store whose task ran elsewhere meanwhile
    catches up from the checkpoint it holds, reading only the segments its task wrote since
    (one per checkpoint), instead of its whole state again (without the host's shared views:
    with them such a store is dropped and its task maps them again)."""
    driver = drivers(location, RunningAggregate("count"), store_config=StoreConfig(host_views=False))
    run_batch(driver, workers, all_keys(), worker_of=lambda t: 0)
    run_batch(driver, workers, all_keys(), worker_of=lambda t: 1)
    stores = [dict(workers.use(w)) for w in (0, 1)]
    for b in range(4):
        stats = run_batch(driver, workers, all_keys(), worker_of=lambda t, b=b: b % 2)
        assert {k: id(v) for k, v in workers.use(b % 2).items()} == {k: id(v) for k, v in stores[b % 2].items()}
        assert all(s["files_opened"] == 1 for s in stats.values()), stats  # the other worker's last segment
    stats = run_batch(driver, workers, all_keys(), worker_of=lambda t: 1)  # staying: nothing read
    assert all(s["files_opened"] == 0 for s in stats.values())
    assert state_counts(location, driver.layout, all_keys()) == [7] * 6
    assert sql_counts(location) == dict.fromkeys(all_keys(), 7)


# ---------------------------------------------------------------------------- (b) retried attempts

@pytest.mark.parametrize("retry_worker", [0, 1])
def test_an_attempt_whose_flush_was_never_committed_leaves_no_duplicate_state(location, workers, drivers,
                                                                              retry_worker):
    driver = drivers(location, RunningAggregate("count"))
    run_batch(driver, workers, all_keys())
    # Batch 1: task 0's first attempt flushes, then is lost (its result never reaches the
    # driver); the retry runs the same plan, and only the retry is committed.
    plan = driver.plan()
    by_task = split_by_task(input_rows(all_keys() + KEYS[0]))
    lost = workers.run(0, plan, 0, by_task[0])
    assert any(r[tasks.R_KIND] == "segment" for r in lost.to_pylist())
    retried = workers.run(retry_worker, plan, 0, by_task[0])
    other = workers.run(0, plan, 1, by_task[1])
    lost_token = json.loads(lost.filter(pc.equal(lost[tasks.R_KIND], "task"))[tasks.R_PAYLOAD][0].as_py())["token"]
    stats = driver.commit(plan, [retried, other])
    assert stats[0]["token"] != lost_token
    # Batch 2 runs on worker 0, whose store holds the lost attempt's flush.
    run_batch(driver, workers, all_keys())
    model = Counter(all_keys() * 3 + KEYS[0])
    assert state_counts(location, driver.layout, all_keys()) == [model[k] for k in all_keys()]
    assert sql_counts(location) == dict(model)


def test_a_replayed_batch_after_a_failed_commit_counts_once(location, workers, drivers):
    driver = drivers(location, RunningAggregate("count"))
    run_batch(driver, workers, all_keys())
    plan = driver.plan()
    for task, rows in split_by_task(input_rows(all_keys())).items():
        workers.run(0, plan, task, rows)  # flushed, but the driver dies before committing
    replay = driver.plan()
    assert replay.checkpoint_id == plan.checkpoint_id and replay.task_tokens == plan.task_tokens
    by_task = split_by_task(input_rows(all_keys()))
    driver.commit(replay, [workers.run(0, replay, t, rows) for t, rows in by_task.items()])
    run_batch(driver, workers, KEYS[1])
    model = Counter(all_keys() * 2 + KEYS[1])
    assert state_counts(location, driver.layout, all_keys()) == [model[k] for k in all_keys()]


# ---------------------------------------------------------------------------- (c) idle tasks and retention

@pytest.mark.parametrize("come_back_in", [0, 1])
def test_a_task_without_rows_for_longer_than_retention_completes_when_rows_return(tmp_path, workers, drivers,
                                                                                  come_back_in):
    location = StateLocation(table="op", warehouse=str(tmp_path / "warehouse"), parallelism=P, max_parallelism=N,
                             retain_checkpoints=2)
    driver = drivers(location, RunningAggregate("count"), output_dir=str(tmp_path / "out"))
    run_batch(driver, workers, all_keys())
    idle_store = workers.use(0)[("run-1", 1)]
    for _ in range(4):  # task 1 has no rows: Spark does not call it; its flush's checkpoint is expired
        run_batch(driver, workers, KEYS[0])
    retained = [c.checkpoint_id for c in driver.table.list_checkpoints()]
    assert 1 not in retained and len(retained) == 2
    run_batch(driver, workers, all_keys(), worker_of=lambda t: come_back_in)
    assert outputs(driver) == sorted([{"k": k, "count": 6} for k in KEYS[0]] + [{"k": k, "count": 2} for k in KEYS[1]],
                                     key=lambda r: r["k"])
    if come_back_in == 0:
        assert workers.use(0)[("run-1", 1)] is idle_store  # its committed flush completed: store and cache kept
    run_batch(driver, workers, all_keys(), worker_of=lambda t: 1 - come_back_in)
    model = Counter(all_keys() * 3 + KEYS[0] * 4)
    assert state_counts(location, driver.layout, all_keys()) == [model[k] for k in all_keys()]
    assert sql_counts(location) == dict(model)


# ---------------------------------------------------------------------------- (d) dirty stores

class FlakyCounter(StatefulProcessor):
    """Counts rows per key; raises on a row with v < 0 while ``fail`` is set."""

    fail = False

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", VALUE)

    def handleInputRows(self, key, rows, timerValues):
        n = (self.count.get() or (0,))[0]
        for row in rows:
            n += 1
            self.count.update((n,))  # written before the failure below
            if row.v < 0 and FlakyCounter.fail:
                raise RuntimeError("processor failed")
        yield Row(k=key[0], count=n)


def test_a_store_left_dirty_by_a_failing_processor_is_replaced(location, workers, drivers, monkeypatch):
    driver = drivers(location, FlakyCounter(), output_dir=None)
    run_batch(driver, workers, all_keys())
    a, b = KEYS[0][0], KEYS[0][1]
    plan = driver.plan()
    rows = input_rows([a, b, a], [1, -1, 1])
    by_task = split_by_task(rows)
    monkeypatch.setattr(FlakyCounter, "fail", True)
    with pytest.raises(RuntimeError, match="processor failed"):
        workers.run(0, plan, 0, by_task[0])
    dirty = workers.use(0)[("run-1", 0)]
    assert dirty.dirty and dirty.pending is None
    monkeypatch.setattr(FlakyCounter, "fail", False)
    driver.commit(plan, [workers.run(0, plan, 0, by_task[0])])  # the retry, in the same worker
    model = Counter([*all_keys(), a, b, a])  # the failed attempt's write of a's count is gone
    assert state_counts(location, driver.layout, all_keys()) == [model[k] for k in all_keys()]
    replaced = workers.use(0)[("run-1", 0)]
    assert replaced is not dirty and not replaced.dirty
    with pytest.raises(Exception, match="closed"):
        dirty.store.get_state("count")


def test_a_store_that_failed_after_its_flush_is_replaced(location, workers, drivers, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    driver = drivers(location, RunningAggregate("count"))
    good = driver.plan()
    bad = dataclasses.replace(good, output_dir=str(not_a_dir / "out"))
    rows = split_by_task(input_rows(all_keys()))
    with pytest.raises(OSError):  # the output directory cannot be created
        workers.run(0, bad, 0, rows[0])
    failed = workers.use(0)[("run-1", 0)]
    assert failed.dirty and failed.pending is not None  # flushed, then failed
    driver.commit(good, [workers.run(0, good, t, r) for t, r in rows.items()])
    assert workers.use(0)[("run-1", 0)] is not failed
    run_batch(driver, workers, all_keys())
    assert state_counts(location, driver.layout, all_keys()) == [2] * 6


# ---------------------------------------------------------------------------- (e) other runs

def test_stores_of_another_run_are_evicted_at_the_next_task(location, workers, drivers):
    first = drivers(location, RunningAggregate("count"), run_id="run-1")
    run_batch(first, workers, all_keys())
    old = dict(workers.use(0))
    assert set(old) == {("run-1", 0), ("run-1", 1)}
    first.table.close()

    # A restarted query: a new run over the same table, the old run's stores still in the worker.
    second = drivers(location, RunningAggregate("count"), run_id="run-2")
    assert second.batch_id == 1
    run_batch(second, workers, KEYS[0])
    assert set(workers.use(0)) == {("run-2", 0)}
    for ts in old.values():
        with pytest.raises(Exception, match="closed"):
            ts.store.get_state("count")
    run_batch(second, workers, all_keys(), worker_of=lambda t: 1)
    assert set(workers.use(1)) == {("run-2", 0), ("run-2", 1)}
    tasks.forget_run("run-2")
    assert workers.use(1) == {}
    model = Counter(all_keys() * 2 + KEYS[0])
    assert state_counts(location, second.layout, all_keys()) == [model[k] for k in all_keys()]


def test_a_task_group_with_rows_of_two_tasks_is_refused(location, workers, drivers):
    driver = drivers(location, RunningAggregate("count"))
    with pytest.raises(RuntimeError, match=r"a task group holds rows of tasks \[0, 1\]: routing is broken"):
        workers.run(0, driver.plan(), 0, input_rows(all_keys()))


# ---------------------------------------------------------------------------- event time

def test_event_time_rows_at_or_before_the_previous_batch_watermark_are_dropped_as_late(location, workers, drivers,
                                                                                      tmp_path):
    schema = pa.schema([("k", pa.string()), ("ts", pa.timestamp("us", tz="UTC"))])
    driver = drivers(location, RunningAggregate("count"), time_mode="eventtime", event_time_column="ts",
                     input_schema=schema, output_dir=str(tmp_path / "out"))
    k = KEYS[0][0]
    rows = routed({"k": [k] * 4, "ts": [4_000_000, 5_000_000, 5_000_001, 9_000_000]}, parallelism=P,
                  max_parallelism=N, schema=schema)
    # The batch's own watermark (eviction, timers) is ahead; the previous batch's drops rows.
    plan = driver.plan(processing_time_ms=10_000, watermark_ms=8_000, late_watermark_ms=5_000)
    rows = rows.append_column(HEARTBEAT, pa.array([False] * rows.num_rows))
    stats = driver.commit(plan, [workers.run(0, plan, 0, rows)])
    assert (stats[0]["rows_in"], stats[0]["rows_late"], stats[0]["max_event_ms"]) == (4, 2, 9_000)
    assert outputs(driver) == [{"k": k, "count": 2}]  # 5000.001 ms is after the watermark: kept


# ---------------------------------------------------------------------------- timers and initial state

class Sessions(StatefulProcessor):
    """Counts rows per key and registers a timer 100 ms after the batch; the timer emits the
    count and clears it."""

    def init(self, handle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", VALUE)

    def handleInputRows(self, key, rows, timerValues):
        n = (self.count.get() or (0,))[0] + sum(1 for _ in rows)
        self.count.update((n,))
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 100)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        yield Row(k=key[0], count=self.count.get()[0])
        self.count.clear()


def heartbeat_rows(task: int, rows: pa.Table | None) -> pa.Table:
    beat = pa.table({"k": pa.array([None], pa.string()), "v": pa.array([None], pa.int64()),
                     KG: pa.array([None], pa.int32()), TASK: pa.array([task], pa.int32()),
                     HEARTBEAT: pa.array([True])})
    if rows is None:
        return beat
    return pa.concat_tables([rows.append_column(HEARTBEAT, pa.array([False] * rows.num_rows)), beat])


def test_timers_fire_once_while_tasks_move_between_workers(location, workers, drivers, tmp_path):
    driver = drivers(location, Sessions(), time_mode="processingtime", output_dir=str(tmp_path / "out"))
    fired: list[dict] = []
    schedule = [(1000, all_keys()), (1050, []), (1150, []), (1200, KEYS[0][:1]), (1400, [])]
    for b, (now, keys) in enumerate(schedule):
        plan = driver.plan(processing_time_ms=now)
        by_task = split_by_task(input_rows(keys)) if keys else {}
        results = [workers.run((b + t) % 2, plan, t, heartbeat_rows(t, by_task.get(t))) for t in range(P)]
        stats = driver.commit(plan, results)
        fired += [{**r, "at": now} for r in outputs(driver)]
        assert sum(s["rows_in"] for s in stats.values()) == len(keys)
    want = [{"k": k, "count": 1, "at": 1150} for k in all_keys()] + [{"k": KEYS[0][0], "count": 1, "at": 1400}]
    assert sorted(fired, key=lambda r: (r["at"], r["k"])) == sorted(want, key=lambda r: (r["at"], r["k"]))
    assert state_counts(location, driver.layout, all_keys()) == [None] * 6


def test_vectorized_initial_state_seeds_the_first_batch(location, workers, drivers):
    driver = drivers(location, RunningAggregate("count"))
    plan = driver.plan()
    initial = routed({"k": all_keys(), "count": [10 * (i + 1) for i in range(6)]}, parallelism=P, max_parallelism=N,
                     schema=pa.schema([("k", pa.string()), ("count", pa.int64())]))
    initial = initial.append_column(PART, pa.array([7] * initial.num_rows, pa.int32()))
    seeds = split_by_task(initial)
    rows = split_by_task(input_rows(KEYS[0][:1]))
    empty = input_rows(KEYS[1][:1]).slice(0, 0)
    workers.use(0)
    results = [tasks.run_task_with_initial(plan, (0,), rows[0], seeds[0]),
               tasks.run_task_with_initial(plan, (1,), empty, seeds[1])]
    driver.commit(plan, results)
    assert state_counts(location, driver.layout, all_keys()) == [11, 20, 30, 40, 50, 60]


def test_nothing_is_frozen_outside_a_spark_task(location, workers, drivers):
    """``tasks._freeze_imports_once`` only acts in a Spark task (PySpark's reused workers run
    a full collection after every task); a task run by other callers freezes nothing."""
    import gc

    before = gc.get_freeze_count()
    driver = drivers(location, RunningAggregate("count"))
    plan = driver.plan()
    rows = split_by_task(input_rows(KEYS[0][:1]))
    workers.use(0)
    driver.commit(plan, [tasks.run_task(plan, (0,), rows[0])])
    assert gc.get_freeze_count() == before == 0


def test_a_worker_returns_freed_memory_at_most_once_per_interval(location, workers, drivers, monkeypatch):
    """After a task, at most once per ``TRIM_EVERY_S``, a worker hands the C allocator's free
    pages back to the system (glibc's ``malloc_trim``) and reports by how much its RSS fell."""
    import ctypes

    try:
        getattr(ctypes.CDLL(None), "malloc_trim")  # noqa: B009 (an attribute lookup that raises)
    except AttributeError:
        pytest.skip("not glibc: nothing to trim")
    def run(driver: Driver, batches: int) -> list[dict]:
        reported = []
        for _ in range(batches):
            plan = driver.plan()
            workers.use(0)
            rows = split_by_task(input_rows(KEYS[0][:2]))
            reported.append(driver.commit(plan, [tasks.run_task(plan, (0,), rows[0])])[0])
        return reported

    driver = drivers(location, RunningAggregate("count"), store_config=StoreConfig(host_views=False))
    monkeypatch.setattr(tasks, "_trimmed_at", float("-inf"))  # due now
    reported = run(driver, 2)
    assert isinstance(reported[0]["trimmed_mb"], float) and reported[0]["trimmed_mb"] >= -1.0
    assert "trimmed_mb" not in reported[1]  # not due again within the interval
    assert state_counts(location, driver.layout, KEYS[0][:2]) == [2, 2]
    # A batch that wrote views to the host's shared views (here the store's first commit, at the
    # second batch) trims at once: its own copies were just swapped for the host's pages.
    shared = drivers(dataclasses.replace(location, table="shared"), RunningAggregate("count"), run_id="run-2")
    reported = run(shared, 2)
    assert reported[1]["views_published"] > 0 and isinstance(reported[1]["trimmed_mb"], float)


def test_a_worker_pins_glibcs_mmap_threshold_so_a_freed_large_block_does_not_move_it():
    """glibc raises its mmap threshold to the size of each mmapped block freed: after a 24 MiB
    block, one of 16 MiB would come from a heap. Pinned (``tasks._pin_mmap_threshold``, at a
    worker's first task), the 16 MiB block is a mapping of its own, unmapped when freed."""
    import ctypes

    libc = ctypes.CDLL(None)
    try:
        mallinfo2 = libc.mallinfo2
    except AttributeError:
        pytest.skip("not glibc 2.33 or later: no mallopt/mallinfo2 to check")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    assert tasks._pin_mmap_threshold()
    libc.free(libc.malloc(24 << 20))  # would raise a dynamic threshold to 24 MiB
    mapped = mallinfo2().hblks
    block = libc.malloc(16 << 20)
    try:
        assert mallinfo2().hblks == mapped + 1  # its own mapping, not the heap's
    finally:
        libc.free(block)
    assert mallinfo2().hblks == mapped  # unmapped at once
