"""Savepoints (Iceberg tags retention never expires) and forks (Iceberg branches that a new
version of a job commits to without touching main), on a real SQLite catalog."""

from __future__ import annotations

import pytest

from catalog import IcebergStateTable
from statestore.errors import CheckpointNotFoundError, CommitConflictError
from statestore.keygroups import KeyGroupRange
from tests.catalog.catalog_helpers import MAX_PARALLELISM, commit_next, file_exists, table_files

ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)


def segment_ids(table: IcebergStateTable) -> list[int]:
    """The checkpoints whose segments the opened checkpoint holds."""
    return sorted({s.checkpoint_id for s in table.segments(ALL)})


# ------------------------------------------------------------------------------ savepoints


def test_a_savepoint_outlives_retention_and_opens_like_a_checkpoint(open_table, warehouse):
    table = open_table(retain_checkpoints=2)
    commit_next(table)
    saved = commit_next(table)
    info = table.savepoint("before-upgrade")
    assert info.checkpoint_id == saved
    expected = table.segments(ALL)
    for _ in range(4):
        commit_next(table)
    assert saved not in [c.checkpoint_id for c in table.list_checkpoints()]  # off the retained line...
    snapshot = table.iceberg_table.metadata.snapshot_by_id(info.snapshot_id)
    assert snapshot is not None and file_exists(snapshot.manifest_list.removeprefix("file://"))  # ...but kept
    assert table.savepoints()["before-upgrade"].checkpoint_id == saved
    at = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op", savepoint="before-upgrade")
    try:
        assert at.current_checkpoint().checkpoint_id == saved
        assert at.segments(ALL) == expected
    finally:
        at.close()


def test_restoring_a_savepoint_continues_from_it_and_abandons_the_newer_line(open_table):
    table = open_table(retain_checkpoints=3)
    ids = [commit_next(table) for _ in range(2)]
    table.savepoint("sp")
    newer = [commit_next(table) for _ in range(4)]
    abandoned = {s.path for s in table.segments(ALL) if s.checkpoint_id in newer}
    assert table.restore(savepoint="sp").checkpoint_id == ids[-1]
    nxt = commit_next(table)
    assert nxt == newer[-1] + 1  # ids stay monotonic on main
    assert segment_ids(table) == [*ids, nxt]
    assert [c.checkpoint_id for c in table.list_checkpoints()][-2:] == [ids[-1], nxt]
    assert not any(file_exists(p) for p in abandoned)  # the abandoned line is collected


def test_removing_a_savepoint_lets_retention_collect_it(open_table):
    table = open_table(retain_checkpoints=1)
    commit_next(table)
    info = table.savepoint("sp")
    commit_next(table)
    commit_next(table)
    metadata = table.iceberg_table.metadata
    assert metadata.snapshot_by_id(info.snapshot_id) is not None
    manifest_list = metadata.snapshot_by_id(info.snapshot_id).manifest_list.removeprefix("file://")
    table.remove_savepoint("sp")
    commit_next(table)
    assert table.iceberg_table.metadata.snapshot_by_id(info.snapshot_id) is None
    assert not file_exists(manifest_list)
    assert table.savepoints() == {}


def test_savepoint_and_fork_names_are_checked(open_table):
    table = open_table()
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        table.savepoint("empty")
    commit_next(table)
    table.savepoint("sp")
    with pytest.raises(ValueError, match="already has a savepoint named 'sp'"):
        table.savepoint("sp")
    with pytest.raises(ValueError, match="already has a savepoint named 'sp'"):
        table.fork("sp")
    for bad in ("", "main", "a b", "x/y"):
        with pytest.raises(ValueError, match="name"):
            table.savepoint(bad)
    with pytest.raises(CheckpointNotFoundError, match=r"no savepoint 'nope'.*savepoints: \['sp'\]"):
        table.restore(savepoint="nope")
    with pytest.raises(ValueError, match="not both"):
        table.restore(1, savepoint="sp")
    with pytest.raises(ValueError, match="no fork 'nope'"):
        open_table(branch="nope")


# ------------------------------------------------------------------------------ forks


def test_a_fork_commits_apart_from_main_and_both_lines_can_be_compared(open_table):
    main = open_table(retain_checkpoints=10)
    base = [commit_next(main) for _ in range(3)]
    forked = main.fork("v2")
    assert forked.checkpoint_id == base[-1]
    fork = open_table(branch="v2", retain_checkpoints=10)
    assert fork.branch == "v2"
    assert fork.current_checkpoint().snapshot_id == forked.snapshot_id
    assert fork.next_checkpoint_id() == base[-1] + 1  # a fork continues the ids of its checkpoint
    f1 = commit_next(fork, [[1, 2]])
    m1 = commit_next(main, [[5]])
    f2 = commit_next(fork, [[3]])
    assert (f1, f2) == (base[-1] + 1, base[-1] + 2)
    assert segment_ids(fork) == [*base, f1, f2]
    assert segment_ids(main) == [*base, m1]
    assert [c.checkpoint_id for c in fork.list_checkpoints()] == [*base, f1, f2]
    assert [c.checkpoint_id for c in main.list_checkpoints()] == [*base, m1]
    # the fork's own segments live apart from main's
    assert all("/data/branches/v2/" in s.path for s in fork.segments(ALL) if s.checkpoint_id > base[-1])
    assert main.forks()["v2"].checkpoint_id == f2
    # a reader opens either line at any retained checkpoint
    at = open_table(branch="v2", checkpoint_id=f1)
    assert segment_ids(at) == [*base, f1]


