"""``FileCache``: whole segment files on local disk, in front of remote storage (as Flink's
ForSt keeps a local cache of its remote SST files).

Segments are immutable, so a cached copy keyed by the remote path is valid forever. The
cache is filled on write (a task's flush puts the bytes it just uploaded) and on read (a miss
fetches the whole file with one sequential read) and evicts whole files, least recently used
first, to stay under ``bytes_max`` and to leave ``reserved_free_bytes`` free on its disk. A
file that does not fit (larger than the bound, or no room even with the cache empty) is
served from memory without caching: the cache never fails a read.

One cache per process and directory (``process_file_cache``): every store of a process (a
Spark Python worker holds several task stores) shares it, so a store opened after another
finds the files the first read or wrote. Each process keeps its files in its own
subdirectory ``<directory>/<pid>-<random>``, holding an exclusive ``flock`` on ``.lock`` in
it while it lives; the directory is removed when the cache closes (at interpreter exit at the
latest), and a process creating a cache removes every sibling whose lock it can take (its
owner died without cleaning up: killed, ``os._exit``). Files are written to a temporary name
and renamed, so a cached name never holds a partial file.

The bound is the directory's, for every process of the host together (a host runs a Spark
Python worker per core, each with its own cache). A process that needs room evicts the least
recently used files of any process: each process stamps a file's access time when it uses it
(``os.utime``, the modification time kept), and reads the others' files from disk, under an
``flock`` on ``<directory>/.evict.lock`` so that two processes do not evict for each other.
Evicting another process's file leaves an empty ``<name>.evicted`` beside it, so that its
owner, finding the copy gone, counts it as evicted and not as damage. The other processes'
files are read from disk at each insert (a directory listing per process); two processes
inserting at the same moment may overshoot the bound by those files until the next insert.

Integrity: the index records each file's size and xxh3-64 digest (computed from the bytes in
memory before they are written). Every use checks the file's size; the digest is checked
the first time the file is read from disk and again whenever its size, mtime or inode
differ from what was recorded. A lost, truncated or altered file is dropped and fetched
again (``refetched``), never served. Damage that keeps size and mtime after the first
check is left to the second line, Parquet's page checksums: the segment reader drops the
cached copy on any read error and fetches the file once more (``invalidate``).

HEAD requests: pyarrow (26) binds ``open_input_file``/``open_input_stream`` for a path
string only (a ``FileInfo`` raises ``TypeError``: the C++ overload that takes a known size is
not exposed), so a fetch from S3 is one HEAD (``open_input_file``) and one GET of the whole
file; the remote size is checked against the size the checkpoint recorded.

Thread safety: one lock guards the index and the files; fetches run outside it, so several
threads fetch in parallel (``prefetch``), and concurrent fetches of the same file wait for
the first.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs
import xxhash

from statestore.paths import is_local_filesystem
from statestore.private_dir import private_directory

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: stale directories are found by pid only
    fcntl = None

if TYPE_CHECKING:
    from statestore.config import StoreConfig

log = logging.getLogger(__name__)

ENV_DIR = "ICESTATE_FILE_CACHE_DIR"
DEFAULT_DIR_NAME = "icestate-file-cache"
PREFETCH_THREADS_MAX = 8
_LOCK_FILE = ".lock"
_EVICT_LOCK_FILE = ".evict.lock"
_SEGMENT_SUFFIX = ".seg"
_EVICTED_SUFFIX = ".evicted"
_OWN_DIR = re.compile(r"^(\d+)-[0-9a-f]+$")
_INIT_DIR = re.compile(r"^\.init-(\d+)-[0-9a-f]+$")


def default_directory() -> str:
    """``$ICESTATE_FILE_CACHE_DIR``, else ``<temp dir>/icestate-file-cache-<uid>``."""
    return os.environ.get(ENV_DIR) or os.path.join(tempfile.gettempdir(), f"{DEFAULT_DIR_NAME}-{os.getuid()}")


def digest(data) -> int:
    """The checksum the cache records: xxh3-64 of the bytes."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass
class FileCacheCounters:
    """What a cache did: for the whole process (``FileCache.counters``) or one reader's share."""

    hits: int = 0  # uses served from a cached file
    misses: int = 0  # files fetched from the remote filesystem
    bytes_fetched: int = 0  # bytes of those fetches
    bytes_written: int = 0  # bytes put into the cache by writers (filled on write)
    evictions: int = 0  # files evicted to make room
    refetched: int = 0  # cached files found lost, truncated or altered, and dropped
    uncached: int = 0  # files served without caching (too large, or no room on disk)

    def as_dict(self, prefix: str = "") -> dict[str, int]:
        return {f"{prefix}{f.name}": getattr(self, f.name) for f in fields(self)}


