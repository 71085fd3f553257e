"""vLLM's `--load-format vlaunch`: each worker rank takes its weights from its vlaunch cache.

Registered through the `vllm.general_plugins` entry point (`pip install 'vlaunch[vllm]'`), so
it is present in every vLLM process. What is not vLLM's is the integration kit's (kit.py,
docs/add-an-engine.md). A rank builds the model on meta; a parameter equal in name, shape and
dtype to a cached tensor, in a layer whose post-load processing only reads it (vLLM's
unquantized linear and embedding methods), *is* that tensor (share mode: the cache's
read-only mapping); the model's `load_weights` fills the rest (fused qkv_proj and
gate_up_proj, padding, casts, slices, quantized layers); `process_weights_after_loading`
then replaces some weights (on CPU it repacks every linear weight) but never writes into
mapped ones.

Engine layout (docs/engine-layout.md; on by default in share mode): after the first
`load_weights` a rank hands its parameters back in vLLM's per-rank layout; later starts map
it, quantized layers as copies. Its fields include the attention backend vLLM's selector
picks. At TP > 1 with a sliced plan, a rank without its engine layout reads the checkpoint
with vLLM's own loader, then hands back. `--enable-eplb` refuses share mode; on a GPU, mapped
weights beyond `--gpu-memory-utilization` refuse the start. A standby parks in `load_model`
once its weights are mapped (standby.py). Options: `--model-loader-extra-config` (JSON,
kit.LoaderOptions); the rest from the environment `vlaunch run` sets.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.roles import DRAFT, TARGET
from vlaunch.cache.contract.standby import is_standby, parks_before_weights
from vlaunch.cache.integrations import kit
from vlaunch.cache.store.target import Target

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.client.weights import Weights

log = logging.getLogger("vllm.vlaunch")  # under vLLM's logger: its handlers print it

LOAD_FORMAT = "vlaunch"
# Layers whose process_weights_after_loading reads the weight and never writes into it.
_READ_ONLY_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def register() -> None:
    """The `vllm.general_plugins` entry point: add the `vlaunch` load format."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    from vlaunch.cache.integrations.standby import export_promote_pipe

    export_promote_pipe()  # a standby: name the promote pipe before vLLM starts its children
    from vlaunch.cache.integrations.vllm_serve import install

    install()  # vlaunch run --listen: the API server serves the passed socket (vllm_serve.py)
    if LOAD_FORMAT not in _LOAD_FORMAT_TO_MODEL_LOADER:
        register_model_loader(LOAD_FORMAT)(_loader_class())


def _loader_class() -> type:
    """The BaseModelLoader subclass (defined here: vLLM is imported only when it runs)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class VlaunchModelLoader(BaseModelLoader):  # type: ignore[misc]
        """Weights from the rank's vlaunch cache; vLLM's own loader for what must change."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = kit.LoaderOptions.from_extra(load_config.model_loader_extra_config)

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the checkpoint is a local directory the cache read."""

        def get_external_weight_memory(self, vllm_config: Any) -> int:
            """Bytes the rank will map from its cache (share mode), for vLLM's budget."""
            return external_bytes(vllm_config, self.options)

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            """Fill an already built model from the cache (vLLM's reload path): copies."""
            from vllm.config import get_current_vllm_config

            config = get_current_vllm_config()
            target = vllm_target(config, model_config, self.options)
            kit.fill(model, _fetch(target, self.options, config, None), {},
                     complete=getattr(model_config, "quantization", None) is None)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            """Build on meta, take the cache's tensors, let the model finish its loading."""
            return load_model(self, vllm_config, model_config, prefix)

    return VlaunchModelLoader


def vllm_target(vllm_config: Any, model_config: Any, options: kit.LoaderOptions) -> Target:
    """What this vLLM worker wants of its cache: where vLLM's parallel config puts it, its
    device, the load format's options; a speculative draft model's load asks the draft group
    (its plan: VLAUNCH_DRAFT_PLAN)."""
    import torch
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    par = vllm_config.parallel_config
    dp = par.data_parallel_size
    position = kit.Position(par.tensor_parallel_size, get_tensor_model_parallel_rank(),
                            par.pipeline_parallel_size, get_pp_group().rank_in_group,
                            dp, par.data_parallel_rank if dp > 1 else 0)
    device = str(vllm_config.device_config.device)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    return kit.engine_target(model_config.model, position, device, options,
                             draft_role(vllm_config, model_config))


def external_bytes(vllm_config: Any, options: kit.LoaderOptions) -> int:
    """Bytes the rank will map from its cache in share mode; refuses a start whose mapped
    weights exceed --gpu-memory-utilization of the device."""
    if options.mode != "share":
        return 0
    target = vllm_target(vllm_config, vllm_config.model_config, options)
    fields = layout_fields(vllm_config, vllm_config.model_config) if options.engine_layout \
        else None
    return kit.external_bytes(target, options, fields,
                              vllm_config.cache_config.gpu_memory_utilization)


