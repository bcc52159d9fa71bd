"""Table metadata is a file in the table's storage: a property there that makes pyiceberg
import and call code (a FileIO, an S3 retry strategy, a location provider) is refused, naming
it, and nothing it names is imported or called; locally and on S3."""

from __future__ import annotations

import dataclasses
import json
import os

import pyarrow as pa
import pytest

from catalog import IcebergStateTable
from catalog.compaction import compact
from catalog.defaults import default_catalog
from catalog.fileio import METADATA_FILES, STATE_FILE_IO
from catalog.output_table import OutputTable
from statestore.errors import UntrustedMetadataError
from tests.catalog.catalog_helpers import commit_next, write_segment
from tests.hostile import MARKER_ENV

HOSTILE = "tests.hostile.MarkOnCall"


def set_metadata_properties(table: IcebergStateTable | OutputTable, **properties: str) -> None:
    """Rewrite the table's current metadata.json in its storage with ``properties`` added, as
    anyone with write access to the storage can."""
    iceberg = table.table if isinstance(table, OutputTable) else table._table
    location = iceberg.metadata_location
    with iceberg.io.new_input(location).open() as f:
        metadata = json.loads(f.read())
    metadata["properties"].update(properties)
    with iceberg.io.new_output(location).create(overwrite=True) as f:
        f.write(json.dumps(metadata).encode())
    METADATA_FILES.clear()  # as a fresh process


@pytest.mark.parametrize("name", ["py-io-impl", "write.py-location-provider.impl", "s3.retry-strategy-impl",
                                  "write.metadata.path"])
def test_a_code_loading_property_in_table_metadata_is_refused(place, tmp_path, monkeypatch, name):
    marker = tmp_path / "called"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    table = place.open()
    commit_next(table)
    set_metadata_properties(table, **{name: HOSTILE})
    table.close()
    with pytest.raises(UntrustedMetadataError, match=f"sets {name}='{HOSTILE}'.*restore its metadata"):
        place.ref("op").open()
    assert not marker.exists()


def test_the_catalogs_own_file_io_named_in_table_metadata_opens(place):
    table = place.open()
    commit_next(table)
    configured = table._table.io.properties.get("py-io-impl", STATE_FILE_IO)
    set_metadata_properties(table, **{"py-io-impl": configured})
    table.close()
    again = place.ref("op").open()
    try:
        assert again.current_checkpoint() is not None
    finally:
        again.close()


def test_an_output_table_whose_metadata_names_a_location_provider_is_refused(tmp_path, monkeypatch):
    """pyiceberg's writes build the location provider a table property names: an output table
    (which receives a query's rows) is refused before anything is written."""
    marker = tmp_path / "called"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    warehouse = str(tmp_path / "wh")
    schema = pa.schema([("k", pa.string()), ("n", pa.int64())])
    out = OutputTable.open(default_catalog(warehouse), "out.results", schema)
    set_metadata_properties(out, **{"write.py-location-provider.impl": HOSTILE})
    out.close()
    with pytest.raises(UntrustedMetadataError, match=r"write\.py-location-provider\.impl"):
        OutputTable.open(default_catalog(warehouse), "out.results", schema)
    assert not marker.exists()


def victim_file(tmp_path, name: str) -> str:
    path = tmp_path / "elsewhere" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"a file of the user's, outside the table")
    return str(path)


def test_a_metadata_log_naming_files_outside_the_table_deletes_none_of_them(open_table, tmp_path, caplog):
    """pyiceberg deletes the metadata files that fall out of a table's metadata log after each
    commit; a log rewritten to name other files of the host gets none of them deleted."""
    victim = victim_file(tmp_path, "metadata/00000-0000.metadata.json")
    table = open_table()
    commit_next(table)
    iceberg = table._table
    with iceberg.io.new_input(iceberg.metadata_location).open() as f:
        metadata = json.loads(f.read())
    metadata["metadata-log"].insert(0, {"metadata-file": f"file://{victim}", "timestamp-ms": 1})
    with iceberg.io.new_output(iceberg.metadata_location).create(overwrite=True) as f:
        f.write(json.dumps(metadata).encode())
    METADATA_FILES.clear()
    table.close()
    reopened = open_table()
    for _ in range(6):  # the log keeps 4 previous versions: the planted entry falls out
        commit_next(reopened)
    reopened.close()
    with open(victim, "rb") as f:
        assert f.read() == b"a file of the user's, outside the table"
    assert f"not deleting file://{victim}: it is outside the table's directory" in caplog.text


def test_manifests_naming_files_outside_the_table_get_none_of_them_deleted(open_table, tmp_path, caplog):
    """Retention deletes the files of expired checkpoints that its manifests name; a checkpoint
    naming a file outside the table's directory gets it dropped from the table, never deleted."""
    table = open_table(retain_checkpoints=1)
    cp = table.next_checkpoint_id()
    inside = write_segment(table, cp, 0, [0, 3, 7])
    victim = victim_file(tmp_path, inside.path.rsplit("/", 1)[-1])
    os.replace(inside.path.removeprefix("file://"), victim)
    table.commit_checkpoint(cp, [dataclasses.replace(inside, path=f"file://{victim}")], parallelism=1,
                            batch_id=cp * 10)
    commit_next(table)
    assert compact(open_table(retain_checkpoints=1)) is not None  # the file is merged away
    for _ in range(3):
        commit_next(table)
    table.collect_garbage()
    assert os.path.exists(victim)
    assert f"not deleting file://{victim}: it is outside the directory of state table" in caplog.text
