"""Fuzzing of damaged files (issue 14): every damaged file is named or read correctly; never a
different state silently, never committed data deleted.

Strategy
    A real Iceberg state table (local warehouse) is built once: four checkpoints of a value
    state, a list state and a map state, with puts, appends, a cleared value, a cleared list
    and a removed map entry. The state of each checkpoint is remembered as the store reads it
    (batched and per key) and as ``catalog.sql.connect`` shows it (the ``state_<name>`` tables and
    the raw ``entries`` view); so are the files each checkpoint references. Every file is then
    made two hours old (so that the orphan sweep's grace period protects nothing), and the
    warehouse is kept as a pristine copy.

    Each example starts from a copy of the pristine warehouse and damages one file chosen by
    hypothesis among the metadata.json files (current and older), the manifest lists, the
    manifests and the segments, in one way: truncated at an offset, a byte flipped, bytes
    overwritten at an offset, emptied, deleted, or replaced by another file of the same kind
    of the same table. Then, as a fresh process (``METADATA_FILES`` cleared, no file cache), it
    opens the table and reads every checkpoint.

Properties
    1. Each read (opening the table, each checkpoint through the store and through SQL) gives
       exactly the remembered state, or raises one of the store's errors
       (``StateStoreError``) whose message names the damaged file. No other exception type.
    2. The next checkpoint's commit and a garbage collection with the orphan sweep (where the
       table opens) delete no undamaged file that a retained checkpoint references.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from catalog import IcebergStateTable
from catalog.fileio import METADATA_FILES, wait_for_deletes
from catalog.sql import connect
from statestore import ListStateDescriptor, MapStateDescriptor, StateStore, StoreConfig, ValueStateDescriptor
from statestore.errors import CorruptMetadataError, CorruptSegmentError, StateStoreError
from statestore.keygroups import KeyGroupRange
from statestore.layout import StateLayout
from tests.catalog.catalog_helpers import commit_next, snapshot_files, table_files
from tests.fuzzing import fuzz_settings

ELSEWHERE = StoreConfig(file_cache_mode="off")  # a reader on another host: nothing cached
LAYOUT = StateLayout.of(pa.schema([("user", pa.string())]), [
    ValueStateDescriptor("count", pa.int64()), ListStateDescriptor("events", pa.string()),
    MapStateDescriptor("seen", pa.int32(), key_type=pa.string())], 16)
USERS = ["a", "b", "c", "d"]
NOW_MS = 1_700_000_000_000
TABLE = "t"
KINDS = ("metadata.json", "manifest list", "manifest", "segment")
MODES = ("truncate", "flip", "overwrite", "empty", "delete", "replace")


def keys(names: list[str]) -> pa.Table:
    return pa.table({"user": pa.array(names, pa.string())})


def write_checkpoints(table: IcebergStateTable) -> None:
    """Four checkpoints: puts, appends and map puts; then a cleared value, a cleared list and a
    removed map entry; then more."""
    store = StateStore(table, config=ELSEWHERE)
    count, events, seen = store.get_state("count"), store.get_state("events"), store.get_state("seen")
    count.update_batch(keys(["a", "b"]), [1, 2])
    events.add_batch(keys(["a", "a", "b"]), ["x", "y", "z"])
    seen.put_batch(keys(["a", "b"]), ["u", "u"], [1, 2])
    store.checkpoint()
    count.update_batch(keys(["a", "c"]), [3, 4])
    events.add_batch(keys(["c"]), ["w"])
    seen.put_batch(keys(["a"]), ["v"], [5])
    store.checkpoint()
    count.clear_batch(keys(["b"]))
    events.clear_batch(keys(["a"]))
    seen.remove_batch(keys(["a"]), ["u"])
    store.checkpoint()
    store.set_current_key("d")
    count.update(9)
    events.add("q")
    seen.put("t", 7)
    store.checkpoint()


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


def read_sql(table: IcebergStateTable, checkpoint_id: int) -> dict:
    """The checkpoint as ``catalog.sql.connect`` shows it: the live state tables and the raw entries."""
    con = connect(table, checkpoint_id=checkpoint_id, now_ms=NOW_MS)
    shown = {name: sorted(map(repr, con.execute(f'SELECT * FROM "state_{name}"').fetchall()))
             for name in ("count", "events", "seen")}
    shown["entries"] = sorted(map(repr, con.execute("SELECT * FROM entries").fetchall()))
    return shown


@dataclass(frozen=True)
class Built:
    """The pristine table: where it is, its checkpoints' states and files, its files by kind."""

    root: str  # holds "pristine" (kept) and "wh" (the warehouse every example damages)
    states: dict  # checkpoint id -> (store state, SQL state)
    referenced: dict  # checkpoint id -> every file its snapshot references
    files: dict  # kind -> sorted relative paths

    @property
    def warehouse(self) -> str:
        return os.path.join(self.root, "wh")


def kind_of(relative: str) -> str | None:
    name = os.path.basename(relative)
    if name.endswith(".metadata.json"):
        return "metadata.json"
    if name.endswith(".avro"):
        return "manifest list" if name.startswith("snap-") else "manifest"
    if name.endswith(".parquet") and relative.startswith("data"):
        return "segment"
    return None


