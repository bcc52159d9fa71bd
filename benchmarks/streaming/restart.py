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


class _Feeder:
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


def _stream_step(runner: Runner, feeder: _Feeder, impl: str, label: str, rd: RestartData, files: int,
                 title: str, parallelism: int = 4) -> dict:
    first = feeder.add(files)
    job = stream_job(impl, feeder.folder, runner.root, label, rd.all.sample, parallelism)
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
            "verified": verify(result["sink"], rd.all, first), "per_batch": batches}


def _build_step(runner: Runner, feeder: _Feeder, impl: str, label: str, rd: RestartData) -> dict:
    step = _stream_step(runner, feeder, impl, label, rd, rd.build + rd.steady,
                        f"{impl}: building a {rd.all.keys:,}-key state ({rd.build} insert + {rd.steady} update "
                        "batches)")
    if "error" not in step:
        steady = [b["batch_ms"] / 1e3 for b in step["per_batch"][rd.build:]]
        step["steady_batch_s_median"] = statistics.median(steady) if steady else None
        step["steady_batch_s_all"] = steady
    return step


def spark_restart_and_rescale(runner: Runner, rd: RestartData, partitions: int) -> dict:
    """RocksDB ``groupBy().count()``: build, restart with one more file, offline repartition to
    ``partitions``, restart with one more file."""
    impl, label = "spark-count-rocksdb", "spark-count-rocksdb-restart"
    feeder = _Feeder(runner.root / "sources" / label, rd.all.files)
    out: dict = {"impl": impl, "state_keys": rd.all.keys}
    out["build"] = _build_step(runner, feeder, impl, label, rd)
    if "error" in out["build"]:
        return out
    out["restart"] = _stream_step(runner, feeder, impl, label, rd, 1, f"{impl}: restart, one more batch")
    checkpoint = str(runner.root / "checkpoints" / label)
    out["repartition"] = runner.run({"kind": "repartition", "impl": impl, "checkpoint": checkpoint,
                                     "partitions": partitions},
                                    f"spark._streamingCheckpointManager.repartition(checkpoint, {partitions})")
    if "error" not in out["repartition"]:
        out["after_repartition"] = _stream_step(runner, feeder, impl, label, rd, 1,
                                                f"{impl}: restart after the repartition, one more batch")
    return out


def ours_restart_and_rescale(runner: Runner, rd: RestartData, partitions: int, impl: str,
                             ours_reason: str | None) -> dict:
    """Ours: build with parallelism 4, restart with parallelism 4, then restart with
    ``partitions`` on the same state (no offline step: the first batch is the rescale)."""
    if ours_reason:
        return {"impl": impl, "status": "not available", "reason": ours_reason}
    label = f"{impl}-restart"
    feeder = _Feeder(runner.root / "sources" / label, rd.all.files)
    out: dict = {"impl": impl, "state_keys": rd.all.keys, "status": "ok"}
    out["build"] = _build_step(runner, feeder, impl, label, rd)
    if "error" in out["build"]:
        return out
    out["restart"] = _stream_step(runner, feeder, impl, label, rd, 1, f"{impl}: restart, one more batch")
    out["rescale"] = _stream_step(runner, feeder, impl, label, rd, 1,
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
