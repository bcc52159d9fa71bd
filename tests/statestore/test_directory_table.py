"""Unit tests of statestore.directory_table: commit, list, restore, retention, layout checks.

State goes in and out through a real ``StateStore`` (value state ``count`` keyed by a long),
and the expected state of every checkpoint is a plain dict kept by the test. Files on disk
are checked by listing the directory, never through the table under test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from statestore import paths
from statestore.descriptors import ListStateDescriptor, ValueStateDescriptor
from statestore.directory_table import CHECKPOINT_DIR, HEAD, DirectoryStateTable
from statestore.errors import CheckpointNotFoundError, CorruptSegmentError, StateTableMismatchError
from statestore.keygroups import KeyGroupRange
from statestore.layout import OP_PUT, StateLayout
from statestore.segment import write_segments
from statestore.store import StateStore
from statestore.table import SegmentFile

MAX_PARALLELISM = 16
KEY_SCHEMA = pa.schema([("k", pa.int64())])
COUNT = ValueStateDescriptor("count", pa.int64())
LAYOUT = StateLayout.of(KEY_SCHEMA, [COUNT], MAX_PARALLELISM)
ALL_KEY_GROUPS = KeyGroupRange.of(0, MAX_PARALLELISM - 1)
PROBE_KEYS = list(range(40))


def open_store(location, layout=LAYOUT, **kwargs) -> StateStore:
    return StateStore(DirectoryStateTable(location, layout, **kwargs))


def write(store: StateStore, changes: dict[int, int | None], state: str = "count") -> None:
    """Apply {key: value, or None to clear} through the batched API."""
    handle = store.get_state(state)
    puts = {k: v for k, v in changes.items() if v is not None}
    clears = [k for k, v in changes.items() if v is None]
    if puts:
        handle.update_batch(pa.table({"k": pa.array(list(puts), pa.int64())}), list(puts.values()))
    if clears:
        handle.clear_batch(pa.table({"k": pa.array(clears, pa.int64())}))


def read(store: StateStore, state: str = "count", keys=PROBE_KEYS) -> dict[int, object]:
    values = store.get_state(state).get_batch(pa.table({"k": pa.array(keys, pa.int64())})).to_pylist()
    return {k: v for k, v in zip(keys, values, strict=True) if v is not None}


def checkpoint_files(location) -> list[int]:
    return sorted(int(p.name[3:-5]) for p in (Path(location) / CHECKPOINT_DIR).glob("cp-*.json"))


def segment_checkpoint_ids(location) -> list[int]:
    data = Path(location) / paths.DATA_DIR
    return sorted(paths.parse_segment_name(p.name)[0] for p in data.glob("seg-*.parquet"))


def head(location) -> str:
    return (Path(location) / CHECKPOINT_DIR / HEAD).read_text()


def orphan_segment(table: DirectoryStateTable, checkpoint_id: int, key: int = 999) -> SegmentFile:
    """A segment written for ``checkpoint_id`` and never committed (a crashed attempt)."""
    schema = table.layout.entry_schema
    row = {f.name: None for f in schema}
    row.update(key_group=0, k=key, state="count", op=OP_PUT, checkpoint_id=checkpoint_id, seq=0, v_count=key)
    return write_segments(table, pa.Table.from_pylist([row], schema=schema), checkpoint_id, 0, 1, 10)[0]


# ---------------------------------------------------------------- commit, list, reopen


def test_empty_table(tmp_path):
    table = DirectoryStateTable(tmp_path, LAYOUT)
    assert table.current_checkpoint() is None
    assert table.list_checkpoints() == []
    assert table.next_checkpoint_id() == 1
    assert table.segments(ALL_KEY_GROUPS) == []
    assert table.restore() is None
    assert read(StateStore(table)) == {}


def test_commit_is_visible_after_reopen(tmp_path):
    store = open_store(tmp_path)
    write(store, {1: 10, 2: 20})
    info = store.checkpoint(batch_id=7, properties={"owner": "test"})
    assert (info.checkpoint_id, info.batch_id, info.parallelism, info.max_parallelism) == (1, 7, 1, MAX_PARALLELISM)
    assert info.properties == {"owner": "test"}
    assert head(tmp_path) == "1"

    table = DirectoryStateTable(tmp_path, LAYOUT)
    assert table.current_checkpoint() == info
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [1]
    assert read(StateStore(table)) == {1: 10, 2: 20}


def test_each_commit_sees_all_earlier_segments(tmp_path):
    store = open_store(tmp_path)
    changes = [{1: 1, 11: 100}, {2: 2, 1: 5}, {1: None, 3: 3}, {1: 7, 11: None}]
    expected_after = [{1: 1, 11: 100}, {1: 5, 2: 2, 11: 100}, {2: 2, 3: 3, 11: 100}, {1: 7, 2: 2, 3: 3}]
    for cp, (change, expected) in enumerate(zip(changes, expected_after, strict=True), start=1):
        write(store, change)
        assert store.checkpoint().checkpoint_id == cp
        assert read(open_store(tmp_path)) == expected
    assert [c.checkpoint_id for c in DirectoryStateTable(tmp_path, LAYOUT).list_checkpoints()] == [1, 2, 3, 4]


def test_segments_are_listed_by_key_group_range_oldest_first(tmp_path):
    table = DirectoryStateTable(tmp_path, LAYOUT)
    schema = LAYOUT.entry_schema

    def seg(cp, kgs):
        rows = [{**dict.fromkeys(schema.names), "key_group": kg, "k": kg, "state": "count", "op": OP_PUT,
                 "checkpoint_id": cp, "seq": i, "v_count": 1} for i, kg in enumerate(kgs)]
        return write_segments(table, pa.Table.from_pylist(rows, schema=schema), cp, 0, 1, 10)

    low = seg(1, [0, 3])
    table.commit_checkpoint(1, low, parallelism=1)
    high = seg(2, [8, 9])
    table.commit_checkpoint(2, high, parallelism=1)
    assert table.segments(KeyGroupRange.of(4, 7)) == []
    assert table.segments(KeyGroupRange.of(3, 8)) == low + high
    assert table.segments(KeyGroupRange.of(9, 15)) == high
    assert table.segments(KeyGroupRange.of(0, 0)) == low


def test_commit_id_must_grow(tmp_path):
    store = open_store(tmp_path)
    write(store, {1: 1})
    store.checkpoint()
    with pytest.raises(ValueError):
        store.table.commit_checkpoint(1, [], parallelism=1)
    assert checkpoint_files(tmp_path) == [1]


def test_restore_of_unknown_checkpoint(tmp_path):
    store = open_store(tmp_path)
    write(store, {1: 1})
    store.checkpoint()
    with pytest.raises(CheckpointNotFoundError, match="99"):
        store.table.restore(99)
    with pytest.raises(CheckpointNotFoundError):
        DirectoryStateTable(tmp_path, LAYOUT, checkpoint_id=99)


def test_retain_checkpoints_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        DirectoryStateTable(tmp_path, LAYOUT, retain_checkpoints=0)


# ---------------------------------------------------------------- retention


def test_retention_keeps_the_newest_checkpoints(tmp_path):
    store = open_store(tmp_path, retain_checkpoints=2)
    states = {}
    for cp in range(1, 6):
        write(store, {cp: cp * 10})
        store.checkpoint()
        states[cp] = {k: k * 10 for k in range(1, cp + 1)}
    assert checkpoint_files(tmp_path) == [4, 5]
    table = DirectoryStateTable(tmp_path, LAYOUT)
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [4, 5]
    with pytest.raises(CheckpointNotFoundError):
        table.restore(3)
    # segments of expired checkpoints are still referenced by the retained ones: none deleted
    assert segment_checkpoint_ids(tmp_path) == [1, 2, 3, 4, 5]
    assert read(open_store(tmp_path, checkpoint_id=4)) == states[4]
    assert read(open_store(tmp_path)) == states[5]


def test_retention_deletes_orphans_up_to_the_newest_checkpoint_only(tmp_path):
    store = open_store(tmp_path)
    write(store, {1: 1})
    store.checkpoint()
    crashed = orphan_segment(store.table, checkpoint_id=2)  # a crashed attempt of checkpoint 2
    future = orphan_segment(store.table, checkpoint_id=5)   # may belong to a checkpoint in flight
    other = Path(tmp_path) / paths.DATA_DIR / "README.txt"
    other.write_text("not a segment")

    write(store, {2: 2})
    assert store.checkpoint().checkpoint_id == 2
    assert not os.path.exists(crashed.path)
    assert os.path.exists(future.path)
    assert other.exists()
    assert segment_checkpoint_ids(tmp_path) == [1, 2, 5]
    assert read(open_store(tmp_path)) == {1: 1, 2: 2}  # the orphan's key 999 never shows

    for cp in (3, 4, 5):
        write(store, {cp: cp})
        assert store.checkpoint().checkpoint_id == cp
    assert not os.path.exists(future.path)
    assert segment_checkpoint_ids(tmp_path) == [1, 2, 3, 4, 5]
    assert read(open_store(tmp_path)) == {1: 1, 2: 2, 3: 3, 4: 4, 5: 5}


def test_restore_older_checkpoint_then_commit_abandons_newer_line(tmp_path):
    store = open_store(tmp_path)
    write(store, {1: 1, 2: 1, 3: 1})
    store.checkpoint()
    write(store, {1: 2, 4: 4})
    store.checkpoint()
    write(store, {5: 5, 2: None})
    store.checkpoint()

    assert store.restore(1).checkpoint_id == 1
    assert read(store) == {1: 1, 2: 1, 3: 1}
    assert store.table.next_checkpoint_id() == 4  # never reuses the ids of the abandoned line
    write(store, {6: 6})
    assert store.checkpoint().checkpoint_id == 4

    assert checkpoint_files(tmp_path) == [1, 4]
    assert segment_checkpoint_ids(tmp_path) == [1, 4]
    table = DirectoryStateTable(tmp_path, LAYOUT)
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [1, 4]
    with pytest.raises(CheckpointNotFoundError):
        table.restore(3)
    assert read(StateStore(table)) == {1: 1, 2: 1, 3: 1, 6: 6}
    assert table.next_checkpoint_id() == 5


def test_next_checkpoint_id_is_monotonic(tmp_path):
    store = open_store(tmp_path, retain_checkpoints=1)
    ids = []
    for i in range(4):
        write(store, {i: i})
        ids.append(store.checkpoint().checkpoint_id)
    assert ids == [1, 2, 3, 4]
    assert checkpoint_files(tmp_path) == [4]
    assert DirectoryStateTable(tmp_path, LAYOUT).next_checkpoint_id() == 5
    store.checkpoint()  # an empty checkpoint still takes the next id
    assert DirectoryStateTable(tmp_path, LAYOUT).next_checkpoint_id() == 6


def test_retention_follows_the_table_through_another_path_spelling(tmp_path):
    """Regression: committed segments are recognised by their path string, so a table opened
    through a symlink (or any other spelling of its directory) deletes the segments that a
    checkpoint committed through the other spelling still references."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    store = open_store(link)
    write(store, {1: 1})
    store.checkpoint()
    store = open_store(real)
    write(store, {2: 2})
    store.checkpoint()
    assert segment_checkpoint_ids(real) == [1, 2]
    assert read(open_store(real)) == {1: 1, 2: 2}


