"""The benchmarks' building blocks (trace reader, contiguous allocators, reservation manager, interleaved
repetitions, provenance, guidellm scenarios, the docs generator) and a `--quick` run of each benchmark through
the CLI, checking directions of its results that do not depend on timing."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_no_leaks, get_model
from paged_backend import LLMEngine, SamplingParams
from paged_backend.benchmarks.paper.contiguous import BuddyArena, FirstFitArena
from paged_backend.benchmarks.harness.docgen import render
from paged_backend.benchmarks.paper.guidellm_run import GuidellmLoad, run_guidellm, scenario
from paged_backend.benchmarks.harness.provenance import GitState, dirty_refusal, git_state
from paged_backend.benchmarks.harness.repeat import format_spread, interleaved_order, paired_ratio, run_interleaved, spread
from paged_backend.benchmarks.harness.server_process import CpuSampler
from paged_backend.benchmarks.paper.serving_systems import paged_system, transformers_system
from paged_backend.benchmarks.paper.reservation import install_reservation, reservation_tokens
from paged_backend.benchmarks.harness.workloads import (ALPACA_MEAN_OUTPUT, ALPACA_MEAN_PROMPT, alpaca_like_trace,
                                                iter_json_array, keep_request, make_trace, sharegpt_trace)
from paged_backend.cli import main as cli_main
from paged_backend.engine.metrics import EngineStats


REPO = Path(__file__).resolve().parent.parent


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


def test_capped_sharegpt_trace_cuts_prompts_and_outputs_at_the_caps(tokenizer):
    trace = sharegpt_trace(tokenizer, 40, seed=0, max_prompt_len=64, max_output_len=32)
    prompts = [r.prompt_len for r in trace.requests]
    outputs = [r.output_len for r in trace.requests]
    assert len(trace.requests) == 40 and max(prompts) == 64 and max(outputs) == 32
    assert min(prompts) >= 4 and min(outputs) >= 4 and min(prompts) < 64  # short prompts stay as they are
    assert "cut to 64" in trace.description and "capped at 32" in trace.description
    assert sharegpt_trace(tokenizer, 40, seed=0, max_prompt_len=64, max_output_len=32).requests == trace.requests
    with pytest.raises(ValueError, match="max_output_len"):
        sharegpt_trace(tokenizer, 4, max_output_len=2)
    with pytest.raises(ValueError, match="sharegpt workload only"):
        make_trace("alpaca", tokenizer, 4, max_prompt_len=64)


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


# ---- interleaved repetitions, provenance, guidellm scenarios, CPU sampling -------------------------
def test_rounds_interleave_the_systems_and_ratios_pair_within_a_round():
    assert interleaved_order(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    speeds = {("a", 0): 10.0, ("b", 0): 5.0, ("a", 1): 4.0, ("b", 1): 4.0, ("a", 2): 9.0, ("b", 2): 3.0}
    rows = run_interleaved(["a", "b"], 3, lambda system, rep: {"tps": speeds[(system, rep)]})
    assert [(r["repetition"], r["system"], r["position"]) for r in rows] == [
        (0, "a", 0), (0, "b", 1), (1, "a", 2), (1, "b", 3), (2, "a", 4), (2, "b", 5)]
    assert spread([r["tps"] for r in rows if r["system"] == "a"]) == {"median": 9.0, "min": 4.0, "max": 10.0,
                                                                      "values": [10.0, 4.0, 9.0]}
    # paired by round: ratios 2, 1, 3 -> median 2 (the ratio of the medians would be 9 / 4)
    assert paired_ratio(rows, "a", "b", "tps") == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [2.0, 1.0, 3.0]}
    assert spread([1.0, None]) is None and format_spread(None) == "-"
    with pytest.raises(ValueError, match="repetitions"):
        interleaved_order(["a"], 0)


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_git_state_sees_uncommitted_changes_and_a_dirty_tree_is_refused(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = git_state(tmp_path)
    assert len(clean.commit) == 40 and clean.dirty is False and dirty_refusal(clean) is None
    (tmp_path / "a.txt").write_text("two")
    (tmp_path / "new.txt").write_text("untracked")
    dirty = git_state(tmp_path)
    assert dirty.commit == clean.commit and dirty.dirty and sorted(dirty.changed) == ["a.txt", "new.txt"]
    assert "--allow-dirty" in dirty_refusal(dirty)
    assert "not in a git checkout" in dirty_refusal(git_state(tmp_path / "missing"))


def test_documented_runs_refuse_options_and_dirty_trees(monkeypatch, capsys):
    import paged_backend.benchmarks.cli as bench_cli

    assert cli_main(["bench", "throughput", "--documented", "--quick"]) == 2
    assert "drop --quick" in capsys.readouterr().err
    assert cli_main(["bench", "throughput", "--documented", "--repetitions", "5"]) == 2
    assert "drop --repetitions" in capsys.readouterr().err
    monkeypatch.setattr(bench_cli, "git_state", lambda: GitState("f" * 40, "main", True, ["benchmarks/x.py"]))
    assert cli_main(["bench", "waste", "--documented"]) == 2
    assert "refusing to write a documented record" in capsys.readouterr().err
    assert cli_main(["bench", "waste", "--quick", "--allow-dirty"]) == 2
    assert "only applies to --documented" in capsys.readouterr().err


def test_bench_all_records_every_benchmark_at_the_state_it_started_from(monkeypatch):
    """`make bench` writes each record into docs/img/ before the next benchmark starts; the later records must
    still say the code was the clean commit the run started from, not a dirty tree."""
    import paged_backend.benchmarks.cli as bench_cli
    import paged_backend.benchmarks.harness.docgen as docgen
    from paged_backend.benchmarks.harness import provenance
    from paged_backend.benchmarks.harness.report import conditions

    clean = GitState("c" * 40, "main", False, [])
    written = []                                  # record files the run has written so far

    def state(root=None):
        return GitState(clean.commit, "main", bool(written), list(written))
    monkeypatch.setattr(provenance, "git_state", state)
    monkeypatch.setattr(bench_cli, "git_state", state)
    seen = {}

    def run_one(name, args):
        seen[name] = conditions()["git"]
        written.append(f"docs/img/bench-{name}.json")
        return []
    monkeypatch.setattr(bench_cli, "run_one", run_one)
    monkeypatch.setattr(docgen, "regenerate", lambda docs_dir: [])
    assert cli_main(["bench", "all", "--documented"]) == 0
    assert list(seen) == list(bench_cli.BENCHMARKS)
    assert all(git == clean.as_dict() for git in seen.values()), seen
    assert conditions()["git"]["dirty"] is True   # outside a bench run the state is read afresh

    def run_one_then_edit_code(name, args):       # code edited mid-run: the later records say so
        run_one(name, args)
        written.append("paged_backend/scheduler.py")
        return []
    written.clear()
    seen.clear()
    monkeypatch.setattr(bench_cli, "run_one", run_one_then_edit_code)
    assert cli_main(["bench", "all", "--documented"]) == 0
    first, *later = seen.values()
    assert first == clean.as_dict() and all(git["dirty"] and "paged_backend/scheduler.py" in git["changed"]
                                            for git in later), seen


def test_guidellm_scenario_has_one_benchmark_per_concurrency(tmp_path):
    load = GuidellmLoad((1, 4, 16), (8, 8, 32), prompt_tokens=128, output_tokens=64, seed=3)
    s = scenario("http://127.0.0.1:9", "m", "/models/m", {"ignore_eos": True}, load, tmp_path / "r.json")
    assert s["benchmarks"] == [{"profile.streams": 1, "constraints[0].count": 8},
                               {"profile.streams": 4, "constraints[0].count": 8},
                               {"profile.streams": 16, "constraints[0].count": 32}]
    spec = s["spec"]
    assert spec["backend"]["max_tokens"] == 64 and spec["backend"]["extras"] == {"body": {"ignore_eos": True}}
    assert spec["data"] == [{"kind": "synthetic_text", "prompt_tokens": 128}]  # no output_tokens: no ignore_eos
    assert spec["seed"]["value"] == 3 and spec["outputs"][0]["path"] == str(tmp_path / "r.json")
    with pytest.raises(ValueError, match="one request count per concurrency"):
        scenario("u", "m", "t", {}, GuidellmLoad((1, 2), (8,), 4, 4), tmp_path / "r.json")


def test_machine_busy_ticks_leave_out_idle_iowait_and_steal():
    """/proc/stat's `cpu` line: user nice system idle iowait irq softirq steal guest guest_nice. Steal is time the
    hypervisor ran something else while this machine's cores waited: not work done here; guest time is already
    inside user."""
    from paged_backend.benchmarks.harness.server_process import busy_ticks

    assert busy_ticks("cpu  100 2 30 5000 40 1 3 700 9 0") == 100 + 2 + 30 + 1 + 3
    assert busy_ticks("cpu0 1 1 1 1 1 1 1 1 1 1") is None and busy_ticks("") is None   # one core's line, nothing


def test_cpu_sampler_reads_busy_cores_between_samples():
    sampler = CpuSampler(pid=0)
    sampler.samples = [(100.0, 10.0), (101.0, 11.5), (103.0, 13.5)]
    assert sampler.busy_cores(100.5, 102.0) == pytest.approx((12.5 - 10.75) / 1.5)
    assert sampler.busy_cores(99.0, 101.0) is None  # before the first sample: unknown, not zero
    with CpuSampler(os.getpid(), interval_s=0.01) as live:
        time.sleep(0.05)
        wall0, cpu0 = time.time(), time.process_time()
        while time.time() < wall0 + 0.3:
            pass  # keep this process busy
        wall1, cpu1 = time.time(), time.process_time()
        time.sleep(0.05)
    # what the process really used over the window, however loaded the machine is (no fixed share asked for)
    assert live.busy_cores(wall0, wall1) == pytest.approx((cpu1 - cpu0) / (wall1 - wall0), abs=0.25)
    # the whole machine's cores in the same window: at least this process's, at most every core /proc/stat counts
    machine = live.machine_busy_cores(wall0, wall1)
    cores = sum(line.startswith("cpu") and line[3].isdigit() for line in open("/proc/stat"))
    assert live.busy_cores(wall0, wall1) - 0.25 <= machine <= cores + 0.25
    sampler.machine = [(100.0, 50.0), (102.0, 53.0)]
    assert sampler.machine_busy_cores(100.0, 101.0) == pytest.approx(1.5)
    assert sampler.machine_busy_cores(101.0, 103.0) is None  # after the last sample: unknown


def test_transformers_serve_is_forced_without_ignore_eos():
    ours = paged_system(Path("/m"), 256, 16, None, "float32")
    theirs = transformers_system(Path("/m"), 256, 16, 2048, "float32")
    assert ours.force_length(64) == {"temperature": 0.0, "ignore_eos": True}
    forced = theirs.force_length(64)
    assert "ignore_eos" not in forced and json.loads(forced["generation_config"]) == {
        "do_sample": False, "max_new_tokens": 64, "eos_token_id": -1}
    assert theirs.argv[theirs.argv.index("--cb-num-blocks") + 1] == "16" and "--continuous-batching" in theirs.argv
    assert ours.argv[ours.argv.index("--num-blocks") + 1] == "16" and "--max-model-len" not in ours.argv
    assert ours.argv[ours.argv.index("--swap-space") + 1] == "0"   # the KV budget is all: no host pool to swap to


# ---- the quick benchmarks -------------------------------------------------------------------------
def _bench(name, tmp_path, *extra):
    """`make bench BENCH="NAME --quick ..."`: the documented entry point, at the smoke size, with one thread."""
    stale = subprocess.run(["make", "-q", "install"], cwd=REPO, capture_output=True, timeout=60).returncode
    assert stale == 0, ".venv is older than the Makefile or pyproject.toml: run `make install` first"
    bench = shlex.join([name, "--quick", "--threads", "1", "--results-dir", str(tmp_path), *extra])
    done = subprocess.run(["make", "bench", f"BENCH={bench}", f"PYTHON={sys.executable}"], cwd=REPO,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / name / f"{name}.json").read_text())
    from paged_backend.benchmarks.cli import spec_of
    if spec_of(name).plot:
        assert (tmp_path / name / f"{name}.png").stat().st_size > 1000
    assert result["problems"] == []
    git, machine = result["conditions"]["git"], result["conditions"]["machine"]
    assert len(git["commit"]) == 40 and isinstance(git["dirty"], bool) and machine["host_cpus"] >= 1
    assert result["conditions"]["torch_threads"] == 1 and result["size"] == "quick" and not result["documented"]
    assert "--size quick" in result["command"] and "--threads 1" in result["command"]
    assert len(machine["load_average_1_5_15"]) == 3 and len(result["conditions"]["load_average_after"]) == 3
    assert result["conditions"]["time"] <= result["conditions"]["finished"]
    assert set(result["conditions"]["versions"]) >= {"python", "torch", "transformers"}
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
    systems = ["paged", "paged-compiled", "oracle", "pow2", "max", "hf-static", "hf-continuous"]
    compact = [r["system"] for r in result["rows"] if r["kind"] == "kv-cache-dtype"]
    assert result["order"] == [[rep, s] for rep in range(2) for s in systems + compact]  # A, B, C, A, B, C
    rows = {r["system"]: r for r in result["rows"]}
    paged = rows["paged"]
    for system in systems:
        row = rows[system]
        assert row["all_finished"] and row["output_tokens"] == result["trace"]["total_output_tokens"]
        ours = system in ("paged", "paged-compiled")
        assert len(row["output_tokens_per_s"]["values"]) == 2 and (row["ratio"] is None) == ours
        # every other system also against our compiled engine (the paged row: compiled / eager)
        assert (row["compiled_ratio"] is None) == (system == "paged-compiled"), row
    # the compiled engine ran every step compiled, took the same steps as the eager one and kept its blocks' books
    compiled = rows["paged-compiled"]
    assert compiled["eager_steps"] == 0 and paged["eager_steps"] is None
    assert compiled["steps"] == paged["steps"] and compiled["preemptions"] == paged["preemptions"]
    assert all(run["compiled"]["buckets"]["batch"]["ready"] for run in result["runs"]
               if run["system"] == "paged-compiled")
    # our engines are stepped as users step them, overlapped (from a thread other than the compute thread)
    assert all(run["overlapped"] for run in result["runs"] if run["system"] not in ("hf-static", "hf-continuous"))
    for policy in ("oracle", "pow2", "max"):  # paging batches at least as many requests in the same memory
        assert paged["avg_batch"] >= rows[policy]["avg_batch"] and paged["token_states"] > rows[policy]["token_states"]
    assert paged["avg_batch"] > rows["max"]["avg_batch"]
    # the quick budget is tight: paging preempts, and the recomputation is reported
    assert paged["preemptions"] > 0 and paged["extra_prefill_tokens"] > 0
    if "num_recomputed_tokens" in {f.name for f in dataclasses.fields(EngineStats)}:
        assert paged["recomputed_tokens"] > 0 and result["missing_stats"] == []
    else:
        assert paged["recomputed_tokens"] is None and result["missing_stats"] == ["EngineStats.num_recomputed_tokens"]
    if compact:  # the engine takes kv_cache_dtype: its rows hold more tokens in the same bytes, apart from the rest
        assert all(rows[s]["kv_slots"] > paged["kv_slots"] and rows[s]["ratio"] for s in compact)
    else:
        assert sorted(result["kv_cache_dtype_skipped"]) == ["bfloat16", "fp8_e4m3"]
    text, problems = render("<!-- generated: record throughput -->\nSTALE\n<!-- end generated -->\n"
                            "<!-- generated: table throughput -->\n<!-- end generated -->\n",
                            {"throughput": result})
    assert problems == [] and result["conditions"]["git"]["commit"][:12] in text and "STALE" not in text
    assert "paged (ours)" in text and "paged (ours), compiled" in text and "all hold" in text


def test_docs_blocks_without_a_record_say_so_and_mixed_commits_are_flagged():
    doc = "a\n<!-- generated: table serving -->\n12.5 tok/s\n<!-- end generated -->\nb\n<!-- generated: nope x -->\n" \
          "<!-- end generated -->\n"
    text, problems = render(doc, {})
    assert "12.5" not in text and "No record of serving" in text and text.startswith("a\n")
    assert problems == ["unknown generated block 'nope' 'x'"]
    records = {name: {"conditions": {"git": {"commit": c}}} for name, c in (("waste", "a" * 40), ("sharing", "b" * 40))}
    assert any("different commits" in p for p in render("", records)[1])


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
        assert all(calls > 0 for calls in run["phase_calls"].values()), run["phase_calls"]  # every phase is hooked
    for row in result["host"]:   # the stand-in rows' overlapped engines ran overlapped, the others inline
        assert row["sleep_overlap"]["overlapped"] and not row["sleep_sync"]["overlapped"]


def test_quick_structured_benchmark(tmp_path):
    result = _bench("structured", tmp_path)
    assert [(r["repetition"], r["system"]) for r in result["runs"]] == [
        (0, "unconstrained"), (0, "json-schema"), (1, "unconstrained"), (1, "json-schema")]
    wanted = result["config"]["output_tokens"] * result["config"]["num_requests"]
    for run in result["runs"]:  # the same work on both: every request at its exact length, the mask on one only
        assert run["output_tokens"] == wanted and run["errors"] == 0
        assert (run["mask_calls"] > 0) == (run["system"] == "json-schema")
    constrained = next(r for r in result["rows"] if r["system"] == "json-schema")
    assert constrained["ratio"]["median"] > 0 and constrained["mask_ms_per_step"]["median"] > 0


def test_quick_serving_benchmark(tmp_path):
    result = _bench("serving", tmp_path)
    config = result["config"]
    assert result["order"] == [[0, "paged"], [0, "hf-serve"], [0, "oracle"]]
    assert {r["system"] for r in result["rows"]} == {"paged", "hf-serve", "oracle"}
    for row in result["rows"]:  # guidellm got every answer, each at the forced length, from all three servers
        assert row["requests_failed"] == 0 and row["requests_ok"] == max(config["min_requests"],
                                                                         config["requests_per_stream"] * row["concurrency"])
        assert row["output_tokens_min"] == row["output_tokens_max"] == config["output_tokens"]
        assert row["busy_cores"]["median"] > 0 and (row["paged_ratio"] is None) == (row["system"] == "paged")
        # the whole machine kept at least the server's cores busy (guidellm's and the rest beside them)
        assert row["machine_busy_cores"]["median"] >= row["busy_cores"]["median"] - 0.25, row
    assert all(code in (0, -15) for code in result["server_exit_codes"].values())


def test_quick_serving_half_benchmark(tmp_path):
    """The half-precision serving record's smoke size: our server in bfloat16, every answer at its forced length;
    the documented size names llama.cpp's bf16 and f16 peers and transformers in bfloat16."""
    from paged_backend.benchmarks.cli import spec_of

    result = _bench("serving-half", tmp_path)
    config = result["config"]
    assert config["dtype"] == "bfloat16" and result["order"] == [[0, "paged"]]
    assert "--dtype" in result["servers"]["paged"]["argv"] and "bfloat16" in result["servers"]["paged"]["argv"]
    (row,) = result["rows"]
    assert row["requests_failed"] == 0 and row["requests_ok"] == config["min_requests"]
    assert row["output_tokens_min"] == row["output_tokens_max"] == config["output_tokens"]
    documented = spec_of("serving-half").config("anchor-half")
    assert documented.dtype == "bfloat16" and {"llama.cpp", "llama.cpp-f16", "hf-serve"} <= set(documented.systems)


