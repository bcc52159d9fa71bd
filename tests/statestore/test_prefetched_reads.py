"""Directed tests of per-key reads after a prefetch (``StateReader._batch_point``).

A per-key loop over a batch's keys (the Spark-API runner's, or a user's after
``StateStore.prefetch``) reads each key through an index over the prefetched keys' rows alone,
not through an index over every row of their key groups' views: on whole-cached views the
latter is built from the whole cached state after every change of a view, so the loop paid
for the state instead of the batch. These tests keep one store's views cached whole over
several rounds of prefetch, per-key reads and writes of value, list and map state, batched
reads in between (they seal the per-key writes into the memtable, which changes the views),
and checkpoints, and compare every read with a plain Python model; and they check that the
reads of prefetched keys never build an index over a whole view. The model-based test
(``test_store_model``) runs prefetches among every other operation, with small states.
"""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from statestore import (
    DirectoryStateTable,
    ListStateDescriptor,
    MapStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    ValueStateDescriptor,
    assign_key_groups,
    read_path,
)

LAYOUT = StateLayout.of(
    pa.schema([("k", pa.string())]),
    [ValueStateDescriptor("v", pa.int64()), ListStateDescriptor("l", pa.int64()),
     MapStateDescriptor("m", key_type=pa.string(), value_type=pa.int64())],
    max_parallelism=8,
)
KEYS = [f"key-{i:04d}" for i in range(600)]


def keys(names: list[str]) -> pa.Table:
    return pa.table({"k": pa.array(names, pa.string())})


@pytest.fixture
def index_builds(monkeypatch) -> dict[str, int]:
    """How many indexes were built over whole views and over prefetched keys."""
    builds = {"view": 0, "prefetched": 0}
    view_index, batch_point = read_path.StateReader._view_index, read_path.StateReader._batch_point

    def counted_view_index(self, name, key_group, kind, columns, build):
        fast = self._point_index.get((name, kind, key_group))
        if fast is None:
            builds["view"] += 1
        return view_index(self, name, key_group, kind, columns, build)

    def counted_batch_point(self, name, key, kind, columns, build):
        if (name, kind) not in self._batch_index and self._prefetched is not None:
            builds["prefetched"] += 1
        return batch_point(self, name, key, kind, columns, build)

    monkeypatch.setattr(read_path.StateReader, "_view_index", counted_view_index)
    monkeypatch.setattr(read_path.StateReader, "_batch_point", counted_batch_point)
    return builds


class Model:
    def __init__(self) -> None:
        self.v: dict[str, int] = {}
        self.l: dict[str, list[int]] = {}
        self.m: dict[str, dict[str, int]] = {}


def check_key(store: StateStore, model: Model, k: str) -> None:
    store.set_current_key(k)
    assert store.get_state("v").get() == model.v.get(k), k
    assert store.get_state("l").get() == model.l.get(k, []), k
    assert dict(store.get_state("m").items()) == model.m.get(k, {}), k
    assert store.get_state("m").get("x") == model.m.get(k, {}).get("x"), k


def write_key(store: StateStore, model: Model, k: str, rng: random.Random) -> None:
    store.set_current_key(k)
    op = rng.randrange(5)
    if op == 0:
        n = rng.randrange(1000)
        store.get_state("v").update(n)
        model.v[k] = n
    elif op == 1:
        store.get_state("v").clear()
        model.v.pop(k, None)
    elif op == 2:
        n = rng.randrange(1000)
        store.get_state("l").add(n)
        model.l.setdefault(k, []).append(n)
    elif op == 3:
        uk, n = rng.choice("xyz"), rng.randrange(1000)
        store.get_state("m").put(uk, n)
        model.m.setdefault(k, {})[uk] = n
    else:
        uk = rng.choice("xyz")
        store.get_state("m").remove(uk)
        if k in model.m:
            model.m[k].pop(uk, None)
            if not model.m[k]:
                del model.m[k]