# ---------------------------------------------------------------- failed commits


def test_commit_of_missing_segment_commits_nothing(tmp_path):
    store = open_store(tmp_path)
    write(store, {1: 1})
    store.checkpoint()
    table = store.table
    good = orphan_segment(table, checkpoint_id=2, key=2)
    missing = SegmentFile(path=str(Path(tmp_path) / paths.DATA_DIR / paths.segment_file_name(2, 0, 0)),
                          checkpoint_id=2, key_group_min=0, key_group_max=0, record_count=1, size_bytes=100)
    with pytest.raises(CorruptSegmentError, match=missing.path):
        table.commit_checkpoint(2, [good, missing], parallelism=1)
    assert table.current_checkpoint().checkpoint_id == 1
    assert checkpoint_files(tmp_path) == [1]
    assert head(tmp_path) == "1"
    assert table.next_checkpoint_id() == 2
    assert read(open_store(tmp_path)) == {1: 1}


def test_commit_of_segment_with_wrong_size_commits_nothing(tmp_path):
    table = DirectoryStateTable(tmp_path, LAYOUT)
    seg = orphan_segment(table, checkpoint_id=1)
    with open(seg.path, "ab") as f:
        f.write(b"x")  # the file changed after it was written
    with pytest.raises(CorruptSegmentError, match=seg.path):
        table.commit_checkpoint(1, [seg], parallelism=1)
    assert table.current_checkpoint() is None
    assert checkpoint_files(tmp_path) == []


