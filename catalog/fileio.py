"""The FileIO of state tables: pyiceberg's pyarrow FileIO, with fewer requests on object stores.

pyarrow's S3 output streams start a multipart upload when opened, so every file pyiceberg or a
task writes (a 2 kB manifest, a metadata.json, a segment) costs three requests (initiate,
part, complete), one after another. With ``allow_delayed_open`` a file smaller than one part
goes up as a single PUT when it is closed. ``StateFileIO`` is pyiceberg's ``PyArrowFileIO``
with that one setting; everything else (endpoint, credentials, region, timeouts, retries) is
pyiceberg's, from the same properties.

Iceberg's metadata files (a table's ``metadata.json`` versions, manifest lists and manifests)
are written once, under names holding a UUID, and never changed. ``StateFileIO`` keeps the ones
this process wrote or read in memory (``MetadataFileCache``, bounded, least recently used out
first), so a commit does not read back the manifest list and the metadata.json it wrote at the
previous commit (pyiceberg's fast append reads the parent's manifest list, and a SQL catalog's
commit reloads the current metadata.json: 6 requests, one after another); it writes them from a
buffer without first asking whether the name exists (a HEAD and, on S3, a LIST per file), and
knows their sizes without a HEAD.

A commit's metadata files go up together, not one after another (``UPLOADS``): a manifest or
manifest list is handed to a pool of I/O threads when its writer closes it (its bytes are
already in ``METADATA_FILES`` for any reader in this process), and a ``metadata.json`` (the
file a catalog commit then points at) returns from its close only when it and every upload
under the same metadata directory that started before it are stored; the first failure is
raised there, so the catalog never switches to metadata whose files are missing. A commit
that wrote a manifest, a manifest list and a metadata.json waits one round trip for them
instead of three. Deletes of metadata files (pyiceberg's pruning of old ``metadata.json``
versions, three requests on S3) run on a pool of their own and are not waited for: a file that
failed to go is unreferenced garbage that retention's sweep finds.

Catalogs opened through ``TableRef`` and the embedded default use it unless their properties
name another ``py-io-impl``; tasks get it through the shipped storage properties.
"""

from __future__ import annotations

import io
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pyarrow.fs import FileSystem
from pyiceberg.io import PY_IO_IMPL, InputFile, InputStream, OutputFile, OutputStream
from pyiceberg.io.pyarrow import PyArrowFileIO

log = logging.getLogger(__name__)

STATE_FILE_IO = f"{__name__}.StateFileIO"
METADATA_CACHE_BYTES_MAX = 64 * 1024 * 1024
IO_THREADS = 16  # concurrent uploads of metadata files (and commit checks) per process
DELETE_THREADS = 8  # concurrent deletes of a table's garbage per process


def is_metadata_file(location: str) -> bool:
    """Whether ``location`` names an Iceberg metadata file (immutable, uniquely named)."""
    return "/metadata/" in location and location.endswith((".metadata.json", ".avro"))


class MetadataFileCache:
    """The bytes of metadata files by location, bounded by ``bytes_max``; thread safe."""

    def __init__(self, bytes_max: int):
        self.bytes_max = bytes_max
        self.size_bytes = 0
        self._files: OrderedDict[str, bytes] = OrderedDict()
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
            old = self._files.pop(location, None)
            self.size_bytes += len(data) - (0 if old is None else len(old))
            self._files[location] = data
            while self.size_bytes > self.bytes_max:
                self.size_bytes -= len(self._files.popitem(last=False)[1])

    def discard(self, location: str) -> None:
        with self._lock:
            data = self._files.pop(location, None)
            if data is not None:
                self.size_bytes -= len(data)

    def clear(self) -> None:
        with self._lock:
            self._files.clear()
            self.size_bytes = 0


METADATA_FILES = MetadataFileCache(METADATA_CACHE_BYTES_MAX)


def _directory(location: str) -> str:
    return location.rsplit("/", 1)[0]


