"""The ``icestate`` Spark data source against the DuckDB reader of the same checkpoints.

One state table (4 writer tasks, 3 checkpoints, value / list / map / struct / TTL state,
deletes) is read through ``spark.read.format("icestate")`` and must give exactly the rows of
``catalog.sql.connect``'s ``state_<name>`` tables (invariant 5), at the newest and an older
checkpoint. Filter pushdown is checked on the planned partitions (which segment files each
partition opens) and on what Spark returns.
"""

from __future__ import annotations

import datetime as dt
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.datasource import EqualTo, GreaterThanOrEqual, In, InputPartition, LessThan, Not

from catalog import IcebergStateTable, connect
from spark_integration.datasource import (
    FILTER_PUSHDOWN_CONF,
    IcestateDataSource,
    IcestateFilteringReader,
    IcestateReader,
    plan_partitions,
    read_partition,
    register,
)
from statestore import (
    CheckpointNotFoundError,
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    TtlConfig,
    ValueStateDescriptor,
    assign_key_group,
    assign_key_groups,
    task_for_key_group,
)

N = 16
TASKS = 4
USERS = [f"u{i}" for i in range(60)]
PROFILE_TYPE = pa.struct([("name", pa.string()), ("age", pa.int32())])
DESCRIPTORS = [
    ValueStateDescriptor("count", pa.int64()),
    ListStateDescriptor("pages", pa.string()),
    MapStateDescriptor("seen", pa.int32(), key_type=pa.string()),
    ValueStateDescriptor("session", pa.string(), ttl=TtlConfig(5000)),
    ValueStateDescriptor("profile", PROFILE_TYPE),
]
LAYOUT = StateLayout.of(pa.schema([("user", pa.string())]), DESCRIPTORS, N)
STATES = [d.name for d in DESCRIPTORS]
# The session values of checkpoint 1 expire at 6000, those rewritten at checkpoint 2 at 7000.
NOW_MS = 6500


def _keys(users: list[str]) -> pa.Table:
    return pa.table({"user": pa.array(users, pa.string())})


def _commit(table: IcebergStateTable, stores: list[StateStore], write) -> None:
    """One checkpoint of every task: ``write(store, index, users)`` with the task's own users."""
    owner = task_for_key_group(N, TASKS, assign_key_groups(_keys(USERS), N).astype(np.int64))
    cp = table.next_checkpoint_id()
    segments = []
    for t, store in enumerate(stores):
        mine = [(i, u) for i, u in enumerate(USERS) if owner[i] == t]
        write(store, [i for i, _ in mine], [u for _, u in mine])
        segments += store.flush(cp)
    table.commit_checkpoint(cp, segments, parallelism=TASKS, batch_id=cp)
    for store in stores:
        store.checkpoint_complete(cp)


def _round1(store: StateStore, ids: list[int], users: list[str]) -> None:
    k = _keys(users)
    store.get_state("count").update_batch(k, pa.array(ids, pa.int64()))
    store.get_state("pages").add_batch(k, ["/a"] * len(ids))
    store.get_state("seen").put_batch(k, ["x"] * len(ids), pa.array(ids, pa.int32()))
    store.get_state("session").update_batch(k, ["s1"] * len(ids))
    store.get_state("profile").update_batch(k, pa.array([{"name": f"n{i}", "age": i} for i in ids], PROFILE_TYPE))


def _round2(store: StateStore, ids: list[int], users: list[str]) -> None:
    def pick(cond):
        return _keys([u for i, u in zip(ids, users, strict=True) if cond(i)]), [i for i in ids if cond(i)]

    even, even_ids = pick(lambda i: i % 2 == 0)
    store.get_state("count").update_batch(even, pa.array([i + 100 for i in even_ids], pa.int64()))
    store.get_state("count").clear_batch(pick(lambda i: i % 5 == 0)[0])
    threes, three_ids = pick(lambda i: i % 3 == 0)
    store.get_state("pages").add_batch(threes, ["/b"] * len(three_ids))
    store.get_state("pages").clear_batch(pick(lambda i: i % 7 == 0)[0])
    odd, odd_ids = pick(lambda i: i % 2 == 1)
    store.get_state("seen").put_batch(odd, ["y"] * len(odd_ids), pa.array([-i for i in odd_ids], pa.int32()))
    fours = pick(lambda i: i % 4 == 0)[0]
    store.get_state("seen").remove_batch(fours, ["x"] * fours.num_rows)
    young = pick(lambda i: i < 20)[0]
    store.get_state("session").update_batch(young, ["s2"] * young.num_rows)
    store.get_state("profile").clear_batch(pick(lambda i: i % 6 == 0)[0])


