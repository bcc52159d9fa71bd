"""Operator (non-keyed) state, FLIP-8: lists per task in the checkpoint's snapshot,
redistributed (split, union, broadcast) at every parallelism from 1 to 8; the seed's Kafka
example; retention and the orphan sweep of operator state files."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from catalog import IcebergStateTable
from statestore import (
    KeyGroupRange,
    OperatorStateDescriptor,
    OperatorStateStore,
    Redistribution,
    SchemaMismatchError,
    StateDescriptorMismatchError,
    StateNotDeclaredError,
)
from statestore.operator_state import redistribute
from tests.catalog.catalog_helpers import LAYOUT, commit_next, write_segment

OFFSET = pa.struct([("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64())])
KAFKA = OperatorStateDescriptor("offsets", OFFSET, Redistribution.SPLIT)
SEEN = OperatorStateDescriptor("seen", pa.string(), Redistribution.UNION)
RULES = OperatorStateDescriptor("rules", pa.int64(), Redistribution.BROADCAST)


def commit_operator_state(table: IcebergStateTable, stores: list[OperatorStateStore], keyed: bool = True) -> int:
    """One checkpoint: every task's operator state, and one keyed segment in the same snapshot."""
    cp = table.next_checkpoint_id()
    files = [s.flush(cp) for s in stores]
    segments = [write_segment(table, cp, 0, [1])] if keyed else []
    table.commit_checkpoint(cp, segments, parallelism=len(stores), operator_state=files)
    return cp


def stores_at(table: IcebergStateTable, parallelism: int, descriptors=(KAFKA, SEEN, RULES)) -> list[OperatorStateStore]:
    return [OperatorStateStore(table, descriptors, task_index=t, parallelism=parallelism) for t in range(parallelism)]


def offset(partition: int, value: int) -> dict:
    return {"topic": "events", "partition": partition, "offset": value}


def test_the_kafka_example_from_two_tasks_to_one_and_to_four(open_table):
    """4 partition offsets held by 2 tasks; restored by 1 task (it gets all 4) and by 4 (one each)."""
    table = open_table()
    two = stores_at(table, 2, [KAFKA])
    two[0].get_list_state(KAFKA).update([offset(0, 100), offset(1, 110)])
    two[1].get_list_state(KAFKA).update([offset(2, 120), offset(3, 130)])
    cp = commit_operator_state(table, two)
    info = table.current_checkpoint()
    assert info.checkpoint_id == cp and table.segments(KeyGroupRange.of(1, 1))
    one = stores_at(table, 1, [KAFKA])
    assert one[0].get_list_state(KAFKA).get() == [offset(p, 100 + 10 * p) for p in range(4)]
    four = stores_at(table, 4, [KAFKA])
    assert [s.get_list_state(KAFKA).get() for s in four] == [[offset(p, 100 + 10 * p)] for p in range(4)]


@pytest.mark.parametrize("parallelism", range(1, 9))
def test_every_mode_at_every_parallelism(open_table, parallelism):
    table = open_table()
    old = stores_at(table, 3)
    lists = [[f"a{i}" for i in range(4)], [], [f"c{i}" for i in range(3)]]  # uneven, one task empty
    for store, values in zip(old, lists, strict=True):
        store.get_list_state(KAFKA).update([offset(int(v[1:]) + (0 if v[0] == "a" else 10), 1) for v in values])
        store.get_list_state(SEEN).update(values)
        store.get_list_state(RULES).update([7, 8])  # broadcast state: the same on every task
    commit_operator_state(table, old)
    new = stores_at(table, parallelism)
    flat = [v for values in lists for v in values]
    split = [s.get_list_state(KAFKA).get() for s in new]
    assert [o["partition"] for part in split for o in part] == [0, 1, 2, 3, 10, 11, 12]  # all, once, in order
    assert max(map(len, split)) - min(map(len, split)) <= 1
    assert all(s.get_list_state(SEEN).get() == flat for s in new)
    assert all(s.get_list_state(RULES).get() == [7, 8] for s in new)


