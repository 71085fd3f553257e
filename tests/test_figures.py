"""Measured figures: README and docs quote benchmarks/results/summary.json, nothing typed by hand.

`benchmarks/figures.py` writes every figure span (`<!-- fig ID -->...<!-- /fig -->`) of
README.md and docs/*.md and the README's Measured section (benchmarks/measured.md with its
`{{ID}}` placeholders filled in); these tests fail when a page is stale, names an id the summary
lacks, or types a measured figure outside a span.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _module(name: str):
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


figures = _module("figures")

# a number with a unit of time, rate, ratio or memory: what a measurement reads like
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?"
                      r"\s?(?:ms|µs|s|GB/s|TB/s|x|×|%|MiB|GiB)(?![\w/])")
# what a page may type: targets, the settings a run used, the (power-of-two) sizes it ran on
SETTINGS = re.compile(r"target \d+(?:\.\d+)? ?(?:s|%)|(?:watchdog|unhealthy-after|timeout|of) "
                      r"\(?\d+ s|\(2 s\)|\d+ s after its last ping|\d+ s \+ \d+ s|"
                      r"detection \+ 0\.1 s|"
                      r"(?<![\d.])(?:1|2|4|8|16|32|64|128|256|512) (?:KiB|MiB|GiB)\b")


def test_every_quoted_figure_is_the_summarys() -> None:
    assert figures.stale(figures.load()) == []


def test_every_figure_names_its_machine_date_and_a_results_file() -> None:
    for fid, entry in figures.load().items():
        assert set(figures.FIELDS) <= set(entry) <= {*figures.FIELDS, *figures.DERIVED}, fid
        name = entry["source"].split(":")[0]
        assert (RESULTS / name).is_file(), f"{fid}: source {name} is not in benchmarks/results/"


def test_quoted_ids_exist_and_the_readme_section_is_generated() -> None:
    known = set(figures.load())
    assert figures.quoted_ids() <= known, figures.quoted_ids() - known
    readme = (ROOT / "README.md").read_text()
    assert figures.BEGIN in readme and figures.END in readme
    # at least the headline figures the issue found contradicted are quoted from the summary
    for fid in ("standby.gpu.tp1.cold", "seed.gpu.tcp.ratio", "seed.cpu.engines.vlaunch",
                "hang.gpu.detected", "copy.before_pieces", "standby.cpu.tp2.warm",
                "layout.engine_mib"):
        assert fid in figures.quoted_ids(), fid


def test_the_measured_template_types_no_figure() -> None:
    text = figures.PLACEHOLDER.sub("", figures.TEMPLATE.read_text())
    text = SETTINGS.sub("", re.sub(r"\s+", " ", text))
    assert MEASURED.findall(text) == []


def test_no_figure_outside_a_span_where_a_page_says_it_was_measured() -> None:
    """A sentence of README or docs that says a figure was measured (on an H200, on the CPU
    machine) carries its figures in spans. The changelog is history; example output
    (fenced blocks) is not a claim."""
    found = []
    for path in figures.pages():
        if path.name == "changelog.md":
            continue
        text = path.read_text()
        if path.name == "README.md":
            text = text.split(figures.BEGIN)[0] + text.split(figures.END)[1]
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        text = figures.SPAN.sub("", text)
        for para in re.split(r"\n\s*\n|\n(?=[-|] )", text):
            flat = re.sub(r"\s+", " ", para)
            if re.search(r"\b[Mm]easured\b|H200|2-core", flat):
                for hit in MEASURED.findall(SETTINGS.sub("", flat)):
                    found.append(f"{path.name}: {hit!r} in {flat[:90]!r}")
    assert found == []


def test_a_stale_or_unknown_span_is_caught() -> None:
    summary = {"a.b": {"value": "1.0 s", "machine": "H200", "date": "2026-12-01",
                       "source": "x.md"}}
    assert figures.render_spans("x <!-- fig a.b -->0.9 s<!-- /fig --> y", summary, "p") == \
        "x <!-- fig a.b -->1.0 s<!-- /fig --> y"
    with pytest.raises(figures.FigureError, match="unknown figure id 'c'"):
        figures.render_spans("<!-- fig c -->1<!-- /fig -->", summary, "p")
    with pytest.raises(figures.FigureError, match="unknown figure id 'c'"):
        figures.render_measured(summary, "{{a.b}} and {{c}}")
    assert "1.0 s and" in figures.render_measured(summary, "{{a.b}} and")
    runs = {**summary, "a.c": {**summary["a.b"], "value": "1.24 s"},
            "a": {**summary["a.b"], "value": "1.0 s", "range_of": ["a.b", "a.c"], "digits": 1}}
    assert figures.derived(runs) == {"a": "1.0-1.2 s"}
    runs["a.c"]["value"] = "1.04 s"
    assert figures.derived(runs) == {"a": "1.0 s"}


def test_record_figures_merges_into_a_summary(tmp_path: Path, monkeypatch) -> None:
    benchlib = _module("benchlib")
    monkeypatch.delenv("RECORD_FIGURES", raising=False)
    assert benchlib.record_figures({"x.y": "1 s"}, machine="m", source="s.md") is None
    out = tmp_path / "summary.json"
    benchlib.record_figures({"x.y": "1 s"}, machine="m", source="s.md", path=out,
                            date="2026-12-02")
    monkeypatch.setenv("RECORD_FIGURES", str(out))
    benchlib.record_figures({"x.z": "2 s"}, machine="m", source="s.md", date="2026-12-02")
    got = json.loads(out.read_text())["figures"]
    assert got == {"x.y": {"value": "1 s", "machine": "m", "date": "2026-12-02", "source": "s.md"},
                   "x.z": {"value": "2 s", "machine": "m", "date": "2026-12-02", "source": "s.md"}}
    into = {"x.y": {"value": "0 s", "machine": "m", "date": "d", "source": "s.md"}}
    assert figures.merge(into, got) == ["x.y", "x.z"] and into["x.y"]["value"] == "1 s"


def test_a_gpu_run_is_printed_against_the_committed_figures() -> None:
    """gpu_lib.sh's compare_figures: a time that grew or a rate that fell by over 20% is
    flagged; a figure within 20%, a count and a new id are printed without a flag."""
    ours = {"a.time": {"value": "0.100 s", "date": "2026-12-01"},
            "b.ms": {"value": "10.0 ms", "date": "2026-12-01"},
            "c.rate": {"value": "50 GB/s", "date": "2026-12-01"},
            "d.count": {"value": "0", "date": "2026-12-01"}}
    new = {"a.time": {"value": "0.130 s"}, "b.ms": {"value": "0.011 s"},
           "c.rate": {"value": "30 GB/s"}, "d.count": {"value": "3"}, "e.new": {"value": "1 s"}}
    lines = {line.split()[0]: line for line in figures.compare(ours, new)}
    assert "REGRESSION?" in lines["a.time"] and "x1.30" in lines["a.time"]
    assert "REGRESSION?" not in lines["b.ms"] and "x1.10" in lines["b.ms"]  # 10 ms -> 11 ms
    assert "REGRESSION?" in lines["c.rate"]
    assert "(new)" in lines["e.new"] and "REGRESSION?" not in lines["d.count"]
