"""Crash anywhere: a seeded SIGKILL harness around checkpoints, compaction and retention
(``store``) and around a running stateful Spark query (``spark``), each iteration checked
against an uninterrupted run.

``store`` (hundreds of iterations in minutes). Each iteration is a fresh warehouse and a
writer process (``child``) that runs ``BATCHES`` seeded batches of a value, a list and a map
state over a few hundred string keys at 1 to 4 tasks: per batch it writes, flushes every
task's store, commits the checkpoint (retention keeps 2 checkpoints, so every commit expires
one and deletes its files) and, every third batch, compacts the table through a second table
object as the compactor process does. The harness SIGKILLs the writer at a seeded moment of
its run (a seeded phase among those an uninterrupted run, measured first, goes through, then a
seeded part of a phase's mean time: paced by the writer, not the clock), then checks
what it left: the newest checkpoint opens in a fresh table object, holds the batch it says
and exactly the state a pure-Python model computes for that batch, and every file it
references exists. It then restarts the writer at another seeded parallelism (a rescale),
which resumes after the newest checkpoint's batch; after ``--kills`` kills the writer runs to
the end, and the final state must equal the model's (the uninterrupted run, which iteration
0 also runs for real and checks against the model). Last, "an hour later": every file's
modification time is set two hours back, a writer's garbage collection sweeps, and the
warehouse must hold exactly the files the table references: nothing a crash left behind
stays forever. The phase the writer was in when killed (from a line it appends per step)
is counted, so the figures show where the kills landed.

``spark`` (a few minutes per round): the driver program of the integration tests
(``tests/integration/cluster_driver.py``: a ``transformWithState`` processor with a count and
a list state, an Iceberg output table, one input file per batch) is SIGKILLed at a seeded
moment, ``--per-round`` drivers side by side; one more driver then runs the uninterrupted
reference (first round) and restarts every killed query on its own checkpoint and warehouse.
Every restarted query must end with the reference's state and output rows, every batch
committed to the output table once.

Results: ``crash_harness.json`` (and ``crash_harness_spark.json``) with the seed, counts,
kills per phase and every failure with the seed that replays it (``--seed S --only I``); a
plot of kills per phase. The exit status is 1 when any iteration failed. A test runs a few
store iterations (tests/test_crash_harness.py).

    python -m benchmarks.crash_harness store --iterations 200 --kills 2 --seed 1
    python -m benchmarks.crash_harness spark --rounds 3 --per-round 3 --seed 1
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0])

BATCHES = 12
KEYS = 240
MAX_PARALLELISM = 16
RETAIN = 2
COMPACT_EVERY = 3
PARALLELISMS = (1, 2, 3, 4)
CHILD_TIMEOUT_S = 300
# Phases the writer announces, in the order a batch passes them.
PHASES = ("open", "write", "flush", "commit", "compact", "done")  # done: closing the tables


# --- the workload and its model ----------------------------------------------------------------


def key(i: int) -> str:
    return f"key-{i:04d}"


def batch_ops(seed: int, batch: int) -> dict[str, Any]:
    """The writes of ``batch``: distinct keys within each operation, so order inside one is moot."""
    rng = random.Random(f"{seed}:{batch}")
    pick = lambda n: [key(i) for i in rng.sample(range(KEYS), n)]  # noqa: E731
    return {
        "v_put": [(k, batch * 1000 + j) for j, k in enumerate(pick(50))],
        "v_clear": pick(6),
        "l_add": [(k, batch) for k in pick(15)],
        "l_clear": pick(2),
        "m_put": [(k, f"u{rng.randrange(5)}", batch) for k in pick(12)],
        "m_remove": [(k, f"u{rng.randrange(5)}") for k in pick(4)],
    }


@dataclass
class Model:
    """The state an uninterrupted run holds after each batch."""

    v: dict[str, int] = field(default_factory=dict)
    l: dict[str, list[int]] = field(default_factory=dict)  # noqa: E741
    m: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def after(cls, seed: int, batch: int) -> Model:
        model = cls()
        for b in range(batch + 1):
            model.apply(batch_ops(seed, b))
        return model

    def apply(self, ops: dict[str, Any]) -> None:
        for k, value in ops["v_put"]:
            self.v[k] = value
        for k in ops["v_clear"]:
            self.v.pop(k, None)
        for k, value in ops["l_add"]:
            self.l.setdefault(k, []).append(value)
        for k in ops["l_clear"]:
            self.l.pop(k, None)
        for k, uk, value in ops["m_put"]:
            self.m.setdefault(k, {})[uk] = value
        for k, uk in ops["m_remove"]:
            if k in self.m:
                self.m[k].pop(uk, None)
                if not self.m[k]:
                    del self.m[k]


def layout() -> Any:
    import pyarrow as pa

    from statestore import ListStateDescriptor, MapStateDescriptor, StateLayout, ValueStateDescriptor

    return StateLayout.of(pa.schema([("k", pa.string())]), [
        ValueStateDescriptor("v", pa.int64()), ListStateDescriptor("l", pa.int64()),
        MapStateDescriptor("m", pa.int64(), key_type=pa.string())], MAX_PARALLELISM)


def read_state(warehouse: str) -> tuple[int, Model, list[int]]:
    """The newest checkpoint's batch (-1: none), its state through the SQL views, and the batch
    ids of the retained checkpoints, read by a fresh table object; every file of the newest
    checkpoint's snapshot must exist."""
    from catalog import IcebergStateTable, connect
    from statestore.keygroups import KeyGroupRange

    with IcebergStateTable.open_existing(warehouse=warehouse, table_name="op") as table:
        info = table.current_checkpoint()
        if info is None:
            return -1, Model(), []
        missing = [s.path for s in table.segments(KeyGroupRange.of(0, MAX_PARALLELISM - 1))
                   if not table.filesystem.get_file_info(s.path).is_file]
        if missing:
            raise AssertionError(f"checkpoint {info.checkpoint_id} references missing segments {missing}")
        con = connect(table)
        model = Model(v=dict(con.sql("SELECT k, v_v FROM state_v").fetchall()))
        for k, value in con.sql("SELECT k, v_l FROM state_l ORDER BY k, ord").fetchall():
            model.l.setdefault(k, []).append(value)
        for k, uk, value in con.sql("SELECT k, mk_m, v_m FROM state_m").fetchall():
            model.m.setdefault(k, {})[uk] = value
        con.close()
        batches = [c.batch_id for c in table.list_checkpoints()]
        return info.batch_id, model, batches


