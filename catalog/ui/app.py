"""The state browser's web application (``create_app``): its pages, their forms and error pages.

Pages, every one a GET (``branch`` picks main or a fork, ``checkpoint`` a retained checkpoint
of its line, by default the newest):

* ``/``: the state tables of the namespace, each with its newest checkpoint;
* ``/tables/<name>``: its state variables, savepoints and forks, the checkpoint timeline and
  list, and the skew of the selected checkpoint over key groups and units;
* ``/tables/<name>/key``: one key's state at a checkpoint and its history;
* ``/tables/<name>/diff``: what changed in one variable between two checkpoints;
* ``/tables/<name>/sql``: a read query over a checkpoint's views (``sql_box``).

The application never finds a catalog itself: ``create_app`` takes a function opening a table
and one listing the state tables (``state_table_names`` lists those of a pyiceberg catalog),
so that the command line brings the catalog its options name and tests bring their own. A
table is opened for one request and closed before its page is rendered.

A failure is a page with its message and a status, never a traceback: 404 for a table, fork,
checkpoint or variable that is not there, 400 for a bad value in a form (shown again with the
message), 503 when the catalog cannot be reached, 500 otherwise. Messages pass through
``scrub`` (the command line's blanks the values of secret catalog properties); the page shows
no catalog property. Jinja escapes every value a page shows.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import html
import logging
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from flask import Flask, Response, current_app, redirect, render_template, request
from werkzeug.exceptions import HTTPException, SecurityError

from catalog import inspection
from catalog.key_text import KeyTextError, example, parse_key
from catalog.sql import STATE_TABLE_PREFIX, connect
from catalog.ui import charts
from catalog.ui.grids import of_table
from catalog.ui.sql_box import SqlBox, SqlError
from statestore import stored_keys
from statestore.changes import CHANGE_TYPE, DELETE, INSERT, UPDATE
from statestore.errors import CatalogUnavailableError, CheckpointNotFoundError, StateNotDeclaredError

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

    from catalog.iceberg_table import IcebergStateTable
    from statestore.descriptors import StateDescriptor

MAIN = "main"
# Opens state table ``name`` on line ``branch`` (main or a fork) at its newest checkpoint.
Opener = Callable[[str, str], "IcebergStateTable"]
_EXTENSION = "icestate.ui"
# The address parameter that carries the browser's token (``create_app``'s ``token``).
TOKEN_PARAMETER = "token"
# The names of a server on loopback (``create_app``'s ``trusted_hosts``).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


@dataclass(frozen=True)
class Browser:
    """What the pages use: how to open and list tables, where they are (shown in the header),
    how to scrub a message, the SQL box."""

    opener: Opener
    list_tables: Callable[[], list[str]]
    where: str
    scrub: Callable[[str], str]
    tracebacks: bool
    sql: SqlBox = field(default_factory=SqlBox)


class PageError(Exception):
    """A request the page cannot answer: ``status`` and a message saying what is wrong and what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def create_app(opener: Opener, list_tables: Callable[[], list[str]], *, where: str = "",
               scrub: Callable[[str], str] = str, tracebacks: bool = False,
               trusted_hosts: Sequence[str] | None = LOOPBACK_HOSTS, token: str | None = None) -> Flask:
    """The state browser's Flask application.

    Other pages a browser shows are kept out (``docs/reliability.md``, threat model): a request
    whose ``Host`` is not one of ``trusted_hosts`` gets 400 (a page of another site whose
    name was made to resolve to this machine's loopback address, DNS rebinding, would
    otherwise read the state), and a request that the browser says another site's page made
    (``Sec-Fetch-Site`` cross-site or same-site) gets 403 (it could not read the answer, but
    could make the server run SQL queries).

    Args:
        opener: opens a state table by name and line (main or a fork), at its newest checkpoint.
        list_tables: the names of the state tables to list.
        where: where the tables are, as the page header says it (no secret in it).
        scrub: applied to every error message a page shows.
        tracebacks: log a failure's traceback (scrubbed) on the server's console.
        trusted_hosts: the host names the page answers to (any port); None: any (a server
            listening beyond loopback, whose names the command cannot know).
        token: when given, a request is answered only with the token in its address (which
            sets a cookie and leads to the same address without it) or with that cookie: the
            page is its starter's, not every local user's (``icestate ui`` makes one).
    """
    app = Flask(__name__)
    app.config["TRUSTED_HOSTS"] = None if trusted_hosts is None else list(trusted_hosts)
    app.before_request(_refuse_other_sites)
    if token is not None:
        app.before_request(functools.partial(_require_token, token))
    app.extensions[_EXTENSION] = Browser(opener, list_tables, where, scrub, tracebacks)
    app.jinja_env.filters.update(bytes=_bytes_filter, thousands=_thousands_filter, when=_when_filter)
    app.context_processor(lambda: {"where": _browser().where})
    app.add_url_rule("/", view_func=index)
    app.add_url_rule("/tables/<name>", view_func=table_page)
    app.add_url_rule("/tables/<name>/key", view_func=key_page)
    app.add_url_rule("/tables/<name>/diff", view_func=diff_page)
    app.add_url_rule("/tables/<name>/sql", view_func=sql_page)
    app.register_error_handler(PageError, _page_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _failure)
    return app


