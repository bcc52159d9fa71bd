"""Reading state from Spark: the ``icestate`` Python data source.

``spark.read.format("icestate")`` returns the resolved state of one state variable of a
state table at its newest (or a given) checkpoint, resolved exactly like every other
reader (``statestore.resolve``, DESIGN invariant 5: newest entry wins, tombstones and
entries expired at ``now_ms`` are invisible)::

    from spark_integration.datasource import register
    register(spark)                      # registers the source, enables filter pushdown
    df = (spark.read.format("icestate")
          .option("warehouse", "/data/wh").option("table", "clicks").option("state", "count")
          .load())
    df.filter("user = 'u-7'").show()     # Spark filters the rows of a full read
    (spark.read.format("icestate").option("warehouse", "/data/wh").option("table", "clicks")
     .option("pushdown", "true").load()
     .filter("user = 'u-7'").show())     # reads only the segments of u-7's key group

Options (names are case-insensitive, like every Spark option):

* ``table`` (required; ``load("name")`` works too): the state table's name;
* ``namespace``: its Iceberg namespace, default ``state``;
* ``warehouse``: local directory of the embedded SQLite catalog
  (``catalog.defaults.default_catalog``), or instead options prefixed ``catalog.``: the
  properties of any Iceberg catalog, ``catalog.name`` its name, resolved as
  ``catalog.table_ref.TableRef`` does (the properties, then the Iceberg client's
  configuration file and environment), e.g. ``catalog.type=rest``, ``catalog.uri=...``;
* ``state``: the state variable; may be left out when the table declares exactly one;
* ``checkpoint``: a retained checkpoint id, default the newest;
* ``now_ms``: the processing time (epoch ms) at which TTL is evaluated, default now
  (taken once, at planning, so every partition resolves at the same time);
* ``partitions``: how many Spark partitions (contiguous key-group ranges, Flink's
  ``compute_key_group_range_for_task``) to split the key-group space into, default
  ``min(max_parallelism, 8)``; ranges left without data after pruning are dropped;
* ``pushdown``: ``false`` (default) or ``true``: filters on the keys and key groups pushed into
  the read (see "Filter pushdown"). Off by default because Spark 4.1 to 4.3 keep the read a
  pushdown planned on the data source instance of the ``load()`` (``PythonScanBuilder`` calls
  ``ds.setReadInfo``; Spark's main branch keeps it in the scan instead): a later query of the
  same DataFrame without a pushable filter (``df.count()``, an ``OR`` of keys) then reads only
  the first query's keys. With ``pushdown=true``, give each filtered query its own ``load()``;
* ``fileCache``: ``auto`` (default: when the table's files are not on a local filesystem),
  ``on`` or ``off``: executors read segments through their Python worker's file cache, the one
  the query's tasks use (``statestore.file_cache``; Spark reuses its Python workers, so a worker
  that ran the query's tasks serves the read from the copies they fetched or wrote), and a
  segment read again is not fetched again; ``fileCacheDir`` the cache's directory when the
  query's store set one (default ``$ICESTATE_FILE_CACHE_DIR``, else
  ``<temp dir>/icestate-file-cache-<uid>``);
* ``readChangeFeed``: ``true`` reads the change feed instead of the state, as Spark's state
  reader does: per step from a checkpoint of the line to the next one, in stream batches
  ``changeStartBatchId`` to ``changeEndBatchId`` (inclusive; default the newest), or in
  checkpoints ``changeStartCheckpoint`` to ``changeEndCheckpoint``. The checkpoint before the
  first step must be retained (or be none: the table's first checkpoint). Columns:
  ``batch_id``, ``checkpoint_id`` (the step), ``change_type`` (``insert``, ``update`` or
  ``delete``: where Spark's feed says ``update`` for a put, this one tells an insert apart), the
  key columns, ``mk_<name>`` (maps), ``key_group``, ``before`` and ``after`` (a list compares as
  the whole list), ``before_checkpoint_id``, ``after_checkpoint_id`` (``statestore.changes``).
  A step reads only the key groups and keys its checkpoint wrote.

Schema: the SQL view ``state_<name>``'s (``catalog.inspection.live_state``,
``statestore.resolve.shown``), one row per live key (value, reducing, aggregating; for the last
two ``v_<name>`` is the stored accumulator), per map entry, or per list element:

* ``<keys>``, ``mk_<name>`` (maps), ``v_<name>``, ``list_position`` and ``ord`` (lists: the
  element's index from 0, and its stored order), then ``key_group int``, ``checkpoint_id long``
  and ``batch_id long`` (the checkpoint and stream batch that wrote the row; the batch is null
  once that checkpoint is no longer retained) and ``expire_at_ms long``.

Arrow types become Spark types through pyspark's ``from_arrow_type`` (structs are Spark
structs, naive timestamps ``TIMESTAMP_NTZ``). A user-given schema may select a subset of
these columns by name.

Filter pushdown (``pushFilters``): filters on ``key_group`` (=, <=>, IN, <, <=, >, >=, NOT
=, NOT IN, IS [NOT] NULL) restrict the key groups read; equality or IN filters on *every*
key column (string, binary, boolean, integer or date keys; timestamp keys are left to
Spark) are hashed to their key groups (``assign_key_groups``, Spark's
``pmod(xxhash64(keys), N)``) and the rows are filtered to those keys. Each partition reads
only the segments (and, inside them, the row groups) whose key-group statistics cover its
key groups. Every other filter is returned to Spark, which applies it after the scan.
``plan_partitions`` is the pure planning function, so a test can check which files a
filtered read opens.

Spark requirements (pyspark 4.3, checked in its sources ``pyspark/sql/worker/*``):

* Python data sources need Spark >= 4.0; ``pushFilters`` exists from 4.1 on (on 4.0 the
  reader has no pushdown) and is called only when ``spark.sql.python.filterPushdown.enabled``
  is true. That conf defaults to **false**, and a reader that implements ``pushFilters``
  then fails planning with ``DATA_SOURCE_PUSHDOWN_DISABLED``. ``register(spark)`` sets the
  conf to true, which ``.option("pushdown", "true")`` needs; the default reader has no
  ``pushFilters`` (a full scan, Spark filters every row) and works either way.
* ``spark.sql.execution.arrow.pyspark.enabled`` is **not** needed: a Python data source
  always hands Arrow batches to the JVM. ``read()`` here yields ``pyarrow.RecordBatch``es,
  whose schema Spark requires to equal ``to_arrow_schema(schema, timezone="UTC")`` exactly
  (else ``DATA_SOURCE_RETURN_SCHEMA_MISMATCH``); the reader casts to it.
  ``spark.sql.execution.arrow.maxRecordsPerBatch`` applies only to sources that yield
  tuples; batches here hold at most ``BATCH_ROWS_MAX`` rows.
* ``schema()``, ``reader()``, ``pushFilters()`` and ``partitions()`` run in Python workers
  on the driver host at planning; ``read()`` runs in Python workers on the executors. Both
  must import ``statestore``, ``catalog`` and ``spark_integration`` (the same environment,
  ``PYSPARK_PYTHON``) and reach the table's files and catalog. Executors get only the
  partition's segment paths and key-group bounds, the filesystem and the read spec: they
  never open the catalog.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

try:  # the filter classes of pushFilters exist from pyspark 4.1 on
    from pyspark.sql.datasource import (
        EqualNullSafe,
        EqualTo,
        Filter,
        GreaterThan,
        GreaterThanOrEqual,
        In,
        IsNotNull,
        IsNull,
        LessThan,
        LessThanOrEqual,
        Not,
    )

    FILTER_PUSHDOWN_AVAILABLE = True
except ImportError:  # pragma: no cover - pyspark 4.0: readers without pushdown only
    FILTER_PUSHDOWN_AVAILABLE = False
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import StructField, StructType

from statestore.changes import change_types, changes_between
from statestore.config import FILE_CACHE_MODES, StoreConfig
from statestore.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateDescriptor,
    StateKind,
    ValueStateDescriptor,
)
from statestore.entries import read_entries, variable_entry_schema
from statestore.errors import CheckpointNotFoundError
from statestore.file_cache import file_cache_for
from statestore.keygroups import KeyGroupRange, assign_key_groups, compute_key_group_range_for_task
from statestore.layout import CHECKPOINT_ID, KEY_GROUP, StateLayout
from statestore.resolve import BATCH_ID, shown, shown_types, survivors
from statestore.segment import SegmentReader
from statestore.table import SegmentFile

if TYPE_CHECKING:
    from catalog.iceberg_table import IcebergStateTable
    from catalog.table_ref import TableRef

# ``catalog`` (Iceberg, SQLAlchemy) is imported where options are parsed and a table is opened,
# at planning only: executors unpickling the reader need statestore, polars and pyarrow alone.

FORMAT_NAME = "icestate"
FILTER_PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"
DEFAULT_PARTITIONS_MAX = 8
# Equality filters on the keys expanding to more keys than this are left to Spark.
KEY_CANDIDATES_MAX = 100_000
BATCH_ROWS_MAX = 32_768
# A partition resolves its key groups in chunks of about this many (compressed) segment bytes.
RESOLVE_CHUNK_BYTES = 256 * 1024 * 1024

OPT_TABLE = "table"
OPT_PATH = "path"  # load("name")
OPT_NAMESPACE = "namespace"
OPT_WAREHOUSE = "warehouse"
OPT_STATE = "state"
OPT_CHECKPOINT = "checkpoint"
OPT_BRANCH = "branch"
OPT_SAVEPOINT = "savepoint"
OPT_NOW_MS = "now_ms"
OPT_PARTITIONS = "partitions"
OPT_PUSHDOWN = "pushdown"
OPT_FILE_CACHE = "filecache"
OPT_FILE_CACHE_DIR = "filecachedir"
# The change feed, named as Spark's state reader names it (batch ids), or by checkpoint ids.
OPT_CHANGE_FEED = "readchangefeed"
OPT_CHANGE_START_BATCH = "changestartbatchid"
OPT_CHANGE_END_BATCH = "changeendbatchid"
OPT_CHANGE_START_CHECKPOINT = "changestartcheckpoint"
OPT_CHANGE_END_CHECKPOINT = "changeendcheckpoint"
CATALOG_PREFIX = "catalog."
CATALOG_NAME = "catalog.name"
KNOWN_OPTIONS = (OPT_TABLE, OPT_PATH, OPT_NAMESPACE, OPT_WAREHOUSE, OPT_STATE, OPT_CHECKPOINT, OPT_BRANCH,
                 OPT_SAVEPOINT, OPT_NOW_MS, OPT_PARTITIONS, OPT_PUSHDOWN, OPT_FILE_CACHE, OPT_FILE_CACHE_DIR,
                 OPT_CHANGE_FEED, OPT_CHANGE_START_BATCH,
                 OPT_CHANGE_END_BATCH, OPT_CHANGE_START_CHECKPOINT, OPT_CHANGE_END_CHECKPOINT)

# Key types whose pushed literals (str, bytes, int, bool, date) hash and compare exactly.
_PUSHABLE_KEY = (pa.types.is_string, pa.types.is_binary, pa.types.is_integer, pa.types.is_boolean,
                 pa.types.is_date32)


# ------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class ReadOptions:
    """The data source's options, parsed and validated (see the module docstring)."""

    ref: TableRef
    state: str | None
    checkpoint_id: int | None
    now_ms: int | None
    partitions: int | None
    pushdown: bool
    savepoint: str | None = None
    change_feed: ChangeFeedRange | None = None
    file_cache: tuple[str, str | None] = ("auto", None)  # StoreConfig's file_cache_mode and file_cache_dir

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        from catalog.defaults import DEFAULT_CATALOG_NAME, DEFAULT_NAMESPACE
        from catalog.table_ref import TableRef

        opts = {str(k).lower(): v for k, v in options.items()}
        unknown = sorted(k for k in opts if k not in KNOWN_OPTIONS and not k.startswith(CATALOG_PREFIX))
        if unknown:
            raise ValueError(
                f"icestate data source: unknown option(s) {unknown}; the options are {list(KNOWN_OPTIONS)} "
                f"and catalog properties prefixed {CATALOG_PREFIX!r}"
            )
        table = opts.get(OPT_TABLE) or opts.get(OPT_PATH)
        if not table:
            raise ValueError(
                "icestate data source: option 'table' is missing: name the state table, "
                "e.g. .option('table', 'clicks') or .load('clicks')"
            )
        if opts.get(OPT_TABLE) and opts.get(OPT_PATH) and opts[OPT_TABLE] != opts[OPT_PATH]:
            raise ValueError(
                f"icestate data source: option table={opts[OPT_TABLE]!r} and load({opts[OPT_PATH]!r}) name "
                "different tables: give the name once"
            )
        catalog_props = {k[len(CATALOG_PREFIX):]: v for k, v in opts.items()
                         if k.startswith(CATALOG_PREFIX) and k != CATALOG_NAME}
        warehouse = opts.get(OPT_WAREHOUSE) or None
        has_catalog = bool(catalog_props) or CATALOG_NAME in opts
        if warehouse and has_catalog:
            raise ValueError(
                "icestate data source: both option 'warehouse' (the embedded SQLite catalog) and 'catalog.*' "
                "options are given: pass one of them"
            )
        if not warehouse and not has_catalog:
            raise ValueError(
                "icestate data source: no catalog: pass option 'warehouse' (the local directory of the embedded "
                "SQLite catalog) or Iceberg catalog properties as 'catalog.*' options "
                "(e.g. catalog.type, catalog.uri, catalog.warehouse; catalog.name names the catalog)"
            )
        pushdown = str(opts.get(OPT_PUSHDOWN, "false")).strip().lower()
        if pushdown not in ("true", "false"):
            raise ValueError(f"icestate data source: option pushdown must be 'true' or 'false', got {pushdown!r}")
        partitions = _int_option(opts, OPT_PARTITIONS, minimum=1)
        cache_mode = str(opts.get(OPT_FILE_CACHE, "auto")).strip().lower()
        if cache_mode not in FILE_CACHE_MODES:
            raise ValueError(f"icestate data source: option fileCache must be one of {list(FILE_CACHE_MODES)}, got "
                             f"{cache_mode!r}")
        if opts.get(OPT_SAVEPOINT) and opts.get(OPT_CHECKPOINT):
            raise ValueError("icestate data source: options checkpoint and savepoint both name what to read: give one")
        try:
            ref = TableRef(
                table=table, namespace=opts.get(OPT_NAMESPACE) or DEFAULT_NAMESPACE, warehouse=warehouse,
                catalog_name=None if warehouse else opts.get(CATALOG_NAME) or DEFAULT_CATALOG_NAME,
                catalog_properties=catalog_props, branch=opts.get(OPT_BRANCH) or "main")
        except ValueError as e:
            raise ValueError(f"icestate data source: {e} (check the options table, namespace, branch and "
                             "warehouse/catalog.*)") from e
        return cls(
            ref=ref, state=opts.get(OPT_STATE) or None, checkpoint_id=_int_option(opts, OPT_CHECKPOINT, minimum=1),
            now_ms=_int_option(opts, OPT_NOW_MS, minimum=None), partitions=partitions, pushdown=pushdown == "true",
            savepoint=opts.get(OPT_SAVEPOINT) or None, change_feed=ChangeFeedRange.parse(opts),
            file_cache=(cache_mode, opts.get(OPT_FILE_CACHE_DIR) or None),
        )

    @property
    def identifier(self) -> str:
        return self.ref.identifier

    @contextlib.contextmanager
    def opened_table(self) -> Iterator[IcebergStateTable]:
        """The state table opened (read only) at option ``checkpoint`` or ``savepoint``, closed
        (with its catalog) on exit."""
        from statestore.errors import CatalogUnavailableError

        ref = self.ref
        try:
            table = ref.open(checkpoint_id=self.checkpoint_id, savepoint=self.savepoint)
        except CatalogUnavailableError as e:
            raise ValueError(f"icestate data source: {e} (the catalog.* options)") from None
        except CheckpointNotFoundError as e:
            what = f"savepoint={self.savepoint}" if self.savepoint else f"checkpoint={self.checkpoint_id}"
            raise CheckpointNotFoundError(
                f"icestate data source: option {what}: {e}; or leave the option out to read the newest checkpoint"
            ) from e
        except ValueError as e:
            where = f"warehouse {ref.warehouse!r}" if ref.warehouse else f"catalog {ref.catalog_name!r}"
            raise ValueError(
                f"icestate data source: cannot read state table {self.identifier} in {where}: {e} "
                "(check the options table, namespace and warehouse/catalog.*)"
            ) from e
        with table:
            yield table

    def descriptor(self, layout: StateLayout) -> StateDescriptor:
        """The state variable to read: option ``state``, or the table's only one."""
        declared = [d.name for d in layout.descriptors]
        if self.state is None:
            if len(declared) == 1:
                return layout.descriptors[0]
            raise ValueError(
                f"icestate data source: state table {self.identifier} declares {len(declared)} state variables "
                f"{declared}: choose one with .option('state', name)"
            )
        try:
            return layout.descriptor(self.state)
        except KeyError:
            raise ValueError(
                f"icestate data source: state table {self.identifier} has no state variable {self.state!r}; "
                f"declared: {declared}"
            ) from None


