"""Where and at which code a benchmark ran: the git commit (and whether the tree was dirty), the machine
(cores, CPU model, memory, load average) and the software versions, recorded in every result JSON so a
documented figure can be traced to the code and the conditions that produced it."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Dict, Iterator, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]  # benchmarks/harness/provenance.py


@dataclass
class GitState:
    """The commit the benchmark code was at; `dirty` lists tracked changes and untracked files."""

    commit: Optional[str]
    branch: Optional[str]
    dirty: Optional[bool]
    changed: List[str]

    def as_dict(self) -> dict:
        return asdict(self)


def _git(args: List[str], root: Path) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(root: Path = REPO_ROOT) -> GitState:
    """The checkout's HEAD and its uncommitted changes (ignored files do not count). Outside git (a copy of the
    package, as the GPU session lays out): the commit $PAGED_BENCH_COMMIT names, dirtiness unknown; else None."""
    commit = _git(["rev-parse", "HEAD"], root)
    if commit is None:
        return GitState(os.environ.get("PAGED_BENCH_COMMIT") or None, None, None, [])
    branch = (_git(["rev-parse", "--abbrev-ref", "HEAD"], root) or "").strip() or None
    status = _git(["status", "--porcelain", "--untracked-files=all"], root)
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return GitState(commit.strip(), branch, None if status is None else bool(changed), changed[:50])


RECORD_OUTPUTS = ("docs/img/bench-", "docs/benchmarks.md")   # what documented runs write
_pinned: List[GitState] = []   # the state a documented run started from, while it runs


@contextlib.contextmanager
def pinned_git_state() -> Iterator[GitState]:
    """Remember the checkout's state at the start of a documented run: each benchmark writes its record into
    docs/img/ before the next one starts, and those writes must not make the later records read as dirty."""
    _pinned.append(git_state())
    try:
        yield _pinned[-1]
    finally:
        _pinned.pop()


def recorded_git_state() -> GitState:
    """The state a record names. Inside `pinned_git_state`: the starting state, dirty also if anything other
    than the run's own records changed since (code edited mid-run reaches later benchmarks' servers)."""
    now = git_state()
    if not _pinned or now.dirty is None:
        return now
    start = _pinned[-1]
    since = [path for path in now.changed if not path.startswith(RECORD_OUTPUTS) and path not in start.changed]
    return GitState(start.commit, start.branch, bool(start.dirty or since or now.commit != start.commit),
                    start.changed + since)


def load_average() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _cpu_model() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> Dict[str, object]:
    """Cores (all and usable by this process), CPU model and instruction sets, memory, OS and the load average
    now."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"host_cpus": os.cpu_count(), "usable_cpus": usable, "cpu_model": _cpu_model(),
            "cpu_features": _cpu_features(), "memory_gib": _memory_gib(), "os": platform.platform(),
            "load_average_1_5_15": load_average()}


def _cpu_features() -> Dict[str, object]:
    """The instruction sets found at run time and what the kernels and PyTorch use of them (cpu_features.py)."""
    from paged_backend.kernels.cpu_features import describe

    return describe()


def instruction_sets_text(machine: dict) -> str:
    """` (instruction sets; kernels' width, PyTorch's dispatch)` for records that name them (older ones do not)."""
    features = machine.get("cpu_features")
    if not features:
        return ""
    bits = features.get("kernel_vector_bits")
    kernels = f"C++ kernels {bits}-bit" if bits else "C++ kernels' width unknown"
    if features.get("linear_kernel_bfloat16") == "AVX512_BF16":   # named since the kernel took vdpbf16ps
        kernels += ", bfloat16 linear through AVX512_BF16"
    return (f" ({', '.join(features.get('instruction_sets') or []) or 'instruction sets unknown'}; {kernels}, "
            f"PyTorch {features.get('torch_capability')})")


def versions(packages=("torch", "transformers", "triton", "paged-backend")) -> Dict[str, Optional[str]]:
    found: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def dirty_refusal(state: GitState) -> Optional[str]:
    """Why a documented record may not be written from this checkout (None when it may)."""
    if state.commit is None:
        return "the benchmark code is not in a git checkout, so the record could not name its commit"
    if state.dirty is None:
        return "git status failed, so it is unknown whether the tree matches the commit"
    if state.dirty:
        shown = ", ".join(state.changed[:5]) + (" ..." if len(state.changed) > 5 else "")
        return (f"the tree differs from commit {state.commit[:12]} ({shown}); commit first, or pass "
                f"--allow-dirty to record it marked dirty")
    return None