def test_documented_run_records_beside_the_plot_and_regenerates_the_page(tmp_path, monkeypatch):
    import paged_backend.benchmarks.cli as bench_cli

    docs = tmp_path / "docs"
    (docs / "img").mkdir(parents=True)
    (docs / "benchmarks.md").write_text("# B\n<!-- generated: record overhead -->\n<!-- end generated -->\n"
                                        "<!-- generated: table overhead -->\n<!-- end generated -->\n")
    quick_spec = dataclasses.replace(bench_cli.spec_of("overhead"), documented_size="quick")
    monkeypatch.setattr(bench_cli, "DOCS_DIR", docs)
    monkeypatch.setattr(bench_cli, "spec_of", lambda name: quick_spec)
    monkeypatch.setattr(bench_cli, "git_state", lambda: GitState("e" * 40, "main", False, []))
    assert cli_main(["bench", "overhead", "--documented", "--results-dir", str(tmp_path / "r")]) == 0
    record = json.loads((docs / "img" / "bench-overhead.json").read_text())
    assert record["documented"] and record["command"] == "paged-backend bench overhead --documented"
    assert (docs / "img" / "bench-overhead.png").stat().st_size > 1000
    page = (docs / "benchmarks.md").read_text()
    assert "paged-backend bench overhead --documented" in page and "running seqs" in page


