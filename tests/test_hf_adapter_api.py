"""`paged_backend.adapters.hf` beyond token fidelity: argument resolution, streamers, `generate_stream`,
sampling statistics, stopping criteria, refusals and the attach / detach life cycle."""

from __future__ import annotations

import math
import threading
import weakref

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList,
                          TemperatureLogitsWarper, TextIteratorStreamer, TextStreamer, TopKLogitsWarper,
                          TopPLogitsWarper)

from conftest import assert_no_leaks, get_model
from hf_compare import assert_same_output, hf_generate, left_padded
from paged_backend.adapters.hf import PagedModelForCausalLM, attach, detach, is_attached
from paged_backend.adapters.hf.generation_config import resolve_generation_config, sampling_params

PAD = 2


@pytest.fixture
def gpt2():
    model, tok = get_model("tiny-gpt2", torch.float64)
    attach(model, tokenizer=tok, num_blocks=128, block_size=8)
    try:
        yield model, tok
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)


@pytest.mark.parametrize("kwargs", [
    {}, {"max_new_tokens": 5}, {"max_length": 30, "do_sample": True}, {"do_sample": True, "top_k": 0, "top_p": 0.8},
    {"num_beams": 3, "num_return_sequences": 2, "early_stopping": "never"}, {"eos_token_id": [5, 7], "pad_token_id": 0},
    {"generation_config": GenerationConfig(max_new_tokens=3, temperature=0.5, do_sample=True)},
])
def test_config_resolution_equals_transformers(kwargs):
    model, _ = get_model("tiny-gpt2", torch.float64)
    kwargs = dict(kwargs)
    given = kwargs.pop("generation_config", None)
    ours = resolve_generation_config(model, given, dict(kwargs)).config
    theirs, _ = model._prepare_generation_config(given, **kwargs)
    assert ours.to_dict() == theirs.to_dict()


def test_transformers_defaults_apply(gpt2):
    model, tok = gpt2
    enc = tok(["Hello there"], return_tensors="pt")
    with pytest.warns(UserWarning, match="max_length"):
        out = model.generate(**enc, eos_token_id=None)
    assert out.shape == (1, enc.input_ids.shape[1] + 20)  # transformers 5: 20 new tokens by default
    assert torch.equal(out, hf_generate(model, **enc, eos_token_id=None))
    resolved = resolve_generation_config(model, None, {"do_sample": True})
    params = sampling_params(resolved, 4, [PAD], seed=1, output_scores=False)
    assert (params.top_k, params.top_p, params.temperature) == (50, 1.0, 1.0)


class Collecting(TextStreamer):
    """A TextStreamer that keeps the text instead of printing it."""

    def __init__(self, tok, **kwargs):
        super().__init__(tok, **kwargs)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.text += text


def test_text_streamer_gets_the_final_text(gpt2):
    model, tok = gpt2
    enc = tok(["Streaming a story: once upon a time"], return_tensors="pt")
    ours, theirs = Collecting(tok), Collecting(tok)
    out = model.generate(**enc, max_new_tokens=12, streamer=ours)
    ref = hf_generate(model, **enc, max_new_tokens=12, streamer=theirs)
    assert torch.equal(out, ref)
    assert ours.text == theirs.text == tok.decode(out[0])


def test_text_iterator_streamer_from_another_thread(gpt2):
    model, tok = gpt2
    enc = tok(["A streamer read by another thread"], return_tensors="pt")
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True, timeout=120)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "out", model.generate(**enc, max_new_tokens=10, streamer=streamer)))
    worker.start()
    text = "".join(streamer)
    worker.join(timeout=120)
    out = result["out"]
    assert text == tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
    assert torch.equal(out, hf_generate(model, **enc, max_new_tokens=10))


def test_streamer_refuses_a_batch_like_transformers(gpt2):
    model, tok = gpt2
    enc = left_padded(tok)
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(**enc, max_new_tokens=4, streamer=TextStreamer(tok))
    assert_no_leaks(model.paged_engine)


