"""Every name a user gives the store, checked in one place.

Names become parts of paths and identifiers: a table and its namespace name the table's
directory (``<warehouse>/<namespace>/<table>`` in the embedded catalog) and its Iceberg
identifier ``namespace.table``; a fork names a directory (``data/branches/<fork>``) and an
Iceberg branch; a savepoint an Iceberg tag; an operator state variable a column. So each is
checked whole (``fullmatch``: a trailing newline is not a name's end), against a character set
that cannot leave its directory (no ``/``, ``\\``, no ``..`` and no name of only dots), and a
length that fits every filesystem's 255 bytes with the prefixes and suffixes added to it.

A keyed state variable's name follows Spark's rules instead (anything but empty, padded,
``default`` or ``$...``): it never becomes a path, only a column stem
(``descriptors.column_stem``).
"""

from __future__ import annotations

import re
from typing import Any

from statestore.errors import StateStoreError

# Tables and namespaces: letters, digits, '_' and '-', not starting with '-'.
_IDENTIFIER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,127}")
# Forks and savepoints: also '.', starting with a letter or digit (so never '.' or '..').
_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# Operator state variables: a column-safe identifier.
_OPERATOR_STATE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
MAIN_BRANCH = "main"
#: The state variable of a stream's timers (``spark_integration.timers``): reserved, and never
#: counted among the live rows (Spark's ``numRowsTotal`` has no timers).
TIMERS_STATE = "icestate_timers"


class InvalidNameError(StateStoreError, ValueError):
    """A table, namespace, fork, savepoint or state name that is not allowed."""


def _shown(name: Any) -> str:
    text = repr(name)
    return text if len(text) <= 80 else f"{text[:60]}...' ({len(name)} characters)"


def _check(name: Any, pattern: re.Pattern, what: str, rule: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"a {what} name must be a string, got {type(name).__name__} ({_shown(name)})")
    if pattern.fullmatch(name) is None:
        raise InvalidNameError(f"{what} name {_shown(name)} is invalid: {rule}")
    return name


def check_table_name(name: Any) -> str:
    """``name`` if it may name a state or output table; else ``InvalidNameError``."""
    return _check(name, _IDENTIFIER, "table", "use 1-128 letters, digits, '_' or '-' (not first), "
                  "e.g. user_sessions; no '/', '.' or spaces (it names the table's directory)")


def check_namespace(name: Any) -> str:
    """``name`` if it may name an Iceberg namespace of state tables; else ``InvalidNameError``."""
    return _check(name, _IDENTIFIER, "namespace", "use 1-128 letters, digits, '_' or '-' (not first), "
                  "e.g. state; one level only, no '/', '.' or spaces (it names a directory)")


def check_ref_name(name: Any, what: str) -> str:
    """``name`` if it may name a new fork or savepoint (``what``); else ``InvalidNameError``."""
    _check(name, _REF, what, "use 1-100 letters, digits, '_', '.' or '-', starting with a letter or digit, "
           "e.g. before-v2")
    if name == MAIN_BRANCH:
        raise InvalidNameError(f"{what} name 'main' is taken: the table's own line of checkpoints")
    return name


def check_branch_name(name: Any) -> str:
    """``name`` if it may name a line to open: ``main`` or a fork's name."""
    return name if name == MAIN_BRANCH else check_ref_name(name, "fork")


def check_operator_state_name(name: Any) -> str:
    """``name`` if it may name an operator state variable; else ``InvalidNameError``."""
    return _check(name, _OPERATOR_STATE, "operator state", "use 1-100 letters, digits or '_', not starting "
                  "with a digit, e.g. offsets")


def check_state_name(name: Any) -> str:
    """Spark's rules for a keyed state variable's name (its state store's column family): not
    empty, no leading or trailing space, not ``default``, not starting with ``$`` (Spark's
    own); anything else goes (dashes, spaces, dots, unicode...)."""
    if not isinstance(name, str):
        raise TypeError(f"a state name must be a string, got {type(name).__name__} ({_shown(name)})")
    if not name or name.strip() != name or name == "default":
        raise InvalidNameError(f"state name {_shown(name)} is invalid: it must not be empty, have leading or "
                               "trailing spaces, or be the reserved 'default' (Spark's rule)")
    if name.startswith("$"):
        raise InvalidNameError(f"state name {_shown(name)} is invalid: names starting with '$' are reserved "
                               "(Spark's rule)")
    return name
