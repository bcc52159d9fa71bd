"""Subprocess plumbing shared by the tests that start Spark processes of their own
(standalone cluster, killed drivers): log tails and cleanup of a whole session."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Whether something accepts connections on loopback ``port`` within ``timeout_s`` (False at
    once when ``proc``, the process meant to listen there, has exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        time.sleep(0.5)
    return False


def tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of a session: a driver or daemon, its JVM, executors, and the
    JVMs' Python daemons and workers (which put themselves in process groups of their own)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                members.append(int(entry))
    return members


def stop_session(proc: subprocess.Popen, grace_s: float = 0, timeout_s: float = 60) -> None:
    """Stop a process started in a session of its own (SIGTERM to its group and ``grace_s`` to
    exit, when given), then SIGKILL whatever is left of that session and wait until it is gone."""
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while (members := session_members(proc.pid)) and time.monotonic() < deadline:
        for pid in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
