"""A Spark standalone cluster on 127.0.0.1 for tests and benchmarks: a master and workers,
separate JVMs started with the installed pyspark's ``bin/spark-class``.

Each worker offers one core and runs in a mount namespace of its own where the cluster's
``driver_only`` directory is an empty tmpfs: its executors cannot read what a driver keeps
there, as on another host. Every daemon runs in a session of its own: stopping it stops every
executor it started (``standalone_cluster`` stops them all on exit).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from statestore.faults import FAIL_FIRST_ATTEMPT_ENV, KILL_ENV
from tests.integration.process_helpers import free_port, stop_session, tail

START_TIMEOUT_S = 180


class ClusterError(RuntimeError):
    """A daemon of the cluster exited, or the workers did not register in time."""


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@dataclass
class Cluster:
    master_url: str
    ui_url: str
    processes: list[subprocess.Popen]
    logs: list[Path]
    env: dict[str, str]
    driver_only: Path  # the workers (and their executors) see an empty directory here
    root: Path  # the daemons' logs and the workers' directories (executors' stdout and stderr)
    worker_memory: str = "1g"
    worker_cores: int = 1  # task slots per worker (its executor's cores)

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.ui_url}/json/", timeout=5) as r:
            return json.loads(r.read().decode())

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{tail(p, 4000)}" for p in self.logs)

    def start(self, name: str, args: list[str], extra: dict[str, str] | None = None, hidden: bool = False) -> None:
        """Start a daemon (``spark-class`` with ``args``) in a session of its own: stopping it
        stops every executor it started. ``hidden``: in a mount namespace of its own where
        ``driver_only`` is an empty tmpfs, so its executors cannot read what the driver keeps
        there (its SQLite catalog, its Spark checkpoints), as on another host."""
        hide = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount -t tmpfs -o size=1m icestate-hidden "$0" && exec "$@"', str(self.driver_only)]
        log = self.root / f"{name}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.processes.append(subprocess.Popen(
                [*(hide if hidden else []), self.env["SPARK_HOME"] + "/bin/spark-class", *args],
                env={**self.env, **(extra or {})}, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True))

    def add_worker(self, i: int) -> None:
        """Worker ``i``: ``worker_cores`` task slots, its own directory, hidden from the driver's disk."""
        self.start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", self.master_url, "--host", "127.0.0.1",
                                  "--cores", str(self.worker_cores), "--memory", self.worker_memory,
                                  "--webui-port", str(free_port())],
                   {"SPARK_WORKER_DIR": str(self.root / f"work{i}")}, hidden=True)

    def wait_workers(self, n: int) -> None:
        """Return once ``n`` workers are registered and alive."""
        deadline = time.monotonic() + START_TIMEOUT_S
        alive = 0
        while alive < n:
            dead = [p.args for p in self.processes if p.poll() is not None]
            if dead:
                raise ClusterError(f"standalone process(es) {dead} exited\n{self.log_tails()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{alive}/{n} workers registered after {START_TIMEOUT_S} s\n{self.log_tails()}")
            with contextlib.suppress(OSError, ValueError):
                alive = sum(w["state"] == "ALIVE" for w in self.state()["workers"])
            time.sleep(0.5)


@contextlib.contextmanager
def standalone_cluster(root: Path, workers: int, worker_memory: str = "1g", worker_cores: int = 1
                       ) -> Iterator[Cluster]:
    """A master and ``workers`` workers (``worker_cores`` task slots and ``worker_memory`` each)
    with their files under ``root``; every process stopped on exit."""
    home = _spark_home()
    conf_dir = root / "conf"  # empty: no spark-env.sh or defaults from elsewhere
    conf_dir.mkdir(parents=True)
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_CONF_DIR": str(conf_dir),
        "SPARK_LOG_DIR": str(root / "logs"),
        "SPARK_LOCAL_DIRS": str(root / "local"),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_PUBLIC_DNS": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_DAEMON_MEMORY": "256m",
    }
    for name in (KILL_ENV, FAIL_FIRST_ATTEMPT_ENV):  # no fault injection (another module's session sets one)
        env.pop(name, None)
    port, ui_port = free_port(), free_port()
    master_url, ui_url = f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}"
    driver_only = root / "driver-only"
    driver_only.mkdir()
    c = Cluster(master_url, ui_url, [], [], env, driver_only, root, worker_memory, worker_cores)
    try:
        c.start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                           "--webui-port", str(ui_port)])
        for i in range(workers):
            c.add_worker(i)
        c.wait_workers(workers)
        yield c
    finally:
        for p in reversed(c.processes):
            stop_session(p, grace_s=15)
