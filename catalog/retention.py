"""Which snapshots a state table keeps, and which files may be deleted. Pure planning.

Retention, run by the writer of one branch (``main`` for a stream, or a fork), keeps on
that branch's line (the ancestors of its head) the newest ``retain`` checkpoints and every
snapshot between them (a compaction snapshot between two retained checkpoints stays); the
whole line of every other branch, which its own writer trims; and the snapshot of every
tag (savepoints, never expired). Everything else is expired: older ancestors on the
writer's line that no other branch shares, and snapshots of abandoned lines (what a restore
to an older checkpoint left behind). A fork thus keeps the history it shares with ``main``
until it is removed.

pyiceberg's expiry deletes no file. Deleting is safe only for a file that no retained
snapshot references, so the plan is computed over every retained snapshot:

1. manifest lists of expired snapshots (each snapshot has its own);
2. manifests that only expired snapshots list (most are carried forward by appends);
3. data files named in those manifests that no retained snapshot holds live.

A crash between expiry and deletion loses the expired snapshots, and with them the list
of files to delete. ``orphans`` finds such files (and those of crashed commits) again by
name, among the files a sweep lists (the writer's own sweeps list the checkpoint
directories written since their last pass, so older leftovers of this kind wait for a full
sweep, ``catalog.gc``): segments carry their checkpoint id (``statestore.paths``), manifests and manifest
lists of checkpoint commits carry it in their commit UUID (``catalog.naming``). A file is
an orphan only when no snapshot in the metadata references it and its checkpoint id is
at most the newest committed one, so files of a checkpoint being written now are safe. A
compaction's output names the checkpoint it was planned on: it is an orphan only once
``COMPACTION_GRACE_CHECKPOINTS`` newer checkpoints are committed (the compaction no longer
tries to commit it, ``statestore.paths``) and the file is older than
``COMPACTION_GRACE_SECONDS`` (an attempt begun before may still be retrying inside
pyiceberg; Iceberg's own orphan removal keeps files younger than days for this reason).
The manifests and manifest list a compaction's commit wrote carry that checkpoint too
(``catalog.naming``): when the commit crashed or lost its race, they are orphans under the
same two conditions. Metadata files of other writers are never touched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from catalog.manifests import ManifestCache
from catalog.naming import base_of_compaction_commit_file, checkpoint_of_commit_file, metadata_json_version
from statestore import stored_keys
from statestore.paths import (
    COMPACTION_GRACE_CHECKPOINTS,
    parse_compaction_name,
    parse_operator_name,
    parse_segment_name,
)


def checkpoint_id_of(snapshot: Snapshot) -> int | None:
    """The checkpoint id a snapshot's summary carries; None for other snapshots."""
    value = summary_value(snapshot, stored_keys.SUMMARY_CHECKPOINT_ID)
    return None if value is None else int(value)


def summary_value(snapshot: Snapshot, key: str) -> str | None:
    """A state store key of a snapshot's summary, under its current or legacy name."""
    return stored_keys.get(snapshot.summary.additional_properties, key) if snapshot.summary else None


def line(metadata: TableMetadata, branch: str = MAIN_BRANCH) -> list[Snapshot]:
    """Ancestors of ``branch``'s head that are still in the metadata, newest first."""
    return list(ancestors_of(metadata.snapshot_by_name(branch), metadata))


def checkpoints_on_line(metadata: TableMetadata, branch: str = MAIN_BRANCH) -> list[tuple[int, Snapshot]]:
    """(checkpoint id, snapshot) of the checkpoints on ``branch``'s line, oldest first."""
    found = [(checkpoint_id_of(s), s) for s in line(metadata, branch)]
    return [(cp, s) for cp, s in reversed(found) if cp is not None]


