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

``python -m catalog.compactor '<TableSpec json>' '<CompactionPolicy json>'`` is that process;
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
from dataclasses import dataclass, field

from catalog.compaction import CompactionPolicy, CompactionResult, compact, needs_compaction
from catalog.defaults import DEFAULT_NAMESPACE
from catalog.iceberg_table import IcebergStateTable

log = logging.getLogger(__name__)

NICE_INCREMENT = 10  # the compactor yields the cores to the stream's tasks
ROUNDS_MAX = 8  # compactions per notification, until the policy is satisfied


@dataclass(frozen=True)
class TableSpec:
    """How another process opens a state table: plain values only."""

    table: str
    namespace: str = DEFAULT_NAMESPACE
    warehouse: str | None = None
    catalog_name: str | None = None
    catalog_properties: dict[str, str] = field(default_factory=dict)
    branch: str = "main"

    def open(self) -> IcebergStateTable:
        """The table at its newest state, with the layout recorded in it."""
        common = dict(namespace=self.namespace, table_name=self.table, branch=self.branch)
        if self.warehouse is not None:
            return IcebergStateTable.open_existing(warehouse=self.warehouse, **common)
        from pyiceberg.catalog import load_catalog

        catalog = load_catalog(self.catalog_name, **self.catalog_properties)
        return IcebergStateTable.open_existing(catalog=catalog, close_catalog=True, **common)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TableSpec:
        return cls(**json.loads(text))


def policy_to_json(policy: CompactionPolicy) -> str:
    return json.dumps(dataclasses.asdict(policy))


def policy_from_json(text: str) -> CompactionPolicy:
    return CompactionPolicy(**json.loads(text))


class CompactorProcess:
    """The writer's handle on its compactor process (module docstring). Thread safe."""

    def __init__(self, spec: TableSpec, policy: CompactionPolicy | None = None):
        self.spec = spec
        self.policy = policy or CompactionPolicy()
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.notified = 0
        # Figures of each compaction the process committed (``CompactionResult.summary`` plus
        # started_ms, finished_ms, attempts), read from its stdout.
        self.results: list[dict] = []

    def checkpoint_committed(self, table: IcebergStateTable) -> bool:
        """Tell the compactor that ``table`` (the writer's, just committed) may need compaction;
        True when it was told. Never raises: compaction is housekeeping."""
        try:
            if not needs_compaction(table, self.policy):
                return False
        except Exception as e:  # a table being closed or restored by its writer meanwhile
            log.warning("compaction check of %s failed (%s)", self.spec.table, e)
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
                        self.spec.table, e)
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
            log.warning("the compactor of %s did not stop within %.0f s; killed", self.spec.table, timeout_s)
            self._stop(kill=True)
        if self._reader is not None:
            self._reader.join(timeout=10)  # the last results, written before it exited
        self._process = None

    def _started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._process is not None:
            log.warning("the compactor of %s exited (code %s); starting it again", self.spec.table,
                        self._process.returncode)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "catalog.compactor", self.spec.to_json(), policy_to_json(self.policy)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=_project_root(),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_project_root(),
                                                                              os.environ.get("PYTHONPATH")]))},
        )
        self._reader = threading.Thread(target=self._read_results, args=(self._process.stdout,),
                                        name="icestate-compactor-results", daemon=True)
        self._reader.start()
        return self._process

    def _read_results(self, stream) -> None:
        for line in stream:
            with contextlib.suppress(ValueError):
                self.results.append(json.loads(line))

    def _stop(self, kill: bool) -> None:
        if self._process is not None and kill:
            with contextlib.suppress(OSError):
                self._process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=10)
        self._process = None


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve(spec: TableSpec, policy: CompactionPolicy, lines, report=None) -> list[CompactionResult]:
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
    table = spec.open()
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
            for result in _settle(spec, table, policy):
                results.append(result)
                log.info("compacted %s: %s", spec.table, result.summary())
                if report is not None and not _report(report, result):
                    return results  # the writer is gone (its end of the pipe closed): so is its input
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


def _settle(spec: TableSpec, table: IcebergStateTable, policy: CompactionPolicy):
    """Compact until the policy selects nothing (at most ``ROUNDS_MAX`` commits): one merge
    can make a run of its own with the segments below it (a tiered policy's carry), so a
    single round does not always leave the units settled. Yields each committed result."""
    for _ in range(ROUNDS_MAX):
        try:
            result = compact(table, policy=policy)
        except Exception:  # housekeeping: report, and try again at the next notification
            log.exception("compaction of %s failed; the next checkpoint retries", spec.table)
            return
        if result is None:
            return
        yield result
        table.restore()  # the head with this compaction (and any checkpoint since)
        if not needs_compaction(table, policy):
            return


def main(argv: list[str]) -> int:
    logging.basicConfig(level=os.environ.get("ICESTATE_COMPACTOR_LOG", "WARNING"),
                        format="icestate-compactor %(levelname)s %(message)s")
    with contextlib.suppress(OSError):
        os.nice(NICE_INCREMENT)
    spec, policy = TableSpec.from_json(argv[0]), policy_from_json(argv[1])
    serve(spec, policy, sys.stdin, sys.stdout)
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    # A writer that died closed its end of the pipe: nothing more to say to it, and nothing
    # for the interpreter's exit to fail on.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
