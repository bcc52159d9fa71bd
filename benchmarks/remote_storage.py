"""Remote-storage benchmark: what S3 round trips cost the store, beside local disk.

One run starts moto's S3 server (``tests.s3_server``, a real process on loopback) and our
latency-and-fault proxy in front of it (``tests.net_proxy``), and measures, for each
*variant* (``VARIANTS``: local disk with the embedded SQLite catalog, and S3 through the
proxy at 0, 10 and 20 ms per request, a SQLite catalog on local disk whose warehouse is
``s3://``, opened through ``TableRef`` as any pyiceberg catalog):

1. *Checkpoint commit* of a ``delta``-key delta of one store (a value state), in the steady
   state of a stream (each commit expires the oldest retained checkpoint): the flush
   (segment upload), the commit (Iceberg metadata) and the whole checkpoint, median of
   ``repeat``, and the requests of the expired files' deletes, which run in the background;
   then as many through ``StateStore.checkpoint()`` (the store alone: the segment uploads
   while the commit prepares its metadata);
2. *Cold open to first lookup* of task 0 of ``tasks`` on a ``keys``-key state written by
   ``tasks`` tasks over ``checkpoints`` checkpoints: a fresh ``TableRef.open`` (the
   restore: metadata only), a fresh ``StateStore`` and a batched get of ``lookup`` of the
   task's keys, median of ``repeat``;
3. *Warm lookup + update throughput* of that task (every key group cached): ``batches``
   batched gets and updates of ``batch`` keys, keys/s of the median batch;
4. *Lookup throughput with a view cache smaller than the state* (``cache_fraction`` of the
   task's resolved views): each batch reads ``batch`` keys of a random ``cache_fraction`` of
   the task's key groups (a batch pins its key groups in the cache, so a batch over all of
   them would never evict), so most of each batch's key groups are read again.

For each operation the proxy counts the requests it forwarded, per method, and the cold
lookup's requests are listed by pattern (method, path with names generalized). Local
variants have no proxy: their request counts are empty. The catalog (SQLite) is local in
every variant: only the object store is remote.

Prints tables, writes ``benchmarks/results/remote_storage.json`` and a plot
(``docs/remote_storage.png``; with ``--quick``, ``remote_storage_quick.*`` under the results; with
``ICESTATE_BENCH_RESULTS_DIR`` set, the plot goes there too).
Run: ``.venv/bin/python -m benchmarks.remote_storage`` (``--quick`` for the smoke test).

Adding a variant (say, S3 with a warm local file cache): one more ``Variant`` in
``variants()``; its store settings go through ``store_config`` alone, and ``prepare`` may
warm what it needs before the measurements.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import typer
from rich.table import Table

from benchmarks.harness import (
    COUNT,
    MAX_PARALLELISM,
    REPO,
    RESULTS_DIR_ENV,
    build_count_state,
    console,
    count_layout,
    machine_info,
    owners,
    pyplot,
    results_path,
    save_figure,
    user_keys,
    write_results,
)
from catalog import TableRef
from catalog.fileio import METADATA_FILES
from catalog.iceberg_table import DEFAULT_RETAIN_CHECKPOINTS
from catalog.task_view import TaskStateTable
from statestore import StateStore, StoreConfig, assign_key_groups
from statestore.file_cache import close_process_file_caches
from tests import s3_server
from tests.net_proxy import NetProxy, Traffic

BUCKET = "icestate-bench"
STATE_TABLE = "remote_state"
DOCS_PLOT = REPO / "docs" / "remote_storage.png"


# Variants --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One storage setting measured: where the tables are, the proxy's latency, and the
    store settings it adds (``store_options``, merged by ``store_config``)."""

    name: str
    remote: bool
    latency_ms: float = 0.0
    store_options: Mapping[str, Any] = field(default_factory=dict)
    # Called with the variant's store config factory and the table ref before its cold and
    # warm measurements (a file-cache variant would fill its cache here).
    prepare: Callable[[Callable[..., StoreConfig], TableRef], None] | None = None