# ---------------------------------------------------------------- layout checks


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
def test_layout_mismatch_is_refused_and_leaves_the_table_intact(tmp_path, layout):
    store = open_store(tmp_path)
    write(store, {1: 1})
    store.checkpoint()
    with pytest.raises(StateTableMismatchError):
        DirectoryStateTable(tmp_path, layout)
    assert read(open_store(tmp_path)) == {1: 1}


def test_adding_a_state_variable_is_allowed_and_remembered(tmp_path):
    store = open_store(tmp_path)
    write(store, {1: 1})
    store.checkpoint()

    names = ValueStateDescriptor("names", pa.string())
    wider = StateLayout.of(KEY_SCHEMA, [COUNT, names], MAX_PARALLELISM)
    store = open_store(tmp_path, wider)
    assert read(store) == {1: 1}
    assert read(store, "names") == {}
    write(store, {1: "one", 2: "two"}, state="names")
    store.checkpoint()

    store = open_store(tmp_path, wider)
    assert read(store) == {1: 1}
    assert read(store, "names") == {1: "one", 2: "two"}
    assert read(open_store(tmp_path)) == {1: 1}  # a job that does not declare "names" still opens
    changed = StateLayout.of(KEY_SCHEMA, [COUNT, ValueStateDescriptor("names", pa.int64())], MAX_PARALLELISM)
    with pytest.raises(StateTableMismatchError):
        DirectoryStateTable(tmp_path, changed)
