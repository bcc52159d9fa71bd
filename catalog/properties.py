"""The Iceberg configuration every state table carries, and which summary keys are Iceberg's.

The state store's own stored keys (table properties, snapshot summary keys) live in
``statestore.stored_keys``; Iceberg's own keys are pyiceberg's constants.
"""

from __future__ import annotations

from pyiceberg.table import TableProperties

from statestore import stored_keys

# Partitioning. A segment covers the key groups of one partition, truncate(key_group, W).
# The default is one partition for the whole table (W = max parallelism): a task writes one
# segment per checkpoint whatever the parallelism, and readers prune by the key_group column
# statistics of each file, which Iceberg keeps in the manifests. Identity partitioning
# would write one tiny file per touched key group (DESIGN: measured facts).
DEFAULT_PARTITION_COUNT = 1

# Manifest merging. A fast append adds one manifest per commit and carries all earlier ones
# forward, so the manifest list of the head (and scan planning, and the open of a table)
# would grow with the age of the stream. A merge append with merging on rewrites the small
# manifests into one as soon as MANIFEST_MIN_MERGE_COUNT of them exist, which keeps every
# snapshot at most that many manifests (see docs: commit time after 10 vs 1000 commits).
MANIFEST_MIN_MERGE_COUNT = 16

# Table metadata keeps the previous metadata.json files listed in its metadata log;
# pyiceberg deletes the ones that fall out of it after each commit.
METADATA_PREVIOUS_VERSIONS_MAX = 4


def iceberg_table_properties() -> dict[str, str]:
    """Iceberg table properties every state table carries (set at creation, restored at open)."""
    return {
        TableProperties.PARQUET_COMPRESSION: "zstd",
        TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED: "true",
        TableProperties.METADATA_PREVIOUS_VERSIONS_MAX: str(METADATA_PREVIOUS_VERSIONS_MAX),
        TableProperties.MANIFEST_MERGE_ENABLED: "true",
        TableProperties.MANIFEST_MIN_MERGE_COUNT: str(MANIFEST_MIN_MERGE_COUNT),
        # The state table retries commits itself: pyiceberg's own retry re-parents the new
        # snapshot on the branch head and drops a rollback staged in the same transaction,
        # which after a restore to an older checkpoint would resurrect the abandoned line.
        TableProperties.COMMIT_NUM_RETRIES: "0",
    }


# Summary keys pyiceberg itself writes (snapshot statistics); checkpoint properties may not use them.
_ICEBERG_SUMMARY_PREFIXES = ("added-", "deleted-", "removed-", "total-", "changed-", "partitions.", "partition-")


def is_iceberg_summary_key(key: str) -> bool:
    return key == "operation" or key.startswith(_ICEBERG_SUMMARY_PREFIXES)


def is_user_summary_key(key: str) -> bool:
    """Whether a checkpoint property may use ``key``: not a key the state store reserves
    (under its current or legacy name) nor one Iceberg writes."""
    return not stored_keys.is_reserved_summary_key(key) and not is_iceberg_summary_key(key)
