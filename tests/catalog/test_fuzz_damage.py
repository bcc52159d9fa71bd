"""Fuzzing of damaged files: every damaged file is named or read correctly; never a different
state silently, never committed data deleted, never a crash.

Strategy
    A real Iceberg state table is built once per place (local disk with the embedded catalog;
    S3 on moto's server, ``tests/s3_server.py``, with a SQLite catalog file): four checkpoints
    of a value state, a list state and a map state, with puts, appends, a cleared value, a
    cleared list and a removed map entry, each with the operator state of two tasks (a split
    and a union list); a compaction of the newest checkpoint (its segments merged, in a commit
    of its own); a fifth checkpoint; then a fork at it with two checkpoints of its own. The
    state of each checkpoint of each line is remembered as the store reads it (batched and per
    key), as ``catalog.sql.connect`` shows it (the ``state_<name>`` tables and the raw
    ``entries`` view) and as a task restoring the operator state gets it; so are the files each
    checkpoint references. Every file is remembered (its bytes) as the pristine table.

    Each example damages one file chosen by hypothesis among the metadata.json files (current
    and older), the manifest lists, the manifests, the segments and the operator state files,
    of the main line, the fork or the compaction (``Damage.origin``), in one way: truncated at
    an offset, a byte flipped, bytes overwritten at an offset, emptied, deleted, or replaced by
    another file of the same kind of the same table. Then, as a fresh process (``METADATA_FILES``
    cleared, no file cache), it opens the table and reads every checkpoint of both lines.

    The reads run in a child process (``in_child``, one for the module, started again after a
    death): a damaged file that crashes the process (pyiceberg's Cython Avro decoder did) fails
    the example instead of killing the test run. The child starts over from the pristine files
    after each example.

Properties
    1. Each read (opening the table, each checkpoint through the store, through SQL and as
       operator state) gives exactly the remembered state, or raises one of the store's errors
       (``StateStoreError``) whose message names the damaged file. No other exception type,
       and the process lives.
    2. The next checkpoint's commit and a garbage collection with the orphan sweep (where the
       table opens) delete no undamaged file that a retained checkpoint references.
"""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from catalog import IcebergStateTable, TableRef
from catalog import gc as gc_module
from catalog.compaction import compact
from catalog.fileio import METADATA_FILES, wait_for_deletes
from catalog.retention import operator_files_of
from catalog.sql import connect
from statestore import (
    ListStateDescriptor,
    MapStateDescriptor,
    OperatorStateDescriptor,
    OperatorStateStore,
    Redistribution,
    StateStore,
    StoreConfig,
    ValueStateDescriptor,
)
from statestore.errors import CorruptMetadataError, CorruptSegmentError, StateStoreError
from statestore.keygroups import KeyGroupRange
from statestore.layout import StateLayout
from tests import s3_server
from tests.catalog.catalog_helpers import commit_next, snapshot_files, table_files
from tests.fuzzing import fuzz_settings

ELSEWHERE = StoreConfig(file_cache_mode="off")  # a reader on another host: nothing cached
LAYOUT = StateLayout.of(pa.schema([("user", pa.string())]), [
    ValueStateDescriptor("count", pa.int64()), ListStateDescriptor("events", pa.string()),
    MapStateDescriptor("seen", pa.int32(), key_type=pa.string())], 16)
OPERATOR = (OperatorStateDescriptor("offsets", pa.int64(), Redistribution.SPLIT),
            OperatorStateDescriptor("sources", pa.string(), Redistribution.UNION))
USERS = ["a", "b", "c", "d", "e"]
NOW_MS = 1_700_000_000_000
TABLE = "t"
FORK = "f"
S3_BUCKET = "icestate-fuzz-damage"
KINDS = ("metadata.json", "manifest list", "manifest", "segment", "operator state")
MODES = ("truncate", "flip", "overwrite", "empty", "delete", "replace")
# Where a file came from: the main line's checkpoints, the compaction, or the fork's checkpoints.
ORIGINS = ("main", "compaction", "fork")


