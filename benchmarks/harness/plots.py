"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CATEGORIES = [("token_states", "token states", "#2e7d32"), ("reserved", "reserved", "#f9a825"),
              ("internal", "internal frag.", "#ef6c00"), ("external", "external frag.", "#c62828")]
SYSTEM_COLORS = {"paged": "#1565c0", "paged-compiled": "#0d47a1", "oracle": "#6a1b9a", "pow2": "#ad1457",
                 "max": "#4e342e", "hf-static": "#757575", "hf-continuous": "#00838f", "hf-serve": "#00838f",
                 "llama.cpp": "#ef6c00", "llama.cpp-f16": "#ffb74d"}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _stacked(ax, labels: List[str], shares: List[Dict[str, float]], title: str) -> None:
    left = [0.0] * len(labels)
    for key, name, color in CATEGORIES:
        values = [100 * s.get(key, 0.0) for s in shares]
        ax.barh(labels, values, left=left, color=color, label=name)
        for i, v in enumerate(values):
            if v >= 7:
                ax.text(left[i] + v / 2, i, f"{v:.0f}", ha="center", va="center", color="white", fontsize=8)
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of KV memory in use or fragmented")
    ax.set_title(title, fontsize=10)
    ax.invert_yaxis()


def plot_waste(result: dict, path: Path) -> Path:
    """Figure 2 style: stacked shares per system, this run beside the paper's numbers."""
    runs = result["runs"]
    labels = [r["label"] + ("" if r["system"] == "paged" else f" [{r['allocator']}]") for r in runs]
    ours = [r["memory"]["shares"] for r in runs]
    paper = result["paper_figure_2_percent"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
    trace = result["trace"]
    _stacked(axes[0], labels, ours, f"this run: {trace['num_requests']} {trace['name']} requests, "
                                    f"{result['config']['kv_slots']} slots")
    _stacked(axes[1], labels, [{k: v / 100 for k, v in paper.get(r["system"], {}).items()} for r in runs],
             "paper, Figure 2 (OPT-13B, A100)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _median_and_error(spreads: List[dict]) -> Tuple[List[float], List[List[float]]]:
    medians = [s["median"] if s else 0.0 for s in spreads]
    below = [s["median"] - s["min"] if s else 0.0 for s in spreads]
    above = [s["max"] - s["median"] if s else 0.0 for s in spreads]
    return medians, [below, above]


def plot_throughput(result: dict, path: Path) -> Path:
    """Output tokens/s per system (median, range as error bars); compact-KV rows hatched and set apart."""
    rows = [r for r in result["rows"] if r["kind"] == "equal-precision"] + \
        [r for r in result["rows"] if r["kind"] != "equal-precision"]
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(rows) + 1.4))
    values, errors = _median_and_error([r["output_tokens_per_s"] for r in rows])
    colors = [SYSTEM_COLORS.get(r["system"], "#90caf9") for r in rows]
    bars = ax.barh([r["label"] for r in rows], values, xerr=errors, color=colors, capsize=3,
                   hatch=None, error_kw={"elinewidth": 1})
    for bar, row in zip(bars, rows):
        if row["kind"] != "equal-precision":
            bar.set_hatch("//")
        ratio, compiled = row.get("ratio"), row.get("compiled_ratio")
        note = "" if not ratio else (f"  (ours {ratio['median']:.2f}x)" if row["kind"] == "equal-precision"
                                     else f"  ({ratio['median']:.2f}x paged)")
        if compiled and row["system"] != "paged":   # our compiled engine against this system too
            text = f"compiled {compiled['median']:.2f}x"
            note = f"{note[:-1]}, {text})" if note else f"  ({text})"
        tps = row["output_tokens_per_s"]
        if tps:
            ax.text(tps["max"], bar.get_y() + bar.get_height() / 2, f"  {tps['median']:.1f} tok/s{note}",
                    va="center", fontsize=8)
    ax.set_xlim(0, max(v + e for v, e in zip(values, errors[1])) * 1.6 if values else 1)
    ax.invert_yaxis()
    trace, config = result["trace"], result["config"]
    ax.set_xlabel(f"useful output tokens / s (median and range of {config['repetitions']} interleaved rounds)")
    ax.set_title(f"{trace['num_requests']} {trace['name']} requests, {config['model']} {config['dtype']}, "
                 f"{config['kv_slots']} KV slots ({result['kv_mib']:.1f} MiB) for every system", fontsize=10)
    return _save(fig, path)


