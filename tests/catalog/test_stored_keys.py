"""Stored keys: new tables and snapshots use the ``icestate.`` names; a table an older version
wrote with its ``statestore.`` names keeps working in every operation.

Strategy: build a table with the current code (checkpoints with keyed and operator state,
a batch id, a savepoint, a fork, a partition width), close it, and rewrite its current
metadata file the way an older version wrote it: every key that version stored under
``statestore.`` (table properties, the ``@<branch>`` properties, checkpoint summaries) is
renamed back, the rest is untouched. Then open, restore, commit more checkpoints, run
retention and read, and check that nothing is lost and new keys are written under the
current names.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest

from catalog import IcebergStateTable
from statestore import stored_keys
from statestore.descriptors import ValueStateDescriptor
from statestore.errors import StateTableMismatchError
from statestore.layout import StateLayout
from statestore.operator_state import OperatorStateDescriptor, OperatorStateStore, Redistribution
from statestore.store import StateStore
from tests.catalog.catalog_helpers import DESCRIPTORS, KEY_SCHEMA, LAYOUT, MAX_PARALLELISM

# What versions before the rename stored under "statestore." (the names, written out here
# on purpose rather than derived from the code under test).
OLD_KEYS = re.compile(
    r'"icestate\.(max-parallelism|key-schema|layout|partition-width|last-checkpoint-id(?:@[^"]+)?'
    r'|fork-base@[^"]+|checkpoint-id|batch-id|parallelism|operator-state|compaction)"'
)
USERS = ("ann", "bob", "cyd", "dan")
OFFSETS = OperatorStateDescriptor("offsets", pa.int64(), Redistribution.SPLIT)


def _rewrite_as_old_version(table: IcebergStateTable) -> None:
    table.iceberg_table.refresh()
    path = Path(table.iceberg_table.metadata_location.removeprefix("file://"))
    text = path.read_text()
    old = OLD_KEYS.sub(lambda m: f'"statestore.{m.group(1)}"', text)
    assert old != text and not OLD_KEYS.search(old)
    path.write_text(old)


def _commit(table: IcebergStateTable, counts: dict[str, int], offsets: list[int], batch_id: int) -> int:
    """One checkpoint: ``counts`` as the value state, ``offsets`` as the operator state."""
    store = StateStore(table)
    count = store.get_state("count")
    for user, n in counts.items():
        store.set_current_key(user)
        count.update(n)
    cp = table.next_checkpoint_id()
    segments = store.flush(cp)
    operator = OperatorStateStore(table, [OFFSETS])
    operator.get_list_state(OFFSETS).update(offsets)
    table.commit_checkpoint(cp, segments, parallelism=1, batch_id=batch_id, operator_state=[operator.flush(cp)],
                            properties={stored_keys.QUERY_ID: "q-1"})
    store.checkpoint_complete(cp)
    store.close()
    return cp


def _read(table: IcebergStateTable) -> tuple[dict[str, int | None], list[int]]:
    store = StateStore(table)
    count = store.get_state("count")
    counts = {}
    for user in USERS:
        store.set_current_key(user)
        counts[user] = count.get()
    store.close()
    return counts, OperatorStateStore(table, [OFFSETS]).get_list_state(OFFSETS).get()


def _views(table: IcebergStateTable) -> dict:
    """What a reader sees of the table: its checkpoints, ids, references, and the state at each checkpoint."""
    listed = table.list_checkpoints()
    seen = {"checkpoints": listed, "next": table.next_checkpoint_id(), "current": table.current_checkpoint(),
            "savepoints": table.savepoints(), "forks": table.forks(), "at_fork_point": table.at_fork_point()}
    for info in listed:
        table.restore(info.checkpoint_id)
        seen[info.checkpoint_id] = _read(table)
    table.restore()
    return seen


def _old_table(open_table) -> tuple[list[int], dict, dict]:
    """The main line's checkpoint ids, and what main and the fork "exp" show, of a table
    rewritten to the old names."""
    table = open_table(partition_width=8, retain_checkpoints=3)
    ids = [_commit(table, {"ann": 1, "bob": 1}, [10], batch_id=100),
           _commit(table, {"ann": 2, "cyd": 1}, [20], batch_id=101),
           _commit(table, {"dan": 1}, [30], batch_id=102)]
    table.savepoint("before-upgrade", ids[1])
    table.fork("exp", ids[0])
    fork = open_table(branch="exp")
    _commit(fork, {"ann": 100}, [99], batch_id=200)
    main_view, fork_view = _views(table), _views(fork)
    _rewrite_as_old_version(table)
    table.close()
    fork.close()
    return ids, main_view, fork_view


def test_new_tables_and_checkpoints_store_only_icestate_names(open_table):
    table = open_table()
    _commit(table, {"ann": 1}, [1], batch_id=7)
    table.fork("exp")
    ice = table.iceberg_table
    ice.refresh()
    stored = [*ice.properties, *ice.current_snapshot().summary.additional_properties]
    ours = [k for k in stored if k.startswith(("icestate.", "statestore."))]
    assert ours and all(k.startswith("icestate.") for k in ours), ours
    assert {stored_keys.LAYOUT, stored_keys.fork_base_key("exp"), stored_keys.SUMMARY_OPERATOR_STATE} <= set(ours)


def test_a_table_written_with_the_old_names_opens_restores_commits_and_collects(open_table):
    ids, main_view, _ = _old_table(open_table)
    table = open_table(retain_checkpoints=3)
    assert _views(table) == main_view
    info = table.current_checkpoint()
    assert (info.checkpoint_id, info.batch_id, info.parallelism, info.max_parallelism) == (ids[2], 102, 1, 16)
    assert info.properties == {stored_keys.QUERY_ID: "q-1"}  # the old reserved names are not user properties
    assert table.partition_of(9) == 1  # the old partition-width property (8)
    assert main_view[ids[2]] == ({"ann": 2, "bob": 1, "cyd": 1, "dan": 1}, [30])
    new = [_commit(table, {"bob": 5 + i}, [40 + i], batch_id=103 + i) for i in range(4)]
    assert new[0] == main_view["next"]
    assert [c.checkpoint_id for c in table.list_checkpoints()] == new[-3:]  # the old-named ones expired
    assert _read(table) == ({"ann": 2, "bob": 8, "cyd": 1, "dan": 1}, [43])
    ice = table.iceberg_table
    assert ice.properties[stored_keys.LAST_CHECKPOINT_ID] == str(new[-1])
    assert stored_keys.SUMMARY_CHECKPOINT_ID in ice.current_snapshot().summary.additional_properties
    table.collect_garbage()
    assert table.savepoints() == main_view["savepoints"]
    table.restore(savepoint="before-upgrade")
    assert _read(table) == main_view[ids[1]]
    table.close()
    assert open_table(retain_checkpoints=3, checkpoint_id=new[-1]).current_checkpoint().batch_id == 106


def test_a_fork_written_with_the_old_names_keeps_its_ids_and_base(open_table):
    ids, main_view, fork_view = _old_table(open_table)
    fork = open_table(branch="exp")
    assert _views(fork) == fork_view
    fork.restore(ids[0])
    assert fork.at_fork_point()  # the old fork-base@exp
    fork.restore()
    assert _commit(fork, {"ann": 101}, [98], batch_id=201) == fork_view["next"]  # the old last-checkpoint-id@exp
    fork.close()
    main = open_table()
    assert main.forks() != main_view["forks"] and set(main.forks()) == {"exp"}
    main.remove_fork("exp")  # removes the fork's properties, by old and new names, with the branch
    properties = main.iceberg_table.properties
    assert not [k for k in properties if k.endswith("@exp")], properties


def test_the_old_layout_properties_are_validated_and_evolved(open_table, warehouse):
    _old_table(open_table)
    with pytest.raises(StateTableMismatchError, match="max_parallelism=16"):
        open_table(StateLayout.of(KEY_SCHEMA, DESCRIPTORS, MAX_PARALLELISM * 2))
    with pytest.raises(StateTableMismatchError, match="key columns"):
        open_table(StateLayout.of(pa.schema([("account", pa.string())]), DESCRIPTORS, MAX_PARALLELISM))
    grown = StateLayout.of(KEY_SCHEMA, [*DESCRIPTORS, ValueStateDescriptor("total", pa.int64())], MAX_PARALLELISM)
    open_table(grown).close()
    existing = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    try:
        assert [d.name for d in existing.layout.descriptors] == ["count", "seen", "total"]
    finally:
        existing.close()


def test_a_table_with_old_names_opens_for_inspection(open_table, warehouse):
    ids, _, _ = _old_table(open_table)
    existing = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    try:
        assert [(d.name, d.kind) for d in existing.layout.descriptors] == [(d.name, d.kind) for d in LAYOUT.descriptors]
        assert existing.layout.max_parallelism == MAX_PARALLELISM
        assert existing.current_checkpoint().checkpoint_id == ids[2]
    finally:
        existing.close()


def test_checkpoint_properties_may_not_use_a_reserved_key_by_either_name(open_table):
    table = open_table()
    for key in sorted(stored_keys.RESERVED_SUMMARY_KEYS):
        for name in stored_keys.stored_names(key):
            with pytest.raises(ValueError, match="reserved"):
                table.commit_checkpoint(table.next_checkpoint_id(), [], parallelism=1, properties={name: "1"})
    # Other names under either prefix stay free, as before the rename (a query records its own).
    info = table.commit_checkpoint(table.next_checkpoint_id(), [], parallelism=1,
                                   properties={stored_keys.QUERY_WATERMARK_MS: "5", "statestore.note": "x"})
    assert info.properties == {stored_keys.QUERY_WATERMARK_MS: "5", "statestore.note": "x"}