def _refuse_other_sites() -> None:
    site = request.headers.get("Sec-Fetch-Site")
    if site in ("cross-site", "same-site"):
        raise PageError(403, "this page answers only its own pages and addresses typed into the browser, not a "
                             f"request another site's page made ({site}): open it from the address bar")


def _require_token(token: str) -> Response | None:
    """Answer a request that brings ``token`` in its address or its cookie; with the address,
    set the cookie and go to the same address without the token (out of the history and logs)."""
    cookie = f"icestate_ui_{request.host.rpartition(':')[2]}"  # one per port: several browsers may run
    given = request.args.get(TOKEN_PARAMETER)
    if given is not None and hmac.compare_digest(given.encode(), token.encode()):
        rest = [(k, v) for k, v in request.args.items(multi=True) if k != TOKEN_PARAMETER]
        answer = redirect(request.path + (f"?{urlencode(rest)}" if rest else ""), code=303)
        answer.set_cookie(cookie, token, httponly=True, samesite="Strict")
        return answer
    if hmac.compare_digest(request.cookies.get(cookie, "").encode(), token.encode()):
        return None
    raise PageError(403, "this state browser answers only the address `icestate ui` printed when it started (with "
                         "its token): open that address")


def state_table_names(catalog: Catalog, namespace: str) -> list[str]:
    """The state tables of ``namespace`` in ``catalog``, sorted: the tables whose properties
    record a layout (an output table has none). A table that cannot be loaded is listed, so
    that its failure shows."""
    from pyiceberg.exceptions import NoSuchNamespaceError

    try:
        identifiers = catalog.list_tables(namespace)
    except NoSuchNamespaceError:
        return []
    names = []
    for identifier in identifiers:
        try:
            properties = catalog.load_table(identifier).properties
        except Exception:  # a damaged table: listed, and its page says what is wrong
            names.append(identifier[-1])
            continue
        if stored_keys.get(properties, stored_keys.LAYOUT) is not None:
            names.append(identifier[-1])
    return sorted(names)


# --- pages ---------------------------------------------------------------------------------

def index() -> str:
    """The state tables with their newest checkpoint."""
    browser = _browser()
    return render_template("index.html", tables=[_summary(name) for name in browser.list_tables()])


