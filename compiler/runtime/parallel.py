"""An instruction's independent blocks on a small persistent thread pool, as the MLA's quads
split one instruction's work (docs/mla-isa.md).

The emulator computes most instructions in blocks that write disjoint parts of the result
(`emulator_ops._blockwise`): runs of output rows or channels of a CONV, runs of an output
stage. Each block's numbers come from the same code on the same operands whichever thread
runs it, so the result is bit-identical for any worker count. numpy's loops and BLAS release
the GIL while they run, so with `WORKERS` above one the blocks of an instruction run on several
cores at once (see `WORKERS` for why one is the default).

Work is handed out one block at a time from a shared counter, the calling thread taking its
share, so a worker that the OS deschedules (on a busy host) delays only the block it holds:
the others take the rest (unlike a statically partitioned multi-threaded BLAS, which waits for
its slowest worker at every product; the emulator holds that one to a single thread).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["WORKERS", "for_each", "worker_count", "workers"]

T = TypeVar("T")

WORKERS: int | None = 1
"""Threads that run an instruction's blocks, the caller included (None: every CPU this process
may run on); 1, the default, runs everything on the calling thread.

Measured on the 2-vCPU host this was built on, two threads gained nothing overall (the real
models of bench/emulator_vs_ort.py: -6% to +20% wall time, within run-to-run noise): the blocks
are cache-sized (`emulator_ops.BLOCK_ELEMENTS`), so each numpy call lasts some 10-40 µs, and
every one of them hands the GIL to the other thread and takes it back, which on a virtual
machine costs a cross-CPU wake-up of about that much; blocks large enough to amortise it lose
the cache. numpy operations of a few hundred µs and more do scale, so hosts with cheaper
wake-ups, or larger inputs, may gain: set WORKERS = None (or `with workers(None):`)."""

MIN_ITEMS = 2
"""Fewer items than this run on the calling thread: handing out work costs some tens of µs."""


def worker_count() -> int:
    """The number of threads `for_each` uses: `WORKERS`, or (None) the CPUs this process may
    use."""
    if WORKERS is not None:
        return max(1, WORKERS)
    return usable_cpus()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@contextmanager
def workers(count: int | None) -> Iterator[None]:
    """Within the block, `for_each` uses `count` threads (None: every usable CPU); `WORKERS`
    is restored after. For tests and determinism checks, not for concurrent use."""
    global WORKERS
    saved, WORKERS = WORKERS, count
    try:
        yield
    finally:
        WORKERS = saved


_POOL_LOCK = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


class _InPool(threading.local):
    """Whether this thread is running a `for_each` item (a nested `for_each` then runs
    serially: waiting on the pool from inside it could wait for itself)."""

    def __init__(self) -> None:
        self.active = False


_IN_POOL = _InPool()


def _reset_after_fork() -> None:
    """A forked child has none of the parent's threads: it starts its own pool when needed."""
    global _pool, _pool_threads
    _pool, _pool_threads = None, 0


os.register_at_fork(after_in_child=_reset_after_fork)


def _executor(helpers: int) -> ThreadPoolExecutor:
    """The shared pool, with at least `helpers` threads (made, or grown, on first need)."""
    global _pool, _pool_threads
    with _POOL_LOCK:
        if _pool is None or _pool_threads < helpers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="mla-quad")
            _pool_threads = helpers
        return _pool


def for_each(items: Sequence[T], work: Callable[[T], object]) -> None:
    """work(item) for every item, on up to `worker_count()` threads (the caller one of them);
    returns when every item is done, raising the first error any of them raised.

    The items must be independent: each may read shared inputs but must write only its own
    part of any shared output, and keep its temporary arrays per thread.
    """
    helpers = min(worker_count(), len(items)) - 1
    if helpers < 1 or len(items) < MIN_ITEMS or _IN_POOL.active:
        for item in items:
            work(item)
        return
    lock = threading.Lock()
    position = [0]
    failed = threading.Event()

    def drain() -> None:
        _IN_POOL.active = True
        try:
            while not failed.is_set():
                with lock:
                    index = position[0]
                    position[0] += 1
                if index >= len(items):
                    return
                try:
                    work(items[index])
                except BaseException:
                    failed.set()
                    raise
        finally:
            _IN_POOL.active = False

    pool = _executor(helpers)
    futures: list[Future[None]] = [pool.submit(drain) for _ in range(helpers)]
    try:
        drain()
    finally:
        wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error
