"""Driver program of the subprocess integration tests (standalone cluster, driver kill).

Run as a script, never imported by pytest: ``python cluster_driver.py CONFIG.json``. It
starts its own SparkSession (a pytest process already holds one, and a process may hold
only one), runs one or more stateful queries over Parquet input files with
``maxFilesPerTrigger=1`` and an ``availableNow`` trigger, then writes a JSON result file:
per query the batch reports (with the Python worker pid of every task and, on a cluster,
the executor and worker that ran it), the final state read back from the state table
(``catalog.sql.connect``) and the rows of the Iceberg output table.

The processors are defined in this file, which runs as ``__main__``: cloudpickle ships
their classes by value, so executors need nothing from the driver's files.

Config keys:

* ``master``, ``app_name``, ``conf`` (extra Spark settings);
* ``input`` (directory of Parquet files ``key string, v long``);
* ``warehouse`` and ``checkpoint_root`` (default locations of the queries' state tables,
  output tables and Spark checkpoints), ``result`` (the JSON file written at the end);
* ``catalog``: instead of ``warehouse``, ``{"name", "properties"}`` of an Iceberg catalog
  (``TableRef``), for state and outputs on an object store;
* ``probe_hidden``: a path the driver sees; the result says whether the executors see it;
* ``queries``: a list of ``{"name", "processor", "parallelism", "max_parallelism"}`` with
  optionally their own ``warehouse``, ``checkpoint`` and ``label`` (key in the result);
  processor is ``count``, ``count_list`` (with ``faults``: see ``CountAndList``) or
  ``vec_count``; ``compaction``: a ``CompactionPolicy``'s arguments; the query named N keeps its
  state in table ``t_N`` and its output in ``out.N`` (``table`` overrides N, so that a
  later query restarts an earlier one, e.g. at another parallelism); ``add_files`` are
  moved into the input directory before the query starts;
* ``wait_executors``: executors to wait for before starting (on a cluster);
* ``progress``: a file that gets a line per batch whose outputs are committed.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

if __name__ == "__main__":  # a checkout that is not pip-installed: import from it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pyspark.sql import Row, SparkSession
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

INPUT_SCHEMA = "key string, v long"
COUNT_SCHEMA = "key string, count long"
COUNT_LIST_SCHEMA = "key string, count long, items long"


class Counter(StatefulProcessor):
    """Rows per key so far (a value state); emits the new count of every key it sees."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count long")

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        n = sum(1 for _ in rows)
        old = self.count.get()
        new = (old[0] if old else 0) + n
        self.count.update((new,))
        yield Row(key=key[0], count=new)

    def close(self) -> None:
        pass


