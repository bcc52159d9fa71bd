"""Operator (non-keyed) state, as in Flink's FLIP-8: lists of values per task, redistributed
over the tasks of a new parallelism when a job restores.

Each task holds, per declared variable, one list. At a checkpoint the task writes all its
lists into one Parquet file (``flush``: typed columns, no pickling), and the driver commits
every task's file with the keyed segments, in the same snapshot (``commit_checkpoint(...,
operator_state=...)``). A task restoring at parallelism ``p`` reads every old task's file
(they are small) and takes its share by the variable's mode:

- ``SPLIT`` (Flink's even-split redistribution): the old lists, concatenated in old task
  order, are cut into ``p`` contiguous parts whose sizes differ by at most one;
- ``UNION``: every task gets the whole concatenation;
- ``BROADCAST``: every task held the same list; new task i gets old task ``i % old``'s.

The seed's example: Kafka partition offsets, 4 held by 2 tasks, restore to 1 task (it gets
all 4) or to 4 tasks (one each).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from statestore import stored_keys
from statestore.errors import (
    CorruptSegmentError,
    SchemaMismatchError,
    StateDescriptorMismatchError,
    StateNotDeclaredError,
)
from statestore.names import check_operator_state_name

STATE_COLUMN = "state"
INDEX_COLUMN = "idx"
# Parquet footer metadata of an operator state file: JSON {"checkpoint_id", "task_index"} it was
# written for, checked against its checkpoint's record when read (older files have none).
WRITTEN_FOR_KEY = "icestate.operator-state-of"


class Redistribution(enum.Enum):
    SPLIT = "split"
    UNION = "union"
    BROADCAST = "broadcast"


@dataclass(frozen=True)
class OperatorStateDescriptor:
    """A list-style operator state variable: its name, element type and redistribution mode."""

    name: str
    value_type: pa.DataType
    mode: Redistribution = Redistribution.SPLIT

    def __post_init__(self) -> None:
        check_operator_state_name(self.name)
        if not isinstance(self.value_type, pa.DataType):
            raise TypeError(f"operator state {self.name!r}: value_type must be a pyarrow DataType")
        if not isinstance(self.mode, Redistribution):
            object.__setattr__(self, "mode", Redistribution(self.mode))

    @property
    def value_column(self) -> str:
        return f"v_{self.name}"


@dataclass(frozen=True)
class OperatorStateFile:
    """One task's operator state at one checkpoint (all its variables), as committed."""

    path: str
    checkpoint_id: int
    task_index: int
    size_bytes: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class OperatorStateTable(Protocol):
    """What the operator state store needs from a state table (``IcebergStateTable``)."""

    @property
    def filesystem(self) -> pafs.FileSystem: ...

    def new_operator_state_path(self, checkpoint_id: int, task_index: int) -> str: ...

    def operator_state_files(self) -> list[OperatorStateFile]: ...


def redistribute(old: Sequence[Sequence[Any]], parallelism: int, mode: Redistribution) -> list[list]:
    """The lists of ``parallelism`` new tasks from the lists of the old tasks (in task order)."""
    if not isinstance(parallelism, int) or parallelism < 1:
        raise ValueError(f"parallelism must be an int >= 1, got {parallelism!r}")
    if mode is Redistribution.BROADCAST:
        if not old:
            return [[] for _ in range(parallelism)]
        return [list(old[i % len(old)]) for i in range(parallelism)]
    flat = [v for lst in old for v in lst]
    if mode is Redistribution.UNION:
        return [list(flat) for _ in range(parallelism)]
    base, extra = divmod(len(flat), parallelism)
    out, start = [], 0
    for i in range(parallelism):
        end = start + base + (1 if i < extra else 0)
        out.append(flat[start:end])
        start = end
    return out


