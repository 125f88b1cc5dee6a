"""Turns sampled tokens into per-choice deltas: stop conditions, detokenization, stop strings.

Stop strings are matched on the detokenized text, across token boundaries. While a request has
stop strings, the last ``max(len(stop)) - 1`` characters are held back (they could be the start of
a stop string); they are released once more text proves otherwise, or at the finish.
"""

from __future__ import annotations

import functools

import msgspec

from shared.engine.sequence import Sequence
from shared.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.wire.outputs import CompletionDelta, TokenLogprobs


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        # Bounded: at most this many token names are kept (a vocabulary's worth for most models).
        self._token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)

    def _decode_token(self, token_id: int) -> str | None:
        # An id the vocabulary cannot decode keeps no name; the gateway shows its id.
        try:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        except Exception:
            return None

    def name_logprobs(self, logprobs: TokenLogprobs) -> TokenLogprobs:
        """The sampler's logprobs with the text of the chosen and the top tokens (for the API)."""
        return msgspec.structs.replace(
            logprobs,
            token=self._token_text(logprobs.token_id),
            top_tokens=[self._token_text(token_id) for token_id, _ in logprobs.top],
        )

    def start(self, seq: Sequence) -> None:
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=seq.request.params.skip_special_tokens,
            prompt_ids=seq.request.prompt_token_ids,
        )

    def append_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Record a sampled token and decide whether the sequence is finished."""
        params = seq.request.params
        seq.token_ids.append(token_id)
        seq.new_token_ids.append(token_id)
        if logprobs is not None:
            seq.new_logprobs.append(self.name_logprobs(logprobs))
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        if is_eos:
            self._finish(seq, "stop", None)
            return
        seq.text += seq.detokenizer.add(token_id)
        if token_id in params.stop_token_ids:
            self._finish(seq, "stop", token_id)
        elif params.stop and self._check_stop_strings(seq):
            pass
        elif (
            seq.num_output_tokens >= seq.request.max_tokens
            or len(seq.token_ids) >= self.max_model_len
        ):
            self._finish(seq, "length", None)

    def _check_stop_strings(self, seq: Sequence) -> bool:
        params = seq.request.params
        # Only the tail can hold a new match: the newest delta plus a stop string's length.
        max_stop = max(len(s) for s in params.stop)
        search_from = max(0, seq.num_emitted_chars - max_stop)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            at = seq.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        seq.text = (
            seq.text[: at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
        )
        self._finish(seq, "stop", stop, flush=False)
        return True

    def _finish(
        self, seq: Sequence, reason: str, stop_reason: str | int | None, *, flush: bool = True
    ) -> None:
        if flush and seq.detokenizer is not None:
            seq.text += seq.detokenizer.finish()
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def take_delta(self, seq: Sequence) -> CompletionDelta | None:
        """The output since the last delta, or None if there is nothing new to say. A choice's
        finish_reason goes out once: with n > 1 the request's other choices keep stepping after
        it."""
        if seq.finish_emitted:
            return None
        end = len(seq.text)
        params = seq.request.params
        if seq.finish_reason is None and params.stop:
            end = max(seq.num_emitted_chars, end - (max(len(s) for s in params.stop) - 1))
        if not seq.new_token_ids and end == seq.num_emitted_chars and seq.finish_reason is None:
            return None
        delta = CompletionDelta(
            index=seq.index,
            token_ids=seq.new_token_ids,
            text=seq.text[seq.num_emitted_chars : end],
            logprobs=seq.new_logprobs if params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        seq.num_emitted_chars = end
        seq.finish_emitted = seq.finish_reason is not None
        seq.new_token_ids = []
        seq.new_logprobs = []
        return delta
