"""Where a stateful query keeps its state: catalog, table and parallelism.

A ``StateLocation`` lives on the driver (and in a Spark Connect server's runner): it holds
only plain values (absolute paths, catalog properties) and opens the catalog where it is
used, so nothing depends on the driver's working directory. Where the table is is its
``ref`` (``catalog.table_ref.TableRef``), through which it opens the table. Tasks never see
it: a batch plan carries the table's identity (no secret) and the checkpoint the driver
holds (``tasks.BatchPlan``), and tasks read without a catalog (``catalog.task_view``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from catalog.defaults import DEFAULT_NAMESPACE, embedded_catalog_class
from catalog.iceberg_table import DEFAULT_RETAIN_CHECKPOINTS, IcebergStateTable
from catalog.table_ref import TableRef, redacted_repr
from statestore.keygroups import DEFAULT_MAX_PARALLELISM, check_max_parallelism
from statestore.layout import StateLayout

# The embedded catalog's client (SQLAlchemy, 0.3 s) comes in with the driver's side, not inside
# the first query's start (tasks never import this module).
embedded_catalog_class()


@dataclass(frozen=True)
class StateLocation:
    """The state table of one stateful query.

    Args:
        table: table name in ``namespace``.
        warehouse: local directory of the embedded SQLite catalog (``catalog.defaults``);
            made absolute here. Give either this or ``catalog_name``.
        catalog_name, catalog_properties: any Iceberg catalog, resolved as ``TableRef`` says
            (the properties, then the Iceberg client's configuration file and environment),
            for a shared catalog (REST, SQL on Postgres, Glue...). Executors load it
            themselves; its secret properties are never printed.
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
        ref = TableRef(table=self.table, namespace=self.namespace, warehouse=self.warehouse,
                       catalog_name=self.catalog_name, catalog_properties=self.catalog_properties, branch=self.branch)
        check_max_parallelism(self.max_parallelism)
        if not isinstance(self.parallelism, int) or not 1 <= self.parallelism <= self.max_parallelism:
            raise ValueError(
                f"StateLocation.parallelism must be an int in [1, max_parallelism={self.max_parallelism}], "
                f"got {self.parallelism!r}"
            )
        object.__setattr__(self, "warehouse", ref.warehouse)  # absolute
        object.__setattr__(self, "catalog_properties", ref.catalog_properties)
        object.__setattr__(self, "_ref", ref)

    def __repr__(self) -> str:
        return redacted_repr(self)

    @property
    def ref(self) -> TableRef:
        """Where the table is (also how another process, such as the compactor, opens it)."""
        return self._ref

    @property
    def identifier(self) -> str:
        return self.ref.identifier

    @property
    def identity(self) -> tuple:
        """Which table this is, whatever the parallelism (``TableRef.identity``)."""
        return self.ref.identity

    def open(self, layout: StateLayout, checkpoint_id: int | None = None) -> IcebergStateTable:
        """Open (creating on first use) the state table at ``checkpoint_id`` (newest when None)."""
        return self.ref.open(layout, checkpoint_id=checkpoint_id, retain_checkpoints=self.retain_checkpoints)
