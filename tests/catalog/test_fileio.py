"""``catalog.fileio.StateFileIO`` against moto's S3 server behind our proxy (which counts the
requests): small files go up with one PUT, metadata files are written without an existence
check and read back from memory, a write that fails halfway leaves no file, and a state
table's commit reads none of the metadata it wrote itself.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.io import load_file_io

from catalog import TableRef
from catalog.fileio import (
    METADATA_FILES,
    STATE_FILE_IO,
    UPLOADS,
    MetadataFileCache,
    is_metadata_file,
    metadata_json_gate,
    wait_for_deletes,
)
from statestore import StateStore
from tests import s3_server
from tests.catalog.catalog_helpers import LAYOUT
from tests.net_proxy import NetProxy


@pytest.fixture
def fileio(s3_proxy: NetProxy):
    METADATA_FILES.clear()
    return load_file_io({"py-io-impl": STATE_FILE_IO, **s3_server.properties(s3_proxy.endpoint)})


def _write(fileio, location: str, data: bytes) -> None:
    with fileio.new_output(location).create() as out:
        out.write(data)


def test_metadata_files_are_recognised_by_name():
    assert is_metadata_file("s3://b/t/metadata/00003-1f0c.metadata.json")
    assert is_metadata_file("s3://b/t/metadata/snap-1-1-1f0c.avro")
    assert is_metadata_file("/w/t/metadata/1f0c-m0.avro")
    assert not is_metadata_file("s3://b/t/data/seg-cp000000000001-t00000-p00000-1f0c.parquet")
    assert not is_metadata_file("s3://b/t/metadata/operator-state.parquet")


def test_a_metadata_file_is_one_put_and_is_then_read_and_sized_without_requests(fileio, s3_proxy, s3_prefix):
    location = f"{s3_prefix}/metadata/00001-abc.metadata.json"
    s3_proxy.reset()
    _write(fileio, location, b'{"format-version": 2}')
    assert s3_proxy.snapshot().by_method == {"PUT": 1}
    s3_proxy.reset()
    assert len(fileio.new_input(location)) == 21
    with fileio.new_input(location).open() as f:
        assert f.read() == b'{"format-version": 2}'
    assert fileio.new_input(location).exists()
    assert s3_proxy.snapshot().count == 0
    METADATA_FILES.clear()  # another process: read from the store once, then from memory
    with fileio.new_input(location).open() as f:
        assert f.read() == b'{"format-version": 2}'
    assert s3_proxy.snapshot().by_method.get("GET") == 1
    s3_proxy.reset()
    with fileio.new_input(location).open() as f:
        f.read()
    assert s3_proxy.snapshot().count == 0


def test_a_deleted_metadata_file_is_forgotten(fileio, s3_prefix):
    location = f"{s3_prefix}/metadata/00003-abc.metadata.json"
    _write(fileio, location, b"{}")
    fileio.delete(fileio.new_input(location))
    assert METADATA_FILES.get(location) is None
    wait_for_deletes()  # the delete itself runs in the background
    assert not fileio.new_input(location).exists()


def test_manifests_upload_in_the_background_and_a_metadata_json_waits_for_them(fileio, s3_proxy, s3_prefix):
    manifest = f"{s3_prefix}/metadata/abc-m0.avro"
    manifest_list = f"{s3_prefix}/metadata/snap-1-1-abc.avro"
    metadata = f"{s3_prefix}/metadata/00001-abc.metadata.json"
    with UPLOADS.deferred("abc"):  # as a checkpoint commit does, with its commit UUID
        s3_proxy.pause()  # the store hangs: nothing is stored until it resumes
        try:
            _write(fileio, manifest, b"manifest")  # returns at once: the upload is on the I/O pool
            _write(fileio, manifest_list, b"list")
            with fileio.new_input(manifest).open() as f:  # readable in this process meanwhile
                assert f.read() == b"manifest"
            done = threading.Event()
            waiter = threading.Thread(target=lambda: (UPLOADS.wait("abc"), done.set()))
            waiter.start()
            assert not done.wait(0.5)  # the commit's wait is not through while the uploads hang
        finally:
            s3_proxy.resume()
        waiter.join(30)
        assert done.is_set()
        _write(fileio, metadata, b"{}")  # what the catalog then switches to
    METADATA_FILES.clear()  # all three are in the store, not only in memory
    assert all(fileio.new_input(loc).exists() for loc in (manifest, manifest_list, metadata))


def test_under_a_gate_the_metadata_json_uploads_while_the_commits_waits_run(fileio, s3_proxy, s3_prefix):
    """``metadata_json_gate`` (a SQL catalog's commit: store the metadata.json, then switch):
    the file's PUT is under way while the gate's wait runs (the wait sees it at the proxy, which
    it could not if the store ran it first or after), and the store returns once both are done.
    A wait that fails makes the store fail with its error, after the upload settled; the file
    is not served from memory then, and the next metadata.json stores as usual."""
    location = f"{s3_prefix}/metadata/00001-gate.metadata.json"
    seen = []

    def wait() -> None:
        for _ in range(500):
            if any(r.method == "PUT" and r.path.endswith("00001-gate.metadata.json")
                   for r in s3_proxy.snapshot().requests):
                seen.append(True)
                return
            threading.Event().wait(0.01)

    s3_proxy.reset()
    with metadata_json_gate(wait) as used:
        assert not used()
        _write(fileio, location, b"{}")
        assert used()
    assert seen == [True]
    METADATA_FILES.clear()
    assert fileio.new_input(location).exists()

    failed = f"{s3_prefix}/metadata/00002-gate.metadata.json"

    def refuse() -> None:
        raise OSError("an upload of the commit failed")

    with pytest.raises(OSError, match="an upload of the commit failed"), metadata_json_gate(refuse):
        _write(fileio, failed, b"{}")
    assert METADATA_FILES.get(failed) is None
    after = f"{s3_prefix}/metadata/00003-gate.metadata.json"  # the gate is spent: stored at once
    s3_proxy.reset()
    _write(fileio, after, b"{}")
    assert s3_proxy.snapshot().by_method == {"PUT": 1}


def test_fileios_of_the_same_s3_settings_share_one_filesystem(s3_proxy, monkeypatch):
    """pyiceberg makes a FileIO per loaded table (a SQL catalog's commit loads two); building
    pyarrow's S3 filesystem waited 20-40 ms for other requests under way. FileIOs whose S3
    settings are the same share one (whatever their other, table, properties); other settings
    get their own."""
    from catalog.fileio import StateFileIO

    built = []
    original = StateFileIO._build_s3_fs
    monkeypatch.setattr(StateFileIO, "_build_s3_fs",
                        lambda self, netloc: built.append(netloc) or original(self, netloc))
    props = {"py-io-impl": STATE_FILE_IO, **s3_server.properties(s3_proxy.endpoint), "s3.request-timeout": "7.5"}
    first = load_file_io(props).fs_by_scheme("s3", "bucket-share")
    second = load_file_io({**props, "icestate.last-checkpoint-id": "9"}).fs_by_scheme("s3", "bucket-share")
    assert second is first and built == ["bucket-share"]
    other = load_file_io({**props, "s3.request-timeout": "8.5"}).fs_by_scheme("s3", "bucket-share")
    assert other is not first and len(built) == 2


def test_leaving_a_deferred_block_waits_for_its_uploads_and_forgets_their_failures(fileio, s3_proxy, s3_prefix):
    """A commit that stopped before its switch (an error, a crash point): its files are
    referenced by nothing, so their failure is not raised to anyone later."""
    manifest = f"{s3_prefix}/metadata/jkl-m0.avro"
    s3_proxy.fail_next(1, status=403, method="PUT")
    with pytest.raises(RuntimeError, match="before the switch"), UPLOADS.deferred("jkl"):
        _write(fileio, manifest, b"manifest")
        raise RuntimeError("the commit failed before the switch")
    UPLOADS.wait("jkl")  # nothing left to raise
    METADATA_FILES.clear()
    assert not fileio.new_input(manifest).exists()


def test_a_failed_upload_fails_the_commits_wait_and_no_other_writer(fileio, s3_proxy, s3_prefix):
    manifest = f"{s3_prefix}/metadata/def-m0.avro"
    with UPLOADS.deferred("def"):
        s3_proxy.fail_next(1, status=403, method="PUT")  # not retried by the client
        _write(fileio, manifest, b"manifest")
        UPLOADS.wait_file(manifest)  # its upload has met the injected failure (raised by wait only)
        # Another writer of the same table meanwhile: written at once, and not failed by it.
        other = f"{s3_prefix}/metadata/xyz-m0.avro"
        _write(fileio, other, b"other")
        with pytest.raises(OSError, match=r"def-m0\.avro"):
            UPLOADS.wait("def")
        assert METADATA_FILES.get(manifest) is None  # never stored: not served from memory either
        UPLOADS.wait("def")  # a failure is raised once
    METADATA_FILES.clear()
    assert fileio.new_input(other).exists() and not fileio.new_input(manifest).exists()


def test_outside_a_deferred_block_a_manifest_is_stored_when_its_close_returns(fileio, s3_proxy, s3_prefix):
    """Only a commit that waits for its uploads before the catalog switch defers them (a REST
    catalog writes no metadata.json through the FileIO: nothing else would wait)."""
    manifest = f"{s3_prefix}/metadata/ghi-m0.avro"
    s3_proxy.reset()
    _write(fileio, manifest, b"manifest")
    assert s3_proxy.snapshot().by_method == {"PUT": 1}  # already through when close returned


def test_other_files_are_not_cached(fileio, s3_proxy, s3_prefix):
    location = f"{s3_prefix}/data/seg-cp000000000001-t00000-p00000-abc.parquet"
    _write(fileio, location, b"PAR1")
    s3_proxy.reset()
    with fileio.new_input(location).open() as f:
        assert f.read() == b"PAR1"
    assert s3_proxy.snapshot().by_method.get("GET") == 1


def test_a_metadata_write_that_fails_halfway_leaves_no_file(fileio, s3_proxy, s3_prefix):
    location = f"{s3_prefix}/metadata/00002-abc.metadata.json"
    with pytest.raises(RuntimeError, match="serializer"), fileio.new_output(location).create() as out:
        out.write(b"{half")
        raise RuntimeError("the serializer failed")
    METADATA_FILES.clear()
    assert not fileio.new_input(location).exists()


def test_the_cache_keeps_the_most_recently_used_files_within_its_bound():
    cache = MetadataFileCache(bytes_max=10)
    cache.put("a", b"1234")
    cache.put("b", b"1234")
    assert cache.get("a") == b"1234"  # a is now the most recent
    cache.put("c", b"1234")
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (b"1234", None, b"1234")
    assert cache.size_bytes == 8
    cache.put("huge", b"x" * 11)  # larger than the bound: not kept
    assert cache.get("huge") is None and cache.size_bytes == 8


def test_a_commit_reads_none_of_the_metadata_it_wrote(tmp_path, s3_proxy, s3_prefix):
    """The second checkpoint of a table: pyiceberg would read back the parent's manifest list
    (twice) and the SQL catalog the current metadata.json; all were written by this process."""
    METADATA_FILES.clear()
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "init_catalog_tables": "true",
             "warehouse": s3_prefix, **s3_server.properties(s3_proxy.endpoint)}
    ref = TableRef("fileio", catalog_name="fileio", catalog_properties=props)
    with ref.open(LAYOUT) as table:
        store = StateStore(table)
        state = store.get_state("count")
        state.update_batch(pa.table({"user": ["a", "b"]}), pa.array([1, 2], pa.int64()))
        store.checkpoint()
        state.update_batch(pa.table({"user": ["c"]}), pa.array([3], pa.int64()))
        segments = store.flush(2)
        s3_proxy.reset()
        table.commit_checkpoint(2, segments, parallelism=1)
        calls = s3_proxy.snapshot().calls()
        store.checkpoint_complete(2)
        store.close()
    metadata_reads = [(m, t) for m, t in calls if m in ("GET", "HEAD") and "/metadata/" in t]
    assert metadata_reads == []
    assert [m for m, t in calls if m == "PUT" and "/metadata/" in t and not t.endswith("/metadata/")] == [
        "PUT", "PUT", "PUT"]  # the manifest, the manifest list and the metadata.json, one PUT each
    with ref.open() as fresh:  # and what it committed reads back from the store
        METADATA_FILES.clear()
        fresh.restore()
        reader = StateStore(fresh)
        assert reader.get_state("count").get_batch(pa.table({"user": ["a", "b", "c"]})).to_pylist() == [1, 2, 3]


def test_files_that_retention_deletes_are_not_served_from_memory(tmp_path):
    """Retention's sweep deletes expired snapshots' manifest lists and manifests through the
    filesystem: the cache forgets them, so reading one fails as it would in a new process."""
    METADATA_FILES.clear()
    with TableRef("gc", warehouse=str(tmp_path)).open(LAYOUT, retain_checkpoints=1) as table:
        store = StateStore(table)
        for i in range(4):
            store.get_state("count").update_batch(pa.table({"user": [f"u{i}"]}), pa.array([i], pa.int64()))
            store.checkpoint()
        store.close()
    cached = list(METADATA_FILES._files)
    assert any(loc.endswith(".avro") for loc in cached)
    assert [loc for loc in cached if not Path(loc.removeprefix("file://")).exists()] == []


def test_the_metadata_file_cache_keeps_the_newest_metadata_json_of_each_table():
    """A process that follows a table reads a new ``.metadata.json`` at each refresh and never an
    older one again: only the newest ``METADATA_JSON_PER_TABLE`` of each table stay, counted in
    its bytes; other files stay until deleted or beyond the byte bound."""
    from catalog.fileio import METADATA_JSON_PER_TABLE, MetadataFileCache

    cache = MetadataFileCache(bytes_max=10_000)
    a = [f"s3://b/wh/a/metadata/{n:05d}-x.metadata.json" for n in range(4)]
    b = "s3://b/wh/b/metadata/00001-y.metadata.json"
    manifest = "s3://b/wh/a/metadata/snap-1-m.avro"
    for location in [*a, b, manifest]:
        cache.put(location, b"0123456789")
    assert METADATA_JSON_PER_TABLE == 2
    assert [cache.get(x) is not None for x in a] == [False, False, True, True]
    assert cache.get(b) is not None and cache.get(manifest) is not None
    assert len(cache) == 4 and cache.size_bytes == 40
    cache.put(a[3], b"01234")  # the same file again: counted once
    assert len(cache) == 4 and cache.size_bytes == 35
    cache.discard(a[2])
    cache.put("s3://b/wh/a/metadata/00009-z.metadata.json", b"0")
    assert cache.get(a[3]) is not None and len(cache) == 4 and cache.size_bytes == 26
    small = MetadataFileCache(bytes_max=25)  # the byte bound evicts the least recently used
    for location in (manifest, *a[:2]):
        small.put(location, b"0123456789")
    assert small.get(manifest) is None and small.size_bytes == 20
    small.clear()
    assert len(small) == 0 and small.size_bytes == 0
