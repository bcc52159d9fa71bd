"""State handles: the user-facing API of each state variable.

Every handle has two forms:

* a per-key API on the store's current key (``store.set_current_key``), with Python
  values; writes collect in an *overlay* (a dict, the cheap path for one key at a time)
  that the store seals into the memtable before batched calls and at checkpoints;
* a batched API taking and returning Arrow data for many keys at once; a batched read is
  one vectorized join per call over the views of the key groups involved.

Reads go to the store's reader (``read_path.StateReader``), which each handle binds once;
writes, keys and the current key go through the store.

Values may not be null (a null would be indistinguishable from absence): write ``clear``
instead. Handles are used by the store's task thread only.
"""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from statestore.conversions import castable, check_no_truncation
from statestore.descriptors import StateDescriptor, StateKind, TtlUpdateType
from statestore.errors import SchemaMismatchError
from statestore.layout import EXPIRE_AT_MS, OP, OP_APPEND, OP_DELETE, OP_PUT
from statestore.resolve import ORD

if TYPE_CHECKING:
    from statestore.read_path import StateReader
    from statestore.store import StateStore

ROW = "_row"


_SCALARS = (int, float, str, bytes, bool, type(None))


def _hashable(value: Any) -> Any:
    t = type(value)
    if t is dict:
        items = sorted(value.items())  # struct field names: unique strings, values never compared
        for _, v in items:
            if type(v) not in _SCALARS:
                return tuple((k, _hashable(v)) for k, v in items)
        return tuple(items)
    if t is list:
        return tuple(_hashable(v) for v in value)
    return value


def _hashable_column(values: pl.Series) -> list:
    """``[_hashable(v) for v in values.to_list()]``, made per column where it can be: a struct
    of fields that are not nested gives each value's (name, value) pairs in name order straight
    from its fields' columns, with no dict per value to build and sort (an index over a map
    state's view hashes every user key of it: most of its cost with struct user keys)."""
    dtype = values.dtype
    if not dtype.is_nested():
        return values.to_list()
    if (isinstance(dtype, pl.Struct) and dtype.fields and values.null_count() == 0
            and not any(f.dtype.is_nested() for f in dtype.fields)):
        names = sorted(f.name for f in dtype.fields)
        fields = values.struct.unnest()
        return list(zip(*[zip(repeat(n), fields.get_column(n).to_list()) for n in names], strict=True))
    return [_hashable(v) for v in values.to_list()]


def _arrow(values: Any, dtype: pa.DataType, what: str) -> pa.Array:
    """Values as an Arrow array of exactly ``dtype``; SchemaMismatchError otherwise."""
    try:
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks()
        if not isinstance(values, pa.Array):
            check_no_truncation(values, pa.list_(dtype))
        arr = values if isinstance(values, pa.Array) else pa.array(values, type=dtype)
        if arr.type != dtype:
            if not castable(arr.type, dtype):
                raise TypeError(f"an array of {arr.type} cannot stand for {dtype}")
            cast = arr.cast(dtype)  # safe: refuses truncation and integer overflow
            if pa.types.is_floating(dtype) and pa.types.is_floating(arr.type) \
                    and pc.sum(pc.is_inf(cast)).as_py() != pc.sum(pc.is_inf(arr)).as_py():
                raise TypeError(f"a value of the {arr.type} array is beyond the range of {dtype} (it would "
                                "become an infinity)")
            arr = cast
        arr.validate(full=True)  # invalid UTF-8 in strings, which no checkpoint could store
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError,
            OverflowError) as e:
        raise SchemaMismatchError(f"{what} do not match the declared type {dtype}: {e}") from e
    if arr.null_count:
        raise ValueError(f"{what} contain {arr.null_count} null(s); state values must not be null (use clear)")
    return arr