def variants(latencies_ms: list[float]) -> list[Variant]:
    return [Variant("local", remote=False)] + [Variant(f"s3 {ms:g} ms", remote=True, latency_ms=ms)
                                               for ms in latencies_ms]


def store_config(variant: Variant, **overrides: Any) -> StoreConfig:
    """The settings of every store the benchmark measures: the defaults, the variant's own
    options, then the measurement's (``cache_size_bytes_max`` for the small-cache run)."""
    return StoreConfig(**{**variant.store_options, **overrides})


# Where tables are -------------------------------------------------------------------------


class Storage:
    """Table references for local and S3 variants, and the proxy's counts around an operation."""

    def __init__(self, root: Path, proxy: NetProxy | None):
        self.root = root
        self.proxy = proxy

    def ref(self, variant: Variant, table: str) -> TableRef:
        if not variant.remote:
            return TableRef(table, warehouse=str(self.root / "local"))
        if self.proxy is None:
            raise RuntimeError("an S3 variant needs the proxy")
        catalog_dir = self.root / "s3-catalog"
        catalog_dir.mkdir(parents=True, exist_ok=True)
        properties = {"type": "sql", "uri": f"sqlite:///{catalog_dir}/catalog.db", "init_catalog_tables": "true",
                      "warehouse": f"s3://{BUCKET}/warehouse", **s3_server.properties(self.proxy.endpoint)}
        return TableRef(table, catalog_name="remote_bench", catalog_properties=properties)

    def use(self, variant: Variant) -> None:
        if variant.remote:
            self.proxy.latency_s = variant.latency_ms / 1000

    @contextmanager
    def counting(self, into: list[Traffic]) -> Iterator[None]:
        """Append the traffic of the block to ``into`` (an empty ``Traffic`` without a proxy)."""
        if self.proxy is not None:
            self.proxy.reset()
        try:
            yield
        finally:
            into.append(self.proxy.snapshot() if self.proxy is not None else Traffic())


def by_method(traffic: Traffic) -> dict[str, int]:
    return dict(sorted(traffic.by_method.items()))


def median_counts(traffics: list[Traffic]) -> dict[str, float]:
    """Per method, the median over repetitions of the requests (a repetition without a method
    counts 0)."""
    methods = sorted({m for t in traffics for m in t.by_method})
    return {m: statistics.median(t.by_method.get(m, 0) for t in traffics) for m in methods}


# Request patterns -----------------------------------------------------------------------

_PATTERNS = [
    (re.compile(r"seg-cp\d+-t\d+-p\d+-[0-9a-f]+\.parquet"), "seg-*.parquet"),
    (re.compile(r"op-cp\d+-t\d+-[0-9a-f]+\.parquet"), "op-*.parquet"),
    (re.compile(r"\d{5}-[0-9a-f-]{36}\.metadata\.json"), "*.metadata.json"),
    (re.compile(r"snap-\d+-\d+-[0-9a-f-]{36}\.avro"), "snap-*.avro (manifest list)"),
    (re.compile(r"[0-9a-f-]{36}-m\d+\.avro"), "*-m*.avro (manifest)"),
    (re.compile(r"uploadId=[^&]+"), "uploadId=*"),
    (re.compile(r"partNumber=\d+"), "partNumber=N"),
    (re.compile(r"continuation-token=[^&]+"), "continuation-token=*"),
]


def pattern(method: str, target: str, headers: Mapping[str, str], table_prefix: str) -> str:
    """``method target`` with the table's location shortened to ``<table>`` and file names
    generalized; ``(ranged)`` marks a ranged GET."""
    text = target.replace(table_prefix, "<table>")
    for regex, repl in _PATTERNS:
        text = regex.sub(repl, text)
    return f"{method} {text}" + (" (ranged)" if "range" in headers else "")


