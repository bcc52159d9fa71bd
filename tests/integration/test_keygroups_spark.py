"""Cross-check of statestore.keygroups against a real Spark session.

For random keys of every supported key type (and several multi-column keys), Spark's own
``xxhash64(cols...)`` and ``pmod(xxhash64(cols...), N)`` must equal
``statestore.keygroups.spark_xxhash64`` and ``assign_key_groups`` row by row. Each case builds
two Spark DataFrames from the same Arrow data, one through Spark's Arrow conversion and one
from plain Python rows with an explicit schema (Spark's own value conversion), so a
conversion quirk on one path cannot hide a hashing mismatch.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from pyspark.sql import types as T

from statestore.keygroups import assign_key_groups, spark_xxhash64

pytestmark = pytest.mark.spark

N_ROWS = 300
MAX_PARALLELISMS = (1, 7, 128, 4096, 32768)
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
DATE_MIN, DATE_MAX = -719162, 2932896  # 0001-01-01 .. 9999-12-31 in days since 1970-01-01
TS_MIN, TS_MAX = -62135596800000000, 253402300799999999  # same bounds in microseconds


@dataclass(frozen=True)
class KeyColumn:
    arrow_type: pa.DataType
    spark_type: T.DataType
    generate: Callable[[np.random.Generator, int], list]


def _strings(rng: np.random.Generator, n: int) -> list[str]:
    alphabet = [*"abcxyzABC0123 _-./", "é", "ß", "Ж", "中", "語", "€", "😀", "𝄞", "\u0301", "\u0000"]
    fixed = ["", " ", "a", "Spark", "héllo wörld", "😀" * 9, "中" * 11, "x" * 31, "x" * 32, "x" * 33]
    lengths = np.concatenate([np.arange(0, 101), rng.integers(0, 101, size=n)])
    rand = ["".join(rng.choice(alphabet, size=int(k))) for k in lengths]
    return (fixed + rand)[:n]


def _binary(rng: np.random.Generator, n: int) -> list[bytes]:
    fixed = [b"", b"\x00", b"\xff" * 8, bytes(range(40))]
    lengths = np.concatenate([np.arange(0, 101), rng.integers(0, 101, size=n)])
    return (fixed + [rng.bytes(int(k)) for k in lengths])[:n]


def _ints(lo: int, hi: int) -> Callable[[np.random.Generator, int], list[int]]:
    def gen(rng: np.random.Generator, n: int) -> list[int]:
        fixed = [lo, hi, 0, -1, 1, lo + 1, hi - 1]
        return (fixed + rng.integers(lo, hi, size=n, endpoint=True, dtype=np.int64).tolist())[:n]

    return gen


def _bools(rng: np.random.Generator, n: int) -> list[bool]:
    return [True, False, *rng.integers(0, 2, size=n).astype(bool).tolist()][:n]


def _dates(rng: np.random.Generator, n: int) -> list[dt.date]:
    fixed = [0, -1, 1, DATE_MIN, DATE_MAX, -141427, -141428, -25567]  # epoch, 1582-10-15/14, 1900
    days = fixed + rng.integers(-40_000, 40_000, size=n // 2).tolist()
    days += rng.integers(DATE_MIN, DATE_MAX, size=n, endpoint=True).tolist()
    return [dt.date(1970, 1, 1) + dt.timedelta(days=int(d)) for d in days[:n]]


def _timestamps(rng: np.random.Generator, n: int) -> list[int]:
    # microseconds since the epoch, many before 1970, all with a microsecond part
    fixed = [0, -1, 1, TS_MIN, TS_MAX, -86_400_000_000, -12_219_292_800_000_001, 1_700_000_000_123_456]
    micros = fixed + rng.integers(-3 * 10**15, 3 * 10**15, size=n // 2).tolist()
    micros += rng.integers(TS_MIN, TS_MAX, size=n, endpoint=True).tolist()
    return micros[:n]


STRING = KeyColumn(pa.string(), T.StringType(), _strings)
BINARY = KeyColumn(pa.binary(), T.BinaryType(), _binary)
BOOL = KeyColumn(pa.bool_(), T.BooleanType(), _bools)
BYTE = KeyColumn(pa.int8(), T.ByteType(), _ints(-128, 127))
SHORT = KeyColumn(pa.int16(), T.ShortType(), _ints(-32768, 32767))
INT = KeyColumn(pa.int32(), T.IntegerType(), _ints(I32_MIN, I32_MAX))
LONG = KeyColumn(pa.int64(), T.LongType(), _ints(I64_MIN, I64_MAX))
DATE = KeyColumn(pa.date32(), T.DateType(), _dates)
TIMESTAMP = KeyColumn(pa.timestamp("us", tz="UTC"), T.TimestampType(), _timestamps)

CASES: dict[str, list[KeyColumn]] = {
    "string": [STRING],
    "binary": [BINARY],
    "bool": [BOOL],
    "byte": [BYTE],
    "short": [SHORT],
    "int": [INT],
    "long": [LONG],
    "date": [DATE],
    "timestamp": [TIMESTAMP],
    "string_long": [STRING, LONG],
    "int_date_bool": [INT, DATE, BOOL],
    "binary_timestamp_short_byte": [BINARY, TIMESTAMP, SHORT, BYTE],
    "long_string_string": [LONG, STRING, STRING],
    "all_types": [STRING, BINARY, BOOL, BYTE, SHORT, INT, LONG, DATE, TIMESTAMP],
}


def _key_table(columns: list[KeyColumn], seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    arrays = {"rid": pa.array(np.arange(N_ROWS, dtype=np.int64))}
    for i, col in enumerate(columns):
        arrays[f"k{i}"] = pa.array(col.generate(rng, N_ROWS), type=col.arrow_type)
    return pa.table(arrays)


def _spark_frames(spark, table: pa.Table, columns: list[KeyColumn]):
    """The same rows as a Spark DataFrame twice: via Arrow, and via Python rows + schema."""
    schema = T.StructType(
        [T.StructField("rid", T.LongType(), False)]
        + [T.StructField(f"k{i}", c.spark_type, False) for i, c in enumerate(columns)]
    )
    via_arrow = spark.createDataFrame(table)
    via_rows = spark.createDataFrame(list(zip(*(c.to_pylist() for c in table.columns), strict=True)), schema)
    for df in (via_arrow, via_rows):
        got = [(f.name, f.dataType) for f in df.schema.fields]
        assert got == [(f.name, f.dataType) for f in schema.fields]
    return via_arrow, via_rows


def _spark_hashes(df, key_names: list[str]) -> dict[str, list[int]]:
    """Spark's xxhash64 and pmod(xxhash64, N) per row, ordered by rid."""
    h = F.xxhash64(*[F.col(k) for k in key_names])
    exprs = [F.col("rid"), h.alias("h")]
    exprs += [F.pmod(h, F.lit(n)).alias(f"g{n}") for n in MAX_PARALLELISMS]
    rows = sorted(df.select(*exprs).collect(), key=lambda r: r["rid"])
    assert [r["rid"] for r in rows] == list(range(N_ROWS))
    out = {"h": [r["h"] for r in rows]}
    for n in MAX_PARALLELISMS:
        out[f"g{n}"] = [r[f"g{n}"] for r in rows]
    return out


