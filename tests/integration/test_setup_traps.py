"""Setup traps, found as a query starts, not as an obscure failure of its first batch: Python
workers that run another interpreter than the driver (``PYSPARK_PYTHON`` unset, the usual trap
with a virtual environment) cannot import the library, and the query fails saying so (the
warm-up beside its start finds it; the stream does not wait for the warm-up).

The driver runs in a subprocess of its own: a worker interpreter is fixed when a
SparkContext starts, and the test session's workers are right.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from tests.integration.process_helpers import stop_session, tail

DRIVER = textwrap.dedent('''
    import sys
    from pyspark.sql import SparkSession
    from spark_integration import StateLocation, start_stateful_query
    from statestore.errors import WorkerEnvironmentError
    from tests.integration.streaming_helpers import CountProcessor

    work = sys.argv[1]
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .getOrCreate())
    df = spark.readStream.schema("key string, v long").parquet(work + "/in")
    query = start_stateful_query(df, ["key"], CountProcessor(), "key string, count long",
                                 location=StateLocation(table="t", warehouse=work + "/wh", parallelism=1),
                                 checkpoint_location=work + "/cp", compaction=None,
                                 time_mode=sys.argv[2])
    try:
        query.awaitTermination(180)
    except WorkerEnvironmentError as e:
        assert isinstance(query.exception(), WorkerEnvironmentError)
        print("REFUSED:", e)
        print("ACTIVE QUERIES:", len(spark.streams.active))  # the query was stopped
        sys.exit(0)
    print("RAN ON:", query.exception())
    sys.exit(3)
''')


@pytest.mark.spark  # a driver of its own, in a process of its own
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("slow", "time_mode"), [(False, "None"), (True, "ProcessingTime")],
                         ids=["fails-at-once", "fails-late-with-ticks"])
def test_workers_without_the_library_fail_the_query_with_what_to_do(tmp_path: Path, slow: bool, time_mode: str):
    """The query fails with what to do whether the workers fail at once or late (``slow``: each
    Python process of Spark's waits 3 s first, so the warm-up fails after the ticks source of a
    query with timers started its own processes); no query is left running."""
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # an interpreter without pyarrow, polars or icestate
    python = bare / "bin" / "python"
    if slow:
        python = bare / "bin" / "slow-python"
        python.write_text(f'#!/bin/sh\nsleep 3\nexec {bare / "bin" / "python"} "$@"\n')
        python.chmod(0o755)
    (tmp_path / "in").mkdir()
    log = tmp_path / "driver.log"
    env = {**os.environ, "PYSPARK_PYTHON": str(python), "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYTHONPATH": os.getcwd()}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), time_mode], stdout=out,
                                stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=240)
        finally:
            stop_session(proc)
    text = tail(log, 20000)
    assert code == 0, text
    refused = next(line for line in text.splitlines() if line.startswith("REFUSED:"))
    assert "Spark's Python workers cannot import icestate (ModuleNotFoundError: No module named" in refused
    assert str(python) in refused and f"Set PYSPARK_PYTHON={sys.executable}" in refused
    assert "ACTIVE QUERIES: 0" in text


def test_spark_python_workers_import_the_installed_pyspark(spark):
    """Spark puts pyspark's bundled zips (and its core jar) first on its Python processes'
    path; with ``icestate_pyspark_path.pth`` installed they import the installed, byte-compiled
    pyspark instead (0.7-0.9 s of CPU less per process start, docs/decisions.md)."""

    def where(_):
        import sys

        import pyspark

        yield pyspark.__file__, [p for p in sys.path if "pyspark" in p and p.endswith((".zip", ".jar"))]

    [(file, archives)] = spark.sparkContext.parallelize([0], 1).mapPartitions(where).collect()
    assert ".zip" not in file and archives == []
