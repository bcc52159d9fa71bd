"""``TableRef``: where a state table is, as plain values.

* It survives pickling and JSON unchanged (a Spark plan, the compactor's input).
* Its arguments are validated with clear errors; a warehouse is made absolute.
* It never prints a secret catalog property: repr, str, f-strings, logging, its identity,
  and the error of a catalog that cannot be loaded.
* It opens a table through the embedded catalog of a warehouse and through a named pyiceberg
  catalog, whose configuration comes from its properties, from ``.pyiceberg.yaml`` (found
  through ``PYICEBERG_HOME``) or from ``PYICEBERG_CATALOG__<NAME>__<KEY>`` variables. pyiceberg
  reads those two when it is imported, so those cases run in a fresh interpreter.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from catalog import TableRef
from catalog.table_ref import redacted
from statestore import StateLayout, StateStore, ValueStateDescriptor
from statestore.errors import CatalogUnavailableError

LAYOUT = StateLayout.of(pa.schema([("k", pa.int64())]), [ValueStateDescriptor("v", pa.int64())], 16)
SECRET = "not-a-real-secret-5e2a"
ROOT = Path(__file__).resolve().parents[2]


def sql_properties(root: Path, **extra: str) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{root / 'catalog.db'}", "warehouse": f"file://{root}",
            "init_catalog_tables": "true", **extra}


@pytest.fixture
def named(tmp_path: Path) -> TableRef:
    """A ref through a named SQL catalog whose properties hold a secret."""
    root = tmp_path / "named"
    root.mkdir()
    return TableRef("op", namespace="ns", catalog_name="named",
                    catalog_properties=sql_properties(root, **{"s3.secret-access-key": SECRET}))


def write_one(ref: TableRef, value: int) -> None:
    with ref.open(LAYOUT) as table:
        store = StateStore(table)
        store.get_state("v").update_batch(pa.table({"k": pa.array([1], pa.int64())}), [value])
        store.checkpoint(batch_id=0)
        store.close()


def read_one(ref: TableRef) -> int | None:
    with ref.open() as table:
        store = StateStore(table)
        try:
            return store.get_state("v").get_batch(pa.table({"k": pa.array([1], pa.int64())})).to_pylist()[0]
        finally:
            store.close()


# --- plain values ---------------------------------------------------------------------


def test_a_ref_survives_pickling_and_json(named: TableRef, tmp_path: Path):
    local = TableRef("op", warehouse=str(tmp_path / "wh"), branch="v2")
    for ref in (named, local):
        assert pickle.loads(pickle.dumps(ref)) == ref
        assert TableRef.from_json(ref.to_json()) == ref
        assert TableRef.from_json(json.loads(ref.to_json())) == ref
        assert hash(pickle.loads(pickle.dumps(ref))) == hash(ref)
    assert json.loads(named.to_json())["catalog_properties"]["s3.secret-access-key"] == SECRET  # a pipe's, not a log's


def test_identity_says_which_table_and_line_and_shows_no_secret(named: TableRef):
    same = TableRef("op", namespace="ns", catalog_name="named", catalog_properties=dict(named.catalog_properties))
    assert same.identity == named.identity and {same: 1}[named] == 1
    other_line = TableRef("op", namespace="ns", catalog_name="named", catalog_properties=named.catalog_properties,
                          branch="v2")
    other_key = TableRef("op", namespace="ns", catalog_name="named",
                         catalog_properties={**named.catalog_properties, "s3.secret-access-key": "other"})
    assert len({named.identity, other_line.identity, other_key.identity}) == 3
    assert SECRET not in repr(named.identity)
    assert named.identifier == "ns.op"


def test_arguments_are_validated(tmp_path: Path, monkeypatch):
    with pytest.raises(ValueError, match=r"exactly one of warehouse= .* or catalog_name="):
        TableRef("op")
    with pytest.raises(ValueError, match="exactly one of warehouse="):
        TableRef("op", warehouse=str(tmp_path), catalog_name="x")
    with pytest.raises(ValueError, match="table name '' is invalid"):
        TableRef("", warehouse=str(tmp_path))
    with pytest.raises(ValueError, match="fork name '' is invalid"):
        TableRef("op", warehouse=str(tmp_path), branch="")
    with pytest.raises(ValueError, match="URI"):
        TableRef("op", warehouse="s3://bucket/wh")
    with pytest.raises(ValueError, match="catalog_properties belong to catalog_name="):
        TableRef("op", warehouse=str(tmp_path), catalog_properties={"uri": "x"})
    with pytest.raises(ValueError, match="catalog_name must be a non-empty string"):
        TableRef("op", catalog_name="")
    monkeypatch.chdir(tmp_path)
    assert TableRef("op", warehouse="wh").warehouse == str(tmp_path / "wh")
    assert TableRef("op", catalog_name="prod").catalog_properties == {}  # a name alone: the configuration has the rest


# --- secrets --------------------------------------------------------------------------


def test_no_secret_is_printed(named: TableRef, caplog):
    uri = TableRef("op", catalog_name="pg", catalog_properties={"uri": "postgresql://icestate:pw-9f3@db:5432/cat",
                                                                "rest.Token": "tok-123", "AWS_Credential": "c-1"})
    logging.getLogger("test_table_ref").warning("opening %s and %r", named, uri)
    shown = [repr(named), str(named), f"{named}", f"{named!r}", repr(uri), str(uri), caplog.text]
    for text in shown:
        for secret in (SECRET, "pw-9f3", "tok-123", "c-1"):
            assert secret not in text, text
    assert "'s3.secret-access-key': '***'" in repr(named)
    assert "postgresql://icestate:***@db:5432/cat" in repr(uri)
    assert "named" in repr(named) and "'type': 'sql'" in repr(named)  # the rest stays readable


def test_redacted_hides_names_with_secret_words_in_any_case():
    props = {"s3.secret-access-key": "a", "adls.account-key": "b", "token": "c", "jdbc.PASSWORD": "d",
             "client.credential": "e", "s3.endpoint": "http://minio:9000", "uri": "http://u:p@rest/x"}
    assert redacted(props) == {**{k: "***" for k in list(props)[:5]}, "s3.endpoint": "http://minio:9000",
                               "uri": "http://u:***@rest/x"}


def test_a_catalog_that_cannot_be_loaded_is_a_clear_error_without_its_secrets():
    ref = TableRef("op", catalog_name="broken", catalog_properties={"uri": "ftp://me:pw-77@host/x", "token": SECRET})
    with pytest.raises(CatalogUnavailableError, match="cannot load pyiceberg catalog 'broken'") as info:
        ref.catalog()
    assert isinstance(info.value, ValueError)
    assert "pw-77" not in str(info.value) and SECRET not in str(info.value)
    assert info.value.__suppress_context__  # pyiceberg's own message, which may quote them, is not shown


# --- opening --------------------------------------------------------------------------


def test_open_through_a_warehouse(tmp_path: Path):
    ref = TableRef("op", warehouse=str(tmp_path / "wh"))
    with pytest.raises(ValueError, match=r"no state table state\.op"):
        ref.open()
    write_one(ref, 7)
    assert read_one(ref) == 7
    with ref.open() as table:
        assert table.layout.key_schema == LAYOUT.key_schema
    catalog = ref.catalog()
    try:
        assert catalog.table_exists("state.op")
    finally:
        catalog.close()


def test_open_through_a_named_catalog_and_its_properties(named: TableRef):
    write_one(named, 3)
    assert read_one(named) == 3
    catalog = named.catalog()
    try:
        assert isinstance(catalog, SqlCatalog) and catalog.name == "named"
        assert catalog.table_exists("ns.op")
    finally:
        catalog.close()
    with named.open(LAYOUT, checkpoint_id=1, retain_checkpoints=3) as table:
        assert table.current_checkpoint().checkpoint_id == 1
    with pytest.raises(ValueError, match="partition_width"):
        named.open(partition_width=4)


CHILD = textwrap.dedent("""
    import sys
    import pyarrow as pa
    from catalog import TableRef
    from statestore import StateLayout, StateStore, ValueStateDescriptor
    layout = StateLayout.of(pa.schema([("k", pa.int64())]), [ValueStateDescriptor("v", pa.int64())], 16)
    ref = TableRef.from_json(sys.argv[1])
    with ref.open(layout) as table:
        store = StateStore(table)
        store.get_state("v").update_batch(pa.table({"k": pa.array([1], pa.int64())}), [int(sys.argv[2])])
        store.checkpoint(batch_id=0)
        store.close()
