"""Contract: an empty table, segment paths and file schema, and committing checkpoints (shape,
visibility, pruning by key-group range, monotonic ids, reopening in a fresh object)."""

from __future__ import annotations

import pytest

from statestore import paths
from statestore.keygroups import KeyGroupRange
from statestore.store import StateStore
from statestore.table import StateTable
from tests.contract.helpers import (
    ALL_KEY_GROUPS,
    LAYOUT,
    MAX_PARALLELISM,
    commit_next,
    read,
    write,
    write_segment,
)


def test_empty_table(backend):
    table = backend.open()
    assert isinstance(table, StateTable)
    assert table.current_checkpoint() is None
    assert table.list_checkpoints() == []
    assert table.next_checkpoint_id() == 1
    assert table.segments(ALL_KEY_GROUPS) == []
    assert table.restore() is None
    assert read(StateStore(table)) == {}


def test_segment_paths_are_fresh_and_named_under_the_root(backend):
    table = backend.open()
    partitions = {table.partition_of(kg) for kg in range(MAX_PARALLELISM)}
    assert all(isinstance(p, int) and p >= 0 for p in partitions)
    partition = max(partitions)
    path = table.new_segment_path(7, 2, partition)
    assert not path.startswith("file:") and path.startswith(backend.root(table))
    assert paths.parse_segment_name(path) == (7, 2, partition)
    assert table.new_segment_path(7, 2, partition) != path


def test_file_schema_has_the_entry_columns(backend):
    table = backend.open()
    assert table.file_schema().names == LAYOUT.entry_schema.names
    assert table.layout is LAYOUT


def test_commit_records_its_shape(backend):
    table = backend.open()
    cp = table.next_checkpoint_id()
    segments = [write_segment(table, cp, t, kgs) for t, kgs in enumerate([[0, 1], [5, 6, 7], [9], [14, 15]])]
    info = table.commit_checkpoint(cp, segments, parallelism=4, batch_id=41, properties={"source": "kafka"})
    assert (info.checkpoint_id, info.batch_id, info.parallelism, info.max_parallelism) == (cp, 41, 4, MAX_PARALLELISM)
    assert info.properties == {"source": "kafka"}
    assert table.current_checkpoint() == info == table.list_checkpoints()[-1]
    assert sorted(s.path for s in table.segments(ALL_KEY_GROUPS)) == sorted(s.path for s in segments)


def test_commit_is_visible_after_reopen(backend):
    store = StateStore(backend.open())
    write(store, {1: 10, 2: 20})
    info = store.checkpoint(batch_id=7, properties={"owner": "test"})
    assert (info.checkpoint_id, info.batch_id, info.parallelism, info.max_parallelism) == (1, 7, 1, MAX_PARALLELISM)
    assert info.properties == {"owner": "test"}

    table = backend.open()
    assert table.current_checkpoint() == info
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [1]
    assert table.next_checkpoint_id() == 2
    assert read(StateStore(table)) == {1: 10, 2: 20}


def test_segments_are_visible_only_once_committed(backend):
    table = backend.open()
    first = commit_next(table)
    before = table.segments(ALL_KEY_GROUPS)
    pending = write_segment(table, first + 1, 0, [1, 2])
    assert table.segments(ALL_KEY_GROUPS) == before
    assert backend.open().segments(ALL_KEY_GROUPS) == before
    table.commit_checkpoint(first + 1, [pending], parallelism=1)
    assert table.segments(ALL_KEY_GROUPS) == [*before, pending]


def test_each_commit_sees_all_earlier_segments(backend):
    store = StateStore(backend.open())
    changes = [{1: 1, 11: 100}, {2: 2, 1: 5}, {1: None, 3: 3}, {1: 7, 11: None}]
    expected_after = [{1: 1, 11: 100}, {1: 5, 2: 2, 11: 100}, {2: 2, 3: 3, 11: 100}, {1: 7, 2: 2, 3: 3}]
    for cp, (change, expected) in enumerate(zip(changes, expected_after, strict=True), start=1):
        write(store, change)
        assert store.checkpoint().checkpoint_id == cp
        assert read(StateStore(backend.open())) == expected
    assert [c.checkpoint_id for c in backend.open().list_checkpoints()] == [1, 2, 3, 4]


