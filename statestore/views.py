"""``KeyedView``: a cached view of one key group and variable, indexed by key hash when large.

A view (``resolve.py``) is a frame of live rows. A micro-batch changes a few of its keys and
reads a few: done with joins over the frame, each batch costs the whole view (a hash probe of
every row), so on a state much larger than a batch the state's size, not the batch's, sets the
batch's cost (5M keys a task, 50k-key batches: 290 ms a batch against 100 ms at 250k keys).

A large view (``index_rows_min`` rows and more, when it first takes new entries in place: it
stayed cached for another batch) is therefore kept as a
short list of *runs*, like an LSM tree in memory: each run a frame that never changes, with the
64-bit hashes of its rows' keys sorted (``hashes``, and ``order``: the row of each) and a mask
of the rows still in the view (``alive``). Then

* the rows of some keys are found by binary search of their hashes in each run
  (``candidates``: O(keys x log rows), a superset when hashes collide: callers join exactly);
* new entries (``replace``) mark the rows of the keys they change dead in place and become a
  new run; runs merge when the older is at most ``MERGE_RATIO`` times the newer's live rows
  (so a view has O(log(rows / batch)) runs, and a row is merged O(log) times), and a run with
  more dead rows than live is compacted; rows expired when a batch comes are marked dead then,
  as the frame's refresh dropped them;
* the frame itself (``frame()``: every run's live rows in order, the order the joins kept) is
  made only when a reader wants every row (whole views, the per-key index of a key group),
  and kept until the view next changes.

Small views stay one plain frame changed by joins (cheaper there than any index). The hashes
are polars' row hashes with a fixed seed (in memory only, never stored), of the key columns in
the view's own dtypes (keys are cast to them first).

Not thread safe; owned by one ``StateReader``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from statestore.host_views import RunPart
from statestore.layout import EXPIRE_AT_MS
from statestore.resolve import ORD, live_rows

# A plain view refreshed in place gains a chunk per refresh; past this many it is made one again.
_CHUNKS_MAX = 16
# Runs merge while the older holds at most this many times the newer's live rows (8: about
# 3 runs for a view 100x a batch; 2 kept 7 runs there and cost as much a batch).
MERGE_RATIO = 8
# Seed of the key hashes (any fixed value: the hashes live only in this process's memory).
_SEED = 0x1CE5
_POS = "__pos"
_NO_ROWS = np.zeros(0, dtype=np.int64)


def key_hashes(keys: pl.DataFrame) -> np.ndarray:
    """The 64-bit hash of each row of ``keys`` (key columns only, in the view's dtypes)."""
    return keys.hash_rows(seed=_SEED).to_numpy()


def distinct_sorted(hashes: np.ndarray) -> np.ndarray:
    """``hashes`` sorted, each once (``np.unique`` hashes first: several times slower here)."""
    h = np.sort(hashes)
    if h.size < 2:
        return h
    keep = np.empty(h.size, dtype=bool)
    keep[0] = True
    np.not_equal(h[1:], h[:-1], out=keep[1:])
    return h[keep]


def _min_expiry(frame: pl.DataFrame, alive: np.ndarray | None) -> int | None:
    """The earliest expiry among ``frame``'s live rows, None when none expires."""
    col = frame.get_column(EXPIRE_AT_MS)
    if col.null_count() == col.len():
        return None
    if alive is not None:
        col = col.filter(pl.Series(alive))
    low = col.min()
    return None if low is None else int(low)


class _Run:
    """Rows that never change, their key hashes sorted, and which rows are still live."""

    __slots__ = ("alive", "dead", "frame", "frame_bytes", "hashes", "min_expiry", "order", "source", "top_ord")

    def __init__(self, frame: pl.DataFrame, key_names: Sequence[str], hashes: np.ndarray | None = None,
                 order: np.ndarray | None = None, unsorted: np.ndarray | None = None):
        """``hashes`` and ``order`` when known, else from ``unsorted`` (each row's key hash) or
        hashed here."""
        self.frame = frame
        self.frame_bytes = int(frame.estimated_size())
        if hashes is None:
            if unsorted is None:
                unsorted = key_hashes(frame.select(key_names))
            order = np.argsort(unsorted)
            hashes = unsorted[order]
        self.hashes = hashes  # sorted
        self.order = order  # hashes[i] is the hash of row order[i]
        self.alive: np.ndarray | None = None  # None: every row
        self.dead = 0
        self.min_expiry = _min_expiry(frame, None)
        self.top_ord: int | None = None  # a list's greatest ord, dead rows included (made when asked)
        self.source = None  # the host's snapshot run it is mapped from (``RunPart.source``)

    @property
    def live(self) -> int:
        return self.frame.height - self.dead

    def nbytes(self) -> int:
        return self.frame_bytes + self.hashes.nbytes + self.order.nbytes + (
            0 if self.alive is None else self.alive.nbytes)

    def rows(self, needles: np.ndarray) -> np.ndarray:
        """The live rows whose key hash is one of ``needles`` (sorted, distinct)."""
        hashes, n = self.hashes, self.hashes.size
        lo = np.searchsorted(hashes, needles, side="left")
        inside = lo < n
        idx = lo[inside]
        idx = idx[hashes[idx] == needles[inside]]
        if not idx.size:
            return _NO_ROWS
        following = np.minimum(idx + 1, n - 1)
        shared = idx[(idx + 1 < n) & (hashes[following] == hashes[idx])]
        if shared.size:  # hashes of several rows (a map's entries of one key, or a collision)
            counts = np.searchsorted(hashes, hashes[shared], side="right") - shared - 1
            starts = np.repeat(shared + 1 - (np.cumsum(counts) - counts), counts)
            idx = np.concatenate([idx, starts + np.arange(int(counts.sum()))])
        rows = self.order[idx]
        return rows if self.alive is None else rows[self.alive[rows]]

    def kill(self, rows: np.ndarray) -> None:
        """Mark ``rows`` (live, distinct) dead."""
        if not rows.size:
            return
        if self.alive is None:
            self.alive = np.ones(self.frame.height, dtype=bool)
        self.alive[rows] = False
        self.dead += int(rows.size)

    def expire(self, now_ms: int) -> None:
        """Mark the rows expired at ``now_ms`` dead."""
        if self.min_expiry is None or self.min_expiry > now_ms:
            return
        exp = self.frame.get_column(EXPIRE_AT_MS)
        expired = (exp.is_not_null() & (exp <= now_ms)).to_numpy()
        if self.alive is not None:
            expired &= self.alive
        self.kill(np.flatnonzero(expired))
        self.min_expiry = _min_expiry(self.frame, self.alive)

    def live_frame(self) -> pl.DataFrame:
        return self.frame if self.alive is None else self.frame.filter(pl.Series(self.alive))

    @classmethod
    def of_part(cls, part: RunPart, key_names: Sequence[str]) -> _Run:
        """A run of ``part`` (an indexed one: its hashes and order kept as they are, mapped or not)."""
        run = cls(part.frame, key_names, part.hashes, part.order)
        run.source = part.source
        if part.alive is not None:
            run.alive = part.alive
            run.dead = int(part.alive.size - np.count_nonzero(part.alive))
            run.min_expiry = _min_expiry(part.frame, part.alive)
        return run

    def live_index(self) -> tuple[np.ndarray, np.ndarray]:
        """The sorted hashes and their rows, of the live rows only, rows numbered as in ``live_frame``."""
        if self.alive is None:
            return self.hashes, self.order
        keep = self.alive[self.order]
        renumbered = np.cumsum(self.alive) - 1
        return self.hashes[keep], renumbered[self.order[keep]]


def _merged(runs: Sequence[_Run], key_names: Sequence[str]) -> _Run:
    """One run of the live rows of ``runs``, in their order."""
    frames, hashes, orders, offset = [], [], [], 0
    for run in runs:
        h, o = run.live_index()
        frames.append(run.live_frame())
        hashes.append(h)
        orders.append(o + offset)
        offset += run.live
    h = np.concatenate(hashes)
    perm = np.argsort(h, kind="stable")  # merges the sorted runs (timsort): linear here
    frame = pl.concat(frames, how="vertical", rechunk=True) if len(frames) > 1 else frames[0].rechunk()
    return _Run(frame, key_names, h[perm], np.concatenate(orders)[perm])


class KeyedView:
    """The view of one key group and variable (see the module docstring)."""

    __slots__ = ("_frame", "_plain", "_plain_source", "_runs", "index_rows_min", "key_names", "merge_ratio")

    def __init__(self, frame: pl.DataFrame, key_names: Sequence[str], index_rows_min: int,
                 merge_ratio: float = MERGE_RATIO):
        self.key_names = list(key_names)
        self.index_rows_min = index_rows_min
        self.merge_ratio = merge_ratio  # see MERGE_RATIO
        self._plain: pl.DataFrame | None = frame  # the view as one frame, while not indexed
        self._plain_source = None  # the host's snapshot run ``_plain`` is mapped from, while unchanged
        self._runs: list[_Run] = []
        self._frame: pl.DataFrame | None = frame  # the materialized frame, while current

    @classmethod
    def of_parts(cls, parts: Sequence[RunPart], key_names: Sequence[str], index_rows_min: int,
                 merge_ratio: float = MERGE_RATIO) -> KeyedView:
        """The view kept as ``parts`` (``parts()`` of a view: one plain frame, or indexed runs)."""
        if len(parts) == 1 and parts[0].hashes is None:
            view = cls(parts[0].frame, key_names, index_rows_min, merge_ratio)
            view._plain_source = parts[0].source
            return view
        view = cls(parts[0].frame.clear(), key_names, index_rows_min, merge_ratio)
        view._plain = view._frame = None
        view._runs = [_Run.of_part(p, view.key_names) for p in parts]
        return view

    def parts(self, index: bool = True) -> list[RunPart]:
        """The view as it is kept: one plain frame, or its runs (indexed first when ``index``
        and large enough, as its first change would)."""
        if index:
            self._index()
        if self._plain is not None:
            return [RunPart(self._plain, source=self._plain_source)]
        return [RunPart(r.frame, r.hashes, r.order, r.alive, r.source) for r in self._runs]

    def shared_as(self, snapshot: str, files: Sequence, mapped: dict[int, RunPart]) -> None:
        """The view was written to the host's ``snapshot`` as ``files`` (one per part of
        ``parts()``, in order): its parts take that snapshot as their source, and those in
        ``mapped`` (index -> the part mapped from there: the same rows) their mapped frames and
        arrays instead of this process's."""
        if self._plain is not None:
            if 0 in mapped:
                self._plain = self._frame = mapped[0].frame
            self._plain_source = (snapshot, files[0])
            return
        for i, run in enumerate(self._runs):
            if i in mapped:
                run.frame, run.hashes, run.order = mapped[i].frame, mapped[i].hashes, mapped[i].order
                run.frame_bytes = int(run.frame.estimated_size())
            run.source = (snapshot, files[i])
        self._frame = None

    def private_bytes(self) -> int:
        """The bytes of the view that are this process's own (not mapped from the host's views)."""
        if self._plain is not None:
            return 0 if self._plain_source is not None else int(self._plain.estimated_size())
        return sum(r.nbytes() for r in self._runs if r.source is None)

    @property
    def indexed(self) -> bool:
        return self._plain is None

    @property
    def height(self) -> int:
        return self._plain.height if self._plain is not None else sum(r.live for r in self._runs)

    @property
    def runs(self) -> int:
        """How many runs the view is kept in (1 while not indexed)."""
        return 1 if self._plain is not None else len(self._runs)

    def estimated_size(self) -> int:
        if self._plain is not None:
            return int(self._plain.estimated_size())
        return sum(r.nbytes() for r in self._runs)

    def frame(self) -> pl.DataFrame:
        """Every live row, as one frame (made once per change of the view)."""
        if self._frame is None:
            frames = [r.live_frame() for r in self._runs]
            self._frame = pl.concat(frames, how="vertical", rechunk=False) if len(frames) > 1 else frames[0]
        return self._frame

    def _index(self) -> bool:
        """Index the view if it is large enough (it stays indexed); whether it is indexed."""
        if self._plain is not None and self._plain.height >= self.index_rows_min and self._plain.height:
            self._runs = [_Run(self._plain.rechunk(), self.key_names)]
            self._plain = self._plain_source = None
        return self._plain is None

    def candidates(self, needles: np.ndarray) -> pl.DataFrame | None:
        """The live rows whose key hash is among ``needles`` (sorted, distinct hashes of keys,
        ``key_hashes`` of the key columns cast to the view's dtypes): a superset of those keys'
        rows, exact after a join on the keys. None when the view is not indexed (read its
        frame): a read does not index a view, its first change in place does (a view evicted
        before it changes, as under a small cache, would not repay its index)."""
        if self._plain is not None:
            return None
        parts = [run.frame[rows] for run in self._runs if (rows := run.rows(needles)).size]
        if not parts:
            return self._runs[0].frame.clear()
        return parts[0] if len(parts) == 1 else pl.concat(parts, how="vertical", rechunk=False)

    def max_ord(self) -> int:
        """At least the greatest ``ord`` of a list view's rows (-1 when none)."""
        if self._plain is not None:
            top = self._plain.get_column(ORD).max() if self._plain.height else None
            return -1 if top is None else int(top)
        for run in self._runs:
            if run.top_ord is None:
                top = run.frame.get_column(ORD).max() if run.frame.height else None
                run.top_ord = -1 if top is None else int(top)
        return max(run.top_ord for run in self._runs)

    def key_dtypes(self) -> dict[str, pl.DataType]:
        schema = (self._plain if self._plain is not None else self._runs[0].frame).schema
        return {k: schema[k] for k in self.key_names}

    def append(self, rows: pl.DataFrame) -> None:
        """Add ``rows`` of keys the view does not hold (a partial view's new keys)."""
        if not rows.height:
            return
        if self._plain is not None:
            self._plain = rows if self._plain.height == 0 else pl.concat([self._plain, rows], how="vertical")
            self._frame = self._plain
            self._plain_source = None
            return
        self._runs.append(_Run(rows, self.key_names))
        self._settle()

    def replace(self, on: Sequence[str], gone: pl.DataFrame | None, gone_keys: pl.DataFrame | None,
                added: pl.DataFrame | None, now_ms: int) -> None:
        """Apply new entries, all newer than every row: the rows matching ``gone`` on ``on``
        (the key columns, and a map's user key) and every row of ``gone_keys`` (key columns: a
        map's whole-key clears) leave the view, rows expired at ``now_ms`` too, and ``added``
        (the new entries' own resolution) joins it. ``replace_rows`` does it for many views."""
        replace_rows([(self, gone, gone_keys, added)], on, now_ms)

    def _replace_plain(self, on: Sequence[str], gone: pl.DataFrame | None, gone_keys: pl.DataFrame | None,
                       added: pl.DataFrame | None, now_ms: int) -> None:
        view = self._plain
        if view.height:
            if gone_keys is not None:
                view = view.join(gone_keys, on=self.key_names, how="anti")
            if gone is not None:
                view = view.join(gone, on=list(on), how="anti", nulls_equal=True)
            view = live_rows(view, now_ms)  # as a resolution would: expired rows leave the view
        if added is not None and added.height:
            view = pl.concat([view, added], how="vertical", rechunk=view.n_chunks() >= _CHUNKS_MAX)
        if view is not self._plain:
            self._plain_source = None
        self._plain = self._frame = view

    def _settle(self) -> None:
        """Compact runs mostly dead, merge the newest runs while the older is not much larger."""
        self._frame = None
        runs = [r if r.dead <= r.live else _merged([r], self.key_names) for r in self._runs if r.live]
        self._runs = runs or [_Run(self._runs[0].frame.clear(), self.key_names)]
        while len(self._runs) >= 2 and self._runs[-2].live <= self.merge_ratio * self._runs[-1].live:
            self._runs[-2:] = [_merged(self._runs[-2:], self.key_names)]


Change = tuple[KeyedView, "pl.DataFrame | None", "pl.DataFrame | None", "pl.DataFrame | None"]


def replace_rows(changes: Sequence[Change], on: Sequence[str], now_ms: int) -> None:
    """``KeyedView.replace`` of many views (of one variable): each change is (view, gone,
    gone_keys, added). The indexed views' work is done for all of them at once where polars
    does it (hashing the keys, the exact check of the rows their hashes found, hashing the new
    rows): a few calls per batch, not per key group and run."""
    on = list(on)
    todo: list[Change] = []
    for change in changes:
        view, gone, gone_keys, added = change
        if view._index():
            todo.append(change)
        else:
            view._replace_plain(on, gone, gone_keys, added, now_ms)
    if not todo:
        return
    key_names, dtypes = todo[0][0].key_names, todo[0][0].key_dtypes()
    for view, *_ in todo:
        for run in view._runs:
            run.expire(now_ms)
    for slot, cols in ((2, key_names), (1, on)):  # a map's whole-key clears, then the changed rows
        matches = [(change[0], change[slot]) for change in todo if change[slot] is not None and change[slot].height]
        if matches:
            _kill_matching(matches, cols, key_names, dtypes)
    added = [(view, a) for view, _, _, a in todo if a is not None and a.height]
    if added:
        frames = [a for _, a in added]
        hashes = key_hashes(pl.concat([f.select(key_names) for f in frames], how="vertical").cast(dtypes))
        bounds = np.cumsum([0] + [f.height for f in frames]).tolist()
        for (view, frame), a, b in zip(added, bounds[:-1], bounds[1:], strict=True):
            view._runs.append(_Run(frame, key_names, unsorted=hashes[a:b]))
    for view, *_ in todo:
        view._settle()


def _kill_matching(matches: list[tuple[KeyedView, pl.DataFrame]], cols: list[str], key_names: list[str],
                   dtypes: dict[str, pl.DataType]) -> None:
    """Mark dead the rows of each view that match its frame on ``cols`` (key columns first):
    candidates by key hash in every run, then one exact join of all candidates (a key lives in
    one key group, so the views' keys need no key group to tell them apart)."""
    match = pl.concat([m.select(cols) for _, m in matches], how="vertical")
    hashes = key_hashes(match.select(key_names).cast(dtypes))
    bounds = np.cumsum([0] + [m.height for _, m in matches]).tolist()
    found, spans = [], []
    for (view, _), a, b in zip(matches, bounds[:-1], bounds[1:], strict=True):
        needles = distinct_sorted(hashes[a:b])
        for run in view._runs:
            rows = run.rows(needles)
            if rows.size:
                found.append(run.frame.select(cols)[rows])
                spans.append((run, rows))
    if not found:
        return
    candidates = pl.concat(found, how="vertical", rechunk=False).with_row_index(_POS)
    hit = candidates.join(match, on=cols, how="semi", nulls_equal=True).get_column(_POS).to_numpy()
    hit = np.sort(hit.astype(np.int64))
    starts = np.cumsum([0] + [rows.size for _, rows in spans])
    cuts = np.searchsorted(hit, starts).tolist()
    for (run, rows), a, b, start in zip(spans, cuts[:-1], cuts[1:], starts[:-1].tolist(), strict=True):
        if b > a:
            run.kill(rows[hit[a:b] - start])
