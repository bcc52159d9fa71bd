"""Unit tests of statestore.resolve: how LSM entries become the live state of a variable.

Hand-written cases pin each rule (newest wins by ``ord``, tombstones, whole-key versus
per-user-key deletes, list order, TTL at ``now_ms``). A hypothesis test then checks, over
random entry sequences, that ``resolve`` of everything at once, and folding chunks of the
sequence with ``merge`` (which goes through ``view_as_entries``), both equal a tiny
pure-Python model that *replays* the entries in ``ord`` order; the model shares no code
with the module (it replays, the module joins against the newest whole-key tombstone).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from statestore.layout import EXPIRE_AT_MS, OP, OP_APPEND, OP_DELETE, OP_PUT
from statestore.resolve import ORD, entry_columns, merge, resolve, view_as_entries, view_columns

KEYS = ["k1", "k2"]
NOW_MS = 1_000

VALUE = ValueStateDescriptor("s", pa.int64())
MAP = MapStateDescriptor("m", pa.int64(), key_type=pa.string())
LIST = ListStateDescriptor("l", pa.int64())
REDUCING = ReducingStateDescriptor("r", pa.int64(), reduce_fn=lambda a, b: a + b, vectorized="sum")

BASE_SCHEMA = {"k1": pl.Int64, "k2": pl.String, OP: pl.Int8, ORD: pl.Int64, EXPIRE_AT_MS: pl.Int64}


def entry_schema(desc) -> pl.Schema:
    extra = {desc.user_key_column: pl.String} if desc.user_key_column else {}
    full = {**BASE_SCHEMA, **extra, desc.value_column: pl.Int64}
    return pl.Schema({c: full[c] for c in entry_columns(desc, KEYS)})


def frame(desc, rows: list[dict]) -> pl.DataFrame:
    """Entries of ``desc`` from dicts with keys key (tuple), op, ord, v, and optional exp, mk."""
    data = {
        "k1": [r["key"][0] for r in rows],
        "k2": [r["key"][1] for r in rows],
        OP: [r["op"] for r in rows],
        ORD: [r["ord"] for r in rows],
        EXPIRE_AT_MS: [r.get("exp") for r in rows],
    }
    if desc.user_key_column:
        data[desc.user_key_column] = [r.get("mk") for r in rows]
    data[desc.value_column] = [r.get("v") for r in rows]
    return pl.DataFrame(data, schema=entry_schema(desc))


def as_state(desc, view: pl.DataFrame) -> dict:
    """A view as plain Python: value {key: (v, exp)}, map {key: {mk: (v, exp)}}, list {key: [(v, exp)]}."""
    assert view.columns == view_columns(desc, KEYS)
    out: dict = {}
    for row in view.iter_rows(named=True):
        key = (row["k1"], row["k2"])
        item = (row[desc.value_column], row[EXPIRE_AT_MS])
        if desc is MAP:
            mk = row[desc.user_key_column]
            assert mk not in out.setdefault(key, {}), f"map entry {key}/{mk} appears twice in the view"
            out[key][mk] = item
        elif desc is LIST:
            out.setdefault(key, []).append(item)
        else:
            assert key not in out, f"key {key} appears twice in the view"
            out[key] = item
    return out


def list_ords_increase(view: pl.DataFrame) -> bool:
    by_key = defaultdict(list)
    for row in view.iter_rows(named=True):
        by_key[(row["k1"], row["k2"])].append(row[ORD])
    return all(all(a < b for a, b in pairwise(o)) for o in by_key.values())


def e(key, op, ord_, v=None, exp=None, mk=None) -> dict:
    return {"key": key, "op": op, "ord": ord_, "v": v, "exp": exp, "mk": mk}


A, B = (1, "a"), (2, "b")


# ---------------------------------------------------------------- value-like state


@pytest.mark.parametrize("desc", [VALUE, REDUCING], ids=["value", "reducing"])
def test_newest_wins_by_ord_not_by_row_order(desc):
    rows = [e(A, OP_PUT, 30, v=3), e(A, OP_PUT, 10, v=1), e(A, OP_PUT, 20, v=2), e(B, OP_PUT, 5, v=50)]
    assert as_state(desc, resolve(frame(desc, rows), desc, KEYS, NOW_MS)) == {A: (3, None), B: (50, None)}


def test_tombstone_hides_older_put():
    rows = [e(A, OP_PUT, 1, v=1), e(A, OP_DELETE, 2), e(B, OP_PUT, 1, v=7)]
    assert as_state(VALUE, resolve(frame(VALUE, rows), VALUE, KEYS, NOW_MS)) == {B: (7, None)}


def test_put_newer_than_tombstone_survives():
    rows = [e(A, OP_PUT, 3, v=9), e(A, OP_DELETE, 2), e(A, OP_PUT, 1, v=1)]
    assert as_state(VALUE, resolve(frame(VALUE, rows), VALUE, KEYS, NOW_MS)) == {A: (9, None)}


def test_value_keys_differ_by_second_key_column():
    rows = [e((1, "a"), OP_PUT, 1, v=1), e((1, "b"), OP_PUT, 2, v=2), e((1, "a"), OP_DELETE, 3)]
    assert as_state(VALUE, resolve(frame(VALUE, rows), VALUE, KEYS, NOW_MS)) == {(1, "b"): (2, None)}


def test_expired_newest_value_does_not_resurrect_older():
    # expire_at_ms == now is expired: an entry is live only while expire_at_ms > now_ms.
    rows = [e(A, OP_PUT, 1, v=1), e(A, OP_PUT, 2, v=2, exp=NOW_MS), e(B, OP_PUT, 1, v=5, exp=NOW_MS + 1)]
    assert as_state(VALUE, resolve(frame(VALUE, rows), VALUE, KEYS, NOW_MS)) == {B: (5, NOW_MS + 1)}


def test_expiry_is_judged_at_now_ms():
    rows = [e(A, OP_PUT, 1, v=1, exp=500)]
    assert as_state(VALUE, resolve(frame(VALUE, rows), VALUE, KEYS, 499)) == {A: (1, 500)}
    assert as_state(VALUE, resolve(frame(VALUE, rows), VALUE, KEYS, 500)) == {}


def test_empty_entries_resolve_to_empty_view():
    for desc in (VALUE, MAP, LIST):
        view = resolve(frame(desc, []), desc, KEYS, NOW_MS)
        assert view.height == 0
        assert view.columns == view_columns(desc, KEYS)


# ---------------------------------------------------------------- map state


def test_map_newest_entry_per_user_key():
    rows = [e(A, OP_PUT, 1, v=1, mk="x"), e(A, OP_PUT, 3, v=3, mk="x"), e(A, OP_PUT, 2, v=2, mk="y")]
    assert as_state(MAP, resolve(frame(MAP, rows), MAP, KEYS, NOW_MS)) == {A: {"x": (3, None), "y": (2, None)}}


def test_map_user_key_delete_removes_only_that_entry():
    rows = [
        e(A, OP_PUT, 1, v=1, mk="x"), e(A, OP_PUT, 2, v=2, mk="y"), e(A, OP_DELETE, 3, mk="x"),
        e(B, OP_PUT, 1, v=9, mk="x"),
    ]
    assert as_state(MAP, resolve(frame(MAP, rows), MAP, KEYS, NOW_MS)) == {A: {"y": (2, None)}, B: {"x": (9, None)}}


def test_map_put_after_user_key_delete_is_visible():
    rows = [e(A, OP_PUT, 1, v=1, mk="x"), e(A, OP_DELETE, 2, mk="x"), e(A, OP_PUT, 3, v=3, mk="x")]
    assert as_state(MAP, resolve(frame(MAP, rows), MAP, KEYS, NOW_MS)) == {A: {"x": (3, None)}}


def test_map_whole_key_tombstone_hides_older_entries_only():
    rows = [
        e(A, OP_PUT, 1, v=1, mk="x"), e(A, OP_PUT, 2, v=2, mk="y"),
        e(A, OP_DELETE, 3),  # no user key: clears A's whole map
        e(A, OP_PUT, 4, v=4, mk="z"),
        e(B, OP_PUT, 2, v=20, mk="x"),  # another key is untouched
    ]
    view = resolve(frame(MAP, rows), MAP, KEYS, NOW_MS)
    assert as_state(MAP, view) == {A: {"z": (4, None)}, B: {"x": (20, None)}}


def test_map_newest_of_several_whole_key_tombstones_counts():
    rows = [e(A, OP_DELETE, 1), e(A, OP_PUT, 2, v=2, mk="x"), e(A, OP_DELETE, 3), e(A, OP_PUT, 4, v=4, mk="y")]
    assert as_state(MAP, resolve(frame(MAP, rows), MAP, KEYS, NOW_MS)) == {A: {"y": (4, None)}}


def test_map_expired_entries_dropped():
    rows = [e(A, OP_PUT, 1, v=1, mk="x", exp=NOW_MS), e(A, OP_PUT, 2, v=2, mk="y", exp=NOW_MS + 5)]
    assert as_state(MAP, resolve(frame(MAP, rows), MAP, KEYS, NOW_MS)) == {A: {"y": (2, NOW_MS + 5)}}


# ---------------------------------------------------------------- list state


def test_list_elements_ordered_by_ord():
    rows = [e(A, OP_APPEND, 30, v=3), e(A, OP_APPEND, 10, v=1), e(B, OP_APPEND, 15, v=9), e(A, OP_APPEND, 20, v=2)]
    view = resolve(frame(LIST, rows), LIST, KEYS, NOW_MS)
    assert as_state(LIST, view) == {A: [(1, None), (2, None), (3, None)], B: [(9, None)]}
    assert view.get_column(ORD).to_list() == [10, 15, 20, 30]


def test_list_tombstone_hides_older_elements_only():
    rows = [e(A, OP_APPEND, 1, v=1), e(A, OP_APPEND, 2, v=2), e(A, OP_DELETE, 3), e(A, OP_APPEND, 4, v=4),
            e(B, OP_APPEND, 2, v=7)]
    assert as_state(LIST, resolve(frame(LIST, rows), LIST, KEYS, NOW_MS)) == {A: [(4, None)], B: [(7, None)]}


def test_list_expired_elements_dropped_keeping_order():
    rows = [e(A, OP_APPEND, 1, v=1, exp=NOW_MS + 1), e(A, OP_APPEND, 2, v=2, exp=NOW_MS), e(A, OP_APPEND, 3, v=3)]
    assert as_state(LIST, resolve(frame(LIST, rows), LIST, KEYS, NOW_MS)) == {A: [(1, NOW_MS + 1), (3, None)]}


# ---------------------------------------------------------------- view_as_entries


def test_view_as_entries_is_older_than_any_real_entry():
    for desc, rows in (
        (VALUE, [e(A, OP_PUT, 0, v=1), e(B, OP_PUT, 0, v=2)]),
        (MAP, [e(A, OP_PUT, 0, v=1, mk="x"), e(A, OP_PUT, 1, v=2, mk="y")]),
        (LIST, [e(A, OP_APPEND, 0, v=1), e(A, OP_APPEND, 1, v=2), e(B, OP_APPEND, 2, v=3)]),
    ):
        entries = view_as_entries(resolve(frame(desc, rows), desc, KEYS, NOW_MS), desc)
        assert entries.height == len(rows)
        assert entries.get_column(ORD).max() < 0
        if desc is LIST:
            # element order survives: ords increase in the same order as the view's rows
            assert entries.get_column(ORD).to_list() == sorted(entries.get_column(ORD).to_list())
            assert entries.get_column(desc.value_column).to_list() == [1, 2, 3]
            assert set(entries.get_column(OP).to_list()) == {OP_APPEND}
        else:
            assert set(entries.get_column(OP).to_list()) == {OP_PUT}


def test_merge_of_nothing_is_empty_view():
    for desc in (VALUE, MAP, LIST):
        view = merge(None, [], desc, KEYS, NOW_MS, entry_schema(desc))
        assert view.height == 0
        assert view.columns == view_columns(desc, KEYS)


def test_merge_new_tombstone_hides_view():
    view = resolve(frame(MAP, [e(A, OP_PUT, 1, v=1, mk="x")]), MAP, KEYS, NOW_MS)
    merged = merge(view, [frame(MAP, [e(A, OP_DELETE, 0), e(A, OP_PUT, 1, v=5, mk="y")])], MAP, KEYS, NOW_MS,
                   entry_schema(MAP))
    assert as_state(MAP, merged) == {A: {"y": (5, None)}}


# ---------------------------------------------------------------- model-based
#
# Strategy: a random sequence of operations on three keys (two key columns) is given strictly
# increasing, gapped ords, cut into chunks, and each chunk's rows are shuffled (resolution must
# not depend on row order). Expiry times straddle NOW_MS. Invariants: resolve(all) equals the
# replay model; folding the chunks with merge (view -> view_as_entries -> + chunk) equals it too.

HYP_KEYS = [(1, "a"), (1, "b"), (2, "a")]
EXPIRES = [None, None, NOW_MS - 1, NOW_MS, NOW_MS + 1]


def model(desc, rows: list[dict], now_ms: int) -> dict:
    """Replay entries oldest first into plain dicts; drop expired items at the end."""
    def live(r):
        return r["exp"] is None or r["exp"] > now_ms

    by_key: dict = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["ord"]):
        by_key[r["key"]].append(r)
    out: dict = {}
    for key, history in by_key.items():
        if desc is MAP:
            m: dict = {}
            for r in history:
                if r["op"] == OP_DELETE and r["mk"] is None:
                    m.clear()
                elif r["op"] == OP_DELETE:
                    m.pop(r["mk"], None)
                else:
                    m[r["mk"]] = r
            live_map = {mk: (r["v"], r["exp"]) for mk, r in m.items() if live(r)}
            if live_map:
                out[key] = live_map
        elif desc is LIST:
            elements: list = []
            for r in history:
                if r["op"] == OP_DELETE:
                    elements.clear()
                else:
                    elements.append(r)
            live_list = [(r["v"], r["exp"]) for r in elements if live(r)]
            if live_list:
                out[key] = live_list
        else:
            last = history[-1]
            if last["op"] == OP_PUT and live(last):
                out[key] = (last["v"], last["exp"])
    return out


def op_strategy(desc):
    key = st.sampled_from(HYP_KEYS)
    exp = st.sampled_from(EXPIRES)
    v = st.integers(-5, 5)
    if desc is MAP:
        mk = st.sampled_from(["x", "y", "z"])
        return st.one_of(
            st.builds(lambda k, m, x, t: {"key": k, "op": OP_PUT, "mk": m, "v": x, "exp": t}, key, mk, v, exp),
            st.builds(lambda k, m: {"key": k, "op": OP_DELETE, "mk": m, "v": None, "exp": None}, key, mk),
            st.builds(lambda k: {"key": k, "op": OP_DELETE, "mk": None, "v": None, "exp": None}, key),
        )
    if desc is LIST:
        return st.one_of(
            st.builds(lambda k, x, t: {"key": k, "op": OP_APPEND, "mk": None, "v": x, "exp": t}, key, v, exp),
            st.builds(lambda k: {"key": k, "op": OP_DELETE, "mk": None, "v": None, "exp": None}, key),
        )
    return st.one_of(
        st.builds(lambda k, x, t: {"key": k, "op": OP_PUT, "mk": None, "v": x, "exp": t}, key, v, exp),
        st.builds(lambda k: {"key": k, "op": OP_DELETE, "mk": None, "v": None, "exp": None}, key),
    )


@st.composite
def chunked_entries(draw, desc):
    ops = draw(st.lists(op_strategy(desc), max_size=30))
    gaps = draw(st.lists(st.integers(1, 1 << 33), min_size=len(ops), max_size=len(ops)))
    ord_, rows = 0, []
    for op, gap in zip(ops, gaps, strict=True):
        ord_ += gap
        rows.append({**op, "ord": ord_})
    cuts = sorted(draw(st.lists(st.integers(0, len(rows)), max_size=4)))
    bounds = [0, *cuts, len(rows)]
    chunks = [rows[lo:hi] for lo, hi in pairwise(bounds)]
    return rows, [draw(st.permutations(c)) for c in chunks]


@pytest.mark.parametrize("desc", [VALUE, MAP, LIST], ids=["value", "map", "list"])
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_resolve_and_merge_match_replay_model(desc, data):
    rows, chunks = data.draw(chunked_entries(desc))
    expected = model(desc, rows, NOW_MS)

    all_at_once = resolve(frame(desc, [r for c in chunks for r in c]), desc, KEYS, NOW_MS)
    assert as_state(desc, all_at_once) == expected

    view = None
    for chunk in chunks:
        view = merge(view, [frame(desc, chunk)], desc, KEYS, NOW_MS, entry_schema(desc))
    assert as_state(desc, view) == expected
    if desc is LIST:
        assert list_ords_increase(view)

    # several new entry frames in one merge call, on top of the first chunk's view
    first = merge(None, [frame(desc, chunks[0])], desc, KEYS, NOW_MS, entry_schema(desc))
    rest = [frame(desc, c) for c in chunks[1:]]
    assert as_state(desc, merge(first, rest, desc, KEYS, NOW_MS, entry_schema(desc))) == expected
