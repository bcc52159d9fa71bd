"""The compactor process beside a writer: real processes, one real table.

* A writer commits checkpoints as fast as it can while its compactor process (started by
  ``CompactorProcess``) compacts the same table: every checkpoint commits, the state equals a
  dict model at every checkpoint, compactions committed between checkpoints, and the files
  per unit stay bounded.
* The compactor exits when its writer process is killed (its input closes).
* The compactor's command line holds no catalog property (secrets travel on its stdin).
* ``icestate compact`` compacts on demand.
* A compaction process killed at each crash point loses no state and leaks no file.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest

from catalog import IcebergStateTable, connect
from catalog import gc as gc_module
from catalog.compaction import CompactionPolicy, compactions, needs_compaction, units
from catalog.compactor import CompactorProcess, serve
from catalog.table_ref import TableRef
from statestore import (
    ListStateDescriptor,
    StateLayout,
    StateStore,
    ValueStateDescriptor,
    assign_key_groups,
    task_for_key_group,
)
from statestore.faults import COMPACTION_CRASH_POINTS, CRASH_ENV, CRASH_EXIT_CODE
from statestore.paths import COMPACTION_GRACE_CHECKPOINTS
from tests.catalog.catalog_helpers import referenced_files, table_files

N = 16
LAYOUT = StateLayout.of(pa.schema([("k", pa.int64())]),
                        [ValueStateDescriptor("v", pa.int64()), ListStateDescriptor("l", pa.int64())], N)
ROOT = Path(__file__).resolve().parents[2]


def ks(values) -> pa.Table:
    return pa.table({"k": pa.array(list(values), pa.int64())})


def owner(k: int, parallelism: int = 2) -> int:
    return int(task_for_key_group(N, parallelism, int(assign_key_groups(ks([k]), N)[0])))


def state_of(table: IcebergStateTable) -> tuple[dict, dict]:
    con = connect(table)
    values = dict(con.sql("SELECT k, v_v FROM state_v").fetchall())
    lists: dict[int, list] = {}
    for k, v in con.sql("SELECT k, v_l FROM state_l ORDER BY k, ord").fetchall():
        lists.setdefault(k, []).append(v)
    return values, lists


def test_a_compactor_process_compacts_while_the_writer_checkpoints(tmp_path):
    wh = str(tmp_path / "wh")
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op", retain_checkpoints=5)
    stores = [StateStore(table, task_index=t, parallelism=2) for t in range(2)]
    compactor = CompactorProcess(TableRef("op", warehouse=wh), CompactionPolicy(min_segments=3))
    model_v: dict[int, int] = {}
    model_l: dict[int, list] = {}
    checked = {}
    try:
        for batch in range(40):
            keys = [(batch * 7 + i * 13) % 200 for i in range(30)]
            for store in stores:
                mine = [k for k in keys if owner(k) == store.task_index]
                if not mine:
                    continue
                store.get_state("v").update_batch(ks(mine), [batch] * len(mine))
                store.get_state("l").add_batch(ks(mine[:3]), [batch] * len(mine[:3]))
                gone = mine[-2:]
                store.get_state("v").clear_batch(ks(gone))
                store.get_state("l").clear_batch(ks(gone))
            for k in keys:
                model_v[k] = batch
            for store in stores:
                for k in [k for k in keys if owner(k) == store.task_index][:3]:
                    model_l.setdefault(k, []).append(batch)
                for k in [k for k in keys if owner(k) == store.task_index][-2:]:
                    model_v.pop(k, None)
                    model_l.pop(k, None)
            cp = table.next_checkpoint_id()
            segments = [seg for s in stores for seg in s.flush(cp)]
            table.commit_checkpoint(cp, segments, parallelism=2, batch_id=batch)  # never fails nor waits
            for s in stores:
                s.checkpoint_complete(cp)
            compactor.checkpoint_committed(table)
            if batch % 10 == 9:
                checked[cp] = ({k: v for k, v in model_v.items()}, {k: list(v) for k, v in model_l.items()})
        assert compactor.pid is not None  # the policy asked for compaction, so the process runs
    finally:
        compactor.close()
    reader = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    done = compactions(reader)
    assert done, "the compactor committed no compaction"
    assert state_of(reader) == (model_v, model_l)
    for cp, expected in checked.items():  # retained checkpoints read the same, compacted or not
        if cp in {c.checkpoint_id for c in reader.list_checkpoints()}:
            reader.restore(cp)
            assert state_of(reader) == expected
    reader.restore()
    per_unit = [len(reader.segments(u)) for u in units(reader)]
    assert max(per_unit) <= 40 // 2  # without compaction: 40 per unit
    assert [c.checkpoint_id for c in reader.list_checkpoints()] == list(range(36, 41))
    reader.close()
    for s in stores:
        s.close()
    table.close()


WRITER = textwrap.dedent("""
    import sys, time
    import pyarrow as pa
    sys.path.insert(0, {root!r})
    from catalog import IcebergStateTable
    from catalog.compaction import CompactionPolicy
    from catalog.compactor import CompactorProcess
    from catalog.table_ref import TableRef
    from statestore import StateLayout, StateStore, ValueStateDescriptor
    layout = StateLayout.of(pa.schema([("k", pa.int64())]), [ValueStateDescriptor("v", pa.int64())], 16)
    table = IcebergStateTable.open(layout, warehouse={wh!r}, table_name="op")
    store = StateStore(table)
    compactor = CompactorProcess(TableRef("op", warehouse={wh!r}), CompactionPolicy(min_segments=2))
    for b in range(3):
        store.get_state("v").update_batch(pa.table({{"k": pa.array([b], pa.int64())}}), [b])
        store.checkpoint(batch_id=b)
        compactor.checkpoint_committed(table)
    print(compactor.pid, flush=True)
    time.sleep(600)
