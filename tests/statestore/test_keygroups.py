"""Unit tests of statestore.keygroups (no Spark).

Every hash is checked against an independent reference: the ``xxhash`` package's standard
XXH64 (seed 42) over the bytes Spark feeds it (little-endian 4-byte ints for
bool/byte/short/int/date, little-endian 8-byte longs for long/timestamp micros, raw bytes
for string/binary). Several key columns chain: the hash of column i seeds column i+1.
Key group ranges are checked against Flink's formula written with exact fractions and
against the partition properties (contiguous, disjoint, covering).
"""

from __future__ import annotations

import datetime as dt
import math
import struct
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from statestore import keygroups as kg
from statestore.errors import UnsupportedKeyTypeError
from statestore.keygroups import (
    EMPTY_KEY_GROUP_RANGE,
    KeyGroupRange,
    assign_key_group,
    assign_key_groups,
    check_key_type,
    compute_key_group_range_for_task,
    spark_xxhash64,
    task_for_key_group,
)

SEED = 42
U64 = 1 << 64
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
EPOCH_DATE = dt.date(1970, 1, 1)
EPOCH_TS = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


# --------------------------------------------------------------------------- references


def ref_int(v: int, seed: int = SEED) -> int:
    """Spark hashInt: XXH64 of the 4 little-endian bytes of a 32-bit int (unsigned result)."""
    return xxhash.xxh64_intdigest(struct.pack("<i", v), seed=seed)


def ref_long(v: int, seed: int = SEED) -> int:
    """Spark hashLong: XXH64 of the 8 little-endian bytes of a 64-bit long (unsigned result)."""
    return xxhash.xxh64_intdigest(struct.pack("<q", v), seed=seed)


def ref_bytes(b: bytes, seed: int = SEED) -> int:
    return xxhash.xxh64_intdigest(b, seed=seed)


def to_signed(u: int) -> int:
    return u - U64 if u >= 1 << 63 else u


def java_pmod(a: int, n: int) -> int:
    """Spark's pmod(a, n) with Java's truncating remainder, written out explicitly."""
    r = abs(a) % n
    if a < 0:
        r = -r
    return (r + n) % n if r < 0 else r


def ref_value(type_: pa.DataType, v, seed: int) -> int:
    """Reference hash of one python value of Arrow type ``type_`` (as to_pylist returns it)."""
    if pa.types.is_dictionary(type_):
        return ref_value(type_.value_type, v, seed)
    if pa.types.is_boolean(type_):
        return ref_int(1 if v else 0, seed)
    if pa.types.is_int8(type_) or pa.types.is_int16(type_) or pa.types.is_int32(type_):
        return ref_int(v, seed)
    if pa.types.is_int64(type_):
        return ref_long(v, seed)
    if pa.types.is_date32(type_):
        return ref_int((v - EPOCH_DATE).days, seed)
    if pa.types.is_timestamp(type_):
        if v.tzinfo is None:
            v = v.replace(tzinfo=dt.UTC)
        delta = v - EPOCH_TS
        micros = (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
        return ref_long(micros, seed)
    if pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_):
        return ref_bytes(v.encode("utf-8"), seed)
    return ref_bytes(bytes(v), seed)


def ref_row_hashes(columns: list[pa.Array | pa.ChunkedArray]) -> list[int]:
    """Signed Spark xxhash64 of each row, chaining the columns, from python values."""
    pylists = [c.to_pylist() for c in columns]
    out = []
    for i in range(len(columns[0])):
        h = SEED
        for col, values in zip(columns, pylists, strict=True):
            h = ref_value(col.type, values[i], h)
        out.append(to_signed(h))
    return out


def assert_hashes(columns, names=None) -> np.ndarray:
    got = spark_xxhash64(columns, names)
    assert got.dtype == np.int64
    assert got.tolist() == ref_row_hashes(list(columns))
    return got


def random_strings(rng: np.random.Generator, n: int, max_len: int = 100) -> list[str]:
    alphabet = [*"abcXYZ019 _-", "é", "ß", "Ж", "中", "語", "€", "😀", "𝄞", "\u0000"]
    return ["".join(rng.choice(alphabet, size=int(rng.integers(0, max_len + 1)))) for _ in range(n)]


# --------------------------------------------------------------------------- low-level hashes

SEEDS_U64 = [0, 1, SEED, U64 - 1, 0x9E3779B185EBCA87, 1 << 63]


