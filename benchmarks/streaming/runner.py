"""The driver of the streaming benchmark: runs jobs one at a time, each in a fresh worker
process (``benchmarks.streaming.worker``), after waiting for the shared machine to be quiet.

With ``one_driver`` (the suite's tiny mode, a smoke run of every code path whose figures mean
nothing), the jobs run one after the other in one worker process that serves them (each still
builds and stops its own SparkSession, on the JVM the first one started): a fresh driver costs
15-20 s of a 2-core machine, a new session on a running JVM about one.
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
    one_driver: bool = False
    jobs_run: int = 0
    _server: subprocess.Popen | None = None

    def wait_for_quiet(self) -> dict:
        """Wait (at most ``quiet_wait_s``) until other processes keep the machine less than
        ``quiet_busy_max`` busy, so that a job does not start in the middle of someone's test run."""
        t0 = time.perf_counter()
        # Not waiting (quiet_wait_s 0, the suite's tiny mode): a short look, for the record.
        busy = machine_busy_fraction(2.0 if self.quiet_wait_s > 0 else 0.2)
        while busy > self.quiet_busy_max and time.perf_counter() - t0 < self.quiet_wait_s:
            if time.perf_counter() - t0 < 3:
                console.log(f"  machine {busy:.0%} busy with other work: waiting up to {self.quiet_wait_s:.0f} s")
            busy = machine_busy_fraction(5.0)
        return {"busy_before": busy, "waited_s": time.perf_counter() - t0}

    def run(self, job: dict, title: str) -> dict:
        """Run one job in a fresh Python process (or the serving one, ``one_driver``); returns its
        result, or {"error": ...}."""
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
        t0 = time.perf_counter()
        result_path = Path(job["result"])
        if self.one_driver:
            log = self.root / "scratch" / "one-driver-log.txt"
            console.log(f"[bold]{title}[/bold] (in the one driver; log: {log})")
            failed = self._serve(job_path, result_path, log)
        else:
            console.log(f"[bold]{title}[/bold] (log: {log})")
            failed = self._fresh(job_path, log)
        if failed is not None:
            return failed
        if not result_path.exists():
            return {"error": f"worker exited without a result: {log.read_text()[-1500:]}"}
        result = json.loads(result_path.read_text())
        result["process_s"] = time.perf_counter() - t0
        result["machine"] = quiet | result.pop("cpu", {})
        if "error" in result:
            console.log(f"  [red]failed[/red]: {result['error'][:300]}")
        elif result["machine"].get("other_cores", 0) > 0.3:
            console.log(f"  [yellow]other processes used {result['machine']['other_cores']:.1f} cores during the "
                        "measurement: treat its figures with care[/yellow]")
        return result

    def _fresh(self, job_path: Path, log: Path) -> dict | None:
        """Run the job in a process of its own; an error result when it timed out."""
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
        return None

    def _serve(self, job_path: Path, result_path: Path, log: Path) -> dict | None:
        """Hand the job to the serving worker (started on first use) and wait for its result
        file; an error result when the worker died or the job timed out (the worker is then
        killed, and the next job starts a new one)."""
        if self._server is None or self._server.poll() is not None:
            with log.open("a") as out:
                self._server = subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.streaming.worker", "--serve"], stdin=subprocess.PIPE,
                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=repo_env(), start_new_session=True, text=True)
        server = self._server
        assert server.stdin is not None
        server.stdin.write(f"{job_path}\n")
        server.stdin.flush()
        deadline = time.perf_counter() + self.timeout_s
        while not result_path.exists():  # written whole, by a rename
            if server.poll() is not None:
                return {"error": f"the serving worker exited {server.returncode}: {log.read_text()[-1500:]}"}
            if time.perf_counter() > deadline:
                os.killpg(server.pid, signal.SIGKILL)  # the stuck job, its process and the JVM it started
                server.wait()
                self._server = None
                return {"error": f"timed out after {self.timeout_s:.0f} s"}
            time.sleep(0.1)
        return None

    def close(self) -> None:
        """Stop the serving worker, if one runs (and the JVM it started)."""
        server, self._server = self._server, None
        if server is None:
            return
        if server.poll() is None:
            assert server.stdin is not None
            server.stdin.close()  # end of jobs: it stops its session and exits
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def stream_job(impl: str, source: Path, root: Path, label: str, sample: dict[str, int],
               parallelism: int = 4, sink: str = "checksum", store_config: dict | None = None) -> dict:
    """A stream job of ``impl`` over the files in ``source``; its checkpoint and state table are
    named by ``label``, so a later job with the same label restarts the same query. ``sink``:
    "checksum" (each batch's output checked) or "noop" (computed and dropped); ``store_config``:
    ours' ``StoreConfig`` fields."""
    return {"kind": "stream", "impl": impl, "source": str(source), "checkpoint": str(root / "checkpoints" / label),
            "warehouse": str(root / "warehouse"), "table": label.replace("-", "_"), "parallelism": parallelism,
            "sample_keys": sorted(sample), "sink": sink, "store_config": store_config}
