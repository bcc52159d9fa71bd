"""Processors of the Spark-compatibility suite (``test_spark_semantics``), written the way
Spark's own ``transformWithState`` tests write theirs: one ``StatefulProcessor`` subclass
per feature, each run unchanged by Spark's operator and by ours.

Every processor has a row variant (``transformWithState``: ``Row``s in and out) and, where
the suite runs it, a pandas variant (``transformWithStateInPandas``: a key's rows as a
pandas DataFrame, DataFrames out) with the same logic. Outputs are deterministic functions
of the input and of the batch's times, so the two engines' outputs compare batch by batch.

Registered with cloudpickle by value: Python workers do not see the tests directory.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pandas as pd
from pyspark import cloudpickle
from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _values(rows) -> list[int]:
    return sorted(r.v for r in rows)


def _pandas_values(frames) -> list[int]:
    return sorted(int(v) for f in frames for v in f["v"])


# ---------------------------------------------------------------------------- value, list, map

COUNTS_OUTPUT = "key string, count long, recent string, parity_keys int"


class CountsProcessor(StatefulProcessor):
    """A running count (value), the last three values (list) and a total per parity (map)."""

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", "n long")
        self.recent = handle.getListState("recent", "v long")
        self.totals = handle.getMapState("totals", "parity int", "total long")

    def _update(self, values: list[int]) -> tuple[int, str, int]:
        old = self.count.get()
        n = (old[0] if old else 0) + len(values)
        self.count.update((n,))
        self.recent.appendList([(v,) for v in values])
        kept = list(self.recent.get())[-3:]
        self.recent.put(kept)
        for v in values:
            cur = self.totals.getValue((v % 2,))
            self.totals.updateValue((v % 2,), ((cur[0] if cur else 0) + v,))
        return n, ",".join(str(t[0]) for t in kept), len(list(self.totals.keys()))

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        n, recent, parities = self._update(_values(rows))
        yield Row(key=key[0], count=n, recent=recent, parity_keys=parities)

    def close(self) -> None:
        pass


class PandasCountsProcessor(CountsProcessor):
    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        n, recent, parities = self._update(_pandas_values(rows))
        yield pd.DataFrame({"key": [key[0]], "count": [n], "recent": [recent], "parity_keys": [parities]})


# ---------------------------------------------------------------------------- processing-time timers

SESSION_OUTPUT = "key string, events long, closed boolean"


class SessionProcessor(StatefulProcessor):
    """Sessions that close ``gap_ms`` of processing time after a key's last rows: each batch
    with rows moves the key's one timer; the timer emits the session's event count."""

    def __init__(self, gap_ms: int):
        self.gap_ms = gap_ms

    def init(self, handle) -> None:
        self.handle = handle
        self.events = handle.getValueState("events", "n long")

    def _rows(self, key, n: int, timerValues) -> tuple:
        old = self.events.get()
        total = (old[0] if old else 0) + n
        self.events.update((total,))
        for t in self.handle.listTimers():
            self.handle.deleteTimer(t)
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + self.gap_ms)
        return key[0], total

    def _expired(self, key) -> tuple:
        total = self.events.get()[0]
        self.events.clear()
        return key[0], total

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        k, total = self._rows(key, sum(1 for _ in rows), timerValues)
        yield Row(key=k, events=total, closed=False)

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Row]:
        k, total = self._expired(key)
        yield Row(key=k, events=total, closed=True)

    def close(self) -> None:
        pass


class AsyncSessionProcessor(SessionProcessor):
    """``SessionProcessor`` with coroutine handlers (``api="async"``): the same logic, its reads
    awaited."""

    async def handleInputRows(self, key, rows, timerValues):
        old = await self.events.get()
        total = (old[0] if old else 0) + sum(1 for _ in rows)
        self.events.update((total,))
        for t in self.handle.listTimers():
            self.handle.deleteTimer(t)
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + self.gap_ms)
        yield Row(key=key[0], events=total, closed=False)

    async def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        total = (await self.events.get())[0]
        self.events.clear()
        return [Row(key=key[0], events=total, closed=True)]


class PandasSessionProcessor(SessionProcessor):
    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        k, total = self._rows(key, sum(len(f) for f in rows), timerValues)
        yield pd.DataFrame({"key": [k], "events": [total], "closed": [False]})

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        k, total = self._expired(key)
        yield pd.DataFrame({"key": [k], "events": [total], "closed": [True]})


class AsyncPandasSessionProcessor(SessionProcessor):
    """``PandasSessionProcessor`` with coroutine handlers (``api="async_pandas"``): DataFrames in
    and out, its reads awaited."""

    async def handleInputRows(self, key, rows, timerValues):
        old = await self.events.get()
        total = (old[0] if old else 0) + sum(len(f) for f in rows)
        self.events.update((total,))
        for t in self.handle.listTimers():
            self.handle.deleteTimer(t)
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + self.gap_ms)
        yield pd.DataFrame({"key": [key[0]], "events": [total], "closed": [False]})

    async def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        total = (await self.events.get())[0]
        self.events.clear()
        yield pd.DataFrame({"key": [key[0]], "events": [total], "closed": [True]})


# ---------------------------------------------------------------------------- event-time timers

WINDOW_OUTPUT = "key string, total long, fired_at long, watermark long, late_seen long"


class EventTimeWindowProcessor(StatefulProcessor):
    """Sums a key's values until the watermark passes its first event time + ``window_ms``;
    the timer emits the sum with the expiry and the watermark it fired at. ``late_seen``
    counts rows at or before the watermark that reached the handler (Spark drops late rows
    with the previous batch's watermark, so some rows older than the current one still come)."""

    def __init__(self, window_ms: int = 10_000):
        self.window_ms = window_ms

    def init(self, handle) -> None:
        self.handle = handle
        self.total = handle.getValueState("total", "total long, late long")

    def _rows(self, times_ms: list[int], values: list[int], timerValues) -> None:
        old = self.total.get()
        if old is None:
            self.handle.registerTimer(min(times_ms) + self.window_ms)
        late = sum(1 for t in times_ms if t <= timerValues.getCurrentWatermarkInMs())
        self.total.update(((old[0] if old else 0) + sum(values), (old[1] if old else 0) + late))

    def _expired(self, key, timerValues, expiredTimerInfo) -> tuple:
        total, late = self.total.get()
        self.total.clear()
        return (key[0], total, expiredTimerInfo.getExpiryTimeInMs(), timerValues.getCurrentWatermarkInMs(), late)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        rows = list(rows)
        self._rows([int(r.ts.timestamp() * 1000) for r in rows], [r.v for r in rows], timerValues)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[Row]:
        k, total, fired_at, watermark, late = self._expired(key, timerValues, expiredTimerInfo)
        yield Row(key=k, total=total, fired_at=fired_at, watermark=watermark, late_seen=late)

    def close(self) -> None:
        pass


class PandasEventTimeWindowProcessor(EventTimeWindowProcessor):
    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        frame = pd.concat(list(rows))
        times = [int(t.timestamp() * 1000) for t in frame["ts"].dt.tz_localize("UTC")]
        self._rows(times, [int(v) for v in frame["v"]], timerValues)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
        k, total, fired_at, watermark, late = self._expired(key, timerValues, expiredTimerInfo)
        yield pd.DataFrame({"key": [k], "total": [total], "fired_at": [fired_at], "watermark": [watermark],
                            "late_seen": [late]})


# ---------------------------------------------------------------------------- initial state

INITIAL_OUTPUT = "key string, count long"


class InitialCountProcessor(StatefulProcessor):
    """A running count seeded from initial state rows (key, seed): seeds add up."""

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", "n long")

    def handleInitialState(self, key, initialState, timerValues) -> None:
        old = self.count.get()
        self.count.update(((old[0] if old else 0) + initialState.seed,))

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        old = self.count.get()
        n = (old[0] if old else 0) + sum(1 for _ in rows)
        self.count.update((n,))
        yield Row(key=key[0], count=n)

    def close(self) -> None:
        pass


class PandasInitialCountProcessor(InitialCountProcessor):
    def handleInitialState(self, key, initialState, timerValues) -> None:
        old = self.count.get()
        self.count.update(((old[0] if old else 0) + int(initialState["seed"].sum()),))

    def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
        old = self.count.get()
        n = (old[0] if old else 0) + sum(len(f) for f in rows)
        self.count.update((n,))
        yield pd.DataFrame({"key": [key[0]], "count": [n]})


# ---------------------------------------------------------------------------- TTL

TTL_OUTPUT = "key string, seen long"


class TtlProcessor(StatefulProcessor):
    """Counts a key's rows in a value state whose entries live ``ttl_ms`` after each update:
    a key that comes back after longer starts again from zero."""

    def __init__(self, ttl_ms: int):
        self.ttl_ms = ttl_ms

    def init(self, handle) -> None:
        self.seen = handle.getValueState("seen", "n long", self.ttl_ms)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        old = self.seen.get()
        n = (old[0] if old else 0) + sum(1 for _ in rows)
        self.seen.update((n,))
        yield Row(key=key[0], seen=n)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- composite types

COMPOSITE_OUTPUT = "key string, reads string"
PROFILE = ("id long, meta struct<a:int, inner:struct<x:string, y:double>>, items array<struct<p:int, q:string>>, "
           "tags map<string, struct<u:int>>, nums array<long>")


def describe(value) -> str:
    """A value with its Python types at every depth (Row fields by name, dicts sorted)."""
    if isinstance(value, Row) and hasattr(value, "__fields__"):
        return "Row(" + ", ".join(f"{k}={describe(v)}" for k, v in zip(value.__fields__, value, strict=True)) + ")"
    if isinstance(value, tuple):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in sorted(value.items())) + "}"
    return f"{type(value).__name__}:{value!r}"


