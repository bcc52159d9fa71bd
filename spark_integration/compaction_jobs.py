"""A stream's compactions as Spark jobs of its own session, where its executors and their file
caches are (``CompactionPolicy.runs_on``: ``spark``, or ``auto`` on a master that is not local).

``SparkCompactor`` has the interface of ``catalog.compactor.CompactorProcess``: the runner calls
``checkpoint_committed(table)`` after each batch. When the policy finds a unit to compact in the
writer's table (metadata it holds, no I/O) and no round is running, a round starts in a thread of
the driver: ``catalog.compaction.compact(..., spark=session)`` on a table object of its own, again
until the policy selects nothing (at most ``ROUNDS_MAX`` compactions), each merging as one Spark
job (a task per unit, at most ``CompactionPolicy.max_units``, by default a quarter of the
application's task slots: ``bounded``; each merge at ``SCHED_IDLE`` priority where allowed) in the scheduler pool
``icestate-compaction`` (with ``spark.scheduler.mode=FAIR`` the stream's jobs and these share the
executors; Spark's default FIFO runs them in turn), committed by the driver in its own snapshot.
A round never blocks or fails a batch: its errors are logged, and the next checkpoint tries again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from catalog.compaction import CompactionPolicy, compact, writer_needs_compaction
from catalog.compactor import ROUNDS_MAX
from catalog.iceberg_table import IcebergStateTable
from catalog.table_ref import TableRef

log = logging.getLogger(__name__)

POOL = "icestate-compaction"


def runs_on(policy: CompactionPolicy, master: str) -> str:
    """``process`` or ``spark``: where a stream on ``master`` compacts under ``policy``."""
    if policy.runs_on != "auto":
        return policy.runs_on
    return "process" if master.startswith("local") else "spark"


def bounded(policy: CompactionPolicy, slots: int) -> CompactionPolicy:
    """``policy`` with ``max_units`` a quarter of the application's task ``slots`` (at least one)
    when it sets none: a Spark task holds its slot until its merge is done (tens of seconds for
    millions of entries), and the stream's batches must find free slots meanwhile. Measured: with
    every slot taken by a compaction, a batch waited for the whole merge (6.3x the p99 without)."""
    if policy.max_units is not None:
        return policy
    return dataclasses.replace(policy, max_units=max(1, slots // 4))


class SparkCompactor:
    """The runner's compactions as Spark jobs (module docstring). Thread safe."""

    def __init__(self, spark: Any, ref: TableRef, policy: CompactionPolicy):
        self.spark = spark
        self.ref = ref
        self.policy = policy
        self.notified = 0
        self.results: list[dict] = []  # a compaction's figures each, with the processes that merged
        self._table: IcebergStateTable | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    pid = None  # no process of its own

    def checkpoint_committed(self, table: IcebergStateTable) -> bool:
        """Start a round when ``table`` (the writer's, just committed) needs compaction and none
        is running; True when one started. Never raises: compaction is housekeeping."""
        self._table = table
        if not writer_needs_compaction(table, self.policy):
            return False
        with self._lock:
            if self._closed or (self._thread is not None and self._thread.is_alive()):
                return False
            self.notified += 1
            self._thread = threading.Thread(target=self._round, name="icestate-compaction-job", daemon=True)
            self._thread.start()
            return True

    def _round(self) -> None:
        context = self.spark.sparkContext
        context.setLocalProperty("spark.scheduler.pool", POOL)
        context.setJobDescription(f"icestate compaction of {self.ref.identifier}")
        policy = bounded(self.policy, context.defaultParallelism)
        try:
            with self.ref.open() as own:
                for _ in range(ROUNDS_MAX):
                    if self._closed:
                        return
                    started = time.time()
                    result = compact(own, policy=policy, spark=self.spark)
                    if result is None:
                        return
                    self.results.append({**result.summary(), "attempts": result.attempts,
                                         "processes": list(result.processes), "started_ms": int(started * 1000),
                                         "finished_ms": int(time.time() * 1000)})
                    writer = self._table
                    if writer is not None:  # the writer's next commit starts from the new head
                        writer.note_outside_commit()
        except Exception as e:
            log.warning("compaction of %s as a Spark job failed (%s); trying again after the next checkpoint",
                        self.ref.identifier, e)

    def close(self, timeout_s: float = 60.0) -> None:
        """Let a running round finish its compaction (waiting up to ``timeout_s``); none starts
        afterwards."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout=timeout_s)
