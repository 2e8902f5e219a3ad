"""Benchmark output: plain-text tables for the terminal and JSON files with the run's conditions."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from paged_backend.benchmarks.harness.provenance import (instruction_sets_text, load_average, machine,
                                                        recorded_git_state, versions)


@dataclass(frozen=True)
class BenchmarkSpec:
    """What the CLI and the docs generator need to know about one benchmark: its config class, named sizes
    (option overrides of the config's defaults), which size the documented record uses, and how to run,
    check, tabulate and plot it (`plot` names a function of plots.py, imported only when drawing)."""

    name: str
    config_cls: type
    run: Callable[[Any], Dict[str, Any]]
    check: Callable[[Dict[str, Any]], List[str]]
    table: Callable[[Dict[str, Any]], str]
    plot: str
    sizes: Dict[str, Dict[str, Any]]
    documented_size: str
    uses_scratch_dir: bool = False   # run(config, scratch_dir) keeps raw by-products there (never committed)
    # run on the compute thread (below); False: in the caller, for benchmarks that step overlapped engines (an
    # engine stepped from the compute thread runs its steps inline) and hand their torch work there themselves
    on_compute_thread: bool = True

    def execute(self, config: Any, scratch_dir: Path) -> Dict[str, Any]:
        """Run on the process's compute thread, where our engines run their torch work: every system a benchmark
        runs in this process (transformers' baselines too) then shares one OpenMP team (architecture.md, *One
        OpenMP team*). A spec with `on_compute_thread=False` runs in the caller and hands its torch work there
        itself, so that the overlapped engines it steps overlap."""
        from paged_backend.worker.compute_thread import run_on_compute_thread

        def job():
            result = self.run(config, scratch_dir) if self.uses_scratch_dir else self.run(config)
            return result, torch.get_num_threads()

        if not self.on_compute_thread:
            return job()[0]
        result, threads = run_on_compute_thread(job)
        torch.set_num_threads(threads)   # the thread count the benchmark chose holds for the caller too
        return result

    def config(self, size: str, **overrides: Any):
        """The config of a named size with explicit options on top."""
        if size not in self.sizes:
            raise ValueError(f"{self.name} has no size {size!r}; sizes: {', '.join(self.sizes)}")
        return self.config_cls(**{**self.sizes[size], **overrides})

    def plot_function(self) -> Callable[[Dict[str, Any], Path], Any]:
        from paged_backend.benchmarks.harness import plots

        return getattr(plots, self.plot)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """A fixed-width table; floats get at most three decimals."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))) for row in body]
    return "\n".join(lines)


def conditions(**extra: Any) -> Dict[str, Any]:
    """Machine, software and code facts recorded with every result: time, git commit (and whether the tree
    was dirty), cores, CPU model, memory, load average now, versions and torch threads."""
    return {"time": now(), "git": recorded_git_state().as_dict(), "machine": machine(), "versions": versions(),
            "torch_threads": torch.get_num_threads(), **extra}


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def conditions_line(c: Dict[str, Any]) -> str:
    """`conditions()` as one line of text, for records written as Markdown."""
    git, m, v = c["git"], c["machine"], c["versions"]
    return (f"Conditions: commit `{git.get('commit') or 'unknown'}`{' (dirty tree)' if git.get('dirty') else ''}, "
            f"started {c['time']}; machine: {m.get('host_cpus')} cores, {m.get('cpu_model')}"
            f"{instruction_sets_text(m)}, "
            f"{m.get('memory_gib')} GiB, load average {m.get('load_average_1_5_15')}; versions: "
            + ", ".join(f"{k} {val}" for k, val in v.items()) + f"; torch threads {c['torch_threads']}")


def write_json(path: Path, data: Dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def run_and_report(name: str, run: Callable[[], Dict[str, Any]], check: Callable[[Dict[str, Any]], List[str]],
                   table: Callable[[Dict[str, Any]], str], plot: Optional[Callable[[Dict[str, Any], Path], Any]],
                   json_path: Path, plot_path: Optional[Path], extra: Optional[Dict[str, Any]] = None
                   ) -> Dict[str, Any]:
    """Run a benchmark, check its invariants, print its table, write its JSON (with `extra`, e.g. the command
    and size, and the conditions at its start and end) and, when `plot` and `plot_path` are given, its PNG."""
    started = conditions()          # before the run: its start time and the machine's load then
    start = time.perf_counter()
    result = run()
    result["elapsed_s"] = time.perf_counter() - start
    own = result.get("conditions", {})   # what the benchmark adds (its threads)
    result["conditions"] = {**started, **own, "torch_threads": torch.get_num_threads(), "finished": now(),
                            "load_average_after": load_average()}
    result.update(extra or {})
    result["problems"] = check(result)
    print(table(result))
    write_json(json_path, result)
    if plot is not None and plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot(result, plot_path)
    return result
