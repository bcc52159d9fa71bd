"""The state-table commands of the ``icestate`` program: list checkpoints, query with SQL,
keep savepoints, fork, list refs, compact.

``tables`` is a Typer app the program (``spark_integration.cli``) mounts without a name,
so its commands sit at the top level (``icestate sql ...``); it is not a program of its
own. The docstrings of the commands and the ``help`` of the options are the users' help
text: they speak of tables and checkpoints, never of modules. Every command opens its
table through ``_open_table``, the one place that knows how a table is found.

Where a table is (``_table_ref``): ``--warehouse DIR`` alone is the embedded SQLite catalog
in a local directory (the default, ``./warehouse``); ``--catalog NAME`` and/or repeatable
``--property KEY=VALUE`` name any pyiceberg catalog, resolved as pyiceberg does (the
properties, then the catalog's entry in ``.pyiceberg.yaml``, then ``PYICEBERG_CATALOG__<NAME>__*``
environment variables; without ``--catalog``, pyiceberg's default catalog name), and
``--warehouse`` then is that catalog's ``warehouse`` property, a URI or a local directory.

Secrets: a catalog property whose name says secret (``table_ref.is_secret``) given with
``--property`` draws a warning (command lines are visible to other users and kept in shell
history; the configuration file or the environment is the place for them). No output or error
of a command shows a property value of such a name: every failure is reported as one line
with the secrets of the command line and of the pyiceberg configuration scrubbed
(``_reporting_errors``), never as a traceback.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import decimal
import enum
import functools
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    import pyarrow as pa

    from catalog.iceberg_table import IcebergStateTable
    from catalog.table_ref import TableRef

tables = typer.Typer()
console = Console()
err_console = Console(stderr=True, highlight=False)
DEFAULT_WAREHOUSE = "./warehouse"
# pyiceberg's catalog property naming where new tables' files go.
WAREHOUSE_PROPERTY = "warehouse"


def _command(**options: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a state-table command: listed under one heading, apart from the main job, and
    reporting its failures as one scrubbed line (``_reporting_errors``)."""
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        return tables.command(rich_help_panel="State tables", **options)(_reporting_errors(fn))
    return register


# Options every command shares, declared once so their help reads the same everywhere.
Warehouse = Annotated[str, typer.Option(
    help="Warehouse directory: holds the embedded SQLite Iceberg catalog and every table's files.")]
TableWarehouse = Annotated[str | None, typer.Option(
    "--warehouse", show_default=False,
    help="Where the tables are. Alone: a local directory holding the embedded SQLite Iceberg catalog and "
         "the tables' files (default ./warehouse). With --catalog or --property: the catalog's warehouse, "
         "a local directory or a URI such as s3://bucket/path.")]
CatalogName = Annotated[str | None, typer.Option(
    "--catalog", show_default=False,
    help="Name of the pyiceberg catalog holding the table, configured in .pyiceberg.yaml "
         "(PYICEBERG_HOME, home or working directory) or PYICEBERG_CATALOG__<NAME>__<PROPERTY> environment "
         "variables: the place for credentials.")]
CatalogProperties = Annotated[list[str] | None, typer.Option(
    "--property", metavar="KEY=VALUE", show_default=False,
    help="A catalog property, repeatable, over the configuration of --catalog (without it: pyiceberg's "
         "default catalog), e.g. uri=sqlite:////data/catalog.db, s3.endpoint=http://host:9000, "
         "s3.region=eu-west-1. Keep secrets out of command lines (visible to other users, kept in shell history).")]
TableName = Annotated[str, typer.Option(
    "--table", help="State table: one per stateful operator (the main job writes demo_user_activity "
    "and demo_page_views).")]
Namespace = Annotated[str, typer.Option(help="Iceberg namespace of the state table.")]
Branch = Annotated[str, typer.Option(help="Line of checkpoints to use: main, or the name of a fork.")]
Checkpoint = Annotated[int | None, typer.Option(help="Checkpoint id (see `icestate checkpoints`). "
                                                "Default: the newest.")]
Savepoint = Annotated[str | None, typer.Option(help="Read this savepoint instead of a checkpoint.")]


