"""Helpers for the HTTP server tests: references from `LLM.generate`, SSE parsing, /metrics reading."""

from __future__ import annotations

import json
import time
from typing import Dict, List

import httpx
from prometheus_client.parser import text_string_to_metric_families

from paged_backend import SamplingParams
from http_server_process import AUTH


def client(server, **kwargs) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=120, **kwargs)


def greedy(llm, prompt, max_tokens: int):
    """The reference completion of `LLM.generate` for a greedy request."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def chat_ids(llm, messages: List[dict]) -> List[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def token_pieces(llm, ids: List[int]) -> List[str]:
    """The text each token adds to the decoded output."""
    tok = llm.get_tokenizer()
    return [tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])):] for i in range(len(ids))]


def sse_events(lines) -> List[dict]:
    """JSON payloads of `data:` lines (TGI's `data:{...}` and OpenAI's `data: {...}`), [DONE] excluded."""
    events = []
    for line in lines:
        if line.startswith("data:"):
            payload = line[len("data:"):].strip()
            if payload != "[DONE]":
                events.append(json.loads(payload))
    return events


def metrics(http: httpx.Client) -> Dict[str, float]:
    """Unlabelled samples of /metrics, plus `name{label=value}` keys for labelled ones."""
    values = {}
    text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def wait_idle(http: httpx.Client, timeout: float = 120.0) -> Dict[str, float]:
    """/metrics once no request is queued or running (or the last reading, after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        busy = (m["paged_backend:num_requests_running"] + m["paged_backend:num_requests_waiting"]
                + m["paged_backend:num_requests_swapped"])
        if (busy == 0 and m["paged_backend:kv_blocks_free"] == m["paged_backend:kv_blocks_total"]) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.1)
