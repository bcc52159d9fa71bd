"""A damaged catalog database is an error naming the file and what to do, at every door.

The embedded catalog keeps a state table's one mutable fact, the location of its current
metadata.json, in the SQLite file ``<warehouse>/catalog.db`` (a named SQL catalog may use any
SQLite file too). SQLAlchemy reported a damaged one as ``DatabaseError: file is not a
database``, naming neither the file nor a remedy. Here real catalog files are truncated,
flipped, overwritten, emptied, made a directory, made unreadable and locked by another process,
and each way of opening a state table (a writer's ``open``, ``open_existing``, a ``TableRef``
on a named catalog, the ``icestate`` commands, an already open table's next commit) must raise
``CatalogDamagedError`` (restore the file, or register the tables again: the remedy is
followed to the end here) or ``CatalogUnavailableError`` (locked, a directory, no permission),
naming the file and never a secret property.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sqlite3
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog import IcebergStateTable, TableRef
from catalog.fileio import METADATA_FILES
from catalog.recovery import CatalogEntryLostError, recover
from statestore.errors import CatalogDamagedError, CatalogUnavailableError, CorruptMetadataError, StateStoreError
from statestore.keygroups import KeyGroupRange
from tests.catalog.catalog_helpers import LAYOUT, MAX_PARALLELISM, commit_next
from tests.catalog.test_cli import ROOT, invoke
from tests.fuzzing import fuzz_settings

SECRET = "s3cr3t-value-never-shown"
ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)


def committed(warehouse: str) -> str:
    """A state table ``op`` with two checkpoints in ``warehouse``; the path of its catalog.db."""
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op") as table:
        commit_next(table)
        commit_next(table)
    return os.path.join(warehouse, "catalog.db")


def state_of(table: IcebergStateTable) -> tuple:
    return ([c.checkpoint_id for c in table.list_checkpoints()],
            sorted((s.checkpoint_id, s.key_group_min, s.key_group_max, s.record_count) for s in table.segments(ALL)))


def flip_header(path: str) -> None:
    with open(path, "r+b") as f:
        head = f.read(16)  # "SQLite format 3\0"
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in head))


def overwrite_with_junk(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(random.Random(7).randbytes(size))


def make_directory(path: str) -> None:
    os.remove(path)
    os.mkdir(path)


DAMAGES = {
    "truncated": lambda path: os.truncate(path, 100),
    "header flipped": flip_header,
    "overwritten with junk": overwrite_with_junk,
    "a directory": make_directory,
}


def named_catalog(warehouse: str, uri_suffix: str = "") -> TableRef:
    """The embedded catalog's file named as any pyiceberg SQL catalog, with a secret property."""
    return TableRef("op", catalog_name="statestore", catalog_properties={
        "type": "sql", "uri": f"sqlite:///{warehouse}/catalog.db{uri_suffix}", "warehouse": f"file://{warehouse}",
        "s3.secret-access-key": SECRET})


OPENERS = {
    "a writer's open": lambda w: IcebergStateTable.open(LAYOUT, warehouse=w, table_name="op"),
    "open_existing": lambda w: TableRef("op", warehouse=w).open(),
    "a named SQL catalog": lambda w: named_catalog(w).open(),
}


@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_catalog_database_is_named_with_what_to_do(warehouse: str, damage: str, opener: str):
    database = committed(warehouse)
    DAMAGES[damage](database)
    with pytest.raises(CatalogUnavailableError) as raised:
        OPENERS[opener](warehouse).close()
    message = str(raised.value)
    assert f"the catalog database {database} " in message and SECRET not in message, message
    if damage == "a directory":
        assert not isinstance(raised.value, CatalogDamagedError) and "is a directory" in message, message
        return
    assert isinstance(raised.value, CatalogDamagedError), message
    assert "Restore it from a backup, or move it aside" in message
    if opener != "a named SQL catalog":
        assert f"`icestate recover --table NAME --warehouse {warehouse}`" in message and "state.op" in message


def test_the_remedy_of_a_damaged_catalog_database_brings_the_table_back(warehouse: str):
    database = committed(warehouse)
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op") as table:
        before = state_of(table)
    overwrite_with_junk(database)
    result = invoke("recover", "--warehouse", warehouse, "--table", "op")
    assert result.exit_code == 1 and "is damaged" in result.output  # the damaged file first
    os.rename(database, database + ".damaged")  # "move it aside"
    result = invoke("recover", "--warehouse", warehouse, "--table", "op")
    assert result.exit_code == 0, result.output
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op") as table:
        assert state_of(table) == before
        assert commit_next(table) == 3


