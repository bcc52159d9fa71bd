"""Lazy package exports (PEP 562): a package's public names imported when first used.

A Python worker that runs a task imports only the modules of the task path; a package whose
``__init__`` imported its whole public surface would make every worker pay for the driver's
side too (catalog clients, DuckDB, pyspark's DataFrame API).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``exports`` maps each public name to the module
    that defines it (a name that is its module's last component is the module itself); the
    first use imports it and keeps it in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module)
        value = loaded if module == f"{package}.{name}" else getattr(loaded, name)
        namespace[name] = value
        return value

    return __getattr__
