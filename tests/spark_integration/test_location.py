"""``StateLocation``: a query's state table, opened through its ``TableRef``."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pyarrow as pa
import pytest

from catalog import TableRef
from spark_integration.location import StateLocation
from statestore import StateLayout, ValueStateDescriptor

LAYOUT = StateLayout.of(pa.schema([("k", pa.int64())]), [ValueStateDescriptor("v", pa.int64())], 16)
SECRET = "not-a-real-secret-0b9d"


def test_a_location_opens_through_its_ref(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    location = StateLocation(table="op", warehouse="wh", max_parallelism=16, branch="main", retain_checkpoints=4)
    assert location.warehouse == str(tmp_path / "wh")  # absolute: executors run elsewhere
    assert location.ref == TableRef("op", warehouse=str(tmp_path / "wh"))
    assert location.identity == location.ref.identity and location.identifier == "state.op"
    with location.open(LAYOUT) as table:
        assert table.current_checkpoint() is None  # created on first use
    with location.ref.open() as table:
        assert table.layout.key_schema == LAYOUT.key_schema
    copy = pickle.loads(pickle.dumps(location))
    assert copy == location and copy.ref == location.ref


def test_a_location_prints_no_secret(tmp_path: Path, caplog):
    location = StateLocation(table="op", catalog_name="prod", catalog_properties={
        "uri": "http://rest:8181", "s3.secret-access-key": SECRET, "token": SECRET})
    logging.getLogger("test_location").warning("state in %s", location)
    for text in (repr(location), str(location), f"{location}", repr(location.ref), caplog.text):
        assert SECRET not in text
        assert "'s3.secret-access-key': '***'" in text and "http://rest:8181" in text
    assert location.catalog_properties["s3.secret-access-key"] == SECRET  # kept, only not shown


def test_a_location_needs_exactly_one_catalog(tmp_path: Path):
    with pytest.raises(ValueError, match="exactly one of warehouse="):
        StateLocation(table="op")
    with pytest.raises(ValueError, match="exactly one of warehouse="):
        StateLocation(table="op", warehouse=str(tmp_path), catalog_name="prod")
    with pytest.raises(ValueError, match="parallelism"):
        StateLocation(table="op", warehouse=str(tmp_path), max_parallelism=4, parallelism=5)
