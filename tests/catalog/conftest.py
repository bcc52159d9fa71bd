"""Fixtures of the catalog tests: a real SQLite SqlCatalog in a tmp_path warehouse.
No mocks: every test commits to and reads from an actual Iceberg table on local disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from catalog import IcebergStateTable
from statestore.layout import StateLayout
from tests.catalog.catalog_helpers import LAYOUT


@pytest.fixture
def warehouse(tmp_path: Path) -> str:
    return str(tmp_path / "warehouse")


@pytest.fixture
def open_table(warehouse: str) -> Iterator[Callable[..., IcebergStateTable]]:
    """Opens state tables in the test's warehouse (table "op" and LAYOUT by default); closes them after."""
    opened: list[IcebergStateTable] = []

    def _open(layout: StateLayout = LAYOUT, table_name: str = "op", **kwargs) -> IcebergStateTable:
        kwargs.setdefault("warehouse", warehouse)
        table = IcebergStateTable.open(layout, table_name=table_name, **kwargs)
        opened.append(table)
        return table

    yield _open
    for t in opened:
        t.close()
