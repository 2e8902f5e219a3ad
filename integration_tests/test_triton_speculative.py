"""The real Triton server on a repository whose model.json turns on speculative decoding (`speculative_config`,
vLLM's dict): tritonclient's gRPC stream gets the same greedy text as the offline engine without speculation,
the proposals were verified and some accepted (not merely configured), and Triton's /metrics shows vLLM's
spec_decode counters."""

from __future__ import annotations

import json
import time

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.adapters.triton.tritonserver_process import ServerConfig, TritonServer
from test_triton_server import StreamClient, grpc_inputs, joined_texts, metric_values, post
from test_triton_lora import CONFIG

MODEL = "spec_llm"
# counting patterns smollm2 continues: its own tokens then repeat earlier n-grams, so prompt lookup proposes
PROMPTS = ["one two three four five one two three four five one two three four five one two",
           "Monday Tuesday Wednesday Monday Tuesday Wednesday Monday Tuesday"]
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton_spec_repo")
    version = repo / MODEL / "1"
    version.mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text(CONFIG)
    (version / "model.json").write_text(json.dumps({
        "model": "smollm2", "dtype": "float32", "disable_log_requests": "true", "num_gpu_blocks_override": 64,
        "speculative_config": SPECULATIVE}, indent=4))
    srv = TritonServer(ServerConfig(model_repository=repo, model_control_mode="explicit", load_models=[MODEL]),
                       workdir=tmp_path_factory.mktemp("triton_spec_work"))
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def expected():
    """The texts without speculation (the offline engine, same model, dtype and cache)."""
    llm = LLM("smollm2", dtype=torch.float32, num_blocks=64)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]


def test_grpc_streams_with_prompt_lookup_equal_decoding_without_it(server, expected):
    stream = StreamClient(server, MODEL)
    try:
        for i, prompt in enumerate(PROMPTS):
            stream.send(f"r{i}", grpc_inputs(prompt, True, GREEDY))
        for i in range(len(PROMPTS)):
            assert joined_texts(stream.wait(f"r{i}")) == [expected[i]], PROMPTS[i]
    finally:
        stream.close()
    status, body = post(server, "generate", {"text_input": PROMPTS[0], "exclude_input_in_output": True,
                                             "parameters": GREEDY}, model=MODEL)
    assert status == 200 and json.loads(body)["text_output"] == expected[0], body
    everything = 3 * GREEDY["max_tokens"]   # two streamed requests and one generate call
    counters = _counters_once_reported(server, lambda c: c.get("generation_tokens_total", 0) >= everything)
    assert counters.get("spec_decode_num_drafts_total", 0) >= 1, counters     # proposals were verified
    assert counters["spec_decode_num_draft_tokens_total"] >= counters["spec_decode_num_accepted_tokens_total"] >= 1


def _counters_once_reported(server: TritonServer, condition, timeout: float = 60.0) -> dict:
    """vLLM's counters of the model on Triton's /metrics, once they satisfy `condition` (Triton publishes a
    model's metrics periodically, not at each request)."""
    deadline = time.monotonic() + timeout
    while True:
        counters = metric_values(server, MODEL, prefix="vllm:")
        if condition(counters) or time.monotonic() > deadline:
            return counters
        time.sleep(0.25)
