"""The state-table commands of ``icestate`` (``catalog.cli.tables``), invoked on their own.
The program that mounts them is tested in tests/spark_integration/test_cli.py."""

from __future__ import annotations

from typer.testing import CliRunner

from catalog.cli import tables as app
from tests.catalog.catalog_helpers import commit_next


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


def test_savepoint_fork_and_refs_commands(open_table, warehouse):
    table = open_table()
    commit_next(table, [[1], [9]])
    commit_next(table, [[1]])
    table.close()
    runner = CliRunner()
    base = ["--warehouse", warehouse, "--table", "op"]
    saved = runner.invoke(app, ["savepoint", "keep", *base, "--checkpoint", "1"])
    assert saved.exit_code == 0, saved.output
    forked = runner.invoke(app, ["fork", "v2", *base, "--savepoint", "keep"])
    assert forked.exit_code == 0, forked.output
    assert "branch='v2'" in forked.output
    listed = runner.invoke(app, ["refs", *base])
    assert listed.exit_code == 0, listed.output
    assert "keep" in listed.output and "v2" in listed.output
    on_fork = runner.invoke(app, ["checkpoints", *base, "--branch", "v2"])
    assert on_fork.exit_code == 0 and "(v2)" in on_fork.output, on_fork.output
    query = runner.invoke(app, ["sql", *base, "--savepoint", "keep", "SELECT count(*) AS n FROM state_count"])
    assert query.exit_code == 0 and "2" in query.output, query.output
    bad = runner.invoke(app, ["savepoint", "keep", *base])
    assert bad.exit_code != 0 and "already has a savepoint" in str(bad.exception)
