"""Our implementations of the keyed running count, through ``spark_integration``: the row
processor of the ``spark-tws-rows`` peer run unchanged, the pandas processor of the
``spark-tws-pandas`` peer run unchanged (``api="pandas"``), and the vectorized ``RunningAggregate``.
``spark_integration`` is imported when a query starts, so the Spark peers run without it."""

from __future__ import annotations

import json
import os
from typing import Any

from benchmarks.streaming.impl import OUTPUT_SCHEMA, Impl, RunContext
from benchmarks.streaming.processors import CountProcessor, PandasCountProcessor, SessionCountProcessor

# The catalog properties of the remote variants (``-s3``): the bench process starts moto's S3
# server behind our latency proxy and publishes where it is here, for the job processes.
S3_CATALOG_ENV = "ICESTATE_BENCH_S3_CATALOG"


def _start_ours(source: Any, ctx: RunContext, processor: Any, remote: bool = False, **options: Any) -> Any:
    """Ours, against the contract of ``spark_integration.start_stateful_query``; with ``remote``
    the state lives on S3 (the SQLite catalog stays in the run's warehouse directory);
    ``options`` go to ``start_stateful_query`` (``api``, ``time_mode``)."""
    import spark_integration

    where: dict[str, Any] = {"warehouse": ctx.warehouse}
    if remote:
        props = json.loads(os.environ[S3_CATALOG_ENV])
        os.makedirs(ctx.warehouse, exist_ok=True)
        where = {"catalog_name": "bench_s3", "catalog_properties": {
            **props, "uri": f"sqlite:///{ctx.warehouse}/catalog.db", "warehouse": f"{props['warehouse']}/{ctx.table}"}}
    location = spark_integration.StateLocation(table=ctx.table, max_parallelism=128, parallelism=ctx.parallelism,
                                               **where)
    if ctx.store_config and "store_config" not in options:
        from statestore import StoreConfig

        options["store_config"] = StoreConfig(**ctx.store_config)
    return spark_integration.start_stateful_query(
        source, keys=["key"], processor=processor, output_schema=OUTPUT_SCHEMA, location=location,
        checkpoint_location=ctx.checkpoint, trigger={"availableNow": True}, foreach_batch=ctx.sink, **options)


def _ours_compat(source: Any, ctx: RunContext) -> Any:
    return _start_ours(source, ctx, CountProcessor())


def _ours_pandas(source: Any, ctx: RunContext) -> Any:
    return _start_ours(source, ctx, PandasCountProcessor(), api="pandas")


def _ours_vectorized(source: Any, ctx: RunContext) -> Any:
    import spark_integration

    return _start_ours(source, ctx, spark_integration.RunningAggregate("count"))


def _ours_vectorized_uncounted(source: Any, ctx: RunContext) -> Any:
    import spark_integration
    from statestore import StoreConfig

    return _start_ours(source, ctx, spark_integration.RunningAggregate("count"),
                       store_config=StoreConfig(**(ctx.store_config or {}), count_live_rows=False))


def _ours_compat_s3(source: Any, ctx: RunContext) -> Any:
    return _start_ours(source, ctx, CountProcessor(), remote=True)


def _ours_vectorized_s3(source: Any, ctx: RunContext) -> Any:
    import spark_integration

    return _start_ours(source, ctx, spark_integration.RunningAggregate("count"), remote=True)


OURS = (
    Impl("ours-compat", "ours, Spark-compatible processor API", _ours_compat, None, ours=True),
    Impl("ours-pandas", "ours, Spark's pandas processor (api='pandas')", _ours_pandas, None, ours=True),
    Impl("ours-vectorized", "ours, vectorized RunningAggregate", _ours_vectorized, None, ours=True),
    Impl("ours-vectorized-uncounted", "ours, vectorized, without the live-row count (numRowsTotal)",
         _ours_vectorized_uncounted, None, ours=True),
    Impl("ours-compat-s3", "ours, Spark-compatible API, state on S3 (proxy latency)", _ours_compat_s3, None,
         ours=True, remote=True),
    Impl("ours-vectorized-s3", "ours, vectorized, state on S3 (proxy latency)", _ours_vectorized_s3, None,
         ours=True, remote=True),
)


def _ours_sessions(source: Any, ctx: RunContext) -> Any:
    return _start_ours(source, ctx, SessionCountProcessor(ctx.gap_ms), time_mode="ProcessingTime")


# The sessions workload (``benchmarks.streaming.sessions``).
OURS_SESSIONS = (
    Impl("ours-sessions", "ours, the same processor, ProcessingTime timers", _ours_sessions, None, ours=True),
)


def ours_unavailable_reason() -> str | None:
    """None when ``spark_integration.start_stateful_query`` can be imported, else why not."""
    try:
        import spark_integration
    except Exception as exc:
        return f"import spark_integration failed: {type(exc).__name__}: {exc}"
    missing = [n for n in ("start_stateful_query", "StateLocation", "RunningAggregate")
               if not hasattr(spark_integration, n)]
    return f"spark_integration has no {', '.join(missing)}" if missing else None
