"""The ``icestate`` commands that read a state table (the demo job is run by scripts/run-main.sh)."""

from __future__ import annotations

from catalog_helpers import commit_next
from typer.testing import CliRunner

from catalog.cli import app


def test_checkpoints_and_sql_commands(open_table, warehouse):
    table = open_table()
    commit_next(table, [[1], [9]], properties={"note": "hi"})
    commit_next(table, [[1]])
    table.close()
    runner = CliRunner()
    listed = runner.invoke(app, ["checkpoints", "--warehouse", warehouse, "--table", "op"])
    assert listed.exit_code == 0, listed.output
    assert "note" in listed.output and "20" in listed.output  # properties and batch id of checkpoint 2
    query = runner.invoke(app, ["sql", "--warehouse", warehouse, "--table", "op", "--checkpoint", "1",
                                'SELECT count(*) AS n FROM state_count'])
    assert query.exit_code == 0, query.output
    assert "2" in query.output