@dataclass(frozen=True)
class ChangeFeedRange:
    """Option ``readChangeFeed``: the steps to read, by stream batch (Spark's
    ``changeStartBatchId``/``changeEndBatchId``, inclusive) or by checkpoint id."""

    start: int
    end: int | None
    by_batch: bool

    @classmethod
    def parse(cls, opts: Mapping[str, str]) -> ChangeFeedRange | None:
        wanted = str(opts.get(OPT_CHANGE_FEED, "false")).strip().lower()
        if wanted not in ("true", "false"):
            raise ValueError(f"icestate data source: option readChangeFeed must be 'true' or 'false', got {wanted!r}")
        given = [o for o in (OPT_CHANGE_START_BATCH, OPT_CHANGE_END_BATCH, OPT_CHANGE_START_CHECKPOINT,
                             OPT_CHANGE_END_CHECKPOINT) if opts.get(o) not in (None, "")]
        if wanted == "false":
            if given:
                raise ValueError(f"icestate data source: option(s) {given} need readChangeFeed=true")
            return None
        if opts.get(OPT_CHECKPOINT) or opts.get(OPT_SAVEPOINT):
            raise ValueError("icestate data source: readChangeFeed reads the changes between checkpoints; options "
                             "checkpoint and savepoint do not apply (use changeStartBatchId/changeEndBatchId)")
        by_batch = OPT_CHANGE_START_BATCH in opts or OPT_CHANGE_END_BATCH in opts
        by_checkpoint = OPT_CHANGE_START_CHECKPOINT in opts or OPT_CHANGE_END_CHECKPOINT in opts
        if by_batch == by_checkpoint:
            raise ValueError("icestate data source: readChangeFeed=true needs changeStartBatchId (and optionally "
                             "changeEndBatchId), as Spark's state reader, or changeStartCheckpoint (and optionally "
                             "changeEndCheckpoint); not both kinds")
        start_opt, end_opt = ((OPT_CHANGE_START_BATCH, OPT_CHANGE_END_BATCH) if by_batch else
                              (OPT_CHANGE_START_CHECKPOINT, OPT_CHANGE_END_CHECKPOINT))
        start = _int_option(opts, start_opt, minimum=0)
        if start is None:
            raise ValueError(f"icestate data source: readChangeFeed=true needs option {start_opt}")
        end = _int_option(opts, end_opt, minimum=start)
        return cls(start, end, by_batch)

    def picks(self, info: Any) -> bool:
        value = info.batch_id if self.by_batch else info.checkpoint_id
        return value is not None and value >= self.start and (self.end is None or value <= self.end)

    def describe(self) -> str:
        what = "batches" if self.by_batch else "checkpoints"
        return f"{what} {self.start} to {'the newest' if self.end is None else self.end}"


