"""Example-based tests of the state handles, per kind, through both APIs.

Each kind is used through the per-key API (``set_current_key`` then ``get``/``update``...)
and the batched Arrow API (``get_batch``/``update_batch``...), over a ``DirectoryStateTable``
in a temporary directory and a fake clock. The failure paths check three things: the
error class and a message naming what is at fault; that the failed call wrote nothing
(the next checkpoint and a reopen show exactly the state committed before it); and, for
corrupt segments, that only the key groups of the broken file become unreadable.
The seeded model-based test of the same store is ``test_store_model.py``.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from statestore import (
    AggregatingStateDescriptor,
    AverageAggregate,
    CheckpointNotFoundError,
    CorruptSegmentError,
    DirectoryStateTable,
    KeyGroupOutOfRangeError,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    SchemaMismatchError,
    StateLayout,
    StateStore,
    StateStoreError,
    StoreConfig,
    TtlConfig,
    TtlUpdateType,
    UnsupportedKeyTypeError,
    ValueStateDescriptor,
    assign_key_group,
    assign_key_groups,
)
from statestore.descriptors import StateKind
from statestore.paths import DATA_DIR, parse_segment_name

MAX_PARALLELISM = 8
TTL_MS = 100
KEYS = ["a", "b", "c", "d", "e"]
KEY_SCHEMA = pa.schema([("k", pa.string())])

DESCRIPTORS = (
    ValueStateDescriptor("v", pa.int64()),
    ListStateDescriptor("l", pa.string()),
    MapStateDescriptor("m", pa.int64(), key_type=pa.string()),
    ReducingStateDescriptor("rsum", pa.int64(), reduce_fn=lambda a, b: a + b, vectorized="sum"),
    ReducingStateDescriptor("rmin", pa.int64(), reduce_fn=min, vectorized="min"),
    ReducingStateDescriptor("rmax", pa.int64(), reduce_fn=max, vectorized="max"),
    # Not commutative, so the order in which values are reduced shows.
    ReducingStateDescriptor("rcat", pa.string(), reduce_fn=lambda a, b: a + b),
    AggregatingStateDescriptor("avg", agg_fn=AverageAggregate()),
)


class FakeClock:
    def __init__(self, now_ms: int = 1_000_000):
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def keys_table(keys: list, name: str = "k", dtype: pa.DataType = pa.string()) -> pa.Table:
    return pa.table({name: pa.array(keys, dtype)})


def open_store(path: Path, descriptors=DESCRIPTORS, key_schema: pa.Schema = KEY_SCHEMA, *,
               clock: FakeClock | None = None, task_index: int = 0, parallelism: int = 1,
               **config) -> StateStore:
    layout = StateLayout.of(key_schema, descriptors, MAX_PARALLELISM)
    table = DirectoryStateTable(path, layout)
    return StateStore(table, task_index=task_index, parallelism=parallelism,
                      config=StoreConfig(clock_ms=clock or FakeClock(), **config))


def snapshot(store: StateStore, keys: list) -> dict[str, list]:
    """Every variable of every key, read with the batched API."""
    table = keys_table(keys)
    out: dict[str, list] = {}
    for d in store.layout.descriptors:
        state = store.get_state(d.name)
        if d.kind is StateKind.MAP:
            maps: list[dict] = [{} for _ in keys]
            for row in state.items_batch(table).to_pylist():
                maps[row["_row"]][row[d.user_key_column]] = row[d.value_column]
            out[d.name] = maps
        else:
            out[d.name] = state.get_batch(table).to_pylist()
    return out


def keys_in_key_group(key_group: int, count: int) -> list[str]:
    candidates = [f"key{i}" for i in range(20 * MAX_PARALLELISM * count)]
    groups = assign_key_groups(keys_table(candidates), MAX_PARALLELISM)
    found = [k for k, g in zip(candidates, groups.tolist(), strict=True) if g == key_group][:count]
    assert len(found) == count and assign_key_group((found[0],), KEY_SCHEMA, MAX_PARALLELISM) == key_group
    return found


@pytest.fixture
def store(tmp_path) -> StateStore:
    return open_store(tmp_path)


# --------------------------------------------------------------------------- prepared keys


def test_prepared_keys_are_reused_for_equal_keys_only(tmp_path):
    """The last keys prepared are remembered: equal keys (another table, a record batch,
    extra columns) get the same key groups without hashing; other keys of the same count
    or of a castable other type are hashed."""
    store = open_store(tmp_path, parallelism=1)
    names = [f"key{i}" for i in range(50)]
    table, kgs = store.prepare_keys(keys_table(names))
    assert kgs.tolist() == assign_key_groups(keys_table(names), MAX_PARALLELISM).tolist()
    again = pa.table({"v": list(range(50)), "k": list(names)})  # another table, extra column first
    assert store.prepare_keys(again)[0] is table and store.prepare_keys(again)[1] is kgs
    assert store.prepare_keys(again.to_batches()[0].select(["k"]))[1] is kgs
    reversed_table, reversed_kgs = store.prepare_keys(keys_table(names[::-1]))
    assert reversed_table.column("k").to_pylist() == names[::-1]
    assert reversed_kgs.tolist() == kgs.tolist()[::-1]
    other = [f"other{i}" for i in range(50)]
    assert store.prepare_keys(keys_table(other))[1].tolist() == assign_key_groups(
        keys_table(other), MAX_PARALLELISM).tolist()

    int_store = open_store(tmp_path / "ints", key_schema=pa.schema([("k", pa.int64())]))
    wide, wide_kgs = int_store.prepare_keys(keys_table([1, 2, 3], dtype=pa.int64()))
    narrow, narrow_kgs = int_store.prepare_keys(keys_table([1, 2, 3], dtype=pa.int32()))
    assert narrow.schema == wide.schema and narrow_kgs.tolist() == wide_kgs.tolist()
    with pytest.raises(ValueError, match="null"):
        int_store.prepare_keys(pa.table({"k": pa.array([1, None, 3], pa.int64())}))


def test_a_warm_lookup_of_many_keys_hashes_only_its_misses_and_still_refuses_other_tasks_keys(tmp_path):
    """A batched read of many keys (``StateReader.lookup`` without key groups) joins the
    cached views first: the keys found are this task's; the others are hashed, so a key of
    another task's key group is refused as before, and new keys read as absent."""
    store = open_store(tmp_path, task_index=0, parallelism=2)  # key groups 0..3 of 8
    names = [f"key{i}" for i in range(400)]
    groups = assign_key_groups(keys_table(names), MAX_PARALLELISM).tolist()
    mine = [n for n, g in zip(names, groups, strict=True) if g < 4]
    theirs = next(n for n, g in zip(names, groups, strict=True) if g >= 4)
    value = store.get_state("v")
    value.update_batch(keys_table(mine[:100]), list(range(100)))
    store.checkpoint()
    reader = StateStore(store.table, task_index=0, parallelism=2).get_state("v")
    assert reader.get_batch(keys_table(mine[:100])).to_pylist() == list(range(100))  # warm now
    assert reader.get_batch(keys_table(mine[::-1])).to_pylist() == [
        i if i < 100 else None for i in range(len(mine))][::-1]
    with pytest.raises(KeyGroupOutOfRangeError):
        reader.get_batch(keys_table([*mine[:100], theirs]))


