"""The asynchronous processor API without Spark (``spark_integration.async_processor``).

The specification is the synchronous runner: a program of state operations run once by a
processor with plain handlers and once by one with coroutine handlers over the same batches
(timers, TTL, restarts, a rescale) gives the same outputs in the same order and commits the
same state. The controller's own guarantees (each key's calls in order, keys interleaving,
bounds, reads only of the keys that ask, failures) are checked on what it records.
"""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor, TimerValues

from spark_integration.async_processor import (
    AsyncOptions,
    ControllerStats,
    check_async_processor,
    run_async_pandas_processor,
    run_async_processor,
)
from spark_integration.compat import declare, rows_to_arrow, run_processor
from spark_integration.timers import TimerService, timers_descriptor
from statestore import DirectoryStateTable, StateStore
from statestore.descriptors import StateKind
from statestore.resolve import ORD
from tests.spark_integration.si_helpers import (
    ITEM,
    PARITY,
    TOTAL,
    VALUE,
    FakeClock,
    commit_together,
    key_groups,
    layout_of,
    open_store,
    task_of,
)

INPUT = pa.schema([("k", pa.string()), ("seq", pa.int64()), ("op", pa.string()), ("a", pa.int64()),
                   ("b", pa.int64())])
OUT = pa.schema([("k", pa.string()), ("seq", pa.int64()), ("snapshot", pa.string())])
OPS = ("value.update", "value.clear", "value.add", "items.appendValue", "items.put", "items.clear",
       "totals.updateValue", "totals.removeKey", "totals.clear", "totals.inc", "fresh.update",
       "timer.register", "timer.delete", "read", "yield")
TTL_MS = 250


# ---------------------------------------------------------------------------- one program, two processors
#
# Each input row (k, seq, op, a, b) applies one operation, then reports every read. A fired
# timer adds 1000 to the value and appends its time to the items. The operations are written
# once, as coroutines whose reads go through ``r``: ``AsyncProgram`` awaits the async handles'
# reads themselves; ``Program`` (Spark's plain handlers, the synchronous runner's handles)
# wraps each value it read in an awaitable that is already done and runs the coroutine to its
# end in one step.


class Done:
    """An awaitable whose value is at hand: a synchronous read, awaited."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # a generator that never suspends


def at_once(coro):
    """Run a coroutine that never suspends; its value."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("a synchronous program suspended")


def same(x):
    return x


class Program(StatefulProcessor):
    def init(self, handle) -> None:
        self.handle = handle
        self.value = handle.getValueState("value", VALUE)
        self.fresh = handle.getValueState("fresh", VALUE, TTL_MS)
        self.items = handle.getListState("items", ITEM)
        self.totals = handle.getMapState("totals", PARITY, TOTAL)

    def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            yield at_once(self.apply(Done, key, row, timerValues))

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        yield at_once(self.fire(Done, key, expiredTimerInfo.getExpiryTimeInMs()))

    async def apply(self, r, key, row, timerValues) -> Row:
        op, a, b = row.op, row.a, row.b
        if op == "value.update":
            self.value.update((a,))
        elif op == "value.clear":
            self.value.clear()
        elif op == "value.add":
            self.value.update(((await r(self.value.get()) or (0,))[0] + a,))
        elif op == "items.appendValue":
            self.items.appendValue((a,))
        elif op == "items.put":
            self.items.put([(b,), (a,)])
        elif op == "items.clear":
            self.items.clear()
        elif op == "totals.updateValue":
            self.totals.updateValue((a % 3,), (b,))
        elif op == "totals.removeKey":
            self.totals.removeKey((a % 3,))
        elif op == "totals.clear":
            self.totals.clear()
        elif op == "totals.inc":
            self.totals.updateValue((a % 3,), ((await r(self.totals.getValue((a % 3,))) or (0,))[0] + b,))
        elif op == "fresh.update":
            self.fresh.update((b,))
        elif op == "timer.register":
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 10 * (a % 30))
        elif op == "timer.delete":
            for ts in list(self.handle.listTimers())[:1]:
                self.handle.deleteTimer(ts)
        return Row(k=key[0], seq=row.seq, snapshot=json.dumps(await self.snapshot(r, a)))

    async def fire(self, r, key, ts: int) -> Row:
        self.value.update(((await r(self.value.get()) or (0,))[0] + 1000,))
        self.items.appendValue((ts,))
        return Row(k=key[0], seq=-ts, snapshot=json.dumps(await self.snapshot(r, 0)))

    async def snapshot(self, r, a: int) -> dict:
        return {
            "value": await r(self.value.get()), "value.exists": await r(self.value.exists()),
            "fresh": await r(self.fresh.get()),
            "items": list(await r(self.items.get())), "items.exists": await r(self.items.exists()),
            "totals": sorted(await r(self.totals.iterator())), "totals.keys": sorted(await r(self.totals.keys())),
            "totals.values": sorted(await r(self.totals.values())), "totals.exists": await r(self.totals.exists()),
            "totals.contains": await r(self.totals.containsKey((a % 3,))),
            "totals.get": await r(self.totals.getValue((a % 3,))),
            "timers": list(self.handle.listTimers()),
        }

    def close(self) -> None:
        pass


