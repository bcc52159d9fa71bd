"""``icestate``: the command line of the state store (typer).

    icestate demo --warehouse ./warehouse        the main job (see catalog/demo.py)
    icestate checkpoints --warehouse ./warehouse --table demo_running_count
    icestate sql --warehouse ./warehouse --table demo_running_count "SELECT ..."
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
) -> None:
    """List the retained checkpoints of a state table."""
    from catalog.iceberg_table import IcebergStateTable

    t = IcebergStateTable.open_existing(warehouse=warehouse, namespace=namespace, table_name=table)
    out = Table(title=f"{namespace}.{table}")
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
) -> None:
    """Query a state table with DuckDB at a checkpoint."""
    from catalog.iceberg_table import IcebergStateTable
    from catalog.sql import connect

    t = IcebergStateTable.open_existing(warehouse=warehouse, namespace=namespace, table_name=table,
                                        checkpoint_id=checkpoint)
    con = connect(t)
    result = con.sql(query)
    out = Table()
    for col in result.columns:
        out.add_column(col)
    for row in result.fetchall():
        out.add_row(*[str(v) for v in row])
    console.print(out)


if __name__ == "__main__":
    app()
