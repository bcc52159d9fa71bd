"""Smoke test of the benchmarks, so that a change that breaks one fails CI rather than the next
benchmark run: every module of ``benchmarks`` imports, and ``bench_store`` runs end to end
through its command line at tiny sizes (no Spark), writing its JSON and plot to a temporary
folder, never over the recorded results.
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


def test_bench_store_runs_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("rocksdict")
    pytest.importorskip("matplotlib")
    from benchmarks import bench_store

    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    app = typer.Typer()
    app.command()(bench_store.main)
    # many >= 15: the commit-growth figure takes the median of checkpoints 5-15.
    args = ["--big", "2000", "--small", "500", "--lookup", "1000", "--delta", "100", "--many", "16", "--repeat", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "bench_store.json").read_text())
    assert results["lookup"]["state_keys"] == 2000
    assert results["checkpoint_restore"]["big"]["delta_keys"] == 100
    assert len(results["commit_growth"]["commit_s_all"]) == 16
    assert (tmp_path / "bench_store.png").stat().st_size > 0
