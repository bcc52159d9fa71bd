"""Fixtures of the catalog tests: a real SQLite SqlCatalog in a tmp_path warehouse.
No mocks: every test commits to and reads from an actual Iceberg table on local disk, or,
through ``place``, on local disk and on S3 (moto's server on loopback, ``tests/s3_server.py``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from catalog import IcebergStateTable, TableRef
from statestore.layout import StateLayout
from tests import s3_server
from tests.catalog.catalog_helpers import LAYOUT
from tests.net_proxy import NetProxy

S3_BUCKET = "icestate-catalog"
PLACES = ["local", "s3"]


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


@pytest.fixture(scope="session")
def catalog_s3(s3_server_endpoint: str) -> str:
    """moto's S3 server (session-wide, ``tests/conftest.py``) with this package's bucket."""
    s3_server.create_bucket(s3_server_endpoint, S3_BUCKET)
    return s3_server_endpoint


@pytest.fixture
def s3_proxy(catalog_s3: str) -> Iterator[NetProxy]:
    """Our proxy in front of that server, for one test: it counts, delays and fails requests."""
    with NetProxy(catalog_s3) as p:
        yield p


def proxied_ref(name: str, tmp_path: Path, proxy: NetProxy, prefix: str, **properties: str) -> TableRef:
    """State table ``name`` in a SQLite catalog of ``tmp_path``, its files under ``prefix`` on S3
    reached through ``proxy`` (which fails or delays requests), with extra FileIO ``properties``."""
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "init_catalog_tables": "true",
             "warehouse": prefix, **s3_server.properties(proxy.endpoint), **properties}
    return TableRef(name, catalog_name=name, catalog_properties=props)


@pytest.fixture
def s3_prefix(tmp_path: Path) -> str:
    """A place of this test's own in this package's bucket."""
    return f"s3://{S3_BUCKET}/{hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]}"


@dataclass
class Place:
    """Where a test's state tables live: ``local`` (the embedded catalog in ``directory``) or
    ``s3`` (files under ``s3://S3_BUCKET/<prefix>`` on moto, a SQLite catalog file in
    ``directory``, named by properties as any pyiceberg catalog is)."""

    kind: str
    directory: str
    endpoint: str | None = None
    # A SQL catalog records its name with each table: whoever reads them names it the same.
    catalog_name: str = "tests"
    opened: list[IcebergStateTable] = field(default_factory=list)

    @property
    def s3_warehouse(self) -> str:
        # One prefix per test directory: tests share the bucket, never a table.
        return f"s3://{S3_BUCKET}/{hashlib.sha256(self.directory.encode()).hexdigest()[:16]}"

    def catalog_properties(self) -> dict[str, str]:
        """The S3 place's catalog (its SQLite file, its warehouse, the server's FileIO settings)."""
        os.makedirs(self.directory, exist_ok=True)
        return {"type": "sql", "uri": f"sqlite:///{self.directory}/catalog.db", "init_catalog_tables": "true",
                "warehouse": self.s3_warehouse, **s3_server.properties(self.endpoint)}

    def ref(self, table: str = "op", **kwargs) -> TableRef:
        if self.kind == "local":
            return TableRef(table, warehouse=self.directory, **kwargs)
        return TableRef(table, catalog_name=self.catalog_name, catalog_properties=self.catalog_properties(), **kwargs)

    def open(self, layout: StateLayout = LAYOUT, table_name: str = "op", **kwargs) -> IcebergStateTable:
        """Open (creating) a state table here; closed at the end of the test."""
        table = self.ref(table_name).open(layout, **kwargs)
        self.opened.append(table)
        return table

    def cli_args(self) -> list[str]:
        """Command-line options naming this place, every catalog property given with --property
        (for commands run in process only: a child's command line must never hold a secret)."""
        if self.kind == "local":
            return ["--warehouse", self.directory]
        props = self.catalog_properties()
        warehouse = props.pop("warehouse")
        return ["--catalog", self.catalog_name, "--warehouse", warehouse,
                *(a for k, v in props.items() for a in ("--property", f"{k}={v}"))]


@pytest.fixture(params=PLACES)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Place]:
    """A fresh place for state tables, on local disk and on S3 (one test run each)."""
    endpoint = request.getfixturevalue("catalog_s3") if request.param == "s3" else None
    made = Place(request.param, str(tmp_path / f"{request.param}-warehouse"), endpoint)
    yield made
    for t in made.opened:
        t.close()
