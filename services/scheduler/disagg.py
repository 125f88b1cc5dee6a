"""Prefill/decode disaggregation: whether a request's prompt is prefilled on a prefill executor
and handed to its decode executor, or prefilled where it will decode. Pure.

Remote prefill pays only when the prompt's uncached part is long: below ``min_uncached_tokens``
the transfer (and the second hop) costs more than the prefill it moves; and a prefill pool
already holding ``max_prefill_queue_tokens`` of unstarted prefill would make the request wait
longer there than on its decode executor. Each decision is named, for the metrics:

    disaggregated        prefilled on the prefill executor, decoded on the decode executor
    short_prompt         uncached part under min_uncached_tokens: local prefill
    prefill_queue_long   every prefill executor has too much queued: local prefill
    no_prefill_executor  none alive with room: local prefill
    multiple_choices     n > 1 (not handed off): local prefill
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.executors import ExecutorState
from services.scheduler.placement import CostWeights, choose
from shared.wire.messages import ExecuteRequest

DECISIONS = (
    "disaggregated",
    "short_prompt",
    "prefill_queue_long",
    "no_prefill_executor",
    "multiple_choices",
)


@dataclass(frozen=True)
class DisaggConfig:
    min_uncached_tokens: int = 256
    max_prefill_queue_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.min_uncached_tokens < 0 or self.max_prefill_queue_tokens < 0:
            raise ValueError("min_uncached_tokens and max_prefill_queue_tokens must be >= 0")


def decide(
    request: ExecuteRequest,
    num_uncached_on_decode: int,
    prefill_candidates: list[ExecutorState],
    cached_blocks: dict[str, int] | None,
    config: DisaggConfig,
    weights: CostWeights,
) -> tuple[str, ExecutorState | None]:
    """(decision, the prefill executor when it is 'disaggregated'). ``prefill_candidates``: live
    prefill executors of the request's model with room for it."""
    if request.params.n > 1:
        return "multiple_choices", None
    if num_uncached_on_decode < config.min_uncached_tokens:
        return "short_prompt", None
    if not prefill_candidates:
        return "no_prefill_executor", None
    shallow = [
        s
        for s in prefill_candidates
        if s.pending_prefill_estimate() <= config.max_prefill_queue_tokens
    ]
    if not shallow:
        return "prefill_queue_long", None
    return "disaggregated", choose(shallow, request, cached_blocks, "cache", weights, 0)