def _int_option(opts: Mapping[str, str], name: str, minimum: int | None) -> int | None:
    raw = opts.get(name)
    if raw is None or str(raw).strip() == "":
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"icestate data source: option {name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"icestate data source: option {name} must be >= {minimum}, got {value}")
    return value


# ------------------------------------------------------------------------------------ schema


def state_arrow_schema(layout: StateLayout, desc: StateDescriptor) -> pa.Schema:
    """The Arrow schema of the resolved state of ``desc``: the SQL view ``state_<name>``'s
    (``statestore.resolve.shown_types``, value and map key named after the variable)."""
    names = desc.display_columns()  # v_<name>, mk_<name> with the variable's own name
    return pa.schema([f.with_name(names.get(f.name, f.name)) for f in shown_types(desc, layout.key_schema)])


def state_spark_schema(layout: StateLayout, desc: StateDescriptor) -> StructType:
    """``state_arrow_schema`` as Spark types (pyspark's Arrow conversion)."""
    return _as_spark(state_arrow_schema(layout, desc), desc)


def change_feed_arrow_schema(layout: StateLayout, desc: StateDescriptor) -> pa.Schema:
    """The Arrow schema of the change feed of ``desc`` (option ``readChangeFeed``): the batch and
    checkpoint of each step, then ``statestore.changes``'s columns (map key named after the variable)."""
    names = desc.display_columns()
    step = [pa.field(BATCH_ID, pa.int64()), pa.field(CHECKPOINT_ID, pa.int64(), nullable=False)]
    return pa.schema([*step, *(f.with_name(names.get(f.name, f.name)) for f in change_types(desc, layout.key_schema))])


