"""Live rows counted as Spark counts them (``statestore.live_rows``): each checkpoint's change,
added to a ledger that drops what expired, equals the live rows a full scan finds, whatever the
writes (per key and batched, clears, map removals, TTL refreshed on read) and however the clock
moves; a lost count says so instead of guessing."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from statestore import (
    DirectoryStateTable,
    ListStateDescriptor,
    MapStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    ValueStateDescriptor,
)
from statestore.descriptors import TtlConfig, TtlUpdateType
from statestore.live_rows import LEDGER_EXPIRIES_MAX, Ledger, histogram
from tests.fuzzing import fuzz_settings

KEYS = ["a", "b", "c", "d", "e"]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


def _layout(ttl_ms: int | None, on_read: bool = False) -> StateLayout:
    ttl = None if ttl_ms is None else TtlConfig(ttl_ms, TtlUpdateType.ON_READ_AND_WRITE if on_read else
                                                 TtlUpdateType.ON_CREATE_AND_WRITE)
    return StateLayout.of(pa.schema([("k", pa.string())]), [
        ValueStateDescriptor("v", pa.int64(), ttl=ttl),
        ListStateDescriptor("l", pa.int64(), ttl=ttl),
        MapStateDescriptor("m", pa.int64(), key_type=pa.int64(), ttl=ttl),
    ], 8)


def _scanned(store: StateStore) -> dict[str, dict]:
    out = {}
    for d in store.layout.descriptors:
        h = histogram(d, store.scan(d.name), store.key_names)
        if h:
            out[d.name] = h
    return out


def _ledger_rows(ledger: Ledger) -> dict[str, dict]:
    return {name: h for name, h in ledger.rows.items() if h}


def _checkpoint(store: StateStore, table: DirectoryStateTable) -> dict | None:
    """``StateStore.checkpoint``, returning the live row change of the checkpoint."""
    checkpoint_id = table.next_checkpoint_id()
    segments = store.flush(checkpoint_id)
    change = store.live_row_change(checkpoint_id)
    table.commit_checkpoint(checkpoint_id, segments, parallelism=1)
    store.checkpoint_complete(checkpoint_id)
    return change


OPS = st.sampled_from(["put", "append", "map_put", "map_remove", "clear_v", "clear_l", "clear_m", "get_all",
                       "batch_put", "batch_clear", "read_then_put", "read_then_put_twice"])


@fuzz_settings(80)
@given(ttl=st.sampled_from([None, 30, 100]), on_read=st.booleans(),
       batches=st.lists(st.tuples(st.integers(0, 60), st.lists(st.tuples(OPS, st.sampled_from(KEYS), st.integers(0, 3)),
                                                                  max_size=12)), min_size=1, max_size=6),
       restart=st.integers(0, 6))
def test_the_ledger_of_changes_equals_a_scan_at_every_checkpoint(tmp_path_factory, ttl, on_read, batches, restart):
    clock = Clock()
    table = DirectoryStateTable(tmp_path_factory.mktemp("t"), _layout(ttl, on_read))
    config = StoreConfig(clock_ms=clock, count_live_rows=True)
    store = StateStore(table, config=config)
    ledger = Ledger()
    for i, (advance, ops) in enumerate(batches):
        if i == restart:  # a new store on the committed state: the ledger goes on
            store.close()
            store = StateStore(table, config=config)
        clock.now += advance
        v, lst, m = store.get_state("v"), store.get_state("l"), store.get_state("m")
        for op, key, n in ops:
            if op == "batch_put":
                v.update_batch(pa.table({"k": [key]}), [n])
                continue
            if op in ("read_then_put", "read_then_put_twice"):  # a vectorized processor's read, then write
                ks = pa.table({"k": [key, KEYS[n]] if op == "read_then_put" else [key, key]})
                v.get_batch(ks)
                v.update_batch(ks, [n, n + 1])
                continue
            if op == "batch_clear":
                m.clear_batch(pa.table({"k": [key]}))
                continue
            store.set_current_key(key)
            if op == "put":
                v.update(n)
            elif op == "append":
                lst.add(n)
            elif op == "map_put":
                m.put(n, n)
            elif op == "map_remove":
                m.remove(n)
            elif op == "clear_v":
                v.clear()
            elif op == "clear_l":
                lst.clear()
            elif op == "clear_m":
                m.clear()
            else:
                v.get(), lst.get(), m.items()
        if i % 2:  # a failed commit first: its flush's entries, and their count, go to the next
            store.flush(table.next_checkpoint_id())
            store.checkpoint_aborted(table.next_checkpoint_id())
        change = _checkpoint(store, table)
        assert change is not None
        ledger.add(change)
        ledger.expire(clock.now)
        assert _ledger_rows(ledger) == _scanned(store)
    store.close()


def test_spark_units_a_list_counts_once_and_timers_of_the_ledger_expire(tmp_path):
    """Spark's units (its probe in the integration tests): a value and a non-empty list count
    one row per key, a map one per entry; a list's row goes with its last element's expiry."""
    clock = Clock()
    table = DirectoryStateTable(tmp_path, _layout(50))
    store = StateStore(table, config=StoreConfig(clock_ms=clock, count_live_rows=True))
    v, lst, m = store.get_state("v"), store.get_state("l"), store.get_state("m")
    for key in ("a", "b"):
        store.set_current_key(key)
        v.update(1)
        lst.add(1)
        lst.add(2)
        m.put(1, 1)
        m.put(2, 2)
    ledger = Ledger()
    ledger.add(_checkpoint(store, table))
    assert {n: ledger.of(n) for n in "vlm"} == {"v": 2, "l": 2, "m": 4}
    clock.now += 30
    store.set_current_key("a")
    lst.add(3)  # a's list now lives until 30 ms later than b's
    ledger.add(_checkpoint(store, table))
    assert ledger.expire(clock.now) == 0 and ledger.of("l") == 2
    clock.now += 25  # b's rows and a's value, map entries and first two elements expired
    assert ledger.expire(clock.now) == 7 and {n: ledger.of(n) for n in "vlm"} == {"v": 0, "l": 1, "m": 0}
    assert _ledger_rows(ledger) == _scanned(store)
    text = ledger.encode()
    assert Ledger.decode(text).rows == ledger.rows and len(text) < 100


def test_a_store_that_does_not_count_says_so_and_a_lost_count_is_none(tmp_path):
    table = DirectoryStateTable(tmp_path, _layout(None))
    plain = StateStore(table)
    plain.set_current_key("a")
    plain.get_state("v").update(1)
    plain.flush(table.next_checkpoint_id())
    assert plain.live_row_change(table.next_checkpoint_id()) is None
    plain.close()
    store = StateStore(table, config=StoreConfig(count_live_rows=True))
    store.set_current_key("a")
    store.get_state("v").update(1)
    first = table.next_checkpoint_id()
    store.flush(first)
    assert store.live_row_change(first) == {"v": {None: 1}}
    # a's state read again after the flush (its entries in), and the flush's commit then fails
    store.get_state("v").update_batch(pa.table({"k": ["a"]}), [2])
    store.checkpoint_aborted(first)
    second = table.next_checkpoint_id()
    store.flush(second)
    assert store.live_row_change(second) is None
    store.checkpoint_aborted(second)
    store.restore()  # a restore starts counting again
    store.set_current_key("c")
    store.get_state("v").update(3)
    assert _checkpoint(store, table) == {"v": {None: 1}}


def test_the_ledger_keeps_its_size_bounded_by_merging_expiries_later():
    ledger = Ledger({"v": {None: 3, **{1000 + i: 1 for i in range(LEDGER_EXPIRIES_MAX + 10)}}})
    assert ledger.expire(999) == 0
    kept = ledger.rows["v"]
    assert len(kept) <= LEDGER_EXPIRIES_MAX + 1 and ledger.of("v") == LEDGER_EXPIRIES_MAX + 13
    assert max(e for e in kept if e is not None) == 1000 + LEDGER_EXPIRIES_MAX + 9  # merged into later ones