class OutputFormat(enum.StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


Output = Annotated[OutputFormat, typer.Option(
    "--format", help="How rows are printed: a table for people, CSV (nested values as JSON), or JSON (a list of "
                     "objects per result).")]


def _open_table(warehouse: str | None, catalog: str | None, properties: list[str] | None, namespace: str,
                table: str, branch: str = "main", **at) -> IcebergStateTable:
    """Open an existing state table for a command (``TableRef.open``); ``at`` picks the point in
    time (``checkpoint_id``, ``savepoint``). The one opener of this module."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    from catalog.defaults import DEFAULT_CATALOG_NAME

    ref = _table_ref(warehouse, catalog, properties, namespace, table, branch)
    try:
        return ref.open(**at)
    except ValueError as e:
        if ref.catalog_name is None or not isinstance(e.__cause__, NoSuchTableError | NoSuchNamespaceError):
            raise
        # The usual slip with a catalog named by properties: a SQL catalog files its tables under its name.
        raise ValueError(
            f"{e}. A SQL catalog keeps its tables under the catalog's name: --catalog must be the name their "
            f"writer used (this was {ref.catalog_name!r}; the embedded catalog of a warehouse directory is named "
            f"{DEFAULT_CATALOG_NAME!r})") from None


def _table_ref(warehouse: str | None, catalog: str | None, properties: list[str] | None, namespace: str,
               table: str, branch: str) -> TableRef:
    """The table the options name (module docstring).

    Raises:
        typer.BadParameter: the options contradict each other or lack what the table needs.
        CatalogUnavailableError: no catalog of that name is configured, or pyiceberg cannot load it.
    """
    from catalog.table_ref import TableRef

    props = _parse_properties(properties or [], catalog)
    if catalog is None and not props:
        directory = DEFAULT_WAREHOUSE if warehouse is None else warehouse
        if "://" in directory:
            raise typer.BadParameter(
                f"{directory} is a URI, and without --catalog or --property the tables' catalog is the embedded "
                "SQLite one, whose file must be on local disk. Name the catalog that records the tables: --catalog "
                "NAME (configured in .pyiceberg.yaml or PYICEBERG_CATALOG__<NAME>__* environment variables), or "
                "give its properties, e.g. --property uri=sqlite:////local/path/catalog.db plus the storage's "
                "(s3.endpoint=..., s3.region=...; credentials from the configuration or the environment).",
                param_hint="'--warehouse'")
        return TableRef(table, namespace=namespace, warehouse=directory, branch=branch)
    if warehouse is not None:
        if WAREHOUSE_PROPERTY in props:
            raise typer.BadParameter("give the warehouse once: --warehouse or --property warehouse=..., not both",
                                     param_hint="'--warehouse'")
        props[WAREHOUSE_PROPERTY] = warehouse if "://" in warehouse else f"file://{os.path.abspath(warehouse)}"
    config = _pyiceberg_config()
    name = catalog if catalog is not None else config.get_default_catalog_name()
    if set(props) <= {WAREHOUSE_PROPERTY} and config.get_catalog_config(name) is None:
        from statestore.errors import CatalogUnavailableError

        known = config.get_known_catalogs()
        raise CatalogUnavailableError(
            f"no pyiceberg catalog named {name!r} is configured (configured: {known or 'none'}): define it in "
            f".pyiceberg.yaml (in $PYICEBERG_HOME, your home or the working directory) or with "
            f"PYICEBERG_CATALOG__{_env_name(name)}__<PROPERTY> environment variables, or give its properties with "
            f"--property KEY=VALUE (e.g. --property uri=sqlite:////local/path/catalog.db)")
    return TableRef(table, namespace=namespace, catalog_name=name, catalog_properties=props, branch=branch)


def _parse_properties(items: list[str], catalog: str | None) -> dict[str, str]:
    """``--property KEY=VALUE`` options as a dict; warns of secrets on the command line. Errors
    name the property by its key only: a value is never echoed."""
    from catalog.table_ref import is_secret

    props: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise typer.BadParameter("expected KEY=VALUE (e.g. s3.region=eu-west-1); one was given without a "
                                     "'=' or with an empty key", param_hint="'--property'")
        if key in props:
            raise typer.BadParameter(f"property {key!r} is given twice", param_hint="'--property'")
        props[key] = value
        if is_secret(key):
            name = _env_name(catalog) if catalog else "<NAME>"
            err_console.print(
                f"warning: --property {key} puts a secret on the command line, where other users of this machine "
                f"can see it and your shell keeps it; put it in .pyiceberg.yaml or in the environment "
                f"(PYICEBERG_CATALOG__{name}__{_env_name(key)})", markup=False)
    return props


def _env_name(name: str) -> str:
    """How pyiceberg's environment variables spell a catalog or property name (``s3.secret-access-key``
    -> ``S3__SECRET_ACCESS_KEY``)."""
    return name.replace(".", "__").replace("-", "_").upper()


def _pyiceberg_config() -> Any:
    """pyiceberg's configuration (``.pyiceberg.yaml`` and ``PYICEBERG_*`` environment) as it
    reads it now, for what a command says about catalogs; ``load_catalog`` resolves the same."""
    from pyiceberg.utils.config import Config

    from catalog.config_trust import check_pyiceberg_config

    check_pyiceberg_config()
    return Config()


# The prefix of the properties the state store and its queries record (the table view of
# ``checkpoints`` shows the users' own only).
STORED_PREFIX = "icestate."
# Set by the program's ``--debug`` option (``spark_integration.cli``): failures show their traceback.
DEBUG = {"traceback": False}


def _reporting_errors(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` reporting any failure as one line on standard error and exit status 1, with the
    secrets of its ``--property`` options and of its catalog's configuration scrubbed: no
    traceback, whose messages could quote a property (``--debug`` shows it, scrubbed the same
    way). Usage errors stay Typer's (status 2)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except (typer.TyperException, typer.Exit, typer.Abort):
            raise
        except Exception as e:
            import duckdb

            from statestore.errors import StateStoreError

            def scrubbed(text: str) -> str:
                return _scrubbed(text, kwargs.get("catalog"), kwargs.get("properties"))

            if DEBUG["traceback"]:
                import traceback

                err_console.print(scrubbed(traceback.format_exc()), markup=False, soft_wrap=True)
            # Messages of these say what failed (DuckDB's start with the kind of error); others need their type.
            known = isinstance(e, StateStoreError | ValueError | OSError | duckdb.Error) and str(e)
            message = str(e) if known else f"{type(e).__name__}: {e}"
            # One line: DuckDB's "LINE 1: ..." context and "Did you mean" hints joined, carets dropped.
            message = " ".join(part.strip() for part in message.splitlines() if part.strip().strip("^"))
            hint = "" if DEBUG["traceback"] else " (--debug shows the traceback)"
            err_console.print(f"error: {scrubbed(message)}{hint}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
    return run


def _scrubbed(text: str, catalog: str | None, properties: list[str] | None) -> str:
    """``text`` without the value of any secret-named property of the command line or of the
    catalog's pyiceberg configuration (``table_ref.scrub``)."""
    from catalog.table_ref import scrub

    given = dict(item.partition("=")[::2] for item in properties or [])
    configured: dict[str, Any] = {}
    try:
        config = _pyiceberg_config()
        configured = dict(config.get_catalog_config(catalog or config.get_default_catalog_name()) or {})
    except Exception:  # a broken configuration file: the command line's secrets are still scrubbed
        pass
    return scrub(text, {**_flat(configured), **given})


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested configuration as ``{"a.b": value}``."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def _emit(rows: pa.Table, fmt: OutputFormat, title: str | None = None, shown: dict[str, Callable] | None = None,
          ) -> None:
    """Print ``rows`` in ``fmt``: a rich table (``shown`` formats chosen columns for people; values
    are the users' data, printed as they are, never as console markup), CSV with a header (nested
    values as JSON), or JSON (``{"title": ..., "rows": [...]}`` when titled, else the list)."""
    records = rows.to_pylist()
    if fmt is OutputFormat.json:
        print(json.dumps(records if title is None else {"title": title, "rows": records}, default=_json_value))
        return
    if fmt is OutputFormat.csv:
        if title is not None:
            print(f"# {title}")
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow(rows.column_names)
        for record in records:
            out.writerow([_csv_value(v) for v in record.values()])
        sys.stdout.flush()
        return
    shown = shown or {}
    out = Table(title=title)
    for col in rows.column_names:
        out.add_column(Text(col))
    for record in records:
        out.add_row(*[Text(shown[c](v) if c in shown and v is not None else _for_people(v))
                      for c, v in record.items()])
    console.print(out)


