"""Garbage collection of a state table: expire what retention plans, delete the files.

Role: the I/O half of retention. ``catalog.retention`` plans, from metadata alone, which
snapshots a branch's writer expires and which files become unreferenced or orphaned;
``GarbageCollector`` commits the expiry, lists the table's directories and deletes the
files. After each checkpoint commit (whose own transaction already staged the expiry,
``catalog.commit``) it deletes what that expiry left unreferenced, then runs retention
again (the SNAPSHOTS_EXPIRED and FILES_DELETED crash points), and every
``ORPHAN_SWEEP_INTERVAL_COMMITS`` commits, and at the first after open, sweeps orphans of
crashed commits.

The deletes after a commit run in the background, several at once (``fileio.delete_later``): on an
object store each costs three requests (pyarrow checks the object, deletes it and puts back
the directory marker), and a checkpoint that expires another drops about ten files, which
one after another took longer than the commit itself (measured: a steady commit of 330 ms
at 20 ms per request, 81 ms of it deleting). ``collect`` and the table's ``close`` wait for
them.

Invariants: a file is deleted only when no retained snapshot references it (the plan) or
it is an orphan by name (``retention.orphans``); a missing file is already deleted; a
failed delete or a lost expiry race is logged and retried by a later commit, never raised:
the checkpoint is already committed. Only ``main``'s writer sweeps orphans (a fork's
leftovers of crashed commits stay until the fork is removed). Metadata files of other
writers are never touched. The sweep deletes nothing while the metadata directory holds a metadata.json of
another table (``recovery.foreign_metadata``). It also takes a Spark query's callback files under
``scratch/outputs/`` once older than the grace period (a crashed driver's leftovers).

Thread safety: none. One collector per opened table, used by the branch's one writer.
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.snapshots import Snapshot

from catalog.fileio import METADATA_FILES, delete_later, is_inside, table_root, wait_for_deletes
from catalog.manifests import ManifestCache
from catalog.naming import METADATA_DIR, Locations, merged_away_manifests, metadata_json_version
from catalog.recovery import foreign_metadata
from catalog.retention import (
    data_orphans,
    live_files,
    newest_checkpoint_id,
    orphans,
    plan_retention,
    summary_value,
    unreferenced_files,
    unreferenced_operator_files,
)
from catalog.task_view import io_properties, locations_of
from statestore import stored_keys
from statestore.errors import CorruptMetadataError
from statestore.faults import FILES_DELETED, SNAPSHOTS_EXPIRED, crash_point
from statestore.paths import (
    COMPACTION_GRACE_CHECKPOINTS,
    COMPACTION_GRACE_SECONDS,
    DATA_DIR,
    OPERATOR_DIR,
    SCRATCH_OUTPUTS_DIR,
    parse_compaction_name,
    parse_output_name,
    parse_window_dir,
    window_dirs,
)

logger = logging.getLogger(__name__)

_MARK = re.compile(r"[0-9]{1,18}")

# Orphans appear only when a process crashes or a commit fails, so the directory listing
# (a full listing of the table's data, costly on object stores) runs at the first commit
# after open and then once per this many commits, not at every checkpoint.
ORPHAN_SWEEP_INTERVAL_COMMITS = 100
# Tries of a full sweep beside a writer whose retention deletes the metadata it started from.
SWEEP_ATTEMPTS = 5


class GarbageCollector:
    """Retention and file deletion for the writer of ``branch`` of ``table``."""

    def __init__(self, table: Table, branch: str, locations: Locations, cache: ManifestCache, retain: int):
        self._table = table
        self._branch = branch
        self._locations = locations
        self._cache = cache
        self._retain = retain
        self._name = ".".join(table.name())
        self._commits_until_sweep = 0  # sweep at the first commit after open
        # The lowest checkpoint id whose directory the next sweep lists (None: every directory).
        self._swept_below = initial_sweep_start(table.metadata) if branch == MAIN_BRANCH else None

    def after_commit(self, snapshot: Snapshot, commit: uuid.UUID, unreferenced: list[str]) -> None:
        """Clean up after the commit of ``snapshot`` (files named after ``commit``), whose
        staged expiry left ``unreferenced`` files (deleted in the background); then
        retention, and a sweep when due."""
        # The expiry went with the commit; a crash from here on leaves files only the sweep finds.
        crash_point(SNAPSHOTS_EXPIRED)
        listed = [m.manifest_path for m in self._cache.manifests(snapshot)]
        self._delete_later(merged_away_manifests(commit, listed) + unreferenced)
        try:
            self.collect(sweep=self._commits_until_sweep <= 0, wait=False)
        except CorruptMetadataError as e:
            # The checkpoint is committed: a damaged metadata file of another snapshot stops this
            # collection (nothing more is deleted) but not the commit; the next commit retries.
            logger.error("garbage collection of %s stopped, nothing more deleted: %s", self._name, e)

    def collect(self, sweep: bool, wait: bool = True, full: bool = False) -> None:
        """Expire what retention drops now and delete its files; with ``sweep`` (on main
        only), also delete orphans of crashed commits: in the checkpoint directories written
        since the last sweep, or with ``full`` in every one. With ``wait``, return when every
        delete of the process under way (this collector's, in the background) is done."""
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
                crash_point(SNAPSHOTS_EXPIRED)
                self._delete_later(doomed)
        else:
            crash_point(SNAPSHOTS_EXPIRED)
        self._commits_until_sweep -= 1
        if sweep:
            self._delete_later(self._orphans(full)[0])
            self._commits_until_sweep = ORPHAN_SWEEP_INTERVAL_COMMITS
        if wait:
            wait_for_deletes()
        crash_point(FILES_DELETED)

    def _delete_later(self, uris: list[str]) -> None:
        """Forget ``uris`` now (no cache serves them from memory) and delete them in the
        background; never a file outside the table's directory (``_inside``)."""
        uris = [uri for uri in uris if self._inside(uri)]
        for uri in uris:
            METADATA_FILES.discard(uri)
        self._cache.forget(uris)
        for uri in uris:
            delete_later(self._delete_file, uri)

    def _inside(self, uri: str) -> bool:
        """Whether ``uri`` is a file of the table's directory, as the place of its metadata file
        says (the place the catalog recorded). Manifests name the files to delete, and a
        manifest is a file in the table's storage: whoever could write there could otherwise
        make this process delete any file it can reach (``docs/reliability.md``)."""
        root = table_root(self._table.metadata_location)
        if root is not None and is_inside(uri, root) and is_inside(uri, self._table.location()):
            return True
        logger.error("not deleting %s: it is outside the directory of state table %s (%s), so the metadata that named "
                     "it is damaged or was tampered with", uri, self._name, root or self._table.metadata_location)
        return False

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

    def summary(self) -> dict[str, str]:
        """What the next checkpoint's summary carries for the sweeps of later writers: where
        main's incremental sweep stands (nothing before the first sweep, or on a fork)."""
        if self._branch != MAIN_BRANCH or self._swept_below is None:
            return {}
        return {stored_keys.SUMMARY_SWEPT_BELOW: str(self._swept_below)}

    def _orphans(self, full: bool, run: Callable[[list[DirectorySweep]], list[DirectoryFound]] | None = None,
                 ) -> tuple[list[str], list[DirectoryFound]]:
        """The orphans to delete here, and what the sweep of each checkpoint directory found:
        listed here and returned as orphans, or with ``run`` listed and deleted where ``run``
        sends each directory (``sweep_directory``: a thread, a Spark task)."""
        location = self._table.location().rstrip("/")
        metadata_files = list_dir(self._locations, f"{location}/{METADATA_DIR}")[0]
        logged = {e.metadata_file for e in self._table.metadata.metadata_log} | {self._table.metadata_location}
        foreign, unreadable = foreign_metadata(self._table, [
            p for p in metadata_files if p not in logged and metadata_json_version(p) >= 0])
        if foreign:
            # Another table's files share this location (a table created over one whose catalog
            # entry was lost): nothing here can be told apart from that table's.
            message = (f"state table {self._name} shares its location {location} with another table ({foreign[0]}): "
                       "the orphan sweep deletes nothing there; see `icestate recover`")
            if run is not None:  # a sweep asked for: say it did nothing
                raise CorruptMetadataError(message)
            logger.error("%s", message)
            return [], []
        metadata = self._table.metadata
        newest = newest_checkpoint_id(metadata)
        data_dir = f"{location}/{DATA_DIR}"
        if full or self._swept_below is None:
            # data/ itself: the checkpoint directories, and the segments of a table written before them
            flat, windows = self._list_dir(data_dir)
        else:
            flat, windows = {}, window_dirs(self._swept_below, newest)
        young = time.time() - COMPACTION_GRACE_SECONDS
        mtimes = {**metadata_files, **flat}
        every_live = live_files(self._cache, metadata.snapshots)
        found = orphans(
            list(flat), [p for p in metadata_files if p not in unreadable], metadata,
            self._table.metadata_location, self._cache,
            operator_files=list(list_dir(self._locations, f"{data_dir}/{OPERATOR_DIR}")[0]),
            settled=lambda uri: mtimes.get(uri) is not None and mtimes[uri] < young, live=every_live,
        )
        live: dict[str, set[str]] = {name: set() for name in windows}
        for uri in every_live:
            # by the directory's name: a fork's files of the same name only add to what is kept
            name = uri.rsplit("/", 2)[-2] if uri.count("/") >= 2 else ""
            if name in live:
                live[name].add(uri)
        io = tuple(sorted(io_properties(self._table.io.properties).items()))
        works = [DirectorySweep(location, io, f"{data_dir}/{name}", frozenset(live[name]), newest, young)
                 for name in windows]
        if run is None:
            done = [_sweep_listed(w, list_dir(self._locations, w.directory)[0], delete=None) for w in works]
            found += [uri for d in done for uri in d.orphans]
        else:
            done = run(works) if works else []
        self._swept_below = next_sweep_start(newest, [d.undecided_from for d in done])
        return found + self._stale_scratch(f"{location}/{SCRATCH_OUTPUTS_DIR}", young), done

    def sweep_all(self, run: Callable[[list[DirectorySweep]], list[DirectoryFound]]) -> SweepResult:
        """A full sweep of main (``icestate sweep``): every checkpoint directory listed and its
        orphans deleted where ``run`` sends it (``sweep_directory`` in threads of this process, or
        as Spark tasks); the metadata directory and ``data/`` itself here. No expiry: how many
        checkpoints to retain is the writer's to say. Safe beside a running writer, as the
        writer's own sweeps are: the orphan rules keep every file a commit may still take."""
        if self._branch != MAIN_BRANCH:
            raise ValueError(f"only main is swept; the files of fork {self._branch!r} of state table {self._name} go "
                             "with the fork")
        for attempt in range(SWEEP_ATTEMPTS):
            try:
                here, done = self._orphans(full=True, run=run)
                break
            except FileNotFoundError:
                # The writer expired snapshots (and deleted their files) since this process read
                # the metadata: read it again.
                if attempt == SWEEP_ATTEMPTS - 1:
                    raise
                self._table.refresh()
        self._delete_later(here)
        wait_for_deletes()
        return SweepResult(directories=len(done), listed=sum(d.listed for d in done),
                           deleted=len(here) + sum(len(d.orphans) for d in done),
                           processes=tuple(sorted({d.pid for d in done})))

    def _list_dir(self, directory_uri: str) -> tuple[dict[str, float | None], list[str]]:
        """The files of a directory (URI -> modification time) and its checkpoint directories."""
        files, dirs = list_dir(self._locations, directory_uri)
        return files, [d for d in dirs if parse_window_dir(d) is not None]

    def _stale_scratch(self, root: str, older_than: float) -> list[str]:
        """A Spark query's output files for its callback under ``root`` that a crashed driver
        left: a callback deletes its batch's files right after it ran."""
        selector = pafs.FileSelector(self._locations.to_path(root), allow_not_found=True, recursive=True)
        return [self._locations.to_uri(i.path) for i in self._locations.filesystem.get_file_info(selector)
                if i.type == pafs.FileType.File and parse_output_name(i.path) is not None
                and i.mtime is not None and i.mtime.timestamp() < older_than]

    def _delete_file(self, uri: str) -> None:
        delete_file(self._locations, uri, self._name)


def initial_sweep_start(metadata: TableMetadata) -> int | None:
    """Where main's incremental orphan sweep starts for a new writer: the mark the newest
    checkpoint that carries one holds (``SUMMARY_SWEPT_BELOW``; it may have gone down since an
    older one, for a compaction output still undecided), or None when none does (sweep
    everything). A mark that is not a plain number is ignored."""
    marked = [(s.sequence_number or 0, s.timestamp_ms, summary_value(s, stored_keys.SUMMARY_SWEPT_BELOW))
              for s in metadata.snapshots]
    marked = [m for m in marked if m[2] is not None and _MARK.fullmatch(m[2])]
    return int(max(marked)[2]) if marked else None


def next_sweep_start(newest: int, undecided: Iterable[int | None]) -> int:
    """The lowest checkpoint id the next incremental sweep lists again, after a sweep at
    checkpoint ``newest`` whose directories held compaction outputs still ``undecided`` from
    these base checkpoint ids (``DirectoryFound.undecided_from``).

    Every file named after a checkpoint id is written while that id is at most
    ``COMPACTION_GRACE_CHECKPOINTS`` past the newest (a task's segment, or a compaction's output
    of that base), so ids below ``newest - COMPACTION_GRACE_CHECKPOINTS`` get no new files. A
    compaction output younger than ``COMPACTION_GRACE_SECONDS`` may still commit or become an
    orphan: its directory is listed again until it has settled. A file a stalled process writes
    later still waits for a full sweep (``icestate sweep``).
    """
    return min([max(0, newest - COMPACTION_GRACE_CHECKPOINTS), *(u for u in undecided if u is not None)])


@dataclass(frozen=True)
class DirectorySweep:
    """One checkpoint directory of main's sweep, planned by the writer and listed anywhere:
    the table's location and storage properties, the directory, the files of it the retained
    snapshots reference (a superset is safe: only more is kept), the newest checkpoint id, and
    before when a compaction output counts as settled (epoch seconds)."""

    location: str
    io: tuple[tuple[str, str], ...] = field(repr=False)  # storage settings: may hold secrets
    directory: str
    live: frozenset[str] = field(repr=False)
    newest: int
    settled_before: float


@dataclass(frozen=True)
class DirectoryFound:
    """What the sweep of one directory found: the files listed, the orphans (deleted unless the
    writer deletes them itself), the lowest base of a compaction output still undecided, and the
    process that listed it."""

    directory: str
    listed: int
    orphans: tuple[str, ...]
    undecided_from: int | None
    pid: int


@dataclass(frozen=True)
class SweepResult:
    """A full sweep: the checkpoint directories listed, their files, the files deleted (orphans
    of the directories, of ``data/`` itself and of the metadata directory), and the processes
    that listed the directories."""

    directories: int
    listed: int
    deleted: int
    processes: tuple[int, ...]

    def summary(self) -> dict[str, int]:
        return {"directories": self.directories, "files_listed": self.listed, "files_deleted": self.deleted,
                "processes": len(self.processes)}


def sweep_directory(work: DirectorySweep) -> DirectoryFound:
    """List one checkpoint directory and delete its orphans, in any process (a thread of the
    writer's, a Spark task on an executor): ``GarbageCollector.sweep_all``."""
    locations = locations_of(work.location, dict(work.io))
    return _sweep_listed(work, list_dir(locations, work.directory)[0], delete=locations)


def _sweep_listed(work: DirectorySweep, files: dict[str, float | None], delete: Locations | None) -> DirectoryFound:
    found = data_orphans(files, work.live, work.newest,
                         lambda uri: files.get(uri) is not None and files[uri] < work.settled_before)
    if delete is not None:
        for uri in found:
            delete_file(delete, uri, work.location)
    # A compaction output no checkpoint holds yet, too young to tell (committed ones are for
    # expiry; without a modification time only a full sweep can tell).
    undecided = [parse_compaction_name(uri)[0] for uri, mtime in files.items()
                 if parse_compaction_name(uri) is not None and uri not in found and uri not in work.live
                 and mtime is not None and mtime >= work.settled_before]
    return DirectoryFound(work.directory, len(files), tuple(found), min(undecided, default=None), os.getpid())


def delete_file(locations: Locations, uri: str, table: str) -> None:
    """Delete one file of ``table``; a missing one is already deleted (an earlier, interrupted
    collection), a failure is logged: a full sweep (``icestate sweep``) takes it later."""
    try:
        locations.filesystem.delete_file(locations.to_path(uri))
    except FileNotFoundError:
        return
    except OSError as e:
        logger.warning("could not delete %s of state table %s (%s); a full sweep (`icestate sweep`) takes it later",
                       uri, table, e)


def list_dir(locations: Locations, directory_uri: str) -> tuple[dict[str, float | None], list[str]]:
    """The files of a directory (URI -> modification time, epoch seconds; None when the
    filesystem has none) and the names of its subdirectories; nothing when it does not exist."""
    selector = pafs.FileSelector(locations.to_path(directory_uri), allow_not_found=True)
    infos = locations.filesystem.get_file_info(selector)
    files = {locations.to_uri(i.path): (None if i.mtime is None else i.mtime.timestamp())
             for i in infos if i.type == pafs.FileType.File}
    return files, sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


def run_in_threads(works: list[DirectorySweep], threads: int = 8,
                   progress: Callable[[DirectoryFound], None] | None = None) -> list[DirectoryFound]:
    """``sweep_directory`` of each directory in threads of this process (``sweep_all``'s ``run``)."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(works)))) as pool:
        done = []
        for found in pool.map(sweep_directory, works):
            done.append(found)
            if progress is not None:
                progress(found)
        return done


def run_on_spark(spark: Any, tasks_max: int = 64) -> Callable[[list[DirectorySweep]], list[DirectoryFound]]:
    """``sweep_all``'s ``run`` as one Spark job of ``spark`` (a classic SparkSession): the
    directories in at most ``tasks_max`` tasks, listed and swept on the executors."""
    def run(works: list[DirectorySweep]) -> list[DirectoryFound]:
        context = spark.sparkContext
        return context.parallelize(works, max(1, min(tasks_max, len(works)))).map(sweep_directory).collect()
    return run