class AsyncProgram(Program):
    async def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            if row.op == "yield":
                await asyncio.sleep(0)
            yield await self.apply(same, key, row, timerValues)

    async def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        return [await self.fire(same, key, expiredTimerInfo.getExpiryTimeInMs())]


def program_layout():
    return layout_of([*declare(Program()).descriptors, timers_descriptor()])


class Job:
    """One state table run by ``parallelism`` task stores, as a query's tasks run it."""

    def __init__(self, path: Path, clock: FakeClock, asynchronous: bool, options: AsyncOptions | None = None,
                 **config):
        self.path, self.clock, self.asynchronous, self.options = path, clock, asynchronous, options
        self.config = config
        self.layout = program_layout()
        self.stores: list = []
        self.timers: list = []
        self.stats = ControllerStats()

    def open(self, parallelism: int) -> None:
        for s in self.stores:
            s.close()
        table = DirectoryStateTable(self.path, self.layout)
        self.table = table
        self.stores = [open_store(self.path, self.layout, clock=self.clock, task_index=i, parallelism=parallelism,
                                  table=table, **self.config) for i in range(parallelism)]
        self.timers = [TimerService(s) for s in self.stores]

    def batch(self, rows: pa.Table) -> list:
        p = len(self.stores)
        now = self.clock.now_ms
        out = []
        for task, (store, timers) in enumerate(zip(self.stores, self.timers, strict=True)):
            mine = rows.filter(pa.array([task_of(k, p) == task for k in rows.column("k").to_pylist()],
                                        pa.bool_())) if rows.num_rows else rows
            kgs = key_groups(mine.column("k").to_pylist())
            tv = TimerValues(now, -1)
            if self.asynchronous:
                out += run_async_processor(AsyncProgram(), store, timers, mine, kgs, tv, now, options=self.options,
                                           stats=self.stats)
            else:
                out += run_processor(Program(), store, timers, mine, kgs, tv, now)
        commit_together(self.table, self.stores, p)
        return rows_to_arrow(out, OUT).to_pylist()

    def state(self) -> dict:
        """Every variable's live state, per key: what the table holds (no ``ord``: write order
        across keys is free; each list's elements in their order)."""
        store = open_store(self.path, self.layout, clock=self.clock)
        out = {}
        for desc in self.layout.descriptors:
            live = store.scan(desc.name)
            live = live.sort(["k", ORD]) if ORD in live.columns else live
            cols = [c for c in live.columns if c != ORD]
            rows = live.select(cols).rows()
            out[desc.name] = rows if desc.kind is StateKind.LIST else sorted(rows, key=repr)
        store.close()
        return out


batches_strategy = st.lists(
    st.tuples(
        st.lists(st.tuples(st.integers(0, 5), st.sampled_from(OPS), st.integers(-3, 40), st.integers(0, 99)),
                 max_size=25),
        st.sampled_from([1, 1, 2]),          # parallelism of the batch (a change: restart and rescale)
        st.integers(0, 300),                 # clock advance before the batch (TTL expiry, timers firing)
    ),
    min_size=1, max_size=5)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=batches_strategy,
       options=st.builds(AsyncOptions, max_in_flight_keys=st.integers(1, 8), max_pending_keys=st.integers(1, 8),
                         max_reads_in_flight=st.integers(1, 3),
                         max_wait_ms=st.sampled_from([0.0, 50.0])),
       partial=st.booleans(), small_cache=st.booleans())
