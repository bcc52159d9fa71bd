"""Our implementations of the keyed running count, through ``spark_integration``: the row
processor of the ``spark-tws-rows`` peer run unchanged, and the vectorized ``RunningAggregate``.
``spark_integration`` is imported when a query starts, so the Spark peers run without it."""

from __future__ import annotations

from typing import Any

from benchmarks.streaming.impl import OUTPUT_SCHEMA, Impl, RunContext
from benchmarks.streaming.processors import CountProcessor


def _start_ours(source: Any, ctx: RunContext, processor: Any) -> Any:
    """Ours, against the contract of ``spark_integration.start_stateful_query``."""
    import spark_integration

    location = spark_integration.StateLocation(warehouse=ctx.warehouse, table=ctx.table, max_parallelism=128,
                                               parallelism=ctx.parallelism)
    return spark_integration.start_stateful_query(
        source, keys=["key"], processor=processor, output_schema=OUTPUT_SCHEMA, location=location,
        checkpoint_location=ctx.checkpoint, trigger={"availableNow": True}, foreach_batch=ctx.sink)


def _ours_compat(source: Any, ctx: RunContext) -> Any:
    return _start_ours(source, ctx, CountProcessor())


def _ours_vectorized(source: Any, ctx: RunContext) -> Any:
    import spark_integration

    return _start_ours(source, ctx, spark_integration.RunningAggregate("count"))


OURS = (
    Impl("ours-compat", "ours, Spark-compatible processor API", _ours_compat, None, ours=True),
    Impl("ours-vectorized", "ours, vectorized RunningAggregate", _ours_vectorized, None, ours=True),
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
