"""The commands README.md and docs/*.md show a reader, read from the Markdown itself.

A command is a `make TARGET ...` or a command line that runs `paged-backend` (directly, or through `torchrun`),
found in a shell code block (fenced with no language or bash/sh/shell/console, or indented by four spaces)
or in an inline code span (prose and tables). Output blocks (```text, ```python, ...) hold no commands.
Lines continued with a backslash are joined and shell comments are dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")  # a fence may be indented (inside a list item)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


@dataclass(frozen=True)
class Documented:
    """A command as the docs show it, and the first place that shows it."""

    text: str
    where: str


def documentation_files(root: Path = ROOT) -> List[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def is_command(text: str) -> bool:
    """A `make` line, or a command line whose program (or torchrun's program) is paged-backend."""
    words = text.split()
    if not words:
        return False
    if words[0] == "make":
        return len(words) > 1 and re.fullmatch(r"[a-z][a-z-]*", words[1]) is not None
    if words[0] == "paged-backend":
        return len(words) > 1           # the program's name alone is not a command
    return words[0] == "torchrun" and any(
        w in ("paged-backend", "$(which paged-backend)") for w in _program_words(text))


def _program_words(text: str) -> List[str]:
    return [w for w in re.split(r"\s+(?![^(]*\))", text) if w]


def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line).rstrip()


def _shell_lines(lines: List[str]) -> Iterator[str]:
    """Logical lines of a shell block: backslash continuations joined, comments and prompts dropped."""
    pending = ""
    for raw in lines:
        line = _strip_comment(raw.strip())
        line = line[2:] if line.startswith("$ ") else line
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield " ".join((pending + line).split())
        pending = ""
    if pending:
        yield " ".join(pending.split())


def _blocks(text: str) -> Iterator[tuple]:
    """(kind, lines, first line number) of each part of a Markdown file: 'shell', 'other' (code of another
    language) or 'prose'."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence:
            indent = len(fence.group(1))
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
            kind = "shell" if fence.group(2).lower() in SHELL_LANGUAGES else "other"
            yield kind, [line[indent:] for line in lines[i + 1:end]], i + 2
            i = end + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()) and lines[i].strip():
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            yield "shell", [line[4:] for line in lines[i:end]], i + 1
            i = end
            continue
        yield "prose", [lines[i]], i + 1
        i += 1


def documented_commands(root: Path = ROOT) -> Dict[str, Documented]:
    """Every command the README and the docs show, keyed by its text (whitespace collapsed), first place first."""
    found: Dict[str, Documented] = {}
    for path in documentation_files(root):
        for kind, lines, first in _blocks(path.read_text()):
            if kind == "shell":
                candidates = [(line, first) for line in _shell_lines(lines)]
            elif kind == "prose":
                candidates = [(" ".join(span.split()), first) for span in INLINE.findall(lines[0])]
            else:
                candidates = []
            for command, line_no in candidates:
                if is_command(command):
                    found.setdefault(command, Documented(command, f"{path.relative_to(root)}:{line_no}"))
    return found
