"""Memory of readers that follow a table: what they hold stays bounded however many checkpoints
they follow (the soak's "memory flat over time", in seconds): a store keeps the Parquet footers
of the table's live segments only, and the manifest cache holds at most its bounds."""

from __future__ import annotations

import pyarrow as pa

from catalog import IcebergStateTable
from catalog.compaction import compact_partition
from catalog.manifests import ManifestCache
from statestore import KeyGroupRange, StateLayout, StateStore, StoreConfig, ValueStateDescriptor
from tests.catalog.catalog_helpers import MAX_PARALLELISM, commit_next

N = 8
LAYOUT = StateLayout.of(pa.schema([("k", pa.string())]), [ValueStateDescriptor("v", pa.int64())], N)
ALL = KeyGroupRange.of(0, N - 1)
EVERY = KeyGroupRange.of(0, MAX_PARALLELISM - 1)  # of the helpers' layout (open_table)
KEYS = pa.table({"k": pa.array([f"k{i}" for i in range(40)], pa.string())})


def test_a_store_following_compactions_keeps_only_live_segments_footers(tmp_path):
    """A store whose views are evicted reads segments again at each batch; compaction replaces
    them. Without forgetting, the store kept the footer of every segment it ever read, until
    the footer cache's bound (4096 per store: tens of MB in a worker that runs for hours)."""
    warehouse = str(tmp_path / "wh")
    table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op", retain_checkpoints=2)
    compactor = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op")
    store = StateStore(table, config=StoreConfig(cache_size_bytes_max=1))  # every view evicted: reads read segments
    held = []
    for c in range(24):
        store.get_state("v").update_batch(KEYS, list(range(c, c + 40)))
        store.checkpoint(batch_id=c)
        assert store.get_state("v").get_batch(KEYS).to_pylist() == list(range(c, c + 40))
        if c % 4 == 3:
            compactor.restore()
            assert compact_partition(compactor, 0) is not None
        held.append(store.reader._segments.footers_held())
    live = {s.path for s in table.segments(ALL)}
    assert store.reader._segments.footers_held() <= len(live) <= 5
    assert max(held) <= 6  # never more than a compaction's inputs and the segments after it
    store.close()
    compactor.close()
    table.close()


def test_a_reader_following_a_writer_holds_at_most_the_manifest_cache_bounds(open_table, monkeypatch):
    """The manifest cache forgets its least recently used lists and manifests beyond its bounds
    (a table retaining thousands of checkpoints), and reads them again when asked."""
    monkeypatch.setattr(ManifestCache, "LISTS_MAX", 3)
    monkeypatch.setattr(ManifestCache, "MANIFESTS_MAX", 4)
    writer = open_table(retain_checkpoints=50)
    for n in range(12):
        commit_next(writer, [[n % 4]])
    cache = writer._cache
    assert len(cache._lists) <= 3 and len(cache._entries) <= 4
    assert set(cache._listed_by) <= {m.manifest_path for p in cache._lists.values() for m in p}
    reader = open_table(retain_checkpoints=50)
    for checkpoint in reader.list_checkpoints():  # every retained checkpoint, read again as needed
        reader.restore(checkpoint.checkpoint_id)
        assert len(reader.segments(EVERY)) == checkpoint.checkpoint_id
    assert len(reader._cache._lists) <= 3 and len(reader._cache._entries) <= 4




def test_pyiceberg_builds_no_avro_reader_per_metadata_file(open_table):
    """pyiceberg caches every Avro reader it builds, and a schema with a list never hit the
    cache (``ListType`` hashed by identity): one reader more per metadata file read, forever."""
    from pyiceberg.utils.singleton import Singleton

    writer = open_table(retain_checkpoints=3)
    reader = open_table(retain_checkpoints=3)

    def follow(checkpoints: int) -> int:
        for n in range(checkpoints):
            commit_next(writer, [[n % 4]])
            reader.restore()
        return len(Singleton._instances)

    cached = follow(4)
    assert follow(8) == cached
    assert len(reader.segments(EVERY)) == 12


def test_a_worker_keeps_a_bounded_number_of_filesystems(tmp_path):
    """Storage properties change when credentials are renewed: each set has its filesystem,
    and a worker running for days keeps at most ``LOCATIONS_MAX`` of them."""
    from catalog import task_view

    location = f"file://{tmp_path}/table"
    first = task_view.locations_of(location, {"s3.session-token": "0"})
    for token in range(1, task_view.LOCATIONS_MAX * 2):
        task_view.locations_of(location, {"s3.session-token": str(token)})
    assert len(task_view._LOCATIONS) <= task_view.LOCATIONS_MAX
    newest = task_view.locations_of(location, {"s3.session-token": str(task_view.LOCATIONS_MAX * 2 - 1)})
    assert newest is task_view.locations_of(location, {"s3.session-token": str(task_view.LOCATIONS_MAX * 2 - 1)})
    assert task_view.locations_of(location, {"s3.session-token": "0"}) is not first  # dropped, made again


def _writer_process(warehouse: str, orders, done) -> None:
    """A writer in a process of its own (its deletes of expired files happen there, so the
    follower's caches learn of them only by reading): ``n`` checkpoints per order, then ``done``."""
    table = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op", retain_checkpoints=2)
    store = StateStore(table)
    c = 0
    for n in iter(orders.get, None):
        for _ in range(n):
            store.get_state("v").update_batch(KEYS, list(range(c, c + 40)))
            store.checkpoint(batch_id=c)
            c += 1
        done.put(c - 1)
    store.close()
    table.close()


def test_a_process_following_another_writer_keeps_the_metadata_of_the_retained_table_only(tmp_path):
    """The compactor and every other reader in a process of its own read a new metadata file at
    each refresh, and the manifest lists and manifests of each new checkpoint; the writer deletes
    the expired ones in its process. The follower's metadata file cache kept every one of them
    until its bound (64 MiB per process: +33 MB in a 90-minute soak's compactor); it now keeps the
    newest metadata files of the table and the lists and manifests of its retained snapshots."""
    import multiprocessing

    from catalog.fileio import METADATA_FILES

    warehouse = str(tmp_path / "wh")
    spawn = multiprocessing.get_context("spawn")
    orders, done = spawn.Queue(), spawn.Queue()
    writer = spawn.Process(target=_writer_process, args=(warehouse, orders, done))
    writer.start()
    try:
        orders.put(2)
        done.get(timeout=120)
        follower = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op")
        counts = []
        for round_ in range(8):
            orders.put(3)
            newest = done.get(timeout=120)
            follower.restore()
            assert follower.current_checkpoint().batch_id == newest
            if round_ % 3 == 2:
                assert compact_partition(follower, 0) is not None
                follower.restore()
            files = [p for p in list(METADATA_FILES._files) if warehouse in p]
            counts.append((len(files), sum(p.endswith(".metadata.json") for p in files)))
        assert counts[-1][1] <= 2, counts
        assert max(n for n, _ in counts[4:]) <= max(n for n, _ in counts[:4]) + 2, counts  # not one more per round
        follower.close()
    finally:
        orders.put(None)
        writer.join(60)
        if writer.exitcode is None:
            writer.kill()
    assert writer.exitcode == 0
