"""The state table layout: which columns a segment has and what an entry means.

Every row of a segment is one LSM entry of one state variable of one key::

    key_group | <key columns> | state | op | checkpoint_id | seq | expire_at_ms | mk_<map> ... | v_<var> ...

``op`` says what the entry does (values are stored on disk: never renumber them):

* ``PUT``: set the value (value, reducing, aggregating state) or one map entry.
* ``DELETE``: a tombstone. Without a map user key it clears the variable for the key
  (value cleared, whole list cleared, whole map cleared) and hides every older entry;
  with a map user key it removes that one map entry.
* ``APPEND``: one list element, after every older element.

Entries are ordered by ``(checkpoint_id, seq)``; the newest wins, a tombstone hides
what is older. Only the value column of the entry's own variable is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from statestore.conversions import castable, type_family
from statestore.descriptors import StateDescriptor, StateKind
from statestore.errors import SchemaMismatchError
from statestore.keygroups import DEFAULT_MAX_PARALLELISM, check_key_type, check_max_parallelism

# Stored on disk (column "op"): do not change.
OP_PUT = 0
OP_DELETE = 1
OP_APPEND = 2

KEY_GROUP = "key_group"
STATE = "state"
OP = "op"
CHECKPOINT_ID = "checkpoint_id"
SEQ = "seq"
EXPIRE_AT_MS = "expire_at_ms"
SYSTEM_COLUMNS = (KEY_GROUP, STATE, OP, CHECKPOINT_ID, SEQ, EXPIRE_AT_MS)


def _normalize_key_type(t: pa.DataType) -> pa.DataType:
    # Segments store one canonical type per key kind, so that keys compare equal whatever
    # Arrow flavour (large, view, dictionary) the caller handed in.
    if pa.types.is_dictionary(t):
        return _normalize_key_type(t.value_type)
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz=t.tz)
    return t


@dataclass(frozen=True)
class StateLayout:
    """Key schema, state variables and max parallelism of one stateful operator.

    Immutable. ``entry_schema`` is the Arrow schema of every segment of the operator.
    """

    key_schema: pa.Schema
    descriptors: tuple[StateDescriptor, ...]
    max_parallelism: int

    @classmethod
    def of(cls, key_schema: pa.Schema, descriptors: Sequence[StateDescriptor],
           max_parallelism: int = DEFAULT_MAX_PARALLELISM) -> StateLayout:
        check_max_parallelism(max_parallelism)
        if not isinstance(key_schema, pa.Schema) or len(key_schema) == 0:
            raise TypeError("key_schema must be a non-empty pyarrow Schema")
        fields = []
        for f in key_schema:
            check_key_type(f.name, f.type)
            if f.name in SYSTEM_COLUMNS or f.name.startswith(("v_", "mk_")):
                raise ValueError(
                    f"key column {f.name!r} collides with a state table column name; rename it "
                    f"(reserved: {', '.join(SYSTEM_COLUMNS)}, and prefixes v_, mk_)"
                )
            fields.append(pa.field(f.name, _normalize_key_type(f.type), nullable=False))
        names = [d.name for d in descriptors]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"state variables declared twice: {sorted(dupes)}")
        columns: dict[str, str] = {}
        for d in descriptors:
            for column in (d.value_column, d.user_key_column):
                if column is not None and columns.setdefault(column, d.name) != d.name:
                    raise ValueError(f"state variables {columns[column]!r} and {d.name!r} would share the stored "
                                     f"column {column!r} (a plain name equal to the other's column stem): rename one")
        return cls(pa.schema(fields), tuple(descriptors), max_parallelism)

    @property
    def key_names(self) -> list[str]:
        return self.key_schema.names

    def descriptor(self, name: str) -> StateDescriptor:
        for d in self.descriptors:
            if d.name == name:
                return d
        raise KeyError(f"no state variable {name!r}; declared: {[d.name for d in self.descriptors]}")

    @property
    def entry_schema(self) -> pa.Schema:
        fields = [pa.field(KEY_GROUP, pa.int32(), nullable=False)]
        fields += list(self.key_schema)
        fields += [
            pa.field(STATE, pa.string(), nullable=False),
            pa.field(OP, pa.int8(), nullable=False),
            pa.field(CHECKPOINT_ID, pa.int64(), nullable=False),
            pa.field(SEQ, pa.int64(), nullable=False),
            pa.field(EXPIRE_AT_MS, pa.int64()),
        ]
        for d in self.descriptors:
            if d.kind is StateKind.MAP:
                fields.append(pa.field(d.user_key_column, d.user_key_type))
        fields += [pa.field(d.value_column, d.value_type) for d in self.descriptors]
        return pa.schema(fields)

    def check_keys(self, keys: pa.Table) -> pa.Table:
        """Validate and normalize a table of keys to ``key_schema`` (same names, castable types, no nulls)."""
        if isinstance(keys, pa.RecordBatch):
            keys = pa.Table.from_batches([keys])
        if not isinstance(keys, pa.Table):
            raise TypeError(f"keys must be a pyarrow Table or RecordBatch, got {type(keys).__name__}")
        missing = [n for n in self.key_names if n not in keys.column_names]
        if missing:
            raise SchemaMismatchError(
                f"keys lack key column(s) {missing}; the state's key schema is {self.key_schema}"
            )
        cols = []
        for f in self.key_schema:
            col = keys.column(f.name)
            if col.null_count:
                raise ValueError(f"key column {f.name!r} has {col.null_count} null value(s): keys must not be null")
            if col.type != f.type:
                check_key_type(f.name, col.type)
                if not castable(col.type, f.type):  # as the per-key API: no int keys for a string column
                    raise SchemaMismatchError(f"key column {f.name!r} has type {col.type}, the state expects "
                                              f"{f.type}: convert the keys explicitly")
                try:
                    col = col.cast(f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise SchemaMismatchError(
                        f"key column {f.name!r} has type {col.type}, the state expects {f.type}: {e}"
                    ) from e
            if type_family(f.type) == "string":
                try:
                    col.validate(full=True)
                except pa.ArrowInvalid as e:
                    raise SchemaMismatchError(
                        f"key column {f.name!r} holds a string that is not valid UTF-8 ({e}); a Spark "
                        "CAST(binary AS STRING) can make one: clean or filter those keys, or key by the binary"
                    ) from e
            cols.append(col)
        return pa.Table.from_arrays(cols, schema=self.key_schema)
