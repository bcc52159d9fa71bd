"""The commit of one checkpoint to one branch of a state table: validate, stage, switch, retry.

Role: turn a checkpoint's segment files and operator state files into one Iceberg snapshot
on a branch (``main`` or a fork), in one catalog commit. ``CheckpointCommitter`` does, in
order (crash points, from ``statestore.faults``, in capitals):

1. ``check_args``, ``data_file``, ``summary``: validate the arguments and the segment
   files (exist, readable, of the table's schema, as declared) into Iceberg DataFiles and
   the snapshot summary (``statestore.stored_keys``);
2. ``commit``: plan the parent (the opened snapshot; rolling the branch back to it first
   when the table was restored to an older checkpoint), stage one merge append and, in the
   same transaction, the expiry retention asks for; COMMIT_METADATA_WRITTEN fires inside
   the catalog call that switches the table to the new metadata. Lost races are retried
   (``COMMIT_ATTEMPTS_MAX``) on fresh metadata.

Invariants: a checkpoint's id is above every id committed on its branch (for main, to the
table); a commit never re-parents onto checkpoints this writer did not commit (that is a
second driver: ``CommitConflictError``); pyiceberg's own commit retry is off (it would
re-parent the snapshot on the head and drop a staged rollback, ``catalog.properties``);
nothing is committed unless the whole checkpoint is.

Thread safety: none. One committer per opened table; one driver writes a branch. Writers
of other branches may commit concurrently: their commits surface as races, retried here.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import sys
import time
import uuid
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io.pyarrow import parquet_file_to_data_file
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table, Transaction
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Snapshot, ancestors_of
from pyiceberg.table.update.snapshot import ExpireSnapshots, ManageSnapshots

from catalog import properties as props
from catalog.fileio import UPLOADS, StateFileIO, metadata_json_gate, submit_io
from catalog.manifests import FileEntry, ManifestCache, file_entry
from catalog.naming import Locations, commit_uuid
from catalog.retention import (
    checkpoint_id_of,
    newest_checkpoint_id,
    plan_retention,
    unreferenced_files,
    unreferenced_operator_files,
)
from statestore import stored_keys
from statestore.errors import CommitConflictError, CorruptSegmentError
from statestore.faults import COMMIT_METADATA_WRITTEN, crash_point
from statestore.layout import StateLayout
from statestore.operator_state import OperatorStateFile
from statestore.paths import parse_operator_name, parse_segment_name
from statestore.table import SegmentFile

logger = logging.getLogger(__name__)

COMMIT_ATTEMPTS_MAX = 4
COMMIT_RETRY_WAIT_MS = 50
FOOTER_READS_MAX = 16  # segment footers read at once while a commit validates its segments


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its snapshot, the UUID its commit files are named after, and
    the files its staged expiry left unreferenced (to delete now that the commit is through)."""

    snapshot: Snapshot
    commit_uuid: uuid.UUID
    unreferenced: list[str]