# --- the writer process ----------------------------------------------------------------------


@app.command(hidden=True)
def child(warehouse: str, seed: int, parallelism: int, phase_file: str) -> None:
    """The writer: resume after the newest checkpoint's batch and run to ``BATCHES``."""
    import pyarrow as pa

    from catalog import IcebergStateTable
    from catalog.compaction import CompactionPolicy, compact
    from statestore import StateStore, assign_key_groups, task_for_key_group

    phases = open(phase_file, "a", buffering=1)  # noqa: SIM115 (line-buffered, open until killed)

    def phase(batch: int, name: str) -> None:
        phases.write(f"{batch} {name}\n")

    table = IcebergStateTable.open(layout(), warehouse=warehouse, table_name="op", retain_checkpoints=RETAIN)
    compactor = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    info = table.current_checkpoint()
    start = 0 if info is None else info.batch_id + 1
    phase(start, "open")
    stores = [StateStore(table, task_index=t, parallelism=parallelism) for t in range(parallelism)]

    def routed(rows: list[tuple], task: int) -> list[tuple]:
        if not rows:
            return []
        keys = pa.table({"k": [r[0] for r in rows]})
        owner = task_for_key_group(MAX_PARALLELISM, parallelism, assign_key_groups(keys, MAX_PARALLELISM))
        return [r for r, o in zip(rows, owner, strict=True) if o == task]

    def keys_of(rows: list[tuple]) -> pa.Table:
        return pa.table({"k": pa.array([r[0] for r in rows], pa.string())})

    for batch in range(start, BATCHES):
        phase(batch, "write")
        ops = batch_ops(seed, batch)
        for task, store in enumerate(stores):
            v, lst, m = store.get_state("v"), store.get_state("l"), store.get_state("m")
            if rows := routed(ops["v_put"], task):
                v.update_batch(keys_of(rows), [r[1] for r in rows])
            if rows := routed([(k,) for k in ops["v_clear"]], task):
                v.clear_batch(keys_of(rows))
            if rows := routed(ops["l_add"], task):
                lst.add_batch(keys_of(rows), [r[1] for r in rows])
            if rows := routed([(k,) for k in ops["l_clear"]], task):
                lst.clear_batch(keys_of(rows))
            if rows := routed(ops["m_put"], task):
                m.put_batch(keys_of(rows), [r[1] for r in rows], [r[2] for r in rows])
            if rows := routed(ops["m_remove"], task):
                m.remove_batch(keys_of(rows), [r[1] for r in rows])
        phase(batch, "flush")
        checkpoint_id = table.next_checkpoint_id()
        segments = [s for store in stores for s in store.flush(checkpoint_id)]
        phase(batch, "commit")
        table.commit_checkpoint(checkpoint_id, segments, parallelism=parallelism, batch_id=batch)
        for store in stores:
            store.checkpoint_complete(checkpoint_id)
        if batch % COMPACT_EVERY == COMPACT_EVERY - 1:
            phase(batch, "compact")
            compact(compactor, policy=CompactionPolicy(min_segments=2))
    phase(BATCHES, "done")
    for store in stores:
        store.close()
    table.close()
    compactor.close()