class OperatorListState:
    """One task's list of one operator state variable."""

    def __init__(self, descriptor: OperatorStateDescriptor, values: list):
        self.descriptor = descriptor
        self._values = values

    def get(self) -> list:
        """A copy of the task's elements, in order."""
        return list(self._values)

    def add(self, value: Any) -> None:
        self.add_all([value])

    def add_all(self, values: Iterable[Any]) -> None:
        values = list(values)
        self._check(values)
        self._values.extend(values)

    def update(self, values: Iterable[Any]) -> None:
        """Replace the task's elements."""
        values = list(values)
        self._check(values)
        self._values[:] = values

    def clear(self) -> None:
        self._values.clear()

    def _check(self, values: list) -> None:
        if any(v is None for v in values):
            raise ValueError(f"operator state {self.descriptor.name!r}: elements must not be null")
        try:
            pa.array(values, type=self.descriptor.value_type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as e:
            raise SchemaMismatchError(
                f"operator state {self.descriptor.name!r}: {values!r} does not match the declared type "
                f"{self.descriptor.value_type}: {e}"
            ) from e


class OperatorStateStore:
    """The operator state of task ``task_index`` of ``parallelism`` over a state table opened
    at the checkpoint to continue from (its operator state is read and redistributed here)."""

    def __init__(self, table: OperatorStateTable, descriptors: Sequence[OperatorStateDescriptor], *,
                 task_index: int = 0, parallelism: int = 1, redistribute_on_rescale_only: bool = False):
        names = [d.name for d in descriptors]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"operator state variables declared twice: {twice}")
        if not isinstance(parallelism, int) or parallelism < 1 or not 0 <= task_index < parallelism:
            raise ValueError(f"task_index must be in [0, parallelism), got {task_index} of {parallelism}")
        self._table = table
        self.task_index = task_index
        self.parallelism = parallelism
        self._descriptors = {d.name: d for d in descriptors}
        self._lists: dict[str, list] = {}
        # A streaming runner's: where the checkpoint has as many tasks as this, each takes back its
        # own lists (a task that moved to another process of a running query, or a restart at the
        # same parallelism); the modes apply when the parallelism changes.
        self._own_at_same_parallelism = redistribute_on_rescale_only
        self.restore()

    def get_list_state(self, descriptor: OperatorStateDescriptor | str) -> OperatorListState:
        name = descriptor if isinstance(descriptor, str) else descriptor.name
        if name not in self._descriptors:
            raise StateNotDeclaredError(
                f"operator state {name!r} is not declared (declared: {sorted(self._descriptors)})")
        if not isinstance(descriptor, str) and descriptor != self._descriptors[name]:
            raise StateDescriptorMismatchError(f"operator state {name!r} is declared as {self._descriptors[name]}, "
                                               f"requested as {descriptor}")
        return OperatorListState(self._descriptors[name], self._lists[name])

    def restore(self) -> None:
        """Take this task's share of the operator state of the table's opened checkpoint."""
        files = sorted(self._table.operator_state_files(), key=lambda f: f.task_index)
        own = self._own_at_same_parallelism and len(files) == self.parallelism
        if own:
            files = [files[self.task_index]]
        old = [_read(self._table.filesystem, f, self._descriptors) for f in files]
        for name, desc in self._descriptors.items():
            if own:
                self._lists[name] = list(old[0].get(name, []))
                continue
            lists = redistribute([o.get(name, []) for o in old], self.parallelism, desc.mode)
            self._lists[name] = lists[self.task_index]

    def flush(self, checkpoint_id: int) -> OperatorStateFile:
        """Write this task's lists as its operator state file of ``checkpoint_id`` (not committed:
        hand it to ``commit_checkpoint(..., operator_state=[...])`` with the other tasks')."""
        columns: dict[str, pa.Array] = {STATE_COLUMN: [], INDEX_COLUMN: []}
        per_state = []
        for name, values in self._lists.items():
            columns[STATE_COLUMN] += [name] * len(values)
            columns[INDEX_COLUMN] += list(range(len(values)))
            per_state.append((name, values))
        n = len(columns[STATE_COLUMN])
        arrays = {STATE_COLUMN: pa.array(columns[STATE_COLUMN], pa.string()),
                  INDEX_COLUMN: pa.array(columns[INDEX_COLUMN], pa.int64())}
        offset = 0
        for name, values in per_state:
            desc = self._descriptors[name]
            full = [None] * n
            full[offset:offset + len(values)] = values
            arrays[desc.value_column] = pa.array(full, desc.value_type)
            offset += len(values)
        table = pa.table(arrays).replace_schema_metadata({stored_keys.OPERATOR_STATE_MODES: json.dumps(
            {d.name: d.mode.value for d in self._descriptors.values()}),
            WRITTEN_FOR_KEY: json.dumps({"checkpoint_id": checkpoint_id, "task_index": self.task_index})})
        path = self._table.new_operator_state_path(checkpoint_id, self.task_index)
        pq.write_table(table, path, filesystem=self._table.filesystem, compression="zstd", write_page_checksum=True)
        size = self._table.filesystem.get_file_info(path).size
        return OperatorStateFile(path, checkpoint_id, self.task_index, size)


def _read(fs: pafs.FileSystem, f: OperatorStateFile, descriptors: dict[str, OperatorStateDescriptor]) -> dict:
    """{state name: list} of one old task's file (only the declared variables). A file that is
    not the one its checkpoint recorded (its size, the checkpoint and task it was written for,
    its pages' checksums) is ``CorruptSegmentError`` naming it."""
    problem = None
    try:
        with fs.open_input_file(f.path) as raw:
            size = raw.size()
            if f.size_bytes and size != f.size_bytes:
                problem = f"it has {size} bytes where its checkpoint recorded {f.size_bytes}"
            else:
                table = pq.ParquetFile(raw, page_checksum_verification=True).read()
    except (OSError, pa.ArrowException, ValueError, UnicodeDecodeError) as e:  # ValueError: a damaged footer
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        written_for = (table.schema.metadata or {}).get(WRITTEN_FOR_KEY.encode())
        try:
            record = None if written_for is None else json.loads(written_for)
            if record is not None and (record["checkpoint_id"], record["task_index"]) != (f.checkpoint_id,
                                                                                         f.task_index):
                problem = (f"it holds the operator state of task {record['task_index']} at checkpoint "
                           f"{record['checkpoint_id']}: another operator state file was copied over it")
            elif not {STATE_COLUMN, INDEX_COLUMN} <= set(table.column_names):
                problem = f"it has no {STATE_COLUMN!r} and {INDEX_COLUMN!r} columns"
        except (ValueError, TypeError, KeyError) as e:
            problem = f"its footer does not say which checkpoint and task it holds ({e})"
    if problem is not None:
        raise CorruptSegmentError(
            f"operator state file {f.path} of task {f.task_index} (checkpoint {f.checkpoint_id}) is missing or "
            f"damaged: {problem}. Restore it from a backup, or restore an older checkpoint that does not use it")
    states = table.column(STATE_COLUMN).to_pylist()
    out: dict[str, list] = {}
    for name, desc in descriptors.items():
        if desc.value_column not in table.column_names:
            continue
        rows = [i for i, s in enumerate(states) if s == name]
        if not rows:
            continue
        try:
            values = table.column(desc.value_column).take(rows).cast(desc.value_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise SchemaMismatchError(f"operator state {name!r} in {f.path} is not of the declared type "
                                      f"{desc.value_type}: {e}") from e
        order = table.column(INDEX_COLUMN).take(rows).to_pylist()
        out[name] = [v for _, v in sorted(zip(order, values.to_pylist(), strict=True))]
    return out