def patterns(traffic: Traffic, table_prefix: str) -> list[list]:
    """``[pattern, count]`` of each request pattern, in order of first appearance."""
    counts = Counter(pattern(r.method, r.target, r.headers, table_prefix) for r in traffic.requests)
    return [[p, n] for p, n in counts.items()]


# Measurements ---------------------------------------------------------------------------


def bench_commit(storage: Storage, variant: Variant, delta: int, repeat: int) -> dict:
    """Checkpoints of ``delta`` new keys each, as a long-running stream makes them: after
    ``DEFAULT_RETAIN_CHECKPOINTS`` + 1 unmeasured ones, so that each measured commit also
    expires the oldest checkpoint (whose files then go in the background: their deletes are
    waited for after the commit and counted apart). Flush, commit and the whole, median of
    ``repeat``."""
    ref = storage.ref(variant, f"commit_{_slug(variant.name)}")
    table = ref.open(count_layout())
    table_prefix = "/" + table.location.split("://", 1)[-1]
    store = StateStore(table, config=store_config(variant))
    state = store.get_state(COUNT)
    flush_s, commit_s, total_s = [], [], []
    flush_t: list[Traffic] = []
    commit_t: list[Traffic] = []
    delete_t: list[Traffic] = []
    rng = np.random.default_rng(11)
    warm_up = DEFAULT_RETAIN_CHECKPOINTS + 1
    for r in range(warm_up + repeat):
        ids = rng.choice(10 * delta * (warm_up + repeat), size=delta, replace=False)
        state.update_batch(user_keys(ids), pa.array(np.full(delta, r, dtype=np.int64)))
        flush_rec: list[Traffic] = []
        commit_rec: list[Traffic] = []
        t0 = time.perf_counter()
        with storage.counting(flush_rec):
            checkpoint_id = table.next_checkpoint_id()
            segments = store.flush(checkpoint_id)
        t1 = time.perf_counter()
        with storage.counting(commit_rec):
            table.commit_checkpoint(checkpoint_id, segments, parallelism=1)
            store.checkpoint_complete(checkpoint_id)
        t2 = time.perf_counter()
        with storage.counting(delete_t if r >= warm_up else []):
            table.wait_for_deletes()
        if r < warm_up:
            continue
        flush_s.append(t1 - t0)
        commit_s.append(t2 - t1)
        total_s.append(t2 - t0)
        flush_t += flush_rec
        commit_t += commit_rec
    # The same, through the store's own API: the segment uploads beside the commit.
    store_s: list[float] = []
    store_t: list[Traffic] = []
    for r in range(warm_up + repeat, warm_up + 2 * repeat):
        ids = rng.choice(10 * delta * (warm_up + 2 * repeat), size=delta, replace=False)
        state.update_batch(user_keys(ids), pa.array(np.full(delta, r, dtype=np.int64)))
        t0 = time.perf_counter()
        with storage.counting(store_t):
            store.checkpoint()
        store_s.append(time.perf_counter() - t0)
        table.wait_for_deletes()
    store.close()
    table.close()
    return {
        "store_checkpoint_s_median": statistics.median(store_s), "store_checkpoint_s_all": store_s,
        "store_checkpoint_requests": median_counts(store_t),
        "delta_keys": delta, "repeat": repeat, "warm_up_checkpoints": warm_up,
        "flush_s_median": statistics.median(flush_s), "commit_s_median": statistics.median(commit_s),
        "checkpoint_s_median": statistics.median(total_s),
        "flush_s_all": flush_s, "commit_s_all": commit_s, "checkpoint_s_all": total_s,
        "flush_requests": median_counts(flush_t), "commit_requests": median_counts(commit_t),
        "background_delete_requests": median_counts(delete_t),
        "checkpoint_requests": median_counts([_merge(a, b) for a, b in zip(flush_t, commit_t, strict=True)]),
        "flush_patterns": patterns(flush_t[-1], table_prefix) if flush_t else [],
        "commit_patterns": patterns(commit_t[-1], table_prefix) if commit_t else [],
        "background_delete_patterns": patterns(delete_t[-1], table_prefix) if delete_t else [],
    }


