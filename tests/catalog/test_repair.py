"""Offline repair and migration (``catalog.repair``): puts, deletes and SQL-made rows commit as one
checkpoint recorded with who, why and how many rows, carrying the base's batch and properties;
the dry run's change feed is the committed one's; a stale base is refused; bad rows are named;
schema migration by Iceberg evolution reads old entries with the new type, on local disk and S3.
The stream resuming after a repair is tested with Spark in tests/integration/test_stateful_query.py."""

from __future__ import annotations

import json

import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from catalog import IcebergStateTable, inspection
from catalog.fileio import wait_for_deletes
from catalog.naming import Locations
from catalog.repair import Repair, RepairConflictError, migrate
from catalog.schema import canonical_arrow_type, canonical_type
from statestore import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    TtlConfig,
    ValueStateDescriptor,
)
from statestore.errors import SchemaMismatchError, StateNotDeclaredError, StateTableMismatchError
from statestore.live_rows import Ledger
from tests.catalog.catalog_helpers import referenced_files

N = 8
POINT = pa.struct([("n", pa.int32()), ("s", pa.string())])
DESCRIPTORS = [
    ValueStateDescriptor("count", pa.int64()),
    ValueStateDescriptor("point", POINT),
    ListStateDescriptor("pages", pa.string()),
    MapStateDescriptor("seen", pa.int64(), key_type=pa.string()),
    ValueStateDescriptor("session", pa.int64(), ttl=TtlConfig(60_000)),
]
LAYOUT = StateLayout.of(pa.schema([("user", pa.string())]), DESCRIPTORS, N)
NOW = 1_000_000
USERS = [f"u{i}" for i in range(6)]


@pytest.fixture
def table(place) -> IcebergStateTable:
    """A table holding two checkpoints of a stream (batches 0 and 1) with query properties."""
    written = place.open(LAYOUT, retain_checkpoints=10)
    store = StateStore(written, config=StoreConfig(clock_ms=lambda: NOW))
    users = pa.table({"user": USERS})
    for batch in range(2):
        store.get_state("count").update_batch(users, [batch * 10 + i for i in range(6)])
        store.get_state("point").update_batch(users, [{"n": i, "s": f"b{batch}"} for i in range(6)])
        store.get_state("pages").add_batch(users, [f"/p{batch}"] * 6)
        store.get_state("seen").put_batch(users, [f"m{batch}"] * 6, [batch] * 6)
        store.checkpoint(batch_id=batch, properties={"icestate.watermark-ms": str(batch * 1000)})
    return written


def stored(table: IcebergStateTable) -> set[str]:
    """Every file under the table's location, on local disk or S3."""
    wait_for_deletes()
    root = Locations.of(table.location, table.iceberg_table.io).to_path(table.location)
    found = table.filesystem.get_file_info(pafs.FileSelector(root, recursive=True))
    return {f.path for f in found if f.type == pafs.FileType.File}


def users(*names: str) -> pa.Table:
    return pa.table({"user": list(names)})


def live(table: IcebergStateTable, variable: str) -> dict:
    rows = inspection.live_state(table, variable, now_ms=NOW).to_pylist()
    if variable == "pages":
        out: dict = {}
        for r in sorted(rows, key=lambda r: r["list_position"]):
            out.setdefault(r["user"], []).append(r["v_pages"])
        return out
    if variable == "seen":
        return {(r["user"], r["mk_seen"]): r["v_seen"] for r in rows}
    return {r["user"]: r[f"v_{variable}"] for r in rows}


