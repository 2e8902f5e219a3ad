"""The process's compute thread: one long-lived thread for the engine's torch work when steps overlap.

PyTorch's CPU operators run on OpenMP (libgomp), which keeps a team of helper threads for every thread that has
run a parallel region. Once a process holds more such threads than it has cores, libgomp stops spinning between
regions (its "throttled" spin count) and its helpers sleep after each operator: a decode step of a few hundred
small operators then pays a wake-up per operator. Measured on 2 cores (smollm2, float32, batch 1): a forward in
a worker thread of a process whose main thread had loaded the model took 57-61 ms per token eager (54 compiled);
with the model loaded in a thread that had exited, 39.7 ms (sync, one thread: 40 eager, 37 compiled).

So an overlapped engine runs all of its torch work here (loading a named model, building the runner and its KV
cache, the forwards and the sampler's draws): one thread, one team. A thread that runs none of it never gets a
team (the event loop, the scheduler's bookkeeping, detokenization). Every engine of a process shares the
thread; jobs run in submission order.

A caller that ran parallel operators of its own (a user's main thread that built or converted a model, any
torch work on large tensors) holds a team too, and the process is over the limit again: on 2 cores smollm2's
bfloat16 batch-1 steps took 15-21 ms instead of 7.4-10. So every job handed here first releases the caller's
helpers (OpenMP 5's `omp_pause_resource_all`, which in libgomp ends the calling thread's pool only); the caller
gets a new helper the next time it runs a parallel region of its own.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import threading
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
_ident: Optional[int] = None
_pause: Optional[Callable[[], int]] = None
_pause_known = False
_OMP_PAUSE_SOFT = 1


def _loaded_libgomp(maps: str = "/proc/self/maps") -> Optional[str]:
    """The path of the libgomp this process has loaded (PyTorch's), or None (not Linux, another OpenMP)."""
    try:
        with open(maps) as lines:
            for line in lines:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libgomp") and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def _openmp_pause() -> Optional[Callable[[], int]]:
    """`omp_pause_resource_all(omp_pause_soft)` of the loaded libgomp (looked up once; None without one)."""
    global _pause, _pause_known
    if not _pause_known:
        import torch  # noqa: F401 - loads PyTorch's OpenMP runtime before it is looked for

        path = _loaded_libgomp()
        try:
            function = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all if path else None
        except (OSError, AttributeError):
            function = None
        if function is not None:
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            _pause = functools.partial(function, _OMP_PAUSE_SOFT)
        _pause_known = True
    return _pause


def release_callers_helpers() -> bool:
    """End the OpenMP helper threads of the calling thread's own parallel regions (none: nothing happens); True
    when the runtime could be asked. Never called on the compute thread, whose team is the one that stays."""
    pause = _openmp_pause()
    return pause is not None and pause() == 0


def _remember_ident() -> None:
    global _ident
    _ident = threading.get_ident()


def compute_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The single-thread executor of the compute thread (started on first use, kept for the process' life)."""
    global _executor
    with _lock:
        if _executor is None:
            executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-compute")
            executor.submit(_remember_ident).result()
            _executor = executor
        return _executor


def submit(fn: Callable[..., T], *args, **kwargs) -> "concurrent.futures.Future[T]":
    """Queue `fn(*args, **kwargs)` on the compute thread with the caller's torch thread count (OpenMP's count
    is per thread: a count set in the caller after the compute thread started would not reach it otherwise)."""
    import torch

    threads = torch.get_num_threads()
    if not on_compute_thread():
        release_callers_helpers()

    def job():
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return fn(*args, **kwargs)

    return compute_executor().submit(job)


def on_compute_thread() -> bool:
    """Whether the caller is the compute thread."""
    return _ident is not None and threading.get_ident() == _ident


def run_on_compute_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on the compute thread (at once when called from it); its result or its exception."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return submit(fn, *args, **kwargs).result()
