"""Store configuration: named settings with units last, validated at construction."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


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
        ``row_group_rows_max``; aligned row groups let a read of one key group skip the rest.
    footer_cache_entries_max: Parquet footers kept in memory (segments are immutable).
    clock_ms: processing-time clock for TTL, in epoch milliseconds.
    """

    cache_size_bytes_max: int = 512 * 1024 * 1024
    row_group_rows_min: int = 4096
    row_group_rows_max: int = 128 * 1024
    footer_cache_entries_max: int = 4096
    clock_ms: Callable[[], int] = field(default=wall_clock_ms)

    def __post_init__(self) -> None:
        for name in ("cache_size_bytes_max", "row_group_rows_min", "row_group_rows_max", "footer_cache_entries_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"StoreConfig.{name} must be a positive int, got {value!r}")
        if self.row_group_rows_min > self.row_group_rows_max:
            raise ValueError("StoreConfig.row_group_rows_min must not exceed row_group_rows_max")