def bench_round_trip(storage: Storage, samples: int = 20) -> float:
    """Median time of one HEAD of a small object through the proxy, in seconds: what one
    request costs at the current latency (moto's own time included)."""
    props = s3_server.properties(storage.proxy.endpoint)
    fs = pafs.S3FileSystem(access_key=props["s3.access-key-id"], secret_key=props["s3.secret-access-key"],
                           region=props["s3.region"], endpoint_override=storage.proxy.endpoint, scheme="http")
    path = f"{BUCKET}/round-trip-probe"
    with fs.open_output_stream(path) as out:
        out.write(b"probe")
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fs.get_file_info(path)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_state(storage: Storage, variant: Variant, keys: int, checkpoints: int, tasks: int) -> None:
    """The measured state: ``keys`` keys written by ``tasks`` task stores over ``checkpoints``
    checkpoints (each checkpoint commits every task's segments as one snapshot)."""
    table = storage.ref(variant, STATE_TABLE).open(count_layout())
    build_count_state(table, keys, checkpoints, tasks, f"{variant.name}: building a {keys:,}-key state")
    table.close()


def task_ids(keys: int, tasks: int) -> np.ndarray:
    """The ids of the keys task 0 of ``tasks`` owns."""
    all_ids = np.arange(keys)
    return all_ids[owners(user_keys(all_ids), tasks) == 0]


def ids_by_key_group(ids: np.ndarray) -> dict[int, np.ndarray]:
    """``ids`` grouped by the key group of their key."""
    kgs = assign_key_groups(user_keys(ids), MAX_PARALLELISM)
    return {int(kg): ids[kgs == kg] for kg in np.unique(kgs)}


def bench_cold(storage: Storage, variant: Variant, keys: int, tasks: int, lookup: int, repeat: int) -> dict:
    """A task's fresh table object, fresh store and first batched lookup of ``lookup`` keys."""
    ref = storage.ref(variant, STATE_TABLE)
    mine = task_ids(keys, tasks)
    rng = np.random.default_rng(12)
    open_s, lookup_s, total_s, task_s = [], [], [], []
    task_t: list[Traffic] = []
    open_t: list[Traffic] = []
    lookup_t: list[Traffic] = []
    table_prefix = ""
    for _ in range(repeat):
        ids = rng.choice(mine, size=min(lookup, len(mine)), replace=False)
        request = user_keys(ids)
        open_rec: list[Traffic] = []
        lookup_rec: list[Traffic] = []
        close_process_file_caches()  # a task on a new host: nothing of the table on local disk
        METADATA_FILES.clear()  # a new driver process: none of the table's metadata in memory
        t0 = time.perf_counter()
        with storage.counting(open_rec):
            table = ref.open(count_layout())
        t1 = time.perf_counter()
        with storage.counting(lookup_rec):
            store = StateStore(table, task_index=0, parallelism=tasks, config=store_config(variant))
            got = store.get_state(COUNT).get_batch(request)
        t2 = time.perf_counter()
        if got.to_numpy().tolist() != ids.tolist():
            raise AssertionError(f"{variant.name}: the cold lookup returned wrong values")
        table_prefix = "/" + table.location.split("://", 1)[-1]
        store.close()
        # A task of a streaming query: the driver ships the checkpoint's view, the task reads
        # no metadata (catalog.task_view), on a new host (empty file cache).
        view = table.checkpoint_view()
        table.close()
        close_process_file_caches()
        task_rec: list[Traffic] = []
        t3 = time.perf_counter()
        with storage.counting(task_rec):
            task = StateStore(TaskStateTable(view, count_layout()), task_index=0, parallelism=tasks,
                              config=store_config(variant))
            got = task.get_state(COUNT).get_batch(request)
        task_s.append(time.perf_counter() - t3)
        if got.to_numpy().tolist() != ids.tolist():
            raise AssertionError(f"{variant.name}: the task's cold lookup returned wrong values")
        task.close()
        task_t += task_rec
        open_s.append(t1 - t0)
        lookup_s.append(t2 - t1)
        total_s.append(t2 - t0)
        open_t += open_rec
        lookup_t += lookup_rec
    return {
        "state_keys": keys, "tasks": tasks, "task_keys": len(mine), "lookup_keys": min(lookup, len(mine)),
        "repeat": repeat,
        "open_s_median": statistics.median(open_s), "first_lookup_s_median": statistics.median(lookup_s),
        "open_to_first_lookup_s_median": statistics.median(total_s),
        "open_s_all": open_s, "first_lookup_s_all": lookup_s, "open_to_first_lookup_s_all": total_s,
        "task_first_lookup_s_median": statistics.median(task_s), "task_first_lookup_s_all": task_s,
        "task_first_lookup_requests": median_counts(task_t),
        "open_requests": median_counts(open_t), "first_lookup_requests": median_counts(lookup_t),
        "open_to_first_lookup_requests": median_counts([_merge(a, b) for a, b in zip(open_t, lookup_t, strict=True)]),
        "open_patterns": patterns(open_t[-1], table_prefix),
        "first_lookup_patterns": patterns(lookup_t[-1], table_prefix),
    }


