"""A Hugging Face transformers model whose weights come from the vlaunch cache.

`load_hf_model(model_dir)` builds the model from its `config.json` with every parameter on the
meta device (buffers such as rotary frequencies are computed as usual: they are small and not
in the checkpoint), then assigns the rank's cached tensors to the parameters: in share mode the
parameters are the cache's read-only mappings (no copy), in the copy modes the engine's own
copies. A restarted server or evaluation job has its weights in milliseconds.

transformers is imported only here: `pip install 'vlaunch[hf]'`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vlaunch.cache.client.loader import load
from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.integrations import kit
from vlaunch.cache.store.target import Target

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vlaunch.cache.integrations.hf")


class HFModelError(UsageError):
    """The cached tensors do not fit the transformers model built from the config."""


def load_hf_model(target: Target | str, *, model_class: Any = None, mode: str = "share",
                  config: Any = None, **load_kwargs: Any) -> torch.nn.Module:
    """A transformers model (eval mode) with its weights from the vlaunch cache.

    `target`: a Target, or the model directory (then `load_kwargs` may name the rest of it:
    rank, socket_dir, device, plan, ...); `load_kwargs` also take load()'s fallback and
    timeout. `model_class` defaults to `AutoModelForCausalLM`; `config` to `AutoConfig` of the
    directory. The tensors keep the checkpoint's dtype. Share-mode parameters are read-only:
    do not train or modify them in place (use mode="copy" for that).
    """
    import transformers

    model_dir = target.model if isinstance(target, Target) else target
    config = config or transformers.AutoConfig.from_pretrained(model_dir)
    model_class = model_class or transformers.AutoModelForCausalLM
    with kit.parameters_on_meta():
        model = model_class.from_config(config)
    weights = load(target, mode=mode, **load_kwargs)
    assign(model, weights, read_only=mode == "share" and weights.source == "cache")
    log.info("transformers model %s: weights from %s (%d bytes outside the engine)",
             type(model).__name__, weights.source, weights.bytes_outside)
    return model.eval()


def assign(model: torch.nn.Module, tensors: dict[str, torch.Tensor], *,
           read_only: bool = False) -> None:
    """Make `tensors` the parameters of `model` (no copy), then tie its shared weights."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise HFModelError(f"the cache holds tensors the transformers model does not have: "
                           f"{', '.join(unknown[:5])}; check that the cache serves this "
                           "model with a tensor-parallel size of 1")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise HFModelError(f"cached tensor {name} has shape {tuple(tensor.shape)} but the "
                               f"model expects {tuple(params[name].shape)}; check that the "
                               "cache serves this model with a tensor-parallel size of 1")
    kit.assign(model, tensors, same_dtype=False)  # the tensors keep the checkpoint's dtype
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = kit.unfilled(model)
    if missing:
        raise HFModelError(f"no cached tensor for {', '.join(missing[:5])}; check that the "
                           "checkpoint has every weight of the model")
    if read_only:
        for param in model.parameters():
            param.requires_grad_(False)
