"""The contract between a store (one task's state) and the table that holds its checkpoints.

A ``StateTable`` is opened at one checkpoint (or empty). It lists the segments that
checkpoint sees, says where new segments go and commits a set of new segments as the
next checkpoint, atomically: a checkpoint either holds all of its segments or does not
exist. ``catalog.IcebergStateTable`` is the production implementation;
``statestore.directory_table.DirectoryStateTable`` is a plain-directory one for tests and
for using the store without Iceberg.

Implementations are not thread safe; one driver commits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.fs as pafs

from statestore.keygroups import KeyGroupRange
from statestore.layout import StateLayout


@dataclass(frozen=True)
class SegmentFile:
    """One immutable Parquet segment: entries of key groups [key_group_min, key_group_max].

    ``footer``: the file's Parquet footer (base64 of ``PAR1`` + footer + length + ``PAR1``) as its
    writer had it in memory, so a commit builds the segment's Iceberg entry without reading the
    file back (on an object store, three round trips); None for segments listed from metadata.
    """

    path: str
    checkpoint_id: int
    key_group_min: int
    key_group_max: int
    record_count: int
    size_bytes: int
    footer: str | None = field(default=None, repr=False, compare=False)

    def key_groups(self) -> KeyGroupRange:
        return KeyGroupRange.of(self.key_group_min, self.key_group_max)


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its id, the stream batch that produced it and its shape."""

    checkpoint_id: int
    batch_id: int | None
    parallelism: int
    max_parallelism: int
    timestamp_ms: int
    snapshot_id: int | None = None
    properties: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class StateTable(Protocol):
    @property
    def layout(self) -> StateLayout: ...

    @property
    def filesystem(self) -> pafs.FileSystem:
        """The filesystem on which segment paths resolve."""
        ...

    def file_schema(self) -> pa.Schema:
        """Arrow schema segments are written with (may carry Parquet field ids)."""
        ...

    def partition_of(self, key_group: int) -> int:
        """Partition of a key group: one segment file per (task, checkpoint, partition)."""
        ...

    def new_segment_path(self, checkpoint_id: int, task_index: int, partition: int) -> str:
        """A fresh, unique path for a segment of an uncommitted checkpoint."""
        ...

    def segments(self, key_groups: KeyGroupRange) -> list[SegmentFile]:
        """Segments of the opened checkpoint that hold entries of ``key_groups``, oldest first."""
        ...

    def current_checkpoint(self) -> CheckpointInfo | None:
        """The checkpoint the table is opened at; None for a table with none."""
        ...

    def next_checkpoint_id(self) -> int:
        """An id greater than every checkpoint id the table has ever committed."""
        ...

    def commit_checkpoint(
        self, checkpoint_id: int, segments: Sequence[SegmentFile], *, parallelism: int,
        batch_id: int | None = None, properties: dict[str, str] | None = None,
    ) -> CheckpointInfo:
        """Commit ``segments`` (of every task) as checkpoint ``checkpoint_id``, atomically."""
        ...

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Retained checkpoints of the current line, oldest first."""
        ...

    def restore(self, checkpoint_id: int | None = None) -> CheckpointInfo | None:
        """Reopen at a retained checkpoint (the newest when None); the next commit follows it.

        Raises CheckpointNotFoundError for an id that is not retained.
        """
        ...

    def close(self) -> None:
        """Release what the table holds (a catalog, connections); every later call raises
        StateClosedError. Idempotent."""
        ...
