"""A driver killed with SIGKILL in the middle of a batch, then restarted on the same
checkpoint location, ends with exactly the state and outputs of an uninterrupted run.

Each driver is a subprocess (``cluster_driver.py``, ``local[2]``, its own SparkSession)
running a ``StatefulProcessor`` with a count and a list state (an append applied twice
shows as a duplicate element) over ``FILES`` Parquet files, one per batch, with an
Iceberg output table. Scenarios:

* ``ICESTATE_KILL_AT=<step>:1`` for every step of ``KILL_STEPS``: the driver kills itself
  after batch 1's tasks are done, after its outputs are committed, after its state is
  committed;
* an external ``os.kill(pid, SIGKILL)`` at a random moment after batch 1 started
  (``ICESTATE_KILL_SEED`` replays a moment).

To keep the module short, the killed drivers run side by side, and one more driver
process then restarts every killed query on its own checkpoint location and warehouse,
one after the other, after running the uninterrupted reference query: a restart is a new
driver process that has only Spark's checkpoint and the Iceberg tables to go on, which
is what a restart of that query alone would have.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from statestore.faults import FAIL_FIRST_ATTEMPT_ENV, KILL_ENV, KILL_STEPS
from tests.integration.process_helpers import stop_session, tail

pytestmark = [
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(sys.platform != "linux", reason="finds a killed driver's leftover processes in /proc"),
]

DRIVER = Path(__file__).with_name("cluster_driver.py")
FILES = 3
ROWS_PER_FILE = 200
KEYS = 29
KILL_BATCH = 1
EXTERNAL = "external"
SCENARIOS = (*KILL_STEPS, EXTERNAL)
RUN_TIMEOUT_S = 420
SEED_ENV = "ICESTATE_KILL_SEED"

SPARK_CONF = {
    "spark.driver.memory": "512m",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.catalogImplementation": "in-memory",
    "spark.sql.shuffle.partitions": 2,
    "spark.default.parallelism": 2,
}


@dataclass
class Run:
    name: str
    root: Path
    returncode: int | None = None
    note: str = ""

    @property
    def warehouse(self) -> Path:
        return self.root / "warehouse"

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def log(self) -> Path:
        return self.root / "driver.log"


def _query(name: str, run: Run, label: str) -> dict:
    return {"name": name, "label": label, "processor": "count_list", "parallelism": 2, "max_parallelism": 8,
            "warehouse": str(run.warehouse), "checkpoint": str(run.checkpoint)}


def _start(run: Run, config: dict, env: dict[str, str]) -> subprocess.Popen:
    run.root.mkdir(parents=True, exist_ok=True)
    path = run.root / "config.json"
    path.write_text(json.dumps(config))
    with open(run.log, "ab") as out:
        return subprocess.Popen([sys.executable, str(DRIVER), str(path)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _write_input(directory: Path) -> list[pa.Table]:
    """FILES Parquet files, distinct modification times (Spark's order), a unique ``v`` per row."""
    directory.mkdir()
    tables = []
    for b in range(FILES):
        ids = list(range(b * ROWS_PER_FILE, (b + 1) * ROWS_PER_FILE))
        table = pa.table({"key": [f"k{(i * 7 + b) % KEYS}" for i in ids], "v": pa.array(ids, pa.int64())})
        path = directory / f"part-{b}.parquet"
        pq.write_table(table, path)
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))
        tables.append(table)
    return tables


def _mid_state(run: Run) -> dict:
    """What the killed driver left: the state table's batch and the output table's batches."""
    from catalog.defaults import default_catalog
    from catalog.iceberg_table import IcebergStateTable
    from statestore.stored_keys import OUTPUT_BATCH_ID

    with IcebergStateTable.open_existing(warehouse=str(run.warehouse), table_name="t_q") as table:
        info = table.current_checkpoint()
        state_batch = info.batch_id if info else None
    catalog = default_catalog(str(run.warehouse))
    try:
        snapshots = catalog.load_table("out.q").snapshots()
        output_batches = [int(s.summary.additional_properties[OUTPUT_BATCH_ID]) for s in snapshots
                          if s.summary and OUTPUT_BATCH_ID in s.summary.additional_properties]
    finally:
        catalog.close()
    return {"state_batch": state_batch, "output_batches": output_batches,
            "offsets": sorted(int(p.name) for p in (run.checkpoint / "offsets").glob("[0-9]*")),
            "commits": sorted(int(p.name) for p in (run.checkpoint / "commits").glob("[0-9]*"))}


@dataclass
class Outcome:
    killed: dict[str, Run]
    mid: dict[str, dict]
    result: dict  # the restarting driver's result: "reference" and one entry per scenario
    tables: list[pa.Table]
    seed: int


def _kill_env_run(run: Run, config: dict, env: dict[str, str], step: str) -> None:
    proc = _start(run, config, {**env, KILL_ENV: f"{step}:{KILL_BATCH}"})
    try:
        run.returncode = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        stop_session(proc)


