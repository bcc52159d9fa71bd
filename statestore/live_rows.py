"""Live state rows counted as Spark counts them: a store's change per checkpoint, and the ledger.

Spark's state operator reports ``numRowsTotal``: the rows its state store holds after a batch,
with expired TTL rows evicted at the batch's end. For ``transformWithState`` that is one row per
key of a value state, one per key of a non-empty list state (RocksDB keeps a key's list as one
merged value), one per entry of a map state; timers are not counted. Ours are LSM entries
(several versions of a key until compaction), so the count is kept apart:

* a store counts, per checkpoint, how the live rows of the keys it wrote changed
  (``LiveRowCounter``): before a key's first write since the last flush it reads what the key
  holds (the committed state), at the flush what it holds then; both as a histogram by expiry
  time (``None``: rows without TTL), since a row with TTL leaves the count when it expires
  whether or not its key is written again;
* the driver keeps the ledger (``Ledger``): the previous checkpoint's histogram plus every
  task's change, without the rows expired at the batch's time; its total is the live rows.
  The ledger travels as a checkpoint property (``stored_keys.QUERY_LIVE_ROWS``) so that a
  restart, a rescale or a compaction continues it.

Exact, with the histogram's resolution: rows with TTL written by one batch share one expiry (its
processing time plus the TTL), so the ledger holds about one entry per batch in the TTL window
and variable. Past ``LEDGER_EXPIRIES_MAX`` entries in a variable, neighbouring expiries merge
into the later one (rows then count as live up to one merged gap longer than they are).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from statestore.descriptors import StateDescriptor, StateKind
from statestore.layout import EXPIRE_AT_MS, OP, OP_PUT
from statestore.memtable import KG, Memtable
from statestore.resolve import ORD, live_rows

if TYPE_CHECKING:
    from statestore.read_path import StateReader

#: expiry time in epoch ms (None: no TTL) -> live rows
Histogram = dict[int | None, int]

LEDGER_EXPIRIES_MAX = 2048
_N = "__n"


def histogram(desc: StateDescriptor, rows: pl.DataFrame, key_names: list[str]) -> Histogram:
    """The live rows of ``rows`` (view rows of one variable) in Spark's units, by expiry: a
    list counts once per key, at its last element's expiry (the key goes when that does)."""
    if not rows.height:
        return {}
    if desc.kind is StateKind.LIST:
        rows = rows.group_by(key_names).agg(pl.col(EXPIRE_AT_MS).max())
    counted = rows.group_by(EXPIRE_AT_MS).agg(pl.len().alias(_N))
    return dict(zip(counted.get_column(EXPIRE_AT_MS).to_list(), counted.get_column(_N).to_list(), strict=True))


def _newest_puts(parts: list[pl.DataFrame], key_names: list[str], now_ms: int) -> pl.DataFrame:
    """The live values that memtable ``parts`` of a value-like variable leave their keys with."""
    if not parts:
        return pl.DataFrame(schema={EXPIRE_AT_MS: pl.Int64})
    entries = pl.concat([p.select(*key_names, OP, ORD, EXPIRE_AT_MS) for p in parts], how="vertical")
    newest = entries.filter(pl.col(ORD) == pl.col(ORD).max().over(key_names))
    return live_rows(newest.filter(pl.col(OP) == OP_PUT), now_ms)


def _add(into: Histogram, more: Mapping[int | None, int], sign: int = 1) -> None:
    for e, n in more.items():
        total = into.get(e, 0) + sign * n
        if total:
            into[e] = total
        else:
            into.pop(e, None)


