"""Disaggregated keyed state: key groups, state variables, memtable, Parquet segments,
resolved key-group cache. Knows nothing of Iceberg or Spark (see ``catalog`` and
``spark_integration``); a ``DirectoryStateTable`` makes it usable on its own.
"""

from statestore.config import StoreConfig
from statestore.descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    AverageAggregate,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateKind,
    TtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)
from statestore.directory_table import DirectoryStateTable
from statestore.errors import (
    CheckpointFailedError,
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptSegmentError,
    KeyGroupOutOfRangeError,
    SchemaMismatchError,
    StateClosedError,
    StateStoreError,
    StateTableMismatchError,
    UnsupportedKeyTypeError,
)
from statestore.keygroups import (
    EMPTY_KEY_GROUP_RANGE,
    KeyGroupRange,
    assign_key_group,
    assign_key_groups,
    compute_key_group_range_for_task,
    spark_xxhash64,
    task_for_key_group,
)
from statestore.layout import StateLayout
from statestore.operator_state import (
    OperatorListState,
    OperatorStateDescriptor,
    OperatorStateFile,
    OperatorStateStore,
    Redistribution,
)
from statestore.state import AggregatingState, ListState, MapState, ReducingState, ValueState
from statestore.store import StateStore
from statestore.table import CheckpointInfo, SegmentFile, StateTable

__all__ = [
    "EMPTY_KEY_GROUP_RANGE",
    "AggregateFunction",
    "AggregatingState",
    "AggregatingStateDescriptor",
    "AverageAggregate",
    "CheckpointFailedError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CommitConflictError",
    "CorruptSegmentError",
    "DirectoryStateTable",
    "KeyGroupOutOfRangeError",
    "KeyGroupRange",
    "ListState",
    "ListStateDescriptor",
    "MapState",
    "MapStateDescriptor",
    "OperatorListState",
    "OperatorStateDescriptor",
    "OperatorStateFile",
    "OperatorStateStore",
    "Redistribution",
    "ReducingState",
    "ReducingStateDescriptor",
    "SchemaMismatchError",
    "SegmentFile",
    "StateClosedError",
    "StateDescriptor",
    "StateKind",
    "StateLayout",
    "StateStore",
    "StateStoreError",
    "StateTable",
    "StateTableMismatchError",
    "StoreConfig",
    "TtlConfig",
    "TtlUpdateType",
    "UnsupportedKeyTypeError",
    "ValueState",
    "ValueStateDescriptor",
    "assign_key_group",
    "assign_key_groups",
    "compute_key_group_range_for_task",
    "spark_xxhash64",
    "task_for_key_group",
]
