"""``icestate``: the command line of the state store (typer).

    icestate demo --warehouse ./warehouse        the main job (see catalog/demo.py)
    icestate checkpoints --warehouse ./warehouse --table demo_running_count
    icestate sql --warehouse ./warehouse --table demo_running_count "SELECT ..."
    icestate savepoint --warehouse ./warehouse --table demo_running_count before-upgrade
    icestate fork --warehouse ./warehouse --table demo_running_count v2 --savepoint before-upgrade
    icestate refs --warehouse ./warehouse --table demo_running_count
    icestate compact --warehouse ./warehouse --table demo_running_count [--follow 10]
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()


@app.command()
def demo(
    warehouse: str = typer.Option("./warehouse", help="local warehouse directory (SQLite catalog inside)"),
    keys: int = typer.Option(100_000, help="distinct user keys"),
    batches: int = typer.Option(5, help="micro-batches, one checkpoint each"),
    events: int = typer.Option(200_000, help="events per micro-batch"),
    parallelism: int = typer.Option(2, help="tasks"),
    max_parallelism: int = typer.Option(128, help="key groups"),
    table: str = typer.Option("demo_running_count", help="state table name"),
) -> None:
    """Run the main job: a keyed running count with checkpoints, a crash and a restore."""
    from catalog.demo import run_demo

    result = run_demo(warehouse, keys=keys, batches=batches, events_per_batch=events, parallelism=parallelism,
                      max_parallelism=max_parallelism, table_name=table, console=console)
    console.print(f"[bold green]done[/bold green]: {result.events:,} events, {result.checkpoints} checkpoints, "
                  f"{result.verified_keys:,} keys verified after restore, {result.seconds:.1f} s")


@app.command()
def checkpoints(
    warehouse: str = typer.Option("./warehouse"),
    table: str = typer.Option(..., help="state table name"),
    namespace: str = typer.Option("state"),
    branch: str = typer.Option("main", help="the line: main or a fork"),
) -> None:
    """List the retained checkpoints of a state table (of one line)."""
    from catalog.iceberg_table import IcebergStateTable

    t = IcebergStateTable.open_existing(warehouse=warehouse, namespace=namespace, table_name=table, branch=branch)
    out = Table(title=f"{namespace}.{table} ({branch})")
    for col in ("checkpoint", "batch", "parallelism", "max parallelism", "snapshot", "properties"):
        out.add_column(col)
    for c in t.list_checkpoints():
        out.add_row(str(c.checkpoint_id), str(c.batch_id), str(c.parallelism), str(c.max_parallelism),
                    str(c.snapshot_id), json.dumps(c.properties))
    console.print(out)


@app.command()
def sql(
    query: str = typer.Argument(..., help="SQL over the views `entries` (raw LSM entries) and `state_<name>`"),
    warehouse: str = typer.Option("./warehouse"),
    table: str = typer.Option(..., help="state table name"),
    namespace: str = typer.Option("state"),
    checkpoint: int | None = typer.Option(None, help="checkpoint id (default: newest)"),
    branch: str = typer.Option("main", help="the line: main or a fork"),
    savepoint: str | None = typer.Option(None, help="read this savepoint instead of a checkpoint"),
) -> None:
    """Query a state table with DuckDB at a checkpoint or savepoint."""
    from catalog.iceberg_table import IcebergStateTable
    from catalog.sql import connect

    t = IcebergStateTable.open_existing(warehouse=warehouse, namespace=namespace, table_name=table,
                                        checkpoint_id=checkpoint, branch=branch, savepoint=savepoint)
    con = connect(t)
    result = con.sql(query)
    out = Table()
    for col in result.columns:
        out.add_column(col)
    for row in result.fetchall():
        out.add_row(*[str(v) for v in row])
    console.print(out)


@app.command()
def savepoint(
    name: str = typer.Argument(..., help="savepoint name"),
    warehouse: str = typer.Option("./warehouse"),
    table: str = typer.Option(..., help="state table name"),
    namespace: str = typer.Option("state"),
    checkpoint: int | None = typer.Option(None, help="checkpoint id (default: newest)"),
    branch: str = typer.Option("main", help="the line the checkpoint is on"),
) -> None:
    """Keep a checkpoint as a named savepoint (an Iceberg tag retention never expires)."""
    from catalog.iceberg_table import IcebergStateTable

    with IcebergStateTable.open_existing(warehouse=warehouse, namespace=namespace, table_name=table,
                                         branch=branch) as t:
        info = t.savepoint(name, checkpoint)
    console.print(f"savepoint [bold]{name}[/bold] = checkpoint {info.checkpoint_id} (snapshot {info.snapshot_id})")


@app.command()
def fork(
    name: str = typer.Argument(..., help="fork (branch) name"),
    warehouse: str = typer.Option("./warehouse"),
    table: str = typer.Option(..., help="state table name"),
    namespace: str = typer.Option("state"),
    checkpoint: int | None = typer.Option(None, help="checkpoint id of main (default: newest)"),
    savepoint: str | None = typer.Option(None, help="fork at this savepoint instead"),
) -> None:
    """Fork the state at a checkpoint or savepoint: a branch a new job version can run on."""
    from catalog.iceberg_table import IcebergStateTable

    with IcebergStateTable.open_existing(warehouse=warehouse, namespace=namespace, table_name=table) as t:
        info = t.fork(name, checkpoint, savepoint=savepoint)
    console.print(f"fork [bold]{name}[/bold] at checkpoint {info.checkpoint_id}: run a query with "
                  f"StateLocation(..., branch={name!r})")


@app.command()
def refs(
    warehouse: str = typer.Option("./warehouse"),
    table: str = typer.Option(..., help="state table name"),
    namespace: str = typer.Option("state"),
) -> None:
    """List the savepoints and forks of a state table."""
    from catalog.iceberg_table import IcebergStateTable

    with IcebergStateTable.open_existing(warehouse=warehouse, namespace=namespace, table_name=table) as t:
        out = Table(title=f"{namespace}.{table}: savepoints and forks")
        for col in ("kind", "name", "checkpoint", "batch", "snapshot"):
            out.add_column(col)
        for name, c in t.savepoints().items():
            out.add_row("savepoint", name, str(c.checkpoint_id), str(c.batch_id), str(c.snapshot_id))
        for name, c in t.forks().items():
            out.add_row("fork", name, *(("-", "-", "-") if c is None else
                                        (str(c.checkpoint_id), str(c.batch_id), str(c.snapshot_id))))
    console.print(out)


@app.command()
def compact(
    warehouse: str = typer.Option("./warehouse"),
    table: str = typer.Option(..., help="state table name"),
    namespace: str = typer.Option("state"),
    branch: str = typer.Option("main", help="the line: main or a fork"),
    min_segments: int | None = typer.Option(None, help="policy: compact units with at least this many segments "
                                            "(default: every unit with 2 or more, merged whole)"),
    size_ratio: float = typer.Option(1.0, help="policy: an older segment joins a merge when its bytes are at most "
                                     "this times the newer ones'"),
    key_groups: str | None = typer.Option(None, help="only the units overlapping this key-group range, e.g. 0-31"),
    follow: float | None = typer.Option(None, help="keep compacting every this many seconds (beside a writer)"),
    as_json: bool = typer.Option(False, "--json", help="print the figures as JSON"),
) -> None:
    """Compact a state table's segments now (a writer's next checkpoint follows the compaction)."""
    import time

    from catalog.compaction import CompactionPolicy
    from catalog.compaction import compact as run
    from catalog.iceberg_table import IcebergStateTable
    from statestore.keygroups import KeyGroupRange

    try:
        policy = None if min_segments is None else CompactionPolicy(min_segments=min_segments, size_ratio=size_ratio)
        if min_segments is None and size_ratio != 1.0:
            policy = CompactionPolicy(min_segments=2, size_ratio=size_ratio)
        kgs = None if key_groups is None else KeyGroupRange.of(*map(int, key_groups.split("-", 1)))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    with IcebergStateTable.open_existing(warehouse=warehouse, namespace=namespace, table_name=table,
                                         branch=branch) as t:
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


if __name__ == "__main__":
    app()