class CheckpointCommitter:
    """Validates and commits checkpoints to ``branch`` of ``table`` (see the module docstring)."""

    def __init__(self, table: Table, branch: str, layout: StateLayout, locations: Locations, cache: ManifestCache,
                 key_group_field_id: int, partition_width: int, retain: int):
        self._table = table
        self._branch = branch
        self._layout = layout
        self._locations = locations
        self._cache = cache
        self._key_group_field_id = key_group_field_id
        self._width = partition_width
        self._retain = retain
        self._name = ".".join(table.name())
        # Set (from any thread) when another writer of the table is known to have committed:
        # the next commit reads the metadata again first (``IcebergStateTable.note_outside_commit``).
        self.outside_commit = False

    # --- what a checkpoint commits ------------------------------------------------------

    def check_args(
        self, checkpoint_id: int, segments: Sequence[SegmentFile], parallelism: int, batch_id: int | None,
        properties: dict[str, str], committed_paths: Container[str],
    ) -> None:
        """Raise ValueError/TypeError for bad arguments; ``committed_paths`` are the segment
        paths the opened checkpoint already holds (a segment is committed once)."""
        newest = newest_checkpoint_id(self._table.metadata, self._branch)
        if not is_int(checkpoint_id) or checkpoint_id <= newest:
            raise ValueError(
                f"checkpoint id {checkpoint_id!r} of state table {self._name} must be an int above every "
                f"committed one (newest: {newest}); use next_checkpoint_id()"
            )
        if not is_int(parallelism) or not 1 <= parallelism <= self._layout.max_parallelism:
            raise ValueError(f"parallelism must be an int in [1, {self._layout.max_parallelism}], got {parallelism!r}")
        if batch_id is not None and (not is_int(batch_id) or batch_id < 0):
            raise ValueError(f"batch_id must be a non-negative int or None, got {batch_id!r}")
        check_user_properties(properties)
        seen: set[str] = set()
        for s in segments:
            self._check_segment(s, checkpoint_id, seen, committed_paths)
        self._check_one_owner(segments, parallelism)

    def _check_one_owner(self, segments: Sequence[SegmentFile], parallelism: int) -> None:
        """Each key group has one owner in a checkpoint: a task writes at most one segment per
        partition, tasks are below ``parallelism``, and no two segments share a key group
        (two stores that both believed they ran one task would otherwise both commit, and
        their entries of a key tie)."""
        owners: dict[tuple[int, int], str] = {}
        for s in segments:
            _, task, partition = parse_segment_name(s.path)
            if task >= parallelism:
                raise ValueError(f"segment {s.path} was written by task {task}, but the checkpoint has "
                                 f"parallelism {parallelism} (tasks 0..{parallelism - 1})")
            if (task, partition) in owners:
                raise ValueError(
                    f"task {task} wrote two segments of partition {partition} for one checkpoint of state table "
                    f"{self._name} ({owners[task, partition]} and {s.path}): two stores ran as the same task; "
                    "commit the segments of one of them")
            owners[task, partition] = s.path
        ordered = sorted(segments, key=lambda s: (s.key_group_min, s.key_group_max))
        for a, b in itertools.pairwise(ordered):
            if b.key_group_min <= a.key_group_max:
                raise ValueError(
                    f"segments {a.path} and {b.path} both hold key groups [{b.key_group_min}, "
                    f"{min(a.key_group_max, b.key_group_max)}]: a key group belongs to one task per checkpoint")

    def _check_segment(self, s: SegmentFile, checkpoint_id: int, seen: set[str],
                       committed_paths: Container[str]) -> None:
        if not isinstance(s, SegmentFile):
            raise TypeError(f"segments must be SegmentFile values, got {type(s).__name__}")
        path = self._locations.to_path(self._locations.to_uri(s.path))
        parsed = parse_segment_name(path)
        if s.checkpoint_id != checkpoint_id or parsed is None or parsed[0] != checkpoint_id:
            raise ValueError(
                f"segment {s.path} does not belong to checkpoint {checkpoint_id}: write it at "
                f"new_segment_path({checkpoint_id}, ...) and declare checkpoint_id={checkpoint_id}"
            )
        if path in seen or path in committed_paths:
            raise ValueError(f"segment {s.path} is committed twice to state table {self._name}")
        seen.add(path)
        n = self._layout.max_parallelism
        if not 0 <= s.key_group_min <= s.key_group_max < n or \
                s.key_group_min // self._width != s.key_group_max // self._width:
            raise ValueError(
                f"segment {s.path} declares key groups [{s.key_group_min}, {s.key_group_max}], which is not "
                f"within one partition of [0, {n - 1}]: write one segment per partition_of(key group)"
            )

    def data_files(self, segments: Sequence[SegmentFile], checkpoint_id: int,
                   uploads: Mapping[str, Future] | None = None) -> tuple[list[DataFile], list[Future]]:
        """``data_file`` of every segment, in order, and what ``commit`` waits for before the
        catalog switches: the check that the segments are stored as their writers reported
        (``check_stored``), running meanwhile on the I/O pool (its round trips overlap the
        commit's metadata uploads), and ``uploads`` (segment path -> its upload, still under way:
        ``IcebergStateTable.upload_segment``), whose success is that segment's check. Footers a
        writer did not report are read now, in parallel (on an object store each is a round
        trip or two)."""
        uploads = uploads or {}
        reported = [s for s in segments if s.footer is not None and s.path not in uploads]
        stored = [*([submit_io(self.check_stored, reported, checkpoint_id)] if reported else []),
                  *(uploads[s.path] for s in segments if s.path in uploads)]
        if sum(s.footer is None for s in segments) <= 1:
            return [self.data_file(s, checkpoint_id) for s in segments], stored
        with ThreadPoolExecutor(min(FOOTER_READS_MAX, len(segments)), thread_name_prefix="icestate-footers") as pool:
            return list(pool.map(lambda s: self.data_file(s, checkpoint_id), segments)), stored

    def check_stored(self, segments: Sequence[SegmentFile], checkpoint_id: int) -> None:
        """Raise CorruptSegmentError unless each of ``segments`` (whose writers reported their
        footers) is stored whole: one HEAD each, in parallel, instead of reading footers back."""
        def check(segment: SegmentFile) -> None:
            what = f"segment {segment.path} of checkpoint {checkpoint_id} in state table {self._name}"
            info = self._locations.filesystem.get_file_info(segment.path)
            if info.type != pafs.FileType.File:
                raise CorruptSegmentError(f"{what} does not exist: the task that wrote it failed; rerun the "
                                          "checkpoint")
            if info.size != segment.size_bytes:
                raise CorruptSegmentError(f"{what} holds {info.size} bytes, its writer wrote {segment.size_bytes}: "
                                          "it was damaged or replaced; rerun the checkpoint")

        if len(segments) <= 1:
            for segment in segments:
                check(segment)
            return
        with ThreadPoolExecutor(min(FOOTER_READS_MAX, len(segments)), thread_name_prefix="icestate-heads") as pool:
            list(pool.map(check, segments))

    def data_file(self, segment: SegmentFile, checkpoint_id: int) -> DataFile:
        """The Iceberg DataFile of a segment, from its writer's footer when reported (nothing
        is read: ``check_stored`` checks the file), else from the file's Parquet footer.

        Raises CorruptSegmentError when the file is missing, unreadable, of another schema,
        or holds other entries than declared.
        """
        uri = self._locations.to_uri(segment.path)
        what = f"segment {segment.path} of checkpoint {checkpoint_id} in state table {self._name}"
        io = self._table.io if segment.footer is None else _FooterIO(segment.footer, segment.size_bytes)
        try:
            data_file = parquet_file_to_data_file(io, self._table.metadata, uri)
        except FileNotFoundError as e:
            raise CorruptSegmentError(f"{what} does not exist: the task that wrote it failed; rerun the "
                                      "checkpoint") from e
        except (OSError, ValueError, KeyError, pa.ArrowException) as e:
            if isinstance(e, OSError):
                # The file, or the storage? A storage out of reach fails this look too, and its
                # error is the checkpoint's (the segment may be fine): raised as it is.
                self._locations.filesystem.get_file_info(self._locations.to_path(uri))
            raise CorruptSegmentError(
                f"{what} is unreadable or not of the table's schema ({e}): write it with file_schema() "
                "and rerun the checkpoint"
            ) from e
        entry = file_entry(data_file, self._key_group_field_id, live=True, snapshot_id=None)
        _check_footer(segment, entry, what)
        return data_file

    def summary(
        self, checkpoint_id: int, parallelism: int, batch_id: int | None, user: dict[str, str],
        operator_state: Sequence[OperatorStateFile] = (),
    ) -> dict[str, str]:
        """The snapshot summary of a checkpoint: the user's properties and the stored keys."""
        summary = {
            **user,
            stored_keys.SUMMARY_CHECKPOINT_ID: str(checkpoint_id),
            stored_keys.SUMMARY_PARALLELISM: str(parallelism),
            stored_keys.SUMMARY_MAX_PARALLELISM: str(self._layout.max_parallelism),
            stored_keys.SUMMARY_BRANCH: self._branch,
        }
        if batch_id is not None:
            summary[stored_keys.SUMMARY_BATCH_ID] = str(batch_id)
        if operator_state:
            summary[stored_keys.SUMMARY_OPERATOR_STATE] = self._operator_summary(
                checkpoint_id, operator_state, parallelism)
        return summary

    def _operator_summary(self, checkpoint_id: int, files: Sequence[OperatorStateFile], parallelism: int) -> str:
        """The snapshot summary value listing the operator state files (validated)."""
        tasks = sorted(f.task_index for f in files)
        if tasks != list(range(parallelism)):
            raise ValueError(f"operator state of checkpoint {checkpoint_id} must hold one file per task "
                             f"0..{parallelism - 1}, got tasks {tasks}")
        out = []
        for f in files:
            if not isinstance(f, OperatorStateFile):
                raise TypeError(f"operator_state must be OperatorStateFile values, got {type(f).__name__}")
            parsed = parse_operator_name(f.path)
            if parsed != (checkpoint_id, f.task_index) or f.checkpoint_id != checkpoint_id:
                raise ValueError(f"operator state file {f.path} does not belong to task {f.task_index} of checkpoint "
                                 f"{checkpoint_id}: write it with new_operator_state_path({checkpoint_id}, task)")
            if self._locations.filesystem.get_file_info(f.path).type != pafs.FileType.File:
                raise CorruptSegmentError(f"operator state file {f.path} of checkpoint {checkpoint_id} does not "
                                          "exist: the task that wrote it failed; rerun the checkpoint")
            out.append({**f.to_json(), "path": self._locations.to_uri(f.path)})
        return json.dumps(out, separators=(",", ":"))

    # --- committing -----------------------------------------------------------------------

    def commit(
        self, checkpoint_id: int, data_files: list[DataFile], summary: dict[str, str], *,
        opened: Snapshot | None, expected_head: int | None, stored: Sequence[Future] = (),
    ) -> Committed:
        """Commit the checkpoint after ``opened`` (the snapshot the table is opened at; the
        branch's head was ``expected_head`` when last seen), retrying lost races. ``stored``
        (``data_files``' checks and uploads) is waited for, and the first error raised, before
        the catalog switches.

        Raises:
            CommitConflictError: another writer kept committing, or committed checkpoints
                this table did not expect (a second driver). Nothing is committed.
        """
        for attempt in range(COMMIT_ATTEMPTS_MAX):
            if attempt:
                time.sleep(COMMIT_RETRY_WAIT_MS * 2 ** (attempt - 1) / 1000)
            if attempt or self._has_other_writers() or self.outside_commit:
                self.outside_commit = False
                self._table.refresh()
                self._check_branch_exists()
                self._check_not_overtaken(checkpoint_id)
            parent, rollback = self._plan_parent(opened, expected_head)
            try:
                return self._commit_once(checkpoint_id, data_files, summary, parent, rollback, stored)
            except CommitFailedException as e:
                # A first lost race is the compactor's commit landing first, several times an hour
                # in a normal run (the soak's log): news only when it repeats.
                (logger.warning if attempt else logger.info)(
                    "commit of checkpoint %s to %s lost a race (%s); retrying", checkpoint_id, self._name, e)
            except (ValueError, FileNotFoundError) as e:
                # The writer of another branch committed or expired snapshots since this table
                # read the metadata: the catalog applies our updates to the newer metadata, where
                # our sequence number is taken or a snapshot we expire is gone, or a manifest
                # list of a snapshot we saw was deleted (pyiceberg raises ValueError there, not
                # a commit conflict). Anything else is not a race.
                if not self._has_other_writers() or (
                        isinstance(e, ValueError) and not _is_stale_metadata_error(e)):
                    if isinstance(e, FileNotFoundError):
                        # A file of the metadata this writer holds is gone: another writer of
                        # this branch (a successor) committed and expired since. A zombie.
                        self._table.refresh()
                        self._check_not_overtaken(checkpoint_id)
                    raise
                logger.info("commit of checkpoint %s to %s raced another branch's writer (%s); retrying",
                            checkpoint_id, self._name, e)
        raise CommitConflictError(
            f"checkpoint {checkpoint_id} of state table {self._name} lost {COMMIT_ATTEMPTS_MAX} commit races to "
            "other writers; nothing was committed: retry the checkpoint, and check that one driver writes the table"
        )

    def _has_other_writers(self) -> bool:
        """Whether another branch of the table may have a writer (main and forks)."""
        return any(name != self._branch and ref.snapshot_ref_type == SnapshotRefType.BRANCH
                   for name, ref in self._table.metadata.refs.items())

    def _check_branch_exists(self) -> None:
        """A fork is created with its ref (``fork``): a writer of a fork whose ref is gone was
        removed under it, and committing would create a new fork holding only this commit."""
        if self._branch != MAIN_BRANCH and self._branch not in self._table.metadata.refs:
            raise CommitConflictError(
                f"fork {self._branch!r} of state table {self._name} was removed while this writer had it open: "
                "nothing was committed; create the fork again (fork()) to go on from one of main's checkpoints")

    def _check_not_overtaken(self, checkpoint_id: int) -> None:
        newest = newest_checkpoint_id(self._table.metadata, self._branch)
        if newest >= checkpoint_id:
            raise CommitConflictError(
                f"another writer committed checkpoint {newest} to state table {self._name} while this one was "
                f"committing {checkpoint_id}: two drivers write the same state; stop one and restore"
            )

    def _plan_parent(self, opened: Snapshot | None, expected_head: int | None) -> tuple[int | None, bool]:
        """(parent snapshot id, whether the branch must be rolled back to it) of the next checkpoint.

        The parent is the opened snapshot. Snapshots another writer appended on top of it
        without a checkpoint (a compaction) are kept: the new checkpoint follows them. When
        the table was opened at an older checkpoint than the branch's head (a restore), the
        branch is rolled back, abandoning the newer line; anything else is a second driver.
        """
        metadata = self._table.metadata
        head = metadata.snapshot_by_name(self._branch)
        base = None if opened is None else opened.snapshot_id
        if head is None or head.snapshot_id == base:
            return base, False
        if adds_no_checkpoint(metadata, head, since=base):
            return head.snapshot_id, False
        if base is not None and adds_no_checkpoint(metadata, head, since=expected_head):
            return base, True
        raise CommitConflictError(
            f"branch {self._branch!r} of state table {self._name} moved to snapshot {head.snapshot_id}, which holds "
            "checkpoints "
            "this table did not commit: another driver writes the same state; stop one and restore"
        )

    def _commit_once(
        self, checkpoint_id: int, data_files: list[DataFile], summary: dict[str, str], parent: int | None,
        rollback: bool, stored: Sequence[Future],
    ) -> Committed:
        """Commit the append and, in the same catalog commit, the expiry that retention asks for.

        The append's manifests and manifest list upload while the transaction goes on; the
        catalog call that switches the table waits for them (``catalog.fileio.UPLOADS``)."""
        main = self._branch == MAIN_BRANCH
        # pyiceberg names the commit's manifests and manifest list after this UUID; tagging
        # it with the checkpoint id lets the orphan sweep recognise them after a crash.
        commit = commit_uuid(checkpoint_id, fork=not main)
        with UPLOADS.deferred(str(commit)):
            return self._commit_transaction(checkpoint_id, data_files, summary, parent, rollback, stored, commit)

    def _commit_transaction(
        self, checkpoint_id: int, data_files: list[DataFile], summary: dict[str, str], parent: int | None,
        rollback: bool, stored: Sequence[Future], commit: uuid.UUID,
    ) -> Committed:
        tx = StagedTransaction(self._table)
        main = self._branch == MAIN_BRANCH
        if rollback:
            # Staged in the same transaction as the append, so the catalog switches to the
            # new checkpoint and abandons the newer line in one atomic step.
            if main:
                ManageSnapshots(tx).set_current_snapshot(snapshot_id=parent)
            else:
                ManageSnapshots(tx).create_branch(parent, self._branch).commit()
        append = tx.update_snapshot(snapshot_properties=summary, branch=self._branch).merge_append()
        append.commit_uuid = commit
        for data_file in data_files:
            append.append_data_file(data_file)
        append.commit()
        key = stored_keys.LAST_CHECKPOINT_ID if main else stored_keys.last_checkpoint_id_key(self._branch)
        tx.set_properties({key: str(checkpoint_id)})
        unreferenced = self._stage_expiry(tx)

        def ready() -> None:  # everything the new metadata references is stored
            for check in stored:
                check.result()
            UPLOADS.wait(str(commit))

        with before_catalog_switch(self._table, ready):
            tx.commit_transaction()
        return Committed(self._table.metadata.snapshot_by_id(append.snapshot_id), commit, unreferenced)

    def _stage_expiry(self, tx: Transaction) -> list[str]:
        """Stage the expiry of what retention drops once the staged snapshot is committed.

        Expiring in the checkpoint's own transaction saves a second catalog commit (and
        pyiceberg's metadata deep copies) per checkpoint: measured 25 ms of a 40 ms commit.
        The files only expired snapshots reference are computed now, while their manifests
        are still listed, and deleted after the commit."""
        plan = plan_retention(tx.table_metadata, self._retain, self._branch)
        if not plan.expired:
            return []
        unreferenced = unreferenced_files(self._cache, plan.expired, plan.retained)
        unreferenced += unreferenced_operator_files(plan.expired, plan.retained)
        ExpireSnapshots(tx).by_ids([s.snapshot_id for s in plan.expired]).commit()
        return unreferenced


