"""Shared pieces of the streaming tests: input files, test processors, running a query to its end.

The processors live in this module, which is registered with cloudpickle by value so the
Python workers (which do not see the tests directory) can unpickle them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import cloudpickle
from pyspark.sql import Row, SparkSession
from pyspark.sql.streaming import StatefulProcessor

from spark_integration import RunningAggregate, StateLocation, runner_of, start_stateful_query

INPUT_SCHEMA = "key string, v long"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
PROVIDER_CONF = "spark.sql.streaming.stateStore.providerClass"
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@contextlib.contextmanager
def spark_own_operator(spark: SparkSession, **conf: str) -> Iterator[None]:
    """Spark's own stateful operator for the queries started inside: RocksDB, one shuffle
    partition (Spark's operator runs a Python worker and a RocksDB store per shuffle partition
    and batch; the number is fixed in a query's checkpoint) and ``conf`` (dotted keys as they are
    spelled, given through ``**{...}``); the session's settings are restored after."""
    from tests.integration.conftest import SPARK_CONF

    spark.conf.set(PROVIDER_CONF, ROCKSDB)
    spark.conf.set(SHUFFLE_PARTITIONS, "1")
    for key, value in conf.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        spark.conf.unset(PROVIDER_CONF)
        for key in conf:
            spark.conf.unset(key)
        spark.conf.set(SHUFFLE_PARTITIONS, SPARK_CONF[SHUFFLE_PARTITIONS])


def write_batches(directory: Path, batches: list[pa.Table]) -> str:
    """One Parquet file per micro-batch (read with maxFilesPerTrigger=1, in name order). Spark's
    file source takes files in order of modification time, in milliseconds, ties in listing
    order: files written within one millisecond would swap, so each gets its own, 10 ms apart."""
    os.makedirs(directory, exist_ok=True)
    start = time.time_ns() - len(batches) * 10_000_000
    for i, t in enumerate(batches):
        path = directory / f"part-{i:04d}.parquet"
        pq.write_table(t, path)
        os.utime(path, ns=(start + i * 10_000_000,) * 2)
    return str(directory)


def key_batches(n_batches: int, rows: int, keys: int, offset: int = 0) -> list[pa.Table]:
    """Deterministic batches: row r of batch b has key k<(b*rows + r)*7 % keys> and v = b*rows + r."""
    out = []
    for b in range(n_batches):
        ids = range(offset + b * rows, offset + (b + 1) * rows)
        out.append(pa.table({"key": [f"k{(i * 7) % keys:04d}" for i in ids], "v": pa.array(list(ids), pa.int64())}))
    return out


def counts(batches: list[pa.Table]) -> dict[str, int]:
    c: Counter = Counter()
    for t in batches:
        c.update(t.column("key").to_pylist())
    return dict(c)


def stream(spark: SparkSession, input_dir: str, schema: str = INPUT_SCHEMA):
    return spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(input_dir)


def run_to_end(spark: SparkSession, input_dir: str, processor, output_schema, *, location: StateLocation,
               checkpoint: str, keys=("key",), schema: str = INPUT_SCHEMA, df=None, **kwargs):
    """Start a stateful query over ``input_dir``, process every file, return its runner."""
    df = stream(spark, input_dir, schema) if df is None else df
    query = start_stateful_query(df, list(keys), processor, output_schema, location=location,
                                 checkpoint_location=checkpoint, trigger={"availableNow": True}, **kwargs)
    try:
        query.awaitTermination(300)
        if query.exception() is not None:
            raise query.exception()
    finally:
        query.stop()
    return runner_of(query)


class CountProcessor(StatefulProcessor):
    """The keyed running count of the benchmark: emit (key, new count) per updated key."""

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", "n long")

    def handleInputRows(self, key, rows, timerValues):
        n = sum(1 for _ in rows)
        old = self.count.get()
        new = (old[0] if old else 0) + n
        self.count.update((new,))
        yield Row(key=key[0], count=new)

    def close(self) -> None:
        pass


class AsyncCountProcessor(CountProcessor):
    """``CountProcessor`` with a coroutine handler and an awaited read (``api="async"``)."""

    async def handleInputRows(self, key, rows, timerValues):
        n = sum(1 for _ in rows)
        old = await self.count.get()
        new = (old[0] if old else 0) + n
        self.count.update((new,))
        yield Row(key=key[0], count=new)


