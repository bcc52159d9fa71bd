"""The window between ``flush(cp)`` and ``checkpoint_complete(cp)``: a driver commits while
the task's store is still in use. Regression tests of the review of the store (issue 2):
writes after a flush were dropped at completion, and a key group loaded after the commit
but before completion applied the checkpoint's list appends twice."""

from __future__ import annotations

import pyarrow as pa
import pytest

from statestore import (
    DirectoryStateTable,
    ListStateDescriptor,
    StateLayout,
    StateStore,
    StateStoreError,
    StoreConfig,
    ValueStateDescriptor,
)

LAYOUT = StateLayout.of(pa.schema([("k", pa.string())]),
                        [ValueStateDescriptor("v", pa.int64()), ListStateDescriptor("l", pa.int64())], 8)


def keys(*ks: str) -> pa.Table:
    return pa.table({"k": list(ks)})


def test_writes_after_flush_survive_completion(tmp_path):
    table = DirectoryStateTable(tmp_path, LAYOUT)
    store = StateStore(table)
    v = store.get_state("v")
    v.update_batch(keys("a"), [1])
    cp = table.next_checkpoint_id()
    segments = store.flush(cp)
    v.update_batch(keys("a"), [2])
    store.set_current_key("b")
    v.update(70)
    assert v.get_batch(keys("a", "b")).to_pylist() == [2, 70]
    table.commit_checkpoint(cp, segments, parallelism=1)
    store.checkpoint_complete(cp)
    assert v.get_batch(keys("a", "b")).to_pylist() == [2, 70]
    store.checkpoint()
    reopened = StateStore(DirectoryStateTable(tmp_path, LAYOUT))
    assert reopened.get_state("v").get_batch(keys("a", "b")).to_pylist() == [2, 70]
    at_cp = StateStore(DirectoryStateTable(tmp_path, LAYOUT, checkpoint_id=cp))
    assert at_cp.get_state("v").get_batch(keys("a", "b")).to_pylist() == [1, None]


def test_key_group_loaded_between_commit_and_completion_applies_appends_once(tmp_path):
    table = DirectoryStateTable(tmp_path, LAYOUT)
    store = StateStore(table)
    lst = store.get_state("l")
    lst.add_batch(keys("a"), [10])
    cp = table.next_checkpoint_id()
    table.commit_checkpoint(cp, store.flush(cp), parallelism=1)
    assert lst.get_batch(keys("a")).to_pylist() == [[10]]  # loaded now: segment and memtable both hold it
    store.checkpoint_complete(cp)
    assert lst.get_batch(keys("a")).to_pylist() == [[10]]
    store.checkpoint()
    assert StateStore(DirectoryStateTable(tmp_path, LAYOUT)).get_state("l").get_batch(keys("a")).to_pylist() == [[10]]


def test_aborted_checkpoint_keeps_its_entries_for_the_next(tmp_path):
    table = DirectoryStateTable(tmp_path, LAYOUT)
    store = StateStore(table)
    store.get_state("l").add_batch(keys("a", "a"), [1, 2])
    store.flush(table.next_checkpoint_id())
    with pytest.raises(StateStoreError, match="neither completed nor aborted"):
        store.flush(table.next_checkpoint_id())
    store.checkpoint_aborted(table.next_checkpoint_id())
    store.checkpoint()
    assert StateStore(DirectoryStateTable(tmp_path, LAYOUT)).get_state("l").get_batch(keys("a")).to_pylist() \
        == [[1, 2]]


def test_completion_of_an_unknown_checkpoint_is_an_error(tmp_path):
    store = StateStore(DirectoryStateTable(tmp_path, LAYOUT))
    with pytest.raises(ValueError, match="not flushed"):
        store.checkpoint_complete(1)


def test_committed_entries_waiting_in_cache_count_against_its_bound(tmp_path):
    """A variable written every checkpoint but never read leaves its committed entries as
    pending parts of cached key groups; they count, so the cache trims them."""
    bound = 64 * 1024
    store = StateStore(DirectoryStateTable(tmp_path, LAYOUT), config=StoreConfig(cache_size_bytes_max=bound))
    many = keys(*[f"k{i}" for i in range(1000)])
    store.get_state("v").get_batch(many)  # caches every key group
    for round_ in range(20):
        store.get_state("l").add_batch(many, [round_] * 1000)
        store.checkpoint()
        assert store.stats()["cache_size_bytes"] <= bound
    assert store.get_state("l").get_batch(keys("k1")).to_pylist() == [list(range(20))]


def test_completion_moves_a_table_object_that_did_not_commit(tmp_path):
    """A task's table object and the driver's are different objects (another process in
    Spark): completing the checkpoint moves the task's table to it."""
    task_table = DirectoryStateTable(tmp_path, LAYOUT)
    driver_table = DirectoryStateTable(tmp_path, LAYOUT)
    store = StateStore(task_table, config=StoreConfig(cache_size_bytes_max=1))
    store.get_state("l").add_batch(keys("a"), [5])
    cp = driver_table.next_checkpoint_id()
    driver_table.commit_checkpoint(cp, store.flush(cp), parallelism=1)
    store.checkpoint_complete(cp)
    assert task_table.current_checkpoint().checkpoint_id == cp
    store.get_state("v").get_batch(keys(*[f"x{i}" for i in range(50)]))  # evicts "a"'s key group
    assert store.get_state("l").get_batch(keys("a")).to_pylist() == [[5]]
