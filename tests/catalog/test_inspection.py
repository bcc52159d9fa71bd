"""Inspection (``catalog.inspection`` and the SQL views over it): the live state of every state
type equals what the store itself reads, at several checkpoints, after compaction and a rescale,
on local disk and S3; the change feed equals the difference of two restores (hypothesis);
checkpoints, segments and key groups agree with the table's own metadata."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog import IcebergStateTable, connect, inspection
from catalog.compaction import compact
from statestore import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    ValueStateDescriptor,
)
from statestore.descriptors import AverageAggregate
from statestore.errors import CheckpointNotFoundError, StateNotDeclaredError
from statestore.keygroups import assign_key_groups
from tests.fuzzing import fuzz_settings

N = 8
POINT = pa.struct([("n", pa.int64()), ("s", pa.string())])
DESCRIPTORS = [
    ValueStateDescriptor("point", POINT),
    ListStateDescriptor("events", pa.int32()),
    MapStateDescriptor("seen", pa.int64(), key_type=pa.string()),
    ReducingStateDescriptor("total", pa.int64(), reduce_fn=lambda a, b: a + b, vectorized="sum"),
    AggregatingStateDescriptor("avg", agg_fn=AverageAggregate()),
]
LAYOUT = StateLayout.of(pa.schema([("k", pa.string())]), DESCRIPTORS, N)
KEYS = [f"k{i}" for i in range(12)]
NOW = 10_000


@pytest.fixture
def open_table(place):
    return place.open


def keys(ks) -> pa.Table:
    return pa.table({"k": pa.array(list(ks), pa.string())})


def write_batch(stores: list[StateStore], rng: random.Random, c: int) -> None:
    """A batch of puts, appends, map puts and removes and deletes over random keys, each key
    written by the store of its task."""
    chosen = sorted(rng.sample(KEYS, rng.randint(1, 6)))
    owner = assign_key_groups(keys(chosen), N)
    for store in stores:
        mine = [k for k, kg in zip(chosen, owner, strict=True) if int(kg) in store.key_group_range]
        if not mine:
            continue
        ks = keys(mine)
        action = rng.randrange(5)
        if action == 0:
            store.get_state("point").clear_batch(ks)
            store.get_state("events").clear_batch(ks)
        else:
            store.get_state("point").update_batch(ks, [{"n": c * 10 + i, "s": f"c{c}"} for i in range(len(mine))])
        store.get_state("events").add_batch(ks, pa.array([c] * len(mine), pa.int32()))
        if action == 1:
            store.get_state("seen").remove_batch(ks, [f"m{c % 3}"] * len(mine))
        else:
            store.get_state("seen").put_batch(ks, [f"m{c % 3}"] * len(mine), [c] * len(mine))
        store.get_state("total").add_batch(ks, [c] * len(mine))
        store.get_state("avg").add_batch(ks, [float(c * i) for i in range(len(mine))])


def commit(table: IcebergStateTable, stores: list[StateStore], batch: int) -> int:
    cp = table.next_checkpoint_id()
    segments = [s for store in stores for s in store.flush(cp)]
    table.commit_checkpoint(cp, segments, parallelism=len(stores), batch_id=batch)
    for store in stores:
        store.checkpoint_complete(cp)
    return cp


def run(table: IcebergStateTable, seed: int, batches: int, parallelisms=(2, 3), compact_at: int | None = None) -> list:
    """Write ``batches`` checkpoints, changing the number of tasks half-way (a rescale: the
    stores of the new tasks restore the same table) and compacting after batch ``compact_at``."""
    rng = random.Random(seed)
    config = StoreConfig(clock_ms=lambda: NOW)
    written = []
    for b in range(batches):
        p = parallelisms[0] if b < batches // 2 else parallelisms[1]
        if b in (0, batches // 2):
            stores = [StateStore(table, task_index=i, parallelism=p, config=config) for i in range(p)]
        write_batch(stores, rng, b + 1)
        written.append(commit(table, stores, b))
        if b == compact_at:
            compact(table)
            for store in stores:
                store.restore()
    return written


def store_reads(table: IcebergStateTable, checkpoint_id: int) -> dict[str, dict]:
    """What a store restored at ``checkpoint_id`` reads for every key, per variable (the table
    is opened at its newest checkpoint again afterwards)."""
    table.restore(checkpoint_id)
    try:
        store = StateStore(table, config=StoreConfig(clock_ms=lambda: NOW))
        ks = keys(KEYS)
        point = store.get_state("point").get_batch(ks).to_pylist()
        events = store.get_state("events").get_batch(ks).to_pylist()
        total = store.get_state("total").get_batch(ks).to_pylist()
        avg = store.get_state("avg").get_batch(ks).to_pylist()
        return {
            "point": {k: v for k, v in zip(KEYS, point, strict=True) if v is not None},
            "events": {k: v for k, v in zip(KEYS, events, strict=True) if v},
            "total": {k: v for k, v in zip(KEYS, total, strict=True) if v is not None},
            "avg": {k: v for k, v in zip(KEYS, avg, strict=True) if v is not None},
            "seen": _items([{"k": KEYS[r["_row"]], **{c: v for c, v in r.items() if c != "_row"}}
                            for r in store.get_state("seen").items_batch(ks).to_pylist()]),
        }
    finally:
        table.restore()


def _items(rows: list[dict]) -> dict:
    out: dict = {}
    for row in rows:
        key, user_key, value = (row[c] for c in row)
        out.setdefault(key, {})[user_key] = value
    return out


def view_reads(table: IcebergStateTable, checkpoint_id: int | None) -> dict[str, dict]:
    """The same through ``inspection.live_state``."""
    out: dict[str, dict] = {}
    for d in DESCRIPTORS:
        rows = inspection.live_state(table, d.name, checkpoint_id, NOW).to_pylist()
        v = f"v_{d.name}"
        if d.name == "events":
            found: dict = {}
            for r in sorted(rows, key=lambda r: (r["k"], r["list_position"])):
                found.setdefault(r["k"], []).append(r[v])
            out[d.name] = found
        elif d.name == "seen":
            out[d.name] = _items([{"k": r["k"], "mk": r["mk_seen"], "v": r[v]} for r in rows])
        elif d.name == "avg":  # the view holds the accumulator, the handle gives its result
            out[d.name] = {r["k"]: r[v]["sum"] / r[v]["count"] for r in rows}
        else:
            out[d.name] = {r["k"]: r[v] for r in rows}
    return out


def test_live_state_equals_the_stores_reads_at_every_checkpoint_after_compaction_and_rescale(open_table):
    table = open_table(LAYOUT, retain_checkpoints=20)
    written = run(table, seed=7, batches=8, compact_at=4)
    assert [c.checkpoint_id for c in table.list_checkpoints()] == written
    for cp in written[1:]:
        assert view_reads(table, cp) == store_reads(table, cp), cp
    assert view_reads(table, None) == store_reads(table, written[-1])
    files = inspection.segments(table).column("file").to_pylist()
    assert all(f.startswith("s3://" if open_table.__self__.kind == "s3" else "file://") for f in files)


def test_provenance_columns_name_the_writing_checkpoint_and_batch(open_table):
    table = open_table(LAYOUT, retain_checkpoints=3)
    written = run(table, seed=3, batches=6)
    rows = inspection.live_state(table, "point", now_ms=NOW)
    assert rows.column_names == ["k", "v_point", "key_group", "checkpoint_id", "batch_id", "expire_at_ms"]
    batch_of = {c.checkpoint_id: c.batch_id for c in table.list_checkpoints()}
    for r in rows.to_pylist():
        assert r["key_group"] == assign_key_groups(keys([r["k"]]), N)[0]
        assert r["checkpoint_id"] <= written[-1]
        # The batch is known while the writing checkpoint is retained.
        assert r["batch_id"] == batch_of.get(r["checkpoint_id"])
        assert r["v_point"]["s"] == f"c{r['checkpoint_id'] - written[0] + 1}"
    listed = inspection.live_state(table, "events", now_ms=NOW)
    assert listed.column_names == ["k", "v_events", "list_position", "ord", "key_group", "checkpoint_id", "batch_id",
                                   "expire_at_ms"]
    by_key: dict = {}
    for r in listed.to_pylist():
        by_key.setdefault(r["k"], []).append(r["list_position"])
    assert all(sorted(p) == list(range(len(p))) for p in by_key.values())
    assert inspection.live_state(table, "seen", now_ms=NOW).column_names[:3] == ["k", "mk_seen", "v_seen"]


@pytest.mark.slow
@given(seed=st.integers(0, 10_000), batches=st.integers(2, 7), data=st.data())
@fuzz_settings(ci_examples=12)
def test_the_change_feed_is_the_difference_of_two_restores(tmp_path_factory, seed, batches, data):
    warehouse = str(tmp_path_factory.mktemp("feed"))
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op", retain_checkpoints=10) as table:
        written = run(table, seed, batches, compact_at=data.draw(st.sampled_from([None, 0, batches - 1])))
        old = data.draw(st.sampled_from(written))
        new = data.draw(st.sampled_from(written))
        before, after = store_reads(table, old), store_reads(table, new)
        for d in DESCRIPTORS:
            feed = inspection.changes(table, d.name, old, new, now_ms=NOW).to_pylist()
            assert feed == sorted(feed, key=lambda r: (r["key_group"], r["k"], r.get("mk_seen") or ""))
            # The feed holds an aggregate's accumulators, the handle gives their results.
            results = [{**r, "before": _mean(r["before"]), "after": _mean(r["after"])} for r in feed] \
                if d.name == "avg" else feed
            assert _apply(before[d.name], results, d.name) == after[d.name], (d.name, old, new)
            for r in feed:
                assert r["change_type"] == ("insert" if r["before"] is None else
                                            "delete" if r["after"] is None else "update")
                assert r["before"] != r["after"]


def _mean(accumulator: dict | None) -> float | None:
    return None if accumulator is None else accumulator["sum"] / accumulator["count"]


def _apply(state: dict, feed: list[dict], name: str) -> dict:
    """``state`` with a change feed applied, checking each change's before value."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in state.items()}
    for r in feed:
        if name == "seen":
            current = out.get(r["k"], {}).get(r["mk_seen"])
            assert current == r["before"], r
            if r["after"] is None:
                del out[r["k"]][r["mk_seen"]]
                if not out[r["k"]]:
                    del out[r["k"]]
            else:
                out.setdefault(r["k"], {})[r["mk_seen"]] = r["after"]
            continue
        assert out.get(r["k"]) == r["before"], r
        if r["after"] is None:
            del out[r["k"]]
        else:
            out[r["k"]] = r["after"]
    return out


