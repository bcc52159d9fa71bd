"""``statestore.views.KeyedView``: a view kept in runs indexed by key hash holds exactly what
the same view kept as one plain frame holds, through replacements, map entries, whole-key
clears, expiry, appends, merges and hash collisions; and a store with large views reads and
writes them through the index."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore import DirectoryStateTable, StateLayout, StateStore, StoreConfig, ValueStateDescriptor
from statestore import views as views_module
from statestore.layout import EXPIRE_AT_MS
from statestore.views import KeyedView, distinct_sorted, key_hashes, replace_rows

KEYS = ["k"]


def value_frame(keys, values, expire=None) -> pl.DataFrame:
    return pl.DataFrame({"k": pl.Series(keys, dtype=pl.String), "v": pl.Series(values, dtype=pl.Int64),
                         EXPIRE_AT_MS: pl.Series(expire or [None] * len(keys), dtype=pl.Int64)})


def rows(frame: pl.DataFrame) -> list[tuple]:
    return sorted(frame.iter_rows(), key=repr)


def pair(frame: pl.DataFrame) -> tuple[KeyedView, KeyedView]:
    """The same view twice: indexed (every size) and plain (never indexed)."""
    return KeyedView(frame, KEYS, 0), KeyedView(frame, KEYS, 1 << 40)


def test_distinct_sorted():
    h = np.array([5, 3, 5, 9, 3, 1], dtype=np.uint64)
    assert distinct_sorted(h).tolist() == [1, 3, 5, 9]
    assert distinct_sorted(h[:0]).size == 0


def test_indexed_view_finds_keys_and_replaces_in_runs():
    n = 1000
    indexed, plain = pair(value_frame([f"k{i}" for i in range(n)], list(range(n))))
    for batch in range(12):  # runs accumulate and merge
        touched = [f"k{(batch * 37 + j * 11) % (n + 50)}" for j in range(40)]  # some new keys
        gone = pl.DataFrame({"k": touched})
        added = value_frame(touched, [batch * 1000 + j for j in range(40)])
        indexed.replace(KEYS, gone, None, added, now_ms=0)
        plain.replace(KEYS, gone, None, added, now_ms=0)
        assert rows(indexed.frame()) == rows(plain.frame())
        assert indexed.height == plain.height
    assert indexed.indexed and not plain.indexed
    assert 1 <= indexed.runs <= 4
    wanted = pl.DataFrame({"k": ["k3", "k999", "k1040", "absent"]})
    found = indexed.candidates(distinct_sorted(key_hashes(wanted)))
    assert rows(found.join(wanted, on=KEYS, how="semi")) == rows(plain.frame().join(wanted, on=KEYS, how="semi"))
    assert plain.candidates(distinct_sorted(key_hashes(wanted))) is None  # plain views are read whole


def test_map_entries_and_whole_key_clears():
    frame = pl.DataFrame({"k": ["a", "a", "a", "b", "b", "c"], "mk": [1, 2, None, 1, 2, 1],
                          "v": [10, 20, 30, 40, 50, 60], EXPIRE_AT_MS: [None] * 6},
                         schema={"k": pl.String, "mk": pl.Int64, "v": pl.Int64, EXPIRE_AT_MS: pl.Int64})
    indexed, plain = KeyedView(frame, KEYS, 0), KeyedView(frame, KEYS, 1 << 40)
    on = ["k", "mk"]
    gone = pl.DataFrame({"k": ["a", "a", "c"], "mk": [2, None, 5]}, schema={"k": pl.String, "mk": pl.Int64})
    cleared = pl.DataFrame({"k": ["b"]})
    added = pl.DataFrame({"k": ["a", "c"], "mk": [None, 5], "v": [99, 98], EXPIRE_AT_MS: [None, None]},
                         schema=frame.schema)
    for view in (indexed, plain):
        view.replace(on, gone, cleared, added, now_ms=0)
    assert rows(indexed.frame()) == rows(plain.frame()) == rows(pl.DataFrame(
        [("a", None, 99, None), ("a", 1, 10, None), ("c", 1, 60, None), ("c", 5, 98, None)],
        schema=frame.schema, orient="row"))


def test_expired_rows_leave_indexed_views_when_they_change():
    indexed, plain = pair(value_frame(["a", "b", "c", "d"], [1, 2, 3, 4], [100, None, 300, 50]))
    for view in (indexed, plain):
        view.replace(KEYS, pl.DataFrame({"k": ["c"]}), None, value_frame(["c"], [30], [1000]), now_ms=100)
    assert rows(indexed.frame()) == rows(plain.frame()) == [("b", 2, None), ("c", 30, 1000)]


def test_a_view_is_indexed_when_it_changes_and_takes_appended_rows_as_runs():
    frame = value_frame(["a", "x"], [1, 0])
    indexed, plain = KeyedView(frame, KEYS, 0, merge_ratio=0), KeyedView(frame, KEYS, 1 << 40)  # runs kept apart
    wanted = distinct_sorted(key_hashes(pl.DataFrame({"k": ["a"]})))
    assert indexed.candidates(wanted) is None  # a read does not index (the view may leave first)
    for view in (indexed, plain):
        view.replace(KEYS, pl.DataFrame({"k": ["x"]}), None, value_frame(["x"], [9]), now_ms=0)
        view.append(value_frame(["b", "c"], [2, 3]))
        view.append(value_frame([], []))
    assert indexed.indexed and indexed.runs >= 2
    assert rows(indexed.frame()) == rows(plain.frame())
    found = indexed.candidates(distinct_sorted(key_hashes(pl.DataFrame({"k": ["c"]}))))
    assert found.get_column("k").to_list() == ["c"]


def test_hash_collisions_are_told_apart_by_the_keys(monkeypatch):
    """With every key hashing alike, candidates hold every row and a replacement still
    removes only the rows of its own keys (the exact join after the hash search)."""
    monkeypatch.setattr(views_module, "key_hashes", lambda keys: np.zeros(keys.height, dtype=np.uint64))
    indexed, plain = pair(value_frame(["a", "b", "c"], [1, 2, 3]))
    gone = pl.DataFrame({"k": ["b", "z"]})
    for view in (indexed, plain):
        view.replace(KEYS, gone, None, value_frame(["b", "z"], [20, 26]), now_ms=0)
    assert rows(indexed.frame()) == rows(plain.frame()) == [("a", 1, None), ("b", 20, None), ("c", 3, None),
                                                            ("z", 26, None)]
    assert indexed.candidates(np.zeros(1, dtype=np.uint64)).height == 4


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(st.integers(0, 60), max_size=25), st.integers(0, 3)), min_size=1, max_size=20))
def test_many_views_replaced_at_once_match_plain_views(batches):
    """``replace_rows`` over several views (key groups) at once against plain views, with
    expiry: random batches of keys written, some with a TTL, the clock moving."""
    indexed = [KeyedView(value_frame([f"g{g}k{i}" for i in range(30)], list(range(30)), None), KEYS, 0)
               for g in range(3)]
    plain = [KeyedView(v.frame(), KEYS, 1 << 40) for v in indexed]
    for now, (ids, ttl) in enumerate(batches):
        changes_i, changes_p = [], []
        for g in range(3):
            keys = sorted({f"g{g}k{i}" for i in ids if i % 3 == g})
            if not keys:
                continue
            gone = pl.DataFrame({"k": pl.Series(keys, dtype=pl.String)})
            expire = [now + ttl] * len(keys) if ttl else None
            added = value_frame(keys, [now] * len(keys), expire)
            changes_i.append((indexed[g], gone, None, added))
            changes_p.append((plain[g], gone, None, added))
        replace_rows(changes_i, KEYS, now)
        replace_rows(changes_p, KEYS, now)
        for a, b in zip(indexed, plain, strict=True):
            assert rows(a.frame()) == rows(b.frame())


@pytest.mark.parametrize("index_rows_min", [0, 1 << 30])
def test_store_reads_large_views_through_their_index(tmp_path, index_rows_min):
    """A store's batched lookups and writes over views indexed (0) or plain give the same
    values through checkpoints, and only the indexed store's views are kept in runs."""
    layout = StateLayout.of(pa.schema([("k", pa.string())]), [ValueStateDescriptor("v", pa.int64())], 8)
    store = StateStore(DirectoryStateTable(tmp_path, layout),
                       config=StoreConfig(view_index_rows_min=index_rows_min))
    state = store.get_state("v")
    n = 20_000  # views far larger than a batch: written in place, read by key
    all_keys = pa.table({"k": [f"k{i}" for i in range(n)]})
    state.update_batch(all_keys, list(range(n)))
    store.checkpoint()
    model = dict(enumerate(range(n)))
    rng = np.random.default_rng(3)
    for batch in range(8):
        ids = sorted(set(rng.integers(0, n + 100, 300).tolist()))
        keys = pa.table({"k": [f"k{i}" for i in ids]})
        got = state.get_batch(keys).to_pylist()
        assert got == [model.get(i) for i in ids]
        state.update_batch(keys, [batch] * len(ids))
        model.update(dict.fromkeys(ids, batch))
        if batch % 3 == 2:
            store.checkpoint()
    assert state.get_batch(pa.table({"k": [f"k{i}" for i in range(n + 100)]})).to_pylist() == [
        model.get(i) for i in range(n + 100)]
    group = store.reader._cache.peek(store.reader._cache.key_groups()[0])
    assert group.views["v"].indexed == (index_rows_min == 0)
    store.close()


