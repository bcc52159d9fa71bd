"""``IcebergStateTable``: the keyed state of one stateful operator as one Iceberg table.

A checkpoint is one Iceberg snapshot on a branch of the table (``main`` for the stream,
or a fork): one append of every new segment of every task, whose summary carries
``statestore.checkpoint-id``, the stream's batch id and the parallelism. The table is
opened at one checkpoint; it answers ``segments()`` from an in-memory index of that
snapshot's data files (built from the manifests once, then updated by each commit), so no
scan is planned per lookup and restore reads no data file.

Commit, in order (crash points in quotes; any crash leaves the newest complete
checkpoint restorable, see DESIGN invariant 2):

1. validate the segment files (exist, readable, table schema) -> DataFiles;
2. stage one merge append on the opened snapshot (rolling main back to it first when it
   was restored from an older checkpoint), writing manifests and the manifest list;
   "commit_metadata_written"; the catalog switches (retried on conflict); "commit_done";
   the new manifest is deleted if the append merged it into a bigger one;
3. retention: expire all but the newest ``retain_checkpoints`` checkpoints of the line
   (and tagged/branched snapshots); "snapshots_expired";
4. delete what only expired snapshots referenced, and now and then orphans of crashed
   commits (``catalog.retention``); "files_deleted".

Savepoints are Iceberg tags on a checkpoint's snapshot: retention never expires them, and
a table opens or restores at one like at a checkpoint. A fork (``fork``) is an Iceberg
branch created at a checkpoint or savepoint: a table opened with ``branch=`` commits there,
with its own checkpoint ids (continuing the forked one), segments under
``data/branches/<name>/`` and its own retention, without touching ``main``; both lines can
be opened and compared at any retained checkpoint. Only ``main``'s writer sweeps orphan
files (a fork's leftovers of crashed commits stay until the fork is removed).

Not thread safe: one driver owns a branch for writing. Readers in other processes may
open the same table at any retained checkpoint of any branch, or any savepoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException, NoSuchNamespaceError, NoSuchTableError
from pyiceberg.io.pyarrow import parquet_file_to_data_file, schema_to_pyarrow
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table, Transaction
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Snapshot, ancestors_of
from pyiceberg.table.update.snapshot import ExpireSnapshots, ManageSnapshots

from catalog import properties as props
from catalog.creation import load_or_create
from catalog.defaults import DEFAULT_NAMESPACE, default_catalog
from catalog.manifests import FileEntry, ManifestCache, file_entry
from catalog.naming import Locations, commit_uuid, merged_away_manifests
from catalog.retention import (
    checkpoint_id_of,
    checkpoints_on_line,
    newest_checkpoint_id,
    operator_files_of,
    orphans,
    plan_retention,
    unreferenced_files,
    unreferenced_operator_files,
)
from catalog.schema import recorded_layout
from statestore.errors import (
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptSegmentError,
    StateClosedError,
)
from statestore.faults import crash_point
from statestore.keygroups import KeyGroupRange
from statestore.layout import KEY_GROUP, StateLayout
from statestore.operator_state import OperatorStateFile
from statestore.paths import (
    BRANCHES_DIR,
    COMPACTION_GRACE_SECONDS,
    DATA_DIR,
    OPERATOR_DIR,
    compaction_file_name,
    operator_file_name,
    parse_compaction_name,
    parse_operator_name,
    parse_segment_name,
    segment_path,
)
from statestore.table import CheckpointInfo, SegmentFile

logger = logging.getLogger(__name__)

DEFAULT_RETAIN_CHECKPOINTS = 10
COMMIT_ATTEMPTS_MAX = 4
COMMIT_RETRY_WAIT_MS = 50
# Orphans appear only when a process crashes or a commit fails, so the directory listing
# (a full listing of the table's data, costly on object stores) runs at the first commit
# after open and then once per this many commits, not at every checkpoint.
ORPHAN_SWEEP_INTERVAL_COMMITS = 100
METADATA_DIR = "metadata"


class IcebergStateTable:
    """A ``statestore.table.StateTable`` backed by one Iceberg table. Use ``open``."""

    def __init__(self, catalog: Catalog, owns_catalog: bool, table: Table, layout: StateLayout, retain: int,
                 branch: str = MAIN_BRANCH):
        self._branch = branch
        self._catalog = catalog
        self._owns_catalog = owns_catalog
        self._table = table
        self._layout = layout
        self._retain = retain
        self._name = ".".join(table.name())
        self._locations = Locations.of(table.location(), table.io)
        self._width = int(table.properties.get(props.PARTITION_WIDTH, layout.max_parallelism))
        self._key_group_field_id = table.schema().find_field(KEY_GROUP).field_id
        self._cache = ManifestCache(table.io, self._key_group_field_id)
        self._snapshot: Snapshot | None = None  # the snapshot the table is opened at
        self._expected_head: int | None = None  # main's head when last seen
        self._index: dict[str, SegmentFile] = {}
        self._ordered: list[SegmentFile] = []
        self._commits_until_sweep = 0
        self._closed = False

    @classmethod
    def open(
        cls, layout: StateLayout, *, warehouse: str | None = None, catalog: Catalog | None = None,
        namespace: str = DEFAULT_NAMESPACE, table_name: str, checkpoint_id: int | None = None,
        retain_checkpoints: int = DEFAULT_RETAIN_CHECKPOINTS, partition_width: int | None = None,
        close_catalog: bool = False, branch: str = MAIN_BRANCH, savepoint: str | None = None,
    ) -> IcebergStateTable:
        """Open (creating if needed) the state table ``namespace.table_name`` at a checkpoint.

        Args:
            layout: the operator's keys, state variables and max parallelism. An existing
                table must have been created for the same keys and max parallelism;
                new state variables are added to it (metadata only).
            warehouse: local directory of the embedded SQLite catalog, used when
                ``catalog`` is None (see ``catalog.defaults``).
            catalog: any pyiceberg catalog; the caller keeps owning it unless ``close_catalog``
                hands it to the table (closed with the table, also when opening fails).
            checkpoint_id: the retained checkpoint to open at; None for the newest.
            retain_checkpoints: how many checkpoints of the current line retention keeps.
            partition_width: key groups per partition (``truncate(key_group, W)``); None
                keeps the table's, or for a new table one partition for all key groups.
            branch: the line to open and commit to: ``main``, or a fork made by ``fork``.
            savepoint: open at this savepoint instead of a checkpoint of the line (the
                next commit continues from it, abandoning the line's newer checkpoints).

        Raises:
            StateTableMismatchError: the table holds another operator's state.
            CheckpointNotFoundError: ``checkpoint_id`` is not retained, or no such savepoint.
            ValueError: no such branch.
        """
        _check_open_args(layout, table_name, retain_checkpoints, partition_width)
        _check_at(checkpoint_id, savepoint)
        catalog, owns = _catalog_for(warehouse, catalog)
        owns = owns or close_catalog
        try:
            catalog.create_namespace_if_not_exists(namespace)
            table = load_or_create(catalog, (namespace, table_name), layout, partition_width)
            state = cls._opened(catalog, owns, table, layout, retain_checkpoints, checkpoint_id, branch, savepoint)
            state._make_data_dir()
            return state
        except BaseException:
            if owns:
                catalog.close()
            raise

    @classmethod
    def open_existing(
        cls, *, warehouse: str | None = None, catalog: Catalog | None = None, namespace: str = DEFAULT_NAMESPACE,
        table_name: str, checkpoint_id: int | None = None, retain_checkpoints: int = DEFAULT_RETAIN_CHECKPOINTS,
        branch: str = MAIN_BRANCH, savepoint: str | None = None, close_catalog: bool = False,
    ) -> IcebergStateTable:
        """Open an existing state table with the layout recorded in it, changing nothing.

        For inspection (CLI, notebooks, SQL): the layout is rebuilt from the table's metadata
        (``catalog.schema.recorded_layout``), so reducing and aggregating states can be read
        but not folded into. Raises ValueError when there is no such table.
        """
        _check_open_args(None, table_name, retain_checkpoints, None)
        _check_at(checkpoint_id, savepoint)
        catalog, owns = _catalog_for(warehouse, catalog)
        owns = owns or close_catalog
        try:
            table = _load_existing(catalog, (namespace, table_name))
            layout = recorded_layout(".".join(table.name()), table.schema(), table.properties)
            return cls._opened(catalog, owns, table, layout, retain_checkpoints, checkpoint_id, branch, savepoint)
        except BaseException:
            if owns:
                catalog.close()
            raise

    @classmethod
    def _opened(
        cls, catalog: Catalog, owns: bool, table: Table, layout: StateLayout, retain: int, checkpoint_id: int | None,
        branch: str = MAIN_BRANCH, savepoint: str | None = None,
    ) -> IcebergStateTable:
        _check_branch(table, branch)
        state = cls(catalog, owns, table, layout, retain, branch)
        state._open_at(state._find_checkpoint(checkpoint_id, savepoint))
        return state

    # --- the StateTable protocol -------------------------------------------------------

    @property
    def layout(self) -> StateLayout:
        return self._layout

    @property
    def filesystem(self) -> pafs.FileSystem:
        return self._locations.filesystem

    def file_schema(self) -> pa.Schema:
        """The table schema as Arrow, with Parquet field ids: segments map to columns by id."""
        return schema_to_pyarrow(self._table.schema())

    def partition_of(self, key_group: int) -> int:
        if not 0 <= key_group < self._layout.max_parallelism:
            raise ValueError(f"key group {key_group} is outside [0, {self._layout.max_parallelism - 1}]")
        return key_group // self._width

    def partition_key_groups(self, partition: int) -> KeyGroupRange:
        """The key groups of one partition (``truncate(key_group, W)``)."""
        lo = partition * self._width
        return KeyGroupRange.of(lo, min(self._layout.max_parallelism - 1, lo + self._width - 1))

    def partition_count(self) -> int:
        return -(-self._layout.max_parallelism // self._width)

    def data_path(self, name: str) -> str:
        """The filesystem path of a file named ``name`` in the table's data directory."""
        return self._locations.to_path(f"{self._table.location().rstrip('/')}/{DATA_DIR}/{name}")

    def to_uri(self, path: str) -> str:
        return self._locations.to_uri(path)

    def new_segment_path(self, checkpoint_id: int, task_index: int, partition: int) -> str:
        """A fresh filesystem path (see ``filesystem``) under the table's data directory."""
        partitions = -(-self._layout.max_parallelism // self._width)
        if not 0 <= partition < partitions:
            raise ValueError(f"partition {partition} is outside [0, {partitions - 1}] of state table {self._name}")
        uri = segment_path(self._table.location(), checkpoint_id, task_index, partition, self._segment_subdir)
        return self._locations.to_path(uri)

    def new_compaction_path(self, base_checkpoint_id: int, partition: int) -> str:
        """A fresh filesystem path for a compaction's output, beside this branch's segments."""
        name = compaction_file_name(base_checkpoint_id, partition)
        return self.data_path(f"{self._segment_subdir}/{name}" if self._segment_subdir else name)

    def new_operator_state_path(self, checkpoint_id: int, task_index: int) -> str:
        """A fresh filesystem path for a task's operator state file of an uncommitted checkpoint."""
        return self._locations.to_path(f"{self._operator_dir_uri}/{operator_file_name(checkpoint_id, task_index)}")

    def operator_state_files(self) -> list[OperatorStateFile]:
        """The operator state of the opened checkpoint: one file per task of the job that
        committed it (none when it committed no operator state)."""
        self._check_open()
        snapshot = self._snapshot
        while snapshot is not None and checkpoint_id_of(snapshot) is None:  # a compaction: its parent's
            parent = snapshot.parent_snapshot_id
            snapshot = None if parent is None else self._table.metadata.snapshot_by_id(parent)
        if snapshot is None:
            return []
        return [OperatorStateFile(**{**f, "path": self._locations.to_path(f["path"])})
                for f in operator_files_of(snapshot)]

    def segments(self, key_groups: KeyGroupRange) -> list[SegmentFile]:
        """Segments of the opened checkpoint overlapping ``key_groups``, oldest checkpoint first."""
        self._check_open()
        if key_groups.is_empty():
            return []
        return [s for s in self._ordered if s.key_group_min <= key_groups.end and s.key_group_max >= key_groups.start]

    def current_checkpoint(self) -> CheckpointInfo | None:
        self._check_open()
        return None if self._snapshot is None else self._info(self._snapshot)

    def next_checkpoint_id(self) -> int:
        """One more than the highest checkpoint id ever committed on this branch (for main: to
        the table), abandoned lines included."""
        self._check_open()
        return newest_checkpoint_id(self._table.metadata, self._branch) + 1

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Checkpoints of this branch's line still in the table, oldest first."""
        self._check_open()
        return [self._info(s) for _, s in checkpoints_on_line(self._table.metadata, self._branch)]

    def restore(self, checkpoint_id: int | None = None, *, savepoint: str | None = None) -> CheckpointInfo | None:
        """Reopen at a retained checkpoint of this branch (the newest when None) or at a
        savepoint, reading only metadata.

        The next commit follows the restored checkpoint; newer checkpoints of this branch
        are then abandoned and removed by retention.
        """
        self._check_open()
        _check_at(checkpoint_id, savepoint)
        self._table.refresh()
        _check_branch(self._table, self._branch)
        self._open_at(self._find_checkpoint(checkpoint_id, savepoint))
        return self.current_checkpoint()

    # --- savepoints and forks -------------------------------------------------------------

    @property
    def branch(self) -> str:
        """The branch this table reads and commits: ``main`` or a fork."""
        return self._branch

    def savepoint(self, name: str, checkpoint_id: int | None = None) -> CheckpointInfo:
        """Name a checkpoint of this branch (the opened one when None) as a savepoint: an
        Iceberg tag that retention never expires. Open or restore at it with ``savepoint=``."""
        self._check_open()
        self._table.refresh()
        _check_new_ref(self._table, name, "savepoint")
        snapshot = self._snapshot if checkpoint_id is None else self._find_checkpoint(checkpoint_id)
        if snapshot is None:
            raise CheckpointNotFoundError(f"state table {self._name} has no checkpoint to save yet")
        self._table.manage_snapshots().create_tag(snapshot.snapshot_id, name).commit()
        return self._info(snapshot)

    def savepoints(self) -> dict[str, CheckpointInfo]:
        """Every savepoint of the table, by name."""
        self._check_open()
        self._table.refresh()
        return {name: self._info(self._table.metadata.snapshot_by_id(ref.snapshot_id))
                for name, ref in sorted(self._table.metadata.refs.items())
                if ref.snapshot_ref_type == SnapshotRefType.TAG}

    def remove_savepoint(self, name: str) -> None:
        """Drop a savepoint; retention may then expire its checkpoint."""
        self._check_open()
        self._table.refresh()
        ref = self._table.metadata.refs.get(name)
        if ref is None or ref.snapshot_ref_type != SnapshotRefType.TAG:
            raise CheckpointNotFoundError(f"state table {self._name} has no savepoint {name!r}")
        self._table.manage_snapshots().remove_tag(name).commit()

    def fork(self, name: str, checkpoint_id: int | None = None, *, savepoint: str | None = None) -> CheckpointInfo:
        """Create the fork ``name`` (an Iceberg branch) at a checkpoint of this branch (the
        opened one when both are None) or at a savepoint. Open it with ``branch=name``: its
        commits never touch this branch."""
        self._check_open()
        _check_at(checkpoint_id, savepoint)
        self._table.refresh()
        _check_new_ref(self._table, name, "fork")
        if checkpoint_id is None and savepoint is None:
            snapshot = self._snapshot
        else:
            snapshot = self._find_checkpoint(checkpoint_id, savepoint)
        if snapshot is None:
            raise CheckpointNotFoundError(f"state table {self._name} has no checkpoint to fork yet")
        tx = self._table.transaction()
        ManageSnapshots(tx).create_branch(snapshot.snapshot_id, name).commit()
        tx.set_properties({props.fork_base_key(name): str(snapshot.snapshot_id)})
        tx.commit_transaction()
        return self._info(snapshot)

    def at_fork_point(self) -> bool:
        """Whether this table is a fork opened at the checkpoint it was forked from (nothing
        committed on the fork yet, or restored back to that point)."""
        self._check_open()
        if self._branch == MAIN_BRANCH or self._snapshot is None:
            return False
        base = self._table.metadata.properties.get(props.fork_base_key(self._branch))
        return base is not None and int(base) == self._snapshot.snapshot_id

    def forks(self) -> dict[str, CheckpointInfo | None]:
        """Every branch of the table but main, with its newest checkpoint."""
        self._check_open()
        self._table.refresh()
        out: dict[str, CheckpointInfo | None] = {}
        for name, ref in sorted(self._table.metadata.refs.items()):
            if name != MAIN_BRANCH and ref.snapshot_ref_type == SnapshotRefType.BRANCH:
                line = checkpoints_on_line(self._table.metadata, name)
                out[name] = self._info(line[-1][1]) if line else None
        return out

    def remove_fork(self, name: str) -> None:
        """Drop a fork (not the branch this table commits to): its own checkpoints become
        garbage that ``main``'s retention expires and deletes."""
        self._check_open()
        if name in (MAIN_BRANCH, self._branch):
            raise ValueError(f"cannot remove branch {name!r} of state table {self._name}: it is main or this "
                             "table's own branch")
        self._table.refresh()
        ref = self._table.metadata.refs.get(name)
        if ref is None or ref.snapshot_ref_type != SnapshotRefType.BRANCH:
            raise ValueError(f"state table {self._name} has no fork {name!r} (forks: {sorted(self.forks())})")
        tx = self._table.transaction()
        ManageSnapshots(tx).remove_branch(name).commit()
        tx.remove_properties(props.fork_base_key(name), props.last_checkpoint_id_key(name))
        tx.commit_transaction()

    def commit_checkpoint(
        self, checkpoint_id: int, segments: Sequence[SegmentFile], *, parallelism: int,
        batch_id: int | None = None, properties: dict[str, str] | None = None,
        operator_state: Sequence[OperatorStateFile] = (),
    ) -> CheckpointInfo:
        """Commit ``segments`` of every task as checkpoint ``checkpoint_id`` in one snapshot,
        with ``operator_state``: one file per task (``OperatorStateStore.flush``), or none.

        Raises:
            ValueError: bad arguments, or ``checkpoint_id`` not above every committed id.
            CorruptSegmentError: a segment file is missing, unreadable or of another
                schema; nothing is committed.
            CommitConflictError: another writer kept committing, or committed checkpoints
                this table did not expect (a second driver).
        """
        self._check_open()
        self._check_commit_args(checkpoint_id, segments, parallelism, batch_id, properties or {})
        data_files = [self._data_file(s, checkpoint_id) for s in segments]
        summary = self._summary(checkpoint_id, parallelism, batch_id, properties or {})
        if operator_state:
            summary[props.SUMMARY_OPERATOR_STATE] = self._operator_summary(checkpoint_id, operator_state, parallelism)
        snapshot, commit, doomed = self._commit_with_retries(checkpoint_id, data_files, summary)
        self._advance_to(snapshot, data_files)
        crash_point("commit_done")
        # The expiry went with the commit; a crash from here on leaves files only the sweep finds.
        crash_point("snapshots_expired")
        listed = [m.manifest_path for m in self._cache.manifests(snapshot)]
        self._delete(merged_away_manifests(commit, listed) + doomed)
        self._retain_and_collect(sweep=self._commits_until_sweep <= 0)
        return self._info(snapshot)

    # --- more public surface -------------------------------------------------------------

    @property
    def identifier(self) -> str:
        """``namespace.table`` in the catalog."""
        return self._name

    @property
    def location(self) -> str:
        """The table's location URI."""
        return self._table.location()

    @property
    def iceberg_table(self) -> Table:
        """The pyiceberg table (metadata as of the last open, restore or commit)."""
        return self._table

    @property
    def snapshot(self) -> Snapshot | None:
        """The Iceberg snapshot the table is opened at."""
        return self._snapshot

    def collect_garbage(self) -> None:
        """Run retention now, including the sweep for orphans of crashed commits."""
        self._check_open()
        self._retain_and_collect(sweep=True)

    def close(self) -> None:
        """Release caches, and the catalog when ``open`` created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._index, self._ordered = {}, []
        if self._owns_catalog:
            self._catalog.close()

    def __enter__(self) -> IcebergStateTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        cp = None if self._snapshot is None else checkpoint_id_of(self._snapshot)
        return f"IcebergStateTable({self._name}, checkpoint={cp}, segments={len(self._ordered)})"

    # --- opening at a checkpoint -----------------------------------------------------------

    @property
    def _operator_dir_uri(self) -> str:
        sub = f"/{self._segment_subdir}" if self._segment_subdir else ""
        return f"{self._table.location().rstrip('/')}/{DATA_DIR}{sub}/{OPERATOR_DIR}"

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
            if self.filesystem.get_file_info(f.path).type != pafs.FileType.File:
                raise CorruptSegmentError(f"operator state file {f.path} of checkpoint {checkpoint_id} does not "
                                          "exist: the task that wrote it failed; rerun the checkpoint")
            out.append({**f.to_json(), "path": self._locations.to_uri(f.path)})
        return json.dumps(out, separators=(",", ":"))

    @property
    def _segment_subdir(self) -> str | None:
        # A fork's segments live apart, where main's orphan sweep (which lists data/ only)
        # never sees a fork's files in flight.
        return None if self._branch == MAIN_BRANCH else f"{BRANCHES_DIR}/{self._branch}"

    def _make_data_dir(self) -> None:
        # Tasks write segments with plain filesystem calls; a local filesystem does not
        # create parent directories on write (object stores have none to create).
        data_dir = f"{self._table.location().rstrip('/')}/{DATA_DIR}"
        if self._segment_subdir:
            data_dir = f"{data_dir}/{self._segment_subdir}"
        self.filesystem.create_dir(self._locations.to_path(data_dir), recursive=True)
        self.filesystem.create_dir(self._locations.to_path(self._operator_dir_uri), recursive=True)

    def _find_checkpoint(self, checkpoint_id: int | None, savepoint: str | None = None) -> Snapshot | None:
        if savepoint is not None:
            return self._savepoint_snapshot(savepoint)
        line = checkpoints_on_line(self._table.metadata, self._branch)
        if checkpoint_id is None:
            if not line:
                return None
            # The newest checkpoint, or the head above it when only compactions follow it
            # (the same state in fewer files).
            head = self._table.metadata.snapshot_by_name(self._branch)
            newest = line[-1][1]
            if head is not None and head.snapshot_id != newest.snapshot_id and \
                    self._adds_no_checkpoint(head, since=newest.snapshot_id):
                return head
            return newest
        for cp, snapshot in line:
            if cp == checkpoint_id:
                return snapshot
        raise CheckpointNotFoundError(
            f"checkpoint {checkpoint_id} is not retained on branch {self._branch!r} of state table {self._name} "
            f"(retained: {[cp for cp, _ in line]}): restore one of those, None for the newest, or a savepoint"
        )

    def _savepoint_snapshot(self, name: str) -> Snapshot:
        ref = self._table.metadata.refs.get(name)
        if ref is None or ref.snapshot_ref_type != SnapshotRefType.TAG:
            tags = sorted(n for n, r in self._table.metadata.refs.items() if r.snapshot_ref_type == SnapshotRefType.TAG)
            raise CheckpointNotFoundError(f"state table {self._name} has no savepoint {name!r} (savepoints: {tags})")
        return self._table.metadata.snapshot_by_id(ref.snapshot_id)

    def _open_at(self, snapshot: Snapshot | None) -> None:
        self._snapshot = snapshot
        head = self._table.metadata.snapshot_by_name(self._branch)
        self._expected_head = None if head is None else head.snapshot_id
        entries = self._cache.live_files(snapshot).values() if snapshot is not None else ()
        self._set_index([self._segment(e) for e in entries])

    def _set_index(self, segments: list[SegmentFile]) -> None:
        self._index = {s.path: s for s in segments}
        self._ordered = sorted(self._index.values(), key=lambda s: (s.checkpoint_id, s.path))

    def _segment(self, entry: FileEntry) -> SegmentFile:
        n = self._layout.max_parallelism
        return SegmentFile(
            path=self._locations.to_path(entry.path), checkpoint_id=self._checkpoint_of(entry),
            key_group_min=0 if entry.key_group_min is None else entry.key_group_min,
            key_group_max=n - 1 if entry.key_group_max is None else entry.key_group_max,
            record_count=entry.record_count, size_bytes=entry.size_bytes,
        )

    def _checkpoint_of(self, entry: FileEntry) -> int:
        # Segments name their checkpoint, a compaction's output the checkpoint it was planned
        # on (no entry in it is newer). Other files (appended by other tools) take the
        # checkpoint of the snapshot that added them, or 0 (oldest) when that snapshot is gone:
        # entries carry their own checkpoint_id column.
        parsed = parse_segment_name(entry.path) or parse_compaction_name(entry.path)
        if parsed is not None:
            return parsed[0]
        added_by = None if entry.snapshot_id is None else self._table.metadata.snapshot_by_id(entry.snapshot_id)
        return (checkpoint_id_of(added_by) or 0) if added_by is not None else 0

    def _info(self, snapshot: Snapshot) -> CheckpointInfo:
        while checkpoint_id_of(snapshot) is None and snapshot.parent_snapshot_id is not None:
            # a compaction above a checkpoint holds that checkpoint's state
            snapshot = self._table.metadata.snapshot_by_id(snapshot.parent_snapshot_id)
        summary = snapshot.summary.additional_properties if snapshot.summary else {}
        batch_id = summary.get(props.SUMMARY_BATCH_ID)
        return CheckpointInfo(
            checkpoint_id=int(summary[props.SUMMARY_CHECKPOINT_ID]),
            batch_id=None if batch_id is None else int(batch_id),
            parallelism=int(summary[props.SUMMARY_PARALLELISM]),
            max_parallelism=int(summary[props.SUMMARY_MAX_PARALLELISM]),
            timestamp_ms=snapshot.timestamp_ms, snapshot_id=snapshot.snapshot_id,
            properties={k: v for k, v in summary.items() if _is_user_summary_key(k)},
        )

    # --- committing ----------------------------------------------------------------------------

    def _check_commit_args(
        self, checkpoint_id: int, segments: Sequence[SegmentFile], parallelism: int,
        batch_id: int | None, properties: dict[str, str],
    ) -> None:
        newest = newest_checkpoint_id(self._table.metadata, self._branch)
        if not _is_int(checkpoint_id) or checkpoint_id <= newest:
            raise ValueError(
                f"checkpoint id {checkpoint_id!r} of state table {self._name} must be an int above every "
                f"committed one (newest: {newest}); use next_checkpoint_id()"
            )
        if not _is_int(parallelism) or not 1 <= parallelism <= self._layout.max_parallelism:
            raise ValueError(f"parallelism must be an int in [1, {self._layout.max_parallelism}], got {parallelism!r}")
        if batch_id is not None and (not _is_int(batch_id) or batch_id < 0):
            raise ValueError(f"batch_id must be a non-negative int or None, got {batch_id!r}")
        _check_user_properties(properties)
        paths: set[str] = set()
        for s in segments:
            self._check_segment(s, checkpoint_id, paths)

    def _check_segment(self, s: SegmentFile, checkpoint_id: int, seen: set[str]) -> None:
        if not isinstance(s, SegmentFile):
            raise TypeError(f"segments must be SegmentFile values, got {type(s).__name__}")
        path = self._locations.to_path(self._locations.to_uri(s.path))
        parsed = parse_segment_name(path)
        if s.checkpoint_id != checkpoint_id or parsed is None or parsed[0] != checkpoint_id:
            raise ValueError(
                f"segment {s.path} does not belong to checkpoint {checkpoint_id}: write it at "
                f"new_segment_path({checkpoint_id}, ...) and declare checkpoint_id={checkpoint_id}"
            )
        if path in seen or path in self._index:
            raise ValueError(f"segment {s.path} is committed twice to state table {self._name}")
        seen.add(path)
        n = self._layout.max_parallelism
        if not 0 <= s.key_group_min <= s.key_group_max < n or \
                self.partition_of(s.key_group_min) != self.partition_of(s.key_group_max):
            raise ValueError(
                f"segment {s.path} declares key groups [{s.key_group_min}, {s.key_group_max}], which is not "
                f"within one partition of [0, {n - 1}]: write one segment per partition_of(key group)"
            )

    def _data_file(self, segment: SegmentFile, checkpoint_id: int) -> DataFile:
        """The Iceberg DataFile of a segment, from its Parquet footer (no data page is read)."""
        uri = self._locations.to_uri(segment.path)
        what = f"segment {segment.path} of checkpoint {checkpoint_id} in state table {self._name}"
        if self.filesystem.get_file_info(self._locations.to_path(uri)).type != pafs.FileType.File:
            raise CorruptSegmentError(f"{what} does not exist: the task that wrote it failed; rerun the checkpoint")
        try:
            data_file = parquet_file_to_data_file(self._table.io, self._table.metadata, uri)
        except (OSError, ValueError, KeyError, pa.ArrowException) as e:
            raise CorruptSegmentError(
                f"{what} is unreadable or not of the table's schema ({e}): write it with file_schema() "
                "and rerun the checkpoint"
            ) from e
        entry = file_entry(data_file, self._key_group_field_id, live=True, snapshot_id=None)
        self._check_footer(segment, entry, what)
        return data_file

    def _check_footer(self, segment: SegmentFile, entry: FileEntry, what: str) -> None:
        lo, hi = entry.key_group_min, entry.key_group_max
        if entry.record_count != segment.record_count or (entry.record_count and (
                lo is None or hi is None or lo < segment.key_group_min or hi > segment.key_group_max)):
            raise CorruptSegmentError(
                f"{what} holds {entry.record_count} entries of key groups [{lo}, {hi}], but was declared with "
                f"{segment.record_count} entries of [{segment.key_group_min}, {segment.key_group_max}]: "
                "the file was replaced or truncated; rerun the checkpoint"
            )

    def _summary(
        self, checkpoint_id: int, parallelism: int, batch_id: int | None, user: dict[str, str],
    ) -> dict[str, str]:
        summary = {
            **user,
            props.SUMMARY_CHECKPOINT_ID: str(checkpoint_id),
            props.SUMMARY_PARALLELISM: str(parallelism),
            props.SUMMARY_MAX_PARALLELISM: str(self._layout.max_parallelism),
        }
        if batch_id is not None:
            summary[props.SUMMARY_BATCH_ID] = str(batch_id)
        return summary

    def _commit_with_retries(
        self, checkpoint_id: int, data_files: list[DataFile], summary: dict[str, str],
    ) -> tuple[Snapshot, uuid.UUID, list[str]]:
        """The committed snapshot, the UUID its commit files are named after, and the files
        its staged expiry left unreferenced."""
        for attempt in range(COMMIT_ATTEMPTS_MAX):
            if attempt:
                time.sleep(COMMIT_RETRY_WAIT_MS * 2 ** (attempt - 1) / 1000)
            if attempt or self._has_other_writers():
                self._table.refresh()
                self._check_not_overtaken(checkpoint_id)
            parent, rollback = self._plan_parent()
            try:
                return self._commit_once(checkpoint_id, data_files, summary, parent, rollback)
            except CommitFailedException as e:
                logger.warning("commit of checkpoint %s to %s lost a race (%s); retrying", checkpoint_id, self._name, e)
            except (ValueError, FileNotFoundError) as e:
                # The writer of another branch committed or expired snapshots since this table
                # read the metadata: the catalog applies our updates to the newer metadata, where
                # our sequence number is taken or a snapshot we expire is gone, or a manifest
                # list of a snapshot we saw was deleted (pyiceberg raises ValueError there, not
                # a commit conflict). Anything else is not a race.
                if not self._has_other_writers() or (
                        isinstance(e, ValueError) and not _is_stale_metadata_error(e)):
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

    def _check_not_overtaken(self, checkpoint_id: int) -> None:
        newest = newest_checkpoint_id(self._table.metadata, self._branch)
        if newest >= checkpoint_id:
            raise CommitConflictError(
                f"another writer committed checkpoint {newest} to state table {self._name} while this one was "
                f"committing {checkpoint_id}: two drivers write the same state; stop one and restore"
            )

    def _plan_parent(self) -> tuple[int | None, bool]:
        """(parent snapshot id, whether main must be rolled back to it) of the next checkpoint.

        The parent is the opened snapshot. Snapshots another writer appended on top of it
        without a checkpoint (a compaction) are kept: the new checkpoint follows them. When
        the table was opened at an older checkpoint than main's head (a restore), main is
        rolled back, abandoning the newer line; anything else is a second driver.
        """
        head = self._table.metadata.snapshot_by_name(self._branch)
        base = None if self._snapshot is None else self._snapshot.snapshot_id
        if head is None or head.snapshot_id == base:
            return base, False
        if self._adds_no_checkpoint(head, since=base):
            return head.snapshot_id, False
        if base is not None and self._adds_no_checkpoint(head, since=self._expected_head):
            return base, True
        raise CommitConflictError(
            f"branch {self._branch!r} of state table {self._name} moved to snapshot {head.snapshot_id}, which holds "
            "checkpoints "
            "this table did not commit: another driver writes the same state; stop one and restore"
        )

    def _adds_no_checkpoint(self, head: Snapshot, since: int | None) -> bool:
        """Whether ``since`` is ``head`` or an ancestor of it, with no checkpoint after it."""
        for snapshot in ancestors_of(head, self._table.metadata):
            if snapshot.snapshot_id == since:
                return True
            if checkpoint_id_of(snapshot) is not None:
                return False
        return since is None

    def _commit_once(
        self, checkpoint_id: int, data_files: list[DataFile], summary: dict[str, str], parent: int | None,
        rollback: bool,
    ) -> tuple[Snapshot, uuid.UUID, list[str]]:
        """Commit the append and, in the same catalog commit, the expiry that retention asks
        for; returns the new snapshot, its commit UUID and the files the expiry leaves
        unreferenced (to delete once the commit is through)."""
        tx = self._table.transaction()
        main = self._branch == MAIN_BRANCH
        if rollback:
            # Staged in the same transaction as the append, so the catalog switches to the
            # new checkpoint and abandons the newer line in one atomic step.
            if main:
                ManageSnapshots(tx).set_current_snapshot(snapshot_id=parent)
            else:
                ManageSnapshots(tx).create_branch(parent, self._branch).commit()
        append = tx.update_snapshot(snapshot_properties=summary, branch=self._branch).merge_append()
        # pyiceberg names the commit's manifests and manifest list after this UUID; tagging
        # it with the checkpoint id lets the orphan sweep recognise them after a crash.
        append.commit_uuid = commit = commit_uuid(checkpoint_id, fork=not main)
        for data_file in data_files:
            append.append_data_file(data_file)
        append.commit()
        key = props.LAST_CHECKPOINT_ID if main else props.last_checkpoint_id_key(self._branch)
        tx.set_properties({key: str(checkpoint_id)})
        doomed = self._stage_expiry(tx)
        with _crash_before_catalog_switch(self._table):
            tx.commit_transaction()
        return self._table.metadata.snapshot_by_id(append.snapshot_id), commit, doomed

    def _stage_expiry(self, tx: Transaction) -> list[str]:
        """Stage the expiry of what retention drops once the staged snapshot is committed.

        Expiring in the checkpoint's own transaction saves a second catalog commit (and
        pyiceberg's metadata deep copies) per checkpoint: measured 25 ms of a 40 ms commit.
        The files only expired snapshots reference are computed now, while their manifests
        are still listed, and deleted after the commit."""
        plan = plan_retention(tx.table_metadata, self._retain, self._branch)
        if not plan.expired:
            return []
        doomed = unreferenced_files(self._cache, plan.expired, plan.retained)
        doomed += unreferenced_operator_files(plan.expired, plan.retained)
        ExpireSnapshots(tx).by_ids([s.snapshot_id for s in plan.expired]).commit()
        return doomed

    def _advance_to(self, snapshot: Snapshot, data_files: list[DataFile]) -> None:
        """Open the table at the snapshot just committed, updating the index in place when it
        follows the opened snapshot directly (the usual case)."""
        base = None if self._snapshot is None else self._snapshot.snapshot_id
        if snapshot.parent_snapshot_id == base:
            field_id = self._key_group_field_id
            added = [self._segment(file_entry(f, field_id, live=True, snapshot_id=snapshot.snapshot_id))
                     for f in data_files]
            self._set_index([*self._index.values(), *added])
            self._snapshot, self._expected_head = snapshot, snapshot.snapshot_id
        else:
            self._open_at(snapshot)

    # --- retention and garbage collection ------------------------------------------------------

    def _retain_and_collect(self, sweep: bool) -> None:
        sweep = sweep and self._branch == MAIN_BRANCH
        plan = plan_retention(self._table.metadata, self._retain, self._branch)
        if plan.expired:
            try:
                doomed = unreferenced_files(self._cache, plan.expired, plan.retained)
                doomed += unreferenced_operator_files(plan.expired, plan.retained)
            except FileNotFoundError as e:
                # Another branch's writer expired and deleted some of these since: the next commit retries.
                logger.info("retention of %s skipped: the metadata changed under it (%s)", self._name, e)
                self._table.refresh()
                return
            if self._expire([s.snapshot_id for s in plan.expired]):
                crash_point("snapshots_expired")
                self._delete(doomed)
        else:
            crash_point("snapshots_expired")
        self._commits_until_sweep -= 1
        if sweep:
            self._delete(self._orphans())
            self._commits_until_sweep = ORPHAN_SWEEP_INTERVAL_COMMITS
        crash_point("files_deleted")

    def _expire(self, snapshot_ids: list[int]) -> bool:
        try:
            self._table.maintenance.expire_snapshots().by_ids(snapshot_ids).commit()
        except (CommitFailedException, ValueError) as e:
            # Housekeeping only: the checkpoint is committed; the next commit retries. (A
            # ValueError: another branch's writer expired some of these snapshots first.)
            logger.warning("expiring %d snapshots of %s lost a race (%s)", len(snapshot_ids), self._name, e)
            self._table.refresh()
            return False
        return True

    def _orphans(self) -> list[str]:
        location = self._table.location().rstrip("/")
        data = self._list_file_infos(f"{location}/{DATA_DIR}")
        young = time.time() - COMPACTION_GRACE_SECONDS
        return orphans(
            list(data), self._list_files(f"{location}/{METADATA_DIR}"),
            self._table.metadata, self._table.metadata_location, self._cache,
            operator_files=self._list_files(f"{location}/{DATA_DIR}/{OPERATOR_DIR}"),
            settled=lambda uri: data[uri] is not None and data[uri] < young,
        )

    def _list_files(self, directory_uri: str) -> list[str]:
        return list(self._list_file_infos(directory_uri))

    def _list_file_infos(self, directory_uri: str) -> dict[str, float | None]:
        """URI -> modification time (epoch seconds; None when the filesystem has none)."""
        selector = pafs.FileSelector(self._locations.to_path(directory_uri), allow_not_found=True)
        infos = self.filesystem.get_file_info(selector)
        return {self._locations.to_uri(i.path): (None if i.mtime is None else i.mtime.timestamp())
                for i in infos if i.type == pafs.FileType.File}

    def _delete(self, uris: list[str]) -> None:
        for uri in uris:
            try:
                self.filesystem.delete_file(self._locations.to_path(uri))
            except FileNotFoundError:
                # Deleted by an earlier, interrupted collection: nothing left to do.
                continue
            except OSError as e:
                logger.warning("could not delete %s of state table %s (%s); the next sweep retries", uri, self._name, e)
        self._cache.forget(uris)

    def _check_open(self) -> None:
        if self._closed:
            raise StateClosedError(f"state table {self._name} is closed; open it again")


@contextlib.contextmanager
def _crash_before_catalog_switch(table: Table) -> Iterator[None]:
    """Call the "commit_metadata_written" crash point inside this table's next catalog commit.

    pyiceberg's ``Transaction.commit_transaction`` ends in ``Table._do_commit``, which calls
    ``table.catalog.commit_table`` once per attempt: the single call that switches the
    catalog to the new metadata. When it is entered, the append has written its manifests
    and manifest list. The table's ``catalog`` attribute (our own Table object, not the
    user's catalog) is replaced for the duration by a proxy that crashes before delegating.
    """
    real = table.catalog
    table.catalog = _CrashBeforeSwitch(real)  # type: ignore[assignment]
    try:
        yield
    finally:
        table.catalog = real


class _CrashBeforeSwitch:
    def __init__(self, catalog: Catalog):
        self._catalog = catalog

    def __getattr__(self, name: str) -> Any:
        return getattr(self._catalog, name)

    def commit_table(self, *args: Any, **kwargs: Any) -> Any:
        crash_point("commit_metadata_written")
        return self._catalog.commit_table(*args, **kwargs)


def _catalog_for(warehouse: str | None, catalog: Catalog | None) -> tuple[Catalog, bool]:
    """The catalog to use, and whether the state table owns (and closes) it."""
    if catalog is not None:
        return catalog, False
    if warehouse is None:
        raise ValueError("pass warehouse= (a local directory for the embedded catalog) or catalog=")
    return default_catalog(warehouse), True


def _load_existing(catalog: Catalog, identifier: tuple[str, str]) -> Table:
    try:
        return catalog.load_table(identifier)
    except (NoSuchTableError, NoSuchNamespaceError) as e:
        raise ValueError(
            f"there is no state table {'.'.join(identifier)} in catalog {catalog.name}: check the names, or create "
            "it with IcebergStateTable.open(layout, ...)"
        ) from e


def _is_stale_metadata_error(e: ValueError) -> bool:
    text = str(e)
    return "sequence number" in text or "does not exist" in text


def _check_at(checkpoint_id: int | None, savepoint: str | None) -> None:
    if checkpoint_id is not None and savepoint is not None:
        raise ValueError("give checkpoint_id= or savepoint=, not both")


def _check_branch(table: Table, branch: str) -> None:
    if not isinstance(branch, str) or not branch:
        raise ValueError(f"branch must be a non-empty string, got {branch!r}")
    if branch == MAIN_BRANCH:
        return
    ref = table.metadata.refs.get(branch)
    if ref is None or ref.snapshot_ref_type != SnapshotRefType.BRANCH:
        forks = sorted(n for n, r in table.metadata.refs.items()
                       if n != MAIN_BRANCH and r.snapshot_ref_type == SnapshotRefType.BRANCH)
        raise ValueError(f"state table {'.'.join(table.name())} has no fork {branch!r} (forks: {forks}); "
                         "create it with fork(name, checkpoint_id) on a table opened at main")


_REF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def _check_new_ref(table: Table, name: str, what: str) -> None:
    if not isinstance(name, str) or not _REF_NAME.match(name) or name == MAIN_BRANCH:
        raise ValueError(f"{what} name {name!r} must be 1-100 letters, digits, '_', '.' or '-' (not 'main')")
    ref = table.metadata.refs.get(name)
    if ref is not None:
        kind = "savepoint" if ref.snapshot_ref_type == SnapshotRefType.TAG else "fork"
        raise ValueError(f"state table {'.'.join(table.name())} already has a {kind} named {name!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_open_args(layout: StateLayout | None, table_name: str, retain: int, width: int | None) -> None:
    if layout is not None and not isinstance(layout, StateLayout):
        raise TypeError(f"layout must be a StateLayout, got {type(layout).__name__}")
    if not isinstance(table_name, str) or not table_name:
        raise ValueError(f"table_name must be a non-empty string, got {table_name!r}")
    if not _is_int(retain) or retain < 1:
        raise ValueError(f"retain_checkpoints must be an int >= 1, got {retain!r}")
    if width is not None and (not _is_int(width) or not 1 <= width <= layout.max_parallelism):
        raise ValueError(
            f"partition_width must be an int in [1, max_parallelism={layout.max_parallelism}], got {width!r}"
        )


def _is_user_summary_key(key: str) -> bool:
    return key not in props.RESERVED_SUMMARY_KEYS and not props.is_iceberg_summary_key(key)


def _check_user_properties(properties: dict[str, str]) -> None:
    for k, v in properties.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"checkpoint properties must map str to str, got {k!r}: {v!r}")
        if not _is_user_summary_key(k):
            raise ValueError(f"checkpoint property {k!r} is reserved (state store or Iceberg summary); rename it")
