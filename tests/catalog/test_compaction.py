"""Compaction: a unit's segments rewritten into one (whole, or its newest segments), the same
state for every reader; a checkpoint committed during a compaction wins and the compaction
commits again above it; crashed outputs are collected; forks compact on their own line."""

from __future__ import annotations

import os
import threading

import pyarrow as pa
import pytest

from catalog import IcebergStateTable, connect
from catalog import compaction as compaction_module
from catalog import gc as gc_module
from catalog.compaction import CompactionPolicy, compact, compact_partition, idle_priority
from catalog.fileio import METADATA_FILES
from statestore import (
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    StateLayout,
    StateStore,
    TtlConfig,
    ValueStateDescriptor,
    assign_key_groups,
)
from statestore.errors import CorruptMetadataError, CorruptSegmentError

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
    # batch_id: known only while the writing checkpoint is retained
    return {d.name: sorted(map(repr, con.sql(f"SELECT * EXCLUDE (batch_id) FROM state_{d.name}").fetchall()))
            for d in DESCRIPTORS}


def store_config(clock: list[int]):
    from statestore import StoreConfig

    return StoreConfig(clock_ms=lambda: clock[0])


def build(warehouse: str, clock: list[int], retain: int = 50) -> tuple[IcebergStateTable, StateStore]:
    table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op", retain_checkpoints=retain)
    store = StateStore(table, config=store_config(clock))
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


def test_compaction_beside_a_writer_with_small_retention_plans_again_defect_12(tmp_path, monkeypatch):
    """Defect 12 (``icestate compact --follow`` beside a writer retaining one checkpoint died on
    FileNotFoundError): the writer commits and expires the head the compaction planned on, so
    the manifest list it reads at its commit is gone. The compaction plans again on the new head."""
    clock = [0]
    table, store = build(str(tmp_path / "wh"), clock, retain=1)
    before = snapshot_state(table, clock[0])
    other = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    real_commit = compaction_module._commit
    raced = []

    def commit_after_two_checkpoints(*args):
        if not raced:  # the stream commits twice, expiring the head this compaction planned on
            for batch in (10, 11):
                store.get_state("v").update_batch(keys(["k1"]), [batch])
                raced.append(store.checkpoint(batch_id=batch).checkpoint_id)
        return real_commit(*args)

    monkeypatch.setattr(compaction_module, "_commit", commit_after_two_checkpoints)
    result = compact(other, now_ms=clock[0])
    assert result is not None and result.attempts == 2
    other.restore()
    assert other.current_checkpoint().checkpoint_id == raced[-1]
    after = snapshot_state(other, clock[0])
    def others(rows: list[str]) -> list[str]:
        return [r for r in rows if not r.startswith("('k1',")]

    assert others(after["v"]) == others(before["v"])
    assert connect(other, now_ms=clock[0]).sql("SELECT v_v FROM state_v WHERE k = 'k1'").fetchall() == [(11,)]
    assert after["l"] == before["l"] and after["m"] == before["m"]
    # its outputs, still valid, committed on the new head: one merged file and the racing checkpoints' two
    assert len(other.segments(ALL)) == 3
    other.close()
    store.close()
    table.close()


def test_compaction_names_a_missing_file_of_an_unmoved_head_defect_12(tmp_path):
    """A file of the head missing while no writer moved it is damage, said so with the file's name:
    a segment (CorruptSegmentError), the head's manifest list (CorruptMetadataError)."""
    clock = [0]
    table, store = build(str(tmp_path / "wh"), clock)
    other = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    segment = other.segments(ALL)[0].path
    other.filesystem.delete_file(segment)
    with pytest.raises(CorruptSegmentError, match="cannot be read") as raised:
        compact(other, now_ms=clock[0])
    assert segment in str(raised.value)
    other.close()
    store.close()
    table.close()

    table, store = build(str(tmp_path / "wh2"), clock)
    other = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh2"), table_name="op")
    manifest_list = other.iceberg_table.metadata.snapshot_by_name("main").manifest_list
    other.filesystem.delete_file(other.iceberg_table.io.new_input(manifest_list).location.split("://")[-1])
    METADATA_FILES.clear()  # as a fresh process: nothing of the table held in memory
    with pytest.raises(CorruptMetadataError, match="missing") as raised:
        compact(other, now_ms=clock[0])
    assert manifest_list.rsplit("/", 1)[-1] in str(raised.value)
    other.close()
    store.close()
    table.close()


def test_policy_skips_a_partition_that_does_not_need_it(tmp_path):
    clock = [0]
    table, store = build(str(tmp_path / "wh"), clock)
    other = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    assert compact_partition(other, 0, policy=CompactionPolicy(min_segments=50, size_ratio=2.0)) is None
    # size_ratio 2: these small deltas differ in size by a few bytes, which must not decide here
    assert compact_partition(other, 0, policy=CompactionPolicy(min_segments=5, size_ratio=2.0)) is not None
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


