"""The memtable: writes since the last checkpoint, as columnar entry batches per
(state variable, key group), each entry stamped with a monotonically increasing ``ord``.

Batched writes land here directly; per-key writes collect in the state handles' overlays
and are sealed into the memtable (``StateStore._seal``) before any batched operation and
at flush. Entries get their checkpoint id at flush. Not thread safe: one task thread.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import polars as pl

from statestore.resolve import ORD

# Entries still in the memtable order after every committed checkpoint: their ord uses
# this checkpoint id until flush stamps the real one.
MEMTABLE_CHECKPOINT_ID = (1 << 31) - 1
SEQ_MAX = (1 << 32) - 1
SEQ_RESET_AT = 1 << 31
KG = "_kg"


class Memtable:
    def __init__(self) -> None:
        self._parts: dict[str, dict[int, list[pl.DataFrame]]] = defaultdict(lambda: defaultdict(list))
        self._seq = 0

    def next_ords(self, n: int) -> np.ndarray:
        if self._seq + n > SEQ_MAX:
            raise OverflowError("more than 2^32 entries in one checkpoint: checkpoint more often")
        start = self._seq
        self._seq += n
        return np.arange(start, start + n, dtype=np.int64) + (MEMTABLE_CHECKPOINT_ID << 32)

    def add(self, name: str, key_groups: np.ndarray, entries: pl.DataFrame) -> list[int]:
        """Append entries (in their row order, newest last) and return the key groups touched."""
        if entries.height == 0:
            return []
        df = entries.with_columns(pl.Series(ORD, self.next_ords(entries.height)),
                                  pl.Series(KG, key_groups, dtype=pl.Int32))
        touched = []
        # Parts keep their key-group column, so that flush can stamp all parts of a variable
        # in one vectorized pass instead of one small polars call per key group.
        for (kg,), part in df.partition_by(KG, as_dict=True, maintain_order=True).items():
            self._parts[name][int(kg)].append(part)
            touched.append(int(kg))
        return touched

    def parts(self, name: str, key_group: int) -> list[pl.DataFrame]:
        by_kg = self._parts.get(name)
        return by_kg.get(key_group, []) if by_kg else []

    def items(self):
        """(state name, key group, entries) of every part, oldest first within a key group."""
        for name, by_kg in self._parts.items():
            for kg, parts in by_kg.items():
                for part in parts:
                    yield name, kg, part

    def parts_by_state(self) -> dict[str, list[pl.DataFrame]]:
        """Every part of each state variable (each with its ``_kg`` column)."""
        out = {name: [p for parts in by_kg.values() for p in parts] for name, by_kg in self._parts.items()}
        return {name: parts for name, parts in out.items() if parts}

    def is_empty(self) -> bool:
        return not any(by_kg for by_kg in self._parts.values())

    def entry_count(self) -> int:
        return sum(p.height for _, _, p in self.items())

    def watermark(self) -> int:
        """The ord the next entry will get: every entry now in the memtable is below it."""
        return (MEMTABLE_CHECKPOINT_ID << 32) + self._seq

    def drop_before(self, watermark: int) -> dict[tuple[str, int], list[pl.DataFrame]]:
        """Remove the parts whose entries are all below ``watermark`` (a flushed and committed
        prefix) and return them by (state name, key group). Parts never straddle a watermark:
        one ``add`` call makes its parts, and a flush happens between calls."""
        dropped: dict[tuple[str, int], list[pl.DataFrame]] = {}
        for name, by_kg in self._parts.items():
            for kg, parts in list(by_kg.items()):
                n = 0
                while n < len(parts) and parts[n].get_column(ORD)[-1] < watermark:
                    n += 1
                if n:
                    dropped[(name, kg)] = parts[:n]
                    if n == len(parts):
                        del by_kg[kg]
                    else:
                        by_kg[kg] = parts[n:]
        return dropped

    def clear(self) -> bool:
        """Drop every part. The ord sequence continues (entries applied lazily by cached views
        after a checkpoint must stay older than new ones) until it passes half its range;
        returns True when it was reset, and callers must then drop those lazy entries."""
        self._parts.clear()
        return self.maybe_reset_sequence()

    def maybe_reset_sequence(self) -> bool:
        """Restart the ord sequence when the memtable is empty and past half its range."""
        if self.is_empty() and self._seq > SEQ_RESET_AT:
            self._seq = 0
            return True
        return False

    def reset(self) -> None:
        self._parts.clear()
        self._seq = 0