def test_hash_long_matches_xxh64_of_little_endian_8_bytes():
    rng = np.random.default_rng(1)
    values = np.concatenate(
        [np.array([0, 1, -1, I64_MIN, I64_MAX, I32_MIN, I32_MAX, 1 << 32], dtype=np.int64),
         rng.integers(I64_MIN, I64_MAX, size=500, dtype=np.int64, endpoint=True)]
    )
    for seed in SEEDS_U64:
        seeds = np.full(len(values), seed, dtype=np.uint64)
        got = kg.hash_long(values, seeds)
        assert got.dtype == np.uint64
        assert got.tolist() == [ref_long(int(v), seed) for v in values]


def test_hash_int_matches_xxh64_of_little_endian_4_bytes():
    rng = np.random.default_rng(2)
    values = np.concatenate(
        [np.array([0, 1, -1, I32_MIN, I32_MAX, 127, -128, 32767, -32768], dtype=np.int32),
         rng.integers(I32_MIN, I32_MAX, size=500, dtype=np.int32, endpoint=True)]
    )
    for seed in SEEDS_U64:
        seeds = np.full(len(values), seed, dtype=np.uint64)
        got = kg.hash_int(values, seeds)
        assert got.dtype == np.uint64
        assert got.tolist() == [ref_int(int(v), seed) for v in values]


def test_hash_int_and_long_with_per_row_seeds():
    rng = np.random.default_rng(3)
    seeds = rng.integers(0, U64 - 1, size=300, dtype=np.uint64, endpoint=True)
    longs = rng.integers(I64_MIN, I64_MAX, size=300, dtype=np.int64, endpoint=True)
    ints = rng.integers(I32_MIN, I32_MAX, size=300, dtype=np.int32, endpoint=True)
    assert kg.hash_long(longs, seeds).tolist() == [
        ref_long(int(v), int(s)) for v, s in zip(longs, seeds, strict=True)
    ]
    assert kg.hash_int(ints, seeds).tolist() == [
        ref_int(int(v), int(s)) for v, s in zip(ints, seeds, strict=True)
    ]


@given(v=st.integers(I64_MIN, I64_MAX), seed=st.integers(0, U64 - 1))
@settings(max_examples=300, deadline=None)
def test_hash_long_property(v, seed):
    got = kg.hash_long(np.array([v], dtype=np.int64), np.array([seed], dtype=np.uint64))
    assert int(got[0]) == ref_long(v, seed)


@given(v=st.integers(I32_MIN, I32_MAX), seed=st.integers(0, U64 - 1))
@settings(max_examples=300, deadline=None)
def test_hash_int_property(v, seed):
    got = kg.hash_int(np.array([v], dtype=np.int32), np.array([seed], dtype=np.uint64))
    assert int(got[0]) == ref_int(v, seed)


def test_hash_bytes_every_length_0_to_100():
    """Lengths 0..100 cross the 4-byte, 8-byte and 32-byte (stripe) boundaries several times."""
    rng = np.random.default_rng(4)
    blobs = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in range(101)]
    blobs += [bytes(n) for n in range(101)] + [b"\xff" * n for n in range(101)]
    rng.shuffle(blobs)
    for seed in SEEDS_U64:
        seeds = np.full(len(blobs), seed, dtype=np.uint64)
        got = kg.hash_binary(pa.array(blobs, pa.binary()), seeds)
        assert got.tolist() == [ref_bytes(b, seed) for b in blobs]


@given(blobs=st.lists(st.binary(max_size=150), max_size=40), seed=st.integers(0, U64 - 1))
@settings(max_examples=200, deadline=None)
def test_hash_bytes_property(blobs, seed):
    got = kg.hash_binary(pa.array(blobs, pa.large_binary()), np.full(len(blobs), seed, dtype=np.uint64))
    assert got.tolist() == [ref_bytes(b, seed) for b in blobs]


def test_hash_bytes_empty_input():
    got = kg.hash_binary(pa.array([], pa.binary()), np.zeros(0, np.uint64))
    assert got.shape == (0,)


# --------------------------------------------------------------------------- strings and binary


def test_empty_string_and_known_xxh64_values():
    # xxh64("", seed=42) is a fixed constant of the XXH64 spec, independent of this module.
    got = spark_xxhash64([pa.array(["", "a", "abc"])])
    assert got.tolist() == [to_signed(ref_bytes(s, SEED)) for s in (b"", b"a", b"abc")]
    assert to_signed(ref_bytes(b"", SEED)) == to_signed(xxhash.xxh64(b"", seed=42).intdigest())


@pytest.mark.parametrize("type_", [pa.string(), pa.large_string(), pa.string_view()], ids=str)
def test_strings_lengths_0_to_100_and_multibyte_utf8(type_):
    rng = np.random.default_rng(5)
    ascii_ = ["x" * n for n in range(101)]
    multi = ["é" * n for n in range(51)] + ["😀" * n for n in range(26)] + ["中" * n for n in range(34)]
    values = ascii_ + multi + random_strings(rng, 300) + ["", "", "\u0000", " "]
    assert_hashes([pa.array(values, type=type_)])


