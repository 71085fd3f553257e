"""Rank layouts, shard plans, and the byte runs each rank reads."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from vlaunch.cache.contract.errors import PlanError, UsageError
from vlaunch.cache.store.checkpoint import Checkpoint, TensorEntry, open_checkpoint
from vlaunch.cache.store.dtypes import DTYPES, to_torch
from vlaunch.cache.store.plan import (
    BUILTIN_PLANS,
    LLAMA_PLAN,
    HookPlan,
    Position,
    ShardPlan,
    SliceSpec,
    load_hook,
    load_plan,
    plan_rank,
)

HIDDEN, KV, FFN, VOCAB = 8, 4, 16, 32


def llama(tmp_path: Path, layers: int = 2, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """A tiny Llama/Qwen2-shaped checkpoint with random values, split over two shards."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
                   p + "self_attn.q_proj.bias": (HIDDEN,),
                   p + "self_attn.k_proj.weight": (KV, HIDDEN),
                   p + "self_attn.k_proj.bias": (KV,),
                   p + "self_attn.v_proj.weight": (KV, HIDDEN),
                   p + "self_attn.v_proj.bias": (KV,),
                   p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "self_attn.o_proj.bias": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "mlp.gate_proj.weight": (FFN, HIDDEN),
                   p + "mlp.up_proj.weight": (FFN, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, FFN)}
    shapes |= {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
               "lm_head.weight": (VOCAB, HIDDEN), "model.rope_scale": ()}
    tensors = {n: random_tensor(s, dtype) for n, s in shapes.items()}
    names = list(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, tmp_path / "model-1.safetensors")
    save_file({n: tensors[n] for n in names[half:]}, tmp_path / "model-2.safetensors")
    return open_checkpoint(tmp_path)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100, 100, shape, dtype=torch.int64).to(dtype)


def read_blocks(spec: SliceSpec, max_bytes: int, max_gap: int | None = None) -> bytes:
    """Read a slice the way a reader does: one pread per block, then copy the runs out."""
    out = bytearray(spec.nbytes)
    fd = os.open(spec.source.file, os.O_RDONLY)
    try:
        for span_offset, span_len, copies in spec.blocks(max_bytes, max_gap):
            assert span_len <= max_bytes
            span = os.pread(fd, span_len, span_offset)
            for src, n, dst in copies:
                assert src + n <= span_len
                out[dst:dst + n] = span[src:src + n]
    finally:
        os.close(fd)
    return bytes(out)


def read_runs(spec: SliceSpec) -> bytes:
    fd = os.open(spec.source.file, os.O_RDONLY)
    try:
        return b"".join(os.pread(fd, n, offset) for offset, n in spec.runs())
    finally:
        os.close(fd)


def as_tensor(data: bytes, spec: SliceSpec) -> torch.Tensor:
    """The slice's bytes as uint8 rows of its shape (exact comparison, even for NaN or fp8)."""
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8)
    return flat.reshape(*spec.shape, DTYPES[spec.dtype].itemsize)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(*t.shape, t.element_size())


def layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


# --- Position --------------------------------------------------------------------------------

def test_global_rank_round_trip() -> None:
    seen = []
    for rank in range(8):
        position = Position.from_global(rank, tp_size=2, pp_size=2, dp_size=2)
        assert position.global_rank == rank and position.world_size == 8
        assert Position(**position.as_dict()) == position
        seen.append((position.dp_rank, position.pp_rank, position.tp_rank))
    assert seen == sorted(seen)  # data, then pipeline, then tensor; tensor fastest
    assert Position.from_global(5, 2, 2, 2).as_dict() == {
        "tp_size": 2, "tp_rank": 1, "pp_size": 2, "pp_rank": 0, "dp_size": 2, "dp_rank": 1}


@pytest.mark.parametrize("kwargs", [dict(tp_size=0, tp_rank=0), dict(tp_size=2, tp_rank=2),
                                    dict(tp_size=2, tp_rank=-1),
                                    dict(tp_size=1, tp_rank=0, pp_size=2, pp_rank=2),
                                    dict(tp_size=1, tp_rank=0, dp_size=0),
                                    dict(tp_size=True, tp_rank=0)])