def _as_spark(schema: pa.Schema, desc: StateDescriptor) -> StructType:
    fields = []
    for f in schema:
        try:
            spark_type = from_arrow_type(f.type)
        except Exception as e:  # pyspark raises PySparkTypeError for types Spark has no equivalent of
            raise TypeError(
                f"icestate data source: column {f.name!r} of state {desc.name!r} has Arrow type {f.type}, which "
                f"Spark cannot represent ({e})"
            ) from e
        fields.append(StructField(f.name, spark_type, nullable=f.nullable))
    return StructType(fields)


# ------------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class KeyGroupPartition(InputPartition):
    """One Spark partition: the key groups ``[start, end]`` (only ``key_groups`` of them when
    filters pruned the range) and the segments holding entries of those key groups."""

    index: int
    start: int
    end: int
    key_groups: tuple[int, ...] | None
    segments: tuple[SegmentFile, ...]

    def wanted(self) -> np.ndarray:
        """The sorted key groups this partition reads."""
        if self.key_groups is not None:
            return np.asarray(self.key_groups, dtype=np.int64)
        return np.arange(self.start, self.end + 1, dtype=np.int64)

    @property
    def files(self) -> list[str]:
        return [s.path for s in self.segments]

    @property
    def bytes_planned(self) -> int:
        """Total size of the partition's segment files (an upper bound of what it reads)."""
        return sum(s.size_bytes for s in self.segments)


