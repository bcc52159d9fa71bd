"""``HostViews``: resolved key-group views written once per host and memory-mapped by every
process of it (every Python worker of an executor).

Spark hands a task to whichever idle Python worker comes first. Each worker resolving the
task's views itself would load the same state again (seconds for millions of keys) and hold
a copy per worker. Instead, a store that resolved whole key groups from a committed
checkpoint writes their views here, and any process of the host that opens a store of those
key groups maps them (no read, no copy: the pages are the kernel's page cache, shared by
every process that maps the file) and catches up with the segments committed since.

A *snapshot* is a directory ``<root>/<slot>/<checkpoint id>-<pid>-<random>/`` holding the
views of some key groups exactly as of one committed checkpoint (no uncommitted write):

* ``manifest.json``: the format, the checkpoint id, the processing time the views were
  resolved at, the segments (path, size, record count) of the snapshot's key-group span at
  that checkpoint, and per key group and variable the view's *runs* (``views.KeyedView``):
  each run's files with their sizes and xxh3-64 digests;
* per run ``<run>.arrow`` (the rows: Arrow IPC, uncompressed, strings as views, so that polars
  maps them without a copy) and, for an indexed run, ``<run>.hashes.npy`` / ``<run>.order.npy``
  (the sorted key hashes and the row of each) and, when some rows are dead,
  ``<run>.alive.npy``.

The *slot* names what every snapshot in it is a view of: the format, polars' version (the
key hashes are polars' row hashes), the filesystem's type and the state layout (key and
entry schemas, variables, key groups). Which table and line a snapshot belongs to is said by
its segments: a segment's path is unique (it carries a random part). A snapshot's views are
the resolution of exactly the segments it lists (of its key groups), so it serves a store
whose checkpoint has every one of them and, beside them, only segments written by a flush
after the newest of them (a flush's entries all carry its checkpoint id, newer than any
entry of the snapshot's segments): the store applies those segments' entries on top
(``StateReader.catch_up``), which is their resolution. Checkpoint ids alone say nothing (a
fork, a restore to an older checkpoint, another table of the same layout number theirs
anew); a compaction output beside them, or any file not named as a flush's segment, makes the
snapshot unusable. It must also have been resolved at a time not after the store's clock (a
view drops rows expired at its resolution time).

Crash safety: a snapshot is written under ``.tmp-<pid>-<random>`` and renamed into place
complete, so no process ever sees a partial one; a writer killed midway leaves a temporary
directory that the next writer removes (its pid gone). A file is mapped only after its size
was checked and either its *stamp* matched or its digest was checked (once per process and
file: device, inode, size and mtime). The stamp: its writer sets the file's modification time
a second back once it is written and records (device, inode, that time) in the manifest; any
write to the file since moves the time to the present, so a file that still bears its stamp
holds the bytes its writer wrote and checked, and a reader skips their digest and validation
(which, per process, cost as much as the rest of opening a task's views). A snapshot that
fails any check is deleted and its key groups load from the table as without it. Files are
never changed in place; a deleted or replaced file stays readable by the processes that
mapped it (POSIX unlink), so eviction never pulls a run from under a reader.

Bound: every snapshot of the host together stays within ``bytes_max`` (a snapshot's size is
in its directory's name, ``<checkpoint id>-<bytes>-<pid>-<random>``) and leaves
``reserved_free_bytes`` free on its disk: a writer that needs room deletes the least
recently used snapshots first (a use stamps the snapshot directory's modification time),
under an ``flock`` on ``<root>/.evict.lock``; a snapshot replaced by a newer one of the same
key groups and table is deleted when the newer one is written.

Where tasks run: a process that runs a task of a table claims it for its checkpoint
(``claim``: ``<root>/tasks/<digest of the task>``, the holder and the checkpoint id, replaced
whole), and another process of the host that holds a store of the same task learns from it
that the task runs elsewhere now (``ran_elsewhere``), so it can free that store at once: with
the shared views a task is as cheap to pick up from them as to keep, and what a store holds of
its own (runs merged since the views were written, the pages of views replaced since) is a
second copy. A claim only ever closes a store (a cache), never decides what state is read.

Threat model (``docs/reliability.md``): the root is a directory of this user's alone
(``private_directory``); the manifest is JSON checked field by field, file names in it must
be plain names, every file must be a regular file (no link, no pipe), arrays are read with
their header checked (no objects, no pickle), and each file's size is checked at every use
and, unless it bears its writer's stamp, once per process before its first use: its digest,
Arrow's full validation of the rows, the hash index's order (sorted hashes, rows in range).
The stamp and the digest guard against accidents (they sit in the same directory: a process
of the user that forges a file can forge its manifest too). Nothing in a snapshot is
executed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc
import xxhash

from statestore.layout import StateLayout
from statestore.paths import parse_segment_name, table_location_of
from statestore.private_dir import private_directory
from statestore.table import SegmentFile

log = logging.getLogger(__name__)

FORMAT = 2  # 2: each file's stamp (device, inode, modification time) beside its size and digest
MANIFEST = "manifest.json"
_EVICT_LOCK = ".evict.lock"
_CLAIMS = "tasks"
_HOLDER = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SNAPSHOT = re.compile(r"^(\d{12})-(\d{1,15})-(\d+)-[0-9a-f]{8}$")
_TMP = re.compile(r"^\.tmp-(\d+)-[0-9a-f]{8}$")
_SLOT = re.compile(r"^[0-9a-f]{32}$")
_FILE = re.compile(r"^r\d{1,6}\.(arrow|hashes\.npy|order\.npy|alive\.npy)$")
_SUFFIXES = ("arrow", "hashes.npy", "order.npy", "alive.npy")
# A temporary directory older than this is removed even when its writer's pid is alive (pid reuse).
_TMP_STALE_S = 3600
_MANIFEST_BYTES_MAX = 64 * 1024 * 1024
_CHECKED_MAX = 1 << 16  # files remembered as checked, per process (then forgotten, checked again)


def default_directory(file_cache_dir: str | None) -> str:
    """``<the file cache's directory>/views`` (see ``file_cache.default_directory``)."""
    from statestore.file_cache import default_directory as file_cache_directory

    return os.path.join(file_cache_dir or file_cache_directory(), "views")