@functools.lru_cache(maxsize=1024)
def _fits_checker(dtype: pa.DataType) -> Callable[[Any], bool]:
    """Whether a value certainly converts to ``dtype`` (plain Python scalars and dicts of them;
    False means "ask Arrow"), as a test decided once per type: the type tests cost more than
    the check itself, once per per-key write."""
    if pa.types.is_int64(dtype) or pa.types.is_int32(dtype):
        lo, hi = -(1 << (dtype.bit_width - 1)), 1 << (dtype.bit_width - 1)
        return lambda v: v is None or (type(v) is int and lo <= v < hi)
    if pa.types.is_float64(dtype):
        return lambda v: v is None or type(v) in (float, int)
    if pa.types.is_string(dtype):
        return lambda v: v is None or type(v) is str
    if pa.types.is_boolean(dtype):
        return lambda v: v is None or type(v) is bool
    if pa.types.is_struct(dtype):
        fields = [(f.name, _fits_checker(f.type)) for f in dtype]
        n = len(fields)

        def struct_fits(v: Any) -> bool:
            if v is None:
                return True  # a null field of a struct; top-level nulls are refused before
            if type(v) is not dict or len(v) != n:
                return False
            for name, fits in fields:  # noqa: SIM110 (a loop: all() over a generator costs ~2x here)
                if name not in v or not fits(v[name]):
                    return False
            return True
        return struct_fits
    return lambda v: v is None


def fields_fit(dtype: pa.StructType) -> Callable[[tuple], bool]:
    """Whether a tuple of a struct's field values (in field order) certainly converts to
    ``dtype`` (False means "ask Arrow", as for ``_fits_checker``): for callers that hold
    struct values as tuples."""
    checks = [_fits_checker(f.type) for f in dtype]
    n = len(checks)
    if n == 1:
        (only,) = checks
        return lambda t: len(t) == 1 and only(t[0])
    return lambda t: len(t) == n and all(fits(v) for fits, v in zip(checks, t, strict=True))


def _check_value(value: Any, dtype: pa.DataType, what: str) -> None:
    """Per-key writes are checked when made, as batched ones are: a value that cannot be
    stored would otherwise fail later, at the seal, and take the whole overlay with it."""
    if value is None:
        raise ValueError(f"{what} must not be null")
    if _fits_checker(dtype)(value):
        return
    try:
        check_no_truncation(value, dtype)
        pa.scalar(value, type=dtype)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError,
            OverflowError) as e:
        # reprlib: bounded in length and depth, whatever the value (a hostile one nests 100,000 deep)
        raise SchemaMismatchError(f"{what} {reprlib.repr(value)} does not match the declared type {dtype}: {e}") from e


def _last_rows(keys: pa.Table) -> np.ndarray:
    """Row indices of the last occurrence of each distinct key, in row order."""
    df = pl.from_arrow(keys).with_row_index(ROW)
    last = df.group_by(keys.column_names).agg(pl.col(ROW).last()).get_column(ROW).sort()
    return last.to_numpy().astype(np.int64)


@dataclass
class _Pending:
    """Per-key writes of one key since the last seal (list and map: a delta on the stored state)."""

    key_group: int
    cleared: bool = False
    value: Any = None
    has_value: bool = False
    expire_at_ms: int | None = None
    appended: list[tuple[Any, int | None]] = field(default_factory=list)
    entries: dict[Any, tuple[Any, Any, bool, int | None]] = field(default_factory=dict)


