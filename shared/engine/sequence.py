"""Requests and their sequences (one per choice) as the engine tracks them.

A sequence's tokens are ``prompt + output``; ``num_computed_tokens`` of them have K/V in the cache.
There are no prefill or decode phases: each step the scheduler gives a sequence some of its
``num_uncomputed`` tokens, and when a chunk reaches the last token a new token is sampled.

    token_ids:  [p p p p p p p p | o o o]
                 └── num_computed ──┘└ uncomputed ┘   (sample when uncomputed reaches 0)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from shared.wire.block_hash import hash_block
from shared.wire.outputs import TokenLogprobs
from shared.wire.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_order: int  # FCFS tie-break: lower arrived first
    max_tokens: int  # resolved: params.max_tokens or what the context leaves
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    scheduled_once: bool = False  # in a step's batch at least once (its queue time is over)

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(
            s.status is SequenceStatus.FINISHED for s in self.sequences
        )


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # choice index (n > 1)
    token_ids: list[int]
    num_computed_tokens: int = 0
    # Chained hashes of the leading full blocks of token_ids (the tokenizer's for the prompt, when
    # given); full_block_hashes() extends it as output fills blocks, so each block is hashed once.
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    generator: Any = None  # torch.Generator for seeded sampling, or None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Output bookkeeping for the next delta.
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    detokenizer: Any = None
    text: str = ""  # detokenized output so far (stop string removed once found)
    num_emitted_chars: int = 0
    finish_emitted: bool = False  # the delta carrying finish_reason went out; nothing follows it
    # Speculative decoding (shared/engine/speculative), within one step only: between steps both
    # are empty. num_lookahead: KV slots asked for beyond the next token (set before scheduling,
    # cut to what the scheduler granted); draft_token_ids: the proposals run after the next token
    # in this step's forward, none of them counted computed or in token_ids until verified.
    num_lookahead: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    proposer_state: Any = None  # the proposer's own bookkeeping for this sequence

    @property
    def seq_id(self) -> str:
        return f"{self.request.request_id}#{self.index}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def full_block_hashes(self, block_size: int) -> list[int]:
        """The chained hash of every full block of token_ids, hashing only blocks not hashed
        before."""
        hashes = self.block_hashes
        tokens = self.token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), len(tokens) // block_size):
            parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
            hashes.append(parent)
        return hashes

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority (lower first), then arrival, then choice index."""
        return (self.request.priority, self.request.arrival_order, self.index)
