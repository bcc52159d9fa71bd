"""The one error hierarchy of the store, rooted at ``StateStoreError``.

Every message names the object at fault and says what to do. Bad arguments to a call
(wrong types, out-of-range numbers) raise ``ValueError``/``TypeError`` instead.
"""

from __future__ import annotations

import pyarrow as pa


class StateStoreError(Exception):
    """Base class of every error the state store raises on purpose."""


class UnsupportedKeyTypeError(StateStoreError, TypeError):
    def __init__(self, column: str, dtype: pa.DataType):
        super().__init__(
            f"key column {column!r} has type {dtype}, which cannot be a state key: use string, binary, "
            "bool, byte, short, int, long, date or timestamp (cast floats/decimals to string or long first)"
        )
        self.column = column
        self.dtype = dtype


class SchemaMismatchError(StateStoreError, TypeError):
    """Data handed to the store does not match a declared schema."""


class KeyGroupOutOfRangeError(StateStoreError):
    """A key whose key group is not owned by this task was read or written."""


class CheckpointNotFoundError(StateStoreError, LookupError):
    """A checkpoint id that the state table does not (or no longer) retain."""


class CorruptSegmentError(StateStoreError):
    """A segment file referenced by a checkpoint is missing, truncated or unreadable."""


class CommitConflictError(StateStoreError):
    """A checkpoint commit lost a race against another writer and could not be retried."""


class CheckpointFailedError(StateStoreError):
    """A checkpoint did not commit; the previous checkpoint stays the newest complete one."""


class StateTableMismatchError(StateStoreError):
    """An existing state table was created for other keys, state variables or max parallelism."""


class StateClosedError(StateStoreError):
    """The store or table was closed."""