def test_given_key_groups_are_taken_but_still_checked_for_ownership_and_count(tmp_path):
    store = open_store(tmp_path, task_index=0, parallelism=2)  # key groups 0..3 of 8
    names = [f"key{i}" for i in range(200)]
    groups = assign_key_groups(keys_table(names), MAX_PARALLELISM)
    mine = [n for n, g in zip(names, groups.tolist(), strict=True) if g < 4][:20]
    mine_groups = assign_key_groups(keys_table(mine), MAX_PARALLELISM)
    table, kgs = store.prepare_keys(keys_table(mine), key_groups=mine_groups)
    assert kgs.tolist() == mine_groups.tolist() and table.column("k").to_pylist() == mine
    with pytest.raises(ValueError, match="20 key groups for 19 keys"):
        store.prepare_keys(keys_table(mine[:19]), key_groups=mine_groups)
    with pytest.raises(KeyGroupOutOfRangeError):
        store.prepare_keys(keys_table(mine), key_groups=np.full(len(mine), 7))
    theirs = [n for n, g in zip(names, groups.tolist(), strict=True) if g >= 4][:5]
    with pytest.raises(KeyGroupOutOfRangeError):
        store.prepare_keys(keys_table(theirs))  # hashed: refused as before


# --------------------------------------------------------------------------- absent state


def test_absent_state_reads_as_none_empty_list_and_empty_map(store):
    store.set_current_key("a")
    for name in ("v", "rsum", "rcat", "avg"):
        assert store.get_state(name).get() is None
        assert not store.get_state(name).exists()
    assert store.get_state("l").get() == []
    m = store.get_state("m")
    assert (m.items(), m.keys(), m.values(), m.get("x"), m.contains("x"), m.is_empty()) == ([], [], [], None, False,
                                                                                            True)
    assert snapshot(store, ["a", "b"]) == {
        "v": [None, None], "l": [[], []], "m": [{}, {}], "rsum": [None, None], "rmin": [None, None],
        "rmax": [None, None], "rcat": [None, None], "avg": [None, None],
    }
    assert store.get_state("m").get_batch(keys_table(["a"]), ["x"]).to_pylist() == [None]


@pytest.mark.parametrize("name", ["v", "l", "m", "rsum", "avg"])
def test_batched_calls_on_no_keys_return_empty_results(store, name):
    """A micro-batch can leave a task without rows; regression: list and map reads raised."""
    state = store.get_state(name)
    none = keys_table([])
    if name == "m":
        assert state.items_batch(none).num_rows == 0
        assert state.get_batch(none, []).to_pylist() == []
        state.put_batch(none, [], [])
    else:
        assert state.get_batch(none).to_pylist() == []
        (state.update_batch if name in ("v", "l") else state.add_batch)(none, [])
    state.clear_batch(none)
    assert store.checkpoint().checkpoint_id == 1


# --------------------------------------------------------------------------- value


def test_value_update_clear_per_key_and_batched_agree(tmp_path, store):
    v = store.get_state("v")
    store.set_current_key("a")
    v.update(1)
    v.update_batch(keys_table(["b", "c"]), [2, 3])
    assert v.get() == 1
    store.set_current_key("b")
    assert v.get() == 2
    v.clear()
    assert v.get() is None and not v.exists()
    assert v.get_batch(keys_table(["c", "b", "a", "c"])).to_pylist() == [3, None, 1, 3]
    store.checkpoint()
    v.clear_batch(keys_table(["a"]))
    assert v.get_batch(keys_table(["a", "c"])).to_pylist() == [None, 3]
    store.checkpoint()
    assert open_store(tmp_path).get_state("v").get_batch(keys_table(["a", "b", "c"])).to_pylist() == [None, None, 3]