def test_the_change_feed_between_a_fork_and_main_compares_every_key(open_table):
    table = open_table(LAYOUT, retain_checkpoints=10)
    written = run(table, seed=11, batches=4)
    feed = inspection.changes(table, "total", written[-1], written[0], now_ms=NOW).to_pylist()
    back = inspection.changes(table, "total", written[0], written[-1], now_ms=NOW).to_pylist()
    # Backwards (not a descendant): every key compared; the same changes, sides swapped.
    swapped = {"insert": "delete", "delete": "insert", "update": "update"}
    assert sorted((swapped[r["change_type"]], r["k"], r["after"], r["before"]) for r in feed) == \
        sorted((r["change_type"], r["k"], r["before"], r["after"]) for r in back)
    assert inspection.changes(table, "total", written[1], written[1], now_ms=NOW).num_rows == 0


def test_checkpoints_segments_and_key_groups_agree_with_the_metadata(open_table):
    table = open_table(LAYOUT, retain_checkpoints=4)
    written = run(table, seed=5, batches=6, compact_at=3)
    table.savepoint("early", written[2])
    listed = inspection.checkpoints(table).to_pylist()
    assert [r["checkpoint_id"] for r in listed] == written[2:]
    assert [r["batch_id"] for r in listed] == [2, 3, 4, 5]
    assert listed[0]["savepoints"] == ["early"] and listed[1]["savepoints"] == []
    assert all(r["operation"] == "checkpoint" and r["on_line"] for r in listed)
    assert [r["parallelism"] for r in listed] == [2, 3, 3, 3]
    assert all(r["rows_added"] > 0 and r["bytes_added"] > 0 and r["files"] > 0 for r in listed)
    # The operator is the state table; written outside a query: no query id, no operator state.
    assert {(r["operator"], r["query_id"], r["operator_state_files"]) for r in listed} == \
        {(table.identifier, None, 0)}
    newest = listed[-1]
    files = inspection.segments(table)
    assert files.num_rows == newest["files"]
    assert sum(files.column("rows").to_pylist()) == newest["rows"]
    assert sum(files.column("bytes").to_pylist()) == newest["bytes"]
    assert {r["unit"] for r in files.to_pylist()} <= set(range(table.partition_count()))
    groups = inspection.key_groups(table)
    assert groups.column("key_group").to_pylist() == list(range(N))
    assert sum(groups.column("rows").to_pylist()) == newest["rows"]
    entries = connect(table).sql("SELECT key_group, count(*) FROM entries GROUP BY 1").fetchall()
    assert dict(entries) == {r["key_group"]: r["rows"] for r in groups.to_pylist() if r["rows"]}
    # Bytes are the row groups' compressed column chunks: at most the files' sizes.
    assert 0 < sum(groups.column("bytes").to_pylist()) <= newest["bytes"]
    with pytest.raises(CheckpointNotFoundError, match="not retained"):
        inspection.segments(table, written[0])