class KeyedState:
    """Common plumbing of every state kind."""

    def __init__(self, store: StateStore, desc: StateDescriptor):
        self._store = store
        # The store's read path, bound once: per-key reads call it with no hop through the store.
        self._reader: StateReader = store.reader
        self.descriptor = desc
        self.name = desc.name
        self._v = desc.value_column
        self._overlay: dict[tuple, _Pending] = {}
        # The type test of a per-key write, decided once: looking it up by its pa.DataType
        # (an lru_cache keyed on the type's hash) cost 1.7 us, most of a count's write.
        self._fits = _fits_checker(desc.value_type)

    def _check(self, value: Any, what: str, kind: str = "state") -> None:
        """``_check_value`` of a per-key write against the value type (the message is only
        formatted for a value that fails)."""
        if value is None or not self._fits(value):
            _check_value(value, self.descriptor.value_type, f"{kind} {self.name!r}: {what}")

    # -- TTL

    def _expire_at(self) -> int | None:
        ttl = self.descriptor.ttl
        return None if ttl is None else self._store.now_ms() + ttl.ttl_ms

    def _refresh_on_read(self) -> bool:
        ttl = self.descriptor.ttl
        return ttl is not None and ttl.update_type is TtlUpdateType.ON_READ_AND_WRITE

    def _live(self, expire_at_ms: int | None) -> bool:
        return expire_at_ms is None or expire_at_ms > self._store.now_ms()

    # -- overlay

    def _pending(self) -> tuple[tuple, _Pending]:
        key, kg = self._store.current_key()
        p = self._overlay.get(key)
        if p is None:
            p = self._overlay[key] = _Pending(kg)
        return key, p

    def seal_overlay(self) -> tuple[np.ndarray, pl.DataFrame] | None:
        """Turn the overlay into (key groups, entries in write order) and empty it."""
        if not self._overlay:
            return None
        rows = self._overlay_rows()
        self._overlay = {}
        if not rows:
            return None
        return self._entries_frame(rows)

    def _overlay_rows(self) -> list[tuple[tuple, int, int, Any, Any, int | None]]:
        """(key, key group, op, user key, value, expire) rows of every key's pending writes."""
        rows: list[tuple[tuple, int, int, Any, Any, int | None]] = []
        for key, p in self._overlay.items():
            rows.extend(self._pending_entries(key, p))
        return rows

    def _pending_entries(self, key: tuple, p: _Pending):
        """The rows of one key's pending writes (``_overlay_rows``)."""
        if p.cleared:
            yield key, p.key_group, OP_DELETE, None, None, None
        if p.has_value:
            yield key, p.key_group, OP_PUT, None, p.value, p.expire_at_ms

    def _entries_frame(self, rows) -> tuple[np.ndarray, pl.DataFrame]:
        keys = list(zip(*[r[0] for r in rows], strict=True))
        schema = self._store.layout.key_schema
        cols: dict[str, pa.Array] = {f.name: pa.array(keys[i], type=f.type) for i, f in enumerate(schema)}
        cols[OP] = pa.array([r[2] for r in rows], pa.int8())
        cols[EXPIRE_AT_MS] = pa.array([r[5] for r in rows], pa.int64())
        if self.descriptor.kind is StateKind.MAP:
            cols[self.descriptor.user_key_column] = pa.array([r[3] for r in rows], self.descriptor.user_key_type)
        cols[self._v] = pa.array([r[4] for r in rows], self.descriptor.value_type)
        kgs = np.array([r[1] for r in rows], dtype=np.int32)
        return kgs, pl.from_arrow(pa.table(cols))

    # -- batched helpers

    def _write_batch(self, keys: pa.Table, kgs: np.ndarray, op: int, values: pa.Array | None,
                     user_keys: pa.Array | None = None, expire: pa.Array | None = None) -> None:
        n = keys.num_rows
        cols = {name: keys.column(name) for name in keys.column_names}
        cols[OP] = pa.array(np.full(n, op, dtype=np.int8))
        if expire is None:
            exp = self._expire_at() if op != OP_DELETE else None
            expire = pa.nulls(n, pa.int64()) if exp is None else pa.array(np.full(n, exp, dtype=np.int64))
        cols[EXPIRE_AT_MS] = expire
        if self.descriptor.kind is StateKind.MAP:
            cols[self.descriptor.user_key_column] = (
                user_keys if user_keys is not None else pa.nulls(n, self.descriptor.user_key_type))
        cols[self._v] = values if values is not None else pa.nulls(n, self.descriptor.value_type)
        self._store.write(self.name, kgs, pl.from_arrow(pa.table(cols)))

    def _lookup_values(self, keys: pa.Table, kgs: np.ndarray | None, seal: bool = True) -> pl.DataFrame:
        """keys joined with live values (``v`` null where absent or expired), in order."""
        return self._reader.lookup(self.name, keys, kgs, seal=seal)

    def _to_arrow(self, series: pl.Series, dtype: pa.DataType) -> pa.Array:
        arr = series.to_arrow()
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        return arr.cast(dtype)

    def clear(self) -> None:
        """Remove the current key's state."""
        _, p = self._pending()
        p.cleared, p.has_value, p.value = True, False, None
        p.appended.clear()
        p.entries.clear()

    def clear_batch(self, keys: pa.Table, key_groups: np.ndarray | None = None) -> None:
        """Remove the state of every key in ``keys``. ``key_groups``: as for ``StateStore.prepare_keys``."""
        keys, kgs = self._store.prepare_keys(keys, key_groups)
        self._write_batch(keys, kgs, OP_DELETE, None)