def _external_kill_run(run: Run, config: dict, env: dict[str, str], rng: random.Random) -> None:
    proc = _start(run, config, env)
    started = run.checkpoint / "offsets" / str(KILL_BATCH)  # Spark logs a batch's offsets before running it
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        delay = rng.uniform(0.0, 1.0)
        time.sleep(delay)
        progress = run.root / "progress"
        run.note = f"killed {delay:.2f} s after batch {KILL_BATCH} started; committed outputs before: " + (
            progress.read_text().replace("\n", ", ") if progress.exists() else "none")
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        run.returncode = proc.wait(timeout=60)
    finally:
        stop_session(proc)


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("the driver subprocesses need Java (java on PATH or JAVA_HOME)")
    root = tmp_path_factory.mktemp("driver-kill")
    tables = _write_input(root / "input")
    seed = int(os.environ.get(SEED_ENV, time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1"}
    for name in (KILL_ENV, FAIL_FIRST_ATTEMPT_ENV):  # fault injection only where a scenario asks for it
        env.pop(name, None)

    def config(run: Run, queries: list[dict], **extra) -> dict:
        return {"master": "local[2]", "app_name": f"icestate-driver-kill-{run.name}", "conf": SPARK_CONF,
                "input": str(root / "input"), "result": str(run.root / "result.json"), "queries": queries,
                **extra}

    # 1. every killed driver, side by side
    killed = {name: Run(name, root / name) for name in SCENARIOS}
    jobs: list[Callable[[], None]] = []
    for step in KILL_STEPS:
        run = killed[step]
        jobs.append(lambda run=run, step=step: _kill_env_run(
            run, config(run, [_query("q", run, step)]), env, step))
    ext = killed[EXTERNAL]
    jobs.append(lambda: _external_kill_run(
        ext, config(ext, [_query("q", ext, EXTERNAL)], progress=str(ext.root / "progress")), env, rng))
    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()
    mid = {}
    for name, run in killed.items():
        try:
            mid[name] = _mid_state(run)
        except Exception as e:  # reported by that scenario's test, with its driver's log
            mid[name] = {"error": repr(e), "state_batch": None, "output_batches": [], "offsets": [], "commits": []}

    # 2. the reference, then every killed query restarted on its checkpoint and warehouse
    restart = Run("restart", root / "restart")
    reference = Run("reference", root / "reference")
    queries = [_query("q", reference, "reference")] + [_query("q", run, name) for name, run in killed.items()]
    proc = _start(restart, config(restart, queries), env)
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        stop_session(proc)
    assert rc == 0, f"the restarting driver exited with {rc}\n{tail(restart.log)}"
    result = json.loads((restart.root / "result.json").read_text())
    return Outcome(killed, mid, result, tables, seed)


def _expected(tables: list[pa.Table]) -> tuple[dict[str, int], dict[str, list[int]], list[tuple[str, int, int]]]:
    counts: collections.Counter[str] = collections.Counter()
    items: dict[str, list[int]] = collections.defaultdict(list)
    rows = []
    for table in tables:
        for key, v in zip(table["key"].to_pylist(), table["v"].to_pylist(), strict=True):
            counts[key] += 1
            items[key].append(v)
        rows += [(k, counts[k], counts[k]) for k in set(table["key"].to_pylist())]
    return dict(counts), {k: sorted(v) for k, v in items.items()}, sorted(rows)


def test_reference_run(outcome: Outcome) -> None:
    """The uninterrupted run holds exactly the input: one count, list element and output row each."""
    ref = outcome.result["queries"]["reference"]
    counts, items, rows = _expected(outcome.tables)
    assert [(r["batch_id"], r["skipped"]) for r in ref["reports"]] == [(b, False) for b in range(FILES)]
    state = ref["state"]
    assert [b for _, b in state["checkpoints"]] == list(range(FILES))
    assert {r["key"]: r["v_count"]["count"] for r in state["variables"]["count"]} == counts
    got_items = collections.defaultdict(list)
    for r in state["variables"]["items"]:
        got_items[r["key"]].append(r["v_items"]["v"])
    assert {k: sorted(v) for k, v in got_items.items()} == items
    assert ref["output"]["batches"] == list(range(FILES))
    assert sorted((r["key"], r["count"], r["items"]) for r in ref["output"]["rows"]) == rows


# Where each step leaves the tables: (state table's batch, output table's batches).
LEFT_BY_STEP = {
    "tasks_done": (KILL_BATCH - 1, list(range(KILL_BATCH))),
    "outputs_committed": (KILL_BATCH - 1, list(range(KILL_BATCH + 1))),
    "state_committed": (KILL_BATCH, list(range(KILL_BATCH + 1))),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_restart_after_sigkill_matches_reference(outcome: Outcome, scenario: str) -> None:
    run = outcome.killed[scenario]
    mid = outcome.mid[scenario]
    context = f"{scenario} (seed {outcome.seed}, {run.note}): left {mid}"
    assert run.returncode == -signal.SIGKILL, f"{context}: the driver exited with {run.returncode}\n{tail(run.log)}"
    assert "error" not in mid, f"{context}\n{tail(run.log)}"
    if scenario in LEFT_BY_STEP:
        # killed where it was asked: batch KILL_BATCH started, Spark never committed it
        assert (mid["offsets"], mid["commits"]) == (list(range(KILL_BATCH + 1)), list(range(KILL_BATCH))), context
        assert (mid["state_batch"], mid["output_batches"]) == LEFT_BY_STEP[scenario], context
    else:
        assert KILL_BATCH in mid["offsets"], context

    ref = outcome.result["queries"]["reference"]
    got = outcome.result["queries"][scenario]
    # exactly the reference's state (a count and a list per key) and output rows
    assert got["state"]["variables"] == ref["state"]["variables"], context
    assert got["output"]["batches"] == list(range(FILES)), context  # no batch twice
    assert got["output"]["rows"] == ref["output"]["rows"], context
    assert got["state"]["batch_id"] == FILES - 1, context
    assert [b for _, b in got["state"]["checkpoints"]] == list(range(FILES)), context
    # The restart replays the batch Spark did not commit (skipped when its state was
    # committed), then plans the rest.
    first = max(mid["commits"], default=-1) + 1
    state_batch = -1 if mid["state_batch"] is None else mid["state_batch"]
    replayed = [(r["batch_id"], r["skipped"]) for r in got["reports"]]
    assert replayed == [(b, b <= state_batch) for b in range(first, FILES)], context
