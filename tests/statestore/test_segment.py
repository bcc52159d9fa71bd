"""Unit tests of statestore.segment: writing sorted, row-group-aligned Parquet segments and
reading back only the row groups of the wanted key groups.

Files are inspected with ``pyarrow.parquet`` directly (sort order, row-group sizes and
boundaries, statistics), never through the reader under test. Expected row-group cuts are
written out by hand for small cases; for random inputs the cuts are checked against the
properties that define them.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from statestore import paths
from statestore.descriptors import MapStateDescriptor, ValueStateDescriptor
from statestore.directory_table import DirectoryStateTable
from statestore.errors import CorruptSegmentError, StateStoreError
from statestore.layout import OP_DELETE, OP_PUT, StateLayout
from statestore.segment import SegmentReader, write_segments
from statestore.table import SegmentFile

KEY_SCHEMA = pa.schema([("k", pa.int64())])
DESCS = (ValueStateDescriptor("a", pa.int64()), MapStateDescriptor("m", pa.string(), key_type=pa.int64()))
LAYOUT = StateLayout.of(KEY_SCHEMA, DESCS, max_parallelism=128)
READ_COLUMNS = ["key_group", "k", "state", "op", "checkpoint_id", "seq", "expire_at_ms", "mk_m", "v_a", "v_m"]


def entries(rows: list[tuple[int, int, str, int]], layout: StateLayout = LAYOUT) -> pa.Table:
    """Entries from (key group, key, state, seq); values derived from the row so it can be recognised."""
    n = len(rows)
    cols: dict[str, list] = {f.name: [None] * n for f in layout.entry_schema}
    for i, (kg, k, state, seq) in enumerate(rows):
        cols["key_group"][i], cols["k"][i], cols["state"][i], cols["seq"][i] = kg, k, state, seq
        cols["op"][i] = OP_DELETE if seq % 7 == 6 else OP_PUT
        cols["checkpoint_id"][i] = 0  # stamped by the caller's checkpoint only in the store; kept as given
        if state == "m":
            cols["mk_m"][i] = k * 100 + seq
            cols["v_m"][i] = f"m{k}-{seq}"
        else:
            cols[f"v_{state}"][i] = k * 1000 + seq
    return pa.table(cols, schema=layout.entry_schema)


def as_tuples(table: pa.Table) -> list[tuple]:
    return [(r["key_group"], r["k"], r["state"], r["seq"]) for r in table.to_pylist()]


def kg_rows(counts: list[int], first_kg: int = 0) -> list[tuple[int, int, str, int]]:
    """counts[i] rows in key group first_kg + i, unique keys and seqs."""
    rows, seq = [], 0
    for i, c in enumerate(counts):
        for j in range(c):
            rows.append((first_kg + i, 1000 * i + j, "a", seq))
            seq += 1
    return rows


@pytest.fixture
def table(tmp_path) -> DirectoryStateTable:
    return DirectoryStateTable(tmp_path / "t", LAYOUT)


def write(table, rows, rows_min=4096, rows_max=1 << 17, checkpoint_id=3, task_index=2) -> SegmentFile:
    files = write_segments(table, entries(rows, table.layout), checkpoint_id, task_index, rows_min, rows_max)
    assert len(files) == 1  # a directory table has one partition
    return files[0]


def row_group_sizes(path: str) -> list[int]:
    md = pq.ParquetFile(path).metadata
    return [md.row_group(g).num_rows for g in range(md.num_row_groups)]


# ---------------------------------------------------------------- writing


def test_segment_file_describes_the_written_file(table):
    rows = [(5, 1, "a", 0), (9, 2, "a", 1), (7, 3, "m", 2)]
    seg = write(table, rows, checkpoint_id=3, task_index=2)
    assert seg.checkpoint_id == 3
    assert (seg.key_group_min, seg.key_group_max) == (5, 9)
    assert seg.record_count == 3
    assert seg.size_bytes == os.path.getsize(seg.path)
    assert Path(seg.path).parent == Path(table.location) / paths.DATA_DIR
    assert paths.parse_segment_name(seg.path) == (3, 2, 0)


def test_empty_entries_write_no_file(table):
    assert write_segments(table, entries([]), 1, 0, 10, 100) == []
    assert not (Path(table.location) / paths.DATA_DIR).exists() or not any(
        (Path(table.location) / paths.DATA_DIR).iterdir())


def test_rows_sorted_by_key_group_key_state_seq(table):
    rng = random.Random(7)
    rows = [(rng.randrange(12), rng.randrange(30), rng.choice("am"), seq) for seq in range(400)]
    rng.shuffle(rows)
    seg = write(table, rows, rows_min=16, rows_max=64)
    got = as_tuples(pq.read_table(seg.path))
    assert got == sorted(rows)
    # values travel with their rows through the sort
    t = pq.read_table(seg.path).to_pylist()
    assert all(r["v_a"] == r["k"] * 1000 + r["seq"] for r in t if r["state"] == "a")
    assert all(r["v_m"] == f"m{r['k']}-{r['seq']}" for r in t if r["state"] == "m")
    assert pq.read_schema(seg.path).names == table.file_schema().names


@pytest.mark.parametrize(
    ("counts", "rows_min", "rows_max", "expected"),
    [
        ([3, 3, 3, 3], 5, 100, [6, 6]),          # cut at the first boundary at or past 5 rows
        ([3, 3, 3, 3], 3, 100, [3, 3, 3, 3]),     # exactly rows_min: cut at every boundary
        ([25], 4, 10, [10, 10, 5]),               # one big key group split at rows_max
        ([2, 25, 1], 4, 10, [10, 10, 7, 1]),      # rows_max cuts inside the group, boundary cut after
        ([1, 1, 1, 1, 1], 100, 3, [3, 2]),        # rows_max even where no key group reaches rows_min
        ([4, 1], 4, 10, [4, 1]),                  # the last row group may be short
    ],
)
def test_row_group_cuts_hand_computed(table, counts, rows_min, rows_max, expected):
    seg = write(table, kg_rows(counts), rows_min=rows_min, rows_max=rows_max)
    assert row_group_sizes(seg.path) == expected


@pytest.mark.parametrize("seed", range(5))
def test_row_groups_end_at_key_group_boundaries_and_respect_rows_max(table, seed):
    rng = random.Random(seed)
    counts = [rng.choice([0, 1, 2, 5, 13, 40]) for _ in range(30)]
    counts[0] = max(counts[0], 1)
    rows_min, rows_max = rng.choice([(1, 8), (5, 20), (10, 10), (16, 64)])
    seg = write(table, kg_rows(counts), rows_min=rows_min, rows_max=rows_max)
    kgs = pq.read_table(seg.path, columns=["key_group"]).column("key_group").to_pylist()
    sizes = row_group_sizes(seg.path)
    assert sum(sizes) == len(kgs)
    start = 0
    for i, size in enumerate(sizes):
        group = kgs[start:start + size]
        assert size <= rows_max
        if i < len(sizes) - 1:
            at_boundary = kgs[start + size - 1] != kgs[start + size]
            # a row group ends at a key-group boundary (with at least rows_min rows) or is full
            assert (at_boundary and size >= rows_min) or size == rows_max, (i, sizes)
        # no key-group boundary inside a row group once it holds rows_min rows
        for j in range(1, size):
            if group[j] != group[j - 1]:
                assert j < rows_min, (i, j, sizes)
        start += size


def test_column_statistics_present_and_exact(table):
    counts = [10, 10, 10, 10]
    seg = write(table, kg_rows(counts, first_kg=20), rows_min=10, rows_max=100)
    md = pq.ParquetFile(seg.path).metadata
    assert md.num_row_groups == 4
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for col in ("key_group", "k", "state", "op", "checkpoint_id", "seq"):
            stats = rg.column(names.index(col)).statistics
            assert stats is not None and stats.has_min_max, (g, col)
        kg_stats = rg.column(names.index("key_group")).statistics
        assert (kg_stats.min, kg_stats.max) == (20 + g, 20 + g)
        k_stats = rg.column(names.index("k")).statistics
        assert (k_stats.min, k_stats.max) == (1000 * g, 1000 * g + 9)


# ---------------------------------------------------------------- reading


@pytest.fixture
def many_groups(table):
    """A segment with 64 key groups of 50 rows, one row group each."""
    rows = kg_rows([50] * 64)
    return write(table, rows, rows_min=50, rows_max=1000), rows


def test_reader_reads_only_row_groups_of_the_wanted_key_group(table, many_groups):
    seg, rows = many_groups
    md = pq.ParquetFile(seg.path).metadata
    assert md.num_row_groups == 64
    reader = SegmentReader(table.filesystem)
    got = reader.read([seg], np.array([17]), READ_COLUMNS)
    assert len(got) == 1
    assert sorted(as_tuples(got[0])) == sorted(r for r in rows if r[0] == 17)
    assert reader.files_opened == 1  # one open: the footer, then the row group from the same file
    rg = md.row_group(17)  # compressed bytes of the column chunks read
    assert reader.bytes_read == sum(rg.column(i).total_compressed_size for i in range(rg.num_columns))
    assert reader.bytes_read * 10 < sum(md.row_group(g).total_byte_size for g in range(64))
    assert reader.bytes_read * 10 < seg.size_bytes


def test_reader_caches_footers(table, many_groups):
    seg, _ = many_groups
    reader = SegmentReader(table.filesystem)
    reader.read([seg], np.array([1]), READ_COLUMNS)
    opened = reader.files_opened
    reader.read([seg], np.array([2]), READ_COLUMNS)
    assert reader.files_opened == opened + 1  # the data read only; the footer came from the cache


def test_reader_returns_exactly_the_wanted_rows_of_several_key_groups(table):
    rng = random.Random(3)
    rows = [(rng.randrange(120), rng.randrange(1000), rng.choice("am"), seq) for seq in range(600)]
    seg = write(table, rows, rows_min=30, rows_max=200)
    md = pq.ParquetFile(seg.path).metadata
    assert md.num_row_groups < 40  # row groups span several key groups: the reader must filter rows
    wanted = np.array([0, 3, 4, 17, 39, 119])
    got = SegmentReader(table.filesystem).read([seg], wanted, READ_COLUMNS)
    assert sorted(t for g in got for t in as_tuples(g)) == sorted(r for r in rows if r[0] in set(wanted.tolist()))
    assert all(g.column_names == READ_COLUMNS for g in got)


def test_reader_with_keys_reads_only_the_row_groups_that_can_hold_them(table):
    """One key group of 1000 keys in row groups of 100: a read of keys 105 and 730 reads two
    row groups (their key bounds hold them) and returns the rows of those keys' values there."""
    rows = [(7, k, "a", k) for k in range(1000)]
    seg = write(table, rows, rows_min=1, rows_max=100)
    md = pq.ParquetFile(seg.path).metadata
    assert md.num_row_groups == 10
    reader = SegmentReader(table.filesystem)
    got = reader.read([seg], np.array([7]), READ_COLUMNS, keys={7: [105, 730]})
    assert sorted(t for g in got for t in as_tuples(g)) == [(7, 105, "a", 105), (7, 730, "a", 730)]
    read = [md.row_group(g) for g in (1, 7)]
    assert reader.bytes_read == sum(rg.column(i).total_compressed_size for rg in read for i in range(rg.num_columns))
    # a key between two row groups' bounds, or past the last, reads nothing
    assert SegmentReader(table.filesystem).read([seg], np.array([7]), READ_COLUMNS, keys={7: [5000]}) == []


