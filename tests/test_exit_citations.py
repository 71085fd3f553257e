"""The exit statuses the docs cite are the registry's (cache/contract/exitcodes.py).

docs/exit-codes.md's table is `vlaunch exit-codes --markdown`'s output; every status cited on
any other page (`exit 85`, `85 SWAP_ROLLED_BACK`, `rolls back (85)`) is registered, carries
the registry's name where it names one, and its page links to the table.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from vlaunch.cache.contract.exitcodes import EXIT_TABLE, ExitStatus, markdown_table

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGISTERED = {int(i.status) for i in EXIT_TABLE}
# Statuses vlaunch does not produce but the docs explain (docs/exit-codes.md, "Other
# statuses" and "Engine statuses"): a broken install, a wrapper, click's abort, exec failures,
# deaths by signal as a shell reports them.
OTHER = {1, 2, 126, 127, 130, 137, 143}
# "exit 85", "exits with 69", "exit status 64", "status 87", "exits 131"
CITED = re.compile(r"\b(?:exit(?:s|ed)?(?: with)?(?: status)?|status(?:es)?)\s+"
                   r"`?(\d{1,3})\b(?![.,]\d|\s*(?:%|ms|s\b|GB|GiB|MB|MiB|x\b))")
# "85 `SWAP_ROLLED_BACK`", "(85)", "85, 86 and 87"
NAMED = re.compile(r"\b(\d{1,3}) `?([A-Z][A-Z_]{3,})`?")
PAREN = re.compile(r"\((\d{2,3})\)")


def _prose(page: Path) -> str:
    """The page without fenced code blocks (commands and outputs cite their own numbers)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def test_the_table_is_the_registry() -> None:
    text = (ROOT / "docs" / "exit-codes.md").read_text()
    block = re.search(r"<!-- generated: vlaunch exit-codes --markdown -->\n\n(.*?)\n\n"
                      r"<!-- /generated -->", text, re.S)
    assert block, "docs/exit-codes.md lost its generated table's markers"
    assert block.group(1) == markdown_table(), \
        "docs/exit-codes.md is stale: paste `vlaunch exit-codes --markdown` between the markers"
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "exit-codes",
                        "--markdown"], capture_output=True, text=True, timeout=30, check=True)
    assert r.stdout.strip() == markdown_table()
    assert all(i.todo for i in EXIT_TABLE), "every status says what to do"


def test_every_cited_status_is_registered_and_named_as_registered() -> None:
    wrong: list[str] = []
    for page in PAGES:
        text = _prose(page)
        for n, line in ((int(m.group(1)), m.group(0)) for m in CITED.finditer(text)):
            if n not in REGISTERED | OTHER:
                wrong.append(f"{page.name}: {line!r}: {n} is not a registered status")
        for m in PAREN.finditer(text):
            if 64 <= int(m.group(1)) < 126 and int(m.group(1)) not in REGISTERED:
                wrong.append(f"{page.name}: {m.group(0)!r} is not a registered status")
        for m in NAMED.finditer(text):
            n, name = int(m.group(1)), m.group(2)
            if n in REGISTERED and name in ExitStatus.__members__ and ExitStatus(n).name != name:
                wrong.append(f"{page.name}: {m.group(0)!r}: {n} is {ExitStatus(n).name}")
            if name in ExitStatus.__members__ and int(ExitStatus[name]) != n and n >= 64:
                wrong.append(f"{page.name}: {m.group(0)!r}: {name} is {int(ExitStatus[name])}")
    assert not wrong, "\n".join(wrong)


def test_pages_that_cite_statuses_link_to_the_table() -> None:
    unlinked = []
    for page in PAGES:
        if page.name in ("exit-codes.md", "changelog.md"):
            continue
        text = _prose(page)
        cites = any(int(m.group(1)) in REGISTERED - {0} for m in CITED.finditer(text))
        cites |= any(int(m.group(1)) in REGISTERED - {0} for m in PAREN.finditer(text))
        if cites and "exit-codes.md" not in text:
            unlinked.append(page.name)
    assert not unlinked, f"cite exit statuses without linking to docs/exit-codes.md: {unlinked}"
