"""No-data micro-batches: the ``icestate_ticks`` streaming source.

Spark runs a micro-batch when a source has new data, or when a stateful operator of the
last batch's plan asks for another one (``shouldRunAnotherBatch``): that is how Spark's
``transformWithState`` fires timers with no new input. A stateful query here is a
``foreachBatch`` over a stateless plan, so Spark would never run such a batch. The ticks
source restores it: ``start_stateful_query`` unions it (no rows, the input's schema) into
the input of every query (without timers it only carries the state figures into the query's
progress, ``reportLatestOffset``), and its offset advances when the committed state has
a timer due:

* processing time: the earliest registered timer is at or before now (the batch Spark then
  constructs has a timestamp at or after now, so the timer fires in it);
* event time: the earliest registered timer is at or before the watermark Spark will give
  the next batch (``max(watermark, batch's max event time - delay)``, Spark's rule), and
  that watermark is ahead of the last batch's.

With Spark's ``spark.sql.streaming.noDataMicroBatches.enabled`` off, nothing is ever due: no
batch runs without input, and a due timer fires in the next batch with input, as on Spark.
A batch with no input and no timer due is never run (Spark runs one at every trigger in
processing time, and at every watermark advance in event time; such a batch fires nothing
and emits nothing). The trigger decides when the source is asked (every trigger interval,
continuously, ``availableNow`` until nothing is due, ``once``: one batch only), as for any
source.

The runner tells the source what is due through a *beacon*: a small JSON file on the driver
host (both run there, under a classic or a Connect session), rewritten after every committed
batch, named by the query's checkpoint location and state table, so a restarted query finds
the last run's. The same figures are stored in the checkpoint's snapshot summary: a query
restarted without its beacon (on another host, after a week: a query's start deletes the beacons
untouched for ``BEACON_MAX_AGE_S``, or on state imported from Spark's store) starts from the one
they describe.

This module stays light: the source runs in a Python process that Spark starts on the driver
for the query's lifetime, and imports nothing of the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from statestore.private_dir import private_directory

FORMAT = "icestate_ticks"
OPTION_BEACON = "beacon"
BEACON_MAX_AGE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Beacon:
    """What the committed state needs next, as of checkpoint ``checkpoint_id``."""

    checkpoint_id: int
    time_mode: str                       # "processingtime" or "eventtime"
    next_timer_ms: int | None = None     # the earliest registered timer of every task
    watermark_ms: int = -1               # the watermark of the batch that committed it
    next_watermark_ms: int = -1          # the watermark Spark gives the next batch
    state: dict | None = None            # the batch's state figures (``StatefulRunner.state_figures``)
    # Spark's spark.sql.streaming.noDataMicroBatches.enabled as the query started: when off, no
    # batch runs without input, and due timers fire in the next batch that has some (as Spark).
    no_data_batches: bool = True

    def due(self, now_ms: int) -> bool:
        """Whether a batch run now would fire a timer."""
        if self.next_timer_ms is None or self.time_mode == "none" or not self.no_data_batches:
            return False
        if self.time_mode == "processingtime":
            return self.next_timer_ms <= now_ms
        return self.next_watermark_ms > self.watermark_ms and self.next_timer_ms <= self.next_watermark_ms


def beacon_path(checkpoint_location: str, table_identity: tuple) -> str:
    """The beacon file of a query: in a directory of this user's own in the driver host's
    temporary directory (``write_beacon``), named by the query's checkpoint location and
    state table (no secret: the identity holds a digest)."""
    digest = hashlib.sha256(json.dumps([checkpoint_location, list(table_identity)], default=str).encode())
    return os.path.join(tempfile.gettempdir(), f"icestate-ticks-{os.getuid()}", f"{digest.hexdigest()[:32]}.json")


def write_beacon(path: str, beacon: Beacon) -> None:
    """Replace the beacon atomically (a reader sees the old one or the new one), in a directory
    of this user's own (``private_directory``: the temporary directory is shared by every user
    of the host), through a new file that no link can redirect."""
    directory = private_directory(os.path.dirname(path), what="the query's timer beacons")
    tmp = os.path.join(directory, f"{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(beacon), f)
    os.replace(tmp, path)


def restamp_beacon(path: str, no_data_batches: bool) -> None:
    """Make a restarted query's beacon follow its setting of Spark's no-data batches at once
    (the previous run's beacon holds the previous run's), before the first batch rewrites it."""
    beacon = read_beacon(path)
    if beacon is not None and beacon.no_data_batches != no_data_batches:
        write_beacon(path, replace(beacon, no_data_batches=no_data_batches))


_BEACON_BYTES_MAX = 1 << 20


def read_beacon(path: str) -> Beacon | None:
    """The beacon at ``path``; None when there is none, or it is not one this module writes
    (unreadable, too large, fields missing or of other types): nothing is then due."""
    try:
        with open(path, "rb") as f:
            data = f.read(_BEACON_BYTES_MAX + 1)
        if len(data) > _BEACON_BYTES_MAX:
            return None
        beacon = Beacon(**json.loads(data))
    except (OSError, ValueError, TypeError, RecursionError):
        return None  # none yet, or one being replaced by a crashed writer's leftover
    return beacon if _well_formed(beacon) else None


def _well_formed(beacon: Beacon) -> bool:
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    return (whole(beacon.checkpoint_id) and beacon.time_mode in ("processingtime", "eventtime", "none")
            and (beacon.next_timer_ms is None or whole(beacon.next_timer_ms))
            and whole(beacon.watermark_ms) and whole(beacon.next_watermark_ms)
            and (beacon.state is None or isinstance(beacon.state, dict)) and isinstance(beacon.no_data_batches, bool))


class _Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"ticks": n, "checkpoint": c}``: n ticks so far, the last for checkpoint c.
    Never a row: a tick is a batch, its input is the other sources'."""

    def __init__(self, beacon: str):
        self.beacon = beacon
        self._version: tuple[int, int, int] | None = None
        self._cached: Beacon | None = None

    def _current(self) -> Beacon | None:
        try:
            st = os.stat(self.beacon)
        except OSError:
            return None
        # Each write renames a new file into place: a new inode, even when two writes fall in
        # one tick of the filesystem's clock (mtimes are only that fine).
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        if version != self._version:
            self._cached, self._version = read_beacon(self.beacon), version
        return self._cached

    def initialOffset(self) -> dict:
        return {"ticks": 0, "checkpoint": -1}

    def latestOffset(self, start: dict, limit: Any) -> dict:
        beacon = self._current()
        # One tick per committed state: the batch it starts commits a newer checkpoint, whose
        # beacon says what is due next.
        if beacon is not None and beacon.checkpoint_id > start["checkpoint"] and beacon.due(int(time.time() * 1000)):
            return {"ticks": start["ticks"] + 1, "checkpoint": beacon.checkpoint_id}
        return start

    def reportLatestOffset(self) -> dict:
        """What Spark shows as this source's ``latestOffset`` in the query's progress: the
        offset, and under ``icestate`` the state figures of the last committed batch (Spark
        asks when it plans a batch, so a batch's progress holds its predecessor's figures)."""
        beacon = self._current()
        if beacon is None:
            return {"ticks": None}
        return {"checkpoint": beacon.checkpoint_id, "icestate": beacon.state or {}}

    def prepareForTriggerAvailableNow(self) -> None:
        # Ticks are due work, not data arriving: an availableNow run ends when none is due.
        pass

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        return []

    def read(self, partition: InputPartition):
        return iter([])

    def commit(self, end: dict) -> None:
        pass


