"""A class-data-sharing archive of the classes a Spark JVM of the tests loads, so that every JVM
the suite starts (shared sessions, drivers in subprocesses, the benchmarks' drivers, Connect
servers) maps them ready-made instead of loading, verifying and linking thousands of classes.

Measured on the 2-core machine (a fresh ``local[2]`` session, one aggregation, one Arrow UDF,
stop; the machine's CPU seconds): 16.1-16.9 s without the archive, 10.1 s with it; wall
14.6-15.3 -> 8.8-9.1 s. The suite starts some fifty JVMs.

The archive is a dynamic one (JDK 13+): one run of a small Spark workload with
``-XX:ArchiveClassesAtExit`` writes it, into the virtual environment beside the pyspark whose
jars it holds (``<sys.prefix>/icestate-test-classes.jsa``), with a stamp of the Java and pyspark
versions; a different JDK, pyspark or class path makes a JVM ignore it (``-Xshare:auto``, the
default) and run as without it, never fail. Only the tests use it (``tests/conftest.py``), never
a user's JVMs or the benchmarks' recorded runs.

    python -m tests.jvm_archive    # write it if missing or stale; prints where
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARCHIVE = Path(sys.prefix) / "icestate-test-classes.jsa"
STAMP = ARCHIVE.with_suffix(".json")
# Options of every test JVM (the C1 compiler alone and the serial collector: short-lived JVMs over
# small data then spend less of two cores compiling and collecting: Spark's semantics module
# 157 -> 133 s with C1; a session's CPU 17.9-18.2 -> 16.6-16.9 s with the serial collector).
BASE_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# A JVM that cannot use the archive (Spark's launcher has another class path) says so on its
# standard output; it runs on without it.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"

# The workload whose classes go in: what most tests do in a Spark JVM.
_WORKLOAD = r"""
import sys, tempfile
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[2]").appName("icestate-class-archive")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "2").getOrCreate())
with tempfile.TemporaryDirectory() as d:
    df = spark.range(2000).selectExpr("cast(id % 50 as string) as key", "id as v")
    df.write.parquet(f"{d}/in")
    df = spark.read.parquet(f"{d}/in")
    df.groupBy("key").count().collect()
    df.mapInArrow(lambda it: it, df.schema).count()
    df.groupBy("key").applyInPandas(lambda p: p, df.schema).count()
    stream = spark.readStream.schema(df.schema).parquet(f"{d}/in")
    q = (stream.writeStream.foreachBatch(lambda b, i: b.groupBy("key").count().collect())
         .option("checkpointLocation", f"{d}/cp").trigger(availableNow=True).start())
    q.awaitTermination()
    q = (stream.groupBy("key").count().writeStream.format("noop").outputMode("update")
         .option("checkpointLocation", f"{d}/cp2").trigger(availableNow=True).start())
    q.awaitTermination()
spark.stop()
"""


def _java_version() -> str | None:
    java = shutil.which("java") or (Path(os.environ["JAVA_HOME"]) / "bin" / "java"
                                    if os.environ.get("JAVA_HOME") else None)
    if java is None:
        return None
    try:
        done = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "JDK_JAVA_OPTIONS"})
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stderr.strip() if done.returncode == 0 else None


def _stamp() -> dict | None:
    java = _java_version()
    if java is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        pyspark = version("pyspark")
    except PackageNotFoundError:  # no pyspark: nothing to archive
        return None
    return {"java": java, "pyspark": pyspark, "options": BASE_OPTIONS}


def current() -> Path | None:
    """The archive, if it was written for this JDK and pyspark; else None."""
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return None
    return ARCHIVE if ARCHIVE.is_file() and stamp == _stamp() else None


def jvm_options() -> str:
    """The options of the tests' JVMs: the archive's when there is a current one."""
    archive = current()
    return f"{BASE_OPTIONS} -XX:SharedArchiveFile={archive} {QUIET}" if archive else BASE_OPTIONS


def ensure() -> Path | None:
    """Write the archive if it is missing or stale; returns it, or None when it cannot be made
    (no Java or pyspark: the tests that need Spark skip or fail on their own)."""
    if current() is not None:
        return ARCHIVE
    stamp = _stamp()
    if stamp is None:
        return None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="icestate-class-archive-") as work:
        scratch = Path(work) / "classes.jsa"
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
               "SPARK_LOCAL_IP": "127.0.0.1",
               "JDK_JAVA_OPTIONS": f"{BASE_OPTIONS} -XX:ArchiveClassesAtExit={scratch} {QUIET}"}
        try:
            done = subprocess.run([sys.executable, "-c", _WORKLOAD], env=env, capture_output=True, text=True,
                                  timeout=600, cwd=work)
        except subprocess.TimeoutExpired:
            print("tests.jvm_archive: the workload timed out; the tests run without the archive", file=sys.stderr)
            return None
        if done.returncode != 0 or not scratch.is_file():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            print(f"tests.jvm_archive: no archive (exit {done.returncode}); the tests run without it:\n{tail}",
                  file=sys.stderr)
            return None
        partial = ARCHIVE.with_suffix(".jsa.partial")
        shutil.move(scratch, partial)
        os.replace(partial, ARCHIVE)
    STAMP.write_text(json.dumps(stamp))
    print(f"tests.jvm_archive: wrote {ARCHIVE} ({ARCHIVE.stat().st_size / 2**20:.0f} MiB) in "
          f"{time.monotonic() - started:.0f} s")
    return ARCHIVE


if __name__ == "__main__":
    where = ensure()
    print(where if where is not None else "no archive (no Java or pyspark)")
