"""Store configuration: named settings with units last, validated at construction."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# auto: cache when the table's filesystem is not local; on: always; off: never
FILE_CACHE_MODES = ("auto", "on", "off")


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one task's store.

    cache_size_bytes_max: bound of the resolved key-group views held in memory; whole key
        groups are evicted, least recently used first. A single request that needs more
        than the bound is served and then trimmed.
    row_group_rows_min / row_group_rows_max: a segment's row groups end at key-group
        boundaries once they hold at least ``row_group_rows_min`` rows, and never exceed
        ``row_group_rows_max``; aligned row groups let a read of one key group skip the rest,
        and a read of a few keys skip the row groups of their key group that cannot hold them
        (32k rows decode as fast as 128k, measured; 8k cost a quarter more).
    footer_cache_entries_max: Parquet footers kept in memory (segments are immutable).
    clock_ms: processing-time clock for TTL, in epoch milliseconds.
    file_cache_mode: the local cache of whole segment files (``file_cache.FileCache``):
        ``auto`` (default) caches when the table's filesystem is not local (S3 and other object
        stores; a cached copy of a local file would only copy it), ``on`` always (tests),
        ``off`` never.
    file_cache_dir: where the cache keeps its files (each process in its own subdirectory);
        None: ``$ICESTATE_FILE_CACHE_DIR``, else ``<temp dir>/icestate-file-cache-<uid>``. One
        cache per process and directory, shared by every store of the process.
    file_cache_bytes_max: bound of the cached files of one process; whole files are evicted,
        least recently used first.
    file_cache_reserved_free_bytes: the cache never fills its disk beyond leaving this much
        free (it evicts, or serves a file without caching it).
    view_partial_reads_max: a key group's views fill key by key: a batched read of a few of
        its keys reads only those keys' entries, from the row groups whose statistics can hold
        them. After about this many such reads (each key group's own number, spread over
        1..2x this, so that a uniformly read state does not load every key group in one
        batch), the key group is loaded whole. 0: always whole.
    view_partial_rows_min: a key group with fewer entries than this is always loaded whole
        (reading a few of its keys would save little).
    view_partial_share_max: a read asking for more than this share of a key group's entries
        (counting the keys it already holds) loads it whole.
    view_index_rows_min: a cached view of one key group and variable with at least this many
        rows is indexed by key hash at its first keyed read or change (``views.KeyedView``):
        a batch then finds and replaces its keys' rows at the cost of its keys, not of the
        view; smaller views are joined whole (cheaper there). 0: index every view.
    count_live_rows: count how each checkpoint changes the live rows, in Spark's units
        (``live_rows.LiveRowCounter``; ``StateStore.live_row_change``): each key's state is
        read before its first write since the last flush, and at the flush. None: the runner
        decides (the Spark runner counts, for ``numRowsTotal``; the store alone does not).
    host_views: share resolved views with the other processes of the host
        (``host_views.HostViews``): whole key groups a store resolves from a committed
        checkpoint are written once as memory-mapped files, and a store of those key groups
        opened in any process of the host maps them and reads only what was committed since,
        instead of loading them again (a Spark task moved to another Python worker). None: the
        runner decides (the Spark runner shares, the store alone does not).
    host_views_dir: where the shared views live; None: ``<file cache directory>/views``.
    host_views_bytes_max: bound of the shared views of every process of the host together
        (least recently used first out); the file cache's reserved free bytes are kept free too.
    host_views_lag: a store writes its key groups' views to the host again once they are this
        many checkpoints behind its own (1 / ``host_views_lag`` of them a commit at most). Each
        worker holds what changed since as its own memory, and a task that moves reads about as
        many checkpoints' segments to catch up; lower is less of both and more written at each
        commit (a 5M-key task, 50k updates a checkpoint: 2 costs a task that never moves
        1.2-1.7x the store time of a checkpoint without the shared views and leaves it 9 MB of
        its own, 4 costs 1.0-1.2x and leaves 13-14 MB; ``benchmarks/bench_host_views_store.py``).
    """

    cache_size_bytes_max: int = 512 * 1024 * 1024
    row_group_rows_min: int = 4096
    row_group_rows_max: int = 32 * 1024
    footer_cache_entries_max: int = 4096
    clock_ms: Callable[[], int] = field(default=wall_clock_ms)
    file_cache_mode: str = "auto"
    file_cache_dir: str | None = None
    file_cache_bytes_max: int = 1024 * 1024 * 1024
    file_cache_reserved_free_bytes: int = 1024 * 1024 * 1024
    view_partial_reads_max: int = 4
    view_partial_rows_min: int = 4096
    view_partial_share_max: float = 0.5
    view_index_rows_min: int = 16384
    count_live_rows: bool | None = None
    host_views: bool | None = None
    host_views_dir: str | None = None
    host_views_bytes_max: int = 8 * 1024 * 1024 * 1024
    host_views_lag: int = 2

    def __post_init__(self) -> None:
        for name in ("cache_size_bytes_max", "row_group_rows_min", "row_group_rows_max", "footer_cache_entries_max",
                     "file_cache_bytes_max", "host_views_bytes_max", "host_views_lag"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"StoreConfig.{name} must be a positive int, got {value!r}")
        reserved = self.file_cache_reserved_free_bytes
        if not isinstance(reserved, int) or reserved < 0:
            raise ValueError(f"StoreConfig.file_cache_reserved_free_bytes must be a non-negative int, got {reserved!r}")
        if not isinstance(self.view_partial_reads_max, int) or self.view_partial_reads_max < 0:
            raise ValueError(
                f"StoreConfig.view_partial_reads_max must be a non-negative int, got {self.view_partial_reads_max!r}")
        if not isinstance(self.view_partial_rows_min, int) or self.view_partial_rows_min < 0:
            raise ValueError(
                f"StoreConfig.view_partial_rows_min must be a non-negative int, got {self.view_partial_rows_min!r}")
        if not isinstance(self.view_index_rows_min, int) or self.view_index_rows_min < 0:
            raise ValueError(
                f"StoreConfig.view_index_rows_min must be a non-negative int, got {self.view_index_rows_min!r}")
        share = self.view_partial_share_max
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0:
            raise ValueError(f"StoreConfig.view_partial_share_max must be a positive number, got {share!r}")
        if self.file_cache_mode not in FILE_CACHE_MODES:
            raise ValueError(
                f"StoreConfig.file_cache_mode must be one of {FILE_CACHE_MODES}, got {self.file_cache_mode!r}")
        if self.file_cache_dir is not None and (not isinstance(self.file_cache_dir, str) or not self.file_cache_dir):
            raise ValueError(f"StoreConfig.file_cache_dir must be a non-empty str or None, got {self.file_cache_dir!r}")
        if self.host_views_dir is not None and (not isinstance(self.host_views_dir, str) or not self.host_views_dir):
            raise ValueError(f"StoreConfig.host_views_dir must be a non-empty str or None, got {self.host_views_dir!r}")
        if self.row_group_rows_min > self.row_group_rows_max:
            raise ValueError("StoreConfig.row_group_rows_min must not exceed row_group_rows_max")
