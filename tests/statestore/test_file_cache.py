"""Unit tests of statestore.file_cache (the local cache of whole segment files) and of the
store reading and writing through it.

The "remote" filesystem is a local directory behind ``pyarrow.fs.PyFileSystem`` with a
handler that counts the files opened for reading, so a test sees every fetch. Cached copies
are damaged on disk directly, the way a disk, a cleaner or another program could.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore import file_cache as fc
from statestore.config import StoreConfig
from statestore.descriptors import ListStateDescriptor, ValueStateDescriptor
from statestore.directory_table import DirectoryStateTable
from statestore.file_cache import FileCache, FileCacheCounters, close_process_file_caches, file_cache_for
from statestore.layout import StateLayout
from statestore.segment import SegmentReader
from statestore.store import StateStore

MAX_PARALLELISM = 32
KEY_SCHEMA = pa.schema([("k", pa.int64())])
DESCRIPTORS = (ValueStateDescriptor("v", pa.int64()), ListStateDescriptor("l", pa.string()))
LAYOUT = StateLayout.of(KEY_SCHEMA, DESCRIPTORS, MAX_PARALLELISM)
NO_RESERVE = 0


class CountingHandler(pafs.FileSystemHandler):
    """A local filesystem that counts ``open_input_file`` calls per path (the fetches)."""

    def __init__(self, delay_s: float = 0.0):
        self._fs = pafs.LocalFileSystem()
        self.opened: dict[str, int] = {}
        self.delay_s = delay_s
        self.concurrent = self.concurrent_max = 0
        self._lock = threading.Lock()

    def open_input_file(self, path):
        with self._lock:
            self.opened[path] = self.opened.get(path, 0) + 1
            self.concurrent += 1
            self.concurrent_max = max(self.concurrent_max, self.concurrent)
        try:
            time.sleep(self.delay_s)
            return self._fs.open_input_file(path)
        finally:
            with self._lock:
                self.concurrent -= 1

    @property
    def fetches(self) -> int:
        return sum(self.opened.values())

    # Everything else as the local filesystem does.
    def get_type_name(self):
        return "counting-local"

    def equals(self, other):
        return self is other

    def get_file_info(self, paths):
        return self._fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self._fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self._fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self._fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise NotImplementedError

    def delete_file(self, path):
        self._fs.delete_file(path)

    def move(self, src, dest):
        self._fs.move(src, dest)

    def copy_file(self, src, dest):
        self._fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self._fs.open_input_stream(path)

    def open_output_stream(self, path, metadata):
        return self._fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self._fs.open_append_stream(path, metadata=metadata)

    def normalize_path(self, path):
        return path


@pytest.fixture
def remote(tmp_path) -> tuple[pafs.FileSystem, CountingHandler, Path]:
    handler = CountingHandler()
    directory = tmp_path / "remote"
    directory.mkdir()
    return pafs.PyFileSystem(handler), handler, directory


@pytest.fixture
def cache_root(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _no_process_caches():
    close_process_file_caches()
    yield
    close_process_file_caches()


def remote_file(directory: Path, name: str, size: int, seed: int = 0) -> tuple[str, bytes]:
    data = np.random.default_rng(seed).bytes(size)
    path = directory / name
    path.write_bytes(data)
    return str(path), data


def read_all(f: pa.NativeFile) -> bytes:
    with f:
        return f.read()


def damage_file(local: str, how: str) -> None:
    """``delete``, ``truncate`` to half, ``scribble`` (same size and inode, other bytes, mtime
    restored) or ``rewrite`` (the same, but a later mtime: another program wrote it)."""
    if how == "delete":
        os.unlink(local)
        return
    st_ = os.stat(local)
    data = Path(local).read_bytes()
    if how == "truncate":
        Path(local).write_bytes(data[: len(data) // 2])
        return
    with open(local, "r+b") as f:  # in place: same inode
        f.write(bytes((b + 1) % 256 for b in data[:64]))  # never restores the bytes (twice: +2)
    later = 0 if how == "scribble" else 1_000_000_000
    os.utime(local, ns=(st_.st_atime_ns, st_.st_mtime_ns + later))


# ---------------------------------------------------------------------- the cache alone


def test_fill_on_read_then_hits_without_fetching(remote, cache_root):
    fs, handler, directory = remote
    path, data = remote_file(directory, "a", 1000)
    cache = FileCache(str(cache_root), 10_000, NO_RESERVE)
    f, cached = cache.open(fs, path, len(data))
    assert (read_all(f), cached) == (data, False)
    for _ in range(3):
        f, cached = cache.open(fs, path, len(data))
        assert (read_all(f), cached) == (data, True)
    assert handler.fetches == 1
    assert cache.stats() == {"hits": 3, "misses": 1, "bytes_fetched": 1000, "bytes_written": 0, "evictions": 0,
                             "refetched": 0, "uncached": 0, "files": 1, "size_bytes": 1000}


def test_lru_evicts_whole_files_least_recently_used_first_within_the_bound(remote, cache_root):
    fs, _handler, directory = remote
    files = {n: remote_file(directory, n, 100, seed=i) for i, n in enumerate("abcde")}
    cache = FileCache(str(cache_root), 300, NO_RESERVE)
    for n in "abc":
        cache.open(fs, files[n][0], 100)[0].close()
    cache.open(fs, files["a"][0], 100)[0].close()  # a is now the most recently used
    cache.open(fs, files["d"][0], 100)[0].close()  # evicts b
    assert cache.paths() == [files[n][0] for n in "cad"]
    cache.put(files["e"][0], files["e"][1])  # evicts c
    assert cache.paths() == [files[n][0] for n in "ade"]
    assert cache.size_bytes == 300 and cache.counters.evictions == 2
    assert sorted(p.name for p in Path(cache.path).iterdir() if not p.name.startswith(".")) == sorted(
        Path(cache.local_path(files[n][0])).name for n in "ade")  # evicted files are gone from disk
    f, cached = cache.open(fs, files["b"][0], 100)
    assert (read_all(f), cached) == (files["b"][1], False)


def test_a_file_larger_than_the_bound_is_served_without_caching(remote, cache_root):
    fs, _handler, directory = remote
    small, _ = remote_file(directory, "small", 100)
    big, big_data = remote_file(directory, "big", 1000)
    cache = FileCache(str(cache_root), 500, NO_RESERVE)
    cache.open(fs, small, 100)[0].close()
    for _ in range(2):
        assert read_all(cache.open(fs, big, 1000)[0]) == big_data
    assert cache.paths() == [small] and cache.counters.uncached == 2 and cache.counters.evictions == 0


def test_reserved_free_space_is_never_used(remote, cache_root, monkeypatch):
    """A 1000-byte disk holding only the cache, with 650 bytes to keep free: 350 bytes may be
    cached, whatever the cache's own bound; with the disk full of other files, nothing."""
    fs, _handler, directory = remote
    files = [remote_file(directory, f"f{i}", 100, seed=i) for i in range(5)]
    cache = FileCache(str(cache_root), 10_000, reserved_free_bytes=650)
    others = {"bytes": 0}

    def disk_usage(path):
        used = cache.size_bytes + others["bytes"]
        return fc.shutil._ntuple_diskusage(1000, used, 1000 - used)

    monkeypatch.setattr(fc.shutil, "disk_usage", disk_usage)
    for path, data in files:
        assert read_all(cache.open(fs, path, 100)[0]) == data
    assert cache.size_bytes == 300 and cache.paths() == [p for p, _ in files[2:]] and cache.counters.evictions == 2
    others["bytes"] = 900  # something else filled the disk: even an empty cache cannot fit a file
    path, data = remote_file(directory, "late", 100, seed=9)
    assert read_all(cache.open(fs, path, 100)[0]) == data
    assert len(cache) == 0 and cache.counters.uncached == 1 and os.listdir(cache.path) == [".lock"]


