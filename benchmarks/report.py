"""Benchmark output: plain-text tables for the terminal and JSON files with the run's conditions."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch


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


def load_average() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def conditions(**extra: Any) -> Dict[str, Any]:
    """Machine and software facts recorded with every result."""
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "host_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average_1_5_15": load_average(),
            "python": platform.python_version(), "torch": torch.__version__, **extra}


def results_dir(base: str, name: str) -> Path:
    path = Path(base) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: Dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"


def run_and_report(name: str, run: Callable[[], Dict[str, Any]], check: Callable[[Dict[str, Any]], List[str]],
                   table: Callable[[Dict[str, Any]], str], plot: Optional[Callable[[Dict[str, Any], Path], Any]],
                   out_dir: Path) -> Dict[str, Any]:
    """Run a benchmark, check its invariants, print its table, write NAME.json and (if `plot`) NAME.png."""
    start = time.perf_counter()
    result = run()
    result["elapsed_s"] = time.perf_counter() - start
    result["problems"] = check(result)
    print(table(result))
    write_json(out_dir / f"{name}.json", result)
    if plot is not None:
        plot(result, out_dir / f"{name}.png")
    return result
