"""Which executor gets a request, among those of its model with room for it. Pure.

Policies:
- ``cache``: the lowest cost, in tokens of work before the request's first token,

      cost = (prefill pending there + uncached prompt tokens) × prefill_token_cost
           + load estimate × sequence_cost_tokens

  where the uncached part is what the prefix index says the executor lacks (the leading blocks it
  holds are skipped by its prefill) and the pending prefill is that of the requests it holds that
  have not started. Without an index answer every executor lacks the whole prompt, so this is
  routing by load and queued work alone.
- ``load``: the lowest load estimate, ignoring the cache.
- ``round_robin``: the next executor in id order, ignoring cache and load (a baseline for
  benchmarks).
Ties go to the lower load, then the most free KV blocks, then the executor id (stable).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.executors import ExecutorState
from shared.wire.messages import ExecuteRequest

ROUTING_POLICIES = ("cache", "load", "round_robin")


@dataclass(frozen=True)
class CostWeights:
    prefill_token_cost: float = 1.0  # per prompt token the executor must prefill
    # per sequence it holds: what waiting behind one more running request is worth, in prompt
    # tokens of prefill; a smaller value packs shared prefixes harder onto their holder
    sequence_cost_tokens: float = 64.0

    def __post_init__(self) -> None:
        if self.prefill_token_cost < 0 or self.sequence_cost_tokens < 0:
            raise ValueError("routing cost weights must be >= 0")


def uncached_tokens(
    state: ExecutorState, request: ExecuteRequest, cached_blocks: dict[str, int] | None
) -> int:
    num_prompt_tokens = len(request.prompt_token_ids)
    if not cached_blocks:
        return num_prompt_tokens
    num_cached = cached_blocks.get(state.executor_id, 0) * state.heartbeat.block_size
    return num_prompt_tokens - min(num_cached, num_prompt_tokens)


def choose(
    candidates: list[ExecutorState],
    request: ExecuteRequest,
    cached_blocks: dict[str, int] | None,
    policy: str,
    weights: CostWeights,
    turn: int,
) -> ExecutorState:
    """The chosen one of ``candidates`` (not empty). ``turn`` counts earlier round-robin picks of
    the request's model."""
    if policy == "round_robin":
        ordered = sorted(candidates, key=lambda s: s.executor_id)
        return ordered[turn % len(ordered)]

    def key(s: ExecutorState) -> tuple[float, int, int, str]:
        load = s.load_estimate()
        if policy == "cache":
            prefill = s.pending_prefill_estimate() + uncached_tokens(s, request, cached_blocks)
            cost = prefill * weights.prefill_token_cost + load * weights.sequence_cost_tokens
        else:
            cost = float(load)
        return (cost, load, -s.heartbeat.stats.num_free_blocks, s.executor_id)

    return min(candidates, key=key)