def plan_partitions(segments: Sequence[SegmentFile], max_parallelism: int, partitions: int,
                    key_groups: Collection[int] | None = None) -> list[KeyGroupPartition]:
    """Split ``[0, max_parallelism)`` into ``partitions`` contiguous key-group ranges (the task
    ranges of ``compute_key_group_range_for_task``), restricted to ``key_groups`` when given;
    each keeps the ``segments`` whose key-group bounds cover one of its key groups. Ranges
    with no key group or no segment are dropped."""
    n = max_parallelism
    partitions = max(1, min(partitions, n))
    allowed = None if key_groups is None else np.unique(np.asarray(sorted(key_groups), dtype=np.int64))
    out: list[KeyGroupPartition] = []
    for i in range(partitions):
        r = compute_key_group_range_for_task(n, partitions, i)
        if allowed is None:
            picked, wanted = None, None
        else:
            wanted = allowed[(allowed >= r.start) & (allowed <= r.end)]
            if not len(wanted):
                continue
            picked = tuple(int(k) for k in wanted)
        segs = tuple(s for s in segments if _covers(s, r, wanted))
        if segs:
            out.append(KeyGroupPartition(len(out), r.start, r.end, picked, segs))
    return out


def _covers(segment: SegmentFile, r: KeyGroupRange, wanted: np.ndarray | None) -> bool:
    if segment.key_group_max < r.start or segment.key_group_min > r.end:
        return False
    if wanted is None:
        return True
    lo = np.searchsorted(wanted, segment.key_group_min, side="left")
    hi = np.searchsorted(wanted, segment.key_group_max, side="right")
    return bool(hi > lo)


# ------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class ReadSpec:
    """Everything an executor needs to read and resolve partitions (picklable, small)."""

    filesystem: pafs.FileSystem
    key_schema: pa.Schema
    descriptor: StateDescriptor  # a plain descriptor of the variable's kind and types
    source_schema: pa.Schema  # the entry columns read from segments
    output_schema: pa.Schema  # exactly what Spark expects
    now_ms: int
    checkpoint_id: int | None
    batches: dict[int, int | None]  # checkpoint id -> stream batch id (``batch_id`` column)
    file_cache: tuple[str, str | None] = ("auto", None)  # ``ReadOptions.file_cache``

    def segment_reader(self) -> SegmentReader:
        """A reader of the segments through this host's file cache (when the options ask for one)."""
        mode, directory = self.file_cache
        cache = file_cache_for(StoreConfig(file_cache_mode=mode, file_cache_dir=directory), self.filesystem)
        return SegmentReader(self.filesystem, file_cache=cache)

    @property
    def key_names(self) -> list[str]:
        return self.key_schema.names


def _plain_descriptor(desc: StateDescriptor) -> StateDescriptor:
    """A descriptor resolving like ``desc`` without its functions (reducing and aggregating
    state resolve like value state), so it pickles to executors."""
    if desc.kind is StateKind.MAP:
        return MapStateDescriptor(desc.name, desc.value_type, key_type=desc.user_key_type)
    if desc.kind is StateKind.LIST:
        return ListStateDescriptor(desc.name, desc.value_type)
    return ValueStateDescriptor(desc.name, desc.value_type)


def _source_schema(layout: StateLayout, desc: StateDescriptor) -> pa.Schema:
    """The entry columns a partition reads of ``desc`` (``statestore.entries``)."""
    return variable_entry_schema(layout, desc)


def read_partition(spec: ReadSpec, partition: KeyGroupPartition, key_filter: pa.Table | None = None,
                   stats: dict[str, int] | None = None) -> Iterator[pa.RecordBatch]:
    """The resolved rows of ``partition``'s key groups, as batches of ``spec.output_schema``.

    ``key_filter`` keeps only rows whose keys are among its rows. ``stats``, when given,
    gets the segment files opened and the bytes read (``SegmentReader`` counters).
    """
    reader = spec.segment_reader()
    wanted = partition.wanted()
    try:
        for chunk in _chunks(partition, wanted):
            out = _resolve_chunk(spec, reader, partition.segments, chunk, key_filter)
            if out is not None and out.num_rows:
                yield from out.to_batches(max_chunksize=BATCH_ROWS_MAX)
    finally:
        if stats is not None:
            stats["segment_files_opened"] = stats.get("segment_files_opened", 0) + reader.files_opened
            stats["segment_bytes_read"] = stats.get("segment_bytes_read", 0) + reader.bytes_read
            for name, n in reader.file_cache_counters.as_dict("file_cache_").items():
                stats[name] = stats.get(name, 0) + n


