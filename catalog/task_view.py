"""What a task needs of a checkpoint, shipped by the driver, so that tasks never open the catalog.

Disaggregated state means any host can run any task. A task that loaded the table from the
catalog itself could not run where the catalog is out of reach (the embedded SQLite catalog is
a file on the driver's disk), would put one catalog round trip and the reading of the table's
metadata and manifests on every cold task, and could race the driver's commits. Instead the
driver, which alone commits, describes the checkpoint a batch starts from
(``IcebergStateTable.checkpoint_view``): the table's location, the checkpoint, every live
segment (path, checkpoint, key-group bounds, size, from the manifests the driver already
holds), the operator state files, and the storage (FileIO) properties; a task opens that
description as a ``TaskStateTable``, reading nothing until it loads a key group.

The storage properties are the table's FileIO properties only (``s3.*``, ``gcs.*``,
``adls.*``, ``hdfs.*``, ``client.*``, ``hf.*``, ``py-io-impl``): never the catalog's URI, token
or credential, which a task has no use for. They travel inside the pickled batch plan, which
Spark sends to executors over its RPC channel and shows nowhere; every ``repr`` of a view
hides them (``catalog.table_ref.redacted``).

A ``TaskStateTable`` is a read-only ``StateTable``: it lists the shipped segments, names fresh
segment paths, and moves to the next batch's view (``advance``); ``commit_checkpoint`` refuses,
since the driver commits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs

from catalog.naming import Locations
from catalog.table_ref import redacted
from statestore.errors import CheckpointNotFoundError, StateClosedError, TaskCommitError
from statestore.keygroups import KeyGroupRange
from statestore.layout import StateLayout
from statestore.operator_state import OperatorStateFile
from statestore.paths import operator_file_name, segment_file_name, window_dir
from statestore.table import CheckpointInfo, SegmentFile

if TYPE_CHECKING:
    from pyiceberg.io import FileIO

# FileIO property names a task may need (pyiceberg.io's families), and nothing else.
_IO_PREFIXES = ("s3.", "gcs.", "adls.", "hdfs.", "client.", "hf.", "py-io-impl")


def io_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """The storage (FileIO) properties among a table's or catalog's ``properties``."""
    return {k: v for k, v in properties.items() if k.startswith(_IO_PREFIXES)}


@dataclass(frozen=True)
class CheckpointView:
    """A checkpoint of a state table as a task sees it: plain values, picklable.

    ``data_dir`` is the URI of this branch's data directory (new segments go to its
    ``window_dir``), ``operator_dir`` where the operator state files go; ``segments`` are the
    live segments of ``checkpoint`` (filesystem paths), oldest checkpoint first;
    ``next_checkpoint_id`` is the id the batch will commit.
    """

    identifier: str
    location: str
    branch: str
    max_parallelism: int
    partition_width: int
    file_schema: pa.Schema
    data_dir: str
    operator_dir: str
    checkpoint: CheckpointInfo | None
    segments: tuple[SegmentFile, ...]
    operator_state: tuple[OperatorStateFile, ...]
    next_checkpoint_id: int
    io: dict[str, str] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        cp = None if self.checkpoint is None else self.checkpoint.checkpoint_id
        return (f"CheckpointView({self.identifier}@{self.branch}, checkpoint={cp}, segments={len(self.segments)}, "
                f"io={redacted(self.io)})")

    @property
    def checkpoint_id(self) -> int | None:
        return None if self.checkpoint is None else self.checkpoint.checkpoint_id


# Filesystems kept per process, the least recently used dropped first: one per storage and
# storage properties, and the properties change when credentials are renewed (a session token
# per hour), so a worker running for days would otherwise keep one client per renewal.
LOCATIONS_MAX = 16
_LOCATIONS: OrderedDict[tuple, Locations] = OrderedDict()
_LOCATIONS_LOCK = threading.Lock()


def locations_of(location: str, io: Mapping[str, str]) -> Locations:
    """The filesystem of a table location with these storage properties, one per process (a
    Python worker runs many tasks: each would otherwise build its own S3 client)."""
    key = (location.split("://", 1)[0], _netloc(location), tuple(sorted(io.items())))
    with _LOCATIONS_LOCK:
        found = _LOCATIONS.get(key)
        if found is None:
            found = _LOCATIONS[key] = Locations.of(location, _file_io(location, io))
            while len(_LOCATIONS) > LOCATIONS_MAX:
                _LOCATIONS.popitem(last=False)
        _LOCATIONS.move_to_end(key)
        return found


# FileIOs whose filesystem for a local location is Arrow's local one (``catalog.fileio``'s
# ``STATE_FILE_IO``, pyiceberg's pyarrow FileIO), so that a task on a local table needs neither.
LOCAL_AS_ARROW_FILE_IOS = frozenset({"catalog.fileio.StateFileIO", "pyiceberg.io.pyarrow.PyArrowFileIO"})


def _file_io(location: str, io: Mapping[str, str]) -> FileIO | None:
    """The FileIO pyiceberg picks for ``location``; none for a local location whose filesystem
    would be Arrow's local one either way: importing pyiceberg's FileIO and what it imports
    (Arrow datasets, pandas) cost each Python worker 0.4 s."""
    scheme = location.split("://", 1)[0] if "://" in location else "file"
    if scheme == "file" and io.get("py-io-impl", "pyiceberg.io.pyarrow.PyArrowFileIO") in LOCAL_AS_ARROW_FILE_IOS:
        return None
    from pyiceberg.io import load_file_io

    return load_file_io(dict(io), location)


def _netloc(location: str) -> str:
    rest = location.split("://", 1)[1] if "://" in location else ""
    return rest.split("/", 1)[0]


class TaskStateTable:
    """A ``statestore.table.StateTable`` over a shipped ``CheckpointView``: reads, never commits."""

    def __init__(self, view: CheckpointView, layout: StateLayout):
        if layout.max_parallelism != view.max_parallelism:
            raise ValueError(f"layout has max parallelism {layout.max_parallelism}, state table {view.identifier} "
                             f"{view.max_parallelism}")
        self._layout = layout
        self._locations = locations_of(view.location, view.io)
        self._view = view
        self._closed = False

    @property
    def view(self) -> CheckpointView:
        return self._view

    def advance(self, view: CheckpointView) -> None:
        """Move to another view of the same table (the next batch's base checkpoint)."""
        self._check_open()
        if (view.location, view.branch) != (self._view.location, self._view.branch):
            raise ValueError(f"a view of {view.identifier}@{view.branch} cannot replace one of "
                             f"{self._view.identifier}@{self._view.branch}")
        if view.io != self._view.io:
            self._locations = locations_of(view.location, view.io)
        self._view = view

    # --- the StateTable protocol -------------------------------------------------------

    @property
    def layout(self) -> StateLayout:
        return self._layout

    @property
    def filesystem(self) -> pafs.FileSystem:
        return self._locations.filesystem

    def file_schema(self) -> pa.Schema:
        return self._view.file_schema

    def partition_of(self, key_group: int) -> int:
        if not 0 <= key_group < self._view.max_parallelism:
            raise ValueError(f"key group {key_group} is outside [0, {self._view.max_parallelism - 1}]")
        return key_group // self._view.partition_width

    def partition_count(self) -> int:
        return -(-self._view.max_parallelism // self._view.partition_width)

    def new_segment_path(self, checkpoint_id: int, task_index: int, partition: int) -> str:
        if not 0 <= partition < self.partition_count():
            raise ValueError(f"partition {partition} is outside [0, {self.partition_count() - 1}] of state table "
                             f"{self._view.identifier}")
        return self._path(f"{self._view.data_dir.rstrip('/')}/{window_dir(checkpoint_id)}",
                          segment_file_name(checkpoint_id, task_index, partition))

    def new_operator_state_path(self, checkpoint_id: int, task_index: int) -> str:
        return self._path(self._view.operator_dir, operator_file_name(checkpoint_id, task_index))

    def operator_state_files(self) -> list[OperatorStateFile]:
        self._check_open()
        return list(self._view.operator_state)

    def segments(self, key_groups: KeyGroupRange) -> list[SegmentFile]:
        self._check_open()
        if key_groups.is_empty():
            return []
        return [s for s in self._view.segments
                if s.key_group_min <= key_groups.end and s.key_group_max >= key_groups.start]

    def current_checkpoint(self) -> CheckpointInfo | None:
        self._check_open()
        return self._view.checkpoint

    def next_checkpoint_id(self) -> int:
        self._check_open()
        return self._view.next_checkpoint_id

    def list_checkpoints(self) -> list[CheckpointInfo]:
        self._check_open()
        return [] if self._view.checkpoint is None else [self._view.checkpoint]

    def restore(self, checkpoint_id: int | None = None) -> CheckpointInfo | None:
        """Stay at the shipped checkpoint: the only one a task knows. Another id means the
        driver shipped a view of another checkpoint than the task expects."""
        self._check_open()
        if checkpoint_id is not None and checkpoint_id != self._view.checkpoint_id:
            raise CheckpointNotFoundError(
                f"state table {self._view.identifier}: this task was shipped checkpoint {self._view.checkpoint_id}, "
                f"not {checkpoint_id}; the driver ships the checkpoint of each batch (advance)"
            )
        return self._view.checkpoint

    def commit_checkpoint(self, checkpoint_id: int, segments: Sequence[SegmentFile], **_: object) -> CheckpointInfo:
        raise TaskCommitError(
            f"state table {self._view.identifier}: a task does not commit checkpoint {checkpoint_id}; it reports its "
            "segments and the driver commits them (IcebergStateTable.commit_checkpoint)"
        )

    def to_uri(self, path: str) -> str:
        return self._locations.to_uri(path)

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"TaskStateTable({self._view!r})"

    def _path(self, directory_uri: str, name: str) -> str:
        return self._locations.to_path(f"{directory_uri.rstrip('/')}/{name}")

    def _check_open(self) -> None:
        if self._closed:
            raise StateClosedError(f"state table {self._view.identifier} is closed; open it again")