def test_fetch_checks_the_recorded_size(remote, cache_root):
    fs, _handler, directory = remote
    path, _data = remote_file(directory, "a", 100)
    cache = FileCache(str(cache_root), 10_000, NO_RESERVE)
    with pytest.raises(OSError, match="100 bytes, the checkpoint recorded 99"):
        cache.open(fs, path, 99)
    assert len(cache) == 0


@pytest.mark.parametrize("how", ["delete", "truncate", "scribble"])
@pytest.mark.parametrize("verified_first", [False, True], ids=["unused", "used"])
def test_a_lost_or_damaged_cached_file_is_fetched_again(remote, cache_root, how, verified_first):
    """Checked on use: size always; the checksum on the first read from disk and whenever the
    file's size, mtime or inode changed. A scribble that keeps size, mtime and inode after the
    first check is left to Parquet's page checksums (see the segment reader's test)."""
    fs, handler, directory = remote
    path, data = remote_file(directory, "a", 1000)
    cache = FileCache(str(cache_root), 10_000, NO_RESERVE)
    cache.put(path, data)
    if verified_first:
        assert read_all(cache.open(fs, path, 1000)[0]) == data
    local = cache.local_path(path)
    damage_file(local, "rewrite" if verified_first and how == "scribble" else how)
    f, cached = cache.open(fs, path, 1000)
    assert (read_all(f), cached) == (data, False)
    assert cache.counters.refetched == 1 and handler.fetches == 1
    assert Path(cache.local_path(path)).read_bytes() == data  # cached again, intact
    assert read_all(cache.open(fs, path, 1000)[0]) == data and handler.fetches == 1


