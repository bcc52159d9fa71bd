"""Where a test run's time went, from the lines ``ICESTATE_TEST_TIMELINE=FILE`` wrote
(``tests/conftest.py``): per process, the time in tests against the run's span, the gaps
between tests, the longest tests and modules, and those that used the most CPU (each test
process's own and that of every process under it: its JVM, workers, drivers it started).

    python -m tests.timeline FILE
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
from pathlib import Path


def _tally(rows: list[dict], value) -> tuple[collections.Counter, collections.Counter]:
    """``value`` of the rows summed per test and per module."""
    per_test, per_module = collections.Counter(), collections.Counter()
    for r in rows:
        per_test[r["test"]] += value(r)
        per_module[r["test"].split("::")[0]] += value(r)
    return per_test, per_module


def main(path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    if not rows:
        raise SystemExit(f"{path} holds no test phases: was the run started with ICESTATE_TEST_TIMELINE={path}?")
    begin, end = min(r["start"] for r in rows), max(r["stop"] for r in rows)
    print(f"span {(end - begin) / 60:.1f} min, {len({r['test'] for r in rows})} tests")
    by_worker = collections.defaultdict(list)
    for r in rows:
        by_worker[r["worker"]].append(r)
    for worker, phases in sorted(by_worker.items()):
        phases.sort(key=lambda r: r["start"])
        busy = sum(r["stop"] - r["start"] for r in phases)
        gaps = [(b["start"] - a["stop"], a["test"], b["test"]) for a, b in itertools.pairwise(phases)]
        idle = sum(g for g, *_ in gaps if g > 0)
        first, last = phases[0]["start"] - begin, end - phases[-1]["stop"]
        print(f"{worker}: in tests {busy / 60:.1f} min, between tests {idle / 60:.1f} min, "
              f"before its first {first:.0f} s, after its last {last:.0f} s")
        for g, a, b in sorted(gaps, reverse=True)[:5]:
            print(f"    gap {g:.1f} s after {a} before {b}")
    per_test, per_module = _tally(rows, lambda r: r["stop"] - r["start"])
    print("longest modules:")
    for name, s in per_module.most_common(15):
        print(f"  {s:7.1f} s  {name}")
    print("longest tests:")
    for name, s in per_test.most_common(15):
        print(f"  {s:7.1f} s  {name}")
    cpu_test, cpu_module = _tally([r for r in rows if r.get("cpu_s") is not None], lambda r: r["cpu_s"])
    busy = sorted((r["stop"], r["machine_busy_s"]) for r in rows if r.get("machine_busy_s") is not None)
    if len(busy) > 1 and busy[-1][0] > busy[0][0]:
        cores = os.cpu_count() or 1
        fraction = (busy[-1][1] - busy[0][1]) / (busy[-1][0] - busy[0][0]) / cores
        print(f"the machine's {cores} cores were {fraction:.0%} busy over the run (all processes, from /proc/stat)")
    if cpu_module:
        total = sum(cpu_module.values())
        print(f"CPU of the processes under each test's process: {total / 60:.1f} min in all "
              f"({total / (end - begin):.2f} cores on average over the span)")
        print("modules using most CPU (CPU s, wall s):")
        for name, s in cpu_module.most_common(25):
            print(f"  {s:7.1f}  {per_module[name]:7.1f}  {name}")
        print("tests using most CPU (CPU s, wall s):")
        for name, s in cpu_test.most_common(15):
            print(f"  {s:7.1f}  {per_test[name]:7.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