def test_bad_layouts(kwargs: dict) -> None:
    with pytest.raises(UsageError):
        Position(**kwargs)


def test_global_rank_out_of_range() -> None:
    with pytest.raises(UsageError, match=r"0\.\.7"):
        Position.from_global(8, 2, 2, 2)


# --- rules ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "dim"), [
    ("model.layers.0.self_attn.q_proj.weight", 0),
    ("model.layers.0.self_attn.k_proj.weight", 0),
    ("model.layers.0.self_attn.v_proj.weight", 0),
    ("model.layers.0.self_attn.q_proj.bias", 0),
    ("model.layers.0.self_attn.k_proj.bias", 0),
    ("model.layers.0.self_attn.v_proj.bias", 0),
    ("model.layers.11.mlp.gate_proj.weight", 0),
    ("model.layers.11.mlp.up_proj.weight", 0),
    ("model.embed_tokens.weight", 0),
    ("lm_head.weight", 0),
    ("model.layers.3.self_attn.o_proj.weight", 1),
    ("model.layers.3.mlp.down_proj.weight", 1),
    ("model.layers.3.self_attn.o_proj.bias", None),
    ("model.layers.3.mlp.down_proj.bias", None),
    ("model.layers.3.input_layernorm.weight", None),
    ("model.layers.3.post_attention_layernorm.weight", None),
    ("model.norm.weight", None),
    ("model.layers.3.self_attn.q_proj.weight_scale", 0),  # size-1 dims: replicated
    ("model.layers.3.self_attn.xq_proj.weight", None),
    ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
])
def test_llama_rules(name: str, dim: int | None) -> None:
    assert LLAMA_PLAN.split_dim(name) == dim
    assert BUILTIN_PLANS["replicate"].split_dim(name) is None


def test_first_matching_rule_wins() -> None:
    plan = ShardPlan("t", ((r"special\.", None), (r"\.weight$", 1), (r"special", 0)))
    assert plan.split_dim("a.special.weight") is None
    assert plan.split_dim("a.weight") == 1
    assert plan.split_dim("special") == 0
    assert plan.split_dim("bias") is None


def test_builtin_identities_are_distinct_and_stable() -> None:
    assert LLAMA_PLAN.identity.startswith("builtin:llama:sha256:")
    assert LLAMA_PLAN.identity != BUILTIN_PLANS["replicate"].identity
    assert ShardPlan("llama", tuple((p.pattern, d) for p, d in LLAMA_PLAN.rules),
                     fused=LLAMA_PLAN.fused).identity == LLAMA_PLAN.identity


def _position(tp: int = 1, dp: int = 1, pp: int = 1) -> dict[str, int]:
    return Position(tp, 0, pp, 0, dp, 0).as_dict()


@pytest.mark.parametrize(("plans", "position", "alike"), [
    (("llama", "replicate", "gpt-oss", "llama-ep"), _position(), True),
    (("llama", "replicate", "gpt-oss"), _position(pp=2), True),
    (("llama", "replicate"), _position(dp=2), True),
    (("llama", "replicate"), _position(tp=2), False),
    (("llama-ep", "replicate"), _position(dp=2), False),  # whole experts split over dp ranks
])
def test_rule_plans_that_split_nothing_have_one_fingerprint(
        plans: tuple[str, ...], position: dict[str, int], alike: bool) -> None:
    from vlaunch.cache.contract.fingerprint import plan_field

    fields = {plan_field(BUILTIN_PLANS[name].identity, position) for name in plans}
    assert (len(fields) == 1) == alike, fields


def test_a_plan_file_that_splits_nothing_matches_a_builtin_and_a_hook_keeps_its_identity(
        tmp_path: Path) -> None:
    from vlaunch.cache.contract.fingerprint import WHOLE, plan_field

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"rules": [{"pattern": "q_proj", "dim": 0}]}))
    assert plan_field(load_plan(str(path)).identity, _position()) == WHOLE
    assert plan_field(load_plan(str(path)).identity, _position(tp=2)).startswith("file:sha256:")
    path.write_text(json.dumps({"rules": [], "experts": "ep"}))
    assert plan_field(load_plan(str(path)).identity, _position(dp=2)).startswith("file:ep:")
    assert plan_field("hook:pkg.mod:build", _position()) == "hook:pkg.mod:build"


