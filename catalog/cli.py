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
import functools
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
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

    return Config()


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


@_command()
def checkpoints(table: TableName, warehouse: TableWarehouse = None, catalog: CatalogName = None,
                properties: CatalogProperties = None, namespace: Namespace = "state", branch: Branch = "main") -> None:
    """List the retained checkpoints of a state table, oldest first.

    Each checkpoint is an Iceberg snapshot; the list shows its stream batch, the number of
    tasks that wrote it and its properties.

    Example: icestate checkpoints --table demo_user_activity
    """
    with _open_table(warehouse, catalog, properties, namespace, table, branch=branch) as t:
        listed = t.list_checkpoints()
    out = Table(title=f"{namespace}.{table} ({branch})")
    for col in ("checkpoint", "batch", "parallelism", "max parallelism", "snapshot", "properties"):
        out.add_column(col)
    for c in listed:
        out.add_row(str(c.checkpoint_id), str(c.batch_id), str(c.parallelism), str(c.max_parallelism),
                    str(c.snapshot_id), Text(json.dumps(c.properties)))
    console.print(out)


@_command()
def sql(
    query: Annotated[str, typer.Argument(
        help="SQL (DuckDB) over the views state_<variable> (the live state of each state variable, one row "
             "per key) and entries (the raw stored entries).")],
    table: TableName,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
    checkpoint: Checkpoint = None,
    branch: Branch = "main",
    savepoint: Annotated[str | None, typer.Option(
        help="Read this savepoint instead of a checkpoint.")] = None,
) -> None:
    """Query a state table with SQL, at its newest checkpoint or at an older one or a savepoint.

    Each state variable is a view named state_<variable> with the key columns and the
    value as v_<variable>. Nothing is restored and no job needs to run.

    Example: icestate sql --table demo_user_activity "SELECT user, v_events.n FROM state_events ORDER BY 2 DESC LIMIT 5"
    """
    from catalog.sql import connect

    with _open_table(warehouse, catalog, properties, namespace, table, checkpoint_id=checkpoint, branch=branch,
                     savepoint=savepoint) as t:
        result = connect(t).sql(query)
        if result is None:  # a statement without rows
            return
        columns, rows = result.columns, result.fetchall()
    out = Table()
    for col in columns:
        out.add_column(Text(col))
    for row in rows:
        # Values are the users' data, printed as they are (no console markup).
        out.add_row(*[Text(str(v)) for v in row])
    console.print(out)


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
) -> None:
    """Merge a state table's small segment files into fewer, larger ones, now or every few seconds.

    Reads stay the same; they get faster. A running job can keep writing: its next
    checkpoint follows the compaction.

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
    with _open_table(warehouse, catalog, properties, namespace, table, branch=branch) as t:
        while True:
            result = run(t, policy=policy, key_groups=kgs)
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