# --- the store harness -----------------------------------------------------------------------


@dataclass
class Iteration:
    index: int
    seed: int
    kills: list[dict] = field(default_factory=list)  # per kill: delay, phase, batch left, parallelism
    finished_before_kill: int = 0
    failure: str | None = None
    garbage_swept: int = 0
    seconds: float = 0.0


def _start_child(warehouse: Path, seed: int, parallelism: int, phase_file: Path, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "benchmarks.crash_harness", "child", str(warehouse), str(seed), str(parallelism),
            str(phase_file)]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=harness.repo_env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=harness.REPO)


def _last_phase(phase_file: Path) -> str:
    lines = phase_file.read_text().splitlines() if phase_file.exists() else []
    return lines[-1] if lines else "starting"


def _wait_started(proc: subprocess.Popen, phase_file: Path, before: int) -> None:
    """Until the writer announced its first phase (imports done, table open) or exited."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if phase_file.exists() and len(phase_file.read_text().splitlines()) > before:
            return
        time.sleep(0.01)


def _wait_phases(proc: subprocess.Popen, phase_file: Path, count: int) -> None:
    """Until the phase file holds ``count`` lines or the writer exited."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if phase_file.exists() and len(phase_file.read_text().splitlines()) >= count:
            return
        time.sleep(0.005)


def _run_to_end(warehouse: Path, seed: int, parallelism: int, phase_file: Path, log: Path) -> float:
    """Run the writer to the end; returns the seconds from its table being open to its exit."""
    before = len(phase_file.read_text().splitlines()) if phase_file.exists() else 0
    proc = _start_child(warehouse, seed, parallelism, phase_file, log)
    _wait_started(proc, phase_file, before)
    opened = time.perf_counter()
    if proc.wait(timeout=CHILD_TIMEOUT_S) != 0:
        raise AssertionError(f"the writer exited with {proc.returncode}: {_tail(log)}")
    return time.perf_counter() - opened


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def _check(warehouse: Path, seed: int, context: str) -> tuple[int, list[int]]:
    batch, state, batches = read_state(str(warehouse))
    expected = Model.after(seed, batch) if batch >= 0 else Model()
    if state != expected:
        diff = {name: sorted(k for k in set(getattr(state, name)) | set(getattr(expected, name))
                             if getattr(state, name).get(k) != getattr(expected, name).get(k))[:5]
                for name in ("v", "l", "m")}
        raise AssertionError(f"{context}: the state at batch {batch} differs from the model's (keys {diff})")
    if batches != sorted(set(batches)):
        raise AssertionError(f"{context}: retained checkpoints hold batches {batches}: a batch twice")
    return batch, batches