def test_each_line_keeps_its_retention_and_main_keeps_what_the_fork_shares(open_table):
    main = open_table(retain_checkpoints=2)
    for _ in range(3):
        commit_next(main)
    shared_files = {s.path for s in main.segments(ALL)}
    main.fork("exp")
    fork = open_table(branch="exp", retain_checkpoints=2)
    for _ in range(4):
        commit_next(main)
        commit_next(fork)
    assert len(main.list_checkpoints()) == 2 and len(fork.list_checkpoints()) == 2
    # the fork still reads every segment of its line, the shared history included
    assert all(file_exists(s.path) for s in fork.segments(ALL))
    assert all(file_exists(s.path) for s in main.segments(ALL))
    assert shared_files <= {s.path for s in fork.segments(ALL)}
    # removing the fork hands its own files to main's garbage collection
    fork_only = {s.path for s in fork.segments(ALL)} - {s.path for s in main.segments(ALL)}
    fork.close()
    main.remove_fork("exp")
    commit_next(main)
    main.collect_garbage()
    assert not any(file_exists(p) for p in fork_only - shared_files)
    assert all(file_exists(s.path) for s in main.segments(ALL))
    assert main.forks() == {}


def test_restore_on_a_fork_rolls_back_the_fork_only(open_table):
    main = open_table(retain_checkpoints=10)
    commit_next(main)
    main.fork("f")
    fork = open_table(branch="f", retain_checkpoints=10)
    a = commit_next(fork)
    commit_next(fork)
    main_before = main.list_checkpoints()
    fork.restore(a)
    c = commit_next(fork)
    assert [x.checkpoint_id for x in fork.list_checkpoints()] == [1, a, c]
    main.restore()
    assert main.list_checkpoints() == main_before


def test_main_and_fork_writers_commit_concurrently_without_conflict(open_table, warehouse):
    """Two writers of one table, on two branches, interleaving commits on separate table
    objects (each sees the other's commits only as a lost race, then retries)."""
    main = open_table(retain_checkpoints=3)
    commit_next(main)
    main.fork("f")
    fork = open_table(branch="f", retain_checkpoints=3)
    for _ in range(5):
        m_cp = main.next_checkpoint_id()
        f_cp = fork.next_checkpoint_id()
        commit_next(main)
        commit_next(fork)
        assert main.current_checkpoint().checkpoint_id == m_cp
        assert fork.current_checkpoint().checkpoint_id == f_cp
    assert all(file_exists(s.path) for s in main.segments(ALL))
    assert all(file_exists(s.path) for s in fork.segments(ALL))
    files = table_files(main)
    assert any("/data/branches/f/" in p for p in files)


def test_a_second_writer_of_the_same_fork_is_refused(open_table):
    main = open_table()
    commit_next(main)
    main.fork("f")
    one = open_table(branch="f")
    two = open_table(branch="f")
    commit_next(one)
    with pytest.raises((CommitConflictError, ValueError)):
        commit_next(two)


def test_fork_cannot_remove_itself_or_main(open_table):
    main = open_table()
    commit_next(main)
    main.fork("f")
    fork = open_table(branch="f")
    with pytest.raises(ValueError, match="main or this table's own branch"):
        fork.remove_fork("f")
    with pytest.raises(ValueError, match="main or this table's own branch"):
        main.remove_fork("main")
    with pytest.raises(ValueError, match="no fork 'g'"):
        main.remove_fork("g")


def test_a_fork_that_never_committed_can_be_removed(open_table):
    """Regression: removing a fork without a checkpoint of its own raised KeyError (pyiceberg
    refuses to remove its absent last-checkpoint-id property)."""
    main = open_table()
    commit_next(main)
    main.fork("f")
    main.remove_fork("f")
    assert main.forks() == {}
    assert not [k for k in main.iceberg_table.properties if k.endswith("@f")]


def test_removing_forks_breaks_nothing(open_table, warehouse):
    """Issue 14, defect 11: a fork never written to is removed; a fork removed through another
    table object leaves main's next checkpoint and its ids alone; the removed fork's open
    writer gets a conflict instead of re-creating the fork with only its last commit."""
    main = open_table()
    commit_next(main)
    commit_next(main)
    main.fork("empty")
    main.remove_fork("empty")
    main.fork("v2")
    writer = open_table(branch="v2")
    commit_next(writer)
    commit_next(writer)  # the fork's checkpoints 3 and 4
    other = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    try:
        other.remove_fork("v2")
    finally:
        other.close()
    assert commit_next(main) == 3  # main's ids ignore the removed fork's snapshots
    with pytest.raises(CommitConflictError, match=r"fork 'v2' .* was removed"):
        commit_next(writer)
    assert main.forks() == {}
    assert [c.checkpoint_id for c in main.list_checkpoints()][-1] == 3


def test_fork_and_savepoint_without_a_checkpoint_take_the_newest(open_table):
    writer = open_table()
    commit_next(writer)
    old = open_table(checkpoint_id=1)  # an object opened at an older checkpoint
    commit_next(writer)
    assert old.fork("v2").checkpoint_id == 2 and old.savepoint("keep").checkpoint_id == 2
    assert old.fork("v1", 1).checkpoint_id == 1


def test_a_table_opened_as_it_is_accepts_its_own_descriptors(open_table, warehouse):
    from statestore import StateStore
    from tests.catalog.catalog_helpers import DESCRIPTORS, LAYOUT

    commit_next(open_table())
    existing = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    try:
        assert existing.layout == LAYOUT  # string keys read back as string, not large_string
        store = StateStore(existing)
        for descriptor in DESCRIPTORS:
            store.get_state(descriptor)
    finally:
        existing.close()
