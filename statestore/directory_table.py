"""``DirectoryStateTable``: a state table in a plain local directory, without Iceberg.

It exists so that ``statestore`` is usable and testable on its own; production tables
are ``catalog.IcebergStateTable``. Files::

    <location>/_layout.json                 key schema, max parallelism, state variables
    <location>/_checkpoints/cp-<id>.json    one checkpoint: parent, shape, every visible segment
    <location>/_checkpoints/HEAD            id of the current checkpoint (replaced atomically)
    <location>/data/seg-*.parquet           segments (``paths.py``)

A commit writes the checkpoint file, then replaces HEAD (the atomic step), then applies
retention: checkpoint files off the current line or beyond the newest ``retain_checkpoints``
are deleted, then every segment that no retained checkpoint lists and whose checkpoint id
is at most HEAD's. Not safe for concurrent writers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from statestore import paths
from statestore.errors import CheckpointNotFoundError, CorruptSegmentError, StateClosedError, StateTableMismatchError
from statestore.faults import COMMIT_DONE, COMMIT_METADATA_WRITTEN, FILES_DELETED, SNAPSHOTS_EXPIRED, crash_point
from statestore.keygroups import KeyGroupRange
from statestore.layout import StateLayout
from statestore.table import CheckpointInfo, SegmentFile

CHECKPOINT_DIR = "_checkpoints"
HEAD = "HEAD"


def layout_signature(layout: StateLayout) -> dict:
    """What must not change over a state table's life (compared on open)."""
    return {
        "max_parallelism": layout.max_parallelism,
        "key_schema": [[f.name, str(f.type)] for f in layout.key_schema],
        "states": {d.name: [d.kind.value, str(d.value_type), str(d.user_key_type)] for d in layout.descriptors},
    }


def check_layout_compatible(stored: dict, layout: StateLayout, table_name: str) -> dict:
    """Raise StateTableMismatchError unless ``layout`` can use a table created with ``stored``;
    returns the merged signature (new state variables are allowed)."""
    new = layout_signature(layout)
    for what in ("max_parallelism", "key_schema"):
        if stored[what] != new[what]:
            raise StateTableMismatchError(
                f"state table {table_name} was created with {what} {stored[what]}, this job declares "
                f"{new[what]}; use another table name, or migrate the state (keys and max parallelism "
                "fix where every key's state lives)"
            )
    for name, sig in new["states"].items():
        old = stored["states"].get(name)
        if old is not None and old != sig:
            raise StateTableMismatchError(
                f"state {name!r} of table {table_name} is stored as {old}, this job declares {sig}; "
                "rename the state variable or migrate it"
            )
    merged = dict(stored)
    merged["states"] = {**stored["states"], **new["states"]}
    return merged