def bench_throughput(storage: Storage, variant: Variant, keys: int, tasks: int, batch: int, batches: int,
                     cache_fraction: float) -> dict:
    """Warm lookup + update throughput, then lookups with a view cache of ``cache_fraction``
    of the task's views."""
    ref = storage.ref(variant, STATE_TABLE)
    mine = task_ids(keys, tasks)
    batch = min(batch, len(mine))
    rng = np.random.default_rng(13)
    out: dict = {"task_keys": len(mine), "batch_keys": batch, "batches": batches}

    table = ref.open(count_layout())
    store = StateStore(table, task_index=0, parallelism=tasks, config=store_config(variant))
    state = store.get_state(COUNT)
    state.get_batch(user_keys(mine))  # every key group of the task in the cache
    views_bytes = store.stats()["cache_size_bytes"]
    rec: list[Traffic] = []
    batch_s = []
    with storage.counting(rec):
        for _ in range(batches):
            request = user_keys(rng.choice(mine, size=batch, replace=False))
            t0 = time.perf_counter()
            values = state.get_batch(request)
            state.update_batch(request, pc.add(values, 1))
            batch_s.append(time.perf_counter() - t0)
    # The median batch: the machine is shared, and a batch that waited for the CPU says nothing
    # about storage (these batches make no request at all).
    out["warm"] = {"keys_per_s": batch / statistics.median(batch_s),
                   "keys_per_s_overall": batches * batch / sum(batch_s), "batch_s_all": batch_s,
                   "requests": by_method(rec[0]), "views_bytes": views_bytes}
    store.close()
    table.close()

    # A batch pins the key groups it reads (the cache never evicts those of the running
    # request), so each batch reads keys of a random ``cache_fraction`` of the task's key
    # groups: it fits the cache, and the next batch mostly needs other key groups.
    cache = max(1, int(views_bytes * cache_fraction))
    groups = ids_by_key_group(mine)
    per_batch = max(1, round(len(groups) * cache_fraction))

    def small_batch() -> pa.Table:
        chosen = rng.choice(np.array(sorted(groups)), size=per_batch, replace=False)
        pool = np.concatenate([groups[int(kg)] for kg in chosen])
        return user_keys(rng.choice(pool, size=min(batch, len(pool)), replace=False))

    table = ref.open(count_layout())
    store = StateStore(table, task_index=0, parallelism=tasks,
                       config=store_config(variant, cache_size_bytes_max=cache))
    state = store.get_state(COUNT)
    state.get_batch(user_keys(mine))  # footers read once, as a running task has them
    requests = [small_batch() for _ in range(batches)]
    before = store.stats()
    rec = []
    batch_s = []
    with storage.counting(rec):
        for request in requests:
            t0 = time.perf_counter()
            state.get_batch(request)
            batch_s.append(time.perf_counter() - t0)
    elapsed = sum(batch_s)
    stats = store.stats()
    looked_up = sum(r.num_rows for r in requests)
    # Overall, not the median batch: the misses are the measure, and they vary by batch.
    out["small_cache"] = {"keys_per_s": looked_up / elapsed, "elapsed_s": elapsed, "keys": looked_up,
                          "batch_s_all": batch_s,
                          "cache_size_bytes_max": cache, "cache_fraction": cache_fraction,
                          "key_groups_per_batch": per_batch, "task_key_groups": len(groups),
                          "requests": by_method(rec[0]), "requests_per_batch": rec[0].count / batches,
                          "cache_misses": stats["cache_misses"] - before["cache_misses"],
                          "cache_evictions": stats["cache_evictions"] - before["cache_evictions"],
                          "cache_size_bytes_after": stats["cache_size_bytes"],
                          "segment_bytes_read": stats["segment_bytes_read"] - before["segment_bytes_read"]}
    store.close()
    table.close()
    return out


