"""Long-running processes hand back what they freed (``statestore.memory``).

* With ``LONG_RUNNING_ENV``, a process that freed most of many small Python objects, a few
  survivors spread among them, gets the freed pages back to the system with one
  ``return_freed_memory``; with Python's own allocator the survivors pin nearly every arena.
  Both in real interpreters started for the purpose.
* The settings for Spark's executors name exactly that environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from statestore import memory

ROOT = Path(__file__).resolve().parents[2]

# 1.5M strings of ~60 bytes (about 170 MB with their list), one in a thousand kept.
FRAGMENTED = textwrap.dedent("""
    import json, os
    from statestore import memory
    page = os.sysconf("SC_PAGE_SIZE")
    base = memory.rss_pages()
    objects = [str(i) * 8 for i in range(1_500_000)]
    survivors = objects[::1000]
    peak = memory.rss_pages()
    del objects
    freed = memory.return_freed_memory()
    after = memory.rss_pages()
    print(json.dumps({"grown_mb": (peak - base) * page / 2**20, "kept_mb": (after - base) * page / 2**20,
                      "freed_mb": freed, "survivors": len(survivors)}))
""")


def _fragmented(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in memory.LONG_RUNNING_ENV}
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], env={**clean, **env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_the_long_running_environment_returns_pages_that_survivors_would_pin():
    if memory.return_freed_memory() is None:
        pytest.skip("not glibc: no malloc_trim")
    default, long_running = _fragmented({}), _fragmented(memory.LONG_RUNNING_ENV)
    for figures in (default, long_running):
        assert figures["grown_mb"] > 100 and figures["survivors"] == 1500, figures
    # Python's arenas (1 MiB) each hold a dozen survivors: none goes back.
    assert default["kept_mb"] > 0.8 * default["grown_mb"], default
    # glibc's pages (4 KiB) hold one survivor in a few dozen: the trim returns the rest.
    assert long_running["kept_mb"] < 0.2 * long_running["grown_mb"], long_running
    assert long_running["freed_mb"] > 0.7 * long_running["grown_mb"], long_running


def test_the_executor_settings_carry_the_workers_environment():
    assert memory.spark_conf() == {"spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL": "system"}
    assert memory.LONG_RUNNING_ENV == {"PYTHONMALLOC": "malloc", "ARROW_DEFAULT_MEMORY_POOL": "system"}


SWITCH = textwrap.dedent("""
    import json
    import pyarrow as pa
    from statestore import memory
    before = pa.default_memory_pool().backend_name
    kept = pa.array(range(1000))  # allocated from the pool in use before the switch
    switched = memory.arrow_on_system_pool()
    again = memory.arrow_on_system_pool.__wrapped__()
    fresh = pa.array(range(1000))
    print(json.dumps({"before": before, "switched": switched, "again": again,
                      "after": pa.default_memory_pool().backend_name, "kept": kept.sum().as_py(),
                      "fresh": fresh.sum().as_py()}))
""")


def _switch(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    out = subprocess.run([sys.executable, "-c", SWITCH], env={**clean, **env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_a_worker_puts_arrow_on_the_system_allocator_unless_the_deployment_chose_a_pool():
    default = _switch({})
    assert default["before"] != "system" and default["switched"] and not default["again"], default
    assert default["after"] == "system" and default["kept"] == default["fresh"] == 499500, default
    chosen = _switch({"ARROW_DEFAULT_MEMORY_POOL": "jemalloc"})
    assert not chosen["switched"] and chosen["after"] == chosen["before"] == "jemalloc", chosen