def test_generate_stream_events_and_output(gpt2):
    model, tok = gpt2
    enc = left_padded(tok)
    stream = model.generate_stream(**enc, max_new_tokens=9, eos_token_id=[PAD, 262])
    events = list(stream)
    out = stream.output
    assert torch.equal(out, model.generate(**enc, max_new_tokens=9, eos_token_id=[PAD, 262]))
    prompt_len = enc.input_ids.shape[1]
    for row in range(out.shape[0]):
        mine = [e for e in events if e.row == row]
        generated = out[row, prompt_len:].tolist()
        assert [e.token_id for e in mine] == generated[: len(mine)]
        assert all(t == PAD for t in generated[len(mine):])
        assert [e.step for e in mine] == list(range(1, len(mine) + 1))
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == ("length" if len(mine) == 9 else "stop")
        assert "".join(e.text for e in mine) == tok.decode(generated[: len(mine)], skip_special_tokens=True)


def test_closing_a_stream_early_frees_its_blocks(gpt2):
    model, tok = gpt2
    enc = left_padded(tok)
    alone = model.generate(**enc, max_new_tokens=2)
    stream = model.generate_stream(**enc, max_new_tokens=30)
    next(stream), next(stream)
    assert torch.equal(model.generate(**enc, max_new_tokens=2), alone)  # same thread, stream not finished
    stream.close()
    assert_no_leaks(model.paged_engine)
    assert model.generate(**enc, max_new_tokens=2).shape[1] == enc.input_ids.shape[1] + 2


def test_an_unfinished_stream_in_one_thread_does_not_block_generate_in_another(gpt2):
    model, tok = gpt2
    enc = left_padded(tok)
    expected = model.generate(**enc, max_new_tokens=5)
    streamed = model.generate(**enc, max_new_tokens=12)
    started, release, events = threading.Event(), threading.Event(), []

    def reader():
        stream = model.generate_stream(**enc, max_new_tokens=12)
        events.append(next(stream))
        started.set()
        release.wait(120)  # holds the stream open, unfinished
        events.extend(stream)
        events.append(stream.output)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        assert started.wait(120)
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault("out", model.generate(**enc, max_new_tokens=5)))
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "generate waited for another thread's unfinished stream"
        assert torch.equal(result["out"], expected)
    finally:
        release.set()
        thread.join(timeout=120)
    assert torch.equal(events[-1], streamed)  # the stream went on unchanged afterwards


def test_an_attached_model_stays_copyable_and_picklable(gpt2):
    import copy
    import io
    import pickle

    model, tok = gpt2
    enc = left_padded(tok)
    expected = model.generate(**enc, max_new_tokens=4)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), copy.copy(model)):
        assert not is_attached(clone) and "generate" not in clone.__dict__ and "paged_engine" not in clone.__dict__
        assert torch.equal(hf_generate(clone, **enc, max_new_tokens=4, do_sample=False), expected)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert is_attached(model) and torch.equal(model.generate(**enc, max_new_tokens=4), expected)


def _set_mode(model, mode: str) -> None:
    model.train(mode != "eval")
    if mode == "mixed":
        model.transformer.h[0].eval()


@pytest.mark.parametrize("mode", ["train", "eval", "mixed"])
def test_attach_and_detach_leave_training_as_they_found_it(mode):
    model, tok = get_model("tiny-gpt2", torch.float64)  # shared with other tests: put back in eval mode after
    _set_mode(model, mode)
    flags = {name: m.training for name, m in model.named_modules()}
    try:
        _check_training_kept(model, tok, mode, flags)
    finally:
        model.eval()


def _check_training_kept(model, tok, mode: str, flags: dict) -> None:
    attach(model, tokenizer=tok, num_blocks=32, block_size=8)
    try:
        assert {name: m.training for name, m in model.named_modules()} == flags
        enc = left_padded(tok)
        out = model.generate(**enc, max_new_tokens=3)  # runs with dropout off, whatever the mode
        assert {name: m.training for name, m in model.named_modules()} == flags
        model.eval()
        assert torch.equal(hf_generate(model, **enc, max_new_tokens=3, do_sample=False), out)
        _set_mode(model, mode)
    finally:
        detach(model)
    assert {name: m.training for name, m in model.named_modules()} == flags