def test_redistribute_rules():
    old = [[1, 2, 3], [4], []]
    assert redistribute(old, 2, Redistribution.SPLIT) == [[1, 2], [3, 4]]
    assert redistribute(old, 5, Redistribution.SPLIT) == [[1], [2], [3], [4], []]
    assert redistribute(old, 2, Redistribution.UNION) == [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert redistribute(old, 4, Redistribution.BROADCAST) == [[1, 2, 3], [4], [], [1, 2, 3]]
    assert redistribute([], 3, Redistribution.SPLIT) == [[], [], []]
    with pytest.raises(ValueError, match="parallelism"):
        redistribute(old, 0, Redistribution.SPLIT)


def test_operator_state_follows_restores_and_the_keyed_state_of_the_same_snapshot(open_table):
    table = open_table(retain_checkpoints=10)
    stores = stores_at(table, 2, [SEEN])
    stores[0].get_list_state(SEEN).add("x")
    first = commit_operator_state(table, stores)
    stores[1].get_list_state(SEEN).add_all(["y", "z"])
    commit_operator_state(table, stores)
    assert stores_at(table, 1, [SEEN])[0].get_list_state(SEEN).get() == ["x", "y", "z"]
    table.restore(first)
    assert stores_at(table, 1, [SEEN])[0].get_list_state(SEEN).get() == ["x"]
    # a checkpoint without operator state keeps the opened checkpoint's
    commit_next(table)
    assert stores_at(table, 1, [SEEN])[0].get_list_state(SEEN).get() == ["x"]


def test_operator_state_survives_checkpoints_committed_without_it(open_table):
    """Issue 14, defect 9: checkpoints that pass no operator state (a batch of a job that writes
    it only now and then, a rescale) list the previous files again, so retention keeps them and
    every later restore, at any parallelism, sees them."""
    table = open_table(retain_checkpoints=2)
    two = stores_at(table, 2, [KAFKA])
    two[0].get_list_state(KAFKA).update([offset(0, 100), offset(1, 110)])
    two[1].get_list_state(KAFKA).update([offset(2, 120), offset(3, 130)])
    first = commit_operator_state(table, two)
    files = [f.path for f in table.operator_state_files()]
    for parallelism in (2, 2, 4, 4):  # far past retention, and a rescale
        commit_next(table, [[1], [9]] if parallelism == 2 else [[1], [5], [9], [13]])
    table.wait_for_deletes()
    assert first not in [c.checkpoint_id for c in table.list_checkpoints()]  # expired long ago
    assert all(os.path.exists(p) for p in files)
    four = stores_at(table, 4, [KAFKA])
    assert [s.get_list_state(KAFKA).get() for s in four] == [[offset(p, 100 + 10 * p)] for p in range(4)]
    reopened = IcebergStateTable.open_existing(warehouse=os.path.dirname(os.path.dirname(
        table.location.removeprefix("file://"))), table_name="op")
    try:
        assert [f.path for f in reopened.operator_state_files()] == files
    finally:
        reopened.close()


def test_expired_and_orphaned_operator_state_files_are_deleted(open_table):
    table = open_table(retain_checkpoints=2)
    stores = stores_at(table, 2, [SEEN])
    written = []
    for i in range(4):
        stores[0].get_list_state(SEEN).update([str(i)])
        commit_operator_state(table, stores)
        written.append([f.path for f in table.operator_state_files()])
    table.wait_for_deletes()  # garbage goes in the background after each commit
    assert not any(os.path.exists(p) for files in written[:2] for p in files)  # expired with their checkpoints
    assert all(os.path.exists(p) for files in written[2:] for p in files)
    # an uncommitted flush (a crash before the commit) is an orphan once a later checkpoint committed
    orphan = stores[0].flush(table.next_checkpoint_id())
    commit_operator_state(table, stores)
    table.collect_garbage()
    assert not os.path.exists(orphan.path)
    assert all(os.path.exists(f.path) for f in table.operator_state_files())


def test_bad_operator_state_is_refused_before_anything_is_written(open_table):
    table = open_table()
    store = stores_at(table, 1, [KAFKA])[0]
    with pytest.raises(SchemaMismatchError, match="offsets"):
        store.get_list_state(KAFKA).add({"topic": "t", "partition": "not a number", "offset": 1})
    with pytest.raises(ValueError, match="null"):
        store.get_list_state(KAFKA).add(None)
    with pytest.raises(StateNotDeclaredError, match="not declared"):
        store.get_list_state("nope")
    with pytest.raises(StateDescriptorMismatchError, match="requested as"):
        store.get_list_state(OperatorStateDescriptor("offsets", pa.int64()))
    with pytest.raises(ValueError, match="twice"):
        OperatorStateStore(table, [SEEN, SEEN])
    with pytest.raises(ValueError, match=r"operator state name .bad name. is invalid"):
        OperatorStateDescriptor("bad name", pa.int64())
    cp = table.next_checkpoint_id()
    f = store.flush(cp)
    with pytest.raises(ValueError, match="one file per task"):
        table.commit_checkpoint(cp, [], parallelism=2, operator_state=[f])
    assert table.current_checkpoint() is None


def test_a_fork_keeps_its_own_operator_state(open_table):
    main = open_table()
    stores = stores_at(main, 1, [SEEN])
    stores[0].get_list_state(SEEN).add("base")
    commit_operator_state(main, stores)
    main.fork("f")
    fork = open_table(branch="f")
    on_fork = stores_at(fork, 2, [SEEN])
    assert [s.get_list_state(SEEN).get() for s in on_fork] == [["base"], ["base"]]
    on_fork[1].get_list_state(SEEN).add("fork-only")
    commit_operator_state(fork, on_fork)
    assert all("/data/branches/f/operator/" in f.path for f in fork.operator_state_files())
    assert stores_at(main, 1, [SEEN])[0].get_list_state(SEEN).get() == ["base"]
    assert stores_at(fork, 1, [SEEN])[0].get_list_state(SEEN).get() == ["base", "base", "fork-only"]


def test_layout_is_untouched(open_table):
    """Operator state needs no column of the keyed table: other readers see nothing new."""
    table = open_table()
    schema = table.iceberg_table.schema()
    commit_operator_state(table, stores_at(table, 2, [SEEN]))
    assert table.iceberg_table.schema() == schema
    assert table.layout == LAYOUT


def test_a_runner_restoring_at_the_same_parallelism_takes_back_each_tasks_own_lists(open_table):
    """``redistribute_on_rescale_only``: without a rescale every task gets its own lists back (a
    split list is not re-cut, a union not merged); at another parallelism the modes apply."""
    table = open_table()
    split = OperatorStateDescriptor("offsets", pa.int64(), Redistribution.SPLIT)
    union = OperatorStateDescriptor("sample", pa.string(), Redistribution.UNION)
    stores = [OperatorStateStore(table, [split, union], task_index=t, parallelism=2) for t in range(2)]
    stores[0].get_list_state(split).update([1, 2, 3])
    stores[0].get_list_state(union).update(["a"])
    stores[1].get_list_state(split).update([4])
    stores[1].get_list_state(union).update(["b"])
    commit_operator_state(table, stores)

    def restored(parallelism: int, own: bool) -> list[tuple[list, list]]:
        out = []
        for t in range(parallelism):
            s = OperatorStateStore(table, [split, union], task_index=t, parallelism=parallelism,
                                   redistribute_on_rescale_only=own)
            out.append((s.get_list_state(split).get(), s.get_list_state(union).get()))
        return out

    assert restored(2, own=True) == [([1, 2, 3], ["a"]), ([4], ["b"])]
    assert restored(2, own=False) == [([1, 2], ["a", "b"]), ([3, 4], ["a", "b"])]  # Flink's restore
    assert restored(3, own=True) == restored(3, own=False) == [([1, 2], ["a", "b"]), ([3], ["a", "b"]),
                                                               ([4], ["a", "b"])]
