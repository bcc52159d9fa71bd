"""A state table whose catalog entry is lost (issue 14, defect 1): opening refuses to create a
new table over its files, `icestate recover` registers it again at its newest metadata, and
the orphan sweep deletes nothing while another table's metadata shares the location. On local
disk and on S3 (moto's server on loopback)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
from pyiceberg.exceptions import NoSuchTableError

from catalog.defaults import default_catalog
from catalog.iceberg_table import IcebergStateTable
from catalog.recovery import RecoveryError, TableLocationInUseError, recover
from statestore.keygroups import KeyGroupRange
from tests.catalog.catalog_helpers import MAX_PARALLELISM, commit_next, file_exists, write_segment
from tests.catalog.conftest import Place
from tests.catalog.test_cli import invoke

ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)


def lose_catalog(place: Place, how: str) -> None:
    path = os.path.join(place.directory, "catalog.db")
    if how == "deleted":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(0)


def committed_state(table: IcebergStateTable) -> tuple[list[int], list[tuple]]:
    return ([c.checkpoint_id for c in table.list_checkpoints()],
            sorted((s.checkpoint_id, s.key_group_min, s.key_group_max, s.record_count) for s in table.segments(ALL)))


@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_a_lost_catalog_entry_is_never_shadowed_and_is_recovered(place: Place, how: str):
    table = place.open()
    commit_next(table, [[1], [9]])
    commit_next(table, [[2]])
    before = committed_state(table)
    table.close()
    lose_catalog(place, how)

    with pytest.raises(TableLocationInUseError, match="icestate recover --table op"):
        place.open()
    with contextlib.closing(place.ref().catalog()) as catalog:
        with pytest.raises(NoSuchTableError):
            catalog.load_table(("state", "op"))  # the refusal created nothing
        recovered = recover(catalog, ("state", "op"))
        assert recovered.properties["icestate.last-checkpoint-id"] == "2"
        with pytest.raises(RecoveryError, match="nothing to recover"):
            recover(catalog, ("state", "op"))

    table = place.open()  # as a writer would: the state of before, and it goes on
    assert committed_state(table) == before
    assert commit_next(table, [[3]]) == 3
    table.restore(1)


def test_recover_from_the_command_line(place: Place):
    table = place.open()
    commit_next(table, [[1]])
    table.close()
    lose_catalog(place, "deleted")
    result = invoke("recover", *place.cli_args(), "--table", "op")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # the console wraps a long metadata path's line
    assert "registered again" in said and "newest checkpoint 1" in said
    again = invoke("recover", *place.cli_args(), "--table", "op")
    assert again.exit_code == 1 and "nothing to recover" in " ".join(again.output.split())
    assert "Traceback" not in again.output


def test_recover_refuses_what_it_cannot_register(open_table, warehouse: str):
    table = open_table()
    commit_next(table, [[1]])
    location = table.location.removeprefix("file://")
    table.close()
    os.remove(os.path.join(warehouse, "catalog.db"))
    with contextlib.closing(default_catalog(warehouse)) as catalog:
        with pytest.raises(RecoveryError, match="no Iceberg metadata under"):
            recover(catalog, ("state", "missing"))
        metadata_dir = os.path.join(location, "metadata")
        newest = max(n for n in os.listdir(metadata_dir) if n.endswith(".metadata.json"))
        twin = os.path.join(metadata_dir, newest.split("-")[0] + "-twin.metadata.json")
        shutil.copy(os.path.join(metadata_dir, newest), twin)
        with pytest.raises(RecoveryError, match="share the newest version"):
            recover(catalog, ("state", "op"))
        os.remove(twin)
        with open(os.path.join(metadata_dir, newest)) as f:
            document = json.load(f)
        document["properties"] = {}  # a newer version of a plain Iceberg table
        with open(os.path.join(metadata_dir, "00077-plain.metadata.json"), "w") as f:
            json.dump(document, f)
        with pytest.raises(RecoveryError, match="not a state table"):
            recover(catalog, ("state", "op"))


def test_the_sweep_deletes_nothing_beside_another_tables_metadata(open_table):
    table = open_table()
    commit_next(table)
    cp = commit_next(table)
    metadata_dir = os.path.dirname(table.iceberg_table.metadata_location.removeprefix("file://"))
    with open(table.iceberg_table.metadata_location.removeprefix("file://")) as f:
        document = json.load(f)
    document["table-uuid"] = "00000000-0000-4000-8000-000000000001"  # another table's
    foreign = os.path.join(metadata_dir, "00099-4a1b2c3d-other.metadata.json")
    with open(foreign, "w") as f:
        json.dump(document, f)
    leftover = write_segment(table, cp, 5, [4])  # what the sweep would take otherwise
    table.collect_garbage()
    assert file_exists(leftover.path) and file_exists(foreign)
    os.remove(foreign)
    table.collect_garbage()
    assert not file_exists(leftover.path)
