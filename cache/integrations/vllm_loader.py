"""vLLM's `--load-format vlaunch`: each worker rank takes its weights from its vlaunch cache.

Registered through the `vllm.general_plugins` entry point (`pip install 'vlaunch[vllm]'`), so
it is present in every vLLM process. Each rank builds the model with its parameters on the meta
device and asks its cache (`vlaunch.cache.load`) for the checkpoint's tensors:

- a parameter whose name, shape and dtype equal a cached tensor's, in a layer whose
  post-load processing only reads it (no quantization method, or vLLM's unquantized linear
  and embedding methods), *is* the cached tensor: in share mode the cache's read-only mapping
  (no copy), in the copy modes the engine's own copy;
- every other parameter (the fused qkv_proj and gate_up_proj, vocabulary padding, a tensor
  cast to another dtype, tensor-parallel slices, quantized layers) is allocated by vLLM and
  filled by the model's own `load_weights` from the cached tensors, as from a checkpoint;

then the model finishes its post-load processing (`process_weights_after_loading`), which
replaces some weights with new tensors (on CPU, every linear weight is repacked for oneDNN)
but never writes into the mapped ones.

Engine layout (docs/engine-layout.md; `engine_layout`, on by default in share mode): once its
`load_weights` ran, a rank hands its parameters back to its cache, in vLLM's own per-rank
layout (fused, sliced, padded, quantized as loaded), and the cache drops its raw layout.
Later starts map that layout: no checkpoint, no `load_weights`, only the post-load
processing; every parameter is then the cache's mapping except those of layers whose
post-load processing may write into them (quantized layers), which are copied. At
tensor-parallel size > 1 `load_weights` needs whole tensors: with the default sliced plan
(`llama`) a rank without its engine layout reads the checkpoint with vLLM's own loader
instead, hands back, and from then on its cache holds 1/N of the model; with `--plan
replicate` it loads from the cache's whole tensors.

The engine layout's fields include the attention backend vLLM's selector picks. With EPLB
(`--enable-eplb`, experts rewritten in place) share mode is refused before anything is mapped;
on a GPU, mapped weights beyond `--gpu-memory-utilization` of the device refuse the start.

A standby engine (`vlaunch run --standby`, docs/standby.md) parks in `load_model` once its
weights are mapped, before the post-load processing (vllm_standby.py).

Options come from `--model-loader-extra-config` (JSON): mode, fallback, timeout, socket_dir,
plan, kernel_backends, loader; the rest from the environment `vlaunch run` sets.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.errors import UsageError
from vlaunch.cache.contract.protocol import MODES
from vlaunch.cache.contract.roles import DRAFT, TARGET
from vlaunch.cache.contract.standby import is_standby, parks_before_weights
from vlaunch.cache.store.target import Target

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.client.weights import Weights

log = logging.getLogger("vllm.vlaunch")  # under vLLM's logger: its handlers print it

LOAD_FORMAT = "vlaunch"
# Layers whose process_weights_after_loading reads the weight and never writes into it.
_READ_ONLY_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


class VllmLoaderError(UsageError):
    """The vlaunch load format is misconfigured for this vLLM engine."""


@dataclass(frozen=True)
class LoaderOptions:
    """The `--model-loader-extra-config` keys the vlaunch load format takes."""

    mode: str = "share"
    fallback: bool = True
    timeout: float = 60.0
    socket_dir: str = ""
    plan: str = ""  # default: the plan vlaunch run names (EngineEnv), else DEFAULT_PLAN
    kernel_backends: str = ""
    loader: str = "vlaunch"
    engine_layout: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise VllmLoaderError(f"vlaunch load format: mode must be one of "
                                  f"{', '.join(MODES)}, not {self.mode!r}")

    @classmethod
    def from_extra(cls, extra: Any) -> LoaderOptions:
        """Options from vLLM's model_loader_extra_config (a dict or a JSON string)."""
        if isinstance(extra, str):
            extra = json.loads(extra) if extra.strip() else {}
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise VllmLoaderError(f"vlaunch load format: unknown model_loader_extra_config "
                                  f"keys {unknown}; use {sorted(known)}")
        return cls(**extra)