def keys(names: list[str]) -> pa.Table:
    return pa.table({"user": pa.array(names, pa.string())})


def checkpoint(table: IcebergStateTable, store: StateStore, step: int) -> None:
    """Commit the store's writes with the operator state of two tasks (what a two-task job
    restoring at any parallelism redistributes)."""
    cp = table.next_checkpoint_id()
    segments = store.flush(cp)
    tasks = [OperatorStateStore(table, OPERATOR, task_index=t, parallelism=2) for t in range(2)]
    for t, task in enumerate(tasks):
        task.get_list_state("offsets").update([100 * step + t, 100 * step + t + 10])
        task.get_list_state("sources").update([f"s{step}-{t}"])
    table.commit_checkpoint(cp, segments, parallelism=2, operator_state=[task.flush(cp) for task in tasks])
    store.checkpoint_complete(cp)


def write_checkpoints(table: IcebergStateTable) -> None:
    """Four checkpoints: puts, appends and map puts; then a cleared value, a cleared list and a
    removed map entry; then more."""
    store = StateStore(table, config=ELSEWHERE)
    count, events, seen = store.get_state("count"), store.get_state("events"), store.get_state("seen")
    count.update_batch(keys(["a", "b"]), [1, 2])
    events.add_batch(keys(["a", "a", "b"]), ["x", "y", "z"])
    seen.put_batch(keys(["a", "b"]), ["u", "u"], [1, 2])
    checkpoint(table, store, 1)
    count.update_batch(keys(["a", "c"]), [3, 4])
    events.add_batch(keys(["c"]), ["w"])
    seen.put_batch(keys(["a"]), ["v"], [5])
    checkpoint(table, store, 2)
    count.clear_batch(keys(["b"]))
    events.clear_batch(keys(["a"]))
    seen.remove_batch(keys(["a"]), ["u"])
    checkpoint(table, store, 3)
    store.set_current_key("d")
    count.update(9)
    events.add("q")
    seen.put("t", 7)
    checkpoint(table, store, 4)


def write_more(table: IcebergStateTable, step: int, user: str) -> None:
    """One more checkpoint: a value, an append and a map entry of ``user``."""
    store = StateStore(table, config=ELSEWHERE)
    store.set_current_key(user)
    store.get_state("count").update(step)
    store.get_state("events").add(f"n{step}")
    store.get_state("seen").put(f"k{step}", step)
    checkpoint(table, store, step)


def read_state(table: IcebergStateTable) -> dict:
    """The opened checkpoint's state of every user, batched and per key, as a fresh store reads it."""
    store = StateStore(table, config=ELSEWHERE)
    count, events, seen = store.get_state("count"), store.get_state("events"), store.get_state("seen")
    state = {"count": count.get_batch(keys(USERS)).to_pylist(), "events": events.get_batch(keys(USERS)).to_pylist(),
             "seen": sorted(map(repr, seen.items_batch(keys(USERS)).to_pylist()))}
    per_key = []
    for user in USERS:
        store.set_current_key(user)
        per_key.append((count.get(), events.get(), sorted(seen.items())))
    state["per key"] = per_key
    return state


def read_operator_state(table: IcebergStateTable) -> list:
    """The opened checkpoint's operator state as the one task of a restoring job gets it."""
    task = OperatorStateStore(table, OPERATOR, task_index=0, parallelism=1)
    return [task.get_list_state(d.name).get() for d in OPERATOR]


def read_sql(table: IcebergStateTable, checkpoint_id: int) -> dict:
    """The checkpoint as ``catalog.sql.connect`` shows it: the live state tables and the raw entries."""
    con = connect(table, checkpoint_id=checkpoint_id, now_ms=NOW_MS)
    shown = {name: sorted(map(repr, con.execute(f'SELECT * FROM "state_{name}"').fetchall()))
             for name in ("count", "events", "seen")}
    shown["entries"] = sorted(map(repr, con.execute("SELECT * FROM entries").fetchall()))
    return shown