def test_reader_with_keys_keeps_row_groups_of_several_key_groups(table):
    """A row group holding several key groups has no single key range: it is read whole and
    filtered by key group and first key value; the caller's join does the rest."""
    seg = write(table, kg_rows([3, 3, 3]), rows_min=9)
    assert row_group_sizes(seg.path) == [9]
    got = SegmentReader(table.filesystem).read([seg], np.array([1]), READ_COLUMNS, keys={1: [1001]})
    assert sorted(t for g in got for t in as_tuples(g)) == [(1, 1001, "a", 4)]


def test_reader_skips_segments_outside_the_wanted_range(table):
    low = write(table, kg_rows([5, 5], first_kg=10), rows_min=1)
    high = write(table, kg_rows([5, 5], first_kg=50), rows_min=1)
    reader = SegmentReader(table.filesystem)
    got = reader.read([low, high], np.array([51]), READ_COLUMNS)
    assert sorted(as_tuples(got[0])) == sorted(kg_rows([5, 5], first_kg=50)[5:])
    assert reader.files_opened == 1  # only the high segment
    assert SegmentReader(table.filesystem).read([low, high], np.array([30]), READ_COLUMNS) == []


def test_reader_prunes_a_key_group_gap_inside_a_segment(table):
    seg = write(table, kg_rows([5, 0, 0, 5], first_kg=1), rows_min=1)  # key groups 1 and 4
    reader = SegmentReader(table.filesystem)
    assert reader.read([seg], np.array([2, 3]), READ_COLUMNS) == []
    assert reader.bytes_read == 0