class _ValueLike(KeyedState):
    """Value, reducing and aggregating state: one stored value per key."""

    def _overlay_rows(self) -> list[tuple[tuple, int, int, Any, Any, int | None]]:
        # ``KeyedState._pending_entries`` inlined: a generator per key cost more than the rows.
        rows: list[tuple[tuple, int, int, Any, Any, int | None]] = []
        append = rows.append
        for key, p in self._overlay.items():
            if p.cleared:
                append((key, p.key_group, OP_DELETE, None, None, None))
            if p.has_value:
                append((key, p.key_group, OP_PUT, None, p.value, p.expire_at_ms))
        return rows

    def _stored(self) -> tuple[bool, Any]:
        key, kg = self._store.current_key()
        p = self._overlay.get(key)
        if p is not None and (p.has_value or p.cleared):
            if p.has_value and self._live(p.expire_at_ms):
                if self._refresh_on_read():
                    p.expire_at_ms = self._expire_at()
                return True, p.value
            return False, None
        hit = self._reader.point_get(self.name, key, kg)
        if hit is None:
            return False, None
        value, expire_at_ms = hit
        if not self._live(expire_at_ms):
            return False, None
        if self._refresh_on_read():
            self._put(value)
        return True, value

    def check(self, value: Any) -> None:
        """Raise what a per-key write of ``value`` would (a null, or a value that does not fit
        the declared type), writing nothing: for callers that batch their writes."""
        if value is None:
            raise ValueError(f"state {self.name!r}: values must not be null; call clear() instead")
        self._check(value, "value")

    def _put(self, value: Any) -> None:
        self.check(value)
        _, p = self._pending()
        p.value, p.has_value, p.expire_at_ms = value, True, self._expire_at()

    def exists(self) -> bool:
        return self._stored()[0]

    def get_batch(self, keys: pa.Table) -> pa.Array:
        """Stored value of each key (null where absent), aligned with ``keys``."""
        keys, kgs = self._store.checked_keys(keys)  # key groups: hashed by the lookup as it needs them
        # The per-key writes of this variable are sealed first; other variables' stay where they
        # are (they change nothing here, and sealing them would forget the indexes of the
        # prefetched keys' rows that a runner's per-key loop reads).
        res = self._lookup_values(keys, kgs, seal=bool(self._overlay))
        values = self._to_arrow(res.get_column(self._v), self.descriptor.value_type)
        if self._refresh_on_read():
            found = pc.is_valid(values)
            if pc.any(found).as_py():
                found_keys = keys.filter(found)
                found_kgs = (self._store.prepare_keys(found_keys)[1] if kgs is None
                             else kgs[found.to_numpy(zero_copy_only=False)])
                self._write_batch(found_keys, found_kgs, OP_PUT, values.filter(found))
        return values


class ValueState(_ValueLike):
    def get(self) -> Any:
        """The current key's value, or None."""
        return self._stored()[1]

    def update(self, value: Any) -> None:
        self._put(value)

    def update_batch(self, keys: pa.Table, values: pa.Array | list, key_groups: np.ndarray | None = None) -> None:
        """Set the value of each key; for a key given twice the last value wins.
        ``key_groups``: as for ``StateStore.prepare_keys``."""
        keys, kgs = self._store.prepare_keys(keys, key_groups)
        values = _arrow(values, self.descriptor.value_type, f"values for state {self.name!r}")
        _check_len(values, keys, self.name)
        self._write_batch(keys, kgs, OP_PUT, values)


