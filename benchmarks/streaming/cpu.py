"""CPU accounting from ``/proc``: the machine is shared, so every job records how busy the
others kept it, and ``bench_spark_cpu`` splits a batch's CPU by process kind.

Linux only (reads ``/proc/stat`` and ``/proc/<pid>/stat``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

TICK_HZ = os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / TICK_HZ, sum(fields) / TICK_HZ


def machine_busy_fraction(interval_s: float) -> float:
    """The busy fraction of all cores over the next ``interval_s`` seconds."""
    b0, t0 = machine_cpu_s()
    time.sleep(interval_s)
    b1, t1 = machine_cpu_s()
    return (b1 - b0) / max(t1 - t0, 1e-9)


class CpuMeter:
    """CPU use of this process tree and of the rest of the machine between start and ``stop()``."""

    def __init__(self) -> None:
        self.t0, self.own0, self.machine0 = time.perf_counter(), process_tree_cpu_s(os.getpid()), machine_cpu_s()[0]

    def stop(self) -> dict:
        wall = time.perf_counter() - self.t0
        own = process_tree_cpu_s(os.getpid()) - self.own0
        others = max(machine_cpu_s()[0] - self.machine0 - own, 0.0)
        return {"own_cores": own / wall, "other_cores": others / wall}


def process_tree_cpu_s(root_pid: int) -> float:
    """CPU seconds used so far by ``root_pid`` and every live descendant (the JVM and its Python
    workers), plus the reaped children each of them has waited for."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # the fields after "pid (comm)"
        parents[int(entry.name)] = int(rest[1])
        times[int(entry.name)] = sum(int(v) for v in rest[11:15]) / TICK_HZ  # utime stime cutime cstime
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier += children
    return sum(times.get(pid, 0.0) for pid in tree)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (children of every thread: the JVM forks from many)."""
    found = [pid]
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for t in threads:
        try:
            children = Path(f"/proc/{pid}/task/{t}/children").read_text().split()
        except OSError:
            continue
        for c in children:
            found += _tree(int(c))
    return found


def _kind(cmdline: str) -> str:
    if "java" in cmdline:
        return "jvm"
    if "pyspark.daemon" in cmdline or "pyspark.worker" in cmdline:
        return "python_workers"
    if "catalog.compactor" in cmdline:
        return "compactor"
    return "driver"


def cpu_by_kind(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every live process under ``root``, by kind."""
    out: dict[str, float] = {}
    for pid in _tree(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        kind = _kind(cmdline)
        out[kind] = out.get(kind, 0.0) + (int(stat[11]) + int(stat[12])) / TICK_HZ
    return out
