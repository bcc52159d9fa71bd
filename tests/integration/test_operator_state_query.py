"""Operator (non-keyed) state in a streaming query, FLIP-8's: every task keeps lists of its own,
checkpointed with the keyed state in each batch's snapshot and redistributed by each variable's
mode when the query restarts at another parallelism; for vectorized processors
(``VectorizedProcessor.operator_state``) and Spark-API ones (``handle.getOperatorListState``)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pyarrow as pa
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

from catalog import IcebergStateTable, connect
from spark_integration import StateLocation, VectorizedBatch, VectorizedProcessor, VectorizedResult
from statestore import OperatorStateDescriptor, OperatorStateStore, Redistribution
from statestore.keygroups import assign_key_groups, compute_key_group_range_for_task
from tests.integration.streaming_helpers import counts, key_batches, run_to_end, write_batches

K = 5  # the sample's size
MAX_PARALLELISM = 16
BATCHES = OperatorStateDescriptor("batches", pa.struct([("rows", pa.int64())]), Redistribution.SPLIT)
SAMPLE = OperatorStateDescriptor("sample", pa.string(), Redistribution.UNION)
SETTING = OperatorStateDescriptor("setting", pa.string(), Redistribution.BROADCAST)


class SampledCount(VectorizedProcessor):
    """A keyed running count, and per task: a record of each batch's rows (split), the ``K``
    smallest keys seen (a bottom-k sample, merged by union at a rescale) and a setting every task
    holds alike (broadcast), written by the first run."""

    def state_variables(self, input_schema, keys):
        from statestore import ValueStateDescriptor

        return [ValueStateDescriptor("count", pa.int64())]

    def output_schema(self, input_schema, keys):
        return pa.schema([("key", pa.string()), ("count", pa.int64())])

    def operator_state(self, input_schema, keys):
        return [BATCHES, SAMPLE, SETTING]

    def process(self, batch: VectorizedBatch) -> VectorizedResult:
        keys = batch.keys.column("key").to_pylist()
        n = Counter(batch.rows.column("key").to_pylist())
        old = batch.state.column("count").to_pylist()
        new = [(o or 0) + n[k] for k, o in zip(keys, old, strict=True)]
        batch.operator_state("batches").add({"rows": batch.rows.num_rows})
        sample = batch.operator_state("sample")
        sample.update(sorted(set(sample.get()) | set(keys))[:K])
        setting = batch.operator_state("setting")
        if not setting.get():
            setting.update(["first run"])
        out = pa.table({"key": keys, "count": pa.array(new, pa.int64())})
        return VectorizedResult(output=out, updates=out)


def lists(location: StateLocation, parallelism: int, descriptors) -> list[dict]:
    """Each task's operator state as it wrote it at the table's newest checkpoint (of
    ``parallelism`` tasks): read as broadcast at the same parallelism, task i gets old task i's."""
    as_written = [dataclasses.replace(d, mode=Redistribution.BROADCAST) for d in descriptors]
    table = IcebergStateTable.open_existing(warehouse=location.warehouse, table_name=location.table)
    try:
        return [{d.name: OperatorStateStore(table, as_written, task_index=t, parallelism=parallelism)
                 .get_list_state(d.name).get() for d in as_written} for t in range(parallelism)]
    finally:
        table.close()


def keys_of_task(batches: list[pa.Table], task: int, parallelism: int) -> set[str]:
    groups = compute_key_group_range_for_task(MAX_PARALLELISM, parallelism, task)
    found = set()
    for b in batches:
        keys = b.select(["key"])
        for key, kg in zip(keys.column("key").to_pylist(), assign_key_groups(keys, MAX_PARALLELISM), strict=True):
            if groups.start <= kg <= groups.end:
                found.add(key)
    return found


def test_a_vectorized_processors_operator_state_survives_a_rescale_by_its_modes(spark, tmp_path):
    batches = key_batches(5, 40, 23)
    input_dir, cp = tmp_path / "in", str(tmp_path / "cp")
    runs = ((2, batches[:3]), (3, batches[3:]))
    seen: list[pa.Table] = []
    for run, (parallelism, files) in enumerate(runs):
        write_batches(input_dir, seen + files)
        seen += files
        location = StateLocation(table="sampled", warehouse=str(tmp_path / "wh"), parallelism=parallelism,
                                 max_parallelism=MAX_PARALLELISM)
        runner = run_to_end(spark, str(input_dir), SampledCount(), None, location=location, checkpoint=cp)
        assert len([r for r in runner.reports if not r.skipped]) == len(files)
        held = lists(location, parallelism, [BATCHES, SAMPLE, SETTING])
        # split: every task's record of every batch with rows, kept whole across the rescale
        assert sum(e["rows"] for t in held for e in t["batches"]) == sum(b.num_rows for b in seen)
        everything = sorted({k for b in seen for k in b.column("key").to_pylist()})
        before = sorted({k for b in seen[:3] for k in b.column("key").to_pylist()})
        for task, state in enumerate(held):
            mine = keys_of_task(files, task, parallelism)
            if run == 0:
                assert state["sample"] == sorted(keys_of_task(files, task, parallelism))[:K]
            else:  # union: the old tasks' samples merged, then this task's own keys
                assert state["sample"] == sorted(set(before[:K]) | mine)[:K]
            assert state["setting"] == ["first run"]  # broadcast: every task alike
        assert {k for t in held for k in t["sample"]} <= set(everything)
        table = IcebergStateTable.open_existing(warehouse=location.warehouse, table_name=location.table)
        try:  # the keyed state beside it
            con = connect(table)
            assert dict(con.sql("SELECT key, v_count FROM state_count").fetchall()) == counts(seen)
            con.close()
        finally:
            table.close()


class HandledKeys(StatefulProcessor):
    """A Spark-API processor that records in a split operator list every key it handled."""

    def init(self, handle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "n long")
        handle.getOperatorListState("handled", "key string, rows long", "split")

    def handleInputRows(self, key, rows, timerValues):
        n = sum(1 for _ in rows)
        self.handle.getOperatorListState("handled").appendValue((key[0], n))
        old = self.count.get()
        self.count.update(((old[0] if old else 0) + n,))
        yield Row(key=key[0], count=(old[0] if old else 0) + n)

    def close(self) -> None:
        pass


def test_a_spark_api_processors_operator_state_through_the_handle_survives_a_rescale(spark, tmp_path):
    batches = key_batches(4, 30, 11)
    input_dir, cp = tmp_path / "in", str(tmp_path / "cp")
    seen: list[pa.Table] = []
    for parallelism, files in ((3, batches[:2]), (2, batches[2:])):
        write_batches(input_dir, seen + files)
        seen += files
        location = StateLocation(table="handled", warehouse=str(tmp_path / "wh"), parallelism=parallelism,
                                 max_parallelism=MAX_PARALLELISM)
        run_to_end(spark, str(input_dir), HandledKeys(), "key string, count long", location=location, checkpoint=cp)
    handled = OperatorStateDescriptor("handled", pa.struct([("key", pa.string()), ("rows", pa.int64())]),
                                      Redistribution.SPLIT)
    recorded = [e for t in lists(location, 2, [handled]) for e in t["handled"]]
    expected = Counter()
    for b in seen:  # one call per key and batch, with the key's rows of the batch
        expected.update(Counter(b.column("key").to_pylist()).items())
    assert Counter((e["key"], e["rows"]) for e in recorded) == expected
