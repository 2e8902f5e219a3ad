"""LoRA adapters over HTTP with clients nobody here wrote: `paged-backend serve --enable-lora --lora-modules ...`
answers the `openai` client's requests under an adapter's name (completions and chat, streamed or not) and
`adapter_id` of TGI requests, exactly as the offline engine with that adapter; an adapter is loaded
and unloaded over HTTP while other requests stream (they finish with their own adapter's tokens), and
`/metrics` shows `vllm:lora_requests_info`. (TGI's own `text_generation` 0.7 client has no `adapter_id`;
`huggingface_hub.InferenceClient`, which sends it, stands for TGI's clients.)"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from huggingface_hub.errors import ValidationError as HFValidationError

from http_fixtures import local_inference_client
from http_helpers import metrics
from http_server_process import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from lora_adapters import adapter_dirs  # noqa: E402  (tests/: the adapters made by peft)

from paged_backend import LLM, LoRARequest, SamplingParams  # noqa: E402

MODEL = "tiny-llama"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return adapter_dirs(MODEL, tmp_path_factory.mktemp("lora-clients"))


@pytest.fixture(scope="module")
def server(dirs):
    srv = ServerProcess([MODEL, "--dtype", "float32", "--num-blocks", "96", "--enable-lora", "--max-loras", "2",
                         "--max-lora-rank", "8", "--lora-modules", f"sql={dirs[0]}",
                         f'{{"name": "chat", "path": "{dirs[1]}"}}', "--log-level", "warning"])
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(dirs):
    """The offline engine with the same adapters: what every reply must equal."""
    llm = LLM(MODEL, dtype=torch.float32, num_blocks=256, enable_lora=True, max_loras=3, max_lora_rank=8)
    loras = {"sql": LoRARequest("sql", 1, str(dirs[0])), "chat": LoRARequest("chat", 2, str(dirs[1])),
             "late": LoRARequest("late", 3, str(dirs[2])), None: None}

    def text(adapter, max_tokens=6, prompt=PROMPT):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate([prompt], params, use_tqdm=False, lora_request=loras[adapter])[0].outputs[0].text

    text.llm = llm
    return text


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _complete(oai, model, max_tokens=6):
    out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                 extra_body={"ignore_eos": True})
    return out.model, out.choices[0].text


def test_openai_client_names_adapters(oai, reference):
    assert _complete(oai, "sql") == ("sql", reference("sql"))
    assert _complete(oai, "chat") == ("chat", reference("chat"))
    assert _complete(oai, MODEL) == (MODEL, reference(None))
    assert len({reference("sql"), reference("chat"), reference(None)}) == 3
    stream = oai.completions.create(model="sql", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference("sql")
    assert {c.model for c in chunks} == {"sql"}
    tok = reference.llm.get_tokenizer()
    chat_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok(chat_prompt, add_special_tokens=False).input_ids
    chat = oai.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert chat.model == "chat" and chat.choices[0].message.content == reference("chat", 5, ids)


def test_models_lists_the_adapters_with_their_parent(oai, dirs):
    cards = {m.id: m for m in oai.models.list().data}
    assert cards["sql"].parent == MODEL and cards["sql"].root == str(dirs[0])
    assert cards["chat"].parent == MODEL and cards[MODEL].parent is None


def test_tgi_adapter_id_from_huggingface_hub(server, reference):
    with local_inference_client(server.url) as hub:
        assert hub.text_generation(PROMPT, max_new_tokens=6, adapter_id="chat") == reference("chat")
        assert "".join(hub.text_generation(PROMPT, max_new_tokens=6, adapter_id="sql", stream=True)) == \
            reference("sql")
        with pytest.raises(HFValidationError, match="not one of this server's adapters"):
            hub.text_generation(PROMPT, max_new_tokens=2, adapter_id="nope")


def test_load_and_unload_over_http_while_requests_run(server, oai, dirs, reference):
    """Streams on the base model and on `sql` run while `late` is loaded and used, and `sql` is unloaded: every
    stream ends with its own adapter's tokens; afterwards `sql` names no adapter (the base model answers)."""
    long = 320   # long enough to outlast loading `late`, a request on it and the unload, however fast the machine
    http = httpx.Client(base_url=server.url, timeout=120)

    def stream(model):
        out = oai.completions.create(model=model, prompt=PROMPT, max_tokens=long, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in out if c.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = {model: pool.submit(stream, model) for model in ("sql", MODEL)}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # both are generating
            info = [k for k, v in metrics(http).items() if k.startswith("vllm:lora_requests_info{")]
            if any("running_lora_adapters=sql" in k for k in info):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the sql stream never showed up in vllm:lora_requests_info")
        assert any("max_lora=2" in k for k in info)
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(dirs[2])})
        assert loaded.status_code == 200, loaded.text
        assert _complete(oai, "late") == ("late", reference("late"))
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert unloaded.status_code == 200, unloaded.text
        assert not running["sql"].done(), "unload while the sql stream still runs"
        assert running["sql"].result() == reference("sql", long)
        assert running[MODEL].result() == reference(None, long)
    assert _complete(oai, "sql") == (MODEL, reference(None))
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 404
    assert {m.id for m in oai.models.list().data} == {MODEL, "chat", "late"}