FAKE_GUIDELLM = """#!/bin/sh
# guidellm's contract as run_guidellm uses it: `run --scenario PATH ...`, run in the work directory; write the
# JSON report where the scenario's first output says.
test -f "$3" || { echo "no scenario at $3 (cwd $(pwd))"; exit 2; }
exec "$PYTHON" -c 'import json, sys; s = json.load(open(sys.argv[1])); open(s["spec"]["outputs"][0]["path"], "w").write("{}")' "$3"
"""


def test_guidellm_gets_paths_that_hold_in_its_own_working_directory(tmp_path, monkeypatch):
    """`make bench` passes a relative scratch directory; guidellm runs inside it, so relative paths broke."""
    fake = tmp_path / "guidellm"
    fake.write_text(FAKE_GUIDELLM)
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHON", sys.executable)
    load = GuidellmLoad(concurrencies=(1,), requests=(1,), prompt_tokens=4, output_tokens=2)
    spec = scenario("http://127.0.0.1:1", "m", str(tmp_path), {}, load, Path("results/guidellm/r0.json"))
    assert run_guidellm(fake, spec, Path("results/guidellm"), "r0", timeout_s=60) == {}
    assert (tmp_path / "results/guidellm/r0.json").exists() and (tmp_path / "results/guidellm/r0.scenario.json").exists()


