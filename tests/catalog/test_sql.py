"""DuckDB views over the raw entries of a checkpoint."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from catalog import connect, entries_view
from statestore.descriptors import ValueStateDescriptor
from statestore.errors import CheckpointNotFoundError
from statestore.layout import StateLayout
from tests.catalog.catalog_helpers import DESCRIPTORS, KEY_SCHEMA, MAX_PARALLELISM, commit_next


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
