"""An in-memory cache of what Iceberg manifests and manifest lists say, by path.

Manifests and manifest lists are immutable once written, so their contents can be kept
by path for as long as the process lives; each commit, restore and garbage collection
then reads only the few manifests it has not seen before. Entries keep only what the
state table needs: the file, whether it is live in the manifest, the snapshot that added
it, and its key-group bounds (decoded from the column statistics).

Not thread safe (the state table that owns it is not either); it reads manifests in threads of
its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyiceberg.avro.file
from pyiceberg.avro.decoder import BinaryDecoder, StreamingBinaryDecoder
from pyiceberg.avro.file import SYNC_SIZE, AvroFile, AvroOutputFile
from pyiceberg.conversions import from_bytes
from pyiceberg.io import FileIO
from pyiceberg.manifest import DataFile, ManifestEntryStatus, ManifestFile
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.types import IntegerType, ListType

from catalog.fileio import METADATA_FILES
from statestore.errors import CorruptMetadataError

MANIFEST_READS_MAX = 16  # manifests read at once when a snapshot is opened
# The key of a manifest list's Avro header naming the snapshot it was written for (Iceberg's spec).
SNAPSHOT_ID_KEY = "snapshot-id"


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of one manifest. ``path`` is the URI stored in Iceberg metadata."""

    path: str
    live: bool  # ADDED or EXISTING; False for an entry that records a deletion
    snapshot_id: int | None  # snapshot that added the file
    key_group_min: int | None  # None when the file has no key_group statistics
    key_group_max: int | None
    record_count: int
    size_bytes: int


def file_entry(data_file: DataFile, key_group_field_id: int, *, live: bool, snapshot_id: int | None) -> FileEntry:
    return FileEntry(
        path=data_file.file_path, live=live, snapshot_id=snapshot_id,
        key_group_min=_bound(data_file.lower_bounds, key_group_field_id),
        key_group_max=_bound(data_file.upper_bounds, key_group_field_id),
        record_count=data_file.record_count, size_bytes=data_file.file_size_in_bytes,
    )


def _bound(bounds: dict[int, bytes] | None, field_id: int) -> int | None:
    raw = (bounds or {}).get(field_id)
    return None if raw is None else from_bytes(IntegerType(), raw)


# What pyiceberg raises for a file whose bytes do not decode (Avro, JSON, the metadata model);
# RecursionError: a hostile file nests its JSON (an Avro header's schema) thousands deep.
# A damaged length makes pyiceberg's Cython decoder ask for a negative (SystemError) or huge
# (MemoryError) buffer; deflated blocks fail in zlib.
DECODE_ERRORS = (EOFError, ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error, RecursionError,
                 zlib.error, SystemError, MemoryError)


# pyiceberg 0.12's Cython Avro decoder advances raw pointers by the lengths a file encodes without
# checking the end of its buffer (apache/iceberg-python#3952, fixed by #3955 after 0.12.0): a
# damaged manifest could crash the process with a segmentation fault instead of raising (found
# by tests/catalog/test_fuzz_damage.py, about one run in four). So the fast decoder decodes only
# bytes that pyiceberg's pure-Python decoder, which raises EOFError there, has decoded whole and
# without error in this process (their digests, ``_DECODED``); any other Avro file is decoded by
# the pure one, whatever reads it and in whichever thread: the catalog's own reads, and
# pyiceberg's (its scans, a commit's merge, each in its own threads). Bytes pyiceberg wrote in
# this process count as decoded. Decoding every read with the pure decoder made a checkpoint
# 36 -> 51-55 ms and a restore 42 -> 69-75 ms in bench_store; this way a commit decodes no more
# files with the pure decoder than the catalog's first reads of each file.
# pyiceberg also ends a file quietly at an end of file inside a block (a manifest list cut in
# its block read as a checkpoint without segments): such an end raises ``AvroTruncatedError``.
_BOUNDED = threading.local()
_DECODED: OrderedDict[bytes, None] = OrderedDict()  # digests, least recently used out first
_DECODED_MAX = 16384  # about 2 MB; a digest pushed out costs one more pure-Python decode
_DECODED_LOCK = threading.Lock()
_fast_decoder = pyiceberg.avro.file.new_decoder
_avro_enter = AvroFile.__enter__
_avro_read_block = AvroFile._read_block
_avro_exit = AvroOutputFile.__exit__


