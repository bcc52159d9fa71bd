"""The host's shared views (``statestore.host_views``): snapshots written once, mapped by any
store of the host, used only where they are the state of an ancestor checkpoint, and never
trusted beyond their checks (a damaged, partial or hostile snapshot is not read as state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
)
from statestore.host_views import MANIFEST, HostViews, RunPart, SnapshotDamaged, slot_name

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


def test_a_store_maps_what_another_published_and_catches_up(env):
    tmp_path, config, _ = env
    writer = store(tmp_path, config)
    write(writer, KEYS, 1)
    assert values(writer, KEYS)[0] == [1] * N  # loads every key group whole: published
    write(writer, KEYS[:10], 2)  # the commit publishes again, linking the runs it shares
    write(writer, KEYS[:5], 3)   # ... and again
    assert writer.stats()["host_views_published"] == 3 * 16
    reader = store(tmp_path, config)
    stats = reader.stats()
    assert stats["host_views_mapped"] == 16 and stats["segment_files_opened"] == 0
    assert values(reader, KEYS[:12]) == (
        [3] * 5 + [2] * 5 + [1] * 2, [[1, 2, 3]] * 5 + [[1, 2]] * 5 + [[1]] * 2)
    assert reader.stats()["segment_files_opened"] == 0  # nothing read: the views were the newest checkpoint's


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
    values(late, KEYS[:3])  # published at 5,000 ms
    clock.now_ms = 4_000  # a store whose clock is earlier: rows expired at 5,000 may be live for it
    early = store(tmp_path, config)
    assert early.stats()["host_views_mapped"] < late.stats()["host_views_published"]


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
    snap = host.publish("0" * 32, 4, 10, [("seg", 1, 1)], {0: {"v": [RunPart(frame, hashes, order, alive)]}})
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


@pytest.mark.parametrize("manifest", [
    "not json",
    json.dumps({"format": 99}),
    json.dumps({"format": 1, "checkpoint_id": 1, "resolved_at_ms": 1, "segments": [], "bytes": 1,
                "views": {"0": {"v": [{"name": "../../x", "rows": 1, "files": [["arrow", 1, 1]]}]}}}),
    json.dumps({"format": 1, "checkpoint_id": -1, "resolved_at_ms": 1, "segments": [], "bytes": 1, "views": {}}),
])
def test_a_manifest_that_is_not_ours_is_never_used(tmp_path, manifest):
    host = HostViews(str(tmp_path / "views"), 1 << 30, 0)
    bad = tmp_path / "views" / ("a" * 32) / "000000000001-1-0000abcd"
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
