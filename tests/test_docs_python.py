"""Every ```python block in README.md and docs/*.md: run where it can run on CPU (against a
tiny checkpoint and a cache rank), otherwise compiled with every `vlaunch` name in it
resolved (module imported, attribute looked up). And `vlaunch.cache.__all__` is what the docs
call: the table in integrations.md ("The Python API") and every `vlaunch.cache.X` they use."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vlaunch.cache

from .conftest import CacheProc, spawn_cache

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKDOWN = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
SNIPPET = re.compile(r'^\s*--8<-- "([^"]+)"\s*$')

# (page, index of the python block on that page) -> what the block needs to run on CPU.
# "cache": a cache rank 0 of 2 on the tiny checkpoint, its socket directory in the
# environment; "hf": a transformers-saved tiny Llama. Every other block is compiled and its
# vlaunch names resolved (it needs a GPU, a running launcher or an engine's own code).
RUNS = {
    ("README.md", 0): "cache",
    ("modes.md", 0): "cache",
    ("integrations.md", 0): "hf",
}
MODEL = "/models/llama"  # the path the blocks use; replaced by the fixture's checkpoint
DOTTED = re.compile(r"\bvlaunch(?:\.[A-Za-z_]\w*)+")


def python_block_bodies(path: Path) -> list[str]:
    """Each ```python block of a page, its snippet lines expanded."""
    blocks, body, inside = [], [], False
    for line in path.read_text().splitlines():
        if not inside and line.strip() == "```python":
            inside, body = True, []
        elif inside and line.strip() == "```":
            blocks.append("\n".join(body) + "\n")
            inside = False
        elif inside:
            m = SNIPPET.match(line)
            body.append((ROOT / m.group(1)).read_text() if m else line)
    return blocks


def python_blocks() -> Iterator[tuple[str, int, str]]:
    for path in MARKDOWN:
        blocks = python_block_bodies(path)
        for i, body in enumerate(blocks):
            yield path.name, i, body


BLOCKS = list(python_blocks())


def resolve(dotted: str) -> Any:
    """Import the longest module prefix of `dotted`, then getattr the rest."""
    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError as exc:
            if exc.name and not ".".join(parts[:i]).startswith(exc.name):
                raise  # the module exists but imports something missing
            i -= 1
    assert obj is not None, dotted
    for attr in parts[i:]:
        obj = getattr(obj, attr)  # AttributeError names what the docs call and the code lacks
    return obj


def vlaunch_names(code: str) -> set[str]:
    """Every vlaunch dotted name the block uses: imports, attributes of imported vlaunch
    modules (through their aliases) and names written out in full (comments too)."""
    tree = ast.parse(code)
    alias: dict[str, str] = {}
    names = set(DOTTED.findall(code))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("vlaunch"):
                    names.add(a.name)
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "vlaunch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vlaunch"):
            for a in node.names:
                names.add(f"{node.module}.{a.name}")
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in alias:
                names.add(".".join([alias[cur.id], *reversed(chain)]))
    return names


def test_every_python_block_is_found() -> None:
    found = {(page, i) for page, i, _ in BLOCKS}
    assert set(RUNS) <= found, set(RUNS) - found
    assert len(BLOCKS) >= 8  # the extraction would pass vacuously otherwise


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS,
                         ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_python_block_compiles_and_its_vlaunch_names_resolve(page: str, index: int,
                                                             code: str) -> None:
    compile(code, f"{page}[{index}]", "exec")
    names = vlaunch_names(code)
    for name in sorted(names):
        resolve(name)


@pytest.fixture(scope="module")
def cache_rank(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Path, Path]]:
    sockdir = tmp_path_factory.mktemp("docs-py") / "s"
    sockdir.mkdir(mode=0o700)
    rank: CacheProc = spawn_cache(llama_ckpt, sockdir, "--plan", "llama", rank=0, tp=2)
    assert rank.ready, rank.proc.stderr.read().decode()[-2000:] if rank.proc.stderr else ""
    yield llama_ckpt, sockdir
    rank.stop()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("docs-hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    return root


@pytest.mark.parametrize(("page", "index"), sorted(RUNS), ids=[f"{p}-{i}" for p, i in
                                                              sorted(RUNS)])
def test_python_block_runs_on_cpu(page: str, index: int, request: pytest.FixtureRequest,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    code = next(c for p, i, c in BLOCKS if (p, i) == (page, index))
    assert MODEL in code, f"{page}[{index}] no longer loads {MODEL}"
    monkeypatch.setenv("VLAUNCH_DEVICE", "cpu")
    namespace: dict[str, Any] = {}
    if RUNS[page, index] == "cache":
        model, sockdir = request.getfixturevalue("cache_rank")
        monkeypatch.setenv("VLAUNCH_SOCKET_DIR", str(sockdir))
        monkeypatch.setenv("VLAUNCH_PLAN", "llama")
    else:
        model = request.getfixturevalue("hf_model")
        monkeypatch.setenv("VLAUNCH_SOCKET_DIR", str(model / "no-cache"))
    exec(compile(code.replace(MODEL, str(model)), f"{page}[{index}]", "exec"), namespace)
    if RUNS[page, index] == "cache":
        weights = namespace["weights"]
        assert weights.source == "cache", weights.reason  # mapped from the rank, not the disk
        assert len(weights) > 0
    else:
        assert not any(p.is_meta for p in namespace["model"].parameters())


API_TABLE = re.compile(r"^\| `([A-Za-z_]\w*)` \|", re.M)


def api_section() -> str:
    text = (DOCS / "integrations.md").read_text()
    start = text.index("## The Python API")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_all_is_the_documented_api() -> None:
    documented = set(API_TABLE.findall(api_section()))
    assert documented == set(vlaunch.cache.__all__)
    for name in vlaunch.cache.__all__:
        getattr(vlaunch.cache, name)


def test_every_top_level_name_the_docs_call_is_exported() -> None:
    called = re.compile(r"\b(?:vlaunch\.cache|vc)\.([A-Za-z_]\w*)\b")
    submodules = {p.name for p in (ROOT / "cache").iterdir() if p.is_dir() or p.suffix == ".py"}
    for path in MARKDOWN:
        for name in called.findall(path.read_text()):
            if name in submodules or f"{name}.py" in submodules:
                continue
            assert name in vlaunch.cache.__all__, f"{path.name}: vlaunch.cache.{name}"


# ------------------------------------------------ claims the pages make, pinned to the code


def test_the_plan_option_names_every_builtin_plan() -> None:
    """configuration.md's --plan row and formats.md's plan table name each built-in plan."""
    from vlaunch.cache.store.plan import BUILTIN_PLANS

    row = next(line for line in (DOCS / "configuration.md").read_text().splitlines()
               if line.startswith("| `--plan` |"))
    formats = (DOCS / "formats.md").read_text()
    for name in BUILTIN_PLANS:
        assert f"`{name}`" in row, name
        assert f"`{name}`" in formats or name in ("llama", "replicate"), name


def test_a_cpu_rank_checksums_its_tensors_by_default(cache_rank: tuple[Path, Path]) -> None:
    """multi-node.md: seeded bytes are checked against the source's checksums, which a CPU
    rank computes by default (a CUDA rank does not: --checksum's default)."""
    from vlaunch.cache.client.connection import CacheClient
    from vlaunch.cache.contract.sockdir import socket_path

    _, sockdir = cache_rank
    client = CacheClient(socket_path(sockdir, 0))
    try:
        manifest = client.manifest()
    finally:
        client.close()
    assert manifest.tensors and all(t.checksum is not None for t in manifest.tensors)