def _for_people(value: Any) -> str:
    """A value in a table for people: times to the second, in UTC."""
    if isinstance(value, datetime.datetime) and value.tzinfo is not None:
        return value.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return str(value)


def _json_value(value: Any) -> Any:
    """A value JSON has no type of: times in ISO 8601, whole decimals (DuckDB's sums) as integers,
    other decimals as exact strings, bytes as text."""
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() else str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def _csv_value(value: Any) -> Any:
    if isinstance(value, dict | list):
        return json.dumps(value, default=_json_value)
    return "" if value is None else _json_value(value) if isinstance(value, bytes | datetime.date) else value


def _size(n: int) -> str:
    """Bytes for people: 1.2 MB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def _track(items: Iterable[Any], what: str, total: int | None = None) -> Iterable[Any]:
    """``items`` with a progress bar on standard error when it is a terminal (gone when done)."""
    from rich.progress import track

    return track(items, description=what, total=total, console=err_console, transient=True,
                 disable=not err_console.is_terminal)


@_command()
def checkpoints(table: TableName, warehouse: TableWarehouse = None, catalog: CatalogName = None,
                properties: CatalogProperties = None, namespace: Namespace = "state", branch: Branch = "main",
                output: Output = OutputFormat.table) -> None:
    """List the retained checkpoints of a state table, oldest first, with their size.

    Each checkpoint is an Iceberg snapshot: the list shows its stream batch, commit time, the
    tasks that wrote it, the rows and bytes it added and the table's at it, its savepoints,
    whether a repair wrote it, and its properties. Savepoints older than the retained
    checkpoints follow them.

    Example: icestate checkpoints --table demo_user_activity
    """
    import pyarrow as pa

    from catalog import inspection

    with _open_table(warehouse, catalog, properties, namespace, table, branch=branch) as t:
        listed = inspection.checkpoints(t)
        given = {c.checkpoint_id: c.properties for c in [*t.list_checkpoints(), *t.savepoints().values()]}
    ids = listed.column("checkpoint_id").to_pylist()
    if output is OutputFormat.table:  # what fits a terminal; CSV and JSON have every column and property
        given = {i: {k: v for k, v in p.items() if not k.startswith(STORED_PREFIX)} for i, p in given.items()}
        listed = listed.select(["checkpoint_id", "batch_id", "committed_at", "operation", "parallelism", "rows_added",
                                "bytes_added", "rows", "bytes", "files", "savepoints", "snapshot_id"])
    listed = listed.append_column("properties", pa.array([json.dumps(given.get(i, {})) for i in ids]))
    _emit(listed, output, f"{namespace}.{table} ({branch})",
          shown={"bytes_added": _size, "bytes": _size, "savepoints": ", ".join})


@_command()
def sql(
    query: Annotated[str, typer.Argument(
        help="SQL (DuckDB) over the views state_<variable> (the live state of each state variable), entries (the "
             "raw stored entries), checkpoints, segments and key_groups, and changes_<variable> with --changes-from.")],
    table: TableName,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    checkpoint: Checkpoint = None,
    branch: Branch = "main",
    savepoint: Savepoint = None,
    changes_from: Annotated[int | None, typer.Option(
        help="Also make the views changes_<variable>: what changed from this checkpoint to the one read.")] = None,
    output: Output = OutputFormat.table,
) -> None:
    """Query a state table with SQL, at its newest checkpoint or at an older one or a savepoint.

    Each state variable is a view named state_<variable>: the key columns, the value as
    v_<variable> (a struct's fields as v_<variable>.field), mk_<variable> for a map's user key,
    list_position for a list's elements, and where each row came from (key_group,
    checkpoint_id, batch_id, expire_at_ms). Nothing is restored, no job needs to run, and the
    query can read nothing but these views.

    Example: icestate sql --table demo_user_activity "SELECT user, v_events.n FROM state_events ORDER BY 2 DESC LIMIT 5"
    """
    from catalog.sql import connect

    with _open_table(warehouse, catalog, properties, namespace, table, checkpoint_id=checkpoint, branch=branch,
                     savepoint=savepoint) as t, err_console.status("reading the state"):
        result = connect(t, changes_from=changes_from).sql(query)
        if result is None:  # a statement without rows
            return
        rows = result.to_arrow_table()
    _emit(rows, output)


@_command()
def key(
    table: TableName,
    values: Annotated[list[str], typer.Option(
        "--key", metavar="COLUMN=VALUE", show_default=False,
        help="A key column's value, once per key column, e.g. --key user=u-7 (numbers, true/false, 2026-11-25, "
             "2026-11-25 10:00:00 as the column's type).")],
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    checkpoint: Checkpoint = None,
    branch: Branch = "main",
    savepoint: Savepoint = None,
    history: Annotated[bool, typer.Option(
        "--history", help="Show the key's state at every retained checkpoint instead of one.")] = False,
    output: Output = OutputFormat.table,
) -> None:
    """Show one key's state in every state variable, at a checkpoint or across all retained ones.

    Reads only the parts of the files that can hold the key. Each row says which checkpoint
    and stream batch wrote it; with --history, each row also says the checkpoint it was read at.

    Example: icestate key --table demo_user_activity --key user=u-7 --history
    """
    from catalog import inspection

    texts = dict(_key_value(v) for v in values)
    with _open_table(warehouse, catalog, properties, namespace, table, checkpoint_id=checkpoint, branch=branch,
                     savepoint=savepoint) as t:
        parsed = inspection.parse_key(t, texts)
        if history:
            found = inspection.key_history(t, parsed, progress=lambda c: _track(c, "reading checkpoints"))
        else:
            found = inspection.key_state(t, parsed)
    shown = ", ".join(f"{k}={v}" for k, v in texts.items())
    for name, rows in found.items():
        _emit(rows, output, f"{name} of {shown}" + (" (history)" if history else ""))


def _key_value(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise typer.BadParameter(f"expected COLUMN=VALUE, got {item!r}", param_hint="'--key'")
    return name, value


@_command()
def diff(
    table: TableName,
    start: Annotated[int, typer.Option(
        "--from", show_default=False, help="The older checkpoint id (see `icestate checkpoints`).")],
    end: Annotated[int | None, typer.Option(
        "--to", show_default=False, help="The newer checkpoint id. Default: the newest.")] = None,
    state: Annotated[list[str] | None, typer.Option(
        "--state", show_default=False, help="Only this state variable (repeatable). Default: every one.")] = None,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    branch: Branch = "main",
    summary: Annotated[bool, typer.Option(
        "--summary", help="Only count the changes per state variable and kind.")] = False,
    output: Output = OutputFormat.table,
) -> None:
    """Show what changed between two checkpoints: per key, what was inserted, updated or deleted.

    Each change has the value before and after (a list compares as the whole list; a map per
    user key) and the checkpoints that wrote them. Between two checkpoints of one line, only
    the keys written after the older one are read.

    Example: icestate diff --table demo_user_activity --from 3 --to 5
    """
    import pyarrow as pa

    from catalog import inspection
    from statestore.changes import DELETE, INSERT, UPDATE

    with _open_table(warehouse, catalog, properties, namespace, table, branch=branch) as t:
        names = state or [d.name for d in t.layout.descriptors]
        feeds = {name: inspection.changes(t, name, start, end) for name in _track(names, "comparing")}
    span = f"{start} -> {'newest' if end is None else end}"
    if summary:
        counts = [{"state": name, "change_type": kind, "keys": rows.column("change_type").to_pylist().count(kind)}
                  for name, rows in feeds.items() for kind in (INSERT, UPDATE, DELETE)]
        _emit(pa.Table.from_pylist(counts), output, f"changes {span}")
        return
    for name, rows in feeds.items():
        _emit(rows, output, f"{name}: changes {span} ({rows.num_rows})")


@_command(name="describe-rescale")
def describe_rescale(
    table: TableName,
    parallelism: Annotated[int, typer.Option(
        show_default=False, help="The number of tasks to describe.")],
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    checkpoint: Checkpoint = None,
    branch: Branch = "main",
    output: Output = OutputFormat.table,
) -> None:
    """Show what each task would own if the job restarted with --parallelism tasks.

    Per task: its key groups, the rows and bytes of state in them, the files it would read
    and its share of the largest task's bytes (skew). A restart at any parallelism copies
    nothing: tasks read their key groups from the same files.

    Example: icestate describe-rescale --table demo_user_activity --parallelism 8
    """
    import pyarrow as pa

    from catalog import inspection
    from statestore.keygroups import compute_key_group_range_for_task

    with _open_table(warehouse, catalog, properties, namespace, table, checkpoint_id=checkpoint, branch=branch) as t:
        n = t.layout.max_parallelism
        if not 1 <= parallelism <= n:
            raise typer.BadParameter(f"must be between 1 and the table's max parallelism {n}",
                                     param_hint="'--parallelism'")
        groups = inspection.key_groups(t).to_pylist()
        files = inspection.segments(t).to_pylist()
        now = t.current_checkpoint()
    tasks = []
    for i in range(parallelism):
        r = compute_key_group_range_for_task(n, parallelism, i)
        mine = groups[r.start:r.end + 1]
        tasks.append({"task": i, "key_groups": f"{r.start}-{r.end}", "groups": len(r),
                      "rows": sum(g["rows"] for g in mine), "bytes": sum(g["bytes"] for g in mine),
                      "files": sum(1 for f in files if f["key_group_min"] <= r.end and f["key_group_max"] >= r.start)})
    largest = max(t["bytes"] for t in tasks) or 1
    for task in tasks:
        task["of_largest"] = round(task["bytes"] / largest, 3)
    was = "no checkpoint" if now is None else f"checkpoint {now.checkpoint_id} written by {now.parallelism} task(s)"
    _emit(pa.Table.from_pylist(tasks), output, f"{namespace}.{table} at {parallelism} task(s) ({was})",
          shown={"bytes": _size})


@_command()
def repair(
    table: TableName,
    reason: Annotated[str, typer.Option(show_default=False, help="What the repair does and why: recorded with it.")],
    put: Annotated[list[str] | None, typer.Option(
        "--put", metavar="STATE=SQL", show_default=False,
        help="Set state to the rows a query selects over the newest checkpoint's views: the key columns and "
             "v_<state> (mk_<state> for a map; a list's whole list), e.g. \"count=SELECT user, v_count - 1 AS "
             "v_count FROM state_count WHERE user = 'u-7'\". Repeatable.")] = None,
    put_parquet: Annotated[list[str] | None, typer.Option(
        "--put-parquet", metavar="STATE=FILE", show_default=False,
        help="Set state to the rows of a Parquet file (same columns as --put): a bulk load. Repeatable.")] = None,
    delete: Annotated[list[str] | None, typer.Option(
        "--delete", metavar="STATE=SQL", show_default=False,
        help="Delete the state of the keys a query selects (with mk_<state> for a map: only those entries). "
             "Repeatable.")] = None,
    delete_key: Annotated[list[str] | None, typer.Option(
        "--delete-key", metavar="COLUMN=VALUE", show_default=False,
        help="Delete one key's state in every state variable, e.g. a poisoned key: once per key column.")] = None,
    by: Annotated[str | None, typer.Option(show_default=False, help="Who repairs. Default: your user name.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Show what would change (the change feed) and commit nothing.")] = False,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    branch: Branch = "main",
    output: Output = OutputFormat.table,
) -> None:
    """Change state while the stream is stopped, committed as a checkpoint the stream resumes from.

    The repair builds on the newest checkpoint: it keeps that checkpoint's stream batch, so the
    stream's next batch runs on the repaired state. Who, why and how many rows are recorded in
    the checkpoint (icestate checkpoints shows it). It is refused if anything committed after
    that checkpoint while it ran. Try it with --dry-run first.

    Example: icestate repair --table demo_user_activity --reason "drop bot" --delete-key user=bot-1 --dry-run
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from catalog import inspection
    from catalog.repair import Repair

    with _open_table(warehouse, catalog, properties, namespace, table, branch=branch) as t, \
            Repair(t, reason=reason, by=by) as fix:
        for state, query in map(_assignment, put or []):
            fix.put(state, fix.sql(query))
        for state, path in map(_assignment, put_parquet or []):
            fix.put(state, pq.read_table(path))
        for state, query in map(_assignment, delete or []):
            fix.delete(state, fix.sql(query))
        if delete_key:
            key = inspection.parse_key(t, dict(_key_value(v) for v in delete_key))
            fix.delete_keys(pa.table({name: [value] for name, value in key.items()}))
        if dry_run:
            for name, rows in fix.dry_run().items():
                _emit(rows, output, f"{name}: would change ({rows.num_rows})")
            return
        info = fix.commit()
    committed = pa.table({"checkpoint_id": [info.checkpoint_id], "batch_id": [info.batch_id],
                          "rows": [info.properties[inspection.SUMMARY_REPAIR_ROWS]]})
    _emit(committed, output, "repair committed")