class AvroTruncatedError(ValueError):
    """An Avro file ends inside a block (pyiceberg would take the end for the last block's)."""


class _StrictDecoder(StreamingBinaryDecoder):
    """pyiceberg's pure decoder, but a negative length is damage: pyiceberg's reads it as empty
    bytes (and its skip moves back), where the Cython decoder raises SystemError on the same
    bytes, so a manifest the pure decoder had passed could fail later in a fast read."""

    __slots__ = ()

    def read_bytes(self) -> bytes:
        return self.read(self._length())

    def skip_bytes(self) -> None:
        self.skip(self._length())

    def _length(self) -> int:
        n = self.read_int()
        if n < 0:
            raise ValueError(f"a negative length ({n}) at byte {self.tell()}")
        return n


class _WholeFile(_StrictDecoder):
    """The pure decoder of the bytes of a whole Avro file, with their digest and size."""

    __slots__ = ("digest", "size")

    def __init__(self, data: bytes, digest: bytes):
        super().__init__(data)
        self.digest = digest
        self.size = len(data)


def _new_decoder(data: bytes) -> BinaryDecoder:
    if getattr(_BOUNDED, "opening", False):  # a whole file's bytes, from AvroFile.__enter__
        _BOUNDED.opening = False
        digest = hashlib.blake2b(data, digest_size=16).digest()
        with _DECODED_LOCK:
            known = digest in _DECODED
            if known:
                _DECODED.move_to_end(digest)
        return _fast_decoder(data) if known else _WholeFile(data, digest)
    bounded = getattr(_BOUNDED, "on", False) or getattr(_BOUNDED, "block", False)  # a block of a _WholeFile's
    return _StrictDecoder(data) if bounded else _fast_decoder(data)


def _enter(self: AvroFile) -> AvroFile:
    _BOUNDED.opening = True
    try:
        return _avro_enter(self)
    finally:
        _BOUNDED.opening = False


def _read_block(self: AvroFile) -> int:
    whole = self.decoder
    if not isinstance(whole, _WholeFile):  # the fast decoder: these bytes were decoded whole before
        return _avro_read_block(self)
    start = whole.tell()
    _BOUNDED.block = True
    try:
        return _avro_read_block(self)
    except EOFError:
        # The file's end must be a block's end: after a block's sync marker, or after the header of
        # a file without blocks (never a manifest list: pyiceberg writes its manifests as a block,
        # empty or not).
        if start + (SYNC_SIZE if self.block else 0) != whole.size or (
                self.block is None and SNAPSHOT_ID_KEY in self.header.meta):
            raise AvroTruncatedError(
                f"the Avro file {self.input_file.location} is cut short: it ends at byte {whole.size}, not at the end "
                "of a block") from None
        _decoded(whole.digest)  # decoded whole by the pure decoder: the fast one may decode these bytes
        raise
    finally:
        _BOUNDED.block = False


def _decoded(digest: bytes) -> None:
    with _DECODED_LOCK:
        _DECODED[digest] = None
        _DECODED.move_to_end(digest)
        if len(_DECODED) > _DECODED_MAX:
            _DECODED.popitem(last=False)


def _written(self: AvroOutputFile, exctype: type[BaseException] | None, *rest: object) -> None:
    """Bytes pyiceberg's encoder wrote whole (to a buffer: ``catalog.fileio``'s writes) are
    well formed: reading them back, as the next commit does, may take the fast decoder."""
    if exctype is None and isinstance(self.output_stream, io.BytesIO) and not self.output_stream.closed:
        _decoded(hashlib.blake2b(self.output_stream.getbuffer(), digest_size=16).digest())
    _avro_exit(self, exctype, *rest)


pyiceberg.avro.file.new_decoder = _new_decoder
AvroFile.__enter__ = _enter
AvroFile._read_block = _read_block
AvroOutputFile.__exit__ = _written


def _new_lock_after_fork() -> None:
    global _DECODED_LOCK
    _DECODED_LOCK = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_new_lock_after_fork)


