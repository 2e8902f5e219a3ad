"""Tensor parallelism (issue 10): 2 gloo ranks on the CPU give the single-process outputs exactly (float64),
under preemption (both modes) and prefix caching; each rank holds only its KV heads; every rank sees the
same block tables at every step; a dead worker fails the engine within seconds; shutdown leaves no process."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from conftest import assert_no_leaks, get_model
from paged_backend import LLM, SamplingParams
from paged_backend.worker.cache_engine import CacheEngine, kv_geometry
from paged_backend.worker.tp_runner import WorkerFailedError
from paged_backend.errors import EngineDeadError
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.step_inputs import StepInputs
from paged_backend.worker.tp_sharding import build_plan, shard_model, weights_fingerprint
from paged_backend.worker.tp_worker import RankState, WorkerSetup, pack_step, unpack_step

F64 = torch.float64
PREFIX = [1] + list(range(300, 311))  # three full blocks of 4 tokens shared by every prompt
PROMPTS = [PREFIX + [500 + 7 * i, 900 + i, 1200 + 3 * i][: 1 + i % 3] for i in range(6)]


def worker_children():
    """pids of live tensor-parallel worker processes started by this process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"spawned_worker_main" in cmdline:
            found.append(int(entry))
    return found


def completions(outputs):
    return [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outputs]


def assert_same_outputs(got, want):
    assert len(got) == len(want)
    for g_req, w_req in zip(completions(got), completions(want)):
        assert [ids for ids, _ in g_req] == [ids for ids, _ in w_req]
        for (_, g_lp), (_, w_lp) in zip(g_req, w_req):
            assert (g_lp is None) == (w_lp is None)   # None: the request reports no log-probabilities
            if w_lp is not None:
                assert g_lp == pytest.approx(w_lp, rel=1e-9, abs=1e-9)


def assert_ranks_consistent(llm, expected_kv_heads: int, num_blocks: int, block_size: int):
    """Each rank holds only its KV heads, and all ranks saw identical block tables at every step."""
    engine = llm.engine
    reports = engine.runner.worker_reports()
    assert [r["rank"] for r in reports] == [0, 1]
    geometry = engine.geometry
    shape = (geometry.num_layers, 2, num_blocks, block_size, expected_kv_heads, geometry.head_size)
    for report in reports:
        assert report["kv_cache_shape"] == shape
        assert report["host_kv_cache_shape"][:2] == shape[:2] and report["host_kv_cache_shape"][3:] == shape[3:]
        assert report["num_steps"] == engine.counters.num_steps > 0
        assert len(report["block_table_digests"]) == report["num_steps"]
    assert reports[1]["block_table_digests"] == reports[0]["block_table_digests"]
    assert reports[1]["digest_chain"] == reports[0]["digest_chain"]
    assert reports[1]["pid"] != reports[0]["pid"] == os.getpid()
    return reports


def shut_down(llm):
    pids = list(llm.engine.runner.worker_pids.values())
    llm.engine.shutdown()
    assert not worker_children()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


# ---- no processes: the step message and the sharded forward ---------------------------------------------
def test_step_message_round_trip():
    inputs = StepInputs(
        input_ids=torch.tensor([5, 6, 7, 8]), positions=torch.tensor([0, 1, 2, 9]),
        slot_mapping=torch.tensor([40, 41, 42, 13]), block_tables=torch.tensor([[10, 0], [3, 7]], dtype=torch.int32),
        context_lens=torch.tensor([3, 10], dtype=torch.int32), query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        sample_indices=torch.tensor([2, 3]), swap_out={4: 1, 5: 0}, swap_in={2: 9}, copies=[(7, 8), (3, 11)])
    header, payload = pack_step(inputs, step=42)
    back = unpack_step(header, payload)
    assert int(header[1]) == 42
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
                 "sample_indices"):
        assert torch.equal(getattr(back, name), getattr(inputs, name)), name
        assert getattr(back, name).dtype == getattr(inputs, name).dtype, name
    assert (back.swap_out, back.swap_in, back.copies) == (inputs.swap_out, inputs.swap_in, inputs.copies)