def _assignment(item: str) -> tuple[str, str]:
    """``STATE=TEXT`` of a --put or --delete option."""
    name, sep, text = item.partition("=")
    if not sep or not name or not text.strip():
        raise typer.BadParameter(f"expected STATE=..., got {item!r}")
    return name, text


@_command()
def migrate(
    table: TableName,
    state: Annotated[str, typer.Option(show_default=False, help="The state variable whose value type changes.")],
    add_field: Annotated[list[str] | None, typer.Option(
        "--add-field", metavar="FIELD:TYPE", show_default=False,
        help="Add a field to the struct value (a.b for a field of a nested struct), e.g. note:string. Types: "
             f"{', '.join(SIMPLE_TYPES)}. Repeatable.")] = None,
    widen: Annotated[list[str] | None, typer.Option(
        "--widen", metavar="FIELD:TYPE", show_default=False,
        help="Widen a field (int to long, float to double; 'value' for a value that is not a struct), e.g. n:long. "
             "Repeatable.")] = None,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
) -> None:
    """Widen a state variable's value type in place, as Iceberg evolves a schema (no file rewritten).

    Old entries read with the new type (added fields null). Stop the stream first, then resume
    it with the processor's new declaration.

    Example: icestate migrate --table demo_user_activity --state events --add-field source:string
    """
    from catalog import inspection
    from catalog.repair import migrate as evolve

    if not add_field and not widen:
        raise typer.BadParameter("say what changes: --add-field or --widen", param_hint="'--add-field'")
    with _open_table(warehouse, catalog, properties, namespace, table) as t:
        new_type = inspection.descriptor(t, state).value_type
        for item in add_field or []:
            path, dtype = _field_change(item, "--add-field")
            new_type = _with_field(new_type, path, dtype, add=True)
        for item in widen or []:
            path, dtype = _field_change(item, "--widen")
            new_type = dtype if path == ["value"] and not _is_struct(new_type) else \
                _with_field(new_type, path, dtype, add=False)
        evolve(t, state, new_type)
    console.print(f"state {state!r} of {namespace}.{table} now holds {new_type}")


