"""Regenerate docs/benchmarks.md and its plots from the recorded JSON alone (docs/img/bench-NAME.json for the
benchmarks, docs/measurements/NAME.json for the studies).

The prose of docs/benchmarks.md is written by hand; every figure sits in a generated block,
`<!-- generated: KIND NAME -->` ... `<!-- end generated -->`, rewritten here from the records:
`record NAME` (command, commit, machine, duration), `table NAME`, `plot NAME` and `headline`; `before NAME` shows
the record and table of docs/measurements/NAME-before.json, the same measurement run on the code before a change
(its record names that commit).
A benchmark without a record gets a line saying so instead of stale numbers. The benchmarks' records must come
from one commit (`make bench` runs them together); each study's record names its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional

from paged_backend.benchmarks.harness.provenance import instruction_sets_text

BLOCK = re.compile(r"(<!-- generated: ([a-z]+)(?: ([a-z-]+))? -->\n)(.*?)(<!-- end generated -->)", re.S)


def names() -> tuple:
    """The benchmarks, then the studies (each with its own record)."""
    from paged_backend.benchmarks.cli import BENCHMARKS, STUDIES

    return BENCHMARKS + STUDIES


def load_records(docs_dir: Path) -> Dict[str, dict]:
    """name -> recorded result, for every benchmark and study that has a record; "NAME:before" -> the record of
    the same measurement before a change, where docs/measurements/NAME-before.json exists."""
    from paged_backend.benchmarks.cli import record_paths

    records = {}
    for name in names():
        path = record_paths(name, docs_dir)[0]
        if path.exists():
            records[name] = json.loads(path.read_text())
        before = docs_dir / "measurements" / f"{name}-before.json"
        if before.exists():
            records[f"{name}:before"] = json.loads(before.read_text())
    return records


def _missing(name: str) -> str:
    return (f"*No record of {name} at this commit yet: `paged-backend bench {name} --documented` (or `make bench`) "
            f"writes it.*\n")


def _commit_text(record: dict) -> str:
    git = record.get("conditions", {}).get("git", {})
    commit = (git.get("commit") or "unknown")[:12]
    return f"`{commit}`" + (" (**dirty tree**: uncommitted changes)" if git.get("dirty") else "")


def _when(c: dict) -> str:
    """The run's start and end times; a record whose start was not taken says so."""
    start, end = c.get("time"), c.get("finished")
    if start and end:
        return f"run {start} to {end}"
    return f"started {start}" if start else f"finished {end} (start not recorded)"


def _load(c: dict) -> str:
    start = c.get("machine", {}).get("load_average_1_5_15")
    return f"{start if start else 'not recorded'} at the start, {c.get('load_average_after')} at the end"


def render_record(name: str, record: dict) -> str:
    c = record.get("conditions", {})
    m = c.get("machine", {})
    v = c.get("versions", {})
    lines = ["| | |", "|---|---|",
             f"| command | `{record.get('command', '?')}` ({record.get('elapsed_s', 0) / 60:.0f} min, size "
             f"`{record.get('size', '?')}`) |",
             f"| commit | {_commit_text(record)}, {_when(c)} |",
             f"| machine | {m.get('host_cpus', '?')} cores ({m.get('usable_cpus', '?')} usable), "
             f"{m.get('cpu_model') or 'unknown CPU'}{instruction_sets_text(m)}, {m.get('memory_gib', '?')} GiB |",
             f"| load average (1/5/15 min) | {_load(c)} |",
             f"| torch | {v.get('torch')}, {c.get('torch_threads')} threads; transformers {v.get('transformers')}, "
             f"Python {v.get('python')} |"]
    if c.get("note"):
        lines.append(f"| note | {c['note']} |")
    problems = record.get("problems") or []
    lines.append(f"| invariants | {'all hold' if not problems else 'VIOLATED: ' + '; '.join(problems)} |")
    return "\n".join(lines) + "\n"


def render_table(name: str, record: dict) -> str:
    from paged_backend.benchmarks.cli import spec_of

    return "```text\n" + spec_of(name).table(record) + "\n```\n"


def render_plot(name: str, record: dict) -> str:
    return f"![{name}](img/bench-{name}.png)\n"


def _ratio(rows: List[dict], system: str, key: str = "ratio") -> Optional[str]:
    row = next((r for r in rows if r["system"] == system and r.get(key)), None)
    if row is None:
        return None
    s = row[key]
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})" if len(s["values"]) > 1 else f"{s['median']:.2f}x"


def _serving_peer_line(record: dict) -> str:
    """Our compiled server against each other server of a serving record, by concurrency (paired medians)."""
    parts = []
    for system in dict.fromkeys(r["system"] for r in record["rows"] if r["compiled_ratio"]):
        rows = [r for r in record["rows"] if r["system"] == system and r["compiled_ratio"]]
        parts.append(f"{system}: " +
                     ", ".join(f"{r['concurrency']}: {r['compiled_ratio']['median']:.2f}x" for r in rows))
    return f"| HTTP, ours compiled / each server by concurrency, {record['config']['dtype']} | {'; '.join(parts)} |"