def load_model(loader: Any, vllm_config: Any, model_config: Any, prefix: str) -> Any:
    """Build the model on meta, take the cache's tensors (its engine layout, else the raw
    layout, handed back as the engine layout), then let vLLM finish its post-load processing."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    start = time.perf_counter()
    options = loader.options
    device = torch.device(vllm_config.load_config.device or vllm_config.device_config.device)
    target = vllm_target(vllm_config, model_config, options)
    fields = layout_fields(vllm_config, model_config) if options.layout(target.role) else None
    early = parks_before_weights()  # an in-place swap's standby (docs/swap.md)
    if early:  # devices and groups up, no weight mapped: park before the cache's
        start += _park(options.mode)
    weights = _fetch(target, options, vllm_config, fields)
    with set_default_torch_dtype(model_config.dtype):
        with device, kit.parameters_on_meta():
            model = loader.create_model(vllm_config=vllm_config, model_config=model_config,
                                        prefix=prefix)
        if weights.layout:  # vLLM's own per-rank parameters: no load_weights
            kit.adopt(model, weights)
            assigned = dict(weights)
        else:
            assigned = _fill_raw(loader, model, weights, model_config, device, target)
            if kit.may_hand_back(weights, options, fields):
                weights = kit.hand_back_model(model, fields, target, _rewritten, log) or weights
        if is_standby() and not early:  # weights mapped, nothing exclusive taken: park here
            start += _park(options.mode)  # the log line times the load only
        process_weights_after_loading(model, model_config, device)
    kit.log_loaded(log, target, weights, assigned, time.perf_counter() - start, "vLLM")
    return model.eval()


def _park(mode: str) -> float:
    """Park this standby's ranks (vLLM's world group) until promoted; the seconds parked."""
    from vllm.distributed.parallel_state import get_world_group

    return kit.park(get_world_group(), mode, log)


def _fill_raw(loader: Any, model: Any, weights: Weights, model_config: Any, device: Any,
              target: Target) -> dict[str, Any]:
    """Fill the model from the raw layout (whole tensors) or, sliced, the checkpoint."""
    complete = getattr(model_config, "quantization", None) is None
    whole = target.position.tp_size == 1 or target.plan == "replicate"
    if not whole and weights.source == "cache":  # sliced: vLLM slices from the files
        kit.fill(model, _disk_weights(loader.load_config, model_config, model), {}, device,
                 complete=complete)
        return {}
    share = loader.options.mode == "share" and weights.source == "cache"
    assigned = kit.assign(model, weights, _rewritten) if share else {}
    kit.fill(model, weights, assigned, device, complete=complete)
    return assigned


def _fetch(target: Target, options: kit.LoaderOptions, vllm_config: Any,
           fields: dict[str, str] | None) -> Weights:
    """The rank's weights from its cache (or, with fallback, from disk); EPLB rewrites them."""
    eplb = getattr(vllm_config.parallel_config, "enable_eplb", False)
    return kit.fetch(target, options, fields, rewrites="EPLB" if eplb else None)


def _rewritten(module: torch.nn.Module) -> bool:
    """True for a layer whose post-load processing may write into its parameters."""
    method = getattr(module, "quant_method", None)
    return method is not None and type(method).__name__ not in _READ_ONLY_METHODS


def draft_role(vllm_config: Any, model_config: Any) -> str:
    """The cache group of this load: draft when vLLM loads its speculative draft model
    (speculative_config's draft model config, another checkpoint than the target's)."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None or model_config is vllm_config.model_config:
        return TARGET
    same = getattr(draft, "model", None) == getattr(model_config, "model", None)
    return DRAFT if same and model_config.model != vllm_config.model_config.model else TARGET


def layout_fields(vllm_config: Any, model_config: Any) -> dict[str, str]:
    """What shapes vLLM's per-rank parameters beyond the raw fingerprint (engine layout)."""
    import hashlib

    import vllm

    hf = getattr(model_config.hf_config, "to_json_string", lambda: repr(model_config.hf_config))
    return {"engine": "vllm", "engine_version": str(vllm.__version__),
            "model_config": hashlib.sha256(hf().encode()).hexdigest()[:16],
            "vllm_dtype": str(model_config.dtype).removeprefix("torch."),
            "vllm_quantization": str(getattr(model_config, "quantization", None) or "none"),
            "vllm_device": str(vllm_config.device_config.device_type),
            "vllm_attention_backend": attention_backend(vllm_config, model_config),
            "stage": "after-load-weights"}


def attention_backend(vllm_config: Any, model_config: Any) -> str:
    """The attention backend vLLM picks for this model's full-attention layers (its selector's
    answer, which the kernel selection environment variables alone do not tell)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(model_config.get_head_size(), model_config.dtype,
                                       vllm_config.cache_config.cache_dtype,
                                       use_mla=bool(getattr(model_config, "use_mla", False)))
    except (ValueError, RuntimeError, ImportError, AttributeError) as exc:
        # a model the selector cannot answer for before it is built: the field still names
        # that, the same way on every start
        log.info("vlaunch load format: no attention backend to record (%s)", exc)
        return "unresolved"
    return str(backend.get_name())


def _disk_weights(load_config: Any, model_config: Any, model: Any) -> dict[str, Any]:
    """The checkpoint's whole tensors through vLLM's default loader (a sliced raw layout
    cannot feed vLLM's weight loaders)."""
    import copy

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    plain = copy.copy(load_config)  # vLLM's loader refuses vlaunch's format and extra keys
    plain.load_format, plain.model_loader_extra_config = "safetensors", {}
    source = DefaultModelLoader(plain)
    return dict(source.get_all_weights(model_config, model))
