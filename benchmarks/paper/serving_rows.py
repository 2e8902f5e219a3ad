"""The serving benchmark's rows: guidellm's per-concurrency figures of every round folded into a median and
range per (system, concurrency), ratios to our server paired within a round, the table and the invariants."""

from __future__ import annotations

from typing import List, Sequence

from paged_backend.benchmarks.harness.repeat import format_spread, paired_ratio, spread
from paged_backend.benchmarks.harness.report import format_table
from paged_backend.benchmarks.paper.serving_systems import COMPILED, LABELS


def summarize_serving(runs: List[dict], systems: Sequence[str], concurrencies: Sequence[int]) -> List[dict]:
    """One row per (system, concurrency)."""
    rows = []
    for system in systems:
        for c in concurrencies:
            own = [r for r in runs if r["system"] == system and r["concurrency"] == c]
            if not own:
                continue
            at_c = [r for r in runs if r["concurrency"] == c]
            rows.append({
                "system": system, "label": LABELS.get(system, system), "concurrency": c, "repetitions": len(own),
                "output_tokens_per_s": spread([r["output_tokens_per_s"] for r in own]),
                "requests_per_s": spread([r["requests_per_s"] for r in own]),
                "ttft_ms_median": spread([r["ttft_ms_median"] for r in own]),
                "itl_ms_mean": spread([r["itl_ms_mean"] for r in own]),
                "latency_s_median": spread([r["latency_s_median"] for r in own]),
                "busy_cores": spread([r["busy_cores"] for r in own]),
                # the whole machine's busy cores in the same windows: the server, guidellm and anything else
                "machine_busy_cores": spread([r.get("machine_busy_cores") for r in own]),
                # ours / this server's output tokens per second, paired by round
                "paged_ratio": None if system == "paged" else paired_ratio(at_c, "paged", system,
                                                                           "output_tokens_per_s"),
                # the same with our compiled server, when it ran
                "compiled_ratio": None if system == COMPILED or COMPILED not in systems else paired_ratio(
                    at_c, COMPILED, system, "output_tokens_per_s"),
                "requests_ok": sum(r["requests_ok"] for r in own),
                "requests_failed": sum(r["requests_failed"] for r in own),
                "output_tokens_min": min((r["min_output_tokens"] for r in own if r["min_output_tokens"] is not None),
                                         default=None),
                "output_tokens_max": max((r["max_output_tokens"] for r in own if r["max_output_tokens"] is not None),
                                         default=None),
                "prompt_tokens_min": min((r["min_prompt_tokens"] for r in own if r["min_prompt_tokens"] is not None),
                                         default=None),
                "prompt_tokens_max": max((r["max_prompt_tokens"] for r in own if r["max_prompt_tokens"] is not None),
                                         default=None),
            })
    return rows


def serving_table(result: dict) -> str:
    compiled = any(r.get("compiled_ratio") for r in result["rows"])
    machine = any(r.get("machine_busy_cores") for r in result["rows"])   # records from before it have none
    headers = ["system", "concurrency", "out tok/s", "paged is x", *(["compiled is x"] if compiled else []),
               "TTFT ms (median)", "ITL ms", "busy cores", *(["machine cores"] if machine else []), "done", "failed"]
    rows = [[r["label"], r["concurrency"], format_spread(r["output_tokens_per_s"]),
             format_spread(r["paged_ratio"], 2, "x"),
             *([format_spread(r.get("compiled_ratio"), 2, "x")] if compiled else []),
             format_spread(r["ttft_ms_median"], 0), format_spread(r["itl_ms_mean"], 0),
             format_spread(r["busy_cores"], 2), *([format_spread(r.get("machine_busy_cores"), 2)] if machine else []),
             r["requests_ok"], r["requests_failed"]] for r in result["rows"]]
    c = result["config"]
    title = (f"Serving over HTTP under guidellm {result['guidellm']}: {c['prompt_tokens']}-token synthetic prompts, "
             f"{c['output_tokens']} forced output tokens, {c['model']} {c['dtype']}, {c['kv_slots']} KV slots and "
             f"{c['threads']} threads per server; median (range) of {c['repetitions']} interleaved rounds"
             f"{llama_cpp_note(result)}")
    if machine:
        title += ("; busy cores: the server's CPU seconds per second, machine cores: every process's (the server, "
                  "guidellm and the rest) in the same windows")
    return format_table(headers, rows, title)


def llama_cpp_note(result: dict) -> str:
    """What the llama.cpp rows ran: its GGUF and KV precision, slots and their context (empty if none ran)."""
    peers = [(name, server["argv"]) for name, server in result["servers"].items() if name.startswith("llama.cpp")]
    if not peers:
        return ""
    parts = []
    for name, argv in peers:
        option = dict(zip(argv, argv[1:]))
        slots, context = int(option["--parallel"]), int(option["--ctx-size"])
        parts.append(f"{name} {option['--cache-type-k']} GGUF and KV cache, {slots} slot{'s' * (slots > 1)} of "
                     f"{context // slots} tokens")
    commit = (result.get("llama_cpp") or {}).get("llama_cpp_commit")
    return f"; llama.cpp at {commit or 'an unknown commit'}: " + ", ".join(parts)


def check_serving(result: dict) -> List[str]:
    """Every request answered, each at the forced output length, on every server (none depends on timing)."""
    problems = []
    wanted = result["config"]["output_tokens"]
    per_concurrency = dict(zip(result["config"]["concurrencies"], result["requests_per_concurrency"]))
    for r in result["rows"]:
        name = f"{r['system']} at concurrency {r['concurrency']}"
        expected = per_concurrency[r["concurrency"]] * r["repetitions"]
        if r["requests_failed"] or r["requests_ok"] != expected:
            problems.append(f"{name}: {r['requests_ok']}/{expected} requests answered, {r['requests_failed']} failed")
        if (r["output_tokens_min"], r["output_tokens_max"]) != (wanted, wanted):
            problems.append(f"{name}: output lengths {r['output_tokens_min']}-{r['output_tokens_max']} tokens, "
                            f"expected exactly {wanted} (the forced length was not honoured)")
    for name, code in result.get("server_exit_codes", {}).items():
        if code not in (0, None, -15):
            problems.append(f"{name} server exited with {code}")
    return problems
