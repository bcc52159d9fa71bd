"""The state browser (``icestate ui``, ``catalog.ui``) on real state tables in a local warehouse.

The tables are written once per module through a real ``StateStore`` (value, list and map
state; four checkpoints, a savepoint, a fork). Three ways in:

* a real headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright; installed by
  scripts/setup.sh) against the real server on loopback: browse, look a key up, compare two
  checkpoints, query with SQL, and be refused a writing statement. Without Chromium these tests
  fail, never skip. With ``ICESTATE_UI_SHOTS=DIR`` they save a screenshot of each page there;
* Flask's test client for the error pages (status and message) and escaping;
* the ``icestate ui`` command: its help, its refusal of a warehouse without tables, and a child
  process serving the index.
"""

from __future__ import annotations

import contextlib
import html
import http.cookiejar
import os
import re
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner
from werkzeug.serving import make_server

from catalog import IcebergStateTable, TableRef, default_catalog, inspection
from catalog.key_text import KeyTextError, parse_key, parse_value
from catalog.ui import create_app, state_table_names
from statestore import ListStateDescriptor, MapStateDescriptor, StateStore, TtlConfig, ValueStateDescriptor
from statestore.layout import StateLayout
from tests.catalog.catalog_helpers import table_files

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
# Two made-up names resolve to loopback in the browser: another site's page (attacker.test) and
# a name an attacker made resolve to this machine (rebind.test, as DNS rebinding does).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--host-resolver-rules=MAP attacker.test 127.0.0.1, MAP rebind.test 127.0.0.1"]
NAMESPACE = "state"
DAY_MS = 86_400_000
USERS = [f"u{i}" for i in range(20)]
SCRIPT = "<script>alert(1)</script>"
ODD_VARIABLE = "<i>note</i>"

ACTIVITY = StateLayout.of(pa.schema([("user", pa.string())]), [
    ValueStateDescriptor("count", pa.int64()),
    ListStateDescriptor("events", pa.string()),
    MapStateDescriptor("pages", pa.int64(), key_type=pa.string(), ttl=TtlConfig(DAY_MS)),
], 16)
VISITS = StateLayout.of(pa.schema([("id", pa.int64()), ("day", pa.date32())]),
                        [ValueStateDescriptor("visits", pa.int32())], 8)
ODD = StateLayout.of(pa.schema([("who", pa.string())]), [ValueStateDescriptor(ODD_VARIABLE, pa.string())], 4)


def users(names: list[str]) -> pa.Table:
    return pa.table({"user": pa.array(names, pa.string())})


def write_activity(table: IcebergStateTable) -> None:
    """Checkpoints 1-4 of ``activity``; savepoint ``before-v2`` and fork ``v2`` at checkpoint 2.

    count: u0..u19 = 0..19 (1); u0..u4 += 100, u19 cleared (2); u0 = 999, u20 = 20 (3);
    unchanged (4, a batch of list appends). events: "a" each (1), "b" for u0 (2), "c" for u1 (4).
    pages: home -> 1 each (1), cart -> 2 for u1 (2).
    """
    store = StateStore(table)
    store.get_state("count").update_batch(users(USERS), list(range(20)))
    store.get_state("events").add_batch(users(USERS), ["a"] * 20)
    store.get_state("pages").put_batch(users(USERS), ["home"] * 20, [1] * 20)
    store.checkpoint(batch_id=10)
    store.get_state("count").update_batch(users(USERS[:5]), [100 + i for i in range(5)])
    store.get_state("count").clear_batch(users(["u19"]))
    store.get_state("events").add_batch(users(["u0"]), ["b"])
    store.get_state("pages").put_batch(users(["u1"]), ["cart"], [2])
    store.checkpoint(batch_id=11)
    table.savepoint("before-v2")
    table.fork("v2")
    store.get_state("count").update_batch(users(["u0", "u20"]), [999, 20])
    store.get_state("events").add_batch(users(["u20"]), ["a"])
    store.checkpoint(batch_id=12)
    store.get_state("events").add_batch(users(["u1"]), ["c"])
    store.checkpoint(batch_id=13)
    store.close()


