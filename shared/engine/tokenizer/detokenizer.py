"""Streaming detokenization: token ids in, text deltas out.

A token's text depends on its neighbours (byte-level tokens carry parts of a UTF-8 character;
SentencePiece drops the space of the first token of a decode), so a token is never decoded alone.
Two offsets into the ids (the vLLM/TGI scheme):

    ids:  ... | prefix_offset ........ | read_offset ........ | (end)
                 already emitted,         not emitted yet
                 kept as context

    delta = decode(ids[prefix_offset:]) minus its prefix decode(ids[prefix_offset:read_offset])

A delta is emitted only when that decode does not end in U+FFFD (an incomplete UTF-8 sequence);
then prefix_offset, read_offset = read_offset, len(ids). Since everything emitted so far ended on
a complete character, the concatenation of all deltas plus `finish()` equals
`tokenizer.decode(ids)` (for byte-level vocabularies exactly; see `finish`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as leading context, as vLLM does: enough for the decoder to treat the first
# generated token as a continuation (no SentencePiece leading-space strip).
NUM_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        """`prompt_ids`: when given, the first delta reads as a continuation of the prompt (its
        leading space kept) instead of as the start of a text."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self.num_output_tokens = 0

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Feed new token ids; returns the text they complete (possibly "")."""
        if isinstance(token_ids, int):
            self._ids.append(token_ids)
            self.num_output_tokens += 1
        else:
            self._ids.extend(token_ids)
            self.num_output_tokens += len(token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """The held-back remainder at the end of the stream, U+FFFD included if the ids end inside a
        character. (For SentencePiece byte tokens the full decode turns a whole run of byte tokens
        into U+FFFDs when any of them is invalid; deltas keep the valid characters already
        emitted.)"""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, *, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        return delta
