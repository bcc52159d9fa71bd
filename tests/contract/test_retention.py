"""Contract: retention keeps the newest K checkpoints and deletes the files that no retained
checkpoint references, never one that a retained checkpoint, a checkpoint in flight or
another tool needs."""

from __future__ import annotations

import pytest

from statestore.errors import CheckpointNotFoundError
from statestore.store import StateStore
from tests.contract.helpers import ALL_KEY_GROUPS, committed_store, read, segment_checkpoint_ids, write, write_segment


def test_retention_keeps_the_newest_checkpoints(backend):
    table = backend.open(retain_checkpoints=2)
    store = StateStore(table)
    states = {}
    for cp in range(1, 6):
        write(store, {cp: cp * 10})
        store.checkpoint()
        states[cp] = {k: k * 10 for k in range(1, cp + 1)}
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [4, 5]
    reopened = backend.open(retain_checkpoints=2)
    assert [c.checkpoint_id for c in reopened.list_checkpoints()] == [4, 5]
    with pytest.raises(CheckpointNotFoundError):
        reopened.restore(3)
    # Segments of expired checkpoints are still referenced by the retained ones: none deleted.
    assert segment_checkpoint_ids(backend.files(table)) == [1, 2, 3, 4, 5]
    assert all(backend.exists(table, s.path) for s in table.segments(ALL_KEY_GROUPS))
    assert read(StateStore(backend.open(checkpoint_id=4))) == states[4]
    assert read(StateStore(backend.open())) == states[5]


def test_retention_deletes_orphans_up_to_the_newest_checkpoint_only(backend):
    """Segments that never committed (a crashed attempt) go once a newer checkpoint commits
    in a table opened after the crash; a segment of a checkpoint id above the newest may
    belong to a checkpoint in flight and stays; files that are not segments are never
    touched."""
    store = committed_store(backend, {1: 1})
    crashed = write_segment(store.table, 2, 0, [0])  # a crashed attempt of checkpoint 2
    future = write_segment(store.table, 5, 0, [0])  # may belong to a checkpoint in flight
    data_dir = crashed.path.rsplit("/", 1)[0]
    foreign = f"{data_dir}/00000-0-someone-else.parquet"
    backend.write_bytes(store.table, foreign, b"not a segment")

    store = StateStore(backend.open())  # the process restarted after the crash
    write(store, {2: 2})
    assert store.checkpoint().checkpoint_id == 2
    table = store.table
    assert not backend.exists(table, crashed.path)
    assert backend.exists(table, future.path)
    assert backend.exists(table, foreign)
    assert segment_checkpoint_ids(backend.files(table)) == [1, 2, 5]
    assert read(StateStore(backend.open())) == {1: 1, 2: 2}  # the orphans' keys never show

    for cp in (3, 4, 5):
        write(store, {cp: cp})
        assert store.checkpoint().checkpoint_id == cp
    store = StateStore(backend.open())
    write(store, {6: 6})
    assert store.checkpoint().checkpoint_id == 6
    assert not backend.exists(table, future.path)
    assert backend.exists(table, foreign)
    assert segment_checkpoint_ids(backend.files(table)) == [1, 2, 3, 4, 5, 6]
    assert all(backend.exists(table, s.path) for s in store.table.segments(ALL_KEY_GROUPS))
    assert read(StateStore(backend.open())) == {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}
