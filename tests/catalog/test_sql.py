"""DuckDB views over the raw entries of a checkpoint, and the live state per variable: every
test runs on local disk and on S3 (moto's server on loopback), where DuckDB reads through the
table's own filesystem (no DuckDB extension); both give the same views."""

from __future__ import annotations

from datetime import UTC, datetime

import duckdb
import pyarrow as pa
import pytest

from catalog import connect, entries_view
from catalog.sql import new_connection
from statestore import ListStateDescriptor, MapStateDescriptor, StateStore, StoreConfig, TtlConfig
from statestore.descriptors import ValueStateDescriptor
from statestore.errors import CheckpointNotFoundError
from statestore.keygroups import KeyGroupRange
from statestore.layout import StateLayout
from tests.catalog.catalog_helpers import DESCRIPTORS, KEY_SCHEMA, MAX_PARALLELISM, commit_next
from tests.catalog.conftest import Place

ALL_GROUPS = KeyGroupRange.of(0, MAX_PARALLELISM - 1)


@pytest.fixture
def open_table(place):
    """The tables of these tests, at the parametrized place (local disk or S3)."""
    return place.open


def test_view_of_the_opened_checkpoint(open_table):
    table = open_table()
    first = commit_next(table, [[0, 3], [9]])
    second = commit_next(table, [[3]])
    con = duckdb.connect()
    rel = entries_view(table, connection=con)
    assert rel.aggregate("count(*)").fetchall() == [(4,)]
    rows = con.execute(
        'SELECT key_group, "user", state, op, checkpoint_id, v_count FROM state_entries '
        "ORDER BY checkpoint_id, key_group"
    ).fetchall()
    assert rows == [(0, "u0", "count", 0, first, first * 1000), (3, "u3", "count", 0, first, first * 1000 + 3),
                    (9, "u9", "count", 0, first, first * 1000 + 9), (3, "u3", "count", 0, second, second * 1000 + 3)]


def test_view_of_an_older_checkpoint_or_snapshot(open_table):
    table = open_table()
    first = commit_next(table, [[1]])
    commit_next(table, [[2]])
    assert entries_view(table, checkpoint_id=first).aggregate("count(*)").fetchall() == [(1,)]
    snapshot_id = table.list_checkpoints()[0].snapshot_id
    rel = entries_view(table.iceberg_table, snapshot_id=snapshot_id, view_name="old")
    assert rel.aggregate("max(key_group)").fetchall() == [(1,)]
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 9"):
        entries_view(table, checkpoint_id=9)


def test_view_spans_schema_evolution(open_table):
    table = open_table()
    commit_next(table, [[1]])
    table.close()
    grown = StateLayout.of(KEY_SCHEMA, [*DESCRIPTORS, ValueStateDescriptor("extra", pa.string())], MAX_PARALLELISM)
    table = open_table(grown)
    commit_next(table, [[2]])
    rel = entries_view(table)
    assert "v_extra" in rel.columns
    assert rel.aggregate("count(*)").fetchall() == [(2,)]


def test_view_of_an_empty_table(open_table):
    rel = entries_view(open_table())
    assert rel.aggregate("count(*)").fetchall() == [(0,)]
    assert "key_group" in rel.columns


def test_view_is_replaced_between_empty_and_filled(open_table):
    con = duckdb.connect()
    empty = open_table(table_name="empty")
    filled = open_table()
    commit_next(filled, [[1]])
    for table, count in [(empty, 0), (filled, 1), (empty, 0)]:
        entries_view(table, connection=con)
        assert con.execute("SELECT count(*) FROM state_entries").fetchall() == [(count,)]


def test_connect_resolves_live_state_per_variable(open_table):
    table = open_table()
    first = commit_next(table, [[0, 3], [9]])
    second = commit_next(table, [[3]])
    con = connect(table)
    rows = con.execute('SELECT "user", v_count FROM state_count ORDER BY "user"').fetchall()
    assert rows == [("u0", first * 1000), ("u3", second * 1000 + 3), ("u9", first * 1000 + 9)]
    assert con.execute("SELECT count(*) FROM state_seen").fetchall() == [(0,)]
    assert con.execute("SELECT count(*) FROM entries").fetchall() == [(4,)]
    older = connect(table, checkpoint_id=first)
    assert older.execute("SELECT v_count FROM state_count WHERE \"user\" = 'u3'").fetchall() == [(first * 1000 + 3,)]


# Every supported kind of state, a two-column key with a timestamp, and a variable added later.
RICH_KEYS = pa.schema([("user", pa.string()), ("at", pa.timestamp("us", tz="UTC"))])
RICH = StateLayout.of(RICH_KEYS, [
    ValueStateDescriptor("v", pa.struct([("n", pa.int64()), ("tag", pa.string())])),
    ListStateDescriptor("l", pa.string()),
    MapStateDescriptor("m", pa.float64(), key_type=pa.int32()),
    ValueStateDescriptor("t", pa.int64(), ttl=TtlConfig(1000)),
], MAX_PARALLELISM)
RICH_GROWN = StateLayout.of(RICH_KEYS, [*RICH.descriptors, ValueStateDescriptor("late", pa.binary())], MAX_PARALLELISM)


