"""Soak: a stateful streaming query for a long while (90 minutes by default), with a checkpoint
every few seconds, retention and compaction on; what must stay flat is sampled and plotted.

The query (local[2], in a driver process of its own, so that the measured driver holds what a
user's job holds and none of this harness): Spark's ``rate`` source at ``--rows-per-second``,
keyed by ``value % --keys`` (every key comes back every keys/rate seconds), through a Spark
``StatefulProcessor`` run unchanged by ``start_stateful_query`` in ProcessingTime mode: a value
state (the key's count) and a map state of per-minute counts with a 2-minute TTL, so the live
state is bounded while every batch writes, expires and tombstones entries. Trigger every
``--trigger-seconds``; each batch is one checkpoint; retention keeps the default 10 checkpoints;
the compactor process runs the default policy. The batch output goes to a ``foreach_batch``
that counts it. Spark's own history is bounded as in production (``SPARK_HISTORY``), and the
Python workers run as a long-running deployment sets them: Arrow's buffers on glibc's
allocator (``statestore.memory.spark_conf()``, ``spark.executorEnv.*``; ``--no-long-running-env``:
Arrow's own allocator).

Sampled every ``--sample-seconds``: resident memory and open file descriptors of the driver's
Python, its JVM, the Python workers (together and each) and the compactor (from ``/proc``); every
``LIVE_HEAP_EVERY_S``, the JVM's live heap after a full collection (``jcmd``; the JVM's heap is
sized and touched whole at its start, so its resident memory does not follow the collector); the
table's segment files per unit (max and mean) and retained checkpoints; the files and bytes under
the table's location; the entries the state holds (the state figures of the newest batch
report). Per batch: its duration and commit time. After a warm-up (``--warmup-minutes``), the
mean of each figure over the window after the warm-up is compared with its mean over the last
window of the same length (a third of the rest, 1 to 10 minutes; batch figures: medians): the
ratio is the drift (1.0: flat; flat: at most ``FLAT``). Results: ``soak.json`` and ``soak.png``
(one panel per figure, against minutes) in ``docs/benchmarks/soak/``, and while it runs
``soak.partial.json`` every 5 minutes. ``--diagnose DIR``: each process's cache sizes and object
counts, to find what grows.

    python -m benchmarks.soak --minutes 90
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness

TABLE = "soak"
TTL_MS = 120_000
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Opt-in diagnosis (``--diagnose DIR``): where each process (the driver, every Python worker)
# appends what it holds (tracemalloc's biggest growths, object counts by type) as JSON lines.
DIAGNOSE_ENV = "ICESTATE_SOAK_DIAGNOSE"
DIAGNOSE_EVERY_S = 60.0
# The driver's JVM heap (``spark.driver.memory``, and its starting size), and how often its live
# content is measured: each measurement is a full collection (a pause of a fraction of a second).
JVM_HEAP = "1g"
LIVE_HEAP_EVERY_S = 150.0

try:  # the processor: pyspark is there whenever the soak runs; the module imports without it
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle

    class SoakProcessor(StatefulProcessor):
        """A key's count (value state) and its per-minute counts (map state, 2-minute TTL)."""

        def init(self, handle: StatefulProcessorHandle) -> None:
            if os.environ.get(DIAGNOSE_ENV):  # --diagnose; by name: this class travels pickled by value
                from benchmarks.soak import diagnose

                diagnose()
            self.count = handle.getValueState("count", "n long")
            self.minutes = handle.getMapState("minutes", "minute long", "n long", TTL_MS)

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
            n = sum(1 for _ in rows)
            total = (self.count.get()[0] if self.count.exists() else 0) + n
            self.count.update((total,))
            minute = timerValues.getCurrentProcessingTimeInMs() // 60_000
            before = self.minutes.getValue(Row(minute=minute)) if self.minutes.containsKey(Row(minute=minute)) else None
            self.minutes.updateValue(Row(minute=minute), Row(n=(before[0] if before else 0) + n))
            yield Row(key=key[0], count=total)
except ImportError:  # pragma: no cover
    SoakProcessor = None  # type: ignore[assignment,misc]


# --- diagnosis ----------------------------------------------------------------------------------

_DIAGNOSIS: dict[str, Any] = {}  # per process: the first snapshot and when the last line was written


