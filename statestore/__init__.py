"""Disaggregated keyed state: key groups, state variables, memtable, Parquet segments,
resolved key-group cache. Knows nothing of Iceberg or Spark (see ``catalog`` and
``spark_integration``); a ``DirectoryStateTable`` makes it usable on its own.
"""

from statestore.exports import lazy_exports

# Exports load lazily: a process that needs one module (a task's path, or Spark's Python
# processes that unpickle the ticks source, which imports nothing of the store) does not
# import polars, pyarrow and the whole store with the package.
_EXPORTS = {
    "StoreConfig": "statestore.config",
    "AggregateFunction": "statestore.descriptors",
    "AggregatingStateDescriptor": "statestore.descriptors",
    "AverageAggregate": "statestore.descriptors",
    "ListStateDescriptor": "statestore.descriptors",
    "MapStateDescriptor": "statestore.descriptors",
    "ReducingStateDescriptor": "statestore.descriptors",
    "StateDescriptor": "statestore.descriptors",
    "StateKind": "statestore.descriptors",
    "TtlConfig": "statestore.descriptors",
    "TtlUpdateType": "statestore.descriptors",
    "ValueStateDescriptor": "statestore.descriptors",
    "DirectoryStateTable": "statestore.directory_table",
    "CatalogUnavailableError": "statestore.errors",
    "CheckpointFailedError": "statestore.errors",
    "CheckpointNotFoundError": "statestore.errors",
    "CheckpointPendingError": "statestore.errors",
    "CommitConflictError": "statestore.errors",
    "CorruptSegmentError": "statestore.errors",
    "InjectedFaultError": "statestore.errors",
    "KeyGroupOutOfRangeError": "statestore.errors",
    "NoCurrentKeyError": "statestore.errors",
    "QueryCheckpointUnreadableError": "statestore.errors",
    "QueryMismatchError": "statestore.errors",
    "QuerySourcesMismatchError": "statestore.errors",
    "SchemaMismatchError": "statestore.errors",
    "StateClosedError": "statestore.errors",
    "StateDescriptorMismatchError": "statestore.errors",
    "StateFunctionUnavailableError": "statestore.errors",
    "StateNotDeclaredError": "statestore.errors",
    "StateOutOfStepError": "statestore.errors",
    "StateStoreError": "statestore.errors",
    "StateTableMismatchError": "statestore.errors",
    "TaskReportError": "statestore.errors",
    "TimersDisabledError": "statestore.errors",
    "UnsupportedKeyTypeError": "statestore.errors",
    "EMPTY_KEY_GROUP_RANGE": "statestore.keygroups",
    "KeyGroupRange": "statestore.keygroups",
    "assign_key_group": "statestore.keygroups",
    "assign_key_groups": "statestore.keygroups",
    "compute_key_group_range_for_task": "statestore.keygroups",
    "spark_xxhash64": "statestore.keygroups",
    "task_for_key_group": "statestore.keygroups",
    "StateLayout": "statestore.layout",
    "OperatorListState": "statestore.operator_state",
    "OperatorStateDescriptor": "statestore.operator_state",
    "OperatorStateFile": "statestore.operator_state",
    "OperatorStateStore": "statestore.operator_state",
    "Redistribution": "statestore.operator_state",
    "AggregatingState": "statestore.state",
    "ListState": "statestore.state",
    "MapState": "statestore.state",
    "ReducingState": "statestore.state",
    "ValueState": "statestore.state",
    "StateStore": "statestore.store",
    "CheckpointInfo": "statestore.table",
    "SegmentFile": "statestore.table",
    "StateTable": "statestore.table",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