PROFILE_OUTPUT = "key string, n long, recent string, evens long, odds long, parities int, cleared boolean"


class ProfileProcessor(StatefulProcessor):
    """Value, list and map state together; deterministic whatever the order of a key's rows."""

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", "n long")
        self.recent = handle.getListState("recent", "v long")
        self.totals = handle.getMapState("totals", "parity int", "total long")

    def handleInputRows(self, key, rows, timerValues):
        values = sorted(r.v for r in rows)
        old = self.count.get()
        n = (old[0] if old else 0) + len(values)
        self.count.update((n,))
        self.recent.appendList([(v,) for v in values])
        kept = list(self.recent.get())[-3:]
        self.recent.put(kept)
        for v in values:
            p = v % 2
            cur = self.totals.getValue((p,))
            self.totals.updateValue((p,), ((cur[0] if cur else 0) + v,))
        cleared = n % 5 == 0
        if cleared:  # exercise removeKey and the map's iteration after it
            self.totals.removeKey((1,))
        evens, odds = self.totals.getValue((0,)), self.totals.getValue((1,))
        yield Row(key=key[0], n=n, recent=",".join(str(t[0]) for t in kept),
                  evens=evens[0] if evens else None, odds=odds[0] if odds else None,
                  parities=len(list(self.totals.keys())), cleared=cleared)

    def close(self) -> None:
        pass


class AsyncProfileProcessor(ProfileProcessor):
    """``ProfileProcessor`` with a coroutine handler, its reads awaited (``api="async"``)."""

    async def handleInputRows(self, key, rows, timerValues):
        values = sorted(r.v for r in rows)
        old = await self.count.get()
        n = (old[0] if old else 0) + len(values)
        self.count.update((n,))
        self.recent.appendList([(v,) for v in values])
        kept = [t async for t in self.recent.get()][-3:]
        self.recent.put(kept)
        for v in values:
            p = v % 2
            cur = await self.totals.getValue((p,))
            self.totals.updateValue((p,), ((cur[0] if cur else 0) + v,))
        cleared = n % 5 == 0
        if cleared:
            self.totals.removeKey((1,))
        evens, odds = await self.totals.getValue((0,)), await self.totals.getValue((1,))
        yield Row(key=key[0], n=n, recent=",".join(str(t[0]) for t in kept),
                  evens=evens[0] if evens else None, odds=odds[0] if odds else None,
                  parities=len([k async for k in self.totals.keys()]), cleared=cleared)  # noqa: SIM118


class FailingProcessor(CountProcessor):
    """A count that raises the user's own exception for one key."""

    def __init__(self, bad_key: str):
        self.bad_key = bad_key

    def handleInputRows(self, key, rows, timerValues):
        if key[0] == self.bad_key:
            raise KeyError(f"no profile for {key[0]}")
        yield from super().handleInputRows(key, rows, timerValues)


class InitialCountProcessor(CountProcessor):
    """A count seeded from an initial state (key, n)."""

    def handleInitialState(self, key, initialState, timerValues) -> None:
        self.count.update((initialState.n,))


class TtlCountProcessor(CountProcessor):
    def __init__(self, ttl_ms: int):
        self.ttl_ms = ttl_ms

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", "n long", self.ttl_ms)


class BadOutputProcessor(CountProcessor):
    """Emits a string where the declared output has a long."""

    def handleInputRows(self, key, rows, timerValues):
        list(CountProcessor.handleInputRows(self, key, rows, timerValues))
        yield Row(key=key[0], count="not a number")


class ForgetfulCount(RunningAggregate):
    """``RunningAggregate("count")`` whose Python workers forget their task stores in every batch
    on an odd base checkpoint: the next batch's tasks then run as in workers that never ran them
    (Spark gives a task to any idle worker), and the batch after that in the same stores again."""

    def __init__(self) -> None:
        super().__init__("count")

    def process(self, batch):
        from spark_integration import tasks

        result = super().process(batch)
        base = batch.store.table.current_checkpoint()
        if base is not None and base.checkpoint_id % 2 == 1:
            tasks._STORES.clear()  # the running task keeps its own reference, and flushes as usual
        return result
