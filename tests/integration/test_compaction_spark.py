"""Compaction as a Spark job (``compact(..., spark=...)``, ``icestate compact --spark``): the
merges run in Spark's Python workers, one task per partition, and commit from the driver as the
local compaction does: the same state before and after, fewer files, and the stream goes on."""

from __future__ import annotations

import os

from typer.testing import CliRunner

from catalog import IcebergStateTable, connect
from catalog.compaction import compact
from spark_integration import StateLocation
from statestore.paths import segment_file_name
from tests.integration.streaming_helpers import CountProcessor, counts, key_batches, run_to_end, write_batches


def state(table: IcebergStateTable) -> dict[str, int]:
    con = connect(table)
    try:
        return dict(con.sql("SELECT key, v_count.n FROM state_count").fetchall())
    finally:
        con.close()


def test_compaction_runs_as_a_spark_job_and_the_stream_goes_on(spark, tmp_path):
    batches = key_batches(6, 40, 29)
    input_dir, cp = tmp_path / "in", str(tmp_path / "cp")
    location = StateLocation(table="counts", warehouse=str(tmp_path / "wh"), parallelism=2, max_parallelism=16)
    write_batches(input_dir, batches[:4])
    run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=location, checkpoint=cp,
               compaction=None)
    table = IcebergStateTable.open_existing(warehouse=location.warehouse, table_name="counts")
    try:
        before, files = state(table), len(table.iceberg_table.scan().plan_files())
        result = compact(table, spark=spark)
        assert result is not None and result.files_in > result.files_out >= 1
        assert len(result.units) == 2 == result.files_out  # a task per unit: both tasks' key groups
        assert os.getpid() not in result.processes and result.processes  # merged in Spark's workers
        assert state(table) == before == counts(batches[:4])
        assert len(table.iceberg_table.scan().plan_files()) == files - result.files_in + result.files_out
    finally:
        table.close()
    write_batches(input_dir, batches)  # the stream's next checkpoint follows the compaction
    run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=location, checkpoint=cp,
               compaction=None)
    from catalog.cli import tables

    result = CliRunner().invoke(tables, ["compact", "--table", "counts", "--warehouse", location.warehouse,
                                         "--spark", "local[2]", "--json"])
    assert result.exit_code == 0, result.output
    with IcebergStateTable.open_existing(warehouse=location.warehouse, table_name="counts") as table:
        assert state(table) == counts(batches)
        # A full sweep as a Spark job: the checkpoint directories listed and swept in Spark's workers.
        data = tmp_path / "wh" / "state" / "counts" / "data"
        stalled = data / "c000000000000" / segment_file_name(1, 9, 0)  # written long after checkpoint 1
        legacy = data / segment_file_name(2, 9, 0)  # where an older version kept segments
        for orphan in (stalled, legacy):
            orphan.write_bytes(b"x")
        swept = table.sweep(spark=spark)
        assert not stalled.exists() and not legacy.exists()
        assert swept.deleted >= 2 and swept.directories >= 1 and swept.listed >= 1
        assert swept.processes and os.getpid() not in swept.processes
        assert state(table) == counts(batches)


def test_a_stream_on_a_cluster_compacts_with_spark_jobs_of_its_own_session(spark, tmp_path):
    """``runs_on="spark"`` (what ``auto`` picks on a master that is not local): the stream's
    compactions run as Spark jobs of its session, in its Python workers, between and beside
    its batches; the state stays exact."""
    from catalog.compaction import CompactionPolicy
    from spark_integration.compaction_jobs import SparkCompactor, bounded, runs_on

    assert runs_on(CompactionPolicy(), "spark://127.0.0.1:7077") == "spark"
    assert runs_on(CompactionPolicy(), "local[2]") == "process"
    assert runs_on(CompactionPolicy(runs_on="spark"), "local[2]") == "spark"
    # a round leaves the stream three quarters of the task slots, unless the policy says otherwise
    assert [bounded(CompactionPolicy(), slots).max_units for slots in (1, 2, 8, 64)] == [1, 1, 2, 16]
    assert bounded(CompactionPolicy(max_units=5), 64).max_units == 5
    batches = key_batches(8, 40, 31)
    input_dir, cp = tmp_path / "in", str(tmp_path / "cp")
    location = StateLocation(table="counts", warehouse=str(tmp_path / "wh"), parallelism=2, max_parallelism=16)
    write_batches(input_dir, batches)
    policy = CompactionPolicy(min_segments=2, runs_on="spark", max_units=1)
    runner = run_to_end(spark, str(input_dir), CountProcessor(), "key string, count long", location=location,
                        checkpoint=cp, compaction=policy)
    compactor = runner.compactor
    assert isinstance(compactor, SparkCompactor) and compactor.results, compactor.results
    assert all(r["processes"] and os.getpid() not in r["processes"] for r in compactor.results)
    assert all(r["files_in"] > r["files_out"] and r["units"] == 1 for r in compactor.results)  # max_units
    with IcebergStateTable.open_existing(warehouse=location.warehouse, table_name="counts") as table:
        assert state(table) == counts(batches)
