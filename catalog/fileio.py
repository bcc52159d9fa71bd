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

Catalogs opened through ``TableRef`` and the embedded default use it unless their properties
name another ``py-io-impl``; tasks get it through the shipped storage properties.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from typing import Any

from pyarrow.fs import FileSystem
from pyiceberg.io import PY_IO_IMPL, InputFile, InputStream, OutputFile, OutputStream
from pyiceberg.io.pyarrow import PyArrowFileIO

STATE_FILE_IO = f"{__name__}.StateFileIO"
METADATA_CACHE_BYTES_MAX = 64 * 1024 * 1024


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
            with self._file.open(seekable=False) as f:
                data = f.read()
            METADATA_FILES.put(self.location, data)
        return io.BytesIO(data)

    def to_input_file(self) -> InputFile:
        return self

    def create(self, overwrite: bool = False) -> OutputStream:
        # No existence check: the name holds a UUID (the check is a HEAD and, on S3, a LIST).
        return _BufferedWrite(self)

    def write_through(self, data: bytes) -> None:
        with self._file.create(overwrite=True) as out:
            out.write(data)
        METADATA_FILES.put(self.location, data)


class _BufferedWrite(io.BytesIO):
    """The bytes of a metadata file, written to storage (one PUT) and cached when closed."""

    def __init__(self, file: _MetadataFile):
        super().__init__()
        self._target = file

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._target.write_through(data)

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
        METADATA_FILES.discard(path)
        super().delete(path)

    def _initialize_s3_fs(self, netloc: str | None) -> FileSystem:
        fs = super()._initialize_s3_fs(netloc)
        rebuild, (options,) = fs.__reduce__()  # the pickle protocol: every option of the filesystem
        return rebuild({**options, "allow_delayed_open": True})


def use_state_file_io(catalog: Any) -> Any:
    """Make ``catalog``'s tables use ``StateFileIO`` unless its properties name a FileIO."""
    catalog.properties.setdefault(PY_IO_IMPL, STATE_FILE_IO)
    return catalog
