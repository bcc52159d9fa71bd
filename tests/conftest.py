"""Fixtures shared by every test package: real servers on loopback, each started once per
session when a test first needs it.

``s3_server_endpoint``: moto's S3 server (``tests/s3_server.py``), a real process on loopback;
its endpoint is also published in ``s3_server.ENDPOINT_ENV`` for child processes. Each package
makes its own buckets on it (``tests/contract``: the contract's bucket in its ``s3_endpoint``;
``tests/catalog``: its own).

``pg_uri``: a PostgreSQL server (``tests/pg_server.py``) with pyiceberg's SQL catalog tables;
its SQLAlchemy URI (with the password) is also published in ``pg_server.URI_ENV``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests import pg_server, s3_server


@pytest.fixture(scope="session")
def s3_server_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint (``http://127.0.0.1:<port>``) of moto's S3 server, one for the session."""
    server = s3_server.start(tmp_path_factory.mktemp("moto"))
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The SQLAlchemy URI of a real PostgreSQL server on loopback for the whole session
    (``tests.pg_server``; also in ``pg_server.URI_ENV`` for child processes), with pyiceberg's
    SQL catalog tables created. Skipped where PostgreSQL is not installed, except on CI
    (``CI`` set), whose setup installs it: there a missing server fails the tests."""
    reason = pg_server.unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL tests cannot run on CI: {reason}")
        pytest.skip(reason)
    server = pg_server.start(tmp_path_factory.mktemp("postgres"))
    try:
        from pyiceberg.catalog.sql import SqlCatalog

        # Created once, here: processes that open their first table together (a writer and
        # its compactor) would otherwise race to create them.
        SqlCatalog("setup", uri=server.uri, init_catalog_tables="true").close()
        yield server.uri
    finally:
        server.stop()