class DirectoryStateTable:
    """A ``StateTable`` in a local directory (see the module docstring)."""

    def __init__(self, location: str | os.PathLike, layout: StateLayout, *, retain_checkpoints: int = 10,
                 checkpoint_id: int | None = None):
        if retain_checkpoints < 1:
            raise ValueError(f"retain_checkpoints must be >= 1, got {retain_checkpoints}")
        self._root = Path(location).absolute()
        self._layout = layout
        self._fs = pafs.LocalFileSystem()
        self._retain = retain_checkpoints
        (self._root / CHECKPOINT_DIR).mkdir(parents=True, exist_ok=True)
        self._check_layout()
        self._current: dict | None = None
        self._closed = False
        self.restore(checkpoint_id)

    # -- StateTable

    @property
    def layout(self) -> StateLayout:
        return self._layout

    @property
    def filesystem(self) -> pafs.FileSystem:
        return self._fs

    @property
    def location(self) -> str:
        return str(self._root)

    def file_schema(self) -> pa.Schema:
        return self._layout.entry_schema

    def partition_of(self, key_group: int) -> int:
        return 0

    def new_segment_path(self, checkpoint_id: int, task_index: int, partition: int) -> str:
        return paths.segment_path(str(self._root), checkpoint_id, task_index, partition)

    def segments(self, key_groups: KeyGroupRange) -> list[SegmentFile]:
        self._check_open()
        if self._current is None:
            return []
        return [s for s in self._segments if not s.key_groups().intersection(key_groups).is_empty()]

    def current_checkpoint(self) -> CheckpointInfo | None:
        self._check_open()
        return None if self._current is None else _info(self._current)

    def next_checkpoint_id(self) -> int:
        self._check_open()
        ids = [c["checkpoint_id"] for c in self._all_checkpoints()]
        return max(ids, default=0) + 1

    def commit_checkpoint(self, checkpoint_id: int, segments: Sequence[SegmentFile], *, parallelism: int,
                          batch_id: int | None = None, properties: dict[str, str] | None = None) -> CheckpointInfo:
        self._check_open()
        if checkpoint_id < self.next_checkpoint_id():
            raise ValueError(f"checkpoint id {checkpoint_id} is not greater than every committed id of {self._root}")
        for s in segments:
            self._check_segment(s)
        new = [{**_seg_dict(s), "path": self._relative(s.path)} for s in segments]
        visible = (self._current["segments"] if self._current else []) + new
        record = {
            "checkpoint_id": checkpoint_id, "batch_id": batch_id, "parallelism": parallelism,
            "max_parallelism": self._layout.max_parallelism, "timestamp_ms": int(time.time() * 1000),
            "parent": self._current["checkpoint_id"] if self._current else None,
            "properties": dict(properties or {}), "segments": visible,
        }
        _write_atomic(self._cp_path(checkpoint_id), json.dumps(record))
        crash_point(COMMIT_METADATA_WRITTEN)
        _write_atomic(self._root / CHECKPOINT_DIR / HEAD, str(checkpoint_id))
        crash_point(COMMIT_DONE)
        self._set_current(record)
        self._apply_retention()
        return _info(record)

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """The restorable checkpoints: HEAD's line. After ``restore(n)`` the newer ones stay
        listed (and restorable) until the next commit abandons them, as in Iceberg."""
        self._check_open()
        return [_info(c) for c in self._line(self._head())]

    def restore(self, checkpoint_id: int | None = None) -> CheckpointInfo | None:
        self._check_open()
        if checkpoint_id is None:
            head = self._root / CHECKPOINT_DIR / HEAD
            if not head.exists():
                self._set_current(None)
                return None
            checkpoint_id = int(head.read_text())
        path = self._cp_path(checkpoint_id)
        committed = self._line(self._head())
        if checkpoint_id not in {c["checkpoint_id"] for c in committed} or not path.exists():
            # A checkpoint file that HEAD never reached belongs to a commit that crashed.
            retained = [c["checkpoint_id"] for c in committed]
            raise CheckpointNotFoundError(
                f"checkpoint {checkpoint_id} is not retained in state table {self._root} (retained: {retained}); "
                "restore one of those"
            )
        self._set_current(json.loads(path.read_text()))
        return _info(self._current)

    def close(self) -> None:
        """Refuse every later call (``StateClosedError``); the directory holds no open handle. Idempotent."""
        self._closed = True

    def __enter__(self) -> DirectoryStateTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals

    def _check_open(self) -> None:
        if self._closed:
            raise StateClosedError(f"state table {self._root} is closed; open it again")

    def _set_current(self, record: dict | None) -> None:
        self._current = record
        self._segments = [SegmentFile(**{**s, "path": self._absolute(s["path"])}) for s in record["segments"]] \
            if record else []

    def _absolute(self, path: str) -> str:
        # Segments are recorded relative to the table root, so the table stays valid when
        # its directory is reached through another spelling (a symlink) or moved.
        return path if os.path.isabs(path) else str(self._root / path)

    def _relative(self, path: str) -> str:
        p = Path(path)
        return str(p.relative_to(self._root)) if p.is_relative_to(self._root) else path

    def _head(self) -> int | None:
        head = self._root / CHECKPOINT_DIR / HEAD
        return int(head.read_text()) if head.exists() else None

    def _check_layout(self) -> None:
        path = self._root / "_layout.json"
        if path.exists():
            merged = check_layout_compatible(json.loads(path.read_text()), self._layout, str(self._root))
        else:
            merged = layout_signature(self._layout)
        _write_atomic(path, json.dumps(merged))

    def _check_segment(self, s: SegmentFile) -> None:
        info = self._fs.get_file_info(s.path)
        if info.type != pafs.FileType.File or info.size != s.size_bytes:
            raise CorruptSegmentError(
                f"segment {s.path} of checkpoint {s.checkpoint_id} is missing or has {info.size} bytes instead of "
                f"{s.size_bytes}; nothing was committed: run the checkpoint again"
            )

    def _cp_path(self, checkpoint_id: int) -> Path:
        return self._root / CHECKPOINT_DIR / f"cp-{checkpoint_id:012d}.json"

    def _all_checkpoints(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((self._root / CHECKPOINT_DIR).glob("cp-*.json"))]

    def _line(self, start: int | None = None) -> list[dict]:
        """Retained checkpoints from ``start`` (default: the current one) back through its
        parents, oldest first."""
        by_id = {c["checkpoint_id"]: c for c in self._all_checkpoints()}
        line, cur = [], start if start is not None else (self._current["checkpoint_id"] if self._current else None)
        while cur is not None and cur in by_id:
            line.append(by_id[cur])
            cur = by_id[cur]["parent"]
        return line[::-1]

    def _apply_retention(self) -> None:
        keep = self._line()[-self._retain:]
        keep_ids = {c["checkpoint_id"] for c in keep}
        for c in self._all_checkpoints():
            if c["checkpoint_id"] not in keep_ids:
                self._cp_path(c["checkpoint_id"]).unlink(missing_ok=True)
        crash_point(SNAPSHOTS_EXPIRED)
        referenced = {s["path"] for c in keep for s in c["segments"]}
        newest = self._current["checkpoint_id"]
        data = self._root / paths.DATA_DIR
        for f in data.glob("seg-*.parquet") if data.exists() else []:
            parsed = paths.parse_segment_name(f.name)
            if parsed and parsed[0] <= newest and self._relative(str(f)) not in referenced:
                f.unlink(missing_ok=True)
        crash_point(FILES_DELETED)


def _seg_dict(s: SegmentFile) -> dict:
    return {"path": s.path, "checkpoint_id": s.checkpoint_id, "key_group_min": s.key_group_min,
            "key_group_max": s.key_group_max, "record_count": s.record_count, "size_bytes": s.size_bytes}


def _info(record: dict) -> CheckpointInfo:
    return CheckpointInfo(
        checkpoint_id=record["checkpoint_id"], batch_id=record["batch_id"], parallelism=record["parallelism"],
        max_parallelism=record["max_parallelism"], timestamp_ms=record["timestamp_ms"],
        properties=record.get("properties", {}),
    )


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