def test_a_crashed_compactions_output_is_collected_only_once_it_can_no_longer_commit(tmp_path, monkeypatch):
    from statestore.paths import COMPACTION_GRACE_CHECKPOINTS

    clock = [0]
    wh = str(tmp_path / "wh")
    table, store = build(wh, clock)
    other = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")

    def crash(*args):
        raise RuntimeError("compaction process died before its commit")

    monkeypatch.setattr(compaction_module, "_commit", crash)
    with pytest.raises(RuntimeError):
        compact(other)
    monkeypatch.undo()
    outputs = list((tmp_path / "wh").rglob("cmp-*.parquet"))
    assert len(outputs) == 1

    def checkpoint_with_sweep():  # a new table object sweeps orphans at its first commit
        writer = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op", retain_checkpoints=50)
        s = StateStore(writer)
        s.get_state("v").update_batch(keys(["k0"]), [1])
        s.checkpoint()
        s.close()
        writer.close()

    store.close()
    table.close()
    checkpoint_with_sweep()
    assert outputs[0].exists()  # still within its grace: a live compaction could commit it
    for _ in range(COMPACTION_GRACE_CHECKPOINTS):
        checkpoint_with_sweep()
    assert outputs[0].exists()  # past its grace in checkpoints, but younger than its grace in seconds
    monkeypatch.setattr(gc_module, "COMPACTION_GRACE_SECONDS", 0.0)
    checkpoint_with_sweep()
    assert not outputs[0].exists()
    # and compaction still works afterwards, with its own outputs kept
    assert compact(other) is not None
    other.restore()
    assert [p.name for p in (tmp_path / "wh").rglob("cmp-*.parquet")] == [
        s.path.rsplit("/", 1)[-1] for s in other.segments(ALL)]
    other.close()


def test_compaction_of_a_fork_leaves_main_untouched(tmp_path):
    clock = [0]
    wh = str(tmp_path / "wh")
    table, store = build(wh, clock)
    main_files = {s.path for s in table.segments(ALL)}
    table.fork("v2")
    fork = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op", branch="v2")
    fork_store = StateStore(fork, config=store_config(clock))
    fork_store.get_state("v").update_batch(keys(["k0"]), [-1])
    fork_store.checkpoint()
    expected_fork = snapshot_state(fork, clock[0])
    expected_main = snapshot_state(table, clock[0])
    compactor = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op", branch="v2")
    result = compact(compactor, now_ms=clock[0])
    assert result is not None and result.files_out == 1
    compactor.restore()
    out = compactor.segments(ALL)
    assert len(out) == 1 and "/branches/v2/c000000000000/cmp-" in out[0].path
    assert snapshot_state(compactor, clock[0]) == expected_fork
    table.restore()
    assert {s.path for s in table.segments(ALL)} == main_files
    assert snapshot_state(table, clock[0]) == expected_main
    # the fork's writer goes on above its compaction
    fork_store.get_state("v").update_batch(keys(["k1"]), [-2])
    fork_store.checkpoint()
    compactor.restore()
    assert len(compactor.segments(ALL)) == 2
    for t in (compactor, fork):
        t.close()
    fork_store.close()
    store.close()
    table.close()


def test_a_store_does_not_catch_up_over_a_compaction_that_dropped_a_tombstone(tmp_path):
    """Two stores of one task (two Spark workers): A holds checkpoint 1; B deletes a key in
    checkpoint 2 and a whole-unit compaction drops the tombstone with the entries it hides.
    A cannot find that deletion among the entries newer than checkpoint 1, so it refuses to
    catch up and restores; without the compaction it catches up reading one segment."""
    warehouse = str(tmp_path / "wh")
    a_table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op")
    a = StateStore(a_table)
    a.get_state("v").update_batch(keys(["x", "y"]), [1, 2])
    a.checkpoint(batch_id=0)
    assert a.get_state("v").get_batch(keys(["x", "y"])).to_pylist() == [1, 2]  # A's cache holds both
    b_table = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    b = StateStore(b_table)
    b.get_state("v").clear_batch(keys(["x"]))
    b.get_state("v").update_batch(keys(["y"]), [3])
    b.checkpoint(batch_id=1)

    a_table.restore()  # the newest checkpoint, as the driver ships it
    files = a.stats()["segment_files_opened"]
    assert a.catch_up()
    assert a.get_state("v").get_batch(keys(["x", "y"])).to_pylist() == [None, 3]
    assert a.stats()["segment_files_opened"] == files + 1  # checkpoint 2's segment alone

    a.get_state("v").update_batch(keys(["y"]), [4])
    a.checkpoint(batch_id=2)
    b_table.restore()
    assert b.catch_up()
    b.get_state("v").clear_batch(keys(["y"]))
    assert not b.catch_up(), "a store with writes since holds no checkpoint exactly"
    b.checkpoint(batch_id=3)
    result = compact(IcebergStateTable.open_existing(warehouse=warehouse, table_name="op"))
    assert result is not None
    a_table.restore()
    assert not a.catch_up(), "the compaction removed segments A's state was read from, and dropped the tombstone"
    a.restore()
    assert a.get_state("v").get_batch(keys(["x", "y"])).to_pylist() == [None, None]
    for t in (a_table, b_table):
        t.close()


