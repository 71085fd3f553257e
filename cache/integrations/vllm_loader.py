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
but never writes into the mapped ones. vLLM slices tensor-parallel shards itself, so the
cache must hold whole tensors: at tensor-parallel size > 1 run the caches with
`--plan replicate`.

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
from vlaunch.cache.contract.launch import EngineEnv
from vlaunch.cache.contract.protocol import MODES

if TYPE_CHECKING:
    import torch

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
    plan: str = ""  # default: the plan vlaunch run names (EngineEnv), else "replicate"
    kernel_backends: str = ""
    loader: str = "vlaunch"

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

    def plan_for(self, tp_size: int) -> str:
        """The cache's plan; vLLM slices shards itself, so it needs whole tensors."""
        plan = self.plan or EngineEnv.from_env().plan or "replicate"
        if tp_size > 1 and plan != "replicate":
            raise VllmLoaderError(f"vlaunch load format: plan {plan!r} at tensor-parallel size "
                                  f"{tp_size}: vLLM slices the shards itself and needs whole "
                                  "tensors; run the caches with --plan replicate")
        return plan


def register() -> None:
    """The `vllm.general_plugins` entry point: add the `vlaunch` load format."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

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
            if self.options.mode != "share":
                return 0
            from vlaunch.cache.client.loader import cached_nbytes

            model = vllm_config.model_config.model
            return cached_nbytes(model, **_where(vllm_config, self.options))

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            """Fill an already built model from the cache (vLLM's reload path): copies."""
            weights = self._cached(model_config, None)
            _fill(model, weights, {}, model_config)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            """Build on meta, take the cache's tensors, let the model finish its loading."""
            import torch
            from vllm.model_executor.model_loader.utils import process_weights_after_loading
            from vllm.utils.torch_utils import set_default_torch_dtype

            from vlaunch.cache.integrations.meta import parameters_on_meta

            start = time.perf_counter()
            load_device = vllm_config.load_config.device or vllm_config.device_config.device
            target = torch.device(load_device)
            weights = self._cached(model_config, vllm_config)
            with set_default_torch_dtype(model_config.dtype):
                with target, parameters_on_meta():
                    model = self.create_model(vllm_config=vllm_config,
                                              model_config=model_config, prefix=prefix)
                share = self.options.mode == "share" and weights.source == "cache"
                assigned = _assign(model, weights) if share else {}
                _fill(model, weights, assigned, model_config, target)
                process_weights_after_loading(model, model_config, target)
            log.info("vlaunch load format: %d of %d tensors mapped from the %s, the rest "
                     "loaded by vLLM, in %.3f s", len(assigned), len(weights), weights.source,
                     time.perf_counter() - start)
            return model.eval()

        def _cached(self, model_config: Any, vllm_config: Any) -> Any:
            from vllm.config import get_current_vllm_config

            from vlaunch.cache.client.loader import load

            config = vllm_config or get_current_vllm_config()
            return load(model_config.model, mode=self.options.mode,
                        fallback=self.options.fallback, timeout=self.options.timeout,
                        **_where(config, self.options))

    return VlaunchModelLoader


def _where(vllm_config: Any, options: LoaderOptions) -> dict[str, Any]:
    """The rank, sizes, socket dir, device and fingerprint fields of this vLLM worker."""
    import torch
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

    par = vllm_config.parallel_config
    tp, pp, dp = par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size
    dp_rank = par.data_parallel_rank if dp > 1 else 0
    rank = (dp_rank * pp + get_pp_group().rank_in_group) * tp + get_tensor_model_parallel_rank()
    device = str(vllm_config.device_config.device)
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    return {"rank": rank, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
            "data_parallel_size": dp, "socket_dir": options.socket_dir or None,
            "device": device, "plan": options.plan_for(tp),
            "kernel_backends": options.kernel_backends or None, "loader": options.loader}


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