class ReducingState(_ValueLike):
    """Keeps ``reduce_fn(reduce_fn(v1, v2), v3)...`` of the values added to a key."""

    def get(self) -> Any:
        return self._stored()[1]

    def add(self, value: Any) -> None:
        found, current = self._stored()
        self._put(self.descriptor.reduce_fn(current, value) if found else value)

    def add_batch(self, keys: pa.Table, values: pa.Array | list) -> None:
        """Add many values (several per key allowed), reduced per key and with the stored value.

        Vectorized when the descriptor names a column aggregation (``vectorized``),
        otherwise ``reduce_fn`` runs in Python per value.
        """
        keys, kgs = self._store.prepare_keys(keys)
        values = _arrow(values, self.descriptor.value_type, f"values for state {self.name!r}")
        _check_len(values, keys, self.name)
        names = self._store.key_names
        df = pl.from_arrow(keys).with_columns(pl.Series(self._v, values), pl.Series("_kg", kgs))
        agg = self.descriptor.vectorized
        if agg is not None:
            grouped = df.group_by([*names, "_kg"], maintain_order=True).agg(getattr(pl.col(self._v), agg)())
        else:
            fn = self.descriptor.reduce_fn
            grouped = df.group_by([*names, "_kg"], maintain_order=True).agg(pl.col(self._v))
            grouped = grouped.with_columns(pl.Series(self._v, [_fold(fn, vs) for vs in grouped[self._v].to_list()],
                                                     dtype=df.schema[self._v]))
        ukeys = grouped.select(names).to_arrow().cast(self._store.layout.key_schema)
        ukgs = grouped.get_column("_kg").to_numpy().astype(np.int32)
        stored = self._lookup_values(ukeys, ukgs).get_column(self._v)
        new = grouped.get_column(self._v)
        if agg is not None:
            both = pl.DataFrame({"a": stored, "b": new})
            combined = both.select(getattr(pl, f"{agg}_horizontal")("a", "b")).to_series()
        else:
            fn = self.descriptor.reduce_fn
            combined = pl.Series([b if a is None else fn(a, b) for a, b in zip(stored.to_list(), new.to_list(),
                                                                                  strict=True)], dtype=new.dtype)
        self._write_batch(ukeys, ukgs, OP_PUT, self._to_arrow(combined, self.descriptor.value_type))


def _fold(fn, values: list) -> Any:
    acc = values[0]
    for v in values[1:]:
        acc = fn(acc, v)
    return acc


class AggregatingState(_ValueLike):
    """Keeps an accumulator per key; ``get`` returns ``agg_fn.get_result(accumulator)``."""

    def get(self) -> Any:
        found, acc = self._stored()
        return self.descriptor.agg_fn.get_result(acc) if found else None

    def add(self, value: Any) -> None:
        fn = self.descriptor.agg_fn
        found, acc = self._stored()
        self._put(fn.add(value, acc if found else fn.create_accumulator()))

    def merge_accumulator(self, accumulator: Any) -> None:
        fn = self.descriptor.agg_fn
        found, acc = self._stored()
        self._put(fn.merge(acc, accumulator) if found else accumulator)

    def add_batch(self, keys: pa.Table, values: pa.Array | list) -> None:
        """Add many values; grouping is vectorized, ``agg_fn.add`` runs per value in Python."""
        keys, kgs = self._store.prepare_keys(keys)
        values = values.to_pylist() if isinstance(values, pa.Array | pa.ChunkedArray) else list(values)
        _check_len(values, keys, self.name)
        names = self._store.key_names
        df = pl.from_arrow(keys).with_columns(pl.Series("_kg", kgs), pl.Series("_i", np.arange(len(values))))
        grouped = df.group_by([*names, "_kg"], maintain_order=True).agg(pl.col("_i"))
        ukeys = grouped.select(names).to_arrow().cast(self._store.layout.key_schema)
        ukgs = grouped.get_column("_kg").to_numpy().astype(np.int32)
        stored = self._lookup_values(ukeys, ukgs).get_column(self._v).to_list()
        fn = self.descriptor.agg_fn
        accs = []
        for acc, idx in zip(stored, grouped.get_column("_i").to_list(), strict=True):
            acc = fn.create_accumulator() if acc is None else acc
            for i in idx:
                acc = fn.add(values[i], acc)
            accs.append(acc)
        accs = _arrow(accs, self.descriptor.value_type, f"accumulators of {self.name!r}")
        self._write_batch(ukeys, ukgs, OP_PUT, accs)

    def get_batch(self, keys: pa.Table) -> pa.Array:  # type: ignore[override]
        """Result of each key's accumulator (null where absent)."""
        accs = super().get_batch(keys).to_pylist()
        fn = self.descriptor.agg_fn
        return pa.array([None if a is None else fn.get_result(a) for a in accs], type=fn.result_type)


