"""``icestate_pyspark_path``: which ``sys.path`` entries Spark's Python processes drop (the
archives bundled in an installed pyspark, when the same modules are installed beside them),
and that an interpreter with the ``.pth`` installed starts with them gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import icestate_pyspark_path as pp


def _installed(site: Path, py4j: bool = True) -> dict[str, str]:
    """A site directory with pyspark (and py4j) installed and pyspark's bundled archives."""
    lib = site / "pyspark" / "python" / "lib"
    lib.mkdir(parents=True)
    (site / "pyspark" / "jars").mkdir()
    (site / "pyspark" / "__init__.py").write_text("")
    if py4j:
        (site / "py4j").mkdir()
        (site / "py4j" / "__init__.py").write_text("")
    return {"zip": str(lib / "pyspark.zip"), "py4j": str(lib / "py4j-0.10.9.9-src.zip"),
            "jar": str(site / "pyspark" / "jars" / "spark-core_2.13-4.3.0.jar")}


def test_the_bundled_archives_of_an_installed_pyspark_go(tmp_path):
    a = _installed(tmp_path / "site")
    other = tmp_path / "spark-dist" / "python" / "lib" / "pyspark.zip"  # a Spark distribution's
    path = ["/app", a["zip"], a["py4j"], a["jar"], str(other), "/usr/lib/python311.zip", str(tmp_path / "site")]
    assert pp.prefer_installed(path) == [a["zip"], a["py4j"], a["jar"]]
    assert path == ["/app", str(other), "/usr/lib/python311.zip", str(tmp_path / "site")]


@pytest.mark.parametrize("missing", ["py4j", "pyspark"])
def test_archives_stay_when_their_modules_are_not_installed_beside_them(tmp_path, missing):
    a = _installed(tmp_path / "site", py4j=missing != "py4j")
    if missing == "pyspark":
        os.remove(tmp_path / "site" / "pyspark" / "__init__.py")
    path = [a["zip"], a["py4j"], a["jar"]]
    assert pp.prefer_installed(path) == [] and path == [a["zip"], a["py4j"], a["jar"]]


def test_a_broken_path_never_fails_an_interpreter_start():
    assert pp.prefer_installed([None]) == []  # type: ignore[list-item]


def test_the_pth_drops_them_at_an_interpreter_start():
    """The environment's interpreter, started as Spark starts its Python processes (the
    bundled zips first on PYTHONPATH), imports the installed pyspark (scripts/setup.sh
    installs the .pth into an editable environment; a regular install ships it)."""
    import pyspark

    site = Path(pyspark.__file__).parent.parent
    if not (site / "icestate_pyspark_path.pth").is_file():
        pytest.fail(f"icestate_pyspark_path.pth is not installed in {site}: run scripts/setup.sh")
    lib = Path(pyspark.__file__).parent / "python" / "lib"
    bundled = sorted(str(p) for p in lib.glob("*.zip"))
    assert any(p.endswith("pyspark.zip") for p in bundled)
    out = subprocess.run([sys.executable, "-c", "import sys, pyspark; print(pyspark.__file__); "
                          "print([p for p in sys.path if p.endswith('.zip') and 'pyspark' in p])"],
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(bundled)}, capture_output=True,
                         text=True, check=True, cwd="/")
    assert out.stderr == ""
    file, zips = out.stdout.splitlines()
    assert file == pyspark.__file__ and zips == "[]"
