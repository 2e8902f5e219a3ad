"""The GPU session's scripts (benchmarks/gpu/gpu_session.sh) on this CPU machine: both refuse to run without CUDA,
and the engine script's pressure check, pointed at the CPU, compares outputs and counts failed requests."""

from __future__ import annotations

import pytest
import torch

from conftest import get_model
from paged_backend.benchmarks.gpu import gpu_capture, gpu_engine, gpu_kernels, gpu_overlap


def test_the_scripts_refuse_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_engine.main([]) == 2
    assert gpu_kernels.main([]) == 2
    assert gpu_overlap.main([]) == 2
    assert gpu_capture.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_overlap_timing_on_the_cpu_reports_both_ways_with_the_same_tokens(monkeypatch):
    monkeypatch.setattr(gpu_engine, "DEVICE", "cpu")
    model, _ = get_model("tiny-llama", torch.float32)
    rows = gpu_overlap.compare(model, (2,), steps=3, device="cpu")
    rows += gpu_overlap.compare(model, (2,), steps=3, device="cpu", sampled=True)   # seeded: the same both ways
    assert [r["overlap"] for r in rows] == [False, True] * 2 and all(r["same_tokens"] for r in rows), rows
    assert all(0 < r["device_ms_per_step"] and 0 < r["device_busy"] <= 1 for r in rows), rows
    assert all(r["between_forwards_ms"] >= 0 and r["engine_thread_cpu_ms"] > 0 and r["forward_thread_cpu_ms"] > 0
               for r in rows), rows
    assert all(0 < r["sampler_host_ms"] == r["sampler_device_ms"] for r in rows), rows   # every step's draws timed
    assert "| 2 | greedy | off | on |" in gpu_overlap.report_markdown({"device": "cpu", "model": "tiny", "rows": rows})


def test_the_graph_token_check_on_the_cpu_runs_the_padded_steps(monkeypatch):
    # no CUDA graphs here: the padded steps on the buffers (reference kernels: they skip padding rows' writes)
    # against the plain engine, as the GPU run compares replayed ones
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", "torch")
    model, _ = get_model("tiny-llama", torch.float32)
    checks = gpu_overlap.check_graph_tokens(model, batches=(3,), tokens=5, device="cpu")
    assert checks[3]["same_as_buffers_eager"] and checks[3]["sequences_same_as_plain_eager"] == 3, checks
    report = gpu_overlap.report_markdown({"device": "cpu", "model": "tiny", "graph_tokens": {"float32": checks}})
    assert "| 3 | yes | 3/3 |" in report


def test_transformers_continuous_batching_baseline_runs_and_reruns(monkeypatch):
    monkeypatch.setattr(gpu_engine, "DEVICE", "cpu")
    model, _ = get_model("tiny-llama", torch.float32)
    baseline = gpu_engine.HFContinuous(model, num_blocks=4, max_batch_tokens=64)   # not 40% of the host's memory
    work = [([5 + i, 7, 9, 11], 3 + i) for i in range(3)]
    try:
        assert baseline.seconds(work) > 0 and baseline.seconds(work) > 0   # the kept manager serves a second run
    finally:
        baseline.close()


def test_a_pressure_mismatch_names_the_requests_and_reruns_each_path(monkeypatch):
    # the H200 run at fda71e0 matched 9 of 12 requests under swapping and said no more: the check now names the
    # requests that differ and reruns the pressure eagerly, without overlap and both, to say which path differs
    monkeypatch.setattr(gpu_engine, "DEVICE", "cpu")
    real = gpu_engine._tight_run

    def one_altered(model, tokenizer, work, mode, **options):
        outputs, stats = real(model, tokenizer, work, mode, **options)
        if not options:   # the default engine's run only: its request 4 (sampled, n=3) gets another 3rd token
            completion = outputs[4].outputs[1]
            completion.token_ids = list(completion.token_ids[:2]) + [completion.token_ids[2] + 1] + \
                list(completion.token_ids[3:])
        return outputs, stats
    monkeypatch.setattr(gpu_engine, "_tight_run", one_altered)
    row = gpu_engine.check_pressure("swap")
    assert not row["same"] and row["requests_same"] == 11 and row["num_errors"] == 0, row   # the rest match
    assert row["swap_preemptions"] > 0 and row["free_blocks_after"] == row["blocks"], row
    assert row["differing"] == [{"request": 4, "kind": "sampled, n=3", "first_difference": [1, 2]}], row
    assert (row["eager_requests_same"], row["no_overlap_requests_same"], row["host_fill_requests_same"],
            row["eager_no_overlap_requests_same"], row["alone_eager_no_overlap_same"]) == (12, 12, 12, 12, 12), row
    report = gpu_engine.report_markdown({"device": "cpu", "fidelity": {}, "pressure": {"swap": row}})
    assert "4 (sampled, n=3, [1, 2])" in report and "eager 12, without overlap 12" in report


