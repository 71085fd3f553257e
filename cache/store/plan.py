r"""Decide which bytes of a checkpoint each rank holds: rank layouts, shard plans, slices.

A shard plan is a list of rules `(regex, dim)`. For each tensor the first rule whose regex
matches the tensor's name (re.search) gives the dimension split evenly across the
tensor-parallel ranks; `None` means replicated, and a tensor no rule matches is replicated.

`load_plan(spec)` takes one of:

- a built-in name: "llama" (also fits Mistral and Qwen2 names) or "replicate";
- a plan file, JSON or TOML (by suffix: .toml is TOML, anything else JSON)::

      {"name": "mymodel", "rules": [{"pattern": "\\.qkv\\.weight$", "dim": 0},
                                    {"pattern": "\\.norm\\.", "dim": null}]}

      name = "mymodel"
      [[rules]]
      pattern = '\.qkv\.weight$'
      dim = 0
      [[rules]]
      pattern = '\.norm\.'      # no dim: replicated

  `name` is optional (default: the file's stem); a rule without `dim`, or with `"dim": null`,
  replicates; dims are non-negative integers; other keys are refused (they are likely typos);
- `module:callable`: a hook, `hook(checkpoint, layout) -> Mapping[str, torch.Tensor]`, that
  builds the rank's own pre-processed tensors (for engines whose weights are not plain slices).

Pipeline stages split the decoder layers (`model.layers.N.`) evenly and in order; when the
layer count L does not divide by pp_size, the first L % pp_size stages hold one layer more
(5 layers on 2 stages: 3 + 2). `embed_tokens` goes to the first stage, `lm_head` and the final
norm (`model.norm.`) to the last; other tensors without a layer index are on every stage.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib

from vlaunch.cache.contract.errors import PlanError, UsageError
from vlaunch.cache.store.checkpoint import Checkpoint, TensorEntry
from vlaunch.cache.store.dtypes import DTYPES, shape_problem
from vlaunch.cache.store.dtypes import nbytes as size_of

if TYPE_CHECKING:
    import torch

Run = tuple[int, int]  # (absolute file offset, length)
Block = tuple[int, int, list[tuple[int, int, int]]]  # (span offset, span length, copies)
PlanHook = Callable[[Checkpoint, "Layout"], Mapping[str, "torch.Tensor"]]

_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")
_HOOK_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


@dataclass(frozen=True)
class Layout:
    """Where a rank sits: its tensor-, pipeline- and data-parallel sizes and ranks.

    Global ranks are ordered data, then pipeline, then tensor (tensor varies fastest):
    global_rank = (dp_rank * pp_size + pp_rank) * tp_size + tp_rank.
    """

    tp_size: int
    tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for kind in ("tp", "pp", "dp"):
            size, rank = getattr(self, f"{kind}_size"), getattr(self, f"{kind}_rank")
            if type(size) is not int or size < 1:
                raise UsageError(f"{kind}_size must be an integer >= 1, got {size!r}")
            if type(rank) is not int or not 0 <= rank < size:
                raise UsageError(f"{kind}_rank must be an integer in 0..{size - 1} for "
                                 f"{kind}_size {size}, got {rank!r}")

    @property
    def world_size(self) -> int:
        """Number of ranks in all: tp_size * pp_size * dp_size."""
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def global_rank(self) -> int:
        """This rank's index in data, pipeline, tensor order."""
        return (self.dp_rank * self.pp_size + self.pp_rank) * self.tp_size + self.tp_rank

    @classmethod
    def from_global(cls, rank: int, tp_size: int, pp_size: int = 1, dp_size: int = 1) -> Layout:
        """Return the layout of global rank `rank` in a world of the given sizes."""
        world = tp_size * pp_size * dp_size
        if type(rank) is not int or not 0 <= rank < world:
            raise UsageError(f"rank must be an integer in 0..{world - 1} for tp_size "
                             f"{tp_size}, pp_size {pp_size}, dp_size {dp_size}, got {rank!r}")
        return cls(tp_size=tp_size, tp_rank=rank % tp_size,
                   pp_size=pp_size, pp_rank=rank // tp_size % pp_size,
                   dp_size=dp_size, dp_rank=rank // (tp_size * pp_size))

    def as_dict(self) -> dict[str, int]:
        """Return the six sizes and ranks by field name."""
        return {"tp_size": self.tp_size, "tp_rank": self.tp_rank, "pp_size": self.pp_size,
                "pp_rank": self.pp_rank, "dp_size": self.dp_size, "dp_rank": self.dp_rank}


@dataclass(frozen=True)
class SliceSpec:
    """The part of one checkpoint tensor a rank holds: whole, or part `part` of `parts`."""

    name: str
    dtype: str
    full_shape: tuple[int, ...]
    dim: int | None  # the split dimension; None: replicated (then part 0 of 1)
    part: int
    parts: int
    source: TensorEntry

    def __post_init__(self) -> None:
        if not 0 <= self.part < self.parts:
            raise ValueError(f"part {self.part} is not in 0..{self.parts - 1}")
        if self.dim is None:
            if self.parts != 1:
                raise ValueError("a replicated slice has exactly one part")
        elif not 0 <= self.dim < len(self.full_shape) or self.full_shape[self.dim] % self.parts:
            raise ValueError(f"cannot split shape {self.full_shape} in {self.parts} along "
                             f"dim {self.dim}")
        elif split_problem(self.dtype, self.full_shape, self.dim, self.parts):
            raise ValueError(split_problem(self.dtype, self.full_shape, self.dim, self.parts))

    @property
    def shape(self) -> tuple[int, ...]:
        """The slice's own shape."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] //= self.parts
        return tuple(shape)

    @property
    def nbytes(self) -> int:
        """Size of the slice in bytes."""
        return size_of(self.dtype, self.shape)

    def runs(self) -> list[Run]:
        """Return the slice's contiguous byte runs in the file, in row-major order."""
        if self.nbytes == 0:
            return []
        if self.dim is None or self.parts == 1:
            return [(self.source.begin, self.source.nbytes)]
        inner = math.prod(self.full_shape[self.dim + 1:]) * DTYPES[self.dtype].bits
        row = self.full_shape[self.dim] * inner // 8  # source bytes per index of outer dims
        chunk = self.shape[self.dim] * inner // 8  # whole bytes: checked in __post_init__
        first = self.source.begin + self.part * chunk
        return [(first + i * row, chunk) for i in range(math.prod(self.full_shape[:self.dim]))]

    def blocks(self, max_bytes: int, max_gap: int | None = None) -> list[Block]:
        """Group the runs into reads of at most `max_bytes` of file span each.

        Each block is (span offset, span length, [(offset in span, length, offset in the
        slice)]): read the span with one pread, then copy each run to its place in the slice.
        Runs longer than `max_bytes` are cut; a run joins the open block only while the gap
        to it is at most `max_gap` bytes (None: any gap).
        """
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        blocks: list[Block] = []
        dst = 0
        for offset, length in self.runs():
            while length:
                if blocks:
                    start, span, copies = blocks[-1]
                    room = start + max_bytes - offset
                    if room > 0 and (max_gap is None or offset - (start + span) <= max_gap):
                        take = min(length, room)
                        copies.append((offset - start, take, dst))
                        blocks[-1] = (start, offset + take - start, copies)
                        offset, length, dst = offset + take, length - take, dst + take
                        continue
                take = min(length, max_bytes)
                blocks.append((offset, take, [(0, take, dst)]))
                offset, length, dst = offset + take, length - take, dst + take
        return blocks


def split_problem(dtype: str, shape: tuple[int, ...], dim: int, parts: int) -> str:
    """Why splitting a sub-byte tensor this way would cut a byte; "" when it would not."""
    if DTYPES[dtype].bits % 8 == 0:
        return ""
    part = list(shape)
    part[dim] //= parts
    inner = math.prod(shape[dim + 1:]) * DTYPES[dtype].bits
    if part[dim] * inner % 8:
        return (f"a part of {dtype} shape {list(shape)} split {parts} ways along dim {dim} "
                "would end inside a byte")
    return shape_problem(dtype, part)


def _compile(pattern: re.Pattern[str] | str, plan: str) -> re.Pattern[str]:
    """Compile a rule's regex; PlanError if it is not one."""
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise PlanError(f"plan {plan}: pattern {pattern!r} is not a string; write the regex "
                        "as a string")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise PlanError(f"plan {plan}: pattern {pattern!r} is not a valid regex ({e}); fix "
                        "the rule") from None


def _check_dim(dim: object, pattern: object, plan: str) -> int | None:
    """Return a rule's dim if it is None or a non-negative integer; PlanError otherwise."""
    if dim is None or (type(dim) is int and dim >= 0):
        return dim  # type: ignore[return-value]
    raise PlanError(f"plan {plan}: rule {getattr(pattern, 'pattern', pattern)!r} has dim "
                    f"{dim!r}; use a non-negative integer, or no dim to replicate")


@dataclass(frozen=True)
class ShardPlan:
    """Name rules that give each tensor its split dimension; the first match wins."""

    name: str
    rules: tuple[tuple[re.Pattern[str] | str, int | None], ...]
    identity: str = ""  # for the fingerprint; default: the name and a hash of the rules

    def __post_init__(self) -> None:
        rules = tuple((_compile(p, self.name), _check_dim(d, p, self.name)) for p, d in self.rules)
        object.__setattr__(self, "rules", rules)
        if not self.identity:
            text = json.dumps([[p.pattern, d] for p, d in rules])
            digest = hashlib.sha256(text.encode()).hexdigest()
            object.__setattr__(self, "identity", f"builtin:{self.name}:sha256:{digest}")

    def split_dim(self, name: str) -> int | None:
        """Return the dimension to split tensor `name` along, or None to replicate it."""
        for pattern, dim in self.rules:
            if re.search(pattern, name):
                return dim
        return None


@dataclass(frozen=True)
class HookPlan:
    """A plan whose hook builds the rank's tensors itself."""

    spec: str  # "module:callable"
    fn: PlanHook = field(compare=False)

    @property
    def identity(self) -> str:
        """The plan's identity for the fingerprint."""
        return f"hook:{self.spec}"

    def build(self, checkpoint: Checkpoint, layout: Layout) -> dict[str, torch.Tensor]:
        """Call the hook and check that it returned a mapping of names to tensors."""
        import torch

        out = self.fn(checkpoint, layout)
        if not isinstance(out, Mapping):
            raise PlanError(f"plan hook {self.spec} returned {type(out).__name__}, not a "
                            "mapping of names to tensors; fix the hook")
        for key, value in out.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise PlanError(f"plan hook {self.spec} returned {key!r}: "
                                f"{type(value).__name__}; keys must be names and values "
                                "tensors; fix the hook")
        return dict(out)


Plan = ShardPlan | HookPlan

_COLUMN = r"(?:^|\.)(?:q_proj|k_proj|v_proj|gate_proj|up_proj)\.(?:weight|bias)$"
LLAMA_PLAN = ShardPlan("llama", (
    (_COLUMN, 0),
    (r"(?:^|\.)(?:embed_tokens|lm_head)\.weight$", 0),
    (r"(?:^|\.)(?:o_proj|down_proj)\.weight$", 1),
))
"""Llama-style names (also Mistral, Qwen2): q/k/v/gate/up and their biases, the embedding
and lm_head split rows; o_proj and down_proj weights split columns; the rest (norms,
o_proj/down_proj biases, quantization scales) is replicated."""

REPLICATE_PLAN = ShardPlan("replicate", ())
"""Every tensor whole on every rank."""

BUILTIN_PLANS: dict[str, ShardPlan] = {"llama": LLAMA_PLAN, "replicate": REPLICATE_PLAN}


def load_plan(spec: str) -> Plan:
    """Return the plan `spec` names: a built-in name, a plan file or `module:callable`."""
    if spec in BUILTIN_PLANS:
        return BUILTIN_PLANS[spec]
    path = Path(spec)
    if path.is_file():
        return _load_plan_file(path)
    if path.suffix in (".json", ".toml"):
        raise PlanError(f"plan file {spec} does not exist; check the path")
    if _HOOK_SPEC.fullmatch(spec):
        return HookPlan(spec, load_hook(spec))
    raise PlanError(f"unknown plan {spec!r}; use one of {', '.join(BUILTIN_PLANS)}, a .json or "
                    ".toml plan file, or a hook as module:callable")


def load_hook(spec: str) -> PlanHook:
    """Import the hook `module:callable` and return it."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PlanError(f"plan hook {spec!r} is not module:callable; write it as "
                        "package.module:function")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # importing runs arbitrary code, which may raise anything
        raise PlanError(f"plan hook {spec}: cannot import {module_name}: {e!r}; check that the "
                        "module is on PYTHONPATH and imports cleanly") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlanError(f"plan hook {spec}: {module_name} has no attribute {attr}; check "
                            "the name after the colon")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PlanError(f"plan hook {spec}: {attr} is a {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]


def plan_rank(ckpt: Checkpoint, plan: ShardPlan, layout: Layout) -> list[SliceSpec]:
    """Return the slices rank `layout` holds, in checkpoint order."""
    stage_of = _stage_filter(ckpt, layout.pp_size)
    slices = []
    for entry in ckpt.tensors.values():
        if stage_of(entry.name) in (None, layout.pp_rank):
            slices.append(_slice(entry, plan, layout))
    return slices


def _slice(entry: TensorEntry, plan: ShardPlan, layout: Layout) -> SliceSpec:
    """Return the tensor-parallel slice of `entry` that rank `layout` holds."""
    dim = plan.split_dim(entry.name)
    shape = "[" + ",".join(map(str, entry.shape)) + "]"
    if dim is not None and dim >= len(entry.shape):
        raise PlanError(f"plan {plan.name}: tensor {entry.name!r} of shape {shape} has no "
                        f"dimension {dim} to split; add a rule for it to a plan file")
    if dim is not None and entry.shape[dim] % layout.tp_size:
        raise PlanError(f"plan {plan.name}: tensor {entry.name!r} of shape {shape}: dimension "
                        f"{dim} (size {entry.shape[dim]}) does not divide evenly by tp size "
                        f"{layout.tp_size}; use a tp size that divides it, or a plan file or "
                        "hook for this model")
    if dim is not None and (why := split_problem(entry.dtype, entry.shape, dim, layout.tp_size)):
        raise PlanError(f"plan {plan.name}: tensor {entry.name!r}: {why}; use a tp size that "
                        "keeps whole bytes, or split it along another dimension")
    parts, part = (1, 0) if dim is None else (layout.tp_size, layout.tp_rank)
    return SliceSpec(name=entry.name, dtype=entry.dtype, full_shape=entry.shape, dim=dim,
                     part=part, parts=parts, source=entry)


def _stage_filter(ckpt: Checkpoint, pp_size: int) -> Callable[[str], int | None]:
    """Return a function giving a tensor name's pipeline stage, or None for every stage."""
    if pp_size == 1:
        return lambda name: None
    indices = [int(m.group(1)) for name in ckpt.tensors if (m := _LAYER.search(name))]
    layers = max(indices) + 1 if indices else 0
    if pp_size > layers:
        raise PlanError(f"pp size {pp_size} exceeds the {layers} layers of the checkpoint "
                        f"{ckpt.root}; use at most {layers} pipeline stages")
    base, extra = divmod(layers, pp_size)
    # stage s starts at s * base + min(s, extra): the first `extra` stages hold base + 1 layers
    starts = [s * base + min(s, extra) for s in range(pp_size)]

    def stage_of(name: str) -> int | None:
        if m := _LAYER.search(name):
            return bisect.bisect_right(starts, int(m.group(1))) - 1
        if "embed_tokens" in name:
            return 0
        if "lm_head" in name or "model.norm." in name:
            return pp_size - 1
        return None

    return stage_of


def _load_plan_file(path: Path) -> ShardPlan:
    """Read a JSON or TOML plan file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PlanError(f"plan file {path} cannot be read: {e.strerror}; check the path and "
                        "its permissions") from None
    try:
        if path.suffix == ".toml":
            obj: Any = tomllib.loads(data.decode("utf-8"))
        else:
            obj = json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, TOMLDecodeError, bad UTF-8
        raise PlanError(f"plan file {path} cannot be parsed: {e}; fix its syntax") from None
    if not isinstance(obj, dict) or not set(obj) <= {"name", "rules"}:
        raise PlanError(f"plan file {path} must be an object with keys 'name' and 'rules' "
                        "only; fix the file")
    rules = obj.get("rules")
    name = obj.get("name", path.stem)
    if not isinstance(rules, list) or not isinstance(name, str):
        raise PlanError(f"plan file {path}: 'rules' must be a list and 'name' a string")
    for i, rule in enumerate(rules):
        if (not isinstance(rule, dict) or "pattern" not in rule
                or not set(rule) <= {"pattern", "dim"}):
            raise PlanError(f"plan file {path}: rule {i} must have a 'pattern' and an optional "
                            f"'dim', nothing else; got {rule!r}")
    digest = hashlib.sha256(data).hexdigest()
    try:
        return ShardPlan(name, tuple((r["pattern"], r.get("dim")) for r in rules),
                         identity=f"file:sha256:{digest}")
    except PlanError as e:
        raise PlanError(f"plan file {path}: {e}") from None