def register() -> None:
    """The `vllm.general_plugins` entry point: add the `vlaunch` load format."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    from vlaunch.cache.integrations.vllm_standby import export_promote_pipe

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
            self.options = LoaderOptions.from_extra(load_config.model_loader_extra_config)

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the checkpoint is a local directory the cache read."""

        def get_external_weight_memory(self, vllm_config: Any) -> int:
            """Bytes the rank will map from its cache (share mode), for vLLM's budget."""
            return external_bytes(vllm_config, self.options)

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            """Fill an already built model from the cache (vLLM's reload path): copies."""
            config = get_vllm_config()
            target = vllm_target(config, model_config, self.options)
            _fill(model, _cached(target, self.options, config, None), {}, model_config)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            """Build on meta, take the cache's tensors, let the model finish its loading."""
            return load_model(self, vllm_config, model_config, prefix)

    return VlaunchModelLoader


def vllm_target(vllm_config: Any, model_config: Any, options: LoaderOptions) -> Target:
    """What this vLLM worker wants of its cache: its rank and sizes from vLLM's parallel
    config, its device, the load format's options, the rest from vlaunch run's environment;
    a speculative draft model's load asks the draft group (its plan: VLAUNCH_DRAFT_PLAN)."""
    import torch
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    par = vllm_config.parallel_config
    tp, pp, dp = par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size
    dp_rank = par.data_parallel_rank if dp > 1 else 0
    rank = (dp_rank * pp + get_pp_group().rank_in_group) * tp + get_tensor_model_parallel_rank()
    device = str(vllm_config.device_config.device)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    role = draft_role(vllm_config, model_config)
    return Target.resolve(model_config.model, rank=rank, tensor_parallel_size=tp,
                          pipeline_parallel_size=pp, data_parallel_size=dp,
                          socket_dir=options.socket_dir or None, device=device,
                          plan=(options.plan or None) if role == TARGET else None,
                          kernel_backends=options.kernel_backends or None,
                          loader=options.loader, role=role)


def external_bytes(vllm_config: Any, options: LoaderOptions) -> int:
    """Bytes the rank will map from its cache in share mode (its engine layout's, else the
    raw layout's); refuses a start whose mapped weights exceed the GPU memory budget."""
    if options.mode != "share":
        return 0
    from vlaunch.cache.client.layout import layout_nbytes
    from vlaunch.cache.client.loader import cached_nbytes

    target = vllm_target(vllm_config, vllm_config.model_config, options)
    held = 0
    if options.engine_layout:  # the engine layout, when the rank holds it
        held = layout_nbytes(target, layout_fields(vllm_config, vllm_config.model_config))
    held = held or cached_nbytes(target)
    _check_budget(held, vllm_config, target.device)
    return held


