"""``StateStore``: one task's keyed state over a ``StateTable``.

The store owns the key groups of one task (``key_group_range``), the memtable of writes
since the last checkpoint, the cache of resolved key-group views and the state handles.
Reads go memtable (through the views, which apply memtable entries lazily) then segments
(loaded into the cache, a whole key group at a time, with pruned Parquet reads). A
checkpoint flushes the memtable into new segments and commits them through the table.

Thread safety: a store is used by one task thread at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from statestore.cache import CachedKeyGroup, KeyGroupCache
from statestore.config import StoreConfig
from statestore.descriptors import StateDescriptor
from statestore.errors import KeyGroupOutOfRangeError, StateClosedError, StateStoreError
from statestore.faults import crash_point
from statestore.keygroups import (
    KeyGroupRange,
    assign_key_group,
    assign_key_groups,
    compute_key_group_range_for_task,
)
from statestore.layout import CHECKPOINT_ID, EXPIRE_AT_MS, KEY_GROUP, OP, SEQ, STATE
from statestore.memtable import KG, MEMTABLE_CHECKPOINT_ID, Memtable
from statestore.resolve import (
    ORD,
    entry_columns,
    live_rows,
    make_ord,
    merge,
    resolve,
    view_columns,
)
from statestore.segment import SegmentReader, write_segments
from statestore.state import STATE_CLASSES, KeyedState
from statestore.table import CheckpointInfo, SegmentFile, StateTable

_NO_ENTRIES: dict = {}


def _index_one(keys: Iterable[tuple], rows: Iterable[tuple]) -> dict:
    return dict(zip(keys, rows, strict=True))


def _index_rows(keys: Iterable[tuple], rows: Iterable[tuple]) -> dict:
    by_key: dict[tuple, list[tuple]] = {}
    for k, row in zip(keys, rows, strict=True):
        found = by_key.get(k)
        if found is None:
            by_key[k] = [row]
        else:
            found.append(row)
    return by_key


def _index_map(keys: Iterable[tuple], rows: Iterable[tuple], hash_key: Callable[[Any], Any]) -> dict:
    by_key: dict[tuple, dict] = {}
    for k, row in zip(keys, rows, strict=True):
        m = by_key.get(k)
        if m is None:
            m = by_key[k] = {}
        m[hash_key(row[0])] = row
    return by_key


class StateStore:
    """Keyed state of one task (``task_index`` of ``parallelism``) over ``table``.

    The table must be opened at the checkpoint to continue from; nothing is read until a
    key group is first accessed (restore downloads nothing up front).
    """

    def __init__(self, table: StateTable, *, task_index: int = 0, parallelism: int = 1,
                 config: StoreConfig | None = None):
        self._table = table
        self.layout = table.layout
        self.key_names = self.layout.key_names
        self.task_index = task_index
        self.parallelism = parallelism
        self.key_group_range = compute_key_group_range_for_task(self.layout.max_parallelism, parallelism, task_index)
        self.config = config or StoreConfig()
        self._memtable = Memtable()
        self._cache = KeyGroupCache(self.config.cache_size_bytes_max)
        self._reader = SegmentReader(table.filesystem, self.config.footer_cache_entries_max)
        self._entry_schemas = self._polars_entry_schemas()
        self._indexable = all(
            pa.types.is_string(f.type) or pa.types.is_binary(f.type) or pa.types.is_integer(f.type)
            or pa.types.is_boolean(f.type) or pa.types.is_date32(f.type) for f in self.layout.key_schema)
        self._handles: dict[str, KeyedState] = {}
        self._point_index: dict[tuple[str, str, int], dict] = {}  # see _view_index
        # checkpoint id -> memtable watermark of a flush whose commit is not settled yet
        self._outstanding: dict[int, int] = {}
        self._current_key: tuple | None = None
        self._current_key_group: int | None = None
        self._closed = False

    # ---------------------------------------------------------------- state handles

    def get_state(self, descriptor: StateDescriptor | str) -> KeyedState:
        """The handle of a state variable declared in the table's layout."""
        self._check_open()
        name = descriptor if isinstance(descriptor, str) else descriptor.name
        try:
            declared = self.layout.descriptor(name)
        except KeyError as e:
            raise StateStoreError(
                f"state {name!r} is not declared in table layout (declared: "
                f"{[d.name for d in self.layout.descriptors]}); declare it when opening the state table"
            ) from e
        if not isinstance(descriptor, str) and descriptor != declared:
            raise StateStoreError(f"state {name!r} is declared as {declared}, requested as {descriptor}")
        if name not in self._handles:
            self._handles[name] = STATE_CLASSES[declared.kind](self, declared)
        return self._handles[name]

    @property
    def table(self) -> StateTable:
        return self._table

    # ---------------------------------------------------------------- current key

    def set_current_key(self, key: Any, key_group: int | None = None) -> None:
        """Select the key the per-key state API works on (a scalar, or a tuple for several columns).

        ``key_group`` may be passed when the caller already computed it with the same hash
        (rows routed by Spark carry it); it is trusted, so it must be right.
        """
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != len(self.key_names):
            raise ValueError(f"key {key!r} has {len(key)} value(s); the key columns are {self.key_names}")
        if any(v is None for v in key):
            raise ValueError(f"key {key!r} has a null value: keys must not be null")
        if key_group is None:
            try:
                key_group = assign_key_group(key, self.layout.key_schema, self.layout.max_parallelism)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
                raise TypeError(f"key {key!r} does not fit the key schema {self.layout.key_schema}: {e}") from e
        r = self.key_group_range
        if not r.start <= key_group <= r.end:
            self._check_owned(np.array([key_group]))
        self._current_key, self._current_key_group = key, key_group

    def check_routed_keys(self, keys: pa.Table, key_groups: np.ndarray) -> None:
        """Check at once, for a batch of keys that arrive with their key groups (rows routed
        by Spark), what ``set_current_key`` checks per key: no key value is null and this
        task owns every key group. ``select_key`` may then set each of them unchecked."""
        for name in self.key_names:
            column = keys.column(name)
            if column.null_count:
                first = pc.index(pc.is_null(column), True).as_py()
                key = tuple(keys.column(n)[first].as_py() for n in self.key_names)
                raise ValueError(f"key {key!r} has a null value: keys must not be null")
        self._check_owned(key_groups)

    def select_key(self, key: tuple, key_group: int) -> None:
        """``set_current_key`` of a key tuple and its key group checked by ``check_routed_keys``
        (0.5 us of checks per key, a tenth of a per-key processor's state work)."""
        self._current_key, self._current_key_group = key, key_group

    def current_key(self) -> tuple[tuple, int]:
        if self._current_key is None:
            raise StateStoreError("no current key: call set_current_key(key) before the per-key state API")
        return self._current_key, self._current_key_group

    # ---------------------------------------------------------------- batched plumbing

    def prepare_keys(self, keys: pa.Table | pa.RecordBatch) -> tuple[pa.Table, np.ndarray]:
        """Validate keys, compute their key groups and check this task owns them."""
        self._check_open()
        table = self.layout.check_keys(keys)
        kgs = assign_key_groups(table, self.layout.max_parallelism)
        self._check_owned(kgs)
        return table, kgs

    def write(self, name: str, key_groups: np.ndarray, entries: pl.DataFrame) -> None:
        """Append entries of state ``name`` (entry columns but ``ord``) to the memtable."""
        self.seal()
        self._memtable.add(name, key_groups, entries)
        self._point_index.clear()

    def views(self, name: str, key_groups: Iterable[int], seal: bool = True) -> list[pl.DataFrame]:
        """Views of ``name`` for the given key groups (loading what is missing), up to date with
        the memtable; with ``seal`` also with the handles' per-key writes (the per-key API reads
        without sealing and applies its own overlay on top)."""
        if seal:
            self.seal()
        kgs = sorted({int(k) for k in key_groups})
        missing = [kg for kg in kgs if kg not in self._cache]
        if missing:
            self._cache.misses += len(missing)
            self._load(missing)
        stale = [kg for kg in kgs if self._is_stale(kg, name)]
        if stale:
            self._refresh(stale, name)
        out = [self._cache.get(kg).views[name] for kg in kgs]
        self._trim(pinned=kgs)
        return out

    def live_view(self, name: str, key_groups: Iterable[int]) -> pl.DataFrame:
        """The view rows of ``name`` in ``key_groups`` that are live now, as one frame."""
        views = self.views(name, key_groups)
        view = pl.concat(views, how="vertical", rechunk=False) if views else None
        if view is None or view.height == 0:
            return self.empty_view(self.layout.descriptor(name))
        return live_rows(view, self.now_ms())

    def scan(self, name: str) -> pl.DataFrame:
        """The live view rows of ``name`` over this task's whole key-group range, read from the
        segments (only the variable's columns) and the memtable, without filling the cache:
        for a variable far smaller than the rest of the state, such as timers."""
        self._check_open()
        self.seal()
        desc = self.layout.descriptor(name)
        r = self.key_group_range
        kgs = list(range(r.start, r.end + 1))
        entries = self._read_entries(kgs, [c for c in (desc.user_key_column, desc.value_column) if c is not None])
        views = self._resolve_loaded(desc, entries, kgs, self.now_ms())
        frames = [v for v in views.values() if v.height]
        return pl.concat(frames, how="vertical") if frames else self.empty_view(desc)

    def lookup(self, name: str, keys: pa.Table, key_groups: np.ndarray, on_extra: pl.DataFrame | None = None,
               ) -> pl.DataFrame:
        """Left join of ``keys`` (in order) with the live view rows of ``name``: the value
        column is null where a key has no live value.

        ``on_extra`` adds join columns (a map's user keys), aligned with ``keys``.
        """
        view = self.live_view(name, np.unique(key_groups).tolist())
        left = pl.from_arrow(keys)
        on = list(self.key_names)
        if on_extra is not None:
            left = left.hstack(on_extra)
            on += on_extra.columns
        return left.join(view, on=on, how="left", maintain_order="left")

    def point_get(self, name: str, key: tuple, key_group: int) -> tuple[Any, int | None] | None:
        """(value, expire_at_ms) of the view row of ``key`` in state ``name``, or None: the
        per-key read of value-like state. Without sealing the handles' overlays (the caller
        applies its own). Served from a dict built once per view (``_view_index``)."""
        columns = (self.layout.descriptor(name).value_column, EXPIRE_AT_MS)
        if not self._indexable:
            rows = self._key_filter(name, key, key_group, columns)
            return rows[0] if rows else None
        return self._view_index(name, key_group, "", columns, _index_one).get(key)

    def key_rows(self, name: str, key: tuple, key_group: int, columns: Sequence[str]) -> list[tuple]:
        """``columns`` of every view row of ``key`` in state ``name`` (TTL not applied), without
        sealing the handles' overlays: the per-key read of list and map state."""
        if not self._indexable:
            return self._key_filter(name, key, key_group, columns)
        return self._view_index(name, key_group, "rows", columns, _index_rows).get(key, [])

    def key_map(self, name: str, key: tuple, key_group: int, hash_key: Callable[[Any], Any]) -> dict:
        """The stored map of ``key`` in map state ``name``: {hash_key(user key): (user key,
        value, expire_at_ms)} (TTL not applied; overlays not sealed), so one map entry is
        found in O(1)."""
        desc = self.layout.descriptor(name)
        columns = (desc.user_key_column, desc.value_column, EXPIRE_AT_MS)
        if not self._indexable:
            return {hash_key(r[0]): r for r in self._key_filter(name, key, key_group, columns)}
        return self._view_index(name, key_group, "map", columns,
                                lambda keys, rows: _index_map(keys, rows, hash_key)).get(key, _NO_ENTRIES)

    def _view_index(self, name: str, key_group: int, kind: str, columns: Sequence[str],
                    build: Callable[[Iterable, Iterable], dict]) -> dict:
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
            keys = zip(*[view.get_column(k).to_list() for k in self.key_names], strict=True)
            rows = zip(*[view.get_column(c).to_list() for c in columns], strict=True)
            index = group.indexes[slot] = (view, build(keys, rows))
            self._cache.resized(key_group)
        self._point_index[(name, kind, key_group)] = index[1]
        return index[1]

    def _key_filter(self, name: str, key: tuple, key_group: int, columns: Sequence[str]) -> list[tuple]:
        """``columns`` of the view rows of ``key``, by a filter over the view (keys that cannot be indexed)."""
        view = self._current_view(name, key_group)
        rows = view.filter(pl.all_horizontal([pl.col(k) == pl.lit(v, dtype=view.schema[k])
                                              for k, v in zip(self.key_names, key, strict=True)]))
        return list(zip(*[rows.get_column(c).to_list() for c in columns], strict=True))

    def _current_view(self, name: str, key_group: int) -> pl.DataFrame:
        group = self._cache.get(key_group)
        if (group is None or name not in group.views or group.pending.get(name)
                or len(self._memtable.parts(name, key_group)) > group.applied.get(name, 0)):
            return self.views(name, [key_group], seal=False)[0]
        return group.views[name]  # cached and current: skip the general path

    def now_ms(self) -> int:
        return int(self.config.clock_ms())

    def empty_view(self, desc: StateDescriptor) -> pl.DataFrame:
        schema = self._entry_schemas[desc.name]
        return pl.DataFrame(schema=schema).select(view_columns(desc, self.key_names))

    def entry_schema(self, name: str) -> pl.Schema:
        return self._entry_schemas[name]

    def seal(self) -> None:
        """Move every handle's per-key writes into the memtable, in write order."""
        for handle in self._handles.values():
            sealed = handle.seal_overlay()
            if sealed is not None:
                self._memtable.add(handle.name, *sealed)
                self._point_index.clear()

    # ---------------------------------------------------------------- checkpoints

    def flush(self, checkpoint_id: int) -> list[SegmentFile]:
        """Write the memtable as this task's segments of ``checkpoint_id`` (not committed).

        The memtable is kept until ``checkpoint_complete``: if the commit fails, the next
        checkpoint writes it again and the files written here are garbage.
        """
        self._check_open()
        if not isinstance(checkpoint_id, int) or not 1 <= checkpoint_id < MEMTABLE_CHECKPOINT_ID:
            # Entries order by checkpoint_id * 2^32 + seq in an int64 (resolve.make_ord).
            raise ValueError(
                f"checkpoint_id must be an int in [1, {MEMTABLE_CHECKPOINT_ID - 1}], got {checkpoint_id!r}")
        if self._outstanding:
            raise StateStoreError(
                f"checkpoint {next(iter(self._outstanding))} was flushed but neither completed nor aborted; call "
                "checkpoint_complete(id) after its commit, or checkpoint_aborted(id) when the commit failed"
            )
        self.seal()
        crash_point("flush_started")
        entries = self._memtable_as_entries(checkpoint_id)
        # Writes after this flush get ords at or above the watermark and stay in the memtable
        # when the checkpoint completes.
        self._outstanding[checkpoint_id] = self._memtable.watermark()
        if entries is None:
            return []
        return write_segments(self._table, entries, checkpoint_id, self.task_index,
                              self.config.row_group_rows_min, self.config.row_group_rows_max)

    def checkpoint_complete(self, checkpoint_id: int) -> None:
        """The checkpoint that ``flush(checkpoint_id)`` wrote is committed: drop the flushed
        entries from the memtable (later writes stay).

        Flushed entries that a cached view has not applied yet move to the view's
        ``pending`` list (counted in the cache's bound), so a cached key group never has to
        be read again. A table object that did not commit the checkpoint itself (another
        process's driver did) is moved forward to it, so later reads see its segments.
        """
        if checkpoint_id not in self._outstanding:
            raise ValueError(f"checkpoint {checkpoint_id} was not flushed by this store (or already completed)")
        dropped = self._memtable.drop_before(self._outstanding.pop(checkpoint_id))
        current = self._table.current_checkpoint()
        if current is None or current.checkpoint_id < checkpoint_id:
            self._table.restore(checkpoint_id)
        for (name, kg), parts in dropped.items():
            group = self._cache.peek(kg)
            if group is None or name not in group.views:
                continue
            applied = group.applied.get(name, 0)
            if len(parts) > applied:
                group.pending.setdefault(name, []).extend(parts[applied:])
            group.applied[name] = max(0, applied - len(parts))
            self._cache.resized(kg)
        self._point_index.clear()
        self._trim()
        if self._memtable.maybe_reset_sequence():
            # The ord sequence restarted: pending entries could sort after newer ones.
            self._cache.clear()

    def checkpoint_aborted(self, checkpoint_id: int) -> None:
        """The commit of ``checkpoint_id`` failed: keep its entries for the next checkpoint.
        The files ``flush`` wrote are garbage for the table's retention to delete."""
        self._outstanding.pop(checkpoint_id, None)

    def checkpoint(self, batch_id: int | None = None, properties: dict[str, str] | None = None) -> CheckpointInfo:
        """Flush and commit a checkpoint of this store alone (single-task use)."""
        checkpoint_id = self._table.next_checkpoint_id()
        segments = self.flush(checkpoint_id)
        crash_point("segments_written")
        try:
            info = self._table.commit_checkpoint(
                checkpoint_id, segments, parallelism=self.parallelism, batch_id=batch_id, properties=properties
            )
        except BaseException:
            self.checkpoint_aborted(checkpoint_id)
            raise
        self.checkpoint_complete(checkpoint_id)
        return info

    def restore(self, checkpoint_id: int | None = None) -> CheckpointInfo | None:
        """Drop all uncommitted state and continue from ``checkpoint_id`` (newest when None)."""
        self._check_open()
        info = self._table.restore(checkpoint_id)
        self._reset()
        return info

    def close(self) -> None:
        self._reset()
        self._closed = True

    # ---------------------------------------------------------------- statistics

    def stats(self) -> dict[str, int]:
        return {
            "cache_key_groups": len(self._cache),
            "cache_size_bytes": self._cache.size_bytes,
            "cache_misses": self._cache.misses,
            "cache_evictions": self._cache.evictions,
            "memtable_entries": self._memtable.entry_count(),
            "segment_bytes_read": self._reader.bytes_read,
            "segment_files_opened": self._reader.files_opened,
        }

    # ---------------------------------------------------------------- internals

    def _trim(self, pinned: Iterable[int] = ()) -> None:
        evictions = self._cache.evictions
        self._cache.trim(pinned=pinned)
        if self._cache.evictions != evictions:
            self._point_index.clear()  # an evicted group's index must not outlive it

    def _reset(self) -> None:
        self._point_index.clear()
        self._memtable.reset()
        self._outstanding.clear()
        self._cache.clear()
        for handle in self._handles.values():
            handle.seal_overlay()
        self._current_key = self._current_key_group = None

    def _check_open(self) -> None:
        if self._closed:
            raise StateClosedError("the state store is closed; open a new StateStore on the table")

    def _check_owned(self, kgs: np.ndarray) -> None:
        r = self.key_group_range
        bad = kgs[(kgs < r.start) | (kgs > r.end)]
        if len(bad):
            raise KeyGroupOutOfRangeError(
                f"key group {int(bad[0])} is not owned by task {self.task_index} of {self.parallelism} "
                f"(owns {r}); route keys with pmod(xxhash64(keys), {self.layout.max_parallelism}) to their task"
            )

    def _polars_entry_schemas(self) -> dict[str, pl.Schema]:
        empty = pl.from_arrow(self.layout.entry_schema.empty_table())
        full = dict(empty.schema)
        full[ORD] = pl.Int64
        return {
            d.name: pl.Schema({c: full[c] for c in entry_columns(d, self.key_names)})
            for d in self.layout.descriptors
        }

    def _is_stale(self, kg: int, name: str) -> bool:
        group = self._cache.peek(kg)
        return len(self._memtable.parts(name, kg)) > group.applied.get(name, 0) or bool(group.pending.get(name))

    def _refresh(self, kgs: Sequence[int], name: str) -> None:
        """Apply the memtable parts and pending entries that the views of ``name`` in ``kgs``
        miss, in one resolution over all of them: the per-call cost of a few polars
        operations is paid once, not once per key group (a task owns many)."""
        desc = self.layout.descriptor(name)
        views, new = [], []
        for kg in kgs:
            group = self._cache.get(kg)
            parts = self._memtable.parts(name, kg)
            new += group.pending.pop(name, []) + parts[group.applied.get(name, 0):]
            group.applied[name] = len(parts)
            views.append(group.views[name])
        heights = [v.height for v in views]
        old = pl.concat(views, how="vertical") if sum(heights) else None
        if old is not None:
            old = old.with_columns(pl.Series(KG, np.repeat(np.asarray(kgs, np.int32), heights)))
        keyed = pl.Schema({KG: pl.Int32, **self._entry_schemas[name]})
        resolved = merge(old, new, desc, [KG, *self.key_names], self.now_ms(), keyed)
        by_kg = resolved.partition_by(KG, as_dict=True, include_key=False)
        empty = self.empty_view(desc)
        for kg in kgs:
            self._cache.peek(kg).views[name] = by_kg.get((kg,), empty)
            self._cache.resized(kg)

    def _load(self, kgs: Sequence[int]) -> None:
        """Read the segments of ``kgs`` and resolve every variable's view of each."""
        value_columns = [c for c in self.layout.entry_schema.names if c.startswith(("mk_", "v_"))]
        entries = self._read_entries(kgs, value_columns)
        groups = {kg: CachedKeyGroup() for kg in kgs}
        now = self.now_ms()
        for desc in self.layout.descriptors:
            for kg, view in self._resolve_loaded(desc, entries, kgs, now).items():
                groups[kg].views[desc.name] = view
                groups[kg].applied[desc.name] = len(self._memtable.parts(desc.name, kg))
        for kg, group in groups.items():
            self._cache.put(kg, group)

    def _read_entries(self, kgs: Sequence[int], value_columns: Sequence[str]) -> pl.DataFrame | None:
        """Segment entries of the sorted key groups ``kgs`` with their ``ord``: the system and key
        columns plus ``value_columns``; None when there are none."""
        wanted = np.asarray(kgs, dtype=np.int64)
        segments = self._table.segments(KeyGroupRange.of(int(wanted[0]), int(wanted[-1])))
        # Entries of a flushed checkpoint stay in the memtable until it completes: reading its
        # segments as well would apply them twice (list appends would repeat).
        segments = [s for s in segments if s.checkpoint_id not in self._outstanding]
        columns = [KEY_GROUP, *self.key_names, STATE, OP, CHECKPOINT_ID, SEQ, EXPIRE_AT_MS, *value_columns]
        tables = self._reader.read(segments, wanted, columns)
        if not tables:
            return None
        table = pa.concat_tables(tables, promote_options="permissive")
        return pl.from_arrow(table).with_columns(make_ord(pl.col(CHECKPOINT_ID), pl.col(SEQ)))

    def _resolve_loaded(self, desc: StateDescriptor, entries: pl.DataFrame | None, kgs: Sequence[int],
                        now: int) -> dict[int, pl.DataFrame]:
        schema = self._entry_schemas[desc.name]
        cols = entry_columns(desc, self.key_names)
        frames = []
        if entries is not None:
            seg = entries.filter(pl.col(STATE) == desc.name)
            frames.append(seg.select([pl.col(KEY_GROUP).cast(pl.Int32).alias(KG), *cols]).cast(schema))
        for kg in kgs:
            frames += [p.select([KG, *cols]) for p in self._memtable.parts(desc.name, kg)]
        keyed_schema = pl.Schema({KG: pl.Int32, **schema})
        frames = [f.cast(keyed_schema) for f in frames if f.height]
        empty = self.empty_view(desc)
        if not frames:
            return dict.fromkeys(kgs, empty)
        view = resolve(pl.concat(frames, how="vertical", rechunk=True), desc, [KG, *self.key_names], now)
        by_kg = view.partition_by(KG, as_dict=True, include_key=False)
        return {kg: by_kg.get((kg,), empty) for kg in kgs}

    def _memtable_as_entries(self, checkpoint_id: int) -> pa.Table | None:
        entry_schema = self.layout.entry_schema
        tables = []
        for name, parts in self._memtable.parts_by_state().items():
            desc = self.layout.descriptor(name)
            cols = entry_columns(desc, self.key_names)
            df = pl.concat(parts, how="diagonal_relaxed").select([KG, *cols]).with_columns(
                pl.col(KG).alias(KEY_GROUP),
                pl.lit(name).alias(STATE),
                pl.lit(checkpoint_id, dtype=pl.Int64).alias(CHECKPOINT_ID),
                (pl.col(ORD) & ((1 << 32) - 1)).alias(SEQ),
            ).drop(ORD, KG)
            tables.append(df.to_arrow())
        if not tables:
            return None
        table = pa.concat_tables(tables, promote_options="permissive")
        cols = [table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
                for f in entry_schema]
        return pa.Table.from_arrays(cols, schema=entry_schema)
