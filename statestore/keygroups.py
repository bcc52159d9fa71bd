"""Key groups: the unit of state partitioning, ownership and rescale.

A key belongs to key group ``pmod(xxhash64(k1, k2, ..., seed=42), max_parallelism)``,
bit for bit Spark SQL's ``pmod(xxhash64(k1, k2, ...), N)``, so Spark can route rows to key
groups inside the JVM while Python computes the same number for lookups. The hash is
vectorized over Arrow arrays with numpy (uint64 arithmetic wraps like Java's long).

Spark's per-type hashing, which this module reproduces (``XxHash64Function``):

* boolean, byte, short, int, date: ``hashInt`` of the 32-bit value (bool as 1/0,
  date as days since the epoch);
* long, timestamp: ``hashLong`` (timestamps as microseconds since the epoch);
* string (UTF-8 bytes), binary: ``hashUnsafeBytes``, standard XXH64 of the bytes.

Several key columns chain: the hash of column i is the seed of column i+1. A null value
leaves the running hash unchanged in Spark; keys here must not be null (checked at the
boundary by the store).

The functions are stateless and thread safe. ``KeyGroupRange`` is an immutable value.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from statestore.errors import UnsupportedKeyTypeError

# Stored in every state table (key_group column): changing the seed or the hash breaks
# every existing table, and Spark's routing.
SPARK_XXHASH64_SEED = 42
DEFAULT_MAX_PARALLELISM = 128
MAX_PARALLELISM_UPPER_BOUND = 1 << 15

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _fmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * _P2
    h = h ^ (h >> np.uint64(29))
    h = h * _P3
    return h ^ (h >> np.uint64(32))


def _round(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    acc = acc + lane * _P2
    acc = _rotl(acc, 31)
    return acc * _P1


def _merge_round(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    h = h ^ _round(np.zeros_like(v), v)
    return h * _P1 + _P4


def hash_int(values: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Spark's ``XXH64.hashInt`` for int32 values (uint64 results, one per value)."""
    v = values.astype(np.int32, copy=False).view(np.uint32).astype(np.uint64)
    h = seeds + _P5 + np.uint64(4)
    h = h ^ (v * _P1)
    h = _rotl(h, 23) * _P2 + _P3
    return _fmix(h)


def hash_long(values: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    """Spark's ``XXH64.hashLong`` for int64 values (uint64 results, one per value)."""
    v = values.astype(np.int64, copy=False).view(np.uint64)
    h = seeds + _P5 + np.uint64(8)
    h = h ^ _round(np.zeros_like(v), v)
    h = _rotl(h, 27) * _P1 + _P4
    return _fmix(h)


def _lanes(buf: np.ndarray, m: int, length: int, pos: int, dtype: str) -> np.ndarray:
    """The ``dtype`` word at byte ``pos`` of each of the ``m`` strings of ``length`` bytes
    stored back to back in ``buf``: a strided view, no copy (numpy reads unaligned words)."""
    return np.ndarray((m,), dtype=dtype, buffer=buf, offset=pos, strides=(length,))


def _hash_equal_length(buf: np.ndarray, m: int, length: int, seeds: np.ndarray) -> np.ndarray:
    """XXH64 of ``m`` byte strings of one common ``length``, stored back to back in the uint8
    array ``buf`` (``m * length`` bytes): each 8, 4 and 1-byte lane is read in place."""
    nstripes = length // 32
    if nstripes:
        v = [seeds + _P1 + _P2, seeds + _P2, seeds.copy(), seeds - _P1]
        for stripe in range(nstripes):
            for lane in range(4):
                v[lane] = _round(v[lane], _lanes(buf, m, length, 32 * stripe + 8 * lane, "<u8"))
        h = _rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)
        for lane in range(4):
            h = _merge_round(h, v[lane])
    else:
        h = seeds + _P5
    h = h + np.uint64(length)
    pos = nstripes * 32
    while length - pos >= 8:
        k = _round(np.zeros(m, dtype=np.uint64), _lanes(buf, m, length, pos, "<u8"))
        h = _rotl(h ^ k, 27) * _P1 + _P4
        pos += 8
    if length - pos >= 4:
        w = _lanes(buf, m, length, pos, "<u4").astype(np.uint64)
        h = _rotl(h ^ (w * _P1), 23) * _P2 + _P3
        pos += 4
    while pos < length:
        h = _rotl(h ^ (_lanes(buf, m, length, pos, "u1").astype(np.uint64) * _P5), 11) * _P1
        pos += 1
    return _fmix(h)