def _sweep_an_hour_later(warehouse: Path) -> int:
    """Age every file two hours, let the stream pass the compactions' grace in checkpoints, sweep
    with a writer's garbage collection, and check that the warehouse holds exactly the files the
    table references. Returns the files swept."""
    from catalog import IcebergStateTable
    from statestore.paths import COMPACTION_GRACE_CHECKPOINTS
    from tests.catalog.catalog_helpers import referenced_files, table_files

    root = warehouse / "state" / "op"
    before = [p for p in root.rglob("*") if p.is_file()]
    old = time.time() - 7200
    for p in before:
        os.utime(p, (old, old))
    with IcebergStateTable.open(layout(), warehouse=str(warehouse), table_name="op", retain_checkpoints=RETAIN) as t:
        # A killed compaction's outputs stay until the checkpoints it could still commit on have
        # passed (COMPACTION_GRACE_CHECKPOINTS): the stream goes on with empty batches meanwhile.
        for batch in range(BATCHES, BATCHES + COMPACTION_GRACE_CHECKPOINTS):
            t.commit_checkpoint(t.next_checkpoint_id(), [], parallelism=1, batch_id=batch)
        t.collect_garbage()
        after, referenced = table_files(t), referenced_files(t)
    if after != referenced:
        raise AssertionError(f"after the sweep, unreferenced files {sorted(after - referenced)[:5]} remain and "
                             f"referenced files {sorted(referenced - after)[:5]} are missing")
    return len(before) - len(after)


def run_iteration(root: Path, index: int, seed: int, kills: int, reference: tuple[int, float],
                  rng: random.Random) -> Iteration:
    """One iteration: kill the writer ``kills`` times at seeded moments, check after each, run
    to the end, check against the model, sweep an hour later.

    ``reference`` is the uninterrupted run's phase count and seconds. A kill is paced by the
    writer's own phases, not by the clock: a seeded phase among those left, then a seeded part of
    a phase's mean time. Timed from the start alone, every kill of a writer that ran faster than
    the reference (a machine less loaded than when it was timed) landed after its end."""
    ref_phases, duration_s = reference
    phase_s = duration_s / max(ref_phases, 1)
    started = time.perf_counter()
    it = Iteration(index, seed)
    where = root / f"it{index:04d}"
    where.mkdir(parents=True)
    warehouse, phase_file, log = where / "warehouse", where / "phases", where / "writer.log"
    try:
        resumes_at = 0  # the batch the next writer starts with
        for kill in range(kills):
            parallelism = rng.choice(PARALLELISMS)
            # Uniform over the phases left of an uninterrupted run (plus its closing), so kills
            # land while the restarted writer still works.
            left = max(1, round(ref_phases * (BATCHES - resumes_at + 1) / (BATCHES + 1)))
            after_phases, delay = rng.randrange(left), rng.uniform(0.0, phase_s)
            before = len(phase_file.read_text().splitlines()) if phase_file.exists() else 0
            proc = _start_child(warehouse, seed, parallelism, phase_file, log)
            try:
                _wait_started(proc, phase_file, before)
                _wait_phases(proc, phase_file, before + 1 + after_phases)
                time.sleep(delay)
                phase = _last_phase(phase_file)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                code = proc.wait(timeout=CHILD_TIMEOUT_S)
            finally:
                if proc.poll() is None:
                    proc.kill()
            if code == 0:
                it.finished_before_kill += 1
            elif code != -signal.SIGKILL:
                raise AssertionError(f"the writer exited with {code} before its kill: {_tail(log)}")
            batch, _ = _check(warehouse, seed, f"after kill {kill + 1} ({phase})")
            resumes_at = batch + 1
            it.kills.append({"after_phases": after_phases, "delay_s": round(delay, 3),
                             "phase": phase.split()[-1] if code else "finished",
                             "at_batch": int(phase.split()[0]) if phase[0].isdigit() else None,
                             "checkpoint_batch": batch, "parallelism": parallelism})
            if code == 0:
                break
        _run_to_end(warehouse, seed, rng.choice(PARALLELISMS), phase_file, log)
        batch, _ = _check(warehouse, seed, "at the end")
        if batch != BATCHES - 1:
            raise AssertionError(f"the finished writer's newest checkpoint holds batch {batch}, not {BATCHES - 1}")
        it.garbage_swept = _sweep_an_hour_later(warehouse)
    except Exception as e:
        it.failure = f"{type(e).__name__}: {e}"
    it.seconds = round(time.perf_counter() - started, 2)
    return it


