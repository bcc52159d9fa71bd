"""Timers without Spark: ``TimerService`` and ``run_processor`` with a fire time.

Spark's semantics (``transformWithState`` with processing or event time): after a batch's
input rows, every timer with expiry <= the batch's time fires, in (time, key) order; a
handler sees its own timer in ``listTimers()``; the timer is deleted after its handler,
so re-registering the same expiry inside the handler does not make it fire again; a timer
that an earlier handler of the batch deleted does not fire. Timers are keyed state: they
survive checkpoints, restores and rescales, and are read without loading the rest of the
task's state.
"""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, TimerValues

from spark_integration.compat import declare, run_processor
from spark_integration.timers import TIMERS_STATE, TimerService, normalize_time_mode, timers_descriptor
from statestore import DirectoryStateTable, StateStoreError, ValueStateDescriptor
from tests.spark_integration.si_helpers import (
    MAX_PARALLELISM,
    VALUE,
    FakeClock,
    commit_together,
    key_groups,
    keys_of_task,
    layout_of,
    open_store,
)

INPUT = pa.schema([("k", pa.string()), ("op", pa.string()), ("ts", pa.int64())])


class TimerProc(StatefulProcessor):
    """Input rows (k, op, ts): op 'reg' registers a timer at ts, 'del' deletes it, 'list' only
    reports. ``on_fire[(key, ts)]`` lists what the handler of that timer does: 'rereg' (the
    same expiry again), ('reg', t) or ('del', t)."""

    def __init__(self, on_fire: dict | None = None) -> None:
        self.on_fire = on_fire or {}

    def init(self, handle) -> None:
        self.handle = handle
        self.fires = handle.getValueState("fires", VALUE)

    def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            if row.op == "reg":
                self.handle.registerTimer(row.ts)
            elif row.op == "del":
                self.handle.deleteTimer(row.ts)
        yield Row(kind="rows", k=key[0], ts=-1, timers=json.dumps(list(self.handle.listTimers())))

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        ts = expiredTimerInfo.getExpiryTimeInMs()
        listed = list(self.handle.listTimers())
        self.fires.update(((self.fires.get() or (0,))[0] + 1,))
        for action in self.on_fire.get((key[0], ts), ()):
            if action == "rereg":
                self.handle.registerTimer(ts)
            elif action[0] == "reg":
                self.handle.registerTimer(action[1])
            else:
                self.handle.deleteTimer(action[1])
        yield Row(kind="fire", k=key[0], ts=ts, timers=json.dumps(listed))


def timer_layout():
    return layout_of([*declare(TimerProc()).descriptors, timers_descriptor()])


def rows_of(*triples: tuple[str, str, int]) -> pa.Table:
    cols = list(zip(*triples, strict=True)) if triples else [[], [], []]
    return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(cols, INPUT, strict=True)], schema=INPUT)


def step(processor, store, timers, rows: pa.Table, fire_upto: int | None) -> list[Row]:
    kgs = key_groups(rows.column("k").to_pylist())
    now = -1 if fire_upto is None else fire_upto
    return run_processor(processor, store, timers, rows, kgs, TimerValues(now, -1), fire_upto)


def fired(out: list[Row]) -> list[tuple[int, str]]:
    return [(r.ts, r.k) for r in out if r.kind == "fire"]


def listed(out: list[Row]) -> dict[str, list[int]]:
    return {r.k: json.loads(r.timers) for r in out if r.kind == "rows"}


def test_time_modes():
    assert normalize_time_mode("ProcessingTime") == "processingtime"
    assert normalize_time_mode("event_time") == "eventtime"
    assert normalize_time_mode("None") == "none"
    with pytest.raises(ValueError, match=r"time_mode 'wall' is not one of"):
        normalize_time_mode("wall")


