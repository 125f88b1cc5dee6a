"""What the engine hands back each step: per request, per choice, the new tokens and text.

These structs cross NATS unchanged (executor → gateway), so they import neither torch nor asyncio.
"""

from __future__ import annotations

import msgspec


class TokenLogprobs(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """Logprobs of one sampled token, computed from the raw logits (before penalties/temperature).

    rank: 1-based position of the chosen token by logprob (1 = most likely; ties share the best
    rank).
    top: the N most likely (token_id, logprob) pairs, sorted by logprob descending; N = the
    request's `logprobs` (empty when it is 0). The chosen token appears in `top` only if it is among
    them.
    token, top_tokens: the text of token_id and of each `top` id, each decoded alone (special tokens
    included; a partial UTF-8 character shows as U+FFFD), named by the executor where it decodes the
    output, so the gateway needs no vocabulary. None where no name was given (the sampler's output
    before the output processor names it, or a token that does not decode).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
    token: str | None = None
    top_tokens: list[str | None] | None = None


class CompletionDelta(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """New output of choice ``index`` since the previous step. ``text`` is already detokenized with
    stop strings removed; ``token_ids`` may run ahead of ``text`` while a multi-byte character or a
    possible stop string is held back. ``finish_reason``: None while running, else 'stop', 'length'
    or 'abort'. ``stop_reason``: the stop string or stop token id that ended it, if any."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class RequestOutput(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One step's output for one request. ``finished`` once every choice has a finish_reason."""

    request_id: str
    deltas: list[CompletionDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool


class EngineStats(msgspec.Struct, kw_only=True, frozen=True):
    """Counters for metrics and heartbeats. Token counts are cumulative since start."""

    num_running: int
    num_waiting: int
    num_total_blocks: int  # usable blocks (the padding block excluded)
    num_free_blocks: int
    kv_cache_usage: float  # used / usable blocks, in [0, 1]
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens admitted
    num_computed_tokens: int  # tokens run through the model (prefill + decode)
    num_generated_tokens: int
    num_steps: int
    last_step_num_tokens: int  # tokens scheduled in the most recent step
    last_step_num_seqs: int = 0  # sequences in the most recent step's batch
    # Blocks holding a reusable prefix hash, in use or free (a free one stays cached until reused).
    num_cached_blocks: int = 0
    # Wall seconds spent inside steps, cumulative: against the wall clock, how busy the engine was
    # (the rest it waited for work); over num_steps, the mean step time.
    step_seconds_total: float = 0.0
    # Speculative decoding, cumulative: steps of a sequence that carried proposals, the proposals
    # run, and those accepted (acceptance rate: accepted / draft tokens; tokens a drafted step
    # yields: 1 + accepted / drafts).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