def test_per_key_reads_of_prefetched_keys_match_the_model_through_writes_seals_and_checkpoints(
        tmp_path, index_builds):
    rng = random.Random(7)
    table = DirectoryStateTable(tmp_path / "t", LAYOUT)
    store = StateStore(table, config=StoreConfig(view_partial_reads_max=0))  # whole views
    model = Model()
    store.get_state("v").update_batch(keys(KEYS), list(range(len(KEYS))))
    store.get_state("l").add_batch(keys(KEYS + KEYS[:100]), list(range(len(KEYS) + 100)))
    store.get_state("m").put_batch(keys(KEYS[::3]), ["x"] * len(KEYS[::3]), list(range(len(KEYS[::3]))))
    model.v = {k: i for i, k in enumerate(KEYS)}
    model.l = {k: [i] for i, k in enumerate(KEYS)}
    for i, k in enumerate(KEYS[:100]):
        model.l[k].append(len(KEYS) + i)
    model.m = {k: {"x": i} for i, k in enumerate(KEYS[::3])}
    store.checkpoint()

    for round_ in range(8):
        batch = [*rng.sample(KEYS, 30), "absent-1", "absent-2"]
        store.prefetch(keys(batch))
        before = index_builds["view"]
        for k in batch:
            check_key(store, model, k)
            write_key(store, model, k, rng)
            check_key(store, model, k)  # the key's own write, from the overlay over the index
        assert index_builds["view"] == before, "a prefetched key was read through a whole view's index"
        if round_ % 2:
            # A batched read seals the per-key writes into the memtable: the views change, and
            # the prefetched keys' index must be rebuilt from them.
            sample = rng.sample(batch, 5)
            assert store.get_state("v").get_batch(keys(sample)).to_pylist() == [model.v.get(k) for k in sample]
            for k in batch:
                check_key(store, model, k)
        # A key not prefetched still reads right (through its key group's view).
        check_key(store, model, rng.choice([k for k in KEYS if k not in batch]))
        if round_ % 3 == 2:
            store.checkpoint()
            for k in batch:
                check_key(store, model, k)
    assert index_builds["prefetched"] >= 8 * 3, "the prefetched keys' index was never used"
    store.checkpoint()

    fresh = StateStore(table)
    for k in [*KEYS, "absent-1", "absent-2"]:
        check_key(fresh, model, k)


def test_the_prefetched_index_holds_the_prefetched_keys_only(tmp_path):
    table = DirectoryStateTable(tmp_path / "t", LAYOUT)
    store = StateStore(table, config=StoreConfig(view_partial_reads_max=0))
    store.get_state("l").add_batch(keys(KEYS), list(range(len(KEYS))))
    store.checkpoint()
    store.prefetch(keys(KEYS[:10]))
    store.set_current_key(KEYS[3])
    assert store.get_state("l").get() == [3]
    index = store.reader._batch_index[("l", "rows")]
    assert sorted(k for (k,) in index) == KEYS[:10]


def test_a_prefetch_whose_key_group_was_evicted_and_read_again_falls_back_to_its_view(tmp_path):
    """A prefetched key group evicted before the loop may come back holding other keys (a
    partial view): the prefetched index is dropped and the read goes through the view, which
    loads the key group whole for a key it lacks."""
    layout = StateLayout.of(pa.schema([("k", pa.string())]), [ValueStateDescriptor("v", pa.int64())],
                            max_parallelism=2)
    groups = assign_key_groups(keys(KEYS), 2).tolist()
    in_a = [k for k, g in zip(KEYS, groups, strict=True) if g == 0]
    in_b = [k for k, g in zip(KEYS, groups, strict=True) if g == 1]
    table = DirectoryStateTable(tmp_path / "t", layout)
    writer = StateStore(table)
    writer.get_state("v").update_batch(keys(KEYS), list(range(len(KEYS))))
    writer.checkpoint()
    store = StateStore(table, config=StoreConfig(cache_size_bytes_max=1, view_partial_rows_min=0))
    v = store.get_state("v")
    store.prefetch(keys(in_a[:5]))
    v.get_batch(keys(in_b[:5]))  # evicts key group a (a 1-byte cache keeps the pinned group only)
    v.get_batch(keys(in_a[100:105]))  # a again, partial with other keys
    assert store.stats()["cache_evictions"] >= 1
    for k in in_a[:5]:
        store.set_current_key(k)
        assert v.get() == KEYS.index(k)
    assert store.reader._prefetched is None
