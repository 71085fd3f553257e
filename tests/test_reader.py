"""The reader: every rank's slices land bit-exactly, split spans are read whole and split once."""

from __future__ import annotations

import itertools
import mmap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlaunch.cache.store import registered
from vlaunch.cache.store.checkpoint import open_checkpoint
from vlaunch.cache.store.manifest import pack, views
from vlaunch.cache.store.pieces import NARROW, pieces
from vlaunch.cache.store.plan import LLAMA_PLAN, Position, plan_rank
from vlaunch.cache.store.reader import fill
from vlaunch.cache.store.registered import window_copies, windows
from vlaunch.cache.store.shard import PlainBackend
from vlaunch.cache.store.slabs import CpuBackend

from .conftest import llama_tensors


def _odd_tensors() -> dict[str, torch.Tensor]:
    """Tensors whose split parts are 1, 2, 4 and 8 bytes wide per row (every word size)."""
    g = torch.Generator().manual_seed(1)
    raw = {"model.layers.0.self_attn.o_proj.weight": (torch.int8, (7, 12)),
           "model.layers.0.mlp.down_proj.weight": (torch.float16, (5, 8)),
           "model.layers.1.self_attn.o_proj.weight": (torch.float32, (9, 8)),
           "model.layers.1.mlp.down_proj.weight": (torch.float64, (3, 4)),
           "model.layers.1.self_attn.q_proj.weight": (torch.int8, (12, 3))}
    out = {}
    for name, (dtype, shape) in raw.items():
        bits = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,),
                             dtype=torch.uint8, generator=g)
        out[name] = bits.view(dtype).reshape(shape)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-shard Llama-named checkpoint plus odd-width splits, one tensor at an odd offset."""
    root = tmp_path_factory.mktemp("reader")
    tensors = llama_tensors(layers=3) | _odd_tensors()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, str(root / "a.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(root / "b.safetensors"))
    return root


def _expected(root: Path) -> dict[str, torch.Tensor]:
    return load_file(str(root / "a.safetensors")) | load_file(str(root / "b.safetensors"))


def _load(root: Path, position: Position, chunk: int, threads: int,
          backend: object) -> dict[str, torch.Tensor]:
    specs = plan_rank(open_checkpoint(root), LLAMA_PLAN, position)
    manifest = pack([(s.name, s.dtype, s.shape) for s in specs], backend="cpu", alignment=256,
                    max_slab=1 << 30)
    slabs = [backend.allocate(size) for size in manifest.slab_sizes]  # type: ignore[attr-defined]
    tensors = [s.tensor() for s in slabs]
    for t in tensors:
        t.fill_(0xA5)  # poison: every byte must be written
    fill(specs, manifest, tensors, threads=threads, chunk=chunk)
    return {k: v.cpu() for k, v in views(manifest, tensors).items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _check_rank(root: Path, position: Position, got: dict[str, torch.Tensor]) -> None:
    full = _expected(root)
    specs = plan_rank(open_checkpoint(root), LLAMA_PLAN, position)
    assert sorted(got) == sorted(s.name for s in specs)
    for spec in specs:
        want = full[spec.name]
        if spec.dim is not None:
            want = want.chunk(spec.parts, spec.dim)[spec.part]
        assert got[spec.name].shape == want.shape, spec.name
        assert torch.equal(_bits(got[spec.name]), _bits(want)), spec.name


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("chunk", [96, 4096, 64 << 20])
@pytest.mark.parametrize("split_read", ["span", "gather"])
def test_every_rank_matches_a_disk_load(ckpt: Path, tp: int, pp: int, chunk: int,
                                        split_read: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLAUNCH_SPLIT_READ", split_read)
    for rank in range(tp * pp):
        position = Position.from_global(rank, tp, pp)
        _check_rank(ckpt, position, _load(ckpt, position, chunk, 3, CpuBackend()))


def test_plain_backend_on_cpu_matches_too(ckpt: Path) -> None:
    position = Position.from_global(3, 4, 2)
    _check_rank(ckpt, position, _load(ckpt, position, 200, 2, PlainBackend("cpu")))


def test_narrow_split_is_read_as_spans_of_whole_rows(ckpt: Path) -> None:
    specs = {s.name: s for s in plan_rank(open_checkpoint(ckpt), LLAMA_PLAN, Position(2, 1))}
    down = specs["model.layers.2.mlp.down_proj.weight"]  # (32, 128) bf16: rows of 256 bytes
    got = pieces(down, 1024)
    assert [(p.rows, p.row, p.lo, p.width) for p in got] == [(4, 256, 128, 128)] * 8
    assert [p.offset for p in got] == [down.source.begin + 1024 * i for i in range(8)]
    assert [p.at for p in got] == [512 * i for i in range(8)]
    assert sum(p.nbytes for p in got) == down.nbytes
    q = specs["model.layers.2.self_attn.q_proj.weight"]  # a row split: contiguous pieces
    assert all(p.contiguous for p in pieces(q, 1024))
    assert sum(p.span for p in pieces(q, 1000)) == q.nbytes
    assert max(p.span for p in pieces(q, 1000)) <= 1000


def test_gathered_pieces_are_sized_by_the_bytes_kept(ckpt: Path) -> None:
    down = {s.name: s for s in plan_rank(open_checkpoint(ckpt), LLAMA_PLAN, Position(4, 3))}[
        "model.layers.2.mlp.down_proj.weight"]  # 256-byte rows, 64 bytes kept of each
    got = pieces(down, 200, packed=True)
    assert [(p.rows, p.row, p.lo, p.width) for p in got[:2]] == [(3, 256, 192, 64)] * 2
    assert all(p.nbytes <= 200 for p in got) and sum(p.nbytes for p in got) == down.nbytes


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("chunk", [8, 96, 200, 4096])
def test_no_piece_outgrows_the_staging_buffer(ckpt: Path, packed: bool, chunk: int) -> None:
    for tp, pp in [(1, 1), (2, 1), (4, 2)]:
        for rank in range(tp * pp):
            for spec in plan_rank(open_checkpoint(ckpt), LLAMA_PLAN, Position.from_global(
                    rank, tp, pp)):
                got = pieces(spec, chunk, packed=packed)
                assert sum(p.nbytes for p in got) == spec.nbytes
                assert all((p.nbytes if packed else p.span) <= chunk for p in got), spec.name


def test_wide_or_long_rows_are_read_where_they_lie(ckpt: Path) -> None:
    down = {s.name: s for s in plan_rank(open_checkpoint(ckpt), LLAMA_PLAN, Position(2, 1))}[
        "model.layers.2.mlp.down_proj.weight"]
    row_longer_than_chunk = pieces(down, 200)  # 256-byte rows: each rank's 128 bytes alone
    assert all(p.contiguous and p.span == 128 for p in row_longer_than_chunk)
    assert [p.offset for p in row_longer_than_chunk] == [off for off, _ in down.runs()]
    assert NARROW >= 1 << 16  # parts this wide are read alone; the tests' tensors are narrower


def test_registration_windows_cover_every_piece_once_in_order() -> None:
    spans = [(0, 10), (10, 30), (70, 5), (95, 40), (200, 1), (130, 0)]
    got = windows(spans, size=203, window=32)
    assert [(start, length) for start, length, _ in got] == [
        (0, 32), (32, 32), (64, 32), (96, 32), (128, 32), (192, 11)]
    assert sorted(i for _, _, ready in got for i in ready) == [0, 1, 2, 3, 4]
    seen = set()
    for start, _, ready in got:
        seen.add(start)
        for i in ready:  # every window a piece touches is registered by the time it is ready
            offset, length = spans[i]
            assert {k * 32 for k in range(offset // 32, (offset + length - 1) // 32 + 1)} <= seen


@pytest.mark.parametrize("window", [8, 24, 64, 4096])
@pytest.mark.parametrize(("rows", "row", "lo", "width"),
                         [(1, 100, 0, 100), (7, 12, 4, 4), (5, 30, 0, 10), (9, 16, 8, 8),
                          (3, 50, 13, 37), (40, 3, 1, 1)])
def test_window_copies_move_each_kept_byte_once_inside_its_window(
        rows: int, row: int, lo: int, width: int, window: int) -> None:
    """The registered reader's copies, replayed on the host: bit-exact, never across windows."""
    import numpy as np

    from vlaunch.cache.store.pieces import Piece

    file = np.arange(1000, dtype=np.int64).astype(np.uint8) ^ 0x5A
    offset = 37
    piece = Piece(offset, rows, row, lo, width, 0)
    want = file[offset:offset + rows * row].reshape(rows, row)[:, lo:lo + width].reshape(-1)
    got = np.zeros(rows * width, dtype=np.uint8)
    written = np.zeros(rows * width, dtype=np.int64)
    for start in range(0, 1000, window):
        for c in window_copies(piece, start, start + window):
            assert start <= c.src and c.src + (c.height - 1) * c.pitch + c.width <= start + window
            for r in range(c.height):
                src = c.src + r * c.pitch
                dst = c.dst + r * c.width
                got[dst:dst + c.width] = file[src:src + c.width]
                written[dst:dst + c.width] += 1
    assert (written == 1).all()
    assert (got == want).all()


