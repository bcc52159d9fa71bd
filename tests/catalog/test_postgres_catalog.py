"""pyiceberg's SQL catalog on a real PostgreSQL server (``tests.pg_server``), as a team shares
one catalog: what matters there beyond the contract suite (which runs every ``StateTable``
test on it, ``iceberg-postgres``).

* Two writers of one table commit through the server's compare-and-swap (pyiceberg's
  ``UPDATE iceberg_tables ... WHERE metadata_location = <the one it loaded>``): a writer that
  loses it gets ``CommitFailedException`` and ``catalog.commit`` retries on fresh metadata, as
  on SQLite; a second driver of one branch is refused.
* The catalog's password (inside its ``uri`` property) is never printed: not by ``repr`` of a
  ``TableRef`` or ``StateLocation``, nor by the errors of a wrong password, a server that is
  not there, or one that goes away while a table is open.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from catalog import TableRef
from spark_integration.location import StateLocation
from statestore.errors import CatalogUnavailableError, CommitConflictError
from tests import pg_server
from tests.contract.backends import IcebergPostgresBackend
from tests.contract.helpers import LAYOUT, commit_next

pytestmark = pytest.mark.usefixtures("pg_uri")


@pytest.fixture
def backend(tmp_path: Path):
    made = IcebergPostgresBackend(str(tmp_path / "wh"))
    yield made
    made.close_all()


def test_writers_of_two_branches_alternate_and_the_one_that_loses_the_catalog_swap_retries(backend, caplog):
    """Two table objects (main's writer and a fork's) commit in turn; once, the fork's writer
    commits between main's load of the catalog row and its swap: the server refuses main's
    swap, and main commits again on top of the fork's commit."""
    main = backend.open(retain_checkpoints=3)
    commit_next(main)
    main.fork("f")
    fork = dataclasses.replace(backend.ref(), branch="f").open(LAYOUT, retain_checkpoints=3)
    catalog = main.iceberg_table.catalog
    real_write_metadata = catalog._write_metadata
    raced: list[int] = []

    def fork_commits_first(*args, **kwargs):  # inside SqlCatalog.commit_table, before its UPDATE
        if not raced:
            raced.append(commit_next(fork))
        return real_write_metadata(*args, **kwargs)

    catalog._write_metadata = fork_commits_first
    committed: dict[str, list[int]] = {"main": [1], "f": [1]}
    with caplog.at_level(logging.INFO, logger="catalog.commit"):
        for _ in range(3):
            committed["main"].append(commit_next(main))
            committed["f"].append(commit_next(fork))
    assert "Table has been updated by another process" in caplog.text  # the server refused one swap
    assert raced == [2]
    committed["f"].insert(1, raced[0])
    for table, branch in ((main, "main"), (fork, "f")):
        table.restore()
        retained = [c.checkpoint_id for c in table.list_checkpoints()]
        assert retained[-3:] == committed[branch][-3:] and set(retained) <= set(committed[branch])
    fork.close()


def test_a_second_driver_of_one_branch_is_refused(backend):
    mine = backend.open()
    commit_next(mine)
    theirs = backend.open()
    commit_next(theirs)
    with pytest.raises(CommitConflictError, match="two drivers"):
        commit_next(mine)


# --- secrets --------------------------------------------------------------------------


def _shown(error: BaseException) -> str:
    """Everything a log or a terminal would show of ``error``: message and traceback."""
    return "".join(traceback.format_exception(error))


def test_repr_of_a_table_ref_and_a_state_location_hides_the_catalog_password(backend, pg_uri):
    password = make_url(pg_uri).password
    ref = backend.ref()
    location = StateLocation(table="op", catalog_name=ref.catalog_name, catalog_properties=ref.catalog_properties)
    for text in (repr(ref), str(ref), repr(location), str(location), repr(location.identity)):
        assert password not in text, text
    assert "icestate:***@127.0.0.1" in repr(ref) and "icestate:***@127.0.0.1" in repr(location)
    assert ref.catalog_properties["uri"] == pg_uri  # only shown redacted, kept whole


@pytest.mark.parametrize("init_tables", ["true", "false"])
@pytest.mark.parametrize("fault", ["wrong password", "no server"])
def test_a_catalog_that_cannot_connect_is_an_error_without_the_password(backend, pg_uri, fault, init_tables):
    """With ``init_catalog_tables`` (pyiceberg's default) loading the catalog fails
    (``CatalogUnavailableError``); without, pyiceberg takes the failed probe for absent tables
    and the first use fails (SQLAlchemy's ``OperationalError``). Neither shows the password."""
    url = make_url(pg_uri)
    wrong = "wrong-" + url.password[:8]
    uri = (url.set(password=wrong) if fault == "wrong password" else url.set(port=_closed_port())
           ).render_as_string(hide_password=False)
    ref = dataclasses.replace(backend.ref(), catalog_properties={
        **backend.properties(), "uri": uri, "init_catalog_tables": init_tables})
    with pytest.raises(CatalogUnavailableError if init_tables == "true" else OperationalError) as info:
        ref.open(LAYOUT)
    shown = _shown(info.value)
    assert ("password authentication failed" if fault == "wrong password" else "refused") in shown, shown
    assert url.password not in shown and wrong not in shown


def test_a_server_that_goes_away_under_an_open_table_is_an_error_without_the_password(tmp_path):
    """A server of its own, stopped while a table is open: the commit fails with SQLAlchemy's
    error (the statement and its parameters, not the URL)."""
    server = pg_server.start(tmp_path, publish=False)
    try:
        ref = TableRef("op", catalog_name="gone", catalog_properties={
            "type": "sql", "uri": server.uri, "init_catalog_tables": "true", "warehouse": f"file://{tmp_path}/wh"})
        table = ref.open(LAYOUT)
        commit_next(table)
    finally:
        server.stop()
    with pytest.raises(Exception) as info:  # whatever the driver raises, it must not show the password
        commit_next(table)
    shown = _shown(info.value)
    assert "server closed the connection" in shown or "Connection refused" in shown, shown
    assert make_url(server.uri).password not in shown
    table.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed
