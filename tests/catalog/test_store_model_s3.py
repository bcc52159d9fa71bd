"""The store's model-based test (``tests/statestore/test_store_model.py``) on S3: the same
machine, rules and invariants, with the store on an ``IcebergStateTable`` whose files are on
moto's S3 server (session-wide, ``tests/conftest.py``) behind a SQLite catalog file, reading
through the file cache. Restore, reopen and retention go through the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import settings

from catalog import TableRef
from statestore import StateStore, StoreConfig
from tests import s3_server
from tests.statestore.test_store_model import DESCRIPTORS, MODEL_SETTINGS, RETAIN_CHECKPOINTS, StoreMachine

S3_BUCKET = "icestate-model"
_S3: dict[str, str] = {}  # the session's moto endpoint, for the machine below


@pytest.fixture(autouse=True)
def _s3_for_the_machines(request):
    """moto's S3 server (session-wide) for ``S3Machine``, which hypothesis builds itself."""
    if "TestS3" in request.node.nodeid:
        endpoint = request.getfixturevalue("s3_server_endpoint")
        s3_server.create_bucket(endpoint, S3_BUCKET)
        _S3["endpoint"] = endpoint


class S3Machine(StoreMachine):
    """The store on an ``IcebergStateTable`` whose files are on moto's S3 server (a SQLite
    catalog file in the machine's directory), through the file cache: the same rules and
    invariants as on a local directory table (restore, reopen and retention included)."""

    CONFIG: ClassVar[dict] = {"file_cache_mode": "on"}

    def open(self) -> None:
        props = {"type": "sql", "uri": f"sqlite:///{self.dir}/catalog.db", "init_catalog_tables": "true",
                 "warehouse": f"s3://{S3_BUCKET}/{Path(self.dir).name}", **s3_server.properties(_S3["endpoint"])}
        ref = TableRef("model", catalog_name="model", catalog_properties=props)
        old = getattr(self, "table", None)
        if old is not None:
            old.close()
        self.table = ref.open(self.layout(), retain_checkpoints=RETAIN_CHECKPOINTS)
        assert self.table.location.startswith("s3://")  # the files really are on the server
        self.store = StateStore(self.table, config=StoreConfig(clock_ms=lambda: self.now_ms,
                                                               file_cache_dir=f"{self.dir}/cache", **self.CONFIG))
        self.states = {d.name: self.store.get_state(d.name) for d in DESCRIPTORS}

    def teardown(self) -> None:
        self.table.close()
        super().teardown()


TestS3 = S3Machine.TestCase
# Every checkpoint, restore and reopen goes to the server: fewer, shorter sequences.
TestS3.settings = settings(MODEL_SETTINGS, max_examples=5, stateful_step_count=40)
TestS3.pytestmark = [pytest.mark.slow]
