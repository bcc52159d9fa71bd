"""The crash harness (``benchmarks/crash_harness.py``) in a bounded run: a few seeded iterations
of SIGKILLed writers that checkpoint, compact and expire, each checked against the model of an
uninterrupted run (which is itself run and checked first), with the sweep "an hour later"
leaving exactly the referenced files. The full campaign (hundreds of iterations) is the
script's; this keeps it from rotting and fails on any lost, doubled or leaked state."""

from __future__ import annotations

import json

import pytest

from benchmarks import crash_harness, harness


@pytest.mark.slow
def test_killed_writers_resume_with_exactly_the_uninterrupted_state(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    summary = crash_harness.run_store(iterations=2, kills=2, seed=20261125, root=tmp_path / "runs")
    assert summary["failures"] == [], summary["failures"]
    assert summary["kills"] >= 1, summary  # a kill lands in the first run of each iteration almost surely
    assert summary["kills"] + summary["finished_before_kill"] <= 2 * 2
    written = json.loads((tmp_path / "results" / "crash_harness.json").read_text())
    assert len(written["runs"]) == 2 and written["seed"] == 20261125


def test_the_model_is_what_the_writes_do():
    """The model the harness checks against: puts, clears, appends and map removals in order."""
    ops = crash_harness.batch_ops(1, 0)
    model = crash_harness.Model.after(1, 0)
    cleared = set(ops["v_clear"])
    assert all(model.v.get(k) == (None if k in cleared else v) for k, v in ops["v_put"])
    assert crash_harness.Model.after(1, 3) != crash_harness.Model.after(1, 2)
    assert crash_harness.batch_ops(1, 5) == crash_harness.batch_ops(1, 5)  # seeded