def test_sampling_with_a_seed_is_reproducible(gpt2):
    model, tok = gpt2
    enc = left_padded(tok)
    kwargs = dict(do_sample=True, max_new_tokens=6, num_return_sequences=2, temperature=0.9)
    torch.manual_seed(1234)
    first = model.generate(**enc, **kwargs)
    torch.manual_seed(1234)
    second = model.generate(**enc, **kwargs)
    assert torch.equal(first, second)
    assert first.shape == (6, enc.input_ids.shape[1] + 6)
    torch.manual_seed(99)
    assert not torch.equal(first, model.generate(**enc, **kwargs))


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_first_token_frequencies_match_the_filtered_distribution():
    model, tok = get_model("tiny-llama", torch.float32)
    attach(model, tokenizer=tok, num_blocks=64, block_size=16, max_num_seqs=2048)
    try:
        enc = tok(["The weather today"], return_tensors="pt")
        samples = 2000
        torch.manual_seed(0)
        out = model.generate(**enc, do_sample=True, temperature=0.6, top_k=12, top_p=0.8, max_new_tokens=1,
                             num_return_sequences=samples)
        assert_no_leaks(model.paged_engine)
    finally:
        detach(model)
    with torch.no_grad():
        logits = model(**enc).logits[:, -1].float()
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(12), TopPLogitsWarper(0.8)])
    probs = warpers(enc.input_ids, logits).softmax(-1)[0]
    drawn = torch.bincount(out[:, -1], minlength=probs.shape[0]).double()
    support = probs > 0
    assert 2 <= int(support.sum()) <= 12
    assert drawn[~support].sum() == 0  # never a token outside the top-k / top-p set
    expected = probs[support].double() * samples
    observed = drawn[support]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < _chi_square_critical(int(support.sum()) - 1), (statistic, observed, expected)


class StopAfterToken(StoppingCriteria):
    """Stops rows whose newest token is `token`, and records the shapes it was called with."""

    def __init__(self, token: int):
        self.token, self.shapes = token, []

    def __call__(self, input_ids, scores, **kwargs):
        self.shapes.append(tuple(input_ids.shape))
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("eos", [PAD, None])
def test_custom_stopping_criteria_see_the_full_ids(gpt2, eos):
    model, tok = gpt2
    enc = left_padded(tok)
    greedy = hf_generate(model, **enc, max_new_tokens=8, eos_token_id=eos)
    token = int(greedy[0, enc.input_ids.shape[1] + 2])
    ours, theirs = StopAfterToken(token), StopAfterToken(token)
    out = model.generate(**enc, max_new_tokens=8, eos_token_id=eos, stopping_criteria=StoppingCriteriaList([ours]))
    ref = hf_generate(model, **enc, max_new_tokens=8, eos_token_id=eos, stopping_criteria=StoppingCriteriaList([theirs]))
    assert_same_output(ref, out)
    assert ours.shapes == theirs.shapes
    if eos is not None:  # row 0 stopped after its third token and was padded from then on
        assert set(out[0, enc.input_ids.shape[1] + 3:].tolist()) == {PAD}


def test_max_time_stops_like_transformers(gpt2):
    model, tok = gpt2
    enc = left_padded(tok)
    assert_same_output(hf_generate(model, **enc, max_new_tokens=8, max_time=0.0),
                       model.generate(**enc, max_new_tokens=8, max_time=0.0))