def table_page(name: str) -> str:
    """One table: variables, savepoints and forks, checkpoints, and the selected one's skew."""
    branch, requested = _branch(), _int_arg("checkpoint")
    with _opened(name, branch) as table:
        line = _line(table, requested)
        groups = inspection.key_groups(table, requested).to_pydict()
        files = inspection.segments(table, requested).to_pydict()
        context = dict(variables=[_variable(d) for d in table.layout.descriptors], keys=_key_columns(table),
                       savepoints=_savepoints(table), forks=_forks(table), max_parallelism=table.layout.max_parallelism)
    unit_count = max(groups["unit"], default=-1) + 1
    rows, sizes = groups["rows"], groups["bytes"]
    timeline = charts.timeline(line.ids, line.column("rows"), line.column("bytes"), line.selected) if line.ids else None
    return render_template(
        "table.html", name=name, branch=branch, line=line, tab="overview", **context, timeline=timeline,
        skew=charts.key_group_skew(groups["key_group"], rows, sizes),
        files=charts.files_per_unit(files["unit"], unit_count), files_count=len(files["unit"]), unit_count=unit_count,
        rows=sum(files["rows"]), size=sum(files["bytes"]), rows_skew=_skew(rows), bytes_skew=_skew(sizes))


def key_page(name: str) -> tuple[str, int]:
    """One key: its state per variable at the checkpoint, and at every retained one."""
    branch, requested = _branch(), _int_arg("checkpoint")
    with _opened(name, branch) as table:
        line = _line(table, requested)
        schema = table.layout.key_schema
        texts = [request.args.get(f"k{i}") for i in range(len(schema))]
        fields = [dict(index=i, name=f.name, type=str(f.type), example=example(f.type), text=texts[i] or "")
                  for i, f in enumerate(schema)]
        error, results = None, None
        if any(t is not None for t in texts):
            try:
                key = parse_key(schema, [t or "" for t in texts])
            except KeyTextError as e:
                error = str(e)
            else:
                results = _key_results(table, key, requested)
    page = render_template("key.html", name=name, branch=branch, line=line, tab="key", fields=fields,
                           results=results, error=error)
    return page, 400 if error else 200


def diff_page(name: str) -> tuple[str, int]:
    """What changed in one variable between two checkpoints, counted per change type."""
    branch = _branch()
    with _opened(name, branch) as table:
        line = _line(table, None)
        variables = [d.name for d in table.layout.descriptors]
        variable = request.args.get("variable")
        before, after = _int_arg("from"), _int_arg("to")
        after = after if after is not None else line.newest
        before = before if before is not None else line.before(after)
        result, error = None, None
        if variable is not None:
            for checkpoint in (before, after):
                line.check(checkpoint)
            if before is None or after is None:
                error = "choose the two retained checkpoints to compare, from and to (a line needs two)"
            else:
                result = inspection.changes(table, variable, before, after)
    counts = None if result is None else Counter(result.column(CHANGE_TYPE).to_pylist())
    page = render_template(
        "diff.html", name=name, branch=branch, line=line, tab="diff", variables=variables, variable=variable,
        before=before, after=after, result=None if result is None else of_table(result), counts=counts,
        change_types=(INSERT, UPDATE, DELETE), error=error)
    return page, 400 if error else 200


def sql_page(name: str) -> tuple[str, int]:
    """A read query over the checkpoint's views ``state_<variable>`` and ``entries``."""
    branch, requested = _branch(), _int_arg("checkpoint")
    query = request.args.get("q", "")
    with _opened(name, branch) as table:
        line = _line(table, requested)
        views = [dict(name=STATE_TABLE_PREFIX + inspection.sql_name(d.name), kind=d.kind.value)
                 for d in table.layout.descriptors]
        grid, error = None, None
        if query.strip():
            key = (name, branch, _snapshot_id(table, line, requested))
            try:
                grid = _browser().sql.run(key, lambda: connect(table, checkpoint_id=requested), query)
            except SqlError as e:
                error = _browser().scrub(str(e))
    example = f"SELECT count(*) FROM {views[0]['name']}" if views else ""
    page = render_template("sql.html", name=name, branch=branch, line=line, tab="sql", views=views, query=query,
                           result=grid, error=error, example=example)
    return page, 400 if error else 200


