"""A replayable streaming source for tests: Spark's Python data source API with offsets, as a
message log (Kafka and the like) is read. Row ``i`` of the log is a function of ``i`` alone, so
any offset range reads back the same rows whatever run, engine or restart asks for it; offsets
advance ``rows_per_batch`` at a time up to ``total`` (``availableNow`` ends there)."""

from __future__ import annotations

import datetime as dt

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

FORMAT = "icestate_test_replay"
SCHEMA = "key string, v long, ts timestamp"
EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def row(i: int, keys: int) -> tuple:
    """Log row ``i``: key ``k<i mod keys>``, value ``i``, event time ``i`` seconds after ``EPOCH``
    less a little jitter (some rows arrive late)."""
    return f"k{i % keys}", i, EPOCH + dt.timedelta(seconds=i - 3 * (i % 4 == 3))


class ReplaySource(DataSource):
    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema) -> DataSourceStreamReader:
        return _Reader(int(self.options.get("rows_per_batch", 10)), int(self.options["total"]),
                       int(self.options.get("keys", 5)))


class _Range(InputPartition):
    def __init__(self, start: int, end: int):
        self.start, self.end = start, end


class _Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, rows_per_batch: int, total: int, keys: int):
        self.step, self.total, self.keys = rows_per_batch, total, keys
        self.end = total

    def initialOffset(self) -> dict:
        return {"offset": 0}

    def prepareForTriggerAvailableNow(self) -> None:
        self.end = self.total

    def latestOffset(self, start: dict, limit) -> dict:
        return {"offset": min(start["offset"] + self.step, self.end)}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        return [_Range(start["offset"], end["offset"])]

    def read(self, partition: _Range):
        for i in range(partition.start, partition.end):
            yield row(i, self.keys)

    def commit(self, end: dict) -> None:
        pass
