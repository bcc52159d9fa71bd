"""Committing checkpoints to Iceberg: one snapshot per checkpoint and its summary, argument
and footer validation, and races with other writers. What every StateTable promises (commit
shape, visibility, pruning, monotonic ids, missing or damaged segments) is in tests/contract."""

from __future__ import annotations

import dataclasses
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.io.pyarrow import parquet_file_to_data_file

from statestore import StateStore, stored_keys
from statestore.errors import CommitConflictError, CorruptSegmentError
from statestore.keygroups import KeyGroupRange
from statestore.table import SegmentFile
from tests.catalog.catalog_helpers import LAYOUT, MAX_PARALLELISM, commit_next, entries, write_segment

ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)


def test_checkpoint_is_one_snapshot_with_summary(open_table):
    table = open_table()
    cp = table.next_checkpoint_id()
    segments = [write_segment(table, cp, t, kgs) for t, kgs in enumerate([[0, 1], [5, 6, 7], [9], [14, 15]])]
    info = table.commit_checkpoint(cp, segments, parallelism=4, batch_id=41, properties={"source": "kafka"})
    ice = table.iceberg_table
    assert len(ice.metadata.snapshots) == 1
    snapshot = ice.current_snapshot()
    summary = snapshot.summary.additional_properties
    assert summary[stored_keys.SUMMARY_CHECKPOINT_ID] == str(cp)
    assert summary[stored_keys.SUMMARY_BATCH_ID] == "41"
    assert summary[stored_keys.SUMMARY_PARALLELISM] == "4"
    assert summary[stored_keys.SUMMARY_MAX_PARALLELISM] == str(MAX_PARALLELISM)
    assert summary["added-data-files"] == "4" and summary["source"] == "kafka"
    assert info.snapshot_id == snapshot.snapshot_id
    assert ice.properties[stored_keys.LAST_CHECKPOINT_ID] == str(cp)


def test_checkpoint_id_error_names_the_way_out(open_table):
    table = open_table()
    cp = commit_next(table)
    segment = write_segment(table, cp, 0, [1])
    with pytest.raises(ValueError, match="next_checkpoint_id"):
        table.commit_checkpoint(cp, [segment], parallelism=1)
    with pytest.raises(ValueError, match="above every committed"):
        table.commit_checkpoint(cp - 1, [], parallelism=1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"parallelism": 0}, "parallelism"),
        ({"parallelism": MAX_PARALLELISM + 1}, "parallelism"),
        ({"batch_id": -1}, "batch_id"),
        ({"properties": {stored_keys.SUMMARY_CHECKPOINT_ID: "9"}}, "reserved"),
        ({"properties": {"statestore.checkpoint-id": "9"}}, "reserved"),  # the name older versions stored
        ({"properties": {"icestate.operator-state": "[]"}}, "reserved"),
        ({"properties": {"statestore.parallelism": "2"}}, "reserved"),
        ({"properties": {"total-records": "9"}}, "reserved"),
    ],
)
def test_commit_arguments_are_validated(open_table, change, message):
    table = open_table()
    kwargs = {"parallelism": 1, **change}
    with pytest.raises(ValueError, match=message):
        table.commit_checkpoint(1, [write_segment(table, 1, 0, [1])], **kwargs)


def test_segment_must_belong_to_the_checkpoint_and_one_partition(open_table):
    table = open_table(partition_width=4)
    other = write_segment(table, 2, 0, [1])
    with pytest.raises(ValueError, match="does not belong to checkpoint 1"):
        table.commit_checkpoint(1, [other], parallelism=1)
    seg = write_segment(table, 1, 0, [1])
    with pytest.raises(ValueError, match="committed twice"):
        table.commit_checkpoint(1, [seg, seg], parallelism=1)
    spanning = SegmentFile(seg.path, 1, 1, 5, seg.record_count, seg.size_bytes)
    with pytest.raises(ValueError, match="one partition"):
        table.commit_checkpoint(1, [spanning], parallelism=1)
    assert table.iceberg_table.metadata.snapshots == []


