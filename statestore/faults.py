"""Every fault-injection point of the project: crash points and injected failures, for tests.

Role: the one place a failure-path test looks up how to make production code fail at a
given step. Production code calls the hooks below at named points; unarmed (the
environment variable unset) each hook costs one ``os.environ`` lookup and does nothing.

* ``crash_point(name)`` ends the process at once (``os._exit``, no cleanup, no flush of
  Python buffers: as close to a kill as a process can do to itself) when the environment
  variable ``STATESTORE_CRASH_AT`` equals ``name``. Tests run a child process with the
  variable set and then check that the newest complete checkpoint is restorable.
* ``kill_if_asked(step, batch_id)`` SIGKILLs the Spark driver at a step of one batch when
  ``ICESTATE_KILL_AT`` is ``"<step>:<batch_id>"`` (``KILL_STEPS``).
* ``fail_if_first_attempt(attempt_number)`` raises ``InjectedFaultError`` in a Spark task's
  first attempt, after its flush, while the file named by ``ICESTATE_FAIL_FIRST_ATTEMPT``
  exists (Spark then retries the task).

Invariant: every point name a caller passes is one of the constants here (the tuples list
them in the order a checkpoint or compaction passes them). Thread safe: the hooks only read
the environment. Imports nothing beyond the standard library, so every layer may use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from statestore.errors import InjectedFaultError

CRASH_ENV = "STATESTORE_CRASH_AT"
CRASH_EXIT_CODE = 77

# Crash points of a checkpoint.
FLUSH_STARTED = "flush_started"                      # memtable sealed, no segment written
SEGMENT_WRITTEN = "segment_written"                  # after the first segment file of a checkpoint is written
SEGMENTS_WRITTEN = "segments_written"                # all segments written, nothing committed
COMMIT_METADATA_WRITTEN = "commit_metadata_written"  # manifests and manifest list stored, catalog not switched
COMMIT_DONE = "commit_done"                          # catalog switched to the new snapshot, retention not run
SNAPSHOTS_EXPIRED = "snapshots_expired"              # old snapshots expired, unreferenced files not deleted yet
FILES_DELETED = "files_deleted"                      # retention planned; its deletes run in the background

# Every crash point, in the order a checkpoint passes them.
CHECKPOINT_CRASH_POINTS = (
    FLUSH_STARTED, SEGMENT_WRITTEN, SEGMENTS_WRITTEN, COMMIT_METADATA_WRITTEN, COMMIT_DONE, SNAPSHOTS_EXPIRED,
    FILES_DELETED,
)

# Crash points of a compaction (catalog.compaction).
COMPACTION_OUTPUT_WRITTEN = "compaction_output_written"    # the first output file written, nothing committed
COMPACTION_OUTPUTS_WRITTEN = "compaction_outputs_written"  # every output written, nothing committed
# its commit's manifests and manifest list stored, catalog not switched
COMPACTION_COMMIT_METADATA_WRITTEN = "compaction_commit_metadata_written"
COMPACTION_COMMITTED = "compaction_committed"              # the overwrite committed, nothing else left to do

# Every crash point of a compaction, in order.
COMPACTION_CRASH_POINTS = (COMPACTION_OUTPUT_WRITTEN, COMPACTION_OUTPUTS_WRITTEN, COMPACTION_COMMIT_METADATA_WRITTEN,
                           COMPACTION_COMMITTED)

# SIGKILL the driver at a step of a given batch: "<step>:<batch_id>" (spark_integration.query).
KILL_ENV = "ICESTATE_KILL_AT"
KILL_STEPS = ("tasks_done", "outputs_committed", "state_committed")

# Names a file: while it exists, every task's attempt 0 raises after flushing (spark_integration.tasks).
FAIL_FIRST_ATTEMPT_ENV = "ICESTATE_FAIL_FIRST_ATTEMPT"


def crash_point(name: str) -> None:
    """End the process at once when ``STATESTORE_CRASH_AT`` is ``name`` (one of the crash points)."""
    if os.environ.get(CRASH_ENV) == name:
        os._exit(CRASH_EXIT_CODE)


def kill_if_asked(step: str, batch_id: int) -> None:
    """SIGKILL this process when ``ICESTATE_KILL_AT`` is ``"<step>:<batch_id>"`` (``step`` in ``KILL_STEPS``)."""
    spec = os.environ.get(KILL_ENV)
    if spec and spec == f"{step}:{batch_id}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def fail_if_first_attempt(attempt_number: Callable[[], int | None]) -> None:
    """Raise ``InjectedFaultError`` when the file ``ICESTATE_FAIL_FIRST_ATTEMPT`` names exists
    and ``attempt_number()`` (the running task's attempt; None outside a task) is 0.

    ``attempt_number`` is called only when the fault is armed, so an engine's task context
    is never consulted in production.
    """
    flag = os.environ.get(FAIL_FIRST_ATTEMPT_ENV)
    if not flag or not os.path.exists(flag):
        return
    if attempt_number() == 0:
        raise InjectedFaultError("injected failure of a task's first attempt (after its flush)")
