"""The Triton model's engine service without a server: a real engine, fake Triton requests."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from paged_backend import LLM, AsyncLLMEngine, SamplingParams
from paged_backend.adapters.triton.engine_loop import CANCELLED, INVALID_ARG, UNAVAILABLE, EngineService
from paged_backend.adapters.triton.request_inputs import GenerateRequest
from paged_backend.errors import EngineDeadError
from paged_backend.sampling import token_constraints
from paged_backend.worker.loader import load_model
from paged_backend.sampling_params import RequestOutputKind

NUM_BLOCKS = 48


class FakeRequest:
    """Collects what the service sends; `cancel()` makes is_cancelled() true."""

    def __init__(self) -> None:
        self.responses = []
        self.done = threading.Event()
        self.cancelled = False

    def is_cancelled(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        self.cancelled = True

    def send(self, arrays, error, final) -> None:
        assert not self.done.is_set(), "a response after the final one"
        self.responses.append((arrays, error, final))
        if final:
            self.done.set()

    def wait(self, timeout: float = 60.0):
        assert self.done.wait(timeout), "no final response"
        return self.responses

    def texts(self):
        return ["".join(a["text_output"][i].decode() for a, _, _ in self.responses if a is not None)
                for i in range(len(self.responses[-1][0]["text_output"]))]


class Logger:
    def __init__(self) -> None:
        self.lines = []

    def log_info(self, message: str) -> None:
        self.lines.append(message)

    log_error = log_info


@pytest.fixture(scope="module")
def tiny():
    # loaded here rather than through tests/conftest.get_model: `from conftest import` is ambiguous when
    # pytest also collects integration_tests/ (which has its own conftest.py)
    return load_model("tiny-llama", dtype=torch.float32)


@pytest.fixture()
def service(tiny):
    model, tokenizer = tiny
    engine = AsyncLLMEngine(model, tokenizer=tokenizer, num_blocks=NUM_BLOCKS, max_num_seqs=8)
    logger = Logger()
    svc = EngineService(engine, logger, cancel_poll_s=0.02, stats_interval_s=0.05).start()
    svc.test_logger = logger
    yield svc
    svc.shutdown()


def generate_request(prompt: str, stream: bool = False, **params) -> GenerateRequest:
    """What request_inputs builds: deltas when streaming, else only the final output."""
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return GenerateRequest(prompt=prompt, params=SamplingParams(output_kind=kind, **params), stream=stream,
                           prepend_input=not stream)


def _wait_free(svc: EngineService, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = svc.stats()
        if stats.num_free_blocks == stats.num_blocks and not stats.num_running and not stats.num_waiting:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"blocks not freed: {svc.stats()}")


def test_greedy_result_equals_llm_generate(service, tiny):
    model, tokenizer = tiny
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = LLM(model, tokenizer=tokenizer, num_blocks=NUM_BLOCKS).generate(["Paged attention"], params,
                                                                               use_tqdm=False)[0]
    whole, streamed = FakeRequest(), FakeRequest()
    service.submit(generate_request("Paged attention", temperature=0.0, max_tokens=12, ignore_eos=True), whole)
    service.submit(generate_request("Paged attention", True, temperature=0.0, max_tokens=12, ignore_eos=True),
                   streamed)
    (arrays, error, final), = whole.wait()
    assert error is None and final
    assert arrays["text_output"][0].decode() == "Paged attention" + expected.outputs[0].text
    streamed.wait()
    assert all(err is None for _, err, _ in streamed.responses)
    assert [final for _, _, final in streamed.responses].count(True) == 1 and streamed.responses[-1][2]
    assert len(streamed.responses) > 1
    assert streamed.texts() == [expected.outputs[0].text]


def test_vllm_default_of_16_new_tokens(service):
    request = FakeRequest()
    whole = generate_request("Count to sixteen", temperature=0.0, ignore_eos=True)
    whole.return_num_output_tokens = True
    service.submit(whole, request)
    (arrays, error, final), = request.wait()
    assert error is None and final and arrays["num_output_tokens"].tolist() == [16]
    streamed = FakeRequest()
    req = generate_request("Count to sixteen", True, temperature=0.0, ignore_eos=True)
    req.return_num_output_tokens = True
    service.submit(req, streamed)
    streamed.wait()
    assert sum(int(a["num_output_tokens"][0]) for a, _, _ in streamed.responses) == 16


class TimedRequest(FakeRequest):
    """Also records when each response arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.times = []

    def send(self, arrays, error, final) -> None:
        self.times.append(time.monotonic())
        super().send(arrays, error, final)


