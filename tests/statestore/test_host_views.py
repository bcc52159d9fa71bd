"""The host's shared views (``statestore.host_views``): snapshots written once, mapped by any
store of the host, used only where they are the state of an ancestor checkpoint, and never
trusted beyond their checks (a damaged, partial or hostile snapshot is not read as state)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from statestore import (
    DirectoryStateTable,
    ListStateDescriptor,
    MapStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    ValueStateDescriptor,
    host_views,
)
from statestore.host_views import FORMAT, MANIFEST, HostViews, RunPart, SnapshotDamaged, slot_name
from statestore.table import SegmentFile

LAYOUT = StateLayout.of(pa.schema([("k", pa.string())]), [
    ValueStateDescriptor("v", pa.int64()),
    MapStateDescriptor("m", key_type=pa.string(), value_type=pa.int64()),
    ListStateDescriptor("l", pa.int64()),
], 16)
N = 3000
KEYS = [f"k{i}" for i in range(N)]


def keys(ks: list[str]) -> pa.Table:
    return pa.table({"k": pa.array(ks, pa.string())})


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def env(tmp_path):
    clock = Clock()
    config = StoreConfig(host_views=True, host_views_dir=str(tmp_path / "views"), view_index_rows_min=50,
                         clock_ms=clock, view_partial_reads_max=0)
    return tmp_path, config, clock


def store(tmp_path, config) -> StateStore:
    return StateStore(DirectoryStateTable(tmp_path / "table", LAYOUT), config=config)


def write(s: StateStore, ks: list[str], value: int) -> None:
    s.get_state("v").update_batch(keys(ks), [value] * len(ks))
    s.get_state("l").add_batch(keys(ks), [value] * len(ks))
    s.checkpoint()


def values(s: StateStore, ks: list[str]) -> tuple[list, list]:
    return s.get_state("v").get_batch(keys(ks)).to_pylist(), s.get_state("l").get_batch(keys(ks)).to_pylist()


@pytest.mark.parametrize("lag", [2, 3, 4])  # the default's neighbours (1 would write every commit)
def test_a_store_maps_what_another_published_and_catches_up(env, lag):
    tmp_path, config, _ = env
    config = dataclasses.replace(config, host_views_lag=lag)
    model = {k: [1] for k in KEYS}

    def write_and_model(s, ks, value):
        write(s, ks, value)
        for k in ks:
            model[k].append(value)

    def expected(ks):
        return [model[k][-1] for k in ks], [model[k] for k in ks]

    writer = store(tmp_path, config)
    write(writer, KEYS, 1)
    assert values(writer, KEYS)[0] == [1] * N  # loads every key group whole: published
    assert writer.stats()["host_views_published"] == 16
    for value in range(2, lag + 1):  # lag - 1 checkpoints behind: not written again yet
        write_and_model(writer, KEYS[:12 - value], value)
    assert writer.stats()["host_views_published"] == 16
    reader = store(tmp_path, config)
    assert reader.stats()["host_views_mapped"] == 16
    assert values(reader, KEYS[:12]) == expected(KEYS[:12])
    assert reader.stats()["segment_files_opened"] == lag - 1  # the checkpoints since, not the state
    # lag behind: written again (links, new runs), 1 / lag of the key groups a commit
    for value in range(lag + 1, 2 * lag):
        write_and_model(writer, KEYS[:1], value)
    assert writer.stats()["host_views_published"] == 16 + (lag - 1) * -(-16 // lag)
    again = store(tmp_path, config)
    assert again.stats()["host_views_mapped"] == 16
    assert values(again, KEYS[:2]) == expected(KEYS[:2])
    # the checkpoints its oldest snapshot (the first) is behind, each read once
    assert again.stats()["segment_files_opened"] == 2 * lag - 2


def test_a_task_that_moves_every_batch_keeps_every_key_groups_views_a_few_checkpoints_behind(env):
    """A Spark task run by another worker each batch: every batch's store maps the host's views,
    catches up, writes half of the key groups again (the most behind first), commits and is
    dropped (its commit completes nowhere). Each key group's views fall at most a few
    checkpoints behind, so a store's catch-up reads a bounded number of checkpoints; when every
    key group counted as behind as the most behind one, the same half was written every time and
    the other half's catch-ups grew by a checkpoint a batch."""
    tmp_path, config, _ = env
    writer = store(tmp_path, config)
    write(writer, KEYS, 0)
    values(writer, KEYS)  # every key group whole: published
    writer.close()
    table = DirectoryStateTable(tmp_path / "table", LAYOUT)
    opened = []
    for value in range(1, 9):
        moved = StateStore(table, config=config)
        assert moved.stats()["host_views_mapped"] == 16
        assert values(moved, KEYS[:3]) == ([value - 1] * 3, [[0, *range(1, value)]] * 3)
        opened.append(moved.stats()["segment_files_opened"])
        moved.get_state("v").update_batch(keys(KEYS), [value] * N)  # every key group
        moved.get_state("l").add_batch(keys(KEYS), [value] * N)
        checkpoint_id = table.next_checkpoint_id()
        table.commit_checkpoint(checkpoint_id, moved.flush(checkpoint_id), parallelism=1)
        moved.close()
    assert max(opened[4:]) <= 2, opened