def test_timers_fire_in_time_then_key_order_only_up_to_the_fire_time(tmp_path):
    store = open_store(tmp_path, timer_layout())
    timers = TimerService(store)
    regs = rows_of(("c", "reg", 100), ("a", "reg", 300), ("b", "reg", 100), ("d", "reg", 200), ("a", "reg", 100),
                   ("c", "reg", 500), ("e", "reg", 301))
    out = step(TimerProc(), store, timers, regs, 50)
    assert fired(out) == []
    assert listed(out) == {"c": [100, 500], "a": [100, 300], "b": [100], "d": [200], "e": [301]}
    assert timers.count() == 7

    out = step(TimerProc(), store, timers, rows_of(), 300)
    assert fired(out) == [(100, "a"), (100, "b"), (100, "c"), (200, "d"), (300, "a")]
    assert timers.count() == 2
    assert fired(step(TimerProc(), store, timers, rows_of(), 300)) == []  # each fires once
    assert fired(step(TimerProc(), store, timers, rows_of(), 1000)) == [(301, "e"), (500, "c")]
    assert timers.count() == 0


def test_timers_registered_by_the_batch_rows_fire_in_the_same_batch(tmp_path):
    store = open_store(tmp_path, timer_layout())
    timers = TimerService(store)
    out = step(TimerProc(), store, timers, rows_of(("a", "reg", 90), ("b", "reg", 150)), 100)
    assert fired(out) == [(90, "a")]
    assert [r.kind for r in out] == ["rows", "rows", "fire"]  # timers after every input row


def test_handler_sees_its_own_timer_in_list_timers(tmp_path):
    store = open_store(tmp_path, timer_layout())
    timers = TimerService(store)
    step(TimerProc(), store, timers, rows_of(("a", "reg", 100), ("a", "reg", 200), ("a", "reg", 900)), 0)
    out = step(TimerProc(), store, timers, rows_of(), 250)
    assert [(r.ts, json.loads(r.timers)) for r in out] == [(100, [100, 200, 900]), (200, [200, 900])]


def test_reregistering_the_same_expiry_in_its_handler_does_not_fire_again(tmp_path):
    store = open_store(tmp_path, timer_layout())
    timers = TimerService(store)
    proc = TimerProc(on_fire={("a", 100): ["rereg", ("reg", 700)]})
    step(proc, store, timers, rows_of(("a", "reg", 100), ("b", "reg", 100)), 0)
    assert fired(step(proc, store, timers, rows_of(), 200)) == [(100, "a"), (100, "b")]
    # Deleted after the handler, as Spark does: not listed, not fired again.
    out = step(proc, store, timers, rows_of(("a", "list", 0)), 200)
    assert fired(out) == [] and listed(out) == {"a": [700]}
    store.checkpoint()
    reopened = open_store(tmp_path, timer_layout())
    out = step(proc, reopened, TimerService(reopened), rows_of(), 1000)
    assert fired(out) == [(700, "a")]


def test_timer_deleted_by_an_earlier_handler_of_the_batch_does_not_fire(tmp_path):
    store = open_store(tmp_path, timer_layout())
    timers = TimerService(store)
    proc = TimerProc(on_fire={("a", 100): [("del", 200), ("del", 999)]})
    step(proc, store, timers, rows_of(("a", "reg", 100), ("a", "reg", 200), ("b", "reg", 150)), 0)
    assert fired(step(proc, store, timers, rows_of(), 300)) == [(100, "a"), (150, "b")]
    assert timers.count() == 0
    store.checkpoint()
    reopened = open_store(tmp_path, timer_layout())
    assert TimerService(reopened).count() == 0
    assert fired(step(proc, reopened, TimerService(reopened), rows_of(), 10_000)) == []


def test_deleting_a_timer_from_the_rows_and_registering_it_again(tmp_path):
    store = open_store(tmp_path, timer_layout())
    timers = TimerService(store)
    out = step(TimerProc(), store, timers, rows_of(("a", "reg", 100), ("a", "del", 100), ("a", "del", 5)), 0)
    assert listed(out) == {"a": []}
    step(TimerProc(), store, timers, rows_of(("a", "reg", 100), ("a", "reg", 100)), 0)
    assert timers.count() == 1
    assert fired(step(TimerProc(), store, timers, rows_of(), 100)) == [(100, "a")]  # once, despite the heap copies