# --- the checkpoints of a line -------------------------------------------------------------

@dataclass(frozen=True)
class Line:
    """The retained checkpoints of the table's line (``inspection.checkpoints``), oldest first,
    and the one selected (``requested``, or the newest)."""

    rows: list[dict[str, Any]]
    requested: int | None
    table: str
    branch: str

    @property
    def ids(self) -> list[int]:
        return [r["checkpoint_id"] for r in self.rows]

    @property
    def newest(self) -> int | None:
        return self.ids[-1] if self.rows else None

    @property
    def selected(self) -> int | None:
        return self.newest if self.requested is None else self.requested

    @property
    def params(self) -> dict[str, Any]:
        """The query parameters of a link that keeps the line and the selected checkpoint."""
        return {"branch": self.branch} if self.requested is None else {"branch": self.branch,
                                                                       "checkpoint": self.requested}

    def column(self, name: str) -> list[Any]:
        return [r[name] for r in self.rows]

    def before(self, checkpoint: int | None) -> int | None:
        """The checkpoint retained before ``checkpoint``, if any."""
        older = [c for c in self.ids if checkpoint is not None and c < checkpoint]
        return older[-1] if older else None

    def check(self, checkpoint: int | None) -> None:
        """Raise a 404 unless ``checkpoint`` is None or retained."""
        if checkpoint is not None and checkpoint not in self.ids:
            raise PageError(404, f"checkpoint {checkpoint} is not retained in state table {self.table} "
                                 f"(line {self.branch}); the retained ones are {self.ids or 'none'}: pick one of them")


def _line(table: IcebergStateTable, requested: int | None) -> Line:
    listed = inspection.checkpoints(table)
    rows = [r for r in listed.to_pylist() if r.get("on_line", True)]
    line = Line(rows, requested, table.identifier, table.branch)
    line.check(requested)
    return line


def _snapshot_id(table: IcebergStateTable, line: Line, requested: int | None) -> int | None:
    """The Iceberg snapshot a page reads: the opened one, or the requested checkpoint's."""
    if requested is None:
        current = table.current_checkpoint()
        return None if current is None else current.snapshot_id
    return next(r["snapshot_id"] for r in line.rows if r["checkpoint_id"] == requested)


# --- what a page shows ---------------------------------------------------------------------

def _summary(name: str) -> dict[str, Any]:
    """A table's line on the index: its newest checkpoint, or the error opening it."""
    try:
        with _opened(name, MAIN) as table:
            line = _line(table, None)
    except Exception as e:
        return dict(name=name, newest=None, error=_message(e))
    return dict(name=name, newest=line.rows[-1] if line.rows else None, error=None)


def _key_results(table: IcebergStateTable, key: dict[str, Any], checkpoint: int | None) -> list[dict[str, Any]]:
    """Per variable, one key's state at ``checkpoint`` and its history."""
    state, history = inspection.key_state(table, key, checkpoint), inspection.key_history(table, key)
    kinds = {d.name: d.kind.value for d in table.layout.descriptors}
    return [dict(variable=v, kind=kinds[v], state=of_table(state[v]), history=of_table(history[v])) for v in state]


def _variable(desc: StateDescriptor) -> dict[str, Any]:
    ttl = None if desc.ttl is None else f"{_duration(desc.ttl.ttl_ms)} ({desc.ttl.update_type.value.replace('_', ' ')})"
    return dict(name=desc.name, kind=desc.kind.value, value_type=str(desc.value_type),
                map_key_type=None if desc.user_key_type is None else str(desc.user_key_type), ttl=ttl)


def _key_columns(table: IcebergStateTable) -> list[dict[str, str]]:
    return [dict(name=f.name, type=str(f.type)) for f in table.layout.key_schema]