def _first_mismatch(table: pa.Table, key_names: list[str], expected: list[int], got: list[int]) -> str:
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        if e != g:
            key = tuple(table.column(k)[i].as_py() for k in key_names)
            types = [str(table.schema.field(k).type) for k in key_names]
            return f"row {i}: key {key!r} of types {types}: spark {e}, python {g}"
    return "no mismatch"


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_key_groups_match_spark(spark, case):
    columns = CASES[case]
    table = _key_table(columns, seed=sorted(CASES).index(case) + 1)
    key_names = [f"k{i}" for i in range(len(columns))]
    keys = table.select(key_names)

    py_hash = spark_xxhash64(keys.columns, key_names).tolist()
    py_groups = {n: assign_key_groups(keys, n).tolist() for n in MAX_PARALLELISMS}

    for source, df in zip(("arrow", "rows"), _spark_frames(spark, table, columns), strict=True):
        spark_out = _spark_hashes(df, key_names)
        assert spark_out["h"] == py_hash, f"xxhash64 via {source}: " + _first_mismatch(
            keys, key_names, spark_out["h"], py_hash
        )
        for n in MAX_PARALLELISMS:
            assert spark_out[f"g{n}"] == py_groups[n], f"pmod(xxhash64, {n}) via {source}: " + (
                _first_mismatch(keys, key_names, spark_out[f"g{n}"], py_groups[n])
            )


def test_string_encodings_match_spark(spark):
    """large_string, dictionary and chunked/sliced versions of a column hash like Spark's StringType."""
    table = _key_table([STRING], seed=99)
    via_arrow, _ = _spark_frames(spark, table, [STRING])
    expected = _spark_hashes(via_arrow, ["k0"])["h"]
    col = table.column("k0").combine_chunks()
    variants = {
        "large_string": col.cast(pa.large_string()),
        "string_view": col.cast(pa.string_view()),
        "dictionary": col.dictionary_encode(),
        "chunked": pa.chunked_array([col.slice(0, 17), col.slice(17, 0), col.slice(17)]),
        "binary": col.cast(pa.binary()),
    }
    for name, arr in variants.items():
        assert spark_xxhash64([arr]).tolist() == expected, name
    sliced = col.slice(41, 100)
    assert spark_xxhash64([sliced]).tolist() == expected[41:141]
