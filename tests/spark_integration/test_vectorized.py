"""Vectorized processors without Spark: ``run_vectorized`` and ``apply_updates`` on a
``StateStore`` over a ``DirectoryStateTable``, against plain-Python models, over several
micro-batches with checkpoints (and a reopen) in between."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from spark_integration.vectorized import (
    Deduplicate,
    RunningAggregate,
    VectorizedBatch,
    VectorizedProcessor,
    VectorizedResult,
    apply_updates,
    run_vectorized,
)
from statestore import ListStateDescriptor, SchemaMismatchError, ValueStateDescriptor, assign_key_groups
from tests.spark_integration.si_helpers import FakeClock, layout_of, open_store

INPUT = pa.schema([("k", pa.string()), ("v", pa.int32()), ("tag", pa.string())])
KEYS = ["k"]


def store_for(path, processor: VectorizedProcessor, clock: FakeClock | None = None, extra=()):
    descriptors = [*processor.state_variables(INPUT, KEYS), *extra]
    return open_store(path, layout_of(descriptors), clock=clock)


def batch(rng: random.Random, n: int, keys: list[str]) -> pa.Table:
    return pa.table({"k": [rng.choice(keys) for _ in range(n)], "v": [rng.randrange(-50, 50) for _ in range(n)],
                     "tag": [f"t{rng.randrange(5)}" for _ in range(n)]}, schema=INPUT)


def first_appearance(values: list) -> list:
    return list(dict.fromkeys(values))


@pytest.mark.parametrize("routed", [False, True], ids=["hashed", "routed"])
@pytest.mark.parametrize("agg", ["count", "sum", "min", "max"])
def test_running_aggregate_matches_a_model(tmp_path, agg, routed):
    """``routed``: the rows come with their key groups, as Spark routes them."""
    proc = RunningAggregate(agg, None if agg == "count" else "v")
    out_schema = proc.output_schema(INPUT, KEYS)
    assert out_schema.names == ["k", agg]
    assert out_schema.field(agg).type == (pa.int64() if agg in ("count", "sum") else pa.int32())
    rng = random.Random(agg)
    keys = [f"key{i}" for i in range(12)]
    store = store_for(tmp_path, proc)
    model: dict[str, int] = {}
    fold = {"count": lambda old, v: (old or 0) + 1, "sum": lambda old, v: (old or 0) + v,
            "min": lambda old, v: v if old is None else min(old, v),
            "max": lambda old, v: v if old is None else max(old, v)}[agg]
    for b in range(4):
        rows = batch(rng, 40, keys)
        kgs = assign_key_groups(rows.select(KEYS), store.layout.max_parallelism) if routed else None
        out = run_vectorized(proc, store, rows, 1000 + b, -1, kgs)
        for k, v in zip(rows.column("k").to_pylist(), rows.column("v").to_pylist(), strict=True):
            model[k] = fold(model.get(k), v)
        updated = first_appearance(rows.column("k").to_pylist())
        assert out.schema.names == ["k", agg]
        assert out.to_pylist() == [{"k": k, agg: model[k]} for k in updated]  # each updated key, new value
        store.checkpoint(batch_id=b)
        if b == 1:
            store = store_for(tmp_path, proc)
    state = store_for(tmp_path, proc).get_state(agg).get_batch(pa.table({"k": keys}))
    assert state.to_pylist() == [model.get(k) for k in keys]


def test_running_aggregate_names_and_errors():
    proc = RunningAggregate("sum", "v", output_column="total", state_name="acc", ttl_ms=50)
    (desc,) = proc.state_variables(INPUT, KEYS)
    assert desc.name == "acc" and desc.value_type == pa.int64() and desc.ttl.ttl_ms == 50
    assert proc.output_schema(INPUT, KEYS).names == ["k", "total"]
    floats = pa.schema([("k", pa.string()), ("x", pa.float32())])
    assert RunningAggregate("sum", "x").state_variables(floats, KEYS)[0].value_type == pa.float64()
    with pytest.raises(ValueError, match=r"agg must be one of"):
        RunningAggregate("avg", "v")
    with pytest.raises(ValueError, match=r"RunningAggregate\('max'\) needs value_column="):
        RunningAggregate("max")
    with pytest.raises(ValueError, match=r"value column 'nope' is not an input column"):
        RunningAggregate("min", "nope").state_variables(INPUT, KEYS)
    with pytest.raises(TypeError, match=r"column 'tag' is string, not numeric"):
        RunningAggregate("sum", "tag").state_variables(INPUT, KEYS)


def test_running_aggregate_with_a_composite_key(tmp_path):
    schema = pa.schema([("a", pa.string()), ("b", pa.int64()), ("v", pa.int32())])
    proc = RunningAggregate("count")
    layout = layout_of(proc.state_variables(schema, ["a", "b"]), pa.schema([schema.field("a"), schema.field("b")]))
    store = open_store(tmp_path, layout)
    rows = pa.table({"a": ["x", "x", "y", "x"], "b": [1, 2, 1, 1], "v": [0, 0, 0, 0]}, schema=schema)
    assert run_vectorized(proc, store, rows, 0, -1).to_pylist() == [
        {"a": "x", "b": 1, "count": 2}, {"a": "x", "b": 2, "count": 1}, {"a": "y", "b": 1, "count": 1}]
    store.checkpoint()
    again = open_store(tmp_path, layout)
    assert run_vectorized(proc, again, rows.slice(0, 1), 0, -1).to_pylist() == [{"a": "x", "b": 1, "count": 3}]


@pytest.mark.parametrize("ttl_ms", [None, 250])
def test_deduplicate_matches_a_model(tmp_path, ttl_ms):
    proc = Deduplicate(ttl_ms=ttl_ms)
    assert proc.output_schema(INPUT, KEYS) == INPUT
    clock = FakeClock(10_000)
    store = store_for(tmp_path, proc, clock)
    rng = random.Random(ttl_ms or 0)
    keys = [f"key{i}" for i in range(20)]
    seen_at: dict[str, int] = {}  # key -> processing time when its state was written
    for b in range(6):
        rows = batch(rng, 15, keys)
        emitted = run_vectorized(proc, store, rows, clock.now_ms, -1)
        want, firsts = [], set()
        for row in rows.to_pylist():
            k = row["k"]
            live = k in seen_at and (ttl_ms is None or seen_at[k] + ttl_ms > clock.now_ms)
            if not live and k not in firsts:
                firsts.add(k)
                want.append(row)
        for k in firsts:
            seen_at[k] = clock.now_ms
        assert emitted.schema == INPUT
        assert emitted.to_pylist() == want, f"batch {b}"
        store.checkpoint(batch_id=b)
        clock.now_ms += 100
        if b == 2:
            store = store_for(tmp_path, proc, clock)
    if ttl_ms is not None:
        assert any(seen_at[k] > 10_000 for k in seen_at)  # some key came back after its TTL


def test_apply_updates_null_leaves_the_value_unchanged(tmp_path):
    descriptors = [ValueStateDescriptor("a", pa.int64()), ValueStateDescriptor("b", pa.string()),
                   ListStateDescriptor("l", pa.int64())]
    store = open_store(tmp_path, layout_of(descriptors))
    keys = pa.table({"k": ["x", "y", "z"]})
    apply_updates(store, pa.table({"k": ["x", "y", "z"], "a": [1, 2, 3], "b": ["p", "q", "r"]}))
    store.checkpoint()
    apply_updates(store, pa.table({"k": ["x", "y", "z"], "a": pa.array([None, 20, None], pa.int64()),
                                   "b": pa.array(["P", None, None], pa.string())}))
    apply_updates(store, pa.table({"b": ["Z"], "k": ["z"]}))  # only some value states, columns in any order
    assert store.get_state("a").get_batch(keys).to_pylist() == [1, 20, 3]
    assert store.get_state("b").get_batch(keys).to_pylist() == ["P", "q", "Z"]
    store.checkpoint()
    fresh = open_store(tmp_path, layout_of(descriptors))
    assert fresh.get_state("a").get_batch(keys).to_pylist() == [1, 20, 3]
    assert fresh.get_state("b").get_batch(keys).to_pylist() == ["P", "q", "Z"]


def test_apply_updates_refuses_unknown_columns(tmp_path):
    descriptors = [ValueStateDescriptor("a", pa.int64()), ListStateDescriptor("l", pa.int64())]
    store = open_store(tmp_path, layout_of(descriptors))
    with pytest.raises(ValueError, match=r"column\(s\) \['nope'\] that are neither key columns \['k'\] nor declared "
                                         r"value states \['a'\]"):
        apply_updates(store, pa.table({"k": ["x"], "a": [1], "nope": [2]}))
    with pytest.raises(ValueError, match=r"\['l'\]"):  # a list state is not a value state
        apply_updates(store, pa.table({"k": ["x"], "l": [2]}))
    with pytest.raises((KeyError, SchemaMismatchError), match=r"\bk\b"):  # names the missing key column
        apply_updates(store, pa.table({"a": [1]}))
    store.checkpoint()
    assert open_store(tmp_path, layout_of(descriptors)).get_state("a").get_batch(pa.table({"k": ["x"]})).to_pylist() \
        == [None]


class Custom(VectorizedProcessor):
    def __init__(self, result) -> None:
        self.result = result
        self.batches: list[VectorizedBatch] = []

    def state_variables(self, input_schema, keys):
        return [ValueStateDescriptor("a", pa.int64()), ValueStateDescriptor("b", pa.int64())]

    def process(self, batch: VectorizedBatch):
        self.batches.append(batch)
        return self.result(batch) if callable(self.result) else self.result


def test_a_processor_must_return_a_vectorized_result(tmp_path):
    proc = Custom(pa.table({"k": ["x"]}))
    store = store_for(tmp_path, proc)
    with pytest.raises(TypeError, match=r"Custom.process must return a VectorizedResult, got Table"):
        run_vectorized(proc, store, pa.table({"k": ["x"], "v": pa.array([1], pa.int32())}), 0, -1)


def test_batch_holds_distinct_keys_and_current_values_and_deletes_clear_every_value_state(tmp_path):
    def first(batch: VectorizedBatch) -> VectorizedResult:
        return VectorizedResult(updates=pa.table({"k": ["x", "y"], "a": [1, 2], "b": [10, 20]}))

    proc = Custom(first)
    store = store_for(tmp_path, proc)
    rows = pa.table({"k": ["y", "x", "y"], "v": pa.array([1, 2, 3], pa.int32())})
    assert run_vectorized(proc, store, rows, 5, 7) is None
    store.checkpoint()

    proc.result = lambda batch: VectorizedResult(output=batch.state, deletes=pa.table({"k": ["y"]}))
    out = run_vectorized(proc, store, pa.table({"k": ["z", "y", "x"], "v": pa.array([0, 0, 0], pa.int32())}), 6, 8)
    b = proc.batches[-1]
    assert (b.processing_time_ms, b.watermark_ms, b.store) == (6, 8, store)
    assert b.keys.to_pylist() == [{"k": "z"}, {"k": "y"}, {"k": "x"}]
    assert out.to_pylist() == [{"k": "z", "a": None, "b": None}, {"k": "y", "a": 2, "b": 20},
                               {"k": "x", "a": 1, "b": 10}]
    store.checkpoint()
    fresh = store_for(tmp_path, proc)
    keys = pa.table({"k": ["x", "y"]})
    assert fresh.get_state("a").get_batch(keys).to_pylist() == [1, None]
    assert fresh.get_state("b").get_batch(keys).to_pylist() == [10, None]


def test_updates_after_deletes_win_in_the_same_batch(tmp_path):
    proc = Custom(lambda batch: VectorizedResult(deletes=pa.table({"k": ["x"]}),
                                                 updates=pa.table({"k": ["x"], "a": pa.array([5], pa.int64()),
                                                                   "b": pa.array([None], pa.int64())})))
    store = store_for(tmp_path, proc)
    apply_updates(store, pa.table({"k": ["x"], "a": [1], "b": [2]}))
    run_vectorized(proc, store, pa.table({"k": ["x"], "v": pa.array([0], pa.int32())}), 0, -1)
    keys = pa.table({"k": ["x"]})
    assert store.get_state("a").get_batch(keys).to_pylist() == [5]
    assert store.get_state("b").get_batch(keys).to_pylist() == [None]  # deleted, null update = unchanged