@pytest.mark.parametrize("type_", [pa.binary(), pa.large_binary(), pa.binary_view()], ids=str)
def test_binary(type_):
    rng = np.random.default_rng(6)
    values = [rng.bytes(int(k)) for k in rng.integers(0, 101, size=300)]
    values += [b"", b"\x00", b"\xff" * 33, bytes(range(256))]
    assert_hashes([pa.array(values, type=type_)])


def test_string_and_binary_of_same_bytes_hash_equal():
    s = ["", "a", "héllo wörld", "x" * 40]
    assert spark_xxhash64([pa.array(s)]).tolist() == spark_xxhash64(
        [pa.array([v.encode() for v in s], type=pa.binary())]
    ).tolist()


@pytest.mark.parametrize(
    "type_", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()], ids=str
)
def test_sliced_variable_length_arrays(type_):
    rng = np.random.default_rng(7)
    values = random_strings(rng, 200)
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
        values = [v.encode() for v in values]
    full = pa.array(values, type=type_)
    for off, length in [(1, 50), (37, 100), (199, 1), (0, 0), (150, 50), (13, 0)]:
        sliced = full.slice(off, length)
        assert sliced.offset == off
        got = assert_hashes([sliced])
        assert len(got) == length


@pytest.mark.parametrize("type_", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()], ids=str)
@pytest.mark.parametrize("length", [1, 3, 4, 7, 8, 11, 32, 45])
def test_values_of_one_length_hash_in_place_sliced_and_chunked(type_, length):
    """Every value of one length: the bytes are hashed where Arrow keeps them (no copy), so the
    array's offset and its first value's data offset must both be honoured."""
    rng = np.random.default_rng(length)
    values = [bytes(rng.integers(0, 256, size=length, dtype=np.uint8)) for _ in range(60)]
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        values = ["".join(rng.choice(list("abcXYZ019 _-"), size=length)) for _ in range(60)]
    assert {len(v if isinstance(v, bytes) else v.encode()) for v in values} == {length}
    full = pa.array(values, type=type_)
    for off, n in [(0, 60), (1, 50), (37, 23), (59, 1)]:
        assert_hashes([full.slice(off, n)])
    assert_hashes([pa.chunked_array([full.slice(5, 10), full.slice(0, 3)])])
    raw = [v if isinstance(v, bytes) else v.encode() for v in values]
    for binary in (pa.binary(), pa.large_binary()):  # hash_binary itself takes both offset widths
        part = pa.array(raw, binary).slice(7, 20)
        got = kg.hash_binary(part, np.full(20, SEED, dtype=np.uint64))
        assert got.tolist() == [ref_bytes(b) for b in raw[7:27]]


def test_many_distinct_lengths_and_a_wide_spread_group_by_sort():
    """More distinct lengths than are picked out one by one, and lengths too far apart for a
    count per length: both group rows by sorting them by length."""
    rng = np.random.default_rng(11)
    many = [rng.bytes(int(n)) for n in rng.integers(0, 60, size=400)]
    assert len({len(v) for v in many}) > kg._LENGTHS_BY_MASK
    assert_hashes([pa.array(many, pa.binary())])
    spread = [b"a", rng.bytes(5000), b"", rng.bytes(4097), b"bc", rng.bytes(5000)]
    assert_hashes([pa.array(spread, pa.large_binary())])


def test_columns_longer_than_a_hash_slice_chain_across_slices(monkeypatch):
    """Long inputs are hashed slice by slice: every slice must chain every column, and the
    slices must land in their rows (a small slice size makes the test cross many)."""
    monkeypatch.setattr(kg, "_HASH_SLICE_ROWS", 7)
    rng = np.random.default_rng(12)
    n = 100
    strings = pa.chunked_array([random_strings(rng, 40, max_len=12), random_strings(rng, n - 40, max_len=12)])
    ids = pa.array(rng.integers(I64_MIN, I64_MAX, size=n, dtype=np.int64))
    same = pa.array([f"k{i:04d}" for i in range(n)]).slice(0, n)
    assert_hashes([strings, ids, same])
    monkeypatch.setattr(kg, "_HASH_SLICE_ROWS", 1 << 16)
    assert_hashes([strings, ids, same])


def test_a_null_key_is_refused_with_the_whole_column_s_count():
    col = pa.chunked_array([["a", None], [None, "b", None]])
    with pytest.raises(ValueError, match=r"key column 'user' has 3 null value\(s\)"):
        spark_xxhash64([col], ["user"])


