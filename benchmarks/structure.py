#!/usr/bin/env python3
"""The tree's shape, read from its syntax: module sizes, parameter lists, VLAUNCH_* reads.

Architecture changes quote these figures before and after (benchmarks/results/structure.md):
the largest modules, the functions with the most parameters, the route one parameter takes
through the calls, every VLAUNCH_* variable with the places that read it, and the launcher
core's state: its fields and which modules write each (`--state` prints only that), and how a
cache rank's server and its parts reach into each other (`--rank`). The tree is
read as text, except for the variable table's option and field columns: a child process
imports the tree's click commands and its engine environment (nothing of them runs).

    python benchmarks/structure.py                     # all four tables
    python benchmarks/structure.py --repo /other/checkout --walk cache/client/loader.py:load:model
    python benchmarks/structure.py --state             # the core's state and its writers
    python benchmarks/structure.py --rank              # the rank's server and its parts
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

TOPS = ("cache", "launcher")
VAR = re.compile(r"VLAUNCH_[A-Z0-9_]+")
READERS = {"get", "getenv", "pop", "setdefault"}


def modules(repo: Path) -> Iterator[Path]:
    """Every Python file of the two packages."""
    for top in TOPS:
        yield from sorted((repo / top).rglob("*.py"))


def sizes(repo: Path, top: int) -> list[str]:
    """The largest modules, by lines."""
    counted = sorted(((len(p.read_text().splitlines()), p.relative_to(repo)) for p in
                      modules(repo)), reverse=True)
    total = sum(n for n, _ in counted)
    rows = [f"{n:5d}  {p}" for n, p in counted[:top]]
    return [f"{len(counted)} modules, {total} lines; the {top} largest:", *rows]


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's parameter names, without self and cls."""
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return [n for n in names if n not in ("self", "cls")]


def functions(repo: Path) -> Iterator[tuple[Path, str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(file, qualified name, node) of every function and method."""
    for path in modules(repo):
        tree = ast.parse(path.read_text(), str(path))
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield path, prefix + child.name, child
                    stack.append((child, f"{prefix}{child.name}."))
                elif isinstance(child, ast.ClassDef):
                    stack.append((child, f"{prefix}{child.name}."))


def longest(repo: Path, least: int) -> list[str]:
    """Functions with `least` parameters or more, longest first, and where they live."""
    found = sorted(((len(parameters(f)), str(p.relative_to(repo)), name)
                    for p, name, f in functions(repo) if len(parameters(f)) >= least),
                   key=lambda r: (-r[0], r[1], r[2]))
    where = Counter(p.split("/")[0] + "/" + p.split("/")[1] for _, p, _ in found)
    rows = [f"{n:3d}  {p}:{name}" for n, p, name in found]
    return [f"{len(found)} functions with {least} or more parameters "
            f"({', '.join(f'{k} {v}' for k, v in where.most_common())}):", *rows]


def typed_any(repo: Path) -> list[str]:
    """Per package, the share of parameters annotated `Any` (self and cls left out)."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path, _, node in functions(repo):
        a = node.args
        parts = path.relative_to(repo).parts
        where = "/".join(parts[:2]) if len(parts) > 2 else f"{parts[0]}/*.py"
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if arg.arg in ("self", "cls"):
                continue
            counts[where][0] += 1
            counts[where][1] += arg.annotation is not None and ast.unparse(arg.annotation) == "Any"
    rows = [f"  {k:22s} {n:4d} parameters, {a:3d} typed Any ({100 * a / n:.0f}%)"
            for k, (n, a) in sorted(counts.items()) if n]
    return ["parameters typed `Any`, per package:", *rows]


def environment_reads(repo: Path) -> dict[str, list[str]]:
    """VLAUNCH_* name -> where it is read: `file:line kind` (environ/getenv with a literal or
    a module-level constant, a click envvar=, a settings registry entry)."""
    out: dict[str, list[str]] = defaultdict(list)
    for path in modules(repo):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(repo)
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}

        def name_of(node: ast.AST, consts: dict[str, str] = consts) -> str:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.Name):
                return consts.get(node.id, "")
            if isinstance(node, ast.JoinedStr):  # f"VLAUNCH_{x}": the literal part
                return "".join(v.value for v in node.values if isinstance(v, ast.Constant)
                               and isinstance(v.value, str)) + "*"
            return ""

        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if attr in READERS and node.args and (env := name_of(node.args[0])):
                    kind = "read"
                elif attr in ("option", "SourceOption", "Option") or any(
                        k.arg == "envvar" for k in node.keywords):
                    env = next((name_of(k.value) for k in node.keywords if k.arg == "envvar"),
                               "")
                    kind = "cli option"
                else:
                    continue
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "environ" and isinstance(node.ctx, ast.Load):
                env, kind = name_of(node.slice), "read"
            else:
                continue
            if env.startswith("VLAUNCH_"):
                out[env].append(f"{rel}:{node.lineno} {kind}")
    return out


