"""Measure what a cold store reads from S3 (moto's server on loopback), with and without the
local file cache of segments: HTTP requests by method (from the server's request log) and
the store's counters.

    PYTHONPATH=$PWD python -m tests.measure_file_cache [--keys 20000] [--checkpoints 4]

Mode ``none`` reads straight from S3 (before the cache: the same but for one more HEAD per
segment read, from opening each file twice); mode ``cache`` writes through the cache, then
drops it and reads as a new process would (cold store: fetches; second store: none).
Not a test (pytest does not collect it): figures for the report and the design notes.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from statestore.config import StoreConfig
from statestore.file_cache import close_process_file_caches
from statestore.store import StateStore
from tests import s3_server
from tests.contract.backends import IcebergS3Backend

_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP')


class RequestLog:
    """Counts the server's requests logged since the last ``mark``."""

    def __init__(self, path: Path):
        self._path = path
        self._offset = 0

    def mark(self) -> None:
        self._offset = self._path.stat().st_size

    def since_mark(self, bucket: str) -> dict[str, int]:
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            text = f.read().decode(errors="replace")
        counts: collections.Counter[str] = collections.Counter()
        for method, target in _REQUEST.findall(text):
            kind = "data" if "/data/" in target else ("metadata" if "/metadata/" in target else "other")
            if target.startswith(f"/{bucket}") or kind != "other":
                counts[f"{method} {kind}"] += 1
        return dict(sorted(counts.items()))


def cache_config(mode: str, directory: str) -> StoreConfig:
    if mode == "none":
        return StoreConfig(file_cache_mode="off")
    return StoreConfig(file_cache_mode="on", file_cache_dir=directory)


def run(keys: int, checkpoints: int, mode: str, log: RequestLog, backend: IcebergS3Backend,
        backend_dir: Path) -> dict:
    cache_dir = str(backend_dir / "file-cache")
    config = cache_config(mode, cache_dir)
    table = backend.open(key_groups_per_partition=4)
    writer = StateStore(table, config=config)
    count = writer.get_state("count")
    log.mark()
    for cp in range(checkpoints):
        ks = pa.table({"k": pa.array(range(cp * keys // 2, cp * keys // 2 + keys), pa.int64())})
        count.update_batch(ks, list(range(ks.num_rows)))
        writer.checkpoint()
    written = log.since_mark(IcebergS3Backend.BUCKET)
    writer_stats = writer.stats()
    everything = pa.table({"k": pa.array(range(checkpoints * keys), pa.int64())})
    # The writer reads back what it flushed (its own segments: with the cache, all local).
    log.mark()
    writer.reader.reset()
    writer.get_state("count").get_batch(everything)
    own_read = log.since_mark(IcebergS3Backend.BUCKET)
    writer.close()

    results = {"mode": mode, "write_requests": written, "writer_read_back_requests": own_read,
               "writer_stats": {k: v for k, v in writer_stats.items() if "file" in k or "segment" in k}}
    # Readers in a new process: no cache yet (the writer's process filled its own).
    close_process_file_caches()
    for label in ("cold_store", "second_cold_store"):
        reopened = backend.open()  # table metadata read before the mark: only segment reads count
        store = StateStore(reopened, config=config)
        log.mark()
        start = time.perf_counter()
        got = store.get_state("count").get_batch(everything)
        elapsed = time.perf_counter() - start
        results[label] = {
            "requests": log.since_mark(IcebergS3Backend.BUCKET), "seconds": round(elapsed, 3),
            "live_values": len(got) - got.null_count,
            "stats": {k: v for k, v in store.stats().items() if "file" in k or "segment" in k},
        }
        store.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--modes", default="none,cache")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="icestate-measure-"))
    server = s3_server.start(work)
    try:
        s3_server.create_bucket(server.endpoint, IcebergS3Backend.BUCKET)
        log = RequestLog(work / "moto_server.log")
        out = []
        for mode in args.modes.split(","):
            backend = IcebergS3Backend(str(work / f"table-{mode}"))
            try:
                out.append(run(args.keys, args.checkpoints, mode, log, backend, work / f"table-{mode}"))
            finally:
                backend.close_all()
        print(json.dumps(out, indent=1))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
