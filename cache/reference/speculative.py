"""Greedy speculative decoding for the reference engine: a small draft proposes, the target
verifies every proposal in one forward pass.

The target keeps the longest prefix of the draft's `k` proposals that equals its own greedy
choice at each position, then appends its own next token: the tokens are the target's greedy
tokens, whatever the draft proposes (a bad draft only costs speed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vlaunch.cache.reference.config import ModelConfigError
from vlaunch.cache.reference.refmodel import Collectives, SingleRank, TPLlama, greedy

if TYPE_CHECKING:
    from vlaunch.cache.reference.options import EngineOptions

log = logging.getLogger("vlaunch.engine")


class DraftMismatchError(ModelConfigError):
    """The draft cannot propose tokens for this target (another vocabulary): exit 78."""


def load_draft(opts: EngineOptions, rank: int, device: str, comm: Collectives) -> TPLlama:
    """The draft model of this rank from the draft cache group (else the disk): replicated,
    so each rank runs all of it alone; a draft that is the target's checkpoint (served by the
    target's group, split like it) runs over the target's `comm`."""
    from vlaunch.cache.client.loader import load
    from vlaunch.cache.reference.config import ModelConfig

    weights = load(opts.draft_model, role="draft", rank=rank, tensor_parallel_size=opts.tp_size,
                   device=device, socket_dir=opts.socket_dir or None, mode=opts.mode,
                   fallback=opts.fallback, timeout=opts.timeout)
    log.info("rank %d: draft model from %s (%.2f GB)", rank, weights.source,
             sum(t.nbytes for t in weights.values()) / 1e9)
    shared = os.path.realpath(opts.draft_model) == os.path.realpath(opts.model)
    return TPLlama(weights, ModelConfig.from_dir(opts.draft_model),
                   comm if shared else SingleRank())


def check_pair(target: TPLlama, draft: TPLlama) -> None:
    """Raise DraftMismatchError unless the draft's tokens are the target's."""
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise DraftMismatchError(
            f"the draft model's vocabulary has {draft.cfg.vocab_size} tokens, the target's "
            f"{target.cfg.vocab_size}; use a draft model trained with the target's tokenizer")


def speculative_greedy(target: TPLlama, draft: TPLlama, prompt_tokens: Sequence[int],
                       max_new_tokens: int, k: int = 4) -> tuple[list[int], int]:
    """The target's greedy tokens for the prompt, and how many draft proposals it accepted."""
    if not prompt_tokens:
        raise ValueError("the prompt needs at least one token")
    if k < 1:
        raise ValueError(f"speculative tokens must be >= 1 (got {k})")
    check_pair(target, draft)
    tokens, new, accepted = list(prompt_tokens), [], 0
    while len(new) < max_new_tokens:
        proposal = greedy(draft, tokens, min(k, max_new_tokens - len(new)))
        seq = torch.tensor(tokens + proposal, dtype=torch.int64, device=target.device)
        # the target's choice after each prefix: position len(tokens) - 1 + i predicts token i
        choices = target.forward(seq)[len(tokens) - 1:].argmax(-1).tolist()
        agree = 0
        while agree < len(proposal) and proposal[agree] == choices[agree]:
            agree += 1
        step = [*proposal[:agree], int(choices[agree])][:max_new_tokens - len(new)]
        accepted += agree
        new += step
        tokens += step
    return new, accepted
