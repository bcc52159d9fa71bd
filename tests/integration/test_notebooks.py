"""Every notebook runs top to bottom without error, every code cell shows something, and
each notebook's own checks hold (see ``notebook_runner``: no Jupyter needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.notebook_runner import run_notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

# What each notebook must have shown, beyond running: the verification it exists for.
CHECKS = {
    # The store alone: after a crash, every key's count restored equals an independent
    # tally, and an older checkpoint holds the tally of its time (asserted in its cells).
    "store_without_spark.ipynb": lambda ns: ns["verified_keys"] > 0 and ns["restored"] == ns["tally"]
    and ns["older"] == ns["tally_at"][ns["oldest"]],
    # SQL over the state: the live counts add up to every event written.
    "inspect_state.ipynb": lambda ns: ns["con"].sql("SELECT sum(v_count) FROM state_count").fetchall()[0][0]
    == ns["events_written"],
}


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"
    assert {p.name for p in NOTEBOOKS} == set(CHECKS), "each notebook needs its check in CHECKS"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path):
    run = run_notebook(path)
    assert all(value is not None for value in run.shown), "every cell should display something"
    assert CHECKS[path.name](run.namespace)