def write_visits(table: IcebergStateTable) -> None:
    import datetime

    store = StateStore(table)
    keys = pa.table({"id": pa.array([1, 2], pa.int64()), "day": pa.array([datetime.date(2024, 5, 1)] * 2)})
    store.get_state("visits").update_batch(keys, [3, 4])
    store.checkpoint(batch_id=1)
    store.close()


def write_odd(table: IcebergStateTable) -> None:
    store = StateStore(table)
    store.get_state(ODD_VARIABLE).update_batch(pa.table({"who": [SCRIPT, "plain"]}), ["<b>bold</b>", "x"])
    store.checkpoint()
    store.close()


@dataclass(frozen=True)
class Warehouse:
    """The module's warehouse: ``activity``, ``visits`` and ``odd`` state tables and a plain
    Iceberg table ``plain`` that is no state table."""

    directory: str

    def open(self, name: str, branch: str = "main") -> IcebergStateTable:
        return TableRef(name, namespace=NAMESPACE, warehouse=self.directory, branch=branch).open()

    def names(self) -> list[str]:
        with contextlib.closing(default_catalog(self.directory)) as cat:
            return state_table_names(cat, NAMESPACE)

    def app(self):
        return create_app(self.open, self.names, where=self.directory)


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory: pytest.TempPathFactory) -> Warehouse:
    made = Warehouse(str(tmp_path_factory.mktemp("ui") / "warehouse"))
    for name, layout, write in (("activity", ACTIVITY, write_activity), ("visits", VISITS, write_visits),
                                ("odd", ODD, write_odd)):
        with IcebergStateTable.open(layout, warehouse=made.directory, table_name=name) as table:
            write(table)
    with contextlib.closing(default_catalog(made.directory)) as cat:
        cat.create_table((NAMESPACE, "plain"), schema=pa.schema([("x", pa.int64())]))
    return made