@pytest.mark.parametrize("index_rows_min", [100, 1 << 30])
def test_large_views_take_a_large_batch_in_place(tmp_path, index_rows_min):
    """A batch of a third as many new entries as the views hold rows: views of indexing size
    take it in place (and are indexed), smaller views are resolved again with it (plain); both
    read the same values after."""
    layout = StateLayout.of(pa.schema([("k", pa.string())]), [ValueStateDescriptor("v", pa.int64())], 2)
    store = StateStore(DirectoryStateTable(tmp_path, layout),
                       config=StoreConfig(view_index_rows_min=index_rows_min))
    state = store.get_state("v")
    n, more = 3_000, 1_000
    state.update_batch(pa.table({"k": [f"k{i}" for i in range(n)]}), list(range(n)))
    store.checkpoint()
    r = store.reader.key_group_range
    store.views("v", range(r.start, r.end + 1))  # the views cached, whole
    state.update_batch(pa.table({"k": [f"k{i}" for i in range(n - more // 2, n + more // 2)]}), [-1] * more)
    store.checkpoint()
    got = state.get_batch(pa.table({"k": [f"k{i}" for i in range(n + more)]})).to_pylist()
    assert got == [i if i < n - more // 2 else (-1 if i < n + more // 2 else None) for i in range(n + more)]
    views = [store.reader._cache.peek(kg).views["v"] for kg in store.reader._cache.key_groups()]
    assert len(views) == 2 and all(v.indexed == (index_rows_min == 100) for v in views)
    store.close()


@pytest.mark.parametrize("index_rows_min", [0, 1 << 30])
def test_list_elements_appended_in_place_keep_their_order(tmp_path, index_rows_min):
    """A list state's views take a batch's appends and clears in place (the views far larger
    than the batch): elements read back in the order they were added, through checkpoints,
    clears and a reopened store."""
    from statestore import ListStateDescriptor

    layout = StateLayout.of(pa.schema([("k", pa.string())]), [ListStateDescriptor("l", pa.int64())], 8)
    table = DirectoryStateTable(tmp_path, layout)
    store = StateStore(table, config=StoreConfig(view_index_rows_min=index_rows_min))
    state = store.get_state("l")
    n = 5000
    state.add_batch(pa.table({"k": [f"k{i}" for i in range(n)]}), list(range(n)))
    store.checkpoint()
    model = {i: [i] for i in range(n)}
    rng = np.random.default_rng(5)
    for batch in range(6):
        ids = rng.integers(0, n + 20, 200).tolist()  # repeats: several appends to a key in a batch
        state.add_batch(pa.table({"k": [f"k{i}" for i in ids]}), [batch * 1000 + j for j in range(len(ids))])
        for j, i in enumerate(ids):
            model.setdefault(i, []).append(batch * 1000 + j)
        if batch == 3:
            gone = sorted(set(ids[:10]))
            state.clear_batch(pa.table({"k": [f"k{i}" for i in gone]}))
            for i in gone:
                model.pop(i)
        probe = sorted(set(ids) | {0, 1, n + 19})
        got = state.get_batch(pa.table({"k": [f"k{i}" for i in probe]})).to_pylist()
        assert got == [model.get(i, []) for i in probe]
        if batch % 2:
            store.checkpoint()
    store.checkpoint()
    every = list(range(n + 20))
    want = [model.get(i, []) for i in every]
    assert state.get_batch(pa.table({"k": [f"k{i}" for i in every]})).to_pylist() == want
    group = store.reader._cache.peek(store.reader._cache.key_groups()[0])
    assert group.views["l"].indexed == (index_rows_min == 0)
    store.close()
    reopened = StateStore(DirectoryStateTable(tmp_path, layout))
    assert reopened.get_state("l").get_batch(pa.table({"k": [f"k{i}" for i in every]})).to_pylist() == want
    reopened.close()
