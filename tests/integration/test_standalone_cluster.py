"""A stateful query on a real Spark standalone cluster: one master and two workers on 127.0.0.1.

The master and the workers are separate JVMs started with the installed pyspark's
``bin/spark-class``; each worker offers one core, so the application gets one executor per
worker. The driver is another process (``cluster_driver.py``: this pytest process may
already hold a SparkContext, and a process holds at most one). Tasks therefore run in
Python workers of two executor JVMs that share nothing with the driver but the warehouse
directory: plans, processors and state locations travel inside the tasks, state is read
and written from the executors, and only metadata comes back to the driver.

Checked: the final per-key counts and the exact output rows of a ``StatefulProcessor``
and of ``RunningAggregate("count")``, that tasks ran in several Python workers under both
executors (not in the driver), and that this process reads the state afterwards.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.process_helpers import stop_session, tail
from tests.spark_cluster import Cluster, standalone_cluster

pytestmark = [
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="starts Spark's bash launchers, reads /proc"),
]

DRIVER = Path(__file__).with_name("cluster_driver.py")
WORKERS = 2
FILES = 3
ROWS_PER_FILE = 300
KEYS = 37
PARALLELISM = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("a standalone cluster needs Java (java on PATH or JAVA_HOME)")
    with standalone_cluster(tmp_path_factory.mktemp("standalone"), WORKERS) as c:
        yield c


def _write_input(directory: Path, files: range = range(FILES)) -> list[list[str]]:
    """Parquet files with distinct modification times (the order Spark reads them)."""
    directory.mkdir()
    batches = []
    for b in files:
        ids = range(b * ROWS_PER_FILE, (b + 1) * ROWS_PER_FILE)
        keys = [f"k{(i * 7 + b) % KEYS}" for i in ids]
        path = directory / f"part-{b}.parquet"
        pq.write_table(pa.table({"key": keys, "v": pa.array(list(ids), pa.int64())}), path)
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))
        batches.append(keys)
    return batches


def _expected_outputs(batches: list[list[str]]) -> tuple[dict[str, int], list[tuple[str, int]]]:
    totals: collections.Counter[str] = collections.Counter()
    rows = []
    for keys in batches:
        totals.update(keys)
        rows += [(k, totals[k]) for k in set(keys)]
    return dict(totals), sorted(rows)


def _count_of(value) -> int:
    return value["count"] if isinstance(value, dict) else value


SPARK_CONF = {
    "spark.executor.cores": 1,
    "spark.cores.max": WORKERS,
    "spark.executor.memory": "512m",
    "spark.driver.memory": "512m",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.catalogImplementation": "in-memory",
    "spark.sql.shuffle.partitions": PARALLELISM,
    # Spread the tasks: no coalescing of the shuffle, no waiting for a preferred executor.
    "spark.sql.adaptive.coalescePartitions.enabled": "false",
    "spark.locality.wait": "0",
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
}


def _run_driver(cluster: Cluster, config: dict, where: Path) -> None:
    """Run ``cluster_driver.py`` with ``config`` (its files in ``where``) to the end."""
    (where / "config.json").write_text(json.dumps(config))
    env = {**cluster.env, "SPARK_LOCAL_DIRS": str(where / "driver-local")}
    log = where / "driver.log"
    with open(log, "wb") as out:
        driver = subprocess.Popen([sys.executable, str(DRIVER), str(where / "config.json")], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        rc = driver.wait(timeout=480)
    finally:
        stop_session(driver, grace_s=15)
    assert rc == 0, f"driver exited with {rc}\n{tail(log, 8000)}\n{cluster.log_tails()}"


@pytest.mark.timeout(600)
def test_stateful_query_on_standalone_cluster(cluster: Cluster, tmp_path: Path) -> None:
    batches = _write_input(tmp_path / "input")
    totals, expected_rows = _expected_outputs(batches)
    warehouse = tmp_path / "warehouse"
    config = {
        "master": cluster.master_url,
        "app_name": "icestate-standalone-test",
        "conf": SPARK_CONF,
        "wait_executors": WORKERS,
        "input": str(tmp_path / "input"),
        "warehouse": str(warehouse),
        "checkpoint_root": str(tmp_path / "checkpoints"),
        "result": str(tmp_path / "result.json"),
        "queries": [
            {"name": "rows", "processor": "count", "parallelism": PARALLELISM, "max_parallelism": 16},
            {"name": "vec", "processor": "vec_count", "parallelism": PARALLELISM, "max_parallelism": 16},
        ],
    }
    _run_driver(cluster, config, tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    driver_pid = result["driver_pid"]

    executors_seen = set()
    for name, q in result["queries"].items():
        reports = q["reports"]
        assert [r["batch_id"] for r in reports] == list(range(FILES)), name
        assert not any(r["skipped"] for r in reports), name
        assert [sum(t["rows_in"] for t in r["tasks"].values()) for r in reports] == [ROWS_PER_FILE] * FILES, name

        # tasks ran in Python workers of both executors, one per worker, never in the driver
        pids = {t["pid"] for r in reports for t in r["tasks"].values()}
        assert len(pids) > 1, (name, pids)
        assert driver_pid not in pids, (name, driver_pid, pids)
        executors = [q["executors"][str(pid)] for pid in sorted(pids)]
        assert all(e is not None for e in executors), (name, q["executors"])
        assert len({e["worker_url"] for e in executors}) == WORKERS, (name, executors)
        assert len({e["executor_id"] for e in executors}) >= WORKERS, (name, executors)
        assert all(e["jvm_pid"] != driver_pid for e in executors), (name, executors)
        executors_seen |= {e["executor_id"] for e in executors}

        # the state (read back by the driver) and the exact output rows
        state = q["state"]
        assert state["checkpoint_id"] == FILES and state["batch_id"] == FILES - 1, (name, state)
        counts = {r["key"]: _count_of(r["v_count"]) for r in state["variables"]["count"]}
        assert counts == totals, name
        output = q["output"]
        assert output["batches"] == list(range(FILES)), name
        assert sorted((r["key"], r["count"]) for r in output["rows"]) == expected_rows, name
    assert len(executors_seen) >= WORKERS, executors_seen
    assert {a["id"] for a in cluster.state()["completedapps"]}, "the driver's application is not completed"

    # this process reads the state the executors wrote
    from catalog import sql
    from catalog.iceberg_table import IcebergStateTable

    for name in ("rows", "vec"):
        with IcebergStateTable.open_existing(warehouse=str(warehouse), table_name=f"t_{name}") as table:
            info = table.current_checkpoint()
            assert (info.checkpoint_id, info.batch_id, info.parallelism) == (FILES, FILES - 1, PARALLELISM)
            assert [c.checkpoint_id for c in table.list_checkpoints()][-FILES:] == list(range(1, FILES + 1))
            con = sql.connect(table)
            try:
                live = con.sql('SELECT * FROM "state_count"').to_arrow_table().to_pylist()
            finally:
                con.close()
        assert {r["key"]: _count_of(r["v_count"]) for r in live} == totals, name


@pytest.mark.timeout(900)
def test_executors_that_cannot_read_the_drivers_disk_run_a_query_on_s3_and_its_restart(
        cluster: Cluster, tmp_path: Path, s3_server_endpoint: str) -> None:
    """State and outputs on S3, the embedded SQLite catalog on the driver's disk where no
    executor can read it: tasks work from what the driver ships, the driver alone commits.
    Then the query restarts at another parallelism over two more input files."""
    from catalog import TableRef
    from tests import s3_server

    secret = f"planted-secret-{uuid.uuid4().hex}"  # moto takes any key: looked for everywhere afterwards
    bucket = "icestate-cluster"
    s3_server.create_bucket(s3_server_endpoint, bucket)
    driver_files = cluster.driver_only / tmp_path.name  # seen by the driver only
    driver_files.mkdir()
    more = FILES + 2
    batches = _write_input(tmp_path / "input")
    batches += _write_input(tmp_path / "later", range(FILES, more))
    properties = {"type": "sql", "uri": f"sqlite:///{driver_files}/catalog.db", "init_catalog_tables": "true",
                  "warehouse": f"s3://{bucket}/{tmp_path.name}", **s3_server.properties(s3_server_endpoint),
                  "s3.secret-access-key": secret}
    events = driver_files / "events"  # Spark's event log: what its UI and history server show
    events.mkdir()
    conf = {**SPARK_CONF, "spark.eventLog.enabled": "true", "spark.eventLog.dir": events.as_uri(),
            "spark.eventLog.compress": "false"}  # searchable as it is
    config = {
        "master": cluster.master_url, "app_name": "icestate-standalone-s3", "conf": conf,
        "wait_executors": WORKERS, "input": str(tmp_path / "input"),
        "catalog": {"name": "driver_sqlite", "properties": properties},
        "checkpoint_root": str(driver_files / "checkpoints"), "result": str(driver_files / "result.json"),
        "probe_hidden": str(driver_files / "config.json"),
        "queries": [
            {"name": "first", "table": "rows", "processor": "count", "parallelism": PARALLELISM},
            {"name": "restarted", "table": "rows", "processor": "count", "parallelism": 3,
             "add_files": [str(tmp_path / "later" / f"part-{b}.parquet") for b in range(FILES, more)]},
        ],
    }
    _run_driver(cluster, config, driver_files)
    result = json.loads((driver_files / "result.json").read_text())
    assert result["driver_sees_hidden"] is True
    assert result["executors_see_hidden"] and not any(result["executors_see_hidden"]), result["executors_see_hidden"]

    first, restarted = result["queries"]["first"], result["queries"]["restarted"]
    totals_first, rows_first = _expected_outputs(batches[:FILES])
    totals, expected_rows = _expected_outputs(batches)
    assert [r["batch_id"] for r in first["reports"]] == list(range(FILES))
    assert [r["batch_id"] for r in restarted["reports"]] == list(range(FILES, more))
    assert {len(r["tasks"]) for r in first["reports"]} == {PARALLELISM}
    assert {len(r["tasks"]) for r in restarted["reports"]} == {3}
    for q in (first, restarted):
        pids = {t["pid"] for r in q["reports"] for t in r["tasks"].values()}
        assert result["driver_pid"] not in pids
        assert all(q["executors"][str(pid)] is not None for pid in pids), q["executors"]
    assert {r["key"]: _count_of(r["v_count"]) for r in first["state"]["variables"]["count"]} == totals_first
    assert sorted((r["key"], r["count"]) for r in first["output"]["rows"]) == rows_first
    state = restarted["state"]
    assert (state["checkpoint_id"], state["batch_id"]) == (more, more - 1)
    assert {r["key"]: _count_of(r["v_count"]) for r in state["variables"]["count"]} == totals
    assert restarted["output"]["batches"] == list(range(more))
    assert sorted((r["key"], r["count"]) for r in restarted["output"]["rows"]) == expected_rows

    # The secret key is in no file the run left, but the config that handed it to the driver:
    # not in Spark's event log, the driver's log, the daemons' logs, the executors' stdout and
    # stderr, the Spark checkpoints or the catalog.
    event_log = b"".join(p.read_bytes() for p in events.rglob("*") if p.is_file())
    assert b"SparkListenerJobStart" in event_log and b"SparkListenerEnvironmentUpdate" in event_log
    left = [p for root in (driver_files, cluster.root) for p in root.rglob("*")
            if p.is_file() and p != driver_files / "config.json"]
    assert any(p.name == "stderr" for p in left)  # the executors' own output is among them
    assert [p for p in left if secret.encode() in p.read_bytes()] == []
    assert secret.encode() in (driver_files / "config.json").read_bytes()  # the search finds it where it is

    # Every segment is on S3, none on the driver's disk.
    with TableRef("t_rows", catalog_name="driver_sqlite", catalog_properties=properties).open() as table:
        assert table.location.startswith(f"s3://{bucket}/")
        assert table.current_checkpoint().parallelism == 3
    assert not list(driver_files.rglob("*.parquet"))


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(900)
def test_a_cluster_that_loses_executors_gives_every_output_once_and_the_uninterrupted_state(
        cluster: Cluster, tmp_path: Path, s3_server_endpoint: str, pg_uri: str) -> None:
    """State on the S3 server, the catalog on PostgreSQL. Mid-batch, a task SIGKILLs the executor
    JVM it runs under (the worker starts another), and in a later batch a task SIGKILLs its own
    Python worker; then a third worker joins and the query restarts at a higher parallelism.
    Every output row once, the state (a count and a list of every row: a batch applied twice
    shows) equal to an uninterrupted run's, and the stream's compactions ran as Spark tasks on
    the executors (their Python workers), never in the driver."""
    from tests import s3_server

    bucket, table = "icestate-executor-loss", f"loss_{uuid.uuid4().hex[:8]}"
    s3_server.create_bucket(s3_server_endpoint, bucket)
    first_files, more = 4, 6
    batches = _write_input(tmp_path / "input", range(first_files))
    batches += _write_input(tmp_path / "later", range(first_files, more))
    markers = tmp_path / "markers"
    markers.mkdir()
    catalog = {"name": "pg_cluster", "properties": {
        "type": "sql", "uri": pg_uri, "warehouse": f"s3://{bucket}/{tmp_path.name}",
        **s3_server.properties(s3_server_endpoint)}}
    faults = {"markers": str(markers), "rows_per_file": ROWS_PER_FILE, "kill_executor": 1, "kill_worker": 2}
    compaction = {"min_segments": 2, "runs_on": "spark", "max_units": 4}

    def run(label: str, executors: int, query: dict) -> dict:
        where = tmp_path / label
        where.mkdir()
        _run_driver(cluster, {
            "master": cluster.master_url, "app_name": f"icestate-{label}", "wait_executors": executors,
            "conf": {**SPARK_CONF, "spark.cores.max": executors}, "input": str(tmp_path / "input"),
            "catalog": catalog, "checkpoint_root": str(tmp_path / "checkpoints"), "result": str(where / "result.json"),
            "queries": [{"name": label, "table": table, "processor": "count_list", "compaction": compaction,
                         **query}]}, where)
        return json.loads((where / "result.json").read_text())

    first = run("first", WORKERS, {"parallelism": PARALLELISM, "faults": faults})
    killed_jvm, killed_worker = (json.loads((markers / kind).read_text()) for kind in ("kill_executor", "kill_worker"))
    assert not _alive(killed_jvm["pid"]) and not _alive(killed_worker["pid"])
    assert killed_worker["executor_id"] != killed_jvm["executor_id"]  # by then on another executor
    cluster.add_worker(WORKERS)  # a third worker joins; the query restarts on three executors
    cluster.wait_workers(WORKERS + 1)
    restarted = run("restarted", WORKERS + 1, {
        "parallelism": PARALLELISM + 2,
        "add_files": [str(tmp_path / "later" / f"part-{b}.parquet") for b in range(first_files, more)]})

    # Every batch once, each file's rows counted once, on executors only (the killed one among them).
    q1, q2 = first["queries"]["first"], restarted["queries"]["restarted"]
    assert [r["batch_id"] for r in q1["reports"]] == list(range(first_files))
    assert [r["batch_id"] for r in q2["reports"]] == list(range(first_files, more))
    for q, parallelism in ((q1, PARALLELISM), (q2, PARALLELISM + 2)):
        assert {len(r["tasks"]) for r in q["reports"]} == {parallelism}
        assert [sum(t["rows_in"] for t in r["tasks"].values()) for r in q["reports"]] == [ROWS_PER_FILE] * len(
            q["reports"])
    # The killed executor ran no task after its batch; the worker started another that did.
    after = [q1["executors"][str(t["pid"])] for r in q1["reports"][faults["kill_executor"] + 1:]
             for t in r["tasks"].values()]
    assert after and all(e is not None and e["executor_id"] != killed_jvm["executor_id"] for e in after), after
    assert {e["worker_url"] for e in after} >= {killed_jvm["worker_url"]}, after
    later = [q2["executors"][str(t["pid"])] for r in q2["reports"] for t in r["tasks"].values()]
    assert len({e["worker_url"] for e in later if e}) == WORKERS + 1  # the third worker took tasks

    # Exactly the outputs and the state of an uninterrupted run.
    totals, rows = _expected_outputs(batches)
    items: dict[str, list[int]] = collections.defaultdict(list)
    for b, keys in enumerate(batches):
        for i, k in enumerate(keys):
            items[k].append(b * ROWS_PER_FILE + i)
    state = q2["state"]
    assert (state["checkpoint_id"], state["batch_id"]) == (more, more - 1)
    assert {r["key"]: _count_of(r["v_count"]) for r in state["variables"]["count"]} == totals
    stored: dict[str, list[int]] = collections.defaultdict(list)
    for r in state["variables"]["items"]:
        stored[r["key"]].append(_count_of(r["v_items"]) if not isinstance(r["v_items"], dict) else r["v_items"]["v"])
    assert {k: sorted(v) for k, v in stored.items()} == {k: sorted(v) for k, v in items.items()}
    assert q2["output"]["batches"] == list(range(more))
    assert sorted((r["key"], r["count"], r["items"]) for r in q2["output"]["rows"]) == sorted(
        (k, n, n) for k, n in rows)

    # The stream compacted on the executors: each merge in a Python worker under an executor JVM.
    compactions = q1["compactions"] + q2["compactions"]
    assert compactions, "no compaction ran"
    for c in compactions:
        where = [{**q1["executors"], **q2["executors"]}.get(str(pid)) for pid in c["processes"]]
        assert where and all(e is not None for e in where), (c, where)
        driver_pids = {first["driver_pid"], restarted["driver_pid"]}
        assert not {e["jvm_pid"] for e in where} & driver_pids and not set(c["processes"]) & driver_pids