# Value types a --add-field or --widen names, by their Spark SQL names.
SIMPLE_TYPES = {"string": "string", "long": "int64", "bigint": "int64", "int": "int32", "integer": "int32",
                "short": "int16", "byte": "int8", "double": "float64", "float": "float32", "boolean": "bool",
                "date": "date32", "timestamp": "timestamp[us, tz=UTC]", "binary": "binary"}


def _field_change(item: str, option: str) -> tuple[list[str], pa.DataType]:
    import pyarrow as pa

    name, sep, type_name = item.partition(":")
    if not sep or not name or type_name.strip().lower() not in SIMPLE_TYPES:
        raise typer.BadParameter(f"expected FIELD:TYPE with a type of {', '.join(SIMPLE_TYPES)}; got {item!r}",
                                 param_hint=f"'{option}'")
    spelled = SIMPLE_TYPES[type_name.strip().lower()]
    dtype = pa.timestamp("us", tz="UTC") if spelled.startswith("timestamp") else pa.type_for_alias(spelled)
    return name.split("."), dtype


def _is_struct(dtype: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_struct(dtype)


def _with_field(dtype: pa.DataType, path: list[str], new: pa.DataType, *, add: bool) -> pa.DataType:
    """``dtype`` (a struct) with the field at ``path`` added or given type ``new``."""
    import pyarrow as pa

    if not pa.types.is_struct(dtype):
        raise typer.BadParameter(f"the value is {dtype}, not a struct: it has no field {'.'.join(path)}")
    names = [f.name for f in dtype]
    head, rest = path[0], path[1:]
    if rest:
        if head not in names:
            raise typer.BadParameter(f"the value has no struct field {head!r} (it has {names})")
        inner = _with_field(dtype.field(head).type, rest, new, add=add)
        return pa.struct([f.with_type(inner) if f.name == head else f for f in dtype])
    if add:
        if head in names:
            raise typer.BadParameter(f"the value already has a field {head!r}")
        return pa.struct([*dtype, pa.field(head, new)])
    if head not in names:
        raise typer.BadParameter(f"the value has no field {head!r} to widen (it has {names})")
    return pa.struct([f.with_type(new) if f.name == head else f for f in dtype])


@_command()
def savepoint(
    name: Annotated[str, typer.Argument(help="Name of the new savepoint, e.g. before-upgrade.")],
    table: TableName,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    checkpoint: Checkpoint = None,
    branch: Branch = "main",
) -> None:
    """Keep a checkpoint as a named savepoint, which retention never expires.

    Query it later with `icestate sql --savepoint NAME` or start a fork from it with
    `icestate fork`.

    Example: icestate savepoint before-upgrade --table demo_user_activity
    """
    with _open_table(warehouse, catalog, properties, namespace, table, branch=branch) as t:
        info = t.savepoint(name, checkpoint)
    console.print(f"savepoint [bold]{name}[/bold] = checkpoint {info.checkpoint_id} (snapshot {info.snapshot_id})")


@_command()
def fork(
    name: Annotated[str, typer.Argument(help="Name of the fork, e.g. v2.")],
    table: TableName,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    checkpoint: Annotated[int | None, typer.Option(
        help="Checkpoint id of main to fork at. Default: the newest.")] = None,
    savepoint: Annotated[str | None, typer.Option(help="Fork at this savepoint instead of a checkpoint.")] = None,
) -> None:
    """Fork the state at a checkpoint or savepoint, for a new version of a job to run on.

    The fork is a line of its own: main goes on unchanged. A query runs on it with
    StateLocation(..., branch=NAME); read it with `--branch NAME`.

    Example: icestate fork v2 --table demo_user_activity --savepoint before-upgrade
    """
    with _open_table(warehouse, catalog, properties, namespace, table) as t:
        info = t.fork(name, checkpoint, savepoint=savepoint)
    console.print(f"fork [bold]{name}[/bold] at checkpoint {info.checkpoint_id}: run a query with "
                  f"StateLocation(..., branch={name!r})")


@_command()
def recover(
    table: TableName,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    location: Annotated[str | None, typer.Option(
        show_default=False,
        help="The table's directory or URI, the one holding its metadata/ directory. Default: where the catalog "
             "puts a table of this name.")] = None,
) -> None:
    """Register a state table the catalog lost, at the newest metadata of its location.

    For a catalog that lost its entry (the warehouse's catalog.db deleted or restored from an
    old copy, a table dropped without purge) while the table's files are still in place. The
    state is as of the newest checkpoint written there; nothing is copied or changed.

    Example: icestate recover --table demo_user_activity
    """
    from catalog.recovery import recover as register_again
    from statestore.stored_keys import LAST_CHECKPOINT_ID

    ref = _table_ref(warehouse, catalog, properties, namespace, table, "main")
    with contextlib.closing(ref.catalog()) as cat:
        registered = register_again(cat, (namespace, table), location)
        last = registered.properties.get(LAST_CHECKPOINT_ID, "0")
    console.print(f"state table [bold]{namespace}.{table}[/bold] registered again at "
                  f"{registered.metadata_location} (newest checkpoint {last})")


@_command()
def refs(table: TableName, warehouse: TableWarehouse = None, catalog: CatalogName = None,
         properties: CatalogProperties = None, namespace: Namespace = "state") -> None:
    """List the savepoints and forks of a state table, with the checkpoint each one is at.

    Example: icestate refs --table demo_user_activity
    """
    with _open_table(warehouse, catalog, properties, namespace, table) as t:
        out = Table(title=f"{namespace}.{table}: savepoints and forks")
        for col in ("kind", "name", "checkpoint", "batch", "snapshot"):
            out.add_column(col)
        for name, c in t.savepoints().items():
            out.add_row("savepoint", name, str(c.checkpoint_id), str(c.batch_id), str(c.snapshot_id))
        for name, c in t.forks().items():
            out.add_row("fork", name, *(("-", "-", "-") if c is None else
                                        (str(c.checkpoint_id), str(c.batch_id), str(c.snapshot_id))))
    console.print(out)


@_command()
def compact(
    table: TableName,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    branch: Branch = "main",
    min_segments: Annotated[int | None, typer.Option(
        help="Compact only the key-group units with at least this many segment files. Default: every unit "
             "with 2 or more, merged whole.")] = None,
    size_ratio: Annotated[float, typer.Option(
        help="An older segment joins a merge when its size is at most this times the newer ones'.")] = 1.0,
    key_groups: Annotated[str | None, typer.Option(
        help="Compact only the units overlapping this key-group range, e.g. 0-31.")] = None,
    follow: Annotated[float | None, typer.Option(
        help="Keep compacting every this many seconds until stopped (Ctrl-C), beside a running job.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as one JSON line per pass.")] = False,
    spark: Annotated[str | None, typer.Option(
        "--spark", metavar="MASTER", show_default=False,
        help="Merge as a Spark job on this master (e.g. spark://host:7077, local[2]): a task per unit, on "
             "the executors and through their file caches; this process plans and commits.")] = None,
) -> None:
    """Merge a state table's small segment files into fewer, larger ones, now or every few seconds.

    Reads stay the same; they get faster. A running job can keep writing: its next
    checkpoint follows the compaction. With --spark the merging runs on a cluster's executors.

    Example: icestate compact --table demo_user_activity --follow 10
    """
    import time

    from catalog.compaction import CompactionPolicy
    from catalog.compaction import compact as run
    from statestore.keygroups import KeyGroupRange

    try:
        policy = None if min_segments is None else CompactionPolicy(min_segments=min_segments, size_ratio=size_ratio)
        if min_segments is None and size_ratio != 1.0:
            policy = CompactionPolicy(min_segments=2, size_ratio=size_ratio)
        kgs = None if key_groups is None else KeyGroupRange.of(*map(int, key_groups.split("-", 1)))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    with (contextlib.nullcontext() if spark is None else spark_session(spark, "icestate compact")) as session, \
            _open_table(warehouse, catalog, properties, namespace, table, branch=branch) as t:
        while True:
            result = run(t, policy=policy, key_groups=kgs, spark=session)
            figures = None if result is None else {**result.summary(), "attempts": result.attempts,
                                                   "seconds": round(result.seconds, 3)}
            if as_json:
                print(json.dumps(figures), flush=True)
            elif figures is None:
                console.print("nothing to compact")
            else:
                console.print(f"compacted {figures['units']} unit(s): {figures['files_in']} files "
                              f"({figures['bytes_in']:,} bytes, {figures['entries_in']:,} entries) into "
                              f"{figures['files_out']} ({figures['bytes_out']:,} bytes, {figures['entries_out']:,} "
                              f"entries) in {figures['seconds']} s")
            if follow is None:
                return
            time.sleep(follow)


@_command()
def sweep(
    table: TableName,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as one JSON line.")] = False,
    spark: Annotated[str | None, typer.Option(
        "--spark", metavar="MASTER", show_default=False,
        help="List and delete as a Spark job on this master (e.g. spark://host:7077): the checkpoint "
             "directories spread over the executors' tasks.")] = None,
) -> None:
    """Delete every file of a state table that no checkpoint can use any more.

    A running job deletes what it leaves behind as it goes, looking only at what it wrote
    recently. This looks everywhere: files a crashed or stalled process wrote long ago, and
    those of a table written by an older version. Safe beside a running job; it never
    expires checkpoints. With --spark the listing runs on a cluster's executors.

    Example: icestate sweep --table demo_user_activity
    """
    with (contextlib.nullcontext() if spark is None else spark_session(spark, "icestate sweep")) as session, \
            _open_table(warehouse, catalog, properties, namespace, table) as t, \
            err_console.status("sweeping", spinner="dots") as status:
        seen = {"directories": 0, "files": 0, "orphans": 0}

        def progress(found: Any) -> None:
            seen["directories"] += 1
            seen["files"] += found.listed
            seen["orphans"] += len(found.orphans)
            status.update(f"swept {seen['directories']:,} directories: {seen['files']:,} files, "
                          f"{seen['orphans']:,} orphans deleted")

        result = t.sweep(spark=session, progress=progress)
    figures = result.summary()
    if as_json:
        print(json.dumps(figures), flush=True)
    else:
        where = "" if session is None else f" in {figures['processes']} executor process(es)"
        console.print(f"listed {figures['files_listed']:,} files in {figures['directories']:,} checkpoint "
                      f"directories{where}; deleted {figures['files_deleted']:,} orphaned files")


@contextlib.contextmanager
def spark_session(master: str, name: str, conf: list[str] | None = None) -> Iterator[Any]:
    """The process's Spark session (a notebook's, or a program's that calls the command), else
    a new one on ``master`` with ``conf`` (``KEY=VALUE`` items), stopped on exit: for the
    commands that run Spark jobs."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    builder = SparkSession.builder.master(master).appName(name)
    for item in ["spark.ui.enabled=false", "spark.ui.showConsoleProgress=false", *(conf or [])]:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{key!r} is not KEY=VALUE", param_hint="'--spark-conf'")
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


@_command()
def ui(
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    host: Annotated[str, typer.Option(
        help="Address to listen on. Keep the loopback address: beyond it the page and its token travel "
             "over plain HTTP.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8765,
    open_browser: Annotated[bool, typer.Option(
        "--open/--no-open", help="Open the page in the default web browser.")] = True,
) -> None:
    """Browse the state tables of a namespace in a web browser, until stopped (Ctrl-C).

    Shows each table's checkpoints over time, its savepoints and forks, how its state
    spreads over key groups, one key's state and history, what changed between two
    checkpoints, and the answers of SQL queries. Read-only: nothing on the page writes.
    The address it prints holds a token: only a browser that opened it is answered.

    Example: icestate ui --warehouse ./warehouse
    """
    import ipaddress
    import secrets
    import threading
    import webbrowser

    from werkzeug.serving import make_server

    from catalog.defaults import DEFAULT_CATALOG_FILE
    from catalog.table_ref import redacted
    from catalog.ui import create_app, state_table_names
    from catalog.ui.app import LOOPBACK_HOSTS, TOKEN_PARAMETER

    # Where the tables are; the table name is a stand-in (the page names the tables).
    ref = _table_ref(warehouse, catalog, properties, namespace, "any", "main")
    if ref.warehouse is not None and not os.path.isfile(os.path.join(ref.warehouse, DEFAULT_CATALOG_FILE)):
        raise typer.BadParameter(f"{ref.warehouse} holds no state tables (no {DEFAULT_CATALOG_FILE}): give the "
                                 "warehouse directory the job wrote", param_hint="'--warehouse'")
    remote = " ".join(filter(None, (f"catalog {ref.catalog_name}",
                                    redacted(ref.catalog_properties).get(WAREHOUSE_PROPERTY))))
    where = f"{ref.warehouse or remote}, namespace {namespace}"

    def names() -> list[str]:
        with contextlib.closing(ref.catalog()) as cat:
            return state_table_names(cat, namespace)

    def opener(name: str, branch: str = "main") -> IcebergStateTable:
        return _open_table(warehouse, catalog, properties, namespace, name, branch)

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    token = secrets.token_urlsafe(24)
    app = create_app(opener, names, where=where, scrub=lambda text: _scrubbed(text, catalog, properties),
                     tracebacks=DEBUG["traceback"], trusted_hosts=(*LOOPBACK_HOSTS, host) if loopback else None,
                     token=token)
    if not loopback:
        err_console.print(f"warning: listening on {host}, not on loopback: anyone who can reach this address and "
                          "learns its token can read the state of these tables, over plain HTTP", markup=False)
    server = make_server(host, port, app, threaded=True, request_handler=_request_handler_class())
    url = f"http://{host if ':' not in host else f'[{host}]'}:{server.server_port}/?{TOKEN_PARAMETER}={token}"
    console.print(f"state browser of {where} at [bold]{url}[/bold] (Ctrl-C stops it)", highlight=False)
    start_page = _start_page(url, server.server_port) if open_browser else None
    if start_page is not None:
        # The browser opens a file that leads to the address: the token never goes on a command line.
        threading.Timer(0.5, webbrowser.open, [f"file://{start_page}"]).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if start_page is not None:
            with contextlib.suppress(OSError):
                os.remove(start_page)


def _start_page(url: str, port: int) -> str:
    """A page of the user's own that leads the browser to ``url`` (which holds the token)."""
    import html
    import tempfile

    from statestore.private_dir import private_directory

    directory = private_directory(os.path.join(tempfile.gettempdir(), f"icestate-ui-{os.getuid()}"),
                                  what="the state browser's start pages")
    path = os.path.join(directory, f"open-{port}.html")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'<!doctype html><meta http-equiv="refresh" content="0;url={html.escape(url)}">'
                f'<a href="{html.escape(url)}">state browser</a>')
    return path


def _token_scrubbed(line: str) -> str:
    import re

    from catalog.ui.app import TOKEN_PARAMETER

    return re.sub(rf"([?&]{TOKEN_PARAMETER}=)[^&\s]*", r"\1...", line)


def _request_handler_class() -> type:
    from werkzeug.serving import WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        """Werkzeug's, logging each request without the browser's token."""

        def log(self, type: str, message: str, *args: Any) -> None:
            super().log(type, "%s", _token_scrubbed(message % args if args else message))

    return Handler