def _merge(a: Traffic, b: Traffic) -> Traffic:
    return Traffic(requests=a.requests + b.requests, connections=a.connections + b.connections,
                   bytes_to_server=a.bytes_to_server + b.bytes_to_server,
                   bytes_to_client=a.bytes_to_client + b.bytes_to_client,
                   by_method=dict(Counter(a.by_method) + Counter(b.by_method)))


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


# The run --------------------------------------------------------------------------------


def run(root: Path, chosen: list[Variant], *, keys: int, checkpoints: int, tasks: int, delta: int, lookup: int,
        batch: int, batches: int, cache_fraction: float, repeat: int) -> dict:
    server = s3_server.start(root) if any(v.remote for v in chosen) else None
    proxy = NetProxy(server.endpoint).start() if server else None
    try:
        if server:
            s3_server.create_bucket(server.endpoint, BUCKET)
        storage = Storage(root, proxy)
        built: set[bool] = set()
        out: dict = {}
        for variant in chosen:
            if variant.remote not in built:  # one state per store kind, built without latency
                storage.use(Variant("build", remote=variant.remote))
                build_state(storage, variant, keys, checkpoints, tasks)
                built.add(variant.remote)
            storage.use(variant)
            if variant.prepare is not None:
                variant.prepare(functools.partial(store_config, variant), storage.ref(variant, STATE_TABLE))
            round_trip = bench_round_trip(storage) if variant.remote else None
            with console.status(f"{variant.name}: checkpoints"):
                commit = bench_commit(storage, variant, delta, repeat)
            with console.status(f"{variant.name}: cold open to first lookup"):
                cold = bench_cold(storage, variant, keys, tasks, lookup, repeat)
            with console.status(f"{variant.name}: lookup throughput"):
                throughput = bench_throughput(storage, variant, keys, tasks, batch, batches, cache_fraction)
            out[variant.name] = {"remote": variant.remote, "latency_ms": variant.latency_ms,
                                 "store_options": dict(variant.store_options), "head_round_trip_s": round_trip,
                                 "commit": commit, "cold": cold, "throughput": throughput}
            console.log(f"{variant.name}: checkpoint {commit['checkpoint_s_median'] * 1e3:.0f} ms, "
                        f"cold open to first lookup {cold['open_to_first_lookup_s_median'] * 1e3:.0f} ms")
        return out
    finally:
        if proxy is not None:
            proxy.close()
        if server is not None:
            server.stop()


