"""Model-based test of the keyed state on Iceberg across rescales, restores and savepoints.

Strategy
    A seeded hypothesis ``RuleBasedStateMachine`` plays a job of ``p`` tasks (one
    ``StateStore`` each, on one ``IcebergStateTable``) over a small pool of string keys
    (max parallelism 8, so keys share key groups and tasks own several). Writes (value put,
    list append, clear; per-key or batched) go to the key's owning task. ``checkpoint``
    flushes every task and commits one snapshot. ``rescale`` drops the tasks (their
    uncommitted writes are lost, as in a restart) and opens the newest checkpoint at a new
    random parallelism from 1 to 8. ``restore`` goes back to a retained checkpoint (or
    tries one retention removed), ``savepoint`` names the newest checkpoint and
    ``restore_savepoint`` goes back to one, even after retention moved past it. The model
    is a dict per checkpoint. ``compact`` (in its own table object, as another process would)
    merges whole units or some of their newest segments, over all key groups or a range.

Invariants (after every step)
    1. Every key of the pool, read through its owning task (batched for half the keys,
       per key for the other half), has exactly the model's value and list, uncommitted
       writes included.
    2. A rescale or restore writes no segment file; a restore of a checkpoint that
       retention removed raises ``CheckpointNotFoundError`` and changes nothing.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from catalog import IcebergStateTable
from catalog.compaction import CompactionPolicy, compact
from statestore import (
    CheckpointNotFoundError,
    KeyGroupRange,
    ListStateDescriptor,
    StateLayout,
    StateStore,
    ValueStateDescriptor,
    assign_key_groups,
    task_for_key_group,
)

N = 8
RETAIN = 3
VALUE = ValueStateDescriptor("v", pa.int64())
LIST = ListStateDescriptor("l", pa.int64())
LAYOUT = StateLayout.of(pa.schema([("k", pa.string())]), [VALUE, LIST], N)
KEYS = [f"k{i}" for i in range(12)]
KEY_GROUPS = dict(zip(KEYS, assign_key_groups(pa.table({"k": KEYS}), N).astype(np.int64).tolist(), strict=True))


def keys_table(keys: list[str]) -> pa.Table:
    return pa.table({"k": pa.array(keys, pa.string())})


class RescaleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="rescale_model_"))
        self.table = IcebergStateTable.open(LAYOUT, warehouse=str(self.dir / "wh"), table_name="op",
                                            retain_checkpoints=RETAIN)
        self.parallelism = 2
        self.stores = self._open_stores()
        self.model: dict[str, dict] = {"v": {}, "l": {}}
        self.committed: dict[int, dict] = {}
        self.savepoints: dict[str, int] = {}
        self.step = 0

    def teardown(self) -> None:
        for s in self.stores:
            s.close()
        self.table.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def _open_stores(self) -> list[StateStore]:
        return [StateStore(self.table, task_index=t, parallelism=self.parallelism) for t in range(self.parallelism)]

    def _owner(self, key: str) -> StateStore:
        return self.stores[int(task_for_key_group(N, self.parallelism, KEY_GROUPS[key]))]

    def _segment_files(self) -> set[str]:
        return {str(p) for p in (self.dir / "wh").rglob("seg-*.parquet")}

    def _reopen(self, checkpoint_id: int | None = None, savepoint: str | None = None) -> None:
        for s in self.stores:
            s.close()
        before = self._segment_files()
        self.table.restore(checkpoint_id, savepoint=savepoint)
        self.stores = self._open_stores()
        assert self._segment_files() == before  # no state copied or rewritten
        cp = self.table.current_checkpoint()
        self.model = copy.deepcopy(self.committed[cp.checkpoint_id]) if cp else {"v": {}, "l": {}}

    # ------------------------------------------------------------------ writes

    @rule(key=st.sampled_from(KEYS), value=st.integers(-50, 50), batched=st.booleans())
    def put(self, key, value, batched):
        store = self._owner(key)
        if batched:
            store.get_state(VALUE).update_batch(keys_table([key]), [value])
        else:
            store.set_current_key(key, KEY_GROUPS[key])
            store.get_state(VALUE).update(value)
        self.model["v"][key] = value

    @rule(key=st.sampled_from(KEYS), value=st.integers(0, 9), batched=st.booleans())
    def append(self, key, value, batched):
        store = self._owner(key)
        if batched:
            store.get_state(LIST).add_batch(keys_table([key]), [value])
        else:
            store.set_current_key(key, KEY_GROUPS[key])
            store.get_state(LIST).add(value)
        self.model["l"].setdefault(key, []).append(value)

    @rule(key=st.sampled_from(KEYS))
    def clear(self, key):
        store = self._owner(key)
        store.get_state(VALUE).clear_batch(keys_table([key]))
        store.get_state(LIST).clear_batch(keys_table([key]))
        self.model["v"].pop(key, None)
        self.model["l"].pop(key, None)

    # ------------------------------------------------------------------ checkpoints, rescale, restore

    @rule()
    def checkpoint(self):
        cp = self.table.next_checkpoint_id()
        segments = [seg for s in self.stores for seg in s.flush(cp)]
        self.table.commit_checkpoint(cp, segments, parallelism=self.parallelism, batch_id=cp)
        for s in self.stores:
            s.checkpoint_complete(cp)
        self.committed[cp] = copy.deepcopy(self.model)

    @rule(writes=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(-50, 50) | st.none()), min_size=1,
                          max_size=6))
    def batch(self, writes):
        """A micro-batch: puts (None: a clear) on a few keys, then a checkpoint."""
        for key, value in writes:
            if value is None:
                self.clear(key)
            else:
                self.put(key, value, batched=True)
        self.checkpoint()

    @rule(parallelism=st.integers(1, N))
    def rescale(self, parallelism):
        self.parallelism = parallelism
        self._reopen()

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def restore(self, data):
        retained = [c.checkpoint_id for c in self.table.list_checkpoints()]
        cp = data.draw(st.sampled_from(sorted(self.committed)), label="checkpoint")
        if cp not in retained:
            before = self.table.current_checkpoint()
            try:
                self.table.restore(cp)
            except CheckpointNotFoundError:
                assert self.table.current_checkpoint() == before
                return
            raise AssertionError(f"checkpoint {cp} restored though retention removed it ({retained})")
        self._reopen(cp)

    @precondition(lambda self: len(self.table.segments(KeyGroupRange.of(0, N - 1))) >= 2)
    @rule(tiered=st.booleans(), size_ratio=st.sampled_from([0.5, 1.0, 10.0]), max_merge=st.integers(2, 4),
          first=st.integers(0, N - 1), width=st.integers(1, N), restart=st.booleans())
    def compact(self, tiered, size_ratio, max_merge, first, width, restart):
        """Whole units, or merges of their newest segments (tombstones kept: older segments are
        left out), over all key groups or a range of them."""
        other = IcebergStateTable.open(LAYOUT, warehouse=str(self.dir / "wh"), table_name="op",
                                       retain_checkpoints=RETAIN)
        policy = CompactionPolicy(min_segments=2, size_ratio=size_ratio, max_merge=max_merge) if tiered else None
        try:
            result = compact(other, policy=policy, key_groups=KeyGroupRange.of(first, min(N - 1, first + width - 1)))
            assert result is None or result.files_out <= len(result.units)
        finally:
            other.close()
        if result is not None and restart:  # the tasks restart on the compacted files
            self._reopen()

    @precondition(lambda self: self.table.current_checkpoint() is not None)
    @rule()
    def savepoint(self):
        self.step += 1
        name = f"sp{self.step}"
        info = self.table.savepoint(name)
        self.savepoints[name] = info.checkpoint_id

    @precondition(lambda self: self.savepoints)
    @rule(data=st.data(), parallelism=st.integers(1, N))
    def restore_savepoint(self, data, parallelism):
        name = data.draw(st.sampled_from(sorted(self.savepoints)), label="savepoint")
        self.parallelism = parallelism
        self._reopen(savepoint=name)
        assert self.table.current_checkpoint().checkpoint_id == self.savepoints[name]

    # ------------------------------------------------------------------ invariants

    @invariant()
    def every_key_reads_the_model(self):
        batched, per_key = KEYS[::2], KEYS[1::2]
        for key in batched:
            store = self._owner(key)
            assert store.get_state(VALUE).get_batch(keys_table([key])).to_pylist() == [self.model["v"].get(key)]
            assert store.get_state(LIST).get_batch(keys_table([key])).to_pylist() == [self.model["l"].get(key, [])]
        for key in per_key:
            store = self._owner(key)
            store.set_current_key(key, KEY_GROUPS[key])
            assert store.get_state(VALUE).get() == self.model["v"].get(key), key
            assert list(store.get_state(LIST).get()) == self.model["l"].get(key, []), key


TestRescaleModel = RescaleMachine.TestCase
TestRescaleModel.pytestmark = [pytest.mark.slow]
TestRescaleModel.settings = settings(max_examples=30, stateful_step_count=40, derandomize=True, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