def diagnose(force: bool = False) -> None:
    """Append this process's growth since its first call to ``$ICESTATE_SOAK_DIAGNOSE/<pid>.jsonl``,
    at most every ``DIAGNOSE_EVERY_S``: what grows is found by measuring, in the driver and in
    the workers alike: the sizes of the caches, object counts by type and, when ``PYTHONTRACEMALLOC`` is
    set, tracemalloc's biggest growths (tracing slows the query several times over)."""
    folder = os.environ.get(DIAGNOSE_ENV)
    now = time.monotonic()
    if not folder or (not force and now - _DIAGNOSIS.get("at", -1e9) < DIAGNOSE_EVERY_S):
        return
    import collections
    import gc
    import json
    import tracemalloc

    import pyarrow as pa

    _DIAGNOSIS["at"] = now
    objects = gc.get_objects()
    types = collections.Counter(type(o).__qualname__ for o in objects)
    modules = set(sys.modules)
    known = _DIAGNOSIS.setdefault("modules", modules)
    line: dict[str, Any] = {"time": time.time(), "rss_mb": round(_rss_and_fds(os.getpid())[0] / 2**20, 1),
                            "rss_kinds_mb": _rss_kinds(os.getpid()),
                            "threads": len(os.listdir("/proc/self/task")),
                            "modules": len(modules), "new_modules": sorted(modules - known)[:40],
                            "arrow_mb": round(pa.total_allocated_bytes() / 2**20, 1),
                            "arrow_peak_mb": round(pa.default_memory_pool().max_memory() / 2**20, 1),
                            "glibc_mb": _glibc_heap(), "pymalloc": _pymalloc_arenas(),
                            "types": dict(types.most_common(60)), "caches": cache_sizes(objects),
                            "functions": dict(collections.Counter(
                                f"{o.__module__}.{o.__qualname__}" for o in objects
                                if type(o).__name__ == "function").most_common(40))}
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        first = _DIAGNOSIS.setdefault("first", snapshot)
        line["traced_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
        line["growth"] = [{"kb": round(d.size_diff / 1024, 1), "count": d.count_diff,
                           "where": d.traceback.format(limit=1)} for d in snapshot.compare_to(first, "lineno")[:25]]
    _DIAGNOSIS["modules"] = modules
    with open(Path(folder) / f"{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")


def _glibc_heap() -> dict[str, float]:
    """glibc's ``mallinfo2``, in MB: the arenas' heap (``arena``), what of it is in use
    (``uordblks``) and free (``fordblks``), and the mmapped blocks (``hblkhd``)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return {}
    fn.restype = MallInfo2
    info = fn()
    return {n: round(getattr(info, n) / 2**20, 1) for n in ("arena", "uordblks", "fordblks", "hblkhd")} | {
        "hblks": info.hblks}


def _pymalloc_arenas() -> dict[str, int]:
    """The counts ``sys._debugmallocstats`` prints (it writes to the C stderr): Python's small
    object allocator's arenas now and at most, and its bytes in used and free blocks."""
    import re
    import tempfile

    wanted = {"arenas allocated current": "arenas", "arenas highwater mark": "arenas_max",
              "bytes in allocated blocks": "used_bytes", "bytes in available blocks": "free_bytes"}
    with tempfile.TemporaryFile(mode="w+") as out:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read()
    found = {}
    for label, name in wanted.items():
        m = re.search(rf"# {label}\s*=\s*([\d,]+)", text)
        if m:
            found[name] = int(m.group(1).replace(",", ""))
    return found


# A Python worker this large runs tasks (the idle daemon and its forks hold 35-80 MB).
TASK_WORKER_MIN_BYTES = 150 * 2**20
_MAPPING_CLASSES = ((1 << 30, "1g_arena"), (8 << 20, "8_64m"), (1 << 20, "1_8m"), (0, "small"))


def anonymous_by_mapping(pid: int) -> dict[str, float]:
    """Anonymous MB of a process by the kind of mapping that holds it (``/proc/<pid>/smaps``):
    ``heap`` (glibc's main arena), ``1g_arena`` (a 1 GiB reservation: Arrow's mimalloc arena),
    ``8_64m`` (glibc's 64 MiB thread heaps, mimalloc's segments), ``1_8m`` (pymalloc's 1 MiB
    arenas, thread stacks, jemalloc's extents for polars), ``small``."""
    out = {"heap": 0, **{name: 0 for _, name in _MAPPING_CLASSES}}
    size = name = None
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=6)
                if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                    lo, hi = head[0].split("-")
                    size = int(hi, 16) - int(lo, 16)
                    name = head[5].strip() if len(head) > 5 else ("" if head[4] == "0" else "file")
                elif head[0] == "Anonymous:" and name is not None and name in ("", "[heap]"):
                    kb = int(head[1])
                    if name == "[heap]":
                        out["heap"] += kb
                    else:
                        out[next(label for floor, label in _MAPPING_CLASSES if size >= floor)] += kb
    except (OSError, ValueError, IndexError):
        return {}
    return {k: round(v / 1024, 1) for k, v in out.items()}


