"""Triton front without a server: request tensors, response arrays (from the engine's deltas), model.json
under vLLM's engine-argument names, instance placement and the repository layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged_backend import CompletionOutput, RequestOutput
from paged_backend.engine.outputs import Logprob
from paged_backend.adapters.triton.model_json import load_model_options, parse_model_options
from paged_backend.adapters.triton.placement import Placement, engine_kwargs, place
from paged_backend.adapters.triton.repository import INPUTS, install_backend, write_model_repository
from paged_backend.adapters.triton.request_inputs import (GenerateRequest, parse_generate_request,
                                                          parse_sampling_parameters)
from paged_backend.adapters.triton.response_outputs import StreamState, build_outputs
from paged_backend.adapters.triton.trtllm_inputs import trtllm_input_configs
from paged_backend.errors import UnsupportedParameter
from paged_backend.sampling_params import RequestOutputKind


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


# ---- requests -----------------------------------------------------------------------------------
def test_sampling_parameters_use_the_engines_mapping():
    params = parse_sampling_parameters(json.dumps({
        "temperature": "0.5", "top_k": "0", "max_tokens": "16", "ignore_eos": "true", "stop": '["a", "b"]',
        "logprobs": 2, "bad_words": ["x"], "allowed_token_ids": [5, 6], "seed": None}))
    assert (params.temperature, params.top_k, params.max_tokens, params.ignore_eos) == (0.5, -1, 16, True)
    assert params.stop_strings == ["a", "b"] and params.logprobs == 2 and params.bad_words == ["x"]
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
    assert parse_sampling_parameters("{}", stream=True).output_kind == RequestOutputKind.DELTA
    assert parse_sampling_parameters("").max_tokens is None  # vLLM's 16 is applied at admission (engine_loop)
    assert parse_sampling_parameters('{"use_beam_search": true, "n": 2}').beam_width == 2


def test_structured_outputs_come_as_the_vllm_backend_sends_them():
    """vllm_backend passes `structured_outputs` as a JSON string and `guided_decoding` as an object or a string
    (its `backend` field dropped); both reach SamplingParams.structured_outputs."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_string = parse_sampling_parameters(json.dumps({"structured_outputs": json.dumps({"json": schema}),
                                                      "temperature": "0"}))
    assert as_string.structured_outputs.schema == schema
    as_object = parse_sampling_parameters(json.dumps({"guided_decoding": {"regex": "[0-9]+", "backend": "xgrammar"}}))
    assert as_object.structured_outputs.regex == "[0-9]+" and as_object.guided_decoding is None
    nested = parse_sampling_parameters(json.dumps({"guided_decoding": json.dumps({"choice": ["a", "b"]})}))
    assert nested.structured_outputs.choice == ["a", "b"]


