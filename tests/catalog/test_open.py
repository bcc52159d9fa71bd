"""Creating and opening Iceberg state tables: Iceberg shape, messages of the validation
against the layout, schema and partition evolution, catalogs passed in, ``open_existing``.
What every StateTable promises on open (an empty table, reopening, closing, layout
refusal, a store on top) is in tests/contract."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
from pyiceberg.table import TableProperties
from pyiceberg.transforms import IdentityTransform, TruncateTransform

from catalog import IcebergStateTable, default_catalog
from statestore import stored_keys
from statestore.descriptors import (
    ListStateDescriptor,
    ReducingStateDescriptor,
    TtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)
from statestore.errors import StateFunctionUnavailableError, StateTableMismatchError
from statestore.keygroups import KeyGroupRange
from statestore.layout import StateLayout
from tests.catalog.catalog_helpers import DESCRIPTORS, KEY_SCHEMA, LAYOUT, MAX_PARALLELISM, commit_next


def test_create_sets_schema_spec_sort_order_and_properties(open_table, warehouse):
    table = open_table()
    ice = table.iceberg_table
    assert os.path.isfile(os.path.join(warehouse, "catalog.db"))
    assert [f.name for f in ice.schema().fields] == LAYOUT.entry_schema.names
    assert ice.schema().find_field("user").required and not ice.schema().find_field("v_count").required
    (part,) = ice.spec().fields
    assert part.transform == TruncateTransform(MAX_PARALLELISM)  # default: one partition
    assert ice.sort_order().fields[0].transform == IdentityTransform()
    p = ice.properties
    assert p[stored_keys.MAX_PARALLELISM] == str(MAX_PARALLELISM)
    assert json.loads(p[stored_keys.KEY_SCHEMA]) == [{"name": "user", "type": "string"}]
    states = {s["name"]: s for s in json.loads(p[stored_keys.LAYOUT])["states"]}
    assert states["seen"] == {"name": "seen", "kind": "map", "value_type": "int32", "user_key_type": "string"}
    assert p[stored_keys.PARTITION_WIDTH] == str(MAX_PARALLELISM)
    assert p[TableProperties.PARQUET_COMPRESSION] == "zstd"
    assert p[TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED] == "true"
    assert "user" in p[TableProperties.DEFAULT_NAME_MAPPING]


def test_file_schema_carries_field_ids(open_table):
    schema = open_table().file_schema()
    ids = [int(f.metadata[b"PARQUET:field_id"]) for f in schema]
    assert schema.names == LAYOUT.entry_schema.names and ids == sorted(set(ids))


def test_paths_partitions_and_filesystem(open_table):
    table = open_table(partition_width=4)
    assert [table.partition_of(kg) for kg in (0, 3, 4, 15)] == [0, 0, 1, 3]
    path = table.new_segment_path(7, 2, 3)
    assert not path.startswith("file:") and path.startswith(table.location.removeprefix("file://"))
    assert os.path.basename(path).startswith("seg-cp000000000007-t00002-p00003-")
    # in the directory of checkpoints 0-99, made when a segment is written; data/ exists at open
    assert os.path.basename(os.path.dirname(path)) == "c000000000000"
    assert table.filesystem.get_file_info(os.path.dirname(os.path.dirname(path))).type.name == "Directory"
    with pytest.raises(ValueError):
        table.partition_of(MAX_PARALLELISM)
    with pytest.raises(ValueError):
        table.new_segment_path(1, 0, 4)


@pytest.mark.parametrize(
    ("layout", "fragment"),
    [
        (StateLayout.of(KEY_SCHEMA, DESCRIPTORS, 32), "max_parallelism=16"),
        (StateLayout.of(pa.schema([("account", pa.string())]), DESCRIPTORS, MAX_PARALLELISM), "key columns ['user']"),
        (StateLayout.of(pa.schema([("user", pa.int64())]), DESCRIPTORS, MAX_PARALLELISM), "column 'user'"),
        (StateLayout.of(KEY_SCHEMA, [ValueStateDescriptor("count", pa.string())], MAX_PARALLELISM),
         "the value changes from int64 to "),
        (StateLayout.of(KEY_SCHEMA, [ListStateDescriptor("count", pa.int64())], MAX_PARALLELISM), "'count'"),
    ],
    ids=["max-parallelism", "key-name", "key-type", "value-type", "state-kind"],
)
def test_mismatched_layout_is_refused_naming_table_and_difference(open_table, layout, fragment):
    open_table().close()
    with pytest.raises(StateTableMismatchError) as e:
        open_table(layout)
    assert "state.op" in str(e.value) and fragment in str(e.value)


def test_equivalent_arrow_flavours_are_compatible(open_table):
    open_table().close()
    large = StateLayout.of(pa.schema([("user", pa.large_string())]), DESCRIPTORS, MAX_PARALLELISM)
    open_table(large)


def test_table_that_is_not_a_state_table_is_refused(open_table, warehouse):
    cat = default_catalog(warehouse)
    cat.create_namespace_if_not_exists("state")
    cat.create_table(("state", "plain"), schema=pa.schema([("x", pa.int64())]))
    cat.close()
    with pytest.raises(StateTableMismatchError, match="not a state table"):
        open_table(table_name="plain")


def test_new_state_variable_is_added_by_schema_evolution(open_table):
    table = open_table()
    first = commit_next(table)
    old_segments = table.segments(KeyGroupRange.of(0, MAX_PARALLELISM - 1))
    table.close()
    grown = StateLayout.of(KEY_SCHEMA, [*DESCRIPTORS, ValueStateDescriptor("last_seen", pa.timestamp("us"))],
                           MAX_PARALLELISM)
    table = open_table(grown)
    ice = table.iceberg_table
    assert ice.schema().find_field("v_last_seen").required is False
    assert "v_last_seen" in ice.properties[TableProperties.DEFAULT_NAME_MAPPING]
    assert "last_seen" in ice.properties[stored_keys.LAYOUT]
    assert ice.metadata.current_snapshot_id == table.current_checkpoint().snapshot_id  # metadata only
    assert table.current_checkpoint().checkpoint_id == first
    assert table.segments(KeyGroupRange.of(0, MAX_PARALLELISM - 1)) == old_segments
    assert "v_last_seen" in table.file_schema().names
    commit_next(table)  # segments with the new column commit
    table.close()
    # The old layout (without the new variable) still opens: its variables are unchanged.
    open_table(LAYOUT)


def test_partition_width_is_kept_and_evolves_metadata_only(open_table):
    table = open_table(partition_width=8)
    commit_next(table, [[0, 3, 7], [8, 12, 15]])
    table.close()
    table = open_table()  # None keeps the table's width
    assert table.partition_of(9) == 1
    table.close()
    table = open_table(partition_width=4)
    assert table.iceberg_table.spec().fields[0].transform == TruncateTransform(4)
    assert table.iceberg_table.properties[stored_keys.PARTITION_WIDTH] == "4"
    commit_next(table, [[0, 3], [4, 7], [8, 11], [12, 15]])
    assert len(table.segments(KeyGroupRange.of(0, 15))) == 6
    assert len(table.segments(KeyGroupRange.of(5, 6))) == 2  # the old 0-7 segment and the new 4-7 one


def test_any_catalog_can_be_passed_in_and_stays_open(tmp_path):
    cat = default_catalog(str(tmp_path / "elsewhere"))
    table = IcebergStateTable.open(LAYOUT, catalog=cat, namespace="ns", table_name="t")
    cp = commit_next(table)
    table.close()
    assert cat.load_table(("ns", "t")).current_snapshot() is not None  # the catalog is still usable
    table = IcebergStateTable.open(LAYOUT, catalog=cat, namespace="ns", table_name="t", checkpoint_id=cp)
    assert table.current_checkpoint().checkpoint_id == cp
    table.close()
    cat.close()


def test_open_arguments_are_validated(open_table, tmp_path):
    with pytest.raises(ValueError, match="warehouse"):
        IcebergStateTable.open(LAYOUT, table_name="t")
    with pytest.raises(ValueError, match="partition_width"):
        open_table(partition_width=MAX_PARALLELISM + 1)
    with pytest.raises(ValueError, match="URI"):
        default_catalog("s3://bucket/warehouse")


def test_open_existing_rebuilds_the_recorded_layout(open_table, warehouse):
    layout = StateLayout.of(KEY_SCHEMA, [*DESCRIPTORS, ListStateDescriptor("pages", pa.string()),
                                         ReducingStateDescriptor("total", pa.int64(), reduce_fn=lambda a, b: a + b)],
                            MAX_PARALLELISM)
    table = open_table(layout)
    cp = commit_next(table)
    table.close()
    existing = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    try:
        assert existing.identifier == "state.op"
        assert existing.current_checkpoint().checkpoint_id == cp
        assert [(d.name, d.kind) for d in existing.layout.descriptors] == [(d.name, d.kind) for d in layout.descriptors]
        assert existing.layout.key_names == ["user"] and existing.layout.max_parallelism == MAX_PARALLELISM
        with pytest.raises(StateFunctionUnavailableError, match="'total'"):
            existing.layout.descriptor("total").reduce_fn(1, 2)
        metadata_location = existing.iceberg_table.metadata_location
    finally:
        existing.close()
    open_table(layout).close()  # the recorded layout matched: nothing was written
    assert open_table().iceberg_table.metadata_location == metadata_location
    with pytest.raises(ValueError, match=r"no state table state\.nope"):
        IcebergStateTable.open_existing(warehouse=warehouse, table_name="nope")


def test_the_recorded_layout_keeps_each_states_current_ttl(open_table, warehouse):
    """Inspection and repairs read the recorded layout: a TTL that was not recorded made their
    entries never expire, and the state browser could not show it."""
    def layout(ttl: TtlConfig | None) -> StateLayout:
        return StateLayout.of(KEY_SCHEMA, [ValueStateDescriptor("count", pa.int64(), ttl=ttl), DESCRIPTORS[1]],
                              MAX_PARALLELISM)

    def recorded() -> list:
        with IcebergStateTable.open_existing(warehouse=warehouse, table_name="op") as t:
            return [d.ttl for d in t.layout.descriptors]

    open_table(layout(TtlConfig(5000))).close()
    assert recorded() == [TtlConfig(5000), None]
    location = open_table(layout(TtlConfig(5000))).iceberg_table.metadata_location
    open_table(layout(TtlConfig(5000))).close()  # the same TTL: nothing written
    assert open_table(layout(TtlConfig(5000))).iceberg_table.metadata_location == location
    open_table(layout(TtlConfig(9000, TtlUpdateType.ON_READ_AND_WRITE))).close()  # changed between runs
    assert recorded() == [TtlConfig(9000, TtlUpdateType.ON_READ_AND_WRITE), None]
    open_table(layout(None)).close()
    assert recorded() == [None, None]


def test_a_table_with_aggregating_state_opens_with_its_recorded_layout(open_table, warehouse):
    """Found by review: the recorded layout's aggregating descriptor took its value type as TTL."""
    from statestore.descriptors import AggregatingStateDescriptor, AverageAggregate

    layout = StateLayout.of(KEY_SCHEMA, [AggregatingStateDescriptor("avg", agg_fn=AverageAggregate())],
                            MAX_PARALLELISM)
    open_table(layout).close()
    with IcebergStateTable.open_existing(warehouse=warehouse, table_name="op") as existing:
        recorded = existing.layout.descriptor("avg")
        assert recorded.value_type == AverageAggregate.accumulator_type and recorded.ttl is None
