"""The ticks source's parts without Spark: when a batch without input is due, the beacon file
(its name, atomic replacement, damaged files, the sweep of stale ones) and the offsets the
source reports. The source inside Spark's queries is in tests/integration/test_spark_semantics.py."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from spark_integration.ticks import (
    BEACON_MAX_AGE_S,
    Beacon,
    _Reader,
    beacon_path,
    read_beacon,
    sweep_beacons,
    write_beacon,
)


def test_processing_time_is_due_when_the_earliest_timer_has_passed():
    beacon = Beacon(checkpoint_id=3, time_mode="processingtime", next_timer_ms=1000)
    assert not beacon.due(999) and beacon.due(1000) and beacon.due(5000)
    assert not Beacon(checkpoint_id=3, time_mode="processingtime").due(10**15)  # no timer
    assert not Beacon(checkpoint_id=3, time_mode="none", next_timer_ms=0).due(10**15)


def test_event_time_is_due_when_the_next_watermark_passes_the_earliest_timer():
    # The next batch's watermark must move (Spark runs no batch for a watermark that stays),
    # and reach the timer.
    assert Beacon(3, "eventtime", next_timer_ms=500, watermark_ms=100, next_watermark_ms=500).due(0)
    assert not Beacon(3, "eventtime", next_timer_ms=501, watermark_ms=100, next_watermark_ms=500).due(0)
    assert not Beacon(3, "eventtime", next_timer_ms=50, watermark_ms=100, next_watermark_ms=100).due(10**15)


def test_beacon_names_are_per_query_and_table_and_hold_no_secret(tmp_path):
    a = beacon_path("/cp/a", ("sqlite", "wh", "ns", "t"))
    assert a == beacon_path("/cp/a", ("sqlite", "wh", "ns", "t"))
    assert a != beacon_path("/cp/b", ("sqlite", "wh", "ns", "t"))
    assert a != beacon_path("/cp/a", ("sqlite", "wh", "ns", "u"))
    assert "cp" not in os.path.basename(a) and "wh" not in os.path.basename(a)


def test_beacon_round_trip_and_damaged_files_read_as_none(tmp_path):
    path = str(tmp_path / "b" / "x.json")
    assert read_beacon(path) is None
    beacon = Beacon(7, "eventtime", next_timer_ms=5, watermark_ms=1, next_watermark_ms=6, state={"numRowsUpdated": 2})
    write_beacon(path, beacon)
    assert read_beacon(path) == beacon
    assert os.listdir(tmp_path / "b") == ["x.json"]  # the temporary file was renamed into place
    with open(path, "w") as f:
        f.write('{"checkpoint_id": 7, "time_m')  # a torn write (another host's filesystem)
    assert read_beacon(path) is None
    with open(path, "w") as f:
        f.write('{"checkpoint_id": 7, "unknown": 1}')
    assert read_beacon(path) is None


def test_sweep_deletes_beacons_untouched_for_a_week_but_never_the_querys_own(tmp_path):
    own, fresh, stale, leftover, other = (str(tmp_path / n) for n in (
        "own.json", "fresh.json", "stale.json", "stale.json.123.tmp", "notes.txt"))
    for path in (own, fresh, stale, leftover, other):
        with open(path, "w") as f:
            f.write("{}")
    old = time.time() - BEACON_MAX_AGE_S - 60
    for path in (own, stale, leftover, other):
        os.utime(path, (old, old))
    assert sweep_beacons(keep=own) == 2
    assert sorted(os.listdir(tmp_path)) == ["fresh.json", "notes.txt", "own.json"]
    assert sweep_beacons(keep=str(tmp_path / "missing-dir" / "x.json")) == 0


def test_the_source_ticks_once_per_committed_checkpoint_with_something_due(tmp_path):
    path = str(tmp_path / "q.json")
    reader = _Reader(path)
    start = reader.initialOffset()
    assert reader.latestOffset(start, None) == start  # no beacon yet: no batch
    assert reader.reportLatestOffset() == {"ticks": None}
    write_beacon(path, Beacon(4, "processingtime", next_timer_ms=0, state={"numEntriesTotal": 9}))
    first = reader.latestOffset(start, None)
    assert first == {"ticks": 1, "checkpoint": 4}
    assert reader.latestOffset(first, None) == first  # the batch it ran has not committed yet
    assert reader.reportLatestOffset() == {"checkpoint": 4, "icestate": {"numEntriesTotal": 9}}
    write_beacon(path, Beacon(5, "processingtime", next_timer_ms=int(time.time() * 1000) + 3_600_000))
    assert reader.latestOffset(first, None) == first  # committed, next timer an hour away
    assert reader.partitions(start, first) == []


def test_unpickling_the_source_imports_nothing_of_the_store():
    """Spark runs the ticks source in Python processes of its own (a planner per step, the
    streaming reader's process), each unpickling it at a query's start on cores busy with the
    workers' warm-up: the source's module and its package must not bring in the store, polars,
    pyarrow or numpy (0.5 s a process when ``statestore`` imported its whole surface)."""
    import pickle
    import subprocess
    import sys

    from spark_integration.ticks import TicksDataSource

    script = (
        "import pickle, sys\n"
        f"source = pickle.loads({pickle.dumps(TicksDataSource)!r})\n"
        "assert source.name() == 'icestate_ticks'\n"
        "heavy = ['polars', 'pyarrow', 'numpy', 'statestore.store', 'statestore.keygroups', 'pyiceberg']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_beacon_of_the_wrong_shape_is_no_beacon(tmp_path):
    """Whoever could write a beacon gets no further than 'nothing is due': fields of other types
    (which would fail the source's comparisons inside Spark), a huge file, JSON nested deep."""
    path = str(tmp_path / "q.json")
    reader = _Reader(path)
    start = reader.initialOffset()
    good = {"checkpoint_id": 4, "time_mode": "processingtime", "next_timer_ms": 0, "watermark_ms": -1,
            "next_watermark_ms": -1, "state": None}
    hostile = [
        {**good, "next_timer_ms": "0"}, {**good, "checkpoint_id": True}, {**good, "checkpoint_id": 4.5},
        {**good, "time_mode": "sometimes"}, {**good, "state": [1]}, [good], "[" * 100_000 + "]" * 100_000,
        {**good, "state": {"x": "y" * (1 << 20)}},
    ]
    for value in hostile:
        with open(path, "w") as f:
            f.write(value if isinstance(value, str) else json.dumps(value))
        assert read_beacon(path) is None, value
        assert reader.latestOffset(start, None) == start
        assert reader.reportLatestOffset() == {"ticks": None}
    with open(path, "w") as f:
        json.dump(good, f)
    assert reader.latestOffset(start, None) == {"ticks": 1, "checkpoint": 4}


def test_beacons_live_in_a_directory_of_this_users_own(tmp_path):
    path = beacon_path("/cp/a", ("sqlite", "wh", "ns", "t"))
    assert os.path.basename(os.path.dirname(path)) == f"icestate-ticks-{os.getuid()}"
    made = str(tmp_path / "new" / "q.json")
    os.makedirs(tmp_path / "new", mode=0o755)
    os.chmod(tmp_path / "new", 0o755)
    with pytest.raises(PermissionError, match=r"new, is not this user's alone .*mode 755"):
        write_beacon(made, Beacon(1, "processingtime"))
    fresh = str(tmp_path / "fresh" / "q.json")
    write_beacon(fresh, Beacon(1, "processingtime"))
    assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o600
    # A link to a private directory is still refused: whoever made the link chose where it goes.
    os.symlink(tmp_path / "fresh", tmp_path / "link")
    with pytest.raises(PermissionError, match="not a directory"):
        write_beacon(str(tmp_path / "link" / "q.json"), Beacon(1, "processingtime"))


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory of another user's needs root")
def test_a_beacon_directory_of_another_user_is_refused(tmp_path):
    other = tmp_path / "other"
    os.mkdir(other, 0o700)
    os.chown(other, 65534, 65534)
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        write_beacon(str(other / "q.json"), Beacon(1, "processingtime"))
    assert os.listdir(other) == []
