"""The tree's rules, checked by path: what may import what, and no import cycles.

`launcher/` (vlaunch.launcher) imports only `cache/contract/` (vlaunch.cache.contract), at any
depth (function-level imports count): the launcher must start fast and never load torch.
The contract imports nothing else of vlaunch; nothing in `cache/` imports the launcher.
The supervisor's core (`launcher/core/`, and the events it speaks) stays pure: data types from
the standard library, the events, the exit statuses; no I/O, no clock, no os.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"launcher": "vlaunch.launcher", "cache": "vlaunch.cache"}
CONTRACT = "vlaunch.cache.contract"

PURE = (ROOT / "launcher" / "core", ROOT / "launcher" / "events.py")
"""The supervisor's pure state machine and its vocabulary."""
PURE_STDLIB = {"__future__", "collections.abc", "dataclasses", "enum", "math", "signal", "types",
               "typing"}
"""Standard-library modules the core may import (`signal` for its numbers and names only)."""
PURE_VLAUNCH = ("vlaunch.launcher.core", "vlaunch.launcher.events",
                "vlaunch.cache.contract.exitcodes")
IMPURE_BUILTINS = {"open", "print", "input", "exec", "eval", "compile", "__import__",
                   "breakpoint"}

LAUNCHER_EXCEPTIONS: dict[str, set[str]] = {
    # none: `vlaunch verify` execs vlaunch.cache.client.verify for its work
}


def module_name(path: Path) -> str:
    """The dotted module name of a file under launcher/ or cache/."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> Iterator[tuple[str, Path]]:
    """Every module of the two packages."""
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield module_name(path), path


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once per session."""
    return ast.parse(path.read_text(), str(path))


@functools.cache
def imports(path: Path, module: str) -> frozenset[str]:
    """Every vlaunch module `path` imports, at any depth, except under `if TYPE_CHECKING:`."""
    tree = parsed(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = {f"{base}.{a.name}" for a in node.names}
            known = {n for n in names if n in MODULES}  # `from pkg import module`
            out |= known or {base}
    return frozenset(name for name in out if name.startswith("vlaunch."))


MODULES = {name for name, _ in sources()}


def graph() -> dict[str, set[str]]:
    """Module -> the vlaunch modules it imports (a package import counts as its __init__)."""
    return {name: {m for m in imports(path, name) if m in MODULES and m != name}
            for name, path in sources()}


def test_the_launcher_imports_only_the_contract() -> None:
    bad = {}
    for name, path in sources():
        if not name.startswith("vlaunch.launcher"):
            continue
        allowed = LAUNCHER_EXCEPTIONS.get(name, set())
        wrong = {m for m in imports(path, name) if not m.startswith(("vlaunch.launcher", CONTRACT))
                 and m not in allowed}
        if wrong:
            bad[name] = sorted(wrong)
    assert not bad, f"launcher modules import beyond vlaunch.cache.contract: {bad}"


def test_the_exceptions_are_still_needed() -> None:
    """An exception that no longer applies goes, so that the rule only ever tightens."""
    for name, allowed in LAUNCHER_EXCEPTIONS.items():
        path = ROOT / "launcher" / f"{name.rsplit('.', 1)[1]}.py"
        assert allowed <= imports(path, name), f"{name} no longer imports all of {allowed}"


def test_the_contract_stands_alone_and_the_cache_never_imports_the_launcher() -> None:
    for name, path in sources():
        found = imports(path, name)
        if name.startswith(CONTRACT):
            assert all(m.startswith(CONTRACT) for m in found), (name, found)
        if name.startswith("vlaunch.cache"):
            assert not any(m.startswith("vlaunch.launcher") for m in found), (name, found)


def test_the_import_graph_has_no_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_launcher_process_loads_neither_torch_nor_the_rest_of_the_cache() -> None:
    code = ("import sys, vlaunch.launcher.cli, vlaunch.launcher.executor, "
            "vlaunch.launcher.options, vlaunch.launcher.status; "
            "mods = [m for m in sys.modules if m.startswith('vlaunch.cache.') and not "
            "m.startswith('vlaunch.cache.contract')]; print('torch' in sys.modules, mods)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=True)
    assert r.stdout.strip() == "False []", r.stdout


def test_no_module_imports_another_modules_private_names() -> None:
    """A helper used by two modules is public where it lives (no `from x import _y`)."""
    bad = []
    for top in ("cache", "launcher", "tests", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(parsed(path)):
                if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                        "vlaunch"):
                    continue
                if any(a.name.startswith("_") and not a.name.startswith("__")
                       for a in node.names):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"private names imported across modules: {bad}"


def pure_sources() -> Iterator[tuple[str, Path]]:
    """Every module of the supervisor's pure core."""
    for place in PURE:
        for path in sorted(place.rglob("*.py")) if place.is_dir() else [place]:
            yield module_name(path), path


def impurities(path: Path, module: str) -> Iterator[str]:
    """What in `path` is more than data and decisions: an import outside the allowed ones, a
    use of `signal` beyond its numbers and names, a builtin that does I/O or loads code."""
    for m in imports(path, module):
        if not m.startswith(PURE_VLAUNCH):
            yield f"imports {m}"
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            yield from (f"imports {a.name}" for a in node.names
                        if not a.name.startswith("vlaunch") and a.name not in PURE_STDLIB)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                not node.module.startswith("vlaunch"):
            if node.module not in PURE_STDLIB:
                yield f"imports {node.module}"
            elif node.module == "signal":
                yield from (f"signal.{a.name}" for a in node.names if not _signal_data(a.name))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "signal" and not _signal_data(node.attr):
            yield f"signal.{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in IMPURE_BUILTINS:
            yield f"calls {node.func.id}()"


def _signal_data(name: str) -> bool:
    """A signal number (SIGTERM) or the Signals enum: data, not a handler or a kill."""
    return name == "Signals" or (name.startswith("SIG") and name[3:].isalnum()
                                 and name[3:].isupper())


def test_the_supervisor_core_is_pure() -> None:
    """No I/O, no clock, no os in the core: time comes in events, effects go out as actions."""
    found = {name: sorted(set(impurities(path, name))) for name, path in pure_sources()}
    assert len(found) > 2, found  # the rule reads the package
    bad = {name: what for name, what in found.items() if what}
    assert not bad, f"the supervisor's core must stay pure: {bad}"
