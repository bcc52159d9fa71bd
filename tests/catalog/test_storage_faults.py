"""Storage faults (issue 14): our proxy in front of moto's real S3 server injects them, a small
tmpfs fills up; nothing we integrate with is mocked.

* Transient faults (503 SlowDown and 500 answers, connections reset mid-request and
  mid-response, slow answers) on each method a checkpoint, a restore and a lookup send (GET,
  HEAD, PUT, the POSTs of a multipart upload, DELETE) are retried by the S3 client with the
  bounded backoff ``catalog/fileio.py`` configures: the calls succeed, the state equals a
  model, every failed request was sent again and none more than ``ATTEMPTS`` times.
* Permanent faults (every request failing, a server that hangs) fail the checkpoint within a
  bounded time with ``StorageUnavailableError`` naming the table and saying what to do; the
  committed state is unchanged, and once the fault is lifted the next checkpoint commits
  everything the failed one held.
* A full disk under a local table fails the flush with ``StorageFullError`` naming the
  directory; after space is freed the same store checkpoints everything. A full file-cache
  disk fails nothing: reads go to the remote store.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from pyarrow.fs import AwsStandardS3RetryStrategy

from catalog import TableRef
from catalog.fileio import (
    DEFAULT_S3_CONNECT_TIMEOUT_S,
    DEFAULT_S3_REQUEST_TIMEOUT_S,
    DEFAULT_S3_RETRY_MAX_ATTEMPTS,
    METADATA_FILES,
    S3_RETRY_MAX_ATTEMPTS,
    StateFileIO,
    s3_retry_options,
    wait_for_deletes,
)
from statestore import StateStore, StoreConfig
from statestore.descriptors import ValueStateDescriptor
from statestore.errors import StorageFullError, StorageUnavailableError
from statestore.file_cache import close_process_file_caches
from statestore.layout import StateLayout
from tests import s3_server
from tests.catalog.catalog_helpers import KEY_SCHEMA, LAYOUT
from tests.catalog.conftest import proxied_ref
from tests.net_proxy import NetProxy, Traffic

# The S3 client's figures for these tests (production's are in catalog/fileio.py): attempts of
# one request in all, and seconds without a byte before an attempt fails. SLOW_S, the delay of
# a slow answer, stays under the request timeout: slow is not dead.
ATTEMPTS = 3
REQUEST_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0
SLOW_S = 1.2
# Backoff of the AWS standard strategy: before retry i a random wait below 2^(i-1) s.
BACKOFF_MAX_S = sum(2 ** i for i in range(ATTEMPTS - 1))
# A hung server holds each attempt of an upload for the request timeout plus about 6 s
# (measured with pyarrow 26: the SDK's aws-chunked PUT with Expect: 100-continue), so the hang
# test allows fewer, shorter attempts to stay fast.
HANG_ATTEMPTS = 2
HANG_REQUEST_TIMEOUT_S = 1.0
UPLOAD_STALL_EXTRA_S = 6.0
METHODS = ("GET", "HEAD", "PUT", "DELETE")

USERS = [f"u{i}" for i in range(30)]
FIRST = {u: i for i, u in enumerate(USERS[:20])}
SECOND = {u: 100 + i for i, u in enumerate(USERS[10:])}
BOTH = {**FIRST, **SECOND}


@pytest.fixture
def proxy(s3_proxy: NetProxy) -> NetProxy:
    return s3_proxy


@pytest.fixture
def ref(tmp_path: Path, proxy: NetProxy, s3_prefix: str) -> TableRef:
    return proxied_ref("faults", tmp_path, proxy, s3_prefix, **{
        S3_RETRY_MAX_ATTEMPTS: str(ATTEMPTS), "s3.request-timeout": str(REQUEST_TIMEOUT_S),
        "s3.connect-timeout": str(CONNECT_TIMEOUT_S)})


def _counts(store: StateStore, users: list[str] = USERS) -> list:
    return store.get_state("count").get_batch(pa.table({"user": users})).to_pylist()


def _put(store: StateStore, values: dict[str, int]) -> None:
    store.get_state("count").update_batch(pa.table({"user": list(values)}), pa.array(list(values.values()), pa.int64()))


def _after_first(ref: TableRef, **open_kwargs) -> StateStore:
    """A store whose checkpoint 1 (batch 0) holds FIRST, with SECOND written since."""
    store = StateStore(ref.open(LAYOUT, **open_kwargs), task_index=0, parallelism=1)
    _put(store, FIRST)
    store.checkpoint(batch_id=0)
    _put(store, SECOND)
    return store


def _fresh_counts(ref: TableRef) -> tuple[int, list[int | None], list]:
    """What a new process would restore: the newest checkpoint id, the batch ids and the counts,
    read through the server (no metadata from memory, no file cache)."""
    METADATA_FILES.clear()
    with ref.open() as fresh:
        store = StateStore(fresh, task_index=0, parallelism=1, config=StoreConfig(file_cache_mode="off"))
        return (fresh.current_checkpoint().checkpoint_id, [c.batch_id for c in fresh.list_checkpoints()],
                _counts(store))


def _check_retried_and_bounded(traffic: Traffic) -> int:
    """Every request the proxy failed (an error answer or a reset) was sent again, and no
    request was attempted more than ATTEMPTS times in a row; returns how many were failed."""
    attempts: dict[tuple[str, str], list[bool]] = defaultdict(list)  # (method, target) -> failed?
    for r in traffic.requests:
        attempts[(r.method, r.target)].append(r.injected_status is not None or r.injected_reset is not None)
    failed = 0
    for key, outcomes in attempts.items():
        assert not outcomes[-1], f"{key}: its last attempt was failed by the proxy and never retried"
        run = 0
        for was_failed in outcomes:
            run = run + 1 if was_failed else 0
            assert run < ATTEMPTS, f"{key}: attempted more than {ATTEMPTS} times in a row ({outcomes})"
        failed += sum(outcomes)
    return failed


# --- the client's figures ------------------------------------------------------------------

class OneAttempt(AwsStandardS3RetryStrategy):
    """A retry strategy named by ``s3.retry-strategy-impl`` (built without arguments)."""

    def __init__(self) -> None:
        super().__init__(max_attempts=1)


def _attempts_of_a_failing_head(proxy: NetProxy, props: dict[str, str], location: str) -> int:
    fs = StateFileIO({**s3_server.properties(proxy.endpoint), **props}).fs_by_scheme("s3", location.split("/")[2])
    path = location.removeprefix("s3://") + "/probe"
    with fs.open_output_stream(path) as out:
        out.write(b"x")
    proxy.reset()
    proxy.fail_next(100, 503)
    try:
        with pytest.raises(OSError, match=r"503"):
            fs.get_file_info(path)
    finally:
        proxy.fail_next(0)
    return proxy.snapshot().count


def test_the_s3_client_has_bounded_retries_and_timeouts_from_the_properties(proxy, s3_prefix):
    """StateFileIO's S3 filesystem: without properties, the documented timeouts; a request
    answered 503 forever is attempted exactly ``s3.retry-max-attempts`` times (pyarrow's own
    default, 3, was what pyiceberg's filesystem got whatever the properties said, and a
    ``s3.retry-strategy-impl`` was dropped when the filesystem was rebuilt); bad values are
    refused naming the property."""
    fs = StateFileIO(s3_server.properties(proxy.endpoint)).fs_by_scheme("s3", "bucket")
    options = fs.__reduce__()[1][0]
    assert (options["connect_timeout"], options["request_timeout"]) == (
        DEFAULT_S3_CONNECT_TIMEOUT_S, DEFAULT_S3_REQUEST_TIMEOUT_S)
    assert options["allow_delayed_open"]
    assert s3_retry_options({})["retry_strategy"].max_attempts == DEFAULT_S3_RETRY_MAX_ATTEMPTS

    assert _attempts_of_a_failing_head(proxy, {S3_RETRY_MAX_ATTEMPTS: "1"}, s3_prefix) == 1
    assert _attempts_of_a_failing_head(proxy, {S3_RETRY_MAX_ATTEMPTS: "2"}, s3_prefix) == 2
    impl = {"s3.retry-strategy-impl": f"{__name__}.OneAttempt"}
    assert _attempts_of_a_failing_head(proxy, impl, s3_prefix) == 1
    for name, bad in ((S3_RETRY_MAX_ATTEMPTS, "0"), (S3_RETRY_MAX_ATTEMPTS, "2.5"), ("s3.request-timeout", "-1"),
                      ("s3.connect-timeout", "soon"), ("s3.retry-strategy-impl", "no.such.Strategy")):
        with pytest.raises(ValueError, match=rf"{name}"):
            s3_retry_options({name: bad})


# --- transient faults -----------------------------------------------------------------------

# One fault per method and round, two for GET: one GET may meet both and still succeed on its
# third attempt. 503 SlowDown (throttling) on GET and PUT, 500 on HEAD and DELETE.
FAULTS_OF = {"GET": 2, "HEAD": 1, "PUT": 1, "DELETE": 1}
TRANSIENT: dict[str, Callable[[NetProxy, str, int], None]] = {
    "503-and-500-answers": lambda p, m, n: p.fail_next(n, 503 if m in ("GET", "PUT") else 500, method=m, append=True),
    "reset-mid-request": lambda p, m, n: p.reset_next(n, method=m, append=True),
    "reset-mid-response": lambda p, m, n: p.reset_next(n, method=m, after_response_bytes=40, append=True),
    "slow-answers": lambda p, m, n: p.delay_next(n, SLOW_S, method=m, append=True),
}


def _inject(proxy: NetProxy, fault: str) -> int:
    """Queue a round of ``fault`` on every method; how many faults were queued."""
    for m, n in FAULTS_OF.items():
        TRANSIENT[fault](proxy, m, n)
    return sum(FAULTS_OF.values())


@pytest.mark.parametrize("fault", [pytest.param(f, marks=pytest.mark.slow) if f == "slow-answers" else f
                                   for f in TRANSIENT])
def test_a_checkpoint_restore_and_lookup_meeting_transient_faults_succeed(ref, proxy, fault):
    """With faults of the kind queued for each method (GET, HEAD, PUT, DELETE), a checkpoint
    (segment and metadata uploads, the retention's deletes) succeeds; with a new round queued,
    a restore by a fresh table and a lookup through the server succeed too; the state equals
    the model; the proxy saw every failed request sent again, none more than ATTEMPTS times."""
    store = _after_first(ref, retain_checkpoints=1)
    proxy.reset()
    queued = _inject(proxy, fault)
    t0 = time.monotonic()
    info = store.checkpoint(batch_id=1)
    wait_for_deletes()  # retention's deletes run in the background
    assert _counts(store) == [BOTH.get(u) for u in USERS]
    happened = queued - proxy.failures_queued()
    _clear(proxy)
    queued = _inject(proxy, fault)  # again, for the restore's and the lookup's reads
    assert _fresh_counts(ref) == (info.checkpoint_id, [1], [BOTH.get(u) for u in USERS])
    elapsed = time.monotonic() - t0
    traffic = proxy.snapshot()
    happened += queued - proxy.failures_queued()
    assert {"GET", "PUT", "DELETE"} <= set(traffic.by_method)  # reads, writes and retention's deletes
    if fault == "slow-answers":  # waited for (some overlap: uploads and deletes run in parallel)
        assert happened >= 5 and elapsed >= 2 * SLOW_S
        assert all(r.injected_status is None and r.injected_reset is None for r in traffic.requests)
    else:
        assert _check_retried_and_bounded(traffic) == happened >= 5
    _clear(proxy)


def _clear(proxy: NetProxy) -> None:
    proxy.fail_next(0)
    proxy.reset_next(0)
    proxy.delay_next(0, 0)


BLOB_LAYOUT = StateLayout.of(KEY_SCHEMA, (ValueStateDescriptor("blob", pa.binary()),), 16)
BLOB_BYTES = 12 * 1024 * 1024  # above pyarrow's upload part size: the segment goes up in parts


def test_a_large_segment_uploads_in_parts_through_failed_posts_and_parts(ref, proxy):
    """A segment larger than one upload part goes up as a multipart upload (a POST to start
    it, PUTs of parts, a POST to complete it); a 503 on the first POST, a 500 and a reset on
    parts are retried, the checkpoint commits and a fresh table reads the bytes back."""
    blobs = {f"k{i}": os.urandom(BLOB_BYTES // 4) for i in range(4)}
    table = ref.open(BLOB_LAYOUT)
    store = StateStore(table, task_index=0, parallelism=1)
    store.get_state("blob").update_batch(pa.table({"user": list(blobs)}), pa.array(list(blobs.values()), pa.binary()))
    proxy.reset()
    proxy.fail_next(1, 503, method="POST")
    proxy.fail_next(1, 500, method="PUT", append=True)
    proxy.reset_next(1, method="PUT", append=True)
    info = store.checkpoint(batch_id=0)
    traffic = proxy.snapshot()
    assert any(r.method == "POST" and "uploads" in r.query for r in traffic.requests)  # a multipart upload
    assert any(r.method == "PUT" and "partNumber" in r.query for r in traffic.requests)
    assert _check_retried_and_bounded(traffic) == 3
    METADATA_FILES.clear()
    with ref.open() as fresh:
        assert fresh.current_checkpoint().checkpoint_id == info.checkpoint_id
        reader = StateStore(fresh, task_index=0, parallelism=1, config=StoreConfig(file_cache_mode="off"))
        assert reader.get_state("blob").get_batch(pa.table({"user": list(blobs)})).to_pylist() == list(blobs.values())
    table.close()


# --- permanent faults -----------------------------------------------------------------------

PERMANENT = {
    "every-request-503": (lambda p: p.fail_next(100_000, 503), lambda p: p.fail_next(0)),
    "every-connection-reset": (lambda p: p.reset_next(100_000), lambda p: p.reset_next(0)),
    "server-hangs": (lambda p: p.pause(), lambda p: p.resume()),
}
# (attempts, seconds) a failing checkpoint may take at most: every attempt of its first
# request, each answered at once (0.5 s allowed) or held until its timeout, the backoff
# between them, and 3 s of slack for a loaded machine.
BOUNDS = {
    "every-request-503": (ATTEMPTS, ATTEMPTS * 0.5 + BACKOFF_MAX_S + 3),
    "every-connection-reset": (ATTEMPTS, ATTEMPTS * 0.5 + BACKOFF_MAX_S + 3),
    "server-hangs": (HANG_ATTEMPTS, HANG_ATTEMPTS * (HANG_REQUEST_TIMEOUT_S + UPLOAD_STALL_EXTRA_S)
                     + sum(2 ** i for i in range(HANG_ATTEMPTS - 1)) + 3),
}


@pytest.mark.parametrize("fault", [pytest.param(f, marks=pytest.mark.slow) if f == "server-hangs" else f
                                   for f in PERMANENT])
def test_a_permanent_fault_fails_the_checkpoint_in_bounded_time_and_loses_nothing(ref, proxy, fault):
    """Every request failing (or held by a hung server): the checkpoint fails within the
    bound the retries and timeouts make (BOUNDS: attempts x time per attempt + backoff),
    with ``StorageUnavailableError`` naming the table and saying what to do, never a secret;
    the failing request was attempted exactly ATTEMPTS times; a fresh table still restores
    checkpoint 1 with FIRST; once the fault is lifted the same store's next checkpoint commits
    everything (FIRST and SECOND, batch ids 0 and 1: nothing lost, nothing doubled)."""
    begin, end = PERMANENT[fault]
    attempts_max, bound = BOUNDS[fault]
    if fault == "server-hangs":  # the same table, through a client with shorter waits
        ref = TableRef(ref.table, catalog_name=ref.catalog_name, catalog_properties={
            **ref.catalog_properties, S3_RETRY_MAX_ATTEMPTS: str(HANG_ATTEMPTS),
            "s3.request-timeout": str(HANG_REQUEST_TIMEOUT_S)})
    store = _after_first(ref)
    location = store.table.location
    proxy.reset()
    begin(proxy)
    t0 = time.monotonic()
    try:
        with pytest.raises(StorageUnavailableError, match=r"checkpoint 2 of task 0 of state table s3://") as raised:
            store.checkpoint(batch_id=1)
    finally:
        elapsed = time.monotonic() - t0
        end(proxy)
    message = str(raised.value)
    assert location in message and "Nothing of it was committed" in message and "reachable" in message
    assert s3_server.SECRET_ACCESS_KEY not in message.replace(location, "")
    assert isinstance(raised.value, OSError)
    assert elapsed < bound, f"the checkpoint took {elapsed:.1f} s to fail, more than {bound} s"
    attempts: dict[tuple[str, str], int] = defaultdict(int)
    for r in proxy.snapshot().requests:
        attempts[(r.method, r.target)] += 1
    assert max(attempts.values()) == attempts_max, attempts  # retried, and bounded

    assert _fresh_counts(ref) == (1, [0], [FIRST.get(u) for u in USERS])
    info = store.checkpoint(batch_id=1)
    assert info.checkpoint_id == 2
    assert _counts(store) == [BOTH.get(u) for u in USERS]
    assert _fresh_counts(ref) == (2, [0, 1], [BOTH.get(u) for u in USERS])


@pytest.mark.parametrize("fault", ["every-request-503", "every-connection-reset"])
def test_a_lookup_that_cannot_reach_the_storage_says_so_and_is_not_called_corruption(ref, proxy, fault):
    """A read whose storage fails every attempt raises StorageUnavailableError saying the state is
    intact (not CorruptSegmentError, which tells the user to restore the file from a backup);
    once the storage is back the same store reads the committed state."""
    _after_first(ref).close()
    METADATA_FILES.clear()
    fresh = ref.open()
    store = StateStore(fresh, task_index=0, parallelism=1, config=StoreConfig(file_cache_mode="off"))
    begin, end = PERMANENT[fault]
    begin(proxy)
    try:
        with pytest.raises(StorageUnavailableError, match=r"could not be read: its storage failed") as raised:
            _counts(store)
    finally:
        end(proxy)
    assert "intact" in str(raised.value) and s3_server.SECRET_ACCESS_KEY not in str(raised.value)
    assert _counts(store) == [FIRST.get(u) for u in USERS]
    store.close()
    fresh.close()


def test_a_driver_commit_the_storage_fails_is_a_storage_error_and_loses_nothing(ref, proxy):
    """The streaming driver's path: the tasks flushed, then ``commit_checkpoint`` (called by the
    driver directly) meets a storage failing every request: StorageUnavailableError saying the
    checkpoint failed while committing, nothing committed, and after the storage is back the
    next checkpoint commits everything."""
    store = _after_first(ref)
    table = store.table
    checkpoint_id = table.next_checkpoint_id()
    segments = store.flush(checkpoint_id)
    begin, end = PERMANENT["every-request-503"]
    begin(proxy)
    try:
        with pytest.raises(StorageUnavailableError, match=r"checkpoint 2 of state table s3://\S+ failed while "
                                                          r"committing it"):
            table.commit_checkpoint(checkpoint_id, segments, parallelism=1, batch_id=1)
    finally:
        end(proxy)
    store.checkpoint_aborted(checkpoint_id)
    assert _fresh_counts(ref) == (1, [0], [FIRST.get(u) for u in USERS])
    store.checkpoint(batch_id=1)
    assert _fresh_counts(ref) == (2, [0, 1], [BOTH.get(u) for u in USERS])


# --- a checkpoint's own uploads ------------------------------------------------------------

def _segment_requests(traffic: Traffic) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in traffic.requests if "/data/" in r.path and r.path.endswith(".parquet")]


def test_a_store_checkpoint_on_s3_uploads_its_segment_beside_the_commit_and_never_checks_it_with_a_head(ref, proxy):
    """``StateStore.checkpoint`` on an object store: the segment goes up once (one PUT) while
    the commit prepares its metadata, and no HEAD asks the server about a file this process
    has just stored (the commit waits for the upload itself); a new process restores exactly
    what was written."""
    store = _after_first(ref)
    proxy.reset()
    store.checkpoint(batch_id=1)
    traffic = proxy.snapshot()
    segment = _segment_requests(traffic)
    assert [m for m, _ in segment] == ["PUT"], traffic.calls()
    assert _fresh_counts(ref) == (2, [0, 1], [BOTH.get(u) for u in USERS])
    # The streaming driver's path (flush by the task, commit by the driver) still checks the
    # files it did not write itself: one HEAD per segment.
    _put(store, {"u0": 7})
    checkpoint_id = store.table.next_checkpoint_id()
    segments = store.flush(checkpoint_id)
    proxy.reset()
    store.table.commit_checkpoint(checkpoint_id, segments, parallelism=1, batch_id=2)
    store.checkpoint_complete(checkpoint_id)
    assert [m for m, _ in _segment_requests(proxy.snapshot())] == ["HEAD"]
    store.close()


def test_a_segment_upload_that_fails_fails_the_checkpoint_before_the_catalog_switch_and_loses_nothing(ref, proxy):
    """The segment's background upload is refused (403, which the client does not retry)
    while the commit goes on: the checkpoint raises StorageUnavailableError naming the table,
    the catalog never switched (a new process restores checkpoint 1), no upload of the failed
    checkpoint is still running when the error is raised, and the store's next checkpoint
    commits everything the failed one held. (Every attempt failing with 503:
    ``test_a_permanent_fault_fails_the_checkpoint...``.)"""
    status = 403
    store = _after_first(ref)
    wait_for_deletes()
    proxy.reset()
    proxy.fail_next(1, status, method="PUT", path_contains="/data/")  # the segment's upload
    try:
        with pytest.raises(StorageUnavailableError, match=r"checkpoint 2 of task 0 of state table s3://"):
            store.checkpoint(batch_id=1)
        settled = proxy.snapshot().count
    finally:
        proxy.fail_next(0)
    failed = [(r.method, r.path) for r in proxy.snapshot().requests if r.injected_status == status]
    assert failed and all("/data/" in p for _, p in failed), failed
    # The metadata.json may have gone up beside the commit's waits: no catalog names it (the
    # check below), and retention deletes it once a newer one is current.
    time.sleep(0.2)
    assert proxy.snapshot().count == settled, "an upload of the failed checkpoint went on after its error"
    assert _fresh_counts(ref) == (1, [0], [FIRST.get(u) for u in USERS])
    assert store.checkpoint(batch_id=1).checkpoint_id == 2
    assert _fresh_counts(ref) == (2, [0, 1], [BOTH.get(u) for u in USERS])
    store.close()


# --- a full disk ----------------------------------------------------------------------------

TMPFS_BYTES = 4 * 1024 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of TMPFS_BYTES mounted for the test (we run as root), unmounted after it."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs on {mount} for the full-disk tests ({done.stderr.strip()}): they need "
                    "root (or CAP_SYS_ADMIN) and the mount command; run them where a tmpfs can be mounted")
    try:
        yield mount
    finally:
        close_process_file_caches()  # the file cache holds a lock file open on the disk
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(directory: Path) -> Path:
    """Write a ballast file into ``directory`` until its disk is full; the file."""
    ballast = directory / "ballast"
    chunk = b"\0" * (64 * 1024)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    with open(ballast, "ab", buffering=0) as f:  # the last bytes of the last block
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
    return ballast


def test_a_full_disk_fails_the_flush_cleanly_and_the_store_resumes_when_space_is_back(small_disk):
    """A local table on a small tmpfs: with the disk full, the checkpoint fails with
    ``StorageFullError`` (an ``OSError`` of ``ENOSPC``) naming the table's directory and saying
    to free space; a fresh table restores checkpoint 1 unchanged; once the ballast is deleted
    the same store's next checkpoint commits everything it held."""
    ref = TableRef("full", warehouse=str(small_disk / "warehouse"))
    store = _after_first(ref)
    ballast = _fill(small_disk)
    with pytest.raises(StorageFullError, match=r"No space is left on the disk holding .*small-disk") as raised:
        store.checkpoint(batch_id=1)
    assert raised.value.errno == errno.ENOSPC and "Free space on that disk" in str(raised.value)
    assert _fresh_counts(ref) == (1, [0], [FIRST.get(u) for u in USERS])
    with pytest.raises(StorageFullError):  # still full: fails again, the same way
        store.checkpoint(batch_id=1)
    ballast.unlink()
    info = store.checkpoint(batch_id=1)
    assert info.checkpoint_id == 2 and _counts(store) == [BOTH.get(u) for u in USERS]
    assert _fresh_counts(ref) == (2, [0, 1], [BOTH.get(u) for u in USERS])
    store.table.close()