# Few distinct lengths are picked out by one comparison each; more, or lengths far apart, are
# grouped by a sort.
_LENGTHS_BY_MASK = 8
_LENGTH_SPREAD_COUNTED = 4096
# Long columns are hashed in slices of this many rows, so that the dozens of temporary uint64
# arrays of the arithmetic stay in the CPU's cache (500k keys of 6-11 bytes: 43 -> 22 ms).
_HASH_SLICE_ROWS = 65536


def hash_binary(arr: pa.Array, seeds: np.ndarray) -> np.ndarray:
    """Standard XXH64 of each value of a binary or large binary array (Spark's
    ``hashUnsafeBytes``).

    Rows are grouped by length and each group is hashed as ``m`` strings of one length whose
    words are read in place from one fixed-size buffer: the array's own data when every value
    has the same length (ids, UUIDs, fixed-format keys: no copy at all), else the group taken
    out by Arrow. The numpy work is proportional to the total byte length plus the number of
    distinct lengths.
    """
    out = np.empty(len(arr), dtype=np.uint64)
    if not len(arr):
        return out
    lengths = pc.binary_length(arr).to_numpy()
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo == hi:
        wide = pa.types.is_large_binary(arr.type)
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64 if wide else np.int32, count=len(arr) + 1,
                                offset=arr.offset * (8 if wide else 4))
        data = np.frombuffer(arr.buffers()[2], dtype=np.uint8) if lo else np.zeros(0, np.uint8)
        return _hash_equal_length(data[int(offsets[0]):int(offsets[-1])], len(arr), lo, seeds)
    present = np.flatnonzero(np.bincount(lengths - lo)) + lo if hi - lo < _LENGTH_SPREAD_COUNTED else None
    if present is not None and len(present) <= _LENGTHS_BY_MASK:
        groups = [(int(n), np.flatnonzero(lengths == n)) for n in present]
    else:
        order = np.argsort(lengths, kind="stable")
        bounds = np.flatnonzero(np.diff(lengths[order])) + 1
        groups = [(int(lengths[rows[0]]), rows) for rows in np.split(order, bounds)]
    for n_bytes, rows in groups:
        if n_bytes:
            fixed = arr.take(pa.array(rows)).cast(pa.binary(n_bytes))
            buf = np.frombuffer(fixed.buffers()[1], dtype=np.uint8, count=len(rows) * n_bytes,
                                offset=fixed.offset * n_bytes)
        else:
            buf = np.zeros(0, np.uint8)
        out[rows] = _hash_equal_length(buf, len(rows), n_bytes, seeds[rows])
    return out


def _hash_column(arr: pa.Array | pa.ChunkedArray, seeds: np.ndarray, name: str) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    t = arr.type
    if arr.null_count:
        raise ValueError(f"key column {name!r} has {arr.null_count} null value(s): keys must not be null")
    if pa.types.is_dictionary(t):
        return _hash_column(arr.dictionary_decode(), seeds, name)
    if pa.types.is_boolean(t):
        return hash_int(np.asarray(arr.cast(pa.int32())), seeds)
    if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_int32(t):
        return hash_int(np.asarray(arr.cast(pa.int32())), seeds)
    if pa.types.is_int64(t):
        return hash_long(np.asarray(arr), seeds)
    if pa.types.is_date32(t):
        return hash_int(np.asarray(arr.view(pa.int32())), seeds)
    if pa.types.is_timestamp(t):
        micros = arr.cast(pa.timestamp("us", tz=t.tz), safe=False).view(pa.int64())
        return hash_long(np.asarray(micros), seeds)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t) or \
            pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return hash_binary(arr.cast(pa.large_binary()), seeds)
    raise UnsupportedKeyTypeError(name, t)


