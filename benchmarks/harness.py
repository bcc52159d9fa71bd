"""What the benchmarks share: timing, the results writer, console and progress, plots, the
machine's description, ratios against a peer, and the keyed inputs of the store benchmarks.

Engine-neutral: nothing here imports pyspark (the Spark session of the streaming benchmarks
is in ``benchmarks.streaming.session``). Results go to ``RESULTS_DIR``; a test points it
elsewhere so that a smoke run never overwrites the recorded results.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.progress import track

from statestore import StateLayout, ValueStateDescriptor, assign_key_groups, task_for_key_group

T = TypeVar("T")

# Where results go: ``benchmarks/results`` unless the suite (``benchmarks.suite``) names its folder.
RESULTS_DIR_ENV = "ICESTATE_BENCH_RESULTS_DIR"
RESULTS_DIR = Path(os.environ.get(RESULTS_DIR_ENV) or Path(__file__).parent / "results")
REPO = Path(__file__).resolve().parents[1]
# Wide when not on a terminal, so that tables in a log are not wrapped at 80 columns.
console = Console(width=None if Console().is_terminal else 200)


# Timing ----------------------------------------------------------------------------------


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """The fastest of ``repeat`` runs of ``fn``, in seconds (the least disturbed by noise)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or zero (a peer that did
    not run, or a figure it did not report): a ratio against a peer is only taken when both ran."""
    return numerator / denominator if numerator and denominator else None


def events_per_s(batches: list[dict]) -> float | None:
    """Input rows per second over streaming ``batches`` (Spark's progress: ``input_rows`` and
    ``batch_ms`` each), or None when they took no time."""
    ms = sum(b["batch_ms"] for b in batches)
    return sum(b["input_rows"] for b in batches) / (ms / 1e3) if ms else None


# Output ----------------------------------------------------------------------------------


def fmt(v: float | None, spec: str = ",.0f", suffix: str = "") -> str:
    """``v`` formatted with ``spec`` and ``suffix`` for a table cell; "-" for a missing figure."""
    return "-" if v is None else f"{v:{spec}}{suffix}"


def progress(items: Iterable[T], description: str) -> Iterator[T]:
    """``items`` with a progress bar on the shared console."""
    yield from track(items, description=description, console=console)


def results_path(name: str) -> Path:
    """Where a result file named ``name`` (e.g. ``bench_store.json``) goes; creates the folder."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / name


def write_results(name: str, results: Any, indent: int = 2, default: Callable | None = None) -> Path:
    """Write ``results`` as JSON to ``results_path(name)``; returns the path."""
    path = results_path(name)
    path.write_text(json.dumps(results, indent=indent, default=default))
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display on a benchmark machine),
    imported on first use: only the benchmarks that draw need matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """Lay out, write and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def repo_env() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``: a benchmark's
    subprocesses, and the Spark Python workers they start (which unpickle the benchmark's
    processors by reference), import ``benchmarks`` and the project from this checkout."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])])}


def machine_info() -> dict:
    """Python version, CPU count and platform of this machine, recorded beside the figures."""
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}


# Inputs of the store benchmarks ------------------------------------------------------------

COUNT = ValueStateDescriptor("count", pa.int64())
USER_KEY_SCHEMA = pa.schema([("user", pa.string())])
MAX_PARALLELISM = 128


def user_keys(ids: np.ndarray) -> pa.Table:
    """The key table ``user = "user-<id>"`` for integer ``ids``."""
    return pa.table({"user": pa.array(np.char.add("user-", ids.astype(str)))})


def count_layout() -> StateLayout:
    """One value state ``count`` (int64) per user key, max parallelism ``MAX_PARALLELISM``."""
    return StateLayout.of(USER_KEY_SCHEMA, [COUNT], max_parallelism=MAX_PARALLELISM)


def owners(keys: pa.Table, parallelism: int) -> np.ndarray:
    """Index of the task that owns each row of the key table ``keys`` at ``parallelism``."""
    key_groups = assign_key_groups(keys, MAX_PARALLELISM).astype(np.int64)
    return task_for_key_group(MAX_PARALLELISM, parallelism, key_groups)


def build_count_state(table: Any, keys: int, checkpoints: int, tasks: int, description: str) -> None:
    """``keys`` running counts (key i holds i) written into ``table`` by ``tasks`` task stores over
    ``checkpoints`` checkpoints, each committing every task's segments as one snapshot. The
    stores are closed; the table stays open."""
    from statestore import StateStore

    stores = [StateStore(table, task_index=t, parallelism=tasks) for t in range(tasks)]
    chunk = -(-keys // checkpoints)
    for lo in progress(range(0, keys, chunk), description):
        ids = np.arange(lo, min(lo + chunk, keys))
        owner = owners(user_keys(ids), tasks)
        checkpoint_id = table.next_checkpoint_id()
        segments = []
        for t, store in enumerate(stores):
            mine = ids[owner == t]
            store.get_state(COUNT).update_batch(user_keys(mine), pa.array(mine, pa.int64()))
            segments += store.flush(checkpoint_id)
        table.commit_checkpoint(checkpoint_id, segments, parallelism=tasks)
        for store in stores:
            store.checkpoint_complete(checkpoint_id)
    for store in stores:
        store.close()
