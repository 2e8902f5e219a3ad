"""The real NVIDIA Triton Inference Server (from the nvidia-pytriton wheel) serving a generated repository.

One server for the module: tiny-llama with a small KV cache on free loopback ports, in explicit
model-control mode so that a deliberately broken model can be loaded on demand. Clients: tritonclient
gRPC streaming, tritonclient HTTP, and plain HTTP on Triton's generate / generate_stream endpoints.
The last test stops the server with SIGTERM and checks that no stub process or /dev/shm region is left.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

import tritonclient.grpc as grpcclient  # the [tritonserver] extra: tritonclient[http,grpc], nvidia-pytriton
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from paged_backend import LLM, SamplingParams
from paged_backend.adapters.triton.repo import write_model_repository
from paged_backend.adapters.triton.server import ServerConfig, TritonServer

MODEL = "paged_llm"
BROKEN = "broken_llm"
NUM_BLOCKS = 96
PROMPTS = ["The capital of France is", "Paged attention splits the KV cache", "Hello"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton_repo")
    write_model_repository(repo, MODEL, {"model": "tiny-llama", "dtype": "float32", "num_blocks": NUM_BLOCKS,
                                         "max_num_seqs": 64})
    write_model_repository(repo, BROKEN, {"model": "tiny-llama", "block_size": 3}, validate=False)
    srv = TritonServer(ServerConfig(model_repository=repo, model_control_mode="explicit", load_models=[MODEL]),
                       workdir=tmp_path_factory.mktemp("triton_work"))
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny-llama", dtype=torch.float32, num_blocks=NUM_BLOCKS)


def expected_text(reference: LLM, prompt: str, **params) -> List[str]:
    out = reference.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    return [c.text for c in out.outputs]


# ---- clients ----------------------------------------------------------------------------------
def grpc_inputs(prompt: Optional[str], stream: bool, params: Optional[object] = None, **flags) -> list:
    inputs = []

    def add(name, array, dtype):
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)

    if prompt is not None:
        add("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES")
    add("stream", np.array([stream]), "BOOL")
    if params is not None:
        raw = params if isinstance(params, str) else json.dumps(params)
        add("sampling_parameters", np.array([raw.encode()], dtype=np.object_), "BYTES")
    for name, value in flags.items():
        add(name, np.array([value]), "BOOL")
    return inputs


class StreamClient:
    """One gRPC stream; collects the responses of each request id until its final one."""

    def __init__(self, server: TritonServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: Dict[str, list] = {}
        self.errors: Dict[str, str] = {}
        self.finished: Dict[str, threading.Event] = {}
        self.client.start_stream(callback=self._callback)

    def _callback(self, result=None, error=None) -> None:
        if error is not None:
            self._on_error(str(error))
            return
        response = result.get_response()
        final = response.parameters.get("triton_final_response")
        if result.as_numpy("text_output") is not None:
            self.results.setdefault(response.id, []).append(result)
        if final is not None and final.bool_param:
            self.finished[response.id].set()

    def _on_error(self, message: str) -> None:
        """gRPC stream errors carry no request id unless Triton put one in the message."""
        match = re.search(r"request id: ([^\]]+)\]", message)
        pending = [rid for rid, event in self.finished.items() if not event.is_set()]
        owner = match.group(1) if match and match.group(1) in self.finished else None
        if owner is None and len(pending) == 1:
            owner = pending[0]
        for rid in [owner] if owner is not None else pending:
            self.errors[rid] = message
            self.finished[rid].set()

    def send(self, request_id: str, inputs: list) -> None:
        self.finished[request_id] = threading.Event()
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def wait(self, request_id: str, timeout: float = 120.0) -> list:
        assert self.finished[request_id].wait(timeout), f"no final response for {request_id}"
        assert request_id not in self.errors, self.errors[request_id]
        return self.results.get(request_id, [])

    def close(self, cancel_requests: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()


def joined_texts(results: list) -> List[str]:
    rows = [[v.decode() for v in r.as_numpy("text_output")] for r in results]
    return ["".join(row[i] for row in rows) for i in range(len(rows[-1]))]


def post(server: TritonServer, path: str, body) -> tuple:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL}/{path}", data=data,
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sse_events(body: str) -> List[dict]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def metric_values(server: TritonServer) -> Dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for match in re.finditer(rf'^paged_backend:(\w+)\{{[^}}]*model="{MODEL}"[^}}]*\}} (\S+)$', text, re.M):
        values[match.group(1)] = float(match.group(2))
    return values


def wait_for_metrics(server: TritonServer, condition, timeout: float = 60.0) -> Dict[str, float]:
    deadline = time.monotonic() + timeout
    values = {}
    while time.monotonic() < deadline:
        values = metric_values(server)
        if values and condition(values):
            return values
        time.sleep(0.25)
    raise AssertionError(f"metrics never met the condition: {values}")


# ---- tests ------------------------------------------------------------------------------------
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}


def test_grpc_streaming_equals_llm_generate(server, reference):
    stream = StreamClient(server)
    try:
        for i, prompt in enumerate(PROMPTS):
            stream.send(f"s{i}", grpc_inputs(prompt, True, GREEDY, return_num_output_tokens=True,
                                             return_finish_reason=True, return_num_input_tokens=True))
            results = stream.wait(f"s{i}")
            assert len(results) > 1, "streaming should answer once per step"
            assert joined_texts(results) == expected_text(reference, prompt, **GREEDY)
            assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == GREEDY["max_tokens"]
            assert results[-1].as_numpy("finish_reason")[0].decode() == "length"
            assert int(results[0].as_numpy("num_input_tokens")[0]) == len(reference.get_tokenizer()(prompt)["input_ids"])
        stream.send("whole", grpc_inputs(PROMPTS[0], False, GREEDY))
        (result,) = stream.wait("whole")
        assert result.as_numpy("text_output")[0].decode() == PROMPTS[0] + expected_text(reference, PROMPTS[0], **GREEDY)[0]
    finally:
        stream.close()


def test_http_client_sees_a_decoupled_model(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        config = client.get_model_config(MODEL)
        assert config["model_transaction_policy"]["decoupled"] is True and config["backend"] == "python"
        names = {entry["name"] for entry in client.get_model_metadata(MODEL)["inputs"]}
        assert {"text_input", "stream", "sampling_parameters", "exclude_input_in_output"} <= names
        text = httpclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
        with pytest.raises(InferenceServerException, match="(?i)decoupled"):
            client.infer(MODEL, [text])  # HTTP /infer does not serve decoupled models: use generate(_stream)
    finally:
        client.close()


def test_generate_endpoint_equals_llm_generate(server, reference):
    prompt = PROMPTS[1]
    expected = expected_text(reference, prompt, **GREEDY)[0]
    status, body = post(server, "generate", {"text_input": prompt, "parameters": GREEDY})
    assert status == 200, body
    assert json.loads(body)["text_output"] == prompt + expected
    status, body = post(server, "generate", {"text_input": prompt, "exclude_input_in_output": True,
                                             "return_finish_reason": True, "return_num_output_tokens": True,
                                             "sampling_parameters": json.dumps({k: str(v) for k, v in GREEDY.items()})})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["text_output"] == expected and answer["finish_reason"] == "length"
    assert answer["num_output_tokens"] == GREEDY["max_tokens"]


def test_generate_stream_pieces_concatenate(server, reference):
    prompt = PROMPTS[0]
    status, body = post(server, "generate_stream", {"text_input": prompt, "stream": True, "parameters": GREEDY})
    assert status == 200, body
    events = sse_events(body)
    assert len(events) > 1 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == expected_text(reference, prompt, **GREEDY)[0]


def test_several_sequences_per_request(server, reference):
    sampled = {"n": 2, "temperature": 0.8, "seed": 11, "max_tokens": 8, "ignore_eos": True}
    beams = {"beam_width": 3, "n": 2, "max_tokens": 6, "temperature": 0}
    for params in (sampled, beams):
        status, body = post(server, "generate", {"text_input": PROMPTS[2], "exclude_input_in_output": True,
                                                 "parameters": params})
        assert status == 200, body
        assert json.loads(body)["text_output"] == expected_text(reference, PROMPTS[2], **params)
    status, body = post(server, "generate_stream", {"text_input": PROMPTS[2], "stream": True, "parameters": beams})
    events = sse_events(body)
    assert status == 200 and all("error" not in e for e in events), body
    streamed = ["".join(e["text_output"][i] for e in events) for i in range(2)]
    assert streamed == expected_text(reference, PROMPTS[2], **beams)


def test_32_concurrent_streams_from_several_clients(server):
    before = metric_values(server)
    clients = [StreamClient(server) for _ in range(4)]
    errors: "queue.Queue[str]" = queue.Queue()
    outcomes: Dict[str, tuple] = {}

    def run(client_index: int, client: StreamClient) -> None:
        try:
            ids = []
            for j in range(8):
                rid = f"c{client_index}-{j}"
                params = {"temperature": 0.7, "seed": 100 * client_index + j, "max_tokens": 10 + j,
                          "ignore_eos": True}
                client.send(rid, grpc_inputs(f"Request {rid}: tell me something", True, params,
                                             return_num_output_tokens=True, return_finish_reason=True))
                ids.append((rid, params["max_tokens"]))
            for rid, max_tokens in ids:
                results = client.wait(rid)
                tokens = sum(int(r.as_numpy("num_output_tokens")[0]) for r in results)
                outcomes[rid] = (tokens, max_tokens, results[-1].as_numpy("finish_reason")[0].decode(),
                                 joined_texts(results)[0])
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.put(f"client {client_index}: {exc!r}")

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    for client in clients:
        client.close()
    assert errors.empty(), list(errors.queue)
    assert len(outcomes) == 32
    for rid, (tokens, max_tokens, reason, text) in outcomes.items():
        assert tokens == max_tokens and reason == "length" and text, (rid, tokens, reason)
    wait_for_metrics(server, lambda v: v["request_success_total"] >= before["request_success_total"] + 32
                     and v["num_free_blocks"] == NUM_BLOCKS and v["num_requests_running"] == 0)


def test_cancelled_stream_frees_its_blocks(server):
    before = wait_for_metrics(server, lambda v: v["num_requests_running"] == 0)
    stream = StreamClient(server)
    stream.send("long", grpc_inputs("Cancel this one", True, {"temperature": 0, "max_tokens": 900,
                                                              "ignore_eos": True}))
    deadline = time.monotonic() + 60
    while len(stream.results.get("long", [])) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(stream.results.get("long", [])) >= 3, "the request never streamed"
    stream.close(cancel_requests=True)
    # the request is over (aborts count as finished) and every block is back in the pool
    after = wait_for_metrics(server, lambda v: v["request_success_total"] > before["request_success_total"]
                             and v["num_free_blocks"] == NUM_BLOCKS and v["num_requests_running"] == 0)
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert 0 < generated < 900, "the request should have been aborted early"
    deadline = time.monotonic() + 30
    while "request was cancelled" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "request was cancelled; aborted in the engine" in server.log_text()


@pytest.mark.parametrize("prompt, params, flags, message", [
    (None, GREEDY, {}, "text_input"),
    ("Hi", "{not json", {}, "not valid JSON"),
    ("Hi", {"temperature": -2}, {}, "temperature"),
    ("Hi", {"top_p": "2.5"}, {}, "top_p"),
    ("Hi", {"max_tokens": "lots"}, {}, "max_tokens must be an integer"),
    ("Hi", {"frobnicate": 1}, {}, "unsupported sampling parameter"),
    ("word " * 2000, {"max_tokens": 2}, {}, "tokens"),
    ("Hi", GREEDY, {"exclude_input_in_output": False}, "streaming"),
])
def test_bad_input_fails_only_that_request(server, reference, prompt, params, flags, message):
    stream = StreamClient(server)
    try:
        stream.send("bad", grpc_inputs(prompt, True, params, **flags))
        assert stream.finished["bad"].wait(60)
        assert re.search(message, stream.errors.get("bad", "")), stream.errors
        stream.send("good", grpc_inputs("Hello", True, {"max_tokens": 4, "temperature": 0, "ignore_eos": True}))
        assert joined_texts(stream.wait("good")) == expected_text(reference, "Hello", max_tokens=4, temperature=0,
                                                                  ignore_eos=True)
    finally:
        stream.close()
    status, body = post(server, "generate", {"text_input": "Hi", "parameters": {"temperature": -2}})
    assert status == 400 and "temperature" in json.loads(body)["error"]
    status, body = post(server, "generate", {"parameters": {"max_tokens": 2}})
    assert status == 400 and "text_input" in json.loads(body)["error"]
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert client.is_model_ready(MODEL)
    finally:
        client.close()


def test_invalid_engine_options_fail_model_loading(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException):
            client.load_model(BROKEN)
        assert not client.is_model_ready(BROKEN)
        assert client.is_model_ready(MODEL)
    finally:
        client.close()
    assert "block_size must be a positive power of two, got 3" in server.log_text()


def test_engine_metrics_are_exported(server):
    values = metric_values(server)
    for name in ("kv_cache_usage_ratio", "num_blocks", "num_free_blocks", "num_requests_running",
                 "num_requests_waiting", "num_preemptions_total", "generation_tokens_total"):
        assert name in values, name
    assert values["num_blocks"] == NUM_BLOCKS and values["kv_cache_usage_ratio"] == 0.0


def test_sigterm_leaves_no_stub_or_shared_memory(server):
    """Runs last: stopping the server finalizes the model, ends the stubs and removes their regions."""
    stubs = server.child_pids()
    regions = server.shm_regions()
    assert stubs and regions, "a loaded model has a stub process and a /dev/shm region"
    assert server.stop() == 0, server.log_tail()
    assert not [pid for pid in stubs if os.path.exists(f"/proc/{pid}")], "stub processes outlived the server"
    assert server.shm_regions() == []
    assert "finalizing model 'paged_llm'" in server.log_text()
