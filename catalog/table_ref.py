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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from catalog.defaults import DEFAULT_NAMESPACE, check_warehouse, default_catalog
from statestore.errors import CatalogUnavailableError
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
            return use_state_file_io(load_catalog(self.catalog_name, **self.catalog_properties))
        except Exception as e:  # pyiceberg raises many types for bad or unreachable catalogs
            # Not chained: pyiceberg's own message may quote the properties, secrets included.
            raise CatalogUnavailableError(
                f"cannot load pyiceberg catalog {self.catalog_name!r} with properties "
                f"{sorted(self.catalog_properties)} and its .pyiceberg.yaml / PYICEBERG_* configuration "
                f"({type(e).__name__}: {scrub(str(e), self.catalog_properties)}): check them"
            ) from None

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
