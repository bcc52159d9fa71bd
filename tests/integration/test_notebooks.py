"""The notebooks in notebooks/: each runs top to bottom in a real Jupyter kernel (``notebook_runner``:
nbclient and ipykernel) without error, so the ``assert`` statements in its cells, the checks it
shows its readers, hold; every code cell shows something; the notebooks that plot draw at least one
image. The committed files carry the outputs of one such run (refreshed with
``python -m tests.integration.notebook_runner notebooks/NAME.ipynb``), of the shape a run gives now.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from tests.integration.notebook_runner import ROOT, kernel_manager, run_notebook

NOTEBOOKS = ROOT / "notebooks"
PNG = "image/png"


@dataclass(frozen=True)
class Expected:
    spark: bool  # runs a local Spark session (needs Java)
    plots: bool  # draws at least one figure


# Every notebook there must be: one deleted, renamed or added without a line here fails.
EXPECTED = {
    "quickstart.ipynb": Expected(spark=True, plots=True),
    "time_travel.ipynb": Expected(spark=False, plots=True),
    "rescale_and_skew.ipynb": Expected(spark=False, plots=True),
    "change_feed_and_repair.ipynb": Expected(spark=True, plots=True),
    "store_without_spark.ipynb": Expected(spark=False, plots=False),
}


def code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def shape(cell: nbformat.NotebookNode) -> set[tuple[str, ...]]:
    """What kinds of output a cell shows: streams by name (standard error left out: warnings may
    come and go), results and displays by MIME type."""
    kinds = set()
    for output in cell.outputs:
        if output.output_type == "stream":
            if output.name != "stderr":
                kinds.add(("stream", output.name))
        else:
            kinds.update((output.output_type, mime) for mime in output.get("data", {}))
            if output.output_type == "error":
                kinds.add(("error", output.ename))
    return kinds


def images(notebook: nbformat.NotebookNode) -> int:
    return sum(PNG in output.get("data", {}) for cell in code_cells(notebook) for output in cell.outputs)


def notebook_params() -> list:
    return [pytest.param(name, marks=[pytest.mark.spark] if expected.spark else [], id=name.removesuffix(".ipynb"))
            for name, expected in sorted(EXPECTED.items())]


def test_the_notebooks_are_the_expected_ones():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", notebook_params())
def test_the_committed_notebook_carries_the_outputs_of_a_whole_run(name: str):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    assert notebook.cells[0].cell_type == "markdown", "a notebook opens with what it shows and how to run it"
    cells = code_cells(notebook)
    assert cells
    assert [i for i, cell in enumerate(cells) if not cell.outputs] == [], "code cells committed without outputs"
    assert [cell.execution_count for cell in cells] == list(range(1, len(cells) + 1)), \
        "the outputs come from one run, top to bottom"
    assert not [kind for cell in cells for kind in shape(cell) if kind[0] == "error"], "an error was committed"
    if EXPECTED[name].plots:
        assert images(notebook) > 0, "the committed notebook lacks its figures"


@pytest.mark.slow
@pytest.mark.parametrize("name", notebook_params())
def test_the_notebook_runs_in_a_kernel(name: str):
    if EXPECTED[name].spark and shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("this notebook runs Spark, which needs Java (java on PATH or JAVA_HOME)")
    path = NOTEBOOKS / name
    executed = run_notebook(path)  # raises on any cell's error: its asserts included
    cells = code_cells(executed)
    assert [i for i, cell in enumerate(cells) if not cell.outputs] == [], "every code cell shows something"
    if EXPECTED[name].plots:
        assert images(executed) > 0, "the notebook draws its figures"
    committed = code_cells(nbformat.read(path, as_version=4))
    stale = [i for i, (now, then) in enumerate(zip(cells, committed, strict=True)) if shape(now) != shape(then)]
    assert stale == [], (f"the committed outputs of code cells {stale} are not what they show now: refresh them "
                         f"with python -m tests.integration.notebook_runner {path.relative_to(ROOT)}")


def test_the_runner_uses_this_interpreter_whatever_kernels_are_installed(tmp_path: Path, monkeypatch):
    """The kernel is ipykernel's own spec run by this Python, even where a user-level ``python3``
    kernelspec names another one (a fresh machine has none; a developer's may)."""
    decoy = tmp_path / "jupyter" / "kernels" / "python3"
    decoy.mkdir(parents=True)
    (decoy / "kernel.json").write_text(json.dumps({"argv": ["/nonexistent/python", "-m", "ipykernel_launcher", "-f",
                                                            "{connection_file}"], "display_name": "decoy",
                                                   "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))
    assert kernel_manager().kernel_spec.argv[0] == sys.executable
