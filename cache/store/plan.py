r"""Decide which bytes of a checkpoint each rank holds: rank layouts, shard plans, slices.

A shard plan is a list of rules `(regex, dim)`. For each tensor the first rule whose regex
matches the tensor's name (re.search) gives the dimension split evenly across the
tensor-parallel ranks; `None` means replicated, and a tensor no rule matches is replicated.

`load_plan(spec)` takes one of:

- a built-in name: "llama" (also fits Mistral, Mixtral, Qwen2/3, their MoE and quantized
  layers), "llama-ep" (the same with whole experts per rank), "gpt-oss" or "replicate";
- a plan file, JSON or TOML (by suffix: .toml is TOML, anything else JSON)::

      {"name": "mymodel", "rules": [{"pattern": "\\.qkv\\.weight$", "dim": 0},
                                    {"pattern": "\\.norm\\.", "dim": null}]}

      name = "mymodel"
      [[rules]]
      pattern = '\.qkv\.weight$'
      dim = 0
      [[rules]]
      pattern = '\.norm\.'      # no dim: replicated

  `"experts": "ep"` places whole experts on ranks; a rule's `"blocks": 2` splits a fused
  gate|up dimension half by half.
  `name` is optional (default: the file's stem); a rule without `dim`, or with `"dim": null`,
  replicates; dims are non-negative integers; other keys are refused (they are likely typos);
- `module:callable`: a hook, `hook(checkpoint, position) -> Mapping[str, torch.Tensor]`, that
  builds the rank's own pre-processed tensors (for engines whose weights are not plain slices).

Pipeline stages split the decoder layers (`model.layers.N.`) evenly and in order; when the
layer count L does not divide by pp_size, the first L % pp_size stages hold one layer more
(5 layers on 2 stages: 3 + 2). `embed_tokens` goes to the first stage, `lm_head` and the final
norm (`model.norm.`) to the last; other tensors without a layer index are on every stage.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import importlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlaunch.cache.contract.errors import PlanError
from vlaunch.cache.store.builtin_plans import BUILTIN, rules_identity
from vlaunch.cache.store.checkpoint import Checkpoint, TensorEntry
from vlaunch.cache.store.dtypes import DTYPES, shape_problem
from vlaunch.cache.store.dtypes import nbytes as size_of
from vlaunch.cache.store.ranks import Position

if TYPE_CHECKING:
    import torch

Run = tuple[int, int]  # (absolute file offset, length)
Block = tuple[int, int, list[tuple[int, int, int]]]  # (span offset, span length, copies)
PlanHook = Callable[[Checkpoint, "Position"], Mapping[str, "torch.Tensor"]]

_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")
_HOOK_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


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
    groups: int = 1  # the dim holds `groups` equal blocks (fused gate|up), each split in parts

    def __post_init__(self) -> None:
        if self.dim is None and self.parts == 1 and self.groups == 1 and self.part == 0:
            return  # replicated: nothing to check (most tensors of an MoE checkpoint)
        if not 0 <= self.part < self.parts:
            raise ValueError(f"part {self.part} is not in 0..{self.parts - 1}")
        pieces = self.parts * self.groups
        if self.dim is None:
            if self.parts != 1 or self.groups != 1:
                raise ValueError("a replicated slice has exactly one part")
        elif not 0 <= self.dim < len(self.full_shape) or self.full_shape[self.dim] % pieces:
            raise ValueError(f"cannot split shape {self.full_shape} in {pieces} along "
                             f"dim {self.dim}")
        elif split_problem(self.dtype, self.full_shape, self.dim, pieces):
            raise ValueError(split_problem(self.dtype, self.full_shape, self.dim, pieces))

    @classmethod
    def whole(cls, entry: TensorEntry) -> SliceSpec:
        """A replicated slice of `entry`: nothing to check, so made without the dataclass's
        frozen __init__, which costs several times more (every tensor of an MoE checkpoint)."""
        spec = object.__new__(cls)
        spec.__dict__.update(name=entry.name, dtype=entry.dtype, full_shape=entry.shape,
                             dim=None, part=0, parts=1, source=entry, groups=1,
                             nbytes=entry.nbytes)
        return spec

    @property
    def shape(self) -> tuple[int, ...]:
        """The slice's own shape."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] //= self.parts
        return tuple(shape)

    @functools.cached_property
    def nbytes(self) -> int:
        """Size of the slice in bytes (made once: the reader asks for it several times)."""
        return size_of(self.dtype, self.shape)

    def runs(self) -> list[Run]:
        """Return the slice's contiguous byte runs in the file, in row-major order."""
        if self.nbytes == 0:
            return []
        if self.dim is None or self.parts == 1:
            return [(self.source.begin, self.source.nbytes)]
        inner = math.prod(self.full_shape[self.dim + 1:]) * DTYPES[self.dtype].bits
        row = self.full_shape[self.dim] * inner // 8  # source bytes per index of outer dims
        block = row // self.groups  # one group (gate or up) of the fused dim
        chunk = self.shape[self.dim] // self.groups * inner // 8  # whole bytes: __post_init__
        first = self.source.begin + self.part * chunk
        return [(first + i * row + g * block, chunk)
                for i in range(math.prod(self.full_shape[:self.dim])) for g in range(self.groups)]

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