def read_all(table: IcebergStateTable, checkpoint_id: int) -> tuple:
    table.restore(checkpoint_id)
    return read_state(table), read_operator_state(table), read_sql(table, checkpoint_id)


@dataclass(frozen=True)
class Place:
    """Where the fuzzed table lives: ``local`` (the embedded catalog in ``root``/wh) or ``s3``
    (its files on moto under a prefix of ``S3_BUCKET``, its SQLite catalog in ``root``/wh)."""

    kind: str
    root: str
    endpoint: str | None = None

    @property
    def warehouse(self) -> str:
        return os.path.join(self.root, "wh")

    def ref(self, branch: str = "main") -> TableRef:
        if self.kind == "local":
            return TableRef(TABLE, warehouse=self.warehouse, branch=branch)
        assert self.endpoint is not None
        return TableRef(TABLE, catalog_name="fuzz", branch=branch, catalog_properties={
            "type": "sql", "uri": f"sqlite:///{self.warehouse}/catalog.db", "init_catalog_tables": "true",
            "warehouse": f"s3://{S3_BUCKET}/{os.path.basename(self.root)}", **s3_server.properties(self.endpoint)})

    def open(self, branch: str = "main", **kwargs) -> IcebergStateTable:
        return self.ref(branch).open(LAYOUT, **kwargs)


@dataclass(frozen=True)
class Built:
    """The pristine table: where it is, its checkpoints' states and files, its files by kind."""

    place: Place
    filesystem: pafs.FileSystem
    location: str  # the table's directory as a filesystem path
    states: dict  # (line, checkpoint id) -> (store state, operator state, SQL state)
    referenced: dict  # (line, checkpoint id) -> every file (filesystem path) its snapshot references
    files: dict  # kind -> sorted (path relative to the location, origin)
    pristine: dict  # path relative to the location -> bytes; and the catalog file's bytes


def kind_of(relative: str) -> str | None:
    name = os.path.basename(relative)
    if name.endswith(".metadata.json"):
        return "metadata.json"
    if name.endswith(".avro"):
        return "manifest list" if name.startswith("snap-") else "manifest"
    if name.endswith(".parquet") and relative.startswith("data"):
        return "operator state" if "/operator/" in relative else "segment"
    return None


def listing(fs: pafs.FileSystem, location: str) -> dict[str, bytes]:
    """Every file under ``location``, by relative path, with its bytes."""
    wait_for_deletes()
    infos = fs.get_file_info(pafs.FileSelector(location, recursive=True, allow_not_found=True))
    found = {}
    for info in infos:
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                found[os.path.relpath(info.path, location)] = f.read()
    return found


def referenced_paths(table: IcebergStateTable) -> set[str]:
    """Every file the opened checkpoint's snapshot references, as filesystem paths."""
    snapshot = table.iceberg_table.snapshot_by_id(table.current_checkpoint().snapshot_id)
    uris = snapshot_files(table, snapshot) | {table.iceberg_table.metadata_location.removeprefix("file://")}
    uris |= {f["path"] for f in operator_files_of(snapshot)}
    return {table.filesystem.normalize_path(u.removeprefix("file://").removeprefix("s3://")) for u in uris}


def build(place: Place) -> Built:
    """Build the table of ``place`` (module docstring) and remember everything about it."""
    phases: list[set[str]] = []
    with place.open() as table:
        fs = table.filesystem
        location = fs.normalize_path(table.location.removeprefix("file://").removeprefix("s3://"))
        write_checkpoints(table)
        phases.append(set(listing(fs, location)))
        with place.open() as compactor:
            assert compact(compactor) is not None
        phases.append(set(listing(fs, location)))
        table.restore()
        write_more(table, 5, "e")
        table.fork(FORK)
    with place.open(FORK) as fork:
        write_more(fork, 6, "a")
        write_more(fork, 7, "e")
    files = listing(fs, location)
    origin = {**{p: "fork" for p in files}, **{p: "compaction" for p in phases[1]}, **{p: "main" for p in phases[0]}}
    METADATA_FILES.clear()
    states, referenced = {}, {}
    for line in ("main", FORK):
        with place.open(line) as table:
            for info in table.list_checkpoints():
                if line == FORK and ("main", info.checkpoint_id) in states:
                    continue  # the fork's base: the main line's checkpoint
                states[line, info.checkpoint_id] = read_all(table, info.checkpoint_id)
                referenced[line, info.checkpoint_id] = referenced_paths(table)
    assert sorted(states) == [("f", 6), ("f", 7), *(("main", cp) for cp in range(1, 6))], sorted(states)
    by_kind: dict[str, list] = {k: [] for k in KINDS}
    for relative in files:
        kind = kind_of(relative)
        if kind is not None:
            by_kind[kind].append((relative, origin[relative]))
    with open(os.path.join(place.warehouse, "catalog.db"), "rb") as f:
        files["catalog.db"] = f.read()
    return Built(place, fs, location, states, referenced, {k: sorted(v) for k, v in by_kind.items()}, files)


