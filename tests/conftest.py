"""Fixtures shared by every test package: real servers on loopback, each started once per
session when a test first needs it.

``s3_server_endpoint``: moto's S3 server (``tests/s3_server.py``), a real process on loopback;
its endpoint is also published in ``s3_server.ENDPOINT_ENV`` for child processes. Each package
makes its own buckets on it (``tests/contract``: the contract's bucket in its ``s3_endpoint``;
``tests/catalog``: its own).

``pg_uri``: a PostgreSQL server (``tests/pg_server.py``) with pyiceberg's SQL catalog tables;
its SQLAlchemy URI (with the password) is also published in ``pg_server.URI_ENV``.

The suite runs in parallel processes (``scripts/test.sh``: pytest-xdist, work stealing), each
with its own servers and Spark session: tests marked ``slow`` are handed out first, so that the
longest ones do not start last and leave one process working alone at the end. The suite's wall
time is reported at its end against its budget.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests import pg_server, s3_server

# What the whole suite may take on the reference machine (2 cores), README's test command.
SUITE_BUDGET_S = 15 * 60
_STARTED = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # trylast: after the packages' hooks have marked their tests (``spark``); a stable sort, the
    # same in every process (xdist checks that its workers collected one order).
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # a worker of pytest-xdist: the controller reports
    wall = time.monotonic() - _STARTED
    over = "" if wall <= SUITE_BUDGET_S else f", over its budget by {(wall - SUITE_BUDGET_S) / 60:.1f} min"
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or str(getattr(config.option, "numprocesses", None) or 1)
    terminalreporter.write_line(f"suite wall time: {wall / 60:.1f} min in {workers} process(es) "
                                f"(budget {SUITE_BUDGET_S // 60} min on 2 cores{over})")


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