@dataclass
class _Entry:
    name: str  # file name in the cache's own directory
    size: int
    digest: int
    stat: tuple[int, int] | None = None  # (mtime_ns, inode) when last checked
    verified: bool = False  # the digest was checked against the file on disk
    used_ns: int = 0  # when last used (also the file's access time, for other processes)


@dataclass
class _Foreign:
    """A cached file of another process of the host, as read from disk."""

    path: str
    size: int
    used_ns: int


def fetch(fs: pafs.FileSystem, path: str, size: int | None) -> pa.Buffer:
    """The whole file ``path`` of ``fs`` in one sequential read (on S3: a HEAD, then one GET).

    Raises OSError when the file's size is not ``size`` (when given) or the read comes back short.
    """
    with fs.open_input_file(path) as f:
        actual = f.size()
        if size and actual != size:  # None or 0: not recorded
            raise OSError(f"{path} is {actual} bytes, the checkpoint recorded {size}: the file changed or is damaged")
        data = f.read_buffer(actual)
    if data.size != actual:
        raise OSError(f"{path}: read {data.size} of {actual} bytes")
    return data


class FileCache:
    """Whole files of a remote filesystem on local disk, keyed by their remote path; bounded
    by ``bytes_max`` and by keeping ``reserved_free_bytes`` free on the disk of ``directory``.

    Files live in a subdirectory of ``directory`` of this process only (see the module doc).
    """

    def __init__(self, directory: str, bytes_max: int, reserved_free_bytes: int):
        self.root = os.path.abspath(directory)
        self.bytes_max = bytes_max
        self.reserved_free_bytes = reserved_free_bytes
        self.counters = FileCacheCounters()
        self._lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # remote path -> entry, LRU first
        self._inflight: dict[str, threading.Event] = {}
        self._size_bytes = 0
        self._pid = os.getpid()
        self._closed = False
        # Another user of the host must not be able to put files in it, or swap a process's
        # directory for theirs (``private_directory``).
        private_directory(self.root, what="the segment file cache", others_may_read=True)
        _remove_stale_directories(self.root)
        self.path, self._lock_fd = _make_own_directory(self.root)

    # ------------------------------------------------------------------ reading

    def open(self, fs: pafs.FileSystem, path: str, size: int | None,
             counters: FileCacheCounters | None = None) -> tuple[pa.NativeFile, bool]:
        """A random-access file with the bytes of ``path`` (``size`` bytes, as recorded), and
        whether they came from a cached copy (False: fetched by this call).

        A cached copy is checked first (see the module doc); a miss fetches the whole file,
        caches it when it fits and returns the fetched bytes."""
        hit = self._use(path, counters)
        if hit is not None:
            return hit, True
        data = self._fetch_and_insert(fs, path, size, counters)
        return pa.BufferReader(data), False

    def prefetch(self, fs: pafs.FileSystem, files: Sequence[tuple[str, int | None]],
                 counters: FileCacheCounters | None = None,
                 threads: int = PREFETCH_THREADS_MAX) -> dict[str, pa.Buffer]:
        """Fetch the files among ``files`` ((path, size)) that are not cached, up to ``threads``
        at a time (on S3 each fetch is a round trip). Returns the bytes of the fetched files
        that could not be cached (no room), for the caller to use once. A failed fetch is left
        for the caller's own read to meet (and report)."""
        with self._lock:
            missing = list(dict.fromkeys((p, s) for p, s in files if p not in self._entries))
        if not missing:
            return {}

        def one(item: tuple[str, int | None]) -> tuple[str, pa.Buffer | None]:
            path, size = item
            try:
                data = self._fetch_and_insert(fs, path, size, counters)
            except (OSError, pa.ArrowException):
                return path, None
            with self._lock:
                return path, (None if path in self._entries else data)

        if len(missing) == 1:
            results = [one(missing[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(threads, len(missing)), thread_name_prefix="icestate-fetch") as ex:
                results = list(ex.map(one, missing))
        return {p: d for p, d in results if d is not None}

    def contains(self, path: str) -> bool:
        with self._lock:
            return path in self._entries

    # ------------------------------------------------------------------ writing

    def put(self, path: str, data: pa.Buffer | bytes, counters: FileCacheCounters | None = None) -> bool:
        """Cache ``data`` as the contents of ``path`` (just written there); False when it does not fit."""
        cached = self._insert(path, data, counters, replace=True)
        if cached:
            self._count(counters, bytes_written=len(memoryview(data)))
        return cached

    def invalidate(self, path: str, counters: FileCacheCounters | None = None, corrupt: bool = True) -> None:
        """Drop the cached copy of ``path`` (a reader found it unreadable: ``corrupt`` counts it)."""
        with self._lock:
            entry = self._entries.pop(path, None)
            if entry is not None:
                self._drop_file(entry)
        if entry is not None and corrupt:
            self._count(counters, refetched=1)

    # ------------------------------------------------------------------ state

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def paths(self) -> list[str]:
        """Cached remote paths, least recently used first."""
        with self._lock:
            return list(self._entries)

    def local_path(self, path: str) -> str | None:
        """Where the cached copy of ``path`` is (tests damage it), or None."""
        with self._lock:
            entry = self._entries.get(path)
            return None if entry is None else os.path.join(self.path, entry.name)

    def stats(self) -> dict[str, int]:
        return {**self.counters.as_dict(), "files": len(self._entries), "size_bytes": self._size_bytes}

    def configure(self, bytes_max: int, reserved_free_bytes: int) -> None:
        """New bounds (the newest store's settings apply); evicts what no longer fits."""
        with self._lock:
            self.bytes_max, self.reserved_free_bytes = bytes_max, reserved_free_bytes
            self._make_room(0, None)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Forget every file and remove this process's directory. Later reads fetch without caching."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            self._size_bytes = 0
            if os.getpid() == self._pid:  # a forked child never removes its parent's files
                shutil.rmtree(self.path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)

    # ------------------------------------------------------------------ internals

    def _count(self, counters: FileCacheCounters | None, **deltas: int) -> None:
        with self._counters_lock:  # prefetch threads count too
            for c in (self.counters, counters):
                if c is not None:
                    for name, delta in deltas.items():
                        setattr(c, name, getattr(c, name) + delta)

    def _use(self, path: str, counters: FileCacheCounters | None) -> pa.NativeFile | None:
        """The cached copy of ``path``, checked; None (and the entry dropped) when it is not trustworthy."""
        with self._lock:
            entry = self._entries.get(path)
            if entry is None:
                return None
            self._entries.move_to_end(path)
            try:
                served = self._checked(entry)
            except OSError:  # the copy was deleted or cannot be read
                served = None
            if served is not None:
                self._touch(entry)
                self._count(counters, hits=1)
                return served
            del self._entries[path]
            self._drop_file(entry)
            if self._evicted_by_another(entry):
                return None  # another process made room: a plain miss
        log.warning("file cache: the cached copy of %s was lost or damaged; fetching it again", path)
        self._count(counters, refetched=1)
        return None

    def _checked(self, entry: _Entry) -> pa.NativeFile | None:
        """The cached copy of ``entry`` when its size (and, unless verified since its last change,
        its digest) is what was recorded; None when damaged. Lock held: no eviction can unlink
        the file before it opens. Raises OSError when the copy is gone."""
        local = os.path.join(self.path, entry.name)
        st = os.stat(local)
        if st.st_size != entry.size:
            return None
        if entry.verified and entry.stat == (st.st_mtime_ns, st.st_ino):
            return pa.OSFile(local)
        with open(local, "rb") as fh:
            st = os.fstat(fh.fileno())
            data = fh.read()
        if len(data) != entry.size or digest(data) != entry.digest:
            return None
        entry.verified, entry.stat = True, (st.st_mtime_ns, st.st_ino)
        return pa.BufferReader(pa.py_buffer(data))

    def _fetch_and_insert(self, fs: pafs.FileSystem, path: str, size: int | None,
                          counters: FileCacheCounters | None) -> pa.Buffer:
        """Fetch ``path`` (once, however many threads ask at the same time) and cache it."""
        while True:
            with self._lock:
                waiting = self._inflight.get(path)
                if waiting is None:
                    done = self._inflight[path] = threading.Event()
                    break
            waiting.wait()
            hit = self._use(path, counters)  # the other fetch cached it (or could not)
            if hit is not None:
                with hit:
                    return hit.read_buffer()
        try:
            data = fetch(fs, path, size)
            self._count(counters, misses=1, bytes_fetched=data.size)
            self._insert(path, data, counters)
            return data
        finally:
            with self._lock:
                del self._inflight[path]
            done.set()

    def _insert(self, path: str, data: pa.Buffer | bytes, counters: FileCacheCounters | None,
                replace: bool = False) -> bool:
        """Cache ``data`` for ``path``; a copy already cached is kept (another thread fetched it)
        unless ``replace`` (a writer's bytes: its copy may have been lost meanwhile)."""
        view = memoryview(data)
        n = view.nbytes
        with self._lock:
            if path in self._entries:
                if not replace:
                    self._entries.move_to_end(path)
                    return True
                self._drop_file(self._entries.pop(path))
            if (self._closed or os.getpid() != self._pid or n > self.bytes_max
                    or not self._make_room(n, counters)):
                self._count(counters, uncached=1)
                return False
            entry = _Entry(name=xxhash.xxh3_128_hexdigest(path.encode()) + ".seg", size=n, digest=digest(view))
            tmp = os.path.join(self.path, f".tmp-{secrets.token_hex(8)}")
            try:
                with open(tmp, "wb") as fh:
                    fh.write(view)
                os.replace(tmp, os.path.join(self.path, entry.name))
            except OSError as e:  # disk full, directory removed: serve without caching
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                log.warning("file cache: cannot write %s into %s (%s); serving it uncached", path, self.path, e)
                self._count(counters, uncached=1)
                return False
            self._entries[path] = entry
            self._size_bytes += n
            self._touch(entry)
            return True

    def _make_room(self, n: int, counters: FileCacheCounters | None) -> bool:
        """Evict least recently used files, of this process or another of the host, until ``n``
        more bytes fit the bound and the disk's reserve (lock held). False when they do not fit
        even with the directory empty."""
        if self._fits(n, sum(f.size for f in self._read_others())):
            return True
        with self._evict_lock():
            foreign = sorted(self._read_others(), key=lambda f: f.used_ns)
            others = sum(f.size for f in foreign)
            while (self._entries or foreign) and not self._fits(n, others):
                own = next(iter(self._entries.values()), None)
                if own is not None and (not foreign or own.used_ns <= foreign[0].used_ns):
                    self._entries.popitem(last=False)
                    self._drop_file(own)
                elif _evict_foreign(foreign[0]):
                    others -= foreign.pop(0).size
                else:  # its owner dropped it meanwhile
                    others -= foreign.pop(0).size
                    continue
                self._count(counters, evictions=1)
            return self._fits(n, others)

    def _fits(self, n: int, others: int) -> bool:
        return self._size_bytes + others + n <= self.bytes_max and self._disk_has_room(n)

    def _read_others(self) -> list[_Foreign]:
        """Read the other processes' files from disk; forget own entries another process evicted."""
        foreign = []
        try:
            children = [c for c in os.scandir(self.root) if c.is_dir(follow_symlinks=False)
                        and _OWN_DIR.match(c.name) and c.path != self.path]
        except OSError:
            children = []
        for child in children:
            with contextlib.suppress(OSError):
                for f in os.scandir(child.path):
                    if f.name.endswith(_SEGMENT_SUFFIX):
                        with contextlib.suppress(OSError):
                            st = f.stat(follow_symlinks=False)
                            foreign.append(_Foreign(f.path, st.st_size, st.st_atime_ns))
        self._forget_evicted()
        return foreign

    def _forget_evicted(self) -> None:
        try:
            evicted = {f.name[:-len(_EVICTED_SUFFIX)] for f in os.scandir(self.path)
                       if f.name.endswith(_EVICTED_SUFFIX)}
        except OSError:
            return
        if not evicted:
            return
        for path, entry in list(self._entries.items()):
            if entry.name in evicted and not os.path.exists(os.path.join(self.path, entry.name)):
                del self._entries[path]
                self._size_bytes -= entry.size
        for name in evicted:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.path, name + _EVICTED_SUFFIX))

    def _evicted_by_another(self, entry: _Entry) -> bool:
        tombstone = os.path.join(self.path, entry.name + _EVICTED_SUFFIX)
        try:
            os.unlink(tombstone)
        except OSError:
            return False
        return True

    def _touch(self, entry: _Entry) -> None:
        """Stamp ``entry`` as used now: in memory, and as its file's access time (what other
        processes of the host compare), keeping its modification time."""
        entry.used_ns = time.time_ns()
        local = os.path.join(self.path, entry.name)
        with contextlib.suppress(OSError):
            os.utime(local, ns=(entry.used_ns, os.stat(local).st_mtime_ns))

    def _evict_lock(self):
        """The host's eviction lock (``flock`` on ``<directory>/.evict.lock``)."""
        return host_lock(os.path.join(self.root, _EVICT_LOCK_FILE))

    def _disk_has_room(self, n: int) -> bool:
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            return False
        return free - n >= self.reserved_free_bytes

    def _drop_file(self, entry: _Entry) -> None:
        self._size_bytes -= entry.size
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.path, entry.name))


