"""Crash points of a checkpoint commit (DESIGN invariant 2).

Strategy: a child process opens a table that holds checkpoint 1, writes a segment of
checkpoint 2 and commits it with ``STATESTORE_CRASH_AT`` set, so it dies (``os._exit``) at
one crash point. The parent then checks, for every crash point:

* the newest complete checkpoint (1 before the catalog switch, 2 after) is the one the
  table opens at, is restorable, and every file of it exists;
* the next commit (and its retention and orphan sweep) leaves no file behind that no
  snapshot references: nothing of the crashed commit leaks. A commit's deletes run in the
  background, so a crash at any point after the switch (``files_deleted`` included) may
  leave its garbage: the first sweep after the reopen finds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from statestore.faults import CRASH_ENV, CRASH_EXIT_CODE
from statestore.keygroups import KeyGroupRange
from tests.catalog.catalog_helpers import (
    MAX_PARALLELISM,
    commit_next,
    file_exists,
    referenced_files,
    snapshot_files,
    table_files,
)

REPO = str(Path(__file__).resolve().parents[2])
ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)

# retain_checkpoints=1, so the crashed commit also has a snapshot to expire and files to delete.
CHILD = """
import sys
from catalog import IcebergStateTable
from tests.catalog.catalog_helpers import LAYOUT, commit_next
table = IcebergStateTable.open(LAYOUT, warehouse=sys.argv[1], table_name="op", retain_checkpoints=1)
commit_next(table, [[2, 5], [9]])
"""

# Each crash point, and the checkpoint that must be the newest complete one after it.
CRASHES = [
    ("commit_metadata_written", 1),
    ("commit_done", 2),
    ("snapshots_expired", 2),
    ("files_deleted", 2),
]


def _run_child(warehouse: str, crash_at: str) -> subprocess.CompletedProcess:
    env = {**os.environ, CRASH_ENV: crash_at, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", CHILD, warehouse], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("crash_at", "newest"), CRASHES)
def test_crash_leaves_newest_complete_checkpoint_and_no_garbage(open_table, warehouse, crash_at, newest):
    table = open_table(retain_checkpoints=1)
    commit_next(table, [[1, 3], [8]])
    table.close()

    child = _run_child(warehouse, crash_at)
    assert child.returncode == CRASH_EXIT_CODE, child.stderr

    table = open_table(retain_checkpoints=1)
    assert table.current_checkpoint().checkpoint_id == newest
    assert table.restore(newest).checkpoint_id == newest
    assert all(file_exists(p) for p in snapshot_files(table, table.snapshot))
    assert all(file_exists(s.path) for s in table.segments(ALL))
    assert table.next_checkpoint_id() == newest + 1

    commit_next(table, [[4], [10]])
    assert table_files(table) == referenced_files(table)
    assert all(file_exists(s.path) for s in table.segments(ALL))
