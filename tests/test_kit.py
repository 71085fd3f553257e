"""The integration kit (cache/integrations/kit.py) with a tiny engine of its own: a real cache
rank on CPU slabs, a model built on meta with one fused parameter, its own `load_weights`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import llama_tensors, spawn_cache
from vlaunch.cache.client.loader import outcome_of
from vlaunch.cache.client.weights import Outcome
from vlaunch.cache.contract.errors import (
    CacheBrokenError,
    CacheUnavailableError,
    FingerprintMismatchError,
)
from vlaunch.cache.integrations import kit

FIELDS = {"engine": "tiny", "engine_version": "1"}
QKV = "model.layers.0.self_attn.qkv_proj.weight"


class Tiny(torch.nn.Module):
    """An engine's model: the embedding as the checkpoint has it, layer 0's q, k and v fused
    into one parameter (its load_weights fuses them), the rest of the checkpoint ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(256, 32, dtype=torch.bfloat16)
        attn = torch.nn.Module()
        attn.qkv_proj = torch.nn.Linear(32, 128, bias=False, dtype=torch.bfloat16)
        layer = torch.nn.Module()
        layer.self_attn = attn
        self.model.layers = torch.nn.ModuleList([layer])

    def load_weights(self, weights: object) -> set[str]:
        parts = {n: t for n, t in weights if n.startswith("model.layers.0.self_attn.")}  # type: ignore[attr-defined]
        fused = [parts[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
        self.get_parameter(QKV).data.copy_(torch.cat(fused))
        return {QKV}


def build() -> Tiny:
    with kit.parameters_on_meta():
        return Tiny()


def test_the_kit_loads_hands_back_and_adopts(llama_ckpt: Path, sockdir: Path, caches) -> None:
    caches.append(spawn_cache(llama_ckpt, sockdir))
    options = kit.LoaderOptions.from_extra(json.dumps({"socket_dir": str(sockdir),
                                                       "fallback": False}))
    target = kit.engine_target(str(llama_ckpt), kit.Position(1, 0), "cpu", options)
    ref = llama_tensors()
    qkv = torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])

    weights = kit.fetch(target, options, FIELDS)  # the first start: no engine layout yet
    assert weights.outcome is Outcome.SERVED and not weights.layout
    model = build()
    assigned = kit.assign(model, weights)
    assert set(assigned) == {"model.embed_tokens.weight"}  # the one that fits as it is
    assert model.model.embed_tokens.weight.data_ptr() == weights[
        "model.embed_tokens.weight"].data_ptr()  # the mapping itself, no copy
    kit.fill(model, weights, assigned, "cpu")
    assert torch.equal(model.get_parameter(QKV), qkv) and not kit.unfilled(model)
    assert kit.may_hand_back(weights, options, FIELDS)
    back = kit.hand_back_model(model, FIELDS, target)
    assert back is not None and back.layout and model.get_parameter(QKV).data_ptr() == \
        back[QKV].data_ptr()
    del weights, back

    again = kit.fetch(target, options, FIELDS)  # a later start: the engine layout
    assert again.layout and again.outcome is Outcome.SERVED
    assert not kit.may_hand_back(again, options, FIELDS)
    fresh = build()
    kit.adopt(fresh, again)
    assert torch.equal(fresh.get_parameter(QKV), qkv)
    assert torch.equal(fresh.model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    wrong = {**again, QKV: again[QKV][:64]}
    with pytest.raises(kit.LoadFormatError, match=r"engine layout tensor .*qkv_proj"):
        kit.adopt(build(), wrong)


def test_fill_refuses_a_parameter_the_model_did_not_load(llama_ckpt: Path, sockdir: Path,
                                                         caches) -> None:
    caches.append(spawn_cache(llama_ckpt, sockdir))
    options = kit.LoaderOptions(socket_dir=str(sockdir), engine_layout=False)
    weights = kit.fetch(kit.engine_target(str(llama_ckpt), kit.Position(1, 0), "cpu", options),
                        options, None)
    with pytest.raises(kit.LoadFormatError, match=r"the cache has no tensor for .*embed_tokens"):
        kit.fill(build(), weights, {})  # nothing assigned: its load_weights skips the embedding


def test_a_copy_release_rank_answers_released_and_takes_a_hand_back(
        llama_ckpt: Path, sockdir: Path, caches) -> None:
    caches.append(spawn_cache(llama_ckpt, sockdir))
    options = kit.LoaderOptions(socket_dir=str(sockdir))
    target = kit.engine_target(str(llama_ckpt), kit.Position(1, 0), "cpu", options)
    kit.fetch(target, kit.LoaderOptions(socket_dir=str(sockdir), mode="copy-release"), None)
    again = kit.fetch(target, options, FIELDS)
    assert again.source == "disk" and again.outcome is Outcome.RELEASED
    assert kit.may_hand_back(again, options, FIELDS)


@pytest.mark.parametrize(("error", "outcome"), [
    (CacheBrokenError("cache at s answered released: gone", "released"), Outcome.RELEASED),
    (CacheBrokenError("the checkpoint changed on disk", "changed"), Outcome.CHANGED),
    (CacheBrokenError("mentions released, code says otherwise", "refused"), Outcome.BROKEN),
    (CacheBrokenError("released, but the reply failed validation"), Outcome.BROKEN),
    (CacheUnavailableError("at its bound", "busy"), Outcome.BUSY),
    (CacheUnavailableError("no cache"), Outcome.UNAVAILABLE),
    (FingerprintMismatchError([("dtype", "bf16", "f16")]), Outcome.MISMATCH),
])
def test_the_outcome_is_the_rank_code_never_its_text(error: Exception, outcome: Outcome) -> None:
    assert outcome_of(error) is outcome  # type: ignore[arg-type]
    assert outcome.takes_hand_back == (outcome is Outcome.RELEASED)


def test_options_refuse_what_they_do_not_know() -> None:
    with pytest.raises(kit.LoadFormatError, match="unknown model_loader_extra_config keys"):
        kit.LoaderOptions.from_extra({"mdoe": "copy"})
    with pytest.raises(kit.LoadFormatError, match="mode must be one of"):
        kit.LoaderOptions(mode="mmap")
    assert kit.Position(2, 1, 2, 1).global_rank == 3  # (dp 0 * pp 2 + pp 1) * tp 2 + tp 1