@functools.cache
def built(kind: str, endpoint: str | None) -> Built:
    """The table of this place, built once per process."""
    root = os.path.realpath(tempfile.mkdtemp(prefix=f"{kind}-", dir=_BASE[0] if _BASE else None))
    os.makedirs(os.path.join(root, "wh"))
    # Files count as settled at once (the sweep's grace, made for crashed commits under way, would
    # otherwise protect every file of a table this young): the sweep may delete any orphan.
    gc_module.COMPACTION_GRACE_SECONDS = -3600
    return build(Place(kind, root, endpoint))


def start_over(b: Built, damaged: str) -> None:
    """The pristine table again after an example that damaged ``damaged``: the files it added
    deleted, the damaged file and the files it deleted written back (the others are as they
    were: a file's name is never used for other bytes)."""
    wait_for_deletes()
    infos = b.filesystem.get_file_info(pafs.FileSelector(b.location, recursive=True, allow_not_found=True))
    now = {os.path.relpath(i.path, b.location) for i in infos if i.type == pafs.FileType.File}
    for relative in now - b.pristine.keys():
        b.filesystem.delete_file(f"{b.location}/{relative}")
    for relative in (b.pristine.keys() - now - {"catalog.db"}) | {damaged}:
        with b.filesystem.open_output_stream(f"{b.location}/{relative}") as f:
            f.write(b.pristine[relative])
    with open(os.path.join(b.place.warehouse, "catalog.db"), "wb") as f:
        f.write(b.pristine["catalog.db"])
    METADATA_FILES.clear()  # as a fresh process


@dataclass(frozen=True)
class Damage:
    """One damage, drawn before the table exists: which file of a kind and origin (an index into
    them; any origin when the kind has none of it), how, where (an offset from the start or
    the end) and with what bytes."""

    kind: str
    origin: str
    index: int
    mode: str
    offset: int
    from_end: bool
    data: bytes
    other: int  # the replacement among the kind's other files

    def resolve(self, b: Built) -> tuple[str, int, str]:
        """(the file, the offset in it, its replacement) in the built table."""
        every = [f for f, _ in b.files[self.kind]]
        files = [f for f, o in b.files[self.kind] if o == self.origin] or every
        target = files[self.index % len(files)]
        size = len(b.pristine[target])
        offset = min(size - 1, self.offset) if not self.from_end else max(0, size - 1 - self.offset)
        others = [f for f in every if f != target] or [target]
        return target, offset, others[self.other % len(others)]


damages = st.builds(
    Damage, kind=st.sampled_from(KINDS), origin=st.sampled_from(ORIGINS), index=st.integers(0, 63),
    mode=st.sampled_from(MODES), offset=st.one_of(st.integers(0, 64), st.integers(0, 1 << 16)),
    from_end=st.booleans(), data=st.binary(min_size=1, max_size=8), other=st.integers(0, 63))


