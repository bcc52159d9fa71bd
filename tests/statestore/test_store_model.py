"""Model-based test of ``StateStore`` over a ``DirectoryStateTable``, against a plain dict.

Strategy
    A seeded hypothesis ``RuleBasedStateMachine`` drives one store through random
    sequences of operations on a small pool of keys (so that keys share key groups:
    ``max_parallelism`` is 8) and a fake clock. Every operation is applied to the store and
    to ``Model``, a few dicts of plain Python values. Each write comes in both forms, the
    per-key API (``set_current_key`` then ``update``/``add``/``put``...) and the batched Arrow
    API (``update_batch``/``add_batch``/``put_batch``... with duplicate keys in a batch).
    State variables: a value, a list, a map, a reducing sum (vectorized) and a reducing max
    (Python ``reduce_fn``), and four TTL variables: a value and a list with
    ON_CREATE_AND_WRITE, a value and a list with ON_READ_AND_WRITE. The clock rules move the
    fake ``StoreConfig.clock_ms`` forward by random amounts, exactly onto (or 1 ms before)
    the next expiry time of a variable, or read every key 1 ms before an expiry and then
    let time pass (so a read that failed to push the expiry shows). ``checkpoint`` commits
    one to four checkpoints and snapshots the model under each id; ``restore`` picks a
    retained checkpoint or any checkpoint ever committed; ``reopen`` drops the store and
    the table objects and opens new ones on the same directory (a crash and restart).
    Variants: string keys; two key columns (string, int32); a 1-byte cache so that every
    request evicts; views filled key by key (partial); partial views with lookups that do not
    hash their keys first; two stores taking turns. All but the 1-byte cache and the unhashed
    lookups keep every view indexed by key hash (``StoreConfig.view_index_rows_min`` 0, runs
    and dead rows as large views have them); those two keep plain frames. The runs are
    derandomized: the same sequences every time.

Invariants (checked after every step)
    1. For every key of the pool, the per-key API and the batched API return exactly the
       model's live state of every variable (absent -> None, [] or an empty map).
    2. Expired entries are never returned, also at the exact expiry time (a rule lands the
       clock on the next expiry); a read of an ON_READ_AND_WRITE variable pushes the expiry
       of what it read to now + ttl (the model does the same at the same time). Such a read
       is a write, so invariant 1 reads those two variables through one API per step,
       alternating: a refresh missing in one API is not hidden by the other's.
    3. Batched writes with a key given twice: the last value wins (value, map entry, whole
       list); appends and reductions apply in row order.
    4. ``checkpoint`` commits exactly the state at that moment; ``restore(n)`` gives the
       state of checkpoint n and drops uncommitted writes; ``reopen`` gives the state of
       the newest committed checkpoint.
    5. Retention (``retain_checkpoints=3``): ``list_checkpoints`` is the current line's
       newest three at most; restoring a checkpoint that retention removed raises
       ``CheckpointNotFoundError`` and changes nothing.

Checked against deliberate breakage (each made some run fail): a value tombstone not hiding
older puts; whole-list/map clears ignored; list elements merged in reverse order; the
first of two batched writes of a key winning; unapplied entries dropped at a checkpoint;
a restore keeping uncommitted writes; retention keeping one checkpoint too many; a read
not pushing the expiry of ON_READ_AND_WRITE state (per-key, batched value, batched list);
an entry still visible at its exact expiry time (in the batched value read). Duplicate
keys in ``ListState.update_batch`` (lists concatenated) were a real bug this test found.
The directed examples, and the bugs found with them, are in ``test_state_api.py``.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from statestore import (
    CheckpointNotFoundError,
    DirectoryStateTable,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateLayout,
    StateStore,
    StoreConfig,
    TtlConfig,
    TtlUpdateType,
    ValueStateDescriptor,
)

MAX_PARALLELISM = 8
RETAIN_CHECKPOINTS = 3
TTL_MS = 100
CLOCK_START_MS = 1_000_000
USER_KEYS = ("x", "y", "z")

STRING_KEYS = ("a", "b", "c", "d", "e", "f")
PAIR_KEYS = (("a", 0), ("a", 1), ("b", 0), ("b", 7), ("c", -1), ("d", 0))

CREATE_TTL = TtlConfig(TTL_MS, TtlUpdateType.ON_CREATE_AND_WRITE)
READ_TTL = TtlConfig(TTL_MS, TtlUpdateType.ON_READ_AND_WRITE)
DESCRIPTORS = (
    ValueStateDescriptor("v", pa.int64()),
    ListStateDescriptor("l", pa.int64()),
    MapStateDescriptor("m", pa.int64(), key_type=pa.string()),
    ReducingStateDescriptor("rsum", pa.int64(), reduce_fn=lambda a, b: a + b, vectorized="sum"),
    ReducingStateDescriptor("rmax", pa.int64(), reduce_fn=max),
    ValueStateDescriptor("tv", pa.int64(), ttl=CREATE_TTL),
    ValueStateDescriptor("rv", pa.int64(), ttl=READ_TTL),
    ListStateDescriptor("tl", pa.int64(), ttl=CREATE_TTL),
    ListStateDescriptor("rl", pa.int64(), ttl=READ_TTL),
)
TTL_VALUES = ("tv", "rv")
TTL_LISTS = ("tl", "rl")
READ_REFRESHED = frozenset({"rv", "rl"})

values = st.integers(-20, 20)
small_lists = st.lists(values, max_size=3)
user_keys = st.sampled_from(USER_KEYS)
VALUE_NAMES = ("v", *TTL_VALUES)
LIST_NAMES = ("l", *TTL_LISTS)
# Writes pick a TTL variable two times in three: expiry needs a write, then time passing.
value_names = st.sampled_from(("v", *TTL_VALUES, *TTL_VALUES))
list_names = st.sampled_from(("l", *TTL_LISTS, *TTL_LISTS))
REDUCE = {"rsum": lambda a, b: a + b, "rmax": max}
TTLS = {d.name: d.ttl for d in DESCRIPTORS}


@dataclass
class Model:
    """The store's live state as plain dicts.

    Value-like variables keep ``key -> (value, expire_at_ms or None)``, lists keep
    ``key -> [(element, expire_at_ms or None)]``, the map keeps ``key -> {user key: value}``.
    """

    values: dict[str, dict[Any, tuple[int, int | None]]] = field(
        default_factory=lambda: {n: {} for n in (*VALUE_NAMES, *REDUCE)})
    lists: dict[str, dict[Any, list[tuple[int, int | None]]]] = field(
        default_factory=lambda: {n: {} for n in LIST_NAMES})
    map: dict[Any, dict[str, int]] = field(default_factory=dict)

    @staticmethod
    def expiry(name: str, now: int) -> int | None:
        return None if TTLS[name] is None else now + TTL_MS

    def value(self, name: str, key: Any, now: int) -> int | None:
        """Live value; a read of an ON_READ_AND_WRITE variable pushes its expiry."""
        hit = self.values[name].get(key)
        if hit is not None and hit[1] is not None and hit[1] <= now:
            event(f"read an expired {name}")
            return None
        if hit is None:
            return None
        if name in READ_REFRESHED:
            if hit[1] == now + 1:
                event(f"read {name} 1 ms before it expired")
            self.values[name][key] = (hit[0], now + TTL_MS)
        return hit[0]

    def elements(self, name: str, key: Any, now: int) -> list[int]:
        stored = self.lists[name].get(key, [])
        live = [(v, e) for v, e in stored if e is None or e > now]
        if len(live) < len(stored):
            event(f"read {name} with expired elements" + (" and live ones" if live else ""))
        if live and name in READ_REFRESHED:
            if min(e for _, e in live) == now + 1:
                event(f"read {name} 1 ms before it expired")
            self.lists[name][key] = [(v, now + TTL_MS) for v, _ in live]
        return [v for v, _ in live]

    def next_expiry(self, name: str, now: int) -> int | None:
        """The earliest expiry time of variable ``name`` after ``now``, if any."""
        if name in self.values:
            times = [e for _, e in self.values[name].values()]
        else:
            times = [e for elements in self.lists[name].values() for _, e in elements]
        return min((e for e in times if e is not None and e > now), default=None)

    def put(self, name: str, key: Any, value: int, now: int) -> None:
        self.values[name][key] = (value, self.expiry(name, now))

    def reduce(self, name: str, key: Any, value: int) -> None:
        hit = self.values[name].get(key)
        self.values[name][key] = (value if hit is None else REDUCE[name](hit[0], value), None)

    def append(self, name: str, key: Any, value: int, now: int) -> None:
        self.lists[name].setdefault(key, []).append((value, self.expiry(name, now)))

    def replace(self, name: str, key: Any, elements: list[int], now: int) -> None:
        self.lists[name][key] = [(v, self.expiry(name, now)) for v in elements]

    def clear(self, name: str, key: Any) -> None:
        state = self.map if name == "m" else self.lists.get(name, self.values.get(name))
        state.pop(key, None)


class StoreMachine(RuleBasedStateMachine):
    """Subclasses choose the key pool and the store config."""

    KEYS: tuple = STRING_KEYS
    # StoreConfig settings of the variant: by default every view is indexed by key hash
    # (``views.KeyedView``, what large views are), so that its runs meet every operation.
    CONFIG: ClassVar[dict] = {"view_index_rows_min": 0}
    BATCHED_FIRST = False  # whether the invariant reads batched before per key

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="statestore-model-")
        self.now_ms = CLOCK_START_MS
        self.model = Model()
        self.snapshots: dict[int, Model] = {}
        self.parents: dict[int, int | None] = {}  # checkpoint files on disk -> parent
        self.current: int | None = None  # checkpoint the table is opened at
        self.head: int | None = None  # newest committed checkpoint (what a reopen sees)
        self.last_id = 0
        # A read of rv/rl is a write (it pushes expiry), so the invariant reads them through
        # one API per step, alternating: otherwise each API's refresh would hide a missing one
        # in the other, and with alternation every read decides what the next one sees.
        self.refreshed_reads_batched = False
        self.reads = 0  # invariant checks so far (a variant may read a different subset each time)
        self.open()

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ plumbing

    def open(self) -> None:
        layout = self.layout()
        self.table = DirectoryStateTable(self.dir, layout, retain_checkpoints=RETAIN_CHECKPOINTS)
        self.store = self.new_store(self.table)
        self.states = {d.name: self.store.get_state(d.name) for d in DESCRIPTORS}

    def new_store(self, table) -> StateStore:
        store = StateStore(table, config=StoreConfig(clock_ms=lambda: self.now_ms, **self.CONFIG))
        if self.CONFIG.get("view_index_rows_min") == 0:
            # The index only serves reads much smaller than the views and writes applied in
            # place; the pool's few keys are neither unless told: every read and write is.
            store.reader.restrict_ratio = store.reader.replace_ratio = store.reader.replace_ratio_indexed = 0
            store.reader.merge_ratio = 1  # and views in several runs, not merged at once
        return store

    @classmethod
    def layout(cls) -> StateLayout:
        return StateLayout.of(pa.schema([("k", pa.string())]), DESCRIPTORS, MAX_PARALLELISM)

    @classmethod
    def keys_table(cls, keys: list) -> pa.Table:
        return pa.table({"k": pa.array(keys, pa.string())})

    def select(self, key: Any) -> None:
        self.store.set_current_key(key)

    def draw_rows(self, data, *columns, max_size: int = 5) -> list[tuple]:
        """1..max_size rows of (key, *columns); keys repeat often (a pool of six)."""
        return data.draw(st.lists(st.tuples(st.sampled_from(self.KEYS), *columns), min_size=1, max_size=max_size))

    def write(self, batched: bool, rows: list[tuple], per_key, batch) -> None:
        """Apply rows through the batched API (one call) or the per-key API (row by row)."""
        if batched:
            batch(self.keys_table([r[0] for r in rows]), *[[r[i] for r in rows] for i in range(1, len(rows[0]))])
            return
        for key, *args in rows:
            self.select(key)
            per_key(*args)

    # ------------------------------------------------------------ writes

    @rule(data=st.data(), name=value_names, batched=st.booleans())
    def value_put(self, data, name, batched):
        rows = self.draw_rows(data, values)
        self.write(batched, rows, self.states[name].update, self.states[name].update_batch)
        for k, v in rows:  # a key given twice in one batch: the last value wins
            self.model.put(name, k, v, self.now_ms)

    @rule(data=st.data(), name=st.sampled_from([d.name for d in DESCRIPTORS]), batched=st.booleans())
    def clear(self, data, name, batched):
        rows = self.draw_rows(data, max_size=3)
        self.write(batched, rows, self.states[name].clear, self.states[name].clear_batch)
        for (k,) in rows:
            self.model.clear(name, k)

    @rule(data=st.data(), name=st.sampled_from(sorted(REDUCE)), batched=st.booleans())
    def reducing_add(self, data, name, batched):
        rows = self.draw_rows(data, values)
        self.write(batched, rows, self.states[name].add, self.states[name].add_batch)
        for k, v in rows:
            self.model.reduce(name, k, v)

    @rule(data=st.data(), name=list_names, batched=st.booleans())
    def list_append(self, data, name, batched):
        rows = self.draw_rows(data, values)
        self.write(batched, rows, self.states[name].add, self.states[name].add_batch)
        for k, v in rows:
            self.model.append(name, k, v, self.now_ms)

    @rule(data=st.data(), name=list_names, batched=st.booleans())
    def list_update(self, data, name, batched):
        rows = self.draw_rows(data, small_lists, max_size=4)
        self.write(batched, rows, self.states[name].update, self.states[name].update_batch)
        for k, v in rows:  # a key given twice in one batch: the last list wins
            self.model.replace(name, k, v, self.now_ms)

    @rule(data=st.data(), batched=st.booleans())
    def map_put(self, data, batched):
        rows = self.draw_rows(data, user_keys, values)
        self.write(batched, rows, self.states["m"].put, self.states["m"].put_batch)
        for k, u, v in rows:
            self.model.map.setdefault(k, {})[u] = v

    @rule(data=st.data(), batched=st.booleans())
    def map_remove(self, data, batched):
        rows = self.draw_rows(data, user_keys, max_size=4)
        self.write(batched, rows, self.states["m"].remove, self.states["m"].remove_batch)
        for k, u in rows:
            self.model.map.get(k, {}).pop(u, None)

    @rule(data=st.data(), batched=st.booleans())
    def map_clear_then_put(self, data, batched):
        """A whole-map tombstone followed by a put: only the new entry survives."""
        rows = self.draw_rows(data, user_keys, values, max_size=1)
        self.write(batched, [r[:1] for r in rows], self.states["m"].clear, self.states["m"].clear_batch)
        self.write(batched, rows, self.states["m"].put, self.states["m"].put_batch)
        for k, u, v in rows:
            self.model.map[k] = {u: v}

    # ------------------------------------------------------------ time

    @rule(data=st.data())
    def prefetch(self, data):
        """A batched read of some keys' state before a per-key loop: until the next prefetch,
        per-key reads of those keys go through an index over their rows alone, across writes,
        checkpoints, restores and worker switches (each must rebuild or drop it)."""
        keys = data.draw(st.lists(st.sampled_from(self.KEYS), min_size=1, max_size=3))
        self.store.prefetch(self.keys_table(keys))

    @rule(ms=st.one_of(st.integers(1, TTL_MS // 2), st.integers(TTL_MS // 2, 2 * TTL_MS)))
    def advance_clock(self, ms):
        self.now_ms += ms

    @rule(name=st.sampled_from((*TTL_VALUES, *TTL_LISTS)), before=st.booleans())
    def advance_clock_to_expiry(self, name, before):
        """Land exactly on the next expiry time of ``name`` (an entry is dead at its
        ``expire_at_ms``), or 1 ms before it, where a read of an ON_READ_AND_WRITE variable
        saves the entry."""
        expiry = self.model.next_expiry(name, self.now_ms)
        if expiry is None:  # nothing of ``name`` is live: the earliest expiry of any variable
            expiries = [self.model.next_expiry(n, self.now_ms) for n in (*TTL_VALUES, *TTL_LISTS)]
            expiry = min((e for e in expiries if e is not None), default=None)
        if expiry is not None:
            event("clock moved " + ("1 ms before" if before else "exactly to") + " an expiry time")
            self.now_ms = max(self.now_ms, expiry - before)

    @rule(name=st.sampled_from(sorted(READ_REFRESHED)), batched=st.booleans(), ms=st.integers(1, TTL_MS - 1))
    def read_just_before_expiry(self, name, batched, ms):
        """Read every key 1 ms before the next expiry of ``name``, then let ``ms`` pass: what
        was read must still be live (the read pushed its expiry to now + ttl)."""
        expiry = self.model.next_expiry(name, self.now_ms)
        if expiry is None:
            return
        self.now_ms = expiry - 1
        read = self.model.value if name in VALUE_NAMES else self.model.elements
        want = [read(name, k, self.now_ms) for k in self.KEYS]
        if batched:
            got = self.states[name].get_batch(self.keys_table(list(self.KEYS))).to_pylist()
        else:
            got = []
            for k in self.KEYS:
                self.select(k)
                got.append(self.states[name].get())
        assert got == want, f"{name} read at {self.now_ms}"
        self.now_ms += ms

    @rule(data=st.data(), name=st.sampled_from(sorted(READ_REFRESHED)))
    def read_refreshed_batch(self, data, name):
        """A batched read of some keys (repeats allowed) of a read-refreshed variable."""
        keys = [k for (k,) in self.draw_rows(data)]
        got = self.states[name].get_batch(self.keys_table(keys)).to_pylist()
        read = self.model.value if name in VALUE_NAMES else self.model.elements
        assert got == [read(name, k, self.now_ms) for k in keys], f"{name}.get_batch({keys}) at {self.now_ms}"

    # ------------------------------------------------------------ checkpoints

    @rule(data=st.data())
    def checkpoint(self, data):
        """One to four checkpoints in a row, each after adding 1 to ``rsum`` of a key, so that
        neighbouring checkpoints differ and retention has something to expire."""
        for (k,) in self.draw_rows(data, max_size=4):
            self.select(k)
            self.states["rsum"].add(1)
            self.model.reduce("rsum", k, 1)
            info = self.store.checkpoint()
            assert info.checkpoint_id == self.last_id + 1, "checkpoint ids grow by one from 1"
            self.last_id = cp = info.checkpoint_id
            self.snapshots[cp] = copy.deepcopy(self.model)
            self.parents[cp] = self.current
            self.current = self.head = cp
            keep = self.line()[-RETAIN_CHECKPOINTS:]  # the rest of the line and every other branch go
            self.parents = {c: p for c, p in self.parents.items() if c in keep}

    @precondition(lambda self: self.last_id > 0)
    @rule(data=st.data())
    def restore(self, data):
        """Restore a retained checkpoint, or try one that retention removed (an error)."""
        retained = sorted(self.parents)
        cp = data.draw(st.one_of(st.sampled_from(retained), st.integers(1, self.last_id)) if retained
                       else st.integers(1, self.last_id))
        event("restore " + ("a retained checkpoint" if cp in self.parents else "a removed checkpoint"))
        if cp not in self.parents:
            before = self.checkpoint_ids()
            with pytest.raises(CheckpointNotFoundError, match=f"checkpoint {cp} is not retained"):
                self.store.restore(cp)
            assert self.checkpoint_ids() == before  # and the model (uncommitted writes too) is unchanged
            return
        info = self.store.restore(cp)
        assert info.checkpoint_id == cp
        self.current = cp
        self.model = copy.deepcopy(self.snapshots[cp])

    @rule()
    def reopen(self):
        """Crash and restart: new table and store objects on the same directory see the newest
        committed checkpoint (HEAD); uncommitted writes, and a restore not followed by a
        commit, are gone."""
        event("reopen " + ("after a restore" if self.current != self.head else "at head"))
        self.open()
        self.current = self.head
        self.model = Model() if self.head is None else copy.deepcopy(self.snapshots[self.head])

    def line(self, start: int | None = None) -> list[int]:
        """Checkpoints on disk from ``start`` (the current one by default) back through its
        parents, oldest first."""
        line, cur = [], self.current if start is None else start
        while cur is not None and cur in self.parents:
            line.append(cur)
            cur = self.parents[cur]
        return line[::-1]

    def checkpoint_ids(self) -> list[int]:
        return [c.checkpoint_id for c in self.table.list_checkpoints()]

    # ------------------------------------------------------------ invariants

    @invariant()
    def retention(self):
        ids = self.checkpoint_ids()
        assert len(ids) <= RETAIN_CHECKPOINTS
        # Listed (and restorable) are the checkpoints of the newest commit's line: a restore
        # abandons newer checkpoints only when the next commit builds on the restored one.
        assert ids == self.line(self.head)
        current = self.table.current_checkpoint()
        assert (None if current is None else current.checkpoint_id) == self.current

    @invariant()
    def reads_match_model(self):
        per_key, batched = self.keys_read()
        if self.BATCHED_FIRST:
            self.check_batched_reads(batched)
        self.check_per_key_reads(per_key)
        if not self.BATCHED_FIRST:
            self.check_batched_reads(batched)
        self.refreshed_reads_batched = not self.refreshed_reads_batched
        self.reads += 1

    def keys_read(self) -> tuple[list, list]:
        """The keys the invariant reads per key and batched: every key, both ways."""
        return list(self.KEYS), list(self.KEYS)

    def check_per_key_reads(self, keys: list):
        now, s, m = self.now_ms, self.states, self.model
        skip = READ_REFRESHED if self.refreshed_reads_batched else frozenset()
        for k in keys:
            self.select(k)
            for name in {*VALUE_NAMES, *REDUCE} - skip:
                assert s[name].get() == m.value(name, k, now), f"{name}[{k}] at {now}"
            for name in set(LIST_NAMES) - skip:
                assert s[name].get() == m.elements(name, k, now), f"{name}[{k}] at {now}"
            assert dict(s["m"].items()) == m.map.get(k, {}), f"m[{k}]"
            assert s["m"].get("x") == m.map.get(k, {}).get("x"), f"m[{k}]['x']"

    def check_batched_reads(self, asked: list):
        now, s, m = self.now_ms, self.states, self.model
        keys = [*asked[::-1], asked[0]]  # reversed, with a repeat: results follow the request
        table = self.keys_table(keys)
        skip = frozenset() if self.refreshed_reads_batched else READ_REFRESHED
        for name in {*VALUE_NAMES, *REDUCE} - skip:
            assert s[name].get_batch(table).to_pylist() == [m.value(name, k, now) for k in keys], name
        for name in set(LIST_NAMES) - skip:
            assert s[name].get_batch(table).to_pylist() == [m.elements(name, k, now) for k in keys], name
        got_maps: list[dict] = [{} for _ in keys]
        for row in s["m"].items_batch(table).to_pylist():
            got_maps[row["_row"]][row["mk_m"]] = row["v_m"]
        assert got_maps == [m.map.get(k, {}) for k in keys]
        pairs = [(k, u) for k in asked for u in USER_KEYS]
        got = s["m"].get_batch(self.keys_table([k for k, _ in pairs]), [u for _, u in pairs]).to_pylist()
        assert got == [m.map.get(k, {}).get(u) for k, u in pairs]


class PairKeyMachine(StoreMachine):
    """Two key columns (string, int32): the hash chains over both."""

    KEYS = PAIR_KEYS

    @classmethod
    def layout(cls) -> StateLayout:
        schema = pa.schema([("name", pa.string()), ("n", pa.int32())])
        return StateLayout.of(schema, DESCRIPTORS, MAX_PARALLELISM)

    @classmethod
    def keys_table(cls, keys: list) -> pa.Table:
        return pa.table({"name": pa.array([k[0] for k in keys], pa.string()),
                         "n": pa.array([k[1] for k in keys], pa.int32())})


class SmallCacheMachine(StoreMachine):
    """A 1-byte cache: every request evicts every key group it did not pin."""

    CONFIG: ClassVar[dict] = {"cache_size_bytes_max": 1}  # and views as plain frames (the default for small)


class PartialViewsMachine(StoreMachine):
    """Views filled key by key: every key group is read partially (never loaded whole for its
    size or the share asked), and each check reads a different part of the keys, so that
    partial views meet writes of keys they lack, checkpoints, restores and reopens. The
    batched read comes first; the per-key reads then take the keys it filled and, every
    third check, one it did not (a per-key read of a key that a partial view lacks loads its
    key group whole)."""

    KEYS = ("a", "f", "g", "d", "h", "l")  # key groups 4, 4, 4, 6, 6, 6: a partial group lacks some
    CONFIG: ClassVar[dict] = {"view_partial_rows_min": 0, "view_partial_share_max": 1e9,
                              "view_partial_reads_max": 1000, "view_index_rows_min": 0}
    BATCHED_FIRST = True

    def keys_read(self) -> tuple[list, list]:
        n, i = len(self.KEYS), self.reads
        batched = [self.KEYS[i % n], self.KEYS[(i + 2) % n]]
        per_key = batched + ([self.KEYS[(i + 3) % n]] if i % 3 == 0 else [])
        return per_key, batched


class UnhashedLookupsMachine(PartialViewsMachine):
    """The partial views' variant whose batched lookups never hash their keys first: they
    join every cached view and hash only the keys they miss (what a lookup of many keys
    does), so keys absent, expired, in groups not cached or not covered yet go through the
    miss path. Its views stay plain frames (a lookup hashes its keys first when a view is
    indexed)."""

    CONFIG: ClassVar[dict] = {**PartialViewsMachine.CONFIG, "view_index_rows_min": 1 << 30}

    def open(self) -> None:
        super().open()
        self.store.reader.keys_per_group_unhashed = 0


class TwoWorkersMachine(StoreMachine):
    """Two stores over one table taking turns, as two Spark workers that run one task in turn
    (Spark gives a task to any idle worker; each keeps its store between batches).
    ``switch_worker`` commits what the working store holds (a task ends with its flush
    committed), then the other worker's store takes over at the newest checkpoint: it
    catches up from the checkpoint it last held exactly (``StateStore.catch_up``: only the
    entries written since are read), or restores when that checkpoint is not on the newest
    line (a restore to an older checkpoint went back past it). Every invariant then reads
    through the store that took over: caught-up views must equal the model exactly, for
    every kind of state, with tombstones, list replacements, map removals and TTL."""

    CONFIG: ClassVar[dict] = {"view_partial_rows_min": 0, "view_partial_share_max": 1e9,
                              "view_partial_reads_max": 2}
    idle: tuple | None = None  # (table, store, checkpoint it holds exactly) of the other worker

    @rule(data=st.data())
    def switch_worker(self, data):
        self.checkpoint(data)
        layout = self.layout()
        if self.idle is None:
            table = DirectoryStateTable(self.dir, layout, retain_checkpoints=RETAIN_CHECKPOINTS)
            store = self.new_store(table)
            event("switch to a worker without a store")
        else:
            table, store, at = self.idle
            table.restore(self.head)  # the driver ships the newest checkpoint
            if at in self.line(self.head):
                assert store.catch_up(), "no compaction here: a store on the line always catches up"
                event("switch: caught up")
            else:
                store.restore(self.head)
                event("switch: restored (its checkpoint is off the newest line)")
        self.idle = (self.table, self.store, self.head)
        self.table, self.store = table, store
        self.states = {d.name: store.get_state(d.name) for d in DESCRIPTORS}


class HostWorkersMachine(StoreMachine):
    """Three stores over one table taking turns, as three Spark Python workers of one host
    sharing its views (``StoreConfig.host_views``): every whole load at an exact checkpoint is
    written to the host's snapshots, and a store opened or restored maps the newest snapshot
    each key group descends from, then catches up with the entries committed since. On a switch
    the next worker either keeps its own store (catching up, or restoring when its checkpoint is
    off the newest line: a restore maps too) or starts a new one (mapping). Restores to older
    checkpoints, reopens and TTL meet snapshots of other checkpoints and resolution times: every
    invariant reads through the store that took over."""

    CONFIG: ClassVar[dict] = {"view_index_rows_min": 0, "view_partial_reads_max": 0, "host_views": True}
    WORKERS = 3

    def __init__(self) -> None:
        self.workers: dict[int, tuple] = {}  # worker -> (table, store, checkpoint it holds exactly)
        self.worker = 0
        super().__init__()

    def new_store(self, table) -> StateStore:
        store = StateStore(table, config=StoreConfig(clock_ms=lambda: self.now_ms, host_views_dir=f"{self.dir}.views",
                                                     **self.CONFIG))
        store.reader.restrict_ratio = store.reader.replace_ratio = store.reader.replace_ratio_indexed = 0
        store.reader.merge_ratio = 1
        event(f"store opened with {store.stats()['host_views_mapped'] > 0} mapped views")
        return store

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(f"{self.dir}.views", ignore_errors=True)

    @rule(data=st.data())
    def switch_worker(self, data):
        self.checkpoint(data)
        self.workers[self.worker] = (self.table, self.store, self.head)
        self.worker = data.draw(st.sampled_from([w for w in range(self.WORKERS) if w != self.worker]))
        kept = self.workers.get(self.worker)
        if kept is None or data.draw(st.booleans()):
            table = DirectoryStateTable(self.dir, self.layout(), retain_checkpoints=RETAIN_CHECKPOINTS)
            store = self.new_store(table)
        else:
            table, store, at = kept
            table.restore(self.head)
            if at in self.line(self.head) and store.catch_up():
                event("switch: caught up")
            else:
                store.restore(self.head)
                event(f"switch: restored, mapped {store.stats()['host_views_mapped'] > 0}")
        self.table, self.store = table, store
        self.states = {d.name: store.get_state(d.name) for d in DESCRIPTORS}


MODEL_SETTINGS = settings(
    max_examples=8, stateful_step_count=50, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

TestStringKeys = StoreMachine.TestCase
TestStringKeys.settings = MODEL_SETTINGS
TestPairKeys = PairKeyMachine.TestCase
TestPairKeys.settings = settings(MODEL_SETTINGS, max_examples=6)
TestSmallCache = SmallCacheMachine.TestCase
# Every read of another key group reloads it from all its segments, and segments pile up
# with checkpoints (no compaction here): the slowest variant, so shorter sequences.
TestSmallCache.settings = settings(MODEL_SETTINGS, max_examples=5, stateful_step_count=30)
TestPartialViews = PartialViewsMachine.TestCase
TestPartialViews.settings = settings(MODEL_SETTINGS, max_examples=6)
TestUnhashedLookups = UnhashedLookupsMachine.TestCase
TestUnhashedLookups.settings = settings(MODEL_SETTINGS, max_examples=6)
TestTwoWorkers = TwoWorkersMachine.TestCase
TestTwoWorkers.settings = settings(MODEL_SETTINGS, max_examples=8)
TestHostWorkers = HostWorkersMachine.TestCase
TestHostWorkers.settings = settings(MODEL_SETTINGS, max_examples=5)



def test_partial_views_variant_reads_partially(tmp_path):
    """The partial-views variant above only means something if its config really fills views
    key by key: a batched read of one key reads that key's row groups only."""
    layout = StoreMachine.layout()
    table = DirectoryStateTable(tmp_path, layout)
    writer = StateStore(table)
    writer.get_state("v").update_batch(StoreMachine.keys_table(list(STRING_KEYS)), list(range(len(STRING_KEYS))))
    writer.checkpoint()
    store = StateStore(table, config=StoreConfig(**PartialViewsMachine.CONFIG))
    assert store.get_state("v").get_batch(StoreMachine.keys_table([STRING_KEYS[0]])).to_pylist() == [0]
    stats = store.stats()
    assert stats["cache_partial_reads"] == 1 and stats["cache_misses"] == 0


