"""Failure-path tests: a checkpoint killed at every crash point leaves the newest complete
checkpoint restorable, and the next checkpoint cleans up what the crashed one left behind.

Strategy, per crash point: the parent commits checkpoint 1 (step 1 of the writes below);
a child process (this module, imported by a one-line script) opens the same directory,
applies step 2 and checkpoints with ``STATESTORE_CRASH_AT`` set, so it dies at that point
with ``CRASH_EXIT_CODE``. The parent then reopens the table and checks invariant 2: the
current checkpoint is 1 before the HEAD switch and 2 after it; its state equals the plain
dict model of steps [1] or [1, 2] exactly; every segment it references exists with its
recorded size. One more checkpoint (step 3) must leave no unreferenced segment with a
checkpoint id at most the newest, and in particular none of the crashed attempt's orphans.
The child keeps one checkpoint (``retain_checkpoints=1``) so that retention has something
to expire and delete, which makes the last two crash points meaningful.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from statestore import paths
from statestore.descriptors import ListStateDescriptor, ValueStateDescriptor
from statestore.directory_table import CHECKPOINT_DIR, DirectoryStateTable
from statestore.errors import CheckpointNotFoundError
from statestore.faults import CHECKPOINT_CRASH_POINTS, CRASH_ENV, CRASH_EXIT_CODE
from statestore.keygroups import KeyGroupRange
from statestore.layout import StateLayout
from statestore.store import StateStore

MAX_PARALLELISM = 32
LAYOUT = StateLayout.of(
    pa.schema([("k", pa.int64())]),
    [ValueStateDescriptor("count", pa.int64()), ListStateDescriptor("events", pa.int64())],
    MAX_PARALLELISM,
)
RETAIN = 1
PROBE_KEYS = list(range(220))

# The writes of each step: value puts (None clears), list clears, then list appends.
STEPS = {
    1: {"count": {k: k for k in range(60)}, "clear_events": [],
        "append_events": {k: [k, k + 1] for k in range(20)}},
    2: {"count": {**{k: 10 * k for k in range(30, 90)}, **dict.fromkeys(range(10))},
        "clear_events": list(range(5)), "append_events": {k: [100 + k] for k in range(10, 30)}},
    3: {"count": dict.fromkeys(range(200, 210), 1), "clear_events": [12],
        "append_events": {200: [7]}},
}

# The point at which a DirectoryStateTable commit switches HEAD; crashes from here on keep
# checkpoint 2. Every crash point is reached by a DirectoryStateTable checkpoint (the store
# passes the first three, the table the rest), so every child must exit with CRASH_EXIT_CODE.
HEAD_SWITCHED_FROM = CHECKPOINT_CRASH_POINTS.index("commit_done")
NOT_REACHED_BY_DIRECTORY_TABLE: frozenset[str] = frozenset()
# Crash points after a segment file exists and before HEAD switches: orphans are left.
LEAVES_ORPHANS = {"segment_written", "segments_written", "commit_metadata_written"}

CHILD = """
import sys
sys.path[:0] = [{root!r}]
import tests.statestore.test_crash_points as test_crash_points
test_crash_points.child_main(sys.argv[1])
"""


def keys(ks) -> pa.Table:
    return pa.table({"k": pa.array(list(ks), pa.int64())})


def apply_step(store: StateStore, step: int) -> None:
    writes = STEPS[step]
    count, events = store.get_state("count"), store.get_state("events")
    puts = {k: v for k, v in writes["count"].items() if v is not None}
    clears = [k for k, v in writes["count"].items() if v is None]
    if puts:
        count.update_batch(keys(puts), list(puts.values()))
    if clears:
        count.clear_batch(keys(clears))
    if writes["clear_events"]:
        events.clear_batch(keys(writes["clear_events"]))
    rows = [(k, v) for k, vs in writes["append_events"].items() for v in vs]
    if rows:
        events.add_batch(keys(k for k, _ in rows), [v for _, v in rows])


def model(steps: list[int]) -> tuple[dict, dict]:
    count: dict = {}
    events: dict = {}
    for step in steps:
        for k, v in STEPS[step]["count"].items():
            if v is None:
                count.pop(k, None)
            else:
                count[k] = v
        for k in STEPS[step]["clear_events"]:
            events.pop(k, None)
        for k, vs in STEPS[step]["append_events"].items():
            events.setdefault(k, []).extend(vs)
    return count, events


def read_state(store: StateStore) -> tuple[dict, dict]:
    counts = store.get_state("count").get_batch(keys(PROBE_KEYS)).to_pylist()
    lists = store.get_state("events").get_batch(keys(PROBE_KEYS)).to_pylist()
    return ({k: v for k, v in zip(PROBE_KEYS, counts, strict=True) if v is not None},
            {k: v for k, v in zip(PROBE_KEYS, lists, strict=True) if v})


def open_store(location) -> StateStore:
    return StateStore(DirectoryStateTable(location, LAYOUT, retain_checkpoints=RETAIN))


def child_main(location: str) -> None:
    """Run by the child process: step 2 and a checkpoint (which the crash point interrupts)."""
    store = open_store(location)
    apply_step(store, 2)
    store.checkpoint()


def run_child(location: Path, crash_at: str) -> subprocess.CompletedProcess:
    script = CHILD.format(root=str(Path(__file__).resolve().parents[2]))
    env = {**os.environ, CRASH_ENV: crash_at}
    return subprocess.run([sys.executable, "-c", script, str(location)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def segment_files(location: Path) -> set[str]:
    return {str(p) for p in (location / paths.DATA_DIR).glob("seg-*.parquet")}


def referenced_segments(location: Path) -> set[str]:
    """Every segment path listed by a checkpoint file still on disk (read as plain JSON;
    paths are recorded relative to the table root)."""
    return {str(location.absolute() / s["path"]) for p in (location / CHECKPOINT_DIR).glob("cp-*.json")
            for s in json.loads(p.read_text())["segments"]}


def commit_checkpoint_1(location: Path) -> None:
    store = open_store(location)
    apply_step(store, 1)
    assert store.checkpoint().checkpoint_id == 1
    assert read_state(store) == model([1])


@pytest.mark.parametrize("crash_at", CHECKPOINT_CRASH_POINTS)
def test_crash_leaves_newest_complete_checkpoint_restorable(tmp_path, crash_at):
    location = tmp_path / "table"
    commit_checkpoint_1(location)
    files_of_checkpoint_1 = segment_files(location)

    child = run_child(location, crash_at)
    if crash_at in NOT_REACHED_BY_DIRECTORY_TABLE:
        assert child.returncode == 0, child.stderr
    else:
        assert child.returncode == CRASH_EXIT_CODE, child.stderr
    crash_leftovers = segment_files(location) - files_of_checkpoint_1
    assert bool(crash_leftovers) == (CHECKPOINT_CRASH_POINTS.index(crash_at) >= 1), crash_leftovers

    switched = CHECKPOINT_CRASH_POINTS.index(crash_at) >= HEAD_SWITCHED_FROM
    steps = [1, 2] if switched else [1]
    table = DirectoryStateTable(location, LAYOUT, retain_checkpoints=RETAIN)
    assert table.current_checkpoint().checkpoint_id == len(steps)
    assert table.list_checkpoints()[-1].checkpoint_id == len(steps)
    visible = table.segments(KeyGroupRange.of(0, MAX_PARALLELISM - 1))
    assert visible, "the restored checkpoint lists no segment"
    for seg in visible:
        assert os.path.getsize(seg.path) == seg.size_bytes, seg.path
    store = StateStore(table)
    assert read_state(store) == model(steps)

    apply_step(store, 3)
    newest = store.checkpoint().checkpoint_id
    assert read_state(open_store(location)) == model([*steps, 3])
    referenced = referenced_segments(location)
    unreferenced = [p for p in segment_files(location)
                    if p not in referenced and paths.parse_segment_name(p)[0] <= newest]
    assert unreferenced == []
    if crash_at in LEAVES_ORPHANS:
        assert not crash_leftovers & segment_files(location), "orphans of the crashed checkpoint survived"
    if switched:
        assert crash_leftovers <= referenced


def test_unfinished_checkpoint_is_not_restorable_by_id(tmp_path):
    """Regression: a checkpoint whose commit died before the HEAD switch never completed, so
    (invariant 2) it must not be visible, not even to an explicit restore of its id. Only
    ``commit_metadata_written`` leaves a checkpoint file behind; earlier points leave none."""
    location = tmp_path / "table"
    commit_checkpoint_1(location)
    assert run_child(location, "commit_metadata_written").returncode == CRASH_EXIT_CODE
    table = DirectoryStateTable(location, LAYOUT, retain_checkpoints=RETAIN)
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [1]
    with pytest.raises(CheckpointNotFoundError):
        table.restore(2)
