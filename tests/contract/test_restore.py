"""Contract: listing and restoring checkpoints; a commit after restoring an older checkpoint
abandons the newer line."""

from __future__ import annotations

import itertools

import pytest

from statestore.errors import CheckpointNotFoundError
from statestore.store import StateStore
from tests.contract.helpers import ALL_KEY_GROUPS, commit_next, read, segment_checkpoint_ids, write


def test_list_and_restore_every_retained_checkpoint(backend):
    table = backend.open()
    ids = [commit_next(table, [[cp_kg]]) for cp_kg in range(5)]
    listed = table.list_checkpoints()
    assert [c.checkpoint_id for c in listed] == ids
    assert [c.batch_id for c in listed] == [i * 10 for i in ids]
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(listed))
    for n, cp in enumerate(ids):
        info = table.restore(cp)
        assert info == listed[n] == table.current_checkpoint()
        assert [s.checkpoint_id for s in table.segments(ALL_KEY_GROUPS)] == ids[: n + 1]
    table.restore(ids[0])
    assert table.restore().checkpoint_id == ids[-1]


def test_restore_reads_no_data_file(backend):
    table = backend.open()
    commit_next(table)
    cp = commit_next(table)
    expected = table.segments(ALL_KEY_GROUPS)
    for seg in expected:
        table.filesystem.move(seg.path, seg.path + ".away")  # restore must not notice
    reopened = backend.open(checkpoint_id=cp)
    assert reopened.segments(ALL_KEY_GROUPS) == expected
    assert reopened.restore(cp - 1).checkpoint_id == cp - 1


def test_unknown_checkpoint_is_named_with_the_retained_ones(backend):
    table = backend.open()
    commit_next(table)
    commit_next(table)
    with pytest.raises(CheckpointNotFoundError) as e:
        table.restore(7)
    message = str(e.value)
    assert "checkpoint 7" in message and backend.name_in_errors(table) in message and "[1, 2]" in message
    assert table.current_checkpoint().checkpoint_id == 2
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 7"):
        backend.open(checkpoint_id=7)


def test_restore_older_checkpoint_then_commit_abandons_newer_line(backend):
    table = backend.open()
    store = StateStore(table)
    write(store, {1: 1, 2: 1, 3: 1})
    store.checkpoint()
    write(store, {1: 2, 4: 4})
    store.checkpoint()
    write(store, {5: 5, 2: None})
    store.checkpoint()
    abandoned = {s.path for s in table.segments(ALL_KEY_GROUPS) if s.checkpoint_id > 1}

    assert store.restore(1).checkpoint_id == 1
    assert read(store) == {1: 1, 2: 1, 3: 1}
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [1, 2, 3]  # nothing changes before the commit
    assert table.next_checkpoint_id() == 4  # never reuses the ids of the abandoned line
    write(store, {6: 6})
    assert store.checkpoint().checkpoint_id == 4

    assert [c.checkpoint_id for c in table.list_checkpoints()] == [1, 4]
    assert [s.checkpoint_id for s in table.segments(ALL_KEY_GROUPS)] == [1, 4]
    # Retention removed every segment only the abandoned line referenced.
    assert not any(backend.exists(table, p) for p in abandoned)
    assert segment_checkpoint_ids(backend.files(table)) == [1, 4]
    reopened = backend.open()
    assert [c.checkpoint_id for c in reopened.list_checkpoints()] == [1, 4]
    with pytest.raises(CheckpointNotFoundError):
        reopened.restore(3)
    assert read(StateStore(reopened)) == {1: 1, 2: 1, 3: 1, 6: 6}
    # Ids stay monotonic after the abandoned ones are gone, also for a new process.
    assert reopened.next_checkpoint_id() == 5


def test_restore_then_restore_newer_before_committing(backend):
    table = backend.open()
    ids = [commit_next(table) for _ in range(3)]
    table.restore(ids[0])
    table.restore(ids[2])
    commit_next(table)
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [*ids, ids[2] + 1]
