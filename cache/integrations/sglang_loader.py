"""SGLang's vlaunch load format: each rank takes its weights from its vlaunch cache (SGLang 0.5).

SGLang's `get_model_loader` takes a loader class as `LoadConfig.load_format` and calls
`load_format(load_config).load_model(model_config=..., device_config=...)`; `loader_class()`
is that class, built on the integration kit alone (kit.py, docs/add-an-engine.md):

    from vlaunch.cache.integrations.sglang_loader import loader_class
    LoadConfig(load_format=loader_class(), model_loader_extra_config={"mode": "share"})

A rank builds SGLang's model on meta; a parameter equal in name, shape and dtype to a cached
tensor, in a layer whose post-load processing only reads it (SGLang's unquantized linear and
embedding methods: on a CPU with AMX they repack into new tensors), *is* that tensor; the
model's own `load_weights` fills the rest (fused qkv_proj and gate_up_proj, slices);
then SGLang's post-load processing runs. In share mode the first start hands the loaded
parameters back as the rank's engine layout, and later starts map it. The options are the
kit's (`model_loader_extra_config`); the rest comes from the environment `vlaunch run` sets.
At tensor-parallel size > 1 SGLang's weight loaders slice whole tensors: with a sliced plan a
rank without its engine layout reads the checkpoint through SGLang's default loader, then
hands back (with `--plan replicate` it loads from the cache's whole tensors).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

from vlaunch.cache.integrations import kit

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.store.target import Target

log = logging.getLogger("sglang.vlaunch")

# Layers whose process_weights_after_loading reads the weight (or replaces it), never writes.
_READ_ONLY_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def loader_class() -> type:
    """SGLang's BaseModelLoader subclass for vlaunch (SGLang is imported only here)."""
    from sglang.srt.model_loader.loader import BaseModelLoader

    class VlaunchSGLangLoader(BaseModelLoader):  # type: ignore[misc]
        """Weights from the rank's vlaunch cache; SGLang's own load_weights for the rest."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = kit.LoaderOptions.from_extra(load_config.model_loader_extra_config)

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the checkpoint is a local directory the cache read."""

        def load_model(self, *, model_config: Any, device_config: Any) -> torch.nn.Module:
            """Build on meta, take the cache's tensors, let SGLang finish its loading."""
            return load_model(self, model_config, device_config)

    return VlaunchSGLangLoader


def sglang_target(model_config: Any, device_config: Any, options: kit.LoaderOptions) -> Target:
    """What this SGLang rank wants of its cache: its tensor- and pipeline-parallel place."""
    import torch
    from sglang.srt.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    pp = get_pp_group()
    position = kit.Position(get_tensor_model_parallel_world_size(),
                            get_tensor_model_parallel_rank(), pp.world_size, pp.rank_in_group)
    device = str(device_config.device)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    return kit.engine_target(model_config.model_path, position, device, options)


def layout_fields(model_config: Any, device_config: Any) -> dict[str, str]:
    """What shapes SGLang's per-rank parameters beyond the raw fingerprint (engine layout)."""
    import sglang

    hf = model_config.hf_config
    text = hf.to_json_string() if hasattr(hf, "to_json_string") else repr(hf)
    return {"engine": "sglang", "engine_version": str(sglang.__version__),
            "model_config": hashlib.sha256(text.encode()).hexdigest()[:16],
            "sglang_dtype": str(model_config.dtype).removeprefix("torch."),
            "sglang_quantization": str(getattr(model_config, "quantization", None) or "none"),
            "sglang_device": str(device_config.device), "stage": "after-load-weights"}


def load_model(loader: Any, model_config: Any, device_config: Any) -> torch.nn.Module:
    """Build SGLang's model on meta, take the cache's tensors (its engine layout, else the raw
    layout, then handed back), then run SGLang's post-load processing."""
    import torch
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        _get_quantization_config,
        _initialize_model,
    )
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    start = time.perf_counter()
    options = loader.options
    device = torch.device(device_config.device)
    target = sglang_target(model_config, device_config, options)
    fields = layout_fields(model_config, device_config) if options.layout(target.role) else None
    weights = kit.fetch(target, options, fields)
    quant_config = _get_quantization_config(model_config, loader.load_config)
    complete = quant_config is None
    with set_default_torch_dtype(model_config.dtype):
        with device, kit.parameters_on_meta():
            model = _initialize_model(model_config, loader.load_config, quant_config)
        if weights.layout:  # SGLang's own per-rank parameters: no load_weights
            kit.adopt(model, weights)
            assigned = dict(weights)
        elif target.position.tp_size > 1 and target.plan != "replicate" and \
                weights.source == "cache":  # sliced: SGLang's weight loaders slice the files
            assigned = {}
            kit.fill(model, _disk_weights(loader.load_config, model_config, model), {}, device,
                     complete=complete)
        else:
            share = options.mode == "share" and weights.source == "cache"
            assigned = kit.assign(model, weights, _rewritten) if share else {}
            kit.fill(model, weights, assigned, device, complete=complete)
        if not weights.layout and kit.may_hand_back(weights, options, fields):
            weights = kit.hand_back_model(model, fields, target, _rewritten, log) or weights
        DefaultModelLoader.postprocess_weights(model, device)
    kit.log_loaded(log, target, weights, assigned, time.perf_counter() - start, "SGLang")
    return model.eval()


def _rewritten(module: torch.nn.Module) -> bool:
    """True for a layer whose post-load processing may write into its parameters."""
    method = getattr(module, "quant_method", None)
    return method is not None and type(method).__name__ not in _READ_ONLY_METHODS


def _disk_weights(load_config: Any, model_config: Any, model: Any) -> Any:
    """The checkpoint's whole tensors through SGLang's default loader."""
    import copy

    from sglang.srt.configs.load_config import LoadFormat
    from sglang.srt.model_loader.loader import DefaultModelLoader

    plain = copy.copy(load_config)  # its loader refuses vlaunch's format and extra keys
    plain.load_format, plain.model_loader_extra_config = LoadFormat.AUTO, {}
    return dict(DefaultModelLoader(plain)._get_all_weights(model_config, model))