def test_string_array_with_only_empty_values():
    arr = pa.array(["", "", ""])
    assert spark_xxhash64([arr]).tolist() == [to_signed(ref_bytes(b""))] * 3
    assert spark_xxhash64([arr.slice(1)]).tolist() == [to_signed(ref_bytes(b""))] * 2


def test_chunked_arrays():
    rng = np.random.default_rng(8)
    strings = random_strings(rng, 120)
    chunked = pa.chunked_array([strings[:10], strings[10:10], strings[10:70], strings[70:]])
    assert_hashes([chunked])
    longs = pa.chunked_array([pa.array([1, -2, 3], pa.int64()), pa.array([I64_MIN, I64_MAX], pa.int64())])
    assert_hashes([longs])
    single = pa.chunked_array([pa.array(strings[:5]).slice(2)])
    assert_hashes([single])
    empty = pa.chunked_array([], type=pa.string())
    assert spark_xxhash64([empty]).shape == (0,)


def test_dictionary_arrays():
    dict_str = pa.DictionaryArray.from_arrays(
        pa.array([2, 0, 1, 2, 2, 0, 3], pa.int32()), pa.array(["b", "", "日本語", "x" * 70])
    )
    got = assert_hashes([dict_str])
    assert got.tolist() == spark_xxhash64([dict_str.dictionary_decode()]).tolist()
    # sliced dictionary array, and a dictionary-encoded int column
    assert_hashes([dict_str.slice(2, 4)])
    dict_int = pa.array([5, -7, 5, 5, I64_MIN], pa.int64()).dictionary_encode()
    assert pa.types.is_dictionary(dict_int.type)
    assert_hashes([dict_int])
    chunked_dict = pa.chunked_array([dict_str.slice(0, 3), dict_str.slice(3)])
    assert_hashes([chunked_dict])


# --------------------------------------------------------------------------- fixed-width types


def test_bool_hashes_as_int_1_or_0():
    arr = pa.array([True, False, True, True, False, False, False, True, True, False, True])
    got = spark_xxhash64([arr])
    assert got.tolist() == [to_signed(ref_int(1 if b else 0)) for b in arr.to_pylist()]
    # bit-packed slices at non-byte-aligned offsets
    for off in range(1, 9):
        assert_hashes([arr.slice(off)])


@pytest.mark.parametrize(
    ("type_", "lo", "hi"),
    [(pa.int8(), -128, 127), (pa.int16(), -32768, 32767), (pa.int32(), I32_MIN, I32_MAX)],
    ids=["int8", "int16", "int32"],
)
def test_small_ints_hash_as_sign_extended_int(type_, lo, hi):
    rng = np.random.default_rng(9)
    values = [lo, hi, 0, -1, 1, *rng.integers(lo, hi, size=300, endpoint=True).tolist()]
    arr = pa.array(values, type=type_)
    got = spark_xxhash64([arr])
    assert got.tolist() == [to_signed(ref_int(v)) for v in values]
    assert_hashes([arr.slice(3, 100)])


def test_int64():
    rng = np.random.default_rng(10)
    values = [I64_MIN, I64_MAX, 0, -1, 1, 1 << 32]
    values += rng.integers(I64_MIN, I64_MAX, size=300, dtype=np.int64, endpoint=True).tolist()
    arr = pa.array(values, type=pa.int64())
    assert spark_xxhash64([arr]).tolist() == [to_signed(ref_long(v)) for v in values]
    assert_hashes([arr.slice(5, 50)])


def test_small_int_differs_from_long_of_same_value():
    # byte/short/int hash 4 bytes, long hashes 8: same value, different hash (as in Spark).
    assert spark_xxhash64([pa.array([7], pa.int32())])[0] != spark_xxhash64([pa.array([7], pa.int64())])[0]
    assert spark_xxhash64([pa.array([7], pa.int8())])[0] == spark_xxhash64([pa.array([7], pa.int32())])[0]


def test_date32_hashes_days_since_epoch():
    rng = np.random.default_rng(11)
    days = [0, -1, 1, -719162, 2932896, *rng.integers(-100_000, 100_000, size=300).tolist()]
    dates = [EPOCH_DATE + dt.timedelta(days=d) for d in days]
    arr = pa.array(dates, type=pa.date32())
    assert spark_xxhash64([arr]).tolist() == [to_signed(ref_int(d)) for d in days]
    assert_hashes([arr.slice(4, 77)])


@pytest.mark.parametrize("tz", [None, "UTC", "Europe/Berlin"])
def test_timestamp_micros_hash_as_long(tz):
    rng = np.random.default_rng(12)
    micros = [0, -1, 1, -86_400_000_001, 253402300799999999, -62135596800000000]
    micros += rng.integers(-5_000_000_000_000_000, 5_000_000_000_000_000, size=300).tolist()
    arr = pa.array(micros, type=pa.timestamp("us", tz=tz))
    assert spark_xxhash64([arr]).tolist() == [to_signed(ref_long(m)) for m in micros]
    assert_hashes([arr.slice(6, 60)])


