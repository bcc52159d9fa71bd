"""Fuzzing of names (issue 14): every name stays in its place or is refused, naming it.

Strategy
    Hypothesis generates names of four kinds: plausible ones (the allowed character sets),
    pieces that could leave a directory or end a name early glued together (``..``, ``/``,
    ``\\``, NUL, newlines, spaces, ``main``, unicode look-alikes), any text at all (lone
    surrogates included) and very long ones. They are given as table name, namespace,
    savepoint, fork and keyed state names of real Iceberg state tables in a fresh local
    warehouse per example.

Properties
    1. A table or namespace name is refused with ``InvalidNameError`` (a ``ValueError``) whose
       message shows the name, and nothing is written anywhere; or it is accepted, and every
       file the table writes (its checkpoints, a fork's checkpoints, savepoints) stays inside
       ``<warehouse>/<namespace>/<table>`` (the warehouse's ``catalog.db`` aside).
    2. A fork or savepoint name is refused the same way, changing nothing, or accepted, and a
       checkpoint committed on the fork writes inside the table's directory only.
    3. Keyed state names (any text Spark allows): distinct names get distinct stored columns;
       each variable reads back its own value after a checkpoint, through the store and the
       SQL tables ``state_<name>``; a refused name is a ``ValueError`` naming it.
    No other exception type (``OSError``, ``UnicodeEncodeError``...) in any of them.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog import IcebergStateTable
from catalog.fileio import METADATA_FILES
from catalog.sql import connect, sql_name
from statestore import StateStore, StoreConfig, ValueStateDescriptor
from statestore.descriptors import column_stem
from statestore.layout import StateLayout
from statestore.names import InvalidNameError
from tests.catalog.catalog_helpers import LAYOUT
from tests.fuzzing import fuzz_settings

ELSEWHERE = StoreConfig(file_cache_mode="off")
USERS = pa.table({"user": ["a", "b"]})
PIECES = ["..", ".", "/", "\\", "\x00", "\n", "\r", "\t", " ", "é", "\u2024", "\u202e", "%2e", "~", "$", ":", "*",
          "a", "Z", "_", "-", "0", "main", "default", "state", "data", "metadata", "catalog.db", '"', "'"]

glued = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
any_text = st.text(st.characters(exclude_categories=()), max_size=12)
long_names = st.integers(100, 300).map(lambda n: "a" * n)
table_names = st.one_of(st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,20}", fullmatch=True), glued, any_text,
                        long_names)
ref_names = st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True), glued, any_text, long_names)
state_names = st.one_of(st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,10}", fullmatch=True), glued, any_text,
                        st.text(max_size=8), long_names)


class Warehouse:
    """A fresh local warehouse per example."""

    def __enter__(self) -> str:
        self.path = os.path.realpath(tempfile.mkdtemp(prefix="icestate-fuzz-"))
        return os.path.join(self.path, "wh")

    def __exit__(self, *exc) -> None:
        METADATA_FILES.clear()
        shutil.rmtree(self.path, ignore_errors=True)


def files_under(root: str) -> list[str]:
    """Every file and symbolic link under ``root`` (real paths of the directories walked)."""
    found = []
    for directory, _, names in os.walk(root):
        found += [os.path.join(directory, n) for n in names]
    return found


def assert_names(error: Exception, *candidates: str) -> None:
    """``error`` shows one of ``candidates`` (as ``statestore.names`` shows a name: its repr,
    cut after 60 characters)."""
    assert any(repr(c)[:60] in str(error) for c in candidates), f"{error} names none of {candidates!r}"


def assert_inside(warehouse: str, table_dir: str) -> None:
    """Every file of the warehouse is its catalog or under ``table_dir``."""
    for path in files_under(os.path.dirname(warehouse)):
        assert path == os.path.join(warehouse, "catalog.db") or path.startswith(table_dir + os.sep), (
            f"{path!r} is outside the table's directory {table_dir!r}")
        assert os.path.realpath(path) == path, f"{path!r} leads elsewhere"


def checkpoint(table: IcebergStateTable, value: int) -> None:
    store = StateStore(table, config=ELSEWHERE)
    store.get_state("count").update_batch(USERS, [value, value + 1])
    store.checkpoint()


@fuzz_settings(25)
@given(name=table_names, namespace=st.one_of(st.just("state"), table_names), fork=ref_names, savepoint=ref_names)
def test_table_namespace_fork_and_savepoint_names_stay_in_their_table(name: str, namespace: str, fork: str,
                                                                      savepoint: str):
    """Properties 1 and 2: a table, its namespace, a savepoint and a fork of generated names."""
    with Warehouse() as warehouse:
        try:
            table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=name, namespace=namespace)
        except InvalidNameError as e:
            assert isinstance(e, ValueError)
            assert_names(e, name, namespace)
            assert files_under(os.path.dirname(warehouse)) == [], "a refused name wrote files"
            return
        table_dir = os.path.join(warehouse, namespace, name)
        try:
            assert table.location == f"file://{table_dir}"
            checkpoint(table, 1)
            try:
                table.savepoint(savepoint)
            except InvalidNameError as e:
                assert_names(e, savepoint)
                assert table.savepoints() == {}
            else:
                assert set(table.savepoints()) == {savepoint}
            try:
                table.fork(fork)
            except InvalidNameError as e:
                assert_names(e, fork)
                assert table.forks() == {}
            except ValueError as e:
                assert fork in table.savepoints() and f"already has a savepoint named {fork!r}" in str(e)
            else:
                with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=name, namespace=namespace,
                                            branch=fork) as forked:
                    checkpoint(forked, 10)
                    assert StateStore(forked, config=ELSEWHERE).get_state("count").get_batch(USERS).to_pylist() \
                        == [10, 11]
            checkpoint(table, 2)
            assert StateStore(table, config=ELSEWHERE).get_state("count").get_batch(USERS).to_pylist() == [2, 3]
        finally:
            table.close()
        assert_inside(warehouse, table_dir)


@st.composite
def state_name_sets(draw) -> list[str]:
    """Two to three distinct state names; one may be another's column stem (a plain name that
    could take another name's columns)."""
    names = draw(st.lists(state_names, min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):
        stem = column_stem(names[0]) if names[0] else "s"
        if stem not in names:
            names.append(stem)
    return names


@fuzz_settings(25)
@given(names=state_name_sets())
def test_distinct_state_names_keep_distinct_columns(names: list[str]):
    """Property 3: a value state per generated name, each given its own value."""
    with Warehouse() as warehouse:
        try:
            descriptors = [ValueStateDescriptor(n, pa.int64()) for n in names]
            layout = StateLayout.of(pa.schema([("user", pa.string())]), descriptors, 8)
        except ValueError as e:  # InvalidNameError included
            assert_names(e, *names)
            return
        assert len({d.value_column for d in layout.descriptors}) == len(names), "two names share a column"
        table = IcebergStateTable.open(layout, warehouse=warehouse, table_name="t")
        try:
            store = StateStore(table, config=ELSEWHERE)
            for i, n in enumerate(names):
                store.get_state(n).update_batch(USERS, [i, -i])
            store.checkpoint()
        finally:
            table.close()
        METADATA_FILES.clear()
        with IcebergStateTable.open(layout, warehouse=warehouse, table_name="t") as table:
            store = StateStore(table, config=ELSEWHERE)
            for i, n in enumerate(names):
                assert store.get_state(n).get_batch(USERS).to_pylist() == [i, -i], f"state {n!r}"
            con = connect(table)
            for i, n in enumerate(names):
                ident = '"' + ("state_" + sql_name(n)).replace('"', '""') + '"'
                rows = con.execute(f"SELECT * FROM {ident} ORDER BY 1").fetchall()
                assert [(r[0], r[1]) for r in rows] == [("a", i), ("b", -i)], f"SQL table of state {n!r}"
        with IcebergStateTable.open_existing(warehouse=warehouse, table_name="t") as table:
            assert [d.name for d in table.layout.descriptors] == names


def test_a_plain_state_name_equal_to_another_names_column_stem_is_refused():
    """Regression (found by this fuzzing): 'a.b' is stored in column v_a_b_<digest>, and a state
    named 'a_b_<digest>' (a plain name, used as is) took the same column: both variables read
    and wrote one column. The layout now refuses the pair, naming both."""
    stem = column_stem("a.b")
    with pytest.raises(ValueError, match=rf"'a\.b' and '{stem}' would share the stored column"):
        StateLayout.of(pa.schema([("user", pa.string())]),
                       [ValueStateDescriptor("a.b", pa.int64()), ValueStateDescriptor(stem, pa.int64())], 8)


def test_a_state_name_holding_a_nul_shows_in_sql(tmp_path):
    """Regression (found by this fuzzing): a state named 'a\x00b' (Spark allows it) made
    ``catalog.sql.connect`` panic in Polars (a NUL in a column name); it is shown as 'a\\0b'."""
    layout = StateLayout.of(pa.schema([("user", pa.string())]), [ValueStateDescriptor("a\x00b", pa.int64())], 8)
    with IcebergStateTable.open(layout, warehouse=str(tmp_path / "wh"), table_name="t") as table:
        store = StateStore(table, config=ELSEWHERE)
        store.get_state("a\x00b").update_batch(USERS, [1, 2])
        store.checkpoint()
        rows = connect(table).execute('SELECT * FROM "state_a\\0b" ORDER BY 1').fetchall()
        assert [(r[0], r[1]) for r in rows] == [("a", 1), ("b", 2)]