def adds_no_checkpoint(metadata: TableMetadata, head: Snapshot, since: int | None) -> bool:
    """Whether ``since`` is ``head`` or an ancestor of it, with no checkpoint after it."""
    for snapshot in ancestors_of(head, metadata):
        if snapshot.snapshot_id == since:
            return True
        if checkpoint_id_of(snapshot) is not None:
            return False
    return since is None


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_user_properties(properties: dict[str, str]) -> None:
    """Raise TypeError/ValueError unless ``properties`` map str to str and use no reserved key."""
    for k, v in properties.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"checkpoint properties must map str to str, got {k!r}: {v!r}")
        if not props.is_user_summary_key(k):
            raise ValueError(f"checkpoint property {k!r} is reserved (state store or Iceberg summary); rename it")


def _check_footer(segment: SegmentFile, entry: FileEntry, what: str) -> None:
    lo, hi = entry.key_group_min, entry.key_group_max
    if entry.record_count != segment.record_count or (entry.record_count and (
            lo is None or hi is None or lo < segment.key_group_min or hi > segment.key_group_max)):
        raise CorruptSegmentError(
            f"{what} holds {entry.record_count} entries of key groups [{lo}, {hi}], but was declared with "
            f"{segment.record_count} entries of [{segment.key_group_min}, {segment.key_group_max}]: "
            "the file was replaced or truncated; rerun the checkpoint"
        )