def test_admitting_a_heavy_request_does_not_stall_other_streams(service, monkeypatch):
    """Tokenizing a request's bad words happens in a worker thread while the loop goes on streaming the other
    requests' tokens: the tokenization below waits, mid-way, until the running stream has received five more
    responses (it would wait forever were it on the loop's thread). Events, not timings: a loaded machine
    slows both sides alike."""
    words = [f"w{i} " + "lorem ipsum dolor sit amet " * 4 for i in range(256)]
    running = TimedRequest()
    seen_while_tokenizing = []
    tokenize = token_constraints._tokenize_words

    def gated(tokenizer, texts):
        if texts and texts[0].startswith("w0 "):
            before = len(running.responses)
            deadline = time.monotonic() + 20
            while len(running.responses) < before + 5 and time.monotonic() < deadline:
                time.sleep(0.005)
            seen_while_tokenizing.append(len(running.responses) - before)
        return tokenize(tokenizer, texts)

    monkeypatch.setattr(token_constraints, "_tokenize_words", gated)
    service.submit(generate_request("stream on", True, temperature=0.0, max_tokens=400, ignore_eos=True), running)
    deadline = time.monotonic() + 30
    while len(running.responses) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    heavy = TimedRequest()
    service.submit(generate_request("heavy", temperature=0.0, max_tokens=2, bad_words=words), heavy)
    (arrays, error, final), = heavy.wait(120)
    running.cancel()
    running.wait()
    assert error is None and final
    assert seen_while_tokenizing and min(seen_while_tokenizing) >= 5, seen_while_tokenizing


def test_cancelled_request_is_aborted_and_frees_its_blocks(service):
    request = FakeRequest()
    service.submit(generate_request("cancel me", True, temperature=0.0, max_tokens=400, ignore_eos=True), request)
    deadline = time.monotonic() + 30
    while not request.responses and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request.responses, "the request never started streaming"
    request.cancel()
    responses = request.wait()
    arrays, error, final = responses[-1]
    assert final and arrays is None and error.code == CANCELLED
    stats = _wait_free(service)
    assert stats.num_generated_tokens < 400
    assert any("cancelled" in line for line in service.test_logger.lines)


def test_engine_refusal_is_an_error_for_that_request_only(service):
    too_long = FakeRequest()
    fine = FakeRequest()
    too_many = FakeRequest()
    service.submit(generate_request("word " * 2000, max_tokens=2), too_long)
    service.submit(generate_request("ok", max_tokens=2000), too_many)
    service.submit(generate_request("ok", max_tokens=2, temperature=0.0), fine)
    (arrays, error, final), = too_long.wait()
    assert final and arrays is None and error.code == INVALID_ARG and "context" in error.message
    (arrays, error, final), = too_many.wait()
    assert final and arrays is None and error.code == INVALID_ARG and "max_tokens" in error.message
    (arrays, error, final), = fine.wait()
    assert error is None and final and arrays["text_output"][0].decode().startswith("ok")


def test_a_dead_engine_answers_unavailable_and_reports_itself_once(tiny):
    model, tokenizer = tiny
    dead = []
    engine = AsyncLLMEngine(model, tokenizer=tokenizer, num_blocks=NUM_BLOCKS)
    svc = EngineService(engine, Logger(), on_dead=dead.append).start()
    try:
        def broken(inputs):
            raise EngineDeadError("tensor-parallel worker rank 1 was killed")

        engine.engine.runner.execute = broken
        first, later = FakeRequest(), FakeRequest()
        svc.submit(generate_request("Hi", max_tokens=2), first)
        (arrays, error, final), = first.wait()
        assert final and error.code == UNAVAILABLE and "rank 1 was killed" in error.message
        svc.submit(generate_request("Hi", max_tokens=2), later)
        (arrays, error, final), = later.wait()
        assert final and error.code == UNAVAILABLE and svc.engine_dead() is not None
        assert len(dead) == 1 and isinstance(dead[0], EngineDeadError)
    finally:
        svc.shutdown()


def test_shutdown_answers_requests_in_flight(tiny):
    model, tokenizer = tiny
    svc = EngineService(AsyncLLMEngine(model, tokenizer=tokenizer, num_blocks=NUM_BLOCKS), Logger()).start()
    request = FakeRequest()
    svc.submit(generate_request("long", True, max_tokens=700, ignore_eos=True), request)
    deadline = time.monotonic() + 30
    while not request.responses and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request.responses and not request.done.is_set()
    svc.shutdown()
    arrays, error, final = request.wait(5)[-1]
    assert final and error is not None and error.code == UNAVAILABLE
    stats = svc.stats()
    assert stats.num_free_blocks == stats.num_blocks
    late = FakeRequest()
    svc.submit(generate_request("late"), late)
    (arrays, error, final), = late.wait(5)
    assert final and error.code == UNAVAILABLE
