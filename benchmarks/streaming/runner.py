"""The driver of the streaming benchmark: runs jobs one at a time, each in a fresh worker
process (``benchmarks.streaming.worker``), after waiting for the shared machine to be quiet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import REPO, console, repo_env
from benchmarks.streaming.cpu import machine_busy_fraction


@dataclass
class Runner:
    root: Path
    driver_memory: str
    timeout_s: float
    quiet_wait_s: float
    quiet_busy_max: float = 0.25
    jobs_run: int = 0

    def wait_for_quiet(self) -> dict:
        """Wait (at most ``quiet_wait_s``) until other processes keep the machine less than
        ``quiet_busy_max`` busy, so that a job does not start in the middle of someone's test run."""
        t0 = time.perf_counter()
        busy = machine_busy_fraction(2.0)
        while busy > self.quiet_busy_max and time.perf_counter() - t0 < self.quiet_wait_s:
            if time.perf_counter() - t0 < 3:
                console.log(f"  machine {busy:.0%} busy with other work: waiting up to {self.quiet_wait_s:.0f} s")
            busy = machine_busy_fraction(5.0)
        return {"busy_before": busy, "waited_s": time.perf_counter() - t0}

    def run(self, job: dict, title: str) -> dict:
        """Run one job in a fresh Python process; returns its result, or {"error": ...}."""
        self.jobs_run += 1
        name = f"job-{self.jobs_run:02d}-{job['impl']}-{job['kind']}"
        scratch = self.root / "scratch" / name
        scratch.mkdir(parents=True)
        job = {**job, "driver_memory": self.driver_memory, "scratch": str(scratch),
               "result": str(scratch / "result.json")}
        job_path = scratch / "job.json"
        job_path.write_text(json.dumps(job))
        log = scratch / "log.txt"
        quiet = self.wait_for_quiet()
        console.log(f"[bold]{title}[/bold] (log: {log})")
        t0 = time.perf_counter()
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.streaming.worker", str(job_path)],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=repo_env(),
                                    start_new_session=True)
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and the JVM it started
                proc.wait()
                return {"error": f"timed out after {self.timeout_s:.0f} s"}
        result_path = Path(job["result"])
        if not result_path.exists():
            return {"error": f"worker exited {proc.returncode} without a result: {log.read_text()[-1500:]}"}
        result = json.loads(result_path.read_text())
        result["process_s"] = time.perf_counter() - t0
        result["machine"] = quiet | result.pop("cpu", {})
        if "error" in result:
            console.log(f"  [red]failed[/red]: {result['error'][:300]}")
        elif result["machine"].get("other_cores", 0) > 0.3:
            console.log(f"  [yellow]other processes used {result['machine']['other_cores']:.1f} cores during the "
                        "measurement: treat its figures with care[/yellow]")
        return result


def stream_job(impl: str, source: Path, root: Path, label: str, sample: dict[str, int],
               parallelism: int = 4, sink: str = "checksum", store_config: dict | None = None) -> dict:
    """A stream job of ``impl`` over the files in ``source``; its checkpoint and state table are
    named by ``label``, so a later job with the same label restarts the same query. ``sink``:
    "checksum" (each batch's output checked) or "noop" (computed and dropped); ``store_config``:
    ours' ``StoreConfig`` fields."""
    return {"kind": "stream", "impl": impl, "source": str(source), "checkpoint": str(root / "checkpoints" / label),
            "warehouse": str(root / "warehouse"), "table": label.replace("-", "_"), "parallelism": parallelism,
            "sample_keys": sorted(sample), "sink": sink, "store_config": store_config}
