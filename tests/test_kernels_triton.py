"""The Triton kernels under Triton's CPU interpreter equal the PyTorch reference (and drive the engine).

`TRITON_INTERPRET=1` must be set before Triton is first imported (Triton's own `tl.max`/`tl.sum`
are `@triton.jit` functions fixed at import). So the checks in interpreter_kernel_checks.py run in
one subprocess with that variable set, and this module reports one test per check function from
its JUnit report. Nothing of the interpreter leaks into this pytest process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from subprocess_pytest import assert_function_passed, list_test_functions, run_pytest_file

CHECKS = Path(__file__).with_name("interpreter_kernel_checks.py")


@pytest.fixture(scope="module")
def interpreter_run(tmp_path_factory):
    junit = tmp_path_factory.mktemp("triton-interpreter") / "junit.xml"
    return run_pytest_file(CHECKS, junit, set_env={"TRITON_INTERPRET": "1"},
                           unset_env=("PAGED_BACKEND_KERNELS",), timeout=590)


@pytest.mark.parametrize("check", list_test_functions(CHECKS))
def test_triton_interpreter(check, interpreter_run):
    assert_function_passed(interpreter_run, check)