def test_an_async_processor_gives_the_outputs_and_state_of_the_same_synchronous_one(tmp_path_factory, batches,
                                                                                     options, partial, small_cache):
    """Also with partial fills of single keys (``view_partial_rows_min=0``, the reads' path on a
    large state) and a cache that holds a few key groups only (reads evict each other's)."""
    base = tmp_path_factory.mktemp("equiv")
    sync_clock, async_clock = FakeClock(), FakeClock()
    config = {**({"view_partial_rows_min": 0} if partial else {}),
              **({"cache_size_bytes_max": 20_000} if small_cache else {})}
    sync = Job(base / "sync", sync_clock, asynchronous=False, **config)
    asyn = Job(base / "async", async_clock, asynchronous=True, options=options, **config)
    parallelism = None
    seq = 0
    for n, (ops, p, advance) in enumerate(batches):
        if p != parallelism:
            sync.open(p)
            asyn.open(p)
            parallelism = p
        sync_clock.now_ms += advance
        async_clock.now_ms += advance
        rows = pa.table({"k": [f"u{k}" for k, *_ in ops], "seq": list(range(seq, seq + len(ops))),
                         "op": [o for _, o, _, _ in ops],
                         "a": [a for *_, a, _ in ops], "b": [b for *_, b in ops]}, schema=INPUT)
        seq += len(ops)
        assert asyn.batch(rows) == sync.batch(rows), f"batch {n}"
    assert asyn.state() == sync.state()


# ---------------------------------------------------------------------------- the controller's guarantees


class Recorder(StatefulProcessor):
    """Reads and updates a count per row, yielding to other keys between rows."""

    def init(self, handle) -> None:
        self.count = handle.getValueState("count", VALUE)
        self.items = handle.getListState("items", ITEM)

    async def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            n = (await self.count.get() or (0,))[0]
            await asyncio.sleep(0)
            self.count.update((n + 1,))
            self.items.appendValue((row.seq,))
            seen = [v async for v in self.items.get()]
            yield (key[0], n + 1, len(seen))

    async def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        return [(key[0], -1, 0)]

    def close(self) -> None:
        pass


class SyncRecorder(Recorder):
    """``Recorder`` with plain handlers."""

    def handleInputRows(self, key, rows, timerValues):
        for row in rows:
            n = (self.count.get() or (0,))[0]
            self.count.update((n + 1,))
            self.items.appendValue((row.seq,))
            yield (key[0], n + 1, len(list(self.items.get())))


def recorder_store(tmp_path, **config):
    layout = layout_of([*declare(Recorder()).descriptors, timers_descriptor()])
    return open_store(tmp_path, layout, **config)


def many_keys(n_keys: int, per_key: int) -> pa.Table:
    ks = [f"k{i % n_keys}" for i in range(n_keys * per_key)]
    return pa.table({"k": ks, "seq": list(range(len(ks)))})


def test_each_keys_calls_run_in_order_while_keys_interleave(tmp_path):
    store = recorder_store(tmp_path)
    timers = TimerService(store)
    rows = many_keys(20, 3)
    store.set_current_key(("k3",))
    timers.register(5)
    timers.register(7)
    store.set_current_key(("k4",))
    timers.register(6)
    trace: list = []
    stats = ControllerStats()
    out = run_async_processor(Recorder(), store, timers, rows, key_groups(rows.column("k").to_pylist()),
                              TimerValues(10, -1), 10, options=AsyncOptions(max_in_flight_keys=6, max_pending_keys=4),
                              stats=stats, trace=trace)
    # Outputs in the synchronous runner's order: keys by first appearance, then timers by time.
    assert [o[0] for o in out[:60]] == [f"k{i}" for i in range(20) for _ in range(3)]
    assert [o[1] for o in out[:60]] == [1, 2, 3] * 20
    assert out[60:] == [("k3", -1, 0), ("k4", -1, 0), ("k3", -1, 0)]
    # Per key: a call starts only after the previous one ended.
    running: dict = {}
    in_flight, most = set(), 0
    for key, what, _ in trace:
        if what == "start":
            assert key not in running, f"{key} started while its previous call ran"
            running[key] = True
            in_flight.add(key)
        else:
            running.pop(key)
            in_flight.discard(key)
        most = max(most, len(in_flight))
    assert most > 1, "keys interleave"
    assert most <= 6 and stats.max_in_flight <= 6
    assert stats.ticks >= 20 / 4 and stats.keys_read == 20 + 0  # timers' keys were read in the input epoch


