"""The per-thread CPU reader behind `benchmarks/micro/busy_threads.py`: it sees this process's threads by name and
counts the CPU time a busy thread spends."""

from __future__ import annotations

import os
import threading
import time

from paged_backend.benchmarks.micro.busy_threads import thread_cpu


def test_thread_cpu_sees_a_busy_thread_and_its_time():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, name="spinner")
    worker.start()
    try:
        before = thread_cpu(os.getpid())
        time.sleep(0.5)
        after = thread_cpu(os.getpid())
    finally:
        stop.set()
        worker.join()
    assert worker.native_id in after and threading.get_native_id() in after
    gained = after[worker.native_id][1] - before.get(worker.native_id, ("", 0.0))[1]
    assert gained > 0.05, gained            # it spun (sharing the GIL) for about half a second
    assert all(seconds >= 0 for _, seconds in after.values())