""")


def run_child(ref: TableRef, value: int, env: dict[str, str], cwd: Path) -> None:
    """Write ``value`` through ``ref`` in a fresh interpreter (pyiceberg reads its configuration
    when imported). The ref here holds a name only: no secret on this command line."""
    child_env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PYICEBERG_")}
    child_env.update(env, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD, ref.to_json(), str(value)], env=child_env, cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_name_alone_finds_its_catalog_in_pyiceberg_yaml(tmp_path: Path):
    root = tmp_path / "yaml_wh"
    root.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    (home / ".pyiceberg.yaml").write_text(textwrap.dedent(f"""
        catalog:
          fromyaml:
            type: sql
            uri: sqlite:///{root / 'catalog.db'}
            warehouse: file://{root}
    """))
    run_child(TableRef("op", catalog_name="fromyaml"), 11, {"PYICEBERG_HOME": str(home)}, tmp_path)
    assert read_one(TableRef("op", catalog_name="fromyaml", catalog_properties=sql_properties(root))) == 11


def test_a_name_alone_finds_its_catalog_in_pyiceberg_environment_variables(tmp_path: Path):
    root = tmp_path / "env_wh"
    root.mkdir()
    env = {"PYICEBERG_CATALOG__FROMENV__URI": f"sqlite:///{root / 'catalog.db'}",  # the type is inferred from it
           "PYICEBERG_CATALOG__FROMENV__WAREHOUSE": f"file://{root}",
           "PYICEBERG_HOME": str(tmp_path)}  # no .pyiceberg.yaml there
    run_child(TableRef("op", catalog_name="fromenv"), 12, env, tmp_path)
    assert read_one(TableRef("op", catalog_name="fromenv", catalog_properties=sql_properties(root))) == 12
