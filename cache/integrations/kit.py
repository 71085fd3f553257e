"""The integration kit: the steps every engine's loader takes, whatever the engine.

An engine's loader (vLLM's and SGLang's load formats, transformers, the reference engine;
docs/add-an-engine.md walks them) builds its model with its parameters on the meta device
(`parameters_on_meta`), then:

1. `LoaderOptions.from_extra(...)`: mode, fallback, timeout and the rest, from the engine's
   loader config (a dict or a JSON string);
2. `engine_target(...)`: the rank's Target, from where the engine put it (a `Position` of its
   tensor-, pipeline- and data-parallel sizes and ranks: the global rank follows);
3. `external_bytes(...)`: what share mode will map outside the engine's memory budget, and
   the start refused when that alone exceeds the budget (`check_budget`);
4. `fetch(...)`: the rank's engine layout when the cache holds one (`layout_fields`), else
   its raw, checkpoint-shaped tensors; `Weights.outcome` says what the rank answered;
5. an engine layout: `adopt` (every parameter *is* its tensor); raw tensors: `assign` the
   ones that fit as they are, `fill` the rest through the model's own `load_weights` (every
   parameter filled, or the load refused), and, when `may_hand_back`, `hand_back_model`:
   the loaded parameters become the cache's engine layout for the next start;
6. a standby: `park(group, mode)` once every rank's weights are mapped (standby.py).

`rewritten(module)` is the engine's one policy here: True for a module whose post-load
processing may write into its parameters (quantized layers, say). Those are never a mapping:
`assign` leaves them to `fill`, and `hand_back_model` asks the cache for private copies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from vlaunch.cache.client.layout import hand_back, layout_nbytes, release_cached
from vlaunch.cache.client.loader import cached_nbytes, load
from vlaunch.cache.contract.errors import UsageError, VlaunchError
from vlaunch.cache.contract.protocol import MODES
from vlaunch.cache.contract.roles import DRAFT, TARGET
from vlaunch.cache.integrations.meta import parameters_on_meta, set_data
from vlaunch.cache.store.ranks import Position
from vlaunch.cache.store.target import Target

if TYPE_CHECKING:
    import torch

    from vlaunch.cache.client.weights import Weights

__all__ = ["LoadFormatError", "LoaderOptions", "Position", "adopt", "assign", "check_budget",
           "engine_target", "external_bytes", "fetch", "fill", "hand_back_model",
           "hand_back_tensors", "log_loaded", "may_hand_back", "parameters_on_meta", "park",
           "unfilled"]

log = logging.getLogger("vlaunch.cache.integrations")


class LoadFormatError(UsageError):
    """A vlaunch load format is misconfigured, or the cache's tensors do not fit the model."""


def never(module: torch.nn.Module) -> bool:
    """The default `rewritten`: no module's post-load processing writes into its weights."""
    return False


@dataclass(frozen=True)
class LoaderOptions:
    """The keys a vlaunch load format takes (vLLM's and SGLang's model_loader_extra_config)."""

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
            raise LoadFormatError(f"vlaunch load format: mode must be one of "
                                  f"{', '.join(MODES)}, not {self.mode!r}")

    @classmethod
    def from_extra(cls, extra: Any) -> LoaderOptions:
        """Options from an engine's loader config (a dict, a JSON string, or None)."""
        if isinstance(extra, str):
            extra = json.loads(extra) if extra.strip() else {}
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise LoadFormatError(f"vlaunch load format: unknown model_loader_extra_config "
                                  f"keys {unknown}; use {sorted(known)}")
        return cls(**extra)

    def layout(self, role: str = TARGET) -> bool:
        """Whether a load with these options maps (or hands back) an engine layout."""
        return self.engine_layout and self.mode in ("share", "copy") and role != DRAFT