@contextlib.contextmanager
def bounded_avro() -> Iterator[None]:
    """Within it, every decoder pyiceberg makes in this thread is its bounded pure-Python one,
    but for the bytes of an Avro file decoded whole before (which is so everywhere)."""
    before = getattr(_BOUNDED, "on", False)
    _BOUNDED.on = True
    try:
        yield
    finally:
        _BOUNDED.on = before


class MissingMetadataError(CorruptMetadataError, FileNotFoundError):
    """A metadata file that a snapshot references is missing (still a ``FileNotFoundError``:
    retention takes one of an expired snapshot as deleted by another writer already)."""


@contextlib.contextmanager
def unreadable_as_corrupt(what: str, uri: str) -> Iterator[None]:
    """Turn a decode failure or the absence of the metadata file ``uri`` into
    ``CorruptMetadataError`` naming it."""
    try:
        yield
    except CorruptMetadataError:
        raise
    except FileNotFoundError as e:
        raise MissingMetadataError(
            f"the {what} {uri} does not exist ({e}): it was deleted. Restore it from a backup, or open an older "
            "checkpoint that does not use it") from e
    except DECODE_ERRORS as e:
        raise CorruptMetadataError(
            f"the {what} {uri} cannot be read ({type(e).__name__}: {e}): it is damaged. Restore it from a backup, "
            "or open an older checkpoint that does not use it") from e


