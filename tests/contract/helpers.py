"""Helpers of the contract suite: the test layout, state in and out through a real
``StateStore`` (value state ``count`` keyed by a long), and raw segments written with
``statestore.segment.write_segments`` wherever the table says.

Expected state is always a plain dict kept by the test.
"""

from __future__ import annotations

import pyarrow as pa

from statestore import paths
from statestore.descriptors import ValueStateDescriptor
from statestore.keygroups import KeyGroupRange
from statestore.layout import OP_PUT, StateLayout
from statestore.segment import write_segments
from statestore.store import StateStore
from statestore.table import SegmentFile, StateTable

MAX_PARALLELISM = 16
KEY_SCHEMA = pa.schema([("k", pa.int64())])
COUNT = ValueStateDescriptor("count", pa.int64())
LAYOUT = StateLayout.of(KEY_SCHEMA, [COUNT], MAX_PARALLELISM)
ALL_KEY_GROUPS = KeyGroupRange.of(0, MAX_PARALLELISM - 1)
PROBE_KEYS = list(range(40))


def keys(ks) -> pa.Table:
    return pa.table({"k": pa.array(list(ks), pa.int64())})


def write(store: StateStore, changes: dict[int, object], state: str = "count") -> None:
    """Apply {key: value, or None to clear} through the batched API."""
    handle = store.get_state(state)
    puts = {k: v for k, v in changes.items() if v is not None}
    clears = [k for k, v in changes.items() if v is None]
    if puts:
        handle.update_batch(keys(puts), list(puts.values()))
    if clears:
        handle.clear_batch(keys(clears))


def read(store: StateStore, state: str = "count", ks=PROBE_KEYS) -> dict[int, object]:
    values = store.get_state(state).get_batch(keys(ks)).to_pylist()
    return {k: v for k, v in zip(ks, values, strict=True) if v is not None}


def committed_store(backend, changes: dict[int, object], **options) -> StateStore:
    """A store on a fresh table of ``backend`` (``tests.contract.backends``) that committed
    ``changes`` as its newest checkpoint."""
    store = StateStore(backend.open(**options))
    write(store, changes)
    store.checkpoint()
    return store


def write_segment(table: StateTable, checkpoint_id: int, task: int, key_groups: list[int]) -> SegmentFile:
    """A real, uncommitted segment of ``checkpoint_id``: one PUT of ``count`` per key group
    (key ``1000 + key group``, outside ``PROBE_KEYS``), in one partition. The key group is
    the given one, not the key's hash: for tests of the table, which never hashes keys."""
    schema = table.layout.entry_schema
    rows = [{**dict.fromkeys(schema.names), "key_group": kg, "k": 1000 + kg, "state": "count", "op": OP_PUT,
             "checkpoint_id": checkpoint_id, "seq": i, "v_count": checkpoint_id * 1000 + kg}
            for i, kg in enumerate(sorted(key_groups))]
    (segment,) = write_segments(table, pa.Table.from_pylist(rows, schema=schema), checkpoint_id, task, 1, 1000)
    return segment


def commit_next(table: StateTable, groups: list[list[int]] | None = None, **kwargs) -> int:
    """Commit the next checkpoint with one segment per key-group list (default: two tasks)
    and batch id ten times the checkpoint id."""
    cp = table.next_checkpoint_id()
    groups = groups if groups is not None else [[0, 3, 7], [8, 12, 15]]
    segments = [write_segment(table, cp, task, kgs) for task, kgs in enumerate(groups)]
    table.commit_checkpoint(cp, segments, parallelism=max(1, len(groups)), batch_id=cp * 10, **kwargs)
    return cp


def segment_checkpoint_ids(files: set[str]) -> list[int]:
    """Checkpoint ids of the segment files among ``files`` (with repeats), sorted."""
    return sorted(parsed[0] for parsed in map(paths.parse_segment_name, files) if parsed is not None)