def is_ticks_offset(line: str) -> bool:
    """Whether a line of Spark's offset log is an offset of this source (``_Reader``'s shape)."""
    try:
        offset = json.loads(line)
    except ValueError:
        return False
    return isinstance(offset, dict) and set(offset) == {"ticks", "checkpoint"}


class _BatchReader(DataSourceReader):
    """A batch read of the source: no rows (``warm_planner`` reads it once at a query's start)."""

    def read(self, partition: InputPartition):
        return iter([])


class TicksDataSource(DataSource):
    """``spark.readStream.format("icestate_ticks").schema(...).option("beacon", path)``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return "tick long"  # a schema given to readStream replaces it

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        path = self.options.get(OPTION_BEACON)
        if not path:
            raise ValueError(f"the {FORMAT} source needs the option {OPTION_BEACON!r} (the query's beacon file)")
        return _Reader(path)

    def reader(self, schema: Any) -> DataSourceReader:
        return _BatchReader()


def ticks_frame(df: Any, beacon: str) -> Any:
    """``df`` with the ticks source unioned in (same columns, never a row)."""
    from pyspark.sql.types import StructField, StructType

    spark = df.sparkSession
    spark.dataSource.register(TicksDataSource)
    # The input's columns without their metadata: the watermark's mark stays on the input's
    # event-time column alone.
    schema = StructType([StructField(f.name, f.dataType, True) for f in df.schema.fields])
    ticks = spark.readStream.format(FORMAT).schema(schema).option(OPTION_BEACON, beacon).load()
    return df.unionByName(ticks)


def warm_planner(spark: Any, beacon: str) -> None:
    """Read the (registered) source once as a batch, so that the Python processes Spark plans
    a Python data source's read with are started and idle when the query's first batch plans
    its read of the source. Spark starts one daemon per planning step (creating the source,
    planning its read) at its first use and reuses its idle workers after: started in the
    first batch, they cost it about a second on two cores; here they start beside the query's
    start. Best effort: a failure changes nothing but that time."""
    with contextlib.suppress(Exception):  # the query's own planning reports any real problem
        spark.read.format(FORMAT).option(OPTION_BEACON, beacon).load().collect()


def sweep_beacons(keep: str, max_age_s: float = BEACON_MAX_AGE_S) -> int:
    """Delete the beacons of queries that committed nothing for ``max_age_s`` (stopped or
    moved to another host; such a query, restarted, fires its due timers at its first batch
    with input, as Spark's does after any restart), except ``keep``. Returns how many went."""
    directory = os.path.dirname(keep)
    cutoff = time.time() - max_age_s
    gone = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if entry.path == keep or not entry.name.endswith((".json", ".tmp")):
                continue
            with contextlib.suppress(OSError):
                if entry.stat().st_mtime < cutoff:
                    os.remove(entry.path)
                    gone += 1
    return gone