def plot_serving(result: dict, path: Path) -> Path:
    """Output tokens/s, median TTFT and busy cores against concurrency, per server (median, range)."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    systems = list(dict.fromkeys(r["system"] for r in result["rows"]))
    panels = [("output_tokens_per_s", "output tokens / s"), ("ttft_ms_median", "median time to first token (ms)"),
              ("busy_cores", "server CPU cores busy")]
    for system in systems:
        rows = [r for r in result["rows"] if r["system"] == system]
        xs = [r["concurrency"] for r in rows]
        for ax, (key, _) in zip(axes, panels):
            have = [(x, r[key]) for x, r in zip(xs, rows) if r[key]]
            if not have:
                continue
            values, errors = _median_and_error([s for _, s in have])
            ax.errorbar([x for x, _ in have], values, yerr=errors, fmt="o-", capsize=3,
                        color=SYSTEM_COLORS.get(system, "#999999"), label=rows[0]["label"])
    concurrencies = sorted({r["concurrency"] for r in result["rows"]})
    for ax, (_, label) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    c = result["config"]
    fig.suptitle(f"guidellm {result['guidellm']}: {c['prompt_tokens']}-token prompts, {c['output_tokens']} output "
                 f"tokens, {c['model']} {c['dtype']}, {c['kv_slots']} KV slots and {c['threads']} threads per server",
                 fontsize=10)
    return _save(fig, path)


def plot_sharing(result: dict, path: Path) -> Path:
    """Figures 15-17 style: % of KV blocks saved per case (step-averaged and at the peak)."""
    runs = [r for r in result["runs"] if r["kind"] != "prefix" or r["prefix_caching"]]
    labels = [(f"parallel n={r['k']}" if r["kind"] == "parallel" else f"beam {r['k']}") if r["kind"] != "prefix"
              else f"prefix {r['k']}-shot" for r in runs]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [100 * r["saving"] for r in runs], width=0.4, label="averaged over steps",
           color="#1565c0")
    ax.bar([i + 0.2 for i in x], [100 * r["peak_saving"] for r in runs], width=0.4, label="at the peak",
           color="#90caf9")
    for i, r in enumerate(runs):
        ax.text(i - 0.2, 100 * r["saving"], f"{100 * r['saving']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.legend(fontsize=8)
    ax.set_title(f"{result['trace']['name']} prompts, {result['config']['model']}", fontsize=10)
    return _save(fig, path)


def plot_overhead(result: dict, path: Path) -> Path:
    """Share of a decode step per phase, one bar per running batch size."""
    names = [("forward", "model forward", "#1565c0"), ("attention", "paged attention", "#64b5f6"),
             ("schedule", "schedule", "#f9a825"), ("block_manager", "block manager", "#ef6c00"),
             ("prepare_inputs", "prepare inputs", "#8e24aa"), ("sampling", "sampling", "#c62828"),
             ("bookkeeping", "output bookkeeping", "#6d4c41"), ("other", "other", "#9e9e9e")]
    runs = result["runs"]
    labels = [f"{r['running']} seqs\n{r['step_ms']:.0f} ms" for r in runs]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    left = [0.0] * len(runs)
    for key, name, color in names:
        values = [100 * r["phase_ms"][key] / r["step_ms"] if r["step_ms"] else 0.0 for r in runs]
        ax.barh(labels, values, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of decode step wall time")
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
    ax.set_title(f"engine step breakdown, {result['config']['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_structured(result: dict, path: Path) -> Path:
    """Output tokens/s with and without a JSON-schema constraint (median, range as error bars)."""
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.4))
    values, errors = _median_and_error([r["output_tokens_per_s"] for r in rows])
    colors = ["#90a4ae" if r["system"] == "unconstrained" else "#1565c0" for r in rows]
    bars = ax.barh([r["system"] for r in rows], values, xerr=errors, color=colors, capsize=3,
                   error_kw={"elinewidth": 1})
    for bar, row in zip(bars, rows):
        tps, ratio = row["output_tokens_per_s"], row["ratio"]
        if tps:
            note = f"  {tps['median']:.1f} tok/s" + (f" ({ratio['median']:.3f}x)" if ratio and
                                                    row["system"] != "unconstrained" else "")
            ax.text(tps["max"], bar.get_y() + bar.get_height() / 2, note, va="center", fontsize=8)
    ax.set_xlim(0, max(v + e for v, e in zip(values, errors[1])) * 1.5 if values else 1)
    ax.invert_yaxis()
    config = result["config"]
    ax.set_xlabel(f"output tokens / s (median and range of {config['repetitions']} interleaved rounds)")
    ax.set_title(f"{config['num_requests']} concurrent requests x {config['output_tokens']} tokens, "
                 f"{config['model']}: JSON schema vs unconstrained", fontsize=10)
    return _save(fig, path)
