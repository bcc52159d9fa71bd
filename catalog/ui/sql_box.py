"""The SQL box of the state browser: read queries over a checkpoint's views, on cached connections.

A connection is ``catalog.sql.connect``'s: confined (no file, no extension, no setting that
lifts it), with the views ``state_<variable>`` and ``entries`` of one checkpoint. Making one
reads every entry of the checkpoint, so the newest few are kept (``CONNECTIONS``), by the
table, line and Iceberg snapshot they show (a snapshot never changes, so a cached connection
never goes stale; a compaction is a new snapshot). Their TTL is evaluated when made.

Only one read statement runs (SELECT, with DESCRIBE, SHOW, SUMMARIZE, VALUES, or EXPLAIN):
anything else is refused before it reaches DuckDB, so no query can change what a cached
connection shows (``CREATE``, ``DROP``, ``SET``...), and the confinement refuses the rest.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import duckdb

from catalog.ui.grids import Grid, of_rows

# Rows a query's answer shows at most.
ROWS_LIMIT = 1000
# Connections kept (each holds a checkpoint's live state in memory).
CONNECTIONS = 4
_READ_STATEMENTS = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)


class SqlError(ValueError):
    """A query the SQL box does not run, or that DuckDB refused; the message says why in one line."""


class SqlBox:
    """Runs read queries on connections kept by key, the least recently used dropped first.
    Thread safe: one query runs at a time (a DuckDB connection is not for concurrent use)."""

    def __init__(self, size: int = CONNECTIONS):
        self._size = size
        self._connections: OrderedDict[Hashable, duckdb.DuckDBPyConnection] = OrderedDict()
        self._lock = threading.Lock()

    def run(self, key: Hashable, connect: Callable[[], duckdb.DuckDBPyConnection], query: str,
            limit: int = ROWS_LIMIT) -> Grid:
        """The first ``limit`` rows of ``query`` on the connection of ``key`` (made by ``connect``
        when not kept).

        Raises:
            SqlError: the query is not one read statement, or DuckDB failed to run it.
        """
        statement = read_statement(query)
        with self._lock:
            con = self._connection(key, connect)
            try:
                cursor = con.execute(statement)
                columns = [d[0] for d in cursor.description or []]
                rows = cursor.fetchmany(limit + 1)
            except duckdb.Error as e:
                raise SqlError(one_line(str(e))) from None
        return of_rows(columns, rows[:limit], more=len(rows) > limit)

    def _connection(self, key: Hashable, connect: Callable[[], duckdb.DuckDBPyConnection]) -> duckdb.DuckDBPyConnection:
        con = self._connections.get(key)
        if con is None:
            con = connect()
            self._connections[key] = con
            while len(self._connections) > self._size:
                _, dropped = self._connections.popitem(last=False)
                dropped.close()
        self._connections.move_to_end(key)
        return con


def read_statement(query: str) -> str:
    """``query`` when it is exactly one read statement (module docstring).

    Raises:
        SqlError: it is empty, several statements, not SQL, or does something else than read.
    """
    try:
        with duckdb.connect() as parser:
            statements = parser.extract_statements(query)
    except duckdb.Error as e:
        raise SqlError(one_line(str(e))) from None
    if len(statements) != 1:
        raise SqlError(f"give one SQL statement; this is {len(statements)}")
    kind = statements[0].type
    if kind not in _READ_STATEMENTS:
        raise SqlError(f"the state browser only reads: a {kind.name} statement does not run here; ask with "
                       "SELECT (or DESCRIBE, SHOW, SUMMARIZE, EXPLAIN)")
    return query


def one_line(message: str) -> str:
    """DuckDB's message on one line: its ``LINE 1: ...`` context joined, the caret line dropped."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip().strip("^"))