class ManifestCache:
    """Contents of manifest lists and manifests, read once per path.

    Bounded by entries: at most ``LISTS_MAX`` manifest lists and ``MANIFESTS_MAX`` manifests,
    the least recently used forgotten first (read again if asked for). A table holds one list
    per retained snapshot and some manifests per list, so the bounds matter only to a table
    that retains thousands of checkpoints; what keeps a process flat is that expired snapshots'
    lists and manifests are forgotten (``forget`` by the writer that deletes them, ``keep_only``
    by a reader that follows the table)."""

    LISTS_MAX = 1024
    MANIFESTS_MAX = 16384

    def __init__(self, io: FileIO, key_group_field_id: int):
        self._io = io
        self._key_group_field_id = key_group_field_id
        self._lists: OrderedDict[str, tuple[ManifestFile, ...]] = OrderedDict()
        self._entries: OrderedDict[str, tuple[FileEntry, ...]] = OrderedDict()
        self._listed_by: dict[str, str] = {}  # manifest -> a cached manifest list naming it

    def manifests(self, snapshot: Snapshot) -> tuple[ManifestFile, ...]:
        """The manifests a snapshot's manifest list names."""
        path = snapshot.manifest_list
        if path not in self._lists:
            with unreadable_as_corrupt("manifest list", path), bounded_avro():
                with AvroFile(self._io.new_input(path)) as avro:
                    written_for = avro.header.meta.get(SNAPSHOT_ID_KEY)
                manifests = tuple(snapshot.manifests(self._io))
            directory = path.rsplit("/", 1)[0]
            strays = [m.manifest_path for m in manifests
                      if m.manifest_path.rsplit("/", 1)[0] != directory or not m.manifest_path.endswith(".avro")]
            if strays:
                raise CorruptMetadataError(
                    f"the manifest list {path} of snapshot {snapshot.snapshot_id} names {strays[0]!r}, not a manifest "
                    "beside it: it is damaged. Restore it from a backup, or open an older checkpoint that does not "
                    "use it")
            if written_for is not None and written_for != str(snapshot.snapshot_id):
                raise CorruptMetadataError(
                    f"the manifest list {path} of snapshot {snapshot.snapshot_id} was written for snapshot "
                    f"{written_for}: another manifest list was copied over it. Restore it from a backup, or open an "
                    "older checkpoint that does not use it")
            self._lists[path] = manifests
            for m in manifests:
                self._listed_by.setdefault(m.manifest_path, path)
            self._bound()
        self._lists.move_to_end(path)
        return self._lists[path]

    def entries(self, manifest: ManifestFile) -> tuple[FileEntry, ...]:
        """Every entry of a manifest, deletions included."""
        path = manifest.manifest_path
        if path not in self._entries:
            self._entries[path] = self._read(manifest)
            self._bound()
        self._entries.move_to_end(path)
        return self._entries[path]

    def _read(self, manifest: ManifestFile) -> tuple[FileEntry, ...]:
        path = manifest.manifest_path
        # The manifest list that named it may be the damaged file instead (a name in it changed).
        listed = f"manifest (listed by {self._listed_by[path]})" if path in self._listed_by else "manifest"
        with unreadable_as_corrupt(listed, path), bounded_avro():
            read = manifest.fetch_manifest_entry(self._io, discard_deleted=False)
        # The manifest list records what the manifest holds: another manifest in its place differs.
        counts = (manifest.added_files_count, manifest.existing_files_count, manifest.deleted_files_count)
        added = {e.snapshot_id for e in read if e.status == ManifestEntryStatus.ADDED}
        if (None not in counts and sum(counts) != len(read)) or \
                (manifest.added_snapshot_id is not None and not added <= {manifest.added_snapshot_id}):
            raise CorruptMetadataError(
                f"the manifest {path} holds {len(read)} entries added by snapshot(s) {sorted(added)} where its "
                f"manifest list records {sum(c or 0 for c in counts)} added by {manifest.added_snapshot_id}: another "
                "manifest was copied over it. Restore it from a backup, or open an older checkpoint that does not "
                "use it")
        return tuple(
            file_entry(e.data_file, self._key_group_field_id,
                       live=e.status != ManifestEntryStatus.DELETED, snapshot_id=e.snapshot_id)
            for e in read
        )

    def live_files(self, snapshot: Snapshot) -> dict[str, FileEntry]:
        """The files a snapshot holds, by URI. Manifests not read before are read in parallel
        (on an object store each is a round trip or two; a restore reads a handful)."""
        manifests = self.manifests(snapshot)
        missing = [m for m in manifests if m.manifest_path not in self._entries]
        if len(missing) > 1:
            workers = min(MANIFEST_READS_MAX, len(missing))
            with ThreadPoolExecutor(workers, thread_name_prefix="icestate-manifests") as pool:
                for manifest, entries in zip(missing, pool.map(self._read, missing), strict=True):
                    self._entries[manifest.manifest_path] = entries
        files = {e.path: e for m in manifests for e in self.entries(m) if e.live}
        self._bound()
        return files

    def manifest_paths(self, snapshots: Iterable[Snapshot]) -> set[str]:
        return {m.manifest_path for s in snapshots for m in self.manifests(s)}

    def keep_only(self, snapshots: Iterable[Snapshot]) -> None:
        """Forget every manifest list but ``snapshots``' and every manifest none of theirs names:
        a reader that follows a writer's checkpoints (restores, never expires) would otherwise
        keep one list and manifest per checkpoint it ever opened."""
        lists = {s.manifest_list for s in snapshots}
        named = {m.manifest_path for p in lists if p in self._lists for m in self._lists[p]}
        self.forget([p for p in self._lists if p not in lists])
        self.forget([p for p in self._entries if p not in named])

    def forget(self, paths: Iterable[str]) -> None:
        """Drop deleted manifests and manifest lists, so memory follows the retained table: their
        contents here, and their bytes in the process's metadata file cache."""
        for p in paths:
            self._lists.pop(p, None)
            self._entries.pop(p, None)
            self._listed_by.pop(p, None)
            METADATA_FILES.discard(p)

    def _bound(self) -> None:
        """Forget the least recently used lists and manifests beyond the bounds."""
        while len(self._lists) > self.LISTS_MAX:
            path, manifests = self._lists.popitem(last=False)
            for m in manifests:
                if self._listed_by.get(m.manifest_path) == path:
                    del self._listed_by[m.manifest_path]
        while len(self._entries) > self.MANIFESTS_MAX:
            self._entries.popitem(last=False)


# pyiceberg (0.12) keeps every Avro reader and writer it builds in ``Singleton._instances``, keyed
# by their arguments, schema included, and a ``ListType`` hashes by identity
# (``hash(data.values())``, a fresh view object): a key with a list in its schema was never found
# again, so each read of a manifest list or manifest kept one more reader with its schema, for
# good, in every process that reads a table's metadata (a writer and a reader restoring after
# each of 200 checkpoints: 7,940 more ``NestedField``s; the soak's driver grew by it). A list type
# hashes here by its values, as pyiceberg's ``MapType`` does, so equal schemas share one reader.
def _list_type_hash(self: ListType) -> int:
    return hash(self.__getnewargs__())


ListType.__hash__ = _list_type_hash  # type: ignore[method-assign]
