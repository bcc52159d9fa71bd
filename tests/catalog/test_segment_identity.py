"""A segment replaced by another valid Parquet file (issue 14, defect 4) is named, never read:
every read checks the file against what its checkpoint recorded (its own name written into its
footer, its size, its row count). On local disk and on S3 (moto's server on loopback)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from statestore import StateStore, StoreConfig
from statestore.errors import CorruptSegmentError
from statestore.keygroups import KeyGroupRange
from statestore.segment import SEGMENT_NAME_KEY
from tests.catalog.catalog_helpers import MAX_PARALLELISM, entries
from tests.catalog.conftest import Place

ALL = KeyGroupRange.of(0, MAX_PARALLELISM - 1)
USERS = pa.table({"user": ["a", "b"]})
# A reader on another host: no local copy of the segments (on S3 the writer's cache holds the
# bytes it committed, which read correctly whatever is on the object store now).
ELSEWHERE = StoreConfig(file_cache_mode="off")


def checkpoint(table, values: list[int]) -> str:
    """Commit ``values`` for users a and b; the path of the one segment it wrote."""
    store = StateStore(table)
    store.get_state("count").update_batch(USERS, values)
    store.checkpoint()
    cp = table.current_checkpoint().checkpoint_id
    (path,) = [s.path for s in table.segments(ALL) if s.checkpoint_id == cp]
    return path


def copy_over(table, source: str, target: str) -> None:
    fs = table.filesystem
    data = fs.open_input_file(source).read()
    with fs.open_output_stream(target) as out:
        out.write(data)


def test_an_older_segment_copied_over_a_newer_one_is_named(place: Place):
    table = place.open()
    older = checkpoint(table, [1, 2])
    newer = checkpoint(table, [10, 20])
    meta = pq.read_metadata(table.filesystem.open_input_file(newer))
    assert meta.metadata[SEGMENT_NAME_KEY.encode()].decode() == newer.rsplit("/", 1)[-1]
    copy_over(table, older, newer)
    reader = place.open()  # a fresh process's view: nothing cached
    with pytest.raises(CorruptSegmentError, match=r"written as seg-cp000000000001.*another segment copied over it"):
        StateStore(reader, config=ELSEWHERE).get_state("count").get_batch(USERS)
    reader.restore(1)  # the older checkpoint is intact and reads as it was
    assert StateStore(reader, config=ELSEWHERE).get_state("count").get_batch(USERS).to_pylist() == [1, 2]


def test_a_segment_with_other_rows_in_its_place_is_named(place: Place):
    table = place.open()
    checkpoint(table, [1, 2])
    newer = checkpoint(table, [10, 20])
    # Another valid file of the table's schema under the same name (no name in its footer, as
    # files written before names were recorded): the row count gives it away.
    with table.filesystem.open_output_stream(newer) as out:
        pq.write_table(entries(table.layout, 2, [1, 2, 3]).cast(table.file_schema()), out)
    reader = place.open()
    with pytest.raises(CorruptSegmentError, match=r"bytes where the checkpoint recorded|rows where the checkpoint"):
        StateStore(reader, config=ELSEWHERE).get_state("count").get_batch(USERS)