def _write_rich_state(place: Place) -> None:
    """Three checkpoints of puts, appends, map entries, tombstones and TTL, the last one after
    the layout grew a variable (so files differ in columns)."""
    clock = [0]
    at = datetime(2024, 5, 1, tzinfo=UTC)
    users = [f"u{i}" for i in range(30)]

    def keys(us):
        return pa.table({"user": pa.array(us), "at": pa.array([at] * len(us), RICH_KEYS.field("at").type)})

    table = place.open(RICH)
    store = StateStore(table, config=StoreConfig(clock_ms=lambda: clock[0]))
    store.get_state("v").update_batch(keys(users), [{"n": i, "tag": f"t{i}"} for i in range(30)])
    store.get_state("l").add_batch(keys(users[:5]), ["a"] * 5)
    store.get_state("m").put_batch(keys(users[:4] * 2), [1, 1, 1, 1, 2, 2, 2, 2], [0.5] * 8)
    store.get_state("t").update_batch(keys(users[:10]), list(range(10)))
    store.checkpoint()
    clock[0] = 5000  # the TTL of the first t values is over
    store.get_state("v").clear_batch(keys(users[:3]))
    store.get_state("l").add_batch(keys(users[:2]), ["b", "c"])
    store.get_state("m").remove_batch(keys(users[:2]), [1, 2])
    store.get_state("t").update_batch(keys(users[5:7]), [70, 71])
    store.checkpoint()
    store.close()
    grown = place.open(RICH_GROWN)
    store = StateStore(grown, config=StoreConfig(clock_ms=lambda: clock[0]))
    store.get_state("late").update_batch(keys(users[:3]), [b"x", b"y", b"z"])
    store.get_state("v").update_batch(keys(users[:1]), [{"n": -1, "tag": None}])
    store.checkpoint()
    store.close()


def _views(place: Place, checkpoint_id: int | None) -> dict:
    """Every view's columns (names and DuckDB types) and sorted rows."""
    from catalog import TableRef

    ref: TableRef = place.ref("op")
    with ref.open(checkpoint_id=checkpoint_id) as table:
        con = connect(table, now_ms=6000)
        names = ["entries", *(f"state_{d.name}" for d in table.layout.descriptors)]
        return {name: (con.sql(f"DESCRIBE {name}").fetchall(),
                       sorted(map(repr, con.sql(f"SELECT * FROM {name}").fetchall()))) for name in names}


def test_views_are_the_same_on_every_filesystem(tmp_path, catalog_s3):
    local = Place("local", str(tmp_path / "local"))
    s3 = Place("s3", str(tmp_path / "s3"), catalog_s3)
    try:
        for p in (local, s3):
            _write_rich_state(p)
        for checkpoint_id in (None, 1, 2):
            on_disk, on_s3 = _views(local, checkpoint_id), _views(s3, checkpoint_id)
            assert on_s3 == on_disk
        newest = _views(s3, None)
        entry_columns = [c[0] for c in newest["entries"][0]]
        assert "v_late" in entry_columns and len(newest["entries"][1]) > 50
        assert len(newest["state_v"][1]) == 28 and len(newest["state_l"][1]) == 7
    finally:
        for p in (local, s3):
            for t in p.opened:
                t.close()


def test_filters_on_s3_read_through_the_table_filesystem(place):
    """A query filtering the raw entries gets the rows of the filter on either filesystem."""
    table = place.open()
    commit_next(table, [[0, 3], [9]])
    commit_next(table, [[3, 15]])
    rel = entries_view(table, connection=new_connection())
    assert rel.filter("key_group = 3").aggregate("count(*)").fetchall() == [(2,)]
    assert sorted(rel.filter("checkpoint_id = 2").project("key_group").fetchall()) == [(3,), (15,)]


def test_no_extension_is_ever_downloaded():
    con = new_connection()
    assert con.execute("SELECT current_setting('autoinstall_known_extensions')").fetchall() == [(False,)]


def test_inspection_is_read_only_and_confined_to_the_table(place: Place, tmp_path):
    """Issue 14, defect 3: `icestate sql` (and a connection of ``connect``) reads the table's
    views and nothing else: no file by path, no COPY over a committed segment, no ATTACH, no
    extension, no setting that lifts it. Each refusal is one line; the table is unchanged."""
    import hashlib
    import os

    from tests.catalog.test_cli import invoke

    table = place.open()
    commit_next(table, [[0, 3], [9]])
    segment = table.segments(ALL_GROUPS)[0].path
    read = table.filesystem.open_input_file(segment).read
    before = hashlib.sha256(read()).hexdigest()
    local = segment if place.kind == "local" else str(tmp_path / "x.parquet")
    hostile = [
        f"COPY (SELECT * FROM entries) TO '{local}' (FORMAT parquet)",
        f"SELECT * FROM read_parquet('{local}')",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM read_csv('/etc/hostname')",
        "SELECT * FROM glob('/etc/*')",
        f"ATTACH '{tmp_path / 'other.db'}'",
        "SET enable_external_access = true",
        "INSTALL httpfs",
        "LOAD httpfs",
    ]
    table.close()
    args = [*place.cli_args(), "--table", "op"]
    for query in hostile:
        result = invoke("sql", *args, query)
        assert result.exit_code == 1, (query, result.output)
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert "Traceback" not in result.output and len(errors) == 1, result.output
        assert "disabled" in result.output or "Cannot change configuration" in result.output, result.output
    assert not os.path.exists(tmp_path / "other.db")
    reopened = place.open()
    assert hashlib.sha256(reopened.filesystem.open_input_file(segment).read()).hexdigest() == before
    ok = invoke("sql", *args, "SELECT count(*) AS n FROM entries")
    assert ok.exit_code == 0 and "3" in ok.output, ok.output
    con = connect(reopened)
    assert con.execute("SELECT count(*) FROM state_count").fetchall() == [(3,)]
    with pytest.raises(duckdb.PermissionException):
        con.execute("SELECT * FROM read_text('/etc/passwd')")
    mine = duckdb.connect()
    connect(reopened, mine)  # a connection passed in stays as its owner made it
    assert mine.execute("SELECT count(*) FROM glob('/etc/host*')").fetchall()[0][0] >= 1