def slot_name(layout: StateLayout, filesystem_type: str) -> str:
    """The slot of snapshots of ``layout``'s state on a filesystem of ``filesystem_type``."""
    h = hashlib.sha256()
    for part in (str(FORMAT), pl.__version__, filesystem_type, str(layout.max_parallelism),
                 ",".join(layout.key_names), ";".join(f"{d.name}:{d.kind.name}" for d in layout.descriptors)):
        h.update(part.encode())
        h.update(b"\0")
    h.update(layout.entry_schema.serialize().to_pybytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class RunFiles:
    name: str  # the run's file stem in the snapshot, r<n>
    rows: int
    # (suffix, size, digest, stamp) of each of its files; the stamp is (device, inode,
    # modification time in ns) as its writer left it (``_written``)
    files: tuple[tuple[str, int, int, tuple[int, int, int]], ...]


@dataclass(frozen=True)
class RunPart:
    """One run of a view as it lies in memory: ``frame`` and, for an indexed run, its sorted key
    hashes, the row of each and which rows are live (None: all)."""

    frame: pl.DataFrame
    hashes: np.ndarray | None = None
    order: np.ndarray | None = None
    alive: np.ndarray | None = None
    # The snapshot (directory) and run this one was mapped from: its files never change, so a
    # later snapshot links them instead of writing the rows again (the same pages on the host).
    source: tuple[str, RunFiles] | None = None


@dataclass(frozen=True)
class Snapshot:
    """A snapshot's manifest, as read and checked."""

    path: str
    checkpoint_id: int
    resolved_at_ms: int
    segments: frozenset[tuple[str, int, int]]  # (path, size, record count)
    top_checkpoint_id: int  # the newest checkpoint id of its segments' entries (-1: none)
    views: Mapping[int, Mapping[str, tuple[RunFiles, ...]]]  # key group -> variable -> runs
    bytes: int

    @property
    def key_groups(self) -> list[int]:
        return sorted(self.views)

    def newer_segments(self, segments: Sequence[SegmentFile], now_ms: int) -> list[SegmentFile] | None:
        """What a store whose checkpoint has ``segments`` (of the snapshot's key groups at least)
        applies on top of the snapshot's views at ``now_ms`` to hold its state: the segments
        beside the snapshot's, each written by a flush after them; None when the snapshot is not
        the state of an ancestor of that checkpoint (see the module docstring)."""
        if self.resolved_at_ms > now_ms:
            return None
        have = {(s.path, s.size_bytes, s.record_count): s for s in segments}
        if not self.segments <= have.keys():
            return None
        newer = []
        for key, segment in have.items():
            if key in self.segments:
                continue
            flushed = parse_segment_name(segment.path)
            if flushed is None or flushed[0] != segment.checkpoint_id or flushed[0] <= self.top_checkpoint_id:
                return None  # a compaction output, a foreign file, or entries not newer than the snapshot's
            newer.append(segment)
        return newer


class SnapshotDamaged(Exception):
    """A snapshot's files are not what its manifest says (lost, truncated, altered)."""


class HostViews:
    """The host's snapshots under ``root`` (see the module docstring). Thread safe."""

    def __init__(self, root: str, bytes_max: int, reserved_free_bytes: int):
        self.root = private_directory(root, what="the host's shared state views")
        self.bytes_max = bytes_max
        self.reserved_free_bytes = reserved_free_bytes
        self._lock = threading.Lock()
        # Files this process checked, as (device, inode, size, mtime_ns): a file linked into a
        # later snapshot is the same file.
        self._checked: set[tuple[int, int, int, int]] = set()
        # Manifests read, by snapshot directory (a directory's name is never reused: pid and random).
        self._manifests: dict[str, Snapshot] = {}

    # ------------------------------------------------------------------ writing

    def publish(self, slot: str, checkpoint_id: int, resolved_at_ms: int, segments: Sequence[SegmentFile],
                views: Mapping[int, Mapping[str, Sequence[RunPart]]]) -> Snapshot | None:
        """Write ``views`` (key group -> variable -> runs: the resolution of exactly
        ``segments`` at ``resolved_at_ms``, as of ``checkpoint_id``) as a snapshot; None when it
        does not fit the bound (nothing written). Replaced snapshots of the slot are deleted."""
        slot_dir = os.path.join(self.root, slot)
        with contextlib.suppress(FileExistsError):
            os.mkdir(slot_dir, 0o700)
        _remove_stale_temporaries(slot_dir)
        tmp = os.path.join(slot_dir, f".tmp-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(tmp, 0o700)
        try:
            manifest_views, total, n = {}, 0, 0
            for kg in sorted(views):
                per_var = {}
                for name, runs in views[kg].items():
                    entries = []
                    for run in runs:
                        files = _write_run(tmp, f"r{n}", run)
                        entries.append({"name": f"r{n}", "rows": run.frame.height,
                                        "files": [[suffix, size, dig, *stamp] for suffix, size, dig, stamp in files]})
                        total += sum(f[1] for f in files)
                        n += 1
                    per_var[name] = entries
                manifest_views[str(kg)] = per_var
            manifest = {"format": FORMAT, "checkpoint_id": int(checkpoint_id), "resolved_at_ms": int(resolved_at_ms),
                        "segments": sorted([s.path, s.size_bytes, s.record_count] for s in segments),
                        "top_checkpoint_id": max((s.checkpoint_id for s in segments), default=-1),
                        "views": manifest_views, "bytes": total}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f)
            if not self._make_room(total):
                shutil.rmtree(tmp, ignore_errors=True)
                return None
            final = os.path.join(slot_dir, f"{checkpoint_id:012d}-{total}-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        snapshot = _parse(manifest, final)
        with self._lock:
            self._manifests[final] = snapshot  # its files bear their stamps: not read again here either
        self._drop_replaced(slot_dir, snapshot)
        return snapshot

    # ------------------------------------------------------------------ reading

    def snapshots(self, slot: str) -> list[Snapshot]:
        """The slot's snapshots, newest checkpoint first (a manifest that does not parse is
        deleted: a snapshot is renamed into place whole, so it was damaged)."""
        slot_dir = os.path.join(self.root, slot)
        try:
            if not stat.S_ISDIR(os.lstat(slot_dir).st_mode):
                return []
            children = [c for c in os.scandir(slot_dir) if _SNAPSHOT.match(c.name) and c.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        found = []
        for child in children:
            known = self._manifests.get(child.path)
            if known is not None:
                found.append(known)
                continue
            try:
                found.append(_read_manifest(child.path))
                with self._lock:
                    self._manifests[child.path] = found[-1]
            except FileNotFoundError:
                continue  # evicted meanwhile
            except (OSError, ValueError, KeyError, TypeError, RecursionError, MemoryError) as e:
                log.warning("shared state views: %s is damaged (%s); deleted", child.path, e)
                shutil.rmtree(child.path, ignore_errors=True)
        listed = {c.path for c in children}
        with self._lock:
            for path in [p for p in self._manifests if os.path.dirname(p) == slot_dir and p not in listed]:
                del self._manifests[path]
        found.sort(key=lambda s: (s.checkpoint_id, s.path), reverse=True)
        return found

    def open_runs(self, snapshot: Snapshot, runs: Sequence[RunFiles], schema: pl.Schema) -> list[RunPart]:
        """The runs mapped (frames and hash arrays backed by the snapshot's files), each file
        checked first. Raises SnapshotDamaged when a file is not as recorded or its frame's
        schema is not ``schema``."""
        out = []
        for run in runs:
            paths = {suffix: os.path.join(snapshot.path, f"{run.name}.{suffix}") for suffix, *_ in run.files}
            fresh = [self._check(paths[suffix], size, dig, stamp) for suffix, size, dig, stamp in run.files]
            frame = _map_frame(paths["arrow"], validate=any(fresh))
            if frame.height != run.rows or frame.schema != schema:
                raise SnapshotDamaged(f"{paths['arrow']}: {frame.height} rows of {frame.schema}, expected "
                                      f"{run.rows} of {schema}")
            hashes = order = alive = None
            if "hashes.npy" in paths:
                hashes = _load_array(paths["hashes.npy"], np.uint64, run.rows)
                order = _load_array(paths["order.npy"], np.int64, run.rows)
                if any(fresh) and run.rows and (
                        bool((hashes[1:] < hashes[:-1]).any()) or int(order.min()) < 0 or int(order.max()) >= run.rows):
                    raise SnapshotDamaged(f"{paths['hashes.npy']}: not a sorted index of the run's rows")
            if "alive.npy" in paths:
                alive = _load_array(paths["alive.npy"], np.bool_, run.rows).copy()  # changes in place
            out.append(RunPart(frame, hashes, order, alive, (snapshot.path, run)))
        return out

    def used(self, snapshot: Snapshot) -> None:
        """Stamp ``snapshot`` as used now (the eviction's order)."""
        with contextlib.suppress(OSError):
            os.utime(snapshot.path)

    def discard(self, snapshot: Snapshot) -> None:
        """Delete a snapshot found damaged."""
        shutil.rmtree(snapshot.path, ignore_errors=True)

    def size_bytes(self) -> int:
        return sum(s for _, s, _ in self._all_snapshots())

    # ------------------------------------------------------------------ where tasks run

    def claim(self, task: str, holder: str, checkpoint_id: int) -> None:
        """Note that ``holder`` (a process: letters, digits, ``-``, ``_``) runs ``task`` (any
        string naming a task of a table) for ``checkpoint_id``. Best effort: a claim that cannot
        be written is skipped (a store elsewhere is then kept until its own process learns)."""
        if not _HOLDER.fullmatch(holder):
            raise ValueError(f"a holder of a task claim is a plain token, not {holder!r}")
        path = self._claim_path(task)
        tmp = f"{path}.{holder}.tmp"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(tmp, "w") as f:
                f.write(f"{holder} {int(checkpoint_id)}")
            os.replace(tmp, path)
        except OSError as e:
            log.debug("shared state views: cannot claim a task (%s)", e)

    def ran_elsewhere(self, task: str, holder: str, checkpoint_id: int) -> bool:
        """Whether another holder than ``holder`` claimed ``task`` for ``checkpoint_id`` or a
        later one. No claim, or one that is not a regular file of a holder and a number: False."""
        try:
            fd = os.open(self._claim_path(task), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            text = os.read(fd, 128).decode("ascii", errors="replace")
        except OSError:
            return False
        finally:
            os.close(fd)
        parts = text.split(" ")
        if len(parts) != 2 or not _HOLDER.fullmatch(parts[0]) or not re.fullmatch(r"\d{1,18}", parts[1]):
            return False
        return parts[0] != holder and int(parts[1]) >= checkpoint_id

    def _claim_path(self, task: str) -> str:
        return os.path.join(self.root, _CLAIMS, hashlib.sha256(task.encode()).hexdigest()[:32])

    # ------------------------------------------------------------------ internals

    def _remember(self, path: str) -> None:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            with self._lock:
                if len(self._checked) >= _CHECKED_MAX:
                    self._checked.clear()
                self._checked.add((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    def _check(self, path: str, size: int, dig: int, stamp: tuple[int, int, int]) -> bool:
        """Check the file at ``path`` (a regular file of ``size`` bytes and digest ``dig``) unless
        this process checked it before or it is unchanged since its writer stamped it
        (``stamp``: no write since, see ``_written``); whether it was checked now (its content
        then to be validated too)."""
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise SnapshotDamaged(f"{path} is not a regular file")
            if st.st_size != size:
                raise SnapshotDamaged(f"{path} is {st.st_size} bytes, its manifest says {size}")
            if (st.st_dev, st.st_ino, st.st_mtime_ns) == stamp:
                return False
            with self._lock:
                if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) in self._checked:
                    return False
            if _file_digest(path) != dig:
                raise SnapshotDamaged(f"{path}: its digest is not its manifest's")
        except OSError as e:  # gone meanwhile (evicted by another process), unreadable
            raise SnapshotDamaged(f"{path}: {e}") from e
        self._remember(path)
        return True

    def _drop_replaced(self, slot_dir: str, newest: Snapshot) -> None:
        """Delete the slot's snapshots that ``newest`` replaces: of none but its key groups, of
        no table but its own (a slot holds every table of the layout: two queries of one
        layout on a host would evict each other's), and neither of a newer checkpoint nor over
        newer segments. A snapshot of no segment is of no table: any newer one replaces it."""
        mine, tables = set(newest.views), _tables(newest)
        for other in self.snapshots(os.path.basename(slot_dir)):
            if other.path != newest.path and set(other.views) <= mine and other.checkpoint_id <= newest.checkpoint_id \
                    and other.top_checkpoint_id <= newest.top_checkpoint_id and _tables(other) <= tables:
                shutil.rmtree(other.path, ignore_errors=True)

    def _all_snapshots(self) -> list[tuple[str, int, int]]:
        """Every snapshot of the host: (path, bytes, last use in ns), from the directories' names."""
        out = []
        with contextlib.suppress(OSError):
            for slot in os.scandir(self.root):
                if not (_SLOT.match(slot.name) and slot.is_dir(follow_symlinks=False)):
                    continue
                with contextlib.suppress(OSError):
                    for snap in os.scandir(slot.path):
                        m = _SNAPSHOT.match(snap.name)
                        if m is not None:
                            with contextlib.suppress(OSError):
                                out.append((snap.path, int(m.group(2)), snap.stat(follow_symlinks=False).st_mtime_ns))
        return out

    def _make_room(self, n: int) -> bool:
        """Delete least recently used snapshots until ``n`` more bytes (already written, under a
        temporary name) fit; False if they cannot."""
        if n > self.bytes_max:
            return False
        with self._evict_lock():
            snaps = sorted(self._all_snapshots(), key=lambda s: s[2])
            total = sum(s for _, s, _ in snaps)
            for path, size, _ in snaps:
                if total + n <= self.bytes_max and self._disk_has_room():
                    break
                shutil.rmtree(path, ignore_errors=True)
                total -= size
            return total + n <= self.bytes_max and self._disk_has_room()

    def _disk_has_room(self) -> bool:
        try:
            return shutil.disk_usage(self.root).free >= self.reserved_free_bytes
        except OSError:
            return False

    def _evict_lock(self):
        from statestore.file_cache import host_lock

        return host_lock(os.path.join(self.root, _EVICT_LOCK))


def _write_run(directory: str, stem: str, run: RunPart) -> list[tuple[str, int, int, tuple[int, int, int]]]:
    """Write one run's files (link them, for a run mapped from a snapshot still there; its
    live rows' mask is the only file written again); (suffix, size, digest, stamp) of each."""
    if run.source is not None:
        linked = _link_run(directory, stem, run)
        if linked is not None:
            return linked
    files = []
    path = os.path.join(directory, f"{stem}.arrow")
    table = _compact(run.frame)
    with ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)
    files.append(_written("arrow", path))
    arrays = [("hashes.npy", run.hashes, np.uint64), ("order.npy", run.order, np.int64),
              ("alive.npy", run.alive, np.bool_)]
    for suffix, array, dtype in arrays:
        if array is None:
            continue
        path = os.path.join(directory, f"{stem}.{suffix}")
        np.save(path, np.ascontiguousarray(array, dtype=dtype), allow_pickle=False)
        files.append(_written(suffix, path))
    return files


def _written(suffix: str, path: str) -> tuple[str, int, int, tuple[int, int, int]]:
    """(suffix, size, digest, stamp) of a file just written at ``path``, stamped: its
    modification time set a second back, the stamp (device, inode, that time). Any later write
    to the file moves its time to the present (the kernel's clock can be coarser than a write,
    so a write in the same tick as the file's own would otherwise leave it as it was); a reader
    that finds a file so stamped finds the bytes its writer wrote, and skips the digest and
    Arrow's validation."""
    dig = _file_digest(path)
    past = time.time_ns() - 1_000_000_000
    os.utime(path, ns=(past, past), follow_symlinks=False)
    st = os.lstat(path)
    return suffix, st.st_size, dig, (st.st_dev, st.st_ino, st.st_mtime_ns)


def _compact(frame: pl.DataFrame) -> pa.Table:
    """``frame`` as Arrow with polars' own string and binary views (mapped back without a copy),
    holding only its own bytes: a frame cut from a larger one (a key group's view out of a
    resolution of many) shares the larger one's string buffers, which a view of its own would
    write whole (32 key groups of a task: 32 copies of the task's strings)."""
    table = frame.to_arrow(compat_level=pl.CompatLevel.newest())
    if "_view" not in str(table.schema):  # no string or binary views (nested ones included)
        return table
    return frame.to_arrow(compat_level=pl.CompatLevel.oldest()).cast(table.schema)


def _link_run(directory: str, stem: str, run: RunPart) -> list[tuple[str, int, int, tuple[int, int, int]]] | None:
    """Link the immutable files of ``run``'s source into ``directory``; None when they are gone."""
    src_dir, src = run.source
    files = []
    try:
        for suffix, size, dig, stamp in src.files:
            if suffix != "alive.npy":  # a link is the same inode: its stamp stays
                os.link(os.path.join(src_dir, f"{src.name}.{suffix}"), os.path.join(directory, f"{stem}.{suffix}"))
                files.append((suffix, size, dig, stamp))
    except OSError:
        for suffix, *_ in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, f"{stem}.{suffix}"))
        return None
    if run.alive is not None:
        path = os.path.join(directory, f"{stem}.alive.npy")
        np.save(path, np.ascontiguousarray(run.alive, dtype=np.bool_), allow_pickle=False)
        files.append(_written("alive.npy", path))
    return files


def _map_frame(path: str, validate: bool = True) -> pl.DataFrame:
    """The Arrow IPC file at ``path`` as a frame over its memory-mapped bytes, fully validated
    first when ``validate`` (offsets and string views in bounds: bad ones would crash a reader)."""
    try:  # (Arrow's mapping keeps no file descriptor open: a host maps thousands of runs)
        table = ipc.open_file(pa.memory_map(path)).read_all()
        if validate:
            table.validate(full=True)
        return pl.from_arrow(table, rechunk=False)
    except (OSError, pa.ArrowException, ValueError, TypeError) as e:
        raise SnapshotDamaged(f"{path}: {e}") from e


def _load_array(path: str, dtype: type, rows: int) -> np.ndarray:
    """The ``.npy`` array at ``path`` (one dimension, ``rows`` of ``dtype``, never objects), read
    only, over its memory-mapped bytes (numpy's own memmap keeps a file descriptor per array)."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"npy format {version}")
            reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, found = reader(f)
            offset = f.tell()
        if found != np.dtype(dtype) or shape != (rows,) or fortran:
            raise ValueError(f"{found} of shape {shape}, expected {np.dtype(dtype)} of ({rows},)")
        buffer = pa.memory_map(path).read_buffer()
        if buffer.size != offset + rows * found.itemsize:
            raise ValueError(f"{buffer.size} bytes, expected {offset + rows * found.itemsize}")
        return np.frombuffer(buffer, dtype=found, count=rows, offset=offset)
    except (OSError, ValueError) as e:
        raise SnapshotDamaged(f"{path}: {e}") from e


def _file_digest(path: str) -> int:
    """xxh3-64 of the file's bytes, hashed in place from its mapping (slices of a mapping would
    copy them first: a third of the digest's time)."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return xxhash.xxh3_64_intdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return xxhash.xxh3_64_intdigest(m)


def _tables(snapshot: Snapshot) -> set[str]:
    """The locations of the tables whose segments ``snapshot`` lists."""
    return {table_location_of(path) for path, _, _ in snapshot.segments}


def _remove_stale_temporaries(slot_dir: str) -> None:
    """Remove the temporary directories of writers that died (or are an hour old)."""
    from statestore.file_cache import _pid_alive

    with contextlib.suppress(OSError):
        for child in os.scandir(slot_dir):
            m = _TMP.match(child.name)
            if m is None:
                continue
            with contextlib.suppress(OSError):
                if not _pid_alive(int(m.group(1))) or time.time() - child.stat().st_mtime > _TMP_STALE_S:
                    shutil.rmtree(child.path, ignore_errors=True)


def _read_manifest(directory: str) -> Snapshot:
    fd = os.open(os.path.join(directory, MANIFEST), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("the manifest is not a regular file")
        data = f.read(_MANIFEST_BYTES_MAX + 1)
    if len(data) > _MANIFEST_BYTES_MAX:
        raise ValueError(f"the manifest is over {_MANIFEST_BYTES_MAX} bytes")
    return _parse(json.loads(data), directory)


def _parse(raw: object, directory: str) -> Snapshot:
    raw = _dict(raw)
    if raw.get("format") != FORMAT:
        raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT}")
    segments = frozenset((_str(p), _int(s), _int(r)) for p, s, r in _list(raw["segments"]))
    views: dict[int, dict[str, tuple[RunFiles, ...]]] = {}
    for kg, per_var in _dict(raw["views"]).items():
        views[int(kg)] = {_str(name): tuple(_run_files(r) for r in _list(runs))
                          for name, runs in _dict(per_var).items()}
    top = raw["top_checkpoint_id"]
    if top != -1:
        _int(top)
    return Snapshot(directory, _int(raw["checkpoint_id"]), _int(raw["resolved_at_ms"]), segments, top, views,
                    _int(raw["bytes"]))


def _run_files(raw: object) -> RunFiles:
    raw = _dict(raw)
    name = _str(raw["name"])
    files = []
    for suffix, size, dig, dev, ino, mtime_ns in _list(raw["files"]):
        if _str(suffix) not in _SUFFIXES or not _FILE.match(f"{name}.{suffix}"):
            raise ValueError(f"file {name}.{suffix} is not a snapshot's")
        files.append((suffix, _int(size), _int(dig), (_int(dev), _int(ino), _int(mtime_ns))))
    suffixes = [f[0] for f in files]
    if "arrow" not in suffixes or ("hashes.npy" in suffixes) != ("order.npy" in suffixes):
        raise ValueError(f"run {name} lacks files")
    return RunFiles(name, _int(raw["rows"]), tuple(files))


def _typed(v: object, kind: type, what: str):
    if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 0):
        raise ValueError(f"{v!r} is not {what}")
    return v


def _int(v: object) -> int:
    return _typed(v, int, "a non-negative integer")


def _str(v: object) -> str:
    return _typed(v, str, "a string")


def _dict(v: object) -> dict:
    return _typed(v, dict, "an object")


def _list(v: object) -> list:
    return _typed(v, list, "a list")


_HOSTS: dict[tuple[str, int, int], HostViews] = {}
_HOSTS_LOCK = threading.Lock()


def host_views(root: str, bytes_max: int, reserved_free_bytes: int) -> HostViews:
    """The process's ``HostViews`` of ``root`` (one per root and bounds)."""
    key = (root, bytes_max, reserved_free_bytes)
    with _HOSTS_LOCK:
        found = _HOSTS.get(key)
        if found is None:
            found = _HOSTS[key] = HostViews(root, bytes_max, reserved_free_bytes)
        return found


def host_views_for(config) -> HostViews | None:
    """The process's ``HostViews`` for a store of ``config``, or None when it does not share
    views (``StoreConfig.host_views`` not True). A directory that cannot be used is logged and
    means no sharing: the shared views never fail a store."""
    if not config.host_views:
        return None
    root = config.host_views_dir or default_directory(config.file_cache_dir)
    try:
        return host_views(root, config.host_views_bytes_max, config.file_cache_reserved_free_bytes)
    except OSError as e:
        log.warning("shared state views: cannot use %s (%s); views stay private", root, e)
        return None