def _check_blocks(blocks: object, pattern: object, plan: str) -> int:
    """Return a fused rule's block count if it is an integer >= 1; PlanError otherwise."""
    if type(blocks) is int and blocks >= 1:
        return blocks
    raise PlanError(f"plan {plan}: fused rule {getattr(pattern, 'pattern', pattern)!r} has "
                    f"blocks {blocks!r}; use an integer >= 1 (2 for a fused gate and up)")


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
    # (regex, blocks): the split dim holds `blocks` equal blocks (fused gate|up), each split
    fused: tuple[tuple[re.Pattern[str] | str, int], ...] = ()
    experts: str = "tp"  # "tp": experts split like dense layers; "ep": whole experts per rank

    def __post_init__(self) -> None:
        rules = tuple((_compile(p, self.name), _check_dim(d, p, self.name)) for p, d in self.rules)
        object.__setattr__(self, "rules", rules)
        fused = tuple((_compile(p, self.name), _check_blocks(g, p, self.name))
                      for p, g in self.fused)
        object.__setattr__(self, "fused", fused)
        if self.experts not in ("tp", "ep"):
            raise PlanError(f"plan {self.name}: experts {self.experts!r} is neither 'tp' nor "
                            "'ep'; use 'tp' to split experts like dense layers or 'ep' to "
                            "place whole experts on ranks")
        if not self.identity:
            object.__setattr__(self, "identity", rules_identity(
                self.name, [(p.pattern, d) for p, d in rules],
                [(p.pattern, g) for p, g in fused], self.experts))

    def blocks(self, name: str) -> int:
        """How many equal blocks (fused gate|up) tensor `name`'s split dim holds; 1 if not fused."""
        for pattern, blocks in self.fused:
            if pattern.search(name):  # compiled in __post_init__
                return blocks
        return 1

    def split_dim(self, name: str) -> int | None:
        """Return the dimension to split tensor `name` along, or None to replicate it."""
        for pattern, dim in self.rules:
            if pattern.search(name):
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

    def build(self, checkpoint: Checkpoint, position: Position) -> dict[str, torch.Tensor]:
        """Call the hook and check that it returned a mapping of names to tensors."""
        import torch

        out = self.fn(checkpoint, position)
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

BUILTIN_PLANS: dict[str, ShardPlan] = {
    name: ShardPlan(name, rules, fused=fused, experts=experts)
    for name, (rules, fused, experts) in BUILTIN.items()}