def _chunks(partition: KeyGroupPartition, wanted: np.ndarray) -> list[np.ndarray]:
    """Key groups split so that each chunk resolves about ``RESOLVE_CHUNK_BYTES`` of segments
    (estimated from each segment's share of key groups), bounding an executor's memory."""
    estimate = 0.0
    for s in partition.segments:
        span = s.key_group_max - s.key_group_min + 1
        inside = np.count_nonzero((wanted >= s.key_group_min) & (wanted <= s.key_group_max))
        estimate += s.size_bytes * inside / span
    n = max(1, min(len(wanted), int(np.ceil(estimate / RESOLVE_CHUNK_BYTES))))
    return [c for c in np.array_split(wanted, n) if len(c)]


def _resolve_chunk(spec: ReadSpec, reader: SegmentReader, segments: Sequence[SegmentFile], key_groups: np.ndarray,
                   key_filter: pa.Table | None) -> pa.Table | None:
    """The resolved rows of ``key_groups`` (sorted), read by the one entry reader and resolved
    by ``statestore.resolve`` (invariant 5), in ``spec.output_schema``; None without entries."""
    desc = spec.descriptor
    entries = read_entries(reader, segments, key_groups, spec.source_schema, state=desc.name)
    if not entries.height:
        return None
    survived = survivors(entries, desc, [KEY_GROUP, *spec.key_names], spec.now_ms)
    view = shown(survived, desc, spec.key_names, spec.batches).rename(desc.display_columns())
    if key_filter is not None:
        wanted = pl.from_arrow(key_filter).cast({k: view.schema[k] for k in spec.key_names})
        view = view.join(wanted, on=spec.key_names, how="semi")
    return _to_output(view.to_arrow(), spec.output_schema)


def _to_output(table: pa.Table, schema: pa.Schema) -> pa.Table:
    cols = [table.column(f.name).cast(f.type) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


# ------------------------------------------------------------------------------------ filters


@dataclass
class _Pushed:
    """What the pushed filters restrict: key groups, and the values of each key column."""

    key_groups: set[int] | None = None
    key_values: dict[str, set] | None = None

    def restrict_key_groups(self, allowed: set[int]) -> None:
        self.key_groups = allowed if self.key_groups is None else self.key_groups & allowed

    def restrict_key(self, name: str, values: set) -> None:
        self.key_values = self.key_values if self.key_values is not None else {}
        current = self.key_values.get(name)
        self.key_values[name] = values if current is None else current & values


def _is_int(v: object) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


def _key_group_set(f: Filter, n: int) -> set[int] | None:
    """Key groups a filter on ``key_group`` admits; None when it is not one we understand."""
    everything = range(n)
    if isinstance(f, IsNotNull):
        return set(everything)
    if isinstance(f, IsNull):
        return set()
    if isinstance(f, Not):
        inner = _key_group_set(f.child, n) if isinstance(f.child, EqualTo | In) else None
        return None if inner is None else set(everything) - inner
    if isinstance(f, EqualTo | EqualNullSafe):
        return ({int(f.value)} & set(everything)) if _is_int(f.value) else None
    if isinstance(f, In):
        if not all(_is_int(v) or v is None for v in f.value):
            return None
        return {int(v) for v in f.value if v is not None} & set(everything)
    bounds = {GreaterThan: lambda v: range(v + 1, n), GreaterThanOrEqual: lambda v: range(v, n),
              LessThan: lambda v: range(0, v), LessThanOrEqual: lambda v: range(0, v + 1)}
    for cls, admitted in bounds.items():
        if isinstance(f, cls):
            if not _is_int(f.value):
                return None
            return set(admitted(max(-1, min(int(f.value), n)))) & set(everything)
    return None


def _key_values(f: Filter) -> set | None:
    """Values an equality or IN filter on a key column admits (None: not such a filter)."""
    if isinstance(f, EqualTo | EqualNullSafe):
        values = [] if f.value is None else [f.value]
    elif isinstance(f, In):
        values = [v for v in f.value if v is not None]
    else:
        return None
    try:
        return {bytes(v) if isinstance(v, bytearray | memoryview) else v for v in values}
    except TypeError:  # an unhashable literal (not a key type)
        return None


def _candidate_keys(key_schema: pa.Schema, values: dict[str, set]) -> pa.Table | None:
    """Every combination of the admitted values as a table of ``key_schema``, or None when a
    value does not convert exactly or there are too many combinations."""
    sizes = [len(values[f.name]) for f in key_schema]
    if int(np.prod(sizes, dtype=np.float64)) > KEY_CANDIDATES_MAX:
        return None
    columns = [sorted(values[f.name], key=repr) for f in key_schema]
    rows = list(itertools.product(*columns))
    try:
        arrays = [pa.array([r[i] for r in rows], type=f.type) for i, f in enumerate(key_schema)]
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return None
    table = pa.Table.from_arrays(arrays, schema=key_schema)
    # Converting must not change a value (e.g. a float to an int column): compare back.
    if any(a.to_pylist() != [r[i] for r in rows] for i, a in enumerate(arrays)):
        return None
    return table


# ------------------------------------------------------------------------------------ Spark API


class IcestateReader(DataSourceReader):
    """Reads the resolved state of one variable at one checkpoint (no filter pushdown).

    Pickled to the executors: it holds only the read spec and the pushed restrictions;
    the segment list of the checkpoint lives in a field that is not pickled, and each
    partition carries its own segments.
    """

    def __init__(self, options: ReadOptions, schema: StructType):
        with options.opened_table() as table:
            layout = table.layout
            desc = options.descriptor(layout)
            current = table.current_checkpoint()
            batches = {c.checkpoint_id: c.batch_id for c in [*table.list_checkpoints(), *filter(None, [current])]}
            self._segments: list[SegmentFile] | None = table.segments(KeyGroupRange.of(0, layout.max_parallelism - 1))
            filesystem = table.filesystem
        self.max_parallelism = layout.max_parallelism
        self.partition_count = options.partitions or min(layout.max_parallelism, DEFAULT_PARTITIONS_MAX)
        full = state_arrow_schema(layout, desc)
        self.spec = ReadSpec(
            filesystem=filesystem, key_schema=layout.key_schema, descriptor=_plain_descriptor(desc),
            source_schema=_source_schema(layout, desc), output_schema=_requested_schema(schema, full, desc),
            now_ms=options.now_ms if options.now_ms is not None else time.time_ns() // 1_000_000,
            checkpoint_id=None if current is None else current.checkpoint_id, batches=batches,
            file_cache=options.file_cache,
        )
        self.pushed = _Pushed()
        self.key_filter: pa.Table | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_segments"] = None  # planning only: partitions carry their own segments
        return state

    def partitions(self) -> list[KeyGroupPartition]:
        if self._segments is None:
            raise RuntimeError("icestate reader: partitions() is planned on the driver, not after unpickling")
        return plan_partitions(self._segments, self.max_parallelism, self.partition_count, self.pushed.key_groups)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, KeyGroupPartition):
            return iter(())  # Spark's stand-in InputPartition(None) when nothing is left to read
        return read_partition(self.spec, partition, self.key_filter)


