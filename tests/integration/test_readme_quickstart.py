"""The README's quickstart ("Bring an existing job over: one call"), run as written: its first
Python block is copied into a file and run by a fresh interpreter in a folder of its own, twice,
with more clicks between the runs. The first run's output holds every user with two clicks or
more and their counts; the second run continues from the state the first committed (counts
over both files), as the README says a restart on the same checkpoint does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Bring an existing job over: one call"


def quickstart() -> str:
    """The first ```python block after the quickstart's heading in the README."""
    text = (REPO / "README.md").read_text()
    assert SECTION in text, f"the README lost its section {SECTION!r}"
    found = re.search(r"```python\n(.*?)```", text[text.index(SECTION):], re.S)
    assert found, "the quickstart section has no Python block"
    return found.group(1)


def write_clicks(folder: Path, name: str, users: list[str]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("".join(json.dumps({"user": u, "page": f"p{i}"}) + "\n" for i, u in enumerate(users)))


def run(work: Path) -> None:
    # Spark's own setting for the host to bind, not the program's: the program stays as written.
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "quickstart.py"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=420)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def counts(work: Path) -> list[tuple[str, int]]:
    files = sorted((work / "out" / "counts").glob("*.parquet"))
    rows = [r for f in files for r in pq.read_table(f, columns=["user", "count"]).to_pylist()]
    return sorted((r["user"], r["count"]) for r in rows)


def test_the_readme_quickstart_runs_as_written_and_restarts_from_its_state(tmp_path):
    (tmp_path / "quickstart.py").write_text(quickstart())
    first = ["ann", "bob", "ann", "cid", "ann", "bob", "dee"]
    write_clicks(tmp_path / "clicks", "1.json", first)
    run(tmp_path)
    tally = Counter(first)
    first_rows = [(u, n) for u, n in tally.items() if n >= 2]  # ann 3, bob 2
    assert counts(tmp_path) == sorted(first_rows)
    assert list((tmp_path / "warehouse").iterdir()), "the state is not in the warehouse the program gave"
    # A restart on the same checkpoint: the counts go on from the first run's state.
    second = ["cid", "dee", "ann", "eve"]
    write_clicks(tmp_path / "clicks", "2.json", second)
    run(tmp_path)
    tally.update(second)
    second_rows = [(u, tally[u]) for u in set(second) if tally[u] >= 2]  # ann 4, cid 2, dee 2
    assert counts(tmp_path) == sorted(first_rows + second_rows)
