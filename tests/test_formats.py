"""Every safetensors dtype, quantized layers and MoE experts: served as a serving engine needs."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vlaunch.cache import load
from vlaunch.cache.contract.errors import CheckpointError, PlanError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.store import dtypes
from vlaunch.cache.store.checkpoint import open_checkpoint
from vlaunch.cache.store.dtypes import DTYPES
from vlaunch.cache.store.fingerprints import fingerprint

from .conftest import spawn_cache

# --- helpers --------------------------------------------------------------------------------


def write_raw(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Write a safetensors file by hand: header JSON + bytes (any dtype, even F6)."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text
                     + b"".join(d for _, _, d in tensors.values()))


def random_bytes(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in row-major order, whatever its dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def assert_same(got: torch.Tensor, want: torch.Tensor, what: object) -> None:
    """Same dtype, shape, stride and bytes."""
    assert (got.dtype, tuple(got.shape), got.stride()) == \
        (want.dtype, tuple(want.shape), want.stride()), what
    assert raw_bytes(got) == raw_bytes(want), what


# --- dtypes ---------------------------------------------------------------------------------

SHAPES = {"matrix": [4, 8], "scalar": [], "empty": [0, 8], "vector": [16]}


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file with every dtype in several shapes, written by hand."""
    path = tmp_path_factory.mktemp("dtypes") / "all.safetensors"
    tensors = {}
    for i, name in enumerate(DTYPES):
        for j, (kind, shape) in enumerate(SHAPES.items()):
            if dtypes.shape_problem(name, shape):
                continue  # a 0-d F4 is half a byte: not a valid tensor
            data = random_bytes(dtypes.nbytes(name, shape), 10 * i + j)
            if name == "BOOL":
                data = bytes(b & 1 for b in data)
            tensors[f"{name}.{kind}"] = (name, shape, data)
    write_raw(path, tensors)
    return path


def expected(path: Path) -> dict[str, torch.Tensor]:
    """What an engine should get: safetensors' own tensors; raw uint8 bytes where it has none."""
    out = {}
    with safe_open(str(path), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            dtype = f.get_slice(name).get_dtype()
            if dtypes.is_plain(dtype) or dtype == "F4":
                out[name] = f.get_tensor(name)
                continue
            shape = f.get_slice(name).get_shape()
            entry = open_checkpoint(path).tensors[name]
            with open(path, "rb") as fh:
                fh.seek(entry.begin)
                data = fh.read(entry.nbytes)
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                torch.empty(0, dtype=torch.uint8)
            out[name] = flat.reshape(dtypes.served_shape(dtype, tuple(shape)))
    return out


def test_every_safetensors_dtype_is_known() -> None:
    for name in ("F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64"):
        assert name in DTYPES
    assert dtypes.to_torch("F8_E8M0") == torch.float8_e8m0fnu
    assert dtypes.to_torch("F4") == torch.float4_e2m1fn_x2
    assert dtypes.to_torch("C64") == torch.complex64
    assert dtypes.to_torch("F6_E2M3") == torch.uint8  # torch has no 6-bit dtype: raw bytes
    assert dtypes.nbytes("F4", (4, 8)) == 16 and dtypes.nbytes("F6_E3M2", (4, 8)) == 24
    assert dtypes.served_shape("F4", (4, 8)) == (4, 4)
    assert dtypes.served_shape("F6_E2M3", (4, 8)) == (4, 6)
    assert dtypes.header_shape(torch.float4_e2m1fn_x2, (4, 4)) == (4, 8)
    with pytest.raises(ValueError, match="not whole bytes"):
        dtypes.nbytes("F4", (3,))
    with pytest.raises(ValueError, match="not whole bytes"):
        _ = DTYPES["F4"].itemsize


def test_every_dtype_served_bit_exactly_in_share_copy_and_fallback(every_dtype: Path,
                                                                    sockdir: Path,
                                                                    caches) -> None:
    want = expected(every_dtype)
    assert {n.split(".")[0] for n in want} == set(DTYPES)
    caches.append(spawn_cache(every_dtype, sockdir, "--plan", "replicate"))
    for mode in ("share", "copy", "fallback"):
        got = load(str(every_dtype), socket_dir=str(sockdir if mode != "fallback" else
                                                     sockdir / "none"),
                   plan="replicate", mode="copy" if mode == "fallback" else mode, timeout=10)
        assert got.source == ("disk" if mode == "fallback" else "cache")
        assert set(got) == set(want)
        for name, ref in want.items():
            assert_same(got[name], ref, (mode, name))


def test_sub_byte_dtypes_split_on_byte_boundaries(tmp_path: Path, sockdir: Path,
                                                  caches) -> None:
    path = tmp_path / "packed.safetensors"
    write_raw(path, {"rows.f4": ("F4", [8, 16], random_bytes(64, 1)),
                     "cols.f4": ("F4", [8, 16], random_bytes(64, 2)),
                     "cols.f6": ("F6_E2M3", [4, 16], random_bytes(48, 3)),
                     "rows.e8m0": ("F8_E8M0", [8, 2], random_bytes(16, 4))})
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"rules": [{"pattern": "^rows", "dim": 0},
                                          {"pattern": "^cols", "dim": 1}]}))
    want = expected(path)
    for rank in range(2):
        caches.append(spawn_cache(path, sockdir, "--plan", str(plan), rank=rank, tp=2))
    for rank in range(2):
        for mode in ("share", "fallback"):
            got = load(str(path), rank=rank, tensor_parallel_size=2, plan=str(plan),
                       socket_dir=str(sockdir if mode == "share" else sockdir / "none"),
                       timeout=10)
            for name, ref in want.items():
                dim = 0 if name.startswith("rows") else 1  # a served F4/F6 row is whole bytes
                assert_same(got[name], ref.chunk(2, dim)[rank].contiguous(), (rank, mode, name))