@pytest.mark.gpu
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (4, 2)])
@pytest.mark.parametrize(("reader", "split_read"), [("staging", "span"), ("staging", "gather"),
                                                    ("register", "span"),
                                                    ("register-windows", "span")])
def test_cuda_ranks_match_a_disk_load(ckpt: Path, tp: int, pp: int, reader: str,
                                      split_read: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if reader == "register-windows":  # pieces that span many registered windows
        reader = "register"
        monkeypatch.setattr(registered, "WINDOW", 2 * mmap.PAGESIZE)
    monkeypatch.setenv("VLAUNCH_SPLIT_READ", split_read)
    monkeypatch.setenv("VLAUNCH_READER", reader)
    for rank, chunk in itertools.product(range(tp * pp), (96, 64 << 20)):
        position = Position.from_global(rank, tp, pp)
        _check_rank(ckpt, position, _load(ckpt, position, chunk, 4, PlainBackend("cuda")))


def test_reader_mode_is_staging_unless_register_is_asked_for(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from vlaunch.cache.store import reader

    for mode, want in (("register", "register"), ("staging", "staging"), ("", "staging"),
                       ("bogus", "staging")):
        monkeypatch.setenv("VLAUNCH_READER", mode)
        assert reader.reader_mode() == want, mode
    assert "VLAUNCH_READER=bogus is not one of staging, register" in caplog.text
