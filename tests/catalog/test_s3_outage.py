"""The object store goes away during a checkpoint (our proxy in front of moto's real server).

Whatever step the outage hits (the segment uploads, the commit's metadata writes, or
requests failing with S3 errors), the checkpoint fails with an error, the previous checkpoint
stays exactly what it was (a fresh table object restores it), and once the store is back the
next checkpoint commits everything the failed one held: nothing is lost, nothing doubled.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from catalog import TableRef
from statestore import StateStore
from tests.catalog.catalog_helpers import LAYOUT
from tests.catalog.conftest import proxied_ref
from tests.net_proxy import NetProxy


@pytest.fixture
def proxy(s3_proxy: NetProxy) -> NetProxy:
    return s3_proxy


@pytest.fixture
def ref(tmp_path: Path, proxy: NetProxy, s3_prefix: str) -> TableRef:
    # fail fast while the server is away (the SDK's own retries would wait it out)
    return proxied_ref("outage", tmp_path, proxy, s3_prefix, **{"s3.connect-timeout": "1", "s3.request-timeout": "2"})


def _counts(store: StateStore, users: list[str]) -> list:
    return store.get_state("count").get_batch(pa.table({"user": users})).to_pylist()


def _put(store: StateStore, values: dict[str, int]) -> None:
    store.get_state("count").update_batch(pa.table({"user": list(values)}), pa.array(list(values.values()), pa.int64()))


USERS = [f"u{i}" for i in range(30)]
FIRST = {u: i for i, u in enumerate(USERS[:20])}
SECOND = {u: 100 + i for i, u in enumerate(USERS[10:])}


def _after_first(ref: TableRef) -> StateStore:
    table = ref.open(LAYOUT)
    store = StateStore(table, task_index=0, parallelism=1)
    _put(store, FIRST)
    store.checkpoint(batch_id=0)
    _put(store, SECOND)
    return store


def _check_previous_checkpoint_intact(ref: TableRef) -> None:
    with ref.open() as fresh:
        assert fresh.current_checkpoint().checkpoint_id == 1
        assert _counts(StateStore(fresh, task_index=0, parallelism=1), USERS) == [FIRST.get(u) for u in USERS]


def _check_everything_committed(ref: TableRef, store: StateStore) -> None:
    info = store.checkpoint(batch_id=1)
    expected = [SECOND.get(u, FIRST.get(u)) for u in USERS]
    assert _counts(store, USERS) == expected
    with ref.open() as fresh:
        assert fresh.current_checkpoint().checkpoint_id == info.checkpoint_id
        assert [c.batch_id for c in fresh.list_checkpoints()] == [0, 1]
        assert _counts(StateStore(fresh, task_index=0, parallelism=1), USERS) == expected


def test_server_gone_while_the_segments_upload(ref, proxy):
    store = _after_first(ref)
    proxy.stop()
    with pytest.raises(OSError):
        store.checkpoint(batch_id=1)
    proxy.resume()
    _check_previous_checkpoint_intact(ref)
    _check_everything_committed(ref, store)


# The server away (stopped), or answering every write with an error (more 503s than the SDK's
# retries), between the segment uploads and the commit.
FAULTS = {
    "server-gone": (lambda proxy: proxy.stop(), lambda proxy: proxy.resume()),
    "writes-answered-503": (lambda proxy: proxy.fail_next(50, status=503, method="PUT"),
                            lambda proxy: proxy.fail_next(0)),
}


@pytest.mark.parametrize("fault", [pytest.param(f, marks=pytest.mark.slow) for f in FAULTS])
def test_a_commit_meeting_an_outage_fails_and_the_next_commits_everything(ref, proxy, fault):
    begin, end = FAULTS[fault]
    store = _after_first(ref)
    table = store.table
    cp = table.next_checkpoint_id()
    segments = store.flush(cp)
    begin(proxy)
    with pytest.raises(OSError):
        table.commit_checkpoint(cp, segments, parallelism=1, batch_id=1)
    store.checkpoint_aborted(cp)
    end(proxy)
    _check_previous_checkpoint_intact(ref)
    table.restore()
    _check_everything_committed(ref, store)
