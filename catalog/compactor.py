"""Compaction beside a running writer, in a process of its own.

A writer (a stream's driver, or any ``StateStore`` user) keeps a ``CompactorProcess``.
After each checkpoint it calls ``checkpoint_committed(table)``: when the policy finds a unit
that needs compaction in the writer's own table object (metadata the writer holds anyway,
no I/O), the compactor process is started (once, lazily: a writer whose units never fill
up never pays for it) and told, one line on its standard input. The process, niced below
the writer, coalesces the lines that arrived while it worked and runs ``compaction.compact``
on its own table object, round after round until the policy selects nothing; each
compaction commits as its own snapshot and never blocks or fails a checkpoint
(``catalog.compaction``). The process exits when its standard input closes: when the
writer closes it, and also when the writer's process dies, so it never outlives its writer.

``python -m catalog.compactor`` is that process. Its standard input is, one JSON object a line:

1. ``{"table": <TableRef.to_json object>, "policy": <CompactionPolicy fields>}``, once, first:
   the catalog's properties may hold secrets, which a command line would show to every user
   of the host (``ps``, ``/proc/<pid>/cmdline``); a pipe shows them to nobody;
2. then a checkpoint id per notification.

Its standard output is a JSON line per compaction it committed (``CompactorProcess.results``);
each also tells the writer's table (``IcebergStateTable.note_outside_commit``), so that the
writer's next checkpoint commits on the new head instead of losing its first attempt.

``icestate compact`` runs compactions on demand (or every few seconds, ``--follow``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time

from catalog.compaction import CompactionPolicy, CompactionResult, compact, needs_compaction, writer_needs_compaction
from catalog.iceberg_table import IcebergStateTable
from catalog.table_ref import TableRef
from statestore import memory

log = logging.getLogger(__name__)

NICE_INCREMENT = 10  # the compactor yields the cores to the stream's tasks
ROUNDS_MAX = 8  # compactions per notification, until the policy is satisfied


def header(ref: TableRef, policy: CompactionPolicy) -> str:
    """The first line of the compactor's input: which table, compacted how (module docstring)."""
    return json.dumps({"table": json.loads(ref.to_json()), "policy": dataclasses.asdict(policy)})


def read_header(line: str) -> tuple[TableRef, CompactionPolicy]:
    """The table and policy of ``header``'s line."""
    if not line.strip():
        raise ValueError("the compactor's input ended before its first line (the table and the policy)")
    values = json.loads(line)
    return TableRef.from_json(values["table"]), CompactionPolicy(**values["policy"])


