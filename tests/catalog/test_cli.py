"""The state-table commands of ``icestate`` (``catalog.cli.tables``), invoked on their own,
on a local warehouse and on S3 (moto's server on loopback). The program that mounts them is
tested in tests/spark_integration/test_cli.py.

The commands are invoked in process (``CliRunner``), except where the catalog comes from
pyiceberg's configuration (``.pyiceberg.yaml``, ``PYICEBERG_*`` environment), which pyiceberg
reads once when a process imports it: those run the program as a child process, in a
temporary home and working directory, as a user would. No secret is ever put on the command
line of a child process: they travel in the configuration file or the environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from catalog import cli
from catalog.cli import tables as app
from statestore import StateLayout, StateStore, ValueStateDescriptor
from statestore.keygroups import assign_key_groups
from statestore.paths import segment_file_name
from tests.catalog.catalog_helpers import KEY_SCHEMA, MAX_PARALLELISM, commit_next
from tests.catalog.conftest import Place

ROOT = Path(__file__).resolve().parents[2]
# A secret no output may show, whatever the command does.
PLANTED = "planted-SECRET-4f9c2e71d0"


def invoke(*args: str):
    # rich fixes a console's width from COLUMNS when the console is made, at the module's import,
    # whichever test imported it first (in whichever process): the tests read wide tables.
    cli.console.width = cli.err_console.width = 200
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def run_program(args: list[str], home: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``icestate ARGS`` in a child process whose home and working directory are ``home``,
    with pyiceberg configured only by ``home`` and ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("PYICEBERG_")}
    full = {**clean, "HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "spark_integration.cli", *args], capture_output=True, text=True,
                          env=full, cwd=home, timeout=120)


def two_checkpoints(place: Place) -> None:
    table = place.open()
    commit_next(table, [[1], [9]], properties={"note": "hi"})
    commit_next(table, [[1]])
    table.close()


def test_checkpoints_and_sql_commands(place):
    two_checkpoints(place)
    where = place.cli_args()
    listed = invoke("checkpoints", *where, "--table", "op")
    assert listed.exit_code == 0, listed.output
    assert "note" in listed.output and "20" in listed.output  # properties and batch id of checkpoint 2
    query = invoke("sql", *where, "--table", "op", "--checkpoint", "1", "SELECT count(*) AS n FROM state_count")
    assert query.exit_code == 0, query.output
    assert "2" in query.output
    raw = invoke("sql", *where, "--table", "op", "SELECT key_group, v_count FROM entries ORDER BY v_count")
    assert raw.exit_code == 0, raw.output
    assert [line.split()[1:4:2] for line in raw.output.splitlines() if "1001" in line or "2001" in line] == [
        ["1", "1001"], ["1", "2001"]]


def test_savepoint_fork_and_refs_commands(place):
    two_checkpoints(place)
    base = [*place.cli_args(), "--table", "op"]
    saved = invoke("savepoint", "keep", *base, "--checkpoint", "1")
    assert saved.exit_code == 0, saved.output
    forked = invoke("fork", "v2", *base, "--savepoint", "keep")
    assert forked.exit_code == 0, forked.output
    assert "branch='v2'" in forked.output
    listed = invoke("refs", *base)
    assert listed.exit_code == 0, listed.output
    assert "keep" in listed.output and "v2" in listed.output
    on_fork = invoke("checkpoints", *base, "--branch", "v2")
    assert on_fork.exit_code == 0 and "(v2)" in on_fork.output, on_fork.output
    query = invoke("sql", *base, "--savepoint", "keep", "SELECT count(*) AS n FROM state_count")
    assert query.exit_code == 0 and "2" in query.output, query.output
    bad = invoke("savepoint", "keep", *base)
    # One line naming what is wrong, no traceback.
    assert bad.exit_code == 1 and "already has a savepoint" in bad.output and "Traceback" not in bad.output


def test_compact_command(place):
    two_checkpoints(place)
    compacted = invoke("compact", *place.cli_args(), "--table", "op", "--json")
    assert compacted.exit_code == 0, compacted.output
    assert '"files_out": 1' in compacted.output
    query = invoke("sql", *place.cli_args(), "--table", "op", "SELECT count(*) AS n FROM state_count")
    assert query.exit_code == 0 and "│ 2 " in query.output, query.output


def test_sweep_command(place):
    two_checkpoints(place)
    with place.open() as table:
        fs = table.filesystem
        segment = table.segments(table.partition_key_groups(0))[0].path
        stalled = f"{segment.rsplit('/', 1)[0]}/{segment_file_name(1, 9, 0)}"  # written long after checkpoint 1
        with fs.open_output_stream(stalled) as f:
            f.write(b"x")
    result = invoke("sweep", *place.cli_args(), "--table", "op", "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.splitlines()[-1])  # after the warnings about secrets on a command line
    assert figures["directories"] == 1 and figures["files_deleted"] == 1 and figures["processes"] == 1
    assert figures["files_listed"] >= 3 and fs.get_file_info(stalled).type.name == "NotFound"
    result = invoke("sweep", *place.cli_args(), "--table", "op")
    assert result.exit_code == 0 and "deleted 0 orphaned files" in result.output, result.output


# --- naming a catalog -----------------------------------------------------------------------


@pytest.fixture
def s3_place(tmp_path, catalog_s3) -> Place:
    made = Place("s3", str(tmp_path / "s3"), catalog_s3)
    yield made
    for t in made.opened:
        t.close()


def yaml_of(catalogs: dict[str, dict[str, str]]) -> str:
    lines = ["catalog:"]
    for name, props in catalogs.items():
        lines.append(f"  {name}:")
        lines += [f"    {k}: {v}" for k, v in props.items()]
    return "\n".join(lines) + "\n"


def test_s3_warehouse_named_by_a_catalog_in_pyiceberg_yaml(s3_place, tmp_path):
    two_checkpoints(s3_place)
    home = tmp_path / "home"
    home.mkdir()
    props = {**s3_place.catalog_properties(), "s3.secret-access-key": PLANTED}
    (home / ".pyiceberg.yaml").write_text(yaml_of({s3_place.catalog_name: props}))
    listed = run_program(["checkpoints", "--catalog", s3_place.catalog_name, "--table", "op"], home)
    assert listed.returncode == 0, listed.stderr
    assert "note" in listed.stdout and "state.op (main)" in listed.stdout
    query = run_program(["sql", "--catalog", s3_place.catalog_name, "--table", "op",
                         "SELECT count(*) AS n FROM state_count"], home)
    assert query.returncode == 0, query.stderr
    assert "│ 2 " in query.stdout
    for out in (listed, query):
        assert PLANTED not in out.stdout + out.stderr
        assert "warning" not in out.stderr  # nothing secret on the command line


def test_s3_warehouse_named_by_a_catalog_in_the_environment(s3_place, tmp_path):
    two_checkpoints(s3_place)
    home = tmp_path / "home"
    home.mkdir()
    name = s3_place.catalog_name.upper()
    env = {f"PYICEBERG_CATALOG__{name}__{k.replace('.', '__').replace('-', '_').upper()}": v
           for k, v in s3_place.catalog_properties().items()}
    # The warehouse URI on the command line, the rest (credentials) in the environment.
    warehouse = env.pop(f"PYICEBERG_CATALOG__{name}__WAREHOUSE")
    refs = run_program(["refs", "--catalog", s3_place.catalog_name, "--warehouse", warehouse, "--table", "op"],
                       home, env)
    assert refs.returncode == 0, refs.stderr
    query = run_program(["sql", "--catalog", s3_place.catalog_name, "--table", "op", "--checkpoint", "1",
                         "SELECT v_count FROM state_count ORDER BY 1"], home, env)
    assert query.returncode == 0, query.stderr
    assert "1001" in query.stdout and "1009" in query.stdout


def test_a_uri_warehouse_needs_a_catalog(tmp_path):
    out = invoke("checkpoints", "--warehouse", "s3://bucket/state", "--table", "op")
    assert out.exit_code == 2
    assert "--catalog" in out.output and "--property" in out.output and "local disk" in out.output


def test_an_unconfigured_catalog_says_where_to_configure_it(tmp_path):
    out = run_program(["checkpoints", "--catalog", "nowhere", "--table", "op"], tmp_path)
    assert out.returncode == 1
    assert "no pyiceberg catalog named 'nowhere' is configured" in out.stderr
    assert "PYICEBERG_CATALOG__NOWHERE__" in out.stderr and ".pyiceberg.yaml" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_warehouse_is_given_once(s3_place):
    out = invoke("refs", *s3_place.cli_args(), "--property", "warehouse=s3://other/place", "--table", "op")
    assert out.exit_code == 2 and "give the warehouse once" in out.output


@pytest.mark.parametrize("item", ["s3.secret-access-key", f"={PLANTED}", PLANTED])
def test_a_malformed_property_is_refused_without_echoing_it(item):
    out = invoke("refs", "--catalog", "c", "--property", item, "--table", "op")
    assert out.exit_code == 2 and "KEY=VALUE" in out.output
    assert item not in out.output


def test_a_property_given_twice_is_refused():
    out = invoke("refs", "--catalog", "c", "--property", "s3.region=a", "--property", "s3.region=b", "--table", "op")
    assert out.exit_code == 2 and "'s3.region' is given twice" in out.output


# --- secrets ----------------------------------------------------------------------------------


def test_a_secret_given_on_the_command_line_is_never_shown(s3_place):
    two_checkpoints(s3_place)
    where = [*s3_place.cli_args(), "--property", f"token={PLANTED}"]
    runs = {
        "checkpoints": invoke("checkpoints", *where, "--table", "op"),
        "sql": invoke("sql", *where, "--table", "op", "SELECT * FROM entries"),
        "refs": invoke("refs", *where, "--table", "op"),
        "no such table": invoke("refs", *where, "--table", "missing"),
        "no such checkpoint": invoke("sql", *where, "--table", "op", "--checkpoint", "9", "SELECT 1"),
        "bad sql": invoke("sql", *where, "--table", "op", f"SELECT '{PLANTED}' FROM nothing"),
        "catalog type": invoke("refs", "--catalog", "x", "--property", "type=bogus", "--property",
                               f"s3.secret-access-key={PLANTED}", "--table", "op"),
        "catalog uri": invoke("refs", "--catalog", "pg", "--property", f"uri=postgresql://u:{PLANTED}@127.0.0.1:1/db",
                              "--table", "op"),
    }
    for what, out in runs.items():
        assert PLANTED not in out.output, f"{what}:\n{out.output}"
        assert out.exit_code == (0 if what in {"checkpoints", "sql", "refs"} else 1), f"{what}:\n{out.output}"
    # The warning names the property and where secrets belong, never its value.
    assert "--property token puts a secret on the command line" in runs["refs"].output
    assert f"PYICEBERG_CATALOG__{s3_place.catalog_name.upper()}__TOKEN" in runs["refs"].output
    assert "there is no state table state.missing" in runs["no such table"].output
    assert "checkpoint 9 is not retained" in runs["no such checkpoint"].output


@pytest.mark.slow
def test_a_secret_of_the_configuration_is_never_shown(s3_place, tmp_path):
    """Failures with the catalog's secrets in .pyiceberg.yaml: a missing table, an object
    store that cannot be reached, a catalog pyiceberg cannot load."""
    two_checkpoints(s3_place)
    home = tmp_path / "home"
    home.mkdir()
    name = s3_place.catalog_name
    good = {**s3_place.catalog_properties(), "s3.secret-access-key": PLANTED}
    unloadable = {"type": "sql", "uri": f"postgresql://u:{PLANTED}@127.0.0.1:9/db", "token": PLANTED}
    (home / ".pyiceberg.yaml").write_text(yaml_of({name: good, "unloadable": unloadable}))
    # The environment overrides the file: the same catalog, its storage on a port nobody serves.
    unreachable = {f"PYICEBERG_CATALOG__{name.upper()}__S3__ENDPOINT": "http://127.0.0.1:9"}
    outs = {"no such table": run_program(["refs", "--catalog", name, "--table", "missing"], home),
            "unreachable": run_program(["sql", "--catalog", name, "--table", "op", "SELECT 1"], home, unreachable),
            "unloadable": run_program(["checkpoints", "--catalog", "unloadable", "--table", "op"], home)}
    for what, out in outs.items():
        assert out.returncode == 1, f"{what}: {out.stderr}"
        assert PLANTED not in out.stdout + out.stderr, f"{what}: {out.stderr}"
        assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr, f"{what}: {out.stderr}"
    assert "127.0.0.1:9" in outs["unreachable"].stderr, outs["unreachable"].stderr


# --- inspection commands ------------------------------------------------------------------


def stored_checkpoints(place: Place) -> dict[str, int]:
    """Two checkpoints written by a store (keys in their real key groups): u1 = 1001 and u9 = 1009
    (batch 10), then u1 = 2001 (batch 20). Returns the key group of each key."""
    table = place.open()
    store = StateStore(table)
    users = pa.table({"user": ["u1", "u9"]})
    store.get_state("count").update_batch(users, [1001, 1009])
    store.checkpoint(batch_id=10, properties={"note": "hi"})
    store.get_state("count").update_batch(users.slice(0, 1), [2001])
    store.checkpoint(batch_id=20)
    table.close()
    return dict(zip(["u1", "u9"], assign_key_groups(users, MAX_PARALLELISM).tolist(), strict=True))


def test_checkpoints_show_time_rows_and_bytes_as_table_csv_and_json(place):
    groups = stored_checkpoints(place)
    where = [*place.cli_args(), "--table", "op"]
    as_json = invoke("checkpoints", *where, "--format", "json")
    assert as_json.exit_code == 0, as_json.output
    listed = json.loads(as_json.stdout)
    assert [r["checkpoint_id"] for r in listed["rows"]] == [1, 2]
    assert [r["batch_id"] for r in listed["rows"]] == [10, 20]
    assert [r["rows_added"] for r in listed["rows"]] == [2, 1] and listed["rows"][1]["rows"] == 3
    assert [r["parallelism"] for r in listed["rows"]] == [1, 1] and groups
    assert all(r["bytes_added"] > 0 and r["committed_at"].startswith("20") for r in listed["rows"])
    assert json.loads(listed["rows"][0]["properties"]) == {"note": "hi"}
    as_csv = invoke("checkpoints", *where, "--format", "csv")
    assert as_csv.exit_code == 0, as_csv.output
    lines = as_csv.stdout.splitlines()
    assert lines[1].startswith("checkpoint_id,batch_id,committed_at") and len(lines) == 4
    as_table = invoke("checkpoints", *where)
    assert as_table.exit_code == 0, as_table.output
    assert all(word in as_table.output for word in (" kB", " UTC", "note")), as_table.output


def test_sql_reads_the_inspection_views_and_a_change_feed(place):
    groups = stored_checkpoints(place)
    where = [*place.cli_args(), "--table", "op"]
    out = invoke("sql", *where, "--format", "json", "SELECT count(*) AS n, sum(rows) AS r FROM key_groups")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == [{"n": 16, "r": 3}]
    changed = invoke("sql", *where, "--changes-from", "1", "--format", "json",
                     'SELECT change_type, "user", before, after FROM changes_count')
    assert changed.exit_code == 0, changed.output
    assert json.loads(changed.stdout) == [{"change_type": "update", "user": "u1", "before": 1001, "after": 2001}]
    assert groups


def test_key_command_shows_state_and_history(place):
    groups = stored_checkpoints(place)
    where = [*place.cli_args(), "--table", "op"]
    now = invoke("key", *where, "--key", "user=u1", "--format", "json")
    assert now.exit_code == 0, now.output
    count, seen = (json.loads(line) for line in now.stdout.splitlines())
    assert count["title"] == "count of user=u1" and [r["v_count"] for r in count["rows"]] == [2001]
    assert seen["rows"] == []
    history = invoke("key", *where, "--key", "user=u1", "--history", "--format", "json")
    assert history.exit_code == 0, history.output
    rows = json.loads(history.stdout.splitlines()[0])["rows"]
    assert [(r["checkpoint_id_at"], r["v_count"], r["batch_id"], r["key_group"]) for r in rows] == [
        (1, 1001, 10, groups["u1"]), (2, 2001, 20, groups["u1"])]
    bad = invoke("key", *where, "--key", "who=u1")
    assert bad.exit_code == 1 and "has the columns ['user']" in bad.output
    malformed = invoke("key", *where, "--key", "u1")
    assert malformed.exit_code == 2 and "COLUMN=VALUE" in malformed.output


def test_diff_command(place):
    groups = stored_checkpoints(place)
    where = [*place.cli_args(), "--table", "op"]
    out = invoke("diff", *where, "--from", "1", "--format", "csv")
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[:3] == ["# count: changes 1 -> newest (1)",
                                           "change_type,user,key_group,before,after,before_checkpoint_id,"
                                           "after_checkpoint_id", f"update,u1,{groups['u1']},1001,2001,1,2"]
    summary = invoke("diff", *where, "--from", "1", "--to", "2", "--summary", "--format", "json")
    assert summary.exit_code == 0, summary.output
    counts = {(r["state"], r["change_type"]): r["keys"] for r in json.loads(summary.stdout)["rows"]}
    assert counts[("count", "update")] == 1 and counts[("count", "insert")] == 0 and counts[("seen", "delete")] == 0
    gone = invoke("diff", *where, "--from", "7")
    assert gone.exit_code == 1 and "checkpoint 7 is not retained" in gone.output


def test_describe_rescale_command(place):
    groups = stored_checkpoints(place)
    where = [*place.cli_args(), "--table", "op"]
    out = invoke("describe-rescale", *where, "--parallelism", "4", "--format", "json")
    assert out.exit_code == 0, out.output
    described = json.loads(out.stdout)
    tasks = described["rows"]
    assert [t["key_groups"] for t in tasks] == ["0-3", "4-7", "8-11", "12-15"]
    # u1's entries twice (two checkpoints), u9's once.
    rows = [0] * 4
    rows[groups["u1"] // 4] += 2
    rows[groups["u9"] // 4] += 1
    assert [t["rows"] for t in tasks] == rows and max(t["of_largest"] for t in tasks) == 1.0
    assert all(t["files"] >= (1 if t["rows"] else 0) for t in tasks)
    assert "written by 1 task(s)" in described["title"]
    bad = invoke("describe-rescale", *where, "--parallelism", "17")
    assert bad.exit_code == 2 and "max parallelism 16" in bad.output


def test_repair_command_dry_run_then_commit(place, tmp_path):
    groups = stored_checkpoints(place)
    where = [*place.cli_args(), "--table", "op"]
    fix = ["--reason", "halve u1", "--by", "ops", "--delete-key", "user=u9",
           "--put", "count=SELECT user, v_count // 2 AS v_count FROM state_count WHERE user = 'u1'"]
    planned = invoke("repair", *where, *fix, "--dry-run", "--format", "json")
    assert planned.exit_code == 0, planned.output
    feeds = {json.loads(line)["title"]: json.loads(line)["rows"] for line in planned.stdout.splitlines()}
    assert feeds["count: would change (2)"] == [
        *sorted([{"change_type": "update", "user": "u1", "key_group": groups["u1"], "before": 2001, "after": 1000,
                  "before_checkpoint_id": 2, "after_checkpoint_id": 3},
                 {"change_type": "delete", "user": "u9", "key_group": groups["u9"], "before": 1009, "after": None,
                  "before_checkpoint_id": 1, "after_checkpoint_id": None}], key=lambda r: r["key_group"])]
    listed = json.loads(invoke("checkpoints", *where, "--format", "json").stdout)["rows"]
    assert [r["checkpoint_id"] for r in listed] == [1, 2]  # the dry run committed nothing
    done = invoke("repair", *where, *fix)
    assert done.exit_code == 0 and "repair committed" in done.output, done.output
    listed = json.loads(invoke("checkpoints", *where, "--format", "json").stdout)["rows"]
    assert (listed[-1]["operation"], listed[-1]["batch_id"], listed[-1]["repair_reason"]) == ("repair", 20, "halve u1")
    values = json.loads(invoke("sql", *where, "--format", "json", "SELECT user, v_count FROM state_count").stdout)
    assert values == [{"user": "u1", "v_count": 1000}]
    bulk = tmp_path / "bulk.parquet"
    pq.write_table(pa.table({"user": ["a", "b"], "v_count": [1, 2]}), bulk)
    loaded = invoke("repair", *where, "--reason", "bulk load", "--put-parquet", f"count={bulk}")
    assert loaded.exit_code == 0, loaded.output
    bad = invoke("repair", *where, "--reason", "typo", "--put", "count=SELECT user FROM state_count")
    assert bad.exit_code == 1 and "lack column(s) ['v_count']" in bad.output


def test_migrate_command_adds_a_field_and_widens(place):
    table = place.open(StateLayout.of(KEY_SCHEMA, [ValueStateDescriptor("point", pa.struct([("n", pa.int32())]))],
                                      MAX_PARALLELISM))
    store = StateStore(table)
    store.get_state("point").update_batch(pa.table({"user": ["u1"]}), [{"n": 1}])
    store.checkpoint()
    table.close()
    where = [*place.cli_args(), "--table", "op"]
    done = invoke("migrate", *where, "--state", "point", "--add-field", "note:string", "--widen", "n:long")
    assert done.exit_code == 0, done.output
    assert "struct<n: int64, note: string>" in done.output
    rows = json.loads(invoke("sql", *where, "--format", "json", "SELECT v_point FROM state_point").stdout)
    assert rows == [{"v_point": {"n": 1, "note": None}}]
    narrowing = invoke("migrate", *where, "--state", "point", "--widen", "n:int")
    assert narrowing.exit_code == 1 and "changes from int64 to int32" in narrowing.output
    unknown = invoke("migrate", *where, "--state", "point", "--add-field", "x:decimal")
    assert unknown.exit_code == 2 and "FIELD:TYPE" in unknown.output
