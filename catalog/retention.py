"""Which snapshots a state table keeps, and which files may be deleted. Pure planning.

Retention keeps, on the current line (the ancestors of the main branch head), the newest
``retain`` checkpoints and every snapshot between them (a compaction snapshot between two
retained checkpoints stays), plus the head of every other branch and tag (savepoints).
Everything else is expired: older ancestors and snapshots of abandoned lines (what a
restore to an older checkpoint left behind).

pyiceberg's expiry deletes no file. Deleting is safe only for a file that no retained
snapshot references, so the plan is computed over every retained snapshot:

1. manifest lists of expired snapshots (each snapshot has its own);
2. manifests that only expired snapshots list (most are carried forward by appends);
3. data files named in those manifests that no retained snapshot holds live.

A crash between expiry and deletion loses the expired snapshots, and with them the list
of files to delete. ``orphans`` finds such files (and those of crashed commits) again by
name: segments carry their checkpoint id (``statestore.paths``), manifests and manifest
lists of checkpoint commits carry it in their commit UUID (``catalog.naming``). A file is
an orphan only when no snapshot in the metadata references it and its checkpoint id is
at most the newest committed one, so files of a checkpoint being written now are safe.
Metadata files of other writers are never touched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from catalog import properties as props
from catalog.manifests import ManifestCache
from catalog.naming import checkpoint_of_commit_file
from statestore.paths import parse_segment_name

_METADATA_JSON = re.compile(r"^(\d+)-[^/]*\.metadata\.json$")


def checkpoint_id_of(snapshot: Snapshot) -> int | None:
    """The checkpoint id a snapshot's summary carries; None for other snapshots."""
    value = snapshot.summary.additional_properties.get(props.SUMMARY_CHECKPOINT_ID) if snapshot.summary else None
    return None if value is None else int(value)


def main_line(metadata: TableMetadata) -> list[Snapshot]:
    """Ancestors of the main branch head that are still in the metadata, newest first."""
    return list(ancestors_of(metadata.snapshot_by_name(MAIN_BRANCH), metadata))


def checkpoints_on_line(metadata: TableMetadata) -> list[tuple[int, Snapshot]]:
    """(checkpoint id, snapshot) of the checkpoints on the main line, oldest first."""
    found = [(checkpoint_id_of(s), s) for s in main_line(metadata)]
    return [(cp, s) for cp, s in reversed(found) if cp is not None]


def newest_checkpoint_id(metadata: TableMetadata) -> int:
    """Highest checkpoint id ever committed to the table (0 for none): the table property,
    or a snapshot that carries a higher one (a table written before the property existed)."""
    ids = [checkpoint_id_of(s) for s in metadata.snapshots]
    recorded = int(metadata.properties.get(props.LAST_CHECKPOINT_ID, "0"))
    return max([recorded, *(i for i in ids if i is not None)])


@dataclass(frozen=True)
class RetentionPlan:
    retained: tuple[Snapshot, ...]
    expired: tuple[Snapshot, ...]


def plan_retention(metadata: TableMetadata, retain_checkpoints: int) -> RetentionPlan:
    """Snapshots to keep and to expire; see the module docstring for the rule."""
    keep: set[int] = set()
    kept_checkpoints = 0
    for snapshot in main_line(metadata):
        if kept_checkpoints == retain_checkpoints:
            break
        keep.add(snapshot.snapshot_id)
        kept_checkpoints += checkpoint_id_of(snapshot) is not None
    keep |= {ref.snapshot_id for ref in metadata.refs.values()}
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


def live_files(cache: ManifestCache, snapshots: Iterable[Snapshot]) -> set[str]:
    """URIs of the data files any of ``snapshots`` holds."""
    manifests = {m.manifest_path: m for s in snapshots for m in cache.manifests(s)}
    return {e.path for m in manifests.values() for e in cache.entries(m) if e.live}


def orphans(
    data_files: Iterable[str], metadata_files: Iterable[str], metadata: TableMetadata,
    metadata_location: str, cache: ManifestCache,
) -> list[str]:
    """URIs among the listed files of the data and metadata directories that may be deleted.

    ``data_files`` and ``metadata_files`` are URIs of the files found in the table's data
    and metadata directories; see the module docstring for what counts as an orphan.
    """
    newest = newest_checkpoint_id(metadata)
    snapshots = metadata.snapshots
    live = live_files(cache, snapshots)
    found = [p for p in data_files if _is_ours_and_old(parse_segment_name(p), newest) and p not in live]
    referenced = cache.manifest_paths(snapshots) | {s.manifest_list for s in snapshots}
    found += [p for p in metadata_files if _is_old_commit_file(p, newest) and p not in referenced]
    found += _stale_metadata_json(metadata_files, metadata, metadata_location)
    return found


def _is_ours_and_old(parsed: tuple[int, int, int] | None, newest_checkpoint: int) -> bool:
    return parsed is not None and parsed[0] <= newest_checkpoint


def _is_old_commit_file(path: str, newest_checkpoint: int) -> bool:
    checkpoint_id = checkpoint_of_commit_file(path)
    return checkpoint_id is not None and checkpoint_id <= newest_checkpoint


def _stale_metadata_json(paths: Iterable[str], metadata: TableMetadata, metadata_location: str) -> list[str]:
    """metadata.json files older than the current one that the metadata log no longer lists.

    Only versions below the current one: a writer racing us writes a higher version, and
    an older one can no longer win the catalog's compare-and-swap.
    """
    current = _metadata_version(metadata_location)
    logged = {e.metadata_file for e in metadata.metadata_log} | {metadata_location}
    return [p for p in paths if p not in logged and -1 < _metadata_version(p) < current]


def _metadata_version(path: str) -> int:
    m = _METADATA_JSON.match(path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else -1
