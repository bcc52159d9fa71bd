"""The FileIO of state tables: pyiceberg's pyarrow FileIO, with fewer requests on object stores.

pyarrow's S3 output streams start a multipart upload when opened, so every file pyiceberg or a
task writes (a 2 kB manifest, a metadata.json, a segment) costs three requests (initiate,
part, complete), one after another. With ``allow_delayed_open`` a file smaller than one part
goes up as a single PUT when it is closed. ``StateFileIO`` is pyiceberg's ``PyArrowFileIO``
with that one setting; everything else (endpoint, credentials, region, timeouts, retries) is
pyiceberg's, from the same properties.

Catalogs opened through ``TableRef`` and the embedded default use it unless their properties
name another ``py-io-impl``; tasks get it through the shipped storage properties.
"""

from __future__ import annotations

from typing import Any

from pyarrow.fs import FileSystem
from pyiceberg.io import PY_IO_IMPL
from pyiceberg.io.pyarrow import PyArrowFileIO

STATE_FILE_IO = f"{__name__}.StateFileIO"


class StateFileIO(PyArrowFileIO):
    """``PyArrowFileIO`` whose S3 filesystem writes small files with one PUT."""

    def _initialize_s3_fs(self, netloc: str | None) -> FileSystem:
        fs = super()._initialize_s3_fs(netloc)
        rebuild, (options,) = fs.__reduce__()  # the pickle protocol: every option of the filesystem
        return rebuild({**options, "allow_delayed_open": True})


def use_state_file_io(catalog: Any) -> Any:
    """Make ``catalog``'s tables use ``StateFileIO`` unless its properties name a FileIO."""
    catalog.properties.setdefault(PY_IO_IMPL, STATE_FILE_IO)
    return catalog
