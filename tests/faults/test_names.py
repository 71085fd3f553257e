"""One tensor-name rule: the checkpoint reader refuses (65) what every client would refuse."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from vlaunch.cache.contract.errors import CacheBrokenError, CheckpointError
from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.cache.store.checkpoint import open_checkpoint
from vlaunch.cache.store.manifest import MAX_NAME, Manifest, pack, tensor_name_problem

from .harness import assert_gone, start_rank

BAD = {"empty": "", "too long": "w" * (MAX_NAME + 1), "control character": "a\x00b",
       "newline": "layer\n.weight", "lone surrogate": "\ud800"}


def _checkpoint(path: Path, name: str) -> Path:
    """A one-tensor safetensors file written by hand (the library may refuse the name)."""
    header = json.dumps({name: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                        ensure_ascii=True).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    return path


@pytest.mark.parametrize("kind", sorted(BAD))
def test_the_reader_and_the_client_apply_the_same_rule(tmp_path: Path, kind: str) -> None:
    name = BAD[kind]
    problem = tensor_name_problem(name)
    assert problem
    with pytest.raises(CheckpointError, match="rename the tensor") as caught:
        open_checkpoint(_checkpoint(tmp_path / "m.safetensors", name))
    assert problem in str(caught.value) and caught.value.status == ExitStatus.BAD_CHECKPOINT
    wire = pack([("ok.weight", "F32", (2,))], backend="cpu", alignment=256,
                max_slab=1 << 20).to_wire()
    wire["tensors"][0][0] = name
    with pytest.raises(CacheBrokenError, match="bad tensor name"):
        Manifest.from_wire(wire)


def test_names_at_the_limit_are_fine() -> None:
    assert not tensor_name_problem("é" * (MAX_NAME // 2))
    assert not tensor_name_problem("model.layers.0.self_attn.q_proj.weight")


def test_a_rank_on_such_a_checkpoint_exits_65(tmp_path: Path, sockdir: Path) -> None:
    r = start_rank(_checkpoint(tmp_path / "m.safetensors", ""), sockdir)
    assert not r.ready and r.proc.wait(60) == ExitStatus.BAD_CHECKPOINT
    assert "a tensor name must be a non-empty string" in r.text()
    assert_gone([r.pid], sockdir)
