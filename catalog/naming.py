"""Iceberg-side file naming: URIs versus filesystem paths, and checkpoint-tagged commit files.

Segment file names are defined in ``statestore.paths``; this module only adds what the
Iceberg side needs:

* Iceberg metadata stores full URIs (``file:///w/t/data/x.parquet``, ``s3://b/t/...``),
  while a pyarrow ``FileSystem`` takes paths without the scheme (``/w/t/...``, ``b/t/...``).
  ``Locations`` converts between the two for one table.
* pyiceberg names the manifests and the manifest list of a commit after the commit's UUID
  (``<uuid>-m<n>.avro``, ``snap-<snapshot id>-<attempt>-<uuid>.avro``). A checkpoint commit
  chooses that UUID so that it carries the checkpoint id. Garbage collection can then tell
  the leftovers of a crashed checkpoint commit (tagged, id <= the newest committed one)
  from files another writer may be committing right now (untagged: never swept). A
  compaction's commit carries the checkpoint it was planned on, so the leftovers of one that
  crashed or lost its race are swept once it can no longer commit.
  The tag format is stored on disk: keep ``checkpoint_of_commit_file`` able to read it.
"""

from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

if TYPE_CHECKING:
    from pyiceberg.io import FileIO

# First 32 bits of every checkpoint commit UUID ("sTaT"); then 48 bits of checkpoint id and
# 48 random bits. A random UUID carries this tag with probability 2**-32. Commits to a fork
# (a branch other than main) carry "sTaF" instead: their checkpoint ids are the fork's own,
# so main's garbage collection must not read them as its own.
_COMMIT_TAG = 0x73546154
_FORK_COMMIT_TAG = 0x73546146
# Commits of a compaction carry the checkpoint it was planned on: "sTaC" on main, "sTaD" on a fork.
_COMPACTION_TAG = 0x73546143
_FORK_COMPACTION_TAG = 0x73546144
_CHECKPOINT_BITS = 48
_RANDOM_BITS = 48
_UUID = re.compile(r"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
_METADATA_JSON = re.compile(r"^(\d+)-[^/]*\.metadata\.json$")
METADATA_DIR = "metadata"


def metadata_json_version(path: str) -> int:
    """The version of an Iceberg ``<version>-<uuid>.metadata.json`` file, -1 for any other name."""
    m = _METADATA_JSON.match(path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else -1


def commit_uuid(checkpoint_id: int, fork: bool = False, compaction: bool = False) -> uuid.UUID:
    """A fresh commit UUID tagged with ``checkpoint_id`` (0 <= id < 2**48), of main or of a fork;
    with ``compaction``, of a compaction planned on that checkpoint."""
    if not 0 <= checkpoint_id < 1 << _CHECKPOINT_BITS:
        raise ValueError(f"checkpoint id {checkpoint_id} does not fit a commit tag (48 bits)")
    tags = (_FORK_COMPACTION_TAG, _COMPACTION_TAG) if compaction else (_FORK_COMMIT_TAG, _COMMIT_TAG)
    tag = tags[0] if fork else tags[1]
    value = (tag << (_CHECKPOINT_BITS + _RANDOM_BITS)) | (checkpoint_id << _RANDOM_BITS)
    return uuid.UUID(int=value | secrets.randbits(_RANDOM_BITS))


def checkpoint_of_commit_file(path: str) -> int | None:
    """Checkpoint id of a manifest or manifest list written by a checkpoint commit to main,
    else None (other files, and commits to forks)."""
    return _tagged(path, _COMMIT_TAG)


def base_of_compaction_commit_file(path: str) -> int | None:
    """The checkpoint a compaction of main was planned on, for a manifest or manifest list its
    commit wrote, else None (other files, and compactions of forks)."""
    return _tagged(path, _COMPACTION_TAG)


def _tagged(path: str, tag: int) -> int | None:
    name = path.rsplit("/", 1)[-1]
    if not name.endswith(".avro"):
        return None
    m = _UUID.search(name)
    if m is None:
        return None
    value = uuid.UUID(m.group(1)).int
    if value >> (_CHECKPOINT_BITS + _RANDOM_BITS) != tag:
        return None
    return (value >> _RANDOM_BITS) & ((1 << _CHECKPOINT_BITS) - 1)


@dataclass(frozen=True)
class Locations:
    """URI <-> filesystem path conversion for the files of one table location."""

    filesystem: pafs.FileSystem
    scheme: str | None  # None for a location given as a plain local path

    @classmethod
    def of(cls, table_location: str, io: FileIO | None = None) -> Locations:
        """Locations of a table; its pyarrow filesystem comes from the table's FileIO when that
        is pyarrow's, so the catalog's storage settings (S3 endpoint, credentials) apply."""
        scheme = table_location.split("://", 1)[0] if "://" in table_location else None
        if io is not None and _is_pyarrow_io(io):
            scheme_, netloc, _ = io.parse_location(table_location)
            return cls(io.fs_by_scheme(scheme_, netloc), scheme)
        fs, _ = pafs.FileSystem.from_uri(table_location)
        return cls(fs, scheme)

    def to_path(self, uri: str) -> str:
        """The filesystem path of ``uri`` (which must use this table's scheme)."""
        if self.scheme is None:
            return uri
        prefix = f"{self.scheme}://"
        if not uri.startswith(prefix):
            raise ValueError(f"{uri!r} is not a {self.scheme} URI; the table's files live under {prefix}")
        return uri[len(prefix):]

    def to_uri(self, path: str) -> str:
        """The URI Iceberg metadata stores for filesystem path ``path``."""
        if self.scheme is None or path.startswith(f"{self.scheme}://"):
            return path
        return f"{self.scheme}://{path}"


_MANIFEST_NUMBER = re.compile(r"-m(\d+)\.avro$")


def merged_away_manifests(commit: uuid.UUID, listed: list[str]) -> list[str]:
    """Manifests a commit wrote but its snapshot does not list (URIs), given the ones it lists.

    pyiceberg numbers a commit's manifests ``<uuid>-m0.avro``, ``-m1``... When a merge
    append folds its new manifest into a merged one, the new one stays on disk unlisted;
    every number below the highest listed one that is not listed is such a file.
    """
    ours = [p for p in listed if str(commit) in p.rsplit("/", 1)[-1]]
    numbers = {int(m.group(1)) for p in ours if (m := _MANIFEST_NUMBER.search(p))}
    if not numbers:
        return []
    directory = ours[0].rsplit("/", 1)[0]
    return [f"{directory}/{commit}-m{n}.avro" for n in range(max(numbers)) if n not in numbers]


def _is_pyarrow_io(io: FileIO) -> bool:
    # Imported when asked: pyiceberg's Arrow FileIO pulls in Arrow datasets and pandas (0.3 s),
    # which a Python worker on a local table never needs.
    from pyiceberg.io.pyarrow import PyArrowFileIO

    return isinstance(io, PyArrowFileIO)
