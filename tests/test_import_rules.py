"""The layout's import rules (docs/architecture.md): dependencies point one way, adapters -> engine ->
core / worker / sampling / structured -> kernels, and each folder imports only what lies below it.

Imports are read statically from every module (relative ones resolved; imports under `if TYPE_CHECKING:`
are annotations and do not count), and the rules that matter at run time are also checked by importing
modules in a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder in the checkout -> the package it is installed as (pyproject's package-dir)
FOLDERS = {"paged_backend": "paged_backend", "adapters": "paged_backend.adapters",
           "kernels": "paged_backend.kernels", "benchmarks": "paged_backend.benchmarks"}
ML_LIBRARIES = ("torch", "transformers", "tokenizers", "xgrammar", "triton", "safetensors", "gguf")  # numpy is fine

# part -> the paged_backend modules (prefixes) it may import, besides itself
ALLOWED: Dict[str, Tuple[str, ...]] = {
    "paged_backend.core": ("paged_backend.config", "paged_backend.errors"),
    "paged_backend.worker": ("paged_backend.kernels", "paged_backend.config", "paged_backend.errors"),
    "paged_backend.sampling": ("paged_backend.kernels", "paged_backend.structured", "paged_backend.sampling_params",
                               "paged_backend.errors"),
    "paged_backend.structured": ("paged_backend.kernels", "paged_backend.errors"),
    "paged_backend.kernels": (),
    "paged_backend.engine": ("paged_backend.core", "paged_backend.worker", "paged_backend.sampling",
                             "paged_backend.structured", "paged_backend.kernels", "paged_backend.config",
                             "paged_backend.errors", "paged_backend.sampling_params"),
    "paged_backend.adapters": ("paged_backend.errors",),  # and the package face, `from paged_backend import X`
}


def modules() -> Iterator[Tuple[str, Path]]:
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join([package] + parts), path


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path) -> Set[str]:
    """Every module `name` imports at run time (absolute names; `from pkg import sub` counts as pkg.sub too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _known_module(module: str) -> bool:
    """`from paged_backend.x import Name` adds `paged_backend.x.Name`: keep only names that are modules."""
    return any(module == m for m, _ in modules()) or module in {"paged_backend"}


def violations() -> List[str]:
    found = []
    for name, path in modules():
        part = next((p for p in ALLOWED if _within(name, [p])), None)
        if part is None:
            continue
        for imported in sorted(imports_of(name, path)):
            if not imported.startswith("paged_backend"):
                if part == "paged_backend.core" and imported.split(".")[0] in ML_LIBRARIES:
                    found.append(f"{name} imports {imported} (core/ is pure bookkeeping)")
                continue
            if _within(imported, [part]) or imported == "paged_backend":
                continue
            if part == "paged_backend.adapters" and imported.count(".") == 1 and not _known_module(imported):
                continue  # `from paged_backend import LLM`: a public name of the package face
            if not _known_module(imported):
                continue  # a name imported from an allowed or reported module
            if not _within(imported, ALLOWED[part]):
                found.append(f"{name} imports {imported}")
    return found


def test_each_part_imports_only_what_lies_below_it():
    assert violations() == []


def test_the_rule_reader_sees_a_violation(tmp_path, monkeypatch):
    """The checker itself can fail: a worker module that imports the scheduler is reported."""
    bad = tmp_path / "paged_backend" / "worker"
    bad.mkdir(parents=True)
    (bad / "bad.py").write_text("from paged_backend.core.scheduler import Scheduler\nimport torch\n"
                                "if TYPE_CHECKING:\n    from paged_backend.engine import llm_engine\n")
    assert imports_of("paged_backend.worker.bad", bad / "bad.py") >= {"paged_backend.core.scheduler", "torch"}
    assert "paged_backend.engine" not in imports_of("paged_backend.worker.bad", bad / "bad.py")


def _loaded_after_import(module: str) -> Dict[str, List[str]]:
    code = ("import json, sys, importlib; importlib.import_module(sys.argv[1]); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('paged_backend', 'torch', 'transformers', 'tokenizers', 'xgrammar'))))")
    out = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, check=True,
                         timeout=120, cwd=ROOT).stdout
    return json.loads(out)


@pytest.mark.parametrize("module", ["paged_backend.core.scheduler", "paged_backend.core.block_manager",
                                    "paged_backend.core.sequence", "paged_backend.core.prefix_cache"])
def test_core_loads_no_torch(module):
    loaded = _loaded_after_import(module)
    assert not [m for m in loaded if m.split(".")[0] in ML_LIBRARIES], loaded


def test_the_tensor_parallel_worker_loads_no_engine_or_scheduler():
    loaded = _loaded_after_import("paged_backend.worker.tp_worker")
    assert not [m for m in loaded if m.startswith(("paged_backend.core", "paged_backend.engine",
                                                   "paged_backend.adapters", "paged_backend.sampling"))], loaded


def test_the_package_face_loads_lazily():
    assert _loaded_after_import("paged_backend") == ["paged_backend"]
    import paged_backend

    for name in paged_backend.__all__:
        assert getattr(paged_backend, name) is not None, name


def test_docs_architecture_shows_the_tree():
    """Every part's folder and every module in it is named in docs/architecture.md, and nothing is left flat."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    flat = sorted(p.name for p in (ROOT / "paged_backend").glob("*.py"))
    assert flat == ["__init__.py", "cli.py", "config.py", "errors.py", "sampling_params.py"]
    missing = []
    for part in ("core", "engine", "worker", "sampling", "structured"):
        if f"paged_backend/{part}/" not in text:
            missing.append(f"paged_backend/{part}/")
        missing += [f"{part}/{p.name}" for p in (ROOT / "paged_backend" / part).glob("*.py")
                    if p.name != "__init__.py" and f"`{p.name}`" not in text and f"`{p.stem}" not in text]
    for sub in ("paper", "micro", "gpu", "harness"):
        if f"`{sub}/`" not in text:
            missing.append(f"benchmarks/{sub}/")
    assert not missing, missing
    assert not sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in ("__init__.py", "cli.py"))
