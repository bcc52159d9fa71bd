"""The store on a real Iceberg table (SQLite SqlCatalog, local warehouse): the promises of
disaggregated state, checked by what is read and written rather than by timing.

- restore opens no segment file; the first lookup reads only its key group's row groups;
- a checkpoint adds only new files: every file of the previous snapshot stays, unchanged;
- the segments of several tasks commit as one snapshot stamped with the checkpoint;
- a corrupt or missing segment is a clear error, and the committed checkpoints stay.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import IcebergStateTable
from statestore import (
    CorruptSegmentError,
    KeyGroupRange,
    ListStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    ValueStateDescriptor,
    assign_key_groups,
    task_for_key_group,
)

N = 32
COUNT = ValueStateDescriptor("count", pa.int64())
PAGES = ListStateDescriptor("pages", pa.string())
LAYOUT = StateLayout.of(pa.schema([("user", pa.string())]), [COUNT, PAGES], N)


def keys(ids) -> pa.Table:
    return pa.table({"user": [f"user-{i}" for i in ids]})


def open_table(warehouse: Path, **kw) -> IcebergStateTable:
    return IcebergStateTable.open(LAYOUT, warehouse=str(warehouse), table_name="op", **kw)


def live_files(table: IcebergStateTable) -> dict[str, int]:
    return {t.file.file_path: t.file.file_size_in_bytes
            for t in table.iceberg_table.scan(snapshot_id=table.snapshot.snapshot_id).plan_files()}


@pytest.fixture
def warehouse(tmp_path: Path) -> Path:
    return tmp_path / "wh"


def build(warehouse: Path, n_keys: int = 5000, checkpoints: int = 3) -> None:
    table = open_table(warehouse)
    # Small row groups (one per key group here) so that pruning shows at this small size.
    store = StateStore(table, config=StoreConfig(row_group_rows_min=64))
    for c in range(checkpoints):
        ids = np.arange(n_keys)
        store.get_state(COUNT).update_batch(keys(ids), pa.array(ids + c, pa.int64()))
        store.get_state(PAGES).add_batch(keys(ids[: n_keys // 10]), [f"/p{c}"] * (n_keys // 10))
        store.checkpoint(batch_id=c)
    table.close()


def test_restore_reads_no_segment_and_first_lookup_reads_one_key_group(warehouse: Path):
    build(warehouse)
    table = open_table(warehouse)
    store = StateStore(table)
    assert store.stats()["segment_files_opened"] == 0
    assert store.stats()["segment_bytes_read"] == 0

    got = store.get_state(COUNT).get_batch(keys([7]))
    assert got.to_pylist() == [7 + 2]
    stats = store.stats()
    total = 0
    for path in live_files(table):
        md = pq.ParquetFile(path.removeprefix("file://")).metadata
        total += sum(md.row_group(g).total_byte_size for g in range(md.num_row_groups))
    assert stats["cache_key_groups"] == 1
    # One key group of 32: a small fraction of the state's bytes is read.
    assert 0 < stats["segment_bytes_read"] < total / 8


@pytest.mark.parametrize("parallelism", range(1, 9))
def test_rescale_is_metadata_and_each_task_reads_only_its_key_groups(warehouse: Path, parallelism: int):
    """A state written by 1 task opened by ``parallelism`` tasks: nothing is written, every task
    reads every one of its keys right, and what it reads is about its share of the state (each
    row group is read by its owner only: the tasks' bytes add up to the state's once)."""
    build(warehouse, n_keys=3000, checkpoints=2)
    data = warehouse / "state" / "op" / "data"
    before = {p: p.stat().st_mtime_ns for p in data.rglob("*")}
    table = open_table(warehouse)
    ids = np.arange(3000)
    owner = task_for_key_group(N, parallelism, assign_key_groups(keys(ids), N).astype(np.int64))
    total = sum(s.size_bytes for s in table.segments(KeyGroupRange.of(0, N - 1)))
    read = []
    for t in range(parallelism):
        store = StateStore(table, task_index=t, parallelism=parallelism, config=StoreConfig(row_group_rows_min=64))
        mine = ids[owner == t]
        assert store.get_state(COUNT).get_batch(keys(mine)).to_pylist() == (mine + 1).tolist()
        stats = store.stats()
        r = store.key_group_range
        share = (r.end - r.start + 1) / N
        assert stats["segment_bytes_read"] <= total * share * 1.5 + 4096, (t, stats, share)
        read.append(stats["segment_bytes_read"])
        store.close()
    table.close()
    assert {p: p.stat().st_mtime_ns for p in data.rglob("*")} == before  # no file written or rewritten
    assert sum(read) <= total  # every column chunk read once, by its owner


def test_checkpoint_adds_files_and_changes_none(warehouse: Path):
    build(warehouse, checkpoints=2)
    table = open_table(warehouse)
    before = live_files(table)
    store = StateStore(table)
    store.get_state(COUNT).update_batch(keys([1, 2, 3]), [10, 20, 30])
    info = store.checkpoint(batch_id=9)
    after = live_files(table)
    assert set(before) <= set(after)
    assert all(after[p] == size for p, size in before.items())
    new = set(after) - set(before)
    assert len(new) == 1 and f"cp{info.checkpoint_id:012d}" in next(iter(new))
    new_rows = pq.ParquetFile(next(iter(new)).removeprefix("file://")).metadata.num_rows
    assert new_rows == 3  # the delta, not the state


def test_several_tasks_commit_one_snapshot(warehouse: Path):
    table = open_table(warehouse)
    stores = [StateStore(table, task_index=i, parallelism=2) for i in range(2)]
    ids = np.arange(400)
    k = keys(ids)
    owner = task_for_key_group(N, 2, assign_key_groups(k, N).astype(np.int64))
    for i, store in enumerate(stores):
        mine = k.filter(pa.array(owner == i))
        store.get_state(COUNT).update_batch(mine, pa.array(np.ones(mine.num_rows, np.int64)))
    cp = table.next_checkpoint_id()
    segments = [s for store in stores for s in store.flush(cp)]
    assert {int(s.path.rsplit("-t", 1)[1][:5]) for s in segments} == {0, 1}
    snapshots_before = len(table.iceberg_table.snapshots())
    info = table.commit_checkpoint(cp, segments, parallelism=2, batch_id=41)
    for store in stores:
        store.checkpoint_complete(cp)
    assert len(table.iceberg_table.snapshots()) == snapshots_before + 1
    summary = table.snapshot.summary.additional_properties
    assert summary["icestate.checkpoint-id"] == str(cp)
    assert summary["icestate.batch-id"] == "41"
    assert summary["icestate.parallelism"] == "2"
    assert summary["icestate.max-parallelism"] == str(N)
    assert (info.checkpoint_id, info.batch_id, info.parallelism) == (cp, 41, 2)

    # Restored at parallelism 1, one task sees every key of both.
    whole = StateStore(open_table(warehouse))
    assert whole.get_state(COUNT).get_batch(k).to_pylist() == [1] * 400


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_corrupt_segment_is_a_clear_error_and_checkpoints_survive(warehouse: Path, damage: str):
    build(warehouse, checkpoints=1)
    table = open_table(warehouse)
    store = StateStore(table)
    store.get_state(COUNT).update_batch(keys([1]), [100])
    store.checkpoint()
    newest = next(p for p in live_files(table) if "cp000000000002" in p).removeprefix("file://")
    checkpoints = [c.checkpoint_id for c in table.list_checkpoints()]
    data = Path(newest).read_bytes()
    if damage == "truncate":
        Path(newest).write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        Path(newest).write_bytes(bytes(len(data)))
    else:
        Path(newest).unlink()

    fresh = StateStore(open_table(warehouse))
    with pytest.raises(CorruptSegmentError, match=Path(newest).name):
        fresh.get_state(COUNT).get_batch(keys([1]))
    table = open_table(warehouse)
    assert [c.checkpoint_id for c in table.list_checkpoints()] == checkpoints
    # The older checkpoint does not reference the damaged file and still restores.
    older = StateStore(open_table(warehouse, checkpoint_id=1))
    assert older.get_state(COUNT).get_batch(keys([1, 2])).to_pylist() == [1, 2]
