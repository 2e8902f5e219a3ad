"""The fronts' documents list every parameter, model.json key and metric the code accepts or exports, and every
file the docs point to exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from paged_backend.adapters.http.openai_request import ChatRequest, CompletionRequest
from paged_backend.adapters.http.tgi_request import TGIParameters
from paged_backend.adapters.triton.model_json import OPTION_NAMES
from paged_backend.adapters.triton.repository import INPUTS, OUTPUTS
from paged_backend.adapters.triton.trtllm_inputs import TRTLLM_TENSORS
from paged_backend.engine.metrics_table import METRICS
from paged_backend.engine.request_params import SAMPLING_PARAMETERS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _doc(name: str) -> str:
    return (DOCS / name).read_text()


@pytest.mark.parametrize("names, doc", [
    (sorted(SAMPLING_PARAMETERS), "triton.md"),
    (sorted(OPTION_NAMES), "triton.md"),
    ([name for name, *_ in INPUTS] + [name for name, *_ in OUTPUTS] + sorted(TRTLLM_TENSORS), "triton.md"),
    (sorted(TGIParameters.model_fields), "http.md"),
    (sorted(set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)), "http.md"),
    ([spec.sample_name for spec in METRICS], "metrics.md"),
], ids=["sampling parameters", "model.json", "tensors", "TGI", "OpenAI", "metrics"])
def test_every_name_is_documented(names, doc):
    text = _doc(doc)
    missing = [name for name in names if f"`{name}" not in text]
    assert not missing, f"{doc} does not mention {missing}"


def _tracked_files() -> list:
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_every_file_the_docs_point_to_exists():
    """Relative links resolve, and every Markdown file a page names (DESIGN.md, ...) is in the repository."""
    tracked = _tracked_files()
    missing = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.name}: link {target}")
        for name in re.findall(r"(?<![\w./-])([\w./-]+\.md)\b", text):
            if "://" not in name and not any(f == name or f.endswith("/" + name.lstrip("./")) for f in tracked):
                missing.append(f"{page.name}: {name}")
    assert not missing, missing
