"""Every notebook's code cells run top to bottom without error (no Jupyter needed: the
cells are executed in one namespace, and each cell's last expression is evaluated and,
when it is a lazy DuckDB relation, fetched, the way a kernel displaying it would)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import duckdb
import pytest


def run_cell(source: str, namespace: dict, name: str):
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, name, "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
    return value.fetchall() if isinstance(value, duckdb.DuckDBPyRelation) else value

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, capsys):
    namespace: dict = {"__name__": "__notebook__"}
    shown = [run_cell("".join(cell["source"]), namespace, path.name)
             for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]
    assert all(value is not None for value in shown), "every cell should display something"
    assert namespace["result"].verified_keys > 0
