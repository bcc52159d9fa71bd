"""Contract: what fails, fails cleanly. A commit of a missing or damaged segment commits
nothing; a damaged committed segment is a ``CorruptSegmentError`` naming the file while older
checkpoints stay restorable; a commit killed at a crash point leaves the newest complete
checkpoint; a table or store that was closed refuses calls; a layout the table was not made
for is refused, a new state variable is not.

The crash tests follow ``tests/statestore/test_crash_points.py`` (which checks every crash
point of the directory table, as ``tests/catalog/test_crash.py`` does for Iceberg's commit):
the parent commits step 1, a child process (``crash_child``) writes step 2 and checkpoints
with ``STATESTORE_CRASH_AT`` set; the parent reopens and checks that the current checkpoint
is 1 before the commit's atomic switch and 2 after it, with exactly the state of the plain
dict model, every visible segment intact, and that one more checkpoint leaves no segment of
the crashed attempt that nothing references. The points checked here are the two around
the switch, where the two outcomes meet.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from statestore import paths
from statestore.descriptors import ListStateDescriptor, ValueStateDescriptor
from statestore.errors import CheckpointNotFoundError, CorruptSegmentError, StateClosedError, StateTableMismatchError
from statestore.faults import CHECKPOINT_CRASH_POINTS, CRASH_ENV, CRASH_EXIT_CODE
from statestore.file_cache import close_process_file_caches
from statestore.layout import StateLayout
from statestore.store import StateStore
from tests.contract import crash_child
from tests.contract.helpers import (
    ALL_KEY_GROUPS,
    COUNT,
    KEY_SCHEMA,
    MAX_PARALLELISM,
    committed_store,
    read,
    write,
    write_segment,
)

REPO = str(Path(__file__).resolve().parents[2])

# ------------------------------------------------------------------ failed commits


@pytest.mark.parametrize("damage", ["delete", "truncate", "append"])
def test_commit_of_missing_or_damaged_segment_commits_nothing(backend, damage):
    table = committed_store(backend, {1: 1}).table
    record = backend.commit_record(table)
    before = table.segments(ALL_KEY_GROUPS)
    good = write_segment(table, 2, 0, [1, 2])
    bad = write_segment(table, 2, 1, [3])
    backend.damage(table, bad.path, damage)
    with pytest.raises(CorruptSegmentError, match=re.escape(bad.path)):
        table.commit_checkpoint(2, [good, bad], parallelism=2)
    assert backend.commit_record(table) == record
    assert table.current_checkpoint().checkpoint_id == 1 and table.segments(ALL_KEY_GROUPS) == before
    assert table.next_checkpoint_id() == 2
    assert read(StateStore(backend.open())) == {1: 1}


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_damaged_committed_segment_is_named_and_older_checkpoints_survive(backend, damage):
    table = backend.open()
    store = StateStore(table)
    write(store, {1: 1, 2: 2})
    store.checkpoint()
    write(store, {1: 100})
    store.checkpoint()
    (newest,) = [s.path for s in table.segments(ALL_KEY_GROUPS) if s.checkpoint_id == 2]
    checkpoints = table.list_checkpoints()
    backend.damage(table, newest, damage)

    # A reader in another process: this process's file cache (on for object stores) holds the
    # writer's intact copies, which it rightly serves (segments are immutable).
    close_process_file_caches()
    fresh = StateStore(backend.open())
    with pytest.raises(CorruptSegmentError, match=re.escape(newest)):
        fresh.get_state("count").get_batch(pa.table({"k": pa.array([1], pa.int64())}))
    reopened = backend.open()
    assert reopened.list_checkpoints() == checkpoints
    # The older checkpoint does not reference the damaged file and still restores.
    assert read(StateStore(backend.open(checkpoint_id=1))) == {1: 1, 2: 2}


# ------------------------------------------------------------------ crashed commits

# The last point before the commit's atomic switch and the first after it (a child process
# costs seconds; the per-implementation tests go through every point).
CONTRACT_CRASH_POINTS = ("commit_metadata_written", "commit_done")
SWITCHED_FROM = CHECKPOINT_CRASH_POINTS.index("commit_done")


def run_child(backend, crash_at: str) -> subprocess.CompletedProcess:
    env = {**os.environ, CRASH_ENV: crash_at, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "tests.contract.crash_child", backend.id, backend.location],
                          env=env, capture_output=True, text=True, timeout=120, check=False, cwd=REPO)


@pytest.mark.parametrize("crash_at", CONTRACT_CRASH_POINTS)
def test_crash_leaves_newest_complete_checkpoint_restorable(backend, crash_at):
    retain = crash_child.RETAIN_CHECKPOINTS
    files_before = backend.files(committed_store(backend, crash_child.STEPS[1], retain_checkpoints=retain).table)

    child = run_child(backend, crash_at)
    assert child.returncode == CRASH_EXIT_CODE, child.stderr

    switched = CHECKPOINT_CRASH_POINTS.index(crash_at) >= SWITCHED_FROM
    steps = [1, 2] if switched else [1]
    newest = len(steps)
    table = backend.open(retain_checkpoints=retain)
    crash_leftovers = backend.files(table) - files_before
    assert table.current_checkpoint().checkpoint_id == newest
    assert table.list_checkpoints()[-1].checkpoint_id == newest
    assert table.restore(newest).checkpoint_id == newest
    if not switched:
        with pytest.raises(CheckpointNotFoundError):  # an unfinished checkpoint is not restorable by id
            table.restore(2)
    assert table.next_checkpoint_id() > newest
    visible = table.segments(ALL_KEY_GROUPS)
    assert visible, "the restored checkpoint lists no segment"
    for seg in visible:
        assert backend.size_bytes(table, seg.path) == seg.size_bytes, seg.path
    store = StateStore(table)
    assert read(store) == crash_child.model(steps)

    write(store, crash_child.STEPS[3])
    newest = store.checkpoint().checkpoint_id
    assert read(StateStore(backend.open(retain_checkpoints=retain))) == crash_child.model([*steps, 3])
    referenced = {s.path for s in table.segments(ALL_KEY_GROUPS)}
    segments = {p: paths.parse_segment_name(p) for p in backend.files(table)}
    unreferenced = [p for p, parsed in segments.items()
                    if parsed is not None and parsed[0] <= newest and p not in referenced]
    assert unreferenced == []
    if switched:
        assert {p for p in crash_leftovers if segments.get(p)} <= referenced
    else:
        assert not crash_leftovers & set(segments), "files of the crashed checkpoint survived"


# ------------------------------------------------------------------ closed objects


def test_closed_table_refuses_calls(backend):
    table = backend.open()
    table.close()
    table.close()
    with pytest.raises(StateClosedError, match=re.escape(backend.name_in_errors(table))):
        table.next_checkpoint_id()


def test_closed_store_refuses_calls(backend):
    store = committed_store(backend, {1: 1})
    store.close()
    with pytest.raises(StateClosedError):
        store.get_state("count")
    assert read(StateStore(backend.open())) == {1: 1}


# ------------------------------------------------------------------ layouts


@pytest.mark.parametrize(
    "layout",
    [
        StateLayout.of(pa.schema([("k", pa.string())]), [COUNT], MAX_PARALLELISM),
        StateLayout.of(pa.schema([("key", pa.int64())]), [COUNT], MAX_PARALLELISM),
        StateLayout.of(pa.schema([("k", pa.int64()), ("k2", pa.int64())]), [COUNT], MAX_PARALLELISM),
        StateLayout.of(KEY_SCHEMA, [COUNT], 2 * MAX_PARALLELISM),
        StateLayout.of(KEY_SCHEMA, [ValueStateDescriptor("count", pa.string())], MAX_PARALLELISM),
        StateLayout.of(KEY_SCHEMA, [ListStateDescriptor("count", pa.int64())], MAX_PARALLELISM),
    ],
    ids=["key-type", "key-name", "extra-key-column", "max-parallelism", "value-type", "state-kind"],
)
def test_layout_mismatch_is_refused_and_leaves_the_table_intact(backend, layout):
    table = committed_store(backend, {1: 1}).table
    record = backend.commit_record(table)
    with pytest.raises(StateTableMismatchError, match=re.escape(backend.name_in_errors(table))):
        backend.open(layout)
    assert backend.commit_record(table) == record
    assert read(StateStore(backend.open())) == {1: 1}


def test_adding_a_state_variable_is_allowed_and_remembered(backend):
    first = committed_store(backend, {1: 1}).table.current_checkpoint()

    names = ValueStateDescriptor("names", pa.string())
    wider = StateLayout.of(KEY_SCHEMA, [COUNT, names], MAX_PARALLELISM)
    table = backend.open(wider)
    assert table.current_checkpoint().checkpoint_id == first.checkpoint_id
    assert "v_names" in table.file_schema().names
    store = StateStore(table)
    assert read(store) == {1: 1}
    assert read(store, "names") == {}
    write(store, {1: "one", 2: "two"}, state="names")
    store.checkpoint()

    store = StateStore(backend.open(wider))
    assert read(store) == {1: 1}
    assert read(store, "names") == {1: "one", 2: "two"}
    assert read(StateStore(backend.open())) == {1: 1}  # a job that does not declare "names" still opens
    changed = StateLayout.of(KEY_SCHEMA, [COUNT, ValueStateDescriptor("names", pa.int64())], MAX_PARALLELISM)
    with pytest.raises(StateTableMismatchError):
        backend.open(changed)