def test_a_savepoint_off_the_line_is_listed(open_table):
    table = open_table(LAYOUT, retain_checkpoints=2)
    written = run(table, seed=2, batches=2)
    table.savepoint("first", written[0])
    run(table, seed=3, batches=4)
    listed = inspection.checkpoints(table).to_pylist()
    assert listed[-1]["checkpoint_id"] == written[0] and not listed[-1]["on_line"]
    assert listed[-1]["savepoints"] == ["first"]
    assert [r["on_line"] for r in listed[:-1]] == [True, True]


def test_one_keys_state_and_history(open_table):
    table = open_table(LAYOUT, retain_checkpoints=10)
    written = run(table, seed=9, batches=5)
    key = next(k for k in KEYS if k in store_reads(table, written[-1])["total"])
    now = inspection.key_state(table, {"k": key}, now_ms=NOW)
    assert set(now) == {d.name for d in DESCRIPTORS}
    assert now["total"].column("v_total").to_pylist() == [store_reads(table, written[-1])["total"][key]]
    history = inspection.key_history(table, {"k": key}, now_ms=NOW)["total"].to_pylist()
    expected = [(cp, reads["total"][key]) for cp in written
                if key in (reads := store_reads(table, cp))["total"]]
    assert [(r["checkpoint_id_at"], r["v_total"]) for r in history] == expected
    assert all(r["committed_at"] is not None for r in history)
    empty = inspection.key_history(table, {"k": "never"}, now_ms=NOW)
    assert all(t.num_rows == 0 for t in empty.values())
    assert empty["events"].column_names[:3] == ["checkpoint_id_at", "batch_id_at", "committed_at"]


