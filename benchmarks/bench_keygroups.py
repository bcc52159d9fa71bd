"""Benchmark of key-group assignment: the numpy-vectorized Spark xxhash64 against a Python
loop over the ``xxhash`` C binding (the obvious alternative), per key type.

Prints a table and writes ``benchmarks/results/bench_keygroups.json``.
Run: ``.venv/bin/python -m benchmarks.bench_keygroups [--n 1000000]``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import typer
import xxhash
from rich.table import Table

from benchmarks.harness import best_of, console, write_results
from statestore.keygroups import SPARK_XXHASH64_SEED, assign_key_groups

N = 128


def _loop_long(values: list[int]) -> list[int]:
    out = []
    for v in values:
        h = xxhash.xxh64_intdigest(v.to_bytes(8, "little", signed=True), seed=SPARK_XXHASH64_SEED)
        out.append((h - (1 << 64) if h >= 1 << 63 else h) % N)
    return out


def _loop_str(values: list[str]) -> list[int]:
    out = []
    for v in values:
        h = xxhash.xxh64_intdigest(v.encode(), seed=SPARK_XXHASH64_SEED)
        out.append((h - (1 << 64) if h >= 1 << 63 else h) % N)
    return out


def main(n: int = typer.Option(1_000_000, help="keys per measurement")) -> None:
    rng = np.random.default_rng(0)
    longs = pa.array(rng.integers(-(1 << 62), 1 << 62, n))
    strs = pa.array(np.char.add("user-", rng.integers(0, 10**9, n).astype(str)))
    results = {}
    for label, arr, loop in (("long", longs, _loop_long), ("string", strs, _loop_str)):
        ours = assign_key_groups([arr], N)
        ref = loop(arr.to_pylist())
        if ours.tolist() != ref:
            raise AssertionError(f"{label}: vectorized key groups differ from the xxhash loop")
        t_vec = best_of(lambda a=arr: assign_key_groups([a], N))
        # The input is Arrow in both cases, so the loop pays for converting it to Python.
        t_loop = best_of(lambda a=arr, f=loop: f(a.to_pylist()))
        results[label] = {"keys": n, "vectorized_s": t_vec, "python_loop_s": t_loop,
                          "vectorized_keys_per_s": n / t_vec, "speedup": t_loop / t_vec}
    write_results("bench_keygroups.json", results)
    t = Table(title=f"key groups of {n:,} keys (N={N}); peer: Python loop over the xxhash C binding")
    for col in ("type", "vectorized ms", "loop ms", "speedup"):
        t.add_column(col, justify="right")
    for label, r in results.items():
        t.add_row(label, f"{r['vectorized_s'] * 1e3:.0f}", f"{r['python_loop_s'] * 1e3:.0f}", f"{r['speedup']:.1f}x")
    console.print(t)


if __name__ == "__main__":
    typer.run(main)