class LiveRowCounter:
    """How the live rows of a store's keys change from checkpoint to checkpoint (see the module
    docstring). Driven by the store: ``before_write`` ahead of every memtable addition,
    ``flushed`` / ``completed`` / ``aborted`` / ``reset`` with its lifecycle."""

    def __init__(self, reader: StateReader, descriptors: Iterable[StateDescriptor], key_names: list[str],
                 memtable: Memtable):
        self._reader = reader
        reader.record_lookups = True
        self._memtable = memtable
        # A value-like variable written once since the flush, with distinct keys: its entries
        # are its keys' state (no newest entry to find at the flush); None once written again.
        self._sole: dict[str, pl.DataFrame | None] = {}
        self._descs = {d.name: d for d in descriptors}
        self._keys = list(key_names)
        self._touched: dict[str, list[pl.DataFrame]] = {}  # keys written since the flush, with KG
        self._before: dict[str, Histogram] = {}
        # checkpoint id -> (touched, before) of a flush whose commit is not settled
        self._flushing: dict[int, tuple[dict, dict]] = {}
        self._changes: dict[int, dict[str, Histogram]] = {}
        self.lost = False  # see ``aborted``

    def before_write(self, name: str, key_groups: np.ndarray, entries: pl.DataFrame) -> None:
        """Count what the keys of ``entries`` hold now, for those not written since the flush."""
        desc = self._descs[name]
        key_columns = entries.select(self._keys)
        # Repeated keys are kept (finding them costs more than it saves): the reads join on keys.
        keys = key_columns.with_columns(pl.Series(KG, key_groups, dtype=pl.Int32))
        seen = self._seen_keys(name)
        rows = None
        if seen is None and desc.kind not in (StateKind.LIST, StateKind.MAP):
            # the keys a vectorized processor just looked up, then writes: what it read is their state
            found = self._reader.recorded(name, key_columns)
            if found is not None and not key_columns.is_duplicated().any():
                rows = found
                self._sole[name] = entries.select(OP, EXPIRE_AT_MS)
        if name in self._sole and rows is None:
            self._sole[name] = None
        if seen is not None:
            keys = keys.join(seen, on=self._keys, how="anti")
        if not keys.height:
            return
        if rows is None:
            rows = self._reader.rows_of(name, keys.select(self._keys), keys.get_column(KG).to_numpy())
        _add(self._before.setdefault(name, {}), histogram(desc, rows, self._keys))
        self._touched.setdefault(name, []).append(keys)

    def _seen_keys(self, name: str) -> pl.DataFrame | None:
        """The keys written since the flush (key columns), the parts made one first."""
        parts = self._touched.get(name)
        if not parts:
            return None
        if len(parts) > 1:
            parts[:] = [pl.concat(parts, how="vertical")]
        return parts[0].select(self._keys)

    def flushed(self, checkpoint_id: int) -> dict[str, Histogram] | None:
        """The change of every written variable's live rows since the last flush (the store
        holds the flush's entries still), None when ``lost``; the counting starts again for
        what comes after."""
        if self.lost:
            self._touched, self._before, self._sole = {}, {}, {}
            return None
        changes: dict[str, Histogram] = {}
        for name in list(self._touched):
            desc = self._descs[name]
            if desc.kind in (StateKind.LIST, StateKind.MAP):
                keys = self._seen_keys(name)
                rows = self._reader.rows_of(name, keys, self._touched[name][0].get_column(KG).to_numpy())
            elif (sole := self._sole.get(name)) is not None:  # one write of distinct keys: its entries
                rows = live_rows(sole.filter(pl.col(OP) == OP_PUT), self._reader.now_ms())
            else:  # a value's state is its newest entry: the memtable's, of every key written since the flush
                rows = _newest_puts(self._memtable.parts_by_state().get(name, []), self._keys,
                                    self._reader.now_ms())
            change = histogram(desc, rows, self._keys)
            _add(change, self._before.get(name, {}), -1)
            if change:
                changes[name] = change
        self._flushing[checkpoint_id] = (self._touched, self._before)
        self._touched, self._before, self._sole = {}, {}, {}
        self._changes[checkpoint_id] = changes
        return changes

    def change(self, checkpoint_id: int) -> dict[str, Histogram] | None:
        """What ``flushed(checkpoint_id)`` returned (None when lost or when it did not run)."""
        return self._changes.get(checkpoint_id)

    def completed(self, checkpoint_id: int) -> None:
        self._flushing.pop(checkpoint_id, None)
        self._changes.pop(checkpoint_id, None)

    def aborted(self, checkpoint_id: int) -> None:
        """The flush's entries stay in the store for the next one: so does its counting. Keys
        written after the flush were read with its entries in: the count is then lost (``lost``)
        until a reset (the Spark runner drops such a store; the store's own ``checkpoint``
        writes nothing between its flush and commit)."""
        self._changes.pop(checkpoint_id, None)
        old = self._flushing.pop(checkpoint_id, None)
        if old is None:
            return
        if self._touched:
            self.lost = True
        self._touched, self._before = old
        self._sole = {name: None for name in old[0]}

    def reset(self) -> None:
        self.lost = False
        self._touched, self._before, self._sole = {}, {}, {}
        self._flushing.clear()
        self._changes.clear()


class Ledger:
    """The live rows of every variable of a query's state, by expiry (see the module docstring)."""

    def __init__(self, rows: dict[str, Histogram] | None = None):
        self.rows: dict[str, Histogram] = rows or {}

    @classmethod
    def decode(cls, text: str) -> Ledger:
        """From ``encode``'s form: ``{variable: [rows without TTL, expiry, rows, expiry, rows, ...]}``."""
        data = json.loads(text)
        rows: dict[str, Histogram] = {}
        for name, flat in data.items():
            h: Histogram = {None: int(flat[0])} if flat[0] else {}
            h.update((int(e), int(n)) for e, n in zip(flat[1::2], flat[2::2], strict=True))
            rows[name] = h
        return cls(rows)

    def encode(self) -> str:
        out = {}
        for name in sorted(self.rows):
            h = self.rows[name]
            flat: list[int] = [h.get(None, 0)]
            for e in sorted(k for k in h if k is not None):
                flat += [e, h[e]]
            out[name] = flat
        return json.dumps(out, separators=(",", ":"))

    def add(self, changes: Mapping[str, Mapping[int | None, int]]) -> None:
        for name, change in changes.items():
            _add(self.rows.setdefault(name, {}), change)

    def expire(self, now_ms: int) -> int:
        """Drop the rows expired at ``now_ms`` (expiry at or before it, as the views do); how many."""
        dropped = 0
        for h in self.rows.values():
            for e in [e for e in h if e is not None and e <= now_ms]:
                dropped += h.pop(e)
            expiring = sorted(e for e in h if e is not None)
            while len(expiring) > LEDGER_EXPIRIES_MAX:
                for early, late in zip(expiring[0::2], expiring[1::2], strict=False):
                    h[late] = h.get(late, 0) + h.pop(early)
                expiring = sorted(e for e in h if e is not None)
        return dropped

    def total(self) -> int:
        return sum(sum(h.values()) for h in self.rows.values())

    def of(self, name: str) -> int:
        return sum(self.rows.get(name, {}).values())
