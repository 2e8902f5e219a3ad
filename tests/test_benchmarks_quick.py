"""The benchmarks' building blocks (trace reader, contiguous allocators, reservation manager) and a
`--quick` run of each benchmark through the CLI, checking the invariants of its results."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch

from conftest import assert_no_leaks, get_model
from paged_backend import LLMEngine, SamplingParams
from paged_backend.benchmarks.contiguous import BuddyArena, FirstFitArena
from paged_backend.benchmarks.reservation import install_reservation, reservation_tokens
from paged_backend.benchmarks.workloads import (ALPACA_MEAN_OUTPUT, ALPACA_MEAN_PROMPT, alpaca_like_trace,
                                                iter_json_array, keep_request, sharegpt_trace)
from paged_backend.cli import main as cli_main


@pytest.fixture(scope="module")
def tokenizer():
    return get_model("tiny-llama")[1]


# ---- traces -------------------------------------------------------------------------------------
def test_json_array_reader_streams_records_and_stops_at_a_truncated_tail():
    text = '[\n {"a": 1},\n {"b": [2, 3]} , {"c": "x' + "y" * 50
    assert list(iter_json_array(io.StringIO(text), chunk_size=7)) == [{"a": 1}, {"b": [2, 3]}]
    assert list(iter_json_array(io.StringIO('[{"a": 1}, {"b": 2}]'), chunk_size=3)) == [{"a": 1}, {"b": 2}]
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_trace_is_filtered_seeded_and_real(tokenizer):
    trace = sharegpt_trace(tokenizer, 50, seed=3)
    assert len(trace.requests) == 50 and not trace.synthetic
    assert all(keep_request(r.prompt_len, r.output_len) for r in trace.requests)
    assert sharegpt_trace(tokenizer, 50, seed=3).requests == trace.requests
    assert sharegpt_trace(tokenizer, 50, seed=4).requests != trace.requests
    assert not keep_request(3, 100) and not keep_request(1025, 4) and not keep_request(1000, 1049)


def test_alpaca_like_trace_is_labelled_synthetic_with_the_papers_means(tokenizer):
    trace = alpaca_like_trace(tokenizer, 1000, seed=0)
    summary = trace.summary()
    assert trace.synthetic and "SYNTHETIC" in trace.description
    assert abs(summary["mean_prompt_len"] - ALPACA_MEAN_PROMPT) < 0.1 * ALPACA_MEAN_PROMPT
    assert abs(summary["mean_output_len"] - ALPACA_MEAN_OUTPUT) < 0.1 * ALPACA_MEAN_OUTPUT
    assert all(len(r.prompt_token_ids) == r.prompt_len >= 4 for r in trace.requests)


# ---- contiguous allocators ------------------------------------------------------------------------
@pytest.mark.parametrize("arena_cls", [FirstFitArena, BuddyArena])
def test_contiguous_arena_never_overlaps_and_coalesces_back(arena_cls):
    rng = random.Random(0)
    arena = arena_cls(100)
    live = {}
    for _ in range(400):
        if live and rng.random() < 0.45:
            start = rng.choice(sorted(live))
            arena.free(start)
            del live[start]
        else:
            got = arena.allocate(rng.randint(1, 20))
            if got is not None:
                live[got[0]] = got[1]
        used = sorted((s, s + n) for s, n in live.items())
        assert all(a[1] <= b[0] for a, b in zip(used, used[1:])) and all(e <= 100 for _, e in used)
        assert arena.free_units == 100 - sum(live.values())
        assert arena.largest_free() <= arena.free_units
    for start in list(live):
        arena.free(start)
    assert arena.free_units == 100 and arena.largest_free() == (100 if arena_cls is FirstFitArena else 64)
    with pytest.raises(ValueError):
        arena.free(0)


def test_first_fit_external_fragmentation_is_real():
    arena = FirstFitArena(30)
    starts = [arena.allocate(10)[0] for _ in range(3)]
    arena.free(starts[0])
    arena.free(starts[2])
    assert arena.free_units == 20 and arena.largest_free() == 10
    assert arena.allocate(15) is None  # 20 slots free, but not in one run


def test_buddy_rounds_up_to_powers_of_two():
    arena = BuddyArena(64)
    assert arena.allocate(5) == (0, 8) and arena.granted_units(17) == 32
    assert arena.allocate(33) is None and arena.allocate(32) == (32, 32)


def test_reservation_sizes():
    assert reservation_tokens("max", 10, 25, 2048) == 2048
    assert reservation_tokens("pow2", 10, 25, 2048) == 42
    assert reservation_tokens("oracle", 10, 25, 2048) == 35
    assert reservation_tokens("oracle", 10, None, 2048) == 2048
    assert reservation_tokens("pow2", 2000, 40, 2048) == 2048
    with pytest.raises(ValueError, match="policy"):
        reservation_tokens("half", 1, 1, 8)


# ---- the reservation baseline runs through the same engine ------------------------------------------
def _greedy_outputs(engine, prompts, lengths):
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.error, out.outputs[0].token_ids if out.outputs else None)
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_reservation_engine_gives_the_paged_engines_tokens_without_leaking(policy):
    model, tok = get_model("tiny-llama", torch.float64)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    lengths = [rng.randint(1, 30) for _ in prompts]
    paged = LLMEngine(model, tok, block_size=16, num_blocks=16, num_swap_blocks=0, max_model_len=256)
    expected = _greedy_outputs(paged, prompts, lengths)
    engine = LLMEngine(model, tok, block_size=1, num_blocks=256, num_swap_blocks=0, max_model_len=256)
    manager = install_reservation(engine, policy)
    assert _greedy_outputs(engine, prompts, lengths) == expected
    assert_no_leaks(paged)
    assert_no_leaks(engine)
    assert manager.arena.free_units == 256 and not manager.regions


def test_reservation_engine_refuses_what_it_cannot_reserve_and_frees_everything():
    model, tok = get_model("tiny-llama", torch.float64)
    engine = LLMEngine(model, tok, block_size=1, num_blocks=128, num_swap_blocks=0, max_model_len=256)
    install_reservation(engine, "max")  # every request reserves 256 slots: more than the cache
    engine.add_request("big", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("two", [5, 6, 7], SamplingParams(n=2, temperature=1.0, max_tokens=4))
    outs = [o for _ in range(3) for o in engine.step()]
    assert sorted(o.request_id for o in outs if o.finished and o.error) == ["big", "two"]
    assert_no_leaks(engine)
    with pytest.raises(ValueError, match="before adding requests"):
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=200))
        install_reservation(engine, "oracle")
    engine.abort_request("x")


# ---- the quick benchmarks -------------------------------------------------------------------------
def _bench(name, tmp_path, *extra):
    code = cli_main(["bench", name, "--quick", "--threads", "1", "--results-dir", str(tmp_path), *extra])
    result = json.loads((tmp_path / name / f"{name}.json").read_text())
    assert (tmp_path / name / f"{name}.png").stat().st_size > 1000
    assert code == 0, result["problems"]
    assert result["problems"] == []
    return result


def test_quick_waste_benchmark(tmp_path):
    result = _bench("waste", tmp_path, "--allocators", "first-fit,buddy")
    runs = {(r["system"], r["allocator"]): r for r in result["runs"]}
    assert result["trace"]["name"] == "sharegpt"
    paged = runs[("paged", "paged")]["memory"]["shares"]
    assert paged["token_states"] >= 0.95 and paged["external"] == 0
    for (system, _), run in runs.items():
        assert run["leaked_blocks"] == 0 and run["num_finished"] == run["num_requests"]
        if system != "paged":
            assert run["memory"]["shares"]["token_states"] < paged["token_states"]
    assert runs[("max", "first-fit")]["memory"]["shares"]["internal"] > 0.5  # most of a 2048 reservation is unused
    assert runs[("oracle", "first-fit")]["memory"]["shares"]["internal"] == 0  # it knows the true lengths


def test_quick_throughput_benchmark(tmp_path):
    result = _bench("throughput", tmp_path)
    systems = {r["system"] for r in result["runs"]}
    assert systems == {"paged", "oracle", "pow2", "max", "hf-static", "hf-continuous"}
    for run in result["runs"]:
        assert run["output_tokens"] == result["trace"]["total_output_tokens"] and run["wrong_lengths"] == 0
    assert next(r for r in result["runs"] if r["system"] == "paged")["paged_speedup"] == 1.0


def test_quick_sharing_benchmark(tmp_path):
    result = _bench("sharing", tmp_path)
    by_case = {(r["kind"], r["k"], r["system"], r.get("prefix_caching")): r for r in result["runs"]}
    assert by_case[("beam", 4, "paged", None)]["saving"] > by_case[("parallel", 2, "paged", None)]["saving"] > 0
    cached, plain = by_case[("prefix", 1, "paged", True)], by_case[("prefix", 1, "paged", False)]
    assert cached["cached_prefill_tokens"] > 0 and cached["peak_used_blocks"] < plain["peak_used_blocks"]
    assert by_case[("prefix", 1, "oracle", False)]["saving"] == 0  # a reservation shares nothing
    assert all(r["leaked_blocks"] == 0 and r["preemptions"] == 0 for r in result["runs"])


def test_quick_overhead_benchmark(tmp_path):
    result = _bench("overhead", tmp_path)
    for run in result["runs"]:
        assert run["running"] == run["batch"] and 0 < run["outside_forward_share"] < 1
        assert sum(run["phase_ms"].values()) == pytest.approx(run["step_ms"], rel=1e-6)


def test_quick_serving_benchmark(tmp_path):
    result = _bench("serving", tmp_path)
    assert {r["system"] for r in result["runs"]} == {"paged", "oracle"}
    for run in result["runs"]:
        assert run["num_finished"] == run["num_requests"] > 0
        assert run["mean_ttft_s"] > 0 and run["normalized_latency_s_per_token"] > 0