def test_feature_rows_compare_tokens_exactly_and_logprobs_within_a_tolerance():
    from types import SimpleNamespace as NS

    from paged_backend.sampling.logprob import Logprob

    def request(tokens, logprob, error=None):
        completion = NS(token_ids=tokens, logprobs=[{t: Logprob(logprob, 1)} for t in tokens],
                        cumulative_logprob=logprob * len(tokens))
        return NS(outputs=[completion], error=error)
    base = request([5, 6], -0.5)
    assert gpu_engine.compare_completions(base, request([5, 6], -0.5 + 1e-6))["same"]
    row = gpu_engine.compare_completions(base, request([5, 6], -0.5 + 1e-3))
    assert not row["same"] and row["tokens_same"] and abs(row["logprob_gap"] - 2e-3) < 1e-9, row
    assert not gpu_engine.compare_completions(base, request([5, 7], -0.5))["tokens_same"]
    assert not gpu_engine.compare_completions(base, request([5, 6], -0.5, error="failed"))["same"]


def test_a_failed_request_fails_the_pressure_check(monkeypatch):
    monkeypatch.setattr(gpu_engine, "DEVICE", "cpu")
    real = gpu_engine._pressure_workload

    def with_a_bad_processor(vocab):
        work = real(vocab)
        prompt, params = work[0]
        params.logits_processors = [lambda ids, logits: 1 / 0]   # fails that request, alone and under pressure
        return work
    monkeypatch.setattr(gpu_engine, "_pressure_workload", with_a_bad_processor)
    row = gpu_engine.check_pressure("recompute")
    assert not row["same"] and row["num_errors"] == 2 and "ZeroDivisionError" in row["errors"][0], row


def test_a_failed_request_fails_the_throughput_timing(monkeypatch):
    # the GPU run of 2026-12-04 counted the tokens of failed requests as produced: the timing now refuses them
    from paged_backend import LLM, SamplingParams
    model, tokenizer = get_model("tiny-llama", torch.float32)
    llm = LLM(model, tokenizer=tokenizer, num_blocks=32)
    failing = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logits_processors=[lambda ids, x: 1 / 0])
    outputs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                                  failing], use_tqdm=False)
    gpu_engine.check_complete(outputs[:1], [4])
    with pytest.raises(RuntimeError, match="1 of 2 requests failed or came back short.*ZeroDivisionError"):
        gpu_engine.check_complete(outputs, [4, 4])
    with pytest.raises(RuntimeError, match="came back short"):
        gpu_engine.check_complete(outputs[:1], [5])


def test_the_session_script_lays_out_the_package_and_reaches_each_part(tmp_path):
    # without CUDA each part refuses with its own message: the script found and started every module it names
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, GPU_PARTS="throughput engine overlap capture",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               ENGINE_ARGS="--presets tiny-llama", OVERLAP_ARGS="--batches 2 --steps 2 --skip-graph-tokens",
               THROUGHPUT_ARGS="--throughput-requests 4")   # docs/gpu.md's options: argparse takes them first
    done = subprocess.run(["bash", "benchmarks/gpu/gpu_session.sh", str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    for log, part in (("gpu_throughput", "gpu_engine"), ("gpu_engine", "gpu_engine"), ("gpu_overlap", "gpu_overlap"),
                      ("gpu_capture", "gpu_capture")):
        assert f"{part} needs a CUDA GPU" in (tmp_path / f"{log}.log").read_text()


def test_the_feature_check_on_the_cpu_compares_both_engines(monkeypatch):
    # on a GPU it compares CUDA graphs with overlap against eager steps without it; here both engines are eager,
    # so this checks the workload (every feature accepted, structured outputs included) and the comparison
    result = gpu_engine.check_features(device="cpu")
    assert result["same"] and result["structured"], result
    assert set(result["rows"]) >= {"penalties", "bias", "allowed", "min_tokens", "logprobs", "seeded", "beams",
                                   "json", "ngram_speculation", "draft_model_speculation"}
    report = gpu_engine.report_markdown({"device": "cpu", "features": result, "fidelity": {}, "pressure": {}})
    assert "| json | yes |" in report and "Structured outputs checked" in report


def test_the_lora_check_on_the_cpu_matches_peft(tmp_path):
    row = gpu_engine.check_lora(tmp_path, device="cpu")
    assert row["same"] and row["adapters_same"] == [True, True, True], row
    assert row["adapters_change_tokens"] == [True, True], row   # else the comparison would prove nothing
    report = gpu_engine.report_markdown({"device": "cpu", "lora": row, "fidelity": {}, "pressure": {}})
    assert "Same greedy tokens: [True, True, True]" in report


def test_the_throughput_part_runs_alone_with_its_size(monkeypatch, tmp_path):
    # `--only-throughput --throughput-requests N` (docs/gpu.md's next run): the timing alone, sized, written out
    import json

    asked = []

    def timing(num_requests):
        asked.append(num_requests)
        return {"error": "stand-in"} if num_requests == 3 else {"model": "stand-in", "requests": num_requests}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    monkeypatch.setattr(gpu_engine, "time_throughput", timing)
    monkeypatch.setattr(gpu_engine, "report_markdown", lambda result: "report\n")
    for checks in ("check_fidelity", "check_features", "check_lora", "check_pressure"):
        monkeypatch.setattr(gpu_engine, checks, lambda *a: pytest.fail(f"{checks} ran"))
    assert gpu_engine.main(["--only-throughput", "--throughput-requests", "7", "--output", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "gpu_engine.json").read_text())["throughput"]["requests"] == 7
    assert gpu_engine.main(["--only-throughput", "--throughput-requests", "3"]) == 1   # a failed timing fails
    assert asked == [7, 3]
