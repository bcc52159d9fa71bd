"""Asynchronous state access for Spark-API processors (Flink's FLIP-424/425/426, in Python's idiom).

A processor written against Spark's ``StatefulProcessor`` API whose handlers are coroutines
(``async def handleInputRows(self, key, rows, timerValues)``, and optionally
``handleExpiredTimer`` and ``handleInitialState``) gets state handles whose reads are
awaitables::

    n = await self.count.get()
    if await self.items.containsKey(("a",)): ...
    async for event in self.events.get(): ...

Writes keep Spark's names and stay plain calls (``update``, ``appendValue``,
``updateValue``, ``removeKey``, ``clear``): they only change the task's memtable. A handler
may return its output (an iterable of rows, or of DataFrames for the pandas flavour) or yield
it (``async def`` with ``yield``: an asynchronous generator).

``ExecutionController`` runs many keys' handlers at once (FLIP-425): each handler call is a
coroutine stepped by the controller, not by an asyncio event loop; a read of a key whose
state the task has not read in this batch suspends the call, and the keys of every call
suspended at one *tick* are read together in one batched, pruned read of every variable
(``StateStore.prefetch``: partial fills of just those keys, FLIP-426), after which their
calls resume. Guarantees:

- **Per-key order.** A key's calls run strictly one after another, in Spark's order: its
  second call starts only after its first returned. Calls of different keys interleave at
  their awaits.
- **Epochs.** The initial state's calls, then the input rows' calls, then the expired timers'
  calls (each key's in time order, a timer skipped when an earlier handler of its key deleted
  it), each epoch drained before the next starts: what a handler sees of its own key, the
  outputs (in the synchronous runner's order, whatever the interleaving) and the committed
  state equal the synchronous runner's for the same processor.
- **Bounds** (``AsyncOptions``): keys in flight, keys waiting before a read is sent, and how
  long running handlers may delay a partial read.
- **Draining.** A run returns only when every call of every epoch has finished, so a
  checkpoint taken after it never sees a request in flight.
- **Failure.** An exception in one call closes every other call and fails the batch,
  naming the handler and the key; the batch's value-state writes are not applied (the
  synchronous runner's contract: the task's store is dropped).

A handler may await the state handles' reads, coroutines that await them, and
``asyncio.sleep(0)`` (a yield to other keys); awaiting anything else (an asyncio future, a
network call) is refused with an error that says so: the controller is not an event loop.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, StatefulProcessor, TimerValues

from spark_integration.compat import (
    ArrowBatching,
    StoreHandle,
    ValueState,
    _key_order,
    _note,
    _pandas_groups,
    _row_groups,
    _row_maker,
    frames_to_arrow,
)
from spark_integration.timers import TimerService
from statestore.descriptors import StateKind
from statestore.store import StateStore


@dataclass(frozen=True)
class AsyncOptions:
    """Bounds of the execution controller (as Flink's ``execution.async-state`` options).

    max_in_flight_keys: keys whose calls may be started and not finished at once (Flink's
        ``in-flight-records-limit``); further keys wait before their first call starts.
    max_pending_keys: keys waiting for a read before the read is sent (Flink's
        ``buffer-size``): the size of one batched read.
    max_wait_ms: how long running other keys' handlers may delay a read that waits with fewer
        keys (Flink's ``buffer-timeout``). A read is also sent as soon as no call can run.
    max_reads_in_flight: batched reads sent and not yet applied, each on an I/O thread of its
        own while the task thread runs the calls that do not wait.
    """

    max_in_flight_keys: int = 4096
    max_pending_keys: int = 4096
    max_wait_ms: float = 50.0
    max_reads_in_flight: int = 4

    def __post_init__(self) -> None:
        for name in ("max_in_flight_keys", "max_pending_keys", "max_reads_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AsyncOptions.{name} must be an int of at least 1, got {value!r}")
        if not isinstance(self.max_wait_ms, (int, float)) or self.max_wait_ms < 0:
            raise ValueError(f"AsyncOptions.max_wait_ms must be a number of milliseconds >= 0, "
                             f"got {self.max_wait_ms!r}")


class _Load:
    """What an awaited read hands the controller when the current key's state is not read yet."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<state read>"


_LOAD = _Load()


@dataclass
class ControllerStats:
    """What one controller did: calls run, batched reads and the keys they read, the most keys
    in flight at once, the suspensions of calls waiting for a read, the time the task thread
    waited for reads."""

    calls: int = 0
    ticks: int = 0            # batched reads planned (of keys waiting together)
    reads: int = 0            # of them, those that read segments (on an I/O thread)
    keys_read: int = 0
    max_in_flight: int = 0
    suspensions: int = 0
    blocked_seconds: float = 0.0  # the task thread waiting for reads, no call able to run

    def add(self, other: ControllerStats) -> None:
        self.calls += other.calls
        self.ticks += other.ticks
        self.reads += other.reads
        self.keys_read += other.keys_read
        self.max_in_flight = max(self.max_in_flight, other.max_in_flight)
        self.suspensions += other.suspensions
        self.blocked_seconds += other.blocked_seconds


class _Call:
    """One handler call of one key: its coroutine (made when it starts) and its output."""

    __slots__ = ("coro", "index", "key", "kg", "make", "out")

    def __init__(self, index: int, key: tuple, kg: int, make: Callable[[list], Any]):
        self.index, self.key, self.kg, self.make = index, key, kg, make
        self.coro: Any = None
        self.out: list = []


class _Read:
    """A read in flight: its plan (which holds the keys, prepared), its future, the calls and
    the key tuples waiting for it."""

    __slots__ = ("calls", "future", "keys", "plan")

    def __init__(self, plan: Any, future: Future | None, calls: list[_Call], keys: list[tuple]):
        self.plan, self.future, self.calls, self.keys = plan, future, calls, keys


class ExecutionController:
    """Runs handler calls as coroutines, many keys at once, each key's calls in order; reads
    the state of the keys whose calls wait, one batched read per tick, on I/O threads while
    other calls run (see the module)."""

    def __init__(self, store: StateStore, handle: AsyncStoreHandle, options: AsyncOptions | None = None):
        self._store = store
        self._handle = handle
        self.options = options or AsyncOptions()
        self._loaded: set[tuple] = set()   # keys whose state was read in this batch
        self.key: tuple | None = None      # the key of the call being stepped
        self.stats = ControllerStats()
        self._pool: ThreadPoolExecutor | None = None
        self._reads: deque[_Read] = deque()  # reads in flight, oldest first
        self._accumulate = False  # whether a read of this batch was applied
        # Ordering log for tests: (key, "start"/"end", call index), when set to a list.
        self.trace: list | None = None

    def close(self) -> None:
        """Wait for the reads still in flight (after a failure) and stop the I/O threads."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()

    # -------------------------------------------------------------- running one epoch

    def run(self, calls: Iterable[_Call]) -> list[_Call]:
        """Run ``calls`` (in Spark's order) to completion; return them in that order."""
        opts = self.options
        store = self._store
        stats = self.stats
        source = iter(calls)
        done: list[_Call] = []
        ready: deque[_Call] = deque()
        waiting: list[_Call] = []
        wait_keys: dict[tuple, int] = {}
        queued: dict[tuple, deque[_Call]] = {}   # a busy key's calls not started
        busy: dict[tuple, _Call] = {}            # key -> its running call
        started: list[_Call] = []
        reads = self._reads
        first_wait = 0.0
        exhausted = False
        trace = self.trace
        try:
            while True:
                # Admit calls while the in-flight bound allows.
                while not exhausted and len(busy) < opts.max_in_flight_keys:
                    call = next(source, None)
                    if call is None:
                        exhausted = True
                        break
                    done.append(call)
                    if call.key in busy:
                        queued.setdefault(call.key, deque()).append(call)
                        continue
                    busy[call.key] = call
                    ready.append(call)
                if len(busy) > stats.max_in_flight:
                    stats.max_in_flight = len(busy)
                while reads and reads[0].future.done():  # reads that arrived: their calls go on
                    ready.extend(self._apply(reads.popleft()))
                # Send a read when no call can run, when enough keys wait, or when they have
                # waited long enough while other keys ran; at most so many reads at once.
                if waiting and len(reads) < opts.max_reads_in_flight and (
                        not ready or len(wait_keys) >= opts.max_pending_keys
                        or (time.perf_counter() - first_wait) * 1000 >= opts.max_wait_ms):
                    ready.extend(self._send(waiting, wait_keys))
                    waiting = []
                    wait_keys = {}
                    continue
                if not ready:
                    if reads:  # every call waits for a read: wait for the oldest
                        t0 = time.perf_counter()
                        wait([reads[0].future], return_when=FIRST_COMPLETED)
                        stats.blocked_seconds += time.perf_counter() - t0
                        continue
                    return done  # nothing runs, nothing waits, nothing is left to admit
                call = ready.popleft()
                if call.coro is None:
                    call.coro = call.make(call.out)
                    started.append(call)
                    stats.calls += 1
                    if trace is not None:
                        trace.append((call.key, "start", call.index))
                self.key = call.key
                store.select_key(call.key, call.kg)
                try:
                    yielded = call.coro.send(None)
                except StopIteration:
                    if trace is not None:
                        trace.append((call.key, "end", call.index))
                    following = queued.get(call.key)
                    if following:
                        nxt = busy[call.key] = following.popleft()
                        ready.append(nxt)
                        if not following:
                            del queued[call.key]
                    else:
                        del busy[call.key]
                    continue
                if yielded is _LOAD:
                    stats.suspensions += 1
                    if not wait_keys:
                        first_wait = time.perf_counter()
                    waiting.append(call)
                    wait_keys[call.key] = call.kg
                elif yielded is None:  # asyncio.sleep(0): let the other keys run first
                    ready.append(call)
                else:
                    raise TypeError(f"a handler for key {call.key!r} awaited {type(yielded).__name__} {yielded!r}, "
                                    f"which is not a state read: {_NOT_A_LOOP}")
        except BaseException:
            for call in started:
                if call.coro is not None:
                    call.coro.close()
            self.close()
            raise

    def _send(self, calls: list[_Call], wait_keys: dict[tuple, int]) -> list[_Call]:
        """One tick: plan the read of the waiting keys' state (every variable's, only those
        keys: partial fills) and send it to an I/O thread; when nothing needs reading, apply it
        at once and return the calls that go on."""
        store = self._store
        schema = store.layout.key_schema
        keys = list(wait_keys)
        table = pa.table([pa.array([k[i] for k in keys], f.type) for i, f in enumerate(schema)], schema=schema)
        kgs = np.fromiter(wait_keys.values(), dtype=np.int64, count=len(keys))
        table, kgs = store.prepare_keys(table, kgs)
        reader = store.reader
        plan = reader.plan_prefetch(table, kgs)
        self.stats.ticks += 1
        self.stats.keys_read += len(keys)
        if not plan.reads:
            return self._apply(_Read(plan, None, calls, keys))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.options.max_reads_in_flight,
                                            thread_name_prefix="icestate-async-read")
        self.stats.reads += 1
        self._reads.append(_Read(plan, self._pool.submit(reader.read_planned, plan), calls, keys))
        return []

    def _apply(self, read: _Read) -> list[_Call]:
        """Cache what ``read`` read (its error, if it failed, fails the batch), then read the
        batched value states of its keys; its calls go on."""
        if read.future is not None:
            read.future.result()
        store = self._store
        # The batch's first read replaces the keys a store remembers as prefetched (the previous
        # batch's); the next ones add theirs, so every key read in the batch is served by the
        # indexes of the prefetched keys' rows, not by an index over its whole key group.
        store.reader.apply_prefetch(read.plan, accumulate=self._accumulate)
        self._accumulate = True
        plan = read.plan
        store.prepare_keys(plan.keys, plan.key_groups)  # the value states' lookup finds them prepared
        self._handle.load(plan.keys)
        self._loaded.update(read.keys)
        return read.calls


# ------------------------------------------------------------------ awaitable reads


class _Await:
    """An awaited read of the current key's state: suspends the call until the controller has
    read the key's state (unless it already has, or ``ready`` says the answer is at hand),
    then answers from the store's per-key API."""

    __slots__ = ("_args", "_ctl", "_fn", "_ready")

    def __init__(self, ctl: ExecutionController, fn: Callable, args: tuple = (),
                 ready: Callable[[], bool] | None = None):
        self._ctl, self._fn, self._args, self._ready = ctl, fn, args, ready

    def __await__(self):
        ctl = self._ctl
        if ctl.key not in ctl._loaded and (self._ready is None or not self._ready()):
            yield _LOAD
        return self._fn(*self._args)


class _IterRead(_Await):
    """An awaited read whose answer is an iterator: ``async for x in state.get()``, or
    ``await state.get()`` for the iterator itself (as Spark's ``get`` returns)."""

    __slots__ = ()

    def __aiter__(self) -> AsyncIterator:
        return self._each()

    async def _each(self) -> AsyncIterator:
        for item in await self:
            yield item


class AsyncValueState:
    """Spark's ``ValueState`` with awaitable reads: ``await get()``, ``await exists()``."""

    __slots__ = ("_ctl", "_held", "_sync")

    def __init__(self, sync: ValueState, ctl: ExecutionController):
        self._sync, self._ctl = sync, ctl
        batch = sync._batch
        # A key whose value the batch already holds (written, or read before) needs no read.
        self._held = None if batch is None else (lambda: ctl.key in batch.values)

    def get(self) -> _Await:
        return _Await(self._ctl, self._sync.get, (), self._held)

    def exists(self) -> _Await:
        return _Await(self._ctl, self._sync.exists, (), self._held)

    def update(self, newValue: tuple) -> None:
        self._sync.update(newValue)

    def clear(self) -> None:
        self._sync.clear()


class AsyncListState:
    """Spark's ``ListState`` with awaitable reads: ``async for v in get()``, ``await exists()``."""

    __slots__ = ("_ctl", "_sync")

    def __init__(self, sync: Any, ctl: ExecutionController):
        self._sync, self._ctl = sync, ctl

    def get(self) -> _IterRead:
        return _IterRead(self._ctl, self._sync.get)

    def exists(self) -> _Await:
        return _Await(self._ctl, self._sync.exists)

    def put(self, newState: list[tuple]) -> None:
        self._sync.put(newState)

    def appendValue(self, newState: tuple) -> None:
        self._sync.appendValue(newState)

    def appendList(self, newState: list[tuple]) -> None:
        self._sync.appendList(newState)

    def clear(self) -> None:
        self._sync.clear()


class AsyncMapState:
    """Spark's ``MapState`` with awaitable reads (``getValue``, ``containsKey``, ``exists``)
    and asynchronous iteration (``iterator``, ``keys``, ``values``)."""

    __slots__ = ("_ctl", "_sync")

    def __init__(self, sync: Any, ctl: ExecutionController):
        self._sync, self._ctl = sync, ctl

    def exists(self) -> _Await:
        return _Await(self._ctl, self._sync.exists)

    def getValue(self, key: tuple) -> _Await:
        return _Await(self._ctl, self._sync.getValue, (key,))

    def containsKey(self, key: tuple) -> _Await:
        return _Await(self._ctl, self._sync.containsKey, (key,))

    def iterator(self) -> _IterRead:
        return _IterRead(self._ctl, self._sync.iterator)

    def keys(self) -> _IterRead:
        return _IterRead(self._ctl, self._sync.keys)

    def values(self) -> _IterRead:
        return _IterRead(self._ctl, self._sync.values)

    def updateValue(self, key: tuple, value: tuple) -> None:
        self._sync.updateValue(key, value)

    def removeKey(self, key: tuple) -> None:
        self._sync.removeKey(key)

    def clear(self) -> None:
        self._sync.clear()


class AsyncStoreHandle(StoreHandle):
    """Spark's ``StatefulProcessorHandle`` for an async processor: the state handles it
    returns have awaitable reads; timers and ``deleteIfExists`` are as Spark's (plain calls)."""

    def __init__(self, store: StateStore, timers: TimerService | None):
        super().__init__(store, timers, batched=True)
        self.controller: ExecutionController | None = None

    def getValueState(self, stateName: str, schema: Any = None, ttlDurationMs: int | None = None) -> AsyncValueState:
        return AsyncValueState(self._get(stateName, StateKind.VALUE), self._ctl())

    def getListState(self, stateName: str, schema: Any = None, ttlDurationMs: int | None = None) -> AsyncListState:
        return AsyncListState(self._get(stateName, StateKind.LIST), self._ctl())

    def getMapState(self, stateName: str, userKeySchema: Any = None, valueSchema: Any = None,
                    ttlDurationMs: int | None = None) -> AsyncMapState:
        return AsyncMapState(self._get(stateName, StateKind.MAP), self._ctl())

    def _ctl(self) -> ExecutionController:
        assert self.controller is not None, "the runner makes the controller before init()"
        return self.controller


# ------------------------------------------------------------------ the runner


def is_async_processor(processor: StatefulProcessor) -> bool:
    """Whether ``processor.handleInputRows`` is a coroutine or asynchronous generator function."""
    fn = getattr(processor, "handleInputRows", None)
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


def check_async_processor(processor: StatefulProcessor) -> None:
    """Refuse, at a query's start, a processor given as async whose handlers are not."""
    if not is_async_processor(processor):
        raise TypeError(f"api='async' needs a processor whose handleInputRows is 'async def'; "
                        f"{type(processor).__name__}.handleInputRows is not (run it with api='row' or "
                        "'pandas', or make its handlers coroutines)")


async def _collect(result: Any, out: list) -> None:
    """Gather a handler's output into ``out``: what an asynchronous generator yields, what a
    coroutine returns (an iterable, or None), or what a plain handler returns."""
    if inspect.isasyncgen(result):
        async for item in result:
            out.append(item)
        return
    if inspect.isawaitable(result):
        result = await result
    if result is not None:
        out.extend(result)


def run_async_processor(processor: StatefulProcessor, store: StateStore, timers: TimerService | None,
                        rows: pa.Table, key_groups: list[int] | np.ndarray, timer_values: TimerValues,
                        fire_upto_ms: int | None, initial: pa.Table | None = None,
                        options: AsyncOptions | None = None, stats: ControllerStats | None = None,
                        trace: list | None = None) -> list:
    """``compat.run_processor`` for an async processor: each key's rows as ``Row`` objects,
    ``Row``s (or tuples, dicts) out, in the synchronous runner's order."""
    return _drive_async(processor, store, timers, rows, key_groups, timer_values, fire_upto_ms, initial,
                        _row_groups, None, options, stats, trace)


def run_async_pandas_processor(processor: StatefulProcessor, store: StateStore, timers: TimerService | None,
                               rows: pa.Table, key_groups: list[int] | np.ndarray, timer_values: TimerValues,
                               fire_upto_ms: int | None, output_schema: pa.Schema, initial: pa.Table | None = None,
                               timezone: str = "UTC", options: AsyncOptions | None = None,
                               stats: ControllerStats | None = None, trace: list | None = None,
                               batching: ArrowBatching | None = None) -> pa.Table:
    """``compat.run_pandas_processor`` for an async processor: a key's rows as pandas
    DataFrames (as ``batching`` cuts them), DataFrames out."""
    frames = _drive_async(processor, store, timers, rows, key_groups, timer_values, fire_upto_ms, initial,
                          lambda r, k, s, o, b: _pandas_groups(r, k, s, timezone, o, b, batching),
                          lambda t, s: _pandas_groups(t, None, s, timezone, batching=batching), options, stats,
                          trace)
    return frames_to_arrow(frames, output_schema, timezone)


def _drive_async(processor: StatefulProcessor, store: StateStore, timers: TimerService | None, rows: pa.Table,
                 key_groups: list[int] | np.ndarray, timer_values: TimerValues, fire_upto_ms: int | None,
                 initial: pa.Table | None, groups: Callable, initial_groups: Callable | None,
                 options: AsyncOptions | None, stats: ControllerStats | None, trace: list | None) -> list:
    """The three epochs (initial state, input rows, expired timers), each run to completion by
    one controller; outputs in the synchronous runner's order."""
    handle = AsyncStoreHandle(store, timers)
    ctl = handle.controller = ExecutionController(store, handle, options)
    ctl.trace = trace
    processor.init(handle)
    out: list = []
    try:
        names = store.key_names
        if initial is not None and initial.num_rows:
            out += _outputs(ctl.run(_initial_calls(processor, store, initial, timer_values, initial_groups)))
        keys, kgs = rows.select(names), np.asarray(key_groups, dtype=np.int64)
        store.check_routed_keys(keys, kgs)
        if rows.num_rows:
            order, bounds = _key_order(keys)
            calls = [_Call(i, key, kg, _input_call(processor, key, key_rows, timer_values))
                     for i, (key, kg, key_rows) in enumerate(groups(rows, kgs, store, order, bounds))]
            out += _outputs(ctl.run(_by_key_group(calls)))
        if timers is not None and fire_upto_ms is not None:
            expired = timers.expired(fire_upto_ms)
            if expired:
                schema = store.layout.key_schema
                table = pa.table([pa.array([key[i] for _, key in expired], f.type) for i, f in enumerate(schema)],
                                 schema=schema)
                _, tkgs = store.prepare_keys(table)
                calls = [_Call(i, key, int(kg), _timer_call(processor, timers, key, ts, timer_values))
                         for i, ((ts, key), kg) in enumerate(zip(expired, tkgs.tolist(), strict=True))]
                out += _outputs(ctl.run(_by_key_group(calls)))
    finally:
        ctl.close()
        processor.close()
        if stats is not None:
            stats.add(ctl.stats)
    handle.drain()  # a batch that raised writes nothing of its value states
    return out


def _by_key_group(calls: list[_Call]) -> list[_Call]:
    """``calls`` in the order the controller starts them: by key group, each key's in their
    order (a stable sort). The keys waiting together are then of neighbouring key groups, so a
    batch's reads touch each segment row group once (row groups end at key-group boundaries),
    where reads of keys in Spark's order would each read most row groups again: on S3 with a
    small cache, 7.9 -> 3.5 MB of row groups read per batch (``bench_async``)."""
    return sorted(calls, key=lambda c: c.kg)


def _outputs(calls: list[_Call]) -> list:
    """The calls' outputs in the synchronous runner's order (the calls' indexes)."""
    out: list = []
    for call in sorted(calls, key=lambda c: c.index):
        out += call.out
    return out


_NOT_A_LOOP = ("an async processor's handlers run on icestate's execution controller, not on an asyncio event "
               "loop: they may await the state handles' reads (and coroutines that await them) and "
               "asyncio.sleep(0) only; run other asynchronous work outside the processor")


def _failed(error: Exception, processor: StatefulProcessor, method: str, key: tuple) -> None:
    """Say on the user's exception where it was raised; and, when it comes of awaiting
    asyncio's machinery, why."""
    _note(error, processor, method, key)
    if isinstance(error, RuntimeError) and "no running event loop" in str(error):
        error.add_note(_NOT_A_LOOP)


def _input_call(processor: StatefulProcessor, key: tuple, key_rows: Iterator, timer_values: TimerValues,
                ) -> Callable[[list], Any]:
    async def call(out: list) -> None:
        try:
            await _collect(processor.handleInputRows(key, key_rows, timer_values), out)
        except Exception as e:
            _failed(e, processor, "handleInputRows", key)
            raise
    return call


def _timer_call(processor: StatefulProcessor, timers: TimerService, key: tuple, ts: int,
                timer_values: TimerValues) -> Callable[[list], Any]:
    async def call(out: list) -> None:
        # As Spark: a timer deleted by an earlier handler of its key does not fire; each is
        # deleted after its handler ran.
        if ts not in timers.list():
            return
        timers.fired += 1
        try:
            await _collect(processor.handleExpiredTimer(key, timer_values, ExpiredTimerInfo(ts)), out)
        except Exception as e:
            _failed(e, processor, f"handleExpiredTimer (timer {ts})", key)
            raise
        timers.delete(ts)
    return call


def _initial_calls(processor: StatefulProcessor, store: StateStore, initial: pa.Table,
                   timer_values: TimerValues, initial_groups: Callable | None) -> Iterator[_Call]:
    """The initial state's calls: one per row (``Row``s), or one per key's DataFrame (pandas)."""
    schema = store.layout.key_schema
    names = store.key_names
    _, kgs = store.prepare_keys(initial.select(names).cast(schema))
    if initial_groups is None:
        columns = initial.column_names
        key_idx = [columns.index(n) for n in names]
        row = _row_maker(columns)
        for i, (values, kg) in enumerate(zip(zip(*[c.to_pylist() for c in initial.columns], strict=True),
                                             kgs.tolist(), strict=True)):
            key = tuple(values[j] for j in key_idx)
            yield _Call(i, key, kg, _initial_call(processor, key, row(values), timer_values))
        return
    kg_of = dict(zip(zip(*[initial.column(n).to_pylist() for n in names], strict=True), kgs.tolist(), strict=False))
    i = 0
    for key, _, frames in initial_groups(initial, store):
        for frame in frames:
            yield _Call(i, key, kg_of[key], _initial_call(processor, key, frame, timer_values))
            i += 1


def _initial_call(processor: StatefulProcessor, key: tuple, value: Any, timer_values: TimerValues,
                  ) -> Callable[[list], Any]:
    async def call(out: list) -> None:
        try:
            result = processor.handleInitialState(key, value, timer_values)
            if inspect.isawaitable(result):
                await result
        except Exception as e:
            _failed(e, processor, "handleInitialState", key)
            raise
    return call


__all__ = [
    "AsyncListState",
    "AsyncMapState",
    "AsyncOptions",
    "AsyncStoreHandle",
    "AsyncValueState",
    "ControllerStats",
    "ExecutionController",
    "check_async_processor",
    "is_async_processor",
    "run_async_pandas_processor",
    "run_async_processor",
]