def check_key_type(name: str, t: pa.DataType) -> None:
    """Raise UnsupportedKeyTypeError unless ``t`` is a key type Spark hashes like we do."""
    if pa.types.is_dictionary(t):
        return check_key_type(name, t.value_type)
    ok = (
        pa.types.is_boolean(t) or pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_int32(t)
        or pa.types.is_int64(t) or pa.types.is_date32(t) or pa.types.is_timestamp(t)
        or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
        or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)
    )
    if not ok:
        raise UnsupportedKeyTypeError(name, t)


def spark_xxhash64(columns: Sequence[pa.Array | pa.ChunkedArray], names: Sequence[str] | None = None) -> np.ndarray:
    """Spark SQL's ``xxhash64(c1, c2, ...)`` as a signed int64 numpy array."""
    if not columns:
        raise ValueError("at least one key column is needed")
    names = list(names) if names is not None else [f"key{i}" for i in range(len(columns))]
    n = len(columns[0])
    arrays = []
    for col, name in zip(columns, names, strict=True):
        if len(col) != n:
            raise ValueError(f"key column {name!r} has {len(col)} rows, expected {n}")
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        if col.null_count:
            raise ValueError(f"key column {name!r} has {col.null_count} null value(s): keys must not be null")
        arrays.append(col)
    out = np.empty(n, dtype=np.uint64)
    for lo in range(0, n, _HASH_SLICE_ROWS):
        m = min(_HASH_SLICE_ROWS, n - lo)
        seeds = np.full(m, SPARK_XXHASH64_SEED, dtype=np.uint64)
        for col, name in zip(arrays, names, strict=True):
            seeds = _hash_column(col.slice(lo, m), seeds, name)
        out[lo:lo + m] = seeds
    return out.view(np.int64)


def assign_key_groups(keys: pa.Table | pa.RecordBatch | Sequence[pa.Array], max_parallelism: int) -> np.ndarray:
    """Key group (int32) of every row: ``pmod(xxhash64(keys...), max_parallelism)``."""
    check_max_parallelism(max_parallelism)
    if isinstance(keys, pa.Table | pa.RecordBatch):
        cols, names = list(keys.columns), keys.schema.names
    else:
        cols, names = list(keys), None
    h = spark_xxhash64(cols, names)
    # numpy's % on signed ints is floor modulo, which equals Spark's pmod for positive N.
    return (h % np.int64(max_parallelism)).astype(np.int32)


def assign_key_group(key: tuple, key_schema: pa.Schema, max_parallelism: int) -> int:
    """Key group of one key tuple (values in the order of ``key_schema``).

    Plain Python values (str, bytes, bool, int, datetime.date, datetime.datetime) take a
    scalar path through the ``xxhash`` C binding, about 100x cheaper than building Arrow
    arrays for one row; anything else goes through the vectorized path. Both agree bit
    for bit (tested).
    """
    check_max_parallelism(max_parallelism)
    seed = SPARK_XXHASH64_SEED
    for v, f in zip(key, key_schema, strict=True):
        data = _scalar_bytes(v, f.type)
        if data is None:
            cols = [pa.array([x], type=g.type) for x, g in zip(key, key_schema, strict=True)]
            return int(assign_key_groups(pa.Table.from_arrays(cols, schema=key_schema), max_parallelism)[0])
        seed = xxhash.xxh64_intdigest(data, seed=seed)
    signed = seed - (1 << 64) if seed >= 1 << 63 else seed
    return signed % max_parallelism


_EPOCH_DATE = datetime.date(1970, 1, 1)
_EPOCH_UTC = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MICRO = datetime.timedelta(microseconds=1)