class ThreadGroup:
    """An in-process all-reduce among threads, standing in for torch.distributed."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.parts = [None] * world

    def rank(self, r: int):
        group = self

        class Comm:
            def all_reduce(self, tensor):
                group.parts[r] = tensor.clone()
                group.barrier.wait()
                total = sum(group.parts[1:], group.parts[0].clone())
                group.barrier.wait()
                tensor.copy_(total)

        return Comm()


def prefill(tokens):
    n = len(tokens)
    return StepInputs(input_ids=torch.tensor(tokens), positions=torch.arange(n), slot_mapping=torch.arange(n),
                      block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                      context_lens=torch.tensor([n], dtype=torch.int32),
                      query_start_loc=torch.tensor([0, n], dtype=torch.int32), sample_indices=torch.tensor([n - 1]))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-opt", "tiny-gpt2", "tiny-gpt-neox"])
def test_sharded_forward_matches_full_model(name, world):
    """Each model family's shards, summed by a threaded all-reduce, reproduce the full model's logits.
    tiny-llama at 4 ranks has fewer KV heads (2) than ranks: each rank keeps a replica of its KV head."""
    model, _ = get_model(name, F64)
    geometry = kv_geometry(model.config)
    reference = ModelRunner(model, CacheEngine(geometry, 16, 2, 1, F64, torch.device("cpu")))
    tokens = list(range(100, 120))
    want = reference.execute(prefill(tokens))
    plan = build_plan(model, world)
    setup = WorkerSetup(world, None, None, None, None, False, F64, "cpu", 0, "gloo", geometry, 16, 2, 1, 60.0, None)
    states = [RankState(shard_model(copy.deepcopy(model), plan, r), setup, r, torch.device("cpu"))
              for r in range(world)]
    group, got = ThreadGroup(world), [None] * world

    def run(r):
        got[r] = states[r].run(prefill(tokens), 1, group.rank(r))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for logits in got:
        assert torch.allclose(logits, want, rtol=0, atol=1e-12)
    local_kv = max(1, geometry.num_kv_heads // world)
    for state in states:
        assert state.cache.kv.shape[-2] == local_kv
    with pytest.raises(RuntimeError, match="tensor-parallel"):  # a shard run outside a step refuses clearly
        states[0].runner.model(input_ids=torch.tensor([[5, 6]]))


def test_unsplittable_models_are_refused():
    llama, _ = get_model("tiny-llama", F64)
    with pytest.raises(ValueError, match="4 attention heads.*3 ranks"):
        build_plan(llama, 3)
    with pytest.raises(ValueError, match="4 attention heads"):
        LLM("tiny-llama", dtype=F64, tensor_parallel_size=3, num_blocks=8)
    assert not worker_children()
    from transformers import Phi3Config, Phi3ForCausalLM

    phi3 = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=2))
    with pytest.raises(ValueError, match="does not split the heads"):
        build_plan(phi3, 2)


# ---- two gloo ranks ---------------------------------------------------------------------------------------
CONFIGS = {
    "llama-recompute-prefix": ("tiny-llama", 1, dict(preemption_mode="recompute", enable_prefix_caching=True)),
    "llama-swap": ("tiny-llama", 1, dict(preemption_mode="swap", num_swap_blocks=64)),
    "opt-recompute-prefix": ("tiny-opt", 2, dict(preemption_mode="recompute", enable_prefix_caching=True)),
    "opt-swap": ("tiny-opt", 2, dict(preemption_mode="swap", num_swap_blocks=64)),
    # every rank stores its heads in fp8 (the kv dtype reaches the workers; swaps move fp8 bytes)
    "llama-swap-fp8": ("tiny-llama", 1, dict(preemption_mode="swap", num_swap_blocks=64, kv_cache_dtype="fp8_e4m3")),
}
BLOCK, NUM_BLOCKS = 4, 22


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_ranks_match_single_process(config):
    name, kv_heads_per_rank, options = CONFIGS[config]
    options = dict(options, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    model, tok = get_model(name, F64)
    reference = LLM(model, tokenizer=tok, **options)
    llm = LLM(name, dtype=F64, tensor_parallel_size=2, **options)
    try:
        assert llm.engine.kv_size.bytes_per_block * 2 == reference.engine.kv_size.bytes_per_block
        greedy_short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        runs = [(PROMPTS[:1], greedy_short),  # alone: fills the prefix cache, no preemption
                (PROMPTS, SamplingParams(temperature=0, max_tokens=18, ignore_eos=True, logprobs=0)),
                (PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, beam_width=4)),
                (PROMPTS[2:6], SamplingParams(temperature=0, max_tokens=10, beam_width=2, n=2))]
        for i, (prompts, params) in enumerate(runs):
            got = llm.generate(prompts, params, use_tqdm=False)
            want = reference.generate(prompts, params, use_tqdm=False)
            assert_same_outputs(got, want)
            if i == 0:
                assert llm.get_stats().num_preemptions == 0
        stats, ref_stats = llm.get_stats(), reference.get_stats()
        print(f"{config}: steps {stats.num_steps}, preemptions {stats.num_preemptions} (swap "
              f"{stats.num_swap_preemptions}, recompute {stats.num_recompute_preemptions}), prefix-cache hits "
              f"{stats.prefix_cache_hits}, copy-on-write {stats.num_copy_on_write}")
        assert stats.num_preemptions == ref_stats.num_preemptions > 0
        if options["preemption_mode"] == "swap":
            assert stats.num_swap_preemptions > 0
        else:
            assert stats.num_recompute_preemptions > 0
        if options.get("enable_prefix_caching"):
            assert stats.prefix_cache_hits == ref_stats.prefix_cache_hits > 0
        assert stats.num_steps == ref_stats.num_steps
        assert_no_leaks(llm.engine)
        reports = assert_ranks_consistent(llm, kv_heads_per_rank, NUM_BLOCKS, BLOCK)
        full = reference.engine.runner.cache_engine.kv
        assert reports[1]["kv_cache_bytes"] * 2 == full.numel() * full.element_size()
    finally:
        shut_down(llm)


@pytest.mark.slow
def test_killed_worker_fails_the_engine_within_seconds():
    model, tok = get_model("tiny-gpt-neox", F64)
    options = dict(block_size=8, num_blocks=64)
    llm = LLM("tiny-gpt-neox", dtype=F64, tensor_parallel_size=2, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert_same_outputs(llm.generate(PROMPTS[:3], params, use_tqdm=False),
                            LLM(model, tokenizer=tok, **options).generate(PROMPTS[:3], params, use_tqdm=False))
        assert_ranks_consistent(llm, 2, 64, 8)
        engine, pid = llm.engine, llm.engine.runner.worker_pids[1]
        start_step, killed_at = engine.counters.num_steps, []

        def kill_after_a_few_steps():
            while engine.counters.num_steps < start_step + 3:
                time.sleep(0.005)
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_after_a_few_steps, daemon=True)
        killer.start()
        with pytest.raises(WorkerFailedError, match=r"rank 1 \(pid \d+\) was killed by signal SIGKILL") as info:
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), use_tqdm=False)
        latency = time.monotonic() - killed_at[0]
        print(f"worker killed -> WorkerFailedError after {latency:.3f} s: {info.value}")
        assert latency < 30, "liveness: the failure must surface promptly, not after a collective timeout"
        assert "cannot continue" in str(info.value)
        assert not engine.has_unfinished_requests()  # every request failed with the engine
        with pytest.raises(EngineDeadError, match="rank 1"):  # and it takes no more, with the same message
            engine.add_request("after", PROMPTS[0], params)
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.step()
    finally:
        shut_down(llm)


@pytest.mark.slow
def test_caller_module_is_shipped_to_workers_and_left_intact():
    model, tok = get_model("tiny-gpt2", F64)
    before = weights_fingerprint(model)
    options = dict(block_size=8, num_blocks=32)
    llm = LLM(model, tokenizer=tok, tensor_parallel_size=2, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        want = LLM(model, tokenizer=tok, **options).generate(PROMPTS[:4], params, use_tqdm=False)
        assert_same_outputs(llm.generate(PROMPTS[:4], params, use_tqdm=False), want)
        assert_ranks_consistent(llm, 2, 32, 8)
    finally:
        shut_down(llm)
    assert weights_fingerprint(model) == before
    assert model.transformer.h[0].attn.c_attn.weight.shape == (64, 192)


@pytest.mark.slow
def test_worker_failing_at_start_up_fails_the_constructor():
    """A worker that cannot even read its setup (here: the model class is not importable there) is reported."""
    from transformers import GPT2LMHeadModel

    module = types.ModuleType("paged_backend_parent_only_module")
    sys.modules[module.__name__] = module
    try:
        cls = type("ParentOnlyGPT2", (GPT2LMHeadModel,), {"__module__": module.__name__})
        module.ParentOnlyGPT2 = cls
        model, tok = get_model("tiny-gpt2", F64)
        local = cls(model.config).to(F64)
        with pytest.raises(WorkerFailedError, match="rank 1.*(ModuleNotFoundError|paged_backend_parent_only_module)"):
            LLM(local, tokenizer=tok, tensor_parallel_size=2, block_size=8, num_blocks=8)
    finally:
        del sys.modules[module.__name__]
    assert not worker_children()


@pytest.mark.slow
def test_torchrun_launch_of_the_cli_matches_single_process():
    """`torchrun --nproc-per-node 2 paged-backend generate --tensor-parallel-size 2`: rank 1 becomes a worker."""
    bindir = os.path.dirname(sys.executable)
    prompt = "The paged cache"
    tp = subprocess.run([os.path.join(bindir, "torchrun"), "--standalone", "--nproc-per-node", "2",
                         os.path.join(bindir, "paged-backend"), "generate", "--model", "tiny-opt", "--dtype", "float64",
                         "--num-blocks", "32", "--max-tokens", "12", "--tensor-parallel-size", "2", prompt],
                        capture_output=True, text=True, timeout=300, env=dict(os.environ, TQDM_DISABLE="1"))
    assert tp.returncode == 0, tp.stderr[-3000:]
    model, tok = get_model("tiny-opt", F64)
    want = LLM(model, tokenizer=tok, num_blocks=32).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert f"[0] (length, 12 tokens) {want.text!r}" in tp.stdout.splitlines()