def test_a_full_file_cache_disk_fails_no_read_and_no_checkpoint(ref, proxy, small_disk):
    """The file cache on a full tmpfs: checkpoints and lookups of an S3 table succeed, the
    segments served from the remote store uncached (the proxy sees their GETs); once space is
    back, the next reads fill the cache again and are then served from it."""
    cache_dir = str(small_disk / "cache")
    config = StoreConfig(file_cache_mode="on", file_cache_dir=cache_dir, file_cache_reserved_free_bytes=0)
    ballast = _fill(small_disk)
    table = ref.open(LAYOUT)
    store = StateStore(table, task_index=0, parallelism=1, config=config)
    _put(store, FIRST)
    store.checkpoint(batch_id=0)
    _put(store, SECOND)
    store.checkpoint(batch_id=1)
    cache = store.reader.file_cache
    assert cache is not None and len(cache) == 0 and cache.counters.uncached >= 2

    proxy.reset()
    reader = StateStore(table, task_index=0, parallelism=1, config=config)
    assert _counts(reader) == [BOTH.get(u) for u in USERS]
    assert proxy.snapshot().by_method.get("GET", 0) >= 2  # read from the server
    assert len(cache) == 0

    ballast.unlink()
    again = StateStore(table, task_index=0, parallelism=1, config=config)
    assert _counts(again) == [BOTH.get(u) for u in USERS]
    assert len(cache) >= 2  # cached now
    proxy.reset()
    last = StateStore(table, task_index=0, parallelism=1, config=config)
    assert _counts(last) == [BOTH.get(u) for u in USERS]
    assert proxy.snapshot().by_method.get("GET", 0) == 0  # served from the cache
    table.close()