def _round3(store: StateStore, ids: list[int], users: list[str]) -> None:
    sevens = _keys([u for i, u in zip(ids, users, strict=True) if i % 7 == 0])
    store.get_state("pages").add_batch(sevens, ["/c"] * sevens.num_rows)
    if "u1" in users:
        store.get_state("count").update_batch(_keys(["u1"]), pa.array([7], pa.int64()))
    if "u2" in users:
        store.get_state("seen").clear_batch(_keys(["u2"]))


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A state table "op" with checkpoints 1, 2, 3 written by 4 tasks (clock 1000, 2000, 3000)."""
    wh = str(tmp_path_factory.mktemp("ds") / "wh")
    clock = [1000]
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    config = StoreConfig(clock_ms=lambda: clock[0], row_group_rows_min=8)
    stores = [StateStore(table, task_index=t, parallelism=TASKS, config=config) for t in range(TASKS)]
    for round_, now in ((_round1, 1000), (_round2, 2000), (_round3, 3000)):
        clock[0] = now
        _commit(table, stores, round_)
    table.close()
    return wh


@pytest.fixture(scope="module")
def icestate(spark):
    """The session with the source registered and filter pushdown on (restored afterwards)."""
    before = spark.conf.get(FILTER_PUSHDOWN_CONF)
    register(spark)
    yield spark
    spark.conf.set(FILTER_PUSHDOWN_CONF, before)


def _opts(warehouse: str, **extra) -> dict[str, str]:
    """The options of these tests: pushdown on (the default is off), unless ``extra`` says otherwise."""
    return {"warehouse": warehouse, "table": "op", "now_ms": str(NOW_MS), "partitions": "2", "pushdown": "true",
            **{k: str(v) for k, v in extra.items()}}


def _load(spark, warehouse: str, **extra):
    reader = spark.read.format("icestate")
    for k, v in _opts(warehouse, **extra).items():
        reader = reader.option(k, v)
    return reader.load()


def _sorted_rows(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=repr)


def _sql_rows(warehouse: str, state: str, checkpoint_id: int | None = None, now_ms: int = NOW_MS) -> list[dict]:
    table = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    try:
        con = connect(table, checkpoint_id=checkpoint_id, now_ms=now_ms)
        return _sorted_rows(con.sql(f"SELECT * FROM state_{state}").to_arrow_table())
    finally:
        table.close()


def _spark_rows(df) -> list[dict]:
    got = df if isinstance(df, pa.Table) else df.toArrow()
    kgs = assign_key_groups(got.select(["user"]), N)
    assert got.column("key_group").to_pylist() == kgs.tolist()
    return _sorted_rows(got)


def _reader(warehouse: str, **extra) -> IcestateReader:
    source = IcestateDataSource(_opts(warehouse, **extra))
    return source.reader(source.schema())


def _read_in_process(reader: IcestateReader) -> tuple[list[dict], dict[str, int]]:
    stats: dict[str, int] = {}
    batches = [b for p in reader.partitions() for b in read_partition(reader.spec, p, reader.key_filter, stats)]
    rows = pa.Table.from_batches(batches, schema=reader.spec.output_schema) if batches else None
    return ([] if rows is None else rows.to_pylist()), stats


# ------------------------------------------------------------------------------ same rows as SQL


def test_newest_checkpoint_matches_duckdb_for_every_state_kind(icestate, warehouse: str):
    frames = {state: _load(icestate, warehouse, state=state) for state in STATES}
    got = {state: df.toArrow() for state, df in frames.items()}
    for state in STATES:
        assert got[state].num_rows, state
        assert _spark_rows(got[state]) == _sql_rows(warehouse, state), state

    schema = {state: df.schema for state, df in frames.items()}
    where = "key_group:int,checkpoint_id:bigint,batch_id:bigint,expire_at_ms:bigint"
    assert schema["count"].simpleString() == f"struct<user:string,v_count:bigint,{where}>"
    assert schema["pages"].simpleString() == (
        f"struct<user:string,v_pages:string,list_position:bigint,ord:bigint,{where}>")
    assert schema["seen"].simpleString() == f"struct<user:string,mk_seen:string,v_seen:int,{where}>"
    assert schema["profile"]["v_profile"].dataType == T.StructType(
        [T.StructField("name", T.StringType()), T.StructField("age", T.IntegerType())])
    assert not schema["count"]["key_group"].nullable and not schema["count"]["user"].nullable

    count = {r["user"]: r["v_count"] for r in got["count"].to_pylist()}
    assert "u5" not in count and count["u1"] == 7 and count["u2"] == 102 and count["u3"] == 3
    pages: dict[str, list[str]] = {}
    for r in sorted(got["pages"].to_pylist(), key=lambda r: r["ord"]):
        pages.setdefault(r["user"], []).append(r["v_pages"])
    # u0, u7, u14: cleared at checkpoint 2 (multiples of 7), then /c; u3: /a then /b.
    assert [pages[u] for u in ("u0", "u3", "u7", "u14", "u1")] == [["/c"], ["/a", "/b"], ["/c"], ["/c"], ["/a"]]
    seen = {(r["user"], r["mk_seen"]): r["v_seen"] for r in got["seen"].to_pylist()}
    assert ("u4", "x") not in seen and seen[("u3", "y")] == -3 and not any(u == "u2" for u, _ in seen)
    # TTL at now_ms: the sessions of checkpoint 1 expired, those rewritten at checkpoint 2 not.
    sessions = got["session"].to_pylist()
    assert sorted(r["user"] for r in sessions) == sorted(USERS[:20])
    assert {(r["v_session"], r["expire_at_ms"]) for r in sessions} == {("s2", 7000)}
    profiles = {r["user"]: r["v_profile"] for r in got["profile"].to_pylist()}
    assert profiles["u7"] == {"name": "n7", "age": 7} and "u6" not in profiles


def test_older_checkpoint_matches_duckdb(icestate, warehouse: str):
    for state in ("count", "pages", "seen"):
        got = _spark_rows(_load(icestate, warehouse, state=state, checkpoint=1))
        assert got == _sql_rows(warehouse, state, checkpoint_id=1), state
        if state == "count":  # before the deletes and updates of checkpoint 2
            assert sorted((r["user"], r["v_count"]) for r in got) == sorted((u, i) for i, u in enumerate(USERS))


def test_ttl_is_evaluated_at_now_ms(icestate, warehouse: str):
    early = _spark_rows(_load(icestate, warehouse, state="session", now_ms=5000))
    assert len(early) == len(USERS)
    assert early == _sql_rows(warehouse, "session", now_ms=5000)


def test_struct_fields_are_spark_struct_fields(icestate, warehouse: str):
    df = _load(icestate, warehouse, state="profile")
    rows = df.filter(F.col("user").isin("u7", "u6")).select("user", "v_profile.name", "v_profile.age").collect()
    assert [tuple(r) for r in rows] == [("u7", "n7", 7)]  # u6 was cleared at checkpoint 2


def test_executors_read_segments_through_the_file_cache(icestate, warehouse: str, tmp_path):
    """With ``fileCache`` on, a read fetches each segment into the process's cache once; the next
    read finds the copies. ``auto`` on a local table reads the files directly, as a cached copy
    would only copy them."""
    cache = {"fileCache": "on", "fileCacheDir": str(tmp_path / "cache")}
    first_rows, first = _read_in_process(_reader(warehouse, state="count", **cache))
    again_rows, again = _read_in_process(_reader(warehouse, state="count", **cache))
    assert first_rows == again_rows and first_rows
    assert first["file_cache_misses"] > 0  # each segment fetched once (its footer and data then read locally)
    assert again["file_cache_misses"] == 0 and again["file_cache_hits"] >= first["file_cache_misses"]
    _, direct = _read_in_process(_reader(warehouse, state="count"))
    assert direct["file_cache_hits"] == direct["file_cache_misses"] == 0
    feed = {"state": "count", "readChangeFeed": "true", "changeStartCheckpoint": "1"}  # through the cache too
    assert _load(icestate, warehouse, **feed, **cache).toArrow().to_pylist() == \
        _load(icestate, warehouse, **feed).toArrow().to_pylist()
    assert (_spark_rows(_load(icestate, warehouse, state="count", **cache))
            == _spark_rows(_load(icestate, warehouse, state="count")) == _sql_rows(warehouse, "count"))
    with pytest.raises(ValueError, match="option fileCache must be one of"):
        _reader(warehouse, state="count", fileCache="always")


# ------------------------------------------------------------------------------ pushdown


def test_key_filter_plans_only_the_key_groups_segments(warehouse: str):
    kg = assign_key_group(("u7",), LAYOUT.key_schema, N)
    reader = _reader(warehouse, state="count")
    full_rows, full_stats = _read_in_process(reader)
    every_file = {f for p in reader.partitions() for f in p.files}

    reader = _reader(warehouse, state="count")
    assert reader.pushFilters([EqualTo(("user",), "u7")]) == []
    (partition,) = reader.partitions()
    assert partition.key_groups == (kg,)
    table = IcebergStateTable.open_existing(warehouse=warehouse, table_name="op")
    covering = {s.path for s in table.segments(KeyGroupRange.of(kg, kg))}
    table.close()
    assert set(partition.files) == covering
    # Written by 4 tasks: the files of the other 3 tasks' key groups are not opened.
    assert len(covering) == 3 and len(every_file) == 3 * TASKS
    rows, stats = _read_in_process(reader)
    assert [(r["user"], r["v_count"], r["key_group"]) for r in rows] == [("u7", 7, kg)]
    assert rows == [r for r in full_rows if r["user"] == "u7"]
    assert 0 < stats["segment_bytes_read"] < full_stats["segment_bytes_read"] / 2
    assert stats["segment_files_opened"] <= 2 * len(covering)  # a footer read and a data read per file


def test_key_filter_in_spark_reads_one_partition(icestate, warehouse: str):
    df = _load(icestate, warehouse, state="seen", partitions=4)
    filtered = df.filter(F.col("user").isin("u7", "u9"))
    kgs = {assign_key_group((u,), LAYOUT.key_schema, N) for u in ("u7", "u9")}
    assert filtered.rdd.getNumPartitions() == len({k * 4 // N for k in kgs})
    expected = [r for r in _sql_rows(warehouse, "seen") if r["user"] in ("u7", "u9")]
    assert _spark_rows(filtered) == expected
    # A filter on another column is left to Spark, and still applies.
    assert _spark_rows(df.filter((F.col("user") == "u9") & (F.col("mk_seen") == "y"))) == \
        [r for r in expected if r["user"] == "u9" and r["mk_seen"] == "y"]


def test_key_group_filters_prune_ranges(icestate, warehouse: str):
    reader = _reader(warehouse, state="count", partitions=4)
    filters = [GreaterThanOrEqual(("key_group",), 3), LessThan(("key_group",), 9), Not(In(("key_group",), (5,)))]
    assert reader.pushFilters(filters) == []
    partitions = reader.partitions()
    assert [p.key_groups for p in partitions] == [(3,), (4, 6, 7), (8,)]
    for p in partitions:
        assert all(any(s.key_group_min <= k <= s.key_group_max for k in p.key_groups) for s in p.segments)
    nothing = _reader(warehouse, state="count")
    assert nothing.pushFilters([EqualTo(("key_group",), 100)]) == []
    assert nothing.partitions() == []

    df = _load(icestate, warehouse, state="count", partitions=4)
    got = df.filter("key_group >= 3 AND key_group < 9 AND key_group != 5")
    assert got.rdd.getNumPartitions() == 3
    expected = [r for r in _sql_rows(warehouse, "count")
                if assign_key_group((r["user"],), LAYOUT.key_schema, N) in (3, 4, 6, 7, 8)]
    assert _spark_rows(got) == expected and expected


THREE_KEYS = pa.schema([("tenant", pa.int32()), ("day", pa.date32()), ("user", pa.string())])
DAY1, DAY2 = dt.date(2024, 1, 1), dt.date(2024, 1, 2)


@pytest.fixture(scope="module")
def three_keys(warehouse: str) -> str:
    """A table "three" keyed by (tenant int, day date, user string), one checkpoint."""
    layout = StateLayout.of(THREE_KEYS, [ValueStateDescriptor("n", pa.int64())], N)
    table = IcebergStateTable.open(layout, warehouse=warehouse, table_name="three")
    store = StateStore(table)
    keys = pa.table({"tenant": pa.array([1, 1, 2, 2, 3], pa.int32()), "day": [DAY1, DAY2, DAY2, DAY2, DAY2],
                     "user": ["a", "a", "a", "b", "a"]}, schema=THREE_KEYS)
    store.get_state("n").update_batch(keys, pa.array([10, 11, 20, 21, 30], pa.int64()))
    store.checkpoint()
    table.close()
    return "three"


def test_filters_on_some_keys_or_other_columns_are_returned(warehouse: str, three_keys: str):
    source = IcestateDataSource({"warehouse": warehouse, "table": three_keys, "pushdown": "true"})
    reader = source.reader(source.schema())
    some_keys = [EqualTo(("user",), "a"), In(("tenant",), (1, 2))]
    value = EqualTo(("v_n",), 10)
    returned = reader.pushFilters([*some_keys, value])
    assert [id(f) for f in returned] == [id(f) for f in [value, *some_keys]]
    assert reader.pushed.key_groups is None and reader.key_filter is None

    reader = source.reader(source.schema())
    every_key = [In(("tenant",), (1, 2, 3)), EqualTo(("day",), DAY2), EqualTo(("user",), "a"), In(("tenant",), (1, 2))]
    assert reader.pushFilters(every_key) == []
    expected_kgs = assign_key_groups(pa.table(
        {"tenant": pa.array([1, 2], pa.int32()), "day": [DAY2, DAY2], "user": ["a", "a"]}, schema=THREE_KEYS), N)
    assert reader.pushed.key_groups == set(expected_kgs.tolist())
    rows, _ = _read_in_process(reader)
    assert sorted((r["tenant"], r["user"], r["v_n"]) for r in rows) == [(1, "a", 11), (2, "a", 20)]


def test_filter_on_every_key_column_in_spark(icestate, warehouse: str, three_keys: str):
    df = icestate.read.format("icestate").options(warehouse=warehouse, table=three_keys, partitions="4",
                                                  pushdown="true").load()
    filtered = df.filter("tenant IN (1, 2) AND day = DATE'2024-01-02' AND user = 'a'")
    got = sorted((r.tenant, r.day, r.user, r.v_n) for r in filtered.collect())
    assert got == [(1, DAY2, "a", 11), (2, DAY2, "a", 20)]
    # Two keys, hence at most two key groups and two partitions planned.
    assert filtered.rdd.getNumPartitions() <= 2


def test_user_schema_selects_columns(warehouse: str):
    source = IcestateDataSource(_opts(warehouse, state="seen"))
    wanted = T.StructType([T.StructField("user", T.StringType(), False), T.StructField("v_seen", T.IntegerType())])
    reader = source.reader(wanted)
    rows, _ = _read_in_process(reader)
    assert reader.spec.output_schema.names == ["user", "v_seen"]
    assert sorted((r["user"], r["v_seen"]) for r in rows) == sorted(
        (r["user"], r["v_seen"]) for r in _sql_rows(warehouse, "seen"))
    with pytest.raises(ValueError, match=r"column\(s\) \['nope'\] that state 'seen' does not have"):
        source.reader(T.StructType([T.StructField("nope", T.StringType())]))


def test_plan_partitions_splits_the_key_group_space():
    from statestore import SegmentFile

    segments = [SegmentFile(f"s{i}", 1, 4 * i, 4 * i + 3, 10, 100) for i in range(4)]
    planned = plan_partitions(segments, 16, 2)
    assert [(p.start, p.end, p.files) for p in planned] == [(0, 7, ["s0", "s1"]), (8, 15, ["s2", "s3"])]
    assert plan_partitions(segments, 16, 2, key_groups=[9]) == [
        planned[1].__class__(0, 8, 15, (9,), (segments[2],))]
    assert plan_partitions(segments, 16, 2, key_groups=[]) == []
    assert [p.key_groups for p in plan_partitions(segments, 16, 64, key_groups=[1, 2, 14])] == [(1,), (2,), (14,)]
    assert len(plan_partitions(segments, 16, 64)) == 16  # at most one partition per key group


def test_reader_pickles_without_the_segment_list(warehouse: str):
    reader = _reader(warehouse, state="count")
    partitions = reader.partitions()
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._segments is None and clone.spec == reader.spec
    assert list(clone.read(partitions[0])) and list(clone.read(InputPartition(None))) == []


# ------------------------------------------------------------------------------ options


def test_catalog_options_instead_of_warehouse(warehouse: str):
    root = Path(warehouse).resolve()
    source = IcestateDataSource({
        "table": "op", "state": "count", "now_ms": str(NOW_MS), "catalog.name": "statestore",
        "catalog.type": "sql", "catalog.uri": f"sqlite:///{root / 'catalog.db'}", "catalog.warehouse": f"file://{root}",
    })
    reader = source.reader(source.schema())
    rows, _ = _read_in_process(reader)
    assert _sorted_rows(pa.Table.from_pylist(rows)) == _sql_rows(warehouse, "count")


def test_pushdown_option_off_gives_a_reader_without_push_filters(warehouse: str):
    assert type(_reader(warehouse, state="count")) is IcestateFilteringReader
    assert type(_reader(warehouse, state="count", pushdown="false")) is IcestateReader


@pytest.mark.parametrize(("options", "message"), [
    ({"warehouse": "W", "state": "count"}, "option 'table' is missing"),
    ({"table": "op", "state": "count"}, "no catalog: pass option 'warehouse'"),
    ({"warehouse": "W", "table": "op", "state": "nope"},
     r"has no state variable 'nope'; declared: \['count', 'pages', 'seen', 'session', 'profile'\]"),
    ({"warehouse": "W", "table": "op"}, r"declares 5 state variables .* choose one with .option\('state'"),
    ({"warehouse": "W", "table": "missing", "state": "count"}, "cannot read state table state.missing"),
    ({"warehouse": "W", "table": "op", "namespace": "other"}, "cannot read state table other.op"),
    ({"warehouse": "W", "table": "op", "state": "count", "partitions": "zero"}, "partitions must be an integer"),
    ({"warehouse": "W", "table": "op", "state": "count", "checkpint": "1"}, r"unknown option\(s\) \['checkpint'\]"),
    ({"warehouse": "W", "table": "op", "catalog.uri": "x"}, "both option 'warehouse'"),
    ({"table": "op", "catalog.name": "nope", "catalog.uri": "ftp://me:pw@host"},
     r"cannot load pyiceberg catalog 'nope' .*ftp://me:\*\*\*@host"),
    ({"warehouse": "s3://bucket/wh", "table": "op"}, "warehouse 's3://bucket/wh' is a URI"),
])
def test_bad_options_are_clear_errors(warehouse: str, options: dict, message: str):
    options = {k: (warehouse if v == "W" else v) for k, v in options.items()}
    with pytest.raises((ValueError, TypeError), match=message):
        IcestateDataSource(options).schema()


def test_checkpoint_not_retained_names_the_retained_ones(warehouse: str):
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint=42: .*retained: \[1, 2, 3\]"):
        IcestateDataSource(_opts(warehouse, state="count", checkpoint=42)).schema()


def test_errors_reach_the_spark_user(icestate, warehouse: str):
    with pytest.raises(Exception, match="has no state variable 'nope'"):
        _load(icestate, warehouse, state="nope").collect()


def test_pushdown_disabled_session_needs_the_option(icestate, warehouse: str):
    icestate.conf.set(FILTER_PUSHDOWN_CONF, "false")
    try:
        with pytest.raises(Exception, match="DATA_SOURCE_PUSHDOWN_DISABLED"):
            _load(icestate, warehouse, state="count").count()
        assert _load(icestate, warehouse, state="count", pushdown="false").filter("user = 'u3'").count() == 1
    finally:
        icestate.conf.set(FILTER_PUSHDOWN_CONF, "true")


def test_a_dataframe_of_the_default_reader_gives_every_query_its_own_rows(icestate, warehouse: str):
    """Found by the notebooks' helper: with pushdown, Spark 4.3 kept the first filtered query's
    read for later queries of the same DataFrame (``df.filter(key).count()`` then ``df.count()``
    gave 1). The default reader pushes nothing, so each query reads what it asks for."""
    df = (icestate.read.format("icestate").option("warehouse", warehouse).option("table", "op")
          .option("state", "count").option("now_ms", str(NOW_MS)).load())
    everyone = len(_sql_rows(warehouse, "count"))
    assert df.filter("user = 'u3'").count() == 1
    assert df.filter("user = 'u3' OR user = 'u7'").count() == 2
    assert df.count() == everyone > 2


def test_empty_table_reads_no_rows(icestate, warehouse: str):
    IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="empty").close()
    df = icestate.read.format("icestate").options(warehouse=warehouse, table="empty", state="pages").load()
    assert df.count() == 0
    assert df.columns == ["user", "v_pages", "list_position", "ord", "key_group", "checkpoint_id", "batch_id",
                          "expire_at_ms"]


def test_savepoints_and_forks_read_like_checkpoints(icestate, warehouse: str, tmp_path: Path):
    """Options savepoint= and branch= read a savepoint and a fork's line (a copy of the
    shared warehouse, so the other tests' table stays as it is)."""
    import shutil

    wh = str(tmp_path / "wh")
    shutil.copytree(warehouse, wh)
    table = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op")
    table.savepoint("sp", 1)
    table.fork("v2", 2)
    table.close()
    fork = IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op", branch="v2")
    owner = task_for_key_group(N, TASKS, assign_key_group(("u3",), LAYOUT.key_schema, N))
    store = StateStore(fork, task_index=owner, parallelism=TASKS)
    store.get_state("count").update_batch(_keys(["u3"]), pa.array([999], pa.int64()))
    cp = fork.next_checkpoint_id()
    fork.commit_checkpoint(cp, store.flush(cp), parallelism=TASKS, batch_id=cp)
    store.checkpoint_complete(cp)
    store.close()
    fork.close()
    at_savepoint = _spark_rows(_load(icestate, wh, state="count", savepoint="sp"))
    assert at_savepoint == _spark_rows(_load(icestate, wh, state="count", checkpoint=1))
    on_fork = {r["user"]: r["v_count"] for r in _spark_rows(_load(icestate, wh, state="count", branch="v2"))}
    on_main = {r["user"]: r["v_count"] for r in _spark_rows(_load(icestate, wh, state="count"))}
    forked = {r["user"]: r["v_count"] for r in _spark_rows(_load(icestate, wh, state="count", checkpoint=2))}
    assert on_fork["u3"] == 999 and on_main.get("u3") != 999
    assert {u: v for u, v in on_fork.items() if u != "u3"} == {u: v for u, v in forked.items() if u != "u3"}
    assert on_main == {r["user"]: r["v_count"] for r in _spark_rows(_load(icestate, warehouse, state="count"))}
    with pytest.raises(Exception, match="checkpoint and savepoint"):
        _load(icestate, wh, state="count", savepoint="sp", checkpoint=1).collect()


def test_the_change_feed_refuses_a_first_step_whose_previous_checkpoint_expired(tmp_path):
    """Found by review: expiry leaves the oldest retained snapshot without a parent, which was
    taken for the table's first checkpoint, and its whole state came back as inserts."""
    wh = str(tmp_path / "retained")
    with IcebergStateTable.open(LAYOUT, warehouse=wh, table_name="op", retain_checkpoints=2) as table:
        store = StateStore(table)
        for batch in range(4):
            store.get_state("count").update_batch(pa.table({"user": [f"u{batch}"]}), [batch])
            store.checkpoint(batch_id=batch)

    def reader(start: int) -> object:
        source = IcestateDataSource({"warehouse": wh, "table": "op", "state": "count", "readChangeFeed": "true",
                                     "changeStartBatchId": str(start)})
        return source.reader(source.schema())

    with pytest.raises(CheckpointNotFoundError, match="is no longer retained"):
        reader(2)
    planned = reader(3).partitions()
    assert {p.batch_id for p in planned} == {3}
