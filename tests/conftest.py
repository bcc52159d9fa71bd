"""Fixtures shared by every test package: real servers on loopback, each started once per
session when a test first needs it.

``s3_server_endpoint``: moto's S3 server (``tests/s3_server.py``), a real process on loopback;
its endpoint is also published in ``s3_server.ENDPOINT_ENV`` for child processes. Each package
makes its own buckets on it (``tests/contract``: the contract's bucket in its ``s3_endpoint``;
``tests/catalog``: its own).

``pg_uri``: a PostgreSQL server (``tests/pg_server.py``) with pyiceberg's SQL catalog tables;
its SQLAlchemy URI (with the password) is also published in ``pg_server.URI_ENV``.

The suite runs in parallel processes (``scripts/test.sh``: pytest-xdist), each with its own
servers and Spark session. Tests are handed out longest first (``tests/durations.json``, the
seconds each test took in a recorded run; a test not in it counts as its marker says), file by
file, the files with the most recorded seconds first, each file to whichever process is free
(``--dist loadfile --no-loadscope-reorder``). A file's tests run together, one after another,
in one process: spread out or interleaved with other files' tests, each process and each return
to a file set its module-scoped fixtures up again (the killed
drivers of ``test_driver_kill`` ran three times in one run). ``ICESTATE_RECORD_DURATIONS=1``
rewrites the file from the run.
The suite's wall time is reported at its end against its budget. ``ICESTATE_TEST_TIMELINE=FILE``
writes each test's phases (start, stop, process) as JSON lines, to see where a run's time goes
(``python -m tests.timeline FILE``).

``--fast`` (``scripts/test.sh --fast``): the tier for editing, the tests that start no Spark, are
not marked slow and took under ``FAST_TEST_S`` in the recorded run (a test not yet recorded
counts as fast); the rest are deselected, and the report says how many.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Every Python process of the tests (test processes, drivers and CLI calls in subprocesses, Spark's
# Python workers, which inherit the JVM's environment) runs polars on one thread: on the tests'
# small frames a pool of two threads only adds its hand-offs (the model tests 176 -> 148 CPU-s),
# and the suite's processes already keep both cores busy. A user's processes are not touched;
# POLARS_MAX_THREADS set before the run wins.
os.environ.setdefault("POLARS_MAX_THREADS", "1")

from tests import jvm_archive, pg_server, s3_server

# Every JVM the tests start (the shared Spark sessions, drivers in subprocesses, the standalone
# cluster, the Connect server) compiles with C1 alone, collects with the serial collector and maps
# the classes Spark loads from a class-data-sharing archive when ``python -m tests.jvm_archive``
# (scripts/test.sh) wrote one (``tests/jvm_archive.py``: a fresh session's CPU 16-17 -> 10 s). A
# user's JVMs are not touched; ICESTATE_TEST_JDK_OPTIONS="" keeps the JVM's defaults but for this: their temporary
# files go where the tests' own do ($TMPDIR: scripts/test.sh gives each run its own directory).
os.environ.setdefault("JDK_JAVA_OPTIONS", " ".join((
    os.environ.get("ICESTATE_TEST_JDK_OPTIONS", jvm_archive.jvm_options()),
    f"-Djava.io.tmpdir={tempfile.gettempdir()}")).strip())

# What the whole suite may take on the reference machine (2 cores), README's test command.
SUITE_BUDGET_S = 15 * 60
_STARTED = time.monotonic()
DURATIONS = Path(__file__).with_name("durations.json")
# Seconds assumed for a test missing from DURATIONS (a new one): its marker's tier.
_UNKNOWN_SLOW_S, _UNKNOWN_S = 20.0, 0.5
_durations_taken: dict[str, float] = {}
# The longest a test may have taken in the recorded run to be in the fast tier (``--fast``).
FAST_TEST_S = 1.5


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help=f"only the tests that start no Spark, are not marked slow and took under {FAST_TEST_S} s "
                          "in the recorded run (tests/durations.json)")


def _base_id(nodeid: str) -> str:
    """A test's id without the ``@group`` that xdist's loadgroup appends."""
    return nodeid.split("@")[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _recorded_durations() -> dict[str, float]:
    try:
        recorded = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in recorded.items()} if isinstance(recorded, dict) else {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # trylast: after the packages' hooks have marked their tests (``spark``). Longest first; a
    # stable sort, the same in every process (xdist checks that its workers collected one order).
    recorded = _recorded_durations()

    def expected_s(item: pytest.Item) -> float:
        base = _base_id(item.nodeid)
        if base in recorded:
            return recorded[base]
        return _UNKNOWN_SLOW_S if item.get_closest_marker("slow") is not None else _UNKNOWN_S

    # A file's tests stay together, in file order (their module-scoped fixtures are set up once),
    # the files ranked by their total: xdist hands out whole files (--dist loadfile).
    totals: dict[str, float] = {}
    for item in items:
        totals[_file_of(item)] = totals.get(_file_of(item), 0.0) + expected_s(item)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-totals[_file_of(item)], _file_of(item), order[id(item)]))
    if config.getoption("fast"):
        def fast(item: pytest.Item) -> bool:
            return (item.get_closest_marker("spark") is None and item.get_closest_marker("slow") is None
                    and recorded.get(_base_id(item.nodeid), 0.0) < FAST_TEST_S)

        kept = [item for item in items if fast(item)]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if not fast(item)])
            items[:] = kept


def _tree_cpu_s() -> float:
    """CPU seconds of this process and every live process under it (its JVM, Python workers,
    drivers in subprocesses), with those of the children they reaped (Linux only)."""
    from benchmarks.streaming.cpu import process_tree_cpu_s

    return process_tree_cpu_s(os.getpid())


def _machine_busy_s() -> float:
    from benchmarks.streaming.cpu import machine_cpu_s

    return machine_cpu_s()[0]


_TIMELINE_CPU = bool(os.environ.get("ICESTATE_TEST_TIMELINE")) and os.path.isdir("/proc")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # With the timeline on, each phase's CPU seconds (the worker's process tree) go to the
    # controller with the report; a phase's start is the previous phase's end.
    outcome = yield
    if not _TIMELINE_CPU:
        return
    now = _tree_cpu_s()
    before = item.stash.get(_CPU_KEY, now) if call.when != "setup" else item.stash.get(_CPU_START_KEY, now)
    item.stash[_CPU_KEY] = now
    report = outcome.get_result()
    report.user_properties += [("cpu_s", round(now - before, 2)), ("machine_busy_s", _machine_busy_s())]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if _TIMELINE_CPU:
        item.stash[_CPU_START_KEY] = _tree_cpu_s()
    yield


_CPU_KEY = pytest.StashKey[float]()
_CPU_START_KEY = pytest.StashKey[float]()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # On the controller, the workers' reports of setup, call and teardown.
    test = _base_id(report.nodeid)
    _durations_taken[test] = _durations_taken.get(test, 0.0) + report.duration
    timeline = os.environ.get("ICESTATE_TEST_TIMELINE")
    if timeline and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller's copy of the report
        node = getattr(report, "node", None)
        worker = node.gateway.id if node is not None else "main"
        with open(timeline, "a") as f:
            props = dict(report.user_properties)
            f.write(json.dumps({"test": test, "when": report.when, "start": report.start, "stop": report.stop,
                                "worker": worker, "cpu_s": props.get("cpu_s"),
                                "machine_busy_s": props.get("machine_busy_s")}) + "\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or not os.environ.get("ICESTATE_RECORD_DURATIONS"):
        return
    if session.config.option.markexpr or session.config.option.keyword:
        return  # a selection: keep the whole suite's record
    merged = {**_recorded_durations(), **{k: round(v, 2) for k, v in _durations_taken.items()}}
    DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # a worker of pytest-xdist: the controller reports
    wall = time.monotonic() - _STARTED
    over = "" if wall <= SUITE_BUDGET_S else f", over its budget by {(wall - SUITE_BUDGET_S) / 60:.1f} min"
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or str(getattr(config.option, "numprocesses", None) or 1)
    terminalreporter.write_line(f"suite wall time: {wall / 60:.1f} min in {workers} process(es) "
                                f"(budget {SUITE_BUDGET_S // 60} min on 2 cores{over})")


@pytest.fixture(scope="session")
def s3_server_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint (``http://127.0.0.1:<port>``) of moto's S3 server, one for the session."""
    server = s3_server.start(tmp_path_factory.mktemp("moto"))
    os.environ[s3_server.ENDPOINT_ENV] = server.endpoint  # for child processes
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The SQLAlchemy URI of a real PostgreSQL server on loopback for the whole session
    (``tests.pg_server``; also in ``pg_server.URI_ENV`` for child processes), with pyiceberg's
    SQL catalog tables created. Skipped where PostgreSQL is not installed, except on CI
    (``CI`` set), whose setup installs it: there a missing server fails the tests."""
    reason = pg_server.unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL tests cannot run on CI: {reason}")
        pytest.skip(reason)
    server = pg_server.start(tmp_path_factory.mktemp("postgres"))
    try:
        from pyiceberg.catalog.sql import SqlCatalog

        # Created once, here: processes that open their first table together (a writer and
        # its compactor) would otherwise race to create them.
        SqlCatalog("setup", uri=server.uri, init_catalog_tables="true").close()
        yield server.uri
    finally:
        server.stop()
