"""The ``icestate`` program: the one command-line entry point (``[project.scripts]``).

It owns its Typer app: the main job (``stream``, which needs Spark, hence this package)
plus the state-table commands of ``catalog.cli``, mounted without a name so they sit at
the top level (``icestate sql ...``). ``HELP`` and the commands' docstrings are what users
read in ``--help``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from catalog.cli import DEBUG, Warehouse, _reporting_errors, console, tables

HELP = """\
Keyed state for PySpark Structured Streaming, kept in Apache Iceberg tables.

Run the main job, a streaming job on local Spark whose state lives in Iceberg:

    icestate stream --warehouse ./warehouse

Then look at the state it wrote (one table per stateful operator):

\b
    icestate checkpoints --table demo_user_activity
    icestate sql --table demo_user_activity "SELECT user, v_events.n FROM state_events LIMIT 5"

Every command takes --warehouse (default ./warehouse); the table commands also take --catalog NAME
and --property KEY=VALUE for any Iceberg catalog and a remote warehouse (secrets: .pyiceberg.yaml
or the environment). `icestate COMMAND --help` tells more.
"""

app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP)
app.add_typer(tables)


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        print(f"icestate {version('icestate')}")
        raise typer.Exit()


@app.callback()
def main(debug: Annotated[bool, typer.Option(
        "--debug", help="On an error, show its traceback (secrets scrubbed) before the one-line message.")] = False,
         _version: Annotated[bool, typer.Option(
             "--version", is_eager=True, callback=_print_version, help="Print the version and exit.")] = False,
         ) -> None:
    DEBUG["traceback"] = debug


@app.command(rich_help_panel="Main job")
@_reporting_errors
def stream(
    warehouse: Warehouse = "./warehouse",
    users: Annotated[int, typer.Option(help="Distinct users in the generated page views.")] = 20_000,
    events: Annotated[int, typer.Option(help="Page views per micro-batch.")] = 100_000,
    first_batches: Annotated[int, typer.Option(help="Micro-batches of the first run.")] = 3,
    second_batches: Annotated[int, typer.Option(help="Micro-batches after the restart.")] = 2,
    first_parallelism: Annotated[int, typer.Option(help="Tasks of the first run.")] = 2,
    second_parallelism: Annotated[int, typer.Option(
        help="Tasks after the restart: a different number rescales the job (no state is copied).")] = 4,
) -> None:
    """Run the main job: two stateful streaming queries on local Spark, with their state in Iceberg.

    Page views arrive as files. One query keeps per-user activity (a Spark
    transformWithState processor, its output written to the Iceberg table
    demo.user_activity), the other a running count per page. The job runs a few
    micro-batches, stops, restarts with more tasks, then checks every user's and page's
    state against the input and prints the checkpoints. It starts afresh: earlier state
    tables of this job in the warehouse are dropped.

    Example: icestate stream --warehouse ./warehouse --events 20000 --users 2000
    """
    from spark_integration.demo import run_stream_demo

    result = run_stream_demo(warehouse, users=users, events_per_batch=events,
                             batches=(first_batches, second_batches),
                             parallelism=(first_parallelism, second_parallelism), console=console)
    console.print(f"[bold green]done[/bold green]: {result.events:,} events in {result.batches} micro-batches, "
                  f"{result.users_verified:,} users and {result.pages_verified:,} pages verified, "
                  f"{result.seconds:.1f} s")


if __name__ == "__main__":
    app()