def test_a_catalog_database_damaged_under_an_open_table_is_named_at_its_next_commit(warehouse: str):
    """The catalog is opened whole and fine; the file is damaged while the writer runs."""
    database = committed(warehouse)
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op") as table:
        overwrite_with_junk(database)
        with pytest.raises(CatalogDamagedError, match=f"the catalog database {database} is damaged"):
            commit_next(table)


@pytest.mark.parametrize("command", [["checkpoints"], ["refs"], ["compact"], ["recover"]])
def test_every_command_names_a_damaged_catalog_database_in_one_line(warehouse: str, command: list[str]):
    database = committed(warehouse)
    flip_header(database)
    result = invoke(*command, "--warehouse", warehouse, "--table", "op")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: the catalog database {database} is damaged"), lines[0]


def test_an_emptied_catalog_database_says_the_entry_was_lost_and_recover_brings_it_back(warehouse: str):
    """An empty file is an empty SQLite database: the table is not in it, its files are. Opening
    the existing table said "there is no state table state.op ... check the names"."""
    database = committed(warehouse)
    os.truncate(database, 0)
    with pytest.raises(CatalogEntryLostError, match=f"({database}).*icestate recover --table op"):
        TableRef("op", warehouse=warehouse).open()
    with contextlib.closing(TableRef("op", warehouse=warehouse).catalog()) as catalog:
        recover(catalog, ("state", "op"))
    with TableRef("op", warehouse=warehouse).open() as table:
        assert state_of(table)[0] == [1, 2]


def test_an_entry_naming_a_missing_metadata_file_is_replaced_by_recover(warehouse: str):
    """A catalog entry whose metadata location no longer names a file (a damaged row, or the
    file deleted): opening says so and sends to ``icestate recover``, which refused ("in the
    catalog: nothing to recover"); it now replaces such an entry."""
    database = committed(warehouse)
    with contextlib.closing(sqlite3.connect(database)) as db, db:
        db.execute("UPDATE iceberg_tables SET metadata_location = metadata_location || '.gone'")
    METADATA_FILES.clear()
    with pytest.raises(CorruptMetadataError, match="icestate recover --table op"):
        TableRef("op", warehouse=warehouse).open()
    result = invoke("recover", "--warehouse", warehouse, "--table", "op")
    assert result.exit_code == 0, result.output
    with TableRef("op", warehouse=warehouse).open() as table:
        assert state_of(table)[0] == [1, 2]


def test_a_catalog_database_locked_by_another_process_is_named(warehouse: str):
    """Another process holds an exclusive transaction; SQLite waits for it (``timeout`` in the
    URI, here short), then the catalog is unavailable: named, nothing changed, and usable once
    the other process lets go."""
    database = committed(warehouse)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
         "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); sys.stdin.read()", database],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CatalogUnavailableError) as raised:
            named_catalog(warehouse, "?timeout=0.2").open()
        message = str(raised.value)
        assert f"the catalog database {database} is locked by another process" in message and SECRET not in message
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    named_catalog(warehouse, "?timeout=0.2").open().close()


def test_an_unreadable_catalog_database_is_named(warehouse: str):
    """Mode 000: the opening process may neither read nor write it (as root, the process runs
    without the capabilities that override file permissions)."""
    database = committed(warehouse)
    os.chmod(database, 0)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file permissions cannot be taken from this process")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    script = ("import sys\nfrom catalog import TableRef\ntry:\n    TableRef('op', warehouse=sys.argv[1]).open()\n"
              "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([*prefix, sys.executable, "-c", script, warehouse], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.stdout.startswith("CatalogUnavailableError "), (out.stdout, out.stderr)
    assert f"the catalog database {database} cannot be read and written by this user" in out.stdout, out.stdout


@fuzz_settings(10)
@given(mode=st.sampled_from(["truncate", "flip", "overwrite"]), offset=st.integers(0, 1 << 15),
       data=st.binary(min_size=1, max_size=16))
