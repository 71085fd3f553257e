"""The troubleshooting entries: what a log line means and what to do (`vlaunch troubleshoot`).

One source, two views: troubleshooting.toml (next to this module, shipped with the package)
holds every entry, keyed on the message as the code writes it; `vlaunch troubleshoot LINE`
looks a line up (an operator in a container, without the docs), and `--markdown` renders
docs/troubleshooting.md's tables (tests/test_docs.py keeps the page equal to it, and every
user-facing message in the code equal to an entry, both ways).

A message cell lists one message or several (`a`, `b`); the code spans of one message are
its literal runs in order, the placeholders between them written `…` (`cache rank` …
`exited`). A line matches a message when it holds every run, in that order.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from importlib import resources
from typing import Any, NamedTuple

import tomllib

from vlaunch.cache.contract.exitcodes import ExitStatus

SOURCE = "troubleshooting.toml"
LOOKED_UP = ("Message", "Symptom")  # the tables whose first column a line can match
_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_EXIT = re.compile(r"\bexit (\d+)\b")


@functools.cache
def sections() -> tuple[dict[str, Any], ...]:
    """The entries, by section, as troubleshooting.toml holds them."""
    text = resources.files("vlaunch.launcher").joinpath(SOURCE).read_text(encoding="utf-8")
    return tuple(tomllib.loads(text)["section"])


def _key(column: str) -> str:
    return column.lower().replace(" ", "_")


def markdown() -> str:
    """docs/troubleshooting.md's part after its introduction."""
    out: list[str] = []
    for section in sections():
        out += [f"{'#' * section.get('level', 2)} {section['title']}", ""]
        if section.get("text"):
            out += [section["text"], ""]
        for table in section.get("table", ()):
            if table.get("intro"):
                out += [table["intro"], ""]
            columns = table["columns"]
            out.append("| " + " | ".join(columns) + " |")
            out.append("| " + " | ".join("---" for _ in columns) + " |")
            out += ["| " + " | ".join(row[_key(c)] for c in columns) + " |"
                    for row in table.get("row", ())]
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def messages(cell: str) -> list[list[str]]:
    """The messages of a first-column cell, each as its literal runs in order."""
    found: list[list[str]] = [[]]
    end = 0
    for span in _SPAN.finditer(cell):
        if found[-1] and "," in cell[end:span.start()] and "…" not in cell[end:span.start()]:
            found.append([])
        found[-1].append(span.group(1))
        end = span.end()
    return [m for m in found if m]


def _holds(line: str, runs: list[str]) -> bool:
    at = 0
    for run in runs:
        at = line.find(run, at)
        if at < 0:
            return False
        at += len(run)
    return True


def entries() -> Iterator[tuple[str, dict[str, str], list[str]]]:
    """(section title, row, its columns) for every entry of a Message or Symptom table (the
    others, e.g. the fingerprint's fields, explain an entry; a line cannot match them)."""
    for section in sections():
        for table in section.get("table", ()):
            if table["columns"][0] in LOOKED_UP:
                for row in table.get("row", ()):
                    yield section["title"], row, table["columns"]


class Found(NamedTuple):
    """An entry a line matched."""

    section: str
    row: dict[str, str]
    columns: list[str]
    message: str  # the message of the cell that matched, its runs joined by " … "
    line: str


def find(lines: Iterable[str]) -> list[Found]:
    """Each entry that one of `lines` matches, once, in the order first matched."""
    table = [(title, row, columns, messages(row[_key(columns[0])]))
             for title, row, columns in entries()]  # each cell parsed once, not once a line
    seen: set[int] = set()
    out = []
    for line in lines:
        for i, (title, row, columns, cell) in enumerate(table):
            if i in seen:
                continue
            for runs in cell:
                if _holds(line, runs):
                    seen.add(i)
                    out.append(Found(title, row, columns, " … ".join(runs), line.rstrip("\n")))
                    break
    return out


def describe(found: Found) -> list[str]:
    """A found entry as terminal lines."""
    out = [found.line.strip()[:300], f"  [{found.section}] {found.message}"]
    for column in found.columns[1:]:
        text = found.row[_key(column)]
        out.append(f"  {column.lower()}: "
                   + ("the message says it all" if text == "—" else plain(text)))
    return out


def plain(text: str) -> str:
    """Markdown of an entry as a terminal shows it: links as `text (docs/<page>.md#<anchor>)`."""
    def link(m: re.Match[str]) -> str:
        target = m.group(2)
        if not target.startswith(("http:", "https:")):
            target = "docs/" + ("troubleshooting.md" + target if target.startswith("#")
                                else target)
        return f"{m.group(1)} ({target})"

    def status(m: re.Match[str]) -> str:
        try:
            return f"{m.group(0)} ({ExitStatus(int(m.group(1))).name})"
        except ValueError:
            return m.group(0)

    return _EXIT.sub(status, _LINK.sub(link, text))
