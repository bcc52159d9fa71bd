"""The ``StateTable`` contract: one behaviour suite run against every table implementation.

As Flink's ``StateBackendTestBase`` and pyiceberg's catalog suite do, every test in this
package takes the ``backend`` fixture, parametrized over ``backends.BACKENDS``
(``directory``: ``DirectoryStateTable``; ``iceberg-sqlite``: ``IcebergStateTable`` on an
embedded SQLite catalog; ``iceberg-s3``: ``IcebergStateTable`` with its files on S3, moto's
server on loopback, and a SQLite catalog named by properties through ``TableRef``;
``iceberg-postgres``: ``IcebergStateTable`` on pyiceberg's SQL catalog in a real PostgreSQL
server on loopback, as a team shares one catalog, with its files in a local warehouse), and
checks only what ``statestore.table.StateTable`` promises:

* segment paths are fresh, named by ``statestore.paths`` and under the table's root;
  segments are written with ``file_schema()``;
* a commit is atomic and records its shape (id, batch id, parallelism, max parallelism,
  properties); ids only grow, also across restores and retention; segments are visible
  only once committed, listed oldest first and pruned by key-group range;
* ``restore`` reaches every retained checkpoint (and the newest with None), reading no
  data file; an unknown id is a ``CheckpointNotFoundError`` naming the retained ones; a
  commit after restoring an older checkpoint abandons the newer line;
* retention keeps the newest K checkpoints and deletes the files no retained checkpoint
  references (never one that a retained checkpoint does, nor a foreign file, nor a segment
  of a checkpoint still in flight);
* a failed or crashed commit leaves the previous checkpoint; a missing or damaged segment
  is a ``CorruptSegmentError`` naming the file; a fresh table object (another process)
  sees the same state; a ``StateStore`` on top reads the same through put, checkpoint,
  restore and rescale.

What only one implementation does (Iceberg snapshots, tags, forks and manifests; the
directory's HEAD and checkpoint files) is tested beside it, in ``tests/catalog`` and
``tests/statestore``.

Adding a backend (an object store, another catalog): subclass ``backends.Backend`` with
``_open`` (open the table at ``self.location``), ``root``, ``name_in_errors`` and
``commit_record``, and add it to ``BACKENDS``: every test here then runs on it, with the
class's ``id`` as the parameter id. A backend that needs a server (moto for S3, PostgreSQL)
starts it in a session fixture (``s3_endpoint`` here, ``pg_uri`` in ``tests/conftest.py``) that
``backend`` requests for that parameter only (``backends.SERVERS``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from statestore import file_cache
from tests import s3_server
from tests.contract.backends import BACKENDS, SERVERS, Backend


@pytest.fixture(scope="session", autouse=True)
def file_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The file cache (on by default for the S3 backend) keeps its files under the session's
    temporary directory, and this process's caches are closed at the end."""
    directory = str(tmp_path_factory.mktemp("file-cache"))
    saved = os.environ.get(file_cache.ENV_DIR)
    os.environ[file_cache.ENV_DIR] = directory
    try:
        yield directory
    finally:
        file_cache.close_process_file_caches()
        if saved is None:
            os.environ.pop(file_cache.ENV_DIR, None)
        else:
            os.environ[file_cache.ENV_DIR] = saved


@pytest.fixture(scope="session")
def s3_endpoint(s3_server_endpoint: str) -> str:
    """moto's S3 server on loopback for the whole session (``tests/conftest.py``, shared with
    other test packages), with the contract's bucket."""
    s3_server.create_bucket(s3_server_endpoint, BACKENDS["iceberg-s3"].BUCKET)
    return s3_server_endpoint


@pytest.fixture(params=list(BACKENDS), ids=list(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """A backend whose tables live in a fresh location; every table it opened is closed after."""
    if request.param in SERVERS:
        request.getfixturevalue(SERVERS[request.param])
    made = BACKENDS[request.param](str(tmp_path / request.param))
    yield made
    made.close_all()