def test_guidellm_comes_from_make_install_and_a_run_never_installs_it(tmp_path, monkeypatch):
    """Installs belong to `make install`: guidellm's environment lives inside .venv and a benchmark run without it
    fails naming `make install` instead of building an environment elsewhere at run time."""
    from paged_backend.benchmarks.paper import guidellm_env

    recipe = subprocess.run(["make", "-n", "-B", "install"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert recipe.returncode == 0 and "-m paged_backend.benchmarks.paper.guidellm_env" in recipe.stdout, recipe.stderr
    made = guidellm_env.venv_dir()
    assert made.parent == Path(sys.prefix) and (made / "bin" / "guidellm").is_file()   # what make install made
    built = []
    monkeypatch.setattr(guidellm_env, "_build", built.append)
    monkeypatch.delenv("PAGED_BENCH_GUIDELLM", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    with pytest.raises(RuntimeError, match="make install"):
        guidellm_env.guidellm_executable()
    assert built == [] and list(tmp_path.iterdir()) == []


def test_recompute_policies_count_what_each_policy_recomputes():
    from paged_backend.benchmarks.paper.engine_runs import load_bench_model
    from paged_backend.benchmarks.micro.recompute_policies import POLICIES, run_policy
    from paged_backend.benchmarks.paper.throughput import QUICK
    from paged_backend.benchmarks.harness.workloads import make_trace

    size = {**QUICK, "kv_slots": 96}
    model, tokenizer = load_bench_model(size["model"])
    trace = make_trace("sharegpt", tokenizer, 12, 0, size["max_prompt_len"], size["max_output_len"])
    default = run_policy(model, tokenizer, trace, POLICIES["on demand (vLLM's: watermark 0.01, recompute)"], size)
    backoff = run_policy(model, tokenizer, trace, POLICIES["default (backoff 512 steps after a preemption)"], size)
    swap = run_policy(model, tokenizer, trace, POLICIES["swap (4096 host blocks beyond the budget)"], size)
    reserve = run_policy(model, tokenizer, trace, POLICIES["reserve 1 block per running sequence"], size)
    assert default["preemptions"] > 0 and default["recomputed"] > 0, default
    assert swap["preemptions"] > 0 and swap["recomputed"] == 0, swap
    for row in (default, swap, reserve, backoff):
        assert row["failed"] == row["wrong_lengths"] == 0, row
    assert 0 < backoff["preemptions"] < default["preemptions"], (backoff, default)
    trace_prompts = sum(r.prompt_len for r in trace.requests)
    # a resumed request also runs its newest token in the prefill, which it would have run as a decode anyway
    assert default["prefill_tokens"] == trace_prompts + default["recomputed"] + default["preemptions"], default
    assert swap["prefill_tokens"] == trace_prompts, swap
    assert reserve["prefill_tokens"] == trace_prompts + reserve["recomputed"] + reserve["preemptions"], reserve
    # the what-if admission rule is in force: with a reserve no cache can hold, a new request waits until
    # nothing else runs, so every step runs one request
    alone = run_policy(model, tokenizer, trace, {**POLICIES["reserve 1 block per running sequence"],
                                                 "reserve_per_seq": 1000}, size)
    assert default["avg_batch"] > 1 and alone["avg_batch"] == 1.0 and alone["preemptions"] == 0, alone


def _slot_use_block_by_block(table, block_size, length, final):
    tokens = reserved = internal = 0
    for i, block in enumerate(table):
        if block == -1:
            continue
        lo, hi = i * block_size, (i + 1) * block_size
        used = min(block_size, max(0, length - lo))
        ahead = min(block_size - used, max(0, min(hi, final) - max(lo, length)))
        tokens, reserved, internal = tokens + used, reserved + ahead, internal + block_size - used - ahead
    return tokens, reserved, internal


def test_slot_use_in_closed_form_equals_counting_block_by_block():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from paged_backend.benchmarks.paper.accounting import _slot_use
    from paged_backend.core.block_manager import HOLE

    assert HOLE == -1

    @settings(max_examples=400, deadline=None)
    @given(st.lists(st.booleans(), max_size=40), st.sampled_from([1, 4, 16]), st.integers(0, 700),
           st.integers(0, 700))
    def check(holes, block_size, length, final):
        table = [HOLE if hole else i for i, hole in enumerate(holes)]
        assert _slot_use(table, block_size, length, final) == _slot_use_block_by_block(table, block_size, length,
                                                                                        final)
    check()


def test_quick_step_profile_records_the_step_call_tree(tmp_path):
    from paged_backend.benchmarks.micro.step_profile import all_calls

    result = _bench("step-profile", tmp_path)
    top = result["profile"]["calls"]
    names = {c["function"].split("(")[-1].rstrip(")") for c in all_calls(top)}
    assert {"schedule", "_execute", "process"} <= names, sorted(names)    # the step's phases are there
    assert sum(c["ms_per_step"] for c in top) <= result["profile"]["step_ms"] * 1.01
    assert result["running"] == 4 and result["unprofiled_step_ms"] > 0


def test_quick_recompute_policies_study(tmp_path):
    result = _bench("recompute-policies", tmp_path)
    rows = {r["policy"]: r for r in result["rows"]}
    assert rows["on demand (vLLM's: watermark 0.01, recompute)"]["recomputed"] > 0
    assert rows["swap (4096 host blocks beyond the budget)"]["recomputed"] == 0


def test_quick_busy_threads_study(tmp_path):
    result = _bench("busy-threads", tmp_path)
    assert [(r["wait_policy"], r["system"]) for r in result["runs"]] == [("PASSIVE", "paged")]   # quick: ours only
    assert all(r["requests"] > 0 and r["busy_cores"] > 0 for r in result["runs"])
    for decode in result["in_process_decode_ms"].values():
        assert 0 < decode["min"] <= decode["median"] <= decode["max"] and len(decode["values"]) == 3


def test_quick_busy_cores_study(tmp_path):
    result = _bench("busy-cores", tmp_path)
    assert [(r["dtype"], r["concurrency"]) for r in result["runs"]] == [("float32", 1), ("float32", 2)]
    for row in result["runs"]:
        assert row["requests"] > 0 and row["busy_cores"] > 0 and row["client_cores"] > 0
        # the machine used at least what the server and the clients used (both are on it)
        assert row["machine_cores"] >= row["busy_cores"] + row["client_cores"] - 0.3, row
        assert sum(t["cores"] for t in row["threads"]) <= row["busy_cores"] + 1e-6


def test_a_record_takes_the_conditions_at_the_start_of_the_run_and_at_its_end(tmp_path, monkeypatch):
    """The time and load average labelled as the start are taken before the run, not when it ends."""
    from paged_backend.benchmarks.harness import provenance, report

    readings = iter([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [3.0, 3.0, 3.0]])
    monkeypatch.setattr(provenance, "load_average", lambda: next(readings))
    monkeypatch.setattr(report, "load_average", provenance.load_average)
    seen = {}

    def run():
        seen["load"] = provenance.load_average()      # the run itself reads the second value
        return {"conditions": {"threads": 1}}
    result = report.run_and_report("x", run, lambda r: [], lambda r: "", None, tmp_path / "x.json", None)
    c = result["conditions"]
    assert c["machine"]["load_average_1_5_15"] == [1.0, 1.0, 1.0] and seen["load"] == [2.0, 2.0, 2.0]
    assert c["load_average_after"] == [3.0, 3.0, 3.0] and c["threads"] == 1 and c["time"] <= c["finished"]


def test_quick_host_overhead_study(tmp_path):
    result = _bench("host-overhead", tmp_path)
    assert result["overlap"] and [r["batch"] for r in result["host"]] == [1, 8]
    for row in result["host"]:
        assert row["running"] == row["batch"]
        for key in ("ready_sync", "ready_overlap", "sleep_sync", "sleep_overlap"):
            assert row[key]["median_ms"] > 0, key
        assert row["sleep_sync"]["median_ms"] >= row["device_ms"]   # the sleeping runner's time is in the step
        assert row["phase_calls"]["schedule"] > 0 and row["host_phase_ms"]["sampling"] > 0
        assert 0 < row["logits_pass"]["median_ms"] < row["ready_sync"]["median_ms"]   # a part of the step
        assert row["argmax_after_idle"]["median_ms"] > 0   # the overlapped worker's pass, after idling D ms
        # overlapped engines are stepped from a thread of their own, so their forwards run on the compute thread
        # (stepped from the compute thread, an overlapped engine runs every step inline: no overlap is measured)
        assert row["ready_overlap"]["overlapped"] and row["sleep_overlap"]["overlapped"]
        assert not row["ready_sync"]["overlapped"] and not row["sleep_sync"]["overlapped"]
        # the overlapped worker from one forward's end to the next one's start: its draws are a part of it
        assert 0 < row["sampling_in_step"]["median_ms"] and 0 < row["between_forwards"]["median_ms"] < row["device_ms"]
        assert 0 < row["worker_rest"]["median_ms"] < row["between_forwards"]["median_ms"]


def test_quick_compiled_decode_study(tmp_path):
    """About 20 s: one compiled start of tiny-llama in a fresh process (the cache on disk) and two engines."""
    result = _bench("compiled-decode", tmp_path)
    [row] = result["rows"]
    assert row["dtype"] == "float32" and row["same_greedy_tokens"]
    assert row["compiled_stats"]["eager_steps"] == 0 and row["decode_ms"]["compiled"]["median"] > 0
    assert row["weight_bytes"] > 0 and 0 < row["floor_ms"] < row["decode_ms"]["eager"]["median"]
    assert set(row["starts_s"]) == {"later"} and result["bandwidth"]["best_gb_s"] > 0
    # the floor is read again before every repetition, and each repetition's compiled step is divided by its own
    reps = result["config"]["repetitions"]
    floors, ratios = row["floors_ms"]["values"], row["to_floor"]["values"]
    assert len(floors) == len(ratios) == len(row["decode_ms"]["compiled"]["values"]) == reps
    for floor, ratio, compiled in zip(floors, ratios, row["decode_ms"]["compiled"]["values"]):
        assert floor > 0 and ratio == pytest.approx(compiled / floor)
    assert row["floor_ms"] == row["floors_ms"]["median"]
    # weights larger than the last-level cache are prefetched non-temporally (tiny-llama's fit in most)
    from paged_backend.kernels import cpu_linear
    assert row["compiled_stats"]["streamed_weights"] == cpu_linear.stream_weights(row["weight_bytes"])


def test_quick_lora_study(tmp_path):
    result = _bench("lora", tmp_path)
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"base", "lora-4", "lora-4-one-slot"}
    assert rows["base"]["ratio"]["median"] == 1.0 and rows["lora-4"]["ratio"]["median"] > 0
    assert all(r["slot_loads"]["min"] >= result["config"]["num_adapters"] for s, r in rows.items() if s != "base")
    swap = result["swap_in"]
    assert swap["adapter_mib"] > 0 and swap["disk_read_ms"] > 0 and swap["slot_load_ms"] > 0


def test_quick_speculative_benchmark(tmp_path):
    """Both workloads with and without prompt lookup, one sequential request at a time: the same greedy tokens
    (the record's check), a ratio per workload and the targets of the issue."""
    result = _bench("speculative", tmp_path)
    rows = {(r["workload"], r["system"]): r for r in result["rows"]}
    assert set(rows) == {(w, s) for w in ("edit", "sharegpt") for s in ("plain", "ngram")}
    for workload, target in (("edit", 1.8), ("sharegpt", 0.95)):
        assert rows[(workload, "plain")]["ratio"]["median"] == 1.0 and rows[(workload, "plain")]["draft_tokens"] == 0
        assert rows[(workload, "ngram")]["ratio"]["median"] > 0 and rows[(workload, "ngram")]["target"] == target
        assert rows[(workload, "ngram")]["output_tokens"] == rows[(workload, "plain")]["output_tokens"] > 0
    assert result["config"]["speculative_config"]["method"] == "ngram"