def _is_stale_metadata_error(e: ValueError) -> bool:
    text = str(e)
    return "sequence number" in text or "does not exist" in text


@contextlib.contextmanager
def before_catalog_switch(table: Table, wait: Callable[[], object] = lambda: None,
                          point: str = COMMIT_METADATA_WRITTEN) -> Iterator[None]:
    """Call ``wait`` (raising what it raises), then the crash point ``point`` (a checkpoint's
    COMMIT_METADATA_WRITTEN, a compaction's COMPACTION_COMMIT_METADATA_WRITTEN), inside this
    table's next catalog commit.

    pyiceberg's ``Transaction.commit_transaction`` ends in ``Table._do_commit``, which calls
    ``table.catalog.commit_table`` once per attempt: the single call that switches the
    catalog to the new metadata. When it is entered, the append has written its manifests
    and manifest list. The table's ``catalog`` attribute (our own Table object, not the
    user's catalog) is replaced for the duration by a proxy that waits and crashes before
    delegating; with pyiceberg's ``SqlCatalog`` over ``StateFileIO``, which stores the new
    metadata.json and then switches, the wait and the crash point run while that file uploads
    (``fileio.metadata_json_gate``), and the switch still comes after them.
    """
    real = table.catalog
    table.catalog = _BeforeSwitch(real, wait, point, _stores_metadata_json_first(real, table))  # type: ignore[assignment]
    try:
        yield
    finally:
        table.catalog = real


