"""The throughput benchmark's rows: repetitions of each system folded into a median and range, ratios paired
by round, the counts that do not depend on timing (batch, token states, preemptions, recomputed tokens,
identical tokens), the tables and the invariants a correct run satisfies."""

from __future__ import annotations

from typing import Dict, List, Optional

from paged_backend.benchmarks.harness.repeat import format_spread, paired_ratio, spread
from paged_backend.benchmarks.harness.report import format_table, percent

KV_PREFIX = "paged-kv-"
COMPILED = "paged-compiled"   # our engine with its forward compiled (`compile="blocking"`)


def _kind(system: str) -> str:
    return "kv-cache-dtype" if system.startswith(KV_PREFIX) else "equal-precision"


def _label(system: str, labels: Dict[str, str]) -> str:
    if system.startswith(KV_PREFIX):
        return f"paged, KV {system[len(KV_PREFIX):]} (same bytes)"
    return labels.get(system, system)


def _same_tokens(first: dict, reference: Optional[dict]) -> Optional[int]:
    if reference is None:
        return None
    return sum(a == b and a != "" for a, b in zip(first["_digests"], reference["_digests"]))


def _stable(runs: List[dict]) -> bool:
    """An engine run is deterministic: every round must take the same steps and give the same tokens."""
    return all(r.get("steps") == runs[0].get("steps") and r["_digests"] == runs[0]["_digests"] for r in runs)


def _row(system: str, runs: List[dict], all_runs: List[dict], labels: Dict[str, str],
         paged_first: Optional[dict], useful_tokens: int) -> dict:
    first = runs[0]
    memory = first.get("memory")
    recomputed = first.get("recomputed_tokens")
    if system in ("paged", COMPILED):   # ours: no ratio against ourselves (the paged row's compiled ratio is it)
        ratio = None
    elif _kind(system) == "equal-precision":
        ratio = paired_ratio(all_runs, "paged", system, "output_tokens_per_s")
    else:
        ratio = paired_ratio(all_runs, system, "paged", "output_tokens_per_s")
    compiled_ratio = None   # ours compiled / this system, equal precision (None where the compiled engine did not run)
    if system != COMPILED and _kind(system) == "equal-precision":
        compiled_ratio = paired_ratio(all_runs, COMPILED, system, "output_tokens_per_s")
    return {
        "system": system, "label": _label(system, labels), "kind": _kind(system), "repetitions": len(runs),
        "output_tokens_per_s": spread([r["output_tokens_per_s"] for r in runs]),
        "requests_per_s": spread([r["requests_per_s"] for r in runs]),
        "wall_s": spread([r["wall_s"] for r in runs]),
        # equal-precision rows: ours / this system; kv-cache-dtype rows: this system / paged at the model dtype
        "ratio": ratio, "compiled_ratio": compiled_ratio,
        "eager_steps": max(r["compiled"]["eager_steps"] for r in runs) if "compiled" in first else None,
        "avg_batch": memory["avg_batch_requests"] if memory else first.get("avg_batch"),
        "token_states": memory["shares"]["token_states"] if memory else None,
        "steps": first.get("steps"), "preemptions": first.get("preemptions"),
        "recomputed_tokens": recomputed, "extra_prefill_tokens": first.get("extra_prefill_tokens"),
        "recomputed_share_of_trace_tokens": recomputed / useful_tokens if recomputed is not None else None,
        "kv_slots": first.get("kv_slots"), "engine": first.get("engine"),
        "same_tokens_as_paged": _same_tokens(first, paged_first),
        "stable_across_rounds": _stable(runs) if "memory" in first else None,
        "num_requests": first["num_requests"], "output_tokens": first["output_tokens"],
        "all_finished": all(r["num_finished"] == r["num_requests"] and not r["wrong_lengths"] for r in runs),
        "leaked_blocks": max(r.get("leaked_blocks", 0) for r in runs),
    }


