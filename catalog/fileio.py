"""The FileIO of state tables: pyiceberg's pyarrow FileIO, with fewer requests on object stores.

pyarrow's S3 output streams start a multipart upload when opened, so every file pyiceberg or a
task writes (a 2 kB manifest, a metadata.json, a segment) costs three requests (initiate,
part, complete), one after another. With ``allow_delayed_open`` a file smaller than one part
goes up as a single PUT when it is closed. ``StateFileIO`` is pyiceberg's ``PyArrowFileIO``
with that setting and with bounded retries and timeouts; everything else (endpoint,
credentials, region) is pyiceberg's, from the same properties.

Retries and timeouts (``s3_retry_options``; the one place they are set, for the driver and the
tasks alike, which build their filesystem from the same storage properties): every S3 request
(HEAD, GET, PUT, the POSTs of a multipart upload, DELETE) that fails with a retryable error
(HTTP 500, 502, 503 and 504, throttling such as 503 SlowDown, a connection refused, reset or
timed out) is tried at most ``s3.retry-max-attempts`` times in all (default
``DEFAULT_S3_RETRY_MAX_ATTEMPTS`` = 5), with the AWS SDK's standard exponential backoff with
full jitter (before retry i a random wait in [0, 2^(i-1)) seconds, at most 20 s, so at most
1 + 2 + 4 + 8 = 15 s over the 4 retries of 5 attempts, 7.5 s on average) and its retry quota
(a client that keeps failing stops retrying early). A request during which the server sends no
byte for ``s3.request-timeout`` seconds (default ``DEFAULT_S3_REQUEST_TIMEOUT_S`` = 10: the
SDK's low-speed limit, not a bound on a long transfer that keeps moving) fails that attempt,
as does a connection not made within ``s3.connect-timeout`` seconds (default
``DEFAULT_S3_CONNECT_TIMEOUT_S`` = 3). A hung server therefore fails one read after at most
5 x 10 s + 15 s = 65 s, and one upload after about 5 x 16 s + 15 s = 95 s (an upload's attempt
waits about 6 s more than the timeout: measured with pyarrow 26, whose SDK sends PUTs
aws-chunked with ``Expect: 100-continue``), failing the checkpoint instead of stalling it.
``s3.retry-strategy-impl`` (pyiceberg's: a ``pyarrow.fs.S3RetryStrategy`` class, built without
arguments) replaces the strategy altogether. A filesystem pickled by pyarrow loses its retry
strategy (pyarrow does not pickle it): processes build theirs from the properties instead.

Iceberg's metadata files (a table's ``metadata.json`` versions, manifest lists and manifests)
are written once, under names holding a UUID, and never changed. ``StateFileIO`` keeps the ones
this process wrote or read in memory (``MetadataFileCache``, bounded, least recently used out
first), so a commit does not read back the manifest list and the metadata.json it wrote at the
previous commit (pyiceberg's fast append reads the parent's manifest list, and a SQL catalog's
commit reloads the current metadata.json: 6 requests, one after another); it writes them from a
buffer without first asking whether the name exists (a HEAD and, on S3, a LIST per file), and
knows their sizes without a HEAD.

A checkpoint commit's manifests and manifest list go up together, not one after another
(``UPLOADS``): inside the commit's ``deferred`` block (keyed by the commit's UUID, which their
names hold), each is handed to a pool of I/O threads when its writer closes it (its bytes are
already in ``METADATA_FILES`` for any reader in this process), and the commit waits for them,
raising the first failure, before the catalog call that switches the table: the catalog never
points at metadata whose files are missing. Every other metadata file (metadata.json, other
pyiceberg commits) is written when closed. Deletes of metadata files (pyiceberg's pruning of
old ``metadata.json`` versions, three requests on S3) run on threads of their own and are not
waited for: a file that failed to go is unreferenced garbage that retention's sweep finds.
The threads are created when first used, again in a child after ``fork``, and at interpreter
exit (when pools refuse work) the work runs in the caller.

Catalogs opened through ``TableRef`` and the embedded default use it unless their properties
name another ``py-io-impl``; tasks get it through the shipped storage properties.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pyarrow.fs import AwsStandardS3RetryStrategy, FileSystem, S3RetryStrategy
from pyiceberg.io import (
    PY_IO_IMPL,
    S3_CONNECT_TIMEOUT,
    S3_REQUEST_TIMEOUT,
    S3_RETRY_STRATEGY_IMPL,
    InputFile,
    InputStream,
    OutputFile,
    OutputStream,
)
from pyiceberg.io.pyarrow import PyArrowFileIO

log = logging.getLogger(__name__)

STATE_FILE_IO = f"{__name__}.StateFileIO"
METADATA_CACHE_BYTES_MAX = 64 * 1024 * 1024
METADATA_JSON_PER_TABLE = 2  # the newest .metadata.json files of a table kept in memory
IO_THREADS = 16  # concurrent uploads of a commit's metadata files (and its checks) per process
DELETE_THREADS = 8  # concurrent deletes of garbage per process
# Retries and timeouts of S3 requests (module docstring): attempts of one request in all.
S3_RETRY_MAX_ATTEMPTS = "s3.retry-max-attempts"
DEFAULT_S3_RETRY_MAX_ATTEMPTS = 5
DEFAULT_S3_CONNECT_TIMEOUT_S = 3.0
DEFAULT_S3_REQUEST_TIMEOUT_S = 10.0


def _plain(uri: str) -> str:
    """A local URI as its path (``file:///a`` and ``/a`` name one file); others as they are."""
    return "/" + uri.removeprefix("file:").lstrip("/") if uri.startswith("file:") else uri


def is_inside(uri: str, root: str) -> bool:
    """Whether ``uri`` names a file under directory ``root`` (URIs or local paths), with no
    empty, ``.`` or ``..`` part after it."""
    prefix = _plain(root).rstrip("/") + "/"
    plain = _plain(uri)
    return plain.startswith(prefix) and all(p not in ("", ".", "..") for p in plain[len(prefix):].split("/"))


def table_root(metadata_location: str) -> str | None:
    """The table directory that the place of its metadata file says, ``<root>/metadata/<file>``
    (the place the catalog recorded, not what the file says); None when it is not there."""
    head = metadata_location.rpartition("/")[0]
    root, _, name = head.rpartition("/")
    return root if name == "metadata" and root else None


def is_metadata_file(location: str) -> bool:
    """Whether ``location`` names an Iceberg metadata file (immutable, uniquely named)."""
    return "/metadata/" in location and location.endswith((".metadata.json", ".avro"))


def _table_dir(metadata_location: str) -> str:
    """The table directory of a file under its ``metadata/`` folder."""
    return metadata_location.rpartition("/metadata/")[0]


class MetadataFileCache:
    """The bytes of metadata files by location, bounded by ``bytes_max``; thread safe.

    Of a table's ``.metadata.json`` files only the newest ``METADATA_JSON_PER_TABLE`` stay: each
    refresh of a table that another process commits to reads a new one (every checkpoint's), and
    an older one is never read again; kept, they would fill the cache to its bound in every process
    that follows a table (the compactor: +33 MB in 90 minutes of 3-second checkpoints). Manifest
    lists and manifests leave with the snapshots that name them (``ManifestCache.forget``)."""

    def __init__(self, bytes_max: int):
        self.bytes_max = bytes_max
        self.size_bytes = 0
        self._files: OrderedDict[str, bytes] = OrderedDict()
        self._metadata_json: dict[str, list[str]] = {}  # table directory -> its cached .metadata.json, oldest first
        self._lock = threading.Lock()

    def get(self, location: str) -> bytes | None:
        with self._lock:
            data = self._files.get(location)
            if data is not None:
                self._files.move_to_end(location)
            return data

    def put(self, location: str, data: bytes) -> None:
        if len(data) > self.bytes_max:
            return
        with self._lock:
            self._drop(location)
            self.size_bytes += len(data)
            self._files[location] = data
            if location.endswith(".metadata.json"):
                newest = self._metadata_json.setdefault(_table_dir(location), [])
                newest.append(location)
                while len(newest) > METADATA_JSON_PER_TABLE:
                    self._drop(newest[0])
            while self.size_bytes > self.bytes_max:
                self._drop(next(iter(self._files)))

    def discard(self, location: str) -> None:
        with self._lock:
            self._drop(location)

    def _drop(self, location: str) -> None:
        data = self._files.pop(location, None)
        if data is None:
            return
        self.size_bytes -= len(data)
        if location.endswith(".metadata.json"):
            newest = self._metadata_json.get(_table_dir(location), [])
            if location in newest:
                newest.remove(location)
            if not newest:
                self._metadata_json.pop(_table_dir(location), None)

    def __len__(self) -> int:
        return len(self._files)

    def clear(self) -> None:
        with self._lock:
            self._files.clear()
            self._metadata_json.clear()
            self.size_bytes = 0


METADATA_FILES = MetadataFileCache(METADATA_CACHE_BYTES_MAX)


class _Pools:
    """The process's background threads: uploads (and a commit's checks), and deletes (their
    own threads: garbage going never delays a commit's uploads). Created when first used, and
    again in a child after ``fork`` (threads do not survive it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._io: ThreadPoolExecutor | None = None
        self._delete: ThreadPoolExecutor | None = None

    def io(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._io is None:
                self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="icestate-io")
            return self._io

    def delete(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._delete is None:
                self._delete = ThreadPoolExecutor(DELETE_THREADS, thread_name_prefix="icestate-delete")
            return self._delete

    def forget(self) -> None:
        self._lock = threading.Lock()
        self._io = self._delete = None


_POOLS = _Pools()


def run_in_background(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit(fn, *args)``, or at interpreter exit (pools refuse work then) ``fn`` run now."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:
            done.set_exception(e)
        return done


def submit_io(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn(*args)`` on the I/O threads (a commit's checks beside its uploads)."""
    return run_in_background(_POOLS.io(), fn, *args)


class PendingUploads:
    """Uploads of metadata files under way; thread safe.

    Only the files of a ``deferred`` commit upload in the background: those whose names hold
    its tag (the commit's UUID, in every manifest and manifest list pyiceberg names for it).
    The commit waits for them (``wait``) before the catalog call that switches the table,
    whatever the catalog (a REST catalog writes no metadata.json through this FileIO); other
    writers, of the same table or not, are never held up by them nor see their failures.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}  # location -> its upload
        self._deferred: Counter[str] = Counter()

    @contextlib.contextmanager
    def deferred(self, tag: str) -> Iterator[None]:
        """Within the block, the metadata files named with ``tag`` upload in the background;
        the block calls ``wait(tag)`` before anything points at them. Leaving it, uploads still
        under way are waited for and their failures forgotten: the block did not get to its
        switch, so nothing references them."""
        with self._lock:
            self._deferred[tag] += 1
        try:
            yield
        finally:
            with self._lock:
                self._deferred[tag] -= 1
                if not self._deferred[tag]:
                    del self._deferred[tag]
            try:
                self.wait(tag)
            except OSError as e:
                log.info("metadata uploads of abandoned commit %s failed (%s); nothing references them", tag, e)

    def deferred_tag(self, location: str) -> str | None:
        name = location.rsplit("/", 1)[-1]
        with self._lock:
            return next((tag for tag in self._deferred if tag in name), None)

    def start(self, location: str, upload: Callable[[], None]) -> None:
        future = run_in_background(_POOLS.io(), upload)
        with self._lock:
            self._pending[location] = future
        future.add_done_callback(lambda f: self._settled(location, f))

    def _settled(self, location: str, future: Future) -> None:
        if future.exception() is not None:
            METADATA_FILES.discard(location)  # never stored: not to be read from memory either
            return  # kept until a wait raises it
        with self._lock:
            if self._pending.get(location) is future:
                del self._pending[location]

    def wait(self, tag: str) -> None:
        """Wait for the uploads of the files named with ``tag``; raise the first failure (each
        failure is raised once)."""
        with self._lock:
            futures = [(loc, f) for loc, f in self._pending.items() if tag in loc.rsplit("/", 1)[-1]]
        errors = [(loc, f.exception()) for loc, f in futures if f.exception() is not None]
        with self._lock:
            for loc, f in futures:
                if self._pending.get(loc) is f:
                    del self._pending[loc]
        if errors:
            location, error = errors[0]
            raise OSError(f"{len(errors)} metadata file(s) could not be stored, first {location}: {error}") from error

    def wait_file(self, location: str) -> None:
        """Wait for ``location``'s upload, if under way (done either way: a failed one is not
        there to read)."""
        with self._lock:
            future = self._pending.get(location)
        if future is not None:
            future.exception()

    def forget(self) -> None:
        self._lock = threading.Lock()
        self._pending, self._deferred = {}, Counter()


UPLOADS = PendingUploads()
_GATE = threading.local()


@contextlib.contextmanager
def metadata_json_gate(wait: Callable[[], None]) -> Iterator[Callable[[], bool]]:
    """Within the block, on this thread, the next metadata.json this FileIO stores uploads in
    the background while ``wait()`` runs, and the store returns once both are done, raising
    ``wait``'s error or the upload's. A SQL catalog's ``commit_table`` stores the new
    metadata.json and then switches the table: its last round trip so overlaps the commit's
    uploads still under way, and the switch still comes after all of them. Yields whether the
    gate was used (if not, ``wait`` never ran)."""
    used = []
    _GATE.wait = lambda: (used.append(True), wait())
    try:
        yield lambda: bool(used)
    finally:
        _GATE.wait = None
_deleting: set[Future] = set()
_deleting_lock = threading.Lock()


def delete_later(delete: Callable[[str], None], location: str) -> None:
    """Run ``delete(location)`` on the delete threads (it logs its own failures)."""
    future = run_in_background(_POOLS.delete(), delete, location)
    with _deleting_lock:
        _deleting.add(future)
    future.add_done_callback(_deleted)


def _deleted(future: Future) -> None:
    with _deleting_lock:
        _deleting.discard(future)


def wait_for_deletes() -> None:
    """Return when every delete this process started in the background is done."""
    with _deleting_lock:
        pending = list(_deleting)
    for future in pending:
        future.result()


def _forget_after_fork() -> None:
    global _deleting, _deleting_lock
    _POOLS.forget()
    UPLOADS.forget()
    _deleting, _deleting_lock = set(), threading.Lock()
    _shared_s3_fs.cache_clear()


@functools.lru_cache(maxsize=32)
def _shared_s3_fs(netloc: str | None, settings: tuple[tuple[str, str], ...]) -> FileSystem:
    """The process's S3 filesystem for a bucket and S3 settings: pyiceberg makes a new FileIO for
    every table it loads (a SQL catalog's commit loads the table twice), and building pyarrow's
    ``S3FileSystem`` costs 20-40 ms while requests of another filesystem are under way (measured
    in a commit on S3 whose segment and manifest uploads were going: the build waited for them),
    against one lookup here. Filesystems are thread safe; least recently used out; forgotten in
    a child after ``fork``."""
    return StateFileIO(dict(settings))._build_s3_fs(netloc)


os.register_at_fork(after_in_child=_forget_after_fork)


class _MetadataFile(InputFile, OutputFile):
    """A metadata file through ``METADATA_FILES``: read whole once, written from a buffer."""

    def __init__(self, file: Any):
        super().__init__(file.location)
        self._file = file  # pyiceberg's own file object, for what the cache cannot answer

    def __len__(self) -> int:
        data = METADATA_FILES.get(self.location)
        if data is None:
            UPLOADS.wait_file(self.location)  # written by this process, dropped from memory meanwhile
            return len(self._file)
        return len(data)

    def exists(self) -> bool:
        if METADATA_FILES.get(self.location) is not None:
            return True
        UPLOADS.wait_file(self.location)
        return self._file.exists()

    def open(self, seekable: bool = True) -> InputStream:
        data = METADATA_FILES.get(self.location)
        if data is None:
            UPLOADS.wait_file(self.location)  # written by this process, dropped from memory meanwhile
            with self._file.open(seekable=False) as f:
                data = f.read()
            METADATA_FILES.put(self.location, data)
        return io.BytesIO(data)

    def to_input_file(self) -> InputFile:
        return self

    def create(self, overwrite: bool = False) -> OutputStream:
        # No existence check: the name holds a UUID (the check is a HEAD and, on S3, a LIST).
        return _BufferedWrite(self)

    def store(self, data: bytes) -> None:
        """Store the file: in the background when it belongs to a ``deferred`` commit (readable
        from memory meanwhile); a commit's metadata.json beside the commit's last waits when
        its thread set a ``metadata_json_gate``; else now."""
        METADATA_FILES.put(self.location, data)
        if UPLOADS.deferred_tag(self.location) is not None:
            UPLOADS.start(self.location, lambda: self._put(data))
            return
        gate = getattr(_GATE, "wait", None)
        try:
            if gate is not None and self.location.endswith(".metadata.json"):
                _GATE.wait = None  # one metadata.json per gate
                upload = run_in_background(_POOLS.io(), self._put, data)
                try:
                    gate()
                finally:
                    failed = upload.exception()  # waited for either way: nothing goes on after a failure
                if failed is not None:
                    raise failed
                return
            self._put(data)
        except BaseException:
            METADATA_FILES.discard(self.location)
            raise

    def _put(self, data: bytes) -> None:
        with self._file.create(overwrite=True) as out:
            out.write(data)


class _BufferedWrite(io.BytesIO):
    """The bytes of a metadata file, written to storage (one PUT) and cached when closed."""

    def __init__(self, file: _MetadataFile):
        super().__init__()
        self._target = file

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._target.store(data)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:  # a write that failed halfway leaves no file
            super().close()
            return
        self.close()


class StateFileIO(PyArrowFileIO):
    """``PyArrowFileIO`` whose S3 filesystem writes small files with one PUT, and whose
    metadata files go through ``METADATA_FILES``."""

    def new_input(self, location: str) -> InputFile:
        file = super().new_input(location)
        return _MetadataFile(file) if is_metadata_file(location) else file

    def new_output(self, location: str) -> OutputFile:
        file = super().new_output(location)
        return _MetadataFile(file) if is_metadata_file(location) else file

    # The table directory this FileIO may delete in (``confine_deletes``); None: anywhere.
    _deletes_root: str | None = None

    def confine_deletes(self, root: str) -> None:
        """Delete nothing outside ``root``, the table's directory: pyiceberg deletes the old
        metadata files a table's metadata log names, and that log is a file in the table's
        storage, which could name any file this process can reach."""
        self._deletes_root = root

    def delete(self, location: str | InputFile | OutputFile) -> None:
        path = location if isinstance(location, str) else location.location
        if self._deletes_root is not None and not is_inside(path, self._deletes_root):
            log.error("not deleting %s: it is outside the table's directory %s, so the table's metadata that named "
                      "it is damaged or was tampered with", path, self._deletes_root)
            return
        if not is_metadata_file(path):
            super().delete(path)
            return
        METADATA_FILES.discard(path)
        delete_later(self._delete_quietly, path)

    def _delete_quietly(self, path: str) -> None:
        try:
            super().delete(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not delete the metadata file %s (%s); retention's sweep will", path, e)

    def _initialize_s3_fs(self, netloc: str | None) -> FileSystem:
        # One per bucket and S3 settings in the process (``_shared_s3_fs``): the properties
        # pyiceberg's S3 filesystem and ``s3_retry_options`` read (``s3.*``, ``client.*``), not
        # the table's own, which change at every commit. The key holds their values in memory
        # only, never shown.
        return _shared_s3_fs(netloc, tuple(sorted(
            (k, v) for k, v in self.properties.items() if k.startswith(("s3.", "client.")))))

    def _build_s3_fs(self, netloc: str | None) -> FileSystem:
        fs = super()._initialize_s3_fs(netloc)
        # The pickle protocol: every option of the filesystem but its retry strategy.
        rebuild, (options,) = fs.__reduce__()
        return rebuild({**options, "allow_delayed_open": True, **s3_retry_options(self.properties)})


def s3_retry_options(properties: dict[str, str]) -> dict[str, Any]:
    """The retry strategy and timeouts of pyarrow's ``S3FileSystem`` for these FileIO
    properties (module docstring): ``s3.retry-max-attempts`` or ``s3.retry-strategy-impl``,
    ``s3.connect-timeout`` and ``s3.request-timeout`` (seconds), each with its default.

    Raises:
        ValueError: a property that is not a number in range, or a strategy class that cannot
            be imported, naming the property.
    """
    options: dict[str, Any] = {
        "connect_timeout": _seconds(properties, S3_CONNECT_TIMEOUT, DEFAULT_S3_CONNECT_TIMEOUT_S),
        "request_timeout": _seconds(properties, S3_REQUEST_TIMEOUT, DEFAULT_S3_REQUEST_TIMEOUT_S),
    }
    impl = properties.get(S3_RETRY_STRATEGY_IMPL)
    if impl:
        module, _, name = impl.rpartition(".")
        try:
            strategy = getattr(importlib.import_module(module), name)()
        except (ImportError, AttributeError, ValueError, TypeError) as e:
            raise ValueError(f"FileIO property {S3_RETRY_STRATEGY_IMPL}={impl!r}: cannot build it ({e}); "
                             "name a pyarrow.fs.S3RetryStrategy class, as module.Class") from e
        if not isinstance(strategy, S3RetryStrategy):
            raise ValueError(f"FileIO property {S3_RETRY_STRATEGY_IMPL}={impl!r} is not a pyarrow.fs.S3RetryStrategy")
        options["retry_strategy"] = strategy
        return options
    raw = properties.get(S3_RETRY_MAX_ATTEMPTS, DEFAULT_S3_RETRY_MAX_ATTEMPTS)
    try:
        attempts = int(raw)
    except (TypeError, ValueError):
        attempts = 0
    if attempts < 1 or str(attempts) != str(raw).strip():
        raise ValueError(f"FileIO property {S3_RETRY_MAX_ATTEMPTS} must be a whole number of attempts >= 1 "
                         f"(1: no retry), got {raw!r}")
    options["retry_strategy"] = AwsStandardS3RetryStrategy(max_attempts=attempts)
    return options


def _seconds(properties: dict[str, str], name: str, default: float) -> float:
    raw = properties.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0:
        raise ValueError(f"FileIO property {name} must be a positive number of seconds, got {raw!r}")
    return value


def use_state_file_io(catalog: Any) -> Any:
    """Make ``catalog``'s tables use ``StateFileIO`` unless its properties name a FileIO, and
    take no code-loading property from their metadata (``refuse_code_from_metadata``)."""
    catalog.properties.setdefault(PY_IO_IMPL, STATE_FILE_IO)
    return refuse_code_from_metadata(catalog)


# Table properties whose value names a class that pyiceberg imports and calls: the FileIO, the
# S3 retry strategy, the location provider of pyiceberg's writes. Any other property named
# ``...-impl`` or ``....impl`` is taken to load code too, so a future one is refused by default.
CODE_LOADING_PROPERTIES = (PY_IO_IMPL, S3_RETRY_STRATEGY_IMPL, "write.py-location-provider.impl")
# Table properties that send pyiceberg's writes out of the table's directory: files would be
# written where the metadata says, and its own deletes (confined to the table's directory)
# would leave them behind.
LOCATION_PROPERTIES = ("write.metadata.path", "write.data.path", "write.object-storage.path",
                       "write.folder-storage.path")


def is_refused_in_metadata(name: str) -> bool:
    """Whether a table's metadata may not set ``name`` (``check_no_code_from_metadata``)."""
    return name in CODE_LOADING_PROPERTIES or name in LOCATION_PROPERTIES or name.endswith(("-impl", ".impl"))


def refuse_code_from_metadata(catalog: Any) -> Any:
    """Make ``catalog`` refuse a table whose metadata sets a code-loading property
    (``is_refused_in_metadata``) to anything else than the catalog's own configuration does.

    pyiceberg builds a table's FileIO from the catalog's properties overlaid with the table
    metadata's own (``Catalog._load_file_io``, at every load, refresh and commit), and imports
    and calls the class a ``py-io-impl`` there names; its writes do the same with
    ``write.py-location-provider.impl``. Table metadata is a file in the table's storage: anyone
    who can write there could make every process that opens the table import a module of their
    choice and call it with the table's properties. Code is loaded only as the catalog's own
    configuration (its properties, ``.pyiceberg.yaml``, the environment) says
    (``docs/reliability.md``, threat model). Idempotent; the catalog otherwise works as before.
    """
    load = catalog._load_file_io
    if getattr(load, "_icestate_guarded", False):
        return catalog

    def _load_file_io(properties: Any = None, location: str | None = None) -> Any:
        check_no_code_from_metadata(properties or {}, catalog.properties, location)
        io = load({} if properties is None else properties, location)
        root = None if location is None else table_root(location)
        if root is not None and isinstance(io, StateFileIO):
            io.confine_deletes(root)
        return io

    _load_file_io._icestate_guarded = True
    catalog._load_file_io = _load_file_io
    return catalog


def check_no_code_from_metadata(properties: dict[str, str], configured: dict[str, str], location: str | None) -> None:
    """Raise ``UntrustedMetadataError`` when table ``properties`` set a code-loading property
    to anything else than ``configured`` (the catalog's properties) does."""
    from statestore.errors import UntrustedMetadataError

    for name, value in properties.items():
        if is_refused_in_metadata(name) and configured.get(name) != value:
            shown = value if len(value) <= 200 else f"{value[:200]}..."
            does = ("sends pyiceberg's writes out of the table's directory" if name in LOCATION_PROPERTIES
                    else "makes pyiceberg import and run code")
            raise UntrustedMetadataError(
                f"the table metadata {location or ''} sets {name}={shown!r}, a property that {does}; icestate takes "
                "such properties only from the catalog's own configuration (its properties, .pyiceberg.yaml), "
                "never from a table's metadata, which anyone who can write to the table's storage can change. "
                "Nothing was opened. If you set it, set it in the catalog's configuration instead and remove it "
                "from the table's properties; if you did not, the table's storage was tampered with: restore its "
                "metadata from a backup")