def test_parallel_prefetch_fetches_each_missing_file_once(remote, cache_root):
    fs, handler, directory = remote
    handler.delay_s = 0.05
    files = [remote_file(directory, f"f{i}", 200, seed=i) for i in range(12)]
    cache = FileCache(str(cache_root), 1_000_000, NO_RESERVE)
    cache.put(files[0][0], files[0][1])
    counters = FileCacheCounters()
    staged = cache.prefetch(fs, [(p, 200) for p, _ in files] + [(files[3][0], 200)], counters)
    assert staged == {}
    assert handler.fetches == 11 and set(handler.opened) == {p for p, _ in files[1:]}
    assert 1 < handler.concurrent_max <= fc.PREFETCH_THREADS_MAX
    assert (counters.misses, counters.bytes_fetched) == (11, 2200)
    for p, data in files:
        f, cached = cache.open(fs, p, 200, counters)
        assert (read_all(f), cached) == (data, True)
    assert handler.fetches == 11


def test_concurrent_opens_of_one_file_fetch_it_once(remote, cache_root):
    fs, handler, directory = remote
    handler.delay_s = 0.1
    path, data = remote_file(directory, "a", 5000)
    cache = FileCache(str(cache_root), 1_000_000, NO_RESERVE)
    results = []
    threads = [threading.Thread(target=lambda: results.append(read_all(cache.open(fs, path, 5000)[0])))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [data] * 4 and handler.fetches == 1


# ---------------------------------------------------------------------- directories of processes


def test_each_process_has_its_own_locked_directory_removed_at_close(cache_root):
    a = FileCache(str(cache_root), 1000, NO_RESERVE)
    b = FileCache(str(cache_root), 1000, NO_RESERVE)
    assert a.path != b.path and Path(a.path).parent == cache_root
    assert Path(a.path).name.startswith(f"{os.getpid()}-") and (Path(a.path) / ".lock").exists()
    a.put("x", b"12345")
    a.close()
    assert not Path(a.path).exists() and Path(b.path).exists()
    b.close()


def test_directories_of_dead_processes_are_removed_and_live_ones_kept(cache_root, tmp_path):
    import fcntl

    cache_root.mkdir()
    dead = cache_root / "999999991-0a0b"  # a process that died: nobody holds its lock
    dead.mkdir()
    (dead / ".lock").touch()
    (dead / "x.seg").write_bytes(b"old")
    alive = cache_root / "999999992-0c0d"  # its lock held (here by this test)
    alive.mkdir()
    fd = os.open(alive / ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    foreign = cache_root / "not-a-cache"
    foreign.mkdir()
    try:
        cache = FileCache(str(cache_root), 1000, NO_RESERVE)
        assert not dead.exists() and alive.exists() and foreign.exists()
        cache.close()
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- one bound per host


def on_disk(cache_root: Path) -> int:
    """Bytes of cached files in every process's directory."""
    return sum(f.stat().st_size for f in cache_root.glob("*/*.seg"))


def test_the_bound_holds_for_every_process_of_the_host_together(remote, cache_root):
    """Two caches on one directory (as two Spark workers of a host): each makes room by
    evicting the least recently used file of either, and the loser takes the loss of its copy
    as an eviction, not as damage."""
    fs, handler, directory = remote
    files = {n: remote_file(directory, n, 100, seed=i) for i, n in enumerate("abcde")}
    a = FileCache(str(cache_root), 300, NO_RESERVE)
    b = FileCache(str(cache_root), 300, NO_RESERVE)

    def cached() -> set[tuple[str, str]]:
        return {(who, n) for who, x in (("a", a), ("b", b)) for n in files
                if x.local_path(files[n][0]) and Path(x.local_path(files[n][0])).exists()}

    try:
        for n in "abc":
            a.open(fs, files[n][0], 100)[0].close()
        a.open(fs, files["a"][0], 100)[0].close()  # use order of the host: b, c, a
        b.open(fs, files["d"][0], 100)[0].close()  # full: evicts the host's oldest, a's b
        assert cached() == {("a", "a"), ("a", "c"), ("b", "d")} and b.counters.evictions == 1
        b.open(fs, files["e"][0], 100)[0].close()  # then a's c
        assert cached() == {("a", "a"), ("b", "d"), ("b", "e")} and b.counters.evictions == 2
        fetches = handler.fetches
        f, hit = a.open(fs, files["b"][0], 100)  # a's copy is gone: a plain miss, not damage
        assert (read_all(f), hit) == (files["b"][1], False) and handler.fetches == fetches + 1
        assert a.counters.refetched == 0 and a.counters.evictions == 1  # it evicted its own a
        assert cached() == {("a", "b"), ("b", "d"), ("b", "e")} and on_disk(cache_root) == 300
        assert a.size_bytes == 100 and b.size_bytes == 200  # each knows what it holds
    finally:
        a.close()
        b.close()


def test_a_process_that_knows_of_evictions_only_from_disk_accounts_for_them(remote, cache_root):
    """The loser's own size follows the evictions at its next fresh look, without using the files."""
    _fs, _handler, directory = remote
    files = {n: remote_file(directory, n, 100, seed=i) for i, n in enumerate("abcd")}
    a = FileCache(str(cache_root), 300, NO_RESERVE)
    b = FileCache(str(cache_root), 300, NO_RESERVE)
    try:
        for n in "abc":
            a.put(files[n][0], files[n][1])
        b.put(files["d"][0], files["d"][1])  # evicts a's oldest (a)
        assert a.size_bytes == 300  # a has not looked yet
        a._read_others()  # what a does at its next insert
        assert a.size_bytes == 200 and not a.contains(files["a"][0])
        assert not list(Path(a.path).glob("*.evicted"))  # the tombstones are consumed
    finally:
        a.close()
        b.close()


def test_another_process_shares_the_bound(remote, cache_root, tmp_path):
    """A real second process (its own pid and directory) fills the directory; this one then
    evicts the other's files to stay within the bound, and the other serves its reads again."""
    import subprocess
    import sys

    fs, _handler, directory = remote
    mine = [remote_file(directory, f"m{i}", 1000, seed=i) for i in range(3)]
    theirs = [remote_file(directory, f"t{i}", 1000, seed=10 + i) for i in range(3)]
    script = f"""
import sys, pyarrow.fs as pafs
from statestore.file_cache import FileCache
cache = FileCache({str(cache_root)!r}, 3000, 0)
fs = pafs.LocalFileSystem()
for path in {[p for p, _ in theirs]!r}:
    cache.open(fs, path, 1000)[0].close()
print("filled", flush=True)
sys.stdin.readline()  # hold the files until told
ok = all(cache.open(fs, p, 1000)[0].read() == open(p, "rb").read() for p in {[p for p, _ in theirs]!r})
print("ok" if ok else "bad", cache.counters.refetched, flush=True)
cache.close()
"""
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=str(Path(__file__).resolve().parents[2]))
    try:
        assert other.stdout.readline().strip() == "filled"
        cache = FileCache(str(cache_root), 3000, NO_RESERVE)
        for path, data in mine:
            assert read_all(cache.open(fs, path, 1000)[0]) == data
        assert on_disk(cache_root) == 3000 and cache.counters.evictions == 3 and len(cache) == 3
        out, _ = other.communicate("go\n", timeout=60)
        assert out.split() == ["ok", "0"]  # its copies were evicted, not damaged: fetched again
        cache.close()
    finally:
        if other.poll() is None:
            other.kill()


# ---------------------------------------------------------------------- configuration


def test_config_validates_the_file_cache_and_shared_views_settings():
    for bad in ({"file_cache_mode": "sometimes"}, {"file_cache_bytes_max": 0},
                {"file_cache_reserved_free_bytes": -1}, {"file_cache_dir": ""}, {"file_cache_bytes_max": 1.5},
                {"host_views_lag": 0}, {"host_views_lag": 2.5}, {"host_views_bytes_max": -1}):
        with pytest.raises(ValueError, match=f"StoreConfig.{next(iter(bad))}"):
            StoreConfig(**bad)
    config = StoreConfig()
    assert (config.file_cache_mode, config.file_cache_dir) == ("auto", None)
    assert config.file_cache_bytes_max == config.file_cache_reserved_free_bytes == 1 << 30


def test_auto_caches_only_remote_filesystems_and_one_cache_serves_the_process(remote, tmp_path, monkeypatch):
    fs, _, _ = remote
    monkeypatch.setenv(fc.ENV_DIR, str(tmp_path / "from-env"))
    assert file_cache_for(StoreConfig(), pafs.LocalFileSystem()) is None
    assert file_cache_for(StoreConfig(), pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())) is None
    assert file_cache_for(StoreConfig(file_cache_mode="off"), fs) is None
    cache = file_cache_for(StoreConfig(), fs)
    assert cache is not None and cache.root == str(tmp_path / "from-env")
    assert file_cache_for(StoreConfig(file_cache_mode="on"), pafs.LocalFileSystem()) is cache
    other = file_cache_for(StoreConfig(file_cache_dir=str(tmp_path / "other"), file_cache_bytes_max=5), fs)
    assert other is not cache and other.bytes_max == 5
    monkeypatch.delenv(fc.ENV_DIR)
    assert fc.default_directory() == os.path.join(fc.tempfile.gettempdir(), f"icestate-file-cache-{os.getuid()}")