def newest_checkpoint_id(metadata: TableMetadata, branch: str = MAIN_BRANCH) -> int:
    """Highest checkpoint id committed on ``branch`` (0 for none), which the next checkpoint
    must exceed. For ``main``: of the whole table but the forks' own snapshots (the table
    property, or a snapshot that carries a higher one: a table written before the property
    existed), so ids stay monotonic after an abandoned line is expired. For a fork: its own property, or the
    newest on its line (it continues the ids of the checkpoint it was forked from)."""
    if branch == MAIN_BRANCH:
        on_forks = {s.snapshot_id for name, ref in metadata.refs.items()
                    if name != MAIN_BRANCH and ref.snapshot_ref_type == SnapshotRefType.BRANCH
                    for s in line(metadata, name)} - {s.snapshot_id for s in line(metadata)}
        # Neither the forks' lines nor a removed fork's snapshots not yet expired (on no branch;
        # their summary names the fork) count toward main's ids.
        ids = [checkpoint_id_of(s) for s in metadata.snapshots if s.snapshot_id not in on_forks
               and summary_value(s, stored_keys.SUMMARY_BRANCH) in (None, MAIN_BRANCH)]
        recorded = int(stored_keys.get(metadata.properties, stored_keys.LAST_CHECKPOINT_ID, "0"))
    else:
        ids = [checkpoint_id_of(s) for s in line(metadata, branch)]
        recorded = int(stored_keys.get(metadata.properties, stored_keys.last_checkpoint_id_key(branch), "0"))
    return max([recorded, *(i for i in ids if i is not None)])


@dataclass(frozen=True)
class RetentionPlan:
    retained: tuple[Snapshot, ...]
    expired: tuple[Snapshot, ...]


def plan_retention(metadata: TableMetadata, retain_checkpoints: int, branch: str = MAIN_BRANCH) -> RetentionPlan:
    """Snapshots to keep and to expire by the writer of ``branch``; see the module docstring."""
    keep: set[int] = set()
    kept_checkpoints = 0
    for snapshot in line(metadata, branch):
        if kept_checkpoints == retain_checkpoints:
            break
        keep.add(snapshot.snapshot_id)
        kept_checkpoints += checkpoint_id_of(snapshot) is not None
    for name, ref in metadata.refs.items():
        keep.add(ref.snapshot_id)
        if name != branch and ref.snapshot_ref_type == SnapshotRefType.BRANCH:
            keep |= {s.snapshot_id for s in line(metadata, name)}
    retained = tuple(s for s in metadata.snapshots if s.snapshot_id in keep)
    expired = tuple(s for s in metadata.snapshots if s.snapshot_id not in keep)
    return RetentionPlan(retained, expired)


def unreferenced_files(cache: ManifestCache, expired: Sequence[Snapshot], retained: Sequence[Snapshot]) -> list[str]:
    """URIs that only ``expired`` snapshots reference: data files, then manifests, then manifest lists."""
    kept_manifests = cache.manifest_paths(retained)
    doomed = {m.manifest_path: m for s in expired for m in cache.manifests(s) if m.manifest_path not in kept_manifests}
    candidates = {e.path for m in doomed.values() for e in cache.entries(m)}
    if candidates:
        candidates -= live_files(cache, retained)
    lists = {s.manifest_list for s in expired} - {s.manifest_list for s in retained}
    return sorted(candidates) + sorted(doomed) + sorted(lists)


def operator_files_of(snapshot: Snapshot) -> list[dict]:
    """The operator state files a checkpoint snapshot lists (``statestore.operator_state``)."""
    value = summary_value(snapshot, stored_keys.SUMMARY_OPERATOR_STATE)
    return [] if not value else json.loads(value)


def unreferenced_operator_files(expired: Sequence[Snapshot], retained: Sequence[Snapshot]) -> list[str]:
    """URIs of operator state files that only ``expired`` snapshots list."""
    kept = {f["path"] for s in retained for f in operator_files_of(s)}
    return sorted({f["path"] for s in expired for f in operator_files_of(s)} - kept)