def test_value_update_batch_with_a_repeated_key_keeps_the_last_value(store):
    v = store.get_state("v")
    v.update_batch(keys_table(["a", "b", "a", "a"]), [1, 2, 3, 4])
    assert v.get_batch(keys_table(["a", "b"])).to_pylist() == [4, 2]
    store.checkpoint()
    store.set_current_key("a")
    assert v.get() == 4


def test_per_key_write_then_batched_write_then_per_key_read(store):
    """Per-key writes wait in an overlay; a batched call must see them and come after them."""
    v = store.get_state("v")
    store.set_current_key("a")
    v.update(1)
    v.update_batch(keys_table(["a"]), [2])
    assert v.get() == 2
    v.update(3)
    assert v.get_batch(keys_table(["a"])).to_pylist() == [3]


@pytest.mark.parametrize("cache_size_bytes_max", [1, 1 << 20], ids=["evicting_cache", "cache"])
def test_per_key_reads_after_every_kind_of_change_see_it(tmp_path, cache_size_bytes_max):
    """Per-key reads go through remembered point indexes; a batched write, a sealed per-key
    write, a completed checkpoint, an eviction and a restore must each make them see the change."""
    store = open_store(tmp_path, cache_size_bytes_max=cache_size_bytes_max)
    v, m = store.get_state("v"), store.get_state("m")
    store.set_current_key("a")
    assert v.get() is None and m.get("x") is None  # remembered: nothing
    v.update_batch(keys_table(["a"]), [1])
    m.put_batch(keys_table(["a"]), ["x"], [10])
    store.set_current_key("a")
    assert v.get() == 1 and m.get("x") == 10
    store.set_current_key("b")
    v.update(2)
    v.get_batch(keys_table(["c"]))  # seals b's write into the memtable
    store.set_current_key("b")
    assert v.get() == 2
    info = store.checkpoint()
    store.set_current_key("a")
    assert v.get() == 1 and m.get("x") == 10
    v.update_batch(keys_table(["a"]), [3])
    store.checkpoint()
    store.set_current_key("a")
    assert v.get() == 3
    store.restore(info.checkpoint_id)
    store.set_current_key("a")
    assert v.get() == 1


# --------------------------------------------------------------------------- list


@pytest.mark.parametrize("cache_size_bytes_max", [1, 1 << 20], ids=["evicting_cache", "cache"])
def test_list_order_is_kept_across_checkpoints_and_reopen(tmp_path, cache_size_bytes_max):
    """Reads between the appends make cached views merge with newer entries (the order of
    merged views is what can go wrong); a 1-byte cache makes every read reload instead."""
    store = open_store(tmp_path, cache_size_bytes_max=cache_size_bytes_max)
    lst = store.get_state("l")
    want: list[str] = []
    for step in range(4):
        store.set_current_key("a")
        lst.add(f"{step}.1")
        assert lst.get() == [*want, f"{step}.1"]
        lst.add_all([f"{step}.2", f"{step}.3"])
        lst.add_batch(keys_table(["a", "b", "a"]), [f"{step}.4", "x", f"{step}.5"])
        want += [f"{step}.{i}" for i in range(1, 6)]
        assert lst.get_batch(keys_table(["a"])).to_pylist() == [want]
        if step % 2:
            store.checkpoint()
    store.checkpoint()
    reopened = open_store(tmp_path, cache_size_bytes_max=cache_size_bytes_max)
    got = reopened.get_state("l").get_batch(keys_table(["b", "a"])).to_pylist()
    assert got == [["x"] * 4, want]
    reopened.set_current_key("a")
    assert reopened.get_state("l").get() == want


def test_list_update_replaces_and_clear_empties(store):
    lst = store.get_state("l")
    lst.add_batch(keys_table(["a", "a", "b"]), ["1", "2", "3"])
    store.checkpoint()
    store.set_current_key("a")
    lst.update(["9"])
    assert lst.get() == ["9"]
    lst.update_batch(keys_table(["b"]), [["7", "8"]])
    store.set_current_key("b")
    assert lst.get() == ["7", "8"]
    lst.clear()
    lst.add("z")
    assert lst.get_batch(keys_table(["a", "b"])).to_pylist() == [["9"], ["z"]]
    lst.update_batch(keys_table(["a"]), [[]])
    assert lst.get_batch(keys_table(["a"])).to_pylist() == [[]]
    store.set_current_key("a")
    assert not lst.exists()


def test_list_update_batch_with_a_repeated_key_keeps_the_last_list(store):
    """Regression: the lists of a repeated key were concatenated ([1, 2] instead of [2])."""
    lst = store.get_state("l")
    lst.add_batch(keys_table(["a"]), ["0"])
    lst.update_batch(keys_table(["a", "b", "a"]), [["1"], ["b"], ["2", "3"]])
    assert lst.get_batch(keys_table(["a", "b"])).to_pylist() == [["2", "3"], ["b"]]
    store.checkpoint()
    store.set_current_key("a")
    assert lst.get() == ["2", "3"]


# --------------------------------------------------------------------------- map


