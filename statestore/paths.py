"""All file naming of a state table, in one place.

A segment of an Iceberg state table is
``<table location>/data/c<first id>/seg-cp<checkpoint id>-t<task>-p<partition>-<uuid>.parquet``:
each directory ``c<first id>`` (``window_dir``) holds the files of ``CHECKPOINTS_PER_DIR``
consecutive checkpoint ids, so that the orphan sweep lists only the directories of the
checkpoints written since its last pass, never the whole table (``catalog.gc``). The checkpoint
id in the name lets garbage collection recognise files of checkpoints that never committed
(stored on disk: keep the format readable by ``parse_segment_name``). Tables written before
the directories existed keep their older files directly in ``data/``; readers take any path
a manifest names.

A compaction's output is ``cmp-cp<base checkpoint id>-p<partition>-<uuid>.parquet`` in the
directory of its base checkpoint id, the base
being the newest checkpoint when the compaction planned. A compaction commits its output
only while the newest checkpoint is below base + ``COMPACTION_GRACE_CHECKPOINTS`` (it
re-commits the same files on top of checkpoints that raced it, and gives up after that), so
an output that no snapshot references once that many checkpoints passed, and older than
``COMPACTION_GRACE_SECONDS`` (far beyond the time between a compaction's last validity
check and its commit, even for a compactor paused mid-way), can never commit: garbage
collection may take it (``parse_compaction_name``).

A Spark query's output file is ``batch-<batch id>-task-<task>-<token>.parquet``, in the output
table's data directory or, when only the query's callback reads it and no accumulator can carry
it (Spark Connect), under ``<table location>/scratch/outputs/<run id>/`` of the state table,
deleted once the callback ran; one older than ``COMPACTION_GRACE_SECONDS`` there is a crashed
driver's leftover (``parse_output_name``).
"""

from __future__ import annotations

import re
import uuid

import pyarrow.fs as pafs

DATA_DIR = "data"
BRANCHES_DIR = "branches"  # under DATA_DIR: the segments of each fork (catalog.iceberg_table)
OPERATOR_DIR = "operator"  # under DATA_DIR (or a fork's directory): operator state files
CHECKPOINTS_PER_DIR = 100  # stored on disk (directory names): changing it strands older directories
_WINDOW = re.compile(r"^c(\d{12})$")
_OPERATOR = re.compile(r"^op-cp(\d{12})-t(\d{5})-([0-9a-f]{12})\.parquet$")
COMPACTION_GRACE_CHECKPOINTS = 16
COMPACTION_GRACE_SECONDS = 3600.0
SCRATCH_OUTPUTS_DIR = "scratch/outputs"
_OUTPUT = re.compile(r"^batch-(\d{12})-task-(\d{5})-([0-9a-f]{12})\.parquet$")
_COMPACTION = re.compile(r"^cmp-cp(\d{12})-p(\d{5})-([0-9a-f]{12})\.parquet$")
_SEGMENT = re.compile(r"^seg-cp(\d{12})-t(\d{5})-p(\d{5})-([0-9a-f]{12})\.parquet$")


def segment_file_name(checkpoint_id: int, task_index: int, partition: int) -> str:
    if checkpoint_id < 0 or task_index < 0 or partition < 0:
        raise ValueError(f"negative id in segment name: cp={checkpoint_id} task={task_index} part={partition}")
    return f"seg-cp{checkpoint_id:012d}-t{task_index:05d}-p{partition:05d}-{uuid.uuid4().hex[:12]}.parquet"


def table_location_of(segment_path: str) -> str:
    """The location of the table whose data directory holds ``segment_path`` (``segment_path``'s
    inverse: ``<table location>/data/...``, a fork's files under it too)."""
    return segment_path.rsplit(f"/{DATA_DIR}/", 1)[0]


def segment_path(table_location: str, checkpoint_id: int, task_index: int, partition: int,
                 subdir: str | None = None) -> str:
    """A fresh segment URI under the table's data directory (or ``subdir`` of it)."""
    directory = f"{table_location.rstrip('/')}/{DATA_DIR}" + (f"/{subdir}" if subdir else "")
    return f"{directory}/{segment_file_name(checkpoint_id, task_index, partition)}"


