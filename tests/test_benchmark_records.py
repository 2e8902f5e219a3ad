"""docs/benchmarks.md holds no figure without a record: every table and result block sits in a generated block,
each generated block's record exists and names its commit, machine and versions, and the page is exactly what
its records generate; the records under docs/measurements/ name their commit, machine and versions too."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from paged_backend.benchmarks.cli import record_paths
from paged_backend.benchmarks.harness.docgen import BLOCK, load_records, render

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = DOCS / "benchmarks.md"


def _blocks(text: str) -> list:
    return [(m.start(), m.end(), m.group(2), m.group(3)) for m in BLOCK.finditer(text)]


def _figure_lines(text: str) -> list:
    """(offset, line) of every Markdown table row and every line of a fenced block that is not shell commands."""
    found, offset, fence = [], 0, None
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif (fence is not None and fence not in ("bash", "sh")) or (fence is None and line.startswith("|")):
            found.append((offset, line.rstrip()))
        offset += len(line)
    return found


def test_every_figure_of_the_page_is_in_a_generated_block():
    text = PAGE.read_text()
    spans = [(start, end) for start, end, _, _ in _blocks(text)]
    loose = [line for offset, line in _figure_lines(text) if not any(a <= offset < b for a, b in spans)]
    assert not loose, "figures written by hand (put them in a generated block fed by a record):\n" + "\n".join(loose)


def _provenance_problems(where: str, conditions: dict) -> list:
    git, machine, versions = conditions.get("git") or {}, conditions.get("machine") or {}, conditions.get("versions") or {}
    problems = []
    if not re.fullmatch(r"[0-9a-f]{40}", git.get("commit") or ""):
        problems.append(f"{where}: no commit")
    if not machine:
        problems.append(f"{where}: no machine")
    if not (versions.get("python") and versions.get("torch")):
        problems.append(f"{where}: no versions")
    return problems


def test_every_generated_block_has_a_record_with_commit_machine_and_versions():
    problems = []
    for _, _, kind, name in _blocks(PAGE.read_text()):
        if kind == "headline":
            continue
        path = record_paths(name, DOCS)[0]
        if not path.is_file():
            problems.append(f"{kind} {name}: no record at {path}")
            continue
        problems += _provenance_problems(f"{kind} {name}", json.loads(path.read_text()).get("conditions", {}))
    assert not problems, problems


def test_the_page_is_what_its_records_generate():
    text = PAGE.read_text()
    generated, problems = render(text, load_records(DOCS))
    assert problems == []
    assert generated == text, "docs/benchmarks.md differs from its records: run `paged-backend bench docs`"


@pytest.mark.parametrize("path", sorted((DOCS / "measurements").iterdir()), ids=lambda p: p.name)
def test_every_measurement_record_names_its_commit_machine_and_versions(path):
    if path.suffix == ".json":
        assert _provenance_problems(path.name, json.loads(path.read_text()).get("conditions", {})) == []
    else:
        head = path.read_text()[:2000]
        assert re.search(r"commit `?[0-9a-f]{7,40}", head) and "machine" in head and "torch" in head, path.name


def test_a_page_with_a_before_record_regenerates_with_its_plots(tmp_path):
    """`bench NAME --documented` redraws every recorded benchmark's plot: a NAME-before.json record (the same
    measurement before a change) is shown in the page and has no plot of its own to draw."""
    from paged_backend.benchmarks.harness.docgen import regenerate

    (tmp_path / "measurements").mkdir()
    for name in ("host-overhead.json", "host-overhead-before.json"):
        shutil.copy(DOCS / "measurements" / name, tmp_path / "measurements" / name)
    (tmp_path / "benchmarks.md").write_text("<!-- generated: before host-overhead -->\n<!-- end generated -->\n")
    regenerate(tmp_path, plot=True)
    assert "ready: step ms" in (tmp_path / "benchmarks.md").read_text()
