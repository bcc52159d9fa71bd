"""Every implementation of the benchmark by name, the Spark peers first (the default run order)."""

from __future__ import annotations

from benchmarks.streaming.impl import Impl
from benchmarks.streaming.ours import OURS
from benchmarks.streaming.peers import PEERS

IMPLS: dict[str, Impl] = {impl.name: impl for impl in (*PEERS, *OURS)}
