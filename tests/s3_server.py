"""A real S3-protocol server for tests: moto's standalone server, a process on loopback.

``start()`` runs ``moto_server`` on a free port of 127.0.0.1 (once per test session, from a
fixture) and waits until it answers; the session's fixture publishes its endpoint in
``ENDPOINT_ENV`` so that child processes of the tests (crash children) reach the same server
(a server of one module published there would outlive its stop in the variable). Nothing is mocked: the
store, pyiceberg and pyarrow talk HTTP to it as to any S3 endpoint.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ENDPOINT_ENV = "ICESTATE_TEST_S3_ENDPOINT"
REGION = "us-east-1"
# moto accepts any credentials; real ones never appear in tests.
ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"
START_TIMEOUT_S = 30


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def available() -> bool:
    """Whether moto's server can be started here (the ``moto[server]`` test extra)."""
    return _server_command() is not None


def start(log_dir: Path) -> S3Server:
    command = _server_command()
    if command is None:
        raise RuntimeError("moto_server not found: install the test extras (pip install -e '.[test]')")
    port = _free_port()
    log = open(log_dir / "moto_server.log", "w")  # noqa: SIM115 - the process writes it until stopped
    process = subprocess.Popen([*command, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log,
                               stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            break
        except OSError as e:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"moto_server did not start on {endpoint}; see {log_dir / 'moto_server.log'}") from e
            time.sleep(0.1)
    return S3Server(endpoint, process)


def properties(endpoint: str) -> dict[str, str]:
    """pyiceberg FileIO properties for the server."""
    return {
        "s3.endpoint": endpoint,
        "s3.access-key-id": ACCESS_KEY_ID,
        "s3.secret-access-key": SECRET_ACCESS_KEY,
        "s3.region": REGION,
    }


def create_bucket(endpoint: str, bucket: str) -> None:
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(access_key=ACCESS_KEY_ID, secret_key=SECRET_ACCESS_KEY, region=REGION,
                           endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)
    fs.create_dir(bucket)


def _server_command() -> list[str] | None:
    # The server of this interpreter's environment (the project's venv), not another one on PATH.
    found = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    return [found] if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
