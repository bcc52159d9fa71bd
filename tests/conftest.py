"""Fixtures shared by every test package.

``s3_server_endpoint``: moto's S3 server (``tests/s3_server.py``), a real process on loopback,
started once per session when a test first needs it; its endpoint is also published in
``s3_server.ENDPOINT_ENV`` for child processes. Each package makes its own buckets on it
(``tests/contract``: the contract's bucket in its ``s3_endpoint``; ``tests/catalog``: its own).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import s3_server


@pytest.fixture(scope="session")
def s3_server_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint (``http://127.0.0.1:<port>``) of moto's S3 server, one for the session."""
    server = s3_server.start(tmp_path_factory.mktemp("moto"))
    try:
        yield server.endpoint
    finally:
        server.stop()
