"""Parquet written by someone else is data, never code: a file whose Arrow schema carries a
pickled Python extension type (the form pyarrow before 14.0.1 unpickled on read,
CVE-2023-47248) is read by every Parquet reader the project uses without loading the pickle."""

from __future__ import annotations

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from tests.hostile import hostile_pickle


def hostile_parquet(path: str, marker: str) -> None:
    field = pa.field("v", pa.int64(), metadata={
        b"ARROW:extension:name": b"arrow.py_extension_type",
        b"ARROW:extension:metadata": hostile_pickle(marker),
    })
    table = pa.table({"k": ["a", "b"], "v": [1, 2]}, schema=pa.schema([pa.field("k", pa.string()), field]))
    pq.write_table(table, path)  # the Arrow schema, with the field's metadata, goes into the footer


def test_a_pickled_extension_type_in_a_parquet_footer_is_never_loaded(tmp_path):
    path, marker = str(tmp_path / "seg.parquet"), tmp_path / "pwned"
    hostile_parquet(path, str(marker))
    read = pq.read_table(path)
    assert read.column("v").to_pylist() == [1, 2] and read.schema.field("v").type == pa.int64()
    read.to_pandas()
    pads.dataset(path).to_table()
    pq.ParquetFile(path).read_row_group(0)
    with pytest.raises(pl.exceptions.ComputeError, match="InvalidUtf8"):
        pl.read_parquet(path)  # polars refuses the pickle's bytes as footer metadata
    with duckdb.connect() as con:
        assert con.execute(f"SELECT sum(v) FROM read_parquet('{path}')").fetchone() == (3,)
    assert not marker.exists()
