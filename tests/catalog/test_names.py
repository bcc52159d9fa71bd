"""Names a user gives the store (issue 14, defect 2 and the newline names of defect 11): each
kind is checked whole, in one place (``statestore.names``), wherever it enters: a table opened
directly or through a TableRef / StateLocation, an output table, a fork, a savepoint, an
operator state. Nothing is created for a refused name."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from catalog import IcebergStateTable, TableRef
from catalog.defaults import default_catalog
from catalog.output_table import OutputTable
from spark_integration.location import StateLocation
from statestore.descriptors import column_stem
from statestore.names import (
    InvalidNameError,
    check_namespace,
    check_ref_name,
    check_state_name,
    check_table_name,
)
from statestore.operator_state import OperatorStateDescriptor
from tests.catalog.catalog_helpers import LAYOUT, commit_next

ESCAPING = ["../../x", "x/../victim", "a/b", "..", ".", "/abs", "x\\y", "x\n", "x\x00", "", " x", "x y", "x.y",
            "-x", "é", "a" * 129]


@pytest.mark.parametrize("name", ESCAPING)
def test_table_and_namespace_names_that_could_leave_their_directory_are_refused(name: str, tmp_path):
    with pytest.raises(InvalidNameError, match="table name"):
        check_table_name(name)
    with pytest.raises(InvalidNameError, match="namespace name"):
        check_namespace(name)
    warehouse = str(tmp_path / "wh")
    with pytest.raises(InvalidNameError):
        IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=name)
    with pytest.raises(InvalidNameError):
        IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="ok", namespace=name)
    with pytest.raises(InvalidNameError):
        TableRef(name, warehouse=warehouse)
    with pytest.raises(InvalidNameError):
        StateLocation(table=name, warehouse=warehouse)
    # Nothing was written for any of them: at most the empty catalog of the warehouse.
    assert set(os.listdir(tmp_path)) <= {"wh"} and set(os.listdir(warehouse) if os.path.isdir(warehouse) else []) \
        <= {"catalog.db"}


def test_names_that_fit_are_kept_as_given():
    for name in ("user_sessions", "UserSessions2", "_tmp", "a-b", "x" * 128):
        assert check_table_name(name) == name and check_namespace(name) == name
    assert check_ref_name("before-v2.1", "savepoint") == "before-v2.1"
    with pytest.raises(TypeError, match="must be a string"):
        check_table_name(7)


@pytest.mark.parametrize("name", ["v2\n", "v2/..", "../v2", ".hidden", "main", "a" * 101, "", "v 2"])
def test_fork_and_savepoint_names_are_checked_whole(open_table, name: str):
    table = open_table()
    commit_next(table)
    with pytest.raises(InvalidNameError):
        table.fork(name)
    with pytest.raises(InvalidNameError):
        table.savepoint(name)
    assert table.forks() == {} and table.savepoints() == {}


def test_output_table_names(tmp_path):
    schema = pa.schema([("k", pa.string())])
    for identifier in ("plain", "a.b.c", "../x.y", "x.y/../../z", "x.", ".y"):
        with pytest.raises(InvalidNameError):
            OutputTable.open(default_catalog(str(tmp_path / "wh")), identifier, schema)
    OutputTable.open(default_catalog(str(tmp_path / "wh")), "results.sessions", schema).close()


def test_operator_and_keyed_state_names():
    with pytest.raises(InvalidNameError, match="operator state name"):
        OperatorStateDescriptor("offsets\n", pa.int64())
    assert OperatorStateDescriptor("offsets", pa.int64()).name == "offsets"
    # Keyed state: Spark's rules, and a name with a newline never becomes a column as is.
    for bad in ("", " padded", "default", "$internal"):
        with pytest.raises(InvalidNameError, match="state name"):
            check_state_name(bad)
    assert check_state_name("my state.v2") == "my state.v2"
    assert column_stem("count") == "count" and column_stem("count\n") != "count\n"
    assert "\n" not in column_stem("count\n")
