"""Deep nesting (issue 14, defect 12's RecursionError): a value type nested as deep as the store
supports (``MAX_TYPE_DEPTH`` levels of structs or lists) is written, checkpointed, restored by
another store and queried with SQL; one level deeper is refused when declared, with a message
that says what to do, instead of a RecursionError or an Arrow error when first written or read.
A hostile Python value nested 100,000 deep is a SchemaMismatchError."""

from __future__ import annotations

import pyarrow as pa
import pytest

from catalog import IcebergStateTable, connect
from statestore import ListStateDescriptor, MapStateDescriptor, StateLayout, StateStore, ValueStateDescriptor
from statestore.descriptors import MAX_TYPE_DEPTH
from statestore.errors import SchemaMismatchError

KEYS = pa.schema([("k", pa.int64())])


def nested(depth: int, kind: str) -> tuple[pa.DataType, object]:
    t: pa.DataType = pa.int64()
    value: object = 7
    for _ in range(depth):
        t = pa.struct([("f", t)]) if kind == "struct" else pa.list_(t)
        value = {"f": value} if kind == "struct" else [value]
    return t, value


def one_key() -> pa.Table:
    return pa.table({"k": pa.array([1], pa.int64())})


@pytest.mark.parametrize("kind", ["struct", "list"])
def test_the_deepest_supported_type_round_trips(tmp_path, kind):
    t, value = nested(MAX_TYPE_DEPTH, kind)
    layout = StateLayout.of(KEYS, [ValueStateDescriptor("v", t), ListStateDescriptor("l", t)], 8)
    with IcebergStateTable.open(layout, warehouse=str(tmp_path / "wh"), table_name="op") as table:
        store = StateStore(table)
        store.get_state("v").update_batch(one_key(), [value])
        store.get_state("l").add_batch(one_key(), [value])
        store.checkpoint(batch_id=0)
        store.close()
        again = StateStore(table)
        again.restore()
        assert again.get_state("v").get_batch(one_key()).to_pylist() == [value]
        again.set_current_key((1,))
        assert list(again.get_state("l").get()) == [value]
        again.close()
        assert connect(table).sql("SELECT count(*) FROM state_v").fetchall() == [(1,)]


@pytest.mark.parametrize("kind", ["struct", "list"])
@pytest.mark.parametrize("depth", [MAX_TYPE_DEPTH + 1, 1000])
def test_a_deeper_type_is_refused_when_declared(kind, depth):
    t, _ = nested(depth, kind)
    for declare in (lambda: ValueStateDescriptor("v", t), lambda: ListStateDescriptor("v", t),
                    lambda: MapStateDescriptor("v", t, key_type=pa.string()),
                    lambda: MapStateDescriptor("v", pa.int64(), key_type=t)):
        with pytest.raises(ValueError, match=f"nests more than {MAX_TYPE_DEPTH} levels") as raised:
            declare()
        assert "'v'" in str(raised.value) and "flatten" in str(raised.value)


def test_a_hostile_deep_value_is_a_schema_mismatch(tmp_path):
    t, _ = nested(3, "list")
    layout = StateLayout.of(KEYS, [ValueStateDescriptor("v", t)], 8)
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    with IcebergStateTable.open(layout, warehouse=str(tmp_path / "wh"), table_name="op") as table:
        store = StateStore(table)
        with pytest.raises(SchemaMismatchError, match="'v'"):
            store.get_state("v").update_batch(one_key(), [deep])
        store.set_current_key((1,))
        with pytest.raises(SchemaMismatchError, match="'v'"):
            store.get_state("v").update(deep)
        assert store.get_state("v").get() is None
        store.close()
