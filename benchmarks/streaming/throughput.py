"""The throughput scenario: every implementation over each data set, one fresh process per
run, rerun while other processes disturbed it; events/s overall, steady (after the first
batch) and per CPU-second of the run's own process tree, and ratios against the Spark peers
on the same data set.
"""

from __future__ import annotations

import statistics

from benchmarks.harness import console, events_per_s, ratio
from benchmarks.streaming.data import DataSet, verify
from benchmarks.streaming.peers import SPARK_PEERS
from benchmarks.streaming.registry import IMPLS
from benchmarks.streaming.runner import Runner, stream_job


def _throughput(result: dict, data: DataSet, check: str | None) -> dict:
    """Events/s overall (query start to end) and steady (batches after the first, by their
    durations), the first batch, and the output check."""
    batches = result["batches"]
    steady = batches[1:]
    return {
        "events": data.events, "keys": data.keys, "batches": len(batches), "wall_s": result["wall_s"],
        "session_s": result["session_s"], "process_s": result["process_s"], "machine": result["machine"],
        "events_per_s": data.events / result["wall_s"],
        "steady_events_per_s": events_per_s(steady),
        "first_batch_s": batches[0]["batch_ms"] / 1e3 if batches else None,
        "steady_batch_s_median": statistics.median(b["batch_ms"] for b in steady) / 1e3 if steady else None,
        "sink_s_total": sum(b["sink_s"] for b in result["sink"]),
        "verified": verify(result["sink"], data, kind=check), "per_batch": batches,
        "ours_batches": result.get("ours_batches"),
    }


def _least_disturbed_run(runner: Runner, name: str, data: DataSet, reruns: int, sink: str) -> dict:
    """Run ``name`` on ``data``; while other processes used more than 0.3 cores during the run,
    run it again from scratch (at most ``reruns`` times) and keep the least disturbed run."""
    runs: list[dict] = []
    for attempt in range(reruns + 1):
        job = stream_job(name, data.files[0].parent, runner.root, f"{name}-{data.name}-{attempt}", data.sample,
                         sink=sink)
        runs.append(runner.run(job, f"{name} on {data.name}: {data.events:,} events, {data.keys:,} keys, "
                                    f"{len(data.files)} batches" + (f" (rerun {attempt})" if attempt else "")))
        if "error" in runs[-1] or runs[-1]["machine"].get("other_cores", 0) <= 0.3:
            break
    # The least disturbed of the runs that did not fail (a failed or timed-out run has no figures).
    best = min(runs, key=lambda r: ("error" in r, r.get("machine", {}).get("other_cores", 0)))
    best["attempts"] = len(runs)
    return best


def run_throughput(runner: Runner, impls: list[str], datasets: dict[str, DataSet], ours_reason: str | None,
                   reruns: int, tws_main: bool = False, sink: str = "checksum") -> list:
    rows = []
    for data in datasets.values():
        for name in impls:
            impl = IMPLS[name]
            if data.name == "main" and impl.per_key_jvm_calls and not (tws_main and name == "spark-tws-rows"):
                continue
            entry = {"impl": name, "label": impl.label, "dataset": data.name, "events": data.events,
                     "keys": data.keys, "batches": len(data.files), "sink": sink}
            if impl.ours and ours_reason:
                rows.append({**entry, "status": "not available", "reason": ours_reason})
                continue
            result = _least_disturbed_run(runner, name, data, reruns, sink)
            if "error" in result:
                rows.append({**entry, "status": "failed", "reason": result["error"]})
                continue
            row = {**entry, "status": "ok", "attempts": result["attempts"], **_throughput(result, data, impl.verify)}
            v = row["verified"]
            said = "not checked" if not v.get("checked", True) else "verified" if v["ok"] else v["problems"]
            console.log(f"  {row['events_per_s']:,.0f} events/s overall, {row['steady_events_per_s'] or 0:,.0f} "
                        f"steady; output {said}")
            rows.append(row)
    derive(rows)
    return rows


def derive(rows: list[dict]) -> None:
    """Events per CPU-second of each ok run (CPU of its process tree: robust to other work on a
    shared machine), and each ok run divided by each Spark peer's run on the same data set."""
    ok = {(r["impl"], r["dataset"]): r for r in rows if r["status"] == "ok"}
    for r in ok.values():
        r["cpu_s"] = r["machine"].get("own_cores", 0) * r["wall_s"]
        r["events_per_cpu_s"] = r["events"] / r["cpu_s"] if r["cpu_s"] else None
    for r in ok.values():
        # A remote variant (state on S3 behind the latency proxy) against the same on local disk.
        local = ok.get((r["impl"].removesuffix("-s3"), r["dataset"])) if r["impl"].endswith("-s3") else None
        if local:
            r["vs_local"] = {"overall": r["events_per_s"] / local["events_per_s"],
                             "steady": ratio(r["steady_events_per_s"], local["steady_events_per_s"])}
    for r in ok.values():
        r["ratios"] = {}
        for peer in SPARK_PEERS:
            p = ok.get((peer, r["dataset"]))
            if p:
                r["ratios"][peer] = {
                    "overall": r["events_per_s"] / p["events_per_s"],
                    "per_cpu_s": ratio(r["events_per_cpu_s"], p["events_per_cpu_s"]),
                    "steady": ratio(r["steady_events_per_s"], p["steady_events_per_s"])}
