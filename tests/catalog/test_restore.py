"""Restoring an Iceberg state table: the snapshots of a line abandoned by a commit after a
restore. Listing and restoring checkpoints, and what abandoning a line means for every
StateTable, are in tests/contract/test_restore.py."""

from __future__ import annotations

from statestore.keygroups import KeyGroupRange
from tests.catalog.catalog_helpers import MAX_PARALLELISM, commit_next, snapshot_files, table_files

ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)


def test_commit_after_restoring_an_older_checkpoint_abandons_the_newer_snapshots(open_table):
    table = open_table(retain_checkpoints=10)
    ids = [commit_next(table) for _ in range(5)]
    table.restore(ids[1])
    new = commit_next(table)
    snapshot = table.iceberg_table.current_snapshot()
    assert snapshot.parent_snapshot_id == table.list_checkpoints()[1].snapshot_id
    assert [s.checkpoint_id for s in table.segments(ALL)] == [ids[0]] * 2 + [ids[1]] * 2 + [new] * 2
    # Retention removed the abandoned snapshots and every file only they referenced.
    assert len(table.iceberg_table.metadata.snapshots) == 3
    referenced = set().union(*(snapshot_files(table, s) for s in table.iceberg_table.metadata.snapshots))
    leftovers = {p for p in table_files(table) if p not in referenced and not p.endswith(".metadata.json")}
    assert leftovers == set()
