"""LoRA requests the engine refuses, with errors that name what does not fit; a request whose adapter cannot be
loaded fails alone; adapters added, removed and listed; `lora_requests_info`; the async engine."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_no_leaks, get_model, run_to_completion
from lora_adapters import adapter_dirs, make_adapter, peft_greedy
from paged_backend import LLM, AsyncLLMEngine, LLMEngine, LoRARequest, SamplingParams
from paged_backend.config import LoRAConfig
from paged_backend.errors import InvalidParameter, InvalidRequest, UnsupportedParameter

FAMILY = "tiny-llama"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-requests")


@pytest.fixture(scope="module")
def adapters(root):
    return [LoRARequest(f"a{i}", i + 1, str(d)) for i, d in enumerate(adapter_dirs(FAMILY, root))]


def engine(**options) -> LLMEngine:
    model, tok = get_model(FAMILY, torch.float64)
    return LLMEngine(model, tokenizer=tok, num_blocks=64, block_size=8, **options)


def ids(text: str = "The capital of France is"):
    return get_model(FAMILY, torch.float64)[1](text).input_ids


def greedy(n: int = 6, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **extra)


def test_an_engine_without_lora_refuses_adapters(adapters):
    eng = engine()
    with pytest.raises(UnsupportedParameter, match="LoRA is not enabled") as info:
        eng.add_request("r", ids(), greedy(), lora_request=adapters[0])
    assert info.value.param == "lora_request"
    assert not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        eng.add_lora(adapters[0])


def _copy(directory, root, name):
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(directory, target)
    return target


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tensor(directory, key_part, new_shape):
    path = directory / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in tensors if key_part in k)
    tensors[key] = torch.zeros(new_shape, dtype=tensors[key].dtype)
    save_file(tensors, str(path))


def _bad_adapter(case: str, root, adapters):
    """(LoRARequest, engine options, expected message) for each way an adapter can fail to fit."""
    good = adapters[0].lora_path
    if case == "missing directory":
        return LoRARequest("x", 50, str(root / "nowhere")), {}, "is not a directory"
    if case == "no adapter_config.json":
        target = _copy(good, root, "no-config")
        (target / "adapter_config.json").unlink()
        return LoRARequest("x", 51, str(target)), {}, "adapter_config.json not found"
    if case == "no weights":
        target = _copy(good, root, "no-weights")
        (target / "adapter_model.safetensors").unlink()
        return LoRARequest("x", 52, str(target)), {}, "no adapter_model.safetensors or adapter_model.bin"
    if case == "rank above max_lora_rank":
        return adapters[2], {"max_lora_rank": 4}, r"rank 8, above max_lora_rank=4"
    if case == "another base model":
        directory = adapter_dirs("tiny-opt", root)[0]
        return LoRARequest("opt", 53, str(directory)), {}, "targets module 'model.decoder.layers.0.self_attn"
    if case == "wrong shape":
        target = _copy(good, root, "wrong-shape")
        _edit_tensor(target, "layers.0.self_attn.q_proj.lora_A", (2, 48))
        return LoRARequest("x", 54, str(target)), {}, r"do not fit its 64 inputs and 64 outputs"
    if case == "rank differs from r":
        target = _copy(good, root, "wrong-rank")
        _edit_config(target, r=3)
        return LoRARequest("x", 55, str(target)), {}, r"do not have the rank r=3"
    if case == "DoRA":
        target = _copy(good, root, "dora")
        _edit_config(target, use_dora=True)
        return LoRARequest("x", 56, str(target)), {}, r"DoRA adapters \(use_dora=True\) are not supported"
    if case == "modules_to_save":
        target = _copy(good, root, "modules-to-save")
        _edit_config(target, modules_to_save=["lm_head"])
        return LoRARequest("x", 57, str(target)), {}, r"modules_to_save"
    if case == "saved base weights":
        target = make_adapter(FAMILY, dict(r=2, lora_alpha=2, target_modules=["lm_head"]), root / "head", 3)
        return LoRARequest("x", 58, str(target)), {}, r"'base_model.model.lm_head.base_layer.weight' is a full weight"
    if case == "output layer":
        target = _copy(make_adapter(FAMILY, dict(r=2, lora_alpha=2, target_modules=["lm_head"]), root / "head2", 3),
                       root, "head-only-lora")
        tensors = load_file(str(target / "adapter_model.safetensors"))
        save_file({k: v for k, v in tensors.items() if "lora_" in k}, str(target / "adapter_model.safetensors"))
        return LoRARequest("x", 61, str(target)), {}, r"targets module 'lm_head', the output layer"
    if case == "embedding":
        target = make_adapter(FAMILY, dict(r=2, lora_alpha=2, target_modules=["embed_tokens"]), root / "embed", 3)
        return LoRARequest("x", 59, str(target)), {}, r"embedding LoRA"
    if case == "not LoRA":
        target = _copy(good, root, "ia3")
        _edit_config(target, peft_type="IA3")
        return LoRARequest("x", 60, str(target)), {}, r"peft_type 'IA3' is not a LoRA adapter"
    raise AssertionError(case)


BAD_CASES = ["missing directory", "no adapter_config.json", "no weights", "rank above max_lora_rank",
             "another base model", "wrong shape", "rank differs from r", "DoRA", "modules_to_save", "saved base weights",
             "output layer",
             "embedding", "not LoRA"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_an_adapter_that_does_not_fit_is_refused_at_add_request_naming_why(case, root, adapters):
    request, options, message = _bad_adapter(case, root, adapters)
    eng = engine(enable_lora=True, max_loras=2, **{"max_lora_rank": 8, **options})
    eng.add_request("ok", ids(), greedy())
    with pytest.raises(InvalidParameter, match=message) as info:
        eng.add_request("bad", ids(), greedy(), lora_request=request)
    assert info.value.param == "lora_request" and request.lora_name in str(info.value)
    finals = run_to_completion(eng)
    assert list(finals) == ["ok"] and finals["ok"].outputs[0].token_ids == peft_greedy(FAMILY, torch.float64, None,
                                                                                         ids(), 6)
    assert_no_leaks(eng)


def test_lora_request_fields_and_ids_are_checked(adapters):
    for bad in (dict(lora_name="", lora_int_id=1, lora_path="x"), dict(lora_name="a", lora_int_id=0, lora_path="x"),
                dict(lora_name="a", lora_int_id=True, lora_path="x"), dict(lora_name="a", lora_int_id=1)):
        with pytest.raises(InvalidParameter):
            LoRARequest(**bad)
    eng = engine(enable_lora=True, max_lora_rank=8)
    eng.add_request("a", ids(), greedy(), lora_request=adapters[0])
    other = LoRARequest("other", adapters[0].lora_int_id, adapters[1].lora_path)
    with pytest.raises(InvalidParameter, match="lora_int_id 1 already names adapter 'a0'"):
        eng.add_request("b", ids(), greedy(), lora_request=other)
    prepared = eng.prepare_request(ids(), greedy(), adapters[0])
    with pytest.raises(InvalidRequest, match="carries its own params and lora_request"):
        eng.add_request("c", prepared, lora_request=adapters[1])
    run_to_completion(eng)
    assert_no_leaks(eng)


def test_lora_options_are_checked():
    with pytest.raises(ValueError, match="max_cpu_loras \\(1\\) must be >= max_loras \\(2\\)"):
        LoRAConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
            LoRAConfig(**{name: 0})
    with pytest.raises(ValueError, match="enable_lora with tensor_parallel_size > 1 is not supported"):
        engine(enable_lora=True, tensor_parallel_size=2)


def test_a_request_whose_adapter_can_no_longer_be_read_fails_alone(root, adapters):
    """Its adapter was checked at add_request, then dropped from the host (max_cpu_loras=1) and deleted from
    disk: at its turn the request fails with the reason; the others' tokens and logprobs are unchanged."""
    doomed = LoRARequest("doomed", 90, str(_copy(adapters[1].lora_path, root, "doomed")))
    params = greedy(logprobs=2)
    neighbours = [("base", None), ("first", adapters[0]), ("again", adapters[0])]

    def run(with_doomed: bool):
        eng = engine(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
        if with_doomed:
            eng.add_request("doomed", ids(), params, lora_request=doomed)
        for rid, lora in neighbours:
            eng.add_request(rid, ids(), params, lora_request=lora)   # reading adapter 0 drops the doomed one
        if with_doomed:
            shutil.rmtree(doomed.lora_path)
        finals = run_to_completion(eng)
        assert_no_leaks(eng)
        return finals

    finals = run(True)
    assert "could not be loaded" in finals["doomed"].error and "doomed" in finals["doomed"].error
    clean = run(False)
    for rid, _ in neighbours:
        assert finals[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids
        assert finals[rid].outputs[0].logprobs == clean[rid].outputs[0].logprobs


def test_adapters_are_added_removed_and_listed(adapters):
    llm = LLM(*get_model(FAMILY, torch.float64), enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8,
              num_blocks=64)
    assert llm.list_loras() == []
    assert llm.add_lora(adapters[0]) is True
    assert llm.add_lora(adapters[0]) is False
    assert llm.add_lora(adapters[1]) is True
    assert sorted(llm.list_loras()) == [1, 2]
    assert llm.remove_lora(1) is True and llm.remove_lora(1) is False
    assert llm.list_loras() == [2]
    out = llm.generate([ids()], greedy(), use_tqdm=False, lora_request=adapters[0])[0]   # read again
    assert out.outputs[0].token_ids == peft_greedy(FAMILY, torch.float64, adapters[0].lora_path, ids(), 6)


def test_lora_requests_info_names_running_and_waiting_adapters(adapters):
    eng = engine(enable_lora=True, max_loras=1, max_lora_rank=8)
    assert eng.get_stats().lora_info == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    eng.add_request("a", ids(), greedy(), lora_request=adapters[0])
    eng.add_request("b", ids(), greedy(), lora_request=adapters[1])
    eng.add_request("base", ids(), greedy())
    eng.step()
    info = eng.get_stats().lora_info
    assert info == {"max_lora": "1", "running_lora_adapters": "a0", "waiting_lora_adapters": "a1"}, info
    run_to_completion(eng)
    assert_no_leaks(eng)
    assert engine().get_stats().lora_info["max_lora"] == "0"


def test_the_async_engine_runs_requests_with_their_adapters(adapters):
    async def main():
        engine_ = AsyncLLMEngine.from_engine(engine(enable_lora=True, max_loras=2, max_lora_rank=8))
        assert await engine_.add_lora(adapters[1]) is True

        async def run(lora, rid):
            final = None
            async for out in engine_.generate(ids(), greedy(), rid, lora_request=lora):
                final = out
            return final.outputs[0].token_ids

        results = await asyncio.gather(*(run(lora, f"r{i}") for i, lora in enumerate([None] + adapters)))
        prepared = await asyncio.get_running_loop().run_in_executor(None, engine_.prepare, ids(), greedy(),
                                                                    adapters[2])
        async for out in engine_.generate(prepared, None, "prepared"):
            last = out
        await engine_.shutdown()
        return results, last.outputs[0].token_ids

    results, prepared = asyncio.run(main())
    expected = [peft_greedy(FAMILY, torch.float64, None if lo is None else lo.lora_path, ids(), 6)
                for lo in [None] + adapters]
    assert results == expected and prepared == expected[-1]


def test_lora_requests_info_is_exported_with_vllms_labels_and_the_time_as_value(adapters):
    """`/metrics` shows the current label set valued at the snapshot's time; Triton keeps a series per label set
    and sets the current one to the newest time (inference gateways read the newest)."""
    from paged_backend.adapters.http.metrics import ServerMetrics
    from paged_backend.adapters.triton.custom_metrics import TritonEngineMetrics
    from test_kernel_fallback import FakeTritonMetrics

    eng = engine(enable_lora=True, max_loras=1, max_lora_rank=8)
    triton = TritonEngineMetrics(FakeTritonMetrics, {"model": "m", "version": "1"})
    eng.add_request("a", ids(), greedy(), lora_request=adapters[0])
    eng.add_request("b", ids(), greedy(), lora_request=adapters[1])
    eng.step()
    busy = eng.get_stats()
    triton.update(busy)
    text = ServerMetrics(eng, "tiny").render().decode()
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="1"' in line and 'running_lora_adapters="a0"' in line and 'waiting_lora_adapters="a1"' in line
    assert 'model_name="tiny"' in line and abs(float(line.split()[-1]) - busy.timestamp) < 1e-3
    run_to_completion(eng)
    idle = eng.get_stats()
    triton.update(idle)
    triton.update(idle)
    series = FakeTritonMetrics.MetricFamily.families["vllm:lora_requests_info"].metrics
    assert [(m.labels["running_lora_adapters"], m.labels["waiting_lora_adapters"]) for m in series] == [
        ("a0", "a1"), ("", "")]
    assert series[0].value == busy.timestamp < series[1].value == idle.timestamp
    assert series[1].labels["model"] == "m" and series[1].labels["max_lora"] == "1"


class FailsBeforeItsFirstSlotLoad:
    """Wraps a runner: the first step that is to load an adapter slot fails before loading it."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.failed = False

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, inputs):
        if not self.failed and inputs.lora is not None and inputs.lora.loads:
            self.failed = True
            raise RuntimeError("injected: the step failed before its adapter slots were loaded")
        return self.runner.execute(inputs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_step_that_failed_before_loading_an_adapter_never_leaves_a_request_on_an_empty_slot(adapters, overlap):
    """With overlapped scheduling the step after a failed one is launched counting on the slots the failed step
    was to load: a request of that step with such an adapter fails with the step's error rather than run on an
    empty slot; a later request of the same adapter has it loaded again and gets the adapter's tokens."""
    params = greedy(5)

    def alone(lora):
        eng = engine(enable_lora=True, max_loras=2, max_lora_rank=8)
        eng.add_request("alone", ids(), params, lora_request=lora)
        return run_to_completion(eng)["alone"].outputs[0].token_ids

    eng = engine(enable_lora=True, max_loras=2, max_lora_rank=8, async_scheduling=overlap)
    eng.runner = FailsBeforeItsFirstSlotLoad(eng.runner)
    finals = {}

    def step():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out

    eng.add_request("base", ids(), greedy(12))
    step()
    eng.add_request("loads", ids(), params, lora_request=adapters[0])   # its step fails before the load
    step()
    eng.add_request("counts-on-it", ids(), params, lora_request=adapters[0])
    finals.update(run_to_completion(eng))
    eng.add_request("later", ids(), params, lora_request=adapters[0])
    finals.update(run_to_completion(eng))
    assert eng.runner.failed
    assert "injected" in finals["loads"].error
    expected = alone(adapters[0])
    assert expected != alone(None)   # the adapter changes the tokens, so an empty slot would show
    counted = finals["counts-on-it"]
    assert counted.error is not None or counted.outputs[0].token_ids == expected
    if not overlap:
        assert counted.error is None
    assert finals["later"].error is None and finals["later"].outputs[0].token_ids == expected
    assert_no_leaks(eng)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_an_engine_without_adapters_beside_one_with_them_on_the_same_model_is_untouched(adapters, overlap):
    """Two engines on one model object, stepped in turns (a LoRA engine's hooks sit on the shared modules, and
    with overlap its next step runs in its worker thread while the other engine steps): each engine's tokens
    are its own alone, and neither fails."""
    params = greedy(8)
    alone_base = engine()
    alone_base.add_request("b", ids(), params)
    expected_base = run_to_completion(alone_base)["b"].outputs[0].token_ids
    alone_lora = engine(enable_lora=True, max_loras=2, max_lora_rank=8)
    alone_lora.add_request("l", ids(), params, lora_request=adapters[0])
    expected_lora = run_to_completion(alone_lora)["l"].outputs[0].token_ids

    base = engine(async_scheduling=overlap)
    lora = engine(enable_lora=True, max_loras=2, max_lora_rank=8, async_scheduling=overlap)
    base.add_request("b", ids(), params)
    lora.add_request("l", ids(), params, lora_request=adapters[0])
    finals = {}
    for _ in range(40):
        for eng in (lora, base):
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out
        if not (base.has_unfinished_requests() or lora.has_unfinished_requests()):
            break
    assert finals["b"].error is None and finals["l"].error is None, (finals["b"].error, finals["l"].error)
    assert finals["b"].outputs[0].token_ids == expected_base
    assert finals["l"].outputs[0].token_ids == expected_lora
    assert_no_leaks(base)
    assert_no_leaks(lora)
