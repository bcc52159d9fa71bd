"""Directed tests of cached views taking new entries in place (``StateReader._refresh_replacing``).

Views of value-like and map state much larger than a batch's writes drop the rows the new
entries touch and append the new entries' own resolution, instead of resolving the whole view
again. Each test keeps one store's views cached whole across several checkpoints of small
writes (puts, deletes, a map's whole-key clears, TTL expiry) and compares every read with a
store opened afresh on the same table, which resolves from the segments alone. The model-based
test (``test_store_model``) covers the paths with small states, where views mostly resolve again.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from statestore import (
    DirectoryStateTable,
    MapStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    TtlConfig,
    ValueStateDescriptor,
    read_path,
)

N_KEYS = 2000  # views of 2,000 keys against batches of at most 50 writes: refreshed in place
KEYS = [f"key-{i:05d}" for i in range(N_KEYS)]


def keys(names: list[str]) -> pa.Table:
    return pa.table({"k": pa.array(names, pa.string())})


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def replacing_calls(monkeypatch) -> list[int]:
    """How many refreshes took the in-place path (a test that never took it tests nothing)."""
    calls: list[int] = []
    original = read_path.StateReader._refresh_replacing

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(read_path.StateReader, "_refresh_replacing", counted)
    return calls


def _store(table, clock: Clock) -> StateStore:
    return StateStore(table, config=StoreConfig(view_partial_reads_max=0, clock_ms=clock))


def _value_state(tmp_path, desc: ValueStateDescriptor, max_parallelism: int):
    """A table of one value state holding ``KEYS`` (key i: i) in one checkpoint, and a store on
    it: (table, clock, store, the state's handle)."""
    layout = StateLayout.of(pa.schema([("k", pa.string())]), [desc], max_parallelism=max_parallelism)
    table = DirectoryStateTable(tmp_path / "t", layout)
    clock = Clock()
    store = _store(table, clock)
    v = store.get_state(desc.name)
    v.update_batch(keys(KEYS), list(range(N_KEYS)))
    store.checkpoint()
    return table, clock, store, v


def test_value_state_views_refreshed_in_place_read_like_a_fresh_store(tmp_path, replacing_calls):
    table, clock, store, v = _value_state(tmp_path, ValueStateDescriptor("v", pa.int64()), max_parallelism=8)
    rng = np.random.default_rng(7)
    expected = dict(zip(KEYS, range(N_KEYS), strict=True))
    assert v.get_batch(keys(KEYS)).to_pylist() == list(range(N_KEYS))  # every view whole and cached
    for step in range(6):
        put = [KEYS[i] for i in rng.choice(N_KEYS, 40, replace=False)]
        gone = [KEYS[i] for i in rng.choice(N_KEYS, 10, replace=False)]
        v.update_batch(keys(put), [step * 10_000 + i for i in range(len(put))])
        v.clear_batch(keys(gone))
        expected.update({k: step * 10_000 + i for i, k in enumerate(put)})
        for k in gone:
            expected.pop(k, None)
        want = [expected.get(k) for k in KEYS]
        assert v.get_batch(keys(KEYS)).to_pylist() == want  # memtable parts applied in place
        store.checkpoint()
        assert v.get_batch(keys(KEYS)).to_pylist() == want  # committed (pending) parts: nothing changes
        fresh = _store(table, clock)
        assert fresh.get_state("v").get_batch(keys(KEYS)).to_pylist() == want
        fresh.close()
    for k in KEYS[:50]:  # per-key reads over the refreshed views
        store.set_current_key(k)
        assert v.get() == expected.get(k)
    assert replacing_calls


def test_map_views_refreshed_in_place_drop_cleared_maps_and_replaced_entries(tmp_path, replacing_calls):
    layout = StateLayout.of(pa.schema([("k", pa.string())]),
                            [MapStateDescriptor("m", pa.int64(), key_type=pa.string())], max_parallelism=4)
    table = DirectoryStateTable(tmp_path / "t", layout)
    clock = Clock()
    store = _store(table, clock)
    m = store.get_state("m")
    owners = keys([k for k in KEYS for _ in range(2)])
    m.put_batch(owners, ["a", "b"] * N_KEYS, list(range(2 * N_KEYS)))
    store.checkpoint()
    model = {k: {"a": 2 * i, "b": 2 * i + 1} for i, k in enumerate(KEYS)}

    def items(s: StateStore) -> dict:
        got = s.get_state("m").items_batch(keys(KEYS)).to_pylist()
        out: dict = {}
        for row in got:
            out.setdefault(KEYS[row["_row"]], {})[row[m._user_key_col()]] = row[m._v]
        return out

    assert items(store) == model
    for step in range(4):
        changed = KEYS[step * 30:step * 30 + 20]
        m.put_batch(keys(changed), ["b"] * len(changed), [-step] * len(changed))  # one entry replaced
        m.put_batch(keys(changed), ["c"] * len(changed), [step] * len(changed))  # one entry added
        cleared = KEYS[1000 + step * 10:1000 + step * 10 + 5]
        m.clear_batch(keys(cleared))  # whole maps cleared
        m.put_batch(keys(cleared[:2]), ["z"] * 2, [99, 99])  # and written again after the clear
        for k in changed:
            model[k].update({"b": -step, "c": step})
        for k in cleared:
            model.pop(k)
        for k in cleared[:2]:
            model[k] = {"z": 99}
        assert items(store) == model
        store.checkpoint()
        fresh = _store(table, clock)
        assert items(fresh) == model == items(store)
        fresh.close()
    assert replacing_calls


def test_ttl_rows_expire_from_views_refreshed_in_place(tmp_path, replacing_calls):
    desc = ValueStateDescriptor("v", pa.int64(), ttl=TtlConfig(60_000))
    table, clock, store, v = _value_state(tmp_path, desc, max_parallelism=4)
    assert v.get_batch(keys(KEYS)).null_count == 0
    clock.now_ms += 30_000
    v.update_batch(keys(KEYS[:20]), [-1] * 20)  # written again: they live 60 s from now
    store.checkpoint()
    clock.now_ms += 40_000  # the first writes expired, the 20 rewritten keys did not
    want = [-1] * 20 + [None] * (N_KEYS - 20)
    assert v.get_batch(keys(KEYS)).to_pylist() == want
    v.update_batch(keys(KEYS[20:25]), [5] * 5)
    assert v.get_batch(keys(KEYS)).to_pylist() == [-1] * 20 + [5] * 5 + [None] * (N_KEYS - 25)
    assert sum(view.height for view in store.views("v", range(4))) == 25  # expired rows left the views
    store.checkpoint()
    fresh = _store(table, clock)
    assert fresh.get_state("v").get_batch(keys(KEYS)).to_pylist() == [-1] * 20 + [5] * 5 + [None] * (N_KEYS - 25)
    assert replacing_calls


def test_a_store_catching_up_orders_its_own_pending_entries_before_newer_segments(tmp_path):
    """Store A reads, writes, commits (its write waits unapplied in its views); store B, the same
    task in another worker, takes over and writes the same keys; A catches up with B's segment.
    A's own entries must lose to B's newer ones, though they were made later in A's memtable
    order (pending entries carry their segment's ords, not the memtable's)."""
    layout = StateLayout.of(pa.schema([("k", pa.string())]),
                            [ValueStateDescriptor("v", pa.int64()),
                             MapStateDescriptor("m", pa.int64(), key_type=pa.string())], max_parallelism=4)
    clock = Clock()
    table_a = DirectoryStateTable(tmp_path / "t", layout)
    a = _store(table_a, clock)
    a.get_state("v").update_batch(keys(KEYS), list(range(N_KEYS)))
    a.get_state("m").put_batch(keys(KEYS), ["x"] * N_KEYS, list(range(N_KEYS)))
    a.checkpoint()
    assert a.get_state("v").get_batch(keys(KEYS)).to_pylist() == list(range(N_KEYS))  # views cached, whole
    a.get_state("m").items_batch(keys(KEYS))
    a.get_state("v").update_batch(keys(KEYS[:10]), [-1] * 10)
    a.get_state("m").put_batch(keys(KEYS[:10]), ["x"] * 10, [-1] * 10)
    a.checkpoint()  # A's writes now wait in its views' pending parts

    table_b = DirectoryStateTable(tmp_path / "t", layout)
    b = _store(table_b, clock)
    b.get_state("v").update_batch(keys(KEYS[:5]), [7] * 5)
    b.get_state("m").put_batch(keys(KEYS[:5]), ["x"] * 5, [7] * 5)
    b.checkpoint()

    table_a.restore(table_b.current_checkpoint().checkpoint_id)  # the driver ships the newest checkpoint
    assert a.catch_up()
    want = [7] * 5 + [-1] * 5 + list(range(10, N_KEYS))
    assert a.get_state("v").get_batch(keys(KEYS)).to_pylist() == want
    got = a.get_state("m").items_batch(keys(KEYS)).to_pylist()
    assert [r["v_m"] for r in sorted(got, key=lambda r: r["_row"])] == want
