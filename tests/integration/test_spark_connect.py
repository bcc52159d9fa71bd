"""Spark Connect: the runner, the ticks source, the data source and the state figures under a
Spark Connect session, as under a classic one.

As on a real deployment, the server and the client are processes of their own: the server
(``connect_server.py``, a local-mode Spark with the Connect plugin) listens on a free loopback
port and runs the batch function and the ticks source in its Python workers; the driver
(``connect_driver.py``) is a Connect client with no JVM.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.process_helpers import free_port, stop_session, tail, wait_for_port


@pytest.mark.spark  # a Spark Connect server and its driver, in processes of their own
@pytest.mark.slow
@pytest.mark.timeout(720)
def test_stateful_queries_under_spark_connect(tmp_path: Path):
    port = free_port()
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYTHONPATH": os.getcwd(), "SPARK_CONNECT_AUTHENTICATE_TOKEN": secrets.token_hex(16)}
    for name in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE"):
        env.pop(name, None)
    server_log, log = tmp_path / "server.log", tmp_path / "driver.log"
    with open(server_log, "w") as server_out, open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "tests.integration.connect_server", str(port)],
                                  stdout=server_out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            assert wait_for_port(port, server, timeout_s=180), tail(server_log)
            # "localhost", not 127.0.0.1: the client sends its token over gRPC's local credentials
            # only to a host of that name (any other host means TLS).
            proc = subprocess.Popen([sys.executable, "-m", "tests.integration.connect_driver", str(tmp_path / "work"),
                                     f"sc://localhost:{port}"],
                                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                code = proc.wait(timeout=540)
            finally:
                stop_session(proc)
        finally:
            stop_session(server)
    text = tail(log, 30000)
    results = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert code == 0 and results, text + tail(server_log)
    got = json.loads(results[-1][len("RESULT "):])
    assert got["session"].startswith("pyspark.sql.connect")
    # Timers fire in the next batch and, after the input, in a batch without input (3).
    assert got["sessions_error"] == "None"
    assert got["sessions"] == [
        [0, [["a", 2, False], ["b", 1, False]]],
        [1, [["a", 2, True], ["b", 2, False], ["c", 1, False]]],
        [2, [["b", 2, True], ["c", 2, False]]],
        [3, [["c", 2, True]]],
    ]
    assert got["scratch_left"] == []  # the callback's files go once it ran
    assert got["counts_error"] == "None"
    assert got["state"] == [["a", 3], ["b", 2], ["c", 1], ["d", 1]]
    # The figures reach a listener of the Connect client (batch n's progress: batch n-1's; the
    # last batch's when Spark asks the sources again after it).
    assert {"0", "1"} <= set(got["figures"])
    assert got["figures"]["0"]["numRowsUpdated"] == 2 and got["figures"]["1"]["numEntriesTotal"] == 5
    # An existing job's own code, switched by enable(spark, ...): on icestate, as Spark would emit.
    assert got["dropin_error"] == "None" and got["dropin_table"] is True
    assert got["dropin"] == [[0, [["a", 2], ["b", 1]]], [1, [["a", 3], ["b", 2], ["c", 1]]]]
    # The same job into the memory, parquet, foreach and console sinks: Spark's rows, each once.
    assert got["sinks_error"] == dict.fromkeys(("memory", "parquet", "foreach", "console"), "None")
    every = [["a", 2], ["b", 1], ["a", 3], ["b", 2], ["c", 1]]  # both batches' updates
    assert got["sink_memory"] == got["sink_parquet"] == got["sink_foreach"] == sorted(every)
    assert got["sink_parquet_log"] == ["0", "1"]
    assert "Batch: 1" in server_log.read_text(errors="replace")  # the console sink prints on the server
    # A hostile input value in the processor's message ran no code (in the server's Python
    # process or the client), and the processor's exception came out as itself.
    assert got["marker_made"] is False
    name, message_is_the_processors, notes, cause = got["failure"]
    assert (name, message_is_the_processors) == ("KeyError", True)
    assert notes[0] == "raised by FailingProcessor.handleInputRows for key ('<hostile>',)"
    assert cause == "StreamingQueryException"
