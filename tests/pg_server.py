"""A real PostgreSQL server for tests: ``initdb`` into a fresh directory, ``pg_ctl start``.

``start()`` (once per test session, from a fixture) makes a cluster that listens only on
127.0.0.1 at a free port (no Unix socket), with password (SCRAM) authentication for every
connection, a role ``icestate`` (not a superuser) and its database ``icestate``, as a team
would give a shared Iceberg SQL catalog. It publishes the SQLAlchemy URI of that database in
``URI_ENV`` so that child processes of the tests (crash children) reach the same server.

PostgreSQL refuses to run as root: when the tests run as root, every server program runs as
the unprivileged ``postgres`` user (``runuser``; Debian's package creates that user), and the
cluster's directory is made in /tmp and owned by it. The binaries come from PATH, else from
``/usr/lib/postgresql/<version>/bin`` (Debian's layout; ``scripts/setup.sh`` installs the
package when none is found).

Secrets: the passwords are random per session and never on a command line: ``initdb``
reads the superuser's from a file only ``postgres`` can read (deleted once the cluster
exists), the role's is set over a connection, and the URI lives in memory and in ``URI_ENV``.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

URI_ENV = "ICESTATE_TEST_PG_URI"
ROLE = "icestate"
DATABASE = "icestate"
ADMIN = "icestate_admin"
SERVER_USER = "postgres"  # who runs the server when the tests run as root
START_TIMEOUT_S = 60
# A test cluster: nothing here must survive a machine crash, so durability is traded for speed.
SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    "max_connections": "200",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
}


class ServerUnavailable(RuntimeError):
    """PostgreSQL cannot be started on this machine (no binaries, no user to run them as)."""


@dataclass
class PgServer:
    uri: str = field(repr=False)  # holds the password
    port: int
    base: Path
    bin_dir: Path
    log_dir: Path

    @property
    def data(self) -> Path:
        return self.base / "data"

    def stop(self) -> None:
        """Stop the server (fast shutdown), keep its log in ``log_dir``, remove the cluster."""
        try:
            _run(self.bin_dir, ["pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", "30"])
        finally:
            log = self.base / "server.log"
            if log.exists():
                shutil.copy(log, self.log_dir / "postgresql.log")
            if os.environ.get(URI_ENV) == self.uri:
                del os.environ[URI_ENV]
            shutil.rmtree(self.base, ignore_errors=True)


def bin_dir() -> Path | None:
    """The directory of PostgreSQL's server programs: PATH first, else the newest Debian version."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl", path=str(Path(on_path).resolve().parent)):
        return Path(on_path).resolve().parent

    def version(d: str) -> int:
        found = re.search(r"/(\d+)/bin$", d)
        return int(found.group(1)) if found else 0

    found = [d for d in glob.glob("/usr/lib/postgresql/*/bin") if os.path.isfile(os.path.join(d, "initdb"))]
    return Path(max(found, key=version)) if found else None


def unavailable_reason() -> str | None:
    """Why ``start`` cannot work here, or None."""
    if bin_dir() is None:
        return ("PostgreSQL server binaries not found (initdb on PATH or /usr/lib/postgresql/*/bin): "
                "run scripts/setup.sh, which installs Debian's postgresql package")
    try:
        import psycopg2  # noqa: F401 - the driver of postgresql+psycopg2:// URIs
    except ImportError:
        return "psycopg2 not installed: install the test extras (pip install -e '.[test]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root and there is no {SERVER_USER!r} user to run PostgreSQL as"
        if shutil.which("runuser") is None:
            return "running as root and runuser (util-linux) is missing"
    return None


def start(log_dir: Path, *, publish: bool = True) -> PgServer:
    """Start a fresh cluster (module docstring) and return it once it accepts connections;
    with ``publish``, its URI goes to ``URI_ENV`` (until ``stop``).

    Raises:
        ServerUnavailable: no binaries or no user to run them as (``unavailable_reason``).
        RuntimeError: the server did not start; the message ends with its log.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise ServerUnavailable(reason)
    bins = bin_dir()
    assert bins is not None
    base = Path(tempfile.mkdtemp(prefix="icestate-pg-"))
    try:
        server = _start(bins, base, log_dir)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    if publish:
        os.environ[URI_ENV] = server.uri
    return server


def _start(bins: Path, base: Path, log_dir: Path) -> PgServer:
    admin_password = secrets.token_urlsafe(24)
    password = secrets.token_urlsafe(24)
    data = base / "data"
    pwfile = base / "pwfile"
    fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(admin_password + "\n")
    if os.geteuid() == 0:
        server_user = pwd.getpwnam(SERVER_USER)
        for path in (base, pwfile):
            os.chown(path, server_user.pw_uid, server_user.pw_gid)
    try:
        _run(bins, ["initdb", "-D", str(data), "-U", ADMIN, f"--pwfile={pwfile}", "--auth=scram-sha-256",
                    "-E", "UTF8", "--locale=C", "--no-sync"])
    finally:
        pwfile.unlink()
    port = _free_port()
    with open(data / "postgresql.conf", "a") as conf:
        conf.write("\n# icestate tests (tests/pg_server.py)\n")
        conf.write("".join(f"{k} = {v}\n" for k, v in {**SETTINGS, "port": str(port)}.items()))
    log = base / "server.log"
    try:
        _run(bins, ["pg_ctl", "start", "-D", str(data), "-l", str(log), "-w", "-t", str(START_TIMEOUT_S)])
        admin = _connect(port, ADMIN, admin_password, "postgres")
    except Exception as e:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        raise RuntimeError(f"PostgreSQL did not start on 127.0.0.1:{port} ({e}); its log ends:\n{tail}") from None
    server = PgServer(f"postgresql+psycopg2://{ROLE}:{password}@127.0.0.1:{port}/{DATABASE}", port, base, bins,
                      log_dir)
    try:
        admin.autocommit = True
        with admin.cursor() as cur:
            # Quoted by the driver; sent over the loopback connection only (statement logging is off).
            cur.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD %s", (password,))
            cur.execute(f"CREATE DATABASE {DATABASE} OWNER {ROLE}")
        admin.close()
        _connect(port, ROLE, password, DATABASE).close()
    except BaseException:
        server.stop()
        raise
    return server


def _connect(port: int, user: str, password: str, dbname: str):
    """A psycopg2 connection, retried until the server accepts it (``pg_ctl -w`` already waited)."""
    import psycopg2

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return psycopg2.connect(host="127.0.0.1", port=port, user=user, password=password, dbname=dbname,
                                    connect_timeout=2)
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _run(bins: Path, command: list[str]) -> None:
    """Run one of PostgreSQL's programs, as ``SERVER_USER`` when root; its output in the error."""
    argv = [str(bins / command[0]), *command[1:]]
    if os.geteuid() == 0:
        argv = ["runuser", "-u", SERVER_USER, "--", *argv]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd="/",
                          timeout=START_TIMEOUT_S + 30)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stdout[-1000:]}{done.stderr[-1000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