class IcestateFilteringReader(IcestateReader):
    """``IcestateReader`` with filter pushdown (needs ``spark.sql.python.filterPushdown.enabled``)."""

    def pushFilters(self, filters: list[Filter]) -> list[Filter]:
        """Take the filters on ``key_group`` and the equality/IN filters on all key columns;
        return the others (the very objects Spark passed) for Spark to apply."""
        keys = self.spec.key_names
        pushable_keys = {f.name for f in self.spec.key_schema if any(ok(f.type) for ok in _PUSHABLE_KEY)}
        returned: list[Filter] = []
        key_filters: list[tuple[Filter, str, set]] = []
        for f in filters:
            column = _column_of(f)
            if column == KEY_GROUP:
                allowed = _key_group_set(f, self.max_parallelism)
                if allowed is not None:
                    self.pushed.restrict_key_groups(allowed)
                    continue
            elif column in keys and isinstance(f, IsNotNull):
                continue  # keys are never null
            elif column in keys and isinstance(f, IsNull):
                self.pushed.restrict_key_groups(set())
                continue
            elif column in pushable_keys:
                values = _key_values(f)
                if values is not None:
                    key_filters.append((f, column, values))
                    continue
            returned.append(f)
        if key_filters:
            values_of: dict[str, set] = {}
            for _, column, values in key_filters:
                values_of[column] = values if column not in values_of else values_of[column] & values
            candidates = _candidate_keys(self.spec.key_schema, values_of) if set(values_of) == set(keys) else None
            if candidates is None:
                returned += [f for f, _, _ in key_filters]  # no pruning: Spark filters these rows itself
            else:
                for column, values in values_of.items():
                    self.pushed.restrict_key(column, values)
                self.key_filter = candidates
                kgs = assign_key_groups(candidates, self.max_parallelism) if candidates.num_rows else []
                self.pushed.restrict_key_groups({int(k) for k in kgs})
        return returned


# ------------------------------------------------------------------------------------ change feed


@dataclass(frozen=True)
class ChangePartition(InputPartition):
    """One Spark partition of the change feed: the key groups ``[start, end]`` of one step, from
    the checkpoint before (``old_segments``; ``after_checkpoint`` its id) to checkpoint
    ``checkpoint_id`` of stream batch ``batch_id`` (``new_segments``)."""

    index: int
    batch_id: int | None
    checkpoint_id: int
    after_checkpoint: int
    start: int
    end: int
    old_segments: tuple[SegmentFile, ...]
    new_segments: tuple[SegmentFile, ...]


def plan_change_partitions(steps: Sequence[tuple[Any, int, list[SegmentFile], list[SegmentFile]]],
                           max_parallelism: int, partitions: int) -> list[ChangePartition]:
    """Each step (checkpoint info, the id of the checkpoint before it (0: none), its files, the
    files before) split into key-group ranges; a range that no segment newer than the step's
    previous checkpoint covers has no change and is dropped."""
    out: list[ChangePartition] = []
    for info, before, new, old in steps:
        for r in (compute_key_group_range_for_task(max_parallelism, partitions, i) for i in range(partitions)):
            newer = [s for s in new if s.checkpoint_id > before and _covers(s, r, None)]
            if not newer:
                continue
            out.append(ChangePartition(
                len(out), info.batch_id, info.checkpoint_id, before, r.start, r.end,
                tuple(s for s in old if _covers(s, r, None)), tuple(s for s in new if _covers(s, r, None))))
    return out