def run_store(iterations: int, kills: int, seed: int, root: Path, only: int | None = None,
              results: str = "crash_harness") -> dict:
    """The store harness; returns the results (also written to ``crash_harness.json``)."""
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # The reference: one uninterrupted run, timed (kills land uniformly over such a run) and checked.
    ref = root / "reference"
    ref.mkdir(parents=True, exist_ok=True)
    duration = _run_to_end(ref / "warehouse", seed, 2, ref / "phases", ref / "writer.log")
    _check(ref / "warehouse", seed, "the uninterrupted run")
    ref_phases = len((ref / "phases").read_text().splitlines())
    harness.console.print(f"uninterrupted run: {duration:.1f} s, {ref_phases} phases for {BATCHES} batches once its "
                          "table is open; killing within those phases")
    results_name, results = results, []
    todo = [only] if only is not None else range(iterations)
    for index in harness.progress(todo, f"{len(todo)} iterations x {kills} kills"):
        rng = random.Random(f"{seed}:{index}")
        it = run_iteration(root, index, rng.randrange(2**31), kills, (ref_phases, duration), rng)
        results.append(it)
        if it.failure:
            harness.console.print(f"[red]iteration {index} failed[/red] (replay: --seed {seed} --only {index}): "
                                  f"{it.failure}")
    phases = collections.Counter(k["phase"] for it in results for k in it.kills)
    summary = {
        "seed": seed, "iterations": len(results), "kills_per_iteration": kills,
        "kills": sum(1 for it in results for k in it.kills if k["phase"] != "finished"),
        "finished_before_kill": sum(it.finished_before_kill for it in results),
        "kills_by_phase": dict(sorted(phases.items(), key=lambda kv: PHASES.index(kv[0]) if kv[0] in PHASES else 99)),
        "rescaled_restarts": sum(1 for it in results for a, b in zip(it.kills, it.kills[1:], strict=False)
                                 if a["parallelism"] != b["parallelism"]),
        "failures": [{"index": it.index, "failure": it.failure} for it in results if it.failure],
        "garbage_swept_an_hour_later": sum(it.garbage_swept for it in results),
        "uninterrupted_run_s": round(duration, 2), "uninterrupted_run_phases": ref_phases,
        "seconds": round(time.perf_counter() - started, 1),
        "batches": BATCHES, "keys": KEYS, "retain_checkpoints": RETAIN, "compact_every": COMPACT_EVERY,
        "machine": harness.machine_info(),
    }
    harness.write_results(f"{results_name}.json", {**summary, "runs": [asdict(it) for it in results]})
    _plot_phases(summary["kills_by_phase"], f"{results_name}.png",
                 f"store: {summary['kills']} SIGKILLs in {len(results)} iterations, {len(summary['failures'])} failed")
    return summary


@contextlib.contextmanager
def _root(workdir: Path | None, prefix: str) -> Iterator[Path]:
    """``workdir``, kept; or a temporary folder removed after the run."""
    if workdir is not None:
        yield workdir
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as root:
        yield Path(root)