def damage(b: Built, target: str, mode: str, offset: int, data: bytes, other: str) -> None:
    path = f"{b.location}/{target}"
    old = b.pristine[target]
    if mode == "delete":
        b.filesystem.delete_file(path)
        return
    if mode == "empty":
        new = b""
    elif mode == "truncate":
        new = old[:offset]
    elif mode == "replace":
        new = b.pristine[other]
    else:
        at = old[offset:offset + len(data)]
        new = old[:offset] + (bytes(x ^ 0xFF for x in at) if mode == "flip" else data[:max(1, len(at))]) + \
            old[offset + len(at) if at else offset:]
    with b.filesystem.open_output_stream(path) as f:
        f.write(new)


def named(error: StateStoreError, target: str) -> None:
    assert os.path.basename(target) in str(error), f"the error does not name the damaged file {target}: {error!r}"


def check_damage(kind: str, endpoint: str | None, choice: Damage) -> None:
    """Properties 1 and 2 for one damaged file (see the module docstring), in this process."""
    b = built(kind, endpoint)
    target, offset, other = choice.resolve(b)
    mode = choice.mode
    damage(b, target, mode, offset, choice.data, other)
    METADATA_FILES.clear()  # as a fresh process
    try:
        check_reads(b, target, f"damaging {target} ({mode} at {offset}) on {kind}")
    finally:
        start_over(b, target)


def check_reads(b: Built, target: str, what: str) -> None:
    for line in ("main", FORK):
        try:
            table = b.place.open(line)
        except StateStoreError as e:
            named(e, target)
            continue
        with table:
            expected = sorted(cp for at, cp in b.states if at == line or (line == FORK and cp <= 5))
            retained = [info.checkpoint_id for info in table.list_checkpoints()]
            assert retained == expected, f"{line}: checkpoints {retained} after {what}"
            for (at, cp), state in b.states.items():
                if at != line:
                    continue
                try:
                    assert read_all(table, cp) == state, f"{line} checkpoint {cp} reads otherwise after {what}"
                except StateStoreError as e:
                    named(e, target)
    # Retention and the orphan sweep: the next checkpoint, then a collection (main line).
    try:
        with b.place.open() as table:
            store = StateStore(table, config=ELSEWHERE)
            store.get_state("count").update_batch(keys(["e"]), [5])
            store.checkpoint()
            table.collect_garbage()
            wait_for_deletes()
    except StateStoreError as e:
        named(e, target)
    damaged = f"{b.location}/{target}"
    for (line, cp), paths in b.referenced.items():
        lost = sorted(p for p in paths if p != damaged and
                      b.filesystem.get_file_info(p).type != pafs.FileType.File)
        assert not lost, f"after {what}, files of {line} checkpoint {cp} were deleted: {lost}"


# --- the child process ------------------------------------------------------------------------

_CHILD: list[ProcessPoolExecutor] = []
# The folder the child builds its tables in, made and removed by this process: a child of a
# process pool ends without running its exit handlers, so it cannot remove them itself.
_BASE: list[str] = []


def _start_child(base: str) -> None:
    faulthandler.enable()
    _BASE[:] = [base]


def in_child(fn: Callable[..., None], *args: object) -> None:
    """``fn(*args)`` in this module's child process (started when first needed, and again after
    it died): its assertion errors are raised here; its death fails the example."""
    if not _BASE:
        _BASE.append(tempfile.mkdtemp(prefix="icestate-fuzz-damage-"))
    if not _CHILD:
        _CHILD.append(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                          initializer=_start_child, initargs=(_BASE[0],)))
    try:
        _CHILD[0].submit(fn, *args).result()
    except BrokenProcessPool:
        _CHILD.pop().shutdown(wait=False)
        raise AssertionError(f"the process died (see its fault report above): {fn.__name__}{args}") from None


@pytest.fixture(scope="module", autouse=True)
def _child_process() -> Iterator[None]:
    yield
    while _CHILD:
        _CHILD.pop().shutdown()
    while _BASE:
        shutil.rmtree(_BASE.pop(), ignore_errors=True)


@pytest.fixture(scope="module")
def fuzz_s3(s3_server_endpoint: str) -> str:
    s3_server.create_bucket(s3_server_endpoint, S3_BUCKET)
    return s3_server_endpoint


