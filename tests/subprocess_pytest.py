"""Run a pytest file in a fresh interpreter with its own environment and read back each test's outcome.

Triton fixes JIT-vs-interpreter mode when it is first imported, so tests that need one mode run in a
subprocess whose environment is set before anything imports Triton.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class CaseResult:
    name: str          # e.g. test_x[param]
    outcome: str       # passed | failed | error | skipped
    message: str


@dataclass
class SubprocessRun:
    returncode: int
    output: str
    results: Dict[str, List[CaseResult]]   # test function name -> its cases

    def tail(self, chars: int = 6000) -> str:
        return self.output[-chars:]


def list_test_functions(path: Path) -> List[str]:
    """`test_*` functions of a file (also those defined under a module-level `if`), without importing it."""
    tree = ast.parse(path.read_text())
    names = [node.name for node in ast.walk(tree)
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    return sorted(set(names), key=names.index)


def _outcome(case: ElementTree.Element) -> CaseResult:
    for tag in ("failure", "error", "skipped"):
        child = case.find(tag)
        if child is not None:
            text = (child.get("message") or "") + "\n" + (child.text or "")
            return CaseResult(case.get("name", "?"), "failed" if tag == "failure" else tag, text.strip())
    return CaseResult(case.get("name", "?"), "passed", "")


def run_pytest_file(path: Path, junit_path: Path, set_env: Optional[Dict[str, str]] = None,
                    unset_env: tuple = (), timeout: float = 900) -> SubprocessRun:
    """Run `pytest path` in a new Python process; per-test outcomes come from its JUnit XML report."""
    env = dict(os.environ)
    for name in unset_env:
        env.pop(name, None)
    env.update(set_env or {})
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
               f"--junitxml={junit_path}", str(path)]
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    results: Dict[str, List[CaseResult]] = {}
    if junit_path.exists():
        for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
            result = _outcome(case)
            results.setdefault(result.name.split("[")[0], []).append(result)
    return SubprocessRun(proc.returncode, proc.stdout + proc.stderr, results)


def assert_function_passed(run: SubprocessRun, function: str) -> None:
    """Every case of `function` ran and passed in the subprocess; otherwise fail with its messages."""
    cases = run.results.get(function)
    assert cases, f"{function} did not run in the subprocess (exit {run.returncode}):\n{run.tail()}"
    bad = [c for c in cases if c.outcome != "passed"]
    assert not bad, "\n\n".join(f"{c.name}: {c.outcome}\n{c.message[-3000:]}" for c in bad)
