"""Crash points for failure-path tests.

``crash_point(name)`` ends the process at once (``os._exit``, no cleanup, no flush of
Python buffers: as close to a kill as a process can do to itself) when the environment
variable ``STATESTORE_CRASH_AT`` equals ``name``. Tests run a child process with the
variable set and then check that the newest complete checkpoint is restorable.
Production code calls it at every step of a checkpoint; unset, it costs one dict lookup.
"""

from __future__ import annotations

import os

CRASH_ENV = "STATESTORE_CRASH_AT"
CRASH_EXIT_CODE = 77

# Every crash point, in the order a checkpoint passes them.
CHECKPOINT_CRASH_POINTS = (
    "flush_started",          # memtable sealed, no segment written
    "segment_written",        # after the first segment file of a checkpoint is written
    "segments_written",       # all segments written, nothing committed
    "commit_metadata_written",  # Iceberg manifests and metadata written, catalog not switched
    "commit_done",            # catalog switched to the new snapshot, retention not run
    "snapshots_expired",      # old snapshots expired, unreferenced files not deleted yet
    "files_deleted",          # retention finished
)

# Every crash point of a compaction (catalog.compaction), in order.
COMPACTION_CRASH_POINTS = (
    "compaction_output_written",   # the first output file written, nothing committed
    "compaction_outputs_written",  # every output written, nothing committed
    "compaction_committed",        # the overwrite committed, nothing else left to do
)


def crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os._exit(CRASH_EXIT_CODE)
