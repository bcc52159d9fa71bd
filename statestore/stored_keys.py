"""Every key the project stores in table metadata, snapshot summaries or file metadata.

STORED ON DISK: DO NOT RENAME. Each value below is written into the Iceberg metadata of
existing state tables and output tables, or into the Parquet footers of their files;
renaming one makes them unreadable. Add new keys under ``PREFIX``.

Role: the one home of the stored names, under one prefix, ``icestate.``. Versions before
it wrote some of them under ``statestore.`` (``LEGACY_PREFIX``): every reader goes through
``get`` (one key) or ``upgraded`` (a whole mapping), which fall back to the old name, so
tables written then keep working; writers only ever write the current names. A table
written by both versions may hold a key under both names: the current name wins (it was
written later).

Iceberg's own keys (``TableProperties``) stay pyiceberg's constants (``catalog.properties``).
This module imports nothing, so Spark's Python workers and every layer may use it cheaply.
Thread safe: constants and pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping

PREFIX = "icestate."
LEGACY_PREFIX = "statestore."

# --- table properties of a state table -------------------------------------------------
MAX_PARALLELISM = "icestate.max-parallelism"
KEY_SCHEMA = "icestate.key-schema"
LAYOUT = "icestate.layout"
PARTITION_WIDTH = "icestate.partition-width"
# Highest checkpoint id ever committed, kept so that ids stay monotonic after the snapshots
# of an abandoned line (restore to an older checkpoint) are expired.
LAST_CHECKPOINT_ID = "icestate.last-checkpoint-id"
_FORK_BASE = "icestate.fork-base"


def last_checkpoint_id_key(branch: str) -> str:
    """The table property holding the highest checkpoint id committed on a fork (a branch
    other than main; main's is ``LAST_CHECKPOINT_ID``)."""
    return f"{LAST_CHECKPOINT_ID}@{branch}"


def fork_base_key(branch: str) -> str:
    """The table property holding the snapshot id a fork was created at."""
    return f"{_FORK_BASE}@{branch}"


def fork_property_keys(branch: str) -> tuple[str, ...]:
    """Every table property a fork may have, under every name (to remove with the fork)."""
    return (*stored_names(fork_base_key(branch)), *stored_names(last_checkpoint_id_key(branch)))


# Partition field names of a state table are this prefix and the partition width (``key_group_range_w16``).
# A name in the partition spec, not a key: it keeps its original spelling.
PARTITION_FIELD_PREFIX = "key_group_range_w"

# --- snapshot summary of a checkpoint ---------------------------------------------------
SUMMARY_CHECKPOINT_ID = "icestate.checkpoint-id"
SUMMARY_BATCH_ID = "icestate.batch-id"
SUMMARY_PARALLELISM = "icestate.parallelism"
SUMMARY_MAX_PARALLELISM = "icestate.max-parallelism"
# JSON list of the checkpoint's operator state files (statestore.operator_state), one per task.
SUMMARY_OPERATOR_STATE = "icestate.operator-state"
# The branch (main or a fork) a checkpoint was committed to: a removed fork's snapshots, until
# expired, are on no branch, and must not count as main's.
SUMMARY_BRANCH = "icestate.branch"
# The orphan sweep of main's writer (catalog.gc): checkpoint ids below it were listed by a sweep
# since every file named after them was written; the next writer starts its sweeps there.
SUMMARY_SWEPT_BELOW = "icestate.swept-below"
# Keys a checkpoint's own summary carries; checkpoint properties given by users may not use them.
RESERVED_SUMMARY_KEYS = frozenset(
    {SUMMARY_CHECKPOINT_ID, SUMMARY_BATCH_ID, SUMMARY_PARALLELISM, SUMMARY_MAX_PARALLELISM, SUMMARY_OPERATOR_STATE,
     SUMMARY_BRANCH, SUMMARY_SWEPT_BELOW}
)


def is_reserved_summary_key(key: str) -> bool:
    """Whether ``key`` is a checkpoint summary key of the state store, by either name."""
    return current_name(key) in RESERVED_SUMMARY_KEYS

# --- snapshot summary of a compaction (catalog.compaction): its figures, as JSON ---------
SUMMARY_COMPACTION = "icestate.compaction"

# --- checkpoint properties a streaming query records (spark_integration.query) -----------
# They travel as user checkpoint properties and are read back from ``CheckpointInfo.properties``.
QUERY_WATERMARK_MS = "icestate.watermark-ms"
QUERY_MAX_EVENT_TIME_MS = "icestate.max-event-time-ms"
# The earliest registered timer after the batch, and the watermark Spark gives the next batch
# (spark_integration.ticks: when a batch with no input is due).
QUERY_NEXT_TIMER_MS = "icestate.next-timer-ms"
QUERY_NEXT_WATERMARK_MS = "icestate.next-watermark-ms"
QUERY_RUN_ID = "icestate.run-id"
# The live state rows after the batch, by variable and expiry (statestore.live_rows.Ledger),
# from which the next batch's count goes on.
QUERY_LIVE_ROWS = "icestate.live-rows"
QUERY_ID = "icestate.query-id"

# --- snapshot summary of an output table's batch (spark_integration.outputs) -------------
# The same names as the state table's batch id and the query's id: they hold the same values.
OUTPUT_BATCH_ID = "icestate.batch-id"
OUTPUT_QUERY_ID = "icestate.query-id"

# --- Parquet footer metadata of an operator state file (statestore.operator_state) -------
# JSON {variable name: redistribution mode}; written for inspection, read by no code.
OPERATOR_STATE_MODES = "icestate.operator-state"

# The keys an older version wrote under LEGACY_PREFIX (the ``@<branch>`` keys by their stem).
_LEGACY_KEYS = frozenset({
    MAX_PARALLELISM, KEY_SCHEMA, LAYOUT, PARTITION_WIDTH, LAST_CHECKPOINT_ID, SUMMARY_CHECKPOINT_ID,
    SUMMARY_BATCH_ID, SUMMARY_PARALLELISM, SUMMARY_OPERATOR_STATE, SUMMARY_COMPACTION,
})
_LEGACY_STEMS = (f"{LAST_CHECKPOINT_ID}@", f"{_FORK_BASE}@")


def legacy_name(key: str) -> str | None:
    """The name an older version stored ``key`` under, or None when it has no older name."""
    if key in _LEGACY_KEYS or key.startswith(_LEGACY_STEMS):
        return LEGACY_PREFIX + key[len(PREFIX):]
    return None


def current_name(key: str) -> str:
    """``key`` under its current name (itself unless it is a legacy name)."""
    if key.startswith(LEGACY_PREFIX):
        renamed = PREFIX + key[len(LEGACY_PREFIX):]
        if legacy_name(renamed) == key:
            return renamed
    return key


def stored_names(key: str) -> tuple[str, ...]:
    """Every name ``key`` may be stored under: the current one, then the legacy one."""
    old = legacy_name(key)
    return (key,) if old is None else (key, old)


def get(stored: Mapping[str, str], key: str, default: str | None = None) -> str | None:
    """The value of ``key`` in table properties or a snapshot summary, under its current
    name or else its legacy one; ``default`` when under neither."""
    value = stored.get(key)
    if value is not None:
        return value
    old = legacy_name(key)
    return stored.get(old, default) if old is not None else default


def upgraded(stored: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``stored`` with every legacy name renamed to its current one (the current
    name's value wins where both are present)."""
    out = {current_name(k): v for k, v in stored.items() if k.startswith(LEGACY_PREFIX)}
    out.update((k, v) for k, v in stored.items() if not k.startswith(LEGACY_PREFIX) or current_name(k) == k)
    return out
