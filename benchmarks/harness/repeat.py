"""Interleaved repetitions and their spread: systems run A, B, C, A, B, C, ... so that a slow spell of a
shared machine lands on every system alike; each figure is reported as the median with its range, and a
ratio between two systems as the median of the ratios paired within each round."""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple


def interleaved_order(systems: Sequence[str], repetitions: int) -> List[Tuple[int, str]]:
    """(round, system) in the order they run: every system once per round, rounds one after another."""
    if repetitions < 1:
        raise ValueError(f"repetitions must be >= 1, got {repetitions}")
    if not systems:
        raise ValueError("no systems to run")
    return [(rep, system) for rep in range(repetitions) for system in systems]


def run_interleaved(systems: Sequence[str], repetitions: int,
                    run_one: Callable[[str, int], dict]) -> List[dict]:
    """Run `run_one(system, round)` in interleaved order; each returned row is tagged with its round and
    its position in the whole run."""
    rows = []
    for position, (rep, system) in enumerate(interleaved_order(systems, repetitions)):
        row = run_one(system, rep)
        row.update(system=system, repetition=rep, position=position)
        rows.append(row)
    return rows


def spread(values: Sequence[Optional[float]]) -> Optional[dict]:
    """Median, min, max and the values themselves (None when a value is missing)."""
    if not values or any(v is None for v in values):
        return None
    values = [float(v) for v in values]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def by_round(rows: Sequence[dict], system: str, key: str) -> Dict[int, Optional[float]]:
    """round -> rows[key] for one system."""
    return {r["repetition"]: r.get(key) for r in rows if r["system"] == system}


def paired_ratio(rows: Sequence[dict], numerator: str, denominator: str, key: str) -> Optional[dict]:
    """Spread of numerator/denominator over the rounds both ran in (each ratio from one round)."""
    top, bottom = by_round(rows, numerator, key), by_round(rows, denominator, key)
    ratios = [top[rep] / bottom[rep] for rep in sorted(set(top) & set(bottom))
              if top[rep] is not None and bottom[rep]]
    return spread(ratios) if ratios else None


def format_spread(value: Optional[dict], digits: int = 1, suffix: str = "") -> str:
    """'47.5 (46.1-48.0)' for a spread; '-' for none; a single value without a range."""
    if not value:
        return "-"
    median = f"{value['median']:.{digits}f}{suffix}"
    if len(value["values"]) == 1:
        return median
    return f"{median} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"
