"""Spark's Python processes import the installed pyspark, not its zipped copy.

Spark starts every Python process (the workers' daemon and each worker it forks, the planners
of Python data sources, a streaming Python source) with ``$SPARK_HOME/python/lib/pyspark.zip``
and py4j's zip first on ``PYTHONPATH``. Under a pip-installed pyspark, ``SPARK_HOME`` is the
installed package itself, so that zip holds the very modules installed beside it, but Python
compiles modules imported from a zip anew in every process (no bytecode cache), and
``importlib.invalidate_caches`` (which Spark calls when a task adds a path) reads the zip's
whole directory again for each zip importer. Spark also puts its ``spark-core`` jar on the path
(no Python module in it; 6k entries, 50 ms to read its directory in each process). Importing
``pyspark.worker`` costs 0.7-0.9 s of CPU from the zip against 0.12-0.14 s installed (measured
on this machine); a query's start runs about eight such processes on two cores
(docs/decisions.md, "Spark's Python processes import the installed pyspark").

``icestate_pyspark_path.pth`` (installed at the root of site-packages) calls ``prefer_installed``
at every interpreter's start: it drops from ``sys.path`` the zips and jars that lie inside an
installed pyspark package whose py4j is installed beside it, so the same code is imported from
the installed files. Any other entry, and zips of a separate Spark distribution, stay as they are.
"""

from __future__ import annotations

import os
import sys


def _installed_package(entry: str) -> str | None:
    """The pyspark package directory that ``entry`` is a bundled archive of
    (``<site>/pyspark/python/lib/*.zip`` or ``<site>/pyspark/jars/*.jar``), else None."""
    folder = os.path.dirname(os.path.abspath(entry))
    if entry.endswith(".zip"):
        package, inside = os.path.dirname(os.path.dirname(folder)), os.path.join("python", "lib")
    elif entry.endswith(".jar"):
        package, inside = os.path.dirname(folder), "jars"
    else:
        return None
    return package if os.path.basename(package) == "pyspark" and folder == os.path.join(package, inside) else None


def bundled_archives(path: list[str]) -> list[str]:
    """The entries of ``path`` that are archives bundled in an installed pyspark package
    (``<site>/pyspark/python/lib/*.zip``, ``<site>/pyspark/jars/*.jar``) whose package and py4j
    are installed in ``<site>``: the same modules are importable from the installed files."""
    found = []
    for entry in path:
        package = _installed_package(entry)
        if (package is not None and os.path.isfile(os.path.join(package, "__init__.py"))
                and os.path.isfile(os.path.join(os.path.dirname(package), "py4j", "__init__.py"))):
            found.append(entry)
    return found


def prefer_installed(path: list[str] | None = None) -> list[str]:
    """Remove ``bundled_archives`` from ``path`` (``sys.path`` by default); returns what went.
    Never raises: an interpreter's start must not fail here."""
    path = sys.path if path is None else path
    try:
        gone = bundled_archives(path)
        for entry in gone:
            path.remove(entry)
        return gone
    except Exception:
        return []