@functools.cache
def built() -> Built:
    """Build the pristine table once per test process."""
    root = os.path.realpath(tempfile.mkdtemp(prefix="icestate-fuzz-damage-"))
    warehouse = os.path.join(root, "wh")
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=TABLE) as table:
        write_checkpoints(table)
        wait_for_deletes()
    METADATA_FILES.clear()
    states, referenced = {}, {}
    with IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name=TABLE) as table:
        for info in table.list_checkpoints():
            table.restore(info.checkpoint_id)
            states[info.checkpoint_id] = (read_state(table), read_sql(table, info.checkpoint_id))
            referenced[info.checkpoint_id] = snapshot_files(table, table.snapshot) | {
                table.iceberg_table.metadata_location.removeprefix("file://")}
        location = table.location.removeprefix("file://")
    assert sorted(states) == [1, 2, 3, 4]
    old = time.time() - 2 * 3600
    files: dict[str, list[str]] = {k: [] for k in KINDS}
    for directory, _, names in os.walk(location):
        for n in names:
            path = os.path.join(directory, n)
            os.utime(path, (old, old))
            kind = kind_of(os.path.relpath(path, location))
            if kind is not None:
                files[kind].append(os.path.relpath(path, warehouse))
    shutil.copytree(warehouse, os.path.join(root, "pristine"))
    return Built(root, states, referenced, {k: sorted(v) for k, v in files.items()})


def fresh_copy(b: Built) -> None:
    shutil.rmtree(b.warehouse)
    shutil.copytree(os.path.join(b.root, "pristine"), b.warehouse)
    METADATA_FILES.clear()  # as a fresh process


@dataclass(frozen=True)
class Damage:
    """One damage, drawn before the table exists: which file of a kind (an index into them),
    how, where (an offset from the start or the end) and with what bytes."""

    kind: str
    index: int
    mode: str
    offset: int
    from_end: bool
    data: bytes
    other: int  # the replacement among the kind's other files

    def resolve(self, b: Built) -> tuple[str, int, str]:
        """(the file, the offset in it, its replacement) in the built table."""
        files = b.files[self.kind]
        target = files[self.index % len(files)]
        size = os.path.getsize(os.path.join(b.root, "pristine", target))
        offset = min(size - 1, self.offset) if not self.from_end else max(0, size - 1 - self.offset)
        others = [f for f in files if f != target] or [target]
        return target, offset, others[self.other % len(others)]


damages = st.builds(
    Damage, kind=st.sampled_from(KINDS), index=st.integers(0, 63), mode=st.sampled_from(MODES),
    offset=st.one_of(st.integers(0, 64), st.integers(0, 1 << 16)), from_end=st.booleans(),
    data=st.binary(min_size=1, max_size=8), other=st.integers(0, 63))


def damage(b: Built, target: str, mode: str, offset: int, data: bytes, other: str) -> None:
    path = os.path.join(b.warehouse, target)
    if mode == "delete":
        os.remove(path)
    elif mode == "empty":
        open(path, "wb").close()
    elif mode == "truncate":
        os.truncate(path, offset)
    elif mode == "replace":
        shutil.copyfile(os.path.join(b.warehouse, other), path)
    else:
        with open(path, "r+b") as f:
            f.seek(offset)
            old = f.read(len(data))
            new = bytes(x ^ 0xFF for x in old) if mode == "flip" else data
            f.seek(offset)
            f.write(new[: max(1, len(old))] if old else new)


def named(error: StateStoreError, target: str) -> None:
    assert os.path.basename(target) in str(error), f"the error does not name the damaged file {target}: {error!r}"


@fuzz_settings(40)
@given(choice=damages)
def test_a_damaged_file_is_named_or_read_correctly_and_never_deletes_committed_data(choice: Damage):
    """Properties 1 and 2 for one damaged file (see the module docstring)."""
    b = built()
    target, offset, other = choice.resolve(b)
    mode = choice.mode
    fresh_copy(b)
    damage(b, target, mode, offset, choice.data, other)
    try:
        table = IcebergStateTable.open(LAYOUT, warehouse=b.warehouse, table_name=TABLE)
    except StateStoreError as e:
        named(e, target)
        return
    try:
        retained = [info.checkpoint_id for info in table.list_checkpoints()]
        assert retained == sorted(b.states), f"checkpoints {retained} after damaging {target} ({mode})"
        for cp, (state, sql) in b.states.items():
            try:
                table.restore(cp)
                assert read_state(table) == state, f"checkpoint {cp} reads otherwise after damaging {target} ({mode})"
            except StateStoreError as e:
                named(e, target)
            try:
                assert read_sql(table, cp) == sql, f"SQL of checkpoint {cp} otherwise after damaging {target} ({mode})"
            except StateStoreError as e:
                named(e, target)
        # Retention and the orphan sweep: the next checkpoint, then a collection.
        try:
            table.restore()
            store = StateStore(table, config=ELSEWHERE)
            store.get_state("count").update_batch(keys(["e"]), [5])
            store.checkpoint()
            table.collect_garbage()
        except StateStoreError as e:
            named(e, target)
        wait_for_deletes()
    finally:
        table.close()
    damaged = os.path.join(b.warehouse, target)
    for cp, paths in b.referenced.items():
        lost = sorted(p for p in paths if p != damaged and not os.path.exists(p))
        assert not lost, f"after damaging {target} ({mode}), files of checkpoint {cp} were deleted: {lost}"


# Regression tests of the defects this fuzzing found (issue 14), one per defect, on the table
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