@pytest.mark.parametrize("batched", [False, True], ids=["per_key", "batched"])
def test_map_clear_then_put_keeps_only_the_new_entries(store, batched):
    m = store.get_state("m")
    m.put_batch(keys_table(["a", "a", "b"]), ["x", "y", "x"], [1, 2, 3])
    store.checkpoint()
    if batched:
        m.clear_batch(keys_table(["a"]))
        m.put_batch(keys_table(["a"]), ["z"], [9])
    else:
        store.set_current_key("a")
        m.clear()
        m.put("z", 9)
    assert snapshot(store, ["a", "b"])["m"] == [{"z": 9}, {"x": 3}]
    store.checkpoint()
    store.set_current_key("a")
    assert sorted(m.items()) == [("z", 9)]
    assert m.get("x") is None and m.contains("z")


def test_map_put_remove_and_repeated_entries(store):
    m = store.get_state("m")
    store.set_current_key("a")
    m.put_all({"x": 1, "y": 2})
    m.remove("x")
    assert (m.get("x"), m.get("y"), sorted(m.keys()), m.values()) == (None, 2, ["y"], [2])
    m.put_batch(keys_table(["a", "a", "b"]), ["y", "y", "y"], [5, 6, 7])  # (a, y) twice: the last wins
    m.remove_batch(keys_table(["b", "b"]), ["y", "q"])
    assert m.get_batch(keys_table(["a", "b", "a"]), ["y", "y", "x"]).to_pylist() == [6, None, None]
    store.checkpoint()
    store.set_current_key("b")
    assert m.is_empty()
    items = m.items_batch(keys_table(["b", "a"])).to_pylist()
    assert items == [{"_row": 1, "mk_m": "y", "v_m": 6}]


# --------------------------------------------------------------------------- reducing, aggregating


@pytest.mark.parametrize(("name", "fold"), [("rsum", sum), ("rmin", min), ("rmax", max)])
def test_vectorized_reducing_matches_per_key_adds(tmp_path, name, fold):
    batched_store = open_store(tmp_path / "batched")
    batched = batched_store.get_state(name)
    per_key_store = open_store(tmp_path / "per_key")
    per_key = per_key_store.get_state(name)
    rows = [("a", 5), ("b", -2), ("a", 7), ("a", -3), ("b", 4), ("c", 0)]
    batched.add_batch(keys_table([k for k, _ in rows[:3]]), [v for _, v in rows[:3]])
    batched_store.checkpoint()  # the rest reduces with a stored value
    batched.add_batch(keys_table([k for k, _ in rows[3:]]), [v for _, v in rows[3:]])
    for k, v in rows:
        per_key_store.set_current_key(k)
        per_key.add(v)
    want = [fold(v for k2, v in rows if k2 == k) for k in ("a", "b", "c")] + [None]
    assert batched.get_batch(keys_table(["a", "b", "c", "d"])).to_pylist() == want
    assert per_key.get_batch(keys_table(["a", "b", "c", "d"])).to_pylist() == want


def test_reducing_with_a_python_function_reduces_in_row_order(store):
    cat = store.get_state("rcat")
    store.set_current_key("a")
    cat.add("1")
    store.checkpoint()
    cat.add_batch(keys_table(["a", "b", "a", "b", "a"]), ["2", "x", "3", "y", "4"])
    store.set_current_key("a")
    cat.add("5")
    assert cat.get() == "12345"
    assert cat.get_batch(keys_table(["b", "a"])).to_pylist() == ["xy", "12345"]


def test_aggregating_average_per_key_and_batched(tmp_path, store):
    avg = store.get_state("avg")
    store.set_current_key("a")
    avg.add(1.0)
    avg.add(2.0)
    avg.add_batch(keys_table(["a", "b", "a"]), [6.0, 10.0, 3.0])
    assert avg.get_batch(keys_table(["a", "b", "c"])).to_pylist() == [3.0, 10.0, None]
    store.set_current_key("b")
    avg.merge_accumulator({"sum": 20.0, "count": 2})
    assert avg.get() == 10.0
    store.checkpoint()
    reopened = open_store(tmp_path)
    reopened.set_current_key("a")
    assert reopened.get_state("avg").get() == 3.0


# --------------------------------------------------------------------------- keys


def test_two_key_columns_are_one_key(tmp_path):
    schema = pa.schema([("name", pa.string()), ("n", pa.int32())])
    store = open_store(tmp_path, key_schema=schema)
    v, lst = store.get_state("v"), store.get_state("l")
    keys = pa.table({"name": ["a", "a", "b"], "n": pa.array([1, 2, 1], pa.int32())})
    v.update_batch(keys, [1, 2, 3])
    store.set_current_key(("a", 2))
    lst.add("only a/2")
    store.checkpoint()
    reopened = open_store(tmp_path, key_schema=schema)
    for key, want in [(("a", 1), 1), (("a", 2), 2), (("b", 1), 3), (("b", 2), None)]:
        reopened.set_current_key(key)
        assert reopened.get_state("v").get() == want
    assert reopened.get_state("l").get_batch(keys).to_pylist() == [[], ["only a/2"], []]
    # Columns in another order, and as a RecordBatch: matched by name.
    swapped = pa.RecordBatch.from_pydict({"n": pa.array([1], pa.int32()), "name": ["b"]})
    assert reopened.get_state("v").get_batch(swapped).to_pylist() == [3]