def test_a_repair_commits_puts_and_deletes_as_one_recorded_checkpoint(table):
    before = {d.name: live(table, d.name) for d in DESCRIPTORS}
    with Repair(table, reason="fix u1, drop poisoned u2", by="ops", now_ms=NOW) as repair:
        repair.put("count", pa.table({"user": ["u1"], "v_count": [999]}))
        repair.put("point", pl.DataFrame({"user": ["u0"], "v_point": [{"n": 7, "s": "fixed"}]}))
        repair.put("pages", pa.table({"user": ["u3", "u9"], "v_pages": [["/a", "/b"], ["/new"]]}))
        repair.put("seen", pa.table({"user": ["u4"], "mk_seen": ["m9"], "v_seen": [9]}))
        repair.delete("seen", pa.table({"user": ["u5"], "mk_seen": ["m0"]}))
        repair.delete_keys(users("u2"))
        info = repair.commit()
    assert info.checkpoint_id == 3 and info.batch_id == 1 and info.parallelism == 1
    assert info.properties["icestate.watermark-ms"] == "1000"  # the query's properties carried forward
    assert info.properties["icestate.repair.by"] == "ops"
    assert info.properties["icestate.repair.reason"] == "fix u1, drop poisoned u2"
    assert info.properties["icestate.repair.base"] == "2"
    assert "icestate.live-rows" not in info.properties  # the base had no live row count to go on from
    assert json.loads(info.properties["icestate.repair.rows"]) == {
        "count": {"put": 1, "delete": 1}, "point": {"put": 1, "delete": 1}, "pages": {"put": 2, "delete": 1},
        "seen": {"put": 1, "delete": 2}, "session": {"put": 0, "delete": 1}}
    listed = inspection.checkpoints(table).to_pylist()[-1]
    assert (listed["operation"], listed["repair_by"], listed["batch_id"]) == ("repair", "ops", 1)

    expected = {d: dict(v) for d, v in before.items()}
    expected["count"]["u1"] = 999
    expected["point"]["u0"] = {"n": 7, "s": "fixed"}
    expected["pages"].update({"u3": ["/a", "/b"], "u9": ["/new"]})
    expected["seen"][("u4", "m9")] = 9
    del expected["seen"][("u5", "m0")]
    for d in expected:
        for k in [k for k in expected[d] if k == "u2" or (isinstance(k, tuple) and k[0] == "u2")]:
            del expected[d][k]
    assert {d.name: live(table, d.name) for d in DESCRIPTORS} == expected
    # A store restored at the repair reads the same (the stream resumes from it).
    reopened = StateStore(table, config=StoreConfig(clock_ms=lambda: NOW))
    assert reopened.get_state("count").get_batch(users("u1", "u2")).to_pylist() == [999, None]
    assert reopened.get_state("pages").get_batch(users("u3")).to_pylist() == [["/a", "/b"]]


def test_the_dry_run_shows_the_change_feed_the_commit_produces_and_leaves_nothing(table):
    files = stored(table)
    repair = Repair(table, reason="double u1, u3", now_ms=NOW)
    repair.put("count", repair.sql("SELECT user, v_count * 2 AS v_count FROM state_count WHERE user IN ('u1', 'u3')"))
    repair.put("pages", pa.table({"user": ["u0"], "v_pages": [["/p0", "/p1"]]}))  # the same list: no change
    repair.delete("seen", users("u1"))
    planned = repair.dry_run()
    assert stored(table) == files and table.current_checkpoint().checkpoint_id == 2
    assert planned["count"].to_pylist() == [
        {"change_type": "update", "user": u, "key_group": kg, "before": v, "after": 2 * v,
         "before_checkpoint_id": 2, "after_checkpoint_id": 3}
        for kg, u, v in sorted((r["key_group"], r["user"], r["v_count"])
                               for r in inspection.live_state(table, "count").to_pylist() if r["user"] in ("u1", "u3"))]
    assert planned["pages"].num_rows == 0
    assert [(r["change_type"], r["mk_seen"]) for r in planned["seen"].to_pylist()] == [("delete", "m0"),
                                                                                       ("delete", "m1")]
    info = repair.commit()
    for name, feed in planned.items():
        committed = inspection.changes(table, name, 2, info.checkpoint_id, now_ms=NOW)
        assert committed.to_pylist() == feed.to_pylist(), name
    repair.close()
    assert len(stored(table)) == len(referenced_files(table))


def test_a_repair_on_a_stale_base_is_refused_and_commits_nothing(table, place):
    repair = Repair(table, reason="late fix", now_ms=NOW)
    repair.put("count", pa.table({"user": ["u1"], "v_count": [5]}))
    # The stream commits meanwhile, from another process's table.
    stream = place.ref("op").open(LAYOUT)
    store = StateStore(stream, config=StoreConfig(clock_ms=lambda: NOW))
    store.get_state("count").update_batch(users("u1"), [77])
    store.checkpoint(batch_id=2)
    stream.close()
    with pytest.raises(RepairConflictError, match="newer than the repair's base 2"):
        repair.commit()
    table.restore()
    assert table.current_checkpoint().checkpoint_id == 3 and live(table, "count")["u1"] == 77
    older = place.ref("op").open(LAYOUT, checkpoint_id=2)
    with pytest.raises(RepairConflictError, match="opened at checkpoint 2, but its newest checkpoint is 3"):
        Repair(older, reason="on an old checkpoint")
    older.close()


