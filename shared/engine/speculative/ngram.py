"""Prompt-lookup proposals: a sequence's next tokens guessed from its own earlier tokens.

Where the text repeats itself (code being edited, a summary quoting its source, a list in a fixed
format), the tokens that followed an earlier occurrence of the last few tokens are a good guess at
the next ones. The proposer looks up the last ``max_n`` tokens, then shorter suffixes down to
``min_n``, and proposes what followed their most recent earlier occurrence. It costs no forward:
each sequence keeps an index of its n-grams, extended by the tokens added since its last lookup.
A sequence caught in a loop (small models often are) is proposed the loop's next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.sequence import Sequence

# Longest and shortest suffix looked up. One token alone matches too often to guess well, and every
# rejected proposal costs a token's compute in the verifying forward.
NGRAM_MAX = 3
NGRAM_MIN = 2


@dataclass
class _NgramIndex:
    """The end (exclusive) of the latest occurrence of each n-gram ending before ``num_indexed``."""

    num_indexed: int = 0
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramProposer:
    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def plan(self, seq: Sequence, max_tokens: int) -> int:
        """Propose at once (it costs no forward); the slots wanted are the proposals found."""
        seq.draft_token_ids = self._lookup(seq, max_tokens)
        return len(seq.draft_token_ids)

    def propose(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            del seq.draft_token_ids[seq.num_lookahead :]

    def _lookup(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens to follow ``seq.token_ids`` (none when no suffix of at least
        ``min_n`` tokens occurred before)."""
        tokens = seq.token_ids
        index = seq.proposer_state
        if not isinstance(index, _NgramIndex):
            index = seq.proposer_state = _NgramIndex()
        # Index every n-gram that ends before the last token: the suffix itself (ending at the
        # last token) must find an earlier occurrence, not itself.
        end = len(tokens) - 1
        for e in range(max(index.num_indexed, self.min_n), end + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                index.last_end[tuple(tokens[e - n : e])] = e
        index.num_indexed = max(index.num_indexed, end + 1)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            at = index.last_end.get(tuple(tokens[len(tokens) - n :]))
            if at is not None:
                # What followed the occurrence, up to the sequence's end; past it, the stretch from
                # the occurrence to the end is a pattern that repeats, and the proposal repeats it.
                period = len(tokens) - at
                return [tokens[at + i % period] for i in range(max_tokens)]
        return []