KEY_TYPES = {
    "int8": (pa.int8(), [1, -1, 127]),
    "int16": (pa.int16(), [1, -1, 30_000]),
    "int32": (pa.int32(), [1, -1, 2**31 - 1]),
    "int64": (pa.int64(), [1, -1, 2**40]),
    "date": (pa.date32(), [dt.date(2024, 2, 29), dt.date(1969, 12, 31), dt.date(1970, 1, 1)]),
    "timestamp": (pa.timestamp("us"), [dt.datetime(2024, 1, 1, 12, 0, 0, 1), dt.datetime(1960, 1, 1),
                                       dt.datetime(2024, 1, 1, 12)]),
    "timestamp_utc": (pa.timestamp("us", tz="UTC"), [dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
                                                     dt.datetime(1960, 1, 1, tzinfo=dt.UTC),
                                                     dt.datetime(2000, 1, 1, tzinfo=dt.UTC)]),
    "binary": (pa.binary(), [b"a", b"\x00\xff", b""]),
    "bool": (pa.bool_(), [True, False]),
    "string": (pa.string(), ["", "é", "a b"]),
}


@pytest.mark.parametrize("type_name", sorted(KEY_TYPES))
def test_every_key_type_round_trips_per_key_and_batched(tmp_path, type_name):
    dtype, keys = KEY_TYPES[type_name]
    schema = pa.schema([("k", dtype)])
    store = open_store(tmp_path, key_schema=schema)
    table = keys_table(keys, dtype=dtype)
    store.get_state("v").update_batch(table, list(range(len(keys))))
    for i, key in enumerate(keys):
        store.set_current_key(key)
        store.get_state("l").add(str(i))
        store.get_state("m").put("x", i)
    store.checkpoint()
    reopened = open_store(tmp_path, key_schema=schema)
    for i, key in enumerate(keys):
        reopened.set_current_key(key)
        assert reopened.get_state("v").get() == i
        assert reopened.get_state("l").get() == [str(i)]
        assert reopened.get_state("m").items() == [("x", i)]
    assert reopened.get_state("v").get_batch(table).to_pylist() == list(range(len(keys)))
    assert reopened.get_state("l").get_batch(table).to_pylist() == [[str(i)] for i in range(len(keys))]


@pytest.mark.parametrize(("declared", "given", "values"), [
    (pa.string(), pa.large_string(), ["a", "b"]),
    (pa.string(), pa.dictionary(pa.int32(), pa.string()), ["a", "b"]),
    (pa.int64(), pa.int32(), [1, 2]),
    (pa.timestamp("us"), pa.timestamp("ms"), [dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 2)]),
])
def test_keys_of_a_compatible_type_find_the_same_state(tmp_path, declared, given, values):
    store = open_store(tmp_path, key_schema=pa.schema([("k", declared)]))
    store.get_state("v").update_batch(keys_table(values, dtype=declared), [1, 2])
    given_keys = pa.table({"k": pa.array(values).cast(given)})
    assert store.get_state("v").get_batch(given_keys).to_pylist() == [1, 2]


# --------------------------------------------------------------------------- TTL

TTL_DESCRIPTORS = (
    ValueStateDescriptor("tv", pa.int64(), ttl=TtlConfig(TTL_MS)),
    ValueStateDescriptor("rv", pa.int64(), ttl=TtlConfig(TTL_MS, TtlUpdateType.ON_READ_AND_WRITE)),
    ListStateDescriptor("tl", pa.int64(), ttl=TtlConfig(TTL_MS)),
    ListStateDescriptor("rl", pa.int64(), ttl=TtlConfig(TTL_MS, TtlUpdateType.ON_READ_AND_WRITE)),
    MapStateDescriptor("rm", pa.int64(), key_type=pa.string(),
                       ttl=TtlConfig(TTL_MS, TtlUpdateType.ON_READ_AND_WRITE)),
)


def test_on_create_and_write_expires_at_write_time_plus_ttl_whatever_the_reads(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path, TTL_DESCRIPTORS, clock=clock)
    tv, tl = store.get_state("tv"), store.get_state("tl")
    store.set_current_key("a")
    tv.update(1)
    tl.add(1)
    clock.now_ms += TTL_MS // 2
    tl.add(2)
    assert (tv.get(), tl.get()) == (1, [1, 2])  # a read does not extend ON_CREATE_AND_WRITE
    store.checkpoint()
    clock.now_ms += TTL_MS // 2 - 1
    assert tv.get_batch(keys_table(["a"])).to_pylist() == [1]
    clock.now_ms += 1  # exactly write time + ttl: expired
    assert tv.get_batch(keys_table(["a"])).to_pylist() == [None]
    store.set_current_key("a")
    assert (tv.get(), tl.get()) == (None, [2])  # list elements expire one by one
    clock.now_ms += TTL_MS // 2
    assert open_store(tmp_path, TTL_DESCRIPTORS, clock=clock).get_state("tl").get_batch(
        keys_table(["a"])).to_pylist() == [[]]


@pytest.mark.parametrize("sealed", [False, True], ids=["in_overlay", "sealed"])
def test_on_read_and_write_read_pushes_expiry(tmp_path, sealed):
    """Regression (in_overlay): a per-key read of a value not yet sealed did not refresh it."""
    clock = FakeClock()
    store = open_store(tmp_path, TTL_DESCRIPTORS, clock=clock)
    rv, rm = store.get_state("rv"), store.get_state("rm")
    store.set_current_key("a")
    rv.update(1)
    rm.put("x", 1)
    if sealed:
        store.checkpoint()
    for _ in range(3):
        clock.now_ms += TTL_MS - 1
        store.set_current_key("a")
        assert (rv.get(), rm.get("x")) == (1, 1)
    clock.now_ms += TTL_MS - 1
    assert rv.get_batch(keys_table(["a"])).to_pylist() == [1]
    clock.now_ms += TTL_MS
    store.set_current_key("a")
    assert (rv.get(), rm.get("x")) == (None, None)