def test_a_snapshot_off_the_line_or_resolved_later_is_not_used(env):
    tmp_path, config, clock = env
    writer = store(tmp_path, config)
    write(writer, KEYS, 1)
    write(writer, KEYS[:5], 2)
    values(writer, KEYS[:3])  # checkpoint 2's views, published
    writer.restore(1)  # back to 1, then on another line: checkpoint 2's snapshot is not its state
    write(writer, KEYS[:5], 7)
    fresh = store(tmp_path, config)
    assert fresh.stats()["host_views_mapped"] == 0
    assert values(fresh, KEYS[:6]) == ([7] * 5 + [1], [[1, 7]] * 5 + [[1]])  # loaded: published at 3
    again = store(tmp_path, config)
    assert again.stats()["host_views_mapped"] > 0
    assert values(again, KEYS[:6]) == ([7] * 5 + [1], [[1, 7]] * 5 + [[1]])

    clock.now_ms = 5_000
    late = store(tmp_path, config)
    write(late, KEYS[:1], 8)
    late.restore()  # maps the 6 key groups published at 1,000 ms
    values(late, KEYS)  # loads the other 10 at 5,000 ms: published
    clock.now_ms = 4_999  # a store whose clock is earlier: rows expired at 5,000 may be live for it
    assert store(tmp_path, config).stats()["host_views_mapped"] == 6
    clock.now_ms = 5_000
    assert store(tmp_path, config).stats()["host_views_mapped"] == 16


def store_at(warehouse: str, config: StoreConfig) -> StateStore:
    from catalog import IcebergStateTable

    return StateStore(IcebergStateTable.open_existing(warehouse=warehouse, table_name="op"), config=config)


def test_checkpoint_ids_are_no_ancestry_a_line_restored_past_a_snapshot(env):
    """Ids are per line: after a restore to 1, the abandoned line's checkpoint 2 and the kept
    line's checkpoint 3 share no state beyond 1. A snapshot taken on the kept line at 3 (nothing
    written since 1) serves a store back on the abandoned line's savepoint only with checkpoint
    2's entries applied on top, although 2 is below 3."""
    tmp_path, config, _ = env
    from catalog import IcebergStateTable

    warehouse = str(tmp_path / "wh")
    s = StateStore(IcebergStateTable.open(LAYOUT, table_name="op", warehouse=warehouse), config=config)
    write(s, KEYS[:200], 1)
    write(s, KEYS[:200], 2)
    s.table.savepoint("sp")
    s.restore(1)
    s.checkpoint()  # 3, on 1: the same state
    assert values(store_at(warehouse, config), KEYS[:3])[0] == [1, 1, 1]  # loaded at 3: published
    on_savepoint = StateStore(IcebergStateTable.open_existing(warehouse=warehouse, table_name="op", savepoint="sp"),
                              config=config)
    on_savepoint.checkpoint()  # 4, on 1 -> 2 -> 4
    fresh = store_at(warehouse, config)
    assert fresh.table.current_checkpoint().checkpoint_id == 4 and fresh.stats()["host_views_mapped"] > 0
    assert values(fresh, KEYS[:3]) == ([2, 2, 2], [[1, 2]] * 3)


