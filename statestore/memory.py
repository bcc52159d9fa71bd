"""Long-running processes hand the memory they freed back to the system.

A reused Spark Python worker and the compactor process live as long as the query and allocate
and free per batch from three allocators: Python's own (pymalloc: 1 MiB arenas, returned only
when wholly empty), glibc's (heaps returned only from their top unless trimmed) and Arrow's
(mimalloc by default: it keeps the pages its threads freed). Over 90-minute soaks each process's
resident memory stepped up by 8-13 MB once or twice, 15-35 minutes in, in whichever of the
three happened to keep a batch's high-water mark (``docs/reliability.md``, "Soak").

(Polars' own jemalloc, a fourth, hands freed pages back by itself: polars sets its decay to
half a second, then one, at import.)

``LONG_RUNNING_ENV`` puts all three on glibc's allocator (Python's small objects and Arrow's
buffers alike), so that one ``malloc_trim`` hands back every free page wherever it lies; the
compactor process is started with it. ``WORKER_ENV``, Arrow's buffers on glibc's allocator alone,
is what the task runner puts a worker on at its first task unless the deployment chose a pool
(``arrow_on_system_pool``; ``spark_conf`` gives it as ``spark.executorEnv.*`` settings, as the soak
sets it): flat over 90 minutes like the whole setting, without the 1.6x that Python's objects on
glibc cost the Spark-API processors with list and map state. ``return_freed_memory`` is the trim.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import pyarrow as pa

# The environment of a long-running Python process whose memory must stay flat: Python's
# objects and Arrow's buffers from glibc's allocator, which ``malloc_trim`` can empty.
LONG_RUNNING_ENV = {"PYTHONMALLOC": "malloc", "ARROW_DEFAULT_MEMORY_POOL": "system"}
# The part of it Spark's Python workers get: Arrow's buffers on glibc's allocator. Python's own
# allocator stays, as glibc's for Python's objects made the per-key processors 1.6x slower.
WORKER_ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system"}

# glibc's mallopt parameter, and the threshold it is pinned at (glibc's default start).
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def spark_conf() -> dict[str, str]:
    """``WORKER_ENV`` as Spark settings for the executors' Python workers."""
    return {f"spark.executorEnv.{name}": value for name, value in WORKER_ENV.items()}


@functools.cache
def arrow_on_system_pool() -> bool:
    """Once per process: new Arrow buffers from glibc's allocator (``WORKER_ENV``'s setting, which
    one ``malloc_trim`` empties), unless the environment chose Arrow's pool. Buffers already
    allocated stay with the pool they came from. Whether this call switched."""
    if "ARROW_DEFAULT_MEMORY_POOL" in os.environ or pa.default_memory_pool().backend_name == "system":
        return False
    pa.set_memory_pool(pa.system_memory_pool())
    return True


@functools.cache
def _libc_function(name: str) -> Callable | None:
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def rss_pages() -> int:
    """This process's resident pages (0 where ``/proc`` is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])
    except OSError:
        return 0


def return_freed_memory() -> float | None:
    """Hand the pages glibc's allocator and Arrow's pool hold free back to the system
    (``malloc_trim``, ``MemoryPool.release_unused``) and return the megabytes this process's
    resident memory fell by; None where the C library is not glibc. A call costs 5-15 ms in a
    Spark worker: callers make it at most once a minute, or after a burst of work."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return None
    before = rss_pages()
    trim(0)
    # mimalloc (Arrow's default pool) keeps freed pages of its threads' heaps until asked: a
    # worker's mimalloc region held 33-48 MB while Arrow counted 0.1 MB allocated.
    pa.default_memory_pool().release_unused()
    return round((before - rss_pages()) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


@functools.cache
def pin_mmap_threshold() -> bool:
    """Once per process: fix glibc's mmap threshold at its default start, 128 KiB, which also
    fixes its trim threshold and turns off their dynamic growth. By default glibc raises the
    mmap threshold to the size of each mmapped block freed (up to 32 MiB), and the trim
    threshold to twice that: from then on such blocks come from the heaps, where a freed
    block's pages can stay pinned by small allocations beside them. False where the C library
    has no mallopt."""
    mallopt = _libc_function("mallopt")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
