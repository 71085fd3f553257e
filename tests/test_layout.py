"""The tree's rules, checked by path: what may import what, and no import cycles.

`launcher/` (vlaunch.launcher) imports only `cache/contract/` (vlaunch.cache.contract), at any
depth (function-level imports count): the launcher must start fast and never load torch.
The contract imports nothing else of vlaunch; nothing in `cache/` imports the launcher.
The supervisor's core (`launcher/core/`, the events it speaks included: core/events.py) stays
pure: data types from the standard library, the events, the exit statuses; no I/O, no clock,
no os.
No import cycle, `TYPE_CHECKING` imports included; the rank side (`cache/rank/`) never
imports the engine's client (`cache/client/`). The engine's client (`cache/client/`) takes
what a call is about as one value (`Target`): its public functions take a handful of
parameters. Every VLAUNCH_* variable is read in one module, contract/settings.py.
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

PURE = (ROOT / "launcher" / "core",)
"""The supervisor's pure state machine and its vocabulary (core/events.py)."""
PURE_STDLIB = {"__future__", "collections.abc", "dataclasses", "enum", "math", "signal", "types",
               "typing"}
"""Standard-library modules the core may import (`signal` for its numbers and names only)."""
PURE_VLAUNCH = ("vlaunch.launcher.core", "vlaunch.cache.contract.exitcodes")
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
def imports(path: Path, module: str, typing_too: bool = False) -> frozenset[str]:
    """Every vlaunch module `path` imports, at any depth, except under `if TYPE_CHECKING:`
    (unless `typing_too`)."""
    tree = parsed(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    skip = set() if typing_too else {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
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
    """Module -> the vlaunch modules it imports, `TYPE_CHECKING` imports included (a package
    import counts as its __init__)."""
    return {name: {m for m in imports(path, name, True) if m in MODULES and m != name}
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


def test_the_rank_side_never_imports_the_engines_client() -> None:
    """A cache rank serves engines; when it is a client itself (seeding from another rank) it
    speaks the protocol through contract/connection.py and asks as every client does
    (client/requests.py, which imports nothing else of the client), not through the engine's
    CacheClient."""
    shared = "vlaunch.cache.client.requests"
    found = {name: sorted(m for m in imports(path, name, True)
                          if m.startswith("vlaunch.cache.client") and m != shared)
             for name, path in sources() if name.startswith("vlaunch.cache.rank")}
    assert len(found) > 5, found
    assert not {k: v for k, v in found.items() if v}, found
    path = dict(sources())[shared]
    assert not [m for m in imports(path, shared, True) if m.startswith("vlaunch.cache.client")]


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


HANDFUL = 8
"""Most parameters a public function of the engine's client takes (`**kwargs` counts one):
what a call is about travels as one Target, not as loose arguments (load and hand_back take
the Target and five or six options; publish its tensors and seven)."""


def test_the_clients_public_functions_take_a_handful_of_parameters() -> None:
    long = {}
    for name, path in sources():
        if not name.startswith("vlaunch.cache.client"):
            continue
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not \
                    node.name.startswith("_"):
                a = node.args
                count = len([x for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                             if x.arg not in ("self", "cls")]) + bool(a.vararg) + bool(a.kwarg)
                if count > HANDFUL:
                    long[f"{name}.{node.name}"] = count
    assert not long, f"public client functions with more than {HANDFUL} parameters: {long}"


SETTINGS = ROOT / "cache" / "contract" / "settings.py"
ENV_READS = {"get", "getenv", "setdefault"}


def _constants() -> dict[str, str]:
    """Module-level string constants of the tree, by name (NAME = "VLAUNCH_..." and such)."""
    out = {}
    for _, path in sources():
        for node in parsed(path).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                    isinstance(node.value.value, str):
                out.update({t.id: node.value.value for t in node.targets
                            if isinstance(t, ast.Name)})
    return out


def environment_reads(tree: ast.Module, constants: dict[str, str]) -> Iterator[tuple[int, str]]:
    """(line, name) of each VLAUNCH_* variable `tree` reads other than through the registry:
    `.get`/`getenv`/`setdefault` of a mapping, a subscript, an `in` test, by a literal, an
    f-string or a constant that holds one."""

    def named(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name | ast.Attribute):
            return constants.get(node.id if isinstance(node, ast.Name) else node.attr, "")
        if isinstance(node, ast.JoinedStr) and node.values and \
                isinstance(node.values[0], ast.Constant):
            return f"{node.values[0].value}*"
        return ""

    for node in ast.walk(tree):
        key: ast.AST | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            through = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                func.value.id == "settings"
            key = node.args[0] if attr in ENV_READS and not through else None
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(o, ast.In | ast.NotIn)
                                                   for o in node.ops):
            key = node.left
        name = named(key) if key is not None else ""
        if name.startswith("VLAUNCH_"):
            yield node.lineno, name


PENDING_READS: set[str] = set()
"""Modules whose VLAUNCH_* reads have not moved to the registry yet: none may be added."""


def test_every_vlaunch_variable_is_read_through_the_settings_registry() -> None:
    """One configuration surface: a module asks contract/settings.py (`settings.get`), which
    knows each variable's type, default and meaning; click reads the options' variables."""
    constants = {**_constants(), "KNOB_ENV": "VLAUNCH_KNOB"}
    probe = ast.parse('os.environ.get("VLAUNCH_A")\nos.getenv(KNOB_ENV, "")\n'
                      'env["VLAUNCH_B"]\nf"VLAUNCH_{x}" in env\nsettings.get("VLAUNCH_C")\n'
                      'os.environ["VLAUNCH_D"] = "1"\n')
    assert [n for _, n in environment_reads(probe, constants)] == [
        "VLAUNCH_A", "VLAUNCH_KNOB", "VLAUNCH_B", "VLAUNCH_*"]  # the scan sees every form
    found = [f"{path.relative_to(ROOT)}:{line} {name}" for _, path in sources()
             if path != SETTINGS for line, name in environment_reads(parsed(path), constants)]
    pending = {f.split(":")[0] for f in found} & PENDING_READS
    assert pending == PENDING_READS, f"no longer pending: {PENDING_READS - pending}"
    found = [f for f in found if f.split(":")[0] not in PENDING_READS]
    assert not found, ("read VLAUNCH_* variables through vlaunch.cache.contract.settings "
                       f"(register them there): {found}")


def test_every_vlaunch_name_the_code_holds_is_a_setting_or_an_option() -> None:
    """A variable the code sets for a child or names in a table is registered too."""
    from vlaunch.cache.contract.settings import REGISTRY
    from vlaunch.launcher.cli import cli

    options: set[str] = set()
    commands = [cli]
    while commands:
        command = commands.pop()
        options |= {p.envvar for p in command.params if isinstance(p.envvar, str)}
        commands += list(getattr(command, "commands", {}).values())
    pattern = __import__("re").compile(r"VLAUNCH_[A-Z0-9_]+")
    held = {(node.value, f"{path.relative_to(ROOT)}:{node.lineno}") for _, path in sources()
            for node in ast.walk(parsed(path)) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and pattern.fullmatch(node.value)}
    unknown = sorted(where for name, where in held if name not in REGISTRY | dict.fromkeys(
        options))
    assert len(held) > 5, held
    assert not unknown, f"register these VLAUNCH_* names in contract/settings.py: {unknown}"
