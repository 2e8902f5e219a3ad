"""Drive one HTTP server with guidellm: write its scenario (synthetic prompts of a fixed token count, concurrent
streams at each concurrency, a request count per concurrency, a forced output length), run it, and read the
figures of each concurrency back from its JSON report."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence


@dataclass
class GuidellmLoad:
    """What guidellm sends: `prompt_tokens` synthetic tokens, `output_tokens` forced by the server-specific
    `extras` (guidellm's own forcing adds `ignore_eos`, which `transformers serve` rejects), at each
    concurrency, `requests[i]` requests at concurrency `concurrencies[i]`."""

    concurrencies: Sequence[int]
    requests: Sequence[int]
    prompt_tokens: int
    output_tokens: int
    seed: int = 0
    request_timeout_s: float = 600.0


def scenario(target: str, model_id: str, tokenizer_dir: str, extras: dict, load: GuidellmLoad,
             report_path: Path) -> dict:
    """A guidellm scenario file's content: one concurrent-streams benchmark per concurrency."""
    if len(load.concurrencies) != len(load.requests) or not load.concurrencies:
        raise ValueError("give one request count per concurrency")
    return {
        "metadata": {"name": "paged-backend serving benchmark"},
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": model_id,
                        "request_format": "/v1/completions", "max_tokens": load.output_tokens,
                        "timeout": load.request_timeout_s, "extras": {"body": extras}},
            "profile": {"kind": "concurrent", "streams": [load.concurrencies[0]]},
            "data": [{"kind": "synthetic_text", "prompt_tokens": load.prompt_tokens}],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer_dir},
            "seed": {"kind": "static", "value": load.seed},
            "constraints": [{"kind": "max_requests", "count": load.requests[0]}],
            "outputs": [{"kind": "json", "path": str(report_path)}],
        },
        "benchmarks": [{"profile.streams": c, "constraints[0].count": n}
                       for c, n in zip(load.concurrencies, load.requests)],
    }


def offline_env(threads: int = 1, workers: int = 1) -> Dict[str, str]:
    """guidellm's environment: nothing from the network, one thread and one worker process for the client
    (one asyncio worker carries hundreds of streams; guidellm's default of up to 10 spawned workers would
    compete with the server for this machine's cores and take seconds to start)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "GUIDELLM__MAX_WORKER_PROCESSES": str(workers)}


def run_guidellm(executable: Path, scenario_data: dict, work_dir: Path, name: str, timeout_s: float) -> dict:
    """Run guidellm on a scenario; returns its JSON report (raises with the log's tail if it fails)."""
    work_dir = work_dir.resolve()  # guidellm runs inside work_dir: every path it is given must be absolute
    work_dir.mkdir(parents=True, exist_ok=True)
    scenario_path = work_dir / f"{name}.scenario.json"
    output = dict(scenario_data["spec"]["outputs"][0])
    report_path = Path(output["path"]).resolve()
    output["path"] = str(report_path)
    spec = {**scenario_data["spec"], "outputs": [output, *scenario_data["spec"]["outputs"][1:]]}
    scenario_path.write_text(json.dumps({**scenario_data, "spec": spec}, indent=2))
    log = work_dir / f"{name}.log"
    with open(log, "w") as out:
        try:
            done = subprocess.run([str(executable), "run", "--scenario", str(scenario_path),
                                   "--disable-console-interactive"], stdout=out, stderr=subprocess.STDOUT,
                                  env=offline_env(), timeout=timeout_s, cwd=work_dir)
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not report_path.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"guidellm failed ({code}) on {name}; log {log}:\n{tail}")
    return json.loads(report_path.read_text())


def _stat(metrics: dict, name: str, field: str = "mean"):
    value = (metrics.get(name) or {}).get("successful") or {}
    if field.startswith("p"):
        return (value.get("percentiles") or {}).get(field)
    return value.get(field)


def read_report(report: dict) -> List[dict]:
    """One dict per concurrency: requests done and failed, output tokens (total, min, max per request), output
    tokens/s and requests/s, TTFT, inter-token latency, TPOT and end-to-end latency, the benchmark's window."""
    rows = []
    for bench in report.get("benchmarks", []):
        m = bench["metrics"]
        made = bench["scheduler_metrics"]["requests_made"]
        rows.append({
            "concurrency": bench["config"]["strategy"]["streams"],
            "requests_ok": made["successful"], "requests_failed": made["errored"] + made["incomplete"],
            "start_time": bench["start_time"], "end_time": bench["end_time"], "duration_s": bench["duration"],
            "output_tokens": _stat(m, "output_token_count", "total_sum"),
            "min_output_tokens": _stat(m, "output_token_count", "min"),
            "max_output_tokens": _stat(m, "output_token_count", "max"),
            "min_prompt_tokens": _stat(m, "prompt_token_count", "min"),
            "max_prompt_tokens": _stat(m, "prompt_token_count", "max"),
            "output_tokens_per_s": _stat(m, "output_tokens_per_second"),
            "requests_per_s": _stat(m, "requests_per_second"),
            "ttft_ms_median": _stat(m, "time_to_first_token_ms", "median"),
            "ttft_ms_p95": _stat(m, "time_to_first_token_ms", "p95"),
            "itl_ms_mean": _stat(m, "inter_token_latency_ms"),
            "tpot_ms_mean": _stat(m, "time_per_output_token_ms"),
            "latency_s_median": _stat(m, "request_latency", "median"),
            "errors": [str(r.get("info", {}).get("error") or r.get("output"))[:200]
                       for r in (bench.get("requests") or {}).get("errored", [])[:3]],
        })
    return rows