def test_bad_rows_are_named_and_change_nothing(table):
    repair = Repair(table, reason="bad rows", now_ms=NOW)
    with pytest.raises(SchemaMismatchError, match=r"lack column\(s\) \['v_count'\].*v_count \(int64\)"):
        repair.put("count", pa.table({"user": ["u1"], "count": [1]}))
    with pytest.raises(SchemaMismatchError, match="v_count of the rows for state 'count' does not convert to int64"):
        repair.put("count", pa.table({"user": ["u1"], "v_count": ["many"]}))
    with pytest.raises(ValueError, match="give each key once"):
        repair.put("count", pa.table({"user": ["u1", "u1"], "v_count": [1, 2]}))
    with pytest.raises(ValueError, match="null values in v_count: delete those keys instead"):
        repair.put("count", pa.table({"user": ["u1"], "v_count": pa.array([None], pa.int64())}))
    with pytest.raises(StateNotDeclaredError, match="no state variable 'nope'"):
        repair.put("nope", pa.table({"user": ["u1"]}))
    with pytest.raises(ValueError, match="changes nothing"):
        repair.commit()
    with pytest.raises(ValueError, match="reason"):
        Repair(table, reason=" ")
    assert table.current_checkpoint().checkpoint_id == 2


def test_repaired_entries_expire_after_the_variables_ttl(table):
    with Repair(table, reason="start sessions", now_ms=NOW) as repair:
        repair.put("session", pa.table({"user": ["u1"], "v_session": [1]}))
        repair.put("count", pa.table({"user": ["u1"], "v_count": [1], "expire_at_ms": [NOW + 5]}))
        repair.commit()
    rows = {r["user"]: r["expire_at_ms"] for r in inspection.live_state(table, "session", now_ms=NOW).to_pylist()}
    assert rows == {"u1": NOW + 60_000}
    assert "u1" not in {r["user"] for r in inspection.live_state(table, "count", now_ms=NOW + 5).to_pylist()}


def test_a_bulk_load_into_an_empty_table(place):
    empty = place.open(LAYOUT, table_name="fresh")
    with Repair(empty, reason="initial state from the warehouse", now_ms=NOW) as repair:
        repair.put("count", pa.table({"user": [f"k{i}" for i in range(1000)], "v_count": list(range(1000))}))
        info = repair.commit()
    assert (info.checkpoint_id, info.batch_id) == (1, None)
    assert sum(live(empty, "count").values()) == sum(range(1000))
    assert Ledger.decode(info.properties["icestate.live-rows"]).rows == {"count": {None: 1000}}


