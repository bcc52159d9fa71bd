"""Timers as keyed state: registered per key, fired in time order, moved with their key groups.

Timers are a map state of the operator (``TIMERS_STATE``: expiry time in ms -> True) so
they are checkpointed in the same snapshot as the rest of the state, survive restarts and
belong to the key group of their key: after a rescale, the task that owns the key group
fires them. Each task also keeps an in-memory index of its timers (Flink's heap timer
queue), built from the state the first time the task's store needs it and maintained by
``register``/``delete``; firing pops them in (time, key) order.
"""

from __future__ import annotations

import heapq

import pyarrow as pa

from statestore.descriptors import MapStateDescriptor
from statestore.names import TIMERS_STATE
from statestore.store import StateStore

__all__ = ["TIMERS_STATE", "TIME_MODES", "TimerService", "normalize_time_mode", "timers_descriptor"]

TIME_MODES = ("none", "processingtime", "eventtime")


def timers_descriptor() -> MapStateDescriptor:
    return MapStateDescriptor(TIMERS_STATE, key_type=pa.int64(), value_type=pa.bool_())


def normalize_time_mode(time_mode: str) -> str:
    mode = str(time_mode).replace("_", "").lower()
    if mode not in TIME_MODES:
        raise ValueError(f"time_mode {time_mode!r} is not one of 'None', 'ProcessingTime', 'EventTime'")
    return mode


class TimerService:
    """The timers of one task's key groups, over ``store``'s ``TIMERS_STATE`` variable."""

    def __init__(self, store: StateStore):
        self._store = store
        self._state = store.get_state(TIMERS_STATE)
        self._by_key: dict[tuple, set[int]] | None = None
        self._queue: list[tuple[int, tuple]] = []
        self.fired = 0  # timers whose handler ran (counted by the runner of the handlers)

    def _index(self) -> dict[tuple, set[int]]:
        if self._by_key is None:
            store = self._store
            live = store.scan(TIMERS_STATE)  # the timers alone, not the task's whole state
            by_key: dict[tuple, set[int]] = {}
            names = store.key_names
            mk = self._state.descriptor.user_key_column
            cols = [live.get_column(n).to_list() for n in names]
            for *key, ts in zip(*cols, live.get_column(mk).to_list(), strict=True):
                by_key.setdefault(tuple(key), set()).add(int(ts))
            self._by_key = by_key
            self._queue = [(ts, key) for key, tss in by_key.items() for ts in tss]
            heapq.heapify(self._queue)
        return self._by_key

    def register(self, ts: int) -> None:
        """Register a timer at ``ts`` (epoch ms) for the store's current key (idempotent)."""
        if not isinstance(ts, int) or isinstance(ts, bool):
            raise TypeError(f"timer expiry must be an int of epoch milliseconds, got {ts!r}")
        key, _ = self._store.current_key()
        tss = self._index().setdefault(key, set())
        if ts not in tss:
            tss.add(ts)
            heapq.heappush(self._queue, (ts, key))
            self._state.put(ts, True)

    def delete(self, ts: int) -> None:
        """Delete the current key's timer at ``ts``; no-op when there is none."""
        key, _ = self._store.current_key()
        tss = self._index().get(key)
        if tss and ts in tss:
            tss.discard(ts)
            if not tss:
                del self._index()[key]
            self._state.remove(ts)

    def list(self) -> list[int]:
        """The current key's timers, earliest first."""
        key, _ = self._store.current_key()
        return sorted(self._index().get(key, ()))

    def next_expiry(self) -> int | None:
        """The earliest registered timer of the task, or None."""
        self._index()
        queue = self._queue
        while queue and queue[0][0] not in self._by_key.get(queue[0][1], ()):
            heapq.heappop(queue)  # deleted since it was queued
        return queue[0][0] if queue else None

    def count(self) -> int:
        return sum(len(v) for v in self._index().values())

    def expired(self, upto_ms: int) -> list[tuple[int, tuple]]:
        """Every timer with expiry <= ``upto_ms`` as (expiry, key), earliest first; they stay
        registered until deleted (the caller deletes each after its handler)."""
        self._index()
        out = []
        while self._queue and self._queue[0][0] <= upto_ms:
            out.append(heapq.heappop(self._queue))
        live = [(ts, key) for ts, key in out if ts in self._by_key.get(key, ())]
        # Still registered ones go back: a handler may keep its timer; deletes are lazy.
        for item in live:
            heapq.heappush(self._queue, item)
        return sorted(set(live))