def _plot_phases(by_phase: dict[str, int], name: str, title: str) -> None:
    if not by_phase:
        return
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(list(by_phase), list(by_phase.values()), color="#4c72b0")
    ax.set_ylabel("SIGKILLs")
    ax.set_title(title, fontsize=9)
    harness.save_figure(fig, harness.results_path(name), dpi=110)


@app.command()
def store(
    iterations: Annotated[int, typer.Option(help="Iterations, each a fresh warehouse.")] = 200,
    kills: Annotated[int, typer.Option(help="SIGKILLs of the writer per iteration, each followed by a restart.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of everything: the writes, the kill moments, the parallelisms.")] = 1,
    only: Annotated[int | None, typer.Option(help="Replay one iteration of this seed.")] = None,
    workdir: Annotated[Path | None, typer.Option(help="Where the warehouses go (default: a temporary folder).")] = None,
    results: Annotated[str, typer.Option(help="Name of the results files (.json, .png).")] = "crash_harness",
) -> None:
    """SIGKILL a writer that checkpoints, compacts and expires, at seeded moments; check every time."""
    with _root(workdir, "crash-harness-") as root:
        summary = run_store(iterations, kills, seed, root, only, results)
    harness.console.print(json.dumps({k: v for k, v in summary.items() if k != "machine"}, indent=1))
    if summary["failures"]:
        raise typer.Exit(1)


# --- the Spark harness -----------------------------------------------------------------------

DRIVER = harness.REPO / "tests" / "integration" / "cluster_driver.py"
SPARK_FILES = 4
ROWS_PER_FILE = 300
SPARK_KEYS = 37
SPARK_CONF = {
    "spark.driver.memory": "512m", "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.sql.session.timeZone": "UTC",
    "spark.sql.catalogImplementation": "in-memory", "spark.sql.shuffle.partitions": 2,
    "spark.default.parallelism": 2,
}


def _spark_input(directory: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    for b in range(SPARK_FILES):
        ids = list(range(b * ROWS_PER_FILE, (b + 1) * ROWS_PER_FILE))
        path = directory / f"part-{b}.parquet"
        pq.write_table(pa.table({"key": [f"k{(i * 7 + b) % SPARK_KEYS}" for i in ids], "v": pa.array(ids, pa.int64())}),
                       path)
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))


def _spark_env() -> dict[str, str]:
    env = {**harness.repo_env(), "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1"}
    for name in ("ICESTATE_KILL_AT", "ICESTATE_FAIL_FIRST_ATTEMPT"):
        env.pop(name, None)
    return env


