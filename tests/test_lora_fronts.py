"""LoRA on the fronts without server processes: OpenAI `model` and TGI `adapter_id` pick adapters (replies and
`/v1/models` name them), vLLM's load/unload routes with vLLM's replies, Triton's `lora_name` against
`multi_lora.json` (an unknown name refuses that request only), and `triton-repo --lora-modules`."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from conftest import get_model
from lora_adapters import adapter_dirs, peft_greedy
from paged_backend import AsyncLLMEngine, LoRARequest
from paged_backend.adapters.http.app import create_app
from paged_backend.adapters.http.loras import parse_lora_module
from paged_backend.adapters.triton.multi_lora import MULTI_LORA_JSON, load_multi_lora
from paged_backend.adapters.triton.request_inputs import parse_generate_request
from paged_backend.cli import main
from paged_backend.errors import InvalidParameter, UnsupportedParameter

FAMILY = "tiny-llama"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return adapter_dirs(FAMILY, tmp_path_factory.mktemp("lora-fronts"))


@pytest.fixture(scope="module")
def http(dirs):
    model, tok = get_model(FAMILY, torch.float32)
    engine = AsyncLLMEngine(model, tokenizer=tok, num_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    app = create_app(engine, "tiny", lora_modules=[LoRARequest("a0", 1, str(dirs[0]))])
    with TestClient(app) as client:
        yield client


def expected_text(directory, max_tokens: int = 5) -> str:
    model, tok = get_model(FAMILY, torch.float32)
    ids = tok(PROMPT).input_ids
    return tok.decode(peft_greedy(FAMILY, torch.float32, directory, ids, max_tokens))


def complete(http, model: str) -> dict:
    reply = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                               "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_openai_model_names_an_adapter_and_models_lists_it(http, dirs):
    reply = complete(http, "a0")
    assert reply["model"] == "a0" and reply["choices"][0]["text"] == expected_text(dirs[0])
    base = complete(http, "tiny")
    assert base["model"] == "tiny" and base["choices"][0]["text"] == expected_text(None)
    assert base["choices"][0]["text"] != reply["choices"][0]["text"]
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert cards["tiny"]["parent"] is None
    assert cards["a0"]["parent"] == "tiny" and cards["a0"]["root"] == str(dirs[0])


def test_tgi_adapter_id_picks_an_adapter(http, dirs):
    body = {"inputs": PROMPT, "parameters": {"adapter_id": "a0", "max_new_tokens": 5}}
    reply = http.post("/generate", json=body)
    assert reply.status_code == 200 and reply.json()["generated_text"] == expected_text(dirs[0])
    base = http.post("/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "tiny", "max_new_tokens": 5}})
    assert base.json()["generated_text"] == expected_text(None)
    unknown = http.post("/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "nope"}})
    assert unknown.status_code == 422
    assert unknown.json() == {"error": "`adapter_id` 'nope' is not one of this server's adapters (a0)",
                              "error_type": "validation"}


def test_load_and_unload_follow_vllms_routes(http, dirs, tmp_path):
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(dirs[2])})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'late' added successfully."
    assert complete(http, "late")["choices"][0]["text"] == expected_text(dirs[2])
    assert "late" in {c["id"] for c in http.get("/v1/models").json()["data"]}
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(dirs[2])})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'late' has already been loaded."
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    broken = http.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(tmp_path / "none")})
    assert broken.status_code == 400 and "is not a directory" in broken.json()["error"]["message"]
    assert broken.json()["error"]["param"] == "lora_path"
    assert "broken" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
    unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'late' removed successfully."
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'late' cannot be found."
    assert complete(http, "late")["model"] == "tiny"     # any name is accepted; not an adapter's: the base model
    reloaded = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(dirs[1])})
    assert reloaded.status_code == 200     # the same name, new weights: a new id, no KV shared with the old ones
    assert complete(http, "late")["choices"][0]["text"] == expected_text(dirs[1])


def test_the_routes_refuse_when_lora_is_off():
    model, tok = get_model(FAMILY, torch.float32)
    engine = AsyncLLMEngine(model, tokenizer=tok, num_blocks=16)
    with pytest.raises(ValueError, match="enable_lora"):
        create_app(engine, "tiny", lora_modules=[LoRARequest("a", 1, "/x")])
    with TestClient(create_app(engine, "tiny")) as client:
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert reply.status_code == 400 and "start the server with --enable-lora" in reply.json()["error"]["message"]
        tgi = client.post("/generate", json={"inputs": "Hi", "parameters": {"adapter_id": "a"}})
        assert tgi.status_code == 422 and "(none)" in tgi.json()["error"]


def test_lora_modules_entries_read_as_vllm_writes_them():
    assert parse_lora_module("sql=/adapters/sql") == LoRARequest("sql", 1, "/adapters/sql")
    assert parse_lora_module('{"name": "sql", "path": "/a/sql", "base_model_name": "m"}').lora_path == "/a/sql"
    for bad in ("sql", "=/x", '{"name": "sql"}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


# ---- Triton -----------------------------------------------------------------------------------
def _text(value: str):
    import numpy as np

    return np.array([value.encode()], dtype=object)


def test_triton_lora_name_picks_an_adapter_of_multi_lora_json(tmp_path, dirs):
    (tmp_path / MULTI_LORA_JSON).write_text(json.dumps({"first": str(dirs[0]), "second": "../rel"}))
    adapters = load_multi_lora(tmp_path)
    assert adapters["first"] == LoRARequest("first", 1, str(dirs[0]))
    assert adapters["second"] == LoRARequest("second", 2, str(tmp_path / "../rel"))
    request = parse_generate_request({"text_input": _text("x"), "sampling_parameters": _text('{"lora_name": "first"}')},
                                     adapters=adapters)
    assert request.lora_request == adapters["first"]
    plain = parse_generate_request({"text_input": _text("x")}, adapters=adapters)
    assert plain.lora_request is None
    with pytest.raises(InvalidParameter, match=r"LoRA third is not supported, we currently support \['first', "
                                               r"'second'\]"):
        parse_generate_request({"text_input": _text("x"), "sampling_parameters": _text('{"lora_name": "third"}')},
                               adapters=adapters)
    with pytest.raises(UnsupportedParameter, match="LoRA feature is not enabled"):
        parse_generate_request({"text_input": _text("x"), "sampling_parameters": _text('{"lora_name": "first"}')})


@pytest.mark.parametrize("content, message", [
    (None, "multi_lora.json is not found"), ("{nope", "not valid JSON"), ("[]", "must hold a JSON object"),
    ('{"a": 5}', "adapter 'a' must map to its directory")])
def test_a_bad_multi_lora_json_names_the_problem(tmp_path, content, message):
    if content is not None:
        (tmp_path / MULTI_LORA_JSON).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_multi_lora(tmp_path)


def test_triton_repo_writes_multi_lora_json(tmp_path, dirs, capsys):
    argv = ["triton-repo", str(tmp_path), "--model", FAMILY, "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"sql={dirs[0]}", f"chat={dirs[1]}"]
    assert main(argv) == 0
    version = tmp_path / "paged_llm" / "1"
    options = json.loads((version / "model.json").read_text())
    assert (options["enable_lora"], options["max_loras"], options["max_lora_rank"]) == (True, 2, 8)
    assert json.loads((version / MULTI_LORA_JSON).read_text()) == {"sql": str(dirs[0]), "chat": str(dirs[1])}
    assert main(["triton-repo", str(tmp_path / "plain"), "--model", FAMILY]) == 0
    plain = json.loads((tmp_path / "plain" / "paged_llm" / "1" / "model.json").read_text())
    assert "enable_lora" not in plain and not (tmp_path / "plain" / "paged_llm" / "1" / MULTI_LORA_JSON).exists()
    assert main(["triton-repo", str(tmp_path / "x"), "--lora-modules", f"a={dirs[0]}"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