def test_fired_handlers_write_state_of_their_key(tmp_path):
    layout = timer_layout()
    store = open_store(tmp_path, layout)
    timers = TimerService(store)
    step(TimerProc(on_fire={("a", 10): [("reg", 20)]}), store, timers, rows_of(("a", "reg", 10), ("b", "reg", 15)), 0)
    proc = TimerProc(on_fire={("a", 10): [("reg", 20)]})
    assert fired(step(proc, store, timers, rows_of(), 100)) == [(10, "a"), (15, "b")]
    # A timer that a handler registers at or before the fire time fires at the next batch.
    assert fired(step(proc, store, timers, rows_of(), 100)) == [(20, "a")]
    store.checkpoint()
    fires = open_store(tmp_path, layout).get_state("fires").get_batch(pa.table({"k": ["a", "b", "c"]}))
    assert fires.to_pylist() == [{"n": 2}, {"n": 1}, None]


def test_timers_survive_a_checkpoint_and_a_restore(tmp_path):
    layout = timer_layout()
    store = open_store(tmp_path, layout)
    timers = TimerService(store)
    step(TimerProc(), store, timers, rows_of(("a", "reg", 100), ("b", "reg", 200), ("c", "reg", 300)), 0)
    info = store.checkpoint()
    # Fired but never committed (the task failed): a restore brings the timers back.
    assert fired(step(TimerProc(), store, timers, rows_of(), 250)) == [(100, "a"), (200, "b")]
    store.restore(info.checkpoint_id)
    timers = TimerService(store)
    assert timers.count() == 3

    reopened = open_store(tmp_path, layout)  # another process, from the table alone
    again = TimerService(reopened)
    assert again.count() == 3
    assert fired(step(TimerProc(), reopened, again, rows_of(("d", "reg", 50)), 1000)) == [
        (50, "d"), (100, "a"), (200, "b"), (300, "c")]
    reopened.checkpoint()
    assert TimerService(open_store(tmp_path, layout)).count() == 0


def test_timers_move_with_their_key_groups_when_rescaled(tmp_path):
    layout = timer_layout()
    table = DirectoryStateTable(tmp_path, layout)
    stores = [open_store(tmp_path, layout, task_index=t, parallelism=2, table=table) for t in range(2)]
    keys = {t: keys_of_task(t, 2, 3, prefix=f"t{t}-") for t in range(2)}
    expected = []
    for t, store in enumerate(stores):
        triples = [(k, "reg", 100 * (i + 1) + t) for i, k in enumerate(keys[t])]
        triples.append((keys[t][0], "reg", 1000 + t))
        step(TimerProc(), store, TimerService(store), rows_of(*triples), 0)
        expected += [(ts, k) for k, _, ts in triples]
    commit_together(table, stores, parallelism=2)

    # 2 -> 1: the single task finds every timer and fires them in (time, key) order.
    single = open_store(tmp_path, layout)
    timers = TimerService(single)
    assert timers.count() == len(expected) == 8
    assert fired(step(TimerProc(), single, timers, rows_of(), 10_000)) == sorted(expected)

    # 1 -> 2 (from the checkpoint before the fires): each task finds its own timers only.
    for t in range(2):
        half = open_store(tmp_path, layout, task_index=t, parallelism=2)
        own = [(ts, k) for ts, k in expected if k in keys[t]]
        assert fired(step(TimerProc(), half, TimerService(half), rows_of(), 10_000)) == sorted(own)


