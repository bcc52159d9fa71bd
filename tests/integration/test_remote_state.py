"""A stateful query whose state and outputs live on S3 (moto's server on loopback, a real
process), with the catalog named by properties: tasks never open the catalog (the driver ships
each batch's checkpoint view), outputs are written and read back through the output table's
storage properties, and a restart at another parallelism continues the same state.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import TableRef
from spark_integration import StateLocation
from statestore import StateStore
from tests import s3_server
from tests.integration.streaming_helpers import CountProcessor, counts, key_batches, run_to_end, write_batches

BUCKET = "icestate-spark"


@pytest.fixture(scope="module")
def bucket(s3_server_endpoint: str) -> str:
    s3_server.create_bucket(s3_server_endpoint, BUCKET)
    return s3_server_endpoint


@pytest.fixture
def s3_location(tmp_path: Path, bucket: str):
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "init_catalog_tables": "true",
             "warehouse": f"s3://{BUCKET}/{prefix}", **s3_server.properties(bucket)}

    def location(parallelism: int) -> StateLocation:
        return StateLocation(table="counts", catalog_name="remote", catalog_properties=props,
                             parallelism=parallelism, max_parallelism=16)
    return location


def _state(location: StateLocation, keys: list[str]) -> dict[str, int]:
    table = location.ref.open()
    try:
        store = StateStore(table, task_index=0, parallelism=1)
        values = store.get_state("count").get_batch(pa.table({"key": keys})).to_pylist()
        return {k: v["n"] for k, v in zip(keys, values, strict=True) if v is not None}
    finally:
        table.close()


def test_a_query_with_state_and_outputs_on_s3_restarts_at_another_parallelism(spark, tmp_path, s3_location):
    first, second = key_batches(2, 60, 23), key_batches(2, 60, 31, offset=120)
    keys = sorted(counts(first + second))
    seen: list[tuple] = []

    def collect(df, batch_id):
        seen.extend((batch_id, r["key"], r["count"]) for r in df.collect())

    loc = s3_location(2)
    runner = run_to_end(spark, write_batches(tmp_path / "in1", first), CountProcessor(), "key string, count long",
                        location=loc, checkpoint=str(tmp_path / "cp1"), output_table="out.counts",
                        foreach_batch=collect)
    assert _state(loc, keys) == counts(first)
    table = loc.ref.open()
    assert table.location.startswith(f"s3://{BUCKET}/")
    table.close()
    assert [r.batch_id for r in runner.reports if not r.skipped] == [0, 1]
    # The callback read the output files from S3 through the output table's properties: each
    # batch's updated keys with their new counts.
    running: dict[str, int] = {}
    expected = []
    for b, batch in enumerate(first):
        running.update({k: running.get(k, 0) + n for k, n in counts([batch]).items()})
        expected += [(b, k, running[k]) for k in set(batch["key"].to_pylist())]
    assert sorted(seen) == sorted(expected)

    # A restart at parallelism 3 with two more input files: tasks own new key-group ranges
    # of the same segments; nothing is copied.
    for i, t in enumerate(second, start=len(first)):
        pq.write_table(t, tmp_path / "in1" / f"part-{i:04d}.parquet")
    loc3 = s3_location(3)
    run_to_end(spark, str(tmp_path / "in1"), CountProcessor(), "key string, count long",
               location=loc3, checkpoint=str(tmp_path / "cp1"), output_table="out.counts")
    assert _state(loc3, keys) == counts(first + second)

    # Everything is on S3: the output table's rows, read with plain pyiceberg.
    catalog = TableRef("counts", catalog_name="remote", catalog_properties=loc.catalog_properties).catalog()
    try:
        out = catalog.load_table("out.counts")
        assert out.location().startswith(f"s3://{BUCKET}/")
        rows = out.scan().to_arrow()
        finals = rows.group_by("key").aggregate([("count", "max")])
        assert dict(zip(finals["key"].to_pylist(), finals["count_max"].to_pylist(), strict=True)) == \
            counts(first + second)
    finally:
        catalog.close()