class CompactorProcess:
    """The writer's handle on its compactor process (module docstring). Thread safe."""

    def __init__(self, ref: TableRef, policy: CompactionPolicy | None = None):
        self.ref = ref
        self.policy = policy or CompactionPolicy()
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.notified = 0
        self._table: IcebergStateTable | None = None  # the writer's, told of each compaction's commit
        # Figures of each compaction the process committed (``CompactionResult.summary`` plus
        # started_ms, finished_ms, attempts), read from its stdout.
        self.results: list[dict] = []

    def checkpoint_committed(self, table: IcebergStateTable) -> bool:
        """Tell the compactor that ``table`` (the writer's, just committed) may need compaction;
        True when it was told. Never raises: compaction is housekeeping."""
        self._table = table
        if not writer_needs_compaction(table, self.policy):
            return False
        with self._lock:
            if self._closed:
                return False
            return self._notify(table)

    def _notify(self, table: IcebergStateTable) -> bool:
        try:
            process = self._started()
            process.stdin.write(f"{table.current_checkpoint().checkpoint_id}\n")
            process.stdin.flush()
            self.notified += 1
            return True
        except (OSError, ValueError) as e:
            log.warning("could not reach the compactor of %s (%s); starting a new one at the next checkpoint",
                        self.ref.identifier, e)
            self._stop(kill=True)
            return False

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the compactor finish what it is doing, then stop it (killed after ``timeout_s``);
        no compactor starts afterwards."""
        with self._lock:
            self._closed = True
            self._close(timeout_s)

    def _close(self, timeout_s: float) -> None:
        if self._process is None:
            return
        with contextlib.suppress(OSError):
            self._process.stdin.close()
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the compactor of %s did not stop within %.0f s; killed", self.ref.identifier, timeout_s)
            self._stop(kill=True)
        if self._reader is not None:
            self._reader.join(timeout=10)  # the last results, written before it exited
        self._process = None

    def _started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._process is not None:
            log.warning("the compactor of %s exited (code %s); starting it again", self.ref.identifier,
                        self._process.returncode)
        # The working directory is the writer's (pyiceberg looks for .pyiceberg.yaml there too, so
        # the child resolves a named catalog as the writer does); -P keeps it off the module path.
        self._process = subprocess.Popen(
            [sys.executable, "-P", "-m", "catalog.compactor"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            # Allocators that hand back what a compaction freed (``statestore.memory``), unless
            # the writer's environment names its own.
            env={**memory.LONG_RUNNING_ENV, **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_project_root(),
                                                                              os.environ.get("PYTHONPATH")]))},
        )
        self._process.stdin.write(header(self.ref, self.policy) + "\n")
        self._reader = threading.Thread(target=self._read_results, args=(self._process.stdout,),
                                        name="icestate-compactor-results", daemon=True)
        self._reader.start()
        return self._process

    def _read_results(self, stream) -> None:
        for line in stream:
            with contextlib.suppress(ValueError):
                self.results.append(json.loads(line))
                # A compaction committed: the writer's next commit starts from the new head.
                table = self._table
                if table is not None:
                    table.note_outside_commit()

    def _stop(self, kill: bool) -> None:
        if self._process is not None and kill:
            with contextlib.suppress(OSError):
                self._process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=10)
        self._process = None


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve(ref: TableRef, policy: CompactionPolicy, lines, report=None) -> list[CompactionResult]:
    """The compactor process's loop: compact after each notification in ``lines`` (a text
    stream), those that arrived meanwhile coalesced; return at its end. Each result's figures
    go to ``report`` (a text stream) as a JSON line."""
    notes: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in lines:
            notes.put(line)
        notes.put(None)  # end of input: the writer closed it, or died

    threading.Thread(target=read, name="icestate-compactor-input", daemon=True).start()
    results = []
    memory.pin_mmap_threshold()
    table = ref.open()
    try:
        ended = False
        while not ended:
            batch = [notes.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(notes.get_nowait())
            ended = None in batch
            if not any(n is not None for n in batch):
                continue
            compacted = False
            for result in _settle(ref, table, policy):
                compacted = True
                results.append(result)
                log.info("compacted %s: %s", ref.identifier, result.summary())
                if report is not None and not _report(report, result):
                    return results  # the writer is gone (its end of the pipe closed): so is its input
            if compacted:  # a compaction's buffers are freed: their pages go back to the system
                memory.return_freed_memory()
        return results
    finally:
        table.close()


def _report(report, result: CompactionResult) -> bool:
    """Write ``result``'s figures to ``report`` as a JSON line; False when the reader is gone."""
    finished = time.time()
    line = json.dumps({**result.summary(), "attempts": result.attempts,
                       "started_ms": int((finished - result.seconds) * 1000), "finished_ms": int(finished * 1000)})
    try:
        report.write(line + "\n")
        report.flush()
    except (BrokenPipeError, ValueError):
        return False
    return True


def _settle(ref: TableRef, table: IcebergStateTable, policy: CompactionPolicy):
    """Compact until the policy selects nothing (at most ``ROUNDS_MAX`` commits): one merge
    can make a run of its own with the segments below it (a tiered policy's carry), so a
    single round does not always leave the units settled. Yields each committed result."""
    for _ in range(ROUNDS_MAX):
        try:
            result = compact(table, policy=policy)
        except Exception:  # housekeeping: report, and try again at the next notification
            log.exception("compaction of %s failed; the next checkpoint retries", ref.identifier)
            return
        if result is None:
            return
        yield result
        table.restore()  # the head with this compaction (and any checkpoint since)
        if not needs_compaction(table, policy):
            return


def main() -> int:
    logging.basicConfig(level=os.environ.get("ICESTATE_COMPACTOR_LOG", "WARNING"),
                        format="icestate-compactor %(levelname)s %(message)s")
    with contextlib.suppress(OSError):
        os.nice(NICE_INCREMENT)
    ref, policy = read_header(sys.stdin.readline())
    serve(ref, policy, sys.stdin, sys.stdout)
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    # A writer that died closed its end of the pipe: nothing more to say to it, and nothing
    # for the interpreter's exit to fail on.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