def test_reader_selects_and_orders_columns(table):
    seg = write(table, [(1, 5, "a", 0), (1, 6, "m", 1)], rows_min=1)
    got = SegmentReader(table.filesystem).read([seg], np.array([1]), ["v_a", "k", "key_group"])
    assert got[0].column_names == ["v_a", "k", "key_group"]
    assert got[0].to_pylist() == [{"v_a": 5000, "k": 5, "key_group": 1}, {"v_a": None, "k": 6, "key_group": 1}]


def test_reader_fills_columns_of_later_state_variables_with_nulls(tmp_path):
    old = StateLayout.of(KEY_SCHEMA, DESCS[:1], max_parallelism=128)
    old_table = DirectoryStateTable(tmp_path / "t", old)
    seg = write(old_table, [(3, 1, "a", 0), (3, 2, "a", 1)], rows_min=1)
    assert "v_m" not in pq.read_schema(seg.path).names
    got = SegmentReader(old_table.filesystem).read([seg], np.array([3]), READ_COLUMNS)
    t = got[0]
    assert t.column_names == READ_COLUMNS
    assert t.column("v_m").null_count == 2 and t.column("mk_m").null_count == 2
    assert t.column("v_a").to_pylist() == [1000, 2001]


# ---------------------------------------------------------------- corrupt segments