def load_model(loader: Any, vllm_config: Any, model_config: Any, prefix: str) -> Any:
    """Build the model on meta, take the cache's tensors (its engine layout, else the raw
    layout, handed back as the engine layout), then let vLLM finish its post-load processing."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vlaunch.cache.integrations.meta import parameters_on_meta

    start = time.perf_counter()
    options = loader.options
    device = torch.device(vllm_config.load_config.device or vllm_config.device_config.device)
    target = vllm_target(vllm_config, model_config, options)
    fields = (layout_fields(vllm_config, model_config) if options.engine_layout
              and options.mode in ("share", "copy") and target.role != DRAFT else None)
    early = parks_before_weights()  # an in-place swap's standby (docs/swap.md)
    if early:  # devices and groups up, no weight mapped: park before the cache's
        from vlaunch.cache.integrations.vllm_standby import park

        start += park(options.mode)
    weights = _cached(target, options, vllm_config, fields)
    with set_default_torch_dtype(model_config.dtype):
        with device, parameters_on_meta():
            model = loader.create_model(vllm_config=vllm_config, model_config=model_config,
                                        prefix=prefix)
        if weights.layout:  # vLLM's own per-rank parameters: no load_weights
            _adopt_layout(model, weights)
            assigned = dict(weights)
        else:
            assigned = _fill_raw(loader, model, weights, model_config, device, target)
            if fields is not None and options.mode == "share" and (
                    weights.source == "cache" or "released" in weights.reason):
                weights = _hand_back(model, fields, target) or weights
        if is_standby() and not early:  # weights mapped, nothing exclusive taken: park here
            from vlaunch.cache.integrations.vllm_standby import park

            start += park(options.mode)  # the log line times the load only
        process_weights_after_loading(model, model_config, device)
    _log_loaded(target, weights, assigned, time.perf_counter() - start)
    return model.eval()


def _log_loaded(target: Target, weights: Weights, assigned: dict[str, Any], seconds: float
                ) -> None:
    if weights.layout:
        log.info("vlaunch load format: rank %d: engine layout %s: %d parameters shared, %d "
                 "copied (%s), in %.3f s", target.rank, weights.layout,
                 len(weights) - len(weights.copied), len(weights.copied),
                 ", ".join(sorted(weights.copied)[:8]) or "none", seconds)
    else:
        log.info("vlaunch load format: %d of %d tensors mapped from the %s, the rest loaded by "
                 "vLLM, in %.3f s", len(assigned), len(weights), weights.source, seconds)


def _fill_raw(loader: Any, model: Any, weights: Weights, model_config: Any, device: Any,
              target: Target) -> dict[str, Any]:
    """Fill the model from the raw layout (whole tensors) or, sliced, the checkpoint."""
    whole = target.position.tp_size == 1 or target.plan == "replicate"
    if not whole and weights.source == "cache":  # sliced: vLLM slices from the files
        _fill(model, _disk_weights(loader.load_config, model_config, model), {}, model_config,
              device)
        return {}
    share = loader.options.mode == "share" and weights.source == "cache"
    assigned = _assign(model, weights) if share else {}
    _fill(model, weights, assigned, model_config, device)
    return assigned


def _cached(target: Target, options: LoaderOptions, vllm_config: Any, layout: Any) -> Weights:
    """The rank's weights from its cache (or, with fallback, from disk)."""
    from vlaunch.cache.client.loader import load

    eplb = getattr(vllm_config.parallel_config, "enable_eplb", False)
    return load(target, mode=options.mode, fallback=options.fallback, timeout=options.timeout,
                layout=layout, rewrites="EPLB" if eplb else None)


def draft_role(vllm_config: Any, model_config: Any) -> str:
    """The cache group of this load: draft when vLLM loads its speculative draft model
    (speculative_config's draft model config, another checkpoint than the target's)."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None or model_config is vllm_config.model_config:
        return "target"
    same = getattr(draft, "model", None) == getattr(model_config, "model", None)
    return "draft" if same and model_config.model != vllm_config.model_config.model \
        else "target"


def get_vllm_config() -> Any:
    """The vLLM config of the running engine."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


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


def _check_budget(nbytes: int, vllm_config: Any, device: str) -> None:
    """Refuse to start when the mapped weights alone exceed the GPU memory budget."""
    if not nbytes or not device.startswith("cuda"):
        return  # vLLM's CPU budget is VLLM_CPU_KVCACHE_SPACE, not a share of device memory
    import torch

    from vlaunch.cache.client.budget import check_external_weights

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    check_external_weights(nbytes, total, vllm_config.cache_config.gpu_memory_utilization,
                           device)