def test_a_dtype_this_torch_lacks_is_served_as_raw_bytes(every_dtype: Path,
                                                         monkeypatch) -> None:
    from vlaunch.cache.store.plan import Position
    from vlaunch.cache.store.shard import PlainBackend, load_shard

    want = expected(every_dtype)["F8_E8M0.matrix"].view(torch.uint8)  # [4, 8] bytes
    older = dtypes.DType("F8_E8M0", 8, "float8_e8m0_not_in_this_torch")
    try:
        with monkeypatch.context() as patch:
            patch.setitem(DTYPES, "F8_E8M0", older)
            dtypes.is_plain.cache_clear()
            got = load_shard(str(every_dtype), "replicate", Position(1, 0),
                             PlainBackend("cpu")).named()
    finally:
        dtypes.is_plain.cache_clear()  # the real table again
    assert_same(got["F8_E8M0.matrix"], want, "raw")
    assert got["F8_E8M0.scalar"].dtype == torch.uint8 and got["F8_E8M0.scalar"].shape == ()


def test_a_split_inside_a_byte_is_refused(tmp_path: Path) -> None:
    from vlaunch.cache.store.plan import Position, ShardPlan, plan_rank

    path = tmp_path / "m.safetensors"
    write_raw(path, {"w": ("F4", [4, 6], random_bytes(12, 0))})
    ckpt = open_checkpoint(path)
    with pytest.raises(PlanError, match=r"inside a byte|multiple of 2"):
        plan_rank(ckpt, ShardPlan("cols", ((r"^w$", 1),)), Position(2, 0))


def test_unknown_and_unpackable_dtypes_are_refused(tmp_path: Path, sockdir: Path) -> None:
    import safetensors

    write_raw(tmp_path / "odd.safetensors", {"w": ("F4", [2, 3], random_bytes(3, 0))})
    with pytest.raises(CheckpointError, match="last dimension of shape \\[2,3\\] must be a "
                       "multiple of 2"):
        open_checkpoint(tmp_path / "odd.safetensors")
    write_raw(tmp_path / "new.safetensors", {"w": ("F2_E1M0", [8], random_bytes(2, 0))})
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(tmp_path / "new.safetensors")
    assert f"safetensors {safetensors.__version__}" in str(err.value)
    assert f"torch {torch.__version__}" in str(err.value)
    assert "'F2_E1M0'" in str(err.value)
    cache = spawn_cache(tmp_path / "new.safetensors", sockdir)
    assert cache.proc.wait(30) == ExitStatus.BAD_CHECKPOINT == 65
    assert b"F2_E1M0" in cache.proc.stderr.read()  # type: ignore[union-attr]


