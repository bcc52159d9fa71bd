"""Fixtures of the integration tests: one real local Spark session shared by the test session.

Every test that uses the ``spark`` fixture is marked ``spark`` automatically, so
``pytest -m "not spark"`` skips them (and never starts a JVM).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest

# Small and quiet: no UI, few shuffle partitions, loopback networking (no hostname lookups).
SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.memory": "512m",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.catalogImplementation": "in-memory",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tryfirst: mark before the -m deselection (also a collection_modifyitems hook) runs.
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A local[2,2] SparkSession, started once and stopped at the end of the test session."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark tests need Java (java on PATH or JAVA_HOME)")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from statestore.faults import FAIL_FIRST_ATTEMPT_ENV

    # Python workers inherit the environment of the JVM: set before it starts. Tests create
    # the file to make every task's first attempt fail after its flush.
    os.environ[FAIL_FIRST_ATTEMPT_ENV] = str(tmp_path_factory.mktemp("faults") / "fail-first-attempt")
    # local[2,2]: two cores, and a failed task is retried once (as on a cluster).
    builder = SparkSession.builder.master("local[2,2]").appName("statestore-integration-tests")
    for key, value in SPARK_CONF.items():
        builder = builder.config(key, value)
    builder = builder.config("spark.sql.warehouse.dir", str(tmp_path_factory.mktemp("spark-warehouse")))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