def _savepoints(table: IcebergStateTable) -> list[dict[str, Any]]:
    on_line = {c.checkpoint_id for c in table.list_checkpoints()}
    return [dict(name=name, checkpoint_id=c.checkpoint_id, batch_id=c.batch_id, at=c.timestamp_ms,
                 on_line=c.checkpoint_id in on_line) for name, c in sorted(table.savepoints().items())]


def _forks(table: IcebergStateTable) -> list[dict[str, Any]]:
    return [dict(name=name, checkpoint_id=None if c is None else c.checkpoint_id,
                 batch_id=None if c is None else c.batch_id, at=None if c is None else c.timestamp_ms)
            for name, c in sorted(table.forks().items())]


def _skew(values: list[int]) -> float | None:
    """How much the largest of ``values`` exceeds their mean (1.0: even)."""
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else None


def _duration(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms} ms"


# --- requests ------------------------------------------------------------------------------

def _browser() -> Browser:
    return current_app.extensions[_EXTENSION]


def _branch() -> str:
    return request.args.get("branch") or MAIN


def _int_arg(name: str) -> int | None:
    """Query parameter ``name`` as a checkpoint id; None when absent or empty."""
    text = request.args.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise PageError(400, f"{name} must be a checkpoint id, a whole number such as 3; got {text!r}") from None


@contextlib.contextmanager
def _opened(name: str, branch: str) -> Iterator[IcebergStateTable]:
    """State table ``name`` on line ``branch``, open for the request; a 404 when there is no
    such state table or fork."""
    browser = _browser()
    try:
        table = browser.opener(name, branch)
    except CatalogUnavailableError as e:
        raise PageError(503, str(e)) from None
    except Exception as e:
        known = browser.list_tables()
        if name not in known:
            raise PageError(404, f"there is no state table {name!r} in {browser.where or 'this catalog'}; the "
                                 f"state tables are {known or 'none'}") from None
        if isinstance(e, ValueError):  # no such fork
            raise PageError(404, str(e)) from None
        raise
    with table:
        yield table


# --- errors --------------------------------------------------------------------------------

def _page_error(e: PageError) -> tuple[str, int]:
    return _error_page(e.status, str(e))


def _http_error(e: HTTPException) -> tuple[str, int]:
    if isinstance(e, SecurityError):  # a Host that is not trusted: no page of ours is built for it
        return (f"<!doctype html><title>{e.code}</title><p>{html.escape(_UNTRUSTED_HOST)}</p>",
                e.code or 400)
    return _error_page(e.code or 500, e.description or e.name)


_UNTRUSTED_HOST = ("this state browser answers only to the names of the address it listens on (loopback: localhost, "
                   "127.0.0.1, ::1); open it by one of them")


def _failure(e: Exception) -> tuple[str, int]:
    if isinstance(e, CheckpointNotFoundError | StateNotDeclaredError):
        return _error_page(404, str(e))
    browser = _browser()
    if browser.tracebacks:
        logging.getLogger(__name__).error(browser.scrub(traceback.format_exc()))
    return _error_page(500, _message(e))


def _error_page(status: int, message: str) -> tuple[str, int]:
    return render_template("error.html", status=status, message=_browser().scrub(message)), status


def _message(e: Exception) -> str:
    """What a failure says: its message, led by its type unless it is one of ours."""
    from statestore.errors import StateStoreError

    known = isinstance(e, StateStoreError | ValueError | OSError | PageError) and str(e)
    return _browser().scrub(str(e) if known else f"{type(e).__name__}: {e}")


# --- filters -------------------------------------------------------------------------------

def _bytes_filter(value: int | None) -> str:
    return "" if value is None else charts.human_bytes(value)


def _thousands_filter(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _when_filter(value: datetime | int | None) -> str:
    """A commit time (a datetime, or milliseconds since the epoch) as UTC to the second."""
    if value is None:
        return ""
    if isinstance(value, int):
        value = datetime.fromtimestamp(value / 1000, UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S UTC")
