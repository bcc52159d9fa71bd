"""The benchmark's input and its expected output.

Events are uniform over K string keys ("k000123", plus a long value), written once as one
Parquet file per micro-batch. For each data set the expected output is computed here (polars),
so that every run's output is checked against its input: per batch the number of emitted rows,
the sum of the emitted counts and the sum of key id x count, plus the final count of a sample
of keys.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SAMPLE_KEYS = 32


@dataclass
class DataSet:
    """Input files in micro-batch order (one file per batch) and the output they must produce."""

    name: str
    keys: int
    files: list[Path]
    events: int = 0
    expected: list[dict] | None = None  # per batch: rows, sum_count, sum_id_count
    expected_per_batch: list[dict] | None = None  # the same of each batch's own counts (no state)
    sample: dict[str, int] | None = None  # final count of a few keys


def _key_strings(ids: np.ndarray, width: int) -> pa.Array:
    digits = pc.utf8_lpad(pc.cast(pa.array(ids, pa.int64()), pa.string()), width, "0")
    return pc.binary_join_element_wise("k", digits, "")


def _write_files(folder: Path, batches: list[np.ndarray], keys: int, rng: np.random.Generator,
                 first_index: int = 0, mtime_base: float | None = None) -> list[Path]:
    """One Parquet file per batch of key ids; modification times strictly increase with the
    index, because the file source orders the files it has not seen by modification time."""
    folder.mkdir(parents=True, exist_ok=True)
    width = max(6, len(str(keys - 1)))
    mtime_base = time.time() - 3600 if mtime_base is None else mtime_base
    paths = []
    for i, ids in enumerate(batches, start=first_index):
        path = folder / f"part-{i:05d}.parquet"
        table = pa.table({"key": _key_strings(ids, width), "value": pa.array(rng.integers(0, 1000, ids.size))})
        pq.write_table(table, path)
        os.utime(path, (mtime_base + i, mtime_base + i))
        paths.append(path)
    return paths


def _uniform_batches(rng: np.random.Generator, events: int, keys: int, batches: int) -> list[np.ndarray]:
    ids = rng.integers(0, keys, events)
    return np.array_split(ids, batches)


def _expect(data: DataSet, rng: np.random.Generator) -> None:
    """The per-batch checksums and the final sample counts the files must produce (polars)."""
    import polars as pl

    frames = [pl.read_parquet(f, columns=["key"]).with_columns(pl.lit(i).alias("batch"))
              for i, f in enumerate(data.files)]
    events = pl.concat(frames).with_columns(pl.col("key").str.slice(1).cast(pl.Int64).alias("id"))
    per_key = (events.group_by(["id", "batch"]).len().sort(["id", "batch"])
               .with_columns(pl.col("len").cum_sum().over("id").alias("cum")))
    per_batch = (per_key.group_by("batch")
                 .agg(rows=pl.len(), sum_count=pl.col("cum").sum(), sum_id_count=(pl.col("id") * pl.col("cum")).sum())
                 .sort("batch"))
    data.events = events.height
    data.expected = per_batch.select("rows", "sum_count", "sum_id_count").to_dicts()
    data.expected_per_batch = (per_key.group_by("batch")
                               .agg(rows=pl.len(), sum_count=pl.col("len").sum(),
                                    sum_id_count=(pl.col("id") * pl.col("len")).sum())
                               .sort("batch").select("rows", "sum_count", "sum_id_count").to_dicts())
    final = per_key.group_by("id").agg(pl.col("cum").max())
    picked = final.sample(min(SAMPLE_KEYS, final.height), seed=int(rng.integers(1 << 31)))
    width = max(6, len(str(data.keys - 1)))
    data.sample = {f"k{i:0{width}d}": c for i, c in zip(picked["id"], picked["cum"], strict=True)}


def make_stream_data(root: Path, name: str, events: int, keys: int, batches: int, seed: int) -> DataSet:
    rng = np.random.default_rng(seed)
    data = DataSet(name, keys, _write_files(root / name, _uniform_batches(rng, events, keys, batches), keys, rng))
    _expect(data, rng)
    return data


@dataclass
class RestartData:
    """Files of the restart scenario: ``build`` files that insert every key once, ``steady``
    files of uniform updates over the full state, and one file for each later restart (their
    sizes in ``after_events``)."""

    all: DataSet
    build: int
    steady: int
    after_events: tuple[int, ...] = ()


def make_restart_data(root: Path, keys: int, build: int, steady: int, after: int | list[int], batch_events: int,
                      seed: int, name: str = "restart") -> RestartData:
    """``after``: how many restart files of ``batch_events`` events, or the events of each."""
    rng = np.random.default_rng(seed)
    after_events = [batch_events] * after if isinstance(after, int) else list(after)
    batches = np.array_split(rng.permutation(keys), build)
    batches += [rng.integers(0, keys, batch_events) for _ in range(steady)]
    batches += [rng.integers(0, keys, n) for n in after_events]
    data = DataSet(name, keys, _write_files(root / f"{name}-files", batches, keys, rng))
    _expect(data, rng)
    return RestartData(data, build, steady, tuple(after_events))


def verify(sink: list[dict], data: DataSet, first: int = 0, kind: str | None = "running") -> dict:
    """Compare a run's per-batch sink checksums with those expected of files ``first``...
    (the counts are cumulative, so a restart that lost or doubled state shows); a run over all
    files also has its sample keys checked against their final counts. ``kind`` "per-batch"
    checks each batch's own counts (the stateless floor); None checks nothing (a run whose
    output is not the keyed count, or a sink that does not read it)."""
    if kind is None or any("rows" not in b for b in sink):
        return {"ok": True, "problems": [], "checked": False}
    every = data.expected_per_batch if kind == "per-batch" else data.expected
    expected = every[first:first + len(sink)]
    problems = []
    if len(sink) != len(expected):
        problems.append(f"{len(sink)} output batches for {len(every) - first} input files")
    for i, (got, want) in enumerate(zip(sink, expected, strict=False)):
        problems += [f"batch {first + i}: {field} {got[field]} != {want[field]}"
                     for field in ("rows", "sum_count", "sum_id_count") if got[field] != want[field]]
    if kind == "running" and first == 0 and len(sink) == len(data.expected):
        seen: dict[str, int] = {}
        for batch in sink:
            seen.update(batch["sample"])
        problems += [f"key {k}: count {seen.get(k)} != {v}" for k, v in data.sample.items() if seen.get(k) != v]
    return {"ok": not problems, "problems": problems[:10], "checked": True}
