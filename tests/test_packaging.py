"""The distribution: a built wheel maps adapters/ and kernels/ into paged_backend and imports on its own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["paged_backend", "paged_backend.core.scheduler", "paged_backend.engine.llm_engine",
           "paged_backend.sampling.sampler", "paged_backend.structured.matcher", "paged_backend.worker.tp_worker", "paged_backend.kernels", "paged_backend.kernels.reference",
           "paged_backend.adapters.hf", "paged_backend.adapters.hf.generate", "paged_backend.adapters.http.app",
           "paged_backend.adapters.triton.repository", "paged_backend.adapters.triton.model_json",
           "paged_backend.benchmarks.cli", "paged_backend.cli"]


def test_wheel_contains_and_imports_every_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, timeout=600, cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("paged_backend-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for path in ("paged_backend/kernels/triton_attention.py", "paged_backend/kernels/cpu_attention.cpp",
                 "paged_backend/kernels/cpu_sampler.cpp", "paged_backend/kernels/cpu_vector.h",
                 "paged_backend/adapters/http/tgi_routes.py",
                 "paged_backend/adapters/triton/model.py", "paged_backend/adapters/hf/runner.py",
                 "paged_backend/engine/request_params.py", "paged_backend/worker/tp_worker.py", "paged_backend/benchmarks/paper/waste.py"):
        assert path in names
    assert not any(n.startswith(("adapters/", "kernels/", "tests/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "paged-backend = paged_backend.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=600)
    code = ("import importlib, sys; mods = sys.argv[1:]; "
            "files = [importlib.import_module(m).__file__ for m in mods]; print('\\n'.join(files))")
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code, *MODULES], check=True, capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300).stdout.split()
    assert len(out) == len(MODULES) and all(f.startswith(str(site)) for f in out), out


def test_editable_install_maps_the_top_level_folders():
    import paged_backend.adapters
    import paged_backend.kernels

    assert Path(paged_backend.kernels.__file__).parent == ROOT / "kernels"
    assert Path(paged_backend.adapters.__file__).parent == ROOT / "adapters"


_FIND_KERNELS = ("import importlib.util; spec = importlib.util.find_spec('kernels'); "
                 "print(spec.origin if spec is not None else None)")


def _not_ours(origin) -> bool:
    return origin in (None, "None") or not Path(origin).resolve().is_relative_to(ROOT / "kernels")


def test_the_checkouts_folders_do_not_shadow_top_level_packages():
    """`kernels/` and `adapters/` are `paged_backend.kernels` and `paged_backend.adapters`; as top-level names
    they belong to PyPI packages (transformers >= 5.25 depends on Hugging Face's `kernels` and imports it when
    installed). A Python started in the checkout's root puts that root first on its path (`python -m pytest`,
    the `-c` workers of pytest-xdist, the servers tests start): neither this process nor a child started
    there may find our folder under the bare name (tests/conftest.py keeps the root off the path)."""
    assert _not_ours(getattr(importlib.util.find_spec("kernels"), "origin", None))
    child = subprocess.run([sys.executable, "-c", _FIND_KERNELS], check=True, capture_output=True, text=True,
                           cwd=ROOT, timeout=120).stdout.strip()
    assert _not_ours(child), child


def test_our_child_pythons_leave_the_current_folder_off_their_path():
    """The children the library starts (tensor-parallel workers, the benchmarks' servers and probes) are started
    through `python_command()`: in a checkout's root, without the tests' PYTHONSAFEPATH, they do not find our
    `kernels/` under the bare name."""
    from paged_backend.worker.child_python import python_command

    env = {name: value for name, value in os.environ.items() if name != "PYTHONSAFEPATH"}
    plain = subprocess.run([sys.executable, "-c", _FIND_KERNELS], check=True, capture_output=True, text=True,
                           cwd=ROOT, env=env, timeout=120).stdout.strip()
    assert not _not_ours(plain), plain   # what a plain `python -c` there finds: the case guarded against
    ours = subprocess.run([*python_command(), "-c", _FIND_KERNELS], check=True, capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120).stdout.strip()
    assert _not_ours(ours), ours


def test_importing_paged_backend_in_the_checkouts_root_leaves_the_root_off_the_path():
    """What the tests and our own children are spared, a Python that someone else starts in the checkout's root
    (Triton's Python stub, `python -c` by hand) is spared by `import paged_backend`: the root leaves the path."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONSAFEPATH"}
    found = subprocess.run([sys.executable, "-c", "import paged_backend; " + _FIND_KERNELS], check=True,
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=120).stdout.strip()
    assert _not_ours(found), found