TABLES = r"""
import json, sys
import click
out = {"options": {}, "fields": {}, "settings": {}}
from vlaunch.launcher.cli import cli
def walk(cmd, path):
    for p in getattr(cmd, "params", []):
        names = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or [])
        for n in names:
            out["options"].setdefault(n, []).append(f"{path} {p.opts[0]}")
    for name, sub in getattr(cmd, "commands", {}).items():
        walk(sub, f"{path} {name}")
walk(cli, "vlaunch")
from vlaunch.cache.contract.engine_env import EngineEnv, env_name
out["fields"] = {env_name(f): f for f in EngineEnv._fields}
try:
    from vlaunch.cache.contract import settings
except ImportError:
    pass
else:
    out["settings"] = {s.name: s.kind for s in settings.REGISTRY.values()}
print(json.dumps(out))
"""


def tables(repo: Path) -> dict[str, dict[str, object]]:
    """The tree's option envvars, EngineEnv fields and registered settings (read by a child
    that imports the tree at `repo` as the vlaunch package)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vlaunch").mkdir()
        (Path(tmp) / "vlaunch" / "__init__.py").write_text("")
        for top in TOPS:
            (Path(tmp) / "vlaunch" / top).symlink_to(repo.resolve() / top)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLAUNCH_")},
               "PYTHONPATH": tmp}
        r = subprocess.run([sys.executable, "-c", TABLES], capture_output=True, text=True,
                           env=env, cwd=tmp, check=True, timeout=120)
    return json.loads(r.stdout)


def environment(repo: Path) -> list[str]:
    """The VLAUNCH_* table: every name, what defines it (an option of a command, a field of
    the engine's environment, a registered setting) and where a module reads it by name."""
    reads = environment_reads(repo)
    named = {n.value for p in modules(repo) for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and VAR.fullmatch(n.value)}
    known = tables(repo)
    options, fields, settings = known["options"], known["fields"], known["settings"]
    rows = []
    for name in sorted(n for n in named | set(reads) | set(options) | set(fields) | set(settings)
                       if "*" not in n):
        what = [*(f"option {o}" for o in options.get(name, [])),
                *([f"EngineEnv.{fields[name]}"] if name in fields else []),
                *([f"setting ({settings[name]})"] if name in settings else []),
                *(f"read {p.removesuffix(' read')}" for p in reads.get(name, [])
                  if p.endswith(" read"))]
        rows.append(f"{name:34s} {'; '.join(what) or 'named only'}")
    files = {p.split(":")[0] for v in reads.values() for p in v if p.endswith(" read")}
    adhoc = {n for n, v in reads.items() if any(p.endswith(" read") for p in v)}
    return [f"{len(rows)} VLAUNCH_* names: {len(options)} option variables, {len(fields)} "
            f"EngineEnv fields ({len(set(fields) & set(options))} also options), "
            f"{len(settings)} registered settings; {len(adhoc)} read by name in {len(files)} "
            "files:", *rows]


def walk(repo: Path, start: str, stops: int = 60) -> list[str]:
    """Follow a parameter from `file:function:param` through the calls that pass it on, by
    name (a call whose argument is the parameter itself, to a function of the tree with that
    name): each step with its module, and how often the route comes back to a module."""
    file, func, param = start.split(":")
    table: dict[str, list[tuple[Path, str, ast.FunctionDef | ast.AsyncFunctionDef]]] = \
        defaultdict(list)
    for p, name, node in functions(repo):
        table[name.rsplit(".", 1)[-1]].append((p, name, node))
    here = next(x for x in table[func.rsplit(".", 1)[-1]]
                if x[0] == repo / file and x[1] == func)
    route: list[tuple[str, str, str]] = []
    seen: set[tuple[str, str]] = set()

    def visit(path: Path, qual: str, node: ast.AST, name: str) -> None:
        if len(route) >= stops or (str(path), qual) in seen:
            return
        seen.add((str(path), qual))
        route.append((str(path.relative_to(repo)), qual, name))
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            callee = call.func.attr if isinstance(call.func, ast.Attribute) else \
                getattr(call.func, "id", "")
            targets = table.get(callee, [])
            if len(targets) != 1:
                continue  # unknown, or one name several functions bear
            tpath, tqual, tnode = targets[0]
            params = parameters(tnode)
            bound = ""
            for i, arg in enumerate(call.args):
                if isinstance(arg, ast.Name) and arg.id == name and i < len(params):
                    bound = params[i]
            for k in call.keywords:
                if isinstance(k.value, ast.Name) and k.value.id == name and k.arg:
                    bound = k.arg
            if bound:
                visit(tpath, tqual, tnode, bound)

    visit(*here, param)
    rows, last, left, back = [], "", set(), 0
    for mod, qual, name in route:
        again = mod in left and mod != last
        back += again
        if last and mod != last:
            left.add(last)
        last = mod
        rows.append(f"  {mod}:{qual} as {name}{'   (back again)' if again else ''}")
    mods = {m for m, _, _ in route}
    return [f"`{param}` from {file}:{func}: {len(route)} functions in {len(mods)} modules, "
            f"{back} returns to a module it had left:", *rows]


CORE = Path("launcher/core")
STATE = CORE / "state.py"
MUTATORS = {"add", "discard", "pop", "clear", "update", "setdefault", "remove", "append",
            "reset", "count"}
"""Methods that change the object they are called on (set, dict, RestartBudget)."""


def state_fields(repo: Path) -> list[str]:
    """The fields `SupervisorState.__init__` gives the state (`self.x = ...`)."""
    tree = ast.parse((repo / STATE).read_text())
    init = next(n for c in tree.body if isinstance(c, ast.ClassDef)
                and c.name == "SupervisorState" for n in c.body
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [t.attr for n in ast.walk(init) if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"]


def _chain(node: ast.AST) -> list[str]:
    """`self._x.y[k].z` as ["self", "_x", "y", "z"] (empty when it starts with no name)."""
    names: list[str] = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            names.insert(0, node.attr)
        node = node.value
    return [node.id, *names] if isinstance(node, ast.Name) else []


def _written(node: ast.AST, aliases: dict[str, str]) -> Iterator[str]:
    """The state paths an assignment target writes: `_x` (the field itself, an item of it)
    or `_x.y` (a field of the record `_x`), also through a local name bound to `self._x`."""
    if isinstance(node, ast.Tuple | ast.List | ast.Starred):
        for elt in node.elts if not isinstance(node, ast.Starred) else [node.value]:
            yield from _written(elt, aliases)
        return
    chain = _chain(node)
    if len(chain) >= 2 and chain[0] == "self":
        yield ".".join(chain[1:3])
    elif len(chain) >= 2 and chain[0] in aliases:
        yield f"{aliases[chain[0]]}.{chain[1]}"


def _aliases(func: ast.AST) -> dict[str, str]:
    """Local names a function binds to a state field: `run = self._x` -> {"run": "_x"}."""
    out: dict[str, str] = {}
    for node in ast.walk(func):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = zip(target.elts, node.value.elts, strict=False) if isinstance(
                target, ast.Tuple) and isinstance(node.value, ast.Tuple) else [(target,
                                                                               node.value)]
            for name, value in pairs:
                chain = _chain(value)
                if isinstance(name, ast.Name) and len(chain) == 2 and chain[0] == "self":
                    out[name.id] = chain[1]
    return out


def state_writers(repo: Path) -> dict[str, set[str]]:
    """State path -> the core modules that write it (assignments, `del`, in-place operators,
    mutating calls such as `.add(`), outside the state's `__init__`."""
    out: dict[str, set[str]] = defaultdict(set)
    for path in sorted((repo / CORE).glob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef) or (
                    path == repo / STATE and func.name == "__init__"):
                continue
            aliases = _aliases(func)
            for node in ast.walk(func):
                targets: list[ast.AST] = []
                if isinstance(node, ast.Assign | ast.Delete):
                    targets = node.targets
                elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.NamedExpr):
                    targets = [node.target]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in MUTATORS:
                    targets = [node.func.value]
                for t in targets:
                    for name in _written(t, aliases):
                        out[name].add(path.stem)
    return out


def core_state(repo: Path) -> list[str]:
    """The core's state: its fields, the records among them, and who writes what."""
    fields = state_fields(repo)
    writers = state_writers(repo)
    paths = sorted(p for p in writers if p.split(".")[0] in fields and
                   p.split(".")[0] != "config")
    shared = [p for p in paths if len(writers[p]) > 1]
    records = sorted({p.split(".")[0] for p in paths if "." in p})
    rows = [f"  {p:32s} {', '.join(sorted(writers[p]))}" for p in paths]
    return [f"core state: {len(fields)} fields in SupervisorState ({len(records)} records "
            f"with fields of their own: {', '.join(records) or 'none'}); {len(paths)} state "
            f"paths written, {len(shared)} by more than one module"
            f"{': ' + ', '.join(shared) if shared else ''}; `_engine` written by "
            f"{len(writers.get('_engine', ()))} module(s):", *rows]


RANK_HOLDERS = ("server", "s", "self.server", "self.swap", "self.swap.server", "openers",
                "server.openers", "self.server.openers", "self.openers")
"""The names the rank's modules reach the server, the swap and the openers by."""
RANK_PARTS = ("integrity", "swap", "copier", "layouts", "openers", "record", "_copies",
              "_layouts", "_copier")
"""The server's parts, as attributes, record fields and the factories that make them."""


def _mentions_any(node: ast.AST | None) -> bool:
    return node is not None and any(isinstance(n, ast.Name) and n.id == "Any"
                                    for n in ast.walk(node))


def rank_parts(repo: Path) -> list[str]:
    """cache/rank/: another object's private attributes read, written or called; attributes
    of the server, the swap or the openers written from outside their class; parts typed Any."""
    private, writes, untyped = [], [], []
    for path in sorted((repo / "cache" / "rank").glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names}
        for node in ast.walk(tree):
            where = f"{path.stem}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and node.attr not in (
                        "_replace", "_asdict", "_fields"):  # a NamedTuple's own API
                base = ast.unparse(node.value)
                if base not in ("self", "cls") and base.split(".")[0] not in modules:
                    private.append(f"{where} {base}.{node.attr}")
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    targets += t.elts if isinstance(t, ast.Tuple) else [t]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            writes += [f"{where} {ast.unparse(t)}" for t in targets
                       if isinstance(t, ast.Attribute) and ast.unparse(t.value) in RANK_HOLDERS]
            if isinstance(node, ast.AnnAssign) and _mentions_any(node.annotation):
                name = node.target.attr if isinstance(node.target, ast.Attribute) else \
                    getattr(node.target, "id", "")
                if name in RANK_PARTS:
                    untyped.append(f"{where} {ast.unparse(node.target)}")
            if isinstance(node, ast.FunctionDef) and node.name in RANK_PARTS \
                    and _mentions_any(node.returns):
                untyped.append(f"{where} {node.name}() -> Any")
    return [f"rank: {len(private)} private attribute(s) of another object; {len(writes)} "
            f"write(s) into the server, the swap or the openers from outside them; "
            f"{len(untyped)} part(s) typed Any",
            *(f"  private  {x}" for x in private), *(f"  write    {x}" for x in writes),
            *(f"  Any      {x}" for x in untyped)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--least", type=int, default=9, help="parameters that make a list long")
    ap.add_argument("--walk", default="cache/client/loader.py:load:model")
    ap.add_argument("--state", action="store_true", help="only the core's state and writers")
    ap.add_argument("--rank", action="store_true", help="only the rank's server and its parts")
    args = ap.parse_args()
    if args.state or args.rank:
        print("\n".join(core_state(args.repo) if args.state else rank_parts(args.repo)))
        return
    for block in (sizes(args.repo, args.top), longest(args.repo, args.least),
                  walk(args.repo, args.walk), typed_any(args.repo), environment(args.repo),
                  core_state(args.repo), rank_parts(args.repo)):
        print("\n".join(block), end="\n\n")


if __name__ == "__main__":
    main()
