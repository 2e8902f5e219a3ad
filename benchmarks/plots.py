"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CATEGORIES = [("token_states", "token states", "#2e7d32"), ("reserved", "reserved", "#f9a825"),
              ("internal", "internal frag.", "#ef6c00"), ("external", "external frag.", "#c62828")]
SYSTEM_COLORS = {"paged": "#1565c0", "oracle": "#6a1b9a", "pow2": "#ad1457", "max": "#4e342e",
                 "hf-static": "#757575", "hf-continuous": "#00838f"}


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


def plot_throughput(result: dict, path: Path) -> Path:
    """Output tokens/s per system at equal KV memory, each bar labelled with ours / its throughput."""
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    labels = [r["label"] for r in runs]
    values = [r["output_tokens_per_s"] for r in runs]
    bars = ax.barh(labels, values, color=[SYSTEM_COLORS.get(r["system"], "#999999") for r in runs])
    for bar, run in zip(bars, runs):
        ratio = run.get("paged_speedup")
        text = f"{run['output_tokens_per_s']:.0f} tok/s" + (f"  (ours {ratio:.2f}x)" if ratio else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=8)
    ax.set_xlim(0, max(values) * 1.45 if values else 1)
    ax.invert_yaxis()
    trace, config = result["trace"], result["config"]
    ax.set_xlabel("useful output tokens / s")
    ax.set_title(f"{trace['num_requests']} {trace['name']} requests, {config['model']}, "
                 f"{config['kv_slots']} KV slots for every system", fontsize=10)
    return _save(fig, path)


def plot_serving(result: dict, path: Path) -> Path:
    """Figure 12 style: normalized latency and mean TTFT against the offered request rate, per system."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    systems = []
    for run in result["runs"]:
        if run["system"] not in systems:
            systems.append(run["system"])
    for system in systems:
        runs = [r for r in result["runs"] if r["system"] == system and r["num_finished"]]
        rates = [r["rate"] for r in runs]
        color = SYSTEM_COLORS.get(system, "#999999")
        label = "paged (ours)" if system == "paged" else f"reserve {system}"
        axes[0].plot(rates, [r["normalized_latency_s_per_token"] for r in runs], "o-", color=color, label=label)
        axes[1].plot(rates, [r["mean_ttft_s"] for r in runs], "o-", color=color, label=label)
    axes[0].set_ylabel("normalized latency (s / output token)")
    axes[1].set_ylabel("mean time to first token (s)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    c = result["config"]
    fig.suptitle(f"{result['trace']['name']} requests over HTTP, {c['model']}, {c['kv_slots']} KV slots",
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