@contextlib.contextmanager
def host_lock(path: str):
    """An exclusive ``flock`` on the file ``path`` (made if missing) while inside: one process of
    the host at a time (none without fcntl, or when the file cannot be made)."""
    fd = None
    if fcntl is not None:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _evict_foreign(f: _Foreign) -> bool:
    """Delete another process's cached file, leaving its tombstone; False when it was gone."""
    try:
        os.unlink(f.path)
    except OSError:
        return False
    with contextlib.suppress(OSError), open(f.path + _EVICTED_SUFFIX, "wb"):
        pass
    return True


# ---------------------------------------------------------------------- directories of processes


def _make_own_directory(root: str) -> tuple[str, int]:
    """Create ``<root>/<pid>-<random>`` holding a locked ``.lock``: made under a temporary
    name and renamed, so no other process ever sees it without its lock held."""
    pid, token = os.getpid(), secrets.token_hex(4)
    init = os.path.join(root, f".init-{pid}-{token}")
    os.makedirs(init)
    fd = os.open(os.path.join(init, _LOCK_FILE), os.O_CREAT | os.O_RDWR, 0o600)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    own = os.path.join(root, f"{pid}-{token}")
    os.rename(init, own)
    return own, fd


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_directories(root: str) -> None:
    """Remove the directories of processes that died without removing theirs."""
    try:
        children = list(os.scandir(root))
    except OSError:
        return
    for child in children:
        if not child.is_dir(follow_symlinks=False):
            continue
        own, init = _OWN_DIR.match(child.name), _INIT_DIR.match(child.name)
        if init is not None:
            if not _pid_alive(int(init.group(1))):
                shutil.rmtree(child.path, ignore_errors=True)
        elif own is not None and _owner_gone(child.path, int(own.group(1))):
            shutil.rmtree(child.path, ignore_errors=True)


