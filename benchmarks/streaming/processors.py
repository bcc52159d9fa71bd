"""The keyed running count as Spark ``StatefulProcessor`` classes, module-level so that the
``spark-tws-rows`` peer and ``ours-compat`` run the very same class. Spark's Python workers
unpickle them by reference: this module imports nothing of the project.
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
