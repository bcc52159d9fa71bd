"""Helpers of the Spark-free tests of ``spark_integration``: a fake clock, key routing as
Spark does it (``pmod(xxhash64(k), N)`` then ``kg * p // N``), stores over a
``DirectoryStateTable`` and a commit of several tasks' flushes as one checkpoint.

No SparkSession or JVM is used: only pyspark's pure-Python classes (``Row``, the
``StatefulProcessor`` base class, ``TimerValues``, ``ExpiredTimerInfo``, types).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from spark_integration import tasks
from statestore import (
    DirectoryStateTable,
    StateLayout,
    StateStore,
    StoreConfig,
    assign_key_groups,
    task_for_key_group,
)
from statestore.descriptors import StateDescriptor

MAX_PARALLELISM = 8
KEY_SCHEMA = pa.schema([("k", pa.string())])

# Spark schemas of the state variables used by the test processors.
VALUE = StructType([StructField("n", LongType())])
PAIR = StructType([StructField("name", StringType()), StructField("amount", LongType())])
ITEM = StructType([StructField("v", LongType())])
PARITY = StructType([StructField("parity", IntegerType())])
TOTAL = StructType([StructField("total", LongType())])


class FakeClock:
    """The store's processing-time clock, moved by hand."""

    def __init__(self, now_ms: int = 1_000_000):
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def key_groups(keys: Sequence[str], max_parallelism: int = MAX_PARALLELISM) -> list[int]:
    """Key group of each string key, as Spark's routing computes it."""
    if not keys:
        return []
    return [int(kg) for kg in assign_key_groups(pa.table({"k": pa.array(list(keys), pa.string())}), max_parallelism)]


def task_of(key: str, parallelism: int, max_parallelism: int = MAX_PARALLELISM) -> int:
    return task_for_key_group(max_parallelism, parallelism, key_groups([key], max_parallelism)[0])


def keys_of_task(task: int, parallelism: int, count: int, prefix: str = "key",
                 max_parallelism: int = MAX_PARALLELISM) -> list[str]:
    """``count`` distinct keys ``<prefix><i>`` that task ``task`` of ``parallelism`` owns."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        k = f"{prefix}{i}"
        if task_of(k, parallelism, max_parallelism) == task:
            out.append(k)
        i += 1
    return out


def layout_of(descriptors: Sequence[StateDescriptor], key_schema: pa.Schema = KEY_SCHEMA,
              max_parallelism: int = MAX_PARALLELISM) -> StateLayout:
    return StateLayout.of(key_schema, list(descriptors), max_parallelism)


def open_store(path: Path, layout: StateLayout, *, clock: FakeClock | None = None, task_index: int = 0,
               parallelism: int = 1, table: DirectoryStateTable | None = None, **config) -> StateStore:
    """A store over the directory table at ``path`` (opened at its newest checkpoint unless given)."""
    table = table if table is not None else DirectoryStateTable(path, layout)
    cfg = StoreConfig(clock_ms=clock or FakeClock(), **config)
    return StateStore(table, task_index=task_index, parallelism=parallelism, config=cfg)


def commit_together(table: DirectoryStateTable, stores: Sequence[StateStore], parallelism: int) -> int:
    """Flush every task's store as one checkpoint, commit it through ``table``, complete it."""
    cp = table.next_checkpoint_id()
    segments = [s for store in stores for s in store.flush(cp)]
    table.commit_checkpoint(cp, segments, parallelism=parallelism)
    for store in stores:
        store.checkpoint_complete(cp)
    return cp


def routed(columns: dict[str, list], key_column: str = "k", *, parallelism: int,
           max_parallelism: int = MAX_PARALLELISM, schema: pa.Schema | None = None) -> pa.Table:
    """Input rows plus the routing columns Spark adds (``tasks.KG``, ``tasks.TASK``)."""
    table = pa.table(columns, schema=schema)
    kgs = key_groups(table.column(key_column).to_pylist(), max_parallelism)
    table = table.append_column(tasks.KG, pa.array(kgs, pa.int32()))
    return table.append_column(tasks.TASK, pa.array([kg * parallelism // max_parallelism for kg in kgs], pa.int32()))


def split_by_task(rows: pa.Table) -> dict[int, pa.Table]:
    """The routed rows of each task that has rows (Spark calls a task only for a non-empty group)."""
    out = {}
    for task in sorted(set(rows.column(tasks.TASK).to_pylist())):
        mask = pc.equal(rows.column(tasks.TASK), task)
        out[task] = rows.filter(mask)
    return out