def test_on_read_and_write_batched_read_pushes_expiry_of_what_it_found(tmp_path):
    clock = FakeClock()
    store = open_store(tmp_path, TTL_DESCRIPTORS, clock=clock)
    rv, rl, rm = store.get_state("rv"), store.get_state("rl"), store.get_state("rm")
    keys = keys_table(["a", "b", "a"])  # a repeated key is refreshed once, not duplicated
    rv.update_batch(keys_table(["a", "b"]), [1, 2])
    rl.add_batch(keys_table(["a", "a", "b"]), [1, 2, 3])
    rm.put_batch(keys_table(["a"]), ["x"], [1])
    store.checkpoint()
    for _ in range(3):
        clock.now_ms += TTL_MS - 1
        assert rv.get_batch(keys).to_pylist() == [1, 2, 1]
        assert rl.get_batch(keys).to_pylist() == [[1, 2], [3], [1, 2]]
        assert rm.get_batch(keys, ["x", "x", "x"]).to_pylist() == [1, None, 1]
    clock.now_ms += TTL_MS
    assert rv.get_batch(keys).to_pylist() == [None, None, None]
    assert rl.get_batch(keys).to_pylist() == [[], [], []]
    assert rm.items_batch(keys).num_rows == 0


# --------------------------------------------------------------------------- bad input

SEEDED = {"v": [1, 2, None, None, None], "l": [["x", "y"], [], [], [], []], "m": [{"u": 1}, {}, {}, {}, {}],
          "rsum": [None, 5, None, None, None], "rmin": [None] * 5, "rmax": [None] * 5, "rcat": [None] * 5,
          "avg": [None] * 5}


@pytest.fixture
def seeded(tmp_path) -> StateStore:
    """A store with a committed checkpoint holding ``SEEDED`` for ``KEYS``."""
    store = open_store(tmp_path)
    store.get_state("v").update_batch(keys_table(["a", "b"]), [1, 2])
    store.get_state("l").add_batch(keys_table(["a", "a"]), ["x", "y"])
    store.get_state("m").put_batch(keys_table(["a"]), ["u"], [1])
    store.get_state("rsum").add_batch(keys_table(["b"]), [5])
    store.checkpoint()
    assert snapshot(store, KEYS) == SEEDED
    return store


def assert_committed_state_intact(store: StateStore, path: Path) -> None:
    """Whatever a failed call left behind gets committed by the next checkpoint: it must be nothing."""
    store.checkpoint()
    assert snapshot(store, KEYS) == SEEDED
    assert snapshot(open_store(path), KEYS) == SEEDED


def key_of_other_task() -> str:
    """A key whose key group task 1 of 2 owns (groups 4..7 of 8)."""
    return keys_in_key_group(MAX_PARALLELISM - 1, 1)[0]


def _per_key(store, key, action):
    store.set_current_key(key)
    action()


