"""Contract: a ``StateStore`` on top of the table reads the same state through put,
checkpoint, restore, reopen and rescale (several tasks committing one checkpoint, then
another parallelism reading it)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from statestore.config import StoreConfig
from statestore.file_cache import close_process_file_caches
from statestore.keygroups import assign_key_groups, task_for_key_group
from statestore.store import StateStore
from tests.contract.helpers import ALL_KEY_GROUPS, MAX_PARALLELISM, keys, read, write

RESCALE_KEYS = list(range(200))


def owners(ks: list[int], parallelism: int) -> np.ndarray:
    return task_for_key_group(MAX_PARALLELISM, parallelism, assign_key_groups(keys(ks), MAX_PARALLELISM))


def test_segments_written_by_the_store_commit(backend):
    """The per-key API end to end, on a table of several partitions where it has them."""
    table = backend.open(key_groups_per_partition=4)
    store = StateStore(table)
    count = store.get_state("count")
    for key, n in [(1, 1), (2, 2), (3, 3)]:
        store.set_current_key(key)
        count.update(n)
    store.checkpoint(batch_id=0)
    store = StateStore(backend.open())
    count = store.get_state("count")
    values = {}
    for key in [1, 2, 3, 4]:
        store.set_current_key(key)
        values[key] = count.get()
    assert values == {1: 1, 2: 2, 3: 3, 4: None}


def test_restore_drops_uncommitted_writes_and_reopen_sees_the_newest(backend):
    store = StateStore(backend.open())
    write(store, {1: 1, 2: 2})
    store.checkpoint()
    write(store, {1: 10, 3: 3})
    store.checkpoint()
    write(store, {1: 100, 2: None})  # never committed
    assert read(store) == {1: 100, 3: 3}
    assert store.restore().checkpoint_id == 2
    assert read(store) == {1: 10, 2: 2, 3: 3}
    write(store, {4: 4})  # never committed either
    assert store.restore(1).checkpoint_id == 1
    assert read(store) == {1: 1, 2: 2}
    assert read(StateStore(backend.open())) == {1: 10, 2: 2, 3: 3}


@pytest.mark.parametrize("parallelism", [1, 3, 4])
def test_rescale_reads_what_other_tasks_wrote(backend, parallelism):
    """Two tasks each write their own keys and commit one checkpoint together; a job of
    ``parallelism`` tasks then reads every key at the task that owns it."""
    table = backend.open()
    writers = [StateStore(table, task_index=t, parallelism=2) for t in range(2)]
    written = owners(RESCALE_KEYS, 2)
    for t, store in enumerate(writers):
        mine = [k for k, o in zip(RESCALE_KEYS, written, strict=True) if o == t]
        write(store, {k: k * 7 for k in mine})
    cp = table.next_checkpoint_id()
    segments = [s for store in writers for s in store.flush(cp)]
    info = table.commit_checkpoint(cp, segments, parallelism=2, batch_id=41)
    for store in writers:
        store.checkpoint_complete(cp)
    assert (info.checkpoint_id, info.batch_id, info.parallelism) == (cp, 41, 2)
    assert {s.path for s in table.segments(ALL_KEY_GROUPS)} == {s.path for s in segments}

    reopened = backend.open()
    assert reopened.current_checkpoint().parallelism == 2
    reading = owners(RESCALE_KEYS, parallelism)
    for t in range(parallelism):
        store = StateStore(reopened, task_index=t, parallelism=parallelism)
        mine = [k for k, o in zip(RESCALE_KEYS, reading, strict=True) if o == t]
        got = store.get_state("count").get_batch(pa.table({"k": pa.array(mine, pa.int64())})).to_pylist()
        assert got == [k * 7 for k in mine], t
        store.close()


def test_the_file_cache_changes_no_result_and_a_warm_process_fetches_nothing(backend, tmp_path):
    """The file cache forced on (it is on by default for object stores only): a store reads
    what a store without it reads; the writer reads its own segments back without a fetch; a
    new process's first store fetches each segment once and its second store none."""
    table = backend.open(key_groups_per_partition=4)
    cached = StoreConfig(file_cache_mode="on", file_cache_dir=str(tmp_path / "file-cache"))
    writer = StateStore(table, config=cached)
    expected: dict[int, int] = {}
    for cp in range(3):
        changes = {k: k * 10 + cp for k in range(cp * 20, cp * 20 + 40)}
        write(writer, changes)
        writer.checkpoint()
        expected.update(changes)
    probe = list(range(100))
    segments = table.segments(ALL_KEY_GROUPS)
    writer.reader.reset()  # read the segments again, from the copies the flushes cached
    assert read(writer, ks=probe) == expected
    stats = writer.stats()
    assert stats["file_cache_misses"] == 0 and stats["file_cache_hits"] == len(segments)
    assert stats["file_cache_bytes_written"] == sum(s.size_bytes for s in segments)

    default = StateStore(backend.open())  # auto: a cache for the object store only
    assert (default.reader.file_cache is not None) == (backend.id == "iceberg-s3")
    plain = StateStore(backend.open(), config=StoreConfig(file_cache_mode="off"))
    assert read(plain, ks=probe) == expected and plain.stats()["file_cache_hits"] == 0
    close_process_file_caches()  # a new process
    cold = StateStore(backend.open(), config=cached)
    assert read(cold, ks=probe) == expected
    stats = cold.stats()
    assert (stats["file_cache_misses"], stats["file_cache_bytes_fetched"]) == (
        len(segments), sum(s.size_bytes for s in segments))
    warm = StateStore(backend.open(), config=cached)
    assert read(warm, ks=probe) == expected
    assert (warm.stats()["file_cache_misses"], warm.stats()["file_cache_bytes_fetched"]) == (0, 0)
    close_process_file_caches()
