"""Map user keys made hashable per value (``state._hashable``, a lookup's) and per column
(``state._hashable_column``, an index over a view's): both must give the same key for the same
value, or a map entry written by one path is not found by the other.

Hypothesis draws Arrow types (scalars, structs of scalars, structs with nested fields, lists)
and values for them, nulls included, and checks the column form against the value form; a store
test then reads struct-keyed map entries through the index after a restore."""

from __future__ import annotations

import datetime
import decimal

import polars as pl
import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from statestore import DirectoryStateTable, MapStateDescriptor, StateLayout, StateStore
from statestore.state import _hashable, _hashable_column
from tests.fuzzing import fuzz_settings

SCALARS = {
    pa.int32(): st.integers(-(2**31), 2**31 - 1),
    pa.int64(): st.integers(-(2**63), 2**63 - 1),
    pa.float64(): st.floats(allow_nan=False),  # NaN equals nothing, in either form
    pa.bool_(): st.booleans(),
    pa.string(): st.text(max_size=4),
    pa.binary(): st.binary(max_size=4),
    pa.date32(): st.dates(datetime.date(1900, 1, 1), datetime.date(2100, 1, 1)),
    pa.decimal128(10, 2): st.decimals(min_value=-10**7, max_value=10**7, places=2, allow_nan=False,
                                     allow_infinity=False).map(lambda d: d.quantize(decimal.Decimal("0.01"))),
}
names = st.sampled_from(["a", "b", "item", "z", "Zeta", "_x"])


def _scalar() -> st.SearchStrategy:
    return st.sampled_from(list(SCALARS)).map(lambda t: (t, SCALARS[t]))


def _struct(fields: list) -> tuple:
    t = pa.struct([pa.field(n, ft) for n, (ft, _) in fields])
    return t, st.fixed_dictionaries({n: st.none() | v for n, (_, v) in fields})


def _list_of(item: tuple) -> tuple:
    return pa.list_(item[0]), st.lists(st.none() | item[1], max_size=3)


def _fields(of: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(st.tuples(names, of), min_size=1, max_size=4, unique_by=lambda f: f[0])


def types_and_values() -> st.SearchStrategy:
    """(Arrow type, strategy of its values): a scalar, a struct of scalars (the column form's
    own path), a struct with a nested field, or a list, equally often."""
    nested = st.one_of(_fields(_scalar()).map(_struct), _scalar().map(_list_of))
    return st.one_of(_scalar(), _fields(_scalar()).map(_struct),
                     _fields(st.one_of(_scalar(), nested)).map(_struct), st.one_of(_scalar(), nested).map(_list_of))


@fuzz_settings(150)
@given(st.data())
def test_a_column_hashes_as_its_values_do(data):
    dtype, values = data.draw(types_and_values())
    column = data.draw(st.lists(values, max_size=8) | st.lists(st.none() | values, max_size=8))
    series = pl.from_arrow(pa.array(column, type=dtype))
    assert _hashable_column(series) == [_hashable(v) for v in series.to_list()]


def test_struct_user_keys_found_through_the_index_after_a_restore(tmp_path):
    """Entries written with struct user keys, checkpointed and read by a fresh store: each entry
    found by its key (the view's index hashes the column), updated and removed by it."""
    item = pa.struct([("name", pa.string()), ("n", pa.int32())])
    layout = StateLayout.of(pa.schema([("k", pa.string())]), [MapStateDescriptor("m", pa.int64(), key_type=item)], 8)
    table = DirectoryStateTable(tmp_path, layout)
    store = StateStore(table)
    m = store.get_state("m")
    for key in ("u1", "u2"):
        store.set_current_key(key)
        for i in range(5):
            m.put({"n": i, "name": f"i{i}"}, i * 10)
    store.checkpoint()
    store.close()
    fresh = StateStore(table)
    m = fresh.get_state("m")
    fresh.set_current_key("u2")
    assert [m.get({"name": f"i{i}", "n": i}) for i in range(5)] == [0, 10, 20, 30, 40]
    assert m.get({"name": "i1", "n": 2}) is None and m.contains({"n": 3, "name": "i3"})
    m.put({"name": "i3", "n": 3}, 7)
    m.remove({"n": 4, "name": "i4"})
    assert sorted(v for _, v in m.items()) == [0, 7, 10, 20]
    fresh.close()