def main(
    quick: bool = typer.Option(False, help="tiny sizes (the smoke test); results named remote_storage_quick"),
    keys: int = typer.Option(200_000, help="keys of the state read by the cold and throughput runs"),
    checkpoints: int = typer.Option(4, help="checkpoints the state is written in"),
    tasks: int = typer.Option(4, help="tasks that write the state; task 0 is measured"),
    delta: int = typer.Option(10_000, help="keys of each measured checkpoint"),
    lookup: int = typer.Option(1_000, help="keys of the cold first lookup"),
    batch: int = typer.Option(5_000, help="keys per batch of the throughput runs"),
    batches: int = typer.Option(10, help="batches of the throughput runs"),
    cache_fraction: float = typer.Option(0.125, help="view cache of the small-cache run, as a fraction of the views"),
    repeat: int = typer.Option(5, help="repetitions of the commit and cold measurements (median)"),
    latencies: str = typer.Option("0,10,20", help="proxy latencies of the S3 variants, ms per request"),
    plot: Path | None = typer.Option(None, help="where the plot goes (default docs/remote_storage.png; "
                                                "with --quick or a results folder set, beside the results)"),
) -> None:
    if quick:
        keys, checkpoints, tasks, delta, lookup, batch, batches, repeat = 4_000, 2, 2, 500, 100, 500, 2, 1
        latencies = "0,5"
    latencies_ms = [float(x) for x in latencies.split(",") if x.strip()]
    chosen = variants(latencies_ms)
    params = {"keys": keys, "checkpoints": checkpoints, "tasks": tasks, "delta": delta, "lookup": lookup,
              "batch": batch, "batches": batches, "cache_fraction": cache_fraction, "repeat": repeat,
              "latencies_ms": latencies_ms}
    root = Path(tempfile.mkdtemp(prefix="remote_storage_"))
    try:
        t0 = time.perf_counter()
        measured = run(root, chosen, **{k: v for k, v in params.items() if k != "latencies_ms"})
        total = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {"machine": machine_info(), "params": params, "total_s": total, "variants": measured}
    stem = "remote_storage_quick" if quick else "remote_storage"
    path = write_results(f"{stem}.json", results)
    # A run into another results folder (the suite's, a probe's) keeps its plot there too.
    plot_path = plot or (results_path(f"{stem}.png") if quick or os.environ.get(RESULTS_DIR_ENV) else DOCS_PLOT)
    _plot(results, plot_path)
    _report(results)
    console.log(f"total {total:.0f} s; results in {path}, plot in {plot_path}")


# Report ---------------------------------------------------------------------------------

MEASURES = [
    ("checkpoint (flush + commit), ms", ("commit", "checkpoint_s_median"), 1e3),
    ("  flush (segment upload), ms", ("commit", "flush_s_median"), 1e3),
    ("  commit (metadata), ms", ("commit", "commit_s_median"), 1e3),
    ("StateStore.checkpoint() (upload beside the commit), ms", ("commit", "store_checkpoint_s_median"), 1e3),
    ("cold open to first lookup, ms", ("cold", "open_to_first_lookup_s_median"), 1e3),
    ("  open (restore), ms", ("cold", "open_s_median"), 1e3),
    ("  first batched lookup, ms", ("cold", "first_lookup_s_median"), 1e3),
    ("task's cold first lookup (shipped view), ms", ("cold", "task_first_lookup_s_median"), 1e3),
    ("warm lookup + update, keys/s (median batch)", ("throughput", "warm", "keys_per_s"), 1),
    ("small-cache lookup, keys/s", ("throughput", "small_cache", "keys_per_s"), 1),
]
REQUESTS = [
    ("flush", ("commit", "flush_requests")),
    ("commit", ("commit", "commit_requests")),
    ("StateStore.checkpoint()", ("commit", "store_checkpoint_requests")),
    ("its garbage (background)", ("commit", "background_delete_requests")),
    ("open (restore)", ("cold", "open_requests")),
    ("first lookup", ("cold", "first_lookup_requests")),
    ("task's cold first lookup", ("cold", "task_first_lookup_requests")),
    ("warm batches (all)", ("throughput", "warm", "requests")),
    ("small-cache batches (all)", ("throughput", "small_cache", "requests")),
]


def _get(d: Mapping, path: tuple[str, ...]) -> Any:
    for k in path:
        d = d[k]
    return d