@pytest.mark.parametrize("told", [False, True], ids=["not told", "told"])
def test_a_writer_told_of_a_compaction_commits_its_next_checkpoint_at_the_first_attempt(tmp_path, caplog, told):
    """After a compaction (another table object, as the compactor process) commits, the
    writer's next checkpoint would stage on the old head and lose its first attempt; told
    (``note_outside_commit``, what ``CompactorProcess`` does for each compaction it reports),
    it reads the metadata first and commits at once. The state is the same either way."""
    clock = [0]
    table, store = build(str(tmp_path / "wh"), clock)
    other = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    assert compact_partition(other, 0, now_ms=clock[0]) is not None
    if told:
        table.note_outside_commit()
    store.get_state("v").update_batch(keys(["k1"]), [777])
    with caplog.at_level("INFO", logger="catalog.commit"):
        cp = store.checkpoint(batch_id=10).checkpoint_id
    assert ("lost a race" in caplog.text) is not told
    other.restore()
    assert other.current_checkpoint().checkpoint_id == cp
    con = connect(other, now_ms=clock[0])
    assert con.sql("SELECT v_v FROM state_v WHERE k = 'k1'").fetchall() == [(777,)]
    assert len(other.segments(ALL)) == 2  # the compaction's output and the checkpoint's segment
    other.close()
    store.close()
    table.close()


def test_a_merge_per_unit_and_at_most_max_units_of_them(tmp_path):
    """A unit per task's key groups (one partition holds both here): each merges on its own
    (a Spark task each), and ``max_units`` takes the units with the most segments first."""
    table = IcebergStateTable.open(LAYOUT, warehouse=str(tmp_path / "wh"), table_name="op")
    stores = [StateStore(table, task_index=t, parallelism=2) for t in range(2)]
    ks = [f"k{i}" for i in range(40)]
    groups = assign_key_groups(keys(ks), N)
    for c in range(4):
        cp = table.next_checkpoint_id()
        segments = []
        for t, store in enumerate(stores):
            r = store.key_group_range
            mine = [k for k, g in zip(ks, groups, strict=True) if r.start <= g <= r.end]
            if t == 1 and c >= 2:
                continue  # task 1's unit gets two segments, task 0's four
            store.get_state("v").update_batch(keys(mine), [c] * len(mine))
            segments += store.flush(cp)
        table.commit_checkpoint(cp, segments, parallelism=2)
        for store in stores[:1 if c >= 2 else 2]:
            store.checkpoint_complete(cp)
    before = snapshot_state(table, 0)
    assert table.partition_count() == 1 and len(compaction_module.units(table)) == 2
    first = compact(table, policy=CompactionPolicy(min_segments=2, max_units=1))
    assert first is not None and first.units == (KeyGroupRange.of(0, 3),) and first.files_in == 4
    rest = compact(table, policy=CompactionPolicy(min_segments=2))
    assert rest is not None and rest.units == (KeyGroupRange.of(4, 7),) and rest.files_out == 1
    assert snapshot_state(table, 0) == before
    for store in stores:
        store.close()
    table.close()


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies")
def test_a_merge_in_a_spark_task_runs_at_idle_priority_and_gives_it_back():
    release = threading.Event()
    with idle_priority():
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
        started = threading.Thread(target=release.wait)  # as Arrow's and Polars' pools start theirs
        started.start()
        assert os.sched_getscheduler(started.native_id) == os.SCHED_IDLE
    try:
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        assert os.sched_getscheduler(started.native_id) == os.SCHED_OTHER
        assert {os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")} == {os.SCHED_OTHER}
    finally:
        release.set()
        started.join()


def test_where_a_worker_may_not_leave_idle_priority_a_merge_keeps_its_own(monkeypatch):
    monkeypatch.setattr(compaction_module, "_IDLE_REVERSIBLE", [False])  # as in a container without CAP_SYS_NICE
    with idle_priority():
        assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_max_units_counts_every_unit_a_selected_segment_reaches():
    from statestore.table import SegmentFile

    u = [KeyGroupRange.of(i, i + 3) for i in range(0, 16, 4)]

    def seg(name, lo, hi):
        return SegmentFile(name, 1, lo, hi, 1, 1)

    selected = {u[0]: [seg("wide", 0, 7)], u[2]: [seg("c", 8, 11)], u[3]: [seg("d1", 12, 15), seg("d2", 12, 15)]}
    assert list(compaction_module._within(selected, u, 2)) == [u[3], u[2]]  # the wide one would make three
    assert list(compaction_module._within(selected, u, 3)) == [u[3], u[0]]
    assert list(compaction_module._within({u[0]: selected[u[0]]}, u, 1)) == [u[0]]  # the first always
