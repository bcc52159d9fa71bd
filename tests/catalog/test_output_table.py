"""The output table of a stateful query (issue 14, defect 5): each batch's rows exactly once,
also when two drivers (or a zombie resumed between its check and its append) commit the same
batch: the check and the append are one commit validated against the head the check read."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.table import TableProperties

from catalog.defaults import default_catalog
from catalog.output_table import OutputTable
from catalog.recovery import TableLocationInUseError

SCHEMA = pa.schema([("k", pa.string()), ("n", pa.int64())])


def rows_file(table: OutputTable, name: str, keys: list[str]) -> str:
    path = os.path.join(table.data_location.removeprefix("file://"), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({"k": keys, "n": list(range(len(keys)))}, schema=SCHEMA), path)
    return f"file://{path}"


def batches(table: OutputTable) -> list[int]:
    table.committed_batch()  # reload
    return sorted(int(s.summary.additional_properties["icestate.batch-id"]) for s in table.table.snapshots()
                  if s.summary and "icestate.batch-id" in s.summary.additional_properties)


def test_two_drivers_commit_a_batch_once(tmp_path):
    warehouse = str(tmp_path / "wh")
    mine = OutputTable.open(default_catalog(warehouse), "out.results", SCHEMA)
    theirs = OutputTable.open(default_catalog(warehouse), "out.results", SCHEMA)
    assert mine.table.properties[TableProperties.COMMIT_NUM_RETRIES] == "0"
    assert mine.commit(6, [rows_file(mine, "b6.parquet", ["a"])], query_id="q")

    # theirs checks (batch 6 is the newest), then mine commits batch 7, then theirs appends.
    check = theirs.committed_batch
    raced = []

    def check_then_lose_the_race():
        seen = check()
        if not raced:
            raced.append(mine.commit(7, [rows_file(mine, "b7-mine.parquet", ["x", "y"])], query_id="q"))
        return seen

    theirs.committed_batch = check_then_lose_the_race
    assert theirs.commit(7, [rows_file(theirs, "b7-theirs.parquet", ["x", "y"])], query_id="q") is False
    assert raced == [True]
    assert batches(mine) == [6, 7]
    assert mine.table.scan().to_arrow().num_rows == 3  # batch 6's row and batch 7's two, once
    # Batch 8 after the race: theirs commits it normally.
    theirs.committed_batch = check
    assert theirs.commit(8, [rows_file(theirs, "b8.parquet", ["z"])], query_id="q")
    assert batches(theirs) == [6, 7, 8]
    mine.close()
    theirs.close()


def test_an_output_table_is_not_created_over_one_whose_catalog_entry_was_lost(tmp_path):
    """As defect 1 for state tables: a lost catalog entry must not let a new, empty output table
    shadow the old one's rows and committed batches (the stream would then commit them again)."""
    warehouse = str(tmp_path / "wh")
    catalog = default_catalog(warehouse)
    table = OutputTable.open(catalog, "out.results", SCHEMA)
    assert table.commit(0, [rows_file(table, "b0.parquet", ["a"])], query_id="q")
    metadata = table.table.metadata_location
    table.close()
    catalog = default_catalog(warehouse)
    catalog.drop_table("out.results")  # the entry is lost; the files stay
    with pytest.raises(TableLocationInUseError, match=r"output table out\.results is not in the catalog") as raised:
        OutputTable.open(catalog, "out.results", SCHEMA)
    assert "register_table" in str(raised.value)
    catalog.register_table("out.results", metadata)  # the documented remedy
    again = OutputTable.open(catalog, "out.results", SCHEMA)
    assert again.committed_batch() == (0, "q") and again.table.scan().to_arrow().num_rows == 1
    again.close()