""")


def test_the_compactor_exits_when_its_writer_is_killed(tmp_path):
    wh = str(tmp_path / "wh")
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(root=str(ROOT), wh=wh)],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(writer.stdout.readline())
        assert _alive(pid)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the compactor outlived its killed writer"


def test_the_compactor_command_line_holds_no_catalog_property(tmp_path):
    """The catalog's properties (here a secret key and the catalog's URI) reach the compactor
    on its standard input: its command line, which every user of the host can read, holds
    none of them; and the compactor still opens the table and compacts it."""
    root = tmp_path / "named"
    root.mkdir()
    secret = "not-a-real-secret-7c1f"
    ref = TableRef("op", catalog_name="named", catalog_properties={
        "type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}", "warehouse": f"file://{root}",
        "init_catalog_tables": "true", "s3.secret-access-key": secret})
    table = ref.open(LAYOUT)
    store = StateStore(table)
    compactor = CompactorProcess(ref, CompactionPolicy(min_segments=2, size_ratio=1e12))
    try:
        _checkpoint_three_times(store, table, compactor)
        argv = Path(f"/proc/{compactor.pid}/cmdline").read_bytes().decode().split("\0")
        for value in ref.catalog_properties.values():
            assert not any(value in arg for arg in argv), (value, argv)
    finally:
        compactor.close()
    assert compactor.results, "the compactor did not compact: it could not open the table from its input"
    table.restore()
    assert len(compactions(table)) >= 1
    store.close()
    table.close()


def _checkpoint_three_times(store: StateStore, table: IcebergStateTable, compactor: CompactorProcess) -> None:
    """Three checkpoints of one key each, the compactor told of each: it has started."""
    for b in range(3):
        store.get_state("v").update_batch(ks([b]), [b])
        store.checkpoint(batch_id=b)
        compactor.checkpoint_committed(table)
    assert compactor.pid is not None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_icestate_compact_on_demand(tmp_path):
    wh = str(tmp_path / "wh")
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    store = StateStore(table)
    for b in range(6):
        store.get_state("v").update_batch(ks(range(b, b + 20)), [b] * 20)
        store.checkpoint(batch_id=b)
    before = state_of(table)
    cli = [sys.executable, "-m", "spark_integration.cli", "compact", "--warehouse", wh, "--table", "op"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([*cli, "--min-segments", "10", "--json"], capture_output=True, text=True, env=env,
                         cwd=ROOT, check=True)
    assert json.loads(out.stdout) is None  # 6 segments: the policy says no
    out = subprocess.run([*cli, "--json"], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    figures = json.loads(out.stdout)
    assert (figures["files_in"], figures["files_out"]) == (6, 1)
    table.restore()
    assert len(table.segments(units(table)[0])) == 1
    assert state_of(table) == before
    store.close()
    table.close()


def four_equal_segments(wh: str) -> tuple[IcebergStateTable, StateStore]:
    """A table whose single unit holds 4 checkpoints of 50 new keys each."""
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    store = StateStore(table)
    for b in range(4):
        store.get_state("v").update_batch(ks(range(100 * b, 100 * b + 50)), [b] * 50)
        store.checkpoint(batch_id=b)
    return table, store


def test_one_notification_compacts_until_the_policy_is_satisfied(tmp_path):
    """A merge can make a run with the segments below it (the tiered policy's carry): one
    notification compacts round after round until the policy selects nothing."""
    wh = str(tmp_path / "wh")
    table, store = four_equal_segments(wh)
    before = state_of(table)
    policy = CompactionPolicy(min_segments=2, max_merge=2)
    assert needs_compaction(table, policy)
    report = io.StringIO()
    results = serve(TableRef(table="op", warehouse=wh), policy, io.StringIO("3\n"), report)
    assert len(results) >= 2  # 4 equal segments, 2 per merge: the first merge alone leaves a run
    assert len(report.getvalue().splitlines()) == len(results)
    table.restore()
    assert not needs_compaction(table, policy)
    assert state_of(table) == before
    store.close()
    table.close()


def test_the_compactor_stops_quietly_when_its_writer_stopped_reading(tmp_path):
    """The writer's end of the results pipe closed (the writer died): the compactor keeps the
    compaction it committed and returns, with no traceback to show for it."""
    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    wh = str(tmp_path / "wh")
    table, store = four_equal_segments(wh)
    before = state_of(table)
    policy = CompactionPolicy(min_segments=2, max_merge=2)
    results = serve(TableRef(table="op", warehouse=wh), policy, io.StringIO("3\n3\n"), Closed())
    assert len(results) == 1  # one committed, then it noticed nobody reads its results
    table.restore()
    assert len(compactions(table)) == 1
    assert state_of(table) == before
    store.close()
    table.close()


@pytest.mark.parametrize("bad", ["--min-segments=1", "--size-ratio=0"])
def test_icestate_compact_refuses_a_bad_policy(tmp_path, bad):
    cli = [sys.executable, "-m", "spark_integration.cli", "compact", "--warehouse", str(tmp_path), "--table", "op"]
    out = subprocess.run([*cli, bad], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         cwd=ROOT)
    assert out.returncode != 0 and "CompactionPolicy" in out.stderr


CRASHING = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from catalog import IcebergStateTable
    from catalog.compaction import compact
    table = IcebergStateTable.open_existing(warehouse={wh!r}, table_name="op")
    compact(table)
""")