"""The built-in plans by name (their rules, and what each fits: builtin_plans.py)."""
LLAMA_PLAN = BUILTIN_PLANS["llama"]
LLAMA_EP_PLAN = BUILTIN_PLANS["llama-ep"]
GPT_OSS_PLAN = BUILTIN_PLANS["gpt-oss"]
REPLICATE_PLAN = BUILTIN_PLANS["replicate"]


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


def plan_rank(ckpt: Checkpoint, plan: ShardPlan, position: Position) -> list[SliceSpec]:
    """Return the slices rank `position` holds, in checkpoint order."""
    from vlaunch.cache.store.quant import act_order, quantization_config

    stage_of = _stage_filter(ckpt, position.pp_size)
    owns = _expert_filter(ckpt, plan, position)
    whole_groups = act_order(quantization_config(ckpt.root))
    rules = _rules_for(plan)
    slices = []
    for entry in ckpt.tensors.values():
        if stage_of(entry.name) in (None, position.pp_rank) and owns(entry.name):
            slices.append(_slice(entry, plan, position, whole_groups, rules))
    return slices


_DIGITS = bytes.maketrans(b"123456789", b"000000000")


def _rules_for(plan: ShardPlan) -> Callable[[str], tuple[int | None, int]]:
    """`name -> (split dim, fused blocks)` for `plan`, each rule matched once per group of
    names that differ only in their digits (layer and expert indices: the 100k tensors of an
    MoE checkpoint are a few hundred groups). Grouping holds only where no pattern can tell
    one digit from another: none holds a digit (a literal, a count, an escape) or a named
    character escape; otherwise every name is matched on its own."""
    patterns = [p.pattern for p, _ in plan.rules] + [p.pattern for p, _ in plan.fused]

    def decide(name: str) -> tuple[int | None, int]:
        return plan.split_dim(name), plan.blocks(name)

    if not patterns:
        return lambda name: (None, 1)
    if any(re.search(r"[0-9]|\\N\{", p) for p in patterns):  # type: ignore[arg-type]
        return decide
    known: dict[bytes, tuple[int | None, int]] = {}

    def grouped(name: str) -> tuple[int | None, int]:
        key = name.encode().translate(_DIGITS)  # ASCII digits only: bytes.translate is fast
        found = known.get(key)
        if found is None:
            found = known[key] = decide(key.decode())
        return found

    return grouped


_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")  # one expert's tensor: experts.N.w1.weight
_FUSED_EXPERTS = re.compile(r"(?:^|\.)experts\.[A-Za-z_]\w*$")  # all experts: [E, ...]
_QUANT_AUX = re.compile(r"\.(?:weight_scale|weight_scale_inv|weight_zero_point|scales|qzeros)$")
_GROUPED = re.compile(r"\.(?:scales|qzeros)$")


def ep_layout(position: Position) -> tuple[int, int]:
    """(ep_size, ep_rank): experts spread over the tp x dp ranks, as vLLM's expert parallelism."""
    p = position
    return p.tp_size * p.dp_size, p.dp_rank * p.tp_size + p.tp_rank


