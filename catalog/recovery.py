"""A state table whose catalog entry is lost: refuse to shadow it, and register it again.

The catalog holds one thing of a table: the location of its current metadata.json. If that
entry goes (the embedded catalog's ``catalog.db`` deleted or truncated, a catalog restored
from an old backup, a table dropped without purge), every file of the table is still in its
location. Creating a table of the same name would put a new, empty table over them: its
checkpoints would start again at 1, and its orphan sweep would take the old table's files as
leftovers of its own. So:

* creating a table refuses a location that holds Iceberg metadata (``check_location_free``);
* ``recover`` registers the location's newest metadata.json in the catalog again (``icestate
  recover``), after checking that it parses, is a state table, and is the newest version;
* the orphan sweep (``catalog.gc``) deletes nothing while the metadata directory holds a
  metadata.json of another table (``foreign_metadata``).

Every lookup lists one directory (``<location>/metadata``); ``recover`` reads one or two
metadata.json files. None of this runs on the checkpoint path.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from dataclasses import dataclass

import pyarrow.fs as pafs
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError, ValidationError
from pyiceberg.io import FileIO, load_file_io
from pyiceberg.schema import Schema
from pyiceberg.table import Table

from catalog.manifests import DECODE_ERRORS
from catalog.naming import METADATA_DIR, Locations, metadata_json_version
from statestore import stored_keys
from statestore.errors import CorruptMetadataError, StateStoreError

logger = logging.getLogger(__name__)


class TableLocationInUseError(StateStoreError):
    """A table was to be created where another table's metadata already is."""


class RecoveryError(StateStoreError):
    """``recover`` found nothing it could register."""


class CatalogEntryLostError(StateStoreError, ValueError):
    """An existing state table was asked for, and the catalog has no entry for it while its
    location holds its metadata: the catalog lost the entry (``recover`` registers it again)."""


@dataclass(frozen=True)
class MetadataFile:
    uri: str
    version: int


def metadata_files(location: str, io: FileIO | None) -> list[MetadataFile]:
    """The ``<version>-<uuid>.metadata.json`` files of ``location``, newest version first."""
    where = Locations.of(location, io)
    selector = pafs.FileSelector(where.to_path(f"{location.rstrip('/')}/{METADATA_DIR}"), allow_not_found=True)
    found = [MetadataFile(where.to_uri(i.path), metadata_json_version(i.path))
             for i in where.filesystem.get_file_info(selector) if i.type == pafs.FileType.File]
    return sorted((f for f in found if f.version >= 0), key=lambda f: (-f.version, f.uri))


def check_location_free(identifier: tuple[str, ...], location: str, io: FileIO | None, *,
                        state_table: bool = True) -> None:
    """Raise ``TableLocationInUseError`` when ``location`` holds a table's metadata (of a state
    table, or with ``state_table=False`` of a query's output table)."""
    found = metadata_files(location, io)
    if found:
        name = ".".join(identifier)
        newest = found[0].uri.rsplit("/", 1)[-1]
        kind, loses, remedy = ("state table", "its state", f"`icestate recover --table {identifier[-1]}` (and the "
                               "same --warehouse/--catalog options)") if state_table else (
            "output table", "its rows and committed batches",
            f"the catalog's register_table({name!r}, <its newest metadata.json>)")
        raise TableLocationInUseError(
            f"{kind} {name} is not in the catalog, but its location {location} holds the metadata of a table "
            f"({len(found)} metadata.json files, the newest {newest}): the catalog lost its entry, and a new table "
            f"there would shadow {loses}. Register it again with {remedy}, or use another table name"
        )


def lost_entry_error(catalog: Catalog, identifier: tuple[str, str]) -> StateStoreError | None:
    """For a table ``catalog`` does not have: the error to raise when its default location
    holds a table's metadata, else None. ``CatalogDamagedError`` when the catalog's SQLite file
    fails its integrity check (a damaged index finds no row), ``CatalogEntryLostError`` naming
    the catalog names that file holds the table under, if any (a SQL catalog files tables
    under its name), else saying the entry was lost (a catalog file emptied, replaced or
    restored from an old backup, a table dropped without purge)."""
    from catalog.table_ref import sqlite_file, sqlite_problem

    try:
        try:
            location = default_location(catalog, identifier)
        except NoSuchNamespaceError:  # a lost catalog lost its namespaces too: pyiceberg's default then
            location = f"{catalog.properties['warehouse'].rstrip('/')}/{identifier[0]}/{identifier[1]}"
        found = metadata_files(location, load_file_io(catalog.properties, location))
    except StateStoreError as e:  # the catalog's database damaged, say
        return e
    except Exception:  # no location to look at: the caller's "no such table" stands
        return None
    if not found:
        return None
    name = ".".join(identifier)
    database = sqlite_file(catalog.properties.get("uri"))
    in_database = f" ({database})" if database else ""
    problems, others = _ask_database(catalog, identifier)
    if database is not None and problems:
        directory = os.path.dirname(database)
        embedded = catalog.properties.get("warehouse") == f"file://{directory}"
        return sqlite_problem(database, sqlite3.DatabaseError(f"integrity check: {'; '.join(problems)}"),
                              directory if embedded else None)
    if others:
        return CatalogEntryLostError(
            f"state table {name} is not filed under catalog name {catalog.name!r}{in_database} but under "
            f"{', '.join(map(repr, others))}, and its location {location} holds its metadata: open it with that "
            "catalog name (a SQL catalog files its tables under its name), or, if that name is damaged, restore the "
            "catalog from a backup")
    return CatalogEntryLostError(
        f"state table {name} is not in catalog {catalog.name}{in_database}, but its location {location} holds its "
        f"metadata ({len(found)} metadata.json files, the newest {found[0].uri.rsplit('/', 1)[-1]}): the catalog "
        "lost its entry (its file emptied, replaced or restored from an old backup, or the table dropped without "
        f"purge). Register it again with `icestate recover --table {identifier[-1]}` (and the same "
        "--warehouse/--catalog options), or restore the catalog from a backup")


