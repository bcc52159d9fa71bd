"""A ``.pyiceberg.yaml`` in the current directory can name code for pyiceberg to import: it is
used only when it is this user's own and no one else may write to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hostile import MARKER_ENV

ROOT = Path(__file__).resolve().parents[2]
# A catalog whose tables' FileIO is a class that marks when called.
CONFIG = ("catalog:\n  evil:\n    type: sql\n    uri: sqlite:///{work}/catalog.db\n    warehouse: file://{work}/wh\n"
          "    py-io-impl: tests.hostile.MarkOnCall\n")
OPEN = ("from catalog.table_ref import TableRef\n"
        "from tests.catalog.catalog_helpers import LAYOUT\n"
        "TableRef('t', catalog_name='evil', catalog_properties={}).open(LAYOUT)\n")


def run_in(work: Path, home: Path, marker: Path, code: str = OPEN, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYICEBERG")}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), COLUMNS="200", **{MARKER_ENV: str(marker)})
    command = [sys.executable, "-c", code] if not args else [sys.executable, "-m", "spark_integration.cli", *args]
    return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def places(tmp_path: Path) -> tuple[Path, Path, Path]:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / ".pyiceberg.yaml").write_text(CONFIG.format(work=work))
    return work, home, tmp_path / "called"


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_configuration_file_of_another_user_is_not_used(places):
    work, home, marker = places
    os.chown(work / ".pyiceberg.yaml", 65534, 65534)
    done = run_in(work, home, marker)
    assert done.returncode != 0 and "CatalogUnavailableError" in done.stderr
    assert f"{work / '.pyiceberg.yaml'} is not this user's own (owned by uid 65534" in done.stderr
    assert not marker.exists()
    # The command line says it in one line.
    done = run_in(work, home, marker, "", "checkpoints", "--catalog", "evil", "--table", "t")
    assert done.returncode == 1 and "is not this user's own" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not marker.exists()


def test_a_configuration_file_others_may_write_is_not_used(places):
    work, home, marker = places
    os.chmod(work / ".pyiceberg.yaml", 0o666)
    done = run_in(work, home, marker)
    assert done.returncode != 0 and "mode 666" in done.stderr
    assert not marker.exists()


def test_the_users_own_configuration_file_is_used(places):
    work, home, marker = places
    os.chmod(work / ".pyiceberg.yaml", 0o644)
    run_in(work, home, marker)
    assert marker.exists()  # the class it names was called: the configuration is the user's to set
