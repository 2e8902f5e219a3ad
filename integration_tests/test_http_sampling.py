"""Ordinary sampling settings over HTTP on the float32 server (they once answered 424/500 from the sampler)."""

from __future__ import annotations

import pytest

from http_fixtures import http, http_server  # noqa: F401 - fixtures

SETTINGS = [
    {"temperature": 1.0, "top_p": 0.9}, {"temperature": 1.0, "top_k": 50}, {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.5, "presence_penalty": 0.5}, {"temperature": 1.0, "min_tokens": 3},
]
IDS = ["top_p", "top_k", "repetition", "frequency-presence", "min_tokens"]


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_tgi_generate_samples_with_ordinary_settings(http, settings):
    tgi = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty"}
    parameters = {tgi[k]: v for k, v in settings.items() if k in tgi}
    parameters.update(do_sample=True, max_new_tokens=5)
    r = http.post("/generate", json={"inputs": "Paged attention is", "parameters": parameters})
    assert r.status_code == 200, r.text
    assert r.json()["generated_text"]


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_openai_completions_sample_with_ordinary_settings(http, settings):
    r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "Paged attention is", "max_tokens": 5,
                                           **settings})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
