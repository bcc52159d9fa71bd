"""``spark_integration.compat`` without Spark: Spark's ``StatefulProcessor`` API served by a
``StateStore`` over a ``DirectoryStateTable``.

A scripted processor calls every method of Spark's ``ValueState``, ``ListState`` and
``MapState`` and reports what each read returns; a plain-Python model says what Spark
would return. Batches are checkpointed in between and the store is reopened from the
table half way, so the results also cover what a restore reads back.
"""

from __future__ import annotations

import datetime
import json
import pickle
import random
from collections.abc import Iterator

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.errors import PySparkException, PySparkRuntimeError
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, TimerValues
from pyspark.sql.types import (
    ArrayType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from spark_integration.compat import (
    ArrowBatching,
    DeclaringHandle,
    SchemaMustBeNullableError,
    StoreHandle,
    arrow_type,
    check_nullable_for_avro,
    declare,
    rows_to_arrow,
    run_processor,
    spark_struct,
)
from spark_integration.timers import TIMERS_STATE
from statestore import (
    DirectoryStateTable,
    ListStateDescriptor,
    MapStateDescriptor,
    StateStoreError,
    TtlConfig,
    ValueStateDescriptor,
    assign_key_groups,
)
from statestore.descriptors import StateKind
from statestore.errors import StateVariableDeletedError
from tests.spark_integration.si_helpers import (
    ITEM,
    MAX_PARALLELISM,
    PAIR,
    PARITY,
    TOTAL,
    VALUE,
    FakeClock,
    commit_together,
    key_groups,
    keys_of_task,
    layout_of,
    open_store,
)

NO_TIME = TimerValues(-1, -1)


def run(processor: StatefulProcessor, store, rows: pa.Table, *, initial: pa.Table | None = None,
        timer_values: TimerValues = NO_TIME) -> list:
    keys = rows.column("k").to_pylist() if rows.num_rows else []
    return run_processor(processor, store, None, rows, key_groups(keys), timer_values, None, initial)


# ---------------------------------------------------------------------------- the scripted processor

OPS = (
    "value.update", "value.clear", "pair.update", "pair.clear",
    "items.appendValue", "items.appendList", "items.put", "items.clear",
    "totals.updateValue", "totals.removeKey", "totals.clear", "read",
)
SCRIPT_SCHEMA = pa.schema([("k", pa.string()), ("seq", pa.int64()), ("snapshot", pa.string())])


class Script(StatefulProcessor):
    """Each input row (k, seq, op, a, b) applies one state operation, then reports every read."""

    def init(self, handle) -> None:
        self.value = handle.getValueState("value", VALUE)
        self.pair = handle.getValueState("pair", PAIR)
        self.items = handle.getListState("items", ITEM)
        self.totals = handle.getMapState("totals", PARITY, TOTAL)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        for row in rows:
            a, b = row.a, row.b
            op = row.op
            if op == "value.update":
                self.value.update((a,))
            elif op == "value.clear":
                self.value.clear()
            elif op == "pair.update":
                self.pair.update((f"n{a}", b))
            elif op == "pair.clear":
                self.pair.clear()
            elif op == "items.appendValue":
                self.items.appendValue((a,))
            elif op == "items.appendList":
                self.items.appendList([(a,), (b,)])
            elif op == "items.put":
                self.items.put([(b,), (a,), (a + b,)])
            elif op == "items.clear":
                self.items.clear()
            elif op == "totals.updateValue":
                self.totals.updateValue((a % 3,), (b,))
            elif op == "totals.removeKey":
                self.totals.removeKey((a % 3,))
            elif op == "totals.clear":
                self.totals.clear()
            yield Row(k=key[0], seq=row.seq, snapshot=json.dumps(self.snapshot(a)))

    def snapshot(self, a: int) -> dict:
        return {
            "value.exists": self.value.exists(), "value.get": self.value.get(),
            "pair.exists": self.pair.exists(), "pair.get": self.pair.get(),
            "items.exists": self.items.exists(), "items.get": list(self.items.get()),
            "totals.exists": self.totals.exists(),
            "totals.iterator": sorted(self.totals.iterator()),
            "totals.keys": sorted(self.totals.keys()),
            "totals.values": sorted(self.totals.values()),
            "totals.containsKey": self.totals.containsKey((a % 3,)),
            "totals.getValue": self.totals.getValue((a % 3,)),
        }


class Model:
    """What Spark's state API returns, per key, in plain Python."""

    def __init__(self) -> None:
        self.value: dict[str, tuple] = {}
        self.pair: dict[str, tuple] = {}
        self.items: dict[str, list[tuple]] = {}
        self.totals: dict[str, dict[tuple, tuple]] = {}

    def apply(self, k: str, op: str, a: int, b: int) -> dict:
        if op == "value.update":
            self.value[k] = (a,)
        elif op == "value.clear":
            self.value.pop(k, None)
        elif op == "pair.update":
            self.pair[k] = (f"n{a}", b)
        elif op == "pair.clear":
            self.pair.pop(k, None)
        elif op == "items.appendValue":
            self.items.setdefault(k, []).append((a,))
        elif op == "items.appendList":
            self.items.setdefault(k, []).extend([(a,), (b,)])
        elif op == "items.put":
            self.items[k] = [(b,), (a,), (a + b,)]
        elif op == "items.clear":
            self.items.pop(k, None)
        elif op == "totals.updateValue":
            self.totals.setdefault(k, {})[(a % 3,)] = (b,)
        elif op == "totals.removeKey":
            self.totals.get(k, {}).pop((a % 3,), None)
        elif op == "totals.clear":
            self.totals.pop(k, None)
        items = self.items.get(k, [])
        totals = self.totals.get(k, {})
        snap = {
            "value.exists": k in self.value, "value.get": self.value.get(k),
            "pair.exists": k in self.pair, "pair.get": self.pair.get(k),
            "items.exists": bool(items), "items.get": list(items),
            "totals.exists": bool(totals),
            "totals.iterator": sorted(totals.items()),
            "totals.keys": sorted(totals),
            "totals.values": sorted(totals.values()),
            "totals.containsKey": (a % 3,) in totals,
            "totals.getValue": totals.get((a % 3,)),
        }
        return json.loads(json.dumps(snap))  # tuples as lists, like the processor's report


def script_layout():
    return layout_of(declare(Script()).descriptors)


def script_batch(rng: random.Random, keys: list[str], start_seq: int, n: int) -> pa.Table:
    rows = {"k": [], "seq": [], "op": [], "a": [], "b": []}
    for i in range(n):
        rows["k"].append(rng.choice(keys))
        rows["seq"].append(start_seq + i)
        rows["op"].append(rng.choice(OPS))
        rows["a"].append(rng.randrange(-5, 50))
        rows["b"].append(rng.randrange(0, 1000))
    return pa.table({"k": pa.array(rows["k"], pa.string()), "seq": pa.array(rows["seq"], pa.int64()),
                     "op": pa.array(rows["op"], pa.string()), "a": pa.array(rows["a"], pa.int64()),
                     "b": pa.array(rows["b"], pa.int64())})


def test_handle_and_state_classes_have_the_methods_of_sparks():
    from pyspark.sql.streaming import stateful_processor as spark

    from spark_integration import compat

    for theirs, ours in [(spark.StatefulProcessorHandle, StoreHandle), (spark.ValueState, compat.ValueState),
                         (spark.ListState, compat.ListState), (spark.MapState, compat.MapState)]:
        public = {m for m in dir(theirs) if not m.startswith("_")}
        assert public <= {m for m in dir(ours) if not m.startswith("_")}, theirs.__name__
    assert {m for m in dir(spark.StatefulProcessorHandle) if not m.startswith("_")} <= set(dir(DeclaringHandle))


def test_declared_descriptors_match_spark_schemas():
    handle = declare(Script())
    kinds = {d.name: d.kind for d in handle.descriptors}
    assert kinds == {"value": StateKind.VALUE, "pair": StateKind.VALUE, "items": StateKind.LIST,
                     "totals": StateKind.MAP}
    by_name = {d.name: d for d in handle.descriptors}
    assert by_name["pair"].value_type == pa.struct([("name", pa.string()), ("amount", pa.int64())])
    assert by_name["totals"].user_key_type == pa.struct([("parity", pa.int32())])
    assert by_name["totals"].value_type == arrow_type(TOTAL)
    # A non-struct schema becomes a struct of one field "value".
    assert spark_struct(LongType(), "x") == StructType([StructField("value", LongType())])


@pytest.mark.parametrize("seed", [1, 2])
def test_state_api_matches_model_over_batches_and_restore(tmp_path, seed):
    rng = random.Random(seed)
    layout = script_layout()
    clock = FakeClock()
    store = open_store(tmp_path, layout, clock=clock)
    model = Model()
    keys = ["a", "b", "c", "d", "e", "f"]
    seq = 0
    for batch in range(4):
        rows = script_batch(rng, keys, seq, 60)
        seq += rows.num_rows
        out = rows_to_arrow(run(Script(), store, rows), SCRIPT_SCHEMA)
        got = {(r["k"], r["seq"]): json.loads(r["snapshot"]) for r in out.to_pylist()}
        want = {(k, s): model.apply(k, op, a, b) for k, s, op, a, b in zip(
            *[rows.column(c).to_pylist() for c in ("k", "seq", "op", "a", "b")], strict=True)}
        assert got.keys() == want.keys()
        for row_id in sorted(want, key=lambda x: x[1]):
            assert got[row_id] == want[row_id], f"batch {batch} row {row_id}"
        store.checkpoint(batch_id=batch)
        clock.now_ms += 1000
        if batch == 1:  # continue from the table alone: restore reads back what the model holds
            store.close()
            store = open_store(tmp_path, layout, clock=clock)

    # A final read-only pass over every key from a freshly opened store.
    fresh = open_store(tmp_path, layout, clock=clock)
    rows = pa.table({"k": keys, "seq": list(range(seq, seq + len(keys))), "op": ["read"] * len(keys),
                     "a": [0] * len(keys), "b": [0] * len(keys)},
                    schema=pa.schema([("k", pa.string()), ("seq", pa.int64()), ("op", pa.string()),
                                      ("a", pa.int64()), ("b", pa.int64())]))
    out = rows_to_arrow(run(Script(), fresh, rows), SCRIPT_SCHEMA).to_pylist()
    for r in out:
        assert json.loads(r["snapshot"]) == model.apply(r["k"], "read", 0, 0)


def test_rows_are_grouped_per_key_with_all_input_columns_and_a_key_tuple(tmp_path):
    key_schema = pa.schema([("k", pa.string()), ("n", pa.int32())])
    seen: list[tuple] = []

    class Probe(StatefulProcessor):
        def init(self, handle) -> None:
            self.count = handle.getValueState("count", VALUE)

        def handleInputRows(self, key, rows, timerValues):
            rows = list(rows)
            seen.append((key, [r.asDict() for r in rows], timerValues.getCurrentProcessingTimeInMs()))
            n = (self.count.get() or (0,))[0] + len(rows)
            self.count.update((n,))
            return iter([(key[0], key[1], n)])

    layout = layout_of(declare(Probe()).descriptors, key_schema)
    store = open_store(tmp_path, layout)
    rows = pa.table({"k": ["x", "y", "x"], "n": pa.array([1, 1, 1], pa.int32()), "v": ["p", "q", "r"]})
    kgs = [int(kg) for kg in assign_key_groups(rows.select(["k", "n"]), MAX_PARALLELISM)]
    out = run_processor(Probe(), store, None, rows, kgs, TimerValues(123, -1), None)
    assert out == [("x", 1, 2), ("y", 1, 1)]  # keys in order of first appearance
    assert seen == [(("x", 1), [{"k": "x", "n": 1, "v": "p"}, {"k": "x", "n": 1, "v": "r"}], 123),
                    (("y", 1), [{"k": "y", "n": 1, "v": "q"}], 123)]
    store.checkpoint()
    out = run_processor(Probe(), open_store(tmp_path, layout), None, rows.slice(0, 1), kgs[:1], NO_TIME, None)
    assert out == [("x", 1, 3)]


def test_processor_lifecycle_init_then_close_every_batch(tmp_path):
    calls: list[str] = []

    class Lifecycle(StatefulProcessor):
        def init(self, handle) -> None:
            calls.append("init")
            self.count = handle.getValueState("count", VALUE)

        def handleInputRows(self, key, rows, timerValues):
            calls.append(f"rows:{key[0]}")
            raise RuntimeError("boom")

        def close(self) -> None:
            calls.append("close")

    layout = layout_of(declare(Lifecycle()).descriptors)
    calls.clear()
    store = open_store(tmp_path, layout)
    with pytest.raises(RuntimeError, match="boom"):
        run(Lifecycle(), store, pa.table({"k": ["a"]}))
    assert calls == ["init", "rows:a", "close"]  # closed even when a handler fails


def test_a_null_key_fails_the_batch_before_any_handler_runs(tmp_path):
    """Keys are checked once per batch (``check_routed_keys``), not per key: a null key value
    anywhere in the rows fails before the first handler, so no key's writes are half made."""
    calls: list[str] = []

    class Counting(StatefulProcessor):
        def init(self, handle) -> None:
            self.count = handle.getValueState("count", VALUE)

        def handleInputRows(self, key, rows, timerValues):
            calls.append(key[0])
            self.count.update((1,))
            return iter([])

    layout = layout_of(declare(Counting()).descriptors)
    store = open_store(tmp_path, layout)
    rows = pa.table({"k": ["a", None, "b"]})
    with pytest.raises(ValueError, match=r"key \(None,\) has a null value: keys must not be null"):
        run_processor(Counting(), store, None, rows, [0, 0, 0], NO_TIME, None)
    assert calls == []


def test_value_state_ttl_from_ttl_duration_ms(tmp_path):
    class Ttl(StatefulProcessor):
        def init(self, handle) -> None:
            self.count = handle.getValueState("count", VALUE, 100)

        def handleInputRows(self, key, rows, timerValues):
            for row in rows:
                if row.op == "set":
                    self.count.update((1,))
                yield (key[0], self.count.exists())

    descriptors = declare(Ttl()).descriptors
    assert descriptors[0].ttl == TtlConfig(100)
    clock = FakeClock(1000)
    store = open_store(tmp_path, layout_of(descriptors), clock=clock)
    assert run(Ttl(), store, pa.table({"k": ["a"], "op": ["set"]})) == [("a", True)]
    store.checkpoint()
    clock.now_ms = 1099
    assert run(Ttl(), store, pa.table({"k": ["a"], "op": ["get"]})) == [("a", True)]
    clock.now_ms = 1100
    assert run(Ttl(), store, pa.table({"k": ["a"], "op": ["get"]})) == [("a", False)]


# ---------------------------------------------------------------------------- rows_to_arrow

OUT = pa.schema([("k", pa.string()), ("n", pa.int64())])


def test_rows_to_arrow_accepts_rows_tuples_and_dicts():
    rows = [Row("a", 1), ("b", 2), ["c", 3], {"n": 4, "k": "d"}, {"k": "e"}]
    table = rows_to_arrow(rows, OUT)
    assert table.schema == OUT
    assert table.to_pylist() == [{"k": "a", "n": 1}, {"k": "b", "n": 2}, {"k": "c", "n": 3}, {"k": "d", "n": 4},
                                 {"k": "e", "n": None}]
    assert rows_to_arrow([], OUT) == OUT.empty_table()


def test_rows_to_arrow_wrong_arity_names_the_columns():
    with pytest.raises(ValueError, match=r"has 3 field\(s\).*2: \['k', 'n'\]"):
        rows_to_arrow([("a", 1), ("b", 2, 3)], OUT, what="processor output")
    with pytest.raises(ValueError, match=r"has 1 field\(s\)"):
        rows_to_arrow([Row("a")], OUT)


def test_rows_to_arrow_wrong_type_names_the_column():
    with pytest.raises(TypeError, match=r"column 'n' does not match the declared type int64"):
        rows_to_arrow([("a", 1), ("b", "two")], OUT)
    with pytest.raises(TypeError, match=r"column 'k' does not match the declared type string"):
        rows_to_arrow([(1.5, 1)], OUT)
    with pytest.raises(TypeError, match=r"rows must be Row, tuple or dict, got int"):
        rows_to_arrow([("a", 1), 7], OUT)


def test_rows_to_arrow_matches_named_row_fields_by_name_as_spark_does():
    # Spark's transformWithState worker converts each output Row with row.asDict(True) and
    # pa.RecordBatch.from_pylist(schema=...): fields are matched by name, in any order.
    schema = pa.schema([("k", pa.string()), ("label", pa.string())])
    table = rows_to_arrow([Row(label="x", k="a")], schema)
    assert table.to_pylist() == [{"k": "a", "label": "x"}]


# ---------------------------------------------------------------------------- handleInitialState

class Seeded(StatefulProcessor):
    """Initial rows (k, start) seed a running sum; input rows (k, a) add to it."""

    def __init__(self) -> None:
        self.initial_calls: list[tuple] = []

    def init(self, handle) -> None:
        self.total = handle.getValueState("total", VALUE)
        self.history = handle.getListState("history", ITEM)

    def handleInitialState(self, key, initialState, timerValues) -> None:
        self.initial_calls.append((key, initialState.asDict(), timerValues.getCurrentProcessingTimeInMs()))
        current = self.total.get()
        self.total.update(((current[0] if current else 0) + initialState.start,))
        self.history.appendValue((initialState.start,))

    def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            n = (self.total.get() or (0,))[0] + row.a
            self.total.update((n,))
            self.history.appendValue((row.a,))
            yield (key[0], n, [v for (v,) in self.history.get()])


def test_handle_initial_state_seeds_state_before_the_first_rows(tmp_path):
    layout = layout_of(declare(Seeded()).descriptors)
    store = open_store(tmp_path, layout)
    initial = pa.table({"k": ["a", "b", "a"], "start": pa.array([10, 20, 5], pa.int64())})
    rows = pa.table({"k": ["a", "c"], "a": pa.array([1, 2], pa.int64())})
    processor = Seeded()
    out = run(processor, store, rows, initial=initial, timer_values=TimerValues(77, -1))
    # Every initial row is handed over, one call per row, with the key as a tuple.
    assert processor.initial_calls == [(("a",), {"k": "a", "start": 10}, 77), (("b",), {"k": "b", "start": 20}, 77),
                                       (("a",), {"k": "a", "start": 5}, 77)]
    assert out == [("a", 16, [10, 5, 1]), ("c", 2, [2])]
    store.checkpoint()

    fresh = open_store(tmp_path, layout)
    out = run(Seeded(), fresh, pa.table({"k": ["b", "a"], "a": pa.array([1, 1], pa.int64())}))
    assert out == [("b", 21, [20, 1]), ("a", 17, [10, 5, 1, 1])]  # the key seeded without rows kept its state


# ---------------------------------------------------------------------------- deleteIfExists

class Writer(StatefulProcessor):
    def init(self, handle) -> None:
        self.count = handle.getValueState("count", VALUE)
        self.old = handle.getListState("old", ITEM)
        self.oldmap = handle.getMapState("oldmap", PARITY, TOTAL)

    def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            self.count.update(((self.count.get() or (0,))[0] + 1,))
            self.old.appendValue((row.a,))
            self.oldmap.updateValue((row.a % 2,), (row.a,))
        return iter([])


class Purger(StatefulProcessor):
    def init(self, handle) -> None:
        self.count = handle.getValueState("count", VALUE)
        handle.deleteIfExists("old")
        handle.deleteIfExists("oldmap")
        handle.deleteIfExists("never_declared")  # nothing to purge: a no-op
        self.old = handle.getListState("old", ITEM)

    def handleInputRows(self, key, rows, timerValues):
        for _ in rows:
            self.count.update(((self.count.get() or (0,))[0] + 1,))
        yield (key[0], self.count.get()[0], list(self.old.get()))


def test_delete_if_exists_purges_a_variable_for_every_key_of_the_task(tmp_path):
    assert declare(Purger()).deleted == ["old", "oldmap", "never_declared"]
    layout = layout_of(declare(Writer()).descriptors)
    table = DirectoryStateTable(tmp_path, layout)
    stores = [open_store(tmp_path, layout, task_index=t, parallelism=2, table=table) for t in range(2)]
    keys = {t: keys_of_task(t, 2, 4, prefix="u") for t in range(2)}
    for t, store in enumerate(stores):
        ks = keys[t]
        rows = pa.table({"k": ks + ks, "a": pa.array(range(2 * len(ks)), pa.int64())})
        run(Writer(), store, rows)
    commit_together(table, stores, 2)
    probe = open_store(tmp_path, layout)
    all_kgs = range(MAX_PARALLELISM)
    assert probe.live_view("old", all_kgs).height == 16 and probe.live_view("oldmap", all_kgs).height == 8

    # Task 0 gets rows of one key only; task 1 runs without rows: both purge all their keys.
    out0 = run(Purger(), stores[0], pa.table({"k": [keys[0][0]], "a": pa.array([0], pa.int64())}))
    out1 = run(Purger(), stores[1], pa.table({"k": pa.array([], pa.string()), "a": pa.array([], pa.int64())}))
    assert out0 == [(keys[0][0], 3, [])]  # purged before the rows are handled
    assert out1 == []
    commit_together(table, stores, 2)

    fresh = open_store(tmp_path, layout)
    assert fresh.live_view("old", all_kgs).height == 0
    assert fresh.live_view("oldmap", all_kgs).height == 0
    counts = fresh.live_view("count", all_kgs)
    got = dict(zip(counts.get_column("k").to_list(), [v["n"] for v in counts.get_column("v_count").to_list()],
                   strict=True))
    assert got == {k: (3 if k == keys[0][0] else 2) for t in range(2) for k in keys[t]}


def test_delete_if_exists_keeps_values_written_after_it_in_the_same_batch(tmp_path):
    class PurgeThenWrite(Writer):
        def init(self, handle) -> None:
            handle.deleteIfExists("old")
            super().init(handle)

    layout = layout_of(declare(Writer()).descriptors)
    store = open_store(tmp_path, layout)
    run(Writer(), store, pa.table({"k": ["a", "b"], "a": pa.array([1, 2], pa.int64())}))
    store.checkpoint()
    run(PurgeThenWrite(), store, pa.table({"k": ["a"], "a": pa.array([9], pa.int64())}))
    store.checkpoint()
    fresh = open_store(tmp_path, layout)
    old = fresh.live_view("old", range(MAX_PARALLELISM))
    assert sorted(zip(old.get_column("k").to_list(), [v["v"] for v in old.get_column("v_old").to_list()],
                      strict=True)) == [("a", 9)]


# ---------------------------------------------------------------------------- handles: errors

class Declares(StatefulProcessor):
    def __init__(self, declare_fn) -> None:
        self.declare_fn = declare_fn

    def init(self, handle) -> None:
        self.declare_fn(handle)

    def handleInputRows(self, key, rows, timerValues):
        return iter([])


def test_declaring_handle_refuses_the_reserved_timers_name():
    for fn in (lambda h: h.getValueState(TIMERS_STATE, VALUE), lambda h: h.getListState(TIMERS_STATE, ITEM),
               lambda h: h.getMapState(TIMERS_STATE, PARITY, TOTAL)):
        with pytest.raises(ValueError, match=r"'icestate_timers' is reserved for timers"):
            declare(Declares(fn))


def test_declaring_handle_refuses_a_variable_declared_twice():
    def twice(h):
        h.getValueState("count", VALUE)
        h.getListState("count", ITEM)

    with pytest.raises(ValueError, match=r"state variable 'count' is declared twice in init\(\)"):
        declare(Declares(twice))


@pytest.mark.parametrize("call", ["registerTimer", "deleteTimer", "listTimers"])
def test_declaring_handle_refuses_timers_in_init(call):
    def timers(h):
        h.getValueState("count", VALUE)
        getattr(h, call)(*(() if call == "listTimers" else (1000,)))

    with pytest.raises(StateStoreError, match=r"needs a grouping key.*not init\(\)"):
        declare(Declares(timers))


def test_declaring_handle_checks_ttl_and_schemas():
    handle = DeclaringHandle()
    with pytest.raises(ValueError, match=r"state 'c': ttlDurationMs must be a positive int"):
        handle.getValueState("c", VALUE, -5)
    handle.getValueState("no-ttl", VALUE, 0)  # 0: no TTL, as Spark
    assert handle.descriptors.pop().ttl is None
    with pytest.raises(TypeError, match=r"schema must be a StructType or a DDL string, got int"):
        handle.getValueState("c", 5)
    handle.getMapState("m", IntegerType(), StringType(), 50)
    (m,) = handle.descriptors
    assert m.user_key_type == pa.struct([("value", pa.int32())]) and m.ttl == TtlConfig(50)


def test_store_handle_refuses_undeclared_variables_wrong_kinds_and_timers_without_time_mode(tmp_path):
    layout = layout_of(declare(Writer()).descriptors)
    handle = StoreHandle(open_store(tmp_path, layout), None)
    with pytest.raises(StateStoreError, match=r"state variable 'nope' was not declared when the query started"):
        handle.getValueState("nope", VALUE)
    with pytest.raises(StateStoreError, match=r"'old' is a list state, requested as value"):
        handle.getValueState("old", ITEM)
    with pytest.raises(StateStoreError, match=r"'count' is a value state, requested as map"):
        handle.getMapState("count", PARITY, TOTAL)
    with pytest.raises(StateStoreError, match=r"timers need time_mode='ProcessingTime' or 'EventTime'"):
        handle.registerTimer(5)
    with pytest.raises(StateStoreError, match=r"timers need time_mode"):
        list(handle.listTimers())


@pytest.mark.parametrize("batched", [False, True], ids=["per-key", "batched"])
def test_state_writes_check_arity_and_types(tmp_path, batched):
    layout = layout_of(declare(Script()).descriptors)
    store = open_store(tmp_path, layout)
    handle = StoreHandle(store, None, batched=batched)
    store.set_current_key("a")
    pair = handle.getValueState("pair", PAIR)
    with pytest.raises(ValueError, match=r"value state 'pair': expected a tuple of 2 field\(s\) \['name', 'amount'\]"):
        pair.update(("x",))
    totals = handle.getMapState("totals", PARITY, TOTAL)
    with pytest.raises(ValueError, match=r"map state 'totals' user key: expected a tuple of 1"):
        totals.updateValue((1, 2), (3,))
    with pytest.raises(Exception, match=r"does not match the declared type"):
        handle.getValueState("value", VALUE).update(("not a number",))
    assert not pair.exists() and not totals.exists()
    handle.drain()
    store.checkpoint()
    assert open_store(tmp_path, layout).live_view("pair", range(MAX_PARALLELISM)).height == 0


def test_struct_schema_with_several_fields_round_trips_through_segments(tmp_path):
    schema = StructType([StructField("name", StringType()), StructField("n", LongType()),
                         StructField("score", IntegerType())])

    class Multi(StatefulProcessor):
        def init(self, handle) -> None:
            self.profile = handle.getValueState("profile", schema)
            self.events = handle.getListState("events", schema)

        def handleInputRows(self, key, rows, timerValues):
            for row in rows:
                self.profile.update((row.k.upper(), row.n, 7))
                self.events.appendValue(Row("e", row.n * 2, row.n))
            yield (key[0], self.profile.get(), list(self.events.get()))

    layout = layout_of(declare(Multi()).descriptors)
    store = open_store(tmp_path, layout)
    assert run(Multi(), store, pa.table({"k": ["a"], "n": pa.array([1], pa.int64())})) == [
        ("a", ("A", 1, 7), [("e", 2, 1)])]
    store.checkpoint()
    out = run(Multi(), open_store(tmp_path, layout), pa.table({"k": ["a"], "n": pa.array([2], pa.int64())}))
    assert out == [("a", ("A", 2, 7), [("e", 2, 1), ("e", 4, 2)])]


def test_named_row_and_dict_values_read_back_in_schema_order_before_and_after_a_checkpoint(tmp_path):
    class Named(StatefulProcessor):
        def init(self, handle) -> None:
            self.pair = handle.getValueState("pair", PAIR)
            self.events = handle.getListState("events", PAIR)
            self.by_parity = handle.getMapState("by_parity", PARITY, PAIR)

        def handleInputRows(self, key, rows, timerValues):
            for row in rows:
                if row.op == "write":
                    self.pair.update(Row(amount=5, name="x"))
                    self.events.appendValue({"amount": 6, "name": "y"})
                    self.by_parity.updateValue(Row(parity=1), Row(amount=7, name="z"))
            yield (self.pair.get(), list(self.events.get()), self.by_parity.getValue((1,)))

    layout = layout_of(declare(Named()).descriptors)
    store = open_store(tmp_path, layout)
    want = (("x", 5), [("y", 6)], ("z", 7))
    same_batch = run(Named(), store, pa.table({"k": ["a"], "op": ["write"]}))
    store.checkpoint()
    after_reload = run(Named(), open_store(tmp_path, layout), pa.table({"k": ["a"], "op": ["read"]}))
    assert after_reload == [want]
    assert same_batch == [want]


def test_the_cyclic_collector_pauses_while_a_processor_runs_and_resumes_after():
    """``tasks._no_cyclic_gc`` (the compat path's speed-up): off inside, back as it was after,
    also when the processor raises; a collector the user turned off stays off."""
    import gc

    from spark_integration.tasks import _no_cyclic_gc

    assert gc.isenabled()
    with _no_cyclic_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _no_cyclic_gc():
        raise RuntimeError("processor failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with _no_cyclic_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("name", ["", " padded", "padded ", "default", "$timers"])
def test_declaring_handle_refuses_the_state_names_spark_refuses(name):
    with pytest.raises(ValueError, match=r"state name .* is invalid"):
        DeclaringHandle().getValueState(name, VALUE)


@pytest.mark.parametrize("name", ["ttl-state", "my state", "a.b", "DEFAULT", "tab\there", "émoji 🙂", "x" * 5000])
def test_declaring_handle_takes_every_state_name_spark_takes(name):
    handle = DeclaringHandle()
    handle.getListState(name, VALUE)
    assert handle.descriptors[0].name == name


@pytest.mark.parametrize("batched", [False, True], ids=["per-key", "batched"])
def test_a_handle_obtained_before_delete_if_exists_raises_one_obtained_after_works(tmp_path, batched):
    layout = layout_of([ValueStateDescriptor("s", pa.struct([("value", pa.int64())]))])
    store = open_store(tmp_path, layout)
    store.set_current_key(("a",))
    store.get_state("s").update({"value": 5})
    handle = StoreHandle(store, None, batched=batched)
    before = handle.getValueState("s")
    handle.deleteIfExists("s")
    for call, text in ((before.get, "Error getting value state"), (before.exists, "Error checking value state exists"),
                       (lambda: before.update((1,)), "Error updating value state"),
                       (before.clear, "Error clearing value state")):
        # Spark's class and text (what processors written for Spark catch), and the store's class.
        with pytest.raises(PySparkRuntimeError) as raised:
            call()
        assert str(raised.value) == f"{text}: Value state s is not initialized."
        assert isinstance(raised.value, StateVariableDeletedError)
        assert "call get...State('s') again after the delete" in raised.value.__notes__[0]
        again = pickle.loads(pickle.dumps(raised.value))  # as an executor's exception reaches the driver
        assert (type(again), str(again), again.__notes__) == (type(raised.value), str(raised.value),
                                                                 raised.value.__notes__)
    after = handle.getValueState("s")
    store.set_current_key(("a",))
    assert (after.exists(), after.get()) == (False, None)
    after.update((7,))
    assert after.get() == (7,)


def test_list_and_map_handles_obtained_before_delete_if_exists_fail_as_on_spark_and_iterate_nothing(tmp_path):
    value = pa.struct([("value", pa.int64())])
    layout = layout_of([ListStateDescriptor("l", value),
                        MapStateDescriptor("m", key_type=pa.struct([("k", pa.string())]), value_type=value)])
    store = open_store(tmp_path, layout)
    store.set_current_key(("a",))
    handle = StoreHandle(store, None)
    items, entries = handle.getListState("l"), handle.getMapState("m")
    items.appendValue((1,))
    entries.updateValue(("x",), (2,))
    handle.deleteIfExists("l")
    handle.deleteIfExists("m")
    read = (list(items.get()), list(entries.iterator()), list(entries.keys()), list(entries.values()))
    assert read == ([], [], [], [])
    for call, text in ((items.exists, "Error checking value state exists: List"),
                       (lambda: items.appendValue((1,)), "Error updating value state: List"),
                       (lambda: items.appendList([(1,)]), "Error updating value state: List"),
                       (lambda: items.put([(1,)]), "Error updating value state: List"),
                       (items.clear, "Error clearing value state: List"),
                       (entries.exists, "Error checking map state exists: Map"),
                       (lambda: entries.getValue(("x",)), "Error getting value: Map"),
                       (lambda: entries.containsKey(("x",)), "Error checking if map state contains key: Map"),
                       (lambda: entries.updateValue(("x",), (1,)), "Error updating map state value: Map"),
                       (lambda: entries.removeKey(("x",)), "Error removing key from map state: Map"),
                       (entries.clear, "Error clearing map state: Map")):
        with pytest.raises(PySparkRuntimeError) as raised:
            call()
        assert str(raised.value) == f"{text} state {'l' if 'List' in text else 'm'} is not initialized."
    assert (handle.getListState("l").exists(), handle.getMapState("m").exists()) == (False, False)


def test_avro_encoding_refuses_a_state_field_that_is_not_nullable_with_sparks_condition():
    strict = StructType([StructField("k", StringType(), False), StructField("v", ArrayType(LongType()))])

    class NotNullable(StatefulProcessor):
        def __init__(self, value_too: bool):
            self.value_too = value_too

        def init(self, handle) -> None:
            handle.getValueState("fine", VALUE)
            # As Spark: a map's user key, and a value with a TTL (stored in a struct of its own), pass.
            handle.getMapState("index", strict, VALUE)
            handle.getListState("kept", strict, ttlDurationMs=60_000)
            if self.value_too:
                handle.getMapState("values", VALUE, strict)

        def handleInputRows(self, key, rows, timerValues):
            return iter(())

    check_nullable_for_avro(declare(NotNullable(False)), "avro")
    declared = declare(NotNullable(True))
    check_nullable_for_avro(declared, None)  # Spark's default encoding takes it
    check_nullable_for_avro(declared, "unsaferow")
    with pytest.raises(SchemaMustBeNullableError) as raised:
        check_nullable_for_avro(declared, "avro")
    error = raised.value
    assert isinstance(error, PySparkException) and isinstance(error, StateStoreError)
    assert (error.getCondition(), error.getSqlState()) == ("TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE", "XXKST")
    shown = "StructType(StructField(k,StringType,false),StructField(v,ArrayType(LongType,true),true))"
    assert error.getMessageParameters() == {"columnFamilyName": "values", "schema": shown}
    assert str(error) == ("[TRANSFORM_WITH_STATE_SCHEMA_MUST_BE_NULLABLE] If Avro encoding is enabled, all the fields "
                          "in the schema for column family values must be nullable\nwhen using the TransformWithState "
                          f"operator.\nPlease make the schema nullable. Current schema: {shown}")
    again = pickle.loads(pickle.dumps(error))  # as an executor's exception reaches the driver
    assert (type(again), str(again)) == (SchemaMustBeNullableError, str(error))


class ChunkSizes(StatefulProcessor):
    """Yields, per key, the sizes of the DataFrames its rows came in (and of its initial state)."""

    def init(self, handle) -> None:
        self.seen = handle.getValueState("seen", StructType([StructField("sizes", StringType())]))

    def handleInitialState(self, key, initialState, timerValues) -> None:
        old = self.seen.get()
        self.seen.update(((old[0] if old else "") + f"i{len(initialState)}",))

    def handleInputRows(self, key, rows, timerValues):
        import pandas as pd

        sizes = [len(frame) for frame in rows]
        old = self.seen.get()
        yield pd.DataFrame({"k": [key[0]], "sizes": [(old[0] if old else "") + str(sizes)]})


@pytest.mark.parametrize(("batching", "expected"), [
    (None, {"a": "i1[5]", "b": "[1]"}),                                      # Spark's defaults: one DataFrame
    (ArrowBatching(max_records=2), {"a": "i1[2, 2, 1]", "b": "[1]"}),
    (ArrowBatching(max_records=0, max_bytes=2), {"a": "i1[1, 1, 1, 1, 1]", "b": "[1]"}),  # every row alone
    (ArrowBatching(max_records=-1), {"a": "i1[5]", "b": "[1]"}),                         # no limit at all
    (ArrowBatching(max_records=-1, max_bytes=30), {"a": "i1[3, 2]", "b": "[1]"}),  # ~13 bytes a row: 3 reach 30
])
def test_a_pandas_processor_gets_a_keys_rows_cut_as_sparks_arrow_batches(tmp_path, batching, expected):
    from spark_integration.compat import run_pandas_processor

    store = open_store(tmp_path, layout_of(declare(ChunkSizes()).descriptors))
    rows = pa.table({"k": ["a", "a", "b", "a", "a", "a"], "v": list(range(6))})
    initial = pa.table({"k": ["a"], "v": [9]})
    schema = pa.schema([("k", pa.string()), ("sizes", pa.string())])
    out = run_pandas_processor(ChunkSizes(), store, None, rows, key_groups(rows.column("k").to_pylist()),
                               TimerValues(-1, -1), None, schema, initial, batching=batching)
    assert dict(zip(*out.to_pydict().values(), strict=True)) == expected


def test_arrow_batching_reads_the_sessions_settings_and_falls_back_to_sparks_defaults():
    records, size = "spark.sql.execution.arrow.maxRecordsPerBatch", "spark.sql.execution.arrow.maxBytesPerBatch"
    assert ArrowBatching.of_session({records: "3", size: "64"}.get) == ArrowBatching(3, 64)
    for text, bytes_ in (("64b", 64), ("64k", 65536), ("1m", 2**20), ("256MB", 256 * 2**20), ("2g", 2**31)):
        assert ArrowBatching.of_session({size: text}.get).max_bytes == bytes_, text
    assert ArrowBatching.of_session({}.get) == ArrowBatching(10_000, 2**31 - 1)
    assert ArrowBatching.of_session({records: "x", size: "lots"}.get) == ArrowBatching(10_000, 2**31 - 1)


def test_frames_to_arrow_matches_columns_by_name_or_position_and_keeps_the_frames_order():
    import pandas as pd

    from spark_integration.compat import frames_to_arrow

    schema = pa.schema([("k", pa.string()), ("n", pa.int64())])
    frames = [pd.DataFrame({"k": ["a"], "n": [1]}), pd.DataFrame({"n": [2], "k": ["b"]}),
              pd.DataFrame([["c", 3]]), pd.DataFrame({"k": ["d", "e"], "n": [4, 5], "extra": [0, 0]})]
    assert frames_to_arrow(frames, schema).to_pylist() == [
        {"k": "a", "n": 1}, {"k": "b", "n": 2}, {"k": "c", "n": 3}, {"k": "d", "n": 4}, {"k": "e", "n": 5}]
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['n'\]"):
        frames_to_arrow([pd.DataFrame({"k": ["a"]})], schema)
    with pytest.raises(TypeError, match=r"must yield pandas\.DataFrames, got tuple"):
        frames_to_arrow([("a", 1)], schema)


# ---------------------------------------------------------------------------- batched value state

S_LAYOUT = [ValueStateDescriptor("s", pa.struct([("value", pa.int64())]))]


def stored_values(tmp_path, layout) -> dict:
    view = open_store(tmp_path, layout).live_view("s", range(MAX_PARALLELISM))
    return dict(zip(view.get_column("k").to_list(), [v["value"] for v in view.get_column("v_s").to_list()],
                    strict=True))


def test_two_handles_of_one_value_state_see_each_others_writes_within_a_batch(tmp_path):
    class Twice(StatefulProcessor):
        def init(self, handle) -> None:
            self.a = handle.getValueState("s", "value long")
            self.b = handle.getValueState("s", "value long")

        def handleInputRows(self, key, rows, timerValues):
            for _ in rows:
                self.a.update(((self.b.get() or (0,))[0] + 1,))
                self.b.update(((self.a.get() or (0,))[0] + 10,))
            yield (key[0], self.a.get()[0], self.b.exists())

    layout = layout_of(S_LAYOUT)
    store = open_store(tmp_path, layout)
    assert run(Twice(), store, pa.table({"k": ["x", "y", "x"]})) == [("x", 22, True), ("y", 11, True)]
    store.checkpoint()
    assert run(Twice(), store, pa.table({"k": ["y"]})) == [("y", 22, True)]
    store.checkpoint()
    assert stored_values(tmp_path, layout) == {"x": 22, "y": 22}


def test_a_batch_that_raises_writes_nothing_of_its_value_states(tmp_path):
    class FailsOnB(StatefulProcessor):
        def init(self, handle) -> None:
            self.s = handle.getValueState("s", "value long")

        def handleInputRows(self, key, rows, timerValues):
            if key[0] == "b":
                raise RuntimeError("boom")
            self.s.update(((self.s.get() or (0,))[0] + 1,))
            return iter([])

    layout = layout_of(S_LAYOUT)
    store = open_store(tmp_path, layout)
    run(FailsOnB(), store, pa.table({"k": ["a"]}))
    store.checkpoint()
    with pytest.raises(RuntimeError, match="boom"):
        run(FailsOnB(), store, pa.table({"k": ["a", "c", "b"]}))
    store.checkpoint()
    assert stored_values(tmp_path, layout) == {"a": 1}


def test_delete_if_exists_after_writes_in_the_same_batch_purges_them_too(tmp_path):
    layout = layout_of(S_LAYOUT)
    store = open_store(tmp_path, layout)
    store.set_current_key(("a",))
    store.get_state("s").update({"value": 5})
    store.checkpoint()
    handle = StoreHandle(store, None, batched=True)
    s = handle.getValueState("s")
    for key, value in (("a", 6), ("b", 7)):
        store.set_current_key((key,))
        s.update((value,))
    handle.deleteIfExists("s")
    after = handle.getValueState("s")
    store.set_current_key(("c",))
    after.update((8,))
    handle.drain()
    store.checkpoint()
    assert stored_values(tmp_path, layout) == {"c": 8}


def test_batched_value_state_clears_and_rewrites_keys_read_from_earlier_checkpoints(tmp_path):
    class Toggle(StatefulProcessor):
        """Clears a key's value when it has one, else sets it to the number of its rows."""

        def init(self, handle) -> None:
            self.s = handle.getValueState("s", "value long")

        def handleInputRows(self, key, rows, timerValues):
            n = sum(1 for _ in rows)
            if self.s.exists():
                self.s.clear()
            else:
                self.s.update((n,))
            yield (key[0], self.s.get())

    layout = layout_of(S_LAYOUT)
    store = open_store(tmp_path, layout)
    assert run(Toggle(), store, pa.table({"k": ["a", "b", "a"]})) == [("a", (2,)), ("b", (1,))]
    store.checkpoint()
    store = open_store(tmp_path, layout)  # the next batch reads them back from the segments
    assert run(Toggle(), store, pa.table({"k": ["b", "c"]})) == [("b", None), ("c", (1,))]
    store.checkpoint()
    assert stored_values(tmp_path, layout) == {"a": 2, "c": 1}


def test_input_rows_behave_as_the_rows_sparks_worker_makes(tmp_path):
    """Spark's worker hands ``Row(*names)(*values)`` rows to ``handleInputRows``; ours answer
    the same reads (and pickle to the same plain Row)."""
    import pickle

    got: list = []

    class Keep(StatefulProcessor):
        def init(self, handle) -> None:
            self.count = handle.getValueState("count", VALUE)

        def handleInputRows(self, key, rows, timerValues):
            got.extend(rows)
            return iter([])

    layout = layout_of(declare(Keep()).descriptors)
    rows = pa.table({"k": ["x", "y", "x"], "a": pa.array([1, 2, 3], pa.int64())})
    run(Keep(), open_store(tmp_path, layout), rows)
    spark_row = Row("k", "a")
    for ours, values in zip(got, [("x", 1), ("x", 3), ("y", 2)], strict=True):
        theirs = spark_row(*values)
        assert isinstance(ours, Row) and ours == theirs and tuple(ours) == values
        assert (ours.k, ours.a, ours["a"], ours[0]) == (theirs.k, theirs.a, theirs["a"], theirs[0])
        assert ours.asDict() == theirs.asDict() and repr(ours) == repr(theirs) and "k" in ours
        assert list(ours.__fields__) == list(theirs.__fields__)
        back = pickle.loads(pickle.dumps(ours))
        assert back == theirs and back.asDict() == theirs.asDict() and type(back) is Row
        with pytest.raises(AttributeError):
            ours.missing  # noqa: B018 (the read raises, as on Spark's row)
        with pytest.raises(Exception, match=r"read-only|read only"):
            ours.k = "z"


# Two schemas: one held as tuples in a batch (plain fields), one held as the store holds it
# (a zoned timestamp and a nested struct are converted at every read).
PLAIN = StructType([StructField("n", LongType()), StructField("s", StringType())])
CONVERTED = StructType([StructField("ts", TimestampType()),
                        StructField("inner", StructType([StructField("x", StringType())]))])


def _plain_value(draw_n: int, s: str, form: str):
    return {"tuple": (draw_n, s), "list": [draw_n, s], "row": Row(n=draw_n, s=s), "dict": {"s": s, "n": draw_n},
            "null_field": (draw_n, None)}[form]


def _converted_value(n: int, s: str, form: str):
    ts = datetime.datetime(2026, 1, 1) + datetime.timedelta(seconds=n % 10 ** 8)
    return {"tuple": (ts, (s,)), "list": [ts, Row(x=s)], "row": Row(ts=ts, inner={"x": s}),
            "dict": {"inner": Row(x=s), "ts": ts}, "null_field": (None, (s,))}[form]


OPS_BATCHED = st.lists(st.tuples(
    st.sampled_from(["a", "b", "c", "d"]),
    st.sampled_from(["plain", "converted"]),
    st.sampled_from(["get", "exists", "update", "clear"]),
    st.integers(-(2 ** 40), 2 ** 40), st.text(max_size=3),
    st.sampled_from(["tuple", "list", "row", "dict", "null_field"])), max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(OPS_BATCHED, min_size=1, max_size=4))
def test_batched_value_states_read_and_store_what_per_key_ones_do(tmp_path_factory, batches):
    """The runner's batched value states against the store's per-key ones: the same calls
    return the same values in every batch (loaded or not, written before or not) and leave
    the same stored state."""
    descriptors = [ValueStateDescriptor("plain", arrow_type(PLAIN)),
                   ValueStateDescriptor("converted", arrow_type(CONVERTED))]
    layout = layout_of(descriptors)
    paths = [tmp_path_factory.mktemp("per_key"), tmp_path_factory.mktemp("batched")]
    stores = [open_store(p, layout) for p in paths]
    make = {"plain": _plain_value, "converted": _converted_value}
    for ops in batches:
        seen = []
        for store, batched in zip(stores, (False, True), strict=True):
            handle = StoreHandle(store, None, batched=batched)
            states = {"plain": handle.getValueState("plain"), "converted": handle.getValueState("converted")}
            loaded = sorted({k for k, *_ in ops})[:2]  # some keys come in the batch's lookup, others not
            if batched and loaded:
                keys = pa.table({"k": loaded})
                store.prefetch(keys)
                handle.load(keys)
            reads = []
            for key, name, op, n, s, form in ops:
                store.set_current_key((key,))
                state = states[name]
                if op == "get":
                    reads.append(state.get())
                elif op == "exists":
                    reads.append(state.exists())
                elif op == "update":
                    state.update(make[name](n, s, form))
                else:
                    state.clear()
            handle.drain()
            store.checkpoint()
            seen.append(reads)
        assert seen[0] == seen[1]
    views = [{name: sorted(map(str, open_store(p, layout).live_view(name, range(MAX_PARALLELISM)).rows()))
              for name in ("plain", "converted")} for p in paths]
    assert views[0] == views[1]