@fuzz_settings(16)
@given(choice=damages)
# In CI too, whatever the examples drawn: damage in the fork, the compaction and the operator state.
@example(choice=Damage("operator state", "main", 0, "replace", 0, False, b"\0", 1))
@example(choice=Damage("segment", "fork", 0, "flip", 200, False, b"\0", 0))
@example(choice=Damage("manifest list", "fork", 1, "truncate", 30, True, b"\0", 0))
@example(choice=Damage("manifest", "compaction", 0, "overwrite", 40, True, b"\xff\xff\xff\xff\x0f", 0))
@example(choice=Damage("segment", "compaction", 0, "delete", 0, False, b"\0", 0))
@pytest.mark.slow
def test_a_damaged_file_is_named_or_read_correctly_and_never_deletes_committed_data(choice: Damage):
    """Properties 1 and 2 for one damaged file of the table on local disk."""
    in_child(check_damage, "local", None, choice)


@fuzz_settings(2)
@pytest.mark.slow
@given(choice=damages)
@example(choice=Damage("manifest list", "compaction", 0, "truncate", 100, True, b"\0", 0))
@example(choice=Damage("operator state", "fork", 0, "flip", 60, False, b"\0", 0))
def test_a_damaged_file_on_s3_is_named_or_read_correctly_and_never_deletes_committed_data(fuzz_s3: str,
                                                                                          choice: Damage):
    """Properties 1 and 2 for one damaged object of the table on S3 (moto's server)."""
    in_child(check_damage, "s3", fuzz_s3, choice)


def test_a_process_that_dies_fails_the_example_and_the_next_one_runs():
    """The harness itself: a read that kills its process is a failure, not the end of the run."""
    with pytest.raises(AssertionError, match="the process died"):
        in_child(os.abort)
    in_child(os.getpid)


# Regression tests of the defects this fuzzing found, one per defect, on the table
# of the catalog tests (``commit_next``: two segments per checkpoint).


def two_checkpoints(open_table) -> IcebergStateTable:
    table = open_table()
    commit_next(table)
    commit_next(table)
    return table


def snapshots(table: IcebergStateTable) -> list:
    return sorted(table.iceberg_table.metadata.snapshots, key=lambda s: s.sequence_number)


def reopen(open_table) -> None:
    METADATA_FILES.clear()  # a fresh process
    open_table().close()


def test_a_manifest_list_replaced_by_another_is_named(open_table):
    """Checkpoint 2's manifest list replaced by checkpoint 1's read as checkpoint 1, silently:
    the snapshot id in a manifest list's header is now checked."""
    table = two_checkpoints(open_table)
    first, second = snapshots(table)
    path = second.manifest_list.removeprefix("file://")
    shutil.copyfile(first.manifest_list.removeprefix("file://"), path)
    with pytest.raises(CorruptMetadataError, match=rf"{os.path.basename(path)}.*was written for snapshot"):
        reopen(open_table)


def test_a_manifest_replaced_by_another_is_named(open_table):
    """A manifest replaced by another of the table listed other segments, silently: what the
    manifest list records of it (entry counts, the snapshot that added them) is now checked."""
    table = two_checkpoints(open_table)
    first, second = snapshots(table)
    io = table.iceberg_table.io
    older = {m.manifest_path for m in first.manifests(io)}
    (newer,) = [m.manifest_path for m in second.manifests(io) if m.manifest_path not in older]
    path = newer.removeprefix("file://")
    shutil.copyfile(next(iter(older)).removeprefix("file://"), path)
    with pytest.raises(CorruptMetadataError, match=rf"{os.path.basename(path)}.*another manifest was copied"):
        reopen(open_table)


def test_a_current_metadata_file_replaced_by_an_older_version_is_named(open_table):
    """The current metadata.json replaced by an older version opened the table at older
    checkpoints, silently: its metadata log must end at the version before its own."""
    table = two_checkpoints(open_table)
    current = table.iceberg_table.metadata_location.removeprefix("file://")
    previous = table.iceberg_table.metadata.metadata_log[-1].metadata_file.removeprefix("file://")
    shutil.copyfile(previous, current)
    with pytest.raises(CorruptMetadataError, match=rf"{os.path.basename(current)}.*holds another version"):
        reopen(open_table)