def test_a_snapshot_of_another_table_of_the_same_layout_is_not_its_state(env):
    """A table whose key groups held nothing gives snapshots of no segment: another table of
    the same layout (the same slot) must not take them for an ancestor of its own state."""
    tmp_path, config, _ = env
    other = StateStore(DirectoryStateTable(tmp_path / "t2", LAYOUT), config=config)
    write(other, KEYS[:200], 42)
    other.checkpoint()
    empty = StateStore(DirectoryStateTable(tmp_path / "t1", LAYOUT), config=config)
    empty.checkpoint()
    empty.checkpoint()
    assert values(empty, KEYS[:3])[0] == [None] * 3 and empty.stats()["host_views_published"] > 0
    fresh = StateStore(DirectoryStateTable(tmp_path / "t2", LAYOUT), config=config)
    assert values(fresh, KEYS[:200])[0] == [42] * 200


def test_two_tables_of_the_same_layout_on_one_host_keep_each_others_snapshots(env):
    """Two queries of the same layout on one host (one slot): a snapshot replaces only the
    earlier snapshots of its own table, so each table's store still maps its views once the
    other published the same key groups (they evicted each other's as replaced)."""
    tmp_path, config, _ = env
    tables = [DirectoryStateTable(tmp_path / name, LAYOUT) for name in ("t1", "t2")]
    for value, table in enumerate(tables):
        writer = StateStore(table, config=config)
        write(writer, KEYS, value)
        assert values(writer, KEYS)[0] == [value] * N  # every key group whole: published
        writer.close()
    host = HostViews(config.host_views_dir, config.host_views_bytes_max, 0)
    (slot,) = (d for d in os.listdir(config.host_views_dir) if not d.startswith("."))
    assert len(host.snapshots(slot)) == 2
    for value, table in enumerate(tables):
        reader = StateStore(table, config=config)
        assert reader.stats()["host_views_mapped"] == 16
        assert values(reader, KEYS[:5])[0] == [value] * 5
        assert reader.stats()["segment_files_opened"] == 0


def test_a_snapshot_replaces_the_earlier_ones_of_its_own_table_only(tmp_path):
    frame = pl.DataFrame({"v": np.arange(10)})
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)

    def publish(table: str, checkpoint_id: int):
        segment = SegmentFile(f"s3://b/w/{table}/data/c000000000000/seg-cp{checkpoint_id:012d}-t00000-p00000-"
                              f"{checkpoint_id:012x}.parquet", checkpoint_id, 0, 0, 10, 100)
        return host.publish("c" * 32, checkpoint_id, 1, [segment], {0: {"v": [RunPart(frame)]}}).path

    first_a, first_b = publish("a", 1), publish("b", 1)
    assert {s.path for s in host.snapshots("c" * 32)} == {first_a, first_b}
    second_a = publish("a", 2)
    assert {s.path for s in host.snapshots("c" * 32)} == {second_a, first_b}
    empty = host.publish("c" * 32, 3, 1, [], {0: {"v": [RunPart(frame)]}}).path  # no segment: no table's
    assert {s.path for s in host.snapshots("c" * 32)} == {empty, second_a, first_b}
    fourth_b = publish("b", 4)  # replaces its table's and the one of no table
    assert {s.path for s in host.snapshots("c" * 32)} == {second_a, fourth_b}


