"""Helpers of the catalog tests: the test layout, real Parquet segments written with pyarrow
(``layout.entry_schema`` cast to ``file_schema()``), and listings of a table's files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from catalog import IcebergStateTable
from catalog.fileio import wait_for_deletes
from statestore.descriptors import MapStateDescriptor, ValueStateDescriptor
from statestore.layout import OP_PUT, StateLayout
from statestore.table import SegmentFile

MAX_PARALLELISM = 16
KEY_SCHEMA = pa.schema([("user", pa.string())])
DESCRIPTORS = (ValueStateDescriptor("count", pa.int64()), MapStateDescriptor("seen", pa.int32(), key_type=pa.string()))
LAYOUT = StateLayout.of(KEY_SCHEMA, DESCRIPTORS, MAX_PARALLELISM)


def entries(layout: StateLayout, checkpoint_id: int, key_groups: list[int]) -> pa.Table:
    """One PUT of the first value state per key group (key ``u<kg>``), in entry_schema."""
    value_state = layout.descriptors[0]
    n = len(key_groups)
    cols = {f.name: pa.nulls(n, f.type) for f in layout.entry_schema}
    cols.update({
        "key_group": pa.array(key_groups, pa.int32()),
        layout.key_names[0]: pa.array([f"u{kg}" for kg in key_groups], layout.key_schema.field(0).type),
        "state": pa.array([value_state.name] * n),
        "op": pa.array([OP_PUT] * n, pa.int8()),
        "checkpoint_id": pa.array([checkpoint_id] * n, pa.int64()),
        "seq": pa.array(range(n), pa.int64()),
        value_state.value_column: pa.array([checkpoint_id * 1000 + kg for kg in key_groups], value_state.value_type),
    })
    return pa.table(cols, schema=layout.entry_schema)


def write_segment(table: IcebergStateTable, checkpoint_id: int, task: int, key_groups: list[int]) -> SegmentFile:
    """A real segment of ``key_groups`` (one partition), written where the table says."""
    key_groups = sorted(key_groups)
    data = entries(table.layout, checkpoint_id, key_groups).cast(table.file_schema())
    path = table.new_segment_path(checkpoint_id, task, table.partition_of(key_groups[0]))
    pq.write_table(data, path, filesystem=table.filesystem)
    size = table.filesystem.get_file_info(path).size
    return SegmentFile(path, checkpoint_id, key_groups[0], key_groups[-1], len(key_groups), size)


def commit_next(table: IcebergStateTable, groups: list[list[int]] | None = None, **kwargs) -> int:
    """Commit the next checkpoint with one segment per key-group list (default: two tasks)."""
    cp = table.next_checkpoint_id()
    groups = groups if groups is not None else [[0, 3, 7], [8, 12, 15]]
    segments = [write_segment(table, cp, task, kgs) for task, kgs in enumerate(groups)]
    table.commit_checkpoint(cp, segments, parallelism=max(1, len(groups)), batch_id=cp * 10, **kwargs)
    return cp


def table_files(table: IcebergStateTable) -> set[str]:
    """Paths of every file under the table's location (once the garbage deletes under way are done)."""
    wait_for_deletes()
    root = table.filesystem.normalize_path(table.location.removeprefix("file://"))
    return {str(p) for p in Path(root).rglob("*") if p.is_file()}


def referenced_files(table: IcebergStateTable) -> set[str]:
    """Paths of every file the table metadata references: data files, manifests and manifest
    lists of every snapshot, the current metadata.json and those in the metadata log."""
    ice = table.iceberg_table
    io = ice.io
    metadata = ice.metadata
    uris = {ice.metadata_location, *(e.metadata_file for e in metadata.metadata_log)}
    for snapshot in metadata.snapshots:
        uris.add(snapshot.manifest_list)
        manifests = snapshot.manifests(io)
        uris.update(m.manifest_path for m in manifests)
        uris.update(e.data_file.file_path for m in manifests for e in m.fetch_manifest_entry(io))
    return {u.removeprefix("file://") for u in uris}


def snapshot_files(table: IcebergStateTable, snapshot) -> set[str]:
    """Paths of a snapshot's live data files, its manifests and its manifest list (read with pyiceberg)."""
    io = table.iceberg_table.io
    manifests = snapshot.manifests(io)
    uris = {snapshot.manifest_list, *(m.manifest_path for m in manifests)}
    uris.update(e.data_file.file_path for m in manifests for e in m.fetch_manifest_entry(io))
    return {u.removeprefix("file://") for u in uris}


def file_exists(path: str) -> bool:
    """Whether ``path`` is a file, once the garbage deletes under way are done."""
    wait_for_deletes()
    return os.path.isfile(path)
