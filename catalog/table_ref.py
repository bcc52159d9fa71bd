"""Where a state table is: the one value every opener of a state table goes through.

A ``TableRef`` names a catalog, a namespace, a table and a line (``main`` or a fork). It
holds plain values only, so it pickles into a Spark plan and travels to a child process as
JSON (``to_json``), and every process opens the catalog itself where it uses the table.

The catalog is either

* ``warehouse=``: a local directory of the embedded SQLite catalog (``catalog.defaults``);
* or ``catalog_name=`` with ``catalog_properties=``: any pyiceberg catalog, resolved by
  pyiceberg's own ``load_catalog(name, **properties)``: the properties given here, then the
  catalog of that name in ``.pyiceberg.yaml`` (``$PYICEBERG_HOME``, home, working directory),
  then ``PYICEBERG_CATALOG__<NAME>__<KEY>`` environment variables, as pyiceberg read them when
  the process imported it. A name alone is enough when the configuration holds the rest.

Catalog properties may hold secrets (object-store keys, tokens, passwords in a URI): a
``TableRef``, and the ``StateLocation`` holding one, never print them (``redacted``), and the
compactor receives a ref on its standard input, never on its command line.

Immutable and thread safe; ``catalog()`` and ``open()`` return new objects each call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sqlite3
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from catalog.defaults import DEFAULT_NAMESPACE, check_warehouse, default_catalog
from statestore.errors import CatalogDamagedError, CatalogUnavailableError, StateStoreError
from statestore.names import check_branch_name, check_namespace, check_table_name

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

    from catalog.iceberg_table import IcebergStateTable
    from statestore.layout import StateLayout

MAIN_BRANCH = "main"
REDACTED = "***"
# A catalog property whose name contains one of these words holds a secret (s3.secret-access-key,
# adls.account-key, token, rest.sigv4... credential, jdbc.password...).
SECRET_WORDS = ("secret", "key", "token", "password", "credential")
# The password of a URI's user information: ``scheme://user:password@host``.
_URI_PASSWORD = re.compile(r"(://[^/:@\s]*:)[^/@\s]*@")


@dataclass(frozen=True)
class TableRef:
    """Where a state table is: catalog, namespace, table and line (module docstring).

    Args:
        table: the table's name in ``namespace``.
        namespace: its Iceberg namespace.
        branch: the line to read and commit: ``main``, or a fork (``IcebergStateTable.fork``).
        warehouse: local directory of the embedded SQLite catalog, made absolute here.
        catalog_name, catalog_properties: a pyiceberg catalog (``load_catalog(name, **props)``).

    Raises:
        ValueError: no table name, or not exactly one of ``warehouse`` and ``catalog_name``,
            or a warehouse that is a URI (the embedded catalog lives on local disk).
    """

    table: str
    namespace: str = DEFAULT_NAMESPACE
    warehouse: str | None = None
    catalog_name: str | None = None
    catalog_properties: dict[str, str] = field(default_factory=dict)
    branch: str = MAIN_BRANCH

    def __post_init__(self) -> None:
        check_table_name(self.table)
        check_namespace(self.namespace)
        check_branch_name(self.branch)
        if (self.warehouse is None) == (self.catalog_name is None):
            raise ValueError(
                f"state table {self.table!r} needs exactly one of warehouse= (a local directory for the embedded "
                "SQLite catalog) or catalog_name= with catalog_properties= (a pyiceberg catalog)"
            )
        if self.warehouse is not None:
            object.__setattr__(self, "warehouse", os.path.abspath(check_warehouse(os.fspath(self.warehouse))))
            if self.catalog_properties:
                raise ValueError(f"state table {self.table!r}: catalog_properties belong to catalog_name=, "
                                 "not to the embedded catalog of warehouse=")
        elif not isinstance(self.catalog_name, str) or not self.catalog_name:
            raise ValueError(f"state table {self.table!r}: catalog_name must be a non-empty string, "
                             f"got {self.catalog_name!r}")
        if not isinstance(self.catalog_properties, Mapping) or not all(
                isinstance(k, str) for k in self.catalog_properties):
            raise ValueError(f"state table {self.table!r}: catalog_properties must map property names to values")
        object.__setattr__(self, "catalog_properties", dict(self.catalog_properties))

    # --- names --------------------------------------------------------------------------

    @property
    def identifier(self) -> str:
        """``namespace.table``."""
        return f"{self.namespace}.{self.table}"

    @property
    def identity(self) -> tuple:
        """Which table and line this is, as a hashable value for cache keys. The catalog's
        properties enter it as a digest, so an identity that gets logged shows no secret."""
        digest = hashlib.sha256(json.dumps(sorted(self.catalog_properties.items()), default=str).encode()).hexdigest()
        return (self.warehouse, self.catalog_name, digest, self.namespace, self.table, self.branch)

    def __hash__(self) -> int:
        return hash(self.identity)

    def __repr__(self) -> str:
        return redacted_repr(self)

    # --- opening ------------------------------------------------------------------------

    def catalog(self) -> Catalog:
        """A new catalog object; the caller closes it (``catalog.close()``).

        Raises:
            CatalogUnavailableError: pyiceberg could not load the named catalog (its message
                holds no secret property value).
        """
        if self.warehouse is not None:
            return default_catalog(self.warehouse)
        from pyiceberg.catalog import load_catalog

        from catalog.config_trust import check_pyiceberg_config
        from catalog.fileio import use_state_file_io

        check_pyiceberg_config()
        try:
            return use_state_file_io(checked_sql_catalog(
                lambda: load_catalog(self.catalog_name, **self.catalog_properties), self._configured_uri()))
        except StateStoreError:
            raise
        except Exception as e:  # pyiceberg raises many types for bad or unreachable catalogs
            # Not chained: pyiceberg's own message may quote the properties, secrets included.
            raise CatalogUnavailableError(
                f"cannot load pyiceberg catalog {self.catalog_name!r} with properties "
                f"{sorted(self.catalog_properties)} and its .pyiceberg.yaml / PYICEBERG_* configuration "
                f"({type(e).__name__}: {scrub(str(e), self.catalog_properties)}): check them"
            ) from None

    def _configured_uri(self) -> str | None:
        """The catalog's ``uri`` as ``load_catalog`` will see it (given, else configured)."""
        if "uri" in self.catalog_properties:
            return str(self.catalog_properties["uri"])
        try:
            from pyiceberg.utils.config import Config

            return (Config().get_catalog_config(self.catalog_name) or {}).get("uri")
        except Exception:  # a broken configuration: load_catalog says what is wrong with it
            return None

    def open(
        self, layout: StateLayout | None = None, *, checkpoint_id: int | None = None, savepoint: str | None = None,
        retain_checkpoints: int | None = None, partition_width: int | None = None,
    ) -> IcebergStateTable:
        """The state table, owning a new catalog (closed with the table).

        With ``layout``: opened, or created on first use, for that layout
        (``IcebergStateTable.open``). Without: the existing table with the layout recorded in
        it, changing nothing (``IcebergStateTable.open_existing``; ValueError when missing).
        ``checkpoint_id`` / ``savepoint`` say where to open (the newest checkpoint when both
        are None); ``retain_checkpoints`` defaults to ``DEFAULT_RETAIN_CHECKPOINTS``.
        """
        from catalog.iceberg_table import DEFAULT_RETAIN_CHECKPOINTS, IcebergStateTable

        if layout is None and partition_width is not None:
            raise ValueError("partition_width applies to a table opened with a layout (which may create it)")
        common: dict[str, Any] = dict(
            catalog=self.catalog(), close_catalog=True, namespace=self.namespace, table_name=self.table,
            branch=self.branch, checkpoint_id=checkpoint_id, savepoint=savepoint,
            retain_checkpoints=DEFAULT_RETAIN_CHECKPOINTS if retain_checkpoints is None else retain_checkpoints,
        )
        if layout is None:
            return IcebergStateTable.open_existing(**common)
        return IcebergStateTable.open(layout, partition_width=partition_width, **common)

    # --- plain values -------------------------------------------------------------------

    def to_json(self) -> str:
        """The ref as a JSON object of plain values (``from_json`` reads it back). It holds the
        catalog properties in clear: hand it over a pipe or a file, never a command line."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> TableRef:
        """The ref of ``to_json`` (its text, or the object parsed from it)."""
        values = json.loads(text) if isinstance(text, str) else dict(text)
        return cls(**values)


def is_secret(name: str) -> bool:
    """Whether catalog property ``name`` holds a secret (its name contains ``SECRET_WORDS``)."""
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def redacted(properties: Mapping[str, str]) -> dict[str, str]:
    """``properties`` fit to print: secrets as ``***``, and so are passwords inside URIs."""
    return {k: REDACTED if is_secret(k) else _URI_PASSWORD.sub(rf"\g<1>{REDACTED}@", str(v))
            for k, v in properties.items()}


def scrub(text: str, properties: Mapping[str, str]) -> str:
    """``text`` (say, an error message) with the secrets of ``properties`` replaced by ``***``."""
    for k, v in properties.items():
        if v and is_secret(k):
            text = text.replace(str(v), REDACTED)
    return _URI_PASSWORD.sub(rf"\g<1>{REDACTED}@", text)


def redacted_repr(obj: Any) -> str:
    """The dataclass ``repr`` of ``obj`` with its ``catalog_properties`` field redacted."""
    shown = ", ".join(
        f"{f.name}={redacted(getattr(obj, f.name)) if f.name == 'catalog_properties' else getattr(obj, f.name)!r}"
        for f in dataclasses.fields(obj) if f.repr)
    return f"{type(obj).__name__}({shown})"


# --- the SQLite file of a SQL catalog -----------------------------------------------------------

# State tables named in the message of a damaged catalog file, at most.
TABLES_SHOWN_MAX = 10


def checked_sql_catalog(make: Callable[[], Catalog], uri: str | None, warehouse: str | None = None) -> Catalog:
    """``make()``, a pyiceberg catalog. When it is a SQL catalog on a SQLite file (``uri``), a
    failure of that file, at the opening or at any later use of the catalog, is
    ``CatalogDamagedError`` (not a database: restore it, or register the tables again) or
    ``CatalogUnavailableError`` (locked by another process, a directory, no permission), naming
    the file and what to do, instead of SQLAlchemy's errors, which name neither. ``warehouse``:
    the embedded catalog's directory (its messages give the ``icestate recover`` command line
    and the state tables found there)."""
    database = sqlite_file(uri)
    if database is None:
        return make()
    from sqlalchemy import event
    from sqlalchemy.exc import DBAPIError

    try:
        catalog = make()
    except (DBAPIError, UnicodeDecodeError) as e:  # UnicodeDecodeError: text of a damaged row
        problem = sqlite_problem(database, e.orig if isinstance(e, DBAPIError) else e, warehouse)
        if problem is None:
            raise
        raise problem from e
    engine = getattr(catalog, "engine", None)
    if engine is not None:
        def on_error(context: Any) -> None:
            problem = sqlite_problem(database, context.original_exception, warehouse)
            if problem is not None:
                raise problem from context.sqlalchemy_exception or context.original_exception
        event.listen(engine, "handle_error", on_error)
    return catalog


def sqlite_file(uri: str | None) -> str | None:
    """The path of the SQLite file a SQLAlchemy ``uri`` names (None: another database, or memory)."""
    if not uri or not str(uri).startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url

    try:
        database = make_url(str(uri)).database
    except Exception:  # not a URL SQLAlchemy reads: its own error says so
        return None
    return os.path.abspath(database) if database and database != ":memory:" else None


def sqlite_problem(database: str, error: BaseException | None, warehouse: str | None) -> StateStoreError | None:
    """The error to raise for SQLite's ``error`` on the catalog file ``database`` (None: one that
    pyiceberg handles, such as a constraint failing under a concurrent create)."""
    if not isinstance(error, sqlite3.DatabaseError | UnicodeDecodeError) or isinstance(
            error, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.DataError | sqlite3.NotSupportedError):
        return None
    said = f"{type(error).__name__}: {error}"
    text = str(error).lower()
    # A row whose text is not UTF-8 any more (UnicodeDecodeError, "could not decode") is damage too.
    if not isinstance(error, sqlite3.OperationalError) or any(
            words in text for words in ("malformed", "not a database", "could not decode")):
        again = (f"`icestate recover --table NAME --warehouse {warehouse}`" if warehouse else
                 "`icestate recover --table NAME` (with this catalog's --catalog/--property options)")
        found = state_tables(warehouse) if warehouse else []
        shown = "" if not found else (
            f" (the warehouse holds state tables {', '.join(found[:TABLES_SHOWN_MAX])}"
            f"{', ...' if len(found) > TABLES_SHOWN_MAX else ''})")
        return CatalogDamagedError(
            f"the catalog database {database} is damaged ({said}): the state tables' own files are not affected. "
            f"Restore it from a backup, or move it aside and register each state table again with {again}, which "
            f"registers a table at the newest metadata file of its location{shown}")
    if "no such table" in text:
        return None  # pyiceberg's: tables not created (init_catalog_tables off)
    if "locked" in text or "busy" in text:
        return CatalogUnavailableError(
            f"the catalog database {database} is locked by another process ({said}): nothing was changed. Retry "
            "once that process has finished its transaction (a sqlite3 shell holding one open, a stuck job), or "
            "stop it")
    if os.path.isdir(database):
        return CatalogUnavailableError(
            f"the catalog database {database} is a directory, not a SQLite file ({said}): move it away and put the "
            "catalog file back there (from a backup), or let a new one be made and register the state tables "
            "again with `icestate recover --table NAME`")
    if not os.path.isdir(os.path.dirname(database)):
        return CatalogUnavailableError(
            f"the catalog database {database} cannot be made: its directory does not exist ({said}). Create the "
            "directory, or name the catalog file that holds the state tables")
    unusable = [p for p in (database, os.path.dirname(database))
                if os.path.exists(p) and not os.access(p, os.R_OK | os.W_OK | (os.X_OK if os.path.isdir(p) else 0))]
    if unusable:
        modes = ", ".join(f"{p} has mode {stat.filemode(os.stat(p).st_mode)}" for p in unusable)
        return CatalogUnavailableError(
            f"the catalog database {database} cannot be read and written by this user ({said}; {modes}): give this "
            "user read and write permission on the file and its directory, then retry")
    return CatalogUnavailableError(
        f"the catalog database {database} cannot be used ({said}): check the file, its directory and its disk, "
        "then retry")


def state_tables(warehouse: str) -> list[str]:
    """``namespace.table`` of each table directory of the embedded catalog's ``warehouse`` that
    holds Iceberg metadata (what ``icestate recover`` can register)."""
    found = []
    try:
        for namespace in sorted(os.scandir(warehouse), key=lambda e: e.name):
            if namespace.is_dir():
                found += [f"{namespace.name}.{t.name}" for t in sorted(os.scandir(namespace.path), key=lambda e: e.name)
                          if os.path.isdir(os.path.join(t.path, "metadata"))]
    except OSError:  # the listing is a hint only
        pass
    return found
