"""Creating a state table, or opening an existing one for a (possibly grown) layout.

Opening validates the layout against what the table was created for
(``catalog.schema.check_compatible``) and then brings the table up to date in one
metadata-only commit: columns of new state variables (schema evolution), the name
mapping that lets self-written Parquet map to field ids, the layout properties, the
Iceberg properties a state table relies on, and a new partition width when asked for
(partition evolution: old segments keep their spec, readers prune by statistics).
"""

from __future__ import annotations

import json

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, TableAlreadyExistsError
from pyiceberg.io import load_file_io
from pyiceberg.table import Table, TableProperties, Transaction
from pyiceberg.transforms import TruncateTransform

from catalog import properties as props
from catalog.recovery import TableLocationInUseError, check_location_free, load_table
from catalog.schema import (
    check_compatible,
    default_partition_width,
    evolved_columns,
    iceberg_schema,
    layout_properties,
    new_columns,
    partition_field_name,
    partition_spec,
    sort_order,
)
from statestore import stored_keys
from statestore.errors import CommitConflictError
from statestore.layout import KEY_GROUP, StateLayout

# Opening retries its metadata commit this often when another process commits meanwhile.
OPEN_ATTEMPTS_MAX = 4
# Iceberg properties that must have exactly these values (others are defaults a user may tune).
_ENFORCED = (TableProperties.COMMIT_NUM_RETRIES,)


def load_or_create(catalog: Catalog, identifier: tuple[str, str], layout: StateLayout, width: int | None) -> Table:
    """The state table ``identifier``, created for ``layout`` or updated to accept it.

    Raises StateTableMismatchError when an existing table holds another operator's state.
    """
    for _ in range(OPEN_ATTEMPTS_MAX):
        try:
            table = load_table(catalog, identifier)
        except NoSuchTableError:
            try:
                return _create(catalog, identifier, layout, width)
            except TableAlreadyExistsError:
                continue  # another process created it first: open theirs
            except TableLocationInUseError:
                if not catalog.table_exists(identifier):
                    raise
                continue  # another process created it between our lookup and our check
        try:
            return _bring_up_to_date(table, layout, width)
        except CommitFailedException:
            continue
    raise CommitConflictError(
        f"state table {'.'.join(identifier)} changed under every one of {OPEN_ATTEMPTS_MAX} attempts to open it: "
        "another process keeps committing to it; retry later"
    )


def _create(catalog: Catalog, identifier: tuple[str, str], layout: StateLayout, width: int | None) -> Table:
    schema = iceberg_schema(layout.entry_schema)
    width = width or default_partition_width(layout.max_parallelism)
    properties = {
        **props.iceberg_table_properties(),
        **layout_properties(layout),
        stored_keys.PARTITION_WIDTH: str(width),
        stored_keys.LAST_CHECKPOINT_ID: "0",
    }
    tx = catalog.create_table_transaction(
        identifier, schema=schema, partition_spec=partition_spec(schema, width),
        sort_order=sort_order(schema), properties=properties,
    )
    # A location that holds a table's metadata is a table whose catalog entry was lost: a new
    # table there would take its files for its own leftovers.
    location = tx.table_metadata.location
    check_location_free(identifier, location, load_file_io(catalog.properties, location))
    # Ids are assigned by the transaction; the name mapping must use the table's own.
    tx.set_properties({TableProperties.DEFAULT_NAME_MAPPING: _name_mapping(tx)})
    tx.commit_transaction()  # returns a StagedTable, which cannot be scanned: load the real one
    return catalog.load_table(identifier)


def _bring_up_to_date(table: Table, layout: StateLayout, width: int | None) -> Table:
    check_compatible(".".join(table.name()), table.schema(), table.properties, layout)
    added = new_columns(table.schema(), layout)
    evolved, dropped, evolved_states = evolved_columns(table.schema(), layout)
    current = stored_keys.upgraded(table.properties)
    width_change = width is not None and str(width) != current.get(stored_keys.PARTITION_WIDTH)
    tx = table.transaction()
    if len(added) or len(evolved):
        # New variables' columns, and values whose schema evolves (fields added, types widened, by
        # name; a field no longer declared stays, optional): metadata only, no file is rewritten.
        with tx.update_schema() as update:
            update.union_by_name(pa.schema([*added, *evolved]))
            for path in dropped:
                update.make_column_optional(path)
    if width_change:
        _evolve_partitioning(tx, width)
    wanted = _wanted_properties(tx, layout, width if width_change else None, evolved_states)
    changed = {k: v for k, v in wanted.items() if current.get(k) != v}
    if changed:
        tx.set_properties(changed)
    return tx.commit_transaction()  # a no-op without staged changes


def _wanted_properties(tx: Transaction, layout: StateLayout, width: int | None,
                       evolved: set[str] = frozenset()) -> dict[str, str]:
    current = stored_keys.upgraded(tx.table_metadata.properties)
    wanted = {k: v for k, v in props.iceberg_table_properties().items() if k in _ENFORCED or k not in current}
    wanted.update(layout_properties(layout, current.get(stored_keys.LAYOUT), evolved))
    if json.loads(wanted[stored_keys.LAYOUT]) == json.loads(current.get(stored_keys.LAYOUT, "null")):
        del wanted[stored_keys.LAYOUT]  # same content, maybe other formatting: no commit for that
    wanted[TableProperties.DEFAULT_NAME_MAPPING] = _name_mapping(tx)
    if width is not None:
        wanted[stored_keys.PARTITION_WIDTH] = str(width)
    return wanted


def _evolve_partitioning(tx: Transaction, width: int) -> None:
    with tx.update_spec() as update:
        for field in tx.table_metadata.spec().fields:
            update.remove_field(field.name)
        update.add_field(KEY_GROUP, TruncateTransform(width), partition_field_name(width))


def _name_mapping(tx: Transaction) -> str:
    return tx.table_metadata.schema().name_mapping.model_dump_json()
