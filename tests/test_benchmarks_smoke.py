"""Smoke test of the benchmarks, so that a change that breaks one fails CI rather than the next
benchmark run: every module of ``benchmarks`` imports, and ``remote_storage``, ``bench_restart_reads``
(moto's S3 server and our proxy, started by the run), ``bench_inspect`` and ``bench_host_views_store`` run end to end
through their command lines at tiny sizes (no Spark), as does the whole suite
(``benchmarks.suite``) in its tiny mode, writing their JSON and plots to a temporary folder,
never over the recorded results.
"""

from __future__ import annotations

import importlib
import json
import pkgutil

import pytest
import typer
from typer.testing import CliRunner

import benchmarks
from benchmarks import harness

MODULES = sorted(m.name for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks."))


def test_the_package_lists_every_benchmark():
    assert {"benchmarks.bench_store", "benchmarks.bench_spark", "benchmarks.bench_spark_cpu",
            "benchmarks.streaming.worker"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)


def test_remote_storage_runs_end_to_end(tmp_path, monkeypatch):
    """The remote-storage benchmark at its ``--quick`` sizes: moto's server and the proxy start
    and stop inside the run, every variant is measured and the proxy's counts are recorded."""
    pytest.importorskip("matplotlib")
    from benchmarks import remote_storage
    from tests import s3_server

    if not s3_server.available():
        pytest.skip("moto_server not installed (test extras)")
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    app = typer.Typer()
    app.command()(remote_storage.main)
    result = CliRunner().invoke(app, ["--quick"])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "remote_storage_quick.json").read_text())
    variants = results["variants"]
    assert list(variants) == ["local", "s3 0 ms", "s3 5 ms"]
    assert variants["local"]["commit"]["flush_requests"] == {}
    s3 = variants["s3 5 ms"]
    assert s3["commit"]["flush_requests"] and s3["cold"]["first_lookup_requests"]
    assert s3["throughput"]["warm"]["requests"] == {}  # warm caches: no round trip
    assert s3["cold"]["first_lookup_patterns"]
    assert (tmp_path / "remote_storage_quick.png").stat().st_size > 0


def test_bench_restart_reads_runs_end_to_end(tmp_path, monkeypatch):
    """The restart benchmark at its ``--quick`` sizes: both variants and the empty state run
    locally and on S3, and the partial variant really reads partially."""
    pytest.importorskip("matplotlib")
    from benchmarks import bench_restart_reads
    from tests import s3_server

    if not s3_server.available():
        pytest.skip("moto_server not installed (test extras)")
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    app = typer.Typer()
    app.command()(bench_restart_reads.main)
    result = CliRunner().invoke(app, ["--quick"])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "bench_restart_reads_quick.json").read_text())
    for where in ("local", "s3"):
        variants = results[where]["variants"]
        assert list(variants) == ["partial", "whole"]
        assert len(results[where]["empty"]["batches"]) == 3
    local = results["local"]["variants"]
    assert local["partial"]["batches"][0]["cache_partial_reads"] > 0
    assert local["whole"]["batches"][0]["cache_partial_reads"] == 0
    # a few keys per key group: the partial views hold those keys, the whole ones every key
    assert local["partial"]["few_keys"]["cache_size_bytes"] * 10 < local["whole"]["few_keys"]["cache_size_bytes"]
    assert (tmp_path / "bench_restart_reads_quick.png").stat().st_size > 0