@pytest.fixture(scope="module")
def server(warehouse: Warehouse) -> Iterator[str]:
    """The real server on loopback, an ephemeral port, in a thread; its base URL."""
    srv = make_server("127.0.0.1", 0, warehouse.app(), threaded=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    thread.join(timeout=30)
    srv.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    """One headless Chromium per module (a fresh profile): a Playwright page."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh, which installs Debian's chromium and "
                    "chromium-driver (CI runs it); the browser tests of the state browser need them")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, args=CHROMIUM_ARGS,
            headless=True, viewport={"width": 1360, "height": 900})
        page = context.new_page()
        page.set_default_timeout(60_000)
        yield page
        context.close()


def shot(page, name: str) -> None:
    """A full-page screenshot in ``$ICESTATE_UI_SHOTS`` when set (to look at the pages)."""
    directory = os.environ.get("ICESTATE_UI_SHOTS")
    if directory:
        os.makedirs(directory, exist_ok=True)
        page.screenshot(path=os.path.join(directory, f"{name}.png"), full_page=True)


def grid(table) -> list[dict[str, str]]:
    """The rows of an HTML table of the page as dicts of its headers."""
    headers = table.locator("thead th").all_inner_texts()
    return [dict(zip(headers, row.locator("td").all_inner_texts(), strict=True))
            for row in table.locator("tbody tr").all()]


# --- in the browser ---------------------------------------------------------------------------

def test_browse_tables_checkpoints_and_charts(browser, server, warehouse):
    page = browser
    page.goto(server)
    listed = grid(page.locator("table.data"))
    assert [r["State table"] for r in listed] == ["activity", "odd", "visits"]  # not the plain table
    activity = next(r for r in listed if r["State table"] == "activity")
    assert activity["Newest checkpoint"] == "4" and activity["Batch"] == "13"
    shot(page, "index")

    page.get_by_role("link", name="activity", exact=True).click()
    page.wait_for_url(re.compile(r"/tables/activity"))
    assert page.locator("h1").inner_text() == "activity"
    assert page.locator("figure.chart svg").count() == 3  # timeline, key-group skew, files per unit
    checkpoints = grid(page.locator("#checkpoints"))
    assert [r["Checkpoint"] for r in checkpoints] == ["4", "3", "2", "1"]
    assert page.locator("#checkpoints tr.selected td").first.inner_text() == "4"
    body = page.locator("main").inner_text()
    assert "before-v2" in body and "v2" in body and "pages" in body
    assert "1 d (on create and write)" in body and "none" in body.split()  # the TTL of pages; the others have none
    shot(page, "table")

    page.locator("#checkpoints").get_by_role("link", name="1", exact=True).click()
    page.wait_for_url(re.compile(r"checkpoint=1"))
    assert page.locator("#checkpoints tr.selected td").first.inner_text() == "1"
    assert "Checkpoint 1" in page.locator("h2", has_text="Checkpoint 1").inner_text()
    assert page.locator("figure.chart svg").count() == 3
    with warehouse.open("activity") as table:
        rows = sum(inspection.segments(table, 1).column("rows").to_pylist())
    assert rows == 60 and f"{rows} rows" in page.locator("ul.figures").inner_text()  # 20 users x 3 variables
    shot(page, "table-checkpoint-1")


def test_look_a_key_up_at_a_checkpoint_and_over_time(browser, server):
    page = browser
    page.goto(f"{server}/tables/activity")
    page.get_by_role("link", name="Key lookup").click()
    page.fill("input[name=k0]", "u0")
    page.select_option("select[name=checkpoint]", "3")
    page.get_by_role("button", name="Look up").click()
    page.wait_for_url(re.compile(r"k0=u0"))
    count = page.locator("section.variable", has=page.locator("h2", has_text="count"))
    state, history = (grid(count.locator("table.data").nth(i)) for i in range(2))
    assert [(r["user"], r["v_count"], r["checkpoint_id"]) for r in state] == [("u0", "999", "3")]
    assert [(r["checkpoint_id_at"], r["v_count"]) for r in history] == [("1", "0"), ("2", "100"), ("3", "999"),
                                                                         ("4", "999")]
    events = page.locator("section.variable", has=page.locator("h2", has_text="events"))
    assert [r["v_events"] for r in grid(events.locator("table.data").first)] == ["a", "b"]
    pages = page.locator("section.variable", has=page.locator("h2", has_text="pages"))
    assert [(r["mk_pages"], r["v_pages"]) for r in grid(pages.locator("table.data").first)] == [("home", "1")]
    shot(page, "key")


def test_diff_of_two_checkpoints(browser, server):
    page = browser
    page.goto(f"{server}/tables/activity/diff")
    page.select_option("select[name=variable]", "count")
    page.select_option("select[name=from]", "2")
    page.select_option("select[name=to]", "3")
    page.get_by_role("button", name="Compare").click()
    page.wait_for_url(re.compile(r"variable=count"))
    changed = {r["user"]: r for r in grid(page.locator("table.data"))}
    assert set(changed) == {"u0", "u20"}
    assert (changed["u0"]["change_type"], changed["u0"]["before"], changed["u0"]["after"]) == ("update", "100", "999")
    assert (changed["u20"]["change_type"], changed["u20"]["after"]) == ("insert", "20")
    counts = page.locator("ul.counts").inner_text()
    assert "1 insert" in counts and "1 update" in counts and "0 deletes" in counts
    shot(page, "diff")


def test_sql_reads_and_is_refused_writing(browser, server, warehouse, tmp_path):
    page = browser
    with warehouse.open("activity") as table:
        before = ([c.snapshot_id for c in table.list_checkpoints()], table_files(table))
    page.goto(f"{server}/tables/activity")
    page.get_by_role("link", name="SQL").click()

    def run(query: str) -> int:
        page.fill("textarea[name=q]", query)
        with page.expect_response(re.compile(r"/sql\?")) as answer:
            page.get_by_role("button", name="Run").click()
        page.wait_for_load_state()
        return answer.value.status

    assert run("SELECT count(*) AS n FROM state_count") == 200
    assert grid(page.locator("table.data")) == [{"n": "20"}]  # u0..u18 and u20
    shot(page, "sql")
    target = tmp_path / "x.parquet"
    for writing in (f"COPY state_count TO '{target}'", "CREATE TABLE t AS SELECT 1"):
        assert run(writing) == 400
        assert "only reads" in page.locator(".error").inner_text()
        assert page.locator("table.data").count() == 0
    shot(page, "sql-refused")
    assert run("SELECT * FROM t") == 400  # nothing was created
    assert "t does not exist" in page.locator(".error").inner_text()
    assert not target.exists()
    with warehouse.open("activity") as table:
        assert ([c.snapshot_id for c in table.list_checkpoints()], table_files(table)) == before


class _Recorder:
    """A WSGI wrapper recording each request's path and answer status."""

    def __init__(self, app):
        self.app, self.seen = app, []

    def __call__(self, environ, start_response):
        def recorded(status, headers, *rest):
            self.seen.append((environ["PATH_INFO"], int(status.split()[0])))
            return start_response(status, headers, *rest)

        return self.app(environ, recorded)


@contextlib.contextmanager
def serving(app) -> Iterator[int]:
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv.server_port
    finally:
        srv.shutdown()
        thread.join(timeout=30)
        srv.server_close()


def test_other_sites_pages_get_nothing(browser, warehouse):
    """Another site's page in the same browser makes requests to the state browser (a fetch, an
    image): refused before any table is opened or query run. A page reached by a name that is
    not loopback's (DNS rebinding) is refused too; typed addresses and the page's own links work."""
    opened: list[str] = []

    def opener(name: str, branch: str = "main") -> IcebergStateTable:
        opened.append(name)
        return warehouse.open(name, branch)

    recorder = _Recorder(create_app(opener, warehouse.names, where=warehouse.directory))
    sql = "/tables/activity/sql?q=SELECT+count(*)+FROM+state_count"
    with serving(recorder) as port:
        target = f"http://127.0.0.1:{port}"
        attack = (f'<img src="{target}{sql}"><script>fetch("{target}{sql}", {{mode: "no-cors"}})'
                  '.finally(() => { document.title = "sent"; });</script>')

        def attacker(environ, start_response):
            start_response("200 OK", [("Content-Type", "text/html")])
            return [attack.encode()]

        with serving(attacker) as attacker_port:
            browser.goto(f"http://attacker.test:{attacker_port}/")
            browser.wait_for_function("document.title === 'sent'")
        refused = [status for path, status in recorder.seen if path == "/tables/activity/sql"]
        assert refused and set(refused) == {403}, recorder.seen
        assert opened == []
        answer = browser.goto(f"http://rebind.test:{port}/tables/activity")
        assert answer.status == 400 and opened == []
        answer = browser.goto(f"{target}{sql}")  # typed: answered
        assert answer.status == 200 and opened == ["activity"]
        browser.get_by_role("link", name="Key").first.click()  # the page's own link
        browser.wait_for_load_state()
        assert ("/tables/activity/key", 200) in recorder.seen


def test_a_browser_without_the_token_gets_nothing(browser, warehouse):
    """With a token (as ``icestate ui`` starts it), only a browser that opened the address
    holding it is answered: it then browses without the token in its address."""
    opened: list[str] = []

    def opener(name: str, branch: str = "main") -> IcebergStateTable:
        opened.append(name)
        return warehouse.open(name, branch)

    with serving(create_app(opener, warehouse.names, where=warehouse.directory, token="s3cret-token")) as port:
        base = f"http://127.0.0.1:{port}"
        answer = browser.goto(f"{base}/tables/activity")
        assert answer.status == 403 and opened == []
        answer = browser.goto(f"{base}/tables/activity?token=wrong")
        assert answer.status == 403 and opened == []
        answer = browser.goto(f"{base}/tables/activity?branch=main&token=s3cret-token")
        assert answer.status == 200 and browser.url == f"{base}/tables/activity?branch=main"
        browser.get_by_role("link", name="Key").first.click()
        browser.wait_for_load_state()
        assert "/tables/activity/key" in browser.url and opened == ["activity", "activity"]
    browser.context.clear_cookies()


# --- error pages and escaping (Flask's test client) -----------------------------------------

@pytest.fixture(scope="module")
def client(warehouse: Warehouse):
    return warehouse.app().test_client()


@pytest.mark.parametrize(("path", "status", "message"), [
    ("/tables/nope", 404, "there is no state table 'nope'"),
    ("/tables/plain", 404, "there is no state table 'plain'"),
    ("/tables/activity?checkpoint=99", 404, "checkpoint 99 is not retained"),
    ("/tables/activity/key?checkpoint=99", 404, "checkpoint 99 is not retained"),
    ("/tables/activity?checkpoint=abc", 400, "checkpoint must be a checkpoint id"),
    ("/tables/activity?branch=nofork", 404, "has no fork 'nofork'"),
    ("/tables/activity/diff?variable=nothing&from=1&to=2", 404, "no state variable 'nothing'"),
    ("/tables/activity/diff?variable=count&from=1&to=99", 404, "checkpoint 99 is not retained"),
    ("/tables/visits/key?k0=abc&k1=2024-05-01", 400, "key column 'id' is int64: 'abc' is not one"),
    ("/tables/visits/key?k0=1&k1=2024-13-01", 400, "key column 'day' is date32[day]"),
    ("/tables/activity/sql?q=SELEC+1", 400, "Parser Error"),
    ("/tables/activity/sql?q=SELECT+*+FROM+nope", 400, "nope does not exist"),
    ("/tables/activity/sql?q=SELECT+1%3B+SELECT+2", 400, "give one SQL statement"),
    ("/tables/activity/sql?q=DROP+VIEW+state_count", 400, "a DROP statement does not run here"),
    ("/no/such/page", 404, "Not found"),
])
def test_error_pages(client, path, status, message):
    answer = client.get(path)
    assert answer.status_code == status
    page = answer.get_data(as_text=True)
    assert message in html.unescape(page)
    assert "Traceback" not in page


def test_pages_answer_for_every_table_and_line(client):
    for path in ("/", "/tables/odd", "/tables/visits", "/tables/activity?branch=v2", "/tables/activity/key",
                 "/tables/activity/diff", "/tables/activity/sql", "/tables/activity?checkpoint=2"):
        assert client.get(path).status_code == 200, path
    answer = client.get("/tables/visits/key?k0=2&k1=2024-05-01")
    assert answer.status_code == 200 and "<td>4</td>" in answer.get_data(as_text=True)


def test_a_fork_shows_its_own_line(client):
    page = client.get("/tables/activity?branch=v2").get_data(as_text=True)
    assert 'class="pill"' in page and ">v2<" in page
    assert "checkpoint=3" not in page  # the fork's line ends at checkpoint 2 (nothing committed on it)


def test_user_data_is_escaped(client):
    answer = client.get("/tables/odd/key", query_string={"k0": SCRIPT})
    page = answer.get_data(as_text=True)
    assert answer.status_code == 200
    assert SCRIPT not in page and "<b>bold</b>" not in page and "<i>note</i>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;b&gt;bold&lt;/b&gt;" in page
    assert "&lt;i&gt;note&lt;/i&gt;" in client.get("/tables/odd").get_data(as_text=True)
    sql = client.get("/tables/odd/sql", query_string={"q": f"SELECT '{SCRIPT}' AS x"}).get_data(as_text=True)
    assert SCRIPT not in sql and "&lt;script&gt;" in sql


def test_sql_reads_the_selected_checkpoint_and_the_inspection_views(client):
    def answer(query: str, **params: str) -> list[str]:
        page = client.get("/tables/activity/sql", query_string={"q": query, **params}).get_data(as_text=True)
        return re.findall(r"<td>([^<]*)</td>", page)

    count = "SELECT count(*) FROM state_count"
    # One cached connection per checkpoint: u19 is cleared at 2, u20 added at 3.
    assert [answer(count, checkpoint=c) for c in ("1", "2", "3")] == [["20"], ["19"], ["20"]]
    assert answer(count, checkpoint="2") == ["19"]
    assert answer("SELECT count(*) FROM checkpoints") == ["4"]
    assert answer("SELECT sum(rows) FROM segments", checkpoint="1") == ["60"]


def test_sql_shows_at_most_1000_rows(client):
    page = client.get("/tables/activity/sql", query_string={"q": "SELECT * FROM range(5000)"}).get_data(as_text=True)
    assert page.count("<tr>") == 1001  # the header and 1,000 rows
    assert "The first 1,000 rows are shown; there are more." in page


def test_the_page_shows_no_secret():
    secret = "planted-SECRET-9a1b"

    def failing_open(name: str, branch: str = "main") -> IcebergStateTable:
        raise RuntimeError(f"cannot reach the catalog with s3.secret-access-key={secret}")

    app = create_app(failing_open, lambda: ["t"], scrub=lambda text: text.replace(secret, "***"))
    for path in ("/", "/tables/t"):
        page = app.test_client().get(path).get_data(as_text=True)
        assert "s3.secret-access-key=***" in page and secret not in page


def test_typed_keys_parse_into_their_column_types():
    from datetime import UTC, date, datetime

    schema = pa.schema([("s", pa.string()), ("b", pa.binary()), ("f", pa.bool_()), ("i", pa.int8()),
                        ("d", pa.date32()), ("t", pa.timestamp("us", tz="UTC")), ("n", pa.timestamp("us"))])
    texts = [" a b ", "xy", "Yes", "-7", "2024-05-01", "2024-05-01T12:30:00", "2024-05-01T14:30:00+02:00"]
    assert parse_key(schema, texts) == {
        "s": " a b ", "b": b"xy", "f": True, "i": -7, "d": date(2024, 5, 1),
        "t": datetime(2024, 5, 1, 12, 30, tzinfo=UTC), "n": datetime(2024, 5, 1, 12, 30)}
    refused = [("i", "300", "int8"), ("i", "1.0", "type it like 42"), ("f", "maybe", "true or false"),
               ("d", "May 1", "2024-05-01")]
    for column, text, said in refused:
        with pytest.raises(KeyTextError, match=said):
            parse_value(schema.field(column), text)


# --- the command ------------------------------------------------------------------------------

def test_ui_command_help_lists_its_options():
    from spark_integration.cli import app

    result = CliRunner().invoke(app, ["ui", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for option in ("--warehouse", "--catalog", "--property", "--namespace", "--host", "--port", "--open", "--no-open"):
        assert option in result.output
    assert "127.0.0.1" in result.output and "8765" in result.output


def test_ui_command_refuses_a_warehouse_without_tables(tmp_path):
    from spark_integration.cli import app

    result = CliRunner().invoke(app, ["ui", "--warehouse", str(tmp_path / "none"), "--no-open"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "holds no state tables" in result.output
    assert not (tmp_path / "none").exists()


def test_ui_command_serves_the_state_tables(warehouse):
    command = [sys.executable, "-m", "spark_integration.cli", "ui", "--warehouse", warehouse.directory, "--port", "0",
               "--no-open"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=ROOT) as child:
        try:
            first = child.stdout.readline()
            url = re.search(r"(http://127\.0\.0\.1:\d+/)\?token=([A-Za-z0-9_-]{32})", first)
            assert url, (first, child.stderr.read() if child.poll() is not None else "")
            base, token = url.groups()
            # Without the token (another local user): refused. With it: a cookie, then the pages.
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(base, timeout=60)
            assert refused.value.code == 403
            assert "answers only the address `icestate ui` printed" in html.unescape(refused.value.read().decode())
            browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
            with browser.open(url.group(0), timeout=60) as answer:
                page = answer.read().decode()
            assert answer.status == 200 and answer.url == base and "activity" in page and "visits" in page
            with browser.open(f"{base}tables/activity", timeout=60) as answer:
                assert answer.status == 200
        finally:
            child.terminate()
            child.wait(timeout=30)
        log = child.stderr.read()
    assert "GET /tables/activity" in log and "token=..." in log  # werkzeug's request log, token scrubbed
    assert token not in log


def test_the_browser_is_opened_on_a_page_of_the_users_own():
    """``icestate ui`` opens the browser on a file that leads to the address with the token, so
    that the token is never on the browser's command line (which other local users can read)."""
    from catalog.cli import _start_page

    url = "http://127.0.0.1:8765/?token=abc&x=<y>"
    path = _start_page(url, 8765)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        with open(path) as f:
            assert f'content="0;url={html.escape(url)}"' in f.read()
    finally:
        os.remove(path)