class CountAndList(StatefulProcessor):
    """A count (value state) and every row's ``v`` (list state): a batch applied twice shows.

    With ``faults`` (``{"markers": dir, "rows_per_file": n, "kill_executor": file, "kill_worker":
    file}``), the first task to see a row of input file ``kill_executor`` SIGKILLs the executor JVM
    it runs under, mid-batch, and the first to see one of ``kill_worker`` its own Python worker;
    each once per run, as its marker file (created exclusively) in ``markers`` says, with the
    killed pid and the executor in it (JSON).
    """

    def __init__(self, faults: dict | None = None):
        self.faults = faults

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count long")
        self.items = handle.getListState("items", "v long")

    def _inject(self, values: list[tuple[int]]) -> None:
        files = {v // self.faults["rows_per_file"] for (v,) in values}
        for kind in ("kill_executor", "kill_worker"):
            if self.faults.get(kind) not in files:
                continue
            executor = _executor_of(os.getpid())
            if executor is None:
                raise RuntimeError("this Python worker runs under no executor JVM")
            victim = executor["jvm_pid"] if kind == "kill_executor" else os.getpid()
            try:
                fd = os.open(os.path.join(self.faults["markers"], kind), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue  # done once already
            os.write(fd, json.dumps({"pid": victim, **executor}).encode())
            os.close(fd)
            os.kill(victim, signal.SIGKILL)
            time.sleep(30)  # killed with the JVM, or by its own hand: never returns

    def handleInputRows(self, key, rows, timerValues) -> Iterator[Row]:
        values = [(int(r.v),) for r in rows]
        if self.faults:
            self._inject(values)
        old = self.count.get()
        new = (old[0] if old else 0) + len(values)
        self.count.update((new,))
        self.items.appendList(values)
        yield Row(key=key[0], count=new, items=sum(1 for _ in self.items.get()))

    def close(self) -> None:
        pass


def _processor(kind: str, faults: dict | None = None):
    from spark_integration import RunningAggregate

    if kind == "count":
        return Counter(), COUNT_SCHEMA
    if kind == "count_list":
        return CountAndList(faults), COUNT_LIST_SCHEMA
    if kind == "vec_count":
        return RunningAggregate("count"), None
    raise ValueError(f"unknown processor {kind!r}")


def _session(cfg: dict) -> SparkSession:
    builder = SparkSession.builder.master(cfg["master"]).appName(cfg.get("app_name", "icestate-subprocess-driver"))
    for key, value in cfg.get("conf", {}).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _wait_executors(spark: SparkSession, n: int, timeout_s: float = 120.0) -> None:
    # getExecutorMemoryStatus holds the driver's block manager too.
    deadline = time.monotonic() + timeout_s
    while spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < n + 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} executors registered after {timeout_s} s")
        time.sleep(0.2)


def _executor_of(pid: int) -> dict | None:
    """The executor JVM above a Python worker process: its executor id and worker URL (Linux)."""
    seen = 0
    while pid > 1 and seen < 8:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        args = [a.decode(errors="replace") for a in cmd]
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in args:
            named = dict(itertools.pairwise(args))
            return {"executor_id": named.get("--executor-id"), "worker_url": named.get("--worker-url"),
                    "jvm_pid": pid}
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # ppid: the field after the state
        seen += 1
    return None


def _executors_see(spark: SparkSession, path: str, executors: int) -> list[bool]:
    """Whether the Python workers of the executors see ``path`` (one answer per task)."""
    n = max(2, 2 * executors)
    return spark.sparkContext.parallelize(range(n), n).map(lambda _: os.path.exists(path)).collect()


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


def _state_dump(ref) -> dict:
    """Every state variable's live state, one sorted list of rows per variable (no ord/expiry)."""
    from catalog import sql

    with ref.open() as state:
        info = state.current_checkpoint()
        checkpoints = [(c.checkpoint_id, c.batch_id) for c in state.list_checkpoints()]
        con = sql.connect(state)
        try:
            out = {}
            for desc in state.layout.descriptors:
                rel = con.sql(f'SELECT * FROM "state_{desc.name}"').to_arrow_table()
                # Where each row came from depends on the run's checkpoints, not on the state.
                where = ("ord", "expire_at_ms", "checkpoint_id", "batch_id")
                rel = rel.drop_columns([c for c in where if c in rel.column_names])
                rows = [_plain(r) for r in rel.to_pylist()]
                out[desc.name] = sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))
        finally:
            con.close()
    return {"variables": out, "checkpoint_id": info.checkpoint_id if info else None,
            "batch_id": info.batch_id if info else None, "checkpoints": checkpoints}


def _output_dump(ref, identifier: str) -> dict:
    from statestore.stored_keys import OUTPUT_BATCH_ID

    cat = ref.catalog()
    try:
        table = cat.load_table(identifier)
        rows = table.scan().to_arrow().to_pylist()
        batches = []
        for snap in table.snapshots():
            props = snap.summary.additional_properties if snap.summary else {}
            if OUTPUT_BATCH_ID in props:
                batches.append(int(props[OUTPUT_BATCH_ID]))
    finally:
        cat.close()
    return {"rows": sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str)), "batches": batches}