def _scalar_bytes(v: object, t: pa.DataType) -> bytes | None:
    """The bytes Spark hashes for one value of type ``t``, or None when the value is not a
    plain Python value of that type (the caller then takes the vectorized path)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if isinstance(v, bool):
        return int(v).to_bytes(4, "little", signed=True) if pa.types.is_boolean(t) else None
    if isinstance(v, int):
        if pa.types.is_int8(t) or pa.types.is_int16(t) or pa.types.is_int32(t):
            bits = t.bit_width
            return v.to_bytes(4, "little", signed=True) if -(1 << (bits - 1)) <= v < 1 << (bits - 1) else None
        if pa.types.is_int64(t):
            return v.to_bytes(8, "little", signed=True) if -(1 << 63) <= v < 1 << 63 else None
        return None
    if isinstance(v, str):
        return v.encode("utf-8") if _is_string(t) else None
    if isinstance(v, bytes):
        return v if _is_binary(t) else None
    if isinstance(v, datetime.datetime):
        if not pa.types.is_timestamp(t):
            return None
        aware = v if v.tzinfo is not None else v.replace(tzinfo=datetime.UTC)
        return ((aware - _EPOCH_UTC) // _MICRO).to_bytes(8, "little", signed=True)
    if isinstance(v, datetime.date):
        return (v - _EPOCH_DATE).days.to_bytes(4, "little", signed=True) if pa.types.is_date32(t) else None
    return None


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


def check_max_parallelism(max_parallelism: int) -> None:
    if not isinstance(max_parallelism, int) or not 1 <= max_parallelism <= MAX_PARALLELISM_UPPER_BOUND:
        raise ValueError(
            f"max_parallelism must be an int in [1, {MAX_PARALLELISM_UPPER_BOUND}], got {max_parallelism!r}"
        )


@dataclass(frozen=True, slots=True)
class KeyGroupRange:
    """An inclusive range [start, end] of key groups; ``KeyGroupRange.EMPTY`` has no groups."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or (self.end < self.start and (self.start, self.end) != (0, -1)):
            raise ValueError(f"invalid key group range [{self.start}, {self.end}]")

    @classmethod
    def of(cls, start: int, end: int) -> KeyGroupRange:
        return cls(start, end) if end >= start else EMPTY_KEY_GROUP_RANGE

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __iter__(self):
        return iter(range(self.start, self.end + 1))

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int | np.integer) and self.start <= key_group <= self.end

    def is_empty(self) -> bool:
        return self.end < self.start

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        return KeyGroupRange.of(max(self.start, other.start), min(self.end, other.end))

    def contains_array(self, key_groups: np.ndarray) -> np.ndarray:
        return (key_groups >= self.start) & (key_groups <= self.end)

    def __str__(self) -> str:
        return "[]" if self.is_empty() else f"[{self.start}, {self.end}]"


EMPTY_KEY_GROUP_RANGE = KeyGroupRange(0, -1)
KeyGroupRange.EMPTY = EMPTY_KEY_GROUP_RANGE  # type: ignore[attr-defined]


def compute_key_group_range_for_task(max_parallelism: int, parallelism: int, task_index: int) -> KeyGroupRange:
    """Key groups owned by task ``task_index`` of ``parallelism`` (Flink's formula).

    REQUIRES: 1 <= parallelism <= max_parallelism and 0 <= task_index < parallelism.
    The ranges of all tasks are contiguous, disjoint and cover [0, max_parallelism - 1].
    """
    check_max_parallelism(max_parallelism)
    if not 1 <= parallelism <= max_parallelism:
        raise ValueError(f"parallelism must be in [1, max_parallelism={max_parallelism}], got {parallelism}")
    if not 0 <= task_index < parallelism:
        raise ValueError(f"task_index must be in [0, {parallelism - 1}], got {task_index}")
    start = (task_index * max_parallelism + parallelism - 1) // parallelism
    end = ((task_index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange.of(start, end)


def task_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """Index of the task that owns ``key_group`` at ``parallelism`` (inverse of the range formula)."""
    return key_group * parallelism // max_parallelism