def window_dir(checkpoint_id: int) -> str:
    """The name of the directory holding the segments and compaction outputs named after
    ``checkpoint_id``: ``c`` and the first id of its ``CHECKPOINTS_PER_DIR`` ids, 12 digits."""
    if checkpoint_id < 0:
        raise ValueError(f"negative checkpoint id {checkpoint_id}")
    return f"c{checkpoint_id - checkpoint_id % CHECKPOINTS_PER_DIR:012d}"


def parse_window_dir(name: str) -> int | None:
    """The first checkpoint id of a ``window_dir`` name, or None for any other name."""
    m = _WINDOW.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m and int(m.group(1)) % CHECKPOINTS_PER_DIR == 0 else None


def window_dirs(first_id: int, last_id: int) -> list[str]:
    """The ``window_dir`` names of the checkpoint ids ``first_id..last_id`` (none when empty)."""
    if last_id < first_id:
        return []
    first = max(0, first_id - first_id % CHECKPOINTS_PER_DIR)
    return [window_dir(i) for i in range(first, last_id + 1, CHECKPOINTS_PER_DIR)]


def operator_file_name(checkpoint_id: int, task_index: int) -> str:
    """An operator state file: ``op-cp<checkpoint id>-t<task>-<uuid>.parquet``."""
    if checkpoint_id < 0 or task_index < 0:
        raise ValueError(f"negative id in operator state file name: cp={checkpoint_id} task={task_index}")
    return f"op-cp{checkpoint_id:012d}-t{task_index:05d}-{uuid.uuid4().hex[:12]}.parquet"


def parse_operator_name(path: str) -> tuple[int, int] | None:
    """(checkpoint id, task index) of an operator state file path, or None for other files."""
    m = _OPERATOR.match(path.rsplit("/", 1)[-1])
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_segment_name(path: str) -> tuple[int, int, int] | None:
    """(checkpoint id, task index, partition) of a segment path, or None for other files."""
    m = _SEGMENT.match(path.rsplit("/", 1)[-1])
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def compaction_file_name(base_checkpoint_id: int, partition: int) -> str:
    if base_checkpoint_id < 0 or partition < 0:
        raise ValueError(f"negative id in compaction file name: cp={base_checkpoint_id} part={partition}")
    return f"cmp-cp{base_checkpoint_id:012d}-p{partition:05d}-{uuid.uuid4().hex[:12]}.parquet"


def parse_compaction_name(path: str) -> tuple[int, int] | None:
    """(base checkpoint id, partition) of a compaction output path, or None for other files."""
    m = _COMPACTION.match(path.rsplit("/", 1)[-1])
    return (int(m.group(1)), int(m.group(2))) if m else None


def output_file_name(batch_id: int, task_index: int, token: str) -> str:
    """The name of a task's output file of a Spark micro-batch (``token``: the task's run token)."""
    return f"batch-{batch_id:012d}-task-{task_index:05d}-{token[:12]}.parquet"


def parse_output_name(path: str) -> tuple[int, int] | None:
    """(batch id, task) of an output file's name, or None for any other file."""
    m = _OUTPUT.match(path.rsplit("/", 1)[-1])
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def _base(fs: pafs.FileSystem) -> pafs.FileSystem:
    while isinstance(fs, pafs.SubTreeFileSystem):
        fs = fs.base_fs
    return fs


def is_local_filesystem(fs: pafs.FileSystem) -> bool:
    """Whether ``fs`` is this host's disk (directly or under a ``SubTreeFileSystem``)."""
    return isinstance(_base(fs), pafs.LocalFileSystem)


def needs_parent_directories(fs: pafs.FileSystem) -> bool:
    """Whether a file's parent directory must exist before it is written: a local filesystem does
    not create parents on write; S3 and GCS have no directories (pyarrow's ``create_dir`` there
    costs a HEAD and a PUT of an empty marker object per path level)."""
    return _base(fs).type_name not in ("s3", "gcs")