BAD_CALLS = {
    # id: (call, error, message pattern)
    "value_wrong_type": (lambda s: s.get_state("v").update_batch(keys_table(["a", "c"]), [7, "seven"]),
                         SchemaMismatchError, r"values for state 'v' do not match the declared type int64"),
    "value_wrong_arrow_type": (lambda s: s.get_state("v").update_batch(keys_table(["a"]), pa.array([b"\x01"])),
                               SchemaMismatchError, r"declared type int64"),
    "per_key_value_wrong_type": (lambda s: _per_key(s, "a", lambda: s.get_state("v").update("seven")),
                                 SchemaMismatchError, r"state 'v': value 'seven' does not match"),
    "map_wrong_user_key_type": (lambda s: s.get_state("m").put_batch(keys_table(["a"]), [3], [1]),
                                SchemaMismatchError, r"user keys for map 'm'"),
    "per_key_map_wrong_value_type": (lambda s: _per_key(s, "a", lambda: s.get_state("m").put("u", [1])),
                                     SchemaMismatchError, r"map 'm': value"),
    "value_null": (lambda s: s.get_state("v").update_batch(keys_table(["a", "c"]), [7, None]),
                   ValueError, r"1 null\(s\); state values must not be null"),
    "per_key_value_null": (lambda s: _per_key(s, "a", lambda: s.get_state("v").update(None)),
                           ValueError, r"must not be null"),
    "list_null_element": (lambda s: s.get_state("l").update_batch(keys_table(["a"]), [["z", None]]),
                          ValueError, r"elements for state 'l' contain 1 null"),
    "per_key_list_null_element": (lambda s: _per_key(s, "a", lambda: s.get_state("l").update(["z", None])),
                                  ValueError, r"list element must not be null"),
    "per_key_list_add_all_wrong_type": (lambda s: _per_key(s, "a", lambda: s.get_state("l").add_all(["z", 3])),
                                        SchemaMismatchError, r"list element 3"),
    "per_key_map_remove_null": (lambda s: _per_key(s, "a", lambda: s.get_state("m").remove(None)),
                                ValueError, r"user key must not be null"),
    "reducing_null": (lambda s: s.get_state("rsum").add_batch(keys_table(["b", "b"]), [1, None]),
                      ValueError, r"null"),
    "null_key": (lambda s: s.get_state("v").update_batch(pa.table({"k": ["a", None]}), [7, 8]),
                 ValueError, r"key column 'k' has 1 null value"),
    "per_key_null_key": (lambda s: s.set_current_key(None), ValueError, r"null value"),
    "routed_null_key": (lambda s: s.check_routed_keys(pa.table({"k": ["a", None]}), np.array([0, 0])),
                        ValueError, r"key \(None,\) has a null value"),
    "missing_key_column": (lambda s: s.get_state("v").update_batch(pa.table({"key": ["a"]}), [7]),
                           SchemaMismatchError, r"keys lack key column\(s\) \['k'\]"),
    "uncastable_key_type": (lambda s: s.get_state("v").update_batch(pa.table({"k": pa.array([1.5])}), [7]),
                            UnsupportedKeyTypeError, r"key column 'k' has type double"),
    "lengths_differ": (lambda s: s.get_state("v").update_batch(keys_table(["a", "c"]), [7]),
                       ValueError, r"1 values for 2 keys"),
    "undeclared_state": (lambda s: s.get_state("nope"), StateStoreError, r"state 'nope' is not declared"),
    "descriptor_differs": (lambda s: s.get_state(ValueStateDescriptor("v", pa.string())), StateStoreError,
                           r"state 'v' is declared as"),
    "restore_missing_checkpoint": (lambda s: s.restore(42), CheckpointNotFoundError,
                                   r"checkpoint 42 is not retained .* \(retained: \[1\]\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_a_clear_error_and_writes_nothing(seeded, tmp_path, case):
    call, error, pattern = BAD_CALLS[case]
    with pytest.raises(error, match=pattern):
        call(seeded)
    assert [c.checkpoint_id for c in seeded.table.list_checkpoints()] == [1]
    assert_committed_state_intact(seeded, tmp_path)


def test_per_key_write_of_a_wrong_type_does_not_lose_other_keys_writes(seeded, tmp_path):
    """Regression: a wrong-typed per-key value was accepted, then failed the next seal with a raw
    ArrowInvalid and dropped every pending per-key write of that state, other keys' too."""
    v = seeded.get_state("v")
    seeded.set_current_key("c")
    v.update(30)
    seeded.set_current_key("a")
    with pytest.raises(SchemaMismatchError):
        v.update("x")
    assert v.get_batch(keys_table(["a", "c"])).to_pylist() == [1, 30]


def test_key_of_another_task_is_refused_and_nothing_is_written(seeded, tmp_path):
    task0 = StateStore(seeded.table, task_index=0, parallelism=2, config=StoreConfig(clock_ms=FakeClock()))
    assert task0.key_group_range.end == MAX_PARALLELISM // 2 - 1
    other = key_of_other_task()
    own = keys_in_key_group(0, 1)[0]
    with pytest.raises(KeyGroupOutOfRangeError, match=r"key group 7 is not owned by task 0 of 2"):
        task0.get_state("v").update_batch(keys_table([own, other]), [1, 2])
    with pytest.raises(KeyGroupOutOfRangeError, match=r"key group 7"):
        task0.get_state("l").get_batch(keys_table([other]))
    with pytest.raises(KeyGroupOutOfRangeError, match=r"key group 7"):
        task0.set_current_key(other)
    with pytest.raises(KeyGroupOutOfRangeError, match=r"key group 7 is not owned by task 0 of 2"):
        task0.check_routed_keys(keys_table([own, other]), np.array([0, 7]))
    task0.check_routed_keys(keys_table([own]), np.array([0]))  # owned: no error
    task0.checkpoint()
    assert open_store(tmp_path).get_state("v").get_batch(keys_table([own, other])).to_pylist() == [None, None]
    assert snapshot(open_store(tmp_path), KEYS) == SEEDED


def test_per_key_api_without_a_current_key_raises(store):
    with pytest.raises(StateStoreError, match=r"no current key: call set_current_key"):
        store.get_state("v").get()
    with pytest.raises(StateStoreError, match=r"no current key"):
        store.get_state("l").add("x")
    store.set_current_key("a")
    store.restore()  # a restore forgets the current key
    with pytest.raises(StateStoreError, match=r"no current key"):
        store.get_state("m").put("u", 1)
    assert store.stats()["memtable_entries"] == 0


def test_unsupported_key_type_is_refused_when_the_layout_is_declared():
    with pytest.raises(UnsupportedKeyTypeError, match=r"key column 'price' has type double"):
        StateLayout.of(pa.schema([("price", pa.float64())]), DESCRIPTORS, MAX_PARALLELISM)
    with pytest.raises(UnsupportedKeyTypeError, match=r"'d' has type decimal"):
        StateLayout.of(pa.schema([("k", pa.string()), ("d", pa.decimal128(10, 2))]), DESCRIPTORS, MAX_PARALLELISM)


# --------------------------------------------------------------------------- corrupt segments


def segment_of_checkpoint(path: Path, checkpoint_id: int) -> Path:
    files = [f for f in (path / DATA_DIR).glob("seg-*.parquet") if parse_segment_name(f.name)[0] == checkpoint_id]
    assert len(files) == 1, files
    return files[0]


def truncate(f: Path) -> None:
    os.truncate(f, f.stat().st_size // 2)


def scribble(f: Path) -> None:
    f.write_bytes(np.random.default_rng(7).bytes(f.stat().st_size))  # same size, no Parquet in it


@pytest.mark.parametrize("damage", [truncate, scribble, Path.unlink], ids=["truncated", "garbage", "deleted"])
def test_corrupt_segment_fails_its_key_groups_only(tmp_path, damage):
    broken_key, other_key = keys_in_key_group(1, 1)[0], keys_in_key_group(6, 1)[0]
    store = open_store(tmp_path)
    store.get_state("v").update_batch(keys_table([broken_key]), [1])
    store.checkpoint()  # checkpoint 1: one file, key group 1 only
    store.get_state("v").update_batch(keys_table([other_key]), [2])
    store.get_state("l").add_batch(keys_table([other_key]), ["x"])
    store.checkpoint()  # checkpoint 2: one file, key group 6 only
    checkpoints = store.table.list_checkpoints()
    bad = segment_of_checkpoint(tmp_path, 1)
    damage(bad)

    reopened = open_store(tmp_path)
    v = reopened.get_state("v")
    for _ in range(2):  # a failed load must not leave an empty (wrong) view in the cache
        with pytest.raises(CorruptSegmentError, match=re.escape(str(bad))):
            v.get_batch(keys_table([broken_key]))
    reopened.set_current_key(broken_key)
    with pytest.raises(CorruptSegmentError, match=re.escape(str(bad))):
        v.get()
    with pytest.raises(CorruptSegmentError, match=r"of checkpoint 1 cannot be read"):
        v.get_batch(keys_table([other_key, broken_key]))
    assert v.get_batch(keys_table([other_key])).to_pylist() == [2]
    reopened.set_current_key(other_key)
    assert reopened.get_state("l").get() == ["x"]
    assert reopened.table.list_checkpoints() == checkpoints


def test_batched_write_does_not_parse_strings_into_numbers(tmp_path):
    """An Arrow array of strings is a schema mismatch for an int64 state, as a Python list of
    strings is; widening int32 to int64 is fine."""
    layout = StateLayout.of(pa.schema([("k", pa.string())]), [ValueStateDescriptor("n", pa.int64())], 8)
    store = StateStore(DirectoryStateTable(tmp_path, layout))
    n = store.get_state("n")
    keys = pa.table({"k": ["a"]})
    with pytest.raises(SchemaMismatchError, match="string"):
        n.update_batch(keys, pa.array(["12"]))
    n.update_batch(keys, pa.array([12], pa.int32()))
    assert n.get_batch(keys).to_pylist() == [12]


def test_aggregating_get_batch_has_the_result_type_when_all_absent(tmp_path):
    layout = StateLayout.of(pa.schema([("k", pa.string())]),
                            [AggregatingStateDescriptor("avg", agg_fn=AverageAggregate())], 8)
    store = StateStore(DirectoryStateTable(tmp_path, layout))
    got = store.get_state("avg").get_batch(pa.table({"k": ["a", "b"]}))
    assert got.type == pa.float64() and got.to_pylist() == [None, None]


@pytest.mark.parametrize("bad", [0, -1, 1 << 31, "3"])
def test_flush_rejects_checkpoint_ids_that_cannot_order_entries(tmp_path, bad):
    layout = StateLayout.of(pa.schema([("k", pa.string())]), [ValueStateDescriptor("n", pa.int64())], 8)
    store = StateStore(DirectoryStateTable(tmp_path, layout))
    store.get_state("n").update_batch(pa.table({"k": ["a"]}), [1])
    with pytest.raises(ValueError, match="checkpoint_id must be an int"):
        store.flush(bad)
    assert store.checkpoint().checkpoint_id == 1  # the memtable is intact
    assert store.get_state("n").get_batch(pa.table({"k": ["a"]})).to_pylist() == [1]


# --------------------------------------------------------------------------- state names

ODD_NAMES = ["ttl-state", "my state", "a.b", "ünïcode", "1st", "_x", "x" * 5000, "v_count", "tab\there", "DEFAULT"]


def test_any_name_spark_accepts_is_a_state_name_with_safe_distinct_columns(tmp_path):
    descriptors = [ValueStateDescriptor(n, pa.int64()) for n in ODD_NAMES] + [
        MapStateDescriptor("map-of things", pa.int64(), key_type=pa.string())]
    columns = [c for d in descriptors for c in (d.value_column, d.user_key_column) if c is not None]
    assert len(set(columns)) == len(columns)
    assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,62}", c) for c in columns), columns
    assert descriptors[0].value_column.startswith("v_ttl_state_")
    assert ValueStateDescriptor("count", pa.int64()).value_column == "v_count"  # plain names as before
    assert descriptors[-1].display_columns() == {descriptors[-1].value_column: "v_map-of things",
                                                 descriptors[-1].user_key_column: "mk_map-of things"}
    store = open_store(tmp_path, descriptors)
    for i, name in enumerate(ODD_NAMES):
        store.set_current_key(("a",))
        store.get_state(name).update(i)
    store.get_state("map-of things").put("k", 7)
    store.checkpoint()
    reopened = open_store(tmp_path, descriptors)
    reopened.set_current_key(("a",))
    assert [reopened.get_state(n).get() for n in ODD_NAMES] == list(range(len(ODD_NAMES)))
    assert reopened.get_state("map-of things").get("k") == 7


@pytest.mark.parametrize("name", ["", "   ", 7])
def test_blank_state_names_are_refused(name):
    with pytest.raises((ValueError, TypeError), match="state name"):
        ValueStateDescriptor(name, pa.int64())