class PendingUploads:
    """Uploads of metadata files under way, by metadata directory; thread safe.

    ``start`` runs an upload on the I/O pool; ``wait_directory`` waits for every upload
    under a directory that started before it and raises the first failure (each upload is
    waited for, and its failure raised, once); ``wait_file`` waits for one file's upload.
    """

    def __init__(self, pool: ThreadPoolExecutor):
        self._pool = pool
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Future]] = {}

    def start(self, location: str, upload: Callable[[], None]) -> Future:
        future = self._pool.submit(upload)
        with self._lock:
            self._pending.setdefault(_directory(location), {})[location] = future
        future.add_done_callback(lambda f: self._settled(location, f))
        return future

    def _settled(self, location: str, future: Future) -> None:
        if future.exception() is not None:
            METADATA_FILES.discard(location)  # never stored: not to be read from memory either
            return  # kept until a wait raises it
        with self._lock:
            files = self._pending.get(_directory(location), {})
            if files.get(location) is future:
                del files[location]

    def wait_directory(self, directory: str) -> None:
        with self._lock:
            futures = list(self._pending.pop(directory, {}).items())
        errors = [(location, f.exception()) for location, f in futures if f.exception() is not None]
        if errors:
            location, error = errors[0]
            raise OSError(f"{len(errors)} metadata file(s) could not be stored, first {location}: {error}") from error

    def wait_file(self, location: str) -> None:
        with self._lock:
            future = self._pending.get(_directory(location), {}).get(location)
        if future is not None:
            future.exception()  # done either way; a failed upload is not there to read

    def settle(self, directory: str) -> None:
        """Wait for the uploads under ``directory`` and forget their failures (the uploads of an
        attempt that was abandoned before its metadata.json: nothing references them)."""
        try:
            self.wait_directory(directory)
        except OSError as e:
            log.info("abandoned metadata uploads under %s failed (%s); nothing references them", directory, e)


IO_POOL = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="icestate-io")
# Deletes have their own threads: garbage going never delays a commit's uploads.
DELETE_POOL = ThreadPoolExecutor(DELETE_THREADS, thread_name_prefix="icestate-delete")
_deleting: set[Future] = set()
_deleting_lock = threading.Lock()


def delete_later(delete: Callable[[str], None], location: str) -> None:
    """Run ``delete(location)`` on the delete pool (it logs its own failures)."""
    future = DELETE_POOL.submit(delete, location)
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
UPLOADS = PendingUploads(IO_POOL)


class _MetadataFile(InputFile, OutputFile):
    """A metadata file through ``METADATA_FILES``: read whole once, written from a buffer."""

    def __init__(self, file: Any):
        super().__init__(file.location)
        self._file = file  # pyiceberg's own file object, for what the cache cannot answer

    def __len__(self) -> int:
        data = METADATA_FILES.get(self.location)
        return len(self._file) if data is None else len(data)

    def exists(self) -> bool:
        return METADATA_FILES.get(self.location) is not None or self._file.exists()

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
        """Store the file: a metadata.json now, after every upload started before it under its
        directory; any other metadata file on the I/O pool (readable from memory meanwhile)."""
        METADATA_FILES.put(self.location, data)
        upload = UPLOADS.start(self.location, lambda: self._put(data))
        if self.location.endswith(".metadata.json"):
            UPLOADS.wait_directory(_directory(self.location))
            upload.result()

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

    def delete(self, location: str | InputFile | OutputFile) -> None:
        path = location if isinstance(location, str) else location.location
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
        fs = super()._initialize_s3_fs(netloc)
        rebuild, (options,) = fs.__reduce__()  # the pickle protocol: every option of the filesystem
        return rebuild({**options, "allow_delayed_open": True})


def use_state_file_io(catalog: Any) -> Any:
    """Make ``catalog``'s tables use ``StateFileIO`` unless its properties name a FileIO."""
    catalog.properties.setdefault(PY_IO_IMPL, STATE_FILE_IO)
    return catalog