def test_small_cache_variant_evicts(tmp_path):
    """The small-cache variant above only means something if that config really evicts."""
    layout = StoreMachine.layout()
    store = StateStore(DirectoryStateTable(tmp_path, layout), config=StoreConfig(cache_size_bytes_max=1))
    value = store.get_state("v")
    keys = StoreMachine.keys_table(list(STRING_KEYS))
    value.update_batch(keys, list(range(len(STRING_KEYS))))
    store.checkpoint()
    for i, k in enumerate(STRING_KEYS):
        store.set_current_key(k)
        assert value.get() == i
    assert store.stats()["cache_evictions"] > 0
    assert store.stats()["cache_key_groups"] == 1


def test_retention_keeps_the_newest_three_and_forgets_older_ones(tmp_path):
    """The retention rules of the machine above, spelled out once."""
    layout = StoreMachine.layout()
    table = DirectoryStateTable(tmp_path, layout, retain_checkpoints=RETAIN_CHECKPOINTS)
    store = StateStore(table)
    total = store.get_state("rsum")
    keys = StoreMachine.keys_table(["a"])
    for _ in range(5):
        total.add_batch(keys, [1])
        store.checkpoint()
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [3, 4, 5]
    for gone in (1, 2):
        with pytest.raises(CheckpointNotFoundError, match=rf"checkpoint {gone} is not retained .* \[3, 4, 5\]"):
            store.restore(gone)
    assert total.get_batch(keys).to_pylist() == [5]  # a failed restore changes nothing
    store.restore(3)
    assert total.get_batch(keys).to_pylist() == [3]
    # 4 and 5 stay listed and restorable until a commit builds on 3 (as in Iceberg)
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [3, 4, 5]
    store.restore(5)
    total.add_batch(keys, [10])
    store.restore(3)
    total.add_batch(keys, [100])
    assert store.checkpoint().checkpoint_id == 6
    assert [c.checkpoint_id for c in table.list_checkpoints()] == [3, 6]
    for gone in (4, 5):  # the abandoned branch went with the commit
        with pytest.raises(CheckpointNotFoundError):
            store.restore(gone)
    reopened = StateStore(DirectoryStateTable(tmp_path, layout, retain_checkpoints=RETAIN_CHECKPOINTS))
    assert reopened.get_state("rsum").get_batch(keys).to_pylist() == [103]