def _rss_kinds(pid: int) -> dict[str, float]:
    """Resident MB by kind (anonymous, file-backed, shared memory) from ``smaps_rollup``: a step made
    by a library mapped for the first time shows as file-backed, one made by an allocator as anonymous."""
    kinds = {}
    try:
        for row in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            name, _, value = row.partition(":")
            if name in ("Rss", "Anonymous", "Shared_Clean", "Private_Clean", "Swap"):
                kinds[name] = round(int(value.split()[0]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return kinds


def cache_sizes(objects: list) -> dict[str, list]:
    """Entries (and bytes where counted) of every cache of the read path alive in this process."""
    sizes: dict[str, list] = {}

    def add(name: str, value: Any) -> None:
        sizes.setdefault(name, []).append(value)

    for o in objects:
        kind = type(o).__qualname__
        if kind == "ManifestCache":
            add(kind, [len(o._lists), len(o._entries), len(o._listed_by)])
        elif kind == "KeyGroupCache":
            add(kind, [len(o), o.size_bytes])
        elif kind == "SegmentReader":
            add(kind, len(o._footers))
        elif kind == "MetadataFileCache":
            add(kind, [len(o._files), o.size_bytes])
        elif kind == "FileCache":
            add(kind, [len(o._entries), o._size_bytes])
        elif kind == "StateReader":
            add(kind, [len(o._point_index), len(o._batch_index), len(o._unsettled)])
        elif kind == "StatefulRunner":
            add(kind, [len(o.reports), len(o.task_tokens), len(o.task_history), len(o._projections)])
    from spark_integration import tasks

    sizes["task_stores"] = [len(tasks._STORES)]
    return sizes


# --- /proc --------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss_and_fds(pid: int) -> tuple[int, int]:
    try:
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0, 0
    return rss, fds


def process_figures(driver: int) -> dict[str, float]:
    """Resident MB and open files of the driver's Python (process ``driver``), its JVM, the Python
    workers, the compactor."""
    groups: dict[str, list[int]] = {"driver": [driver], "jvm": [], "workers": [], "compactor": []}
    for pid in _descendants(driver):
        cmd = _cmdline(pid)
        if "java" in cmd.split(" ", 1)[0]:
            groups["jvm"].append(pid)
        elif "compactor" in cmd:
            groups["compactor"].append(pid)
        elif "python" in cmd:
            groups["workers"].append(pid)
    figures: dict[str, Any] = {}
    for name, pids in groups.items():
        if not pids:  # not started yet (the compactor starts after the first checkpoint): no figure
            figures[f"{name}_rss_mb"] = figures[f"{name}_fds"] = None
            continue
        pairs = [_rss_and_fds(p) for p in pids]
        figures[f"{name}_rss_mb"] = round(sum(r for r, _ in pairs) / 2**20, 1)
        figures[f"{name}_fds"] = sum(f for _, f in pairs)
        if name == "workers":  # each worker on its own: a worker's growth must not hide in the sum
            figures["worker_rss_mb"] = {str(p): round(r / 2**20, 1) for p, (r, _) in zip(pids, pairs, strict=True)}
            # The task workers' anonymous memory by the mapping that holds it (which allocator grew).
            figures["worker_anon_mb"] = {str(p): anonymous_by_mapping(p) for p, (r, _) in zip(pids, pairs, strict=True)
                                         if r > TASK_WORKER_MIN_BYTES}
    figures["workers"] = len(groups["workers"])
    return figures


def table_figures(table: Any, location: Path) -> dict[str, float]:
    """Segment files per unit, retained checkpoints, and the files and bytes under the table."""
    from catalog.compaction import units

    table.restore()
    per_unit = [len(table.segments(u)) for u in units(table)] or [0]
    files = [p for p in location.rglob("*") if p.is_file()]
    return {"files_per_unit_max": max(per_unit), "files_per_unit_mean": round(statistics.mean(per_unit), 2),
            "checkpoints_retained": len(table.list_checkpoints()), "table_files": len(files),
            "table_mb": round(sum(p.stat().st_size for p in files if p.exists()) / 2**20, 2)}


# --- the run ------------------------------------------------------------------------------------

# The history Spark's driver keeps, bounded as a long-running deployment bounds it. Spark's status
# store (there without the UI too: it backs the status tracker) keeps the newest 1,000 jobs,
# stages and SQL executions with their tasks and plan metrics by default; a soak's JVM kept
# 1.5-2 MB more live heap a minute through its first minutes (class histograms after a full
# GC, 64 -> 71 MB from minute 2 to 6: SQLPlanMetric, StageData, TaskDataWrapper,
# RDDOperationNode) and its resident memory grew 12 % in 8 minutes, toward those bounds. Nothing
# of ours reads that history; the streaming query's own (recent progress, the offset and commit
# logs' batches) is bounded too.
SPARK_HISTORY = {
    "spark.ui.retainedJobs": "100", "spark.ui.retainedStages": "100", "spark.ui.retainedTasks": "10000",
    "spark.sql.ui.retainedExecutions": "50", "spark.ui.retainedDeadExecutors": "10",
    "spark.sql.streaming.ui.retainedQueries": "10", "spark.sql.streaming.ui.retainedProgressUpdates": "100",
    "spark.sql.streaming.numRecentProgressUpdates": "100", "spark.sql.streaming.minBatchesToRetain": "20",
}


def jvm_live_heap_mb(pid: int) -> float | None:
    """The bytes of the objects the JVM ``pid`` holds, in MB: ``jcmd GC.class_histogram`` runs a
    full collection first, so this is the live heap, not the heap with its garbage (which the
    collector lets grow toward its bound as it pleases). None where ``jcmd`` (the JDK's) is missing
    or the JVM is gone."""
    try:
        out = subprocess.run(["jcmd", str(pid), "GC.class_histogram"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = [line.split() for line in out.splitlines() if line.startswith("Total ")]
    return round(int(total[-1][2]) / 2**20, 1) if total and len(total[-1]) == 3 else None


def jvm_heap(pid: int) -> dict[str, float]:
    """The JVM's heap as its garbage collector sees it (``jstat -gc``, KB), to tell the heap's
    growth toward its bound from what the JVM holds."""
    try:
        out = subprocess.run(["jstat", "-gc", str(pid)], capture_output=True, text=True, timeout=20).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return {}
    half = len(out) // 2
    return {k: float(v.replace(",", ".")) for k, v in zip(out[:half], out[half:], strict=True) if v != "-"}


def run(minutes: float, rows_per_second: int, keys: int, trigger_seconds: float, sample_seconds: float,
        warmup_minutes: float, root: Path, diagnose_dir: Path | None = None,
        on_sample: Callable[[dict], None] | None = None, retain_checkpoints: int = 10,
        long_running_env: bool = True) -> dict:
    """Run the query for ``minutes`` in a driver process of its own (``drive``), sampling it from
    here: the measured driver holds the Spark session and the runner as a user's job does, and
    nothing of this harness (its table reader, its samples, its console). ``on_sample`` sees the
    result so far after each sample (a long run's figures can be looked at before it ends)."""
    path = os.pathsep.join([str(harness.REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path}
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    if diagnose_dir is not None:
        diagnose_dir.mkdir(parents=True, exist_ok=True)
        env[DIAGNOSE_ENV] = str(diagnose_dir)
    from catalog import IcebergStateTable

    root.mkdir(parents=True, exist_ok=True)
    reports, stop = root / "batches.jsonl", root / "stop"
    reports.unlink(missing_ok=True)
    stop.unlink(missing_ok=True)
    config = {"minutes": minutes, "rows_per_second": rows_per_second, "keys": keys, "trigger_seconds": trigger_seconds,
              "retain_checkpoints": retain_checkpoints, "root": str(root), "long_running_env": long_running_env}
    (root / "driver.json").write_text(json.dumps(config))
    warehouse = root / "warehouse"
    log = root / "driver.log"
    with open(log, "w") as out:
        driver = subprocess.Popen([sys.executable, "-m", "benchmarks.soak", "--drive", str(root / "driver.json")],
                                  cwd=harness.REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    started_wall, started = time.time(), time.monotonic()
    samples: list[dict] = []
    batches: list[dict] = []
    emitted = [0]
    entries: list[int | None] = [None]
    deadline = started + minutes * 60
    heap_due = started + LIVE_HEAP_EVERY_S
    table = None
    read_to = [0]

    def collect() -> None:  # the batch reports the driver appended since the last call
        if not reports.exists():
            return
        with open(reports) as f:
            f.seek(read_to[0])
            for line in f:
                if not line.endswith("\n"):
                    break  # being written
                read_to[0] += len(line.encode())
                r = json.loads(line)
                batches.append({"batch_id": r["batch_id"], "minute": round((r["time"] - started_wall) / 60, 3),
                                **{k: r[k] for k in ("duration_ms", "commit_ms", "tasks_ms")}})
                emitted[0], entries[0] = r["emitted"], r["entries"]

    try:
        with harness.console.status("soaking") as status:
            while time.monotonic() < deadline:
                if driver.poll() is not None:
                    raise RuntimeError(f"the query's driver stopped (exit {driver.returncode}):\n"
                                       f"{log.read_text(errors='replace')[-4000:]}")
                collect()
                if table is None and batches:
                    table = IcebergStateTable.open_existing(warehouse=str(warehouse), table_name=TABLE)
                sample = {"minute": round((time.monotonic() - started) / 60, 3), **process_figures(driver.pid)}
                jvms = [pid for pid in _descendants(driver.pid) if "java" in _cmdline(pid).split(" ", 1)[0]]
                if jvms and time.monotonic() >= heap_due:
                    heap_due = time.monotonic() + LIVE_HEAP_EVERY_S
                    sample["jvm_live_heap_mb"] = jvm_live_heap_mb(jvms[0])
                if diagnose_dir is not None:
                    sample["jvm_heap"] = {pid: jvm_heap(pid) for pid in jvms}
                if table is not None:
                    sample.update(table_figures(table, warehouse / "state" / TABLE))
                sample["entries"] = entries[0]
                sample["batches"] = len(batches)
                samples.append(sample)
                if on_sample is not None:
                    on_sample({"samples": samples, "batches": batches, "emitted_rows": emitted[0]})
                status.update(f"soaking: minute {sample['minute']:.1f} of {minutes}, {sample['batches']} batches, "
                              f"{sample.get('table_files', 0)} files, {sample.get('files_per_unit_max', 0)} per unit")
                time.sleep(sample_seconds)
    finally:
        stop.touch()
        try:
            driver.wait(timeout=180)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        if table is not None:
            table.close()
    collect()
    if driver.returncode != 0:
        raise RuntimeError(f"the query's driver failed (exit {driver.returncode}):\n"
                           f"{log.read_text(errors='replace')[-4000:]}")
    return {"samples": samples, "batches": batches, "emitted_rows": emitted[0]}


def drive(config_path: Path) -> None:
    """The soak's driver (a process of its own, ``run``): start the query, append each batch
    report to ``<root>/batches.jsonl`` as a line, stop when ``<root>/stop`` appears (or long
    after the run's end, should the harness be gone)."""
    import json as json_module

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import spark_integration
    from spark_integration.query import runner_of

    config = json_module.loads(config_path.read_text())
    root = Path(config["root"])
    builder = SparkSession.builder.master("local[2]").appName("icestate-soak")
    # The JVM's heap at its full size from the start, every page touched, as a long-running
    # deployment sizes it: the collector then never grows it in steps, so the JVM's resident
    # memory is the heap plus what lives outside it, and a growth there shows; the heap's own
    # content is measured apart (``jvm_live_heap_mb``).
    builder = builder.config("spark.driver.memory", JVM_HEAP).config(
        "spark.driver.extraJavaOptions", f"-Xms{JVM_HEAP} -XX:+AlwaysPreTouch")
    for key, value in SPARK_HISTORY.items():
        builder = builder.config(key, value)
    if config.get("long_running_env", True):
        # The Python workers' allocators as a long-running deployment sets them
        # (``statestore.memory.WORKER_ENV``): what a batch freed goes back to the system.
        from statestore import memory

        for key, value in memory.spark_conf().items():
            builder = builder.config(key, value)
    spark = (builder.config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.local.dir", str(root / "spark-local")).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    source = (spark.readStream.format("rate").option("rowsPerSecond", config["rows_per_second"]).load()
              .select(F.concat(F.lit("k"), (F.col("value") % config["keys"]).cast("string")).alias("key"), "value"))
    location = spark_integration.StateLocation(table=TABLE, warehouse=str(root / "warehouse"), max_parallelism=64,
                                               parallelism=2, retain_checkpoints=config["retain_checkpoints"])
    emitted = [0]

    def count_output(df: Any, batch_id: int) -> None:
        emitted[0] += df.count()

    query = spark_integration.start_stateful_query(
        source, keys=["key"], processor=SoakProcessor(), output_schema="key string, count long", location=location,
        checkpoint_location=str(root / "checkpoint"),
        trigger={"processingTime": f"{config['trigger_seconds']} seconds"}, foreach_batch=count_output,
        time_mode="ProcessingTime")
    runner = runner_of(query)
    seen = -1
    deadline = time.monotonic() + config["minutes"] * 60 + 600
    stop = root / "stop"
    try:
        with open(root / "batches.jsonl", "a") as out:
            while query.isActive and not stop.exists() and time.monotonic() < deadline:
                for r in list(runner.reports):
                    if not r.skipped and r.batch_id > seen:
                        seen = r.batch_id
                        out.write(json_module.dumps({
                            "batch_id": r.batch_id, "time": time.time(), "duration_ms": round(r.duration_ms, 1),
                            "commit_ms": round(r.commit_ms, 1), "tasks_ms": round(r.tasks_ms, 1),
                            "entries": (r.state or {}).get("numEntriesTotal"), "emitted": emitted[0]}) + "\n")
                out.flush()
                diagnose()
                time.sleep(1.0)
        if not query.isActive:
            raise RuntimeError(f"the query stopped: {query.exception()}")
    finally:
        query.stop()
        spark.stop()


FIGURES = ("driver_rss_mb", "jvm_rss_mb", "jvm_live_heap_mb", "workers_rss_mb", "compactor_rss_mb", "driver_fds",
           "jvm_fds", "workers_fds", "compactor_fds", "files_per_unit_max", "files_per_unit_mean", "table_files",
           "table_mb", "checkpoints_retained", "entries")


# What must stay flat after the warm-up (the drift criterion): the late window's mean at most
# this much above the early window's.
FLAT = 1.03
MUST_BE_FLAT = ("driver_rss_mb", "jvm_rss_mb", "jvm_live_heap_mb", "worker_rss_mb_each", "compactor_rss_mb",
                "driver_fds", "jvm_fds", "workers_fds", "compactor_fds", "table_files", "batch_commit_ms_median")


def windows(samples: list[dict], warmup_minutes: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The window after the warm-up and the last window, of the same length: a third of what
    follows the warm-up, at most 10 minutes (empty when nothing follows it)."""
    end = samples[-1]["minute"] if samples else 0.0
    window = max(0.0, min(10.0, (end - warmup_minutes) / 3))
    return (warmup_minutes, warmup_minutes + window), (end - window, end + 1e-9)


def _compare(a: list[float], b: list[float], average: Any = statistics.mean) -> dict | None:
    if not a or not b:
        return None
    early, late = average(a), average(b)
    return {"early": round(early, 2), "late": round(late, 2), "ratio": round(late / early, 3) if early else None}


def steady_from(samples: list[dict], warmup_minutes: float) -> float:
    """When the warm-up ends: after ``warmup_minutes``, and not before retention holds as many
    checkpoints as it keeps, the compactor runs and has compacted once (segment files per unit
    fell): on a loaded machine the first batches are slow, and a table still filling up would
    read as growth."""
    kept = max((s.get("checkpoints_retained") or 0 for s in samples), default=0)
    for before, s in itertools.pairwise(samples):
        if s.get("checkpoints_retained") == kept and s.get("compactor_rss_mb") is not None and \
                (s.get("files_per_unit_max") or 0) < (before.get("files_per_unit_max") or 0):
            return max(warmup_minutes, s["minute"])
    return max(warmup_minutes, samples[-1]["minute"] if samples else 0.0)


def drift(samples: list[dict], batches: list[dict], warmup_minutes: float) -> dict[str, dict]:
    """Per figure: its mean over the window after the warm-up (``steady_from``) and over the
    last window of the same length, and their ratio (1.0: flat); per batch figure, the medians
    of the batches of each window. ``worker_rss_mb_each``: the task worker (``TASK_WORKER_MIN_BYTES``
    and more) that grew most of those alive in both windows."""
    (a0, a1), (b0, b1) = windows(samples, steady_from(samples, warmup_minutes))
    early = [s for s in samples if a0 <= s["minute"] < a1]
    late = [s for s in samples if b0 <= s["minute"] < b1]
    out = {}
    for name in FIGURES:
        compared = _compare([s[name] for s in early if s.get(name) is not None],
                            [s[name] for s in late if s.get(name) is not None])
        if compared:
            out[name] = compared
    task_workers = {p for s in late for p, mb in s.get("worker_rss_mb", {}).items()
                    if mb * 2**20 >= TASK_WORKER_MIN_BYTES}  # the idle daemon and its forks say nothing
    each = [c for pid in task_workers
            if (c := _compare([s["worker_rss_mb"][pid] for s in early if pid in s.get("worker_rss_mb", {})],
                              [s["worker_rss_mb"][pid] for s in late if pid in s.get("worker_rss_mb", {})]))]
    if each:
        out["worker_rss_mb_each"] = max(each, key=lambda c: c["ratio"] or 0)
    for name in ("duration_ms", "commit_ms"):
        compared = _compare([x[name] for x in batches if a0 <= x["minute"] < a1],
                            [x[name] for x in batches if b0 <= x["minute"] < b1], statistics.median)
        if compared:
            out[f"batch_{name}_median"] = compared
    for name, d in out.items():
        if name in MUST_BE_FLAT:
            d["flat"] = d["ratio"] is not None and d["ratio"] <= FLAT
    return out


def plot(result: dict, path: Path) -> None:
    plt = harness.pyplot()
    samples = result["samples"]
    minutes = [s["minute"] for s in samples]
    panels = [("resident memory (MB)", ["driver_rss_mb", "jvm_rss_mb", "workers_rss_mb", "compactor_rss_mb"]),
              ("open files", ["driver_fds", "jvm_fds", "workers_fds", "compactor_fds"]),
              ("JVM live heap after a full collection (MB)", ["jvm_live_heap_mb"]),
              ("segment files per unit", ["files_per_unit_max", "files_per_unit_mean"]),
              ("files under the table", ["table_files"]), ("table MB", ["table_mb"]),
              ("entry rows in segments", ["entries"])]
    fig, axes = plt.subplots(5, 2, figsize=(11, 15))
    for ax, (title, names) in zip(axes.flat, panels, strict=False):
        for name in names:
            measured = [(s["minute"], s[name]) for s in samples if s.get(name) is not None]
            ax.plot([m for m, _ in measured], [v for _, v in measured], label=name.replace("_", " "),
                    marker="." if name == "jvm_live_heap_mb" else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minutes")
        ax.legend(fontsize=7)
    batches = result["batches"]
    span = minutes[-1] if minutes else 1.0
    for ax, name, title in ((axes.flat[7], "commit_ms", "commit time per batch (ms)"),
                            (axes.flat[8], "duration_ms", "batch duration (ms)")):
        ax.plot([b["minute"] for b in batches], [b[name] for b in batches], ".", markersize=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minutes (when sampled)")
    axes.flat[9].set_visible(False)
    fig.suptitle(f"soak: {span:.0f} minutes, {len(batches)} checkpoints, retention and compaction on", fontsize=11)
    harness.save_figure(fig, path, dpi=100)


# Where the soak's results go (``--results-dir``, or ``$ICESTATE_BENCH_RESULTS_DIR`` as a test sets it).
RESULTS = harness.REPO / "docs" / "benchmarks" / "soak"
PARTIAL_EVERY_S = 300


def finished(result: dict, config: dict) -> dict:
    """``result`` with its drift figures and the run's configuration."""
    return {**result, "drift": drift(result["samples"], result["batches"], config["warmup_minutes"]),
            "config": config}


def main(
    minutes: Annotated[float, typer.Option(help="How long the query runs.")] = 90.0,
    rows_per_second: Annotated[int, typer.Option(help="Rows of the rate source per second.")] = 2000,
    keys: Annotated[int, typer.Option(help="Distinct keys (value % keys).")] = 20_000,
    trigger_seconds: Annotated[float, typer.Option(help="Seconds between micro-batches (checkpoints).")] = 3.0,
    sample_seconds: Annotated[float, typer.Option(
        help="Seconds between samples: best not a multiple of the trigger's, or the samples lock onto one "
             "phase of the compactions' cycle and a window's mean of the table's files moves with that phase.")] = 14.0,
    warmup_minutes: Annotated[float, typer.Option(help="Minutes left out of the drift figures.")] = 15.0,
    workdir: Annotated[Path | None, typer.Option(
        help="Where the warehouse goes (default: a temporary folder).")] = None,
    diagnose_dir: Annotated[Path | None, typer.Option(
        "--diagnose", help="Record the caches' sizes and object counts of the driver and the workers in this "
                           "folder (with PYTHONTRACEMALLOC set, tracemalloc's growths too; slows the query).")] = None,
    retain_checkpoints: Annotated[int, typer.Option(help="Checkpoints retention keeps.")] = 10,
    long_running_env: Annotated[bool, typer.Option(
        help="Start the Python workers with statestore.memory.spark_conf() (Arrow's buffers on glibc's "
             "allocator), as a long-running deployment does.")] = True,
    results_dir: Annotated[Path | None, typer.Option(
        help=f"Where soak.json and soak.png go (default: ${harness.RESULTS_DIR_ENV}, else "
             f"{RESULTS.relative_to(harness.REPO)}).")] = None,
    drive_config: Annotated[Path | None, typer.Option("--drive", hidden=True,
                                                      help="Be the query's driver (internal).")] = None,
) -> None:
    """Run a stateful query for a long while and check that what must stay flat does."""
    if drive_config is not None:
        drive(drive_config)
        return
    harness.RESULTS_DIR = results_dir or (Path(os.environ[harness.RESULTS_DIR_ENV])
                                          if os.environ.get(harness.RESULTS_DIR_ENV) else RESULTS)
    if workdir is not None and workdir.exists() and any(workdir.iterdir()):
        # A soak measures a query from its first batch: a restart on an old run's checkpoint and
        # table starts with their state, and its figures would not be the run's.
        raise typer.BadParameter(f"{workdir} is not empty (an earlier run's checkpoint and table?): give an empty "
                                 "or new folder", param_hint="--workdir")
    root = workdir or Path(tempfile.mkdtemp(prefix="icestate-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    config = {"minutes": minutes, "rows_per_second": rows_per_second, "keys": keys, "trigger_seconds": trigger_seconds,
              "sample_seconds": sample_seconds, "warmup_minutes": warmup_minutes, "ttl_ms": TTL_MS,
              "retain_checkpoints": retain_checkpoints, "long_running_env": long_running_env,
              "started": time.time(), "machine": harness.machine_info(), "spark": SPARK_HISTORY}
    written = [time.monotonic()]

    def partial(result: dict) -> None:  # the figures so far, every few minutes
        if time.monotonic() - written[0] >= PARTIAL_EVERY_S:
            written[0] = time.monotonic()
            harness.write_results("soak.partial.json", finished(result, config))

    try:
        result = run(minutes, rows_per_second, keys, trigger_seconds, sample_seconds, warmup_minutes, root,
                     diagnose_dir, partial, retain_checkpoints, long_running_env)
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    result = finished(result, config)
    harness.write_results("soak.json", result)
    harness.results_path("soak.partial.json").unlink(missing_ok=True)
    plot(result, harness.results_path("soak.png"))
    from rich.table import Table

    table = Table(title=f"soak: drift after {warmup_minutes:g} min warm-up (late / early; 1.0 is flat; "
                        f"flat: at most {FLAT})")
    for column in ("figure", "early", "late", "ratio", "flat"):
        table.add_column(column)
    for name, d in result["drift"].items():
        table.add_row(name, str(d["early"]), str(d["late"]), str(d["ratio"]), str(d.get("flat", "")))
    harness.console.print(table)
    harness.console.print(f"{len(result['batches'])} batches, {result['emitted_rows']:,} output rows; "
                          f"results in {harness.results_path('soak.json')}")


if __name__ == "__main__":
    typer.run(main)
