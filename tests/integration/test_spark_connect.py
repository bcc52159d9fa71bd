"""Spark Connect: the runner, the ticks source, the data source and the state figures under a
Spark Connect session (``remote("local[2]")``: a local Connect server, no JVM on the client),
as under a classic one.

The driver runs in a subprocess of its own (``connect_driver.py``): a process holds either a
classic session (the test session's) or a Connect client, and the server's Python processes
(the batch function, the ticks source) are the same as on a real Connect deployment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.process_helpers import stop_session, tail


@pytest.mark.timeout(600)
def test_stateful_queries_under_spark_connect(tmp_path: Path):
    log = tmp_path / "driver.log"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYTHONPATH": os.getcwd()}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.connect_driver", str(tmp_path / "work")],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=540)
        finally:
            stop_session(proc)
    text = tail(log, 30000)
    results = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert code == 0 and results, text
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
    name, message, notes, cause = got["failure"]
    assert (name, message) == ("KeyError", "'no profile for b'")
    assert notes[0] == "raised by FailingProcessor.handleInputRows for key ('b',)"
    assert cause == "StreamingQueryException"