def _replace_with_other_schema(path: str) -> None:
    pq.write_table(pa.table({"key_group": pa.array([1], pa.int32()), "surprise": ["x"]}), path)


def _replace_with_more_rows(path: str) -> None:
    pq.write_table(entries(LAYOUT, 2, [1, 1, 1]), path)


@pytest.mark.parametrize("damage", [_replace_with_other_schema, _replace_with_more_rows])
def test_segment_of_another_schema_or_footer_commits_nothing(open_table, damage):
    """The footer is checked against the table schema and the declared shape (a missing,
    truncated or grown file: tests/contract)."""
    table = open_table()
    first = commit_next(table)
    metadata_location = table.iceberg_table.metadata_location
    before = table.segments(ALL)
    good = write_segment(table, 2, 0, [1, 2])
    bad = write_segment(table, 2, 1, [3])
    damage(bad.path)
    with pytest.raises(CorruptSegmentError, match=os.path.basename(bad.path)):
        table.commit_checkpoint(2, [good, bad], parallelism=2)
    assert table.iceberg_table.refresh().metadata_location == metadata_location
    assert table.current_checkpoint().checkpoint_id == first and table.segments(ALL) == before
    assert table.next_checkpoint_id() == 2


def test_second_driver_with_the_same_id_gets_a_conflict(open_table):
    mine = open_table()
    commit_next(mine)
    theirs = open_table()
    commit_next(theirs)
    with pytest.raises(CommitConflictError, match="two drivers"):
        commit_next(mine)


def test_commit_follows_a_non_checkpoint_append_of_another_writer(open_table):
    """A writer that appends without a checkpoint id (as compaction will) is followed, not undone."""
    table = open_table()
    commit_next(table)
    other = open_table().iceberg_table
    extra = write_segment(table, 1, 9, [4])  # named like a segment of checkpoint 1, added by "compaction"
    with other.transaction() as tx:
        append = tx.update_snapshot().fast_append()
        append.append_data_file(parquet_file_to_data_file(other.io, other.metadata, "file://" + extra.path))
        append.commit()
    cp = commit_next(table)
    ice = table.iceberg_table
    assert ice.current_snapshot().parent_snapshot_id == other.current_snapshot().snapshot_id
    assert extra.path in {s.path for s in table.segments(ALL)}
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [1, cp]


def test_a_segment_reported_with_its_footer_commits_the_entry_read_from_the_file(open_table):
    """Segments carry the footer their writer had in memory: the commit builds the same Iceberg
    entry as from the file itself, with one existence-and-size check instead of reading it back."""
    table = open_table()
    store = StateStore(table, task_index=0, parallelism=1)
    store.get_state("count").update_batch(pa.table({"user": [f"u{i}" for i in range(300)]}),
                                          pa.array(range(300), pa.int64()))
    cp = table.next_checkpoint_id()
    (segment,) = store.flush(cp)
    assert segment.footer is not None
    with pytest.raises(CorruptSegmentError, match="its writer wrote"):
        table.commit_checkpoint(cp, [dataclasses.replace(segment, size_bytes=segment.size_bytes + 1)],
                                parallelism=1)
    table.commit_checkpoint(cp, [segment], parallelism=1)
    store.checkpoint_complete(cp)
    uri = table.to_uri(segment.path)
    (committed,) = [e.data_file for e in table.snapshot.manifests(table.iceberg_table.io)[0]
                    .fetch_manifest_entry(table.iceberg_table.io)]
    from_file = parquet_file_to_data_file(table.iceberg_table.io, table.iceberg_table.metadata, uri)
    for name in ("record_count", "file_size_in_bytes", "lower_bounds", "upper_bounds", "null_value_counts",
                 "value_counts", "column_sizes", "split_offsets"):
        assert getattr(committed, name) == getattr(from_file, name), name


