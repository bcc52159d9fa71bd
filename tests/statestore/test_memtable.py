"""Unit tests of statestore.memtable: ord stamping, partitioning by key group, clear and reset.

Ords are checked against their documented encoding (checkpoint id ``MEMTABLE_CHECKPOINT_ID``
in the high 32 bits, a per-memtable sequence in the low 32), written out here with plain
integer arithmetic. Tests that need the sequence near its limits set ``_seq`` directly:
reaching 2^31 through ``next_ords`` would allocate 16 GiB.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from statestore.memtable import KG, MEMTABLE_CHECKPOINT_ID, SEQ_MAX, SEQ_RESET_AT, Memtable
from statestore.resolve import ORD

LOW_32 = (1 << 32) - 1


def entries(values: list[int]) -> pl.DataFrame:
    return pl.DataFrame({"k": values, "v_s": [v * 10 for v in values]})


def seqs(ords) -> list[int]:
    return [int(o) & LOW_32 for o in ords]


def test_ord_encoding_is_memtable_checkpoint_then_sequence():
    mt = Memtable()
    ords = mt.next_ords(3)
    assert ords.dtype == np.int64
    assert [int(o) >> 32 for o in ords] == [MEMTABLE_CHECKPOINT_ID] * 3
    assert seqs(ords) == [0, 1, 2]


def test_ords_strictly_increase_across_calls_and_parts():
    mt = Memtable()
    mt.add("a", np.array([3, 1, 3, 2]), entries([1, 2, 3, 4]))
    mt.add("b", np.array([1]), entries([5]))
    mt.add("a", np.array([1, 1]), entries([6, 7]))
    # items() is oldest first within a key group; across the whole memtable every ord is distinct
    # and the ords of each add follow the previous add's.
    ords = [o for _, _, part in mt.items() for o in part.get_column(ORD).to_list()]
    assert sorted(ords) == [(MEMTABLE_CHECKPOINT_ID << 32) + s for s in range(7)]
    for _, _, part in mt.items():
        col = part.get_column(ORD).to_list()
        assert col == sorted(col) and len(set(col)) == len(col)
    assert seqs(mt.next_ords(1)) == [7]


def test_add_partitions_by_key_group_keeping_row_order():
    mt = Memtable()
    touched = mt.add("a", np.array([3, 1, 3, 2, 1]), entries([10, 11, 12, 13, 14]))
    assert sorted(touched) == [1, 2, 3]
    by_kg = {kg: [p.get_column("k").to_list() for p in mt.parts("a", kg)] for kg in (1, 2, 3)}
    assert by_kg == {1: [[11, 14]], 2: [[13]], 3: [[10, 12]]}
    # seq of each row is its position in the add call
    assert seqs(mt.parts("a", 3)[0].get_column(ORD)) == [0, 2]
    assert seqs(mt.parts("a", 1)[0].get_column(ORD)) == [1, 4]
    # each part carries its key group as a column (flush stamps it in one pass); values
    # travel with their rows
    assert mt.parts("a", 3)[0].columns == ["k", "v_s", ORD, KG]
    assert mt.parts("a", 3)[0].get_column(KG).to_list() == [3, 3]
    assert mt.parts("a", 3)[0].get_column("v_s").to_list() == [100, 120]


def test_parts_of_unknown_state_or_key_group_are_empty():
    mt = Memtable()
    mt.add("a", np.array([1]), entries([1]))
    assert mt.parts("a", 2) == []
    assert mt.parts("zzz", 1) == []


def test_parts_accumulate_oldest_first_per_state_and_key_group():
    mt = Memtable()
    mt.add("a", np.array([5]), entries([1]))
    mt.add("b", np.array([5]), entries([2]))
    mt.add("a", np.array([5, 6]), entries([3, 4]))
    assert [p.get_column("k").to_list() for p in mt.parts("a", 5)] == [[1], [3]]
    assert [p.get_column("k").to_list() for p in mt.parts("b", 5)] == [[2]]
    assert [(n, kg, p.get_column("k").to_list()) for n, kg, p in mt.items()] == [
        ("a", 5, [1]), ("a", 5, [3]), ("a", 6, [4]), ("b", 5, [2])
    ]
    assert mt.entry_count() == 4


def test_empty_add_touches_nothing_and_uses_no_ords():
    mt = Memtable()
    assert mt.add("a", np.array([], dtype=np.int64), entries([])) == []
    assert mt.is_empty()
    assert seqs(mt.next_ords(1)) == [0]


def test_clear_drops_parts_and_sequence_continues():
    mt = Memtable()
    mt.add("a", np.array([1, 2]), entries([1, 2]))
    assert not mt.is_empty()
    assert mt.clear() is False
    assert mt.is_empty() and mt.entry_count() == 0 and mt.parts("a", 1) == []
    # entries written after a checkpoint stay newer than the ones it flushed
    mt.add("a", np.array([1]), entries([3]))
    assert seqs(mt.parts("a", 1)[0].get_column(ORD)) == [2]


def test_clear_at_reset_threshold_keeps_sequence():
    mt = Memtable()
    mt._seq = SEQ_RESET_AT
    assert mt.clear() is False
    assert seqs(mt.next_ords(1)) == [SEQ_RESET_AT]


def test_clear_past_reset_threshold_resets_sequence():
    mt = Memtable()
    mt.add("a", np.array([1]), entries([1]))
    mt._seq = SEQ_RESET_AT + 1
    assert mt.clear() is True
    assert mt.is_empty()
    assert seqs(mt.next_ords(2)) == [0, 1]


def test_sequence_limit():
    mt = Memtable()
    mt._seq = SEQ_MAX - 1
    last = mt.next_ords(1)
    assert seqs(last) == [SEQ_MAX - 1]
    assert int(last[0]) >> 32 == MEMTABLE_CHECKPOINT_ID  # the sequence never carries into the id
    with pytest.raises(OverflowError):
        mt.next_ords(1)


def test_reset_drops_parts_and_restarts_sequence():
    mt = Memtable()
    mt.add("a", np.array([1, 2, 3]), entries([1, 2, 3]))
    mt.reset()
    assert mt.is_empty()
    assert list(mt.items()) == []
    assert seqs(mt.next_ords(1)) == [0]


def test_drop_before_removes_only_the_flushed_prefix():
    mt = Memtable()
    mt.add("a", np.array([1, 2]), entries([10, 11]))
    mark = mt.watermark()
    mt.add("a", np.array([1]), entries([12]))
    dropped = mt.drop_before(mark)
    assert {k: [p.get_column("k").to_list() for p in v] for k, v in dropped.items()} == {("a", 1): [[10]],
                                                                                           ("a", 2): [[11]]}
    assert [p.get_column("k").to_list() for p in mt.parts("a", 1)] == [[12]]
    assert mt.parts("a", 2) == []
    assert not mt.is_empty()
