"""Table metadata is a file in the table's storage: a property there that makes pyiceberg
import and call code (a FileIO, an S3 retry strategy, a location provider) is refused, naming
it, and nothing it names is imported or called; locally and on S3."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from catalog import IcebergStateTable
from catalog.defaults import default_catalog
from catalog.fileio import METADATA_FILES, STATE_FILE_IO
from catalog.output_table import OutputTable
from statestore.errors import UntrustedMetadataError
from tests.catalog.catalog_helpers import commit_next
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


@pytest.mark.parametrize("name", ["py-io-impl", "write.py-location-provider.impl", "s3.retry-strategy-impl"])
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