def _stores_metadata_json_first(catalog: Catalog, table: Table) -> bool:
    """Whether ``catalog.commit_table`` stores the new metadata.json through ``StateFileIO``
    and only then switches the table: pyiceberg's own ``SqlCatalog`` (SQLite, PostgreSQL) over
    a table whose FileIO is ours. Its module is not imported for the check (executors never
    load SQLAlchemy): a catalog of that class has imported it."""
    sql = sys.modules.get("pyiceberg.catalog.sql")
    return sql is not None and type(catalog) is sql.SqlCatalog and isinstance(table.io, StateFileIO)


class _BeforeSwitch:
    def __init__(self, catalog: Catalog, wait: Callable[[], object], point: str, gate: bool):
        self._catalog = catalog
        self._wait = wait
        self._point = point
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._catalog, name)

    def _ready(self) -> None:
        self._wait()
        crash_point(self._point)

    def commit_table(self, *args: Any, **kwargs: Any) -> Any:
        if not self._gate:
            self._ready()
            return self._catalog.commit_table(*args, **kwargs)
        # The metadata.json goes up while the waits run (``metadata_json_gate``), the switch after both.
        with metadata_json_gate(self._ready) as used:
            response = self._catalog.commit_table(*args, **kwargs)
            if not used():  # it stored nothing, so it switched nothing (pyiceberg: no change)
                self._ready()
        return response


