"""``icestate``: the command line (typer). The store and table commands come from
``catalog.cli``; this module adds the streaming main job.

    icestate stream --warehouse ./warehouse      the main job (spark_integration/demo.py)
    icestate demo --warehouse ./warehouse        the store alone, without Spark (catalog/demo.py)
    icestate checkpoints --warehouse ./warehouse --table demo_user_activity
    icestate sql --warehouse ./warehouse --table demo_user_activity "SELECT ..."
"""

from __future__ import annotations

import typer

from catalog.cli import app, console

app.info.help = __doc__


@app.command()
def stream(
    warehouse: str = typer.Option("./warehouse", help="local warehouse directory (SQLite catalog inside)"),
    users: int = typer.Option(20_000, help="distinct users"),
    events: int = typer.Option(100_000, help="events per micro-batch"),
    first_batches: int = typer.Option(3, help="micro-batches of the first run"),
    second_batches: int = typer.Option(2, help="micro-batches after the restart"),
    first_parallelism: int = typer.Option(2, help="tasks of the first run"),
    second_parallelism: int = typer.Option(4, help="tasks after the restart (a rescale)"),
) -> None:
    """Run the main job: stateful streaming queries on local Spark with state in Iceberg."""
    from spark_integration.demo import run_stream_demo

    result = run_stream_demo(warehouse, users=users, events_per_batch=events,
                             batches=(first_batches, second_batches),
                             parallelism=(first_parallelism, second_parallelism), console=console)
    console.print(f"[bold green]done[/bold green]: {result.events:,} events in {result.batches} micro-batches, "
                  f"{result.users_verified:,} users and {result.pages_verified:,} pages verified, "
                  f"{result.seconds:.1f} s")


if __name__ == "__main__":
    app()