def _owner_gone(directory: str, pid: int) -> bool:
    if pid == os.getpid():
        return False  # another cache of this process (another root spelling), or our own
    if fcntl is None:
        return not _pid_alive(pid)
    try:
        fd = os.open(os.path.join(directory, _LOCK_FILE), os.O_RDWR)
    except FileNotFoundError:
        return not _pid_alive(pid)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its owner lives
    finally:
        os.close(fd)  # releases the lock if we took it
    return True


# ---------------------------------------------------------------------- one cache per process


_caches: dict[str, FileCache] = {}
_caches_lock = threading.Lock()


def process_file_cache(directory: str, bytes_max: int, reserved_free_bytes: int) -> FileCache:
    """This process's cache in ``directory``, created on first use (the newest bounds apply)."""
    key = os.path.realpath(directory)
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None or cache.closed:
            cache = _caches[key] = FileCache(key, bytes_max, reserved_free_bytes)
            return cache
    if (cache.bytes_max, cache.reserved_free_bytes) != (bytes_max, reserved_free_bytes):
        cache.configure(bytes_max, reserved_free_bytes)
    return cache


def close_process_file_caches() -> None:
    """Close every cache of this process (at exit; tests, to act as a new process)."""
    with _caches_lock:
        caches = list(_caches.values())
        _caches.clear()
    for cache in caches:
        cache.close()


def _forget_after_fork() -> None:
    # A forked child starts without caches: its parent's directories and locks are not its own.
    global _caches_lock
    _caches.clear()
    _caches_lock = threading.Lock()


atexit.register(close_process_file_caches)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def file_cache_for(config: StoreConfig, fs: pafs.FileSystem) -> FileCache | None:
    """The process's file cache for a store of ``config`` over ``fs``, or None when not caching
    (mode ``off``; mode ``auto`` and a local filesystem, where a cached copy would only copy
    the file). A cache directory that cannot be created is logged and means no cache: the
    cache never fails a store."""
    mode = config.file_cache_mode
    if mode == "off" or (mode == "auto" and is_local_filesystem(fs)):
        return None
    directory = config.file_cache_dir or default_directory()
    try:
        return process_file_cache(directory, config.file_cache_bytes_max, config.file_cache_reserved_free_bytes)
    except OSError as e:
        log.warning("file cache: cannot use %s (%s); reading segments without a local cache", directory, e)
        return None