def test_the_cache_directory_is_the_users_own(tmp_path):
    """Another user of the host could plant segment copies in a directory they can write to, or
    swap a process's directory for a link: such a directory is refused, naming it."""
    made = fc.FileCache(str(tmp_path / "fresh"), 1 << 20, 0)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) == 0o700
    finally:
        made.close()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match=r"segment file cache, .*shared, is not this user's alone .*mode 777"):
        fc.FileCache(str(shared), 1 << 20, 0)
    assert os.listdir(shared) == []
    os.symlink(tmp_path / "fresh", tmp_path / "link")
    with pytest.raises(PermissionError, match="not a directory"):
        fc.FileCache(str(tmp_path / "link"), 1 << 20, 0)
    readable = tmp_path / "readable"
    readable.mkdir()
    readable.chmod(0o755)  # a directory the user made for the cache, readable by others: accepted
    fc.FileCache(str(readable), 1 << 20, 0).close()


# ---------------------------------------------------------------------- the store through the cache


def keys(ks) -> pa.Table:
    return pa.table({"k": pa.array(list(ks), pa.int64())})


def open_store(table_dir: Path, cache_dir: Path, **config) -> StateStore:
    table = DirectoryStateTable(table_dir, LAYOUT)
    return StateStore(table, config=StoreConfig(file_cache_mode="on", file_cache_dir=str(cache_dir), **config))