def engine_target(model: str, position: Position, device: str, options: LoaderOptions,
                  role: str = TARGET) -> Target:
    """What this engine rank wants of its cache: its global rank and sizes from `position`,
    the options' fields, the rest from vlaunch run's environment (a draft: its own plan)."""
    return Target.resolve(model, rank=position.global_rank, tensor_parallel_size=position.tp_size,
                          pipeline_parallel_size=position.pp_size,
                          data_parallel_size=position.dp_size,
                          socket_dir=options.socket_dir or None, device=device,
                          plan=(options.plan or None) if role == TARGET else None,
                          kernel_backends=options.kernel_backends or None,
                          loader=options.loader, role=role)


def external_bytes(target: Target, options: LoaderOptions, layout_fields: Mapping[str, str]
                   | None, utilization: float) -> int:
    """Bytes a share-mode load will map (the engine layout's when the rank holds it, else the
    raw layout's); refuses a start whose mapped weights exceed `utilization` of the device."""
    if options.mode != "share":
        return 0
    held = layout_nbytes(target, layout_fields) if layout_fields is not None else 0
    held = held or cached_nbytes(target)
    check_budget(held, target.device, utilization)
    return held


def check_budget(nbytes: int, device: str, utilization: float) -> None:
    """Refuse to start when the mapped weights alone exceed the device memory budget."""
    if not nbytes or not device.startswith("cuda"):
        return  # a CPU engine's budget is its own setting, not a share of device memory
    import torch

    from vlaunch.cache.client.budget import check_external_weights

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    check_external_weights(nbytes, total, utilization, device)


def fetch(target: Target, options: LoaderOptions, layout_fields: Mapping[str, str] | None,
          rewrites: str | None = None) -> Weights:
    """The rank's engine layout with these fields, else its raw tensors (else, with fallback,
    the checkpoint's); `rewrites` names what rewrites weights in place (share mode refuses)."""
    return load(target, mode=options.mode, fallback=options.fallback, timeout=options.timeout,
                layout=layout_fields, rewrites=rewrites)


def may_hand_back(weights: Weights, options: LoaderOptions,
                  layout_fields: Mapping[str, str] | None) -> bool:
    """Whether to hand the loaded parameters back: share mode, layout fields, and a rank that
    served these weights or released the layout they replace (`Weights.outcome`)."""
    return (layout_fields is not None and options.mode == "share" and not weights.layout
            and weights.outcome.takes_hand_back)


