"""The transformers helper: a model built from its config with the cached tensors assigned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import spawn_cache

transformers = pytest.importorskip("transformers")

from vlaunch.cache.integrations.hf import HFModelError, load_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved by transformers itself (safetensors, config.json)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    return root


def _logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.tensor([[1, 5, 9, 33, 2, 77, 4]])
    with torch.no_grad():
        return model(tokens).logits


def test_cached_model_outputs_equal_from_pretrained(hf_ckpt: Path, sockdir: Path,
                                                    caches) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_ckpt, dtype=torch.float32).eval()
    caches.append(spawn_cache(hf_ckpt, sockdir))
    shared = load_hf_model(str(hf_ckpt), socket_dir=str(sockdir), fallback=False, device="cpu")
    copied = load_hf_model(str(hf_ckpt), socket_dir=str(sockdir), mode="copy", device="cpu")
    from_disk = load_hf_model(str(hf_ckpt), socket_dir=str(sockdir / "none"), device="cpu")
    want = _logits(ref)
    for model in (shared, copied, from_disk):
        assert torch.equal(_logits(model), want)
    assert not any(p.is_meta for p in shared.parameters())
    assert not shared.model.embed_tokens.weight.requires_grad  # read-only mappings
    assert copied.model.embed_tokens.weight.requires_grad


def test_wrong_shapes_name_the_tensor(hf_ckpt: Path, sockdir: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(hf_ckpt)
    config.intermediate_size = 256
    with pytest.raises(HFModelError, match=r"down_proj.weight has shape \(64, 128\) but"):
        load_hf_model(str(hf_ckpt), config=config, socket_dir=str(sockdir), device="cpu")