def test_bounds_of_one_key_in_flight_and_one_key_per_read(tmp_path):
    store = recorder_store(tmp_path)
    rows = many_keys(7, 2)
    stats = ControllerStats()
    trace: list = []
    run_async_processor(Recorder(), store, None, rows, key_groups(rows.column("k").to_pylist()),
                        TimerValues(-1, -1), None, options=AsyncOptions(max_in_flight_keys=1, max_pending_keys=1),
                        stats=stats, trace=trace)
    assert stats.max_in_flight == 1
    assert [w for _, w, _ in trace] == ["start", "end"] * 7
    assert stats.ticks == 7 and stats.keys_read == 7


def test_only_the_keys_whose_handlers_read_are_read(tmp_path):
    class Sparse(StatefulProcessor):
        def init(self, handle) -> None:
            self.count = handle.getValueState("count", VALUE)

        async def handleInputRows(self, key, rows, timerValues):
            rows = list(rows)
            if key[0].endswith("0"):
                self.count.update(((await self.count.get() or (0,))[0] + len(rows),))
            else:
                self.count.update((len(rows),))  # a write needs no read
            return []

        def close(self) -> None:
            pass

    layout = layout_of(declare(Sparse()).descriptors)
    store = open_store(tmp_path, layout)
    rows = many_keys(30, 1)
    for _ in range(2):
        stats = ControllerStats()
        run_async_processor(Sparse(), store, None, rows, key_groups(rows.column("k").to_pylist()),
                            TimerValues(-1, -1), None, stats=stats)
        store.checkpoint()
        assert stats.keys_read == 3 and stats.ticks == 1  # k0, k10, k20: one batched read
    fresh = open_store(tmp_path, layout)
    got = dict(zip(*[c.to_pylist() for c in fresh.scan("count").select(["k", "v_count"]).to_arrow().columns],
                   strict=True))
    assert got["k0"] == {"n": 2} and got["k1"] == {"n": 1}


def test_an_exception_in_one_key_fails_the_batch_names_the_key_and_commits_nothing(tmp_path):
    class Failing(Recorder):
        async def handleInputRows(self, key, rows, timerValues):
            n = (await self.count.get() or (0,))[0]
            if key[0] == "k5" and n == 1:
                raise ValueError("bad event")
            self.count.update((n + 1,))
            return [(key[0], n + 1, 0)]

    store = recorder_store(tmp_path)
    rows = many_keys(10, 1)
    kgs = key_groups(rows.column("k").to_pylist())
    run_async_processor(Failing(), store, None, rows, kgs, TimerValues(-1, -1), None)
    store.checkpoint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every other key's coroutine is closed, none left never awaited
        with pytest.raises(ValueError, match="bad event") as failed:
            run_async_processor(Failing(), store, None, rows, kgs, TimerValues(-1, -1), None,
                                options=AsyncOptions(max_in_flight_keys=4, max_pending_keys=2))
    assert any("Failing.handleInputRows for key ('k5',)" in note for note in failed.value.__notes__)
    store.close()
    fresh = recorder_store(tmp_path)  # the committed state is the first batch's
    counts = fresh.scan("count").get_column("v_count").to_list()
    assert counts == [{"n": 1}] * 10


class Foreign:
    def __await__(self):
        yield "a network call"


def test_awaiting_something_other_than_a_state_read_is_refused_clearly(tmp_path):
    class Sleeper(Recorder):
        async def handleInputRows(self, key, rows, timerValues):
            await asyncio.sleep(0.01)
            return []

    class Caller(Recorder):
        async def handleInputRows(self, key, rows, timerValues):
            await Foreign()
            return []

    store = recorder_store(tmp_path)
    rows = many_keys(2, 1)
    kgs = key_groups(rows.column("k").to_pylist())
    with pytest.raises(RuntimeError, match="no running event loop") as failed:
        run_async_processor(Sleeper(), store, None, rows, kgs, TimerValues(-1, -1), None)
    assert any("run on icestate's execution controller, not on an asyncio event loop" in n
               for n in failed.value.__notes__)
    with pytest.raises(TypeError,
                       match=r"for key \('k[01]',\) awaited str 'a network call', which is not a state read"):
        run_async_processor(Caller(), store, None, rows, kgs, TimerValues(-1, -1), None)


def test_a_processor_without_coroutine_handlers_is_refused_for_the_async_api():
    with pytest.raises(TypeError, match=r"api='async' needs a processor whose handleInputRows is 'async def'"):
        check_async_processor(Program())
    check_async_processor(AsyncProgram())
    check_async_processor(Recorder())