def render_headline(records: Dict[str, dict]) -> str:
    """The ratios the issue's targets name, each from its record (medians and ranges of paired rounds)."""
    lines = ["| measurement | this record |", "|---|---|"]
    t = records.get("throughput")
    if t:
        rows = [r for r in t["rows"] if r["kind"] == "equal-precision"]
        parts = [f"{r['label']} {_ratio(rows, r['system'])}" for r in rows if r["system"] != "paged" and r["ratio"]]
        lines.append(f"| output tokens/s, paged / system at equal KV ({t['kv_mib']:.1f} MiB) | {'; '.join(parts)} |")
        compiled = [f"{r['label']} {_ratio(rows, r['system'], 'compiled_ratio')}" for r in rows
                    if r.get("compiled_ratio")]
        if compiled:
            lines.append(f"| output tokens/s, paged compiled / system at equal KV | {'; '.join(compiled)} |")
        paged = next((r for r in rows if r["system"] == "paged"), None)
        if paged:
            recomputed = paged["recomputed_tokens"]
            text = "missing from the engine's stats" if recomputed is None else \
                f"{recomputed} ({100 * paged['recomputed_share_of_trace_tokens']:.1f}% of the trace's tokens)"
            lines.append(f"| paged: preemptions / recomputed tokens | {paged['preemptions']} / {text} |")
    s = records.get("serving")
    if s:
        per = [r for r in s["rows"] if r["system"] == "hf-serve" and r["paged_ratio"]]
        if per:
            text = ", ".join(f"{r['concurrency']}: {r['paged_ratio']['median']:.2f}x" for r in per)
            lines.append(f"| HTTP under guidellm, ours / transformers serve by concurrency | {text} |")
    lines += [_serving_peer_line(records[name]) for name in ("serving", "serving-half") if name in records]
    w = records.get("waste")
    if w:
        shares = {f"{r['system']}/{r['allocator']}": r["memory"]["shares"]["token_states"] for r in w["runs"]}
        lines.append("| KV memory holding token states (waste) | " +
                     ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()) + " |")
    o = records.get("overhead")
    if o:
        lines.append("| step time outside the model forward (overhead) | " +
                     ", ".join(f"{r['running']} sequences {100 * r['outside_forward_share']:.1f}%" for r in o["runs"]) +
                     " |")
    st = records.get("structured")
    if st:
        row = next((r for r in st["rows"] if r["system"] == "json-schema" and r["ratio"]), None)
        if row:
            c = st["config"]
            lines.append(f"| output tokens/s, {c['num_requests']} JSON-schema requests / the same unconstrained | "
                         f"{_ratio([row], 'json-schema')} |")
    if len(lines) == 2:
        return "*No benchmark records at this commit yet: `make bench` writes them.*\n"
    return "\n".join(lines) + "\n"


RENDERERS: Dict[str, Callable[[str, dict], str]] = {"record": render_record, "table": render_table,
                                                    "plot": render_plot}


def render(text: str, records: Dict[str, dict]) -> tuple:
    """The doc with every generated block rewritten; and the problems met (unknown blocks, mixed commits)."""
    problems: List[str] = []

    def block(match: re.Match) -> str:
        kind, name = match.group(2), match.group(3)
        if kind == "headline":
            body = render_headline(records)
        elif kind == "before" and name in names():
            before = records.get(f"{name}:before")
            body = render_record(name, before) + "\n" + render_table(name, before) if before else \
                f"*No record of {name} before the change (docs/measurements/{name}-before.json).*\n"
        elif kind in RENDERERS and name in names():
            body = RENDERERS[kind](name, records[name]) if name in records else _missing(name)
        else:
            problems.append(f"unknown generated block {kind!r} {name!r}")
            body = match.group(4)
        return match.group(1) + body + match.group(5)

    out = BLOCK.sub(block, text)
    from paged_backend.benchmarks.cli import BENCHMARKS

    commits = {r.get("conditions", {}).get("git", {}).get("commit") for n, r in records.items() if n in BENCHMARKS}
    if len(commits) > 1:
        problems.append(f"the records come from {len(commits)} different commits; rerun `make bench` at one commit")
    return out, problems


def regenerate(docs_dir: Path, plot: bool = True) -> List[str]:
    """Rewrite docs/benchmarks.md's generated blocks and redraw each recorded benchmark's plot."""
    from paged_backend.benchmarks.cli import record_paths, spec_of

    records = load_records(docs_dir)
    if plot:
        for name, record in records.items():
            if ":" not in name and spec_of(name).plot:   # "NAME:before" records are shown, never plotted
                spec_of(name).plot_function()(record, record_paths(name, docs_dir)[1])
    doc = docs_dir / "benchmarks.md"
    text, problems = render(doc.read_text(), records)
    doc.write_text(text)
    return problems
