"""Every implementation of the benchmark by name, the Spark peers first (the default run order):
``IMPLS`` of the keyed running count, ``SESSION_IMPLS`` of the processing-time sessions."""

from __future__ import annotations

from benchmarks.streaming.impl import Impl
from benchmarks.streaming.ours import OURS, OURS_SESSIONS
from benchmarks.streaming.peers import PEERS, SESSION_PEERS

IMPLS: dict[str, Impl] = {impl.name: impl for impl in (*PEERS, *OURS)}
SESSION_IMPLS: dict[str, Impl] = {impl.name: impl for impl in (*SESSION_PEERS, *OURS_SESSIONS)}