class IcebergMachine(StoreMachine):
    """The same machine over the production table: an ``IcebergStateTable`` on a SQLite
    ``SqlCatalog`` in a local warehouse, so every checkpoint is an Iceberg snapshot,
    restore opens an older snapshot and retention expires snapshots and deletes files."""

    def open(self) -> None:
        from catalog import IcebergStateTable

        old = getattr(self, "table", None)
        if old is not None:
            old.close()
        layout = self.layout()
        self.table = IcebergStateTable.open(layout, warehouse=self.dir, table_name="model",
                                            retain_checkpoints=RETAIN_CHECKPOINTS)
        self.store = StateStore(self.table, config=StoreConfig(clock_ms=lambda: self.now_ms))
        self.states = {d.name: self.store.get_state(d.name) for d in DESCRIPTORS}

    def teardown(self) -> None:
        self.table.close()
        super().teardown()


TestIceberg = IcebergMachine.TestCase
TestIceberg.settings = settings(MODEL_SETTINGS, max_examples=5, stateful_step_count=40)
# Each over 7 s on the reference machine: left out of the fast tier (scripts/test.sh --fast).
for _case in (TestStringKeys, TestPairKeys, TestPartialViews, TestUnhashedLookups, TestTwoWorkers, TestIceberg):
    _case.pytestmark = [pytest.mark.slow]
del _case  # a module-level name bound to a TestCase is collected again: TestIceberg ran twice
