"""The real Triton server on a repository written the way Triton's vLLM backend documents multi-LoRA serving:
`model.json` with `enable_lora` (+ `max_loras`, `max_lora_rank`) and `multi_lora.json` beside it; requests pick an
adapter with `lora_name` in `sampling_parameters`. tritonclient's gRPC stream runs requests of two adapters and
the base model at once, each equal to the offline engine with its adapter; an unknown name gets an error
response for that request only; Triton's generate endpoint takes `lora_name` too; Triton's /metrics shows
`vllm:lora_requests_info`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from paged_backend import LLM, LoRARequest, SamplingParams
from paged_backend.adapters.triton.tritonserver_process import ServerConfig, TritonServer
from test_triton_server import StreamClient, grpc_inputs, joined_texts, metrics_text, post

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from lora_adapters import adapter_dirs  # noqa: E402  (tests/: the adapters made by peft)

MODEL = "lora_llm"
PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
CONFIG = '''backend: "paged_backend"

instance_group [
  {
    count: 1
    kind: KIND_MODEL
  }
]
parameters {
  key: "REPORT_CUSTOM_METRICS"
  value: { string_value: "true" }
}
'''


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return adapter_dirs("tiny-llama", tmp_path_factory.mktemp("triton-lora-adapters"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, dirs):
    repo = tmp_path_factory.mktemp("triton_lora_repo")
    version = repo / MODEL / "1"
    version.mkdir(parents=True)
    (repo / MODEL / "config.pbtxt").write_text(CONFIG)
    (version / "model.json").write_text(json.dumps({
        "model": "tiny-llama", "dtype": "float32", "disable_log_requests": "true", "enable_lora": "true",
        "max_lora_rank": 8, "max_loras": 2, "num_gpu_blocks_override": 64}, indent=4))
    (version / "multi_lora.json").write_text(json.dumps({"sql": str(dirs[0]), "chat": str(dirs[1])}, indent=4))
    srv = TritonServer(ServerConfig(model_repository=repo, model_control_mode="explicit", load_models=[MODEL]),
                       workdir=tmp_path_factory.mktemp("triton_lora_work"))
    srv.start()
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def expected(dirs):
    llm = LLM("tiny-llama", dtype=torch.float32, num_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    loras = {"sql": LoRARequest("sql", 1, str(dirs[0])), "chat": LoRARequest("chat", 2, str(dirs[1])), None: None}
    return {name: llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False, lora_request=lora)[0]
            .outputs[0].text for name, lora in loras.items()}


def test_grpc_streams_of_two_adapters_and_the_base_model(server, expected):
    assert len(set(expected.values())) == 3, "the adapters must change the text for this test to mean anything"
    stream, other = StreamClient(server, MODEL), StreamClient(server, MODEL)   # gRPC stream errors carry no id
    try:
        for name in ("sql", "chat", None):
            params = dict(GREEDY, **({"lora_name": name} if name else {}))
            stream.send(f"r-{name}", grpc_inputs(PROMPT, True, params))
        other.send("unknown", grpc_inputs(PROMPT, True, dict(GREEDY, lora_name="nope")))
        for name in ("sql", "chat", None):
            assert joined_texts(stream.wait(f"r-{name}")) == [expected[name]], name
        assert other.finished["unknown"].wait(60)
        assert "LoRA nope is not supported, we currently support ['sql', 'chat']" in other.errors["unknown"]
    finally:
        stream.close()
        other.close()


def test_generate_endpoint_takes_lora_name(server, expected):
    status, body = post(server, "generate", {"text_input": PROMPT, "exclude_input_in_output": True,
                                             "parameters": dict(GREEDY, lora_name="chat")}, model=MODEL)
    assert status == 200 and json.loads(body)["text_output"] == expected["chat"], body
    status, body = post(server, "generate", {"text_input": PROMPT, "parameters": dict(GREEDY, lora_name="x")},
                        model=MODEL)
    assert status == 400 and "LoRA x is not supported" in body, body


def test_lora_requests_info_on_tritons_metrics(server):
    lines = [line for line in metrics_text(server).splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert lines and all(f'model="{MODEL}"' in line and 'max_lora="2"' in line for line in lines), lines
    assert any(re.search(r'running_lora_adapters="[a-z,]*"', line) for line in lines)