def _big_state_with_few_timers(path):
    big = ValueStateDescriptor("payload", pa.string())
    layout = layout_of([big, timers_descriptor()])
    store = open_store(path, layout)
    keys = [f"k{i}" for i in range(300)]
    rng = random.Random(0)  # incompressible payloads: their bytes dominate the segment
    store.get_state("payload").update_batch(pa.table({"k": keys}), [rng.randbytes(1000).hex() for _ in keys])
    for k in keys[:5]:
        store.set_current_key(k)
        store.get_state(TIMERS_STATE).put(50 + int(k[1:]), True)
    store.checkpoint()
    return layout


def test_timers_are_scanned_without_loading_the_rest_of_the_state(tmp_path):
    layout = _big_state_with_few_timers(tmp_path)
    lean = open_store(tmp_path, layout)
    requested: list[list[str]] = []
    read = lean.reader._segments.read

    def recording_read(segments, key_groups, columns, keys=None):
        requested.append(list(columns))
        return read(segments, key_groups, columns, keys)

    lean.reader._segments.read = recording_read
    timers = TimerService(lean)
    assert timers.count() == 5
    assert lean.stats()["cache_key_groups"] == 0  # nothing of the task's state is cached
    assert requested and all("v_payload" not in cols and "v_icestate_timers" in cols for cols in requested)

    # And the scan sees the store's uncommitted writes.
    lean.set_current_key("k7")
    timers.register(77)
    assert TimerService(lean).count() == 6
    assert lean.stats()["cache_key_groups"] == 0


def test_timer_scan_bytes_read_count_only_the_timer_columns(tmp_path):
    layout = _big_state_with_few_timers(tmp_path)
    lean = open_store(tmp_path, layout)
    assert TimerService(lean).count() == 5
    scanned = lean.stats()["segment_bytes_read"]
    full = open_store(tmp_path, layout)
    assert full.live_view(TIMERS_STATE, range(MAX_PARALLELISM)).height == 5
    loaded = full.stats()["segment_bytes_read"]
    assert 0 < scanned * 10 < loaded, (scanned, loaded)


def test_scan_equals_the_live_view_around_a_checkpoint(tmp_path):
    """``StateStore.scan`` between flush and completion: a list variable's appends appear once."""
    from statestore import ListStateDescriptor

    layout = layout_of([ListStateDescriptor("l", pa.int64())])
    table = DirectoryStateTable(tmp_path, layout)
    store = open_store(tmp_path, layout, clock=FakeClock(), table=table)
    lst = store.get_state("l")
    keys = pa.table({"k": ["a", "b", "a"]})
    lst.add_batch(keys, [1, 2, 3])

    def both() -> tuple[list, list]:
        scan = store.scan("l").sort(["k", "ord"]).select("k", "v_l").rows()
        live = store.live_view("l", range(MAX_PARALLELISM)).sort(["k", "ord"]).select("k", "v_l").rows()
        return scan, live

    expected = [("a", 1), ("a", 3), ("b", 2)]
    assert both() == (expected, expected)
    cp = table.next_checkpoint_id()
    segments = store.flush(cp)
    lst.add_batch(pa.table({"k": ["b"]}), [4])
    expected = [("a", 1), ("a", 3), ("b", 2), ("b", 4)]
    assert both() == (expected, expected)
    table.commit_checkpoint(cp, segments, parallelism=1)
    assert both() == (expected, expected)  # committed, not yet completed: segments and memtable hold it
    store.checkpoint_complete(cp)
    assert both() == (expected, expected)
    store.checkpoint()
    fresh = open_store(tmp_path, layout)
    assert fresh.scan("l").sort(["k", "ord"]).select("k", "v_l").rows() == expected


def test_timer_expiry_must_be_an_int_of_milliseconds(tmp_path):
    store = open_store(tmp_path, timer_layout())
    timers = TimerService(store)
    store.set_current_key("a")
    for bad in ("100", 1.5, True, None):
        with pytest.raises(TypeError, match=r"timer expiry must be an int of epoch milliseconds"):
            timers.register(bad)
    with pytest.raises(StateStoreError, match=r"no current key"):
        TimerService(open_store(tmp_path / "other", timer_layout())).register(5)