@pytest.mark.parametrize("point", COMPACTION_CRASH_POINTS)
def test_a_compaction_killed_at_any_point_loses_nothing_and_leaks_nothing(tmp_path, point, monkeypatch):
    """The compaction process dies (os._exit) at each crash point: the state reads the same,
    the writer goes on, and after the outputs' grace the orphan sweep leaves exactly the files
    the snapshots reference."""
    wh = str(tmp_path / "wh")
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op", retain_checkpoints=2)
    store = StateStore(table)
    for b in range(6):
        store.get_state("v").update_batch(ks(range(b, b + 20)), [b] * 20)
        store.get_state("v").clear_batch(ks([b * 3]))
        store.checkpoint(batch_id=b)
    before = state_of(table)
    child = subprocess.run([sys.executable, "-c", CRASHING.format(root=str(ROOT), wh=wh)],
                           env={**os.environ, CRASH_ENV: point}, capture_output=True, text=True, timeout=120)
    assert child.returncode == CRASH_EXIT_CODE, child.stderr
    monkeypatch.setattr(gc_module, "COMPACTION_GRACE_SECONDS", 0.0)  # its grace in seconds: none
    committed = point == "compaction_committed"
    table.restore()
    assert state_of(table) == before
    assert len(table.segments(units(table)[0])) == (1 if committed else 6)
    store.close()
    table.close()
    for b in range(6, 6 + COMPACTION_GRACE_CHECKPOINTS + 1):
        writer = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op", retain_checkpoints=2)
        s = StateStore(writer)  # a new table object: its first commit sweeps orphans
        s.get_state("v").update_batch(ks([1000 + b]), [b])
        s.checkpoint(batch_id=b)
        s.close()
        writer.close()
    reader = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    on_disk = {str(p) for p in Path(wh).rglob("*.parquet")}
    referenced = {s.path for s in reader.segments(units(reader)[0])}
    retained = set()
    for c in reader.list_checkpoints():
        reader.restore(c.checkpoint_id)
        retained |= {s.path for s in reader.segments(units(reader)[0])}
    assert on_disk == retained | referenced
    # Metadata too (found by the crash harness: the manifests of a compaction commit killed before
    # the catalog switch stayed forever; they carry the planned-on checkpoint now).
    assert table_files(reader) == referenced_files(reader)
    assert state_of(reader)[0] == {**before[0], **{1000 + b: b for b in range(6, 6 + COMPACTION_GRACE_CHECKPOINTS + 1)}}
    reader.close()