def test_bad_keys_and_variables_are_named(open_table):
    table = open_table(LAYOUT)
    run(table, seed=1, batches=1)
    with pytest.raises(ValueError, match=r"columns \['k'\]"):
        inspection.key_state(table, {"user": "x"})
    with pytest.raises(ValueError, match="key column 'k' is string"):
        inspection.key_state(table, {"k": object()})
    with pytest.raises(StateNotDeclaredError, match="no state variable 'nope'"):
        inspection.live_state(table, "nope")


def test_sql_views_are_the_inspection_tables(open_table):
    table = open_table(LAYOUT, retain_checkpoints=10)
    written = run(table, seed=4, batches=4)
    con = connect(table, now_ms=NOW, changes_from=written[0])
    for name in ("checkpoints", "segments", "key_groups"):
        got, expected = con.sql(f"SELECT * FROM {name}").to_arrow_table(), getattr(inspection, name)(table)
        # DuckDB holds timestamps in microseconds (committed_at)
        assert got.column_names == expected.column_names and got.to_pylist() == expected.to_pylist()
    for d in DESCRIPTORS:
        assert con.sql(f"SELECT * FROM state_{d.name}").to_arrow_table().to_pylist() == \
            inspection.live_state(table, d.name, now_ms=NOW).to_pylist()
        assert con.sql(f"SELECT * FROM changes_{d.name}").to_arrow_table().to_pylist() == \
            inspection.changes(table, d.name, written[0], now_ms=NOW).to_pylist()
    skew = con.sql("SELECT max(rows) - min(rows) FROM key_groups").fetchall()[0][0]
    assert skew >= 0


def test_a_compaction_between_two_checkpoints_hides_no_delete(open_table):
    """Found by review: a unit merged whole keeps survivors only, so the tombstone of a key
    deleted after the older checkpoint left no newer entry, and the feed missed the delete."""
    from catalog.compaction import compact as merge

    layout = StateLayout.of(pa.schema([("k", pa.string())]), [ValueStateDescriptor("v", pa.int64())], 4)
    table = open_table(layout, retain_checkpoints=10)
    store = StateStore(table, config=StoreConfig(clock_ms=lambda: NOW))
    store.get_state("v").update_batch(keys(["a", "b"]), [1, 2])
    store.checkpoint()
    store.get_state("v").update_batch(keys(["c"]), [3])
    older = store.checkpoint().checkpoint_id
    store.get_state("v").clear_batch(keys(["a"]))
    store.checkpoint()
    merge(table)
    store.restore()
    store.get_state("v").update_batch(keys(["c"]), [30])
    newer = store.checkpoint().checkpoint_id
    feed = {r["k"]: r["change_type"] for r in inspection.changes(table, "v", older, newer, now_ms=NOW).to_pylist()}
    assert feed == {"a": "delete", "c": "update"}
