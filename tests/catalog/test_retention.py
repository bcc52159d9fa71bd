"""Retention and garbage collection of Iceberg state tables: expired snapshots, the files only
they referenced, the orphan sweep, stale metadata, and Iceberg files that must never be
deleted. Retention as every StateTable promises it is in tests/contract/test_retention.py."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from pyiceberg.table import TableProperties

from catalog import properties as props
from catalog.gc import DirectorySweep, initial_sweep_start, next_sweep_start, sweep_directory
from catalog.naming import checkpoint_of_commit_file, commit_uuid
from statestore.keygroups import KeyGroupRange
from statestore.paths import (
    COMPACTION_GRACE_CHECKPOINTS,
    COMPACTION_GRACE_SECONDS,
    SCRATCH_OUTPUTS_DIR,
    compaction_file_name,
    output_file_name,
    parse_window_dir,
    segment_file_name,
    window_dirs,
)
from statestore.stored_keys import SUMMARY_SWEPT_BELOW
from tests.catalog.catalog_helpers import (
    MAX_PARALLELISM,
    commit_next,
    file_exists,
    referenced_files,
    snapshot_files,
    table_files,
    write_segment,
)

ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)


def test_keeps_exactly_the_newest_k_checkpoints(open_table):
    table = open_table(retain_checkpoints=3)
    early_lists, early_metadata = set(), set()
    for n in range(10):
        commit_next(table, [[n], [n + 5]])
        if n < 5:
            early_lists.add(table.iceberg_table.current_snapshot().manifest_list.removeprefix("file://"))
            early_metadata.add(table.iceberg_table.metadata_location.removeprefix("file://"))
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [8, 9, 10]
    metadata = table.iceberg_table.metadata
    assert len(metadata.snapshots) == 3 and len(metadata.snapshot_log) == 3
    assert len(metadata.metadata_log) <= props.METADATA_PREVIOUS_VERSIONS_MAX
    assert not any(file_exists(p) for p in early_lists | early_metadata)
    for snapshot in metadata.snapshots:
        assert all(file_exists(p) for p in snapshot_files(table, snapshot))
    # Appends carry every earlier segment forward: all 20 are still live in the newest checkpoint.
    assert len(table.segments(ALL)) == 20
    assert table_files(table) == referenced_files(table)
    for cp in (8, 9, 10):
        table.restore(cp)


def test_manifests_per_snapshot_stay_bounded(open_table):
    table = open_table(retain_checkpoints=2)
    for _ in range(props.MANIFEST_MIN_MERGE_COUNT + 4):
        commit_next(table, [[1]])
    manifests = table.iceberg_table.current_snapshot().manifests(table.iceberg_table.io)
    assert len(manifests) < props.MANIFEST_MIN_MERGE_COUNT
    assert len(table.segments(ALL)) == props.MANIFEST_MIN_MERGE_COUNT + 4
    assert table_files(table) == referenced_files(table)


def test_tagged_snapshot_is_kept_with_its_files(open_table):
    table = open_table(retain_checkpoints=2)
    commit_next(table, [[1]])
    savepoint = table.iceberg_table.current_snapshot()
    table.iceberg_table.manage_snapshots().create_tag(savepoint.snapshot_id, "savepoint-1").commit()
    for _ in range(4):
        commit_next(table, [[2]])
    kept = {s.snapshot_id for s in table.iceberg_table.metadata.snapshots}
    assert savepoint.snapshot_id in kept and len(kept) == 3
    assert all(file_exists(p) for p in snapshot_files(table, savepoint))


def test_collect_garbage_sweeps_orphans_now(open_table):
    """A commit sweeps for orphans at the first commit after open, then now and then (what
    every table promises of orphans: tests/contract/test_retention.py); ``collect_garbage``
    sweeps at once."""
    table = open_table()
    commit_next(table)
    cp = commit_next(table)
    in_flight = write_segment(table, cp + 1, 0, [3])  # the next checkpoint, being written now
    leftover = write_segment(table, cp, 5, [4])  # a failed task's retry leftover of checkpoint 2
    table.collect_garbage()
    assert file_exists(in_flight.path) and not file_exists(leftover.path)
    assert all(file_exists(s.path) for s in table.segments(ALL))


def test_sweep_takes_a_crashed_drivers_callback_files(open_table):
    """A Spark query's callback files under scratch/outputs/ that no callback deleted (the
    driver crashed between the batch's tasks and its callback) go once older than the grace
    period; younger ones (a batch in flight) and files of other names stay."""
    table = open_table()
    commit_next(table)
    run = os.path.join(table.iceberg_table.location().removeprefix("file://"), SCRATCH_OUTPUTS_DIR, "0" * 32)
    os.makedirs(run)
    old, young, foreign = (os.path.join(run, name) for name in (
        output_file_name(3, 1, "a" * 32), output_file_name(4, 1, "b" * 32), "notes.parquet"))
    for path in (old, young, foreign):
        with open(path, "wb") as f:
            f.write(b"x")
    stale = time.time() - COMPACTION_GRACE_SECONDS - 60
    os.utime(old, (stale, stale))
    os.utime(foreign, (stale, stale))
    table.collect_garbage()
    assert not file_exists(old) and file_exists(young) and file_exists(foreign)


def test_foreign_files_are_never_swept(open_table):
    table = open_table()
    commit_next(table)
    window_dir = os.path.dirname(table.segments(ALL)[0].path)
    data_dir = os.path.dirname(window_dir)
    metadata_dir = os.path.join(os.path.dirname(data_dir), "metadata")
    foreign = [os.path.join(data_dir, "00000-0-someone-else.parquet"),
               os.path.join(window_dir, "00000-1-someone-else.parquet"),
               os.path.join(metadata_dir, "6f1a2b3c-0000-4000-8000-000000000001-m0.avro"),
               os.path.join(metadata_dir, "99999-future.metadata.json")]
    for path in foreign:
        with open(path, "wb") as f:
            f.write(b"x")
    commit_next(table)
    table.collect_garbage()
    assert all(file_exists(p) for p in foreign)


def test_stale_metadata_json_is_swept(open_table):
    table = open_table()
    commit_next(table)
    metadata_dir = os.path.dirname(table.iceberg_table.metadata_location.removeprefix("file://"))
    stale = os.path.join(metadata_dir, "00000-0a1b2c3d-lost-race.metadata.json")  # our own lost race
    # A commit that stored its metadata.json beside its last waits and failed before the switch:
    # the current version's number, another file.
    failed = os.path.join(metadata_dir, f"{os.path.basename(table.iceberg_table.metadata_location)[:5]}-"
                                        "0a1b2c3d-failed-commit.metadata.json")
    racing = os.path.join(metadata_dir, "99999-0a1b2c3d-racing.metadata.json")  # a newer version: kept
    with open(table.iceberg_table.metadata_location.removeprefix("file://"), "rb") as current:
        data = current.read()
    for path in (stale, failed, racing):
        with open(path, "wb") as f:
            f.write(data)
    table.collect_garbage()
    assert not file_exists(stale) and not file_exists(failed)
    assert file_exists(racing) and file_exists(table.iceberg_table.metadata_location.removeprefix("file://"))
    assert table.iceberg_table.properties[TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED] == "true"


def test_a_torn_metadata_json_of_a_killed_commit_is_swept_and_a_damaged_one_kept(open_table):
    """A commit killed while storing its metadata.json leaves a prefix of it (empty, or cut
    anywhere): of a version up to the current one, no commit can switch to it, so the sweep takes
    it; one damaged inside, or of a newer version, stays."""
    table = open_table()
    commit_next(table)
    current = table.iceberg_table.metadata_location.removeprefix("file://")
    metadata_dir, version = os.path.dirname(current), os.path.basename(current)[:5]
    with open(current, "rb") as f:
        data = f.read()
    cut_in_a_string = data.index(b'"table-uuid"') + 5
    torn = {os.path.join(metadata_dir, f"{version}-0a1b2c3d-torn-{n}.metadata.json"): content
            for n, content in enumerate([b"", data[:1], data[:cut_in_a_string], data[:len(data) // 2], data[:-1]])}
    kept = {os.path.join(metadata_dir, f"{version}-0a1b2c3d-damaged.metadata.json"): data.replace(b":", b";", 1),
            os.path.join(metadata_dir, "99999-0a1b2c3d-torn-racing.metadata.json"): data[:len(data) // 2]}
    for path, content in {**torn, **kept}.items():
        with open(path, "wb") as f:
            f.write(content)
    table.collect_garbage()
    assert [p for p in torn if file_exists(p)] == []
    assert all(file_exists(p) for p in kept) and file_exists(current)


def test_commit_files_carry_their_checkpoint_id(open_table):
    table = open_table()
    cp = commit_next(table)
    snapshot = table.iceberg_table.current_snapshot()
    assert checkpoint_of_commit_file(snapshot.manifest_list) == cp
    manifests = snapshot.manifests(table.iceberg_table.io)
    assert [checkpoint_of_commit_file(m.manifest_path) for m in manifests] == [cp]
    assert checkpoint_of_commit_file(f"snap-1-0-{commit_uuid(2**40)}.avro") == 2**40
    assert checkpoint_of_commit_file("snap-1-0-6f1a2b3c-0000-4000-8000-000000000001.avro") is None


def test_a_reader_following_a_writer_keeps_only_the_retained_manifests(open_table):
    """A reader that restores after each of a writer's checkpoints (never commits, so never
    expires) used to keep one manifest list and manifest per checkpoint it ever opened."""
    writer = open_table(retain_checkpoints=3)
    commit_next(writer, [[0]])
    reader = open_table(retain_checkpoints=3)
    for n in range(12):
        commit_next(writer, [[n]])
        reader.restore()
        assert reader.current_checkpoint().checkpoint_id == writer.current_checkpoint().checkpoint_id
    cache = reader._cache
    retained = {s.manifest_list for s in reader.iceberg_table.metadata.snapshots}
    assert set(cache._lists) <= retained
    assert set(cache._entries) <= {m.manifest_path for p in cache._lists.values() for m in p}
    assert len(reader.segments(ALL)) == len(writer.segments(ALL)) == 13


def _commit_at(table, checkpoint_id: int) -> None:
    """Commit checkpoint ``checkpoint_id`` (ids may jump) with one segment."""
    table.commit_checkpoint(checkpoint_id, [write_segment(table, checkpoint_id, 0, [0, 3])], parallelism=1,
                            batch_id=checkpoint_id)


def test_the_sweep_lists_only_the_checkpoint_directories_written_since_the_last_one(open_table):
    table = open_table()
    _commit_at(table, 5)  # the first sweep: no mark on record, the whole data directory
    crashed = write_segment(table, 6, 9, [1]).path  # a commit that never happened
    assert os.path.basename(os.path.dirname(crashed)) == "c000000000000"
    _commit_at(table, 300)
    table.collect_garbage()  # the directories of checkpoints 0-300
    assert not file_exists(crashed)
    mark = int(table.iceberg_table.current_snapshot().summary.additional_properties[SUMMARY_SWEPT_BELOW])
    assert mark == 0  # the commit of 300 carries where the sweep stood before it

    stalled = write_segment(table, 10, 9, [1]).path  # a process writing long after its checkpoint
    recent = write_segment(table, 290, 9, [1]).path
    legacy = os.path.join(os.path.dirname(os.path.dirname(recent)), os.path.basename(stalled))
    os.rename(stalled, legacy)  # where a table written before the directories kept its segments
    stalled = write_segment(table, 11, 9, [1]).path
    _commit_at(table, 310)
    mark = int(table.iceberg_table.current_snapshot().summary.additional_properties[SUMMARY_SWEPT_BELOW])
    assert mark == 300 - COMPACTION_GRACE_CHECKPOINTS
    table.close()

    again = open_table()  # a new writer starts from the mark: its first sweep lists c200 and c300
    _commit_at(again, 320)
    again.wait_for_deletes()
    assert not file_exists(recent)
    assert file_exists(stalled) and file_exists(legacy)
    again.collect_garbage(full=True)  # `icestate sweep`: every directory, and data/ itself
    assert not file_exists(stalled) and not file_exists(legacy)
    assert table_files(again) == referenced_files(again)


def test_a_directory_sweep_deletes_exactly_its_orphans_and_keeps_an_unsettled_compaction_in_view(tmp_path):
    directory = tmp_path / "t" / "data" / "c000000000100"
    directory.mkdir(parents=True)
    settled_before = time.time() - COMPACTION_GRACE_SECONDS
    names = {"crashed": segment_file_name(130, 0, 0), "live": segment_file_name(140, 0, 0),
             "in_flight": segment_file_name(501, 0, 0), "young_cmp": compaction_file_name(120, 0),
             "old_cmp": compaction_file_name(110, 0), "other": "notes.parquet"}
    for name in names.values():
        (directory / name).write_bytes(b"x")
    os.utime(directory / names["old_cmp"], (settled_before - 60, settled_before - 60))
    work = DirectorySweep(str(tmp_path / "t"), (), str(directory), frozenset({str(directory / names["live"])}),
                          newest=500, settled_before=settled_before)
    found = sweep_directory(work)
    assert sorted(found.orphans) == sorted(str(directory / names[k]) for k in ("crashed", "old_cmp"))
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        names[k] for k in ("live", "in_flight", "young_cmp", "other"))
    assert (found.listed, found.undecided_from, found.pid) == (6, 120, os.getpid())
    # a young compaction output a checkpoint already holds is for expiry: it keeps no directory in view
    held = DirectorySweep(str(tmp_path / "t"), (), str(directory), frozenset(
        {str(directory / names[k]) for k in ("live", "young_cmp")}), newest=500, settled_before=settled_before)
    assert sweep_directory(held).undecided_from is None
    # the next incremental sweep starts at that compaction's directory until it settled
    assert next_sweep_start(500, [found.undecided_from, None]) == 120
    assert next_sweep_start(500, [None]) == 500 - COMPACTION_GRACE_CHECKPOINTS and next_sweep_start(3, []) == 0
    assert window_dirs(284, 320) == ["c000000000200", "c000000000300"]
    assert window_dirs(0, 0) == ["c000000000000"] and window_dirs(5, 4) == []
    assert parse_window_dir("s3://b/t/data/c000000000300/") == 300
    assert parse_window_dir("c000000000301") is None and parse_window_dir("branches") is None


def test_a_new_writer_starts_at_the_mark_of_the_newest_checkpoint_and_ignores_one_that_is_not_a_number():
    def snapshot(seq: int, mark: str | None):
        props = {} if mark is None else {SUMMARY_SWEPT_BELOW: mark}
        return SimpleNamespace(sequence_number=seq, timestamp_ms=seq, summary=SimpleNamespace(
            additional_properties=props))

    def start(*marks):
        return initial_sweep_start(SimpleNamespace(snapshots=[snapshot(i + 1, m) for i, m in enumerate(marks)]))

    assert start() is None and start(None, None) is None
    assert start("300", "284") == 284  # gone down (a compaction output still undecided): the newest says
    assert start("284", None) == 284
    assert start("7", "²") == 7 and start("x") is None and start("1" * 40) is None


def test_a_full_sweep_beside_a_writer_whose_retention_deleted_what_it_read_reads_the_metadata_again(open_table):
    writer = open_table(retain_checkpoints=2)
    for _ in range(3):
        commit_next(writer)
    sweeper = open_table(retain_checkpoints=2)  # another process's view: checkpoints 2 and 3
    for _ in range(4):
        commit_next(writer)  # expires 2 and 3 and deletes their manifest lists
    writer.wait_for_deletes()
    orphan = os.path.join(os.path.dirname(writer.segments(ALL)[0].path), segment_file_name(1, 9, 0))
    with open(orphan, "wb") as f:
        f.write(b"x")
    result = sweeper.sweep()
    assert result.deleted >= 1 and not file_exists(orphan)
    assert table_files(writer) == referenced_files(writer)
