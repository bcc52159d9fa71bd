"""The benchmark's Spark ``StatefulProcessor`` classes (the keyed running count, row and pandas;
the processing-time sessions; a list-state and a map-state processor for the store-level
``bench_processors``), module-level so that each Spark peer and ours run the very same
class (``spark-tws-rows`` and ``ours-compat``, ``spark-tws-pandas`` and ``ours-pandas``,
``spark-tws-sessions`` and ``ours-sessions``). Spark's Python workers unpickle them by
reference: this module imports nothing of the project.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from pyspark.sql.types import LongType, StructField, StructType

COUNT_STATE_SCHEMA = StructType([StructField("count", LongType(), True)])


class CountProcessor(StatefulProcessor):
    """Row-based keyed running count for ``transformWithState``: one ValueState per key;
    emits (key, new count) for every key of the batch."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", COUNT_STATE_SCHEMA)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        n = sum(1 for _ in rows)
        current = self.count.get()  # one state call: get() returns None for a new key
        total = (current[0] if current else 0) + n
        self.count.update((total,))
        yield Row(key=key[0], count=total)

    def close(self) -> None:
        pass


class PandasCountProcessor(StatefulProcessor):
    """The same running count for ``transformWithStateInPandas``: rows arrive as pandas frames."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", COUNT_STATE_SCHEMA)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        import pandas as pd

        n = sum(len(frame) for frame in rows)
        current = self.count.get()
        total = (int(current[0]) if current else 0) + n
        self.count.update((total,))
        yield pd.DataFrame({"key": [key[0]], "count": [total]})

    def close(self) -> None:
        pass


class SessionCountProcessor(StatefulProcessor):
    """Sessions in processing time for ``transformWithState`` (``timeMode="ProcessingTime"``):
    counts a key's events in a ValueState and keeps one timer per key, ``gap_ms`` after the
    processing time of the key's last batch with input (the previous timer is deleted); the
    timer emits (key, the session's event count) and clears the state."""

    def __init__(self, gap_ms: int = 1) -> None:
        self.gap_ms = gap_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", COUNT_STATE_SCHEMA)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        n = sum(1 for _ in rows)
        current = self.count.get()
        self.count.update(((current[0] if current else 0) + n,))
        for timer in self.handle.listTimers():
            self.handle.deleteTimer(timer)
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + self.gap_ms)
        return iter([])

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
        total = self.count.get()[0]
        self.count.clear()
        yield Row(key=key[0], count=total)

    def close(self) -> None:
        pass


ITEM_SCHEMA = StructType([StructField("value", LongType(), True)])
BUCKET_SCHEMA = StructType([StructField("bucket", LongType(), True)])


class RecentValuesProcessor(StatefulProcessor):
    """A ListState per key: keeps the key's last three values (a read and a replace per key);
    emits (key, how many it keeps)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.recent = handle.getListState("recent", ITEM_SCHEMA)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        kept = ([*self.recent.get(), *((r.value,) for r in rows)])[-3:]
        self.recent.put(kept)
        yield Row(key=key[0], count=len(kept))

    def close(self) -> None:
        pass


class BucketCountProcessor(StatefulProcessor):
    """A MapState per key: counts the key's events per bucket (value mod 4), a get and a put
    per event; emits (key, the key's events in this batch)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.buckets = handle.getMapState("buckets", BUCKET_SCHEMA, COUNT_STATE_SCHEMA)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
        n = 0
        for r in rows:
            bucket = (r.value % 4,)
            current = self.buckets.getValue(bucket)
            self.buckets.updateValue(bucket, ((current[0] if current else 0) + 1,))
            n += 1
        yield Row(key=key[0], count=n)

    def close(self) -> None:
        pass
