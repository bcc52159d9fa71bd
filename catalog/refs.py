"""Savepoints and forks of a state table: its Iceberg tags and branches.

Role: name, list and drop the references of a state table other than ``main``.

* A savepoint is an Iceberg tag on a checkpoint's snapshot. Retention never expires a
  tagged snapshot (``catalog.retention``), and a table opens or restores at a savepoint as
  at a checkpoint.
* A fork is an Iceberg branch created at a checkpoint or savepoint, with the table
  property ``fork_base_key(name)`` recording the snapshot it was forked at (so a query can
  tell that a fork has not moved yet). Its own checkpoint ids, segment directory and
  retention are the commit's business (``catalog.commit``, ``catalog.gc``).

Invariants: a reference name is 1-100 letters, digits, ``_``, ``.`` or ``-`` and never
``main``; one name is either a savepoint or a fork. Removing a fork also removes its table
properties, in the same catalog commit.

Thread safety: none of its own. Every function works on the pyiceberg ``Table`` it is given
and commits through its catalog, whose compare-and-swap makes concurrent writers of other
references safe; callers refresh the table first where they read references.
"""

from __future__ import annotations

from pyiceberg.table import Table
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.table.update.snapshot import ManageSnapshots

from catalog.retention import checkpoints_on_line
from statestore import stored_keys
from statestore.errors import CheckpointNotFoundError
from statestore.names import check_ref_name


def _name(table: Table) -> str:
    return ".".join(table.name())


def _refs_of_type(table: Table, ref_type: SnapshotRefType) -> dict[str, int]:
    """{name: snapshot id} of the table's references of one type, ``main`` excluded, by name."""
    return {name: ref.snapshot_id for name, ref in sorted(table.metadata.refs.items())
            if name != MAIN_BRANCH and ref.snapshot_ref_type == ref_type}


def check_branch(table: Table, branch: str) -> None:
    """Raise ValueError unless ``branch`` is ``main`` or a fork of ``table``."""
    if not isinstance(branch, str) or not branch:
        raise ValueError(f"branch must be a non-empty string, got {branch!r}")
    if branch == MAIN_BRANCH:
        return
    if branch not in _refs_of_type(table, SnapshotRefType.BRANCH):
        forks = sorted(_refs_of_type(table, SnapshotRefType.BRANCH))
        raise ValueError(f"state table {_name(table)} has no fork {branch!r} (forks: {forks}); "
                         "create it with fork(name, checkpoint_id) on a table opened at main")


def check_new_ref(table: Table, name: str, what: str) -> None:
    """Raise ValueError unless ``name`` is a valid name no reference of ``table`` has yet."""
    check_ref_name(name, what)
    ref = table.metadata.refs.get(name)
    if ref is not None:
        kind = "savepoint" if ref.snapshot_ref_type == SnapshotRefType.TAG else "fork"
        raise ValueError(f"state table {_name(table)} already has a {kind} named {name!r}")


def savepoint_snapshot(table: Table, name: str) -> Snapshot:
    """The snapshot the savepoint ``name`` tags. Raises CheckpointNotFoundError when there is none."""
    tags = _refs_of_type(table, SnapshotRefType.TAG)
    if name not in tags:
        raise CheckpointNotFoundError(f"state table {_name(table)} has no savepoint {name!r} "
                                      f"(savepoints: {sorted(tags)})")
    return table.metadata.snapshot_by_id(tags[name])


def create_savepoint(table: Table, name: str, snapshot: Snapshot) -> None:
    """Tag ``snapshot`` (a checkpoint's) as the savepoint ``name`` (checked by ``check_new_ref``)."""
    table.manage_snapshots().create_tag(snapshot.snapshot_id, name).commit()


def savepoint_snapshots(table: Table) -> dict[str, Snapshot]:
    """Every savepoint's snapshot, by name."""
    return {name: table.metadata.snapshot_by_id(snapshot_id)
            for name, snapshot_id in _refs_of_type(table, SnapshotRefType.TAG).items()}


def remove_savepoint(table: Table, name: str) -> None:
    """Drop the savepoint ``name``. Raises CheckpointNotFoundError when there is none."""
    savepoint_snapshot(table, name)
    table.manage_snapshots().remove_tag(name).commit()


def create_fork(table: Table, name: str, snapshot: Snapshot) -> None:
    """Create the fork ``name`` at ``snapshot`` and record its base, in one catalog commit."""
    tx = table.transaction()
    ManageSnapshots(tx).create_branch(snapshot.snapshot_id, name).commit()
    tx.set_properties({stored_keys.fork_base_key(name): str(snapshot.snapshot_id)})
    tx.commit_transaction()


def fork_newest_checkpoints(table: Table) -> dict[str, Snapshot | None]:
    """Every fork's newest checkpoint snapshot (None when its line holds none), by name."""
    out: dict[str, Snapshot | None] = {}
    for name in _refs_of_type(table, SnapshotRefType.BRANCH):
        line = checkpoints_on_line(table.metadata, name)
        out[name] = line[-1][1] if line else None
    return out


def remove_fork(table: Table, name: str) -> None:
    """Drop the fork ``name`` and its table properties, in one catalog commit. Raises
    ValueError when there is no such fork."""
    forks = _refs_of_type(table, SnapshotRefType.BRANCH)
    if name not in forks:
        raise ValueError(f"state table {_name(table)} has no fork {name!r} (forks: {sorted(forks)})")
    tx = table.transaction()
    ManageSnapshots(tx).remove_branch(name).commit()
    present = table.metadata.properties  # pyiceberg refuses to remove a property that is not there
    tx.remove_properties(*(k for k in stored_keys.fork_property_keys(name) if k in present))
    tx.commit_transaction()


def is_at_fork_point(table: Table, branch: str, snapshot: Snapshot | None) -> bool:
    """Whether ``snapshot`` is the one the fork ``branch`` was created at (False on main)."""
    if branch == MAIN_BRANCH or snapshot is None:
        return False
    base = stored_keys.get(table.metadata.properties, stored_keys.fork_base_key(branch))
    return base is not None and int(base) == snapshot.snapshot_id
