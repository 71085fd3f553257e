"""The built-in shard plans as data (name rules, fused blocks, expert placement), and the
plan identity a fingerprint carries.

Apart from plan.py, which builds its `ShardPlan`s from these tables, because an engine's
share handoff needs a plan's identity and nothing else of it: `builtin_identity` compiles no
regex and imports no checkpoint code. Rules are `(regex, dim)` as plan.py describes them.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable

Rules = tuple[tuple[str, int | None], ...]
Fused = tuple[tuple[str, int], ...]

_COL = r"(?:^|\.)(?:q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)\."  # w1/w3: Mixtral's gate/up
_ROW = r"(?:^|\.)(?:o_proj|down_proj|w2)\."
# weights laid out [out, in] (bf16, fp8, NVFP4/MXFP4 packed, compressed-tensors) and their
# scales and zero points, which follow the weight's split (a dim of size 1 is replicated)
_OUT_IN = r"(?:weight|weight_packed|weight_scale|weight_scale_inv|weight_zero_point)$"
_IN_OUT = r"(?:qweight|qzeros|scales)$"  # GPTQ/AWQ int4: [in (packed), out (packed)]
LLAMA_RULES: Rules = (
    (_COL + r"(?:bias|" + _OUT_IN + ")", 0),
    (_COL + _IN_OUT, 1),
    (r"(?:^|\.)(?:embed_tokens|lm_head)\.weight$", 0),
    (_ROW + r"(?:weight_)?g_idx$", 0),
    (_ROW + _OUT_IN, 1),
    (_ROW + _IN_OUT, 0),
    (r"(?:^|\.)experts\.gate_up_proj$", 2),  # fused experts [E, hidden, 2 * inter]: gate|up
    (r"(?:^|\.)experts\.gate_up_proj_bias$", 1),
    (r"(?:^|\.)experts\.down_proj$", 1),  # [E, inter, hidden]
)
"""Llama-style names (also Mistral, Mixtral, Qwen2/3 and their MoE, DeepSeek-style experts):
q/k/v/gate/up (Mixtral w1/w3), their biases, the embedding and lm_head split rows; o_proj and
down_proj (w2) split columns; quantized layers split with their weight (GPTQ/AWQ's transposed
qweight/qzeros/scales along their own output or input dim, g_idx with its input rows);
per-tensor scales, norms, routers and o_proj/down_proj biases are replicated. Fused expert
tensors split the intermediate dimension, each half of a fused gate|up on its own."""

FUSED_GATE_UP: Fused = ((r"(?:^|\.)experts\.gate_up_proj(?:_bias)?$", 2),)

GPT_OSS_RULES: Rules = (
    *LLAMA_RULES[:6],
    (r"(?:^|\.)self_attn\.sinks$", 0),
    (r"(?:^|\.)experts\.gate_up_proj$", 2),  # [E, hidden, 2 * inter], gate and up interleaved
    (r"(?:^|\.)experts\.gate_up_proj_(?:bias|blocks|scales)$", 1),  # MXFP4: [E, 2 * inter, ..]
    (r"(?:^|\.)experts\.down_proj$", 1),
    (r"(?:^|\.)experts\.down_proj_(?:blocks|scales)$", 2),  # MXFP4: [E, hidden, inter / 32, ..]
)
"""gpt-oss: Llama-style attention plus sinks; experts whose gate and up rows interleave (a
contiguous split keeps pairs together), in bf16 or MXFP4 (blocks and E8M0 scales)."""

BUILTIN: dict[str, tuple[Rules, Fused, str]] = {
    "llama": (LLAMA_RULES, FUSED_GATE_UP, "tp"),
    # as "llama", but experts are not split: each rank of tp x dp holds whole experts, a
    # contiguous block of them (expert parallelism, as vLLM's --enable-expert-parallel)
    "llama-ep": (LLAMA_RULES, FUSED_GATE_UP, "ep"),
    "gpt-oss": (GPT_OSS_RULES, (), "tp"),
    "replicate": ((), (), "tp"),  # every tensor whole on every rank
}
"""Each built-in plan's (rules, fused blocks, experts), by name."""


def rules_identity(name: str, rules: Iterable[tuple[str, int | None]],
                   fused: Iterable[tuple[str, int]] = (), experts: str = "tp") -> str:
    """A plan's identity from its name and its checked rules: the name and their hash (and
    `:ep:` where whole experts are placed on ranks, which splits experts over data-parallel
    ranks too)."""
    text = json.dumps([[p, d] for p, d in rules])
    fused = list(fused)
    if fused or experts != "tp":
        text += json.dumps({"fused": [[p, g] for p, g in fused], "experts": experts})
    ep = "ep:" if experts == "ep" else ""
    return f"builtin:{name}:{ep}sha256:{hashlib.sha256(text.encode()).hexdigest()}"


@functools.cache  # every engine start's fingerprint asks (a hash of the rules' text)
def builtin_identity(spec: str) -> str:
    """The identity of the built-in plan `spec`; "" when `spec` names none."""
    if spec not in BUILTIN:
        return ""
    rules, fused, experts = BUILTIN[spec]
    return rules_identity(spec, rules, fused, experts)