def run_query(spark: SparkSession, df, cfg: dict, q: dict) -> dict:
    from spark_integration import StateLocation, runner_of, start_stateful_query

    name = q["name"]
    table = q.get("table", name)
    warehouse = q.get("warehouse", cfg.get("warehouse"))
    catalog = {} if warehouse else cfg["catalog"]
    checkpoint = q.get("checkpoint", os.path.join(cfg.get("checkpoint_root", ""), table))
    processor, schema = _processor(q["processor"], q.get("faults"))
    for path in q.get("add_files", []):
        os.replace(path, os.path.join(cfg["input"], os.path.basename(path)))
    location = StateLocation(table=f"t_{table}", warehouse=warehouse, catalog_name=catalog.get("name"),
                             catalog_properties=catalog.get("properties", {}),
                             max_parallelism=int(q.get("max_parallelism", 16)),
                             parallelism=int(q.get("parallelism", 2)))
    progress = cfg.get("progress")
    compaction = {}
    if "compaction" in q:  # a CompactionPolicy's arguments
        from catalog.compaction import CompactionPolicy

        compaction["compaction"] = CompactionPolicy(**q["compaction"])
    holder: dict = {}
    executors: dict[int, dict | None] = {}

    def resolve_pids() -> None:
        # Idle Python workers are reaped after a minute: resolve each pid soon after its batch.
        if "query" in holder:
            runner = runner_of(holder["query"])
            pids = [stats["pid"] for report in runner.reports for stats in report.tasks.values()]
            pids += [pid for c in getattr(runner.compactor, "results", []) for pid in c["processes"]]
            for pid in pids:
                if executors.get(pid) is None:
                    executors[pid] = _executor_of(pid)

    def note(batch_df, batch_id: int) -> None:
        # called after the batch's outputs are committed, before its state is
        resolve_pids()
        if progress:
            with open(progress, "a") as f:
                f.write(f"{name} {batch_id}\n")

    started = time.perf_counter()
    query = start_stateful_query(
        df, ["key"], processor, schema, location=location,
        checkpoint_location=checkpoint, trigger={"availableNow": True},
        output_table=f"out.{table}", foreach_batch=note, query_name=f"q_{name}", **compaction)
    holder["query"] = query
    query.awaitTermination()
    resolve_pids()
    elapsed = time.perf_counter() - started
    runner = runner_of(query)
    reports = [{"batch_id": r.batch_id, "skipped": r.skipped, "checkpoint_id": r.checkpoint_id,
                "output_rows": r.output_rows, "segments": r.segments, "duration_ms": round(r.duration_ms),
                "commit_ms": round(r.commit_ms),
                "tasks": {str(t): {"pid": s["pid"], "rows_in": s["rows_in"], "rows_out": s["rows_out"],
                                   "elapsed_ms": s["elapsed_ms"]}
                          for t, s in r.tasks.items()}} for r in runner.reports]
    compactor = runner.compactor
    runner.close()  # a compaction round under way finishes first
    compactions = list(getattr(compactor, "results", []))
    for pid in (pid for c in compactions for pid in c["processes"]):
        if executors.get(pid) is None:
            executors[pid] = _executor_of(pid)
    return {
        "compactions": compactions,
        "seconds": round(elapsed, 2), "reports": reports,
        "executors": {str(pid): info for pid, info in sorted(executors.items())},
        "state": _state_dump(location.ref),
        "output": _output_dump(location.ref, f"out.{table}"),
    }


def run(cfg: dict) -> dict:
    started = time.perf_counter()
    timings = {}
    spark = _session(cfg)
    timings["session"] = time.perf_counter() - started
    if cfg.get("wait_executors"):
        _wait_executors(spark, int(cfg["wait_executors"]))
        timings["executors"] = time.perf_counter() - started
    df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).parquet(cfg["input"])
    results: dict = {"driver_pid": os.getpid(), "queries": {}, "timings": timings}
    if cfg.get("probe_hidden"):
        results["driver_sees_hidden"] = os.path.exists(cfg["probe_hidden"])
        results["executors_see_hidden"] = _executors_see(spark, cfg["probe_hidden"], int(cfg.get("wait_executors", 1)))
    for q in cfg["queries"]:
        label = q.get("label", q["name"])
        results["queries"][label] = run_query(spark, df, cfg, q)
        timings[label] = time.perf_counter() - started
    spark.stop()
    timings["stopped"] = time.perf_counter() - started
    results["timings"] = {k: round(v, 2) for k, v in timings.items()}
    return results


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    # the executors' Python: this interpreter (before the JVM starts; workers inherit it)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    cfg = json.loads(Path(argv[1]).read_text())
    results = run(cfg)
    results["timings"]["total"] = round(time.perf_counter() - started, 2)
    Path(cfg["result"]).write_text(json.dumps(results, sort_keys=True, default=str))
    print("timings:", json.dumps(results["timings"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