class ListState(KeyedState):
    def _pending_entries(self, key: tuple, p: _Pending):
        if p.cleared:
            yield key, p.key_group, OP_DELETE, None, None, None
        for value, expire in p.appended:
            yield key, p.key_group, OP_APPEND, None, value, expire

    def get(self) -> list:
        """The current key's elements in order (an empty list when none)."""
        key, kg = self._store.current_key()
        p = self._overlay.get(key)
        stored: list = []
        if p is None or not p.cleared:
            rows = self._reader.key_rows(self.name, key, kg, (self._v, EXPIRE_AT_MS, ORD))
            stored = [v for v, e, _ in sorted(rows, key=lambda r: r[2]) if self._live(e)]
        pending = [v for v, e in p.appended if self._live(e)] if p is not None else []
        result = stored + pending
        if self._refresh_on_read() and result:
            self.update(result)
        return result

    def exists(self) -> bool:
        return bool(self.get())

    def size(self) -> int:
        """How many live elements the current key's list holds (a read that refreshes no TTL)."""
        key, kg = self._store.current_key()
        p = self._overlay.get(key)
        n = 0
        if p is None or not p.cleared:
            n = sum(1 for _, e, _ in self._reader.key_rows(self.name, key, kg, (self._v, EXPIRE_AT_MS, ORD))
                    if self._live(e))
        return n + (sum(1 for _, e in p.appended if self._live(e)) if p is not None else 0)

    def add(self, value: Any) -> None:
        if value is None:
            raise ValueError(f"state {self.name!r}: list elements must not be null")
        self._check(value, "list element")
        _, p = self._pending()
        p.appended.append((value, self._expire_at()))

    def add_all(self, values: list) -> None:
        """Append every value, or none of them when one is invalid."""
        values = list(values)
        for v in values:
            self._check(v, "list element")
        for v in values:
            self.add(v)

    def update(self, values: list) -> None:
        """Replace the current key's list (unchanged when an element is invalid)."""
        values = list(values)
        for v in values:
            self._check(v, "list element")
        self.clear()
        self.add_all(values)

    def get_batch(self, keys: pa.Table) -> pa.ListArray:
        """Each key's list (empty when none), aligned with ``keys``."""
        keys, kgs = self._store.prepare_keys(keys)
        names = self._store.key_names
        live = self._reader.live_view(self.name, (), keys, kgs)
        lists = live.sort(ORD).group_by(names, maintain_order=True).agg(pl.col(self._v))
        res = pl.from_arrow(keys).join(lists, on=names, how="left", maintain_order="left")
        out = res.get_column(self._v).to_arrow()
        if isinstance(out, pa.ChunkedArray):
            out = out.combine_chunks()
        out = out.cast(pa.list_(self.descriptor.value_type))
        out = pc.if_else(pc.is_null(out), pa.scalar([], out.type), out)
        if self._refresh_on_read():
            found = res.filter(pl.col(self._v).is_not_null())
            if found.height:
                fkeys = found.select(names).to_arrow().cast(self._store.layout.key_schema)
                self.update_batch(fkeys, self._to_arrow(found.get_column(self._v),
                                                        pa.list_(self.descriptor.value_type)))
        return out

    def add_batch(self, keys: pa.Table, values: pa.Array | list) -> None:
        """Append ``values[i]`` to the list of ``keys[i]``, in row order."""
        keys, kgs = self._store.prepare_keys(keys)
        values = _arrow(values, self.descriptor.value_type, f"elements for state {self.name!r}")
        _check_len(values, keys, self.name)
        self._write_batch(keys, kgs, OP_APPEND, values)

    def update_batch(self, keys: pa.Table, lists: pa.Array | list) -> None:
        """Replace the list of each key with ``lists[i]`` (a list array aligned with ``keys``)."""
        keys, kgs = self._store.prepare_keys(keys)
        lists = _arrow(lists, pa.list_(self.descriptor.value_type), f"lists for state {self.name!r}")
        _check_len(lists, keys, self.name)
        last = _last_rows(keys)
        if len(last) < keys.num_rows:  # a key given twice: its last list replaces the earlier ones
            keys, kgs, lists = keys.take(last), kgs[last], lists.take(last)
        elems = _arrow(pc.list_flatten(lists), self.descriptor.value_type, f"elements for state {self.name!r}")
        self._write_batch(keys, kgs, OP_DELETE, None)
        if len(elems):
            parents = pc.list_parent_indices(lists)
            self._write_batch(keys.take(parents), kgs[parents.to_numpy()], OP_APPEND, elems)