def expert_range(experts: int, ep_size: int, ep_rank: int) -> range:
    """The experts rank `ep_rank` holds: a contiguous block; the first E % ep_size get one more."""
    base, extra = divmod(experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


def _expert_filter(ckpt: Checkpoint, plan: ShardPlan, position: Position) -> Callable[[str], bool]:
    """Under expert parallelism, whether rank `position` holds tensor `name`'s expert."""
    if plan.experts != "ep":
        return lambda name: True
    indices = {int(m.group(1)) for name in ckpt.tensors if (m := _EXPERT.search(name))}
    mine = expert_range(max(indices) + 1 if indices else 0, *ep_layout(position))

    def owns(name: str) -> bool:
        m = _EXPERT.search(name)
        return m is None or int(m.group(1)) in mine

    return owns


def _slice(entry: TensorEntry, plan: ShardPlan, position: Position,
           whole_groups: bool = False,
           rules: Callable[[str], tuple[int | None, int]] | None = None) -> SliceSpec:
    """Return the tensor-parallel (or expert-parallel) slice of `entry` that rank `position` holds
    (`rules`: the plan's rules for a name, as `_rules_for` gives them)."""
    dim, blocks = rules(entry.name) if rules else (plan.split_dim(entry.name),
                                                   plan.blocks(entry.name))
    parts, part, across = position.tp_size, position.tp_rank, "tp size"
    if plan.experts == "ep" and _EXPERT.search(entry.name):
        dim = None  # a whole expert, on the rank that owns it (plan_rank filters)
    elif plan.experts == "ep" and _FUSED_EXPERTS.search(entry.name) and entry.shape:
        dim, blocks = 0, 1  # [E, ...]: a contiguous block of experts per rank
        (parts, part), across = ep_layout(position), "ep size (tp x dp)"
    if dim is not None and _QUANT_AUX.search(entry.name) and (
            dim >= len(entry.shape) or entry.shape[dim] == 1):
        dim = None  # a per-tensor or per-channel scale: it broadcasts along the split dim
    if dim == 0 and whole_groups and _GROUPED.search(entry.name):
        dim = None  # GPTQ act order: a row-parallel layer's ranks need every group's scales
    if dim is None:
        return SliceSpec.whole(entry)
    shape = "[" + ",".join(map(str, entry.shape)) + "]"
    if dim is not None and dim >= len(entry.shape):
        raise PlanError(f"plan {plan.name}: tensor {entry.name!r} of shape {shape} has no "
                        f"dimension {dim} to split; add a rule for it to a plan file")
    if dim is not None and entry.shape[dim] % (parts * blocks):
        raise PlanError(f"plan {plan.name}: tensor {entry.name!r} of shape {shape}: dimension "
                        f"{dim} (size {entry.shape[dim]}) does not divide evenly by {across} "
                        f"{parts}" + (f" x {blocks} fused blocks" if blocks > 1 else "")
                        + "; use a tp size that divides it, or a plan file or hook for this "
                        "model")
    if dim is not None and (why := split_problem(entry.dtype, entry.shape, dim, parts * blocks)):
        raise PlanError(f"plan {plan.name}: tensor {entry.name!r}: {why}; use a tp size that "
                        "keeps whole bytes, or split it along another dimension")
    return SliceSpec(name=entry.name, dtype=entry.dtype, full_shape=entry.shape, dim=dim,
                     part=part, parts=parts, source=entry, groups=blocks)


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
            import tomllib

            obj: Any = tomllib.loads(data.decode("utf-8"))
        else:
            obj = json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, TOMLDecodeError, bad UTF-8
        raise PlanError(f"plan file {path} cannot be parsed: {e}; fix its syntax") from None
    if not isinstance(obj, dict) or not set(obj) <= {"name", "rules", "experts"}:
        raise PlanError(f"plan file {path} must be an object with keys 'name', 'rules' and "
                        "'experts' only; fix the file")
    rules = obj.get("rules")
    name = obj.get("name", path.stem)
    if not isinstance(rules, list) or not isinstance(name, str):
        raise PlanError(f"plan file {path}: 'rules' must be a list and 'name' a string")
    for i, rule in enumerate(rules):
        if (not isinstance(rule, dict) or "pattern" not in rule
                or not set(rule) <= {"pattern", "dim", "blocks"}):
            raise PlanError(f"plan file {path}: rule {i} must have a 'pattern', an optional "
                            f"'dim' and optional 'blocks', nothing else; got {rule!r}")
    digest = hashlib.sha256(data).hexdigest()
    ep = "ep:" if obj.get("experts") == "ep" else ""  # read by fingerprint.plan_field
    try:
        return ShardPlan(name, tuple((r["pattern"], r.get("dim")) for r in rules),
                         identity=f"file:{ep}sha256:{digest}",
                         fused=tuple((r["pattern"], r["blocks"]) for r in rules if "blocks" in r),
                         experts=obj.get("experts", "tp"))
    except PlanError as e:
        raise PlanError(f"plan file {path}: {e}") from None