def test_a_bulk_load_appends_list_elements_with_their_own_expiry_at_a_stream_position(place):
    """The bulk load of state brought from elsewhere: list elements appended in order, each with
    its expiry; timers stored and never counted as rows; the first checkpoint at the stream's
    batch with its properties; an empty load still commits that position; a repair on top keeps
    its base's position and may not set one."""
    layout = StateLayout.of(LAYOUT.key_schema, [*DESCRIPTORS, MapStateDescriptor(
        "icestate_timers", pa.bool_(), key_type=pa.int64())], N)
    fresh = place.open(layout, table_name="loaded")
    with Repair(fresh, reason="imported", now_ms=NOW) as load:
        load.append("pages", pa.table({"user": ["a", "b", "a", "a"], "v_pages": ["/1", "/x", "/2", "/3"],
                                       "expire_at_ms": [NOW + 5, None, NOW - 1, NOW + 9]}))
        load.put("icestate_timers", pa.table({"user": ["a", "a"], "mk_icestate_timers": [7, 9],
                                              "v_icestate_timers": [True, True]}))
        with pytest.raises(ValueError, match="append takes a list"):
            load.append("count", pa.table({"user": ["a"], "v_count": [1]}))
        info = load.commit(batch_id=41, stream={"icestate.query-id": "q-1", "icestate.watermark-ms": "7"})
    assert (info.batch_id, info.properties["icestate.query-id"], info.properties["icestate.watermark-ms"]) == (
        41, "q-1", "7")
    assert live(fresh, "pages") == {"a": ["/1", "/3"], "b": ["/x"]}  # /2 expired
    assert json.loads(info.properties[inspection.SUMMARY_REPAIR_ROWS])["pages"] == {"put": 0, "delete": 0,
                                                                                  "append": 4}
    assert Ledger.decode(info.properties["icestate.live-rows"]).rows == {"pages": {NOW + 9: 1, None: 1}}
    with Repair(fresh, reason="later", now_ms=NOW) as repair:
        repair.put("count", pa.table({"user": ["a"], "v_count": [1]}))
        with pytest.raises(ValueError, match="keeps those of its base"):
            repair.commit(batch_id=3)
        assert repair.commit().batch_id == 41
    empty = place.open(LAYOUT, table_name="empty")
    with Repair(empty, reason="imported nothing", now_ms=NOW) as load:
        assert load.commit(batch_id=5, stream={"icestate.query-id": "q-2"}).batch_id == 5
    with Repair(empty, reason="nothing", now_ms=NOW) as repair, pytest.raises(ValueError, match="changes nothing"):
        repair.commit()


def test_a_repair_goes_on_with_the_streams_live_row_count(place):
    """A base that carries the stream's live row count (``statestore.live_rows``): the repair's
    checkpoint carries it on with the repair's change, equal to the rows it leaves."""
    written = place.open(LAYOUT, table_name="counted", retain_checkpoints=10)
    store = StateStore(written, config=StoreConfig(clock_ms=lambda: NOW, count_live_rows=True))
    ledger = Ledger()
    everyone = pa.table({"user": USERS})
    store.get_state("count").update_batch(everyone, list(range(6)))
    store.get_state("pages").add_batch(everyone, ["/a"] * 6)
    store.get_state("seen").put_batch(everyone, ["m0"] * 6, [1] * 6)
    store.get_state("session").update_batch(everyone, [1] * 6)
    cp = written.next_checkpoint_id()
    segments = store.flush(cp)
    ledger.add(store.live_row_change(cp))
    written.commit_checkpoint(cp, segments, parallelism=1, batch_id=0,
                              properties={"icestate.live-rows": ledger.encode()})
    store.checkpoint_complete(cp)
    store.close()
    with Repair(written, reason="drop u2, two pages for u9", now_ms=NOW + 1) as repair:
        repair.delete_keys(users("u2"))
        repair.put("pages", pa.table({"user": ["u9"], "v_pages": [["/x", "/y"]]}))
        repair.put("seen", pa.table({"user": ["u0"], "mk_seen": ["m1"], "v_seen": [3]}))
        info = repair.commit()
    counted = Ledger.decode(info.properties["icestate.live-rows"])
    assert {d.name: counted.of(d.name) for d in DESCRIPTORS} == {
        "count": len(live(written, "count")), "point": 0, "pages": len(live(written, "pages")),
        "seen": len(live(written, "seen")), "session": len(live(written, "session"))} == {
        "count": 5, "point": 0, "pages": 6, "seen": 6, "session": 5}


def test_migration_adds_a_struct_field_and_widens_types(table, place):
    migrate(table, "point", pa.struct([("n", pa.int64()), ("s", pa.string()), ("note", pa.string())]))
    migrate(table, "seen", pa.int64())  # the same type: nothing to do
    table.close()
    new_point = pa.struct([("n", pa.int64()), ("s", pa.string()), ("note", pa.string())])
    layout = StateLayout.of(LAYOUT.key_schema, [DESCRIPTORS[0], ValueStateDescriptor("point", new_point),
                                                *DESCRIPTORS[2:]], N)
    resumed = place.ref("op").open(layout)  # the stream's new declaration is accepted
    store = StateStore(resumed, config=StoreConfig(clock_ms=lambda: NOW))
    old = store.get_state("point").get_batch(users("u1")).to_pylist()
    assert old == [{"n": 1, "s": "b1", "note": None}]
    store.get_state("point").update_batch(users("u2"), [{"n": 2**40, "s": "new", "note": "wide"}])
    store.checkpoint(batch_id=2)
    both = {r["user"]: r["v_point"] for r in inspection.live_state(resumed, "point", now_ms=NOW).to_pylist()}
    assert both["u1"] == {"n": 1, "s": "b1", "note": None} and both["u2"] == {"n": 2**40, "s": "new", "note": "wide"}
    with place.ref("op").open() as reread:
        assert reread.layout.descriptor("point").value_type == new_point
    with pytest.raises(SchemaMismatchError, match="loses field"):
        migrate(resumed, "point", pa.struct([("n", pa.int64())]))
    with pytest.raises(SchemaMismatchError, match="changes from int64 to int32"):
        migrate(resumed, "count", pa.int32())


