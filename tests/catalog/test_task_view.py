"""A task's table (``catalog.task_view``): the driver's view of a checkpoint, shipped to tasks.

Tasks must never need the catalog: a store on a ``TaskStateTable`` reads and flushes with
the catalog gone (its SQLite file moved away), the driver commits what the task flushed, and
the next batch's view shows it. The view is plain values (picklable), carries only storage
properties, and never shows them.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pyarrow as pa
import pytest

from catalog import IcebergStateTable
from catalog.task_view import CheckpointView, TaskStateTable, io_properties
from statestore import StateStore
from statestore.errors import CheckpointNotFoundError, TaskCommitError
from statestore.keygroups import KeyGroupRange
from tests.catalog.catalog_helpers import LAYOUT

SECRET = "s3cr3t-planted-value"


def _counts(store: StateStore, users: list[str]) -> list:
    return store.get_state("count").get_batch(pa.table({"user": users})).to_pylist()


def _put(store: StateStore, values: dict[str, int]) -> None:
    store.get_state("count").update_batch(pa.table({"user": list(values)}), pa.array(list(values.values()), pa.int64()))


def test_io_properties_keep_storage_settings_only():
    props = {"uri": f"postgresql://u:{SECRET}@h/db", "warehouse": "s3://b/w", "credential": SECRET,
             "token": SECRET, "s3.endpoint": "http://127.0.0.1:1", "s3.secret-access-key": SECRET,
             "client.region": "eu", "py-io-impl": "pyiceberg.io.pyarrow.PyArrowFileIO", "type": "sql"}
    assert io_properties(props) == {"s3.endpoint": "http://127.0.0.1:1", "s3.secret-access-key": SECRET,
                                    "client.region": "eu", "py-io-impl": "pyiceberg.io.pyarrow.PyArrowFileIO"}


def test_a_view_is_plain_values_and_never_shows_its_storage_secrets(open_table):
    table = open_table()
    store = StateStore(table, task_index=0, parallelism=1)
    _put(store, {"a": 1})
    store.checkpoint()
    view = table.checkpoint_view()
    view = CheckpointView(**{**view.__dict__, "io": {**view.io, "s3.secret-access-key": SECRET}})
    assert SECRET not in repr(view) and SECRET not in str(view)
    assert SECRET not in repr(TaskStateTable(view, LAYOUT))
    again = pickle.loads(pickle.dumps(view))
    assert again == view and again.io["s3.secret-access-key"] == SECRET
    assert view.checkpoint_id == 1 and view.next_checkpoint_id == 2
    assert view.segments == tuple(table.segments(KeyGroupRange.of(0, LAYOUT.max_parallelism - 1)))


def test_tasks_read_flush_and_move_on_without_the_catalog(open_table, warehouse):
    driver = open_table()
    seed = StateStore(driver, task_index=0, parallelism=1)
    _put(seed, {f"u{i}": i for i in range(50)})
    seed.checkpoint()
    view = driver.checkpoint_view()

    # The catalog goes away (executors on another host cannot reach the driver's SQLite file).
    catalog_db = Path(warehouse) / "catalog.db"
    hidden = catalog_db.with_suffix(".hidden")
    catalog_db.rename(hidden)
    try:
        task_table = TaskStateTable(view, LAYOUT)
        task = StateStore(task_table, task_index=0, parallelism=1)
        assert _counts(task, ["u3", "u49", "nobody"]) == [3, 49, None]
        _put(task, {"u3": 300, "new": 7})
        cp = task_table.next_checkpoint_id()
        segments = task.flush(cp)
        with pytest.raises(TaskCommitError, match="driver commits"):
            task_table.commit_checkpoint(cp, segments, parallelism=1)
    finally:
        hidden.rename(catalog_db)

    # The driver commits the task's segments; the task moves to the next view and completes.
    driver.commit_checkpoint(cp, segments, parallelism=1)
    task_table.advance(driver.checkpoint_view())
    task.checkpoint_complete(cp)
    assert _counts(task, ["u3", "new", "u4"]) == [300, 7, 4]
    cold = StateStore(TaskStateTable(driver.checkpoint_view(), LAYOUT), task_index=0, parallelism=1)
    assert _counts(cold, ["u3", "new", "u4"]) == [300, 7, 4]
    fresh = IcebergStateTable.open(LAYOUT, warehouse=warehouse, table_name="op")
    try:
        assert _counts(StateStore(fresh, task_index=0, parallelism=1), ["u3", "new"]) == [300, 7]
    finally:
        fresh.close()


def test_a_task_table_stays_at_its_shipped_checkpoint(open_table):
    table = open_table()
    store = StateStore(table, task_index=0, parallelism=1)
    _put(store, {"a": 1})
    store.checkpoint()
    _put(store, {"a": 2})
    store.checkpoint()
    task_table = TaskStateTable(table.checkpoint_view(), LAYOUT)
    assert task_table.restore(None).checkpoint_id == 2
    assert task_table.restore(2).checkpoint_id == 2
    with pytest.raises(CheckpointNotFoundError, match="shipped checkpoint 2, not 1"):
        task_table.restore(1)
    other = open_table(table_name="other")
    with pytest.raises(ValueError, match="cannot replace"):
        task_table.advance(other.checkpoint_view())


def test_new_paths_go_to_the_branch_directory_of_the_view(open_table):
    table = open_table()
    store = StateStore(table, task_index=0, parallelism=1)
    _put(store, {"a": 1})
    store.checkpoint()
    table.fork("trial")
    fork = open_table(branch="trial")
    task_table = TaskStateTable(fork.checkpoint_view(), LAYOUT)
    path = task_table.new_segment_path(5, 0, 0)
    assert "/data/branches/trial/c000000000000/seg-cp000000000005-t00000-p00000-" in path
    assert path == fork.new_segment_path(5, 0, 0)[:-len("abcdef123456.parquet")] + path[-len("abcdef123456.parquet"):]
    assert "/data/branches/trial/operator/op-cp000000000005-t00001-" in task_table.new_operator_state_path(5, 1)


def test_the_local_file_ios_named_are_the_ones_that_exist():
    from catalog.fileio import STATE_FILE_IO
    from catalog.task_view import LOCAL_AS_ARROW_FILE_IOS

    assert STATE_FILE_IO in LOCAL_AS_ARROW_FILE_IOS
    for name in LOCAL_AS_ARROW_FILE_IOS:
        module, _, cls = name.rpartition(".")
        assert isinstance(getattr(__import__(module, fromlist=[cls]), cls), type)


def test_a_python_worker_s_task_path_imports_no_catalog_client(open_table, tmp_path):
    """What a Python worker imports to run a task on a local table: not the SQL catalog
    (SQLAlchemy), DuckDB, pyiceberg's Arrow FileIO or pandas (0.6 s of a worker's start); the
    filesystem is Arrow's local one, as the table's FileIO would give."""
    import subprocess
    import sys

    table = open_table()
    store = StateStore(table, task_index=0, parallelism=1)
    _put(store, {"a": 1})
    store.checkpoint()
    view = table.checkpoint_view()
    assert view.io.get("py-io-impl")  # the embedded catalog's tables name the state FileIO
    (tmp_path / "view.pkl").write_bytes(pickle.dumps((view, LAYOUT)))
    script = (
        "import pickle, sys\n"
        "import pyarrow.fs as pafs\n"
        "from spark_integration.tasks import warm_worker\n"
        "from catalog.task_view import locations_of\n"
        f"view, layout = pickle.loads(open({str(tmp_path / 'view.pkl')!r}, 'rb').read())\n"
        "warm_worker(view, layout)\n"
        "assert isinstance(locations_of(view.location, view.io).filesystem, pafs.LocalFileSystem)\n"
        "heavy = ['sqlalchemy', 'duckdb', 'pyiceberg.io.pyarrow', 'pyiceberg.catalog.sql', 'pandas']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