# Problems of a SQLite integrity check shown in an error, at most.
INTEGRITY_PROBLEMS_SHOWN = 3


def _ask_database(catalog: Catalog, identifier: tuple[str, str]) -> tuple[list[str], list[str]]:
    """Of a SQL catalog's database: what a SQLite one's integrity check finds wrong, and the
    catalog names it holds ``identifier`` under (nothing when it cannot tell)."""
    engine = getattr(catalog, "engine", None)
    if engine is None:
        return [], []
    from sqlalchemy import text

    problems: list[str] = []
    try:
        with engine.connect() as connection:
            if engine.dialect.name == "sqlite":
                # Only here, on the way to an error: it reads the whole (small) file.
                problems = [r[0] for r in connection.execute(text("PRAGMA integrity_check")).fetchall()
                            if r[0] != "ok"][:INTEGRITY_PROBLEMS_SHOWN]
            names = connection.execute(text(
                "SELECT DISTINCT catalog_name FROM iceberg_tables WHERE table_namespace = :namespace AND "
                "table_name = :name AND catalog_name != :catalog"),
                {"namespace": identifier[0], "name": identifier[1], "catalog": catalog.name}).scalars().all()
        return problems, sorted(names)
    except Exception as e:  # a database failing its queries is damaged; another cannot tell
        return ([f"{type(e).__name__}: {e}"] if engine.dialect.name == "sqlite" else []), []


def load_table(catalog: Catalog, identifier: tuple[str, str]) -> Table:
    """``catalog.load_table``, with a damaged current metadata.json reported as
    ``CorruptMetadataError`` naming the file (the newest one in the table's default location,
    which is the current one unless the catalog put the table elsewhere) and what to do."""
    try:
        table = catalog.load_table(identifier)
    except StateStoreError:  # the catalog's own (its database damaged: a ValueError too)
        raise
    except (*DECODE_ERRORS, ValidationError, FileNotFoundError) as e:  # ValidationError: JSON of the wrong shape
        name = ".".join(identifier)
        try:
            found = metadata_files(default_location(catalog, identifier), load_file_io(catalog.properties))
            where = found[0].uri if found else "(none found in its default location)"
        except Exception:  # the damage is the news; where it is, a best guess
            where = "(its location could not be listed)"
        raise CorruptMetadataError(
            f"the current metadata file of state table {name} cannot be read ({type(e).__name__}: {e}); newest "
            f"metadata file: {where}. Move the damaged file aside and run `icestate recover --table {identifier[-1]}` "
            "to register the newest readable version, or restore the file from a backup") from e
    check_current_version(table)
    return table


def check_current_version(table: Table) -> None:
    """Raise ``CorruptMetadataError`` unless the metadata.json ``table`` was loaded from holds
    the version its name says: its metadata log ends at the version before it (each commit
    writes version n + 1 and logs version n). Another version copied over the current file,
    which would open the table silently at older checkpoints, does not."""
    location = table.metadata_location
    version = metadata_json_version(location)
    logged = [metadata_json_version(e.metadata_file) for e in table.metadata.metadata_log]
    keeps_log = int(table.metadata.properties.get("write.metadata.previous-versions-max", "100")) > 0
    expected = version - 1 if keeps_log and version > 0 else None
    if version < 0 or (not logged and expected is None) or (logged and logged[-1] == version - 1):
        return
    raise CorruptMetadataError(
        f"the current metadata file {location} of state table {'.'.join(table.name())} holds another version of "
        f"the table's metadata (its log ends at version {logged[-1] if logged else 'none'}, not {version - 1}): "
        "another metadata file was copied over it. Restore it from a backup, or move it aside and run "
        f"`icestate recover --table {table.name()[-1]}` to register the newest readable version")


def default_location(catalog: Catalog, identifier: tuple[str, str]) -> str:
    """Where ``catalog`` puts a new table ``identifier`` (staged, nothing written)."""
    return catalog.create_table_transaction(identifier, schema=Schema()).table_metadata.location


def _read_json(io: FileIO, uri: str) -> dict:
    with io.new_input(uri).open() as f:
        return json.loads(f.read())