def live_files(cache: ManifestCache, snapshots: Iterable[Snapshot]) -> set[str]:
    """URIs of the data files any of ``snapshots`` holds."""
    manifests = {m.manifest_path: m for s in snapshots for m in cache.manifests(s)}
    return {e.path for m in manifests.values() for e in cache.entries(m) if e.live}


def orphans(
    data_files: Iterable[str], metadata_files: Iterable[str], metadata: TableMetadata,
    metadata_location: str, cache: ManifestCache, operator_files: Iterable[str] = (),
    settled: Callable[[str], bool] = lambda uri: True, live: set[str] | None = None,
) -> list[str]:
    """URIs among the listed files of the data and metadata directories that may be deleted.

    ``data_files`` and ``metadata_files`` are URIs of the files found in the table's data
    and metadata directories; see the module docstring for what counts as an orphan.
    ``settled(uri)`` says whether a compaction output, or a manifest or manifest list of a
    compaction's commit, is old enough to be past any commit attempt of its compaction
    (``COMPACTION_GRACE_SECONDS``). ``live``: the data files of the snapshots, when the caller
    has them already (``live_files``).
    """
    newest = newest_checkpoint_id(metadata)
    snapshots = metadata.snapshots
    past_grace = newest - COMPACTION_GRACE_CHECKPOINTS  # a compaction planned at or before it can no longer commit
    found = data_orphans(data_files, live_files(cache, snapshots) if live is None else live, newest, settled)
    referenced = cache.manifest_paths(snapshots) | {s.manifest_list for s in snapshots}
    found += [p for p in metadata_files if p not in referenced and (
        _is_old_commit_file(p, newest)
        or (_is_ours_and_old((base_of_compaction_commit_file(p),), past_grace) and settled(p)))]
    found += _stale_metadata_json(metadata_files, metadata, metadata_location)
    listed = {f["path"] for s in snapshots for f in operator_files_of(s)}
    found += [p for p in operator_files if p not in listed and _is_ours_and_old(parse_operator_name(p), newest)]
    return found


def data_orphans(data_files: Iterable[str], live: Container[str], newest: int,
                 settled: Callable[[str], bool]) -> list[str]:
    """The segments and compaction outputs among ``data_files`` that may be deleted, given the
    ``live`` files of the retained snapshots and the ``newest`` checkpoint id (``orphans``)."""
    past_grace = newest - COMPACTION_GRACE_CHECKPOINTS  # a compaction planned at or before it can no longer commit
    return [p for p in data_files if p not in live and (
        _is_ours_and_old(parse_segment_name(p), newest)
        or (_is_ours_and_old(parse_compaction_name(p), past_grace) and settled(p)))]


def _is_ours_and_old(parsed: tuple[int | None, ...] | None, newest_checkpoint: int) -> bool:
    return parsed is not None and parsed[0] is not None and parsed[0] <= newest_checkpoint


def _is_old_commit_file(path: str, newest_checkpoint: int) -> bool:
    checkpoint_id = checkpoint_of_commit_file(path)
    return checkpoint_id is not None and checkpoint_id <= newest_checkpoint


def _stale_metadata_json(paths: Iterable[str], metadata: TableMetadata, metadata_location: str) -> list[str]:
    """metadata.json files up to the current version that are neither the current one nor
    listed by the metadata log.

    A metadata.json of version v is written by a commit based on version v - 1; once the
    catalog holds the current version, one of a version up to it that is not the current file
    can no longer win the catalog's compare-and-swap (a lost race, or a commit that stored its
    metadata.json beside its last waits and failed before the switch). A writer racing us
    writes a higher version: never taken.
    """
    current = metadata_json_version(metadata_location)
    logged = {e.metadata_file for e in metadata.metadata_log} | {metadata_location}
    return [p for p in paths if p not in logged and -1 < metadata_json_version(p) <= current]
