"""Runs a notebook's code cells without Jupyter, the way a kernel would, and can write
what each cell shows back into the notebook (its committed outputs).

The cells run top to bottom in one namespace. A cell's last expression is evaluated and
shown as its result (its ``repr``, as a kernel's plain-text display); a lazy DuckDB
relation is fetched, as displaying it would. Printed text is kept as the cell's stream
output. Refresh a notebook's outputs with the project's venv, from the repository root:

    python -m tests.integration.notebook_runner notebooks/store_without_spark.ipynb
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import duckdb


@dataclass
class NotebookRun:
    namespace: dict
    shown: list = field(default_factory=list)  # each code cell's result (None: it showed nothing)


def run_cell(source: str, namespace: dict, name: str):
    """Run one cell; return its last expression's value (None when it ends in a statement)."""
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, name, "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
    if isinstance(value, duckdb.DuckDBPyRelation):
        value.fetchall()  # a relation is lazy: fetching runs its query, as displaying it would
    return value


def run_notebook(path: Path, write_outputs: bool = False) -> NotebookRun:
    """Run every code cell of ``path``; with ``write_outputs`` store what each showed in the file."""
    notebook = json.loads(path.read_text())
    run = NotebookRun({"__name__": "__notebook__"})
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    for number, cell in enumerate(code_cells, start=1):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            value = run_cell("".join(cell["source"]), run.namespace, path.name)
        run.shown.append(value)
        cell["execution_count"] = number
        cell["outputs"] = _outputs(printed.getvalue(), value, number)
    if write_outputs:
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    return run


def _outputs(printed: str, value, number: int) -> list[dict]:
    outputs = []
    if printed:
        outputs.append({"name": "stdout", "output_type": "stream", "text": printed.splitlines(keepends=True)})
    if value is not None:
        outputs.append({"data": {"text/plain": repr(value).splitlines(keepends=True)}, "execution_count": number,
                        "metadata": {}, "output_type": "execute_result"})
    return outputs


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        run_notebook(Path(arg), write_outputs=True)
        print(f"executed {arg}")
