"""Speculative decoding: proposers (n-gram lookup, a layer-cut draft of the model) and the
``Speculator`` that reserves, runs and verifies their proposals inside the engine's steps."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.scheduler import Scheduler
from shared.engine.speculative.layer_draft import LayerDraftProposer
from shared.engine.speculative.ngram import NgramProposer
from shared.engine.speculative.speculator import Proposer, Speculator

__all__ = ["LayerDraftProposer", "NgramProposer", "Proposer", "Speculator", "make_speculator"]


def make_speculator(
    config: EngineConfig,
    runner: ModelRunner,
    scheduler: Scheduler,
    block_manager: BlockManager,
    argmax_rows: Callable[[torch.Tensor], torch.Tensor],
    max_model_len: int,
) -> Speculator | None:
    """The speculator ``config.speculative`` asks for (None: off)."""
    if config.speculative is None:
        return None
    proposer: Proposer
    if config.speculative == "ngram":
        proposer = NgramProposer()
    else:
        num_layers = config.speculative_draft_layers or max(1, runner.model.config.num_layers // 3)
        proposer = LayerDraftProposer(runner, block_manager, num_layers, argmax_rows)
    return Speculator(
        proposer,
        scheduler,
        num_tokens=config.num_speculative_tokens,
        max_num_seqs=config.speculative_max_num_seqs,
        max_model_len=max_model_len,
    )