def _fmt_requests(counts: Mapping[str, float]) -> str:
    counts = {m: n for m, n in counts.items() if n}
    if not counts:
        return "0"
    total = sum(counts.values())
    return f"{total:g}: " + " ".join(f"{m} {n:g}" for m, n in counts.items())


def _report(results: dict) -> None:
    vs = results["variants"]
    p = results["params"]
    t = Table(title=f"remote storage: {p['delta']:,}-key checkpoints; task 0 of {p['tasks']} on a "
                    f"{p['keys']:,}-key state ({p['checkpoints']} checkpoints); medians of {p['repeat']}")
    t.add_column("measure")
    for name in vs:
        t.add_column(name, justify="right")
    t.add_row("one HEAD round trip (moto + proxy), ms",
              *["-" if v["head_round_trip_s"] is None else f"{v['head_round_trip_s'] * 1e3:.1f}" for v in vs.values()])
    for label, path, scale in MEASURES:
        t.add_row(label, *[f"{_get(v, path) * scale:,.0f}" for v in vs.values()])
    console.print(t)
    r = Table(title="requests per operation (median per method over repetitions; local: no proxy)")
    r.add_column("operation")
    remote = {n: v for n, v in vs.items() if v["remote"]}
    for name in remote:
        r.add_column(name, justify="right")
    for label, path in REQUESTS:
        r.add_row(label, *[_fmt_requests(_get(v, path)) for v in remote.values()])
    console.print(r)
    if remote:
        last = next(reversed(remote.values()))
        pt = Table(title="requests of a cold open and first lookup, by pattern")
        pt.add_column("phase")
        pt.add_column("request")
        pt.add_column("count", justify="right")
        for phase, key in (("open", "open_patterns"), ("first lookup", "first_lookup_patterns"),
                           ("flush", "flush_patterns"), ("commit", "commit_patterns")):
            section = last["cold"] if key in last["cold"] else last["commit"]
            for pat, n in section[key]:
                pt.add_row(phase, pat, str(n))
        console.print(pt)


def _plot(results: dict, path: Path) -> None:
    vs = results["variants"]
    remote = [v for v in vs.values() if v["remote"]]
    local = vs.get("local")
    x = [v["latency_ms"] for v in remote]
    panels = [
        ("checkpoint of a delta", "ms", [("flush + commit", ("commit", "checkpoint_s_median"), 1e3),
                                         ("flush", ("commit", "flush_s_median"), 1e3),
                                         ("commit", ("commit", "commit_s_median"), 1e3)]),
        ("cold open to first lookup", "ms", [("open + first lookup", ("cold", "open_to_first_lookup_s_median"), 1e3),
                                             ("open", ("cold", "open_s_median"), 1e3),
                                             ("first lookup", ("cold", "first_lookup_s_median"), 1e3),
                                             ("task (shipped view) first lookup",
                                              ("cold", "task_first_lookup_s_median"), 1e3)]),
        ("lookup throughput", "keys/s", [("warm lookup + update", ("throughput", "warm", "keys_per_s"), 1),
                                         ("small view cache", ("throughput", "small_cache", "keys_per_s"), 1)]),
    ]
    fig, axes = pyplot().subplots(1, len(panels), figsize=(15, 4.2))
    for ax, (title, unit, lines) in zip(axes, panels, strict=True):
        for i, (label, key, scale) in enumerate(lines):
            color = f"C{i}"
            if remote:
                ax.plot(x, [_get(v, key) * scale for v in remote], "o-", color=color, label=f"S3: {label}")
            if local is not None:
                ax.axhline(_get(local, key) * scale, color=color, ls="--", lw=1, label=f"local: {label}")
        ax.set_xticks(x)
        ax.set_xlabel("proxy latency per S3 request (ms)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    p = results["params"]
    fig.suptitle(f"S3 (moto on loopback behind a latency proxy) vs local disk: {p['delta']:,}-key checkpoints; "
                 f"task 0 of {p['tasks']}, {p['keys']:,}-key state, {p['lookup']:,}-key first lookup", fontsize=10)
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    typer.run(main)
