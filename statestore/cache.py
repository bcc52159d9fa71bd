"""The local cache of resolved key-group views.

For each cached key group it holds, per state variable, the *view* (``resolve.py``): the
newest live entry per key over every segment of that key group and the memtable entries
applied so far (``applied``: how many memtable parts of that variable and key group are in
the view; ``pending``: committed entries not yet applied). A *partial* group (``covered``
set) holds the views of the covered keys only, filled key by key as requests read them; a
*whole* group (``covered`` None) holds every key's. The cache is bounded by
``size_bytes_max`` and evicts whole key groups, least recently used first, never those a
running request pinned. Not thread safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import polars as pl

# Approximate memory of one entry of a point-lookup index (a dict slot, a key tuple and
# the boxed value), counted against the cache's bound.
INDEX_ENTRY_BYTES = 160


@dataclass
class CachedKeyGroup:
    views: dict[str, pl.DataFrame] = field(default_factory=dict)
    applied: dict[str, int] = field(default_factory=dict)
    # Entries that were committed by a checkpoint while still unapplied to the view: the
    # memtable forgets them at the checkpoint, the view applies them on its next read.
    pending: dict[str, list[pl.DataFrame]] = field(default_factory=dict)
    # Per-key point lookups of value-like state: {name: (the view indexed, {key: (value, expire)})},
    # built on first use and rebuilt when the view object changes.
    indexes: dict[str, tuple[pl.DataFrame, dict]] = field(default_factory=dict)
    # A partial group: the keys (key columns, unique) whose views are complete; None: every key's.
    covered: pl.DataFrame | None = None
    # How many reads filled a partial group (its next miss may load it whole).
    partial_reads: int = 0
    size_bytes: int = 0
    _covered_set: set | None = field(default=None, repr=False)

    def cover(self, keys: pl.DataFrame) -> None:
        """Add ``keys`` (not yet covered) to a partial group's covered keys."""
        self.covered = keys if self.covered is None or self.covered.height == 0 else pl.concat(
            [self.covered, keys], how="vertical")
        self._covered_set = None

    def covers(self, key: tuple) -> bool:
        """Whether the views hold ``key``'s state complete (always, for a whole group)."""
        if self.covered is None:
            return True
        if self._covered_set is None:
            self._covered_set = set(zip(*[c.to_list() for c in self.covered.get_columns()], strict=True))
        return key in self._covered_set

    def measure(self) -> int:
        self.size_bytes = sum(int(v.estimated_size()) for v in self.views.values()) + sum(
            int(p.estimated_size()) for parts in self.pending.values() for p in parts) + sum(
            len(ix) * INDEX_ENTRY_BYTES for _, ix in self.indexes.values()) + (
            0 if self.covered is None else int(self.covered.estimated_size())) + (
            0 if self._covered_set is None else len(self._covered_set) * INDEX_ENTRY_BYTES)
        return self.size_bytes


class KeyGroupCache:
    def __init__(self, size_bytes_max: int):
        self.size_bytes_max = size_bytes_max
        self._groups: OrderedDict[int, CachedKeyGroup] = OrderedDict()
        self._size_bytes = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, key_group: int) -> bool:
        return key_group in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    def key_groups(self) -> list[int]:
        """The cached key groups, in no particular order."""
        return list(self._groups)

    def get(self, key_group: int) -> CachedKeyGroup | None:
        group = self._groups.get(key_group)
        if group is not None:
            self._groups.move_to_end(key_group)
        return group

    def peek(self, key_group: int) -> CachedKeyGroup | None:
        """The group, without making it the most recently used."""
        return self._groups.get(key_group)

    def put(self, key_group: int, group: CachedKeyGroup) -> None:
        old = self._groups.pop(key_group, None)
        if old is not None:
            self._size_bytes -= old.size_bytes
        self._groups[key_group] = group
        self._size_bytes += group.measure()

    def resized(self, key_group: int) -> None:
        """Re-measure a group whose views were replaced in place."""
        group = self._groups[key_group]
        self._size_bytes -= group.size_bytes
        self._size_bytes += group.measure()

    def trim(self, pinned: Iterable[int] = ()) -> None:
        """Evict least recently used groups until within the bound, sparing ``pinned``."""
        pinned = set(pinned)
        for kg in list(self._groups):
            if self._size_bytes <= self.size_bytes_max:
                return
            if kg in pinned:
                continue
            self._size_bytes -= self._groups.pop(kg).size_bytes
            self.evictions += 1

    def clear(self) -> None:
        self._groups.clear()
        self._size_bytes = 0