def test_a_value_schema_declared_changed_evolves_when_the_table_is_reopened_as_sparks_does(table, place):
    """As Spark evolves a state's schema on restart (Avro's resolution, by field name): fields
    reordered, widened and added, then dropped; metadata only, old entries read with the new
    declaration; a dropped field stays in the table (nothing stored is lost); a narrowing or a
    new field that is not nullable is refused."""
    table.close()

    def layout_with(point: pa.DataType) -> StateLayout:
        return StateLayout.of(LAYOUT.key_schema, [DESCRIPTORS[0], ValueStateDescriptor("point", point),
                                                  *DESCRIPTORS[2:]], N)

    wider = pa.struct([("s", pa.string()), ("n", pa.int64()), ("note", pa.string())])
    resumed = place.ref("op").open(layout_with(wider))
    snapshot = resumed.iceberg_table.metadata.current_snapshot_id
    assert resumed.current_checkpoint().snapshot_id == snapshot  # no new snapshot: no file written
    # The table's column, by name: n widened, note added (its fields keep the table's order).
    assert canonical_type(resumed.iceberg_table.schema().find_field("v_point").field_type) == canonical_arrow_type(
        pa.struct([("n", pa.int64()), ("s", pa.string()), ("note", pa.string())]))
    store = StateStore(resumed, config=StoreConfig(clock_ms=lambda: NOW))
    assert store.get_state("point").get_batch(users("u1")).to_pylist() == [{"s": "b1", "n": 1, "note": None}]
    store.get_state("point").update_batch(users("u2"), [{"s": "new", "n": 2**40, "note": "wide"}])
    store.checkpoint(batch_id=2)
    resumed.close()

    narrower = pa.struct([("n", pa.int64())])  # s and note no longer declared
    resumed = place.ref("op").open(layout_with(narrower))
    store = StateStore(resumed, config=StoreConfig(clock_ms=lambda: NOW))
    assert store.get_state("point").get_batch(users("u1", "u2")).to_pylist() == [{"n": 1}, {"n": 2**40}]
    store.get_state("point").update_batch(users("u3"), [{"n": 3}])
    store.checkpoint(batch_id=3)
    resumed.close()
    with place.ref("op").open() as recorded:  # the table's own layout: every field it holds
        kept = {r["user"]: r["v_point"] for r in inspection.live_state(recorded, "point", now_ms=NOW).to_pylist()}
    assert kept["u1"] == {"n": 1, "s": "b1", "note": None}  # the dropped fields are still stored
    assert kept["u2"] == {"n": 2**40, "s": "new", "note": "wide"} and kept["u3"] == {"n": 3, "s": None, "note": None}

    for point, problem in ((pa.struct([("n", pa.int32())]), "field 'n' changes from int64 to int32"),
                           (pa.struct([("n", pa.int64()), pa.field("must", pa.int64(), nullable=False)]),
                            "gains field 'must', which is not nullable"),
                           (pa.struct([pa.field("n", pa.int64(), nullable=False)]), "field 'n' becomes not nullable")):
        with pytest.raises(StateTableMismatchError) as refused:
            place.ref("op").open(layout_with(point))
        assert problem in str(refused.value) and "STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION" in str(refused.value)


def test_a_map_entry_without_its_user_key_is_refused(table):
    repair = Repair(table, reason="bad map rows", now_ms=NOW)
    with pytest.raises(ValueError, match="null map keys in mk_seen"):
        repair.put("seen", pa.table({"user": ["u1"], "mk_seen": pa.array([None], pa.string()), "v_seen": [5]}))
