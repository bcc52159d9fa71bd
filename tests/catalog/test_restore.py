"""Listing and restoring checkpoints; restore to an older checkpoint abandons the newer line."""

from __future__ import annotations

import itertools
import os

import pytest

from statestore.errors import CheckpointNotFoundError
from statestore.keygroups import KeyGroupRange
from tests.catalog.catalog_helpers import MAX_PARALLELISM, commit_next, file_exists, snapshot_files, table_files

ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)


def test_list_and_restore_every_retained_checkpoint(open_table):
    table = open_table()
    ids = [commit_next(table, [[cp_kg]]) for cp_kg in range(5)]
    listed = table.list_checkpoints()
    assert [c.checkpoint_id for c in listed] == ids
    assert [c.batch_id for c in listed] == [i * 10 for i in ids]
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(listed))
    for n, cp in enumerate(ids):
        info = table.restore(cp)
        assert info == listed[n]
        assert [s.checkpoint_id for s in table.segments(ALL)] == ids[: n + 1]
    assert table.restore().checkpoint_id == ids[-1]


def test_restore_reads_no_data_file(open_table):
    table = open_table()
    commit_next(table)
    cp = commit_next(table)
    expected = table.segments(ALL)
    table.close()
    for seg in expected:
        os.rename(seg.path, seg.path + ".away")  # restore must not notice
    reopened = open_table(checkpoint_id=cp)
    assert reopened.segments(ALL) == expected
    assert reopened.restore(cp - 1).checkpoint_id == cp - 1


def test_unknown_checkpoint_is_named_with_the_retained_ones(open_table):
    table = open_table()
    commit_next(table)
    commit_next(table)
    with pytest.raises(CheckpointNotFoundError) as e:
        table.restore(7)
    assert "checkpoint 7" in str(e.value) and "state.op" in str(e.value) and "[1, 2]" in str(e.value)
    with pytest.raises(CheckpointNotFoundError):
        open_table(checkpoint_id=7)


def test_commit_after_restoring_an_older_checkpoint_abandons_the_newer_line(open_table):
    table = open_table(retain_checkpoints=10)
    ids = [commit_next(table) for _ in range(5)]
    abandoned = {s.path for s in table.segments(ALL) if s.checkpoint_id > ids[1]}
    table.restore(ids[1])
    assert [c.checkpoint_id for c in table.list_checkpoints()] == ids  # nothing changes before the commit
    assert table.next_checkpoint_id() == ids[-1] + 1
    new = commit_next(table)
    assert new == ids[-1] + 1
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [ids[0], ids[1], new]
    snapshot = table.iceberg_table.current_snapshot()
    assert snapshot.parent_snapshot_id == table.list_checkpoints()[1].snapshot_id
    assert [s.checkpoint_id for s in table.segments(ALL)] == [ids[0]] * 2 + [ids[1]] * 2 + [new] * 2
    # Retention removed the abandoned snapshots and every file only they referenced.
    assert len(table.iceberg_table.metadata.snapshots) == 3
    assert not any(file_exists(p) for p in abandoned)
    referenced = set().union(*(snapshot_files(table, s) for s in table.iceberg_table.metadata.snapshots))
    leftovers = {p for p in table_files(table) if p not in referenced and not p.endswith(".metadata.json")}
    assert leftovers == set()
    # Ids stay monotonic after the abandoned ones are gone, also for a new process.
    assert table.next_checkpoint_id() == new + 1
    table.close()
    assert open_table().next_checkpoint_id() == new + 1


def test_restore_then_restore_newer_before_committing(open_table):
    table = open_table()
    ids = [commit_next(table) for _ in range(3)]
    table.restore(ids[0])
    table.restore(ids[2])
    commit_next(table)
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [*ids, ids[2] + 1]