def _two_stores_for_task_zero(table):
    """Two stores that both believe they run task 0 of 1, each writing key "a" (and one more)."""
    from statestore import StateStore

    stores = [StateStore(table, task_index=0, parallelism=1) for _ in range(2)]
    for n, store in enumerate(stores):
        store.get_state("count").update_batch(pa.table({"user": ["a", f"only{n}"]}), [10 + n, 1])
    cp = table.next_checkpoint_id()
    return stores, cp, [seg for store in stores for seg in store.flush(cp)]


def test_two_stores_for_one_task_cannot_both_commit(open_table):
    """Issue 14, defect 6: a checkpoint refuses two segments of one task and partition, and
    segments of different tasks whose key groups overlap; nothing is committed."""
    table = open_table()
    first = commit_next(table)
    _, cp, segments = _two_stores_for_task_zero(table)
    with pytest.raises(ValueError, match="two stores ran as the same task"):
        table.commit_checkpoint(cp, segments, parallelism=1)
    other = write_segment(table, cp, 1, [segments[0].key_group_min])
    with pytest.raises(ValueError, match="a key group belongs to one task per checkpoint"):
        table.commit_checkpoint(cp, [segments[0], other], parallelism=2)
    with pytest.raises(ValueError, match="parallelism 1"):
        table.commit_checkpoint(cp, [other], parallelism=1)
    assert table.current_checkpoint().checkpoint_id == first


def test_a_tie_left_by_an_older_writer_reads_one_value_per_key(open_table, monkeypatch):
    """Issue 14, defect 6: where two stores' entries of a key tie on (checkpoint, seq) (a table
    committed before the check above), a batched read still returns one value per key."""
    from catalog.commit import CheckpointCommitter
    from statestore import StateStore

    table = open_table()
    monkeypatch.setattr(CheckpointCommitter, "_check_one_owner", lambda *args: None)
    _, cp, segments = _two_stores_for_task_zero(table)
    table.commit_checkpoint(cp, segments, parallelism=1)
    monkeypatch.undo()
    values = StateStore(table).get_state("count").get_batch(pa.table({"user": ["a", "only0"]}))
    assert len(values) == 2 and values.to_pylist()[1] == 1 and values.to_pylist()[0] in (10, 11)


def test_a_commit_computes_the_staged_metadata_once_per_staging_step(open_table, monkeypatch):
    """pyiceberg's ``Transaction.table_metadata`` applies every staged update and deep-copies
    the whole metadata at each read; a checkpoint's commit read it some 18 times
    (``StagedTransaction``). It now computes it once per staging step (the append, the
    checkpoint property, the expiry, the requirement pyiceberg adds), and what it returns is
    pyiceberg's own result for the same staged updates."""
    from pyiceberg.table import Transaction

    from catalog.commit import StagedTransaction

    table = open_table(retain_checkpoints=2)
    for _ in range(3):
        commit_next(table)
    computed = []
    original = Transaction.table_metadata

    def counted(tx):
        computed.append(len(tx._updates))
        return original.fget(tx)

    monkeypatch.setattr(Transaction, "table_metadata", property(counted))
    commit_next(table)  # an append, the property and an expiry (retain 2)
    assert 0 < len(computed) <= 6, computed  # 18 without the memo
    assert len(computed) == len(set(computed)), f"the same staged updates computed twice: {computed}"
    monkeypatch.setattr(Transaction, "table_metadata", original)

    tx = StagedTransaction(table.iceberg_table)
    first = tx.table_metadata
    assert tx.table_metadata is first  # nothing staged since
    tx.set_properties({"example": "1"})
    staged = tx.table_metadata
    assert staged is not first and staged.properties["example"] == "1"
    fresh = original.fget(tx)  # pyiceberg's own computation of the same staged updates
    assert staged.model_dump(exclude={"last_updated_ms"}) == fresh.model_dump(exclude={"last_updated_ms"})
