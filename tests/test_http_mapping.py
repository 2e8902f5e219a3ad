"""The HTTP adapter's mappings without a server process: finish reasons, TGI/OpenAI parameters to
SamplingParams through the engine's contract, the concurrency cap, the ready banner."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from conftest import get_model
from paged_backend import AsyncLLMEngine, CompletionOutput
from paged_backend.adapters.http.app import create_app
from paged_backend.adapters.http.cli import ready_message
from paged_backend.adapters.http.errors import ValidationFailed
from paged_backend.adapters.http.openai_request import ChatRequest, CompletionRequest, plan_chat, plan_completion
from paged_backend.adapters.http.tgi_request import TGIRequest, plan_tgi
from paged_backend.adapters.http.tgi_routes import tgi_finish_reason


@pytest.fixture(scope="module")
def app():
    model, tokenizer = get_model("tiny-llama", torch.float32)
    engine = AsyncLLMEngine(model, tokenizer=tokenizer, num_blocks=16, num_swap_blocks=0)
    yield create_app(engine, "tiny", max_concurrent_requests=1)
    engine.engine.shutdown()


@pytest.fixture(scope="module")
def ctx(app):
    return app.state.ctx


def _comp(text, ids, finish=None, stop=None, index=0):
    return CompletionOutput(index, text, ids, 0.0, finish_reason=finish, stop_reason=stop)


@pytest.mark.parametrize("finish,stop,expected", [
    ("length", None, "length"), ("stop", None, "eos_token"), ("stop", 7, "eos_token"),
    ("stop", "END", "stop_sequence")])
def test_tgi_finish_reasons(finish, stop, expected):
    assert tgi_finish_reason(_comp("x", [1], finish, stop)) == expected


def test_tgi_greedy_unless_sampling_or_warpers(ctx):
    greedy = plan_tgi(ctx, TGIRequest(inputs="Hi", parameters={"max_new_tokens": 3}), stream=False)
    assert greedy.params.temperature == 0.0 and greedy.seed is None and greedy.params.max_tokens == 3
    # TGI samples when a warper is set even with do_sample=false
    warped = plan_tgi(ctx, TGIRequest(inputs="Hi", parameters={"temperature": 0.5}), stream=False)
    assert warped.params.temperature == 0.5 and isinstance(warped.seed, int)
    stops = plan_tgi(ctx, TGIRequest(inputs="Hi", parameters={"stop": ["x"], "do_sample": True, "top_k": 5,
                                                                "top_p": 0.9, "seed": 3}), stream=False)
    p = stops.params
    assert p.include_stop_str_in_output and p.stop_strings == ["x"] and (p.top_k, p.top_p, p.seed) == (5, 0.9, 3)


def test_tgi_max_new_tokens_defaults_to_100_and_null_to_all_that_fits(ctx):
    absent = plan_tgi(ctx, TGIRequest(inputs="Hi there"), stream=False)
    assert absent.params.max_tokens == 100  # TGI's default
    assert plan_tgi(ctx, TGIRequest(inputs="Hi there", parameters={}), stream=False).params.max_tokens == 100
    null = plan_tgi(ctx, TGIRequest(inputs="Hi there", parameters={"max_new_tokens": None}), stream=False)
    assert null.params.max_tokens == ctx.engine.max_new_tokens(len(null.prompt_ids)) == 16 * 16 - len(null.prompt_ids)
    with pytest.raises(ValidationFailed, match="KV cache") as info:
        plan_tgi(ctx, TGIRequest(inputs="Hi", parameters={"max_new_tokens": 300}), stream=False)
    assert info.value.param == "max_new_tokens" and info.value.code == "kv_cache_exceeded"


def test_openai_params(ctx):
    plan = plan_completion(ctx, CompletionRequest(prompt=["a", "b"], n=2, temperature=0.7, top_k=0, min_p=0.1,
                                                  stop="x", logprobs=3))
    p = plan.params[0]
    assert len(plan.prompts) == 2 and p.n == 2 and p.max_tokens == 16 and p.top_k == -1 and p.min_p == 0.1
    assert p.logprobs == 3 and p.stop_strings == ["x"] and not p.include_stop_str_in_output
    beam = plan_completion(ctx, CompletionRequest(prompt="a", n=2, use_beam_search=True, best_of=3))
    assert beam.params[0].beam_width == 3 and beam.params[0].temperature == 0.0
    with pytest.raises(ValidationFailed, match="use_beam_search needs best_of"):  # as vLLM: no beam of one
        plan_completion(ctx, CompletionRequest(prompt="a", use_beam_search=True))
    chat = plan_chat(ctx, ChatRequest(messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2,
                                      max_completion_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chat.params[0].max_tokens == 5 and chat.logprobs == 2 and chat.include_usage
    assert ctx.tokenizer.decode(chat.prompts[0]).endswith("<|im_start|>assistant\n")


def test_overloaded_requests_get_429(app):
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            slow = c.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 60}})
            fast = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            return await asyncio.gather(slow, fast)

    slow, fast = asyncio.run(run())
    assert slow.status_code == 200
    assert fast.status_code == 429 and fast.json()["error"]["type"] == "rate_limit_exceeded"
    assert app.state.ctx.in_flight == 0


def test_two_apps_have_separate_metrics(app):
    model, tokenizer = get_model("tiny-llama", torch.float32)
    other = create_app(AsyncLLMEngine(model, tokenizer=tokenizer, num_blocks=8), "other")
    assert b"paged_backend:kv_blocks_total 8.0" in other.state.ctx.metrics.render()
    assert b"paged_backend:kv_blocks_total 16.0" in app.state.ctx.metrics.render()


def test_ready_message_has_curl_lines():
    class Stats:
        num_blocks, block_size = 10, 16

    text = ready_message("http://127.0.0.1:8000", "smollm2", "sekret", Stats())
    lines = text.splitlines()
    assert lines[0].startswith("paged-backend: ready on http://127.0.0.1:8000 serving smollm2")
    assert any(line.strip().startswith("curl http://127.0.0.1:8000/generate ") for line in lines)
    assert any(line.strip().startswith("curl http://127.0.0.1:8000/v1/chat/completions ") for line in lines)
    assert all("Authorization: Bearer sekret" in line for line in lines if "curl" in line)
