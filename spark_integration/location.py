"""Where a stateful query keeps its state: catalog, table and parallelism.

A ``StateLocation`` is shipped to every executor inside a batch plan, so it holds only
plain values (absolute paths, catalog properties) and opens the catalog where it is used:
nothing depends on driver memory or on the driver's working directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from catalog.compactor import TableSpec
from catalog.defaults import DEFAULT_NAMESPACE
from catalog.iceberg_table import DEFAULT_RETAIN_CHECKPOINTS, IcebergStateTable
from statestore.keygroups import DEFAULT_MAX_PARALLELISM, check_max_parallelism
from statestore.layout import StateLayout


@dataclass(frozen=True)
class StateLocation:
    """The state table of one stateful query.

    Args:
        table: table name in ``namespace``.
        warehouse: local directory of the embedded SQLite catalog (``catalog.defaults``);
            made absolute here. Give either this or ``catalog_properties``.
        catalog_name, catalog_properties: any pyiceberg catalog (``load_catalog(name, **props)``),
            for a shared catalog (REST, SQL on Postgres, Glue...). Executors load it themselves.
        max_parallelism: number of key groups, fixed when the table is created.
        parallelism: tasks of this run; may change at every restart (1..max_parallelism).
        retain_checkpoints: checkpoints of the line that retention keeps.
        branch: the line of the table this query reads and commits: ``main``, or a fork
            (``IcebergStateTable.fork``), so that a new version of a job runs against a
            copy of the state that costs no bytes and leaves ``main`` untouched.
    """

    table: str
    warehouse: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    parallelism: int = 2
    catalog_name: str | None = None
    catalog_properties: dict[str, str] = field(default_factory=dict)
    retain_checkpoints: int = DEFAULT_RETAIN_CHECKPOINTS
    branch: str = "main"

    def __post_init__(self) -> None:
        if not isinstance(self.table, str) or not self.table:
            raise ValueError(f"StateLocation.table must be a non-empty table name, got {self.table!r}")
        if (self.warehouse is None) == (self.catalog_name is None):
            raise ValueError(
                "StateLocation needs exactly one of warehouse= (a local directory for the embedded SQLite "
                "catalog) or catalog_name= with catalog_properties= (a pyiceberg catalog)"
            )
        if self.warehouse is not None:
            object.__setattr__(self, "warehouse", os.path.abspath(os.fspath(self.warehouse)))
        check_max_parallelism(self.max_parallelism)
        if not isinstance(self.parallelism, int) or not 1 <= self.parallelism <= self.max_parallelism:
            raise ValueError(
                f"StateLocation.parallelism must be an int in [1, max_parallelism={self.max_parallelism}], "
                f"got {self.parallelism!r}"
            )
        object.__setattr__(self, "catalog_properties", dict(self.catalog_properties))

    @property
    def identifier(self) -> str:
        return f"{self.namespace}.{self.table}"

    @property
    def identity(self) -> tuple:
        """Which table this is, whatever the parallelism."""
        return (self.warehouse, self.catalog_name, tuple(sorted(self.catalog_properties.items())), self.identifier,
                self.branch)

    def table_spec(self) -> TableSpec:
        """How another process (the compactor) opens this table."""
        return TableSpec(table=self.table, namespace=self.namespace, warehouse=self.warehouse,
                         catalog_name=self.catalog_name, catalog_properties=dict(self.catalog_properties),
                         branch=self.branch)

    def open(self, layout: StateLayout, checkpoint_id: int | None = None) -> IcebergStateTable:
        """Open (creating on first use) the state table at ``checkpoint_id`` (newest when None)."""
        common = dict(namespace=self.namespace, table_name=self.table, checkpoint_id=checkpoint_id,
                      retain_checkpoints=self.retain_checkpoints, branch=self.branch)
        if self.warehouse is not None:
            return IcebergStateTable.open(layout, warehouse=self.warehouse, **common)
        from pyiceberg.catalog import load_catalog

        catalog = load_catalog(self.catalog_name, **self.catalog_properties)
        return IcebergStateTable.open(layout, catalog=catalog, close_catalog=True, **common)