class CompositeProcessor(StatefulProcessor):
    """Nested structs, arrays of structs and maps of structs in value, list and map state,
    written as tuples, Rows and dicts; each batch reports what every read returns."""

    def init(self, handle) -> None:
        self.profile = handle.getValueState("profile", PROFILE)
        self.events = handle.getListState("events", "n long, at struct<x:string>")
        self.index = handle.getMapState("index", "name string, k int", "val long, st struct<z:string, w:int>")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        n = sum(1 for _ in rows)
        reads = [describe(self.profile.get()), describe(list(self.events.get()) if self.events.exists() else None),
                 describe(self.index.getValue(("first", 1))), describe(list(self.index.iterator())),
                 describe(list(self.index.keys())), describe(list(self.index.values()))]
        self.profile.update((n, Row(a=n, inner=Row(x=key[0], y=n / 2)), [Row(p=n, q="q"), (n + 1, "r")],
                             {"t": Row(u=n), "s": {"u": n + 1}}, [n, n + 1]))
        self.events.appendValue((n, Row(x=f"e{n}")))
        self.index.updateValue(("first", 1), (n, Row(z=key[0], w=n)))
        self.index.updateValue(Row(name="second", k=n), Row(val=n * 10, st={"z": "d", "w": 0}))
        reads.append(describe(self.profile.get()))
        yield Row(key=key[0], reads=" | ".join(reads))

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- deleted state