def _driver(root: Path, input_dir: Path, queries: list[dict], progress: Path | None = None) -> subprocess.Popen:
    root.mkdir(parents=True, exist_ok=True)
    config = {"master": "local[2]", "app_name": f"crash-harness-{root.name}", "conf": SPARK_CONF,
              "input": str(input_dir), "result": str(root / "result.json"), "queries": queries,
              **({"progress": str(progress)} if progress else {})}
    (root / "config.json").write_text(json.dumps(config))
    with open(root / "driver.log", "ab") as out:
        return subprocess.Popen([sys.executable, str(DRIVER), str(root / "config.json")], env=_spark_env(),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _spark_query(label: str, where: Path) -> dict:
    return {"name": "q", "label": label, "processor": "count_list", "parallelism": 2, "max_parallelism": 8,
            "warehouse": str(where / "warehouse"), "checkpoint": str(where / "checkpoint")}


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (its JVM, Python workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)


def _killed_run(where: Path, input_dir: Path, label: str, rng: random.Random, window_s: float) -> dict:
    """A driver SIGKILLed (the driver process alone, as a crash would) at a seeded moment after
    its first batch started; then its JVM and workers are stopped."""
    proc = _driver(where, input_dir, [_spark_query(label, where)], progress=where / "progress")
    first = where / "checkpoint" / "offsets" / "0"
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    delay = rng.uniform(0.0, window_s)
    time.sleep(delay)
    committed = (where / "progress").read_text().split() if (where / "progress").exists() else []
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    code = proc.wait(timeout=60)
    _stop_group(proc)
    return {"label": label, "delay_s": round(delay, 2), "returncode": code, "outputs_committed_before": committed}


def run_spark(rounds: int, per_round: int, seed: int, root: Path) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    input_dir = root / "input"
    _spark_input(input_dir)
    reference = None
    window = 20.0  # the killed drivers' span after their first batch starts, re-measured from the reference
    runs, failures = [], []
    started = time.perf_counter()
    for r in harness.progress(range(rounds), f"{rounds} rounds x {per_round} killed drivers"):
        labels = [f"r{r}k{i}" for i in range(per_round)]
        rngs = [random.Random(rng.randrange(2**31)) for _ in labels]
        with ThreadPoolExecutor(per_round) as pool:
            killed = list(pool.map(_killed_run, [root / label for label in labels], [input_dir] * per_round, labels,
                                   rngs, [window] * per_round))
        restart = root / f"restart{r}"
        queries = ([_spark_query("reference", root / "reference")] if reference is None else []) + [
            _spark_query(label, root / label) for label in labels]
        t0 = time.perf_counter()
        proc = _driver(restart, input_dir, queries)
        try:
            code = proc.wait(timeout=CHILD_TIMEOUT_S * 2)
        finally:
            _stop_group(proc)
        if code != 0:
            failures.append({"round": r, "failure": f"the restarting driver exited with {code}: "
                             f"{_tail(restart / 'driver.log')}"})
            continue
        result = json.loads((restart / "result.json").read_text())["queries"]
        if reference is None:
            reference = result["reference"]
            window = max(5.0, (time.perf_counter() - t0) / (per_round + 1))
        for run in killed:
            got = result[run["label"]]
            problems = []
            run["finished_before_kill"] = run["returncode"] == 0  # still compared with the reference
            if run["returncode"] not in (0, -signal.SIGKILL):
                problems.append(f"exited with {run['returncode']} before its kill")
            if got["state"]["variables"] != reference["state"]["variables"]:
                problems.append("state differs from the reference")
            if got["output"]["rows"] != reference["output"]["rows"]:
                problems.append("output rows differ from the reference")
            if got["output"]["batches"] != list(range(SPARK_FILES)):
                problems.append(f"output batches {got['output']['batches']}")
            run["ok"] = not problems
            runs.append(run)
            if problems:
                failures.append({"label": run["label"], "seed": seed, "failure": "; ".join(problems)})
    summary = {"seed": seed, "rounds": rounds, "drivers": len(runs),
               "killed": sum(1 for r in runs if not r["finished_before_kill"]),
               "finished_before_kill": sum(1 for r in runs if r["finished_before_kill"]), "failures": failures,
               "kill_window_s": round(window, 1), "files": SPARK_FILES, "rows_per_file": ROWS_PER_FILE,
               "outputs_committed_when_killed": dict(collections.Counter(
                   len(r["outputs_committed_before"]) for r in runs)),
               "seconds": round(time.perf_counter() - started, 1), "machine": harness.machine_info()}
    harness.write_results("crash_harness_spark.json", {**summary, "runs": runs})
    return summary


@app.command()
def spark(
    rounds: Annotated[int, typer.Option(help="Rounds: killed drivers side by side, then one restarting driver.")] = 3,
    per_round: Annotated[int, typer.Option(help="Drivers killed per round.")] = 3,
    seed: Annotated[int, typer.Option(help="Seed of the kill moments.")] = 1,
    workdir: Annotated[Path | None, typer.Option(help="Where the runs go (default: a temporary folder).")] = None,
) -> None:
    """SIGKILL stateful Spark drivers at seeded moments; restart each and compare with a reference run."""
    with _root(workdir, "crash-harness-spark-") as root:
        summary = run_spark(rounds, per_round, seed, root)
    harness.console.print(json.dumps({k: v for k, v in summary.items() if k != "machine"}, indent=1))
    if summary["failures"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