@pytest.mark.parametrize("raw, message", [
    ('{"structured_outputs": "{not json"}', "structured_outputs is not valid JSON"),
    ('{"structured_outputs": {"regex": "a", "choice": ["b"]}}', "exactly one of"),
    ('{"guided_decoding": {"jsn": {}}}', "unknown structured_outputs field"),
    ('{"structured_outputs": {"regex": "a"}, "guided_decoding": {"regex": "b"}}', "not both"),
    ('{"structured_outputs": 5}', "must be an object"),
    ("{bad json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"temperature": "hot"}', "temperature must be a finite number"),
    ('{"top_k": -3}', "top_k"),
    ('{"max_tokens": 1.5}', "max_tokens must be an integer"),
    ('{"frobnicate": 1}', "unsupported sampling parameter 'frobnicate'"),
    ('{"use_beam_search": true}', "use_beam_search needs best_of"),
    ('{"lora_name": "adapter"}', "LoRA feature is not enabled"),
    ('{"prompt_logprobs": 1}', "prompt_logprobs=1 is not supported"),
])
def test_bad_sampling_parameters_raise_clear_errors(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_sampling_parameters(raw)


def test_defaults_follow_the_vllm_backend():
    req = parse_generate_request({"text_input": text("Hello")})
    assert req.prompt == "Hello" and not req.stream and req.prepend_input
    assert not (req.return_finish_reason or req.return_cumulative_logprob or req.return_logprobs
                or req.return_num_input_tokens or req.return_num_output_tokens)
    streaming = parse_generate_request({"text_input": text("Hello"), "stream": flag(True)})
    assert streaming.stream and not streaming.prepend_input
    excluded = parse_generate_request({"text_input": text("Hello"), "exclude_input_in_output": flag(True),
                                       "return_logprobs": flag(True), "return_num_output_tokens": flag(True)})
    assert not excluded.prepend_input and excluded.return_logprobs and excluded.return_num_output_tokens


def test_sampling_parameters_tensor_wins_over_request_parameters():
    req = parse_generate_request({"text_input": text("Hi"), "sampling_parameters": text('{"max_tokens": "4"}')},
                                 '{"max_tokens": 9}')
    assert req.params.max_tokens == 4
    generate = parse_generate_request({"text_input": text("Hi")},
                                      '{"max_tokens": 5, "temperature": 0, "stream": true, "return_logprobs": true}')
    assert generate.params.max_tokens == 5 and generate.stream and generate.return_logprobs


@pytest.mark.parametrize("inputs, params, message", [
    ({}, None, "missing required input tensor 'text_input'"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None, "exactly one element, got 2"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, None, "not valid UTF-8"),
    ({"text_input": np.array([3], dtype=np.int32)}, None, "text_input must be a string"),
    ({"text_input": text("x"), "sampling_parameters": text("{oops")}, None, "sampling_parameters is not valid JSON"),
    ({"text_input": text("x")}, "{oops", "request parameters is not valid JSON"),
    ({"text_input": text("x"), "stream": flag(True), "exclude_input_in_output": flag(False)}, None,
     "not allowed when streaming"),
    ({"text_input": text("x"), "stream": flag(True), "sampling_parameters": text('{"n": 1, "best_of": 2}')}, None,
     "cannot be streamed"),
    ({"text_input": text("x"), "image": text("aGk=")}, None, "images are not supported"),
    ({"text_input": text("x"), "embedding_request": text("{}")}, None, "embedding requests are not supported"),
])
def test_bad_requests_raise_clear_errors(inputs, params, message):
    with pytest.raises(ValueError, match=message):
        parse_generate_request(inputs, params)


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("inputs, message", [
    ({"sampling_parameters": text(json.dumps({"structured_outputs": json.dumps({"json": DEEP})}))}, "nested more than"),
    ({"sampling_parameters": text(json.dumps({"guided_decoding": {"json": DEEP}}))}, "nested more than"),
    ({"sampling_parameters": text('{"a": ' * 5000 + "1" + "}" * 5000)}, "sampling_parameters is nested more than"),
])
def test_json_nested_thousands_deep_is_a_value_error(inputs, message):
    """A ValueError is answered INVALID_ARG (a RecursionError was INTERNAL)."""
    with pytest.raises(ValueError, match=message):
        parse_generate_request({"text_input": text("x"), **inputs})
    with pytest.raises(ValueError, match="nested more than"):
        parse_generate_request({"text_input": text("x")}, json.dumps({"stop": "x", "structured_outputs": DEEP}))


# ---- TensorRT-LLM-style requests (Triton's OpenAI frontend) -----------------------------------------
def frontend_inputs(prompt: str, stream: bool, max_tokens: int = 16, stop=None, top_p=None, frequency_penalty=None,
                    presence_penalty=None, seed=None, temperature=None, echo=None, guided_json=None) -> dict:
    """The tensors of `_create_trtllm_generate_request` in triton-inference-server/server
    (python/openai/openai_frontend/engine/utils/triton.py), shapes and dtypes as it builds them."""
    inputs = {"text_input": np.array([[prompt]], dtype=np.object_), "stream": np.bool_([[stream]]),
              "max_tokens": np.int32([[max_tokens]])}
    if stop:
        inputs["stop_words"] = np.array([stop if isinstance(stop, list) else [stop]], dtype=np.object_)
    for name, value, kind in (("top_p", top_p, np.float32), ("frequency_penalty", frequency_penalty, np.float32),
                              ("presence_penalty", presence_penalty, np.float32), ("seed", seed, np.uint64),
                              ("temperature", temperature, np.float32)):
        if value is not None:
            inputs[name] = kind([[value]])
    if echo is not None:
        inputs["exclude_input_in_output"] = np.bool_([[not echo]])
    if guided_json is not None:
        inputs["guided_decoding_guide_type"] = np.array([["json_schema"]], dtype=np.object_)
        inputs["guided_decoding_guide"] = np.array([[guided_json]], dtype=np.object_)
    inputs["return_num_input_tokens"] = np.bool_([[True]])
    inputs["return_num_output_tokens"] = np.bool_([[True]])
    return inputs


def test_the_openai_frontends_trtllm_requests_are_understood():
    chat = parse_generate_request(frontend_inputs("<|user|>Hi", False, max_tokens=7, stop=["\n", "END"], top_p=0.5,
                                                  frequency_penalty=0.25, presence_penalty=-0.5, seed=42,
                                                  temperature=0.0))
    p = chat.params
    assert chat.prompt == "<|user|>Hi" and not chat.stream and not chat.prepend_input and chat.batched
    assert (p.max_tokens, p.stop_strings, p.top_p, p.seed, p.temperature) == (7, ["\n", "END"], 0.5, 42, 0.0)
    assert (p.frequency_penalty, p.presence_penalty) == (0.25, -0.5)
    assert p.output_kind == RequestOutputKind.FINAL_ONLY and chat.return_num_input_tokens
    streamed = parse_generate_request(frontend_inputs("Hi", True))
    assert streamed.stream and not streamed.prepend_input and streamed.params.output_kind == RequestOutputKind.DELTA
    echoed = parse_generate_request(frontend_inputs("Hi", False, echo=True))
    assert echoed.prepend_input  # completions with echo: the prompt comes back first
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    tool = parse_generate_request(frontend_inputs("Hi", False, guided_json=schema))
    assert tool.params.structured_outputs.schema == json.loads(schema)


def test_trtllm_tensors_of_tensorrt_llm_models_map_to_vllm_names():
    req = parse_generate_request({"text_input": text("Hi"), "top_k": np.int32([3]), "random_seed": np.uint64([7]),
                                  "repetition_penalty": np.float32([1.25]), "bad_words": np.array([b"foo", b""],
                                                                                                   dtype=np.object_),
                                  "stop_words": np.array([b""], dtype=np.object_), "min_tokens": np.int32([2]),
                                  "num_return_sequences": np.int32([2]), "temperature": np.float32([1.0])})
    p = req.params
    assert (p.top_k, p.seed, p.repetition_penalty, p.bad_words, p.stop_strings, p.min_tokens, p.n) == \
        (3, 7, 1.25, ["foo"], [], 2, 2)
    assert not req.prepend_input and not req.batched
    assert parse_generate_request({"text_input": text("Hi"), "guided_decoding_guide_type": text("json")}
                                  ).params.structured_outputs.json_object
    assert parse_generate_request({"text_input": text("Hi"), "guided_decoding_guide_type": text("regex"),
                                   "guided_decoding_guide": text("[ab]+")}).params.structured_outputs.regex == "[ab]+"


@pytest.mark.parametrize("inputs, params, message", [
    ({"max_tokens": np.int32([[0]])}, None, "max_tokens must be"),
    ({"temperature": np.float32([[-1.0]])}, None, "temperature must be"),
    ({"seed": np.uint64([[1]]), "random_seed": np.uint64([[2]])}, None, "not both"),
    ({"max_tokens": np.int32([[4]]), "sampling_parameters": text('{"max_tokens": 5}')}, None,
     "max_tokens given both as an input tensor and in the sampling parameters"),
    ({"temperature": np.float32([[0.0]])}, '{"temperature": 0}', "temperature given both"),
    ({"guided_decoding_guide_type": text("structural_tag"), "guided_decoding_guide": text("{}")}, None,
     "guided_decoding_guide_type='structural_tag' is not supported"),
    ({"guided_decoding_guide": text("{}")}, None, "needs guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": text("json_schema")}, None, "needs guided_decoding_guide"),
    ({"max_tokens": np.int32([[4], [5]])}, None, "exactly one element"),
])
def test_bad_trtllm_requests_raise_clear_errors(inputs, params, message):
    with pytest.raises(ValueError, match=message):
        parse_generate_request({"text_input": np.array([[b"x"]], dtype=np.object_), **inputs}, params)


def test_batched_requests_get_batched_outputs():
    req = parse_generate_request(frontend_inputs("P:", False))
    arrays = build_outputs(req, _delta({0: ("ab", [7, 9])}, True), StreamState())
    assert arrays["text_output"].shape == (1, 1) and arrays["text_output"][0, 0] == b"ab"
    assert arrays["num_input_tokens"].tolist() == [[3]] and arrays["num_output_tokens"].tolist() == [[2]]


def test_generate_endpoint_requests_may_carry_both_tensors_and_parameters():
    """Triton's generate endpoint turns `parameters` keys that name an input (on a max_batch_size 1 model:
    max_tokens, temperature, ...) into tensors and leaves the others as request parameters."""
    req = parse_generate_request({"text_input": np.array([[b"Hi"]], dtype=np.object_),
                                  "max_tokens": np.int32([[5]]), "temperature": np.float32([[0.0]])},
                                 '{"ignore_eos": true, "stop": ["x"]}')
    p = req.params
    assert (p.max_tokens, p.temperature, p.ignore_eos, p.stop_strings) == (5, 0.0, True, ["x"])
    assert not req.prepend_input  # a batched request: only the new text, by TensorRT-LLM's convention


def test_the_trtllm_tensors_are_inputs_only_of_batched_models():
    names = {entry["name"]: entry for entry in trtllm_input_configs()}
    for name, kind, dims in (("max_tokens", "TYPE_INT32", [1]), ("stop_words", "TYPE_STRING", [-1]),
                             ("temperature", "TYPE_FP32", [1]), ("seed", "TYPE_UINT64", [1]),
                             ("guided_decoding_guide", "TYPE_STRING", [1])):
        assert names[name] == dict(name=name, data_type=kind, dims=dims, optional=True)
    # the vLLM backend's set stays as it is: with max_batch_size 0 a generate-endpoint parameter such as
    # "temperature": "0.7" must stay a request parameter (a typed input tensor would refuse the string)
    assert not set(names) & {entry[0] for entry in INPUTS}


# ---- responses ----------------------------------------------------------------------------------
def _delta(pieces, finished, prompt="P:", reasons=None, logprobs=None):
    """An engine output: pieces maps a sequence index to (text, token ids)."""
    outs = [CompletionOutput(i, t, ids, -1.5 * (i + 1), logprobs=(logprobs or {}).get(i),
                             finish_reason=(reasons or {}).get(i)) for i, (t, ids) in pieces.items()]
    return RequestOutput("r", prompt, [1, 2, 3], outs, finished)


def _texts(arrays):
    return [v.decode() for v in arrays["text_output"]]


def test_streamed_deltas_answer_every_sequence():
    req = GenerateRequest(prompt="P:", params=parse_sampling_parameters('{"n": 2, "temperature": 1}', True),
                          stream=True, prepend_input=False, return_num_output_tokens=True,
                          return_finish_reason=True, return_cumulative_logprob=True)
    state = StreamState()
    first = build_outputs(req, _delta({0: ("a", [5]), 1: ("x", [6])}, False), state)
    second = build_outputs(req, _delta({1: ("y", [7])}, False, reasons={1: "length"}), state)  # 0: nothing new
    last = build_outputs(req, _delta({0: ("bc", [8, 9])}, True, reasons={0: "stop"}), state)
    assert [_texts(a) for a in (first, second, last)] == [["a", "x"], ["", "y"], ["bc", ""]]
    assert [a["num_output_tokens"].tolist() for a in (first, second, last)] == [[1, 1], [0, 1], [2, 0]]
    assert [v.decode() for v in second["finish_reason"]] == ["None", "length"]  # str(None) while running, as vLLM
    assert [v.decode() for v in last["finish_reason"]] == ["stop", "length"]
    assert last["cumulative_logprob"].tolist() == [-1.5, -3.0] and last["num_output_tokens"].dtype == np.uint32


def test_the_final_response_prepends_the_prompt_and_returns_everything_asked():
    req = GenerateRequest(prompt="P:", params=parse_sampling_parameters("{}"), return_finish_reason=True,
                          return_cumulative_logprob=True, return_num_input_tokens=True, return_num_output_tokens=True)
    arrays = build_outputs(req, _delta({0: (" done", [4, 5, 6])}, True, reasons={0: "length"}), StreamState())
    assert _texts(arrays) == ["P: done"] and [v.decode() for v in arrays["finish_reason"]] == ["length"]
    assert arrays["cumulative_logprob"].dtype == np.float32 and arrays["cumulative_logprob"].tolist() == [-1.5]
    assert arrays["num_input_tokens"].tolist() == [3] and arrays["num_input_tokens"].dtype == np.uint32
    assert arrays["num_output_tokens"].tolist() == [3]
    bare = build_outputs(GenerateRequest(prompt="P:", params=req.params), _delta({0: ("x", [1])}, True),
                         StreamState())
    assert set(bare) == {"text_output"}


def test_logprobs_come_back_as_vllm_shapes_them():
    req = GenerateRequest(prompt="P", params=parse_sampling_parameters('{"logprobs": 1}'), return_logprobs=True,
                          prepend_input=False)
    # token 7 was the most likely; token 9 was sampled although token 8 ranked first (9 ranked 7th: the engine
    # ranks a sampled token outside the top k in the whole vocabulary, as vLLM does)
    tops = [{7: Logprob(-0.1, 1)}, {8: Logprob(-0.2, 1), 9: Logprob(-2.5, 7)}]
    arrays = build_outputs(req, _delta({0: ("ab", [7, 9])}, True, logprobs={0: tops}), StreamState(),
                           decode_token=lambda t: f"<{t}>")
    (entries,) = [json.loads(v) for v in arrays["logprobs"]]
    assert entries == [{"7": {"logprob": -0.1, "rank": 1, "decoded_token": "<7>"}},
                       {"8": {"logprob": -0.2, "rank": 1, "decoded_token": "<8>"},
                        "9": {"logprob": -2.5, "rank": 7, "decoded_token": "<9>"}}]
    unasked = GenerateRequest(prompt="P", params=parse_sampling_parameters("{}"), return_logprobs=True)
    arrays = build_outputs(unasked, _delta({0: ("ab", [7, 9])}, True), StreamState())
    assert [v.decode() for v in arrays["logprobs"]] == ["null"]


def test_return_cumulative_logprob_asks_the_engine_for_it_and_returns_no_logprobs_unasked():
    """The engine reports cumulative_logprob only to requests that set `logprobs`: the flag alone sets 0 on the
    engine's parameters, and the `logprobs` output stays null as the request did not ask for it."""
    req = parse_generate_request({"text_input": text("P"), "return_cumulative_logprob": flag(True),
                                  "return_logprobs": flag(True)})
    assert req.params.logprobs == 0 and req.params.reports_logprobs and not req.logprobs_requested
    tops = [{7: Logprob(-0.1, 1)}]
    arrays = build_outputs(req, _delta({0: ("a", [7])}, True, logprobs={0: tops}), StreamState())
    assert [v.decode() for v in arrays["logprobs"]] == ["null"] and arrays["cumulative_logprob"].tolist() == [-1.5]
    plain = parse_generate_request({"text_input": text("P")})
    assert plain.params.logprobs is None and not plain.params.reports_logprobs
    asked = parse_generate_request({"text_input": text("P"), "sampling_parameters": text('{"logprobs": 2}'),
                                    "return_cumulative_logprob": flag(True)})
    assert asked.params.logprobs == 2 and asked.logprobs_requested


# ---- model.json -----------------------------------------------------------------------------------
def test_a_vllm_backend_model_json_loads_unchanged():
    # the vLLM backend's sample model.json (its model swapped for an offline preset)
    opts = parse_model_options({"model": "tiny-llama", "gpu_memory_utilization": 0.5, "enforce_eager": "true",
                                "disable_log_requests": "true"})
    assert opts.engine == {"gpu_memory_utilization": 0.5, "enforce_eager": True}
    assert opts.dtype == "auto" and opts.device == "auto"
    assert set(opts.ignored) == {"disable_log_requests"}
    vllm_names = parse_model_options({"model": "tiny-llama", "dtype": "bf16", "trust_remote_code": "true",
                                      "disable_log_stats": True, "swap_space": 2, "num_gpu_blocks_override": 40,
                                      "max_logprobs": "5", "enable_prefix_caching": "true", "block_size": "8",
                                      "max_num_seqs": 4, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                      "quantization": None, "kv_cache_dtype": "fp8_e4m3"})
    assert vllm_names.dtype == "bfloat16" and vllm_names.trust_remote_code and vllm_names.disable_log_stats
    assert vllm_names.engine == {"swap_space": 2 * 2 ** 30, "num_blocks": 40, "max_logprobs": 5,
                                 "enable_prefix_caching": True, "block_size": 8, "max_num_seqs": 4,
                                 "tensor_parallel_size": 1, "kv_cache_dtype": "fp8_e4m3"}


def test_vllm_keys_of_newer_releases_are_accepted():
    opts = parse_model_options({"model": "tiny-llama", "guided_decoding_backend": "outlines", "task": "generate",
                                "generation_config": "auto", "disable_sliding_window": "true"})
    assert set(opts.ignored) == {"guided_decoding_backend", "generation_config", "disable_sliding_window"}
    assert parse_model_options({"model": "tiny-llama", "task": "auto"}).engine == {}
    with pytest.raises(ValueError, match="task='embed' is not supported: this engine generates text"):
        parse_model_options({"model": "tiny-llama", "task": "embed"})



@pytest.mark.parametrize("values, message", [
    ({"model": "tiny-llama", "gpu_memory_utilisation": 0.9}, "unknown option\\(s\\) 'gpu_memory_utilisation'"),
    ({"block_size": 3}, "block_size must be a positive power of two"),
    ({"block_size": "sixteen"}, "block_size must be an integer"),
    ({"dtype": "int8"}, "dtype must be one of"),
    ({"device": "tpu"}, "device must be"),
    ({"preemption_mode": "evict"}, "preemption_mode must be"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
    ({"gpu_memory_utilization": 0.5, "num_blocks": 8}, "either num_blocks or kv_cache_memory or gpu_memory"),
    ({"num_blocks": 8, "num_gpu_blocks_override": 9}, "both set num_blocks"),
    ({"pipeline_parallel_size": 2}, "pipeline parallelism is not implemented"),
    ({"quantization": "awq"}, "quantized weights are not supported"),
    ({"enable_lora": "true", "max_loras": 0}, "max_loras must be a positive integer"),
    ({"lora_dtype": "float16"}, "LoRA weights run in the model's dtype"),
    ({"fully_sharded_loras": True}, "LoRA with tensor parallelism is not supported"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of auto, bfloat16"),
    ({"enable_prefix_caching": "sometimes"}, "enable_prefix_caching must be a boolean"),
    ({"model": ""}, "model in model.json"),
])
def test_invalid_model_options_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        parse_model_options(values)


# ---- placement ----------------------------------------------------------------------------------
def _config(*groups):
    return {"instance_group": list(groups)}


def test_kind_gpu_runs_each_instance_on_its_gpu_and_shares_its_memory():
    opts = parse_model_options({"model": "tiny-llama", "gpu_memory_utilization": 0.8})
    config = _config({"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]})
    placement = place(opts, "GPU", 1, config)
    assert placement == Placement("cuda:1", 2)
    assert engine_kwargs(opts, placement)["gpu_memory_utilization"] == pytest.approx(0.4)
    default = engine_kwargs(parse_model_options({"model": "tiny-llama"}), placement)
    assert default["device"] == "cuda:1" and default["gpu_memory_utilization"] == pytest.approx(0.45)  # vLLM's 0.9
    with pytest.raises(ValueError, match="KIND_MODEL"):
        place(parse_model_options({"tensor_parallel_size": 2}), "GPU", 0, config)
    with pytest.raises(ValueError, match="device 'cpu'"):
        place(parse_model_options({"device": "cpu"}), "GPU", 0, config)


def test_kind_cpu_and_kind_model_placements():
    opts = parse_model_options({"model": "tiny-llama", "num_blocks": 16})
    cpu = place(opts, "CPU", 0, _config({"kind": "KIND_CPU", "count": 3}))
    assert cpu == Placement("cpu", 3) and engine_kwargs(opts, cpu)["num_blocks"] == 16  # explicit sizes stay
    shared = engine_kwargs(parse_model_options({"model": "tiny-llama"}), cpu)
    assert 0 < shared["kv_cache_memory"] <= 4 * 2 ** 30 // 3
    assert "kv_cache_memory" not in engine_kwargs(parse_model_options({}), Placement("cpu", 1))
    assert place(parse_model_options({"device": "cpu"}), "MODEL", 0, _config({"kind": "KIND_MODEL"})).device == "cpu"
    with pytest.raises(ValueError, match="KIND_CPU"):
        place(parse_model_options({"device": "cuda"}), "CPU", 0, _config({"kind": "KIND_CPU"}))


# ---- repositories ---------------------------------------------------------------------------------
def test_repository_layouts(tmp_path):
    model_dir = write_model_repository(tmp_path, "my_llm", {"model": "tiny-llama", "num_blocks": 16})
    config = (model_dir / "config.pbtxt").read_text()
    assert 'backend: "paged_backend"' in config and "KIND_CPU" in config and "input [" not in config
    assert not (model_dir / "1" / "model.py").exists()
    opts = load_model_options(model_dir / "1")
    assert opts.model == "tiny-llama" and opts.engine["num_blocks"] == 16
    python = write_model_repository(tmp_path, "py_llm", {"model": "tiny-llama"}, layout="python")
    config = (python / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "decoupled: true" in config
    for name in ("text_input", "sampling_parameters", "return_logprobs", "image", "embedding_request",
                 "text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                 "num_output_tokens"):
        assert f'name: "{name}"' in config, name
    assert "paged_backend.adapters.triton.model import TritonPythonModel" in (python / "1" / "model.py").read_text()
    backend = install_backend(tmp_path / "backends")
    assert backend.name == "paged_backend" and "TritonPythonModel" in (backend / "model.py").read_text()
    with pytest.raises(ValueError, match="block_size"):
        write_model_repository(tmp_path, "bad", {"block_size": 5})
    with pytest.raises(ValueError, match="model name"):
        write_model_repository(tmp_path, "../escape", {})
    with pytest.raises(ValueError, match="not found"):
        load_model_options(tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_options(tmp_path / "broken")


def test_lora_is_refused_as_the_vllm_backend_refuses_it_when_disabled():
    with pytest.raises(UnsupportedParameter, match="LoRA feature is not enabled"):
        parse_generate_request({"text_input": text("x"), "sampling_parameters": text('{"lora_name": "a"}')})


def test_model_json_kv_cache_dtype_reaches_the_engine():
    import torch

    from paged_backend import LLM, SamplingParams

    opts = parse_model_options({"model": "tiny-llama", "dtype": "float32", "kv_cache_dtype": "fp8", "num_blocks": 32})
    llm = LLM(opts.model, **engine_kwargs(opts, Placement("cpu", 1)))
    assert llm.engine.config.cache.kv_cache_dtype == "fp8"
    assert llm.engine.runner.cache_engine.kv.dtype == torch.float8_e4m3fn
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
