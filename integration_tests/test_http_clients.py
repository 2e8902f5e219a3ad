"""`paged-backend serve` queried with clients nobody here wrote: huggingface_hub's InferenceClient, TGI's
`text-generation` client (installed with --no-deps: it pins huggingface-hub<1.0) and `openai`."""

from __future__ import annotations

import huggingface_hub
import openai
import pytest
import text_generation
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError as HFValidationError

from http_fixtures import http_reference, http_server, local_inference_client  # noqa: F401 (fixtures)
from http_helpers import chat_ids, greedy
from http_server_process import AUTH, HTTP_API_KEY, HTTP_MODEL

# text-generation 0.7 still calls pydantic's deprecated `.dict()`
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Write a haiku about memory pages."}]


@pytest.fixture(scope="module")
def hf(http_server) -> InferenceClient:
    with local_inference_client(http_server.url, HTTP_API_KEY) as client:
        yield client


@pytest.fixture(scope="module")
def tgi(http_server) -> text_generation.Client:
    return text_generation.Client(http_server.url, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def oai(http_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_server.url + "/v1", api_key=HTTP_API_KEY, max_retries=0, timeout=120)


def test_client_versions():
    assert int(huggingface_hub.__version__.split(".")[0]) >= 1  # the hub client the TGI client refuses


def test_inference_client_text_generation(hf, http_reference):
    ref = greedy(http_reference, PROMPT, 8)
    assert hf.text_generation(PROMPT, max_new_tokens=8) == ref.text
    out = hf.text_generation(PROMPT, max_new_tokens=8, details=True)
    assert out.generated_text == ref.text
    assert out.details.finish_reason == "length" and out.details.generated_tokens == 8
    assert [t.id for t in out.details.tokens] == ref.token_ids


def test_inference_client_streaming(hf, http_reference):
    ref = greedy(http_reference, PROMPT, 6)
    assert "".join(hf.text_generation(PROMPT, max_new_tokens=6, stream=True)) == ref.text
    events = list(hf.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    assert [e.token.id for e in events] == ref.token_ids
    assert events[-1].generated_text == ref.text and events[-1].details.finish_reason == "length"


def test_inference_client_chat(hf, http_reference):
    ref = greedy(http_reference, chat_ids(http_reference, MESSAGES), 6)
    out = hf.chat_completion(MESSAGES, max_tokens=6, temperature=0)
    assert out.choices[0].message.content == ref.text and out.usage.completion_tokens == 6
    streamed = hf.chat_completion(MESSAGES, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == ref.text


def test_inference_client_sees_validation_errors(hf):
    with pytest.raises(HFValidationError, match="must be <= 1024"):
        hf.text_generation(PROMPT, max_new_tokens=5000)


def test_text_generation_client(tgi, http_reference):
    ref = greedy(http_reference, PROMPT, 8)
    out = tgi.generate(PROMPT, max_new_tokens=8)
    assert out.generated_text == ref.text
    assert out.details.finish_reason == text_generation.types.FinishReason.Length
    assert [t.id for t in out.details.tokens] == ref.token_ids
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=8))
    assert "".join(e.token.text for e in events) == ref.text == events[-1].generated_text
    assert events[-1].details.generated_tokens == 8


def test_text_generation_client_sampling_and_errors(tgi):
    a = tgi.generate(PROMPT, max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20, seed=7)
    b = tgi.generate(PROMPT, max_new_tokens=5, do_sample=True, temperature=0.8, top_k=20, seed=7)
    assert a.generated_text == b.generated_text and a.details.seed == 7
    with pytest.raises(text_generation.errors.ValidationError, match="KV blocks"):
        tgi.generate("word " * 790, max_new_tokens=5)


def test_openai_completions(oai, http_reference):
    ref = greedy(http_reference, PROMPT, 8)
    out = oai.completions.create(model=HTTP_MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    stream = oai.completions.create(model=HTTP_MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == 8


def test_openai_chat(oai, http_reference):
    ref = greedy(http_reference, chat_ids(http_reference, MESSAGES), 7)
    out = oai.chat.completions.create(model=HTTP_MODEL, messages=MESSAGES, max_tokens=7, temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    stream = oai.chat.completions.create(model=HTTP_MODEL, messages=MESSAGES, max_tokens=7, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.prompt_tokens == len(chat_ids(http_reference, MESSAGES))
    assert chunks[-1].usage.completion_tokens == 7


def test_openai_sampling_n(oai):
    out = oai.chat.completions.create(model=HTTP_MODEL, messages=MESSAGES, max_tokens=4, temperature=0.9, n=3,
                                      seed=11)
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens == 12


def test_openai_errors(http_server, oai):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=HTTP_MODEL, messages=MESSAGES, temperature=5)
    assert bad.value.body["param"] == "temperature"
    wrong = openai.OpenAI(base_url=http_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=HTTP_MODEL, prompt=PROMPT, max_tokens=2)