def test_a_compaction_beside_a_snapshot_makes_it_unusable(env):
    """A compaction output's entries may be older than a snapshot's: beside its segments it
    makes the snapshot unusable (the state loads from the table)."""
    tmp_path, config, _ = env
    from catalog import IcebergStateTable
    from catalog.compaction import compact

    warehouse = str(tmp_path / "wh")
    s = StateStore(IcebergStateTable.open(LAYOUT, table_name="op", warehouse=warehouse), config=config)
    write(s, KEYS[:300], 1)
    write(s, KEYS[:300], 2)
    values(s, KEYS[:300])  # published over checkpoints 1 and 2's segments
    write(s, KEYS[:300], 3)
    with IcebergStateTable.open_existing(warehouse=warehouse, table_name="op") as table:
        assert compact(table, policy=None) is not None
    fresh = StateStore(IcebergStateTable.open_existing(warehouse=warehouse, table_name="op"), config=config)
    assert fresh.stats()["host_views_mapped"] == 0
    assert values(fresh, KEYS[:2]) == ([3, 3], [[1, 2, 3]] * 2)


def test_a_damaged_snapshot_is_deleted_and_the_state_loads_from_the_table(env):
    tmp_path, config, _ = env
    writer = store(tmp_path, config)
    write(writer, KEYS, 1)
    values(writer, KEYS)
    host = HostViews(config.host_views_dir, 1 << 30, 0)
    (snap,) = host.snapshots(slot_name(LAYOUT, "local"))
    victim = next(os.path.join(snap.path, f) for f in sorted(os.listdir(snap.path)) if f.endswith(".arrow"))
    with open(victim, "r+b") as f:  # same size, other bytes
        f.seek(os.path.getsize(victim) // 2)
        f.write(b"\xff\xfe")
    reader = store(tmp_path, config)  # a new process would check every file: this one did not write it
    reader.reader._host = host
    reader.restore()
    assert values(reader, KEYS[:4]) == ([1] * 4, [[1]] * 4)
    assert not os.path.exists(snap.path)


def test_open_runs_checks_sizes_digests_and_schemas(tmp_path):
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    frame = pl.DataFrame({"k": ["a", "b", "c"], "v": [1, 2, 3]})
    hashes = np.array([1, 2, 3], dtype=np.uint64)
    order = np.array([2, 0, 1], dtype=np.int64)
    alive = np.array([True, False, True])
    snap = host.publish("0" * 32, 4, 10, [], {0: {"v": [RunPart(frame, hashes, order, alive)]}})
    fresh = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    (run,) = fresh.open_runs(snap, snap.views[0]["v"], frame.schema)
    assert run.frame.equals(frame) and (run.hashes == hashes).all() and (run.order == order).all()
    run.alive[0] = False  # its own copy: the file is never written through
    assert fresh.open_runs(snap, snap.views[0]["v"], frame.schema)[0].alive.tolist() == [True, False, True]
    with pytest.raises(SnapshotDamaged, match="rows of"):
        fresh.open_runs(snap, snap.views[0]["v"], pl.Schema({"k": pl.String, "v": pl.Int32}))
    with open(os.path.join(snap.path, "r0.order.npy"), "ab") as f:
        f.write(b"x")
    with pytest.raises(SnapshotDamaged, match="bytes, its manifest says"):
        HostViews(str(tmp_path / "views"), 1 << 30, 0).open_runs(snap, snap.views[0]["v"], frame.schema)


def test_a_file_bearing_its_writers_stamp_is_not_checked_again_and_one_written_since_is(tmp_path, monkeypatch):
    """A reader skips the digest and Arrow's validation of a file that still bears the stamp its
    writer recorded (a second back: any write since moves it); a file written since, even with
    its own bytes, is checked again."""
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    frame = pl.DataFrame({"k": ["a", "b", "c"], "v": [1, 2, 3]})
    hashes, order = np.array([1, 2, 3], dtype=np.uint64), np.array([2, 0, 1], dtype=np.int64)
    snap = host.publish("0" * 32, 4, 10, [], {0: {"v": [RunPart(frame, hashes, order)]}})
    (run,) = snap.views[0]["v"]
    for suffix, _, _, (_, ino, mtime_ns) in run.files:
        st = os.lstat(os.path.join(snap.path, f"r0.{suffix}"))
        assert (st.st_ino, st.st_mtime_ns) == (ino, mtime_ns) and mtime_ns < time.time_ns() - 500_000_000
    digested, validated = [], []
    digest, map_frame = host_views._file_digest, host_views._map_frame
    monkeypatch.setattr(host_views, "_file_digest", lambda p: digested.append(os.path.basename(p)) or digest(p))
    monkeypatch.setattr(host_views, "_map_frame",
                        lambda p, validate=True: validated.append(validate) or map_frame(p, validate))
    (part,) = HostViews(str(tmp_path / "views"), 1 << 30, 0).open_runs(snap, (run,), frame.schema)
    assert part.frame.equals(frame) and (part.order == order).all()
    assert (digested, validated) == ([], [False])
    victim = os.path.join(snap.path, "r0.order.npy")
    with open(victim, "r+b") as f:  # its own bytes again, at once: the time moves all the same
        data = f.read()
        f.seek(0)
        f.write(data)
    HostViews(str(tmp_path / "views"), 1 << 30, 0).open_runs(snap, (run,), frame.schema)
    assert (digested, validated) == (["r0.order.npy"], [False, True])


@pytest.mark.parametrize("manifest", [
    "not json",
    json.dumps({"format": 99}),
    json.dumps({"format": FORMAT, "checkpoint_id": 1, "resolved_at_ms": 1, "segments": [], "bytes": 1,
                "top_checkpoint_id": -1,
                "views": {"0": {"v": [{"name": "../../x", "rows": 1, "files": [["arrow", 1, 1, 1, 1, 1]]}]}}}),
    json.dumps({"format": FORMAT, "checkpoint_id": 1, "resolved_at_ms": 1, "segments": [], "bytes": 1,
                "top_checkpoint_id": -1,
                "views": {"0": {"v": [{"name": "r0", "rows": 1, "files": [["arrow", 1, 1, 1, -1, 1]]}]}}}),
    json.dumps({"format": FORMAT - 1, "checkpoint_id": 1, "resolved_at_ms": 1, "segments": [], "bytes": 1,
                "top_checkpoint_id": -1,
                "views": {"0": {"v": [{"name": "r0", "rows": 1, "files": [["arrow", 1, 1]]}]}}}),
    json.dumps({"format": FORMAT, "checkpoint_id": -1, "resolved_at_ms": 1, "segments": [], "bytes": 1, "views": {},
                "top_checkpoint_id": -1}),
    "[" * 100_000,
])
def test_a_manifest_that_is_not_ours_is_never_used(tmp_path, manifest):
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    bad = tmp_path / "views" / ("a" * 32) / "000000000001-1-1-0000abcd"
    bad.mkdir(parents=True)
    (bad / MANIFEST).write_text(manifest)
    assert host.snapshots("a" * 32) == []
    assert not bad.exists()


def test_a_writer_killed_midway_leaves_nothing_read_and_its_leftovers_go(tmp_path):
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / "views" / ("b" * 32) / f".tmp-{int(dead.stdout)}-0000abcd"
    leftover.mkdir(parents=True)
    (leftover / "r0.arrow").write_bytes(b"partial")
    assert host.snapshots("b" * 32) == []
    host.publish("b" * 32, 1, 1, [], {0: {"v": [RunPart(pl.DataFrame({"v": [1]}))]}})
    assert not leftover.exists() and len(host.snapshots("b" * 32)) == 1


def test_the_bound_evicts_least_recently_used_and_mapped_runs_stay_readable(tmp_path):
    frame = pl.DataFrame({"v": np.arange(20_000)})
    host = HostViews(str(tmp_path / "views"), 400_000, 0)
    first = host.publish("c" * 32, 1, 1, [], {0: {"v": [RunPart(frame)]}})
    (mapped,) = host.open_runs(first, first.views[0]["v"], frame.schema)
    host.publish("d" * 32, 1, 1, [], {0: {"v": [RunPart(frame)]}})
    host.publish("e" * 32, 1, 1, [], {0: {"v": [RunPart(frame)]}})
    assert host.snapshots("c" * 32) == [] and host.size_bytes() <= 400_000
    assert mapped.frame.equals(frame)  # deleted under it: the mapping keeps its pages
    assert host.publish("f" * 32, 1, 1, [], {0: {"v": [RunPart(pl.DataFrame({"v": np.arange(100_000)}))]}}) is None


def test_processes_share_the_pages_of_a_mapped_view(tmp_path):
    """Two processes mapping one snapshot hold one copy between them: each one's proportional
    share (Pss) of the mapped rows is about half of what it maps."""
    host = HostViews(str(tmp_path / "views"), 1 << 31, 0)
    frame = pl.DataFrame({"k": [f"key-{i}" for i in range(400_000)], "v": np.arange(400_000)})
    host.publish("9" * 32, 1, 1, [], {0: {"v": [RunPart(frame)]}})
    script = f"""
import sys, time
from statestore.host_views import HostViews
import polars as pl
host = HostViews({str(tmp_path / 'views')!r}, 1 << 31, 0)
(snap,) = host.snapshots({'9' * 32!r})
(run,) = host.open_runs(snap, snap.views[0]['v'], pl.Schema({{'k': pl.String, 'v': pl.Int64}}))
assert run.frame['v'].sum() == {int(np.arange(400_000).sum())} and run.frame['k'].str.len_bytes().sum() > 0
path = snap.path
rss = pss = 0
for line in open('/proc/self/smaps'):
    if line[0].isdigit() or line[0] in 'abcdef':
        inside = path in line
    elif inside and line.startswith('Rss:'):
        rss += int(line.split()[1])
    elif inside and line.startswith('Pss:'):
        pss += int(line.split()[1])
print(rss, pss, flush=True)
sys.stdin.read()
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    first = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        first.stdout.readline()
        second = subprocess.run([sys.executable, "-c", script], input="", capture_output=True, text=True, env=env,
                                check=True)
        rss, pss = map(int, second.stdout.split())
    finally:
        first.communicate("")
    assert rss > 4_000 and pss < 0.6 * rss, (rss, pss)


def test_mapped_runs_hold_no_file_descriptor(tmp_path):
    """A host's workers map thousands of runs (key groups x variables x runs x tasks): each
    mapping must not keep a file open (the process's descriptor limit is often 1024)."""
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    frame = pl.DataFrame({"k": ["a", "b"], "v": [1, 2]})
    parts = RunPart(frame, np.array([1, 2], dtype=np.uint64), np.array([0, 1], dtype=np.int64),
                    np.array([True, True]))
    snap = host.publish("7" * 32, 1, 1, [], {0: {"v": [parts]}})
    before = len(os.listdir("/proc/self/fd"))
    runs = [host.open_runs(snap, snap.views[0]["v"], frame.schema)[0] for _ in range(300)]
    assert len(os.listdir("/proc/self/fd")) < before + 10
    assert runs[-1].frame.equals(frame) and runs[-1].order.tolist() == [0, 1]


def test_a_snapshot_serves_only_checkpoints_whose_other_segments_are_later_flushes():
    from statestore.host_views import Snapshot
    from statestore.paths import compaction_file_name, segment_file_name
    from statestore.table import SegmentFile

    def seg(name: str, checkpoint_id: int) -> SegmentFile:
        return SegmentFile(f"/t/data/{name}", checkpoint_id, 0, 15, 10, 100)

    a, b = seg(segment_file_name(1, 0, 0), 1), seg(segment_file_name(2, 0, 0), 2)
    snap = Snapshot("/v/s", 2, 1_000, frozenset((s.path, s.size_bytes, s.record_count) for s in (a, b)), 2, {}, 0)
    later = seg(segment_file_name(3, 0, 0), 3)
    assert snap.newer_segments([a, b], 1_000) == []
    assert snap.newer_segments([a, b, later], 1_000) == [later]
    assert snap.newer_segments([a, b, later], 999) is None  # resolved after the store's clock
    assert snap.newer_segments([a, later], 1_000) is None  # one of its segments is not the checkpoint's
    assert snap.newer_segments([a, b, seg(segment_file_name(2, 1, 0), 2)], 1_000) is None  # not newer: another line
    assert snap.newer_segments([a, b, seg(compaction_file_name(3, 0), 3)], 1_000) is None  # may hold older entries
    assert snap.newer_segments([a, b, seg("imported.parquet", 3)], 1_000) is None


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_run_file_that_is_not_a_regular_file_is_not_opened(tmp_path, kind):
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    frame = pl.DataFrame({"v": [1, 2]})
    snap = host.publish("6" * 32, 1, 1, [], {0: {"v": [RunPart(frame)]}})
    run = os.path.join(snap.path, "r0.arrow")
    os.unlink(run)
    if kind == "symlink":
        (tmp_path / "elsewhere.arrow").write_bytes(b"x" * 10)
        os.symlink(tmp_path / "elsewhere.arrow", run)
    else:
        os.mkfifo(run)
    with pytest.raises(SnapshotDamaged, match="not a regular file"):
        HostViews(str(tmp_path / "views"), 1 << 30, 0).open_runs(snap, snap.views[0]["v"], frame.schema)


def test_a_view_cut_from_a_larger_frame_is_written_with_its_own_bytes(tmp_path):
    """Polars' string views of a frame cut from a larger one share the larger one's buffers: a
    key group's view of a task's resolution must not write the whole task's strings."""
    big = pl.DataFrame({"k": [f"a-key-longer-than-twelve-{i:09d}" for i in range(200_000)], "v": np.arange(200_000)})
    part = big.with_columns(g=pl.col("v") % 100).partition_by("g", as_dict=True, include_key=False)[(7,)]
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    snap = host.publish("5" * 32, 1, 1, [], {0: {"v": [RunPart(part)]}})
    assert snap.bytes < 2_000 * 64
    (run,) = host.open_runs(snap, snap.views[0]["v"], part.schema)
    assert run.frame.equals(part)


def test_a_task_claimed_by_another_holder_for_this_checkpoint_or_later_ran_elsewhere(tmp_path):
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    assert not host.ran_elsewhere("t0", "w1", 5)  # no claim yet
    host.claim("t0", "w1", 5)
    assert not host.ran_elsewhere("t0", "w1", 5)  # its own
    assert host.ran_elsewhere("t0", "w2", 5) and host.ran_elsewhere("t0", "w2", 4)
    assert not host.ran_elsewhere("t0", "w2", 6)  # an older claim: the task has not started elsewhere yet
    assert not host.ran_elsewhere("t1", "w2", 5)  # another task
    host.claim("t0", "w2", 6)
    assert host.ran_elsewhere("t0", "w1", 6) and not host.ran_elsewhere("t0", "w2", 6)
    with pytest.raises(ValueError, match="plain token"):
        host.claim("t0", "w 1\n99", 1)
    assert host.snapshots("0" * 32) == [] and host.size_bytes() == 0  # claims are no snapshot


@pytest.mark.parametrize("content", ["w2", "w2 x", "w2 7 8", "w\u00e92 7", "w2 " + "9" * 40, "", "w2 -7"])
def test_a_claim_that_is_not_a_holder_and_a_checkpoint_says_nothing(tmp_path, content):
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    host.claim("t0", "w2", 1)
    path = host._claim_path("t0")
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)
    assert not host.ran_elsewhere("t0", "w1", 0)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_claim_that_is_not_a_regular_file_says_nothing(tmp_path, kind):
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    host.claim("t0", "w2", 1)
    path = host._claim_path("t0")
    os.remove(path)
    if kind == "symlink":
        (tmp_path / "elsewhere").write_text("w2 9")
        os.symlink(tmp_path / "elsewhere", path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkdir(path)
    assert not host.ran_elsewhere("t0", "w1", 0)  # returns at once: a FIFO is not read
