"""``StateReader``: the read path of one task's store.

Every read of a ``StateStore``'s keyed state goes through its reader: the batched reads
(``lookup``, ``live_view``, ``views``, ``scan``) and the per-key ones of the current key
(``point_get``, ``key_rows``, ``key_map``). The state handles (``state.py``) hold the
reader itself and call it directly; the store keeps the lifecycle (writes, flush,
checkpoints, restore) and owns one reader.

Reads go memtable then segments. The reader owns:

* the cache of resolved key-group views (``cache.KeyGroupCache``), each a ``views.KeyedView``
  (large ones indexed by key hash: a batch's keyed reads and refreshes cost its keys, not
  the view). A batched read of keys
  (``lookup``, ``keyed_view``, ``prefetch``) fills the views of just those keys: one read
  of each covering segment, pruned to the row groups whose statistics can hold them, the
  entries of those keys resolved by ``resolve.py`` (a *partial* key group). A read that
  asks for every key (``views``, ``live_view``), a per-key read of a key a partial group
  lacks, a read asking for much of a key group, or a key group read partially often enough
  (``StoreConfig.view_partial_*``) loads the key group whole, for every variable
  and every such key group of a request at once. A cached view is then kept up to date with
  the memtable parts it has not applied (``applied``) and the committed parts moved to it
  (``pending``), of its covered keys only when partial;
* the point indexes of the per-key reads: a dict over the rows of the last prefetch's keys
  (``_batch_point``: a per-key loop over a batch costs the batch), or over a cached view
  for any other key (``_view_index``);
* the segment reader (Parquet footer cache, read counters), reading through the process's
  file cache of whole segments (``file_cache``) when the store's config asks for one.

It reads the store's memtable and table but never changes them. What it must learn of the
lifecycle comes through a small interface, called by the store: ``memtable_changed`` (a
write or a seal), ``flushed`` / ``aborted`` / ``committed`` (a flush and how it settled),
``reset`` (a restore, a close, a restart of the memtable's ord sequence).

Invariants (design invariant 7): a cached view holds every entry of its key group and
variable (of its covered keys, when partial) exactly once: the segments of the opened
checkpoint, minus those of a flush not settled yet (the memtable still holds their entries),
plus the first ``applied`` memtable parts; ``pending`` parts are committed entries it has yet
to apply. A partial view never serves a key it does not cover. A point index in
``_point_index`` is current: every event that can change a view forgets them all
(``_forget_indexes``, ``_forget_view_indexes``). One in ``_batch_index`` holds copies of the
prefetched keys' rows: it is current until their state can change (the memtable, a commit, new
segments, a reset: ``_forget_indexes``), whatever the cache does meanwhile, and is built only
from views that still cover every prefetched key (an eviction since the prefetch drops them).

Thread safety: used by the store's task thread only, like the store; but the read of a
prefetch planned there (``plan_prefetch``) may run on other threads (``read_planned``, with
segment readers of their own) while the task thread goes on, and is applied on the task thread
(``apply_prefetch``).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from statestore.cache import CachedKeyGroup, KeyGroupCache
from statestore.config import StoreConfig
from statestore.descriptors import StateDescriptor, StateKind
from statestore.entries import read_entries, variable_entry_schema
from statestore.file_cache import FileCache, FileCacheCounters, file_cache_for
from statestore.host_views import HostViews, Snapshot, SnapshotDamaged, host_views_for, slot_name
from statestore.keygroups import KeyGroupRange
from statestore.layout import CHECKPOINT_ID, EXPIRE_AT_MS, KEY_GROUP, OP, OP_DELETE, STATE
from statestore.memtable import KG, Memtable
from statestore.resolve import ORD, empty_view, entry_columns, live_rows, merge, resolve
from statestore.segment import SegmentReader
from statestore.table import SegmentFile, StateTable
from statestore.views import MERGE_RATIO, KeyedView, distinct_sorted, key_hashes, replace_rows

log = logging.getLogger(__name__)

_NO_ENTRIES: dict = {}
# Views take new entries in place (``_refresh_replacing``) when they hold more than this many
# rows per new entry; else one resolution of views and entries together costs less (a few
# polars calls per key group against a few in all). Measured with 50k new entries over 128 key
# groups: views of 200k rows 196 (in place) against 162 ms a batch, 500k about even, 1M 237
# against 291 ms, 2M 258 against 516 ms.
_REPLACE_RATIO = 10
# The same for views of ``StoreConfig.view_index_rows_min`` rows a key group and more (indexed,
# or indexed at this change): in place down to 2 view rows per new entry. Measured with one
# task's 5M-key share after a batch of new keys (`docs/decisions.md`, "Large views take a
# large batch in place"): 1.25M new entries against 3.75M view rows, the next two batches 0.95 s in place
# against 1.75-2.1 s resolved; 1.65M against 3.35M, 1.4 against 2.2 s; 2.5M against 2.5M, 2.3
# against 1.7 s.
_REPLACE_RATIO_INDEXED = 2
# A keyed read first restricts the views to its keys when they hold more than this many rows
# per key (partial views hold about the keys read: the restriction would only add a join).
_RESTRICT_RATIO = 4
# A lookup's row numbers (the keys' order), while it joins.
_ROW = "__row"
# A lookup whose keys come without key groups joins every cached view when it has at least
# this many keys per cached key group (uniform keys then touch all but e^-4, 2 %, of them, so
# the views of its own key groups would be about as many rows), and hashes only the keys it
# misses; with fewer keys it hashes them all and joins the views of their key groups only.
_KEYS_PER_GROUP_UNHASHED = 4


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    """The sum of several readers' counters, name by name."""
    out = dict(counts[0])
    for more in counts[1:]:
        for name, n in more.items():
            out[name] += n
    return out


def _distinct(key_groups: np.ndarray) -> list[int]:
    """The distinct key groups of ``key_groups`` in order: a count per key group (key groups
    are small non-negative ints), 5x cheaper than ``np.unique``'s sort on 500k keys."""
    return np.flatnonzero(np.bincount(np.asarray(key_groups))).tolist()


def _tuples(frame: pl.DataFrame, columns: Sequence[str]) -> Iterator[tuple]:
    """``frame``'s rows as tuples of ``columns``, in order."""
    return zip(*[frame.get_column(c).to_list() for c in columns], strict=True)


def _index_one(keys: Iterable[tuple], rows: Iterable[tuple], view: pl.DataFrame) -> dict:
    return dict(zip(keys, rows, strict=True))


def _index_rows(keys: Iterable[tuple], rows: Iterable[tuple], view: pl.DataFrame) -> dict:
    by_key: dict[tuple, list[tuple]] = {}
    for k, row in zip(keys, rows, strict=True):
        found = by_key.get(k)
        if found is None:
            by_key[k] = [row]
        else:
            found.append(row)
    return by_key


def _index_map(keys: Iterable[tuple], rows: Iterable[tuple], hashed: Iterable[Any]) -> dict:
    """{key: {hashed user key: row}}; ``hashed``: each row's user key made hashable."""
    by_key: dict[tuple, dict] = {}
    for k, row, h in zip(keys, rows, hashed, strict=True):
        m = by_key.get(k)
        if m is None:
            m = by_key[k] = {}
        m[h] = row
    return by_key


_NOT_PREFETCHED = object()
# The host's shared views of a reader's key groups are written at its first commit (or load),
# then again once they are ``StoreConfig.host_views_lag`` checkpoints behind the reader's, or
# once this share of the views' bytes is the process's own (new runs, merges: one copy on the
# host again).
HOST_VIEWS_PRIVATE_SHARE_MAX = 0.25
_AFTER = "__after"  # a key group's newest checkpoint already in its views, while catching up


@dataclass
class _Prefetched:
    """The keys of a reader's last prefetch (key columns), each key's key group, their
    distinct key groups, the cache's eviction count then, and the keys as a set of tuples
    (made at the first per-key read)."""

    keys: pl.DataFrame
    key_groups: np.ndarray
    kgs: list[int]
    evictions: int
    key_set: set | None = None


@dataclass
class CoverPlan:
    """A read that makes cached views hold some keys' state, in three steps: planned on the
    task's thread (``StateReader.plan_prefetch``), read on any thread (``read_planned``: the
    segments' entries, the only I/O), applied on the task's thread (``apply_prefetch``:
    resolved and cached), so a caller may run other work while it is read.

    ``whole``: key groups to load whole; ``partial``: key groups to fill with the ``new`` keys
    (key columns and ``KG``) they lack; the segments to read for each; ``installs``: the
    reader's count of cache changes when planned (an apply after other changes checks again
    what is still missing). ``keys``/``key_groups``/``kgs``: the prefetch's keys."""

    keys: pa.Table
    key_groups: np.ndarray
    kgs: list[int]
    installs: int
    whole: list[int]
    partial: list[int]
    new: pl.DataFrame | None
    whole_segments: list[SegmentFile]
    partial_segments: list[SegmentFile]
    whole_entries: pl.DataFrame | None = None
    partial_entries: pl.DataFrame | None = None

    @property
    def reads(self) -> bool:
        """Whether anything is to be read."""
        return bool(self.whole or self.partial)