DELETED_OUTPUT = "key string, stale string, fresh string, kept long"


class DeletedStateProcessor(StatefulProcessor):
    """``deleteIfExists`` in ``init`` (Spark runs it at every batch): ``stale`` (and a list and
    a map state) obtained before its delete (every call through them raises Spark's
    ``PySparkRuntimeError`` with Spark's text, or reads nothing: ``stale`` tells which),
    ``fresh`` after its delete (usable, empty at every batch), ``kept`` is never deleted."""

    def init(self, handle) -> None:
        self.stale = handle.getValueState("stale", "n long")
        self.stale_list = handle.getListState("stale_list", "n long")
        self.stale_map = handle.getMapState("stale_map", "k string", "n long")
        for name in ("stale", "stale_list", "stale_map", "fresh"):
            handle.deleteIfExists(name)
        self.fresh = handle.getValueState("fresh", "n long")
        self.kept = handle.getValueState("kept", "n long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        from pyspark.errors import PySparkRuntimeError

        n = sum(1 for _ in rows)
        calls = {"value.exists": self.stale.exists, "value.get": self.stale.get,
                 "value.update": lambda: self.stale.update((n,)), "value.clear": self.stale.clear,
                 "list.exists": self.stale_list.exists, "list.get": lambda: list(self.stale_list.get()),
                 "list.appendValue": lambda: self.stale_list.appendValue((n,)),
                 "list.appendList": lambda: self.stale_list.appendList([(n,)]),
                 "list.put": lambda: self.stale_list.put([(n,)]), "list.clear": self.stale_list.clear,
                 "map.exists": self.stale_map.exists, "map.getValue": lambda: self.stale_map.getValue(("x",)),
                 "map.containsKey": lambda: self.stale_map.containsKey(("x",)),
                 "map.updateValue": lambda: self.stale_map.updateValue(("x",), (n,)),
                 "map.iterator": lambda: list(self.stale_map.iterator()),
                 "map.keys": lambda: list(self.stale_map.keys()), "map.values": lambda: list(self.stale_map.values()),
                 "map.removeKey": lambda: self.stale_map.removeKey(("x",)), "map.clear": self.stale_map.clear}
        said = []
        for name, call in calls.items():
            try:
                said.append(f"{name} -> {call()!r}")
            except PySparkRuntimeError as e:  # what a processor written for Spark catches
                said.append(f"{name} raised PySparkRuntimeError({e})")
        fresh = self.fresh.get()
        self.fresh.update((n,))
        kept = self.kept.get()
        self.kept.update(((kept[0] if kept else 0) + n,))
        yield Row(key=key[0], stale="; ".join(said), fresh=str(fresh), kept=(kept[0] if kept else 0) + n)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- not nullable

NOT_NULLABLE_OUTPUT = "key string, seen string"


class NotNullableProcessor(StatefulProcessor):
    """State schemas with fields declared not nullable (value, list element, map key and
    value), written with values only, read back the next batch; a key's third batch clears."""

    def init(self, handle) -> None:
        from pyspark.sql.types import LongType, StringType, StructField, StructType

        fields = StructType([StructField("id", LongType(), False), StructField("name", StringType(), False)])
        self.last = handle.getValueState("last", fields)
        self.items = handle.getListState("items", fields)
        self.index = handle.getMapState("index", StructType([StructField("k", StringType(), False)]), fields)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        n = sum(1 for _ in rows)
        seen = [str(self.last.get()), str(list(self.items.get())), str(sorted(self.index.iterator()))]
        if self.last.exists() and len(list(self.items.get())) >= 2:
            self.last.clear()
            self.items.clear()
            self.index.clear()
        else:
            self.last.update((n, f"n{n}"))
            self.items.appendValue((n, key[0]))
            self.index.updateValue((key[0] + str(n),), (n, "v"))
        yield Row(key=key[0], seen=" | ".join(seen))

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- arrow batches

CHUNKS_OUTPUT = "key string, sizes string"


class PandasChunksProcessor(StatefulProcessor):
    """The sizes of the DataFrames a key's rows arrive in (Spark cuts them at
    ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows / ``maxBytesPerBatch`` bytes)."""

    def init(self, handle) -> None:
        self.batches = handle.getValueState("batches", "n long")

    def handleInputRows(self, key, rows, timerValues):
        import pandas as pd

        sizes = [len(frame) for frame in rows]
        n = self.batches.get()
        self.batches.update(((n[0] if n else 0) + 1,))
        yield pd.DataFrame({"key": [key[0]], "sizes": [str(sizes)]})

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- schema evolution

EVOLVING_OUTPUT = "key string, read string"
EVOLVING_SCHEMAS = (
    "id int, name string",                   # as first declared
    "id long, name string, count int",       # id widened, count added
    "name string, id long",                  # reordered, count dropped
)


class EvolvingProcessor(StatefulProcessor):
    """A value state whose declared schema changes between runs (``EVOLVING_SCHEMAS[version]``):
    each batch emits what it read (the old value, read with the new schema), then writes a value
    of the new schema."""

    def __init__(self, version: int):
        self.version = version

    def init(self, handle) -> None:
        self.value = handle.getValueState("value", EVOLVING_SCHEMAS[self.version])

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        n = sum(1 for _ in rows)
        read = self.value.get()
        new = {0: (n, key[0]), 1: (n * 10, key[0] + "1", n), 2: (key[0] + "2", n * 100)}[self.version]
        self.value.update(new)
        yield Row(key=key[0], read=describe(read))

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- state names

NAMES_OUTPUT = "key string, count long, items long, entries long"


class OddNamesProcessor(StatefulProcessor):
    """State names that are not identifiers: with a dash, a space, a dot and non-ASCII."""

    def init(self, handle) -> None:
        self.count = handle.getValueState("ttl-state", "n long")
        self.items = handle.getListState("my state", "v long")
        self.entries = handle.getMapState("a.b", "k string", "v long")
        self.other = handle.getValueState("ünïcode", "n long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        values = _values(rows)
        old = self.count.get()
        n = (old[0] if old else 0) + len(values)
        self.count.update((n,))
        self.items.appendList([(v,) for v in values])
        self.entries.updateValue((f"n{n}",), (n,))
        self.other.update((n * 2,))
        yield Row(key=key[0], count=n, items=len(list(self.items.get())), entries=len(list(self.entries.keys())))

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- live rows

LIVE_ROWS_OUTPUT = "key string, rows long"


class LiveRowsProcessor(StatefulProcessor):
    """Writes and removes value, list and map state (the map and list with a TTL no batch
    reaches) by each row's ``v`` mod 10, and registers timers that never fire: Spark's
    ``numRowsTotal`` after each batch counts a value per key, a non-empty list per key, a map
    entry each, and no timer; ``numRowsUpdated`` and ``numRowsRemoved`` count calls, elements
    and entries."""

    def init(self, handle) -> None:
        self.handle = handle
        self.value = handle.getValueState("value", "n long")
        self.items = handle.getListState("items", "n long", 3_600_000)
        self.entries = handle.getMapState("entries", "slot int", "n long", 3_600_000)

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        for r in sorted(rows, key=lambda r: r.v):
            op = r.v % 10
            if op <= 4:
                self.value.update((r.v,))
                self.items.appendValue((r.v,))
                self.entries.updateValue((r.v % 3,), (r.v,))
                self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 86_400_000 + op)
            elif op == 5:
                self.value.clear()
            elif op == 6:
                self.items.clear()
            elif op == 7:
                self.entries.removeKey((r.v % 3,))
            elif op == 8:
                self.entries.clear()
            else:
                self.items.put([(r.v,), (r.v + 1,)])
                self.items.appendList([(r.v + 2,)])
        yield Row(key=key[0], rows=len(list(self.entries.keys())))