@pytest.mark.parametrize("kwargs, message", [
    ({"encoder_no_repeat_ngram_size": 2}, "encoder_no_repeat_ngram_size"),
    ({"forced_eos_token_id": 5}, "forced_eos_token_id"),
    ({"do_sample": True, "typical_p": 0.5}, "typical_p"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
    ({"logits_processor": TemperatureLogitsWarper(0.5)}, "LogitsProcessorList"),
    ({"logits_processor": LogitsProcessorList([5])}, "must be callables"),
    ({"prefix_allowed_tokens_fn": [1, 2]}, "prefix_allowed_tokens_fn must be a callable"),
    ({"foo": 1}, "foo"),
    ({"token_type_ids": torch.zeros(3, 13, dtype=torch.long)}, "token_type_ids"),
    ({"num_beams": 2, "do_sample": True}, "beam sampling"),
    ({"num_beams": 2, "stop_strings": ["a"]}, "beam search"),
    ({"num_beams": 2, "streamer": "set below"}, "streamer"),
    ({"max_new_tokens": 5000}, "context"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
])
def test_unsupported_arguments_raise_value_error(gpt2, kwargs, message):
    model, tok = gpt2
    enc = left_padded(tok)
    if kwargs.get("streamer") == "set below":
        kwargs["streamer"] = TextStreamer(tok)
    with pytest.raises(ValueError, match=message):
        model.generate(**enc, **kwargs)


def test_right_padding_is_refused_and_empty_lists_are_accepted(gpt2):
    model, tok = gpt2
    tok.padding_side = "right"
    try:
        right = tok(["a longer prompt here", "short"], return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "left"
    with pytest.raises(ValueError, match="right padding"):
        model.generate(**right, max_new_tokens=2)
    enc = left_padded(tok)
    out = model.generate(**enc, max_new_tokens=3, logits_processor=LogitsProcessorList(),
                         stopping_criteria=StoppingCriteriaList(), synced_gpus=False)
    assert torch.equal(out, hf_generate(model, **enc, max_new_tokens=3))


def test_concurrent_calls_from_threads_are_serialized(gpt2):
    model, tok = gpt2
    enc = left_padded(tok)
    expected = model.generate(**enc, max_new_tokens=5)
    results = [None, None]

    def call(i):
        results[i] = model.generate(**enc, max_new_tokens=5)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(torch.equal(r, expected) for r in results)


def test_attach_detach_life_cycle():
    model, tok = get_model("tiny-opt", torch.float64)
    original = model.generate
    attach(model, tokenizer=tok, num_blocks=32, block_size=8)
    with pytest.raises(ValueError, match="already attached"):
        attach(model, tokenizer=tok)
    kv = weakref.ref(model.paged_engine.runner.cache_engine.kv)
    enc = tok(["Attach me"], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=3)
    detach(model)
    assert kv() is None  # the KV cache tensors are gone
    assert not is_attached(model) and not hasattr(model, "generate_stream") and not hasattr(model, "paged_engine")
    assert model.generate == original
    assert torch.equal(out, model.generate(**enc, max_new_tokens=3))
    with pytest.raises(ValueError, match="not attached"):
        detach(model)


def test_paged_model_from_pretrained(tmp_path):
    model = PagedModelForCausalLM.from_pretrained("tiny-gpt-neox", num_blocks=32, block_size=8)
    tok = model.paged_engine.tokenizer
    try:
        enc = tok(["From a preset"], return_tensors="pt")
        first = model.generate(**enc, max_new_tokens=4)
        assert torch.equal(first, hf_generate(model, **enc, max_new_tokens=4))
        model.save_pretrained(tmp_path)
        tok.save_pretrained(tmp_path)
    finally:
        detach(model)
    loaded = PagedModelForCausalLM.from_pretrained(str(tmp_path), num_blocks=32, block_size=8)
    try:
        assert torch.equal(loaded.generate(**enc, max_new_tokens=4), first)
    finally:
        detach(loaded)


@pytest.mark.parametrize("case", ["positional", "no_mask", "bos_start", "beams_without_eos", "beam_pad_zero"])
def test_edge_calls_equal_transformers(gpt2, case):
    model, tok = gpt2
    ids = torch.tensor([[504, 3575, 282], [4649, 314, 58]])
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    args, kwargs = (), dict(max_new_tokens=6)  # "bos_start": no inputs at all, transformers starts from BOS
    if case == "positional":
        args = (ids,)
    elif case == "no_mask":
        kwargs["input_ids"] = ids
    elif case == "beams_without_eos":
        kwargs.update(enc, num_beams=3, num_return_sequences=2, eos_token_id=None, return_dict_in_generate=True,
                      output_scores=True)
    elif case == "beam_pad_zero":  # transformers fills beams with eos when pad_token_id is 0
        kwargs.update(enc, num_beams=2, pad_token_id=0, eos_token_id=[262, 48354], max_new_tokens=12)
    out = model.generate(*args, **kwargs)
    assert_same_output(hf_generate(model, *args, **kwargs), out)
    if case == "beam_pad_zero":
        assert int(out[0, -1]) == 262  # row 0 ended early and was filled with eos_token_id[0], not 0
    if case == "bos_start":
        assert out.shape == (1, 7) and int(out[0, 0]) == 1


def test_a_failing_stopping_criterion_leaves_nothing_behind(gpt2):
    model, tok = gpt2
    enc = left_padded(tok)
    calls = []

    def explode(input_ids, scores, **kwargs):
        calls.append(input_ids.shape)
        if len(calls) == 2:
            raise KeyError("criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with pytest.raises(KeyError, match="criterion failed"):
        model.generate(**enc, max_new_tokens=6, stopping_criteria=[explode])
    assert_no_leaks(model.paged_engine)
    assert model.generate(**enc, max_new_tokens=2).shape == (3, enc.input_ids.shape[1] + 2)
