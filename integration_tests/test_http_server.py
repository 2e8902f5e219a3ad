"""`paged-backend serve` over raw HTTP: TGI and OpenAI routes, equality with `LLM.generate`, streaming,
stop sequences, 64 concurrent streams, client disconnects, /metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from paged_backend import SamplingParams

from http_fixtures import http, http_reference, http_server  # noqa: F401 (fixtures)
from http_helpers import chat_ids, client, greedy, metrics, sse_events, token_pieces, wait_idle
from http_server_process import AUTH, HTTP_MODEL, HTTP_NUM_BLOCKS

PROMPTS = ["The capital of France is", "Paged attention splits the KV cache into", "1, 2, 3, 4,"]


def test_health_info_models(http_server, http):
    assert httpx.get(http_server.url + "/health").status_code == 200  # open without a key
    info = http.get("/info").json()
    assert info["model_id"] == HTTP_MODEL and info["model_dtype"] == "torch.float32"
    assert info["max_total_tokens"] == 1024 and info["max_input_tokens"] == 1023
    assert info["max_batch_total_tokens"] == HTTP_NUM_BLOCKS * 16
    assert info["validation_workers"] == 2  # TGI's field: the threads that tokenize and validate requests
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [HTTP_MODEL]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generate_equals_llm(http, http_reference, prompt):
    ref = greedy(http_reference, prompt, 8)
    body = http.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}})
    assert body.status_code == 200, body.text
    out = body.json()
    assert out["generated_text"] == ref.text
    details = out["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 8
    assert [t["id"] for t in details["tokens"]] == ref.token_ids
    assert "".join(t["text"] for t in details["tokens"]) == ref.text
    assert all(t["logprob"] <= 0 and t["special"] is False for t in details["tokens"])
    assert details["seed"] is None and details["prefill"] == []


def test_generate_without_details_and_compat_route(http, http_reference):
    ref = greedy(http_reference, PROMPTS[0], 5)
    plain = http.post("/generate", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 5}}).json()
    assert plain == {"generated_text": ref.text}
    compat = http.post("/", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 5}}).json()
    assert compat == [{"generated_text": ref.text}]


def test_generate_stream_equals_llm(http, http_reference):
    ref = greedy(http_reference, PROMPTS[1], 6)
    with http.stream("POST", "/generate_stream",
                     json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 6, "details": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert [e["index"] for e in events] == list(range(1, 7))
    assert [e["token"]["id"] for e in events] == ref.token_ids
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == ref.text == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"]["finish_reason"] == "length"
    assert events[-1]["details"]["generated_tokens"] == 6


def test_compat_route_streams_when_asked(http, http_reference):
    ref = greedy(http_reference, PROMPTS[2], 4)
    with http.stream("POST", "/", json={"inputs": PROMPTS[2], "stream": True,
                                        "parameters": {"max_new_tokens": 4}}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1]["generated_text"] == ref.text and len(events) == 4


def test_return_full_text_truncate_and_top_tokens(http, http_reference):
    tok = http_reference.get_tokenizer()
    ids = tok(PROMPTS[1])["input_ids"]
    ref = greedy(http_reference, ids[-3:], 4)
    out = http.post("/generate", json={"inputs": PROMPTS[1], "parameters": {
        "max_new_tokens": 4, "truncate": 3, "return_full_text": True, "details": True,
        "decoder_input_details": True, "top_n_tokens": 3}}).json()
    assert out["generated_text"] == PROMPTS[1] + ref.text
    details = out["details"]
    assert [p["id"] for p in details["prefill"]] == ids[-3:]
    assert all(len(top) == 3 for top in details["top_tokens"])
    for token, top in zip(details["tokens"], details["top_tokens"]):
        assert top[0]["id"] == token["id"]  # greedy picks the most likely token
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)


def test_sampling_seed_and_best_of(http):
    params = {"max_new_tokens": 6, "do_sample": True, "temperature": 0.9, "seed": 1234, "details": True}
    a = http.post("/generate", json={"inputs": PROMPTS[0], "parameters": params}).json()
    b = http.post("/generate", json={"inputs": PROMPTS[0], "parameters": params}).json()
    assert a == b and a["details"]["seed"] == 1234
    best = http.post("/generate", json={"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": 4, "do_sample": True, "best_of": 2, "details": True}}).json()
    others = best["details"]["best_of_sequences"]
    assert len(others) == 1 and isinstance(best["details"]["seed"], int)
    assert sum(t["logprob"] for t in best["details"]["tokens"]) >= sum(t["logprob"] for t in others[0]["tokens"])
    # TGI's router takes any given temperature, 1.0 included, as a sampling request for best_of
    plain = http.post("/generate", json={"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": 4, "temperature": 1.0, "best_of": 2, "details": True}})
    assert plain.status_code == 200, plain.text
    assert len(plain.json()["details"]["best_of_sequences"]) == 1


def _stop_across_tokens(llm, prompt, max_tokens):
    """A stop string made of the end of one token's text and the start of the next one's."""
    ref = greedy(llm, prompt, max_tokens)
    pieces = token_pieces(llm, ref.token_ids)
    for j in range(1, len(pieces) - 2):
        if len(pieces[j]) >= 2 and len(pieces[j + 1]) >= 2:
            stop = pieces[j][-2:] + pieces[j + 1][:2]
            if ref.text.find(stop) == len("".join(pieces[: j + 1])) - 2:
                return ref, stop
    raise AssertionError(f"no usable stop string in {pieces}")


def test_stop_sequences(http, http_reference):
    ref, stop = _stop_across_tokens(http_reference, PROMPTS[1], 12)
    cut = ref.text.find(stop)
    tgi = http.post("/generate", json={"inputs": PROMPTS[1], "parameters": {
        "max_new_tokens": 12, "stop": [stop], "details": True}}).json()
    assert tgi["generated_text"] == ref.text[: cut + len(stop)]  # TGI keeps the stop sequence
    assert tgi["details"]["finish_reason"] == "stop_sequence"
    body = {"model": HTTP_MODEL, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "stop": stop}
    oai = http.post("/v1/completions", json=body).json()["choices"][0]
    assert oai["text"] == ref.text[:cut] and oai["finish_reason"] == "stop" and oai["stop_reason"] == stop
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = sse_events(r.iter_lines())
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text[:cut]  # nothing of the stop leaks
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == stop
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])
    chat = {"model": HTTP_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=chat) as r:
        last = [c for c in sse_events(r.iter_lines()) if c["choices"]][-1]["choices"][0]
    assert last["finish_reason"] == "length" and "stop_reason" in last and last["stop_reason"] is None


def test_openai_completions_equal_llm(http, http_reference):
    refs = [greedy(http_reference, p, 7) for p in PROMPTS[:2]]
    out = http.post("/v1/completions", json={"model": HTTP_MODEL, "prompt": PROMPTS[:2], "max_tokens": 7,
                                             "temperature": 0, "logprobs": 2}).json()
    assert out["object"] == "text_completion" and out["model"] == HTTP_MODEL
    assert [c["text"] for c in out["choices"]] == [r.text for r in refs]
    assert [c["index"] for c in out["choices"]] == [0, 1]
    lp = out["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == refs[0].text and len(lp["token_logprobs"]) == 7
    assert all(len(top) >= 2 for top in lp["top_logprobs"])
    prompt_tokens = sum(len(http_reference.get_tokenizer()(p)["input_ids"]) for p in PROMPTS[:2])
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 14,
                            "total_tokens": prompt_tokens + 14}


def test_openai_completions_token_prompt_and_echo(http, http_reference):
    ids = http_reference.get_tokenizer()(PROMPTS[2])["input_ids"]
    ref = greedy(http_reference, ids, 5)
    out = http.post("/v1/completions", json={"model": "any-name", "prompt": ids, "max_tokens": 5,
                                             "temperature": 0, "echo": True}).json()
    assert out["choices"][0]["text"] == PROMPTS[2] + ref.text


def test_openai_beam_search_equals_llm(http, http_reference):
    params = SamplingParams(n=2, beam_width=2, temperature=0, max_tokens=5)
    ref = http_reference.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    out = http.post("/v1/completions", json={"model": HTTP_MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "n": 2,
                                             "use_beam_search": True}).json()
    assert [c["text"] for c in out["choices"]] == [c.text for c in ref.outputs]


def test_chat_uses_the_chat_template(http, http_reference):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]
    ref = greedy(http_reference, chat_ids(http_reference, messages), 6)
    out = http.post("/v1/chat/completions", json={"model": HTTP_MODEL, "messages": messages, "max_tokens": 6,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()
    choice = out["choices"][0]
    assert out["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": ref.text} and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and all(len(e["top_logprobs"]) == 2 for e in content)
    assert all(e["top_logprobs"][0]["token"] == e["token"] and e["logprob"] <= 0 for e in content)
    assert out["usage"]["prompt_tokens"] == len(chat_ids(http_reference, messages))
    assert out["usage"]["completion_tokens"] == 6


def test_chat_stream_with_usage(http, http_reference):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]
    ref = greedy(http_reference, chat_ids(http_reference, [{"role": "user", "content": "Say something."}]), 5)
    with http.stream("POST", "/v1/chat/completions", json={
            "model": HTTP_MODEL, "messages": messages, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        lines = list(r.iter_lines())
    assert [line for line in lines if line][-1] == "data: [DONE]"
    chunks = sse_events(lines)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == ref.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


async def _stream_one(http: httpx.AsyncClient, i: int, prompt: str, max_tokens: int) -> str:
    if i % 2:
        body = {"model": HTTP_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = sse_events([line async for line in r.aiter_lines()])
        return "".join(c["choices"][0]["text"] for c in chunks)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}}
    async with http.stream("POST", "/generate_stream", json=body) as r:
        assert r.status_code == 200
        events = sse_events([line async for line in r.aiter_lines()])
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]
    return events[-1]["generated_text"]


def test_64_concurrent_streams(http_server, http, http_reference):
    prompts = [f"Request {i}: the story of item {i * 13} goes like" for i in range(64)]
    refs = http_reference.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)

    async def run_all():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=http_server.url, headers=AUTH, timeout=300, limits=limits) as ac:
            return await asyncio.gather(*(_stream_one(ac, i, p, 6) for i, p in enumerate(prompts)))

    texts = asyncio.run(run_all())
    assert texts == [r.outputs[0].text for r in refs]
    m = wait_idle(http)
    assert m["paged_backend:kv_blocks_free"] == HTTP_NUM_BLOCKS
    assert m["paged_backend:generation_tokens_total"] >= 64 * 6


def test_disconnect_aborts_and_frees_blocks(http_server, http):
    before = metrics(http).get("paged_backend:request_finished_total{finished_reason=abort}", 0.0)
    body = {"inputs": "A very long story begins", "parameters": {"max_new_tokens": 600}}
    with httpx.Client(base_url=http_server.url, headers=AUTH, timeout=120) as c:
        with c.stream("POST", "/generate_stream", json=body) as r:
            lines = r.iter_lines()
            first = [line for line in (next(lines), next(lines)) if line.startswith("data:")]
            assert first, "the stream should have started"
    # a non-streaming request whose client gives up (read timeout) is aborted as well
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(http_server.url + "/generate", json=body, headers=AUTH, timeout=httpx.Timeout(5, read=0.5))
    m = wait_idle(http)
    assert m["paged_backend:kv_blocks_free"] == HTTP_NUM_BLOCKS
    assert m["paged_backend:num_requests_running"] == 0
    assert m["paged_backend:request_finished_total{finished_reason=abort}"] == before + 2


def test_metrics_exposes_the_engine(http):
    assert http.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).status_code == 200
    m = metrics(http)
    for name in ("kv_cache_usage", "kv_token_utilization", "kv_blocks_free", "num_requests_running",
                 "num_requests_waiting", "num_requests_swapped", "num_preemptions_total",
                 "prefix_cache_hit_rate", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count"):
        assert "paged_backend:" + name in m, name
    assert m["paged_backend:time_to_first_token_seconds_count"] > 0
    assert m["paged_backend:kv_blocks_total"] == HTTP_NUM_BLOCKS


def test_metrics_under_vllm_names_follow_the_same_values(http):
    """vLLM's names (with vLLM's model_name label) beside ours, so vLLM dashboards work unchanged."""
    before = wait_idle(http)
    r = http.post("/v1/completions", json={"prompt": "Count me", "max_tokens": 3, "n": 2, "temperature": 1.0})
    assert r.status_code == 200
    m = wait_idle(http)
    label = "{model_name=tiny-llama}"
    same = {"num_requests_running": "num_requests_running", "num_requests_waiting": "num_requests_waiting",
            "gpu_cache_usage_perc": "kv_cache_usage", "kv_cache_usage_perc": "kv_cache_usage",
            "prompt_tokens_total": "prompt_tokens_total", "generation_tokens_total": "generation_tokens_total",
            "num_preemptions_total": "num_preemptions_total",
            "time_to_first_token_seconds_count": "time_to_first_token_seconds_count",
            "e2e_request_latency_seconds_count": "e2e_request_latency_seconds_count"}
    for vllm_name, ours in same.items():
        assert m[f"vllm:{vllm_name}{label}"] == m[f"paged_backend:{ours}"], vllm_name
    grew = lambda name: m[name] - before.get(name, 0.0)  # noqa: E731
    assert grew(f"vllm:request_generation_tokens_sum{label}") == 6
    assert grew(f"vllm:request_params_n_sum{label}") == 2
    assert grew("vllm:request_success_total{finished_reason=length,model_name=tiny-llama}") == 1
    assert m["vllm:time_per_output_token_seconds_count" + label] > 0


def test_tokenize(http, http_reference):
    tokens = http.post("/tokenize", json={"inputs": "Hello world"}).json()
    assert [t["id"] for t in tokens] == http_reference.get_tokenizer()("Hello world")["input_ids"]
    assert [t["text"] for t in tokens] == ["Hello", " world"] and tokens[1]["start"] == 5


def test_vllm_tokenize_and_detokenize(http, http_reference):
    tok = http_reference.get_tokenizer()
    plain = http.post("/tokenize", json={"model": HTTP_MODEL, "prompt": "Hello world"}).json()
    assert plain == {"count": len(tok("Hello world")["input_ids"]), "max_model_len": 1024,
                     "tokens": tok("Hello world")["input_ids"], "token_strs": None}
    strs = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                        "return_token_strs": True}).json()
    assert strs["tokens"] == tok("Hello world", add_special_tokens=False)["input_ids"]
    assert strs["token_strs"] == tok.convert_ids_to_tokens(strs["tokens"])
    messages = [{"role": "user", "content": "Say something."}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == chat_ids(http_reference, messages) and chat["count"] == len(chat["tokens"])
    back = http.post("/detokenize", json={"model": HTTP_MODEL, "tokens": strs["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


def test_vllm_v1_metric_series(http):
    """vLLM v1's series the engine fills, under vLLM's names and label."""
    before = wait_idle(http)
    body = {"prompt": "A series of metrics, please. " * 8, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert http.post("/v1/completions", json=body).status_code == 200  # the same prompt: prefix-cache hits
    m = wait_idle(http)
    label = "{model_name=tiny-llama}"
    grew = lambda name: m[f"vllm:{name}{label}"] - before.get(f"vllm:{name}{label}", 0.0)  # noqa: E731
    assert grew("prefix_cache_queries_total") >= grew("prefix_cache_hits_total") > 0
    assert grew("prefix_cache_hits_total") % 16 == 0  # whole blocks of 16 tokens, counted in tokens
    assert m["vllm:prompt_tokens_cached_total" + label] == m["paged_backend:cached_prompt_tokens_total"]
    assert m["vllm:inter_token_latency_seconds_count" + label] == m["paged_backend:time_per_output_token_seconds_count"]
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert grew(name + "_count") == 2, name
        assert m[f"vllm:{name}_sum{label}"] >= 0, name
    assert grew("request_max_num_generation_tokens_sum") == 10 and grew("request_params_max_tokens_sum") == 10
    assert grew("iteration_tokens_total_count") >= 2 * 5  # at least one step per generated token
    info = [k for k in m if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and m[info[0]] == 1.0
    assert f"num_gpu_blocks={HTTP_NUM_BLOCKS}" in info[0] and "block_size=16" in info[0]
