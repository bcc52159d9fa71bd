"""The restart and rescale scenario, on a state built by a query of the same implementation.

Spark (RocksDB ``groupBy().count()``): build, restart with one more file, Spark's experimental
offline ``spark._streamingCheckpointManager.repartition(checkpoint, p)``, restart with one more
file. Ours: build with parallelism 4, restart with 4, restart with ``p`` on the same state (no
offline step: the first batch is the rescale). Each restart's first batch is compared with the
steady batch and with the first batch of a fresh query on an empty state.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

from benchmarks.streaming.data import RestartData, verify
from benchmarks.streaming.runner import Runner, stream_job


class Feeder:
    """A source folder that the restart scenario fills file by file (copies keep the mtimes)."""

    def __init__(self, folder: Path, files: list[Path]) -> None:
        self.folder, self.files, self.next = folder, files, 0
        folder.mkdir(parents=True)

    def add(self, count: int) -> int:
        first = self.next
        for f in self.files[first:first + count]:
            shutil.copy2(f, self.folder / f.name)
        self.next += count
        return first


def stream_step(runner: Runner, feeder: Feeder, impl: str, label: str, rd: RestartData, files: int,
                title: str, parallelism: int = 4, store_config: dict | None = None, check: bool = True) -> dict:
    """Run ``impl``'s query ``label`` over the next ``files`` files of ``feeder``; its output is
    checked against the data set's counts from the first of them (``check`` False: a fresh
    query over files from the middle of the data set, whose counts start anew)."""
    first = feeder.add(files)
    job = stream_job(impl, feeder.folder, runner.root, label, rd.all.sample, parallelism, store_config=store_config)
    result = runner.run(job, title)
    if "error" in result:
        return result
    batches = result["batches"]
    return {"session_s": result["session_s"], "import_s": result.get("import_s"), "wall_s": result["wall_s"],
            "process_s": result["process_s"],
            "machine": result["machine"],
            "first_batch_s": batches[0]["batch_ms"] / 1e3 if batches else None,
            "start_to_first_batch_end_s": result["start_to_first_batch_end_s"],
            "state_rows_total": batches[-1]["state_rows_total"] if batches else None,
            "state_store_instances": batches[-1]["state_store_instances"] if batches else None,
            "storage": result.get("storage"), "ours_batches": result.get("ours_batches"),
            "verified": verify(result["sink"], rd.all, first, kind="running" if check else None), "per_batch": batches}


def build_step(runner: Runner, feeder: Feeder, impl: str, label: str, rd: RestartData,
               store_config: dict | None = None, note: str = "") -> dict:
    """A fresh query over the build and steady files: the steady batches' durations."""
    step = stream_step(runner, feeder, impl, label, rd, rd.build + rd.steady,
                       f"{impl}: building a {rd.all.keys:,}-key state ({rd.build} insert + {rd.steady} update "
                       f"batches){note}", store_config=store_config)
    if "error" not in step:
        steady = [b["batch_ms"] / 1e3 for b in step["per_batch"][rd.build:]]
        step["steady_batch_s_median"] = statistics.median(steady) if steady else None
        step["steady_batch_s_all"] = steady
    return step


def _restarts(runner: Runner, feeder: Feeder, impl: str, label: str, rd: RestartData, out: dict,
              restarts: tuple[str, ...]) -> None:
    """One restart per name in ``restarts``, each with the next file (their sizes: ``rd.after_events``)."""
    for name in restarts:
        events = f" of {rd.after_events[feeder.next - rd.build - rd.steady]:,} events" if rd.after_events else ""
        out[name] = stream_step(runner, feeder, impl, label, rd, 1, f"{impl}: {name}, one more batch{events}")


def spark_restart_and_rescale(runner: Runner, rd: RestartData, partitions: int,
                              restarts: tuple[str, ...] = ("restart",), label: str = "") -> dict:
    """RocksDB ``groupBy().count()``: build, restart with one more file (once per name in
    ``restarts``), offline repartition to ``partitions``, restart with one more file."""
    impl = "spark-count-rocksdb"
    label = label or f"{impl}-restart"
    feeder = Feeder(runner.root / "sources" / label, rd.all.files)
    out: dict = {"impl": impl, "state_keys": rd.all.keys}
    out["build"] = build_step(runner, feeder, impl, label, rd)
    if "error" in out["build"]:
        return out
    _restarts(runner, feeder, impl, label, rd, out, restarts)
    checkpoint = str(runner.root / "checkpoints" / label)
    out["repartition"] = runner.run({"kind": "repartition", "impl": impl, "checkpoint": checkpoint,
                                     "partitions": partitions},
                                    f"spark._streamingCheckpointManager.repartition(checkpoint, {partitions})")
    if "error" not in out["repartition"]:
        out["after_repartition"] = stream_step(runner, feeder, impl, label, rd, 1,
                                               f"{impl}: restart after the repartition, one more batch")
    return out


def ours_restart_and_rescale(runner: Runner, rd: RestartData, partitions: int, impl: str,
                             ours_reason: str | None, restarts: tuple[str, ...] = ("restart",),
                             label: str = "") -> dict:
    """Ours: build with parallelism 4, restart with parallelism 4 (once per name in
    ``restarts``), then restart with ``partitions`` on the same state (no offline step: the
    first batch is the rescale)."""
    if ours_reason:
        return {"impl": impl, "status": "not available", "reason": ours_reason}
    label = label or f"{impl}-restart"
    feeder = Feeder(runner.root / "sources" / label, rd.all.files)
    out: dict = {"impl": impl, "state_keys": rd.all.keys, "status": "ok"}
    out["build"] = build_step(runner, feeder, impl, label, rd)
    if "error" in out["build"]:
        return out
    _restarts(runner, feeder, impl, label, rd, out, restarts)
    out["rescale"] = stream_step(runner, feeder, impl, label, rd, 1,
                                 f"{impl}: restart with parallelism {partitions}, one more batch",
                                 parallelism=partitions)
    return out


def derive_restart(results: dict) -> None:
    """Give each restart scenario the first batch of a fresh query of the same implementation on
    an empty state with the same batch size (the main data set's first batch): the share of a
    first batch after a restart that any fresh process pays (JIT, Python workers, code
    generation) whatever the state."""
    first = {r["impl"]: r["first_batch_s"] for r in results["throughput"]
             if r["status"] == "ok" and r["dataset"] == "main"}
    for scenario in (results.get("restart") or {}).values():
        if scenario and scenario.get("impl") in first:
            scenario["fresh_query_first_batch_s"] = first[scenario["impl"]]