def adopt(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Make each parameter its tensor of the engine layout (names, shapes, dtypes all match)."""
    params = dict(model.named_parameters())
    if params.keys() != weights.keys():
        missing = sorted(params.keys() - weights.keys())[:5]
        raise LoadFormatError(f"vlaunch load format: the engine layout does not fit this model "
                              f"(missing {missing}); bump engine_version or restart the caches")
    for name, param in params.items():
        t = weights[name]
        if t.shape != param.shape or t.dtype != param.dtype:
            raise LoadFormatError(f"vlaunch load format: engine layout tensor {name} is "
                                  f"{t.dtype} {list(t.shape)}, the model wants {param.dtype} "
                                  f"{list(param.shape)}; restart the caches")
        set_data(param, t)


def assign(model: torch.nn.Module, weights: Mapping[str, torch.Tensor],
           rewritten: Callable[[torch.nn.Module], bool] = never, *,
           same_dtype: bool = True) -> dict[str, torch.Tensor]:
    """Make each tensor that fits a meta parameter (same name, shape and, with `same_dtype`,
    dtype) of a module that is not `rewritten` that parameter, as it is (no copy; a tied
    parameter stays tied); the tensors assigned, by name."""
    assigned = {}
    for module_name, module in model.named_modules():
        if rewritten(module):
            continue
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            tensor = weights.get(full)
            if (tensor is not None and param.is_meta and tensor.shape == param.shape
                    and (tensor.dtype == param.dtype or not same_dtype)):
                set_data(param, tensor)
                assigned[full] = tensor
    return assigned


def fill(model: torch.nn.Module, weights: Mapping[str, torch.Tensor],
         assigned: Mapping[str, torch.Tensor], device: torch.device | str | None = None, *,
         load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
         complete: bool = True) -> None:
    """Allocate the parameters still on meta and let the model's `load_weights` fill them from
    the tensors not assigned. When it returns the names it loaded and `complete`, a parameter
    it did not load refuses the load."""
    import torch

    for param in model.parameters():
        if param.is_meta:
            set_data(param, torch.empty(param.shape, dtype=param.dtype, device=device))
    expected = {name for name, _ in model.named_parameters()} - set(assigned)
    loader = load_weights or model.load_weights  # type: ignore[operator]
    loaded = loader((n, t) for n, t in weights.items() if n not in assigned)
    if complete and loaded is not None:
        missing = sorted(expected - set(loaded))
        if missing:
            raise LoadFormatError(f"vlaunch load format: the cache has no tensor for "
                                  f"{', '.join(missing[:5])}; check that the cache serves "
                                  "this checkpoint with whole tensors")


def unfilled(model: torch.nn.Module) -> list[str]:
    """The parameters still on the meta device (no tensor was given them)."""
    return [n for n, p in model.named_parameters() if p.is_meta]


def hand_back_model(model: torch.nn.Module, layout_fields: Mapping[str, str], target: Target,
                    rewritten: Callable[[torch.nn.Module], bool] = never,
                    logger: logging.Logger = log) -> Weights | None:
    """Hand the loaded parameters back as the rank's engine layout and rebind them to it (the
    `rewritten` modules' as private copies); None, with a warning, when the cache refuses."""
    params = dict(model.named_parameters())
    copy = [name for name in params if rewritten(_module_of(model, name))]

    def rebind(back: Weights) -> None:
        for name, param in params.items():
            set_data(param, back[name])

    return hand_back_tensors({n: p.data for n, p in params.items()}, layout_fields, target,
                             copy, logger, rebind)


def hand_back_tensors(tensors: dict[str, torch.Tensor], layout_fields: Mapping[str, str],
                      target: Target, copy: Iterable[str] = (), logger: logging.Logger = log,
                      rebind: Callable[[Weights], object] | None = None) -> Weights | None:
    """Give the cache `tensors` as the rank's engine layout; `rebind` points the engine at the
    tensors it sends back, then `tensors` is emptied and on CUDA the freed memory goes back
    to the driver: one copy. None, with a warning, when the cache refuses."""
    try:
        back = hand_back(tensors, target, fields=layout_fields, copy=copy)
    except (VlaunchError, ValueError) as exc:
        logger.warning("vlaunch load format: could not hand the engine layout back to the "
                       "cache for rank %d (%s); the engine keeps its own copy", target.rank, exc)
        return None
    if rebind is not None:
        rebind(back)
    tensors.clear()  # the engine's own copies go (the caller drops its other references)
    release_cached(target.device)  # before the post-load processing allocates (engine-layout.md)
    return back


def _module_of(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


def log_loaded(logger: logging.Logger, target: Target, weights: Weights,
               assigned: Mapping[str, Any], seconds: float, engine: str) -> None:
    """One line for the rank's load: its engine layout's, or what was mapped and filled."""
    if weights.layout:
        logger.info("vlaunch load format: rank %d: engine layout %s: %d parameters shared, %d "
                    "copied (%s), in %.3f s", target.rank, weights.layout,
                    len(weights) - len(weights.copied), len(weights.copied),
                    ", ".join(sorted(weights.copied)[:8]) or "none", seconds)
    else:
        logger.info("vlaunch load format: %d of %d tensors mapped from the %s, the rest loaded "
                    "by %s, in %.3f s", len(assigned), len(weights), weights.source, engine,
                    seconds)


def park(group: Any, mode: str, logger: logging.Logger = log) -> float:
    """Standby: once every rank of `group` (a torch.distributed process group's coordinator:
    rank_in_group, world_size, ranks, cpu_group) mapped its weights, park until promoted; the
    seconds parked (standby.py)."""
    from vlaunch.cache.integrations.standby import park as park_group

    return park_group(group, mode, logger)