def _read_expecting_corrupt(table, seg, reader=None) -> CorruptSegmentError:
    reader = reader or SegmentReader(table.filesystem)
    with pytest.raises(CorruptSegmentError) as info:
        reader.read([seg], np.array([seg.key_group_min]), READ_COLUMNS)
    assert seg.path in str(info.value)
    assert isinstance(info.value, StateStoreError)
    return info.value


def test_truncated_segment_is_corrupt(table, many_groups):
    seg, _ = many_groups
    with open(seg.path, "r+b") as f:
        f.truncate(seg.size_bytes // 2)
    _read_expecting_corrupt(table, seg)


def test_garbage_segment_is_corrupt(table, many_groups):
    seg, _ = many_groups
    Path(seg.path).write_bytes(random.Random(1).randbytes(seg.size_bytes))
    _read_expecting_corrupt(table, seg)


def test_missing_segment_is_corrupt(table, many_groups):
    seg, _ = many_groups
    os.unlink(seg.path)
    _read_expecting_corrupt(table, seg)


def test_segment_lost_after_its_footer_was_cached_is_corrupt(table, many_groups):
    seg, _ = many_groups
    reader = SegmentReader(table.filesystem)
    reader.read([seg], np.array([seg.key_group_max]), READ_COLUMNS)
    os.unlink(seg.path)
    _read_expecting_corrupt(table, seg, reader)


def test_segment_truncated_after_its_footer_was_cached_is_corrupt(table, many_groups):
    seg, _ = many_groups
    reader = SegmentReader(table.filesystem)
    reader.read([seg], np.array([0]), READ_COLUMNS)
    with open(seg.path, "r+b") as f:
        f.truncate(16)
    _read_expecting_corrupt(table, seg, reader)