class StateReader:
    """The reads of one task's store over ``table``'s opened checkpoint and ``memtable``.

    ``seal`` moves the handles' per-key writes into the memtable: batched reads call it
    first, so they see those writes too.
    """

    def __init__(self, table: StateTable, memtable: Memtable, key_group_range: KeyGroupRange,
                 config: StoreConfig, seal: Callable[[], None], key_groups_of: Callable[[pa.Table], np.ndarray]):
        self._table = table
        self._key_groups_of = key_groups_of  # normalized keys -> their key groups, owned or refused
        self.keys_per_group_unhashed = _KEYS_PER_GROUP_UNHASHED  # (0: lookups never hash first)
        # Cost thresholds (tests set 0: views always restricted to a read's keys, new entries
        # always applied in place): see ``_RESTRICT_RATIO`` and ``_REPLACE_RATIO(_INDEXED)``.
        self.restrict_ratio = _RESTRICT_RATIO
        self.replace_ratio = _REPLACE_RATIO
        self.replace_ratio_indexed = _REPLACE_RATIO_INDEXED
        self.merge_ratio = MERGE_RATIO  # of the indexed views' runs (``views.MERGE_RATIO``)
        self.layout = table.layout
        self.key_names = self.layout.key_names
        self.key_group_range = key_group_range
        self._config = config
        self._memtable = memtable
        self._seal = seal
        self._cache = KeyGroupCache(config.cache_size_bytes_max)
        self._segments = SegmentReader(table.filesystem, config.footer_cache_entries_max,
                                       file_cache_for(config, table.filesystem))
        # Segment readers of reads planned here and read on other threads (``read_planned``),
        # one per concurrent read; their counters join this reader's in ``stats``.
        self._io_readers: list[SegmentReader] = []
        self._io_idle: list[SegmentReader] = []
        self._io_lock = threading.Lock()
        self._installs = 0  # changes of the cached key groups (see ``CoverPlan.installs``)
        self._entry_schema = self.layout.entry_schema
        self._entry_schemas = self._polars_entry_schemas()
        # An empty view per variable, made once (one per empty key group and per reader was a
        # tenth of the model tests' CPU); its schema is the variable's view schema.
        self._empty_views = {d.name: empty_view(d, self.key_names, self._entry_schemas[d.name])
                             for d in self.layout.descriptors}
        self._indexable = all(
            pa.types.is_string(f.type) or pa.types.is_binary(f.type) or pa.types.is_integer(f.type)
            or pa.types.is_boolean(f.type) or pa.types.is_date32(f.type) for f in self.layout.key_schema)
        self._point_index: dict[tuple[str, str, int], dict] = {}  # see _view_index
        # The last prefetch's keys, and point indexes over their rows only (see _batch_point).
        self._prefetched: _Prefetched | None = None
        self._batch_index: dict[tuple[str, str], dict] = {}
        self._batch_builds: dict[tuple[str, str], tuple[Sequence[str], Callable]] = {}  # how each was built
        # What a per-key read of value-like state takes of a view row (point_get), per variable.
        self._point_columns = {d.name: (d.value_column, EXPIRE_AT_MS) for d in self.layout.descriptors}
        # What a per-key read of map state takes of a view row and builds its index with (key_map).
        self._map_reads: dict[str, tuple[Callable, tuple[str, str, str], Callable]] = {}
        # Partial views need keys that compare in Python as polars returns them (point reads).
        self._partial_reads_max = config.view_partial_reads_max if self._indexable else 0
        # Views this large are kept indexed by key hash (``views.KeyedView``).
        self._index_rows_min = config.view_index_rows_min
        self._host_views_lag = config.host_views_lag  # see StoreConfig.host_views_lag
        self.partial_reads = 0
        # Checkpoints flushed but not settled: their entries are still in the memtable.
        self._unsettled: set[int] = set()
        # ``lookup`` keeps what it found of a value-like variable's keys while nothing changed
        # since (``recorded``): the live row count then needs no second read of keys just read.
        self.record_lookups = False
        self._last_lookup: tuple[str, pl.DataFrame, pl.DataFrame] | None = None
        # The host's shared views (``host_views``), when the config shares them.
        self._host: HostViews | None = host_views_for(config)
        self._slot = slot_name(self.layout, table.filesystem.type_name) if self._host is not None else ""
        self.host_views_mapped = 0  # key groups mapped from the host's views
        self.host_views_published = 0  # key groups written to them
        # Per cached key group whose views the host has (written or mapped here): how many
        # checkpoints those are behind this reader's.
        self._host_lag: dict[int, int] = {}

    # ---------------------------------------------------------------- lifecycle events

    def memtable_changed(self) -> None:
        """Entries were added to the memtable: the point indexes may be stale."""
        self._forget_indexes()

    def flushed(self, checkpoint_id: int) -> None:
        """``checkpoint_id``'s segments were written from the memtable, which keeps their
        entries until the commit settles: loads skip those segments, or would apply them twice
        (list appends would repeat)."""
        self._unsettled.add(checkpoint_id)

    def aborted(self, checkpoint_id: int) -> None:
        """The commit of ``checkpoint_id`` failed: its segments are garbage, never read."""
        self._unsettled.discard(checkpoint_id)

    def committed(self, checkpoint_id: int, dropped: dict[tuple[str, int], list[pl.DataFrame]]) -> None:
        """``checkpoint_id`` committed and the memtable dropped its parts (``dropped``: the
        parts of each (variable, key group), as ``Memtable.drop_before`` returns them).

        Parts a cached view has not applied yet move to its ``pending`` list (counted in the
        cache's bound), so a cached key group never has to be read again. They move with the
        ords their segment gave them ((checkpoint id, seq), not the memtable's): they then
        order among entries read from newer segments as those segments say (``catch_up``).
        """
        self._unsettled.discard(checkpoint_id)
        stamped = pl.lit(checkpoint_id << 32, dtype=pl.Int64) + (pl.col(ORD) & ((1 << 32) - 1))
        for (name, kg), parts in dropped.items():
            group = self._cache.peek(kg)
            if group is None or name not in group.views:
                continue
            applied = group.applied.get(name, 0)
            if len(parts) > applied:
                group.pending.setdefault(name, []).extend(p.with_columns(stamped.alias(ORD)) for p in parts[applied:])
            group.applied[name] = max(0, applied - len(parts))
            self._cache.resized(kg)
        self._forget_indexes()
        self._forget_dead_footers()
        self._trim()
        for kg in self._host_lag:
            self._host_lag[kg] += 1
        info = self._table.current_checkpoint()
        if info is not None and info.checkpoint_id == checkpoint_id:  # else the views are behind the table's
            self._publish_committed()

    def catch_up(self, newer: Sequence[SegmentFile], after_checkpoint_id: int | dict[int, int] | None,
                 key_groups: Sequence[int] | None = None, publish: bool = True) -> None:
        """Bring the cached views (of ``key_groups`` only, when given) forward by the entries of
        ``newer``: segments of the task's key groups that the views' checkpoint did not have, all
        written after it (``StateStore.catch_up`` checks that; entries of checkpoints up to
        ``after_checkpoint_id`` are skipped, per key group when a dict, None: none is). Their entries become ``pending``
        parts of the views they touch, applied at the next read as a committed flush of this
        store's own would be; the views are then shared with the host (``publish``, see
        ``_publish_committed``)."""
        self._forget_indexes()
        cached = sorted(self._cache.key_groups() if key_groups is None else key_groups)
        if not newer or not cached:
            return
        after_of = after_checkpoint_id.get if isinstance(after_checkpoint_id, dict) else lambda _: after_checkpoint_id
        # The store's own committed entries still pending carry their segment's ords
        # (``committed``): the newer segments' entries join them and the views take all at their
        # next read, in one refresh.
        entries = read_entries(self._segments, newer, np.asarray(cached, dtype=np.int64), self._entry_schema)
        if isinstance(after_checkpoint_id, dict):
            after = pl.DataFrame({KEY_GROUP: list(after_checkpoint_id), _AFTER: list(after_checkpoint_id.values())},
                                 schema={KEY_GROUP: entries.schema[KEY_GROUP], _AFTER: pl.Int64})
            entries = entries.join(after, on=KEY_GROUP).filter(pl.col(CHECKPOINT_ID) > pl.col(_AFTER)).drop(_AFTER)
        elif after_checkpoint_id is not None:
            entries = entries.filter(pl.col(CHECKPOINT_ID) > after_checkpoint_id)
        for desc in self.layout.descriptors:
            part = entries.filter(pl.col(STATE) == desc.name)
            if not part.height:
                continue
            cols = entry_columns(desc, self.key_names)
            part = part.select([pl.col(KEY_GROUP).cast(pl.Int32).alias(KG), *cols])
            for (kg,), frame in part.partition_by(KG, as_dict=True).items():
                group = self._cache.peek(kg)
                if group is not None and desc.name in group.views:
                    group.pending.setdefault(desc.name, []).append(frame)
                    self._cache.resized(kg)
        self._forget_dead_footers()
        self._trim()
        # How many checkpoints each key group's shared views fell behind: those of ``newer``
        # after its own (a key group mapped from an older snapshot is the more behind; counting
        # every one of ``newer`` for all made them equal, and the first half of the key groups
        # by number were written again every time while the rest stayed at their first
        # snapshot, their catch-ups growing a checkpoint each batch).
        ids = sorted({s.checkpoint_id for s in newer})
        for kg in cached:
            if kg in self._host_lag:
                after = after_of(kg)
                self._host_lag[kg] += len(ids) - (0 if after is None else bisect.bisect_right(ids, after))
        if publish:
            self._publish_committed()

    def reset(self) -> None:
        """Forget every view, point index and unsettled flush: after a restore or a close, or
        when the memtable's ord sequence restarted (pending entries could sort after newer ones)."""
        self._forget_indexes()
        self._prefetched = None
        self._cache.clear()
        self._unsettled.clear()
        self._host_lag.clear()

    def _forget_dead_footers(self) -> None:
        """Keep the footers of the table's live segments of this reader's key groups only: the
        table moves on (compaction, retention), and the footers of the segments it dropped
        would stay until the footer cache's bound."""
        live = None
        for reader in self._readers():
            if reader.footers_held():
                live = live or {s.path for s in self._table.segments(self.key_group_range)}
                reader.keep_footers(live)

    def stats(self) -> dict[str, int]:
        """The cache's and the segment reader's counters."""
        return {
            "cache_key_groups": len(self._cache),
            "cache_size_bytes": self._cache.size_bytes,
            "cache_misses": self._cache.misses,
            "cache_partial_reads": self.partial_reads,
            "cache_evictions": self._cache.evictions,
            "host_views_mapped": self.host_views_mapped,
            "host_views_published": self.host_views_published,
            "segment_bytes_read": sum(r.bytes_read for r in self._readers()),
            "segment_files_opened": sum(r.files_opened for r in self._readers()),
            # This store's share of the process's file cache (zeros without one): a fetch is
            # a miss; ``refetched`` counts cached copies found lost or damaged.
            **_summed([r.file_cache_counters.as_dict("file_cache_") for r in self._readers()]),
            # The process's cache as a whole (shared by the stores of the process).
            "file_cache_size_bytes": 0 if self.file_cache is None else self.file_cache.size_bytes,
        }

    def _readers(self) -> list[SegmentReader]:
        """This reader's segment readers: its own and those of reads on other threads."""
        with self._io_lock:
            return [self._segments, *self._io_readers]

    @property
    def file_cache(self) -> FileCache | None:
        """The process's file cache this reader reads through (None: not caching)."""
        return self._segments.file_cache

    @property
    def file_cache_counters(self) -> FileCacheCounters:
        """This reader's share of the file cache's counters (writers of the store add theirs)."""
        return self._segments.file_cache_counters

    # ---------------------------------------------------------------- batched reads

    def views(self, name: str, key_groups: Iterable[int], seal: bool = True) -> list[pl.DataFrame]:
        """Whole views of ``name`` for the given key groups (loading what is missing), up to date
        with the memtable; with ``seal`` also with the handles' per-key writes (the per-key API
        reads without sealing and applies its own overlay on top)."""
        if seal:
            self._seal()
        kgs = sorted({int(k) for k in key_groups})
        missing = [kg for kg in kgs if not self._is_whole(kg)]
        if missing:
            self._cache.misses += len(missing)
            self._load(missing)
        return self._current(name, kgs)

    def keyed_views(self, name: str, keys: pa.Table, key_groups: np.ndarray) -> list[pl.DataFrame]:
        """Views of ``name`` of the key groups of ``keys`` (``key_groups``: each key's), holding
        at least those keys' state: partial views are filled with the keys they lack, not
        loaded whole. Up to date with the memtable and the handles' per-key writes."""
        self._seal()
        kgs = _distinct(key_groups)
        self._cover(keys, key_groups, kgs)
        return self._current(name, kgs)

    def prefetch(self, keys: pa.Table, key_groups: np.ndarray) -> None:
        """Make the views of every variable hold ``keys``' state (``key_groups``: each key's),
        in one batched read: what a per-key loop over those keys will read."""
        kgs = _distinct(key_groups)
        if kgs:
            self._cover(keys, key_groups, kgs)
        self._prefetched_keys(keys, key_groups, kgs)

    def plan_prefetch(self, keys: pa.Table, key_groups: np.ndarray) -> CoverPlan:
        """``prefetch`` in steps: what must be read for ``keys`` now (``CoverPlan``), to read
        with ``read_planned`` (on any thread) and apply with ``apply_prefetch``."""
        kgs = _distinct(key_groups)
        plan = self._plan_cover(keys, key_groups, kgs) if kgs else None
        return plan or CoverPlan(keys, np.asarray(key_groups), kgs, self._installs, [], [], None, [], [])

    def read_planned(self, plan: CoverPlan) -> None:
        """Read the entries ``plan`` needs (its only I/O); safe on any thread, several at once,
        beside the task thread's use of this reader."""
        if not plan.reads:
            return
        with self._io_lock:
            segments = self._io_idle.pop() if self._io_idle else None
            if segments is None:
                segments = SegmentReader(self._table.filesystem, self._config.footer_cache_entries_max,
                                         self._segments.file_cache)
                self._io_readers.append(segments)
        try:
            self._read_cover(plan, segments)
        finally:
            with self._io_lock:
                self._io_idle.append(segments)

    def apply_prefetch(self, plan: CoverPlan, accumulate: bool = False) -> None:
        """Cache what ``read_planned`` read for ``plan`` (task thread): the keys' views then hold
        their state, as after ``prefetch``. With ``accumulate``, the keys join those of the
        prefetches before (a batch read in several steps): per-key reads of any of them are
        served by the prefetched keys' indexes, which grow by the new keys' rows."""
        if plan.reads:
            self._apply_cover(plan)
        self._prefetched_keys(plan.keys, plan.key_groups, plan.kgs, accumulate)

    def _prefetched_keys(self, keys: pa.Table, key_groups: np.ndarray, kgs: list[int],
                         accumulate: bool = False) -> None:
        """After the keys' views were filled: bring them up to date and index them (``prefetch``)."""
        if kgs:
            # Bring them up to date now, every key group at once: the per-key loop would
            # refresh each key group at its first read, a few polars calls per key group (a
            # 50k-key batch over 128 key groups: a quarter of the loop's time).
            self._refresh_all([kg for kg in kgs if kg in self._cache])
            self._trim(pinned=kgs)
        pre = self._prefetched
        if accumulate and pre is not None and kgs and self._indexable:
            self._add_prefetched(pre, pl.from_arrow(keys).select(self.key_names), np.asarray(key_groups), kgs)
            return
        # The loop's per-key reads of these keys are served by indexes over their rows alone
        # (``_batch_point``), not over whole views.
        self._batch_index.clear()
        self._prefetched = _Prefetched(pl.from_arrow(keys).select(self.key_names), np.asarray(key_groups), kgs,
                                       self._cache.evictions) if kgs and self._indexable else None

    def _add_prefetched(self, pre: _Prefetched, keys: pl.DataFrame, key_groups: np.ndarray, kgs: list[int]) -> None:
        """Add keys (not prefetched before; their views current and pinned now) to ``pre``: the
        indexes already built take their rows at once (an index holds copies of its keys' rows,
        current until the memtable changes, whatever the cache does later); the others are
        built at their first read, over every prefetched key, if the views still hold them."""
        if any(kg not in self._cache for kg in kgs):  # a cache too small for one read's key groups
            self._batch_index.clear()
        for (name, kind), index in self._batch_index.items():
            columns, build = self._batch_builds[(name, kind)]
            view = self._keyed_rows(self.layout.descriptor(name), kgs, keys, key_groups)
            index.update(build(_tuples(view, self.key_names), _tuples(view, columns), view))
        pre.keys = pl.concat([pre.keys, keys], how="vertical", rechunk=False)
        pre.key_groups = np.concatenate([pre.key_groups, key_groups])
        pre.kgs = sorted({*pre.kgs, *kgs})
        if pre.key_set is not None:
            pre.key_set.update(_tuples(keys, self.key_names))

    def _current(self, name: str, kgs: list[int]) -> list[pl.DataFrame]:
        """The current views of ``name`` in the cached ``kgs``, as frames."""
        return [v.frame() for v in self._current_views(name, kgs)]

    def _current_views(self, name: str, kgs: list[int]) -> list[KeyedView]:
        """The views of ``name`` in the cached ``kgs``, brought up to date."""
        stale = [kg for kg in kgs if self._is_stale(kg, name)]
        if stale:
            self._refresh(stale, name)
        out = [self._cache.get(kg).views[name] for kg in kgs]
        self._trim(pinned=kgs)
        return out

    def live_view(self, name: str, key_groups: Iterable[int], keys: pa.Table | None = None,
                  keys_key_groups: np.ndarray | None = None) -> pl.DataFrame:
        """The view rows of ``name`` in ``key_groups`` that are live now, as one frame: of every
        key, or (``keys`` given, with each key's group in ``keys_key_groups``) at least of
        those keys (see ``_keyed_rows``: the caller joins with its keys)."""
        desc = self.layout.descriptor(name)
        if keys is None:
            views = self.views(name, key_groups)
            view = pl.concat(views, how="vertical", rechunk=False) if views else self._empty_view(desc)
        else:
            self._seal()
            kgs = _distinct(keys_key_groups)
            self._cover(keys, keys_key_groups, kgs)
            view = self._keyed_rows(desc, kgs, pl.from_arrow(keys).select(self.key_names), keys_key_groups)
        return live_rows(view, self._now_ms()) if view.height else self._empty_view(desc)

    def _keyed_rows(self, desc: StateDescriptor, kgs: list[int], keys: pl.DataFrame,
                    key_groups: np.ndarray | None) -> pl.DataFrame:
        """The current view rows of ``desc`` in the cached ``kgs`` of at least ``keys`` (key
        columns; ``key_groups``: each key's) as one frame (TTL not applied): the views whole
        when they are not much larger than the keys (``_RESTRICT_RATIO``), else only rows of
        these keys and, where hashes collide, of a few others (the caller joins on its keys).

        Indexed views (``views.KeyedView``) find the keys' rows by binary search of their
        hashes, the cost of the keys; other views are restricted by a semi join, which hashes
        the keys and probes every view row (a left join of 50k keys against whole views of 2M
        keys hashed all 2M: 86 ms, against 21 ms for the semi join and a join of what it kept)."""
        views = self._current_views(desc.name, kgs) if kgs else []
        if not views:
            return self._empty_view(desc)
        if sum(v.height for v in views) <= self.restrict_ratio * keys.height:
            return pl.concat([v.frame() for v in views], how="vertical", rechunk=False)
        indexed = key_groups is not None and any(v.indexed for v in views)
        needles = self._hashes_by_group(keys, key_groups, kgs, views[0]) if indexed else {}
        found, plain = [], []
        for kg, view in zip(kgs, views, strict=True):
            rows = view.candidates(needles[kg]) if indexed else None
            if rows is None:
                plain.append(view.frame())
            elif rows.height:
                found.append(rows)
        if plain:
            found.append(pl.concat(plain, how="vertical", rechunk=False).join(keys, on=list(self.key_names),
                                                                               how="semi"))
        return pl.concat(found, how="vertical", rechunk=False) if found else self._empty_view(desc)

    def _any_indexed(self) -> bool:
        """Whether a cached view is indexed (``KeyedView``): keys are then best hashed first."""
        return any(v.indexed for kg in self._cache.key_groups() for v in self._cache.peek(kg).views.values())

    def _hashes_by_group(self, keys: pl.DataFrame, key_groups: np.ndarray, kgs: list[int],
                         view: KeyedView) -> dict[int, np.ndarray]:
        """The distinct, sorted key hashes (``views.key_hashes`` in ``view``'s key dtypes) of
        ``keys`` in each of ``kgs`` (``key_groups``: each key's)."""
        hashes = key_hashes(keys.cast(view.key_dtypes()))
        key_groups = np.asarray(key_groups)
        order = np.argsort(key_groups, kind="stable")
        sorted_kgs = key_groups[order]
        wanted = np.asarray(kgs, dtype=sorted_kgs.dtype)
        lo = np.searchsorted(sorted_kgs, wanted, side="left")
        hi = np.searchsorted(sorted_kgs, wanted, side="right")
        return {kg: distinct_sorted(hashes[order[a:b]]) for kg, a, b in zip(kgs, lo.tolist(), hi.tolist(), strict=True)}

    def rows_of(self, name: str, keys: pl.DataFrame, key_groups: np.ndarray) -> pl.DataFrame:
        """The view rows of ``name`` live now of exactly ``keys`` (key columns, repeats allowed;
        ``key_groups``: each key's), reading what the views lack, without sealing the handles'
        writes: for a write about to be added, asking what its keys hold (``live_rows``)."""
        desc = self.layout.descriptor(name)
        if not keys.height:
            return self._empty_view(desc)
        key_groups = np.asarray(key_groups, dtype=np.int64)
        kgs = _distinct(key_groups)
        if not all(self._is_whole(kg) for kg in kgs):
            self._cover(keys.to_arrow().cast(self.layout.key_schema), key_groups, kgs)
        view = self._keyed_rows(desc, kgs, keys, key_groups)
        if not view.height:
            return view
        view = live_rows(view, self._now_ms())
        return view.join(keys.cast(dict(view.select(self.key_names).schema)), on=self.key_names, how="semi")

    def scan(self, name: str) -> pl.DataFrame:
        """The live view rows of ``name`` over the task's whole key-group range, read from the
        segments (only the variable's columns) and the memtable, without filling the cache:
        for a variable far smaller than the rest of the state, such as timers."""
        self._seal()
        desc = self.layout.descriptor(name)
        r = self.key_group_range
        kgs = list(range(r.start, r.end + 1))
        entries = self._read(kgs, variable_entry_schema(self.layout, desc), state=name)
        views = self._resolve_loaded(desc, entries, kgs, self._now_ms())
        frames = [v for v in views.values() if v.height]
        return pl.concat(frames, how="vertical") if frames else self._empty_view(desc)

    def lookup(self, name: str, keys: pa.Table, key_groups: np.ndarray | None,
               on_extra: pl.DataFrame | None = None, seal: bool = True) -> pl.DataFrame:
        """Left join of ``keys`` (normalized, in order) with the value column of the live view
        rows of ``name``: null where a key has no live value.

        ``key_groups``: each key's, or None when not known yet: with enough keys
        (``_KEYS_PER_GROUP_UNHASHED``) they join every cached view and only the keys without a
        value are hashed (and refused when not this task's: a key found in a view is); else
        all are hashed first. ``on_extra`` adds join columns (a map's user keys), aligned
        with ``keys``.

        The keys are joined with the cached views first; only the keys that found no row there
        are checked against the partial views' covered keys, and those not covered are read
        and joined again. A key found in a view is covered (a partial view holds the rows of
        its covered keys only), so a warm lookup of keys that exist pays no coverage check:
        500k of 1M keys, 21 ms of a 120 ms lookup; nor, without key groups, their hashing.

        ``seal``: first move the handles' per-key writes into the memtable (see ``_seal``);
        False for a caller that holds the per-key writes of ``name`` itself.
        """
        if seal:
            self._seal()
        left = pl.from_arrow(keys)
        on = list(self.key_names)
        if on_extra is not None:
            left = left.hstack(on_extra)
            on += on_extra.columns
        desc = self.layout.descriptor(name)
        if key_groups is None and (keys.num_rows < self.keys_per_group_unhashed * max(1, len(self._cache))
                                   or self._any_indexed()):
            key_groups = self._key_groups_of(keys)
        if key_groups is None:
            kgs = None
            cached = sorted(self._cache.key_groups())
        else:
            kgs = _distinct(key_groups)
            cached = [kg for kg in kgs if kg in self._cache]
        record = self.record_lookups and on_extra is None and desc.kind not in (StateKind.LIST, StateKind.MAP)
        self._last_lookup = None
        out = self._join_views(desc, left, on, cached, key_groups, with_expiry=record)
        # A null value reads as absent whether or not a row matched: a miss either way.
        missed = out.get_column(desc.value_column).is_null()
        if (kgs is None or any(not self._is_whole(kg) for kg in kgs)) and missed.any():
            rows = out.filter(missed).get_column(_ROW).to_numpy()
            miss_keys = keys.take(rows)
            miss_kgs = self._key_groups_of(miss_keys) if kgs is None else np.asarray(key_groups)[rows]
            miss_kg_list = _distinct(miss_kgs)
            if self._cover(miss_keys, miss_kgs, miss_kg_list):
                again = self._join_views(desc, left[rows].with_columns(pl.Series(_ROW, rows, dtype=pl.UInt32)),
                                         on, miss_kg_list, miss_kgs, with_expiry=record)
                out = pl.concat([out.filter(~missed), again.select(out.columns)], how="vertical").sort(
                    _ROW, maintain_order=True)
        kind = desc.kind
        one_row_per_key = kind not in (StateKind.LIST, StateKind.MAP) or on_extra is not None
        if out.height != left.height and one_row_per_key:
            # Two newest entries of one key tie: only a table whose checkpoint took segments
            # of two stores for one task can hold that (commits refuse it now). One row per
            # key all the same, the last of the view's order, and say so.
            log.warning("state %r holds entries of one key that tie on (checkpoint, seq): the table was "
                        "written by two stores for one task; each key's last one is read", name)
            if kgs is None:
                kgs = _distinct(self._key_groups_of(keys))
            out = self._join_views(desc, left, on, kgs, None, last_per_key=True, with_expiry=record)
            record = False
        if record:
            found = out.filter(pl.col(desc.value_column).is_not_null()).select(EXPIRE_AT_MS)
            self._last_lookup = (name, left.select(self.key_names), found)
            out = out.drop(EXPIRE_AT_MS)
        return out.drop(_ROW)

    def recorded(self, name: str, keys: pl.DataFrame) -> pl.DataFrame | None:
        """The live rows (``EXPIRE_AT_MS`` only) of ``keys`` of value-like ``name`` as the last
        ``lookup`` found them, when it looked up exactly ``keys`` and nothing changed since
        (``record_lookups``); else None."""
        last = self._last_lookup
        if last is None or last[0] != name or not last[1].equals(keys):
            return None
        return last[2]

    def _join_views(self, desc: StateDescriptor, left: pl.DataFrame, on: list[str], kgs: list[int],
                    key_groups: np.ndarray | None, last_per_key: bool = False,
                    with_expiry: bool = False) -> pl.DataFrame:
        """``left`` (numbered in ``_ROW`` unless it already is) left-joined with the live view
        rows of ``desc`` in the cached ``kgs`` (brought up to date): the value column, null
        where no row matched; with ``last_per_key`` only the last view row of each join key, in
        the views' order. ``key_groups``: each row's of ``left``, None when not known (the
        views are then restricted by a semi join, not by their indexes)."""
        if _ROW not in left.columns:
            left = left.with_row_index(_ROW)
        # Only the columns the join returns: gathering less is faster.
        view = self._keyed_rows(desc, kgs, left.select(self.key_names), key_groups)
        view = live_rows(view, self._now_ms()).select(*on, desc.value_column, *([EXPIRE_AT_MS] if with_expiry else []))
        if last_per_key:
            view = view.unique(subset=on, keep="last", maintain_order=True)
        return left.join(view, on=on, how="left", maintain_order="left")

    # ---------------------------------------------------------------- per-key reads

    def point_get(self, name: str, key: tuple, key_group: int) -> tuple[Any, int | None] | None:
        """(value, expire_at_ms) of the view row of ``key`` in state ``name``, or None: the
        per-key read of value-like state. Without sealing the handles' overlays (the caller
        applies its own). Served from a dict built once per view (``_view_index``)."""
        columns = self._point_columns[name]
        if not self._indexable:
            rows = self._key_filter(name, key, key_group, columns)
            return rows[0] if rows else None
        return self._point(name, key, key_group, "", columns, _index_one)

    def key_rows(self, name: str, key: tuple, key_group: int, columns: Sequence[str]) -> list[tuple]:
        """``columns`` of every view row of ``key`` in state ``name`` (TTL not applied), without
        sealing the handles' overlays: the per-key read of list and map state."""
        if not self._indexable:
            return self._key_filter(name, key, key_group, columns)
        rows = self._point(name, key, key_group, "rows", columns, _index_rows)
        return [] if rows is None else rows

    def key_map(self, name: str, key: tuple, key_group: int, hash_key: Callable[[Any], Any],
                hash_column: Callable[[pl.Series], list]) -> dict:
        """The stored map of ``key`` in map state ``name``: {hash_key(user key): (user key,
        value, expire_at_ms)} (TTL not applied; overlays not sealed), so one map entry is
        found in O(1). ``hash_column``: ``hash_key`` of each value of a user key column, in a
        list (an index hashes every user key of a view)."""
        known = self._map_reads.get(name)
        if known is None or known[0] is not hash_key:
            desc = self.layout.descriptor(name)
            user_key = desc.user_key_column

            def build(keys: Iterable, rows: Iterable, view: pl.DataFrame) -> dict:
                return _index_map(keys, rows, hash_column(view.get_column(user_key)))
            # Made once per variable: a map's per-key loop calls this for every entry it reads.
            known = self._map_reads[name] = (hash_key, (desc.user_key_column, desc.value_column, EXPIRE_AT_MS), build)
        _, columns, build = known
        if not self._indexable:
            return {hash_key(r[0]): r for r in self._key_filter(name, key, key_group, columns)}
        found = self._point(name, key, key_group, "map", columns, build)
        return _NO_ENTRIES if found is None else found

    def _point(self, name: str, key: tuple, key_group: int, kind: str, columns: Sequence[str],
               build: Callable[[Iterable, Iterable, pl.DataFrame], dict]) -> Any:
        """What ``build``'s index holds for ``key`` (None: no row): from the prefetched keys'
        index when ``key`` is one of them, else from the index over its key group's view."""
        found = self._batch_point(name, key, kind, columns, build)
        if found is not _NOT_PREFETCHED:
            return found
        found = self._view_index(name, key_group, kind, columns, build).get(key)
        if found is None and self._uncovered(key, key_group):
            found = self._view_index(name, key_group, kind, columns, build).get(key)
        return found

    def _batch_point(self, name: str, key: tuple, kind: str, columns: Sequence[str],
                     build: Callable[[Iterable, Iterable, pl.DataFrame], dict]) -> Any:
        """``key``'s entry in an index over the rows of the last prefetch's keys only, built at
        the first per-key read of (``name``, ``kind``) after it; ``_NOT_PREFETCHED`` when
        ``key`` was not prefetched. An index over a whole view is built from every row of its
        key group, again after every change of the view: on whole-cached views a per-key loop
        over a batch paid for the cached state, not for the batch (a list state of 500k keys,
        50k-key batches: most of the loop). Views much larger than the keys are first
        restricted to them (a semi join in polars; the Python dict is the batch's size)."""
        pre = self._prefetched
        if pre is None:
            return _NOT_PREFETCHED
        if pre.key_set is None:
            pre.key_set = set(_tuples(pre.keys, self.key_names))
        if key not in pre.key_set:
            return _NOT_PREFETCHED
        index = self._batch_index.get((name, kind))
        if index is None:
            if self._cache.evictions != pre.evictions or any(kg not in self._cache for kg in pre.kgs):
                # A prefetched key group may have left and come back covering other keys: the
                # views no longer hold these keys for sure.
                self._prefetched = None
                return _NOT_PREFETCHED
            view = self._keyed_rows(self.layout.descriptor(name), pre.kgs, pre.keys, pre.key_groups)
            index = self._batch_index[(name, kind)] = build(_tuples(view, self.key_names), _tuples(view, columns), view)
            self._batch_builds[(name, kind)] = (columns, build)
        return index.get(key)

    def _forget_indexes(self) -> None:
        """Forget every point index: a view's state may have changed (the memtable, a commit,
        new segments, a reset)."""
        self._point_index.clear()
        self._batch_index.clear()
        self._last_lookup = None

    def _forget_view_indexes(self) -> None:
        """Forget the indexes over views (``_view_index``): views were replaced, filled or
        evicted, their keys' state unchanged. The prefetched keys' indexes hold copies of their
        rows, which stay current."""
        self._point_index.clear()

    def _uncovered(self, key: tuple, key_group: int) -> bool:
        """Whether ``key`` missed only because its key group's views are partial and lack it;
        if so, the key group is loaded whole (a per-key loop over keys not prefetched)."""
        group = self._cache.peek(key_group)
        if group is None or group.covers(key):
            return False
        self._cache.misses += 1
        self._load([key_group])
        self._forget_view_indexes()
        return True

    def _view_index(self, name: str, key_group: int, kind: str, columns: Sequence[str],
                    build: Callable[[Iterable, Iterable, pl.DataFrame], dict]) -> dict:
        """A dict over the current view of ``name`` in ``key_group``, from its key tuples and
        ``columns`` rows; built on first use and again whenever the view object changes. Only
        for key columns whose plain Python values compare equal to what polars returns
        (``_indexable``: strings, binaries, integers, booleans, dates).

        ``_point_index`` remembers the dicts known current: a per-key loop over a batch reads
        them with one lookup, and anything that can change a view (a memtable write, a
        checkpoint completing, an eviction, a restore) forgets them all."""
        fast = self._point_index.get((name, kind, key_group))
        if fast is not None:
            return fast
        view = self._current_view(name, key_group)
        group = self._cache.peek(key_group)
        slot = f"{name}\0{kind}" if kind else name
        index = group.indexes.get(slot)
        if index is None or index[0] is not view:
            index = group.indexes[slot] = (view, build(_tuples(view, self.key_names), _tuples(view, columns), view))
            self._cache.resized(key_group)
        self._point_index[(name, kind, key_group)] = index[1]
        return index[1]

    def _key_filter(self, name: str, key: tuple, key_group: int, columns: Sequence[str]) -> list[tuple]:
        """``columns`` of the view rows of ``key``, by a filter over the view (keys that cannot be indexed)."""
        view = self._current_view(name, key_group)
        rows = view.filter(pl.all_horizontal([pl.col(k) == pl.lit(v, dtype=view.schema[k])
                                              for k, v in zip(self.key_names, key, strict=True)]))
        return list(_tuples(rows, columns))

    def _current_view(self, name: str, key_group: int) -> pl.DataFrame:
        """The current view of ``name`` in ``key_group``, partial if cached partial (loaded
        whole if not cached)."""
        group = self._cache.get(key_group)
        if group is None:
            return self.views(name, [key_group], seal=False)[0]
        if (name not in group.views or group.pending.get(name)
                or len(self._memtable.parts(name, key_group)) > group.applied.get(name, 0)):
            return self._current(name, [key_group])[0]
        return group.views[name].frame()  # cached and current: skip the general path

    # ---------------------------------------------------------------- loading and refreshing

    def _keyed_view(self, frame: pl.DataFrame) -> KeyedView:
        return KeyedView(frame, self.key_names, self._index_rows_min, self.merge_ratio)

    def _now_ms(self) -> int:
        return int(self._config.clock_ms())

    now_ms = _now_ms

    def _empty_view(self, desc: StateDescriptor) -> pl.DataFrame:
        return self._empty_views[desc.name].clone()  # a copy: callers may be handed it

    def _polars_entry_schemas(self) -> dict[str, pl.Schema]:
        empty = pl.from_arrow(self._entry_schema.empty_table())
        full = dict(empty.schema)
        full[ORD] = pl.Int64
        return {
            d.name: pl.Schema({c: full[c] for c in entry_columns(d, self.key_names)})
            for d in self.layout.descriptors
        }

    def _trim(self, pinned: Iterable[int] = ()) -> None:
        evictions = self._cache.evictions
        self._cache.trim(pinned=pinned)
        if self._cache.evictions != evictions:
            self._forget_view_indexes()  # an evicted group's index must not outlive it

    def _is_whole(self, kg: int) -> bool:
        group = self._cache.peek(kg)
        return group is not None and group.covered is None

    def _cover(self, keys: pa.Table, key_groups: np.ndarray, kgs: list[int]) -> bool:
        """Make the views of ``kgs`` hold the state of ``keys`` (``key_groups``: each key's):
        key groups not cached or partial get the keys they lack by a filtered read, or are
        loaded whole (see ``StoreConfig.view_partial_reads_max``). Whether anything was read."""
        plan = self._plan_cover(keys, key_groups, kgs)
        if plan is None:
            return False
        self._read_cover(plan, self._segments)
        self._apply_cover(plan)
        return True

    def _plan_cover(self, keys: pa.Table, key_groups: np.ndarray, kgs: list[int]) -> CoverPlan | None:
        """What ``_cover`` reads: None when the views hold every key already."""
        todo = [kg for kg in kgs if not self._is_whole(kg)]
        if not todo:
            return None
        whole: list[int] = []
        partial: list[int] = []
        wanted = None
        if not self._partial_reads_max:
            whole = todo
        else:
            wanted = pl.from_arrow(keys).select(self.key_names).with_columns(
                pl.Series(KG, np.asarray(key_groups), dtype=pl.Int32))
            wanted = self._lacking(wanted.filter(pl.col(KG).is_in(todo)), todo)
            wanted = wanted.unique()  # after the anti join: on a warm cache it leaves few keys, often none
            asked = dict(wanted.group_by(KG).len().iter_rows())
            todo = [kg for kg in todo if kg in asked]
            if not todo:
                return None
            estimate = self._estimated_rows(todo)
            for kg in todo:
                group = self._cache.peek(kg)
                covered_rows = 0 if group is None else group.covered.height
                reads = 0 if group is None else group.partial_reads
                rows = estimate[kg]
                if (rows < self._config.view_partial_rows_min or reads >= self._partial_reads_limit(kg)
                        or covered_rows + asked[kg] > self._config.view_partial_share_max * rows):
                    whole.append(kg)
                else:
                    partial.append(kg)
        new = wanted.filter(pl.col(KG).is_in(partial)) if partial else None
        if partial:
            partial = sorted(new.get_column(KG).unique().to_list())
        return CoverPlan(keys, np.asarray(key_groups), kgs, self._installs, whole, partial, new,
                         self._segments_of(whole) if whole else [], self._segments_of(partial) if partial else [])

    def _lacking(self, wanted: pl.DataFrame, kgs: list[int]) -> pl.DataFrame:
        """The keys of ``wanted`` (key columns and ``KG``) that the partial groups among the
        non-whole ``kgs`` do not cover yet (a key is in one key group: keys alone join)."""
        covered = [g.covered for kg in kgs if (g := self._cache.peek(kg)) is not None and g.covered is not None
                   and g.covered.height]
        if not covered:
            return wanted
        return wanted.join(pl.concat(covered, how="vertical", rechunk=False), on=self.key_names, how="anti")

    def _read_cover(self, plan: CoverPlan, segments: SegmentReader) -> None:
        """Read ``plan``'s entries with ``segments`` (any thread: reads only the table's files)."""
        if plan.whole:
            plan.whole_entries = read_entries(segments, plan.whole_segments, np.asarray(plan.whole, dtype=np.int64),
                                              self._entry_schema)
        if plan.partial:
            plan.partial_entries = read_entries(segments, plan.partial_segments,
                                                np.asarray(plan.partial, dtype=np.int64), self._entry_schema,
                                                keys=plan.new.rename({KG: KEY_GROUP}))

    def _apply_cover(self, plan: CoverPlan) -> None:
        """Cache what ``plan`` read. When the cache changed since it was planned (another
        read applied first, a per-key read loaded a key group, an eviction), what became
        whole, or covered, meanwhile is left as it is."""
        whole, partial, new, entries = plan.whole, plan.partial, plan.new, plan.partial_entries
        if plan.installs != self._installs:
            whole = [kg for kg in whole if not self._is_whole(kg)]
            if partial:
                partial = [kg for kg in partial if not self._is_whole(kg)]
                new = self._lacking(new.filter(pl.col(KG).is_in(partial)), partial)
                partial = sorted(new.get_column(KG).unique().to_list())
                entries = entries.join(new.rename({KG: KEY_GROUP}).with_columns(pl.col(KEY_GROUP).cast(
                    entries.schema[KEY_GROUP])), on=[KEY_GROUP, *self.key_names], how="semi")
        if whole:
            self._cache.misses += len(whole)
            self._install_whole(whole, plan.whole_entries)
        if partial:
            self._install_partial(partial, new, entries)

    def _partial_reads_limit(self, kg: int) -> int:
        """Partial reads of ``kg`` before it is loaded whole: 1..2x ``view_partial_reads_max``,
        spread over the key groups so that their whole loads fall into different batches."""
        return 1 + (kg * 7919) % (2 * self._partial_reads_max)

    def _estimated_rows(self, kgs: list[int]) -> dict[int, float]:
        """Entries of each key group in the opened checkpoint's segments (a segment's records
        spread evenly over its key groups)."""
        lo, hi = kgs[0], kgs[-1]
        rows = np.zeros(hi - lo + 1)
        for seg in self._table.segments(KeyGroupRange.of(lo, hi)):
            a, b = max(seg.key_group_min, lo), min(seg.key_group_max, hi)
            rows[a - lo:b - lo + 1] += seg.record_count / (seg.key_group_max - seg.key_group_min + 1)
        return {kg: float(rows[kg - lo]) for kg in kgs}

    def _install_partial(self, kgs: list[int], new: pl.DataFrame, entries: pl.DataFrame) -> None:
        """Add the views of the ``new`` keys (key columns and ``KG``; keys of the sorted ``kgs``
        that their partial or absent groups lack), from their segment ``entries``, to those groups."""
        self._installs += 1
        self._refresh_all([kg for kg in kgs if kg in self._cache])  # pending and unapplied parts: covered keys'
        self.partial_reads += 1
        now = self._now_ms()
        views = {desc.name: self._resolve_loaded(desc, entries, kgs, now, keys=new) for desc in self.layout.descriptors}
        keys_of = new.partition_by(KG, as_dict=True, include_key=False)
        for kg in kgs:
            group = self._cache.peek(kg)
            if group is None:
                group = CachedKeyGroup(covered=keys_of[(kg,)].clear())
            for desc in self.layout.descriptors:
                view, old = views[desc.name][kg], group.views.get(desc.name)
                if old is None:
                    group.views[desc.name] = self._keyed_view(view)
                else:
                    old.append(view)
                group.applied[desc.name] = len(self._memtable.parts(desc.name, kg))
            group.cover(keys_of[(kg,)])
            group.partial_reads += 1
            self._cache.put(kg, group)
        self._forget_view_indexes()

    def _refresh_all(self, kgs: Sequence[int]) -> None:
        """``_refresh`` every variable's views of the cached ``kgs`` that miss memtable parts or
        pending entries."""
        for desc in self.layout.descriptors:
            stale = [kg for kg in kgs if self._is_stale(kg, desc.name)]
            if stale:
                self._refresh(stale, desc.name)

    def _is_stale(self, kg: int, name: str) -> bool:
        group = self._cache.peek(kg)
        return len(self._memtable.parts(name, kg)) > group.applied.get(name, 0) or bool(group.pending.get(name))

    def _refresh(self, kgs: Sequence[int], name: str) -> None:
        """Apply the memtable parts and pending entries that the views of ``name`` in ``kgs``
        miss: every key group's new entries at once (the per-call cost of a few polars
        operations is paid once, not once per key group: a task owns many)."""
        desc = self.layout.descriptor(name)
        views, new = [], []
        for kg in kgs:
            group = self._cache.get(kg)
            parts = self._memtable.parts(name, kg)
            fresh = group.pending.pop(name, []) + parts[group.applied.get(name, 0):]
            if group.covered is not None:  # a partial view takes only its covered keys' entries
                fresh = [p.join(group.covered, on=list(self.key_names), how="semi") for p in fresh]
            new += fresh
            group.applied[name] = len(parts)
            views.append(group.views[name])
        keyed = pl.Schema({KG: pl.Int32, **self._entry_schemas[name]})
        rows = sum(v.height for v in views)
        ratio = self.replace_ratio_indexed if rows >= len(views) * self._index_rows_min else self.replace_ratio
        if ratio * sum(p.height for p in new) > rows:
            self._refresh_resolving(kgs, desc, views, new, keyed)
        else:
            self._refresh_replacing(kgs, desc, views, new, keyed)

    def _refresh_resolving(self, kgs: Sequence[int], desc: StateDescriptor, views: list[KeyedView],
                           new: list[pl.DataFrame], keyed: pl.Schema) -> None:
        """The views and the new entries resolved again as one: views with few rows per new
        entry (``_REPLACE_RATIO``). A list's elements are renumbered below every new entry, so
        that later entries sort after them."""
        heights = [v.height for v in views]
        old = pl.concat([v.frame() for v in views], how="vertical") if sum(heights) else None
        if old is not None:
            old = old.with_columns(pl.Series(KG, np.repeat(np.asarray(kgs, np.int32), heights)))
        resolved = merge(old, new, desc, [KG, *self.key_names], self._now_ms(), keyed)
        by_kg = resolved.partition_by(KG, as_dict=True, include_key=False)
        empty = self._empty_view(desc)
        for kg in kgs:
            self._cache.peek(kg).views[desc.name] = self._keyed_view(by_kg.get((kg,), empty))
            self._cache.resized(kg)

    def _refresh_replacing(self, kgs: Sequence[int], desc: StateDescriptor, views: list[KeyedView],
                           new: list[pl.DataFrame], keyed: pl.Schema) -> None:
        """Every new entry is newer than every view row, so a view changes only at the keys
        (map entries) the new entries touch: their rows leave the view and the new entries'
        own resolution takes their place. The work is the new entries' and, for views not
        indexed, a hash probe of the view, not a resolution of the whole view again (whole
        views of 2M keys over 128 key groups, 50k new entries: 129 against 294 ms).

        A list's elements are appended: its view keeps every row but those of keys the new
        entries clear (a whole-key tombstone), and the new entries' surviving elements follow,
        their ``ord`` stamped above every view row's (new entries' own ords need not exceed the
        view's: a view's rows may carry a segment's ords or sit below 0 after a resolution)."""
        if not new:
            return
        keys = list(self.key_names)
        entries = pl.concat(new, how="diagonal_relaxed").select(list(keyed)).cast(keyed)
        now = self._now_ms()
        resolved = resolve(entries, desc, [KG, *keys], now)
        if desc.kind is StateKind.LIST:
            top = max((v.max_ord() for v in views), default=-1)
            resolved = resolved.sort(ORD, maintain_order=True).with_columns(
                (pl.int_range(0, pl.len(), dtype=pl.Int64) + (top + 1)).alias(ORD))
            cleared = entries.filter(pl.col(OP) == OP_DELETE).select([KG, *keys]).unique().partition_by(
                KG, as_dict=True, include_key=False)
            touched, on = {}, keys
        elif desc.kind is StateKind.MAP:
            mk = desc.user_key_column
            whole = (pl.col(OP) == OP_DELETE) & pl.col(mk).is_null()
            cleared = entries.filter(whole).select([KG, *keys]).unique().partition_by(
                KG, as_dict=True, include_key=False)
            touched = entries.filter(~whole).select([KG, *keys, mk]).unique().partition_by(
                KG, as_dict=True, include_key=False)
            on = [*keys, mk]
        else:
            cleared = {}
            touched = entries.select([KG, *keys]).unique().partition_by(KG, as_dict=True, include_key=False)
            on = keys
        fresh = resolved.partition_by(KG, as_dict=True, include_key=False)
        changes, changed = [], []
        for kg, view in zip(kgs, views, strict=True):
            gone_keys, gone, added = cleared.get((kg,)), touched.get((kg,)), fresh.get((kg,))
            if gone_keys is not None or gone is not None or added is not None:
                changes.append((view, gone, gone_keys, added))
                changed.append(kg)
        replace_rows(changes, on, now)
        for kg in changed:
            self._cache.resized(kg)

    def _load(self, kgs: Sequence[int]) -> None:
        """Read the segments of ``kgs`` and resolve every variable's view of each (replacing
        partial groups: the point indexes over them are forgotten)."""
        self._install_whole(kgs, self._read(kgs, self._entry_schema))

    def _install_whole(self, kgs: Sequence[int], entries: pl.DataFrame) -> None:
        """Cache the views of ``kgs`` resolved from their segment ``entries`` (of those key
        groups at least) and the memtable, replacing what was cached of them."""
        self._installs += 1
        self._forget_view_indexes()
        groups = {kg: CachedKeyGroup() for kg in kgs}
        now = self._now_ms()
        for desc in self.layout.descriptors:
            for kg, view in self._resolve_loaded(desc, entries, kgs, now).items():
                groups[kg].views[desc.name] = self._keyed_view(view)
                groups[kg].applied[desc.name] = len(self._memtable.parts(desc.name, kg))
        for kg, group in groups.items():
            self._cache.put(kg, group)
        self._publish(kgs)

    # ---------------------------------------------------------------- the host's shared views

    def adopt_host_views(self) -> int:
        """Fill an empty cache with the host's shared views (``host_views``) of this reader's
        key groups that the opened checkpoint descends from, the newest of each, within the
        cache's bound, and catch them up with the entries committed since (read at the next
        read, as ``catch_up`` does); how many key groups were mapped. Nothing is read but the
        snapshots' manifests, and their files once per process (their digests)."""
        host, info = self._host, self._table.current_checkpoint()
        if host is None or info is None or len(self._cache) or self._unsettled or self._memtable.entry_count():
            return 0
        now, wanted = self._now_ms(), set(range(self.key_group_range.start, self.key_group_range.end + 1))
        budget = self._config.cache_size_bytes_max
        chosen: dict[int, Snapshot] = {}
        newer_of: dict[str, list[SegmentFile]] = {}
        for snap in host.snapshots(self._slot):
            kgs = [kg for kg in snap.key_groups if kg in wanted and kg not in chosen]
            if not kgs:
                continue
            newer = snap.newer_segments(self._table.segments(KeyGroupRange.of(snap.key_groups[0], snap.key_groups[-1])),
                                        now)
            if newer is None:
                continue
            newer_of[snap.path] = newer
            for kg in kgs:
                size = sum(f[1] for runs in snap.views[kg].values() for run in runs for f in run.files)
                if size > budget:
                    break
                budget -= size
                chosen[kg] = snap
        if not chosen:
            return 0
        groups = self._map_snapshots(chosen)
        if not groups:
            return 0
        self._installs += 1
        self._forget_view_indexes()
        for kg, group in groups.items():
            self._cache.put(kg, group)
        self._host_lag.update(dict.fromkeys(groups, 0))
        # One read of every snapshot's newer segments (each a flush after its snapshot's newest
        # entry: ``Snapshot.newer_segments``); a key group takes the entries after its own snapshot's.
        newer = {s.path: s for path in {chosen[kg].path for kg in groups} for s in newer_of[path]}
        self.catch_up(sorted(newer.values(), key=lambda s: s.checkpoint_id),
                      {kg: chosen[kg].top_checkpoint_id for kg in groups}, sorted(groups), publish=False)
        self.host_views_mapped += len(groups)
        self._publish_committed()
        return len(groups)

    def _map_snapshots(self, chosen: dict[int, Snapshot]) -> dict[int, CachedKeyGroup]:
        """The cached groups of ``chosen`` (key group -> snapshot), mapped; a damaged
        snapshot's are left out (and the snapshot deleted)."""
        groups: dict[int, CachedKeyGroup] = {}
        damaged: set[str] = set()
        for kg in sorted(chosen):
            snap = chosen[kg]
            if snap.path in damaged:
                continue
            try:
                group = CachedKeyGroup()
                for desc in self.layout.descriptors:
                    runs = snap.views[kg].get(desc.name)
                    if runs is None:
                        raise SnapshotDamaged(f"{snap.path}: no view of {desc.name!r} in key group {kg}")
                    parts = self._host.open_runs(snap, runs, self._empty_views[desc.name].schema)
                    group.views[desc.name] = KeyedView.of_parts(parts, self.key_names, self._index_rows_min,
                                                                self.merge_ratio)
                    group.applied[desc.name] = 0
                groups[kg] = group
            except SnapshotDamaged as e:
                log.warning("shared state views: %s; its key groups load from the table", e)
                damaged.add(snap.path)
                self._host.discard(snap)
        for kg in [kg for kg in groups if chosen[kg].path in damaged]:
            del groups[kg]
        for snap in {chosen[kg].path: chosen[kg] for kg in groups}.values():
            self._host.used(snap)
        return groups

    def _publish_committed(self) -> None:
        """After a commit or a catch-up, with nothing written since: bring the whole cached key
        groups to the opened checkpoint (their pending entries applied, as their next read
        would) and write them to the host's shared views, linking the runs they already share
        from there."""
        if self._host is None or self._unsettled or self._memtable.entry_count():
            return
        whole = [kg for kg in self._cache.key_groups() if self._is_whole(kg)]
        new = sorted(kg for kg in whole if kg not in self._host_lag)  # the host has none of theirs: all now
        due = sorted((kg for kg in whole if kg in self._host_lag and (
            self._host_lag[kg] >= self._host_views_lag or self._mostly_private(kg))),
            key=lambda kg: -self._host_lag[kg])
        # At most 1 / lag of the key groups a time: a batch never pays for writing all of them
        # at once (each is written again about every lag checkpoints, at most 2 * lag - 1
        # behind while the first ones due take their turns).
        kgs = sorted(new + due[:max(1, -(-len(whole) // self._host_views_lag))])
        if not kgs:
            return
        self._refresh_all(kgs)
        self._publish(kgs)

    def _mostly_private(self, kg: int) -> bool:
        """Whether more than ``HOST_VIEWS_PRIVATE_SHARE_MAX`` of the bytes of ``kg``'s indexed views
        are this process's own (plain views, below ``view_index_rows_min`` rows, are a new frame
        at any change: only the lag writes them again)."""
        views = [v for v in self._cache.peek(kg).views.values() if v.indexed]
        return sum(v.private_bytes() for v in views) > HOST_VIEWS_PRIVATE_SHARE_MAX * sum(
            v.estimated_size() for v in views)

    def _publish(self, kgs: Sequence[int]) -> None:
        """Write the views of ``kgs`` just resolved whole to the host's shared views, when they
        are exactly the opened checkpoint's (no unsettled flush, no memtable entry of theirs),
        and keep them mapped from there (one copy on the host)."""
        host, info = self._host, self._table.current_checkpoint()
        if host is None or info is None or self._unsettled or any(
                self._memtable.parts(d.name, kg) for d in self.layout.descriptors for kg in kgs):
            return
        kgs = sorted(kgs)
        views = {}
        for kg in kgs:
            group = self._cache.peek(kg)
            if group is None or group.covered is not None or group.pending:
                return
            views[kg] = {name: view.parts() for name, view in group.views.items()}
        span = self._table.segments(KeyGroupRange.of(int(kgs[0]), int(kgs[-1])))
        try:
            snap = host.publish(self._slot, info.checkpoint_id, self._now_ms(), span, views)
        except (OSError, ValueError) as e:
            log.warning("shared state views: cannot write to %s (%s); views stay private", host.root, e)
            return
        if snap is None:
            return
        self.host_views_published += len(kgs)
        self._host_lag.update(dict.fromkeys(kgs, 0))
        # The runs this process held of its own now come from the host's pages (one copy on the
        # host); the runs it mapped already are the same files, linked: only their source moves.
        try:
            for kg in kgs:
                for name, view in self._cache.peek(kg).views.items():
                    files = snap.views[kg][name]
                    own = [i for i, part in enumerate(view.parts(index=False)) if part.source is None]
                    schema = self._empty_views[name].schema
                    mapped = host.open_runs(snap, [files[i] for i in own], schema) if own else []
                    view.shared_as(snap.path, files, dict(zip(own, mapped, strict=True)))
                self._cache.resized(kg)
        except SnapshotDamaged as e:  # removed meanwhile (another process made room): the views stay private
            log.warning("shared state views: %s; views stay private", e)
        self._forget_view_indexes()

    def _read(self, kgs: Sequence[int], schema: pa.Schema, state: str | None = None,
              keys: pl.DataFrame | None = None) -> pl.DataFrame:
        """``read_entries`` of the sorted key groups ``kgs`` (of only ``keys``, when given) from
        the opened checkpoint's segments, but those of unsettled flushes (see ``flushed``)."""
        wanted = np.asarray(kgs, dtype=np.int64)
        return read_entries(self._segments, self._segments_of(kgs), wanted, schema, state=state, keys=keys)

    def _segments_of(self, kgs: Sequence[int]) -> list[SegmentFile]:
        """The opened checkpoint's segments that may hold the sorted ``kgs``, but those of
        unsettled flushes (see ``flushed``)."""
        segments = self._table.segments(KeyGroupRange.of(int(kgs[0]), int(kgs[-1])))
        return [s for s in segments if s.checkpoint_id not in self._unsettled]

    def _resolve_loaded(self, desc: StateDescriptor, entries: pl.DataFrame, kgs: Sequence[int],
                        now: int, keys: pl.DataFrame | None = None) -> dict[int, pl.DataFrame]:
        """The views of ``desc`` in ``kgs`` over segment ``entries`` and the memtable's parts
        (of only ``keys``, key columns and ``KG``, when given: ``entries`` hold only theirs)."""
        schema = self._entry_schemas[desc.name]
        cols = entry_columns(desc, self.key_names)
        seg = entries.filter(pl.col(STATE) == desc.name)
        frames = [seg.select([pl.col(KEY_GROUP).cast(pl.Int32).alias(KG), *cols])]
        for kg in kgs:
            parts = [p.select([KG, *cols]) for p in self._memtable.parts(desc.name, kg)]
            if keys is not None:
                parts = [p.join(keys, on=[KG, *self.key_names], how="semi") for p in parts]
            frames += parts
        keyed_schema = pl.Schema({KG: pl.Int32, **schema})
        frames = [f.cast(keyed_schema) for f in frames if f.height]
        empty = self._empty_view(desc)
        if not frames:
            return dict.fromkeys(kgs, empty)
        view = resolve(pl.concat(frames, how="vertical", rechunk=True), desc, [KG, *self.key_names], now)
        by_kg = view.partition_by(KG, as_dict=True, include_key=False)
        return {kg: by_kg.get((kg,), empty) for kg in kgs}