def test_the_pandas_flavour_takes_a_keys_rows_as_a_dataframe_and_yields_dataframes(tmp_path):
    class Frames(Recorder):
        async def handleInputRows(self, key, rows, timerValues):
            total = 0
            async for v in self.items.get():
                total += v[0]
            for frame in rows:
                for s in frame["seq"]:
                    self.items.appendValue((int(s),))
                    total += int(s)
                yield pd.DataFrame({"k": [key[0]], "total": [total], "rows": [len(frame)]})

    store = recorder_store(tmp_path)
    schema = pa.schema([("k", pa.string()), ("total", pa.int64()), ("rows", pa.int64())])
    rows = many_keys(3, 2)
    kgs = key_groups(rows.column("k").to_pylist())
    out = run_async_pandas_processor(Frames(), store, None, rows, kgs, TimerValues(-1, -1), None, schema)
    assert out.to_pylist() == [{"k": "k0", "total": 3, "rows": 2}, {"k": "k1", "total": 5, "rows": 2},
                               {"k": "k2", "total": 7, "rows": 2}]
    out = run_async_pandas_processor(Frames(), store, None, rows, kgs, TimerValues(-1, -1), None, schema)
    assert out.column("total").to_pylist() == [6, 10, 14]


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"AsyncOptions.max_in_flight_keys must be an int of at least 1"):
        AsyncOptions(max_in_flight_keys=0)
    with pytest.raises(ValueError, match=r"AsyncOptions.max_wait_ms must be a number of milliseconds"):
        AsyncOptions(max_wait_ms=-1)


# ---------------------------------------------------------------------------- reads on S3, with delays


def test_reads_on_s3_with_random_delays_keep_each_keys_order_and_the_synchronous_outputs(tmp_path,
                                                                                         s3_server_endpoint):
    """The state on S3 (moto) behind our proxy, no local file cache, partial reads of single
    keys, and a delay per request that changes all the time: the reads run on I/O threads and
    come back in any order, several at once; each key's calls still run in order, keys
    interleave, and the outputs are those of the synchronous runner over the same state."""
    import random
    import threading

    from catalog import TableRef
    from statestore import StoreConfig
    from tests import s3_server
    from tests.net_proxy import NetProxy

    layout = layout_of([*declare(Recorder()).descriptors, timers_descriptor()])
    with NetProxy(s3_server_endpoint) as proxy:
        s3_server.create_bucket(s3_server_endpoint, "async-reads")
        ref = TableRef("t", catalog_name="async_reads", catalog_properties={
            "type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "init_catalog_tables": "true",
            "warehouse": "s3://async-reads/wh", **s3_server.properties(proxy.endpoint)})
        table = ref.open(layout)
        config = StoreConfig(file_cache_mode="off", view_partial_rows_min=0)
        writer = StateStore(table, config=config)
        rows = many_keys(40, 2)
        kgs = key_groups(rows.column("k").to_pylist())
        for _ in range(2):  # two checkpoints of state for every key
            run_processor(SyncRecorder(), writer, None, rows, kgs, TimerValues(-1, -1), None)
            writer.checkpoint()
        writer.close()

        stop = threading.Event()

        def jitter() -> None:  # 0-15 ms per request, changing every 2 ms
            rng = random.Random(3)
            while not stop.is_set():
                proxy.latency_s = rng.random() * 0.015
                time.sleep(0.002)

        flipper = threading.Thread(target=jitter, daemon=True)
        flipper.start()
        try:
            trace: list = []
            stats = ControllerStats()
            store = StateStore(table, config=config)
            got = run_async_processor(Recorder(), store, None, rows, kgs, TimerValues(-1, -1), None,
                                      options=AsyncOptions(max_in_flight_keys=16, max_pending_keys=3,
                                                           max_reads_in_flight=3), stats=stats, trace=trace)
            store.close()
        finally:
            stop.set()
            flipper.join()
        want = run_processor(SyncRecorder(), StateStore(table, config=config), None, rows, kgs,
                             TimerValues(-1, -1), None)
        table.close()
    assert got == want
    assert stats.reads > 5 and stats.keys_read == 40
    running: set = set()
    most = 0
    for key, what, _ in trace:
        if what == "start":
            assert key not in running
            running.add(key)
        else:
            running.discard(key)
        most = max(most, len(running))
    assert most > 3
