"""The Iceberg shape of a state table: schema, partition spec, sort order, layout properties.

A state table's Iceberg schema is ``StateLayout.entry_schema`` with Iceberg field ids.
The layout (key schema, state variables and their kinds, max parallelism) is recorded in
table properties so that opening the table again can tell a compatible operator (same
keys, same types for known state variables, maybe new variables) from a different one.

Types are compared in a canonical form, Arrow -> Iceberg -> Arrow, so that Arrow
flavours Iceberg does not distinguish (int8 and int32, string and large_string) compare
equal while real changes (long to string) do not. Pure functions, thread safe.
"""

from __future__ import annotations

import json

import pyarrow as pa
from pyiceberg.io.pyarrow import _ConvertToIcebergWithoutIDs, schema_to_pyarrow, visit_pyarrow
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema, assign_fresh_schema_ids
from pyiceberg.table.sorting import SortField, SortOrder
from pyiceberg.transforms import IdentityTransform, TruncateTransform

from catalog import properties as props
from statestore import stored_keys
from statestore.descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateKind,
    TtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
    column_stem,
)
from statestore.errors import StateFunctionUnavailableError, StateTableMismatchError
from statestore.layout import KEY_GROUP, StateLayout

# The key of a state's TTL in the recorded layout (``layout_properties``).
TTL_KEY = "ttl"
# Partition field ids start here in Iceberg (spec rule); a fresh spec uses the first one.
_FIRST_PARTITION_FIELD_ID = 1000
_FIX = (
    "open it with the declaration it was created with, or give the changed operator a new table_name "
    "(changing a state variable's type needs a new state name)"
)


def iceberg_schema(arrow_schema: pa.Schema) -> Schema:
    """An Iceberg schema for ``arrow_schema`` with fresh field ids 1, 2, ... in column order."""
    # pyiceberg's own converter for create_table(schema=pa.Schema); it has no public name.
    return assign_fresh_schema_ids(visit_pyarrow(arrow_schema, _ConvertToIcebergWithoutIDs()))


def partition_spec(schema: Schema, width: int, field_id: int = _FIRST_PARTITION_FIELD_ID) -> PartitionSpec:
    """``truncate(key_group, width)``: partition p holds key groups [p*width, (p+1)*width - 1]."""
    return PartitionSpec(
        PartitionField(
            source_id=schema.find_field(KEY_GROUP).field_id, field_id=field_id,
            transform=TruncateTransform(width), name=partition_field_name(width),
        )
    )


def partition_field_name(width: int) -> str:
    return f"{stored_keys.PARTITION_FIELD_PREFIX}{width}"


def sort_order(schema: Schema) -> SortOrder:
    """Segments are sorted by key group (then key); recorded so other engines know it."""
    return SortOrder(SortField(source_id=schema.find_field(KEY_GROUP).field_id, transform=IdentityTransform()))


