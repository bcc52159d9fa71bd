"""Conversions of keys and values (issue 14, defects 7, 8 and 12's OverflowError): nothing is
converted with a loss, and the per-key and batched APIs agree. Each refusal is a
SchemaMismatchError that names what is wrong; nothing refused reaches a checkpoint."""

from __future__ import annotations

import pyarrow as pa
import pytest

from statestore import MapStateDescriptor, ValueStateDescriptor
from statestore.directory_table import DirectoryStateTable
from statestore.errors import SchemaMismatchError
from statestore.layout import StateLayout
from statestore.store import StateStore

POINT = pa.struct([("x", pa.int64()), ("label", pa.string())])
LAYOUT = StateLayout.of(pa.schema([("k", pa.string())]), [
    ValueStateDescriptor("n", pa.int64()), ValueStateDescriptor("ratio", pa.float64()),
    ValueStateDescriptor("point", POINT), MapStateDescriptor("m", pa.int32(), key_type=pa.string())], 16)


@pytest.fixture
def store(tmp_path) -> StateStore:
    return StateStore(DirectoryStateTable(str(tmp_path / "t"), LAYOUT))


def keys(*names) -> pa.Table:
    return pa.table({"k": pa.array(names, pa.string())})


@pytest.mark.parametrize("value", [1.9, 1.0, float("nan"), True, "3", 2**70])
def test_a_long_state_takes_only_integers_that_fit(store: StateStore, value):
    n = store.get_state("n")
    store.set_current_key(("a",))
    with pytest.raises(SchemaMismatchError, match="int64"):
        n.update(value)
    with pytest.raises(SchemaMismatchError, match="int64"):
        n.update_batch(keys("a"), [value])
    assert n.get() is None and n.get_batch(keys("a")).to_pylist() == [None]


def test_nested_and_map_values_are_not_truncated(store: StateStore):
    store.set_current_key(("a",))
    with pytest.raises(SchemaMismatchError, match="truncated"):
        store.get_state("point").update({"x": 2.5, "label": "p"})
    with pytest.raises(SchemaMismatchError, match="truncated"):
        store.get_state("point").update_batch(keys("a"), [{"x": 2.5, "label": "p"}])
    with pytest.raises(SchemaMismatchError, match="truncated"):
        store.get_state("m").put("u", 3.7)
    with pytest.raises(SchemaMismatchError, match="int32"):
        store.get_state("m").put("u", 2**40)  # overflow of the declared int32


def test_lossless_conversions_still_happen(store: StateStore):
    store.set_current_key(("a",))
    store.get_state("ratio").update(3)  # an int into a double, exactly
    store.get_state("n").update_batch(keys("a", "b"), pa.array([1, 2], pa.int32()))  # widening
    store.get_state("point").update({"x": 7, "label": "p"})
    assert store.get_state("n").get_batch(keys("a", "b")).to_pylist() == [1, 2]
    assert store.get_state("ratio").get() == 3.0
    assert store.get_state("point").get() == {"x": 7, "label": "p"}


def test_batched_keys_are_converted_as_per_key_ones(store: StateStore):
    n = store.get_state("n")
    with pytest.raises(SchemaMismatchError, match="key column 'k' has type int64"):
        n.update_batch(pa.table({"k": [1, 2]}), [5, 6])
    with pytest.raises(SchemaMismatchError, match="key column 'k' has type int64"):
        n.get_batch(pa.table({"k": [1, 2]}))
    with pytest.raises(TypeError):
        store.set_current_key((1,))
    n.update_batch(pa.table({"k": pa.array(["a"], pa.large_string())}), [5])  # a wider string type is fine
    assert n.get_batch(keys("a")).to_pylist() == [5]


def test_invalid_utf8_keys_are_refused_at_the_write_and_checkpoints_go_on(store: StateStore):
    bad = pa.array([b"ok", b"\xff\xfe"], pa.binary()).cast(pa.string(), safe=False)  # Spark's CAST(binary AS STRING)
    n = store.get_state("n")
    with pytest.raises(SchemaMismatchError, match="key column 'k' holds a string that is not valid UTF-8"):
        n.update_batch(pa.table({"k": bad}), [1, 2])
    n.update_batch(keys("a"), [1])
    assert store.flush(1)  # the refused write left nothing behind that would fail the checkpoint
    with pytest.raises(SchemaMismatchError, match=r"Invalid UTF8"):
        store.get_state("point").update_batch(keys("b"), pa.array([{"x": 1, "label": b"\xff"}], pa.struct(
            [("x", pa.int64()), ("label", pa.binary())])).cast(POINT, safe=False))


@pytest.mark.parametrize(("key", "column_type"), [((1.0,), "int64"), ((True,), "int64"), ((b"k",), "string"),
                                                   (("1",), "int64"), ((1,), "string")])
def test_a_key_of_another_python_type_is_refused_per_key(tmp_path, key, column_type):
    """Found by fuzzing: a per-key key Arrow would convert (1.0 stored as 1, b"k" as "k") was
    written under the converted key and looked up by the raw one (after a checkpoint, None)."""
    layout = StateLayout.of(pa.schema([("k", getattr(pa, column_type)())]), [ValueStateDescriptor("n", pa.int64())], 16)
    store = StateStore(DirectoryStateTable(str(tmp_path / "t"), layout))
    with pytest.raises(TypeError, match=r"for key column 'k' of type"):
        store.set_current_key(key)
    store.set_current_key(1 if column_type == "int64" else "k")  # the right type is taken
    store.get_state("n").update(5)
    store.checkpoint()
    assert store.get_state("n").get() == 5
