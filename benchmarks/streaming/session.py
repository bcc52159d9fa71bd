"""The SparkSession of one benchmark job, and the description of the machine it ran on.

Every job gets the same local[2] configuration, its own scratch folders, and the state store
provider its implementation asks for. pyspark is imported on first use, as a job runs in a
fresh process that builds exactly one session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import machine_info

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
PROVIDER_CONF = "spark.sql.streaming.stateStore.providerClass"
SPARK_CONF = {
    # Every batch of a run is measured: Spark's recent progress and our runner's batch reports
    # (which follow the same setting) keep them all.
    "spark.sql.streaming.numRecentProgressUpdates": "100000",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.catalogImplementation": "in-memory",
    # Spark keeps 100 versions of its state by default; ours keeps 10 checkpoints
    # (``catalog.iceberg_table.DEFAULT_RETAIN_CHECKPOINTS``): the same retention for both, so that
    # their state on disk is compared like for like.
    "spark.sql.streaming.minBatchesToRetain": "10",
}


# Extra Spark settings for every job of a run, as JSON (a configuration experiment, e.g.
# '{"spark.sql.execution.arrow.maxRecordsPerBatch": "100000"}'); recorded in the results.
EXTRA_CONF_ENV = "ICESTATE_BENCH_SPARK_CONF"


def extra_conf() -> dict[str, str]:
    return {k: str(v) for k, v in json.loads(os.environ.get(EXTRA_CONF_ENV) or "{}").items()}


def spark_session(job: dict, provider: str | None) -> Any:
    """A local[2] session for ``job`` (its ``impl``, ``driver_memory`` and ``scratch`` folder),
    with ``provider`` as the state store provider class (None leaves Spark's default) and the
    run's extra settings (``ICESTATE_BENCH_SPARK_CONF``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    conf = {**SPARK_CONF, "spark.driver.memory": job["driver_memory"],
            "spark.sql.warehouse.dir": str(Path(job["scratch"]) / "spark-warehouse"),
            "spark.local.dir": str(Path(job["scratch"]) / "spark-local")}
    if provider:
        conf[PROVIDER_CONF] = provider
    # A JVM that crashes writes its report in the job's scratch folder, not in the repository
    # (workers run from its root).
    conf["spark.driver.extraJavaOptions"] = f"-XX:ErrorFile={Path(job['scratch']) / 'hs_err_pid%p.log'}"
    conf.update(extra_conf())
    builder = SparkSession.builder.master("local[2]").appName(f"bench-spark-{job['impl']}")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def spark_machine_info() -> dict:
    """``harness.machine_info()`` plus the versions of pyspark and Java, the memory and the
    Spark configuration of every job."""
    import pyspark

    java = [line for line in subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()
            if not line.startswith("NOTE: Picked up")]  # JDK_JAVA_OPTIONS, when set, is announced first
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None)
    base = machine_info()
    return {"python": base["python"], "pyspark": pyspark.__version__, "java": java[0] if java else None,
            "cpus": base["cpus"], "mem_total_kib": int(mem) if mem else None, "platform": base["platform"],
            "spark_conf": {**SPARK_CONF, **extra_conf(), "master": "local[2]"}}
