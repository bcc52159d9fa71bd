"""The ``icestate`` program: the one command-line entry point (``[project.scripts]``).

It owns its Typer app: the main job (``stream``, which needs Spark, hence this package)
plus the state-table commands of ``catalog.cli``, mounted without a name so they sit at
the top level (``icestate sql ...``). ``HELP`` and the commands' docstrings are what users
read in ``--help``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from catalog.cli import (
    DEBUG,
    CatalogName,
    CatalogProperties,
    Namespace,
    TableWarehouse,
    Warehouse,
    _reporting_errors,
    _table_ref,
    _track,
    console,
    spark_session,
    tables,
)

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


@app.command(name="import-spark-state", rich_help_panel="State tables")
@_reporting_errors
def import_spark_state(
    checkpoint: Annotated[str, typer.Option(
        show_default=False, help="The stopped query's checkpointLocation on Spark's own state store (only read).")],
    to: Annotated[str, typer.Option(
        show_default=False, help="A new checkpoint location: start the same query on it to continue here.")],
    table: Annotated[str | None, typer.Option(
        show_default=False, help="The new state table. Default: the one the one-call switch "
        "(spark_integration.enable) gives a query named --query-name on checkpoint --to.")] = None,
    query_name: Annotated[str | None, typer.Option(
        show_default=False, help="The query's queryName, for the default --table.")] = None,
    aggregate: Annotated[str | None, typer.Option(
        metavar="AGG[:COLUMN]", show_default=False,
        help="For an aggregation's state (groupBy().agg()): the aggregate the query continues with as "
             "RunningAggregate(AGG, COLUMN), e.g. count or sum:amount.")] = None,
    deduplicate: Annotated[bool, typer.Option(
        "--deduplicate", help="For dropDuplicates' state: the query continues with Deduplicate().")] = False,
    max_parallelism: Annotated[int, typer.Option(help="Key groups of the new table (its most tasks).")] = 128,
    master: Annotated[str, typer.Option(
        help="Spark master that reads Spark's state (when the process has no Spark session yet).")] = "local[2]",
    spark_conf: Annotated[list[str] | None, typer.Option(
        "--spark-conf", metavar="KEY=VALUE", show_default=False,
        help="A Spark setting, repeatable (e.g. the checkpoint's filesystem); keep secrets in spark-defaults.conf "
             "or the environment.")] = None,
    warehouse: TableWarehouse = None,
    catalog: CatalogName = None,
    properties: CatalogProperties = None,
    namespace: Namespace = "state",
) -> None:
    """Bring a stopped Spark query's state over from Spark's own state store.

    Reads every state variable of the query's transformWithState (values, lists, maps, TTL
    expiries, registered timers; an aggregation's aggregate per key with --aggregate; the keys
    dropDuplicates saw with --deduplicate) at its last committed batch into a new state table,
    and copies the query's progress (offsets, commits, the sources' logs; not its state) to --to. Start
    the same query on --to, with icestate: it continues at the next batch, every input row
    counted once. Spark's checkpoint is left as it was, so the query can go back to it.

    Example: icestate import-spark-state --checkpoint ./checkpoints/counts --to ./checkpoints/counts-icestate
    --query-name counts --warehouse ./warehouse
    """


    from spark_integration.dropin import state_table_name
    from spark_integration.location import StateLocation
    from spark_integration.spark_import import import_spark_state as run_import
    from spark_integration.vectorized import Deduplicate, RunningAggregate

    processor = None
    if aggregate and deduplicate:
        raise typer.BadParameter("give --aggregate or --deduplicate, not both", param_hint="'--aggregate'")
    if aggregate:
        agg, _, column = aggregate.partition(":")
        try:
            processor = RunningAggregate(agg, column or None)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="'--aggregate'") from None
    elif deduplicate:
        processor = Deduplicate()

    ref = _table_ref(warehouse, catalog, properties, namespace, table or state_table_name(query_name, to), "main")
    location = StateLocation(table=ref.table, warehouse=ref.warehouse, namespace=ref.namespace,
                             max_parallelism=max_parallelism, catalog_name=ref.catalog_name,
                             catalog_properties=ref.catalog_properties)
    with spark_session(master, "icestate import-spark-state", spark_conf) as spark:
        report = run_import(spark, checkpoint, to, location=location, processor=processor, progress=_track)
    rows = ", ".join(f"{name} {n:,}" for name, n in report.rows.items())
    console.print(f"[bold green]{'already imported' if report.resumed else 'imported'}[/bold green]: "
                  f"batch {report.batch_id} of the query as checkpoint {report.checkpoint_id} of {report.table}"
                  + (f" ({rows})" if rows else "") + f" in {report.seconds:.1f} s; start the query on {to}",
                  markup=True, highlight=False)


if __name__ == "__main__":
    app()
