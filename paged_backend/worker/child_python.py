"""The command line that starts one of our Python child processes (tensor-parallel workers, the servers and
probes of the benchmarks).

A Python started with `-m` or `-c` puts its current folder first on its import path. Started in a checkout of
this repository, that folder holds kernels/ and adapters/ (`paged_backend.kernels`, `paged_backend.adapters`),
which then shadow PyPI packages of those names: transformers >= 5.25 depends on Hugging Face's `kernels` and
imports it whenever it is installed, and found ours instead. `-P` (Python >= 3.11) leaves the folder out.
"""

from __future__ import annotations

import sys
from typing import List


def python_command() -> List[str]:
    """This interpreter, told not to put the current folder on the import path where it can (`-P`)."""
    return [sys.executable, "-P"] if sys.version_info >= (3, 11) else [sys.executable]