@pytest.mark.parametrize("slabs", ["plain", "rank"])
def test_a_hook_may_build_packed_fp4_tensors(tmp_path: Path, monkeypatch, slabs: str) -> None:
    """In the engine's fallback (plain tensors) and in a rank's slabs (numpy arrays over
    memfds or files, which a hook's torch tensors are copied into)."""
    from vlaunch.cache.store.plan import Position
    from vlaunch.cache.store.shard import PlainBackend, load_shard
    from vlaunch.cache.store.slabs import get_backend

    write_raw(tmp_path / "m.safetensors", {"x": ("U8", [4], bytes(4))})
    (tmp_path / "fp4hook.py").write_text(
        "import torch\n"
        "def build(ckpt, position):\n"
        "    raw = torch.arange(24, dtype=torch.uint8).reshape(4, 6)\n"
        "    return {'w': raw.view(torch.float4_e2m1fn_x2), 'e': raw.view(torch.float8_e8m0fnu)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    backend = PlainBackend("cpu") if slabs == "plain" else get_backend("cpu")
    shard = load_shard(str(tmp_path), "fp4hook:build", Position(1, 0), backend)
    rec = {t.name: t for t in shard.manifest.tensors}
    assert (rec["w"].dtype, rec["w"].shape) == ("F4", (4, 12))
    got = shard.named()
    raw = torch.arange(24, dtype=torch.uint8).reshape(4, 6)
    assert_same(got["w"], raw.view(torch.float4_e2m1fn_x2), "w")
    assert_same(got["e"], raw.view(torch.float8_e8m0fnu), "e")


# --- quantization: the fingerprint ----------------------------------------------------------


def quantized_dir(root: Path, config: dict | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_raw(root / "model.safetensors", {"x.weight": ("BF16", [4, 4], random_bytes(32, 0))})
    body = {"architectures": ["LlamaForCausalLM"]}
    if config is not None:
        body["quantization_config"] = config
    (root / "config.json").write_text(json.dumps(body))
    return root


def test_the_fingerprint_carries_the_quantization_config_and_method(tmp_path: Path) -> None:
    from vlaunch.cache.contract import fingerprint as fp
    from vlaunch.cache.store.plan import Position
    from vlaunch.cache.store.target import Target

    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    model = quantized_dir(tmp_path / "m", gptq)
    cache = fingerprint(Target(str(model), Position(1, 0), "cpu"))
    assert cache["quantization"] == "gptq" and cache["quantization_config"].startswith("sha256:")
    assert fp.compare(cache, fingerprint(Target(str(model), Position(1, 0), "cpu"))) == []
    engine = fingerprint(Target(str(model), Position(1, 0), "cpu", quantization="gptq_marlin"))
    assert fp.compare(cache, engine) == [("quantization", "gptq", "gptq_marlin")]
    (model / "config.json").write_text(json.dumps({"quantization_config": {**gptq,
                                                                           "desc_act": True}}))
    engine = fingerprint(Target(str(model), Position(1, 0), "cpu"))
    assert [m[0] for m in fp.compare(cache, engine)] == ["quantization_config"]
    plain = fingerprint(Target(str(quantized_dir(tmp_path / "p", None)), Position(1, 0), "cpu"))
    assert (plain["quantization_config"], plain["quantization"]) == ("none", "none")


def test_kernel_backends_auto_detects_libraries_and_selection_variables(tmp_path: Path,
                                                                        monkeypatch) -> None:
    from vlaunch.cache.contract import fingerprint as fp
    from vlaunch.cache.contract import kernels
    from vlaunch.cache.store.plan import Position
    from vlaunch.cache.store.target import Target

    env = {"VLLM_ATTENTION_BACKEND": "FLASHINFER", "VLLM_USE_DEEP_GEMM": "1", "HOME": "/x",
           "VLLM_MARLIN_USE_ATOMIC_ADD": "1", "VLLM_ATTENTION_BACKEND_X": "1", "VLLM_MXFP4-": "1"}
    found = kernels.detect(env)
    assert "VLLM_ATTENTION_BACKEND=FLASHINFER" in found and "VLLM_USE_DEEP_GEMM=1" in found
    assert "VLLM_MARLIN_USE_ATOMIC_ADD=1" in found  # a prefix's variables
    assert "_X=" not in found and "VLLM_MXFP4-" not in found  # full names; identifiers only
    assert "HOME" not in found and kernels.resolve("flashinfer=0.2", env) == "flashinfer=0.2"
    model = quantized_dir(tmp_path / "m", None)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASH_ATTN")
    cache = fingerprint(Target(str(model), Position(1, 0), "cpu", kernel_backends="auto"))
    assert "VLLM_ATTENTION_BACKEND=FLASH_ATTN" in cache["kernel_backends"]
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    engine = fingerprint(Target(str(model), Position(1, 0), "cpu", kernel_backends="auto"))
    assert [m[0] for m in fp.compare(cache, engine)] == ["kernel_backends"]


# --- quantization: placement per method, against the engine's own sharding ----------------
#
# The reference is written the way a serving engine shards (vLLM's ColumnParallelLinear /
# RowParallelLinear): each parameter declares its output and input dimension (or none); a
# column-parallel layer splits the output dim, a row-parallel one the input dim, and a
# parameter without that dim is whole on every rank. Packed dims (8 int4 in an int32, 2 fp4 in
# a byte) split like the dim they pack. Nothing here reads vlaunch's plan rules.

HIDDEN, INTER, GROUP = 1024, 2048, 64
COLUMN = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN // 2, HIDDEN),
          "self_attn.v_proj": (HIDDEN // 2, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN),
          "mlp.up_proj": (INTER, HIDDEN)}
ROW = {"self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}


def method_params(method: str, out: int, inp: int) -> dict[str, tuple[str, list[int], object,
                                                                       object]]:
    """suffix -> (dtype, shape, output dim, input dim) of one linear layer's parameters."""
    if method == "fp8-tensor":
        return {"weight": ("F8_E4M3", [out, inp], 0, 1), "weight_scale": ("F32", [], None, None),
                "input_scale": ("F32", [], None, None)}
    if method == "fp8-channel":
        return {"weight": ("F8_E4M3", [out, inp], 0, 1),
                "weight_scale": ("F32", [out, 1], 0, None)}
    if method == "fp8-block":
        return {"weight": ("F8_E4M3", [out, inp], 0, 1),
                "weight_scale_inv": ("F32", [out // 128, inp // 128], 0, 1)}
    if method in ("gptq", "gptq-act-order"):
        groups_in = None if method == "gptq-act-order" else 0
        return {"qweight": ("I32", [inp // 8, out], 1, 0),
                "qzeros": ("I32", [inp // GROUP, out // 8], 1, groups_in),
                "scales": ("F16", [inp // GROUP, out], 1, groups_in),
                "g_idx": ("I32", [inp], None, 0)}
    if method == "awq":
        return {"qweight": ("I32", [inp, out // 8], 1, 0),
                "qzeros": ("I32", [inp // GROUP, out // 8], 1, 0),
                "scales": ("F16", [inp // GROUP, out], 1, 0)}
    if method == "mxfp4":
        return {"weight": ("U8", [out, inp // 2], 0, 1),
                "weight_scale": ("F8_E8M0", [out, inp // 32], 0, 1)}
    if method == "mxfp4-f4":  # the same, with the packed weight as safetensors' F4
        return {"weight": ("F4", [out, inp], 0, 1),
                "weight_scale": ("F8_E8M0", [out, inp // 32], 0, 1)}
    if method == "nvfp4":
        return {"weight": ("U8", [out, inp // 2], 0, 1),
                "weight_scale": ("F8_E4M3", [out, inp // 16], 0, 1),
                "weight_scale_2": ("F32", [], None, None), "input_scale": ("F32", [], None, None)}
    raise AssertionError(method)


QUANT_CONFIGS = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                          "desc_act": False},
                 "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                    "desc_act": True},
                 "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP}}


def write_quantized(root: Path, method: str) -> dict[str, tuple[str, object, object, str]]:
    """A one-layer Llama checkpoint quantized with `method`; name -> (dtype, out, in, kind)."""
    tensors, meta = {}, {}
    seed = 0
    for kind, layers in (("column", COLUMN), ("row", ROW)):
        for layer, (out, inp) in layers.items():
            for suffix, (dtype, shape, o, i) in method_params(method, out, inp).items():
                name = f"model.layers.0.{layer}.{suffix}"
                seed += 1
                tensors[name] = (dtype, shape, random_bytes(dtypes.nbytes(dtype, shape), seed))
                meta[name] = (dtype, o, i, kind)
    tensors["model.layers.0.input_layernorm.weight"] = ("BF16", [HIDDEN],
                                                       random_bytes(2 * HIDDEN, 99))
    meta["model.layers.0.input_layernorm.weight"] = ("BF16", None, None, "column")
    quantized_dir(root, QUANT_CONFIGS.get(method, {"quant_method": method.split("-")[0]}))
    write_raw(root / "model.safetensors", tensors)
    return meta


def reference_shard(full: torch.Tensor, out_dim: object, in_dim: object, kind: str, tp: int,
                    rank: int) -> torch.Tensor:
    """What the engine's parallel linear layer keeps of a parameter on rank `rank`."""
    dim = out_dim if kind == "column" else in_dim
    if dim is None:
        return full
    return full.chunk(tp, dim=int(dim))[rank].contiguous()  # type: ignore[call-overload]


def shards(model: Path, plan: str, tp: int, rank: int, **sizes: int) -> dict[str, torch.Tensor]:
    from vlaunch.cache.store.plan import Position
    from vlaunch.cache.store.shard import PlainBackend, load_shard

    position = Position.from_global(rank, tp, 1, sizes.get("dp", 1))
    return load_shard(str(model), plan, position, PlainBackend("cpu")).named()


@pytest.mark.parametrize("method", ["fp8-tensor", "fp8-channel", "fp8-block", "gptq",
                                    "gptq-act-order", "awq", "mxfp4", "mxfp4-f4", "nvfp4"])
@pytest.mark.parametrize("tp", [2, 4])
def test_quantized_layers_are_placed_as_the_engine_shards_them(tmp_path: Path, method: str,
                                                               tp: int) -> None:
    meta = write_quantized(tmp_path, method)
    full = shards(tmp_path, "replicate", 1, 0)
    for rank in range(tp):
        got = shards(tmp_path, "llama", tp, rank)
        assert set(got) == set(meta)
        for name, (_, out_dim, in_dim, kind) in meta.items():
            want = reference_shard(full[name], out_dim, in_dim, kind, tp, rank)
            assert_same(got[name], want, (method, tp, rank, name))


# --- mixture of experts ---------------------------------------------------------------------

EXPERTS, H, INTER_E = 6, 64, 128


def write_moe(root: Path, style: str) -> dict[str, torch.Tensor]:
    """A one-layer MoE checkpoint: per-expert (mixtral, qwen) or fused expert tensors."""
    g = torch.Generator().manual_seed(1)
    t: dict[str, torch.Tensor] = {}
    attn = "model.layers.0.self_attn"
    t[f"{attn}.q_proj.weight"] = torch.randn(H, H, generator=g)
    t[f"{attn}.o_proj.weight"] = torch.randn(H, H, generator=g)
    if style == "mixtral":
        moe = "model.layers.0.block_sparse_moe"
        t[f"{moe}.gate.weight"] = torch.randn(EXPERTS, H, generator=g)
        for e in range(EXPERTS):
            for w, shape in (("w1", (INTER_E, H)), ("w3", (INTER_E, H)), ("w2", (H, INTER_E))):
                t[f"{moe}.experts.{e}.{w}.weight"] = torch.randn(shape, generator=g)
    elif style == "qwen":
        moe = "model.layers.0.mlp"
        t[f"{moe}.gate.weight"] = torch.randn(EXPERTS, H, generator=g)
        for e in range(EXPERTS):
            for w, shape in (("gate_proj", (INTER_E, H)), ("up_proj", (INTER_E, H)),
                             ("down_proj", (H, INTER_E))):
                t[f"{moe}.experts.{e}.{w}.weight"] = torch.randn(shape, generator=g)
        t[f"{moe}.shared_expert.gate_proj.weight"] = torch.randn(INTER_E, H, generator=g)
        t[f"{moe}.shared_expert.down_proj.weight"] = torch.randn(H, INTER_E, generator=g)
    else:  # fused, as Llama 4 and transformers write them: gate|up along the last dim
        moe = "model.layers.0.feed_forward"
        t[f"{moe}.router.weight"] = torch.randn(EXPERTS, H, generator=g)
        t[f"{moe}.experts.gate_up_proj"] = torch.randn(EXPERTS, H, 2 * INTER_E, generator=g)
        t[f"{moe}.experts.down_proj"] = torch.randn(EXPERTS, INTER_E, H, generator=g)
    t = {k: v.to(torch.bfloat16) for k, v in t.items()}
    root.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(t, str(root / "model.safetensors"))
    return t


_GATE_UP = ("w1", "w3", "gate_proj", "up_proj", "q_proj")
_DOWN = ("w2", "down_proj", "o_proj")


def tp_reference(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The engine's tensor-parallel MoE: every expert's intermediate dim split across ranks."""
    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if leaf in _GATE_UP:
        return full.chunk(tp, 0)[rank]
    if leaf in _DOWN:
        return full.chunk(tp, 1)[rank].contiguous()
    if leaf == "gate_up_proj":  # each half on its own: the rank's part of gate, then of up
        gate, up = full.chunk(2, -1)
        return torch.cat([gate.chunk(tp, -1)[rank], up.chunk(tp, -1)[rank]], -1)
    return full  # routers


@pytest.mark.parametrize("style", ["mixtral", "qwen", "fused"])
def test_moe_tensor_parallel_placement(tmp_path: Path, style: str) -> None:
    full = write_moe(tmp_path, style)
    for rank in range(2):
        got = shards(tmp_path, "llama", 2, rank)
        assert set(got) == set(full)
        for name, ref in full.items():
            want = ref if name.endswith("down_proj") and "experts" in name else \
                tp_reference(name, ref, 2, rank)
            if name.endswith("experts.down_proj"):  # fused [E, inter, hidden]
                want = ref.chunk(2, 1)[rank].contiguous()
            assert_same(got[name], want, (style, rank, name))


@pytest.mark.parametrize("style", ["mixtral", "qwen", "fused"])
@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (4, 1), (2, 2)])
def test_moe_expert_parallel_placement(tmp_path: Path, style: str, tp: int, dp: int) -> None:
    full = write_moe(tmp_path, style)
    ep = tp * dp
    seen: dict[int, set[int]] = {}
    if style == "fused" and EXPERTS % ep:
        with pytest.raises(PlanError, match=r"does not divide evenly by ep size \(tp x dp\)"):
            shards(tmp_path, "llama-ep", tp, 0, dp=dp)
        return
    for rank in range(ep):
        tp_rank, dp_rank = rank % tp, rank // tp
        got = shards(tmp_path, "llama-ep", tp, rank, dp=dp)
        # the engine's expert map: contiguous blocks, the first E % ep ranks one expert more
        mine = torch.arange(EXPERTS).tensor_split(ep)[dp_rank * tp + tp_rank].tolist()
        for name, ref in full.items():
            expert = name.split("experts.")[1].split(".")[0] if "experts." in name else None
            if expert is not None and expert.isdigit():
                assert (name in got) == (int(expert) in mine), (rank, name)
                if name in got:
                    assert_same(got[name], ref, (rank, name))
                    seen.setdefault(int(expert), set()).add(rank)
            elif expert is not None:  # fused [E, ...]: this rank's block of experts
                assert_same(got[name], ref.tensor_split(ep, 0)[rank].contiguous(), (rank, name))
            else:  # attention and routers as under plain tensor parallelism
                assert_same(got[name], tp_reference(name, ref, tp, tp_rank), (rank, name))
    if style != "fused":
        assert sorted(seen) == list(range(EXPERTS)) and all(len(r) == 1 for r in seen.values())


def test_gpt_oss_mxfp4_experts(tmp_path: Path) -> None:
    """gpt-oss: gate and up rows interleave; MXFP4 blocks of 32 values in 16 bytes, E8M0 scales."""
    e, hid, inter, tp = 4, 128, 256, 2
    moe = "model.layers.0.mlp.experts"
    tensors = {f"{moe}.gate_up_proj_blocks": ("U8", [e, 2 * inter, hid // 32, 16]),
               f"{moe}.gate_up_proj_scales": ("F8_E8M0", [e, 2 * inter, hid // 32]),
               f"{moe}.gate_up_proj_bias": ("BF16", [e, 2 * inter]),
               f"{moe}.down_proj_blocks": ("U8", [e, hid, inter // 32, 16]),
               f"{moe}.down_proj_scales": ("F8_E8M0", [e, hid, inter // 32]),
               f"{moe}.down_proj_bias": ("BF16", [e, hid]),
               "model.layers.0.mlp.router.weight": ("BF16", [e, hid]),
               "model.layers.0.self_attn.sinks": ("BF16", [8])}
    write_raw(tmp_path / "model.safetensors",
              {n: (d, s, random_bytes(dtypes.nbytes(d, s), i))
               for i, (n, (d, s)) in enumerate(tensors.items())})
    full = shards(tmp_path, "replicate", 1, 0)
    split = {"gate_up_proj_blocks": 1, "gate_up_proj_scales": 1, "gate_up_proj_bias": 1,
             "down_proj_blocks": 2, "down_proj_scales": 2, "sinks": 0}
    for rank in range(tp):
        got = shards(tmp_path, "gpt-oss", tp, rank)
        for name, ref in full.items():
            dim = split.get(name.rsplit(".", 1)[1])
            want = ref if dim is None else ref.chunk(tp, dim)[rank].contiguous()
            assert_same(got[name], want, (rank, name))


# --- EPLB: weights rewritten in place need copy mode ----------------------------------------


def test_share_mode_refuses_an_engine_that_rewrites_weights(tmp_path: Path) -> None:
    from vlaunch.cache.client.rewrites import ShareModeRewriteError

    write_moe(tmp_path, "mixtral")
    with pytest.raises(ShareModeRewriteError, match="EPLB rewrites weights in place") as err:
        load(str(tmp_path), mode="share", rewrites="EPLB", socket_dir=str(tmp_path / "none"))
    assert err.value.status == ExitStatus.BAD_PLAN == 78  # vlaunch run does not restart it
    got = load(str(tmp_path), mode="copy", rewrites="EPLB", socket_dir=str(tmp_path / "none"))
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    got[name].add_(1)  # copy mode: the engine's own memory, free to rewrite


def test_a_stray_write_into_share_mode_weights_names_its_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("from vlaunch.cache.store.slabs import get_backend\n"
            "from vlaunch.cache.client.rewrites import check_rewrites\n"
            "backend = get_backend('cpu')\n"
            "slab = backend.allocate(4096)\n"
            "weights = backend.import_fd(slab.export_fd(), 4096, readonly=True)\n"
            "check_rewrites('share', None)\n"
            "weights.add_(1)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                          check=False)
    assert done.returncode == -11, done.stderr  # SIGSEGV: the mapping is read-only
    assert b"Segmentation fault" in done.stderr and b"line 7" in done.stderr


# --- the same on a GPU (pytest -m gpu) ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_dtype_on_cuda_slabs(every_dtype: Path, tmp_path: Path, sockdir: Path,
                                   caches) -> None:
    """Every dtype through CUDA (VMM) slabs: share, copy and fallback, replicated and split."""
    want = expected(every_dtype)
    caches.append(spawn_cache(every_dtype, sockdir, "--plan", "replicate", "--device", "cuda:0"))
    assert caches[-1].ready, caches[-1].proc.stderr.read()  # type: ignore[union-attr]
    for mode in ("share", "copy", "fallback"):
        got = load(str(every_dtype), plan="replicate", device="cuda:0", timeout=10,
                   mode="copy" if mode == "fallback" else mode,
                   socket_dir=str(sockdir if mode != "fallback" else sockdir / "none"))
        torch.cuda.synchronize()
        assert got.source == ("disk" if mode == "fallback" else "cache")
        for name, ref in want.items():
            assert got[name].is_cuda, (mode, name)
            assert_same(got[name], ref, (mode, name))


# --- the engine's memory budget ---------------------------------------------------------------


def test_weights_held_outside_the_engine_must_fit_its_budget(caplog) -> None:
    from vlaunch.cache.client.budget import GiB, WeightBudgetError, check_external_weights

    caplog.set_level(logging.INFO, "vlaunch.cache")
    assert check_external_weights(60 * GiB, 140 * GiB, 0.9, "cuda:0") == 66 * GiB
    assert "60.00 GiB of a 126.00 GiB budget; 66.00 GiB left" in caplog.text
    with pytest.raises(WeightBudgetError) as err:
        check_external_weights(130 * GiB, 140 * GiB, 0.9, "cuda:0")
    assert "130.00 GiB mapped from the vlaunch cache, budget 126.00 GiB (0.9 x 140.00 GiB)" in \
        str(err.value)
    assert err.value.status == ExitStatus.BAD_PLAN