def fill(store: StateStore, checkpoints: int = 3, n: int = 300) -> dict[int, int]:
    expected = {}
    for cp in range(checkpoints):
        ks = list(range(cp * n // 2, cp * n // 2 + n))
        store.get_state("v").update_batch(keys(ks), [k * 10 + cp for k in ks])
        store.get_state("l").add_batch(keys(ks[:10]), [f"x{cp}"] * 10)
        store.checkpoint()
        expected.update({k: k * 10 + cp for k in ks})
    return expected


def read_values(store: StateStore, n: int) -> dict[int, int]:
    got = store.get_state("v").get_batch(keys(range(n))).to_pylist()
    return {k: v for k, v in enumerate(got) if v is not None}


def cache_stats(store: StateStore) -> dict[str, int]:
    return {k.removeprefix("file_cache_"): v for k, v in store.stats().items() if k.startswith("file_cache_")}


def test_a_store_reads_its_own_flushed_segments_without_fetching(tmp_path):
    writer = open_store(tmp_path / "t", tmp_path / "c")
    expected = fill(writer)
    segments = writer.table.segments(writer.key_group_range)
    written = cache_stats(writer)
    assert written["bytes_written"] == sum(s.size_bytes for s in segments) and written["misses"] == 0
    writer.reader.reset()  # forget the views: read the segments again
    assert read_values(writer, 600) == expected
    # A second store of the process finds the writer's files too.
    second = open_store(tmp_path / "t", tmp_path / "c")
    assert read_values(second, 600) == expected
    for stats in (cache_stats(writer), cache_stats(second)):
        assert (stats["misses"], stats["bytes_fetched"]) == (0, 0) and stats["hits"] == len(segments)


def test_a_cold_process_fetches_each_segment_once_then_serves_it_locally(tmp_path):
    expected = fill(open_store(tmp_path / "t", tmp_path / "c"))
    close_process_file_caches()  # as a new process
    cold = open_store(tmp_path / "t", tmp_path / "c")
    assert read_values(cold, 600) == expected
    segments = cold.table.segments(cold.key_group_range)
    stats = cache_stats(cold)
    assert (stats["misses"], stats["bytes_fetched"]) == (len(segments), sum(s.size_bytes for s in segments))
    warm = open_store(tmp_path / "t", tmp_path / "c")
    assert read_values(warm, 600) == expected and cache_stats(warm)["misses"] == 0
    plain = StateStore(DirectoryStateTable(tmp_path / "t", LAYOUT), config=StoreConfig(file_cache_mode="off"))
    assert read_values(plain, 600) == expected and cache_stats(plain)["hits"] == 0


@pytest.mark.parametrize("how", ["delete", "truncate", "scribble"])
def test_damaged_cached_segments_are_refetched_and_the_result_is_right(tmp_path, how):
    """Damage after the copies were used once (checksum already checked): delete and truncate
    are caught by the size check; a same-size, same-mtime scribble by Parquet's page checksums,
    after which the reader drops the copy and fetches the file again."""
    writer = open_store(tmp_path / "t", tmp_path / "c")
    expected = fill(writer)
    assert read_values(open_store(tmp_path / "t", tmp_path / "c"), 600) == expected  # verified once
    cache = writer.reader.file_cache
    segments = writer.table.segments(writer.key_group_range)
    for seg in segments:
        local = cache.local_path(seg.path)
        if how == "scribble":  # the middle of the file: data pages, not the footer
            st_ = os.stat(local)
            with open(local, "r+b") as f:
                f.seek(seg.size_bytes // 3)
                chunk = f.read(64)
                f.seek(seg.size_bytes // 3)
                f.write(bytes(b ^ 0xFF for b in chunk))
            os.utime(local, ns=(st_.st_atime_ns, st_.st_mtime_ns))
        else:
            damage_file(local, how)
    reader = open_store(tmp_path / "t", tmp_path / "c")
    assert read_values(reader, 600) == expected
    assert reader.get_state("l").get_batch(keys(range(5))) is not None
    stats = cache_stats(reader)
    assert stats["refetched"] == len(segments) and stats["misses"] == len(segments)
    again = open_store(tmp_path / "t", tmp_path / "c")
    assert read_values(again, 600) == expected and cache_stats(again)["misses"] == 0


def test_segment_reader_reads_each_segment_once_without_a_cache(tmp_path, remote):
    """Without a cache, a cold read opens each segment once (the footer and the row groups
    from one open file), and a read with the footer cached opens it once again."""
    fs, handler, _directory = remote
    store = open_store(tmp_path / "t", tmp_path / "c")
    fill(store)
    segments = store.table.segments(store.key_group_range)
    reader = SegmentReader(fs)
    wanted = np.arange(MAX_PARALLELISM, dtype=np.int64)
    first = reader.read(segments, wanted, ["key_group", "k", "v_v"])
    assert handler.fetches == len(segments) and reader.files_opened == len(segments)
    second = reader.read(segments, wanted, ["key_group", "k", "v_v"])
    assert handler.fetches == 2 * len(segments) and [t.num_rows for t in first] == [t.num_rows for t in second]


# ---------------------------------------------------------------------- a model of the cache


OPS = st.lists(st.tuples(st.sampled_from(["open", "put", "delete", "truncate", "scribble", "evict-all"]),
                         st.integers(0, 5)), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, bound=st.integers(100, 900))
def test_model_every_read_returns_the_remote_bytes(tmp_path_factory, ops, bound):
    """Against a dict of the remote files: every open returns the file's bytes, whatever was
    done to the cached copies; the cache stays within its bound; fetches happen only for files
    not cached intact (the model tracks which are)."""
    base = tmp_path_factory.mktemp("model")
    handler = CountingHandler()
    fs = pafs.PyFileSystem(handler)
    (base / "remote").mkdir()
    remote_files = {i: remote_file(base / "remote", f"f{i}", 50 + 37 * i, seed=i) for i in range(6)}
    cache = FileCache(str(base / "cache"), bound, NO_RESERVE)
    intact: set[int] = set()  # model: files whose cached copy is present and undamaged (or detectably damaged)
    try:
        for op, i in ops:
            path, data = remote_files[i]
            local = cache.local_path(path)
            if op == "open":
                before = handler.fetches
                f, cached = cache.open(fs, path, len(data))
                assert read_all(f) == data
                assert cached == (i in intact) and handler.fetches == before + (not cached)
                intact = {j for j in intact if cache.contains(remote_files[j][0])}
                if cache.contains(path):
                    intact.add(i)
            elif op == "put":
                cache.put(path, data)
                intact = {j for j in intact if cache.contains(remote_files[j][0])}
                if cache.contains(path):
                    intact.add(i)
            elif op == "evict-all":
                for p in cache.paths():
                    cache.invalidate(p, corrupt=False)
                intact.clear()
            elif local is not None and os.path.exists(local):
                # A same-size scribble is detectable while the copy was never read from disk,
                # or when its mtime changes: rewrite it later so the model stays exact.
                damage_file(local, "rewrite" if op == "scribble" else op)
                intact.discard(i)
            assert cache.size_bytes <= bound
            assert cache.size_bytes == sum(len(remote_files[j][1]) for j in range(6) if cache.contains(
                remote_files[j][0]))
    finally:
        cache.close()
