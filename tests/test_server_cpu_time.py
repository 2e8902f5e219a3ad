"""benchmarks/harness/server_process.cpu_seconds: a server's CPU time counts the processes it spawned (transformers
5.25's `serve` runs its model in a spawned process; its own process then looked idle: 0.01 busy cores)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from paged_backend.benchmarks.harness.server_process import cpu_seconds

# A parent that idles while its child (and the child's child) spin for about a second each.
SPINNING_CHILDREN = """
import subprocess, sys, time
spin = "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass\\ntime.sleep(30)"
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\\n"
                          f"subprocess.Popen([sys.executable, '-c', {spin!r}])\\nexec({spin!r})"])
time.sleep(30)
"""


def test_cpu_seconds_count_the_processes_a_server_spawned():
    parent = subprocess.Popen([sys.executable, "-c", SPINNING_CHILDREN], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        seconds = 0.0
        while time.monotonic() < deadline:
            seconds = cpu_seconds(parent.pid) or 0.0
            if seconds >= 1.8:
                break
            time.sleep(0.2)
        assert seconds >= 1.8, f"{seconds:.2f} CPU seconds: the spawned processes' time is missing"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)   # the children too
        parent.wait()
