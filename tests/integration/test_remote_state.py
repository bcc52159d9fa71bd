"""A stateful query whose state and outputs live on S3 (moto's server on loopback, a real
process), with the catalog named by properties: tasks never open the catalog (the driver ships
each batch's checkpoint view), outputs are written and read back through the output table's
storage properties, and a restart at another parallelism continues the same state.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from catalog import TableRef
from catalog.compaction import CompactionPolicy
from spark_integration import StateLocation
from statestore import StateStore
from tests import s3_server
from tests.integration.streaming_helpers import CountProcessor, counts, key_batches, run_to_end, write_batches

BUCKET = "icestate-spark"
# moto takes any credentials: a secret key planted to be looked for everywhere afterwards.
SECRET = f"planted-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def bucket(s3_server_endpoint: str) -> str:
    s3_server.create_bucket(s3_server_endpoint, BUCKET)
    return s3_server_endpoint


@pytest.fixture
def s3_location(tmp_path: Path, bucket: str):
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "init_catalog_tables": "true",
             "warehouse": f"s3://{BUCKET}/{prefix}", **s3_server.properties(bucket),
             "s3.secret-access-key": SECRET}

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


class CommandLines:
    """Every process's command line seen while running (polled: short-lived children count)."""

    def __init__(self) -> None:
        self.seen: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for pid in (p for p in os.listdir("/proc") if p.isdigit()):
                with contextlib.suppress(OSError):
                    self.seen[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            self._stop.wait(0.1)

    def __enter__(self) -> CommandLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_query_with_state_and_outputs_on_s3_restarts_at_another_parallelism(spark, tmp_path, s3_location, caplog,
                                                                              capfd):
    first, second = key_batches(2, 60, 23), key_batches(2, 60, 31, offset=120)
    keys = sorted(counts(first + second))
    seen: list[tuple] = []

    def collect(df, batch_id):
        seen.extend((batch_id, r["key"], r["count"]) for r in df.collect())

    loc = s3_location(2)
    caplog.set_level(logging.DEBUG)
    with CommandLines() as commands:
        runner = run_to_end(spark, write_batches(tmp_path / "in1", first), CountProcessor(),
                            "key string, count long", location=loc, checkpoint=str(tmp_path / "cp1"),
                            output_table="out.counts", foreach_batch=collect,
                            compaction=CompactionPolicy(min_segments=2))
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
    restarted = run_to_end(spark, str(tmp_path / "in1"), CountProcessor(), "key string, count long",
                           location=loc3, checkpoint=str(tmp_path / "cp1"), output_table="out.counts")
    assert _state(loc3, keys) == counts(first + second)
    # The new tasks loaded their key groups through the executors' file caches: hits where a
    # worker wrote the segment itself (filled on write), fetches from S3 otherwise.
    tasks = [t for r in restarted.reports for t in r.tasks.values()]
    assert sum(t["file_cache_hits"] + t["file_cache_misses"] for t in tasks) > 0
    fetched = sum(t["file_cache_bytes_fetched"] for t in tasks)
    assert (fetched > 0) == (sum(t["file_cache_misses"] for t in tasks) > 0)
    # When the compactor ran (whether a unit needed it depends on the batches' timing; its
    # command line is tested in tests/catalog/test_compactor.py): its command line as started,
    # since it may live shorter than one poll of /proc.
    if runner.compactor is not None and runner.compactor.pid is not None:
        compactor_args = " ".join(map(str, runner.compactor._process.args))
        assert "catalog.compactor" in compactor_args and SECRET not in compactor_args

    # The secret reached no process's command line, log record, output, repr or summary.
    assert len(commands.seen) > 3
    assert [c for c in commands.seen.values() if SECRET in c] == []
    assert SECRET not in caplog.text
    out, err = capfd.readouterr()
    assert SECRET not in out and SECRET not in err
    assert SECRET not in repr(loc) and SECRET not in repr(runner.table.checkpoint_view())

    # Everything is on S3: the output table's rows, read with plain pyiceberg.
    catalog = TableRef("counts", catalog_name="remote", catalog_properties=loc.catalog_properties).catalog()
    try:
        out = catalog.load_table("out.counts")
        assert out.location().startswith(f"s3://{BUCKET}/")
        rows = out.scan().to_arrow()
        finals = rows.group_by("key").aggregate([("count", "max")])
        assert dict(zip(finals["key"].to_pylist(), finals["count_max"].to_pylist(), strict=True)) == \
            counts(first + second)
        state = catalog.load_table("state.counts")
        for table in (out, state):
            for snapshot in table.snapshots():
                assert SECRET not in repr(snapshot.summary)
            assert SECRET not in repr(table.properties)
    finally:
        catalog.close()


def test_the_object_store_going_away_mid_batch_fails_the_batch_and_the_restart_loses_nothing(spark, tmp_path,
                                                                                             bucket):
    """The S3 server goes away after batch 1's outputs are committed, before its state is (our
    proxy in front of moto stops): the batch fails and the query stops with the error; the
    previous checkpoint is intact; once the server is back, the restarted query replays batch
    1 (its outputs are not added twice) and goes on, nothing lost."""
    from tests.net_proxy import NetProxy

    batches = key_batches(3, 50, 19)
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    keys = sorted(counts(batches))
    with NetProxy(bucket) as proxy:
        props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "init_catalog_tables": "true",
                 "warehouse": f"s3://{BUCKET}/{prefix}", **s3_server.properties(proxy.endpoint),
                 "s3.connect-timeout": "1", "s3.request-timeout": "2"}
        loc = StateLocation(table="counts", catalog_name="outage", catalog_properties=props, parallelism=2,
                            max_parallelism=16)

        def outage_at_batch_1(df, batch_id):
            if batch_id == 1:
                proxy.stop()

        input_dir = write_batches(tmp_path / "in", batches)
        with pytest.raises(Exception):  # noqa: B017 - Spark wraps the storage error in its own
            run_to_end(spark, input_dir, CountProcessor(), "key string, count long", location=loc,
                       checkpoint=str(tmp_path / "cp"), output_table="out.counts", foreach_batch=outage_at_batch_1)
        proxy.resume()
        with loc.ref.open() as table:
            assert (table.current_checkpoint().checkpoint_id, table.current_checkpoint().batch_id) == (1, 0)
        assert _state(loc, keys) == counts(batches[:1])

        run_to_end(spark, input_dir, CountProcessor(), "key string, count long", location=loc,
                   checkpoint=str(tmp_path / "cp"), output_table="out.counts")
        assert _state(loc, keys) == counts(batches)
        catalog = loc.ref.catalog()
        try:
            out = catalog.load_table("out.counts").scan().to_arrow()
        finally:
            catalog.close()
        expected = sum(len(set(b["key"].to_pylist())) for b in batches)
        assert out.num_rows == expected  # batch 1's outputs once
        finals = out.group_by("key").aggregate([("count", "max")])
        assert dict(zip(finals["key"].to_pylist(), finals["count_max"].to_pylist(), strict=True)) == counts(batches)
