"""The fronts' documents list every parameter, model.json key and metric the code accepts or exports."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_backend.adapters.http.openai_request import ChatRequest, CompletionRequest
from paged_backend.adapters.http.tgi_request import TGIParameters
from paged_backend.adapters.triton.model_json import OPTION_NAMES
from paged_backend.adapters.triton.repository import INPUTS, OUTPUTS
from paged_backend.adapters.triton.trtllm_inputs import TRTLLM_TENSORS
from paged_backend.metrics_table import METRICS
from paged_backend.request_params import SAMPLING_PARAMETERS

DOCS = Path(__file__).resolve().parents[1] / "docs"


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
