"""Any Arrow table or query result as a grid to show: column names and rows of text.

Every page shows its tables through a ``Grid``, whatever their columns (checkpoints, one
key's state, a change feed, a SQL answer), so each value is shown the same way: its ``str``,
a null as a null, and at most ``limit`` rows with the count of all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

# Rows shown of one table; the page says how many there are in all.
ROWS_SHOWN = 500


@dataclass(frozen=True)
class Grid:
    """Rows of text under column names; ``None`` is a null. ``total`` counts every row, shown
    or not; ``more`` says there may be rows beyond ``total`` (a query cut at its limit)."""

    columns: list[str]
    rows: list[list[str | None]]
    total: int
    more: bool = False

    @property
    def cut(self) -> bool:
        """Whether rows are left out."""
        return self.more or len(self.rows) < self.total


def of_table(table: pa.Table, limit: int = ROWS_SHOWN) -> Grid:
    """The first ``limit`` rows of ``table``."""
    columns = [column.to_pylist() for column in table.slice(0, limit).columns]
    return Grid(list(table.column_names), [[text(v) for v in row] for row in zip(*columns, strict=True)],
                table.num_rows)


def of_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], more: bool = False) -> Grid:
    """Rows of Python values (a DB-API fetch), ``more`` when the fetch stopped at its limit."""
    return Grid(list(columns), [[text(v) for v in row] for row in rows], len(rows), more)


def text(value: Any) -> str | None:
    """How one value shows: its ``str``; None for a null."""
    return None if value is None else str(value)