class MapState(KeyedState):

    def __init__(self, store: StateStore, desc: StateDescriptor):
        super().__init__(store, desc)
        self._fits_user_key = _fits_checker(desc.user_key_type)

    def _check_user_key(self, user_key: Any) -> None:
        if user_key is None or not self._fits_user_key(user_key):
            _check_value(user_key, self.descriptor.user_key_type, f"map {self.name!r}: user key")

    def _pending_entries(self, key: tuple, p: _Pending):
        if p.cleared:
            yield key, p.key_group, OP_DELETE, None, None, None
        for uk, value, present, expire in p.entries.values():
            yield key, p.key_group, OP_PUT if present else OP_DELETE, uk, value, expire

    def _user_key_col(self) -> str:
        return self.descriptor.user_key_column

    def _entries(self) -> dict:
        """The current key's live map: {hashable user key: (user key, value)}."""
        key, kg = self._store.current_key()
        p = self._overlay.get(key)
        result: dict = {}
        if p is None or not p.cleared:
            stored = self._reader.key_map(self.name, key, kg, _hashable, _hashable_column)
            for h, (uk, v, e) in stored.items():
                if self._live(e):
                    result[h] = (uk, v)
        if p is not None:
            for h, (uk, value, present, expire) in p.entries.items():
                if present and self._live(expire):
                    result[h] = (uk, value)
                else:
                    result.pop(h, None)
        return result

    def _touch(self, entries: dict) -> None:
        if self._refresh_on_read():
            for uk, v in list(entries.values()):
                self.put(uk, v)

    def _entry(self, user_key: Any) -> tuple[Any, Any] | None:
        """(user key, value) of one live entry of the current key's map, or None: O(1)."""
        key, kg = self._store.current_key()
        h = _hashable(user_key)
        p = self._overlay.get(key)
        if p is not None:
            pending = p.entries.get(h)
            if pending is not None:
                uk, value, present, expire = pending
                return (uk, value) if present and self._live(expire) else None
            if p.cleared:
                return None
        stored = self._reader.key_map(self.name, key, kg, _hashable, _hashable_column).get(h)
        if stored is None or not self._live(stored[2]):
            return None
        return stored[0], stored[1]

    def get(self, user_key: Any) -> Any:
        hit = self._entry(user_key)
        if hit is None:
            return None
        if self._refresh_on_read():
            self._touch({0: hit})
        return hit[1]

    def contains(self, user_key: Any) -> bool:
        return self._entry(user_key) is not None

    def put(self, user_key: Any, value: Any) -> None:
        if user_key is None or value is None:
            raise ValueError(f"state {self.name!r}: map user keys and values must not be null")
        self._check_user_key(user_key)
        self._check(value, "value", kind="map")
        _, p = self._pending()
        p.entries[_hashable(user_key)] = (user_key, value, True, self._expire_at())

    def put_all(self, mapping: dict) -> None:
        for k, v in mapping.items():
            self.put(k, v)

    def remove(self, user_key: Any) -> None:
        # A null user key would be stored as a whole-map tombstone (see layout.py).
        self._check_user_key(user_key)
        _, p = self._pending()
        p.entries[_hashable(user_key)] = (user_key, None, False, None)

    def items(self) -> list[tuple[Any, Any]]:
        entries = self._entries()
        self._touch(entries)
        return list(entries.values())

    def keys(self) -> list:
        return [uk for uk, _ in self.items()]

    def values(self) -> list:
        return [v for _, v in self.items()]

    def is_empty(self) -> bool:
        return not self._entries()

    def size(self) -> int:
        """How many live entries the current key's map holds (a read that refreshes no TTL)."""
        return len(self._entries())

    def exists(self) -> bool:
        return not self.is_empty()

    def get_batch(self, keys: pa.Table, user_keys: pa.Array | list) -> pa.Array:
        """Value of ``(keys[i], user_keys[i])`` (null where absent), aligned with the rows."""
        keys, kgs = self._store.prepare_keys(keys)
        uks = _arrow(user_keys, self.descriptor.user_key_type, f"user keys for map {self.name!r}")
        _check_len(uks, keys, self.name)
        extra = pl.from_arrow(pa.table({self._user_key_col(): uks}))
        res = self._reader.lookup(self.name, keys, kgs, on_extra=extra)
        values = self._to_arrow(res.get_column(self._v), self.descriptor.value_type)
        if self._refresh_on_read():
            found = pc.is_valid(values)
            if pc.any(found).as_py():
                self._write_batch(keys.filter(found), kgs[found.to_numpy(zero_copy_only=False)], OP_PUT,
                                  values.filter(found), user_keys=uks.filter(found))
        return values

    def items_batch(self, keys: pa.Table) -> pa.Table:
        """Every live entry of the given keys: columns ``_row`` (index into ``keys``), user key, value."""
        keys, kgs = self._store.prepare_keys(keys)
        names = self._store.key_names
        live = self._reader.live_view(self.name, (), keys, kgs)
        left = pl.from_arrow(keys).with_row_index(ROW)
        res = left.join(live, on=names, how="inner", maintain_order="left")
        out = res.select([pl.col(ROW).cast(pl.Int64), self._user_key_col(), self._v]).to_arrow()
        return out.cast(pa.schema([(ROW, pa.int64()), (self._user_key_col(), self.descriptor.user_key_type),
                                   (self._v, self.descriptor.value_type)]))

    def put_batch(self, keys: pa.Table, user_keys: pa.Array | list, values: pa.Array | list) -> None:
        keys, kgs = self._store.prepare_keys(keys)
        uks = _arrow(user_keys, self.descriptor.user_key_type, f"user keys for map {self.name!r}")
        values = _arrow(values, self.descriptor.value_type, f"values for map {self.name!r}")
        _check_len(uks, keys, self.name)
        _check_len(values, keys, self.name)
        self._write_batch(keys, kgs, OP_PUT, values, user_keys=uks)

    def remove_batch(self, keys: pa.Table, user_keys: pa.Array | list) -> None:
        keys, kgs = self._store.prepare_keys(keys)
        uks = _arrow(user_keys, self.descriptor.user_key_type, f"user keys for map {self.name!r}")
        _check_len(uks, keys, self.name)
        self._write_batch(keys, kgs, OP_DELETE, None, user_keys=uks)


def _check_len(values, keys: pa.Table, name: str) -> None:
    if len(values) != keys.num_rows:
        raise ValueError(f"state {name!r}: {len(values)} values for {keys.num_rows} keys; they must align")


STATE_CLASSES: dict[StateKind, type[KeyedState]] = {
    StateKind.VALUE: ValueState,
    StateKind.LIST: ListState,
    StateKind.MAP: MapState,
    StateKind.REDUCING: ReducingState,
    StateKind.AGGREGATING: AggregatingState,
}

__all__ = ["AggregatingState", "KeyedState", "ListState", "MapState", "ReducingState", "ValueState"]