def test_bench_inspect_runs_end_to_end(tmp_path, monkeypatch):
    """The inspection benchmark at tiny sizes without Spark: every measure of ours runs and reads
    what the input implies, with about one segment per unit per checkpoint; those of
    ``catalog.inspection`` are measured or recorded as not available, never missing."""
    pytest.importorskip("matplotlib")
    from benchmarks import bench_inspect

    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    app = typer.Typer()
    app.command()(bench_inspect.main)
    args = ["--keys", "2000", "--checkpoints", "4", "--repeat", "1", "--skip-spark"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "bench_inspect.json").read_text())
    assert results["config"]["keys"] == 2000 and results["spark"]["status"] == "skipped"
    assert results["ours"]["build"]["segments_per_unit"] == [4] * results["ours"]["build"]["units"]
    measures = results["ours"]["measures"]
    for name in ("views_all", "views_all_warm", "views_key", "views_key_warm", "views_history",
                 "views_history_warm", "store_all", "store_all_warm", "store_all_scan", "store_key",
                 "store_key_warm"):
        assert measures[name]["status"] == "ok" and measures[name]["ok"], (name, measures[name])
        assert measures[name]["best_s"] > 0
    assert measures["views_all"]["rows"] == 2000 and measures["views_history"]["rows"] == 4
    for name in ("inspection_all", "inspection_key", "inspection_history_batches"):
        assert measures[name]["status"] in ("ok", bench_inspect.NOT_AVAILABLE), (name, measures[name])
        assert measures[name]["status"] != "ok" or measures[name]["ok"], (name, measures[name])
    assert [r["row"] for r in results["rows"]][:2] == ["all", "all_warm"]
    assert (tmp_path / "bench_inspect.png").stat().st_size > 0


