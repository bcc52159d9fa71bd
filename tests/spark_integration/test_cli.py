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


# --- errors: one line each (defect 12 of the reliability issue) --------------------------------


def bad_commands(warehouse: str) -> dict[str, list[str]]:
    """Commands that must fail, each for another reason a user meets."""
    where = ["--warehouse", warehouse]
    return {
        "missing table": ["checkpoints", *where, "--table", "nope"],
        "escaping name": ["checkpoints", *where, "--table", "../victim"],
        "bad SQL": ["sql", *where, "--table", "op", "SELEC 1"],
        "writing SQL": ["sql", *where, "--table", "op", "COPY (SELECT 1) TO '/tmp/x.csv'"],
        "host file": ["sql", *where, "--table", "op", "SELECT * FROM read_text('/etc/passwd')"],
        "no such checkpoint": ["savepoint", "keep", *where, "--table", "op", "--checkpoint", "99"],
        "no such savepoint": ["fork", "f", *where, "--table", "op", "--savepoint", "nope"],
        "bad savepoint name": ["savepoint", "a/b", *where, "--table", "op"],
        "compact a missing table": ["compact", *where, "--table", "nope"],
        "recover a present table": ["recover", *where, "--table", "op"],
    }


@pytest.fixture(scope="module")
def one_table(tmp_path_factory) -> str:
    import pyarrow as pa

    from catalog import IcebergStateTable
    from statestore import StateLayout, StateStore, ValueStateDescriptor

    warehouse = str(tmp_path_factory.mktemp("wh"))
    layout = StateLayout.of(pa.schema([("k", pa.int64())]), [ValueStateDescriptor("v", pa.int64())], 8)
    with IcebergStateTable.open(layout, warehouse=warehouse, table_name="op") as table:
        store = StateStore(table)
        store.get_state("v").update_batch(pa.table({"k": pa.array([1, 2], pa.int64())}), [10, 20])
        store.checkpoint(batch_id=0)
        store.close()
    return warehouse


@pytest.mark.parametrize("case", list(bad_commands("wh")))
def test_every_error_is_one_line_naming_what_is_wrong(one_table, case, monkeypatch):
    from catalog.cli import DEBUG

    monkeypatch.setitem(DEBUG, "traceback", False)  # ``--debug`` below sets it for the process
    argv = bad_commands(one_table)[case]
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "80"})
    assert result.exit_code == 1, (case, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (case, result.stderr)
    assert "Traceback" not in result.output and "--debug shows the traceback" in lines[0]
    debug = CliRunner().invoke(app, ["--debug", *argv], env={"COLUMNS": "80"})
    assert debug.exit_code == 1 and "Traceback (most recent call last)" in debug.stderr, (case, debug.stderr)
    assert debug.stderr.splitlines()[-1] == lines[0].removesuffix(" (--debug shows the traceback)")


def test_a_damaged_metadata_file_is_one_line_naming_it(tmp_path):
    import pyarrow as pa

    from catalog import IcebergStateTable
    from catalog.fileio import METADATA_FILES
    from statestore import StateLayout, StateStore, ValueStateDescriptor

    warehouse = str(tmp_path / "wh")
    layout = StateLayout.of(pa.schema([("k", pa.int64())]), [ValueStateDescriptor("v", pa.int64())], 8)
    with IcebergStateTable.open(layout, warehouse=warehouse, table_name="op") as table:
        store = StateStore(table)
        store.get_state("v").update_batch(pa.table({"k": pa.array([1], pa.int64())}), [10])
        store.checkpoint(batch_id=0)
        store.close()
        metadata = table.iceberg_table.metadata_location.removeprefix("file://")
    Path(metadata).write_text('{"format-version": 2, "table-uuid": ')  # truncated
    METADATA_FILES.clear()
    result = CliRunner().invoke(app, ["checkpoints", "--warehouse", warehouse, "--table", "op"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    assert Path(metadata).name in lines[0] and "Traceback" not in result.output
