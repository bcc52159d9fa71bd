"""Tests of what only ``statestore.directory_table`` does: its HEAD and checkpoint files, a
sweep of orphan segments at every commit, and segment paths recorded relative to the root.

What every ``StateTable`` promises (commit, list, restore, retention, failed commits, layout
checks) is tested once for all implementations in ``tests/contract``. State goes in and out
through a real ``StateStore``; files on disk are checked by listing the directory, never
through the table under test.
"""

from __future__ import annotations

from pathlib import Path

from statestore import paths
from statestore.directory_table import CHECKPOINT_DIR, HEAD, DirectoryStateTable
from statestore.store import StateStore
from tests.contract.helpers import LAYOUT, read, write, write_segment


def open_store(location, layout=LAYOUT, **kwargs) -> StateStore:
    return StateStore(DirectoryStateTable(location, layout, **kwargs))


def checkpoint_files(location) -> list[int]:
    return sorted(int(p.name[3:-5]) for p in (Path(location) / CHECKPOINT_DIR).glob("cp-*.json"))


def segment_checkpoint_ids(location) -> list[int]:
    data = Path(location) / paths.DATA_DIR
    return sorted(paths.parse_segment_name(p.name)[0] for p in data.glob("seg-*.parquet"))


def head(location) -> str:
    return (Path(location) / CHECKPOINT_DIR / HEAD).read_text()


def test_head_and_checkpoint_files_follow_commits_and_retention(tmp_path):
    store = open_store(tmp_path, retain_checkpoints=2)
    write(store, {1: 10})
    store.checkpoint()
    assert head(tmp_path) == "1" and checkpoint_files(tmp_path) == [1]
    for cp in range(2, 6):
        write(store, {cp: cp * 10})
        store.checkpoint()
    assert head(tmp_path) == "5" and checkpoint_files(tmp_path) == [4, 5]
    store.restore(4)
    assert head(tmp_path) == "5"  # a restore alone changes no file
    write(store, {6: 6})
    assert store.checkpoint().checkpoint_id == 6
    assert head(tmp_path) == "6" and checkpoint_files(tmp_path) == [4, 6]

    single = tmp_path / "single"
    store = open_store(single, retain_checkpoints=1)
    for i in range(4):
        write(store, {i: i})
        store.checkpoint()
    assert checkpoint_files(single) == [4]


def test_every_commit_sweeps_orphans_up_to_the_newest_checkpoint(tmp_path):
    """Unlike Iceberg's sweep (at the first commit after open, then now and then), every
    commit here deletes the orphans it can: a segment of a checkpoint in flight goes as soon
    as a checkpoint with its id commits without it, in the same process."""
    store = open_store(tmp_path)
    write(store, {1: 1})
    store.checkpoint()
    crashed = write_segment(store.table, 2, 0, [0])
    future = write_segment(store.table, 5, 0, [0])
    write(store, {2: 2})
    store.checkpoint()
    assert not Path(crashed.path).exists() and Path(future.path).exists()
    for cp in (3, 4, 5):
        write(store, {cp: cp})
        assert store.checkpoint().checkpoint_id == cp
    assert not Path(future.path).exists()
    assert segment_checkpoint_ids(tmp_path) == [1, 2, 3, 4, 5]
    assert read(open_store(tmp_path)) == {1: 1, 2: 2, 3: 3, 4: 4, 5: 5}


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
