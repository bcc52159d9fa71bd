"""Directed tests of partial key-group views (``StateReader``: reads proportional to the keys
touched). The model-based test (``test_store_model.PartialViewsMachine``) checks that partial
views always read like whole ones; these check what they read and when a key group is loaded
whole instead.

One key group layout: max parallelism 1, so every key shares key group 0; 2,000 keys written
in two checkpoints, row groups of 100 rows (``row_group_rows_max``), so that the row groups
that can hold a key are few.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from statestore import DirectoryStateTable, StateLayout, StateStore, StoreConfig, ValueStateDescriptor

LAYOUT = StateLayout.of(pa.schema([("k", pa.string())]), [ValueStateDescriptor("v", pa.int64())], max_parallelism=1)
KEYS = [f"key-{i:05d}" for i in range(2000)]
SMALL_ROW_GROUPS = {"row_group_rows_min": 1, "row_group_rows_max": 100}


def keys(names: list[str]) -> pa.Table:
    return pa.table({"k": pa.array(names, pa.string())})


@pytest.fixture
def table(tmp_path) -> DirectoryStateTable:
    table = DirectoryStateTable(tmp_path / "t", LAYOUT)
    store = StateStore(table, config=StoreConfig(**SMALL_ROW_GROUPS))
    v = store.get_state("v")
    v.update_batch(keys(KEYS), list(range(2000)))
    store.checkpoint()
    v.update_batch(keys(KEYS[::2]), [-i for i in range(0, 2000, 2)])  # every other key again
    store.checkpoint()
    store.close()
    return table


def reader(table, **options) -> StateStore:
    return StateStore(table, config=StoreConfig(view_partial_rows_min=0, **options))


def test_a_few_keys_read_only_their_row_groups_and_resolve_like_a_whole_load(table):
    partial, whole = reader(table), reader(table, view_partial_reads_max=0)
    asked = [KEYS[3], KEYS[1501], KEYS[1502], "absent"]
    expected = [3, 1501, -1502, None]
    assert partial.get_state("v").get_batch(keys(asked)).to_pylist() == expected
    assert whole.get_state("v").get_batch(keys(asked)).to_pylist() == expected
    p, w = partial.stats(), whole.stats()
    assert (p["cache_partial_reads"], p["cache_misses"]) == (1, 0)
    assert (w["cache_partial_reads"], w["cache_misses"]) == (0, 1)
    # 2 row groups (of 20 in the first checkpoint's segment, of 10 in the second's) per segment
    assert p["segment_bytes_read"] * 4 < w["segment_bytes_read"]
    assert p["cache_size_bytes"] * 10 < w["cache_size_bytes"]


def test_keys_already_covered_read_nothing_and_per_key_reads_of_them_hit(table):
    store = reader(table)
    store.get_state("v").get_batch(keys(KEYS[:5]))
    read = store.stats()["segment_bytes_read"]
    assert store.get_state("v").get_batch(keys(KEYS[2:4])).to_pylist() == [-2, 3]
    store.set_current_key(KEYS[4])
    assert store.get_state("v").get() == -4
    assert store.stats()["segment_bytes_read"] == read
    assert store.stats()["cache_partial_reads"] == 1


def test_a_per_key_read_of_a_key_the_partial_view_lacks_loads_the_key_group_whole(table):
    store = reader(table)
    store.get_state("v").get_batch(keys(KEYS[:5]))
    store.set_current_key(KEYS[1999])
    assert store.get_state("v").get() == 1999
    assert store.stats()["cache_misses"] == 1
    read = store.stats()["segment_bytes_read"]
    assert store.get_state("v").get_batch(keys(KEYS[1000:1010])).to_pylist() == [
        -i if i % 2 == 0 else i for i in range(1000, 1010)]
    assert store.stats()["segment_bytes_read"] == read  # whole now: nothing more to read


def test_prefetch_covers_the_keys_of_a_per_key_loop(table):
    store = reader(table)
    store.prefetch(keys(KEYS[10:20]))
    for i in range(10, 20):
        store.set_current_key(KEYS[i])
        assert store.get_state("v").get() == (-i if i % 2 == 0 else i)
    assert (store.stats()["cache_partial_reads"], store.stats()["cache_misses"]) == (1, 0)


def test_a_read_of_much_of_the_key_group_loads_it_whole(table):
    store = reader(table, view_partial_share_max=0.25)  # 2,000 keys in 3,000 entries: 750 is the bound
    store.get_state("v").get_batch(keys(KEYS[:700]))
    assert (store.stats()["cache_partial_reads"], store.stats()["cache_misses"]) == (1, 0)
    store.get_state("v").get_batch(keys(KEYS[700:800]))  # 800 covered or asked > 750
    assert store.stats()["cache_misses"] == 1


def test_a_key_group_read_partially_often_enough_is_loaded_whole(table):
    store = reader(table, view_partial_reads_max=1)  # key group 0 may read partially once
    v = store.get_state("v")
    v.get_batch(keys(KEYS[:3]))
    v.get_batch(keys(KEYS[3:6]))
    stats = store.stats()
    assert (stats["cache_partial_reads"], stats["cache_misses"]) == (1, 1)


def test_writes_of_keys_a_partial_view_lacks_are_read_once_they_are_covered(table):
    """A write to a key the partial view lacks must not enter the view before its stored
    entries do (the view would then hold it twice, or without its older state)."""
    store = reader(table)
    v = store.get_state("v")
    v.get_batch(keys(KEYS[:2]))
    v.update_batch(keys([KEYS[7], "new"]), [70, 1])
    assert v.get_batch(keys(KEYS[:2])).to_pylist() == [0, 1]  # refreshes the view with those writes
    assert v.get_batch(keys([KEYS[7], "new", KEYS[8]])).to_pylist() == [70, 1, -8]
    store.checkpoint()
    assert v.get_batch(keys([KEYS[7], "new", KEYS[9], KEYS[0]])).to_pylist() == [70, 1, 9, 0]


def test_a_lookup_reads_only_the_keys_its_views_lack_and_keeps_the_asked_order(table, caplog):
    """Keys found in the views are not checked again; the missing ones (absent, or not yet
    covered) are, and only those not covered are read; answers stay in the order asked,
    duplicates included."""
    store = reader(table)
    v = store.get_state("v")
    asked = [KEYS[500], KEYS[3], "absent", KEYS[4], KEYS[501], KEYS[3], "absent"]
    assert v.get_batch(keys(asked)).to_pylist() == [-500, 3, None, -4, 501, 3, None]
    assert (store.stats()["cache_partial_reads"], store.stats()["cache_misses"]) == (1, 0)
    read = store.stats()["segment_bytes_read"]
    again = [KEYS[501], "absent", KEYS[3], KEYS[500]]  # found, or absent but covered: nothing to read
    assert v.get_batch(keys(again)).to_pylist() == [501, None, 3, -500]
    assert (store.stats()["segment_bytes_read"], store.stats()["cache_partial_reads"]) == (read, 1)
    # One key not covered among found ones: key group 0's second read loads it whole.
    mixed = [KEYS[4], KEYS[1703], "absent", KEYS[500]]
    assert v.get_batch(keys(mixed)).to_pylist() == [-4, 1703, None, -500]
    assert (store.stats()["cache_partial_reads"], store.stats()["cache_misses"]) == (1, 1)
    assert "tie" not in caplog.text  # one row per key all along, not the tie fallback's repair
