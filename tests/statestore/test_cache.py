"""Unit tests of statestore.cache: whole-key-group LRU eviction under a size bound.

Group sizes come from polars' ``estimated_size`` of the views, computed here on the frames
themselves; frames of fixed-width columns make the sizes exact and easy to add up.
"""

from __future__ import annotations

import polars as pl

from statestore.cache import CachedKeyGroup, KeyGroupCache


def frame(rows: int) -> pl.DataFrame:
    return pl.DataFrame({"k": pl.Series(range(rows), dtype=pl.Int64), "v": pl.Series(range(rows), dtype=pl.Int64)})


ROW_BYTES = frame(1000).estimated_size() // 1000  # 16: two int64 columns


def group(*rows: int) -> CachedKeyGroup:
    return CachedKeyGroup(views={f"s{i}": frame(n) for i, n in enumerate(rows)})


def test_group_size_is_sum_of_its_views():
    g = group(10, 30)
    assert g.measure() == 40 * ROW_BYTES
    assert g.size_bytes == 40 * ROW_BYTES


def test_put_accounts_sizes_and_replacing_a_group_subtracts_the_old_one():
    cache = KeyGroupCache(size_bytes_max=10**9)
    cache.put(1, group(10))
    cache.put(2, group(20, 5))
    assert cache.size_bytes == 35 * ROW_BYTES
    assert len(cache) == 2 and 1 in cache and 2 in cache and 3 not in cache
    cache.put(1, group(3))
    assert cache.size_bytes == 28 * ROW_BYTES
    assert len(cache) == 2


def test_resized_remeasures_a_group_changed_in_place():
    cache = KeyGroupCache(size_bytes_max=10**9)
    cache.put(1, group(10))
    cache.put(2, group(10))
    cache.get(1).views["s0"] = frame(50)
    cache.resized(1)
    assert cache.size_bytes == 60 * ROW_BYTES
    cache.get(2).views["extra"] = frame(5)
    cache.resized(2)
    assert cache.size_bytes == 65 * ROW_BYTES


def test_trim_evicts_least_recently_used_whole_groups():
    cache = KeyGroupCache(size_bytes_max=25 * ROW_BYTES)
    for kg in (1, 2, 3):
        cache.put(kg, group(10))
    cache.get(1)  # 1 is now the most recently used; 2 is the least
    cache.trim()
    assert 2 not in cache and 1 in cache and 3 in cache
    assert cache.size_bytes == 20 * ROW_BYTES
    assert cache.evictions == 1


def test_trim_evicts_only_until_within_bound():
    cache = KeyGroupCache(size_bytes_max=30 * ROW_BYTES)
    for kg, rows in ((1, 5), (2, 5), (3, 30), (4, 1)):
        cache.put(kg, group(rows))
    cache.trim()
    # over by 11 rows' worth: 1 and 2 (10 rows) are not enough, 3 goes too; 4 stays
    assert [kg for kg in (1, 2, 3, 4) if kg in cache] == [4]
    assert cache.size_bytes == 1 * ROW_BYTES
    assert cache.evictions == 3


def test_put_of_existing_group_makes_it_most_recent():
    cache = KeyGroupCache(size_bytes_max=20 * ROW_BYTES)
    for kg in (1, 2, 3):
        cache.put(kg, group(10))
    cache.put(1, group(10))
    cache.trim()
    assert 1 in cache and 3 in cache and 2 not in cache


def test_trim_within_bound_evicts_nothing():
    cache = KeyGroupCache(size_bytes_max=30 * ROW_BYTES)
    for kg in (1, 2, 3):
        cache.put(kg, group(10))
    cache.trim()
    assert len(cache) == 3 and cache.evictions == 0


def test_pinned_groups_are_never_evicted():
    cache = KeyGroupCache(size_bytes_max=10 * ROW_BYTES)
    for kg in (1, 2, 3, 4):
        cache.put(kg, group(10))
    cache.trim(pinned=[1, 2])
    # 3 and 4 go; 1 and 2 stay although the cache remains over its bound
    assert [kg for kg in (1, 2, 3, 4) if kg in cache] == [1, 2]
    assert cache.size_bytes == 20 * ROW_BYTES
    cache.trim(pinned=[1, 2])
    assert len(cache) == 2
    cache.trim(pinned=[2])
    assert 1 not in cache and 2 in cache


def test_single_oversized_group_is_served_then_evicted():
    cache = KeyGroupCache(size_bytes_max=5 * ROW_BYTES)
    cache.put(7, group(100))
    cache.trim(pinned=[7])
    assert 7 in cache
    cache.trim()
    assert 7 not in cache and cache.size_bytes == 0


def test_get_of_missing_group_is_none():
    cache = KeyGroupCache(size_bytes_max=100)
    assert cache.get(3) is None


def test_clear_empties_and_zeroes_size():
    cache = KeyGroupCache(size_bytes_max=10**9)
    cache.put(1, group(10))
    cache.clear()
    assert len(cache) == 0 and cache.size_bytes == 0 and 1 not in cache