@pytest.mark.parametrize("which", ["metadata.json", "manifest list"])
def test_a_missing_metadata_file_is_named(open_table, which: str):
    """A deleted current metadata.json or manifest list raised a bare FileNotFoundError."""
    table = two_checkpoints(open_table)
    ice = table.iceberg_table
    uri = ice.metadata_location if which == "metadata.json" else snapshots(table)[-1].manifest_list
    os.remove(uri.removeprefix("file://"))
    with pytest.raises(CorruptMetadataError, match=os.path.basename(uri)):
        reopen(open_table)


def test_sql_names_a_damaged_manifest_list_and_a_missing_segment(open_table):
    """``catalog.sql.connect`` planned with pyiceberg (EOFError on a truncated manifest list)
    and built its entries view before checking the segments (FileNotFoundError)."""
    table = two_checkpoints(open_table)
    second = snapshots(table)[-1]
    segment = next(s.path for s in table.segments(KeyGroupRange.of(0, 15)) if s.checkpoint_id == 1)
    os.remove(segment)
    with pytest.raises(CorruptSegmentError, match=os.path.basename(segment)):
        connect(table)
    os.truncate(second.manifest_list.removeprefix("file://"), 10)
    METADATA_FILES.clear()
    with pytest.raises(CorruptMetadataError, match=os.path.basename(second.manifest_list)):
        connect(open_table())


def test_a_checkpoint_commits_beside_a_damaged_manifest_list_of_another_snapshot(open_table):
    """The orphan sweep after a commit read every retained snapshot's manifests and raised from
    ``commit_checkpoint`` after the checkpoint was committed; it now stops deleting, logs, and
    the commit returns (every file is kept)."""
    table = two_checkpoints(open_table)
    os.truncate(snapshots(table)[0].manifest_list.removeprefix("file://"), 10)
    METADATA_FILES.clear()
    writer = open_table()  # opens at checkpoint 2, whose manifests are intact
    before = table_files(writer)
    assert commit_next(writer) == 3
    assert before <= table_files(writer)


def test_a_segment_footer_whose_text_is_not_utf8_is_named(open_table):
    """A flipped byte in a column name of a segment's footer raised UnicodeDecodeError from the
    read; it is ``CorruptSegmentError`` naming the segment."""
    table = two_checkpoints(open_table)
    segment = next(s for s in table.segments(KeyGroupRange.of(0, 15)) if s.checkpoint_id == 2)
    with open(segment.path, "rb") as f:
        data = bytearray(f.read())
    at = data.rindex(b"key_group")  # a column name in the footer
    data[at] = 0x94
    with open(segment.path, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptSegmentError, match=os.path.basename(segment.path)):
        StateStore(open_table(), config=ELSEWHERE).scan("count")


def test_an_operator_state_file_replaced_by_another_tasks_is_named(open_table):
    """An operator state file replaced by another task's file of the same checkpoint was read
    silently: a restoring job got that task's lists twice and the other's never. The file now
    records the checkpoint and task it was written for (and its pages their checksums), and a
    read checks them and its size against the checkpoint's record."""
    table = open_table()
    tasks = [OperatorStateStore(table, OPERATOR, task_index=t, parallelism=2) for t in range(2)]
    for t, task in enumerate(tasks):
        task.get_list_state("offsets").update([t, t + 10])
    cp = table.next_checkpoint_id()
    table.commit_checkpoint(cp, [], parallelism=2, operator_state=[task.flush(cp) for task in tasks])
    first, second = sorted(table.operator_state_files(), key=lambda f: f.task_index)
    shutil.copyfile(second.path, first.path)
    with pytest.raises(CorruptSegmentError, match=rf"{os.path.basename(first.path)}.*another operator state file"):
        OperatorStateStore(table, OPERATOR, task_index=0, parallelism=1).get_list_state("offsets").get()
