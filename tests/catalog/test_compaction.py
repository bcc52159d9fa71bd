"""Compaction (work in progress): a partition's segments rewritten into one, same state for
every reader; a checkpoint committed during a compaction wins and the compaction retries."""

from __future__ import annotations

import pyarrow as pa
import pytest

from catalog import IcebergStateTable, connect
from catalog import compaction as compaction_module
from catalog.compaction import CompactionPolicy, compact, compact_partition
from statestore import (
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    StateLayout,
    StateStore,
    TtlConfig,
    ValueStateDescriptor,
)

N = 8
DESCRIPTORS = [ValueStateDescriptor("v", pa.int64()), ListStateDescriptor("l", pa.string()),
               MapStateDescriptor("m", pa.int64(), key_type=pa.string()),
               ValueStateDescriptor("t", pa.int64(), ttl=TtlConfig(1000))]
LAYOUT = StateLayout.of(pa.schema([("k", pa.string())]), DESCRIPTORS, N)
ALL = KeyGroupRange.of(0, N - 1)


def keys(ks) -> pa.Table:
    return pa.table({"k": pa.array(list(ks), pa.string())})


def snapshot_state(table: IcebergStateTable, now_ms: int) -> dict:
    con = connect(table, now_ms=now_ms)
    return {d.name: sorted(map(repr, con.sql(f"SELECT * FROM state_{d.name}").fetchall())) for d in DESCRIPTORS}


def build(warehouse: str, clock: list[int]) -> tuple[IcebergStateTable, StateStore]:
    from statestore import StoreConfig

    table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op", retain_checkpoints=50)
    store = StateStore(table, config=StoreConfig(clock_ms=lambda: clock[0]))
    ks = [f"k{i}" for i in range(40)]
    for c in range(10):
        clock[0] = 1000 * c
        store.get_state("v").update_batch(keys(ks[c:c + 20]), list(range(c, c + 20)))
        store.get_state("v").clear_batch(keys(ks[c * 3 % 40: c * 3 % 40 + 2]))
        store.get_state("l").add_batch(keys(ks[:5]), [f"e{c}"] * 5)
        if c % 4 == 3:
            store.get_state("l").clear_batch(keys(ks[:2]))
        store.get_state("m").put_batch(keys(ks[:8]), [f"u{c % 3}"] * 8, [c] * 8)
        store.get_state("m").remove_batch(keys(ks[:3]), ["u0"] * 3)
        store.get_state("t").update_batch(keys(ks[c:c + 3]), [c] * 3)
        store.checkpoint(batch_id=c)
    return table, store


def test_compaction_keeps_every_state_and_leaves_one_file(tmp_path):
    clock = [0]
    table, store = build(str(tmp_path / "wh"), clock)
    now = clock[0]
    before = snapshot_state(table, now)
    files_before = len(table.segments(ALL))
    assert files_before == 10
    other = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    result = compact_partition(other, 0, now_ms=now)
    assert result is not None and result.files_in == 10 and result.files_out == 1
    assert result.entries_out < result.entries_in  # shadowed, deleted and expired entries are gone
    other.restore()
    assert len(other.segments(ALL)) == 1
    assert snapshot_state(other, now) == before
    # the stream goes on: its next checkpoint follows the compaction
    store.get_state("v").update_batch(keys(["k0"]), [999])
    store.checkpoint(batch_id=10)
    other.restore()
    assert len(other.segments(ALL)) == 2
    after = snapshot_state(other, now)
    assert after["l"] == before["l"] and after["m"] == before["m"]
    other.close()
    store.close()
    table.close()


def test_a_checkpoint_committed_during_compaction_wins_and_compaction_retries(tmp_path, monkeypatch):
    clock = [0]
    table, store = build(str(tmp_path / "wh"), clock)
    other = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    real_commit = compaction_module._commit
    raced = []

    def commit_after_a_checkpoint(*args):
        if not raced:  # the stream commits between the compaction's plan and its commit
            store.get_state("v").update_batch(keys(["k1"]), [12345])
            raced.append(store.checkpoint(batch_id=10).checkpoint_id)
        return real_commit(*args)

    monkeypatch.setattr(compaction_module, "_commit", commit_after_a_checkpoint)
    result = compact_partition(other, 0, now_ms=clock[0])
    assert result is not None and result.attempts == 2
    other.restore()
    assert other.current_checkpoint().checkpoint_id == raced[0]  # the checkpoint stands
    con = connect(other, now_ms=clock[0])
    assert con.sql("SELECT v_v FROM state_v WHERE k = 'k1'").fetchall() == [(12345,)]
    # it committed the same output again on top of the checkpoint, without re-reading anything
    assert len(other.segments(ALL)) == 2
    other.close()
    store.close()
    table.close()


def test_policy_skips_a_partition_that_does_not_need_it(tmp_path):
    clock = [0]
    table, store = build(str(tmp_path / "wh"), clock)
    other = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    assert compact_partition(other, 0, policy=CompactionPolicy(min_segments=50)) is None
    assert compact_partition(other, 0, policy=CompactionPolicy(min_segments=5)) is not None
    other.close()
    store.close()
    table.close()


@pytest.mark.parametrize("segments", [0, 1])
def test_nothing_to_compact(tmp_path, segments):
    table = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    store = StateStore(table)
    for c in range(segments):
        store.get_state("v").update_batch(keys(["a"]), [c])
        store.checkpoint()
    assert compact_partition(table, 0) is None
    store.close()
    table.close()


def test_a_partial_merge_keeps_the_tombstones_that_hide_older_segments(tmp_path):
    """Merging only the newest segments must keep a clear that hides a value (or list, or map
    entry) in an older segment left out; a whole merge afterwards drops both."""
    wh = str(tmp_path / "wh")
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    store = StateStore(table)
    store.get_state("v").update_batch(keys(["a", "b"]), [1, 2])
    store.get_state("l").add_batch(keys(["a"]), ["x"])
    store.get_state("m").put_batch(keys(["a", "a"]), ["u1", "u2"], [1, 2])
    store.checkpoint()  # the older segment, left out of the merge
    store.get_state("v").clear_batch(keys(["a"]))
    store.get_state("l").clear_batch(keys(["a"]))
    store.get_state("m").remove_batch(keys(["a"]), ["u1"])
    store.checkpoint()
    store.get_state("v").update_batch(keys(["c"]), [3])
    store.checkpoint()
    expected = snapshot_state(table, 0)
    other = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    result = compact(other, policy=CompactionPolicy(min_segments=2, max_merge=2))
    assert result is not None and (result.files_in, result.files_out, result.full_units) == (2, 1, 0)
    other.restore()
    assert len(other.segments(ALL)) == 2
    assert snapshot_state(other, 0) == expected
    full = compact(other)
    assert full is not None and full.full_units == 1 and full.entries_out < full.entries_in
    other.restore()
    assert len(other.segments(ALL)) == 1
    assert snapshot_state(other, 0) == expected
    other.close()
    store.close()
    table.close()