# --- slices --------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shapes(tmp_path: Path, tp: int) -> None:
    ckpt = llama(tmp_path)
    for rank in range(tp):
        specs = {s.name: s for s in plan_rank(ckpt, LLAMA_PLAN, Position(tp, rank))}
        assert list(specs) == list(ckpt.tensors)
        p = "model.layers.1."
        assert specs[p + "self_attn.q_proj.weight"].shape == (HIDDEN // tp, HIDDEN)
        assert specs[p + "self_attn.k_proj.bias"].shape == (KV // tp,)
        assert specs[p + "self_attn.o_proj.weight"].shape == (HIDDEN, HIDDEN // tp)
        assert specs[p + "self_attn.o_proj.bias"].shape == (HIDDEN,)
        assert specs[p + "mlp.down_proj.weight"].shape == (HIDDEN, FFN // tp)
        assert specs["lm_head.weight"].shape == (VOCAB // tp, HIDDEN)
        assert specs["model.rope_scale"].shape == () and specs["model.rope_scale"].dim is None
        q = specs[p + "self_attn.q_proj.weight"]
        assert (q.dim, q.part, q.parts) == (0, rank, tp)
        assert q.nbytes == HIDDEN * HIDDEN * 4 // tp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8,
                                   torch.float8_e4m3fn])
def test_ranks_reassemble_every_tensor(tmp_path: Path, dtype: torch.dtype) -> None:
    ckpt = llama(tmp_path, dtype=dtype)
    full = {}
    for f in ckpt.files:
        full.update(load_file(f))
    for tp in (1, 2, 4):
        per_rank = [{s.name: s for s in plan_rank(ckpt, LLAMA_PLAN, Position(tp, r))}
                    for r in range(tp)]
        for name, tensor in full.items():
            specs = [ranks[name] for ranks in per_rank]
            for max_bytes in (3, 16, 1 << 20):
                parts = [as_tensor(read_blocks(s, max_bytes), s) for s in specs]
                assert all(read_runs(s) == read_blocks(s, max_bytes) for s in specs)
                if specs[0].dim is None:
                    assert all(torch.equal(p, as_bytes(tensor)) for p in parts)
                else:
                    assert torch.equal(torch.cat(parts, specs[0].dim), as_bytes(tensor))


def test_runs_of_a_column_split(tmp_path: Path) -> None:
    ckpt = llama(tmp_path)
    o = ckpt.tensors["model.layers.0.self_attn.o_proj.weight"]
    spec = {s.name: s for s in plan_rank(ckpt, LLAMA_PLAN, Position(2, 1))}[o.name]
    row = HIDDEN * 4
    assert spec.runs() == [(o.begin + i * row + row // 2, row // 2) for i in range(HIDDEN)]
    assert spec.blocks(1 << 20) == [(o.begin + row // 2, (HIDDEN - 1) * row + row // 2,
                                     [(i * row, row // 2, i * row // 2) for i in range(HIDDEN)])]
    assert len(spec.blocks(1 << 20, max_gap=0)) == HIDDEN
    q = {s.name: s for s in plan_rank(ckpt, LLAMA_PLAN, Position(2, 1))}[
        "model.layers.0.self_attn.q_proj.weight"]
    assert q.runs() == [(q.source.begin + q.nbytes, q.nbytes)]


def fake_entry(shape: tuple[int, ...], itemsize: int, begin: int = 1000) -> TensorEntry:
    dtype = {1: "U8", 2: "BF16", 4: "F32", 8: "I64"}[itemsize]
    return TensorEntry("t", dtype, shape, Path("/nonexistent"), begin,
                       math.prod(shape) * itemsize)


@st.composite
def slices(draw: st.DrawFn) -> SliceSpec:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    entry = fake_entry(shape, itemsize)
    if not shape or draw(st.booleans()):
        return SliceSpec("t", entry.dtype, shape, None, 0, 1, entry)
    dim = draw(st.integers(0, len(shape) - 1))
    parts = draw(st.sampled_from([p for p in range(1, 7) if shape[dim] % p == 0]))
    part = draw(st.integers(0, parts - 1))
    return SliceSpec("t", entry.dtype, shape, dim, part, parts, entry)


def expected_bytes(spec: SliceSpec) -> list[int]:
    """Absolute file offsets of the slice's bytes, in order, computed with torch indexing."""
    isz = DTYPES[spec.dtype].itemsize
    index = torch.arange(math.prod(spec.full_shape)).reshape(spec.full_shape)
    if spec.dim is not None:
        size = spec.full_shape[spec.dim] // spec.parts
        index = index.narrow(spec.dim, spec.part * size, size)
    return [spec.source.begin + e * isz + b for e in index.reshape(-1).tolist()
            for b in range(isz)]


@settings(max_examples=300, deadline=None)
@given(slices(), st.integers(1, 64), st.one_of(st.none(), st.integers(0, 40)))
def test_runs_and_blocks_cover_exactly_the_slice(spec: SliceSpec, max_bytes: int,
                                                 max_gap: int | None) -> None:
    want = expected_bytes(spec)
    runs = spec.runs()
    assert [o + i for o, n in runs for i in range(n)] == want
    assert all(n > 0 for _, n in runs)
    assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(runs))  # coalesced
    if spec.dim in (None, 0) and want:
        assert len(runs) == 1
    got = [-1] * len(want)
    for span_offset, span_len, copies in spec.blocks(max_bytes, max_gap):
        assert 0 < span_len <= max_bytes
        assert copies[0][0] == 0 and copies[-1][0] + copies[-1][1] == span_len
        for (s1, n1, _), (s2, _, _) in itertools.pairwise(copies):
            assert s1 + n1 <= s2 and (max_gap is None or s2 - (s1 + n1) <= max_gap)
        for src, n, dst in copies:
            got[dst:dst + n] = range(span_offset + src, span_offset + src + n)
    assert got == want


def test_zero_dim_and_empty_slices() -> None:
    scalar = SliceSpec("s", "F32", (), None, 0, 1, fake_entry((), 4))
    assert scalar.shape == () and scalar.nbytes == 4 and scalar.runs() == [(1000, 4)]
    assert scalar.blocks(3) == [(1000, 3, [(0, 3, 0)]), (1003, 1, [(0, 1, 3)])]
    empty = SliceSpec("e", "F32", (0, 4), 0, 1, 2, fake_entry((0, 4), 4))
    assert empty.shape == (0, 4) and empty.nbytes == 0
    assert empty.runs() == [] and empty.blocks(8) == []


def test_bad_slice_specs() -> None:
    entry = fake_entry((4, 6), 4)
    for dim, part, parts in [(None, 0, 2), (0, 2, 2), (2, 0, 2), (1, 0, 4)]:
        with pytest.raises(ValueError):
            SliceSpec("t", "F32", (4, 6), dim, part, parts, entry)
    with pytest.raises(ValueError):
        SliceSpec("t", "F32", (4, 6), None, 0, 1, entry).blocks(0)


# --- plan errors ---------------------------------------------------------------------------

def test_split_that_does_not_divide(tmp_path: Path) -> None:
    ckpt = llama(tmp_path)
    with pytest.raises(PlanError, match=r"does not divide evenly by tp size 3"):
        plan_rank(ckpt, LLAMA_PLAN, Position(3, 0))
    only_q = ShardPlan("q", ((r"layers\.1\.self_attn\.q_proj\.weight$", 1),))
    with pytest.raises(PlanError, match=r"tensor 'model\.layers\.1\.self_attn\.q_proj\.weight' "
                       r"of shape \[8,8\]: dimension 1 \(size 8\) does not divide evenly by tp "
                       "size 3"):
        plan_rank(ckpt, only_q, Position(3, 2))


def test_split_of_a_missing_dimension(tmp_path: Path) -> None:
    ckpt = llama(tmp_path)
    bias = "model.layers.0.self_attn.q_proj.bias"
    for plan, name in [(ShardPlan("t", ((r"rope_scale", 0),)), "model.rope_scale"),
                       (ShardPlan("t", ((re.escape(bias), 1),)), bias)]:
        with pytest.raises(PlanError, match=f"tensor '{re.escape(name)}' of shape .* has no "
                           "dimension"):
            plan_rank(ckpt, plan, Position(1, 0))


# --- pipeline ------------------------------------------------------------------------------

def test_five_layers_on_two_stages(tmp_path: Path) -> None:
    ckpt = llama(tmp_path, layers=5)
    first = plan_rank(ckpt, LLAMA_PLAN, Position(1, 0, pp_size=2, pp_rank=0))
    last = plan_rank(ckpt, LLAMA_PLAN, Position(1, 0, pp_size=2, pp_rank=1))
    assert {layer_of(s.name) for s in first} == {0, 1, 2, None}
    assert {layer_of(s.name) for s in last} == {3, 4, None}
    names0, names1 = {s.name for s in first}, {s.name for s in last}
    assert "model.embed_tokens.weight" in names0 and "model.embed_tokens.weight" not in names1
    for name in ("lm_head.weight", "model.norm.weight"):
        assert name in names1 and name not in names0
    assert "model.rope_scale" in names0 & names1
    assert names0 | names1 == set(ckpt.tensors)


@pytest.mark.parametrize(("layers", "pp", "counts"), [(7, 3, [3, 2, 2]), (6, 4, [2, 2, 1, 1]),
                                                      (4, 4, [1, 1, 1, 1]), (3, 1, [3])])
def test_layers_per_stage(tmp_path: Path, layers: int, pp: int, counts: list[int]) -> None:
    ckpt = llama(tmp_path, layers=layers)
    got = []
    for stage in range(pp):
        specs = plan_rank(ckpt, LLAMA_PLAN, Position(1, 0, pp_size=pp, pp_rank=stage))
        got.append(len({layer_of(s.name) for s in specs} - {None}))
    assert got == counts


def test_more_stages_than_layers(tmp_path: Path) -> None:
    ckpt = llama(tmp_path, layers=2)
    with pytest.raises(PlanError, match="pp size 3 exceeds the 2 layers"):
        plan_rank(ckpt, LLAMA_PLAN, Position(1, 0, pp_size=3, pp_rank=0))


def test_pipeline_and_tensor_parallel(tmp_path: Path) -> None:
    ckpt = llama(tmp_path, layers=4)
    for rank in range(8):
        position = Position.from_global(rank, tp_size=2, pp_size=2, dp_size=2)
        specs = {s.name: s for s in plan_rank(ckpt, LLAMA_PLAN, position)}
        layers = {layer_of(n) for n in specs} - {None}
        assert layers == ({0, 1} if position.pp_rank == 0 else {2, 3})
        assert ("lm_head.weight" in specs) == (position.pp_rank == 1)
        q = specs[f"model.layers.{min(layers)}.self_attn.q_proj.weight"]
        assert (q.shape, q.part) == ((HIDDEN // 2, HIDDEN), position.tp_rank)
        peer = Position(**{**position.as_dict(), "dp_rank": 1 - position.dp_rank})
        assert plan_rank(ckpt, LLAMA_PLAN, peer) == list(specs.values())


# --- plan files and hooks ------------------------------------------------------------------

def test_builtin_names() -> None:
    assert load_plan("llama") is LLAMA_PLAN
    assert load_plan("replicate").rules == ()


def test_json_plan_file(tmp_path: Path) -> None:
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"name": "mine", "rules": [{"pattern": r"\.norm\.", "dim": None},
                                                       {"pattern": r"\.weight$", "dim": 1}]}))
    plan = load_plan(str(f))
    assert isinstance(plan, ShardPlan) and plan.name == "mine"
    assert plan.split_dim("model.norm.weight") is None and plan.split_dim("x.weight") == 1
    assert plan.identity.startswith("file:sha256:")
    assert load_plan(str(f)).identity == plan.identity
    f.write_text(f.read_text() + " ")
    assert load_plan(str(f)).identity != plan.identity


def test_toml_plan_file(tmp_path: Path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text("[[rules]]\npattern = '\\.norm\\.'\n\n"
                 "[[rules]]\npattern = 'proj\\.weight$'\ndim = 0\n")
    plan = load_plan(str(f))
    assert isinstance(plan, ShardPlan) and plan.name == "mine"
    assert plan.split_dim("model.norm.weight") is None
    assert plan.split_dim("a.q_proj.weight") == 0 and plan.split_dim("a.bias") is None


@pytest.mark.parametrize(("suffix", "text", "match"), [
    (".json", "{nope", "cannot be parsed"),
    (".toml", "rules = [", "cannot be parsed"),
    (".json", "[]", "must be an object"),
    (".json", '{"rule": []}', "must be an object"),
    (".json", '{"rules": {}}', "'rules' must be a list"),
    (".json", '{"rules": [{"dim": 0}]}', "rule 0 must have a 'pattern'"),
    (".json", '{"rules": [{"pattern": "x", "split": 0}]}', "rule 0 must have"),
    (".json", '{"rules": [{"pattern": "(", "dim": 0}]}', "not a valid regex"),
    (".json", '{"rules": [{"pattern": 3, "dim": 0}]}', "not a string"),
    (".json", '{"rules": [{"pattern": "x", "dim": -1}]}', "has dim -1"),
    (".json", '{"rules": [{"pattern": "x", "dim": "0"}]}', "has dim '0'"),
    (".json", '{"rules": [{"pattern": "x", "dim": true}]}', "has dim True"),
])
def test_bad_plan_files(tmp_path: Path, suffix: str, text: str, match: str) -> None:
    f = tmp_path / f"bad{suffix}"
    f.write_text(text)
    with pytest.raises(PlanError, match=match) as e:
        load_plan(str(f))
    assert str(f) in str(e.value)


@pytest.mark.parametrize(("spec", "match"), [("lama", "unknown plan 'lama'; use one of llama"),
                                             ("/nope/plan.json", "does not exist"),
                                             ("no_such_module_xyz:build", "cannot import")])
def test_bad_plan_specs(spec: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        load_plan(spec)


HOOK = '''
import torch

def build(checkpoint, position):
    return {"rank": torch.tensor([position.tp_rank]), "n": torch.tensor(len(checkpoint.tensors))}

def bad(checkpoint, position):
    return [1, 2]

def legacy(checkpoint, layout):  # the name older docs gave the argument: hooks get it positionally
    return {"rank": torch.tensor([layout.tp_rank])}

class Holder:
    @staticmethod
    def build(checkpoint, position):
        return {}

value = 3
'''


def hook_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{name}.py").write_text(HOOK)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    return name


def test_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = hook_module(tmp_path, monkeypatch, "vlaunch_test_hook_a")
    ckpt = llama(tmp_path)
    plan = load_plan(f"{mod}:build")
    assert isinstance(plan, HookPlan) and plan.identity == f"hook:{mod}:build"
    out = plan.build(ckpt, Position(2, 1))
    assert out["rank"].tolist() == [1] and int(out["n"]) == len(ckpt.tensors)
    assert load_hook(f"{mod}:Holder.build")(ckpt, Position(1, 0)) == {}
    assert load_plan(f"{mod}:legacy").build(ckpt, Position(2, 1))["rank"].tolist() == [1]
    with pytest.raises(PlanError, match="returned list, not a mapping"):
        HookPlan(f"{mod}:bad", load_hook(f"{mod}:bad")).build(ckpt, Position(1, 0))


@pytest.mark.parametrize(("attr", "match"), [("missing", "has no attribute missing"),
                                             ("value", "is a int, not callable")])
def test_bad_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attr: str,
                   match: str) -> None:
    mod = hook_module(tmp_path, monkeypatch, f"vlaunch_test_hook_{attr}")
    with pytest.raises(PlanError, match=match):
        load_plan(f"{mod}:{attr}")


def test_hook_module_that_fails_to_import(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "vlaunch_test_hook_broken.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PlanError, match="cannot import vlaunch_test_hook_broken: "
                       "RuntimeError\\('boom'\\)"):
        load_hook("vlaunch_test_hook_broken:build")
    with pytest.raises(PlanError, match="is not module:callable"):
        load_hook("just_a_module")


def test_dtype_names_round_trip() -> None:
    assert {str(to_torch(n)) for n in DTYPES} >= {"torch.bfloat16", "torch.float8_e4m3fn"}


def test_importing_does_not_load_torch() -> None:
    code = ("import sys, vlaunch.cache.store.plan, vlaunch.cache.store.checkpoint, "
            "vlaunch.cache.store.dtypes; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