def read_change_partition(spec: ReadSpec, partition: ChangePartition) -> Iterator[pa.RecordBatch]:
    """The change feed rows of one partition (``statestore.changes.changes_between``)."""
    desc = spec.descriptor
    kgs = np.arange(partition.start, partition.end + 1, dtype=np.int64)
    feed = changes_between(spec.segment_reader(), spec.source_schema, desc, spec.key_names,
                           partition.old_segments, partition.new_segments, kgs, spec.now_ms, partition.after_checkpoint)
    if not feed.height:
        return
    feed = feed.rename(desc.display_columns()).with_columns(
        pl.lit(partition.batch_id, dtype=pl.Int64).alias(BATCH_ID),
        pl.lit(partition.checkpoint_id, dtype=pl.Int64).alias(CHECKPOINT_ID))
    yield from _to_output(feed.to_arrow(), spec.output_schema).to_batches(max_chunksize=BATCH_ROWS_MAX)


class IcestateChangeFeedReader(DataSourceReader):
    """Reads the change feed of one variable over a range of checkpoints (option ``readChangeFeed``):
    per step from a checkpoint to the next one of the line, what each key's state became."""

    def __init__(self, options: ReadOptions, schema: StructType):
        wanted = options.change_feed
        with options.opened_table() as table:
            layout = table.layout
            desc = options.descriptor(layout)
            steps = _change_steps(table, wanted)
            filesystem = table.filesystem
        full = change_feed_arrow_schema(layout, desc)
        self.spec = ReadSpec(
            filesystem=filesystem, key_schema=layout.key_schema, descriptor=_plain_descriptor(desc),
            source_schema=_source_schema(layout, desc), output_schema=_requested_schema(schema, full, desc),
            now_ms=options.now_ms if options.now_ms is not None else time.time_ns() // 1_000_000,
            checkpoint_id=None, batches={}, file_cache=options.file_cache)
        count = min(options.partitions or DEFAULT_PARTITIONS_MAX, layout.max_parallelism)
        self._partitions = plan_change_partitions(steps, layout.max_parallelism, count)

    def partitions(self) -> list[ChangePartition]:
        return self._partitions

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, ChangePartition):
            return iter(())
        return read_change_partition(self.spec, partition)


def _change_steps(table: IcebergStateTable, wanted: ChangeFeedRange) -> list[tuple[Any, int, list, list]]:
    """(checkpoint, id of the one before it, its segments, those before) of every checkpoint of
    the line in ``wanted``; the first one's predecessor must be retained (or it must be the
    table's first checkpoint)."""
    line = table.list_checkpoints()
    picked = [i for i, info in enumerate(line) if wanted.picks(info)]
    retained = f"retained: batches {[c.batch_id for c in line]}, checkpoints {[c.checkpoint_id for c in line]}"
    if not picked:
        raise CheckpointNotFoundError(
            f"icestate data source: readChangeFeed: no retained checkpoint of {wanted.describe()} on branch "
            f"{table.branch!r} of state table {table.identifier} ({retained})")
    steps = []
    for i in picked:
        info = line[i]
        if i > 0:
            before, old = line[i - 1].checkpoint_id, table.segments_at(line[i - 1].checkpoint_id)[1]
        elif all(s.checkpoint_id >= info.checkpoint_id for s in table.segments_at(info.checkpoint_id)[1]):
            before, old = 0, []  # the table's first checkpoint: everything in it is new
        else:
            raise CheckpointNotFoundError(
                f"icestate data source: readChangeFeed: the checkpoint before checkpoint {info.checkpoint_id} (batch "
                f"{info.batch_id}) is no longer retained, so its changes cannot be told; start the feed one step later "
                f"({retained})")
        steps.append((info, before, table.segments_at(info.checkpoint_id)[1], old))
    return steps


def _column_of(f: Filter) -> str | None:
    attribute = getattr(f, "attribute", None)
    if attribute is None and isinstance(f, Not):
        attribute = getattr(f.child, "attribute", None)
    if attribute is None or len(attribute) != 1:
        return None
    return attribute[0]


def _requested_schema(schema: StructType, full: pa.Schema, desc: StateDescriptor) -> pa.Schema:
    """The Arrow schema Spark checks batches against: ``schema`` (the source's own or a subset
    the user gave by name) converted as Spark does."""
    missing = [n for n in schema.fieldNames() if n not in full.names]
    if missing:
        raise ValueError(
            f"icestate data source: the given schema has column(s) {missing} that state {desc.name!r} does not "
            f"have; its columns are {full.names}"
        )
    return to_arrow_schema(schema, timezone="UTC")


class IcestateDataSource(DataSource):
    """``spark.read.format("icestate")``: the resolved state of a state table (module docstring)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def schema(self) -> StructType:
        options = ReadOptions.parse(self.options)
        with options.opened_table() as table:
            desc = options.descriptor(table.layout)
            if options.change_feed is not None:
                return _as_spark(change_feed_arrow_schema(table.layout, desc), desc)
            return state_spark_schema(table.layout, desc)

    def reader(self, schema: StructType) -> DataSourceReader:
        options = ReadOptions.parse(self.options)
        if options.change_feed is not None:
            return IcestateChangeFeedReader(options, schema)
        cls = IcestateFilteringReader if options.pushdown and FILTER_PUSHDOWN_AVAILABLE else IcestateReader
        return cls(options, schema)


def register(spark: Any, filter_pushdown: bool = True) -> None:
    """Register the ``icestate`` format with ``spark``; with ``filter_pushdown`` also set
    ``spark.sql.python.filterPushdown.enabled`` to true (needed for the default reader)."""
    spark.dataSource.register(IcestateDataSource)
    if filter_pushdown:
        spark.conf.set(FILTER_PUSHDOWN_CONF, "true")