def _torn(e: Exception) -> bool:
    """Whether ``e`` says the JSON document ended early: a prefix of a document, as a writer
    killed while storing it leaves (empty, or cut anywhere), not a document damaged inside."""
    if not isinstance(e, json.JSONDecodeError):
        return False
    return e.msg.startswith("Unterminated string") or e.pos >= len(e.doc.rstrip())


def foreign_metadata(table: Table, metadata_uris: list[str]) -> tuple[list[str], list[str]]:
    """Of ``metadata_uris`` (metadata.json files in ``table``'s metadata directory that its
    metadata log does not list): those of another table (another ``table-uuid``), and those
    that cannot be read (nothing is known of them, so they are neither taken for another
    table's nor deleted). A torn write (a commit killed while storing its metadata.json: the
    document ends early) is neither: the sweep takes it like any stale version of the table
    once its version is not above the current one (no commit can switch to it then)."""
    ours = str(table.metadata.table_uuid)
    foreign, unreadable = [], []
    for uri in metadata_uris:
        try:
            theirs = _read_json(table.io, uri).get("table-uuid")
        except FileNotFoundError:
            continue  # deleted since it was listed (an expired version): nothing to take or keep
        except (OSError, ValueError, AttributeError) as e:
            if _torn(e):
                logger.info("metadata file %s of state table %s ends early (a commit killed while storing it)",
                            uri, ".".join(table.name()))
                continue
            logger.warning("metadata file %s of state table %s cannot be read (%s): kept", uri,
                           ".".join(table.name()), e)
            unreadable.append(uri)
            continue
        if str(theirs) != ours:
            foreign.append(uri)
    return foreign, unreadable


def recover(catalog: Catalog, identifier: tuple[str, str], location: str | None = None) -> Table:
    """Register the state table at ``location`` (default: where ``catalog`` puts a table of
    that name) in ``catalog`` under ``identifier``, at its newest metadata.json.

    Replaces an entry whose metadata file cannot be loaded (missing or damaged). Refuses when
    the catalog already has the table, when the location has no metadata, when
    the newest metadata.json cannot be read or is not a state table's, and when two files
    share the newest version (a lost commit race: say which with ``location``'s listing).
    """
    name = ".".join(identifier)
    unreadable = None  # why the metadata file the catalog's entry names cannot be loaded
    try:
        existing = catalog.load_table(identifier)
    except NoSuchTableError:
        existing = None
    except StateStoreError:  # the catalog's own (its database damaged: a ValueError too)
        raise
    except (*DECODE_ERRORS, ValidationError, OSError) as e:  # a damaged entry, or its file damaged or gone
        existing, unreadable = None, f"{type(e).__name__}: {e}"
    if existing is not None:
        raise RecoveryError(f"state table {name} is in the catalog (at {existing.metadata_location}): nothing to "
                            "recover")
    catalog.create_namespace_if_not_exists(identifier[0])  # a lost catalog lost its namespaces too
    location = location or default_location(catalog, identifier)
    io = load_file_io(catalog.properties, location)  # the catalog's storage settings
    found = metadata_files(location, io)
    if not found:
        raise RecoveryError(f"there is no Iceberg metadata under {location}/{METADATA_DIR}: nothing to recover "
                            "there (give the table's location with --location)")
    newest = [f for f in found if f.version == found[0].version]
    if len(newest) > 1:
        raise RecoveryError(
            f"{len(newest)} metadata files of {location} share the newest version {found[0].version} "
            f"({', '.join(f.uri.rsplit('/', 1)[-1] for f in newest)}): a commit race left both; register the one "
            "whose snapshots are newest with the catalog's register_table")
    try:
        document = _read_json(io, newest[0].uri)
    except (OSError, ValueError) as e:
        raise RecoveryError(f"the newest metadata file {newest[0].uri} cannot be read ({e}); move it aside and "
                            "recover again to register the version before it") from e
    properties = document.get("properties") or {}
    if stored_keys.get(properties, stored_keys.LAST_CHECKPOINT_ID) is None:
        raise RecoveryError(f"{newest[0].uri} is the metadata of an Iceberg table that is not a state table "
                            f"(no {stored_keys.LAST_CHECKPOINT_ID} property): not registered")
    if unreadable is not None:
        # The entry names metadata that cannot be loaded (it says so for ever): replace it.
        logger.warning("state table %s: the catalog's entry names metadata that cannot be loaded (%s): replaced by "
                       "%s", name, unreadable, newest[0].uri)
        catalog.drop_table(identifier)  # the catalog's entry only: no file is deleted
    try:
        table = catalog.register_table(identifier, newest[0].uri)
    except StateStoreError:
        raise
    except (*DECODE_ERRORS, ValidationError, OSError) as e:
        raise RecoveryError(f"the newest metadata file {newest[0].uri} cannot be loaded ({type(e).__name__}: {e}); "
                            "move it aside and recover again to register the version before it") from e
    logger.info("state table %s registered again at %s", name, newest[0].uri)
    return table