def test_segments_prune_by_key_group_range_oldest_first(backend):
    table = backend.open()
    first = commit_next(table, [[0, 1, 2], [10, 11]])
    second = commit_next(table, [[2, 3], [12, 15]])
    got = table.segments(KeyGroupRange.of(2, 2))
    assert [s.checkpoint_id for s in got] == [first, second]
    assert all(s.key_group_min <= 2 <= s.key_group_max for s in got)
    assert [s.checkpoint_id for s in table.segments(KeyGroupRange.of(13, 14))] == [second]
    assert table.segments(KeyGroupRange.of(4, 9)) == []
    assert table.segments(KeyGroupRange.EMPTY) == []
    assert [s.checkpoint_id for s in table.segments(ALL_KEY_GROUPS)] == [first, first, second, second]
    seg = table.segments(KeyGroupRange.of(10, 10))[0]
    assert (seg.key_group_min, seg.key_group_max, seg.record_count) == (10, 11, 2)
    assert seg.size_bytes == backend.size_bytes(table, seg.path)


def test_segments_are_the_committed_files(backend):
    table = backend.open()
    low = [write_segment(table, 1, 0, [0, 3])]
    table.commit_checkpoint(1, low, parallelism=1)
    high = [write_segment(table, 2, 0, [8, 9])]
    table.commit_checkpoint(2, high, parallelism=1)
    assert table.segments(KeyGroupRange.of(4, 7)) == []
    assert table.segments(KeyGroupRange.of(3, 8)) == low + high
    assert table.segments(KeyGroupRange.of(9, 15)) == high
    assert table.segments(KeyGroupRange.of(0, 0)) == low


def test_index_after_reopen_matches_index_after_commit(backend):
    table = backend.open()
    for _ in range(3):
        commit_next(table)
    expected = table.segments(ALL_KEY_GROUPS)
    assert backend.open().segments(ALL_KEY_GROUPS) == expected


def test_empty_checkpoint_commits(backend):
    table = backend.open()
    commit_next(table)
    before = table.segments(ALL_KEY_GROUPS)
    cp = table.next_checkpoint_id()
    info = table.commit_checkpoint(cp, [], parallelism=1, batch_id=3)
    assert info.checkpoint_id == cp and table.segments(ALL_KEY_GROUPS) == before
    assert table.current_checkpoint() == info


def test_checkpoint_ids_must_grow(backend):
    table = backend.open()
    cp = commit_next(table)
    record = backend.commit_record(table)
    segment = write_segment(table, cp, 0, [1])
    with pytest.raises(ValueError, match=f"checkpoint id {cp}"):
        table.commit_checkpoint(cp, [segment], parallelism=1)
    with pytest.raises(ValueError, match=f"checkpoint id {cp - 1}"):
        table.commit_checkpoint(cp - 1, [], parallelism=1)
    assert backend.commit_record(table) == record
    assert table.current_checkpoint().checkpoint_id == cp


def test_next_checkpoint_id_is_monotonic(backend):
    table = backend.open(retain_checkpoints=1)
    store = StateStore(table)
    ids = []
    for i in range(4):
        write(store, {i: i})
        ids.append(store.checkpoint().checkpoint_id)
    assert ids == [1, 2, 3, 4]
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [4]
    assert backend.open().next_checkpoint_id() == 5
    store.checkpoint()  # an empty checkpoint still takes the next id
    assert backend.open().next_checkpoint_id() == 6


def test_retain_checkpoints_must_be_positive(backend):
    with pytest.raises(ValueError, match="retain_checkpoints"):
        backend.open(retain_checkpoints=0)


def test_partitions_hold_their_key_groups(backend):
    """Segments are written one per ``partition_of``; a table asked for several partitions
    (where the implementation has them) still lists and prunes them by key group."""
    table = backend.open(key_groups_per_partition=4)
    store = StateStore(table)
    write(store, {k: k for k in range(40)})
    store.checkpoint()
    segments = table.segments(ALL_KEY_GROUPS)
    for s in segments:
        assert table.partition_of(s.key_group_min) == table.partition_of(s.key_group_max)
        assert paths.parse_segment_name(s.path)[2] == table.partition_of(s.key_group_min)
    assert sum(s.record_count for s in segments) == 40
    assert read(StateStore(backend.open())) == {k: k for k in range(40)}