@pytest.mark.parametrize(("unit", "factor"), [("s", 1_000_000), ("ms", 1_000), ("ns", 1)])
def test_timestamp_other_units_are_hashed_as_micros(unit, factor):
    """Non-microsecond timestamps hash the microseconds since the epoch (Spark's TimestampType)."""
    rng = np.random.default_rng(13)
    if unit == "ns":
        raw = [*(rng.integers(-(10**15), 10**15, size=200) * 1000).tolist(), 0, -1000, 1000]
        micros = [r // 1000 for r in raw]
    else:
        raw = [*rng.integers(-(10**10), 10**10, size=200).tolist(), 0, -1, 1]
        micros = [r * factor for r in raw]
    arr = pa.array(raw, type=pa.timestamp(unit, tz="UTC"))
    assert spark_xxhash64([arr]).tolist() == [to_signed(ref_long(m)) for m in micros]


# --------------------------------------------------------------------------- multi-column chaining


def test_two_columns_chain_hash_as_seed():
    strings = ["", "a", "héllo", "x" * 33]
    longs = [0, -1, I64_MAX, 12345]
    got = spark_xxhash64([pa.array(strings), pa.array(longs, pa.int64())])
    expected = [
        to_signed(ref_long(v, ref_bytes(s.encode(), SEED))) for s, v in zip(strings, longs, strict=True)
    ]
    assert got.tolist() == expected
    # order matters
    swapped = spark_xxhash64([pa.array(longs, pa.int64()), pa.array(strings)])
    assert swapped.tolist() != got.tolist()


def test_many_columns_of_all_types_chain():
    rng = np.random.default_rng(14)
    n = 200
    cols = [
        pa.array(random_strings(rng, n, 40)),
        pa.array(rng.integers(I32_MIN, I32_MAX, size=n).tolist(), pa.int32()),
        pa.array(rng.integers(0, 2, size=n).astype(bool).tolist()),
        pa.array(rng.integers(-(10**5), 10**5, size=n).tolist(), pa.int32()).cast(pa.date32()),
        pa.array(rng.integers(-128, 128, size=n).tolist(), pa.int8()),
        pa.array(rng.integers(-32768, 32768, size=n).tolist(), pa.int16()),
        pa.array(rng.integers(I64_MIN, I64_MAX, size=n, dtype=np.int64).tolist(), pa.int64()),
        pa.array(rng.integers(-(6 * 10**16), 6 * 10**16, size=n).tolist(), pa.timestamp("us", tz="UTC")),
        pa.array([rng.bytes(int(k)) for k in rng.integers(0, 70, size=n)], pa.binary()),
    ]
    names = [f"c{i}" for i in range(len(cols))]
    got = assert_hashes(cols, names)
    table = pa.table(dict(zip(names, cols, strict=True)))
    assert spark_xxhash64(table.columns, table.schema.names).tolist() == got.tolist()
    for n_groups in (1, 7, 128, 4096, 32768):
        expected = [java_pmod(h, n_groups) for h in got.tolist()]
        assert assign_key_groups(table, n_groups).tolist() == expected
        assert assign_key_groups(table.to_batches()[0], n_groups).tolist() == expected
        assert assign_key_groups(cols, n_groups).tolist() == expected


def test_assign_key_group_single_tuple():
    schema = pa.schema([("user", pa.string()), ("day", pa.date32()), ("flag", pa.bool_())])
    key = ("alice", dt.date(1969, 7, 20), True)
    h = ref_int(1, ref_int(-165, ref_bytes(b"alice")))
    assert (dt.date(1969, 7, 20) - EPOCH_DATE).days == -165
    for n in (1, 7, 128, 32768):
        got = assign_key_group(key, schema, n)
        assert isinstance(got, int)
        assert got == java_pmod(to_signed(h), n)


# --------------------------------------------------------------------------- Spark golden values

# Computed once with Spark 4.3 (session time zone UTC):
#   SELECT xxhash64(<keys>), pmod(xxhash64(<keys>), 128)
SPARK_GOLDEN = [
    ([pa.array(["Spark"])], -4294468057691064905, 55),
    ([pa.array([""])], -7444071767201028348, 4),
    ([pa.array(["😀中é"])], -7089128988863799010, 30),
    ([pa.array(["x" * 40])], -5348608777870439244, 52),
    ([pa.array([b"\x00\xff"], pa.binary())], 879945414100663330, 34),
    ([pa.array([-1], pa.int8())], 2017008487422258757, 69),
    ([pa.array([-32768], pa.int16())], -904511417458573795, 29),
    ([pa.array([True])], -6698625589789238999, 41),
    ([pa.array([False])], 3614696996920510707, 115),
    ([pa.array([42], pa.int32())], -387659249110444264, 24),
    ([pa.array([42], pa.int64())], -6876166290308861218, 94),
    ([pa.array([dt.date(1969, 7, 20)], pa.date32())], 4358245511639172990, 126),
    ([pa.array([-1], pa.timestamp("us", tz="UTC"))], 3858142552250413010, 82),
    ([pa.array(["Spark"]), pa.array([7], pa.int64())], 7081094736886788433, 81),
    ([pa.array([1], pa.int32()), pa.array([dt.date(2024, 2, 29)]), pa.array([True])], 1421148509405662125, 45),
]


@pytest.mark.parametrize(("columns", "spark_hash", "spark_group"), SPARK_GOLDEN, ids=lambda v: None)
def test_spark_golden_values(columns, spark_hash, spark_group):
    assert spark_xxhash64(columns).tolist() == [spark_hash]
    assert assign_key_groups(columns, 128).tolist() == [spark_group]
    assert ref_row_hashes(columns) == [spark_hash]  # the xxhash-package reference agrees with Spark


# --------------------------------------------------------------------------- pmod


def test_java_pmod_reference_sanity():
    assert java_pmod(-1, 7) == 6
    assert java_pmod(-7, 7) == 0
    assert java_pmod(I64_MIN, 128) == 0
    assert java_pmod(I64_MIN, 7) == (I64_MIN % 7)


@given(
    values=st.lists(st.integers(I64_MIN, I64_MAX), min_size=1, max_size=50),
    n=st.integers(1, kg.MAX_PARALLELISM_UPPER_BOUND),
)
@settings(max_examples=300, deadline=None)
def test_pmod_never_negative_and_matches_java_pmod(values, n):
    arr = pa.array(values, pa.int64())
    groups = assign_key_groups([arr], n)
    assert groups.dtype == np.int32
    assert (groups >= 0).all()
    assert (groups < n).all()
    hashes = [to_signed(ref_long(v)) for v in values]
    assert groups.tolist() == [java_pmod(h, n) for h in hashes]


def test_pmod_on_negative_hashes():
    # Find keys whose hash is negative; their key groups must still be in [0, N).
    values = list(range(2000))
    hashes = [to_signed(ref_long(v)) for v in values]
    assert any(h < 0 for h in hashes)
    for n in (1, 3, 7, 100, 128, 1000, 32768):
        got = assign_key_groups([pa.array(values, pa.int64())], n).tolist()
        assert got == [java_pmod(h, n) for h in hashes]
        assert min(got) >= 0


def test_max_parallelism_one_puts_everything_in_group_zero():
    assert assign_key_groups([pa.array(["a", "b", ""])], 1).tolist() == [0, 0, 0]


# --------------------------------------------------------------------------- errors


def test_null_key_raises_value_error_naming_column():
    table = pa.table({"user_id": pa.array(["a", None, "c"]), "n": pa.array([1, 2, 3], pa.int64())})
    with pytest.raises(ValueError, match="user_id"):
        assign_key_groups(table, 128)
    table2 = pa.table({"user_id": pa.array(["a", "b", "c"]), "n": pa.array([1, None, 3], pa.int64())})
    with pytest.raises(ValueError, match="'n'"):
        assign_key_groups(table2, 128)
    with pytest.raises(ValueError, match="key1"):
        spark_xxhash64([pa.array([1, 2], pa.int32()), pa.array([None, True])])
    chunked = pa.chunked_array([pa.array([1, 2], pa.int64()), pa.array([None], pa.int64())])
    with pytest.raises(ValueError, match="account"):
        spark_xxhash64([chunked], ["account"])
    dict_null = pa.DictionaryArray.from_arrays(pa.array([0, None], pa.int32()), pa.array(["x"]))
    with pytest.raises(ValueError, match="d"):
        spark_xxhash64([dict_null], ["d"])


def test_null_outside_slice_is_ignored():
    arr = pa.array([None, "a", "b"])
    assert_hashes([arr.slice(1)])


UNSUPPORTED = [
    pa.array([1.5, 2.5], pa.float64()),
    pa.array([1.5, 2.5], pa.float32()),
    pa.array([1, 2], pa.decimal128(10, 2)),
    pa.array([[1], [2, 3]], pa.list_(pa.int64())),
    pa.array([{"a": 1}, {"a": 2}], pa.struct([("a", pa.int64())])),
    pa.array([1, 2], pa.uint32()),
    pa.array([1, 2], pa.uint8()),
    pa.array([1, 2], pa.uint64()),
    pa.array([1, 2], pa.int32()).cast(pa.time32("s")),
    pa.array([1, 2], pa.int64()).cast(pa.duration("us")),
]


@pytest.mark.parametrize("arr", UNSUPPORTED, ids=lambda a: str(a.type))
def test_unsupported_types_raise_naming_column(arr):
    with pytest.raises(UnsupportedKeyTypeError, match="price_col") as exc:
        spark_xxhash64([arr], ["price_col"])
    assert exc.value.column == "price_col"
    assert exc.value.dtype == arr.type
    assert isinstance(exc.value, TypeError)
    table = pa.table({"ok": pa.array(["a", "b"]), "bad_col": arr})
    with pytest.raises(UnsupportedKeyTypeError, match="bad_col"):
        assign_key_groups(table, 128)
    with pytest.raises(UnsupportedKeyTypeError, match="price_col"):
        check_key_type("price_col", arr.type)
    with pytest.raises(UnsupportedKeyTypeError, match="price_col"):
        check_key_type("price_col", pa.dictionary(pa.int32(), arr.type))


@pytest.mark.parametrize(
    "type_",
    [pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.date32(), pa.timestamp("us", tz="UTC"),
     pa.timestamp("ns"), pa.string(), pa.large_string(), pa.binary(), pa.large_binary(),
     pa.dictionary(pa.int32(), pa.string())],
    ids=str,
)
def test_check_key_type_accepts_supported(type_):
    check_key_type("k", type_)


def test_bad_column_arguments():
    with pytest.raises(ValueError):
        spark_xxhash64([])
    with pytest.raises(ValueError, match="b"):
        spark_xxhash64([pa.array([1, 2], pa.int64()), pa.array([1], pa.int64())], ["a", "b"])


def test_zero_rows():
    assert assign_key_groups([pa.array([], pa.string())], 128).shape == (0,)
    assert spark_xxhash64([pa.array([], pa.int64()), pa.array([], pa.date32())]).shape == (0,)


@pytest.mark.parametrize("bad", [0, -1, kg.MAX_PARALLELISM_UPPER_BOUND + 1, 1.0, "8", None])
def test_bad_max_parallelism(bad):
    with pytest.raises(ValueError):
        assign_key_groups([pa.array([1], pa.int64())], bad)
    with pytest.raises(ValueError):
        compute_key_group_range_for_task(bad, 1, 0)


# --------------------------------------------------------------------------- KeyGroupRange


def test_empty_range():
    empty = KeyGroupRange.EMPTY
    assert empty is EMPTY_KEY_GROUP_RANGE
    assert empty.is_empty()
    assert len(empty) == 0
    assert list(empty) == []
    assert 0 not in empty
    assert -1 not in empty
    assert str(empty) == "[]"
    assert KeyGroupRange.of(5, 4) == empty
    assert KeyGroupRange.of(10, 0).is_empty()
    assert empty.intersection(KeyGroupRange(0, 100)).is_empty()
    assert KeyGroupRange(0, 100).intersection(empty).is_empty()
    assert not empty.contains_array(np.array([-1, 0, 1, 5])).any()


def test_range_basics():
    r = KeyGroupRange(3, 7)
    assert not r.is_empty()
    assert len(r) == 5
    assert list(r) == [3, 4, 5, 6, 7]
    assert 3 in r and 7 in r and 5 in r
    assert 2 not in r and 8 not in r
    assert np.int32(4) in r and np.int64(7) in r and np.int64(8) not in r
    assert "4" not in r and None not in r
    assert str(r) == "[3, 7]"
    assert KeyGroupRange(4, 4).__len__() == 1
    assert r.contains_array(np.arange(10)).tolist() == [x in {3, 4, 5, 6, 7} for x in range(10)]
    assert hash(r) == hash(KeyGroupRange(3, 7))
    with pytest.raises(AttributeError):
        r.start = 1  # type: ignore[misc]


@pytest.mark.parametrize(("start", "end"), [(-1, 3), (-1, -1), (5, 3), (1, 0), (-5, -6)])
def test_invalid_ranges(start, end):
    with pytest.raises(ValueError):
        KeyGroupRange(start, end)


ranges = st.one_of(
    st.just(EMPTY_KEY_GROUP_RANGE),
    st.tuples(st.integers(0, 200), st.integers(0, 200)).map(lambda t: KeyGroupRange(min(t), max(t))),
)


@given(a=ranges, b=ranges)
@settings(max_examples=500, deadline=None)
def test_intersection_matches_set_intersection(a, b):
    got = a.intersection(b)
    expected = set(range(a.start, a.end + 1)) & set(range(b.start, b.end + 1))
    assert set(got) == expected
    assert len(got) == len(expected)
    assert got.is_empty() == (not expected)
    if not expected:
        assert got == EMPTY_KEY_GROUP_RANGE
    assert b.intersection(a) == got
    for x in range(-1, 202):
        assert (x in got) == (x in expected)


def flink_range(n: int, p: int, i: int) -> tuple[int, int]:
    """Flink's [ceil(i*N/p), floor(((i+1)*N-1)/p)] with exact fractions."""
    return math.ceil(Fraction(i * n, p)), math.floor(Fraction((i + 1) * n - 1, p))


def check_partition(n: int, p: int) -> None:
    owner = [-1] * n
    expected_next = 0
    for i in range(p):
        r = compute_key_group_range_for_task(n, p, i)
        assert isinstance(r, KeyGroupRange)
        s, e = flink_range(n, p, i)
        assert (r.start, r.end) == (s, e)
        assert not r.is_empty()  # p <= N: every task owns at least one key group
        assert r.start == expected_next  # contiguous and disjoint
        expected_next = r.end + 1
        for g in r:
            assert owner[g] == -1
            owner[g] = i
    assert expected_next == n  # covers [0, N-1]
    assert -1 not in owner
    for g in range(n):
        assert task_for_key_group(n, p, g) == owner[g]


def test_task_ranges_exhaustive_small():
    for n in range(1, 65):
        for p in range(1, n + 1):
            check_partition(n, p)


@given(data=st.data(), n=st.integers(1, 300))
@settings(max_examples=400, deadline=None)
def test_task_ranges_partition_property(data, n):
    p = data.draw(st.integers(1, n))
    check_partition(n, p)


@pytest.mark.parametrize(("n", "p"), [(300, 300), (300, 1), (300, 7), (128, 3), (32768, 1), (32768, 3)])
def test_task_ranges_edges(n, p):
    if n <= 300:
        check_partition(n, p)
    else:
        assert compute_key_group_range_for_task(n, p, 0).start == 0
        assert compute_key_group_range_for_task(n, p, p - 1).end == n - 1


def test_task_range_known_values():
    assert [str(compute_key_group_range_for_task(128, 3, i)) for i in range(3)] == [
        "[0, 42]", "[43, 85]", "[86, 127]"
    ]
    assert compute_key_group_range_for_task(10, 10, 9) == KeyGroupRange(9, 9)
    assert compute_key_group_range_for_task(1, 1, 0) == KeyGroupRange(0, 0)


@pytest.mark.parametrize(
    ("n", "p", "i"),
    [(128, 0, 0), (128, 129, 0), (128, -1, 0), (128, 4, 4), (128, 4, -1), (0, 1, 0), (10, 11, 0)],
)
def test_task_range_bad_arguments(n, p, i):
    with pytest.raises(ValueError):
        compute_key_group_range_for_task(n, p, i)


# --------------------------------------------------------------------------- scalar path

SCALAR_CASES = [
    (pa.string(), st.text(max_size=40)),
    (pa.binary(), st.binary(max_size=40)),
    (pa.bool_(), st.booleans()),
    (pa.int8(), st.integers(-(1 << 7), (1 << 7) - 1)),
    (pa.int16(), st.integers(-(1 << 15), (1 << 15) - 1)),
    (pa.int32(), st.integers(-(1 << 31), (1 << 31) - 1)),
    (pa.int64(), st.integers(-(1 << 63), (1 << 63) - 1)),
    (pa.date32(), st.dates()),
    (pa.timestamp("us"), st.datetimes()),
    (pa.timestamp("us", tz="UTC"), st.datetimes(timezones=st.just(dt.UTC))),
]


@pytest.mark.parametrize(("dtype", "values"), SCALAR_CASES, ids=[str(c[0]) for c in SCALAR_CASES])
def test_scalar_key_group_equals_vectorized(dtype, values):
    """``assign_key_group`` (one plain Python key, through the xxhash binding) agrees with the
    vectorized path for every supported type, also chained after a string column."""
    schema = pa.schema([("k", dtype)])
    pair = pa.schema([("s", pa.string()), ("k", dtype)])

    @given(v=values, s=st.text(max_size=10), n=st.sampled_from([1, 7, 128, 4096]))
    @settings(max_examples=60, deadline=None)
    def check(v, s, n):
        vec = assign_key_groups(pa.table({"k": pa.array([v], dtype)}), n)
        assert kg.assign_key_group((v,), schema, n) == int(vec[0])
        vec2 = assign_key_groups(pa.table({"s": [s], "k": pa.array([v], dtype)}), n)
        assert kg.assign_key_group((s, v), pair, n) == int(vec2[0])

    check()
