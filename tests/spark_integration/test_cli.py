"""The ``icestate`` program: one app that mounts the state-table commands at the top level
beside the main job, with help written for users (no internal docstrings on ``--help``).

The installed console script and ``python -m spark_integration.cli`` are run as
subprocesses (with this checkout first on PYTHONPATH), so the mount is checked the way the
installed Typer does it; the help of each command is read in process (fast).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from catalog.cli import tables
from spark_integration.cli import app

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["stream", "checkpoints", "sql", "savepoint", "fork", "refs", "compact"]
# Words of the code, not of the user: a module docstring leaking into --help would show them.
INTERNAL = [".py", "typer", "module", "spark_integration", "statestore", "docstring", "__"]
# Names users write that look like code: pyiceberg's configuration file and environment variables.
USER_NAMES = re.compile(r"\.pyiceberg\.yaml|PYICEBERG_CATALOG__\S*")


def run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def installed_script() -> str:
    script = Path(sys.executable).with_name("icestate")
    if not script.exists():
        pytest.skip(f"no installed icestate console script beside {sys.executable}")
    return str(script)


def assert_for_users(text: str) -> None:
    text = USER_NAMES.sub("", text)
    leaked = [word for word in INTERNAL if word in text.lower()]
    assert not leaked, f"internal text {leaked} in help:\n{text}"


@pytest.mark.parametrize("program", ["script", "module"])
def test_the_program_lists_every_command_at_the_top_level(program):
    argv = [installed_script()] if program == "script" else [sys.executable, "-m", "spark_integration.cli"]
    out = run([*argv, "--help"])
    assert out.returncode == 0, out.stderr
    for command in COMMANDS:
        assert f" {command} " in out.stdout, f"{command} missing from:\n{out.stdout}"
    assert " demo " not in out.stdout  # the store-only demo is a notebook now
    if program == "script":
        assert_for_users(out.stdout)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_written_for_users(command):
    argv = ["--help"] if command is None else [command, "--help"]
    out = CliRunner().invoke(app, argv, prog_name="icestate", env={"COLUMNS": "120"})
    assert out.exit_code == 0, out.output
    assert "Example" in out.output or command is None
    assert_for_users(out.output)


def test_every_option_has_a_help_text():
    import typer.main

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for param in command.params:
            assert getattr(param, "help", None) or param.name == "help", f"{name} --{param.name} has no help"


def test_a_table_command_runs_through_the_installed_program(tmp_path):
    from catalog import IcebergStateTable
    from tests.catalog.catalog_helpers import LAYOUT, commit_next

    warehouse = str(tmp_path / "wh")
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op") as table:
        commit_next(table, [[1], [9]], properties={"note": "hi"})
    out = run([installed_script(), "checkpoints", "--warehouse", warehouse, "--table", "op"])
    assert out.returncode == 0, out.stderr
    assert "note" in out.stdout and "state.op (main)" in out.stdout


def test_the_program_mounts_the_table_commands_without_changing_them():
    assert "stream" not in {c.callback.__name__ for c in tables.registered_commands}
    assert CliRunner().invoke(app, ["demo"]).exit_code != 0