def test_a_reported_compaction_spares_the_writer_s_next_commit_a_lost_race(tmp_path, caplog):
    """The compactor process commits, then reports; the report tells the writer's table, whose
    next checkpoint then commits at its first attempt (untold, it would stage on the old head
    and lose once: ``test_compaction``)."""
    from catalog.compaction import compact_partition

    wh = str(tmp_path / "wh")
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    store = StateStore(table)
    for b in range(3):
        store.get_state("v").update_batch(ks([b]), [b])
        store.checkpoint(batch_id=b)
    compactor = CompactorProcess(TableRef("op", warehouse=wh), CompactionPolicy(min_segments=100))
    assert compactor.checkpoint_committed(table) is False  # nothing to compact yet: no process
    other = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")  # as the compactor's own
    result = compact_partition(other, 0, now_ms=0)
    assert result is not None
    compactor._read_results(io.StringIO(json.dumps(result.summary()) + "\n"))  # its report line
    assert compactor.results == [result.summary()]
    store.get_state("v").update_batch(ks([7]), [70])
    with caplog.at_level("INFO", logger="catalog.commit"):
        store.checkpoint(batch_id=3)
    assert "lost a race" not in caplog.text
    other.restore()
    assert state_of(other)[0] == {0: 0, 1: 1, 2: 2, 7: 70}
    compactor.close()
    other.close()
    store.close()
    table.close()


def test_the_compactor_runs_on_allocators_that_give_back_what_a_compaction_freed(tmp_path, monkeypatch):
    """The compactor process starts with ``statestore.memory.LONG_RUNNING_ENV`` (glibc's
    allocator for Python's objects and Arrow's buffers, trimmed after each compaction); a
    writer whose environment names its own allocator keeps it."""
    from statestore import memory

    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    wh = str(tmp_path / "wh")
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    store = StateStore(table)
    compactor = CompactorProcess(TableRef("op", warehouse=wh), CompactionPolicy(min_segments=2, size_ratio=1e12))
    try:
        _checkpoint_three_times(store, table, compactor)
        environ = dict(line.split("=", 1) for line in
                       Path(f"/proc/{compactor.pid}/environ").read_bytes().decode().split("\0") if "=" in line)
    finally:
        compactor.close()
    assert compactor.results
    assert environ["PYTHONMALLOC"] == memory.LONG_RUNNING_ENV["PYTHONMALLOC"]
    assert environ["ARROW_DEFAULT_MEMORY_POOL"] == "jemalloc"  # the writer's own choice
    store.close()
    table.close()
