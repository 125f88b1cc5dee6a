"""Speculative decoding: proposers (n-gram lookup, the model's int8 twin as a draft) and the
``Speculator`` that reserves, runs and verifies their proposals inside the engine's steps."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.scheduler import Scheduler
from shared.engine.speculative.draft import DraftProposer
from shared.engine.speculative.ngram import NgramProposer
from shared.engine.speculative.speculator import Proposer, Speculator

__all__ = ["DraftProposer", "NgramProposer", "Proposer", "Speculator", "make_speculator"]


def make_speculator(
    config: EngineConfig,
    draft_runner: ModelRunner | None,
    scheduler: Scheduler,
    block_manager: BlockManager,
    argmax_rows: Callable[[torch.Tensor], torch.Tensor],
    max_model_len: int,
) -> Speculator | None:
    """The speculator ``config.speculative`` asks for (None: off). ``draft_runner``: the draft
    model on the engine's KV cache (for "draft")."""
    if config.speculative is None:
        return None
    proposer: Proposer
    if config.speculative == "ngram":
        proposer = NgramProposer()
    else:
        if draft_runner is None:
            raise ValueError("speculative='draft' needs the draft model's runner")
        proposer = DraftProposer(
            draft_runner, block_manager, config.speculative_draft_layers, argmax_rows
        )
    return Speculator(
        proposer,
        scheduler,
        num_tokens=config.num_speculative_tokens,
        max_num_seqs=config.speculative_max_num_seqs,
        max_model_len=max_model_len,
    )
