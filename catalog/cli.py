"""The state-table commands of the ``icestate`` program: list checkpoints, query with SQL,
keep savepoints, fork, list refs, compact.

``tables`` is a Typer app the program (``spark_integration.cli``) mounts without a name,
so its commands sit at the top level (``icestate sql ...``); it is not a program of its
own. The docstrings of the commands and the ``help`` of the options are the users' help
text: they speak of tables and checkpoints, never of modules. Every command opens its
table through ``_open_table``, the one place that knows how a table is found.
"""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from catalog.iceberg_table import IcebergStateTable

tables = typer.Typer()
console = Console()
# The program lists these commands under one heading, apart from the main job.
_command = partial(tables.command, rich_help_panel="State tables")

# Options every command shares, declared once so their help reads the same everywhere.
Warehouse = Annotated[str, typer.Option(
    help="Warehouse directory: holds the embedded SQLite Iceberg catalog and every table's files.")]
TableName = Annotated[str, typer.Option(
    "--table", help="State table: one per stateful operator (the main job writes demo_user_activity "
    "and demo_page_views).")]
Namespace = Annotated[str, typer.Option(help="Iceberg namespace of the state table.")]
Branch = Annotated[str, typer.Option(help="Line of checkpoints to use: main, or the name of a fork.")]
Checkpoint = Annotated[int | None, typer.Option(help="Checkpoint id (see `icestate checkpoints`). "
                                                "Default: the newest.")]


def _open_table(warehouse: str, namespace: str, table: str, branch: str = "main", **at) -> IcebergStateTable:
    """Open an existing state table for a command (``TableRef.open``); ``at`` picks the point in
    time (``checkpoint_id``, ``savepoint``). The one opener of this module."""
    from catalog.table_ref import TableRef

    return TableRef(table, namespace=namespace, warehouse=warehouse, branch=branch).open(**at)


@_command()
def checkpoints(table: TableName, warehouse: Warehouse = "./warehouse", namespace: Namespace = "state",
                branch: Branch = "main") -> None:
    """List the retained checkpoints of a state table, oldest first.

    Each checkpoint is an Iceberg snapshot; the list shows its stream batch, the number of
    tasks that wrote it and its properties.

    Example: icestate checkpoints --table demo_user_activity
    """
    t = _open_table(warehouse, namespace, table, branch=branch)
    out = Table(title=f"{namespace}.{table} ({branch})")
    for col in ("checkpoint", "batch", "parallelism", "max parallelism", "snapshot", "properties"):
        out.add_column(col)
    for c in t.list_checkpoints():
        out.add_row(str(c.checkpoint_id), str(c.batch_id), str(c.parallelism), str(c.max_parallelism),
                    str(c.snapshot_id), json.dumps(c.properties))
    console.print(out)


@_command()
def sql(
    query: Annotated[str, typer.Argument(
        help="SQL (DuckDB) over the views state_<variable> (the live state of each state variable, one row "
             "per key) and entries (the raw stored entries).")],
    table: TableName,
    warehouse: Warehouse = "./warehouse",
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

    t = _open_table(warehouse, namespace, table, checkpoint_id=checkpoint, branch=branch, savepoint=savepoint)
    result = connect(t).sql(query)
    out = Table()
    for col in result.columns:
        out.add_column(col)
    for row in result.fetchall():
        out.add_row(*[str(v) for v in row])
    console.print(out)


@_command()
def savepoint(
    name: Annotated[str, typer.Argument(help="Name of the new savepoint, e.g. before-upgrade.")],
    table: TableName,
    warehouse: Warehouse = "./warehouse",
    namespace: Namespace = "state",
    checkpoint: Checkpoint = None,
    branch: Branch = "main",
) -> None:
    """Keep a checkpoint as a named savepoint, which retention never expires.

    Query it later with `icestate sql --savepoint NAME` or start a fork from it with
    `icestate fork`.

    Example: icestate savepoint before-upgrade --table demo_user_activity
    """
    with _open_table(warehouse, namespace, table, branch=branch) as t:
        info = t.savepoint(name, checkpoint)
    console.print(f"savepoint [bold]{name}[/bold] = checkpoint {info.checkpoint_id} (snapshot {info.snapshot_id})")


@_command()
def fork(
    name: Annotated[str, typer.Argument(help="Name of the fork, e.g. v2.")],
    table: TableName,
    warehouse: Warehouse = "./warehouse",
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
    with _open_table(warehouse, namespace, table) as t:
        info = t.fork(name, checkpoint, savepoint=savepoint)
    console.print(f"fork [bold]{name}[/bold] at checkpoint {info.checkpoint_id}: run a query with "
                  f"StateLocation(..., branch={name!r})")


@_command()
def refs(table: TableName, warehouse: Warehouse = "./warehouse", namespace: Namespace = "state") -> None:
    """List the savepoints and forks of a state table, with the checkpoint each one is at.

    Example: icestate refs --table demo_user_activity
    """
    with _open_table(warehouse, namespace, table) as t:
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
    warehouse: Warehouse = "./warehouse",
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
    with _open_table(warehouse, namespace, table, branch=branch) as t:
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