def test_bench_host_views_store_runs_end_to_end(tmp_path, monkeypatch):
    """The store-level price of the host's shared views at tiny sizes: without them nothing is
    written or mapped; with them a moved store maps every key group of its task, and views
    written 2 checkpoints behind are written more often than 4 behind."""
    from benchmarks import bench_host_views_store

    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    app = typer.Typer()
    app.command()(bench_host_views_store.main)
    args = ["--keys", "40000", "--checkpoints", "5", "--updates", "2000", "--lag-other", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    off, lag2, lag4 = json.loads((tmp_path / "bench_host_views_store.json").read_text())["runs"]
    assert (off["views_written"], off["moved_views_mapped"]) == (0, 0)
    assert (lag2["lag"], lag4["lag"]) == (2, 4)
    assert lag2["moved_views_mapped"] == lag4["moved_views_mapped"] == harness.MAX_PARALLELISM // 2
    assert lag2["views_written"] > lag4["views_written"] >= harness.MAX_PARALLELISM // 2
    assert all(r["steady_total_s"] > 0 and len(r["checkpoints"]) == 5 for r in (off, lag2, lag4))


@pytest.mark.spark  # real Spark, one driver process per job
@pytest.mark.slow
def test_the_suite_runs_every_step_end_to_end_in_tiny_mode(tmp_path):
    """``python -m benchmarks.suite --mode tiny``: every benchmark of the suite at its smallest
    sizes, each in a process of its own with its results in the suite's folder (real Spark, one
    process per job): the streaming throughput of ours against Spark's stateless floor, the
    scaling scenario (build, restarts, Spark's offline repartition and our rescale,
    every step's output checked against the input), the cache scenario, the store, rescale and
    compaction benchmarks, the Spark-API processors against state size, async processors
    against the synchronous runner on S3; then the headline
    table, its Markdown and its plot from their results."""
    pytest.importorskip("matplotlib")
    from benchmarks import suite

    app = typer.Typer()
    app.command()(suite.main)
    result = CliRunner().invoke(app, ["--mode", "tiny", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(step["ok"] for step in summary["steps"].values()), summary["steps"]
    assert set(summary["steps"]) == {s.name for s in suite.STEPS}
    rows = {r["measure"]: r for r in summary["headline"]}
    for measure in ("vectorized processor: events/s steady / stateless floor",
                    "store: warm batched lookup / polars left join",
                    "cache 0.1x of the state (3,000 keys): steady events/s / cache 1x",
                    "state 0.003M keys: rescale 4 -> 8 to its first batch, largest / smallest",
                    "restart, small first batch at 3,000 keys, query start to first batch end / RocksDB's",
                    "state on disk at 3,000 keys / Spark's RocksDB checkpoint",
                    "rescale 4 -> 8 (metadata), big / small state",
                    "checkpoint p99 with the compactor / without",
                    "Spark-API processor, list state: a batch at 10,000 / 2,000 state keys",
                    "tiny query in a fresh driver: start call to first trigger / Spark groupBy().count()",
                    "tiny query in a fresh driver: start call to its end / Spark transformWithState",
                    "async processor on S3: events/s / the synchronous runner on S3",
                    "async processor, fully cached: CPU per event / the synchronous runner's"):
        assert rows[measure]["value"] > 0, rows[measure]
    # The store step (bench_store at its tiny sizes; many >= 15: the commit-growth figure takes the
    # median of checkpoints 5-15).
    store = json.loads((tmp_path / "bench_store.json").read_text())
    assert store["lookup"]["state_keys"] == 2000
    assert store["checkpoint_restore"]["big"]["delta_keys"] == 100
    assert len(store["commit_growth"]["commit_s_all"]) == 16
    runs = json.loads((tmp_path / "bench_async.json").read_text())["runs"]
    assert set(runs) == {f"{where}, {runner}" for where in ("local cached", "local small cache", "s3 small cache")
                         for runner in ("sync", "async")}
    assert all(len(r["batches"]) == 2 and r["events_per_s"] > 0 for r in runs.values())
    assert runs["s3 small cache, async"]["requests_per_batch"] > 0  # it went through the proxy
    spark = json.loads((tmp_path / "spark.json").read_text())
    ours = next(r for r in spark["throughput"] if r["impl"] == "ours-vectorized")
    assert ours["status"] == "ok" and len(ours["ours_batches"]) == ours["batches"] == 3
    assert all(b["task_pids"] and b["tasks_ms"] > 0 for b in ours["ours_batches"])
    for impl, by_size in spark["scaling"]["figures"].items():
        figures = by_size["3000"]
        assert figures["verified"], (impl, figures)
        assert figures["storage_bytes"] > 0 and figures["checkpoint_ms"] > 0, (impl, figures)
    assert {"rocksdb", "1x", "0.1x"} == set(spark["cache"]["runs"])
    assert all(run["verified"]["ok"] for run in spark["cache"]["runs"].values())
    assert spark["cache"]["state_view_bytes"] > 0
    processors = json.loads((tmp_path / "bench_processors.json").read_text())
    assert {(r["kind"], r["state_keys"]) for r in processors["runs"]} == {
        (k, n) for k in ("value", "list", "map", "vectorized") for n in (2000, 10000)}
    start = json.loads((tmp_path / "bench_start.json").read_text())
    assert {impl: len(runs) for impl, runs in start["runs"].items()} == {
        "spark-count-rocksdb": 1, "spark-tws-rows": 1, "ours-compat": 1}
    assert all(r["batches"] >= 1 and 0 < r["start_to_first_trigger_s"] < r["start_to_end_s"]
               for runs in start["runs"].values() for r in runs)
    for name in ("headline.png", "spark.png", "spark_state.png", "bench_store.png", "bench_processors.png",
                 "bench_start.png", "bench_async.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "| store: warm batched lookup / polars left join |" in (tmp_path / "summary.md").read_text()


def test_the_soak_refuses_a_workdir_holding_an_earlier_run(tmp_path):
    """A soak restarted on an earlier run's checkpoint would measure a query that starts with that
    run's state: it refuses the folder before starting anything, and names it."""
    from benchmarks import soak

    work = tmp_path / "work"
    (work / "checkpoint").mkdir(parents=True)
    app = typer.Typer()
    app.command()(soak.main)
    result = CliRunner().invoke(app, ["--minutes", "1", "--workdir", str(work), "--results-dir", str(tmp_path / "r")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "is not empty" in result.output and "--workdir" in result.output
    assert sorted(p.name for p in work.iterdir()) == ["checkpoint"] and not (tmp_path / "r").exists()
