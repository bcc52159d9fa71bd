"""``IcebergStateTable``: the keyed state of one stateful operator as one Iceberg table.

Role: the facade. A checkpoint is one Iceberg snapshot on a branch of the table (``main``
for the stream, or a fork): one append of every new segment of every task, whose summary
carries the checkpoint id, the stream's batch id and the parallelism
(``statestore.stored_keys``). The table is opened at one checkpoint; it answers
``segments()`` from an in-memory index of that snapshot's data files (built from the
manifests once, then updated by each commit), so no scan is planned per lookup and
restore reads no data file. Everything else it hands to one module per concern:

* ``catalog.commit``: validating a checkpoint and committing it (parent planning,
  rollback after a restore, retries on conflict, the expiry staged in the same commit);
* ``catalog.gc``: deleting what the expiry left unreferenced, retention, orphan sweeps;
  ``catalog.retention`` plans both from metadata alone;
* ``catalog.refs``: savepoints (Iceberg tags) and forks (Iceberg branches);
* ``catalog.creation`` and ``catalog.schema``: creating, validating and evolving the table.

Commit, in order (crash points of ``statestore.faults`` in capitals; any crash leaves the
newest complete checkpoint restorable, see DESIGN invariant 2):

1. validate the segment files (exist, readable, table schema) -> DataFiles;
2. stage one merge append on the opened snapshot (rolling the branch back to it first when
   it was restored from an older checkpoint), writing manifests and the manifest list,
   and the expiry of all but the newest ``retain_checkpoints`` checkpoints of the line;
   COMMIT_METADATA_WRITTEN; the catalog switches (retried on conflict); COMMIT_DONE;
3. SNAPSHOTS_EXPIRED; delete what only expired snapshots referenced and the new manifest
   if the append merged it into a bigger one; retention again; now and then orphans of
   crashed commits; FILES_DELETED.

Savepoints are Iceberg tags on a checkpoint's snapshot: retention never expires them, and
a table opens or restores at one like at a checkpoint. A fork (``fork``) is an Iceberg
branch created at a checkpoint or savepoint: a table opened with ``branch=`` commits there,
with its own checkpoint ids (continuing the forked one), segments under
``data/branches/<name>/`` and its own retention, without touching ``main``; both lines can
be opened and compared at any retained checkpoint. Only ``main``'s writer sweeps orphan
files (a fork's leftovers of crashed commits stay until the fork is removed).

Invariant: the index (``segments()``) is exactly the live data files of the opened
snapshot. Not thread safe: one driver owns a branch for writing. Readers in other
processes may open the same table at any retained checkpoint of any branch, or any
savepoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.snapshots import Snapshot

from catalog import properties as props
from catalog import refs
from catalog.commit import CheckpointCommitter, adds_no_checkpoint, is_int
from catalog.creation import load_or_create
from catalog.defaults import DEFAULT_NAMESPACE, default_catalog
from catalog.fileio import refuse_code_from_metadata, submit_io, wait_for_deletes
from catalog.gc import DirectoryFound, GarbageCollector, SweepResult, run_in_threads, run_on_spark
from catalog.manifests import FileEntry, ManifestCache, file_entry
from catalog.naming import Locations
from catalog.recovery import load_table, lost_entry_error
from catalog.retention import (
    checkpoint_id_of,
    checkpoints_on_line,
    newest_checkpoint_id,
    operator_files_of,
    summary_value,
)
from catalog.schema import recorded_layout
from catalog.task_view import CheckpointView, io_properties
from statestore import stored_keys
from statestore.errors import CheckpointNotFoundError, StateClosedError, as_storage_error
from statestore.faults import COMMIT_DONE, crash_point
from statestore.keygroups import KeyGroupRange
from statestore.layout import KEY_GROUP, StateLayout
from statestore.names import check_branch_name, check_namespace, check_table_name
from statestore.operator_state import OperatorStateFile
from statestore.paths import (
    BRANCHES_DIR,
    DATA_DIR,
    OPERATOR_DIR,
    compaction_file_name,
    needs_parent_directories,
    operator_file_name,
    parse_compaction_name,
    parse_segment_name,
    segment_path,
    window_dir,
)
from statestore.segment import store_file
from statestore.table import CheckpointInfo, SegmentFile

logger = logging.getLogger(__name__)

DEFAULT_RETAIN_CHECKPOINTS = 10


class IcebergStateTable:
    """A ``statestore.table.StateTable`` backed by one Iceberg table. Use ``open``."""

    def __init__(self, catalog: Catalog, owns_catalog: bool, table: Table, layout: StateLayout, retain: int,
                 branch: str = MAIN_BRANCH):
        self._branch = branch
        self._catalog = catalog
        self._owns_catalog = owns_catalog
        self._table = table
        self._layout = layout
        self._name = ".".join(table.name())
        self._locations = Locations.of(table.location(), table.io)
        self._width = int(stored_keys.get(table.properties, stored_keys.PARTITION_WIDTH, layout.max_parallelism))
        self._key_group_field_id = table.schema().find_field(KEY_GROUP).field_id
        self._cache = ManifestCache(table.io, self._key_group_field_id)
        self._committer = CheckpointCommitter(table, branch, layout, self._locations, self._cache,
                                              self._key_group_field_id, self._width, retain)
        self._gc = GarbageCollector(table, branch, self._locations, self._cache, retain)
        self._snapshot: Snapshot | None = None  # the snapshot the table is opened at
        self._expected_head: int | None = None  # the branch's head when last seen
        self._index: dict[str, SegmentFile] = {}
        self._ordered: list[SegmentFile] = []
        self._view: tuple[int | None, CheckpointView] | None = None  # checkpoint_view's, by snapshot id
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
        _check_open_args(layout, namespace, table_name, retain_checkpoints, partition_width)
        check_branch_name(branch)
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
        _check_open_args(None, namespace, table_name, retain_checkpoints, None)
        check_branch_name(branch)
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
        refs.check_branch(table, branch)
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
        uri = segment_path(self._table.location(), checkpoint_id, task_index, partition,
                           self._window_subdir(checkpoint_id))
        return self._locations.to_path(uri)

    def new_compaction_path(self, base_checkpoint_id: int, partition: int) -> str:
        """A fresh filesystem path for a compaction's output, beside this branch's segments."""
        return self.data_path(f"{self._window_subdir(base_checkpoint_id)}/"
                              f"{compaction_file_name(base_checkpoint_id, partition)}")

    def _window_subdir(self, checkpoint_id: int) -> str:
        """The directory under ``data/`` of the files named after ``checkpoint_id`` (``window_dir``)."""
        window = window_dir(checkpoint_id)
        return f"{self._segment_subdir}/{window}" if self._segment_subdir else window

    def new_operator_state_path(self, checkpoint_id: int, task_index: int) -> str:
        """A fresh filesystem path for a task's operator state file of an uncommitted checkpoint."""
        return self._locations.to_path(f"{self._operator_dir_uri}/{operator_file_name(checkpoint_id, task_index)}")

    def operator_state_files(self) -> list[OperatorStateFile]:
        """The operator state of the opened checkpoint: one file per task of the job that
        committed it (none when it committed no operator state)."""
        self._check_open()
        snapshot = self._checkpoint_snapshot()
        if snapshot is None:
            return []
        return [OperatorStateFile(**{**f, "path": self._locations.to_path(f["path"])})
                for f in operator_files_of(snapshot)]

    def _checkpoint_snapshot(self) -> Snapshot | None:
        """The snapshot of the opened checkpoint (past the compactions committed on top of it)."""
        snapshot = self._snapshot
        while snapshot is not None and checkpoint_id_of(snapshot) is None:  # a compaction: its parent's
            parent = snapshot.parent_snapshot_id
            snapshot = None if parent is None else self._table.metadata.snapshot_by_id(parent)
        return snapshot

    def segments(self, key_groups: KeyGroupRange) -> list[SegmentFile]:
        """Segments of the opened checkpoint overlapping ``key_groups``, oldest checkpoint first."""
        self._check_open()
        if key_groups.is_empty():
            return []
        return [s for s in self._ordered if s.key_group_min <= key_groups.end and s.key_group_max >= key_groups.start]

    def segments_at(self, checkpoint_id: int | None = None) -> tuple[CheckpointInfo | None, list[SegmentFile]]:
        """A checkpoint and every segment of it, without moving the table: the opened
        checkpoint's when None (the newest, a restored one, a savepoint or a fork's head, as the
        table was opened), else the retained checkpoint ``checkpoint_id`` of this branch's line.

        Raises:
            CheckpointNotFoundError: ``checkpoint_id`` is not retained on this branch.
        """
        self._check_open()
        if checkpoint_id is None:
            return self.current_checkpoint(), list(self._ordered)
        snapshot = self._find_checkpoint(checkpoint_id)
        found = sorted((self._segment(e) for e in self._cache.live_files(snapshot).values()),
                       key=lambda s: (s.checkpoint_id, s.path))
        return self._info(snapshot), found

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
        refs.check_branch(self._table, self._branch)
        self._cache.keep_only(self._table.metadata.snapshots)
        self._open_at(self._find_checkpoint(checkpoint_id, savepoint))
        return self.current_checkpoint()

    def checkpoint_view(self) -> CheckpointView:
        """The opened checkpoint as a task needs it (``catalog.task_view``): what the driver
        ships so that tasks never open the catalog. Built from the in-memory index: no I/O."""
        self._check_open()
        key = None if self._snapshot is None else self._snapshot.snapshot_id
        if self._view is None or self._view[0] != key:
            data_dir = f"{self._table.location().rstrip('/')}/{DATA_DIR}"
            if self._segment_subdir:
                data_dir = f"{data_dir}/{self._segment_subdir}"
            view = CheckpointView(
                identifier=self._name, location=self._table.location(), branch=self._branch,
                max_parallelism=self._layout.max_parallelism, partition_width=self._width,
                file_schema=self.file_schema(), data_dir=data_dir, operator_dir=self._operator_dir_uri,
                checkpoint=self.current_checkpoint(), segments=tuple(self._ordered),
                operator_state=tuple(self.operator_state_files()), next_checkpoint_id=self.next_checkpoint_id(),
                io=io_properties(self._table.io.properties),
            )
            self._view = (key, view)
        return self._view[1]

    # --- savepoints and forks -------------------------------------------------------------

    @property
    def branch(self) -> str:
        """The branch this table reads and commits: ``main`` or a fork."""
        return self._branch

    def savepoint(self, name: str, checkpoint_id: int | None = None) -> CheckpointInfo:
        """Name a checkpoint of this branch (its newest when None) as a savepoint: an Iceberg
        tag that retention never expires. Open or restore at it with ``savepoint=``."""
        self._check_open()
        self._table.refresh()
        refs.check_new_ref(self._table, name, "savepoint")
        snapshot = self._find_checkpoint(checkpoint_id)
        if snapshot is None:
            raise CheckpointNotFoundError(f"state table {self._name} has no checkpoint to save yet")
        refs.create_savepoint(self._table, name, snapshot)
        return self._info(snapshot)

    def savepoints(self) -> dict[str, CheckpointInfo]:
        """Every savepoint of the table, by name."""
        self._check_open()
        self._table.refresh()
        return {name: self._info(s) for name, s in refs.savepoint_snapshots(self._table).items()}

    def remove_savepoint(self, name: str) -> None:
        """Drop a savepoint; retention may then expire its checkpoint."""
        self._check_open()
        self._table.refresh()
        refs.remove_savepoint(self._table, name)

    def fork(self, name: str, checkpoint_id: int | None = None, *, savepoint: str | None = None) -> CheckpointInfo:
        """Create the fork ``name`` (an Iceberg branch) at a checkpoint of this branch (its
        newest when both are None) or at a savepoint. Open it with ``branch=name``: its
        commits never touch this branch."""
        self._check_open()
        _check_at(checkpoint_id, savepoint)
        self._table.refresh()
        refs.check_new_ref(self._table, name, "fork")
        snapshot = self._find_checkpoint(checkpoint_id, savepoint)
        if snapshot is None:
            raise CheckpointNotFoundError(f"state table {self._name} has no checkpoint to fork yet")
        refs.create_fork(self._table, name, snapshot)
        return self._info(snapshot)

    def at_fork_point(self) -> bool:
        """Whether this table is a fork opened at the checkpoint it was forked from (nothing
        committed on the fork yet, or restored back to that point)."""
        self._check_open()
        return refs.is_at_fork_point(self._table, self._branch, self._snapshot)

    def forks(self) -> dict[str, CheckpointInfo | None]:
        """Every branch of the table but main, with its newest checkpoint."""
        self._check_open()
        self._table.refresh()
        return {name: None if s is None else self._info(s)
                for name, s in refs.fork_newest_checkpoints(self._table).items()}

    def remove_fork(self, name: str) -> None:
        """Drop a fork (not the branch this table commits to): its own checkpoints become
        garbage that ``main``'s retention expires and deletes."""
        self._check_open()
        if name in (MAIN_BRANCH, self._branch):
            raise ValueError(f"cannot remove branch {name!r} of state table {self._name}: it is main or this "
                             "table's own branch")
        self._table.refresh()
        refs.remove_fork(self._table, name)

    def commit_checkpoint(
        self, checkpoint_id: int, segments: Sequence[SegmentFile], *, parallelism: int,
        batch_id: int | None = None, properties: dict[str, str] | None = None,
        operator_state: Sequence[OperatorStateFile] = (), uploads: Mapping[str, Future] | None = None,
    ) -> CheckpointInfo:
        """Commit ``segments`` of every task as checkpoint ``checkpoint_id`` in one snapshot,
        with ``operator_state``: one file per task (``OperatorStateStore.flush``), or none to
        keep the opened checkpoint's operator state as it is. ``uploads``: segment path -> its
        upload still under way (``upload_segment``), waited for before the catalog switch
        instead of checking the stored file.

        Raises:
            ValueError: bad arguments, or ``checkpoint_id`` not above every committed id.
            CorruptSegmentError: a segment file is missing, unreadable or of another
                schema; nothing is committed.
            CommitConflictError: another writer kept committing, or committed checkpoints
                this table did not expect (a second driver).
            StorageUnavailableError, StorageFullError: the storage failed the commit (after its
                client's bounded retries), or the disk is full; nothing is committed.
        """
        self._check_open()
        properties = properties or {}
        self._committer.check_args(checkpoint_id, segments, parallelism, batch_id, properties, self._index)
        data_files, stored = self._committer.data_files(segments, checkpoint_id, uploads)
        summary = self._committer.summary(checkpoint_id, parallelism, batch_id, properties, operator_state)
        if not operator_state:
            # A checkpoint without operator state keeps the opened one's (the same files, listed
            # again): operator state changes only when a job writes it.
            previous = self._checkpoint_snapshot()
            listed = None if previous is None else summary_value(previous, stored_keys.SUMMARY_OPERATOR_STATE)
            if listed:
                summary[stored_keys.SUMMARY_OPERATOR_STATE] = listed
        summary.update(self._gc.summary())
        try:
            committed = self._committer.commit(checkpoint_id, data_files, summary, opened=self._snapshot,
                                               expected_head=self._expected_head, stored=stored)
        except Exception as e:
            # The storage (or the catalog's disk) failed the commit: say so, as a store's flush does.
            converted = as_storage_error(e, f"checkpoint {checkpoint_id} of state table {self.location} failed while "
                                         "committing it", self.location.removeprefix("file://"))
            if converted is not None:
                raise converted from e
            raise
        self._advance_to(committed.snapshot, data_files)
        crash_point(COMMIT_DONE)
        self._gc.after_commit(committed.snapshot, committed.commit_uuid, committed.unreferenced)
        return self._info(committed.snapshot)

    def upload_segment(self, path: str, data: pa.Buffer) -> Future:
        """Start storing a segment's bytes as ``path`` on the I/O threads; the upload, for
        ``commit_checkpoint(..., uploads={path: upload})``. ``StateStore.checkpoint`` on an
        object store: the upload's round trip overlaps the commit's metadata work."""
        self._check_open()
        return submit_io(store_file, self.filesystem, path, data)

    def note_outside_commit(self) -> None:
        """Another writer of this table (its compactor) has committed: the next checkpoint's
        commit reads the table's metadata first instead of staging on the old head and losing
        its first attempt (a lost race costs the staging again plus the retry's wait: about
        150 ms beside the compactor). A hint, from any thread: a commit still retries a race."""
        self._committer.outside_commit = True

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

    def collect_garbage(self, full: bool = False) -> None:
        """Run retention now, including the sweep for orphans of crashed commits: of the
        checkpoints since the last sweep, or with ``full`` of the whole data directory."""
        self._check_open()
        self._gc.collect(sweep=True, full=full)

    def sweep(self, spark: Any = None, progress: Callable[[DirectoryFound], None] | None = None) -> SweepResult:
        """A full orphan sweep of main (``icestate sweep``): every checkpoint directory listed
        and its orphans deleted, in threads of this process or, with ``spark`` (a classic
        SparkSession), as one Spark job on the executors; ``progress`` gets each directory's
        result (in this process only). The writer's own sweeps list only the directories
        written since the last one; this one also takes what a stalled process wrote long
        after its checkpoint, and the orphans of a table written before the directories."""
        self._check_open()
        return self._gc.sweep_all(run_on_spark(spark) if spark is not None
                                  else lambda works: run_in_threads(works, progress=progress))

    def wait_for_deletes(self) -> None:
        """Return when the garbage deletes started so far are done: after a commit, the files
        its expiry left unreferenced go in the background (``catalog.gc``)."""
        wait_for_deletes()

    def close(self) -> None:
        """Release caches, and the catalog when ``open`` created it (after the garbage deletes
        under way). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._index, self._ordered = {}, []
        wait_for_deletes()
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

    @property
    def _segment_subdir(self) -> str | None:
        # A fork's segments live apart, where main's orphan sweep (which lists data/ only)
        # never sees a fork's files in flight.
        return None if self._branch == MAIN_BRANCH else f"{BRANCHES_DIR}/{self._branch}"

    def _make_data_dir(self) -> None:
        # Tasks write segments with plain filesystem calls; a local filesystem does not
        # create parent directories on write. Object stores have none to create: on S3 each
        # level would cost a HEAD and a PUT of an empty marker, at every open.
        if not needs_parent_directories(self.filesystem):
            return
        data_dir = f"{self._table.location().rstrip('/')}/{DATA_DIR}"
        if self._segment_subdir:
            data_dir = f"{data_dir}/{self._segment_subdir}"
        self.filesystem.create_dir(self._locations.to_path(data_dir), recursive=True)
        self.filesystem.create_dir(self._locations.to_path(self._operator_dir_uri), recursive=True)

    def _find_checkpoint(self, checkpoint_id: int | None, savepoint: str | None = None) -> Snapshot | None:
        if savepoint is not None:
            return refs.savepoint_snapshot(self._table, savepoint)
        line = checkpoints_on_line(self._table.metadata, self._branch)
        if checkpoint_id is None:
            if not line:
                return None
            # The newest checkpoint, or the head above it when only compactions follow it
            # (the same state in fewer files).
            head = self._table.metadata.snapshot_by_name(self._branch)
            newest = line[-1][1]
            if head is not None and head.snapshot_id != newest.snapshot_id and \
                    adds_no_checkpoint(self._table.metadata, head, since=newest.snapshot_id):
                return head
            return newest
        for cp, snapshot in line:
            if cp == checkpoint_id:
                return snapshot
        raise CheckpointNotFoundError(
            f"checkpoint {checkpoint_id} is not retained on branch {self._branch!r} of state table {self._name} "
            f"(retained: {[cp for cp, _ in line]}): restore one of those, None for the newest, or a savepoint"
        )

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
        stored = snapshot.summary.additional_properties if snapshot.summary else {}
        summary = stored_keys.upgraded(stored)  # a table written before the keys' rename holds their old names
        batch_id = summary.get(stored_keys.SUMMARY_BATCH_ID)
        return CheckpointInfo(
            checkpoint_id=int(summary[stored_keys.SUMMARY_CHECKPOINT_ID]),
            batch_id=None if batch_id is None else int(batch_id),
            parallelism=int(summary[stored_keys.SUMMARY_PARALLELISM]),
            max_parallelism=int(summary[stored_keys.SUMMARY_MAX_PARALLELISM]),
            timestamp_ms=snapshot.timestamp_ms, snapshot_id=snapshot.snapshot_id,
            properties={k: v for k, v in stored.items() if props.is_user_summary_key(k)},
        )

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

    def _check_open(self) -> None:
        if self._closed:
            raise StateClosedError(f"state table {self._name} is closed; open it again")


def _catalog_for(warehouse: str | None, catalog: Catalog | None) -> tuple[Catalog, bool]:
    """The catalog to use, and whether the state table owns (and closes) it."""
    if catalog is not None:
        return refuse_code_from_metadata(catalog), False
    if warehouse is None:
        raise ValueError("pass warehouse= (a local directory for the embedded catalog) or catalog=")
    return default_catalog(warehouse), True


def _load_existing(catalog: Catalog, identifier: tuple[str, str]) -> Table:
    try:
        return load_table(catalog, identifier)
    except (NoSuchTableError, NoSuchNamespaceError) as e:
        lost = lost_entry_error(catalog, identifier)  # its files are there: the catalog lost its entry
        if lost is not None:
            raise lost from None
        raise ValueError(
            f"there is no state table {'.'.join(identifier)} in catalog {catalog.name}: check the names, or create "
            "it with IcebergStateTable.open(layout, ...)"
        ) from e


def _check_at(checkpoint_id: int | None, savepoint: str | None) -> None:
    if checkpoint_id is not None and savepoint is not None:
        raise ValueError("give checkpoint_id= or savepoint=, not both")


def _check_open_args(layout: StateLayout | None, namespace: str, table_name: str, retain: int,
                     width: int | None) -> None:
    if layout is not None and not isinstance(layout, StateLayout):
        raise TypeError(f"layout must be a StateLayout, got {type(layout).__name__}")
    check_namespace(namespace)
    check_table_name(table_name)
    if not is_int(retain) or retain < 1:
        raise ValueError(f"retain_checkpoints must be an int >= 1, got {retain!r}")
    if width is not None and (not is_int(width) or not 1 <= width <= layout.max_parallelism):
        raise ValueError(
            f"partition_width must be an int in [1, max_parallelism={layout.max_parallelism}], got {width!r}"
        )
