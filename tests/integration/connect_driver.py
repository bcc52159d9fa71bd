"""A driver under Spark Connect (``test_spark_connect``): a Connect client, no JVM on this side.
Runs stateful queries and prints what it saw as one JSON line. Arguments: the work directory
(shared with the server, which runs on this host) and the server's ``sc://`` address."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQueryListener

from spark_integration import StateLocation, disable, enable, register, runner_of, start_stateful_query
from tests.hostile import forged_envelopes
from tests.integration import tws_processors as P
from tests.integration.streaming_helpers import AsyncCountProcessor, FailingProcessor


class Listener(StreamingQueryListener):
    def __init__(self) -> None:
        self.figures: dict[int, dict] = {}

    def onQueryStarted(self, event) -> None:
        pass

    def onQueryProgress(self, event) -> None:
        for source in event.progress.sources:
            try:
                offset = json.loads(source.latestOffset)
            except (TypeError, ValueError):
                continue
            if isinstance(offset, dict) and offset.get("icestate"):
                self.figures[offset["icestate"]["batchId"]] = offset["icestate"]

    def onQueryIdle(self, event) -> None:
        pass

    def onQueryTerminated(self, event) -> None:
        pass


def files(directory: str, spec: list[str]) -> str:
    os.makedirs(directory, exist_ok=True)
    for i, s in enumerate(spec):
        pq.write_table(pa.table({"key": list(s), "v": pa.array(range(len(s)), pa.int64())}),
                       f"{directory}/part-{i:04d}.parquet")
    return directory


def main(work: str, url: str) -> None:
    spark = SparkSession.builder.remote(url).config("spark.sql.shuffle.partitions", "2").getOrCreate()
    out: dict = {"session": type(spark).__module__}
    listener = Listener()
    spark.streams.addListener(listener)

    def stream(directory: str):
        return spark.readStream.schema("key string, v long").option("maxFilesPerTrigger", 1).parquet(directory)

    # Timers, batches without input, the callback's DataFrame.
    seen = f"{work}/sessions.jsonl"

    def record(df, batch_id):  # runs in the server's Python process: writes what it saw
        with open(seen, "a") as f:
            f.write(json.dumps([batch_id, sorted(list(r) for r in df.collect())]) + "\n")

    sessions = StateLocation(table="sessions", warehouse=f"{work}/wh", parallelism=2)
    query = start_stateful_query(stream(files(f"{work}/in-s", ["aab", "bc", "c"])), ["key"], P.SessionProcessor(1),
                                 P.SESSION_OUTPUT, location=sessions, checkpoint_location=f"{work}/cp-s",
                                 trigger={"availableNow": True}, time_mode="ProcessingTime", foreach_batch=record,
                                 compaction=None)
    query.awaitTermination(240)
    out["sessions_error"] = repr(query.exception())
    with open(seen) as f:
        out["sessions"] = [json.loads(line) for line in f]
    out["scratch_left"] = [
        name for _, _, names in os.walk(f"{work}/wh") for name in names if "scratch" in _]

    # Counts (an async processor), then the state read back through the data source, and the
    # figures a listener got.
    counts = StateLocation(table="counts", warehouse=f"{work}/wh", parallelism=2)
    query = start_stateful_query(stream(files(f"{work}/in-c", ["aab", "bca", "d"])), ["key"], AsyncCountProcessor(),
                                 "key string, count long", location=counts, checkpoint_location=f"{work}/cp-c",
                                 trigger={"availableNow": True}, output_table="out.counts", compaction=None,
                                 progress_figures=True, api="async")
    query.awaitTermination(240)
    out["counts_error"] = repr(query.exception())
    register(spark)
    state = spark.read.format("icestate").option("warehouse", counts.warehouse).option("table", "counts") \
        .option("state", "count").load()
    out["state"] = sorted((r["key"], r["v_count"]["n"]) for r in state.collect())
    deadline = time.monotonic() + 30
    while len(listener.figures) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    out["figures"] = listener.figures

    # An existing job's own code after one call: the processor, a stateless operator after it,
    # Spark's writer (spark_integration.dropin).
    enable(spark, warehouse=f"{work}/wh-dropin")
    seen_dropin = f"{work}/dropin.jsonl"

    def record_dropin(df, batch_id):
        with open(seen_dropin, "a") as f:
            f.write(json.dumps([batch_id, sorted(list(r) for r in df.collect())]) + "\n")

    query = (stream(files(f"{work}/in-d", ["aab", "bca"])).groupBy("key")
             .transformWithState(P.CountsProcessor(), P.COUNTS_OUTPUT, "Update", "None")
             .select("key", "count").writeStream.option("checkpointLocation", f"{work}/cp-d")
             .trigger(availableNow=True).foreachBatch(record_dropin).start())
    query.awaitTermination(240)
    out["dropin_error"] = repr(query.exception())
    out["dropin_table"] = runner_of(query).location.warehouse == f"{work}/wh-dropin"
    with open(seen_dropin) as f:
        out["dropin"] = [json.loads(line) for line in f]
    # The same job into Spark's other sinks: memory (a table of the client's session), a
    # parquet file sink (exactly once with its _spark_metadata log), foreach (a function per row,
    # in the server's workers), console (printed by the server).
    seen_rows = f"{work}/foreach.jsonl"

    def record_row(row):
        with open(seen_rows, "a") as f:
            f.write(json.dumps(list(row)) + "\n")

    sinks = {"memory": lambda w: w.format("memory").queryName("dropin_memory").outputMode("update"),
             "parquet": lambda w: w.format("parquet").option("path", f"{work}/files-d"),
             "foreach": lambda w: w.foreach(record_row),
             "console": lambda w: w.format("console").outputMode("update")}
    out["sinks_error"] = {}
    for name, sink in sinks.items():
        query = sink(stream(f"{work}/in-d").groupBy("key")
                     .transformWithState(P.CountsProcessor(), P.COUNTS_OUTPUT, "Update", "None")
                     .select("key", "count").writeStream.option("checkpointLocation", f"{work}/cp-d-{name}")
                     .trigger(availableNow=True)).start()
        try:  # a failed query raises here under Connect
            ended = query.awaitTermination(120)
            out["sinks_error"][name] = "None" if ended else "did not end in 120 s"
        except Exception as e:
            ended, out["sinks_error"][name] = True, repr(e)[:2000]
        if not ended:
            query.stop()
    disable(spark)
    out["sink_memory"] = sorted(list(r) for r in spark.table("dropin_memory").collect())
    out["sink_parquet"] = sorted(list(r) for r in spark.read.parquet(f"{work}/files-d").collect())
    out["sink_parquet_log"] = sorted(n for n in os.listdir(f"{work}/files-d/_spark_metadata") if n[0] != ".")
    with open(seen_rows) as f:
        out["sink_foreach"] = sorted(json.loads(line) for line in f)

    # A processor's exception, as itself, when its message quotes an input value shaped like the
    # exception envelope (each forged form; loading any would create ``marker``).
    marker = f"{work}/pwned"
    hostile = " ".join(forged_envelopes(marker))
    os.makedirs(f"{work}/in-h", exist_ok=True)
    pq.write_table(pa.table({"key": ["a", hostile], "v": pa.array([1, 2], pa.int64())}), f"{work}/in-h/part-0.parquet")
    query = start_stateful_query(stream(f"{work}/in-h"), ["key"], FailingProcessor(hostile), "key string, count long",
                                 location=StateLocation(table="failing", warehouse=f"{work}/wh", parallelism=2),
                                 checkpoint_location=f"{work}/cp-f", trigger={"availableNow": True}, compaction=None)
    try:
        query.awaitTermination(240)
        out["failure"] = None
    except Exception as e:
        out["failure"] = [type(e).__name__, e.args[0] == f"no profile for {hostile}",
                          [n.replace(hostile, "<hostile>") for n in getattr(e, "__notes__", [])],
                          type(e.__cause__).__name__]
    out["marker_made"] = os.path.exists(marker)
    spark.streams.removeListener(listener)
    print("RESULT " + json.dumps(out), flush=True)
    spark.stop()


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except BaseException:  # the Connect client's threads would keep a failed driver alive
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