def test_any_damage_of_the_catalog_database_reads_the_table_as_it_was_or_is_named(
        tmp_path_factory: pytest.TempPathFactory, mode: str, offset: int, data: bytes):
    """Property: with catalog.db truncated, flipped or overwritten anywhere, opening the table
    (a writer's open and open_existing) gives its checkpoints and segments as they were, or one
    of our errors; an error about the catalog's file names it."""
    warehouse = str(tmp_path_factory.mktemp("catalog-damage") / "wh")
    database = committed(warehouse)
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op") as table:
        before = state_of(table)
    size = os.path.getsize(database)
    offset %= size
    if mode == "truncate":
        os.truncate(database, offset)
    else:
        with open(database, "r+b") as f:
            f.seek(offset)
            old = f.read(len(data))
            f.seek(offset)
            f.write(bytes(b ^ 0xFF for b in old) if mode == "flip" else data[:len(old)])
    METADATA_FILES.clear()
    for opener in (OPENERS["open_existing"], OPENERS["a writer's open"]):
        try:
            with opener(warehouse) as table:
                assert state_of(table) == before, f"{mode} at {offset} of {size}: the table reads otherwise"
        except CatalogUnavailableError as e:
            assert f"the catalog database {database} " in str(e), e
        except StateStoreError:
            pass  # the entry lost (an emptied database), or the metadata file it names unreadable
    shutil.rmtree(os.path.dirname(database))


def test_a_catalog_database_in_a_missing_directory_is_named(tmp_path):
    """SQLite cannot make a file in a directory that does not exist: "unable to open database file"."""
    database = tmp_path / "gone" / "catalog.db"
    ref = TableRef("op", catalog_name="statestore", catalog_properties={
        "type": "sql", "uri": f"sqlite:///{database}", "warehouse": f"file://{tmp_path}/wh"})
    with pytest.raises(CatalogUnavailableError, match=f"the catalog database {database} cannot be made: its "
                                                      "directory does not exist"):
        ref.open(LAYOUT)


def test_a_catalog_row_whose_text_is_not_utf8_is_named(warehouse: str):
    """A flipped byte in the text of the table's row (found by the property above) raised
    UnicodeDecodeError, or sqlite3's "Could not decode to UTF-8 column", from SQLAlchemy's fetch."""
    database = committed(warehouse)
    with open(database, "rb") as f:
        data = bytearray(f.read())
    data[data.rindex(b".metadata.json") - 3] = 0xFF  # inside the row's metadata location
    with open(database, "wb") as f:
        f.write(data)
    for opener in OPENERS.values():
        with pytest.raises(CatalogDamagedError, match=f"the catalog database {database} is damaged "
                                                      r"\((UnicodeDecodeError|OperationalError: Could not decode)"):
            opener(warehouse).close()


def test_a_table_filed_under_another_catalog_name_says_which(warehouse: str):
    """A SQL catalog files its tables under its name: opened under another name, the table is
    not there while its files are. That is a wrong name, not a lost entry (``icestate recover``
    would register the table a second time)."""
    committed(warehouse)
    ref = TableRef("op", catalog_name="another", catalog_properties={
        "type": "sql", "uri": f"sqlite:///{warehouse}/catalog.db", "warehouse": f"file://{warehouse}"})
    with pytest.raises(CatalogEntryLostError, match=r"not filed under catalog name 'another'.* but under "
                                                    r"'statestore'.*open it with that catalog name") as raised:
        ref.open()
    assert "icestate recover" not in str(raised.value)


def test_a_catalog_database_whose_index_is_damaged_is_named(warehouse: str):
    """The row of the table is intact and its index entry is not: the lookup finds nothing (found
    by the property above, which took it for a wrong catalog name). SQLite's integrity check,
    run on the way to that error, tells."""
    database = committed(warehouse)
    with contextlib.closing(sqlite3.connect(database)) as db:
        index = db.execute("SELECT rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name = 'iceberg_tables'"
                           ).fetchone()[0]
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
    with open(database, "r+b") as f:  # the name of the table in the index's page only
        f.seek((index - 1) * page_size)
        page = bytearray(f.read(page_size))
        at = page.rindex(b"op")
        page[at:at + 2] = b"oq"
        f.seek((index - 1) * page_size)
        f.write(page)
    with pytest.raises(CatalogDamagedError, match=f"the catalog database {database} is damaged .*integrity check"):
        TableRef("op", warehouse=warehouse).open()


def test_a_catalog_database_damaged_in_the_name_of_the_table_is_named(warehouse: str):
    """The table's name in its row no longer UTF-8: the lookup finds nothing, and the look at
    the location for a lost entry, which queries the catalog again, turned the catalog's error
    into a "no such table" (found by the property above)."""
    database = committed(warehouse)
    with contextlib.closing(sqlite3.connect(database)) as db, db:  # "op" as the bytes 6f ff
        db.execute("UPDATE iceberg_tables SET table_name = CAST(X'6FFF' AS TEXT)")
    with pytest.raises(CatalogDamagedError, match=f"the catalog database {database} is damaged"):
        TableRef("op", warehouse=warehouse).open()