def default_partition_width(max_parallelism: int) -> int:
    return -(-max_parallelism // props.DEFAULT_PARTITION_COUNT)


def layout_properties(layout: StateLayout, recorded_layout: str | None = None,
                      evolved: set[str] = frozenset()) -> dict[str, str]:
    """The statestore.* table properties of ``layout``.

    States recorded earlier stay recorded as they were: undeclared ones because their
    columns stay in the table and a later operator may declare them again, declared ones
    because ``check_compatible`` found them equal (an Arrow flavour of the same type must
    not rewrite the property at every open), except those in ``evolved`` (their schema
    evolved to the declared one).
    """
    states = {s["name"]: s for s in _recorded_states(recorded_layout)}
    for d in layout.descriptors:
        if d.name not in states or d.name in evolved:  # else validated equal: keep the recorded spelling
            states[d.name] = {
                "name": d.name, "kind": d.kind.value, "value_type": str(d.value_type),
                "user_key_type": None if d.user_key_type is None else str(d.user_key_type),
            }
        # The TTL the operator declares now (it may change between runs, as in Spark): readers of
        # the recorded layout (inspection, repairs) expire and write entries as the stream does.
        if d.ttl is None:
            states[d.name].pop(TTL_KEY, None)
        else:
            states[d.name][TTL_KEY] = {"ttl_ms": d.ttl.ttl_ms, "update_type": d.ttl.update_type.value}
    return {
        stored_keys.MAX_PARALLELISM: str(layout.max_parallelism),
        stored_keys.KEY_SCHEMA: json.dumps([{"name": f.name, "type": str(f.type)} for f in layout.key_schema]),
        stored_keys.LAYOUT: json.dumps({"states": list(states.values())}, sort_keys=True),
    }


def _recorded_states(recorded_layout: str | None) -> list[dict]:
    return json.loads(recorded_layout)["states"] if recorded_layout else []


def check_compatible(table_name: str, schema: Schema, properties: dict[str, str], layout: StateLayout) -> None:
    """Raise StateTableMismatchError unless ``layout`` may use the existing table.

    Compatible means: same max parallelism, same key column names (in order) and types,
    and the same kind and column types for every state variable the table already knows.
    New state variables are fine (``new_columns`` lists what to add).
    """
    properties = stored_keys.upgraded(properties)
    if stored_keys.MAX_PARALLELISM not in properties:
        raise StateTableMismatchError(
            f"table {table_name} is not a state table (it has no {stored_keys.MAX_PARALLELISM} property): "
            "pick a table_name that is unused or was created by IcebergStateTable.open"
        )
    recorded_n = int(properties[stored_keys.MAX_PARALLELISM])
    if recorded_n != layout.max_parallelism:
        raise StateTableMismatchError(
            f"state table {table_name} was created with max_parallelism={recorded_n}, the operator declares "
            f"{layout.max_parallelism}: key groups are fixed for the life of the state; open it with "
            f"max_parallelism={recorded_n} or start a new table"
        )
    recorded_keys = [k["name"] for k in json.loads(properties[stored_keys.KEY_SCHEMA])]
    if recorded_keys != layout.key_names:
        raise StateTableMismatchError(
            f"state table {table_name} has key columns {recorded_keys}, the operator declares "
            f"{layout.key_names}: {_FIX}"
        )
    _check_state_kinds(table_name, properties.get(stored_keys.LAYOUT), layout)
    _check_column_types(table_name, schema, layout)


def _check_state_kinds(table_name: str, recorded_layout: str | None, layout: StateLayout) -> None:
    recorded = {s["name"]: s["kind"] for s in _recorded_states(recorded_layout)}
    for d in layout.descriptors:
        if d.name in recorded and recorded[d.name] != d.kind.value:
            raise StateTableMismatchError(
                f"state variable {d.name!r} of state table {table_name} is a {recorded[d.name]} state, the "
                f"operator declares a {d.kind.value} state: {_FIX}"
            )


def _check_column_types(table_name: str, schema: Schema, layout: StateLayout) -> None:
    known = {f.name for f in schema.fields}
    values = {d.value_column: d.name for d in layout.descriptors}
    for f in layout.entry_schema:
        if f.name not in known:
            if not f.nullable:
                raise StateTableMismatchError(
                    f"state table {table_name} lacks the required column {f.name!r}: it was created for "
                    f"another layout; {_FIX}"
                )
            continue
        have = canonical_type(schema.find_field(f.name).field_type)
        want = canonical_arrow_type(f.type)
        if have.equals(want):
            continue
        if f.name in values:
            problem = evolution_problem(have, want, "the value")
            if problem is None:
                continue  # the state's schema evolves when the table is opened (``evolved_columns``)
            raise StateTableMismatchError(
                f"state {values[f.name]!r} of state table {table_name} holds {have}; the operator declares {want}, "
                f"which is not an evolution of it: {problem} (as Spark's STATE_STORE_INVALID_VALUE_SCHEMA_EVOLUTION: "
                "a value's schema may gain nullable fields, lose fields, reorder them and widen int to long or float "
                "to double); declare it as it was, or declare the changed value as a new state variable")
        raise StateTableMismatchError(
            f"column {f.name!r} of state table {table_name} has type {have}, the operator declares "
            f"{want}: {_FIX}"
        )


def evolution_problem(old: pa.DataType, new: pa.DataType, where: str, drops: bool = True) -> str | None:
    """Why values stored as ``old`` cannot be read as ``new`` the way Spark evolves a state's
    schema (Avro's schema resolution: fields matched by name, fields added (read as null) or,
    with ``drops``, dropped; int -> long and float -> double widened); None when they can."""
    if old.equals(new):
        return None
    if pa.types.is_struct(old) and pa.types.is_struct(new):
        declared = {f.name for f in new}
        gone = [f.name for f in old if f.name not in declared]
        if gone and not drops:
            return f"{where} loses field(s) {gone}"
        stored = {f.name: f for f in old}
        for f in new:
            if f.name not in stored:
                if not f.nullable:
                    return f"{where} gains field {f.name!r}, which is not nullable (old values have none)"
                continue
            if stored[f.name].nullable and not f.nullable:
                return f"field {f.name!r} becomes not nullable (old values may hold nulls)"
            problem = evolution_problem(stored[f.name].type, f.type, f"field {f.name!r}", drops)
            if problem:
                return problem
        return None
    if _is_list(old) and _is_list(new):
        return evolution_problem(old.value_type, new.value_type, f"the elements of {where}", drops)
    if pa.types.is_map(old) and pa.types.is_map(new):
        return (evolution_problem(old.key_type, new.key_type, f"the keys of {where}", drops)
                or evolution_problem(old.item_type, new.item_type, f"the values of {where}", drops))
    if pa.types.is_signed_integer(old) and pa.types.is_signed_integer(new) and new.bit_width >= old.bit_width:
        return None
    if old == pa.float32() and new == pa.float64():
        return None
    return f"{where} changes from {old} to {new}"


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def evolved_columns(schema: Schema, layout: StateLayout) -> tuple[pa.Schema, list[str], set[str]]:
    """The value columns whose declared type evolves the table's (``evolution_problem`` found
    none), as a schema to unite the table's with by name (fields added, types widened); the
    paths of the table's required fields the declaration dropped (they stay in the table, so no
    stored value is lost, but become optional: values written from now on have none); and the
    names of the state variables concerned."""
    known = {f.name for f in schema.fields}
    fields, dropped, names = [], [], set()
    for d in layout.descriptors:
        if d.value_column not in known:
            continue
        have = canonical_type(schema.find_field(d.value_column).field_type)
        if not have.equals(canonical_arrow_type(d.value_type)):
            fields.append(pa.field(d.value_column, d.value_type))
            dropped += _required_fields_dropped(have, canonical_arrow_type(d.value_type), (d.value_column,))
            names.add(d.name)
    return pa.schema(fields), dropped, names


def _required_fields_dropped(old: pa.DataType, new: pa.DataType, path: tuple[str, ...]) -> list[str]:
    if pa.types.is_struct(old) and pa.types.is_struct(new):
        declared = {f.name: f for f in new}
        out = []
        for f in old:
            if f.name not in declared:
                if not f.nullable:
                    out.append(".".join((*path, f.name)))
            else:
                out += _required_fields_dropped(f.type, declared[f.name].type, (*path, f.name))
        return out
    if _is_list(old) and _is_list(new):
        return _required_fields_dropped(old.value_type, new.value_type, (*path, "element"))
    if pa.types.is_map(old) and pa.types.is_map(new):
        return _required_fields_dropped(old.item_type, new.item_type, (*path, "value"))
    return []


def new_columns(schema: Schema, layout: StateLayout) -> pa.Schema:
    """Columns of ``layout.entry_schema`` that the table lacks (columns of new state variables)."""
    known = {f.name for f in schema.fields}
    return pa.schema([f for f in layout.entry_schema if f.name not in known])


def canonical_type(iceberg_type) -> pa.DataType:
    """The Arrow type Iceberg reads ``iceberg_type`` as, without field ids."""
    return schema_to_pyarrow(iceberg_type, include_field_ids=False)


def canonical_arrow_type(arrow_type: pa.DataType) -> pa.DataType:
    converted = iceberg_schema(pa.schema([pa.field("c", arrow_type)]))
    return canonical_type(converted.find_field("c").field_type)


def recorded_layout(table_name: str, schema: Schema, properties: dict[str, str]) -> StateLayout:
    """The layout an existing state table was created (and grown) for, rebuilt from its metadata.

    Types come from the table's columns. Reducing and aggregating states get functions that
    refuse to run: their code is not stored, so such a layout reads state but cannot fold
    new values into it (open with the operator's own layout for that).
    """
    properties = stored_keys.upgraded(properties)
    if stored_keys.MAX_PARALLELISM not in properties:
        raise StateTableMismatchError(
            f"table {table_name} is not a state table (no {stored_keys.MAX_PARALLELISM} property)")
    keys = json.loads(properties[stored_keys.KEY_SCHEMA])
    key_schema = pa.schema([pa.field(k["name"], _column_type(schema, k["name"], k.get("type"))) for k in keys])
    descriptors = [_descriptor(s, schema) for s in _recorded_states(properties.get(stored_keys.LAYOUT))]
    return StateLayout.of(key_schema, descriptors, int(properties[stored_keys.MAX_PARALLELISM]))


def _column_type(schema: Schema, name: str, recorded: str | None = None) -> pa.DataType:
    """The Arrow type of column ``name``: as the operator declared it (``recorded``, the type's
    name in the layout properties) when that is the column's type in another Arrow flavour
    (``string`` for Iceberg's ``large_string``), so a layout read back equals the original;
    else as Iceberg reads it."""
    read = canonical_type(schema.find_field(name).field_type)
    narrow = _narrow(read)
    return narrow if recorded is not None and str(narrow) == recorded else read


def _narrow(t: pa.DataType) -> pa.DataType:
    """``t`` with 32-bit offsets where Iceberg reads 64-bit ones (large_string -> string...)."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_narrow(t.value_type)))
    if pa.types.is_map(t):
        return pa.map_(_narrow(t.key_type), t.item_field.with_type(_narrow(t.item_type)))
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_narrow(f.type)) for f in t])
    return t


def _descriptor(state: dict, schema: Schema) -> StateDescriptor:
    name, kind = state["name"], StateKind(state["kind"])
    stem = column_stem(name)
    value_type = _column_type(schema, f"v_{stem}", state.get("value_type"))
    recorded_ttl = state.get(TTL_KEY)
    ttl = None if recorded_ttl is None else TtlConfig(int(recorded_ttl["ttl_ms"]),
                                                      TtlUpdateType(recorded_ttl["update_type"]))
    if kind is StateKind.MAP:
        return MapStateDescriptor(name, value_type, ttl=ttl,
                                  key_type=_column_type(schema, f"mk_{stem}", state.get("user_key_type")))
    if kind is StateKind.REDUCING:
        return ReducingStateDescriptor(name, value_type, ttl=ttl, reduce_fn=_StoredFunctionUnavailable(name))
    if kind is StateKind.AGGREGATING:
        return AggregatingStateDescriptor(name, value_type=value_type, ttl=ttl, agg_fn=_StoredFunctionUnavailable(name))
    return {StateKind.VALUE: ValueStateDescriptor, StateKind.LIST: ListStateDescriptor}[kind](name, value_type,
                                                                                               ttl=ttl)


class _StoredFunctionUnavailable(AggregateFunction):
    """Stands in for the reduce or aggregate function of a layout rebuilt from metadata."""

    def __init__(self, state_name: str):
        self.state_name = state_name

    def __call__(self, *args: object) -> object:
        raise StateFunctionUnavailableError(
            f"state {self.state_name!r} was opened from the table's recorded layout, which has no reduce or "
            "aggregate function: open the table with the operator's own layout to add values"
        )

    create_accumulator = add = merge = get_result = __call__