def _adopt_layout(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Make each parameter its tensor of the engine layout (shape and dtype must match)."""
    from vlaunch.cache.integrations.meta import set_data

    params = dict(model.named_parameters())
    if params.keys() != weights.keys():
        missing = sorted(params.keys() - weights.keys())[:5]
        raise VllmLoaderError(f"vlaunch load format: the engine layout does not fit this model "
                              f"(missing {missing}); bump engine_version or restart the caches")
    for name, param in params.items():
        t = weights[name]
        if t.shape != param.shape or t.dtype != param.dtype:
            raise VllmLoaderError(f"vlaunch load format: engine layout tensor {name} is "
                                  f"{t.dtype} {list(t.shape)}, the model wants {param.dtype} "
                                  f"{list(param.shape)}; restart the caches")
        set_data(param, t)


def _hand_back(model: torch.nn.Module, fields: dict[str, str], target: Target) -> Any:
    """Hand the loaded parameters back as the rank's engine layout and rebind them to it;
    None (with a warning) when the cache refuses."""
    from vlaunch.cache.client.layout import hand_back, release_cached
    from vlaunch.cache.contract.errors import VlaunchError
    from vlaunch.cache.integrations.meta import set_data

    params = dict(model.named_parameters())
    copy = [name for name in params if _rewritten(model, name)]
    try:
        back = hand_back({n: p.data for n, p in params.items()}, target, fields=fields,
                         copy=copy)
    except (VlaunchError, ValueError) as exc:
        log.warning("vlaunch load format: could not hand the engine layout back to the cache "
                    "(%s); vLLM keeps its own copy", exc)
        return None
    for name, param in params.items():
        set_data(param, back[name])
    # vLLM's own copies went with the dict handed back; on CUDA give their memory back to the
    # driver before the post-load processing allocates (one copy, docs/engine-layout.md)
    release_cached(target.device)
    return back


def _rewritten(model: torch.nn.Module, name: str) -> bool:
    """True for a parameter of a layer whose post-load processing may write into it."""
    module = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    method = getattr(module, "quant_method", None)
    return method is not None and type(method).__name__ not in _READ_ONLY_METHODS


def _disk_weights(load_config: Any, model_config: Any, model: Any) -> dict[str, Any]:
    """The checkpoint's whole tensors through vLLM's default loader (a sliced raw layout
    cannot feed vLLM's weight loaders)."""
    import copy

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    plain = copy.copy(load_config)  # vLLM's loader refuses vlaunch's format and extra keys
    plain.load_format, plain.model_loader_extra_config = "safetensors", {}
    source = DefaultModelLoader(plain)
    return dict(source.get_all_weights(model_config, model))


def _assign(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Make each cached tensor that fits a read-only-processed parameter that parameter."""
    from vlaunch.cache.integrations.meta import set_data

    assigned = {}
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in _READ_ONLY_METHODS:
            continue
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            tensor = weights.get(full)
            if (tensor is not None and param.is_meta and tensor.shape == param.shape
                    and tensor.dtype == param.dtype):
                set_data(param, tensor)
                assigned[full] = tensor
    return assigned


def _fill(model: torch.nn.Module, weights: dict[str, torch.Tensor],
          assigned: dict[str, torch.Tensor], model_config: Any,
          target: torch.device | None = None) -> None:
    """Allocate the other parameters and let the model's load_weights fill them."""
    import torch

    from vlaunch.cache.integrations.meta import set_data

    for param in model.parameters():
        if param.is_meta:
            set_data(param, torch.empty(param.shape, dtype=param.dtype, device=target))
    expected = {name for name, _ in model.named_parameters()} - set(assigned)
    loaded = model.load_weights((n, t) for n, t in weights.items() if n not in assigned)
    if loaded is not None and getattr(model_config, "quantization", None) is None:
        missing = sorted(expected - set(loaded))
        if missing:
            raise VllmLoaderError(f"vlaunch load format: the cache has no tensor for "
                                  f"{', '.join(missing[:5])}; check that the cache serves "
                                  "this checkpoint with whole tensors")