def summarize(runs: List[dict], labels: Dict[str, str], trace_tokens: int) -> List[dict]:
    """One row per system, in the order the systems first ran; `trace_tokens` (prompt + output tokens of the
    trace) is what recomputation is measured against."""
    systems = list(dict.fromkeys(r["system"] for r in runs))
    paged = next((r for r in runs if r["system"] == "paged"), None)
    return [_row(system, [r for r in runs if r["system"] == system], runs, labels, paged, max(1, trace_tokens))
            for system in systems]


def _cells(row: dict, compiled: bool) -> List[str]:
    def num(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    recomputed = row["recomputed_tokens"]
    recomputed_text = "missing" if recomputed is None and row["engine"] else num(recomputed, 0)
    if recomputed is not None:
        recomputed_text += f" ({percent(row['recomputed_share_of_trace_tokens'])})"
    ratios = [format_spread(row["ratio"], 2, "x")]
    if compiled:
        ratios.append(format_spread(row.get("compiled_ratio"), 2, "x"))
    return [row["label"], format_spread(row["output_tokens_per_s"]), *ratios, num(row["avg_batch"]),
            percent(row["token_states"]) if row["token_states"] is not None else "-",
            "-" if row["preemptions"] is None else str(row["preemptions"]), recomputed_text,
            num(row["extra_prefill_tokens"], 0) if row["engine"] else "-",
            "-" if row["same_tokens_as_paged"] is None else f"{row['same_tokens_as_paged']}/{row['num_requests']}",
            format_spread(row["wall_s"])]


HEADERS = ["system", "out tok/s", "ratio", "avg batch", "token states", "preempt", "recomputed", "extra prefill",
           "same tokens", "wall s"]


def _headers(compiled: bool) -> List[str]:
    """The table's columns: a compiled ratio beside the ratio where our compiled engine ran."""
    return HEADERS[:3] + ["compiled ratio"] + HEADERS[3:] if compiled else HEADERS


def throughput_table(result: dict) -> str:
    trace, config = result["trace"], result["config"]
    rounds = config["repetitions"]
    title = (f"Throughput at equal KV memory ({config['kv_slots']} token slots, {result['kv_mib']:.1f} MiB): "
             f"{trace['num_requests']} {trace['name']} requests, {trace['total_output_tokens']} output tokens, "
             f"{config['model']} {config['dtype']}, {result['conditions']['torch_threads']} threads; median "
             f"(range) of {rounds} interleaved rounds; ratio = paged / system")
    compiled = any(r.get("compiled_ratio") for r in result["rows"])
    if compiled:
        title += "; compiled ratio = paged compiled / system"
    equal = [_cells(r, compiled) for r in result["rows"] if r["kind"] == "equal-precision"]
    text = format_table(_headers(compiled), equal, title)
    compact = [_cells(r, False) for r in result["rows"] if r["kind"] == "kv-cache-dtype"]
    if compact:
        text += "\n\n" + format_table(HEADERS, compact, "Compact KV cache at the same KV bytes (not part of the "
                                                        "comparison above); ratio = this row / paged")
    for dtype, reason in result.get("kv_cache_dtype_skipped", {}).items():
        text += f"\nkv_cache_dtype {dtype}: {reason}"
    for name in result.get("missing_stats", []):
        text += f"\nmissing from the engine: {name} (shown as 'missing')"
    return text


def check_throughput(result: dict) -> List[str]:
    """Invariants of a correct run (none depends on timing)."""
    problems = []
    for row in result["rows"]:
        name = row["system"]
        if not row["all_finished"]:
            problems.append(f"{name}: a round did not finish every request at its trace length")
        if row["kind"] == "equal-precision" and row["output_tokens"] != result["trace"]["total_output_tokens"]:
            problems.append(f"{name}: {row['output_tokens']} useful output tokens, expected "
                            f"{result['trace']['total_output_tokens']}")
        if row["leaked_blocks"]:
            problems.append(f"{name}: {row['leaked_blocks']} KV blocks leaked")
        if row.get("eager_steps"):
            problems.append(f"{name}: {row['eager_steps']} steps ran eagerly (no compiled bucket took them)")
        if row["stable_across_rounds"] is False:
            problems.append(f"{name}: rounds took different steps or gave different tokens (the engine is "
                            f"deterministic; something changed the model or the engine between rounds)")
    return problems