class StagedTransaction(Transaction):
    """pyiceberg's ``Transaction`` whose ``table_metadata`` (the table's metadata with the
    staged updates applied) is computed once per set of staged updates.

    pyiceberg computes it afresh at every read, and a checkpoint's commit reads it some 18
    times (each snapshot producer, expiry, validation): each read applies every staged update
    and deep-copies the whole metadata, 3 ms at a few retained checkpoints, so 57 of a commit's
    ~150 ms of CPU went there (profile in ``docs/decisions.md``, "A commit's CPU"). The
    metadata is a frozen model and both inputs are immutable (the staged updates a tuple that
    staging replaces, the table's metadata an object a commit or refresh replaces): the same
    inputs give the same metadata, so one computation serves every read until either changes.
    """

    def __init__(self, table: Table, autocommit: bool = False):
        super().__init__(table, autocommit)
        self._memo: tuple[TableMetadata, tuple, TableMetadata] | None = None

    @property
    def table_metadata(self) -> TableMetadata:
        base, updates, memo = self._table.metadata, self._updates, self._memo
        if memo is None or memo[0] is not base or memo[1] is not updates:
            # Holding both inputs keeps their ids from being reused while compared by identity.
            memo = self._memo = (base, updates, super().table_metadata)
        return memo[2]


class _FooterInput:
    """A segment as pyiceberg's ``parquet_file_to_data_file`` reads it: its footer, its size."""

    def __init__(self, footer: bytes, size: int):
        self._footer, self._size = footer, size

    def __len__(self) -> int:
        return self._size

    def open(self, seekable: bool = True) -> pa.BufferReader:
        return pa.BufferReader(self._footer)


class _FooterIO:
    """The FileIO of one segment whose footer its writer reported (``SegmentFile.footer``)."""

    def __init__(self, footer: str, size: int):
        self._input = _FooterInput(base64.b64decode(footer), size)

    def new_input(self, location: str) -> _FooterInput:
        return self._input
