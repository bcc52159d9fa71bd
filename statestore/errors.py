"""The one error hierarchy of the store, rooted at ``StateStoreError``.

Every message names the object at fault and says what to do. Bad arguments to a call
(wrong types, out-of-range numbers) raise ``ValueError``/``TypeError`` instead.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: this module (and statestore.faults) imports no third-party package
    import pyarrow as pa


class StateStoreError(Exception):
    """Base class of every error the state store raises on purpose."""


class UnsupportedKeyTypeError(StateStoreError, TypeError):
    """A key column's type cannot be hashed to a key group the way Spark does."""

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


class CorruptMetadataError(StateStoreError):
    """A metadata file of a state table (metadata.json, manifest list, manifest) cannot be read."""


class UntrustedMetadataError(CorruptMetadataError):
    """A table's metadata asks for something only the catalog's own configuration may ask for:
    a property that makes pyiceberg import and run code (``catalog.fileio.refuse_code_from_metadata``)."""


class CommitConflictError(StateStoreError):
    """A checkpoint commit lost a race against another writer and could not be retried."""


class CheckpointFailedError(StateStoreError):
    """A checkpoint did not commit for a reason other than a commit race (see
    ``CommitConflictError``); the previous checkpoint stays the newest complete one."""


class StorageUnavailableError(CheckpointFailedError, OSError):
    """The table's storage (an object store, a file system) failed a checkpoint's writes or its
    commit, or a segment read, after the bounded retries of its client (unreachable, answering
    errors, hanging past the request timeout). Nothing of the checkpoint was committed and the
    store keeps every write for the next one; a failed read changed nothing. An ``OSError``
    too, as the storage's own errors are."""


class StorageFullError(StorageUnavailableError):
    """The disk a checkpoint writes to has no space left (``ENOSPC``); its message names the
    directory. Nothing was committed; once space is freed the next checkpoint writes everything."""


class TaskReportError(CheckpointFailedError):
    """The tasks of a micro-batch did not report their flushed segments exactly once (none
    after a full run, or one task twice), so the batch's checkpoint was not committed."""


class CheckpointPendingError(StateStoreError):
    """A store was asked to flush while an earlier flush was neither completed nor aborted."""


class StateNotDeclaredError(StateStoreError):
    """A state variable (keyed or operator state) was requested that the layout does not declare."""


class StateDescriptorMismatchError(StateStoreError):
    """A state variable was requested with another descriptor (kind, type, TTL) than declared."""


class NoCurrentKeyError(StateStoreError):
    """The per-key state API was used before a current key was set."""


class StateFunctionUnavailableError(StateStoreError):
    """A reducing or aggregating state opened from a table's recorded layout was asked to add
    values: the recorded layout holds no reduce or aggregate function."""


class StateVariableDeletedError(StateStoreError, RuntimeError):
    """A state variable handle was used after ``deleteIfExists`` removed its variable (as
    Spark's "state is not initialized"); a handle obtained after the delete works."""


class WorkerEnvironmentError(StateStoreError, RuntimeError):
    """Spark's Python workers cannot import the library (another interpreter than the
    driver's, without icestate or its dependencies): found by the warm-up beside a query's
    start, or by its first batch; the query fails with it before any state is written."""


class ProcessorError(StateStoreError, RuntimeError):
    """A processor's code raised in a task; its message starts with the processor's own
    exception (``spark_integration.errors`` carries the exception itself to the driver)."""


class TimersDisabledError(StateStoreError):
    """Timers were used by a query started without a time mode (ProcessingTime or EventTime)."""


class QueryCheckpointUnreadableError(StateStoreError):
    """A file of Spark's streaming checkpoint (offset log, query metadata) could not be read."""


class QueryMismatchError(StateStoreError):
    """A state or output table holds the batches of another streaming query than this one."""


class QuerySourcesMismatchError(QueryMismatchError):
    """A query needs a source (the ticks source of timers and progress figures) that its Spark
    checkpoint was started without: Spark refuses a checkpoint whose sources changed."""


class StateOutOfStepError(QueryMismatchError):
    """A state table's newest checkpoint is behind the batches Spark says its query committed,
    or ahead of anything the query ran."""


class InjectedFaultError(StateStoreError, RuntimeError):
    """A failure injected by a test through ``statestore.faults``; never raised in production."""


class StateTableMismatchError(StateStoreError):
    """An existing state table was created for other keys, state variables or max parallelism."""


class StateClosedError(StateStoreError):
    """The store or table was closed."""


class CatalogUnavailableError(StateStoreError, ValueError):
    """The pyiceberg catalog of a ``TableRef`` could not be loaded from its name and properties."""


class CatalogDamagedError(CatalogUnavailableError):
    """A SQL catalog's SQLite file (the embedded ``catalog.db``) is not a readable database: the
    state tables' own files are intact; restore the file, or register the tables again
    (``catalog.recovery.recover``)."""


class TaskCommitError(StateStoreError):
    """A task's table (``catalog.task_view.TaskStateTable``) was asked to commit: only the driver
    commits checkpoints."""


def as_storage_error(error: BaseException, what: str, directory: str) -> OSError | None:
    """``error`` as ``StorageFullError`` (a full disk: ``ENOSPC`` anywhere in its chain, or
    SQLite's "database or disk is full" of the embedded catalog) or ``StorageUnavailableError``
    (another ``OSError`` of the storage), with ``what`` failed (``checkpoint 3 of state table
    s3://...  failed while committing it``) and what to do; None for any other error, and for
    one of the store's own (already saying what is wrong). ``directory``: the table's place,
    named for a full disk. Quotes the storage's message, never a catalog property."""
    if isinstance(error, StateStoreError) or not isinstance(error, Exception):
        return None
    full = _disk_full(error)
    if not full and not isinstance(error, OSError):
        return None
    what = f"{what}: {type(error).__name__}: {error}"
    kept = ("Nothing of it was committed: the previous checkpoint stays the newest, and the stores keep every "
            "write for the next checkpoint")
    if full:
        raised: OSError = StorageFullError(
            f"{what}. No space is left on the disk holding {directory}. {kept}. Free space on that disk (or move "
            "the table to a larger one), then checkpoint again: the next checkpoint writes everything this one held")
        raised.errno = errno.ENOSPC
        return raised
    raised = StorageUnavailableError(
        f"{what}. The storage failed after the bounded retries of its client (on S3, the FileIO properties "
        f"s3.retry-max-attempts, s3.request-timeout and s3.connect-timeout bound them). {kept}. Check that the "
        "storage is reachable and answering (endpoint, network, credentials, its status), then checkpoint again")
    raised.errno = getattr(error, "errno", None)
    return raised


def _disk_full(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        text = str(current)
        if "No space left on device" in text or "database or disk is full" in text:
            return True
        current = current.__cause__ or current.__context__
    return False
