"""Per-request sampling parameters (OpenAI / vLLM semantics).

`SamplingParams` travels over NATS inside request messages, so it is a frozen msgspec Struct that
rejects unknown fields. Every constructor path (direct, `from_dict`, `decode_sampling_params`) runs
`__post_init__`, which is the single place values are checked; the decoders only translate msgspec's
errors into `ValueError`s that name the offending field.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

# Below this a temperature means greedy: dividing logits by ~0 only overflows (vLLM uses the same).
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
PENALTY_RANGE = (-2.0, 2.0)
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# Every other integer has an upper bound too: an unbounded Python int does not fit the wire
# (msgpack stops at 64 bits: OverflowError, once a 500) nor the engine's int32/int64 tensors. Token
# ids and counts fit an int32 with room; no context is anywhere near it.
MAX_INT32 = 2**31 - 1
# Stop strings are checked against every step's text of every sequence: their number and length
# bound that work (OpenAI allows 4 strings; these are generous).
MAX_STOP_SEQUENCES = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How to pick the tokens of one request.

    n: completions per prompt. max_tokens: None = until the context is full.
    temperature: 0 = greedy. top_k: 0 or -1 = off. top_p: 1 = off. min_p: 0 = off.
    repetition_penalty (multiplicative, prompt + output tokens): 1 = off.
    presence_penalty / frequency_penalty (subtractive, output tokens only): 0 = off.
    seed: None = unseeded. logprobs: None = none; N = the chosen token plus the top-N alternatives.
    stop / stop_token_ids / ignore_eos / skip_special_tokens / include_stop_str_in_output are
    applied by the engine and detokenizer, not by the sampler.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: the engine never speculates for this request (the output is the same either way).
    speculative: bool = True

    def __post_init__(self) -> None:
        _check_int("n", self.n, lo=1, hi=MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=MAX_INT32)
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            # Normalise ints to float so downstream code (and equality after a wire round trip)
            # sees one type; force_setattr is msgspec's sanctioned escape hatch for frozen structs.
            msgspec.structs.force_setattr(self, name, _as_float(name, getattr(self, name)))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int(
            "top_k",
            self.top_k,
            lo=-1,
            hi=MAX_INT32,
            what=f"an integer in [-1, {MAX_INT32}] (0 or -1 disables it)",
        )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=_SEED_MIN, hi=_SEED_MAX)
        msgspec.structs.force_setattr(self, "stop", _check_stop(self.stop))
        msgspec.structs.force_setattr(
            self, "stop_token_ids", _check_stop_token_ids(self.stop_token_ids)
        )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def uses_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Strict conversion (no str→int coercion, unknown fields rejected); ValueError on bad
        input."""
        try:
            return msgspec.convert(d, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(_explain(e)) from e


_json_decoder = msgspec.json.Decoder(SamplingParams)


def decode_sampling_params(data: bytes | str | dict[str, Any]) -> SamplingParams:
    """Decode JSON bytes/str or a plain dict into validated SamplingParams; ValueError on bad
    input."""
    if isinstance(data, dict):
        return SamplingParams.from_dict(data)
    try:
        return _json_decoder.decode(data)
    except msgspec.ValidationError as e:
        raise ValueError(_explain(e)) from e
    except msgspec.DecodeError as e:
        raise ValueError(f"invalid sampling params JSON: {e}") from e


_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`")
_AT_PATH = re.compile(r"^(?P<msg>.*) - at `\$\.?(?P<path>[^`]*)`$")


def _explain(e: msgspec.ValidationError) -> str:
    """Rewrite msgspec's message so the field comes first:
    "max_tokens: expected `int | null`..."."""
    text = str(e)
    if m := _UNKNOWN_FIELD.match(text):
        return f"unknown field '{m['name']}'"
    if m := _AT_PATH.match(text):
        msg = m["msg"]
        return f"{m['path']}: {msg[:1].lower()}{msg[1:]}"
    return text


def _check_int(
    name: str, value: object, *, lo: int, hi: int | None = None, what: str | None = None
) -> None:
    # bool is an int subclass; True must not silently mean 1.
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    ok = ok and (hi is None or value <= hi)  # type: ignore[operator]
    if not ok:
        what = what or (f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")
        raise ValueError(f"{name} must be {what}, got {_short(value)}")


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _short(value: object) -> str:
    """A value for an error message, cut short: the value may be megabytes long (and an int of
    more than 4300 digits has no repr at all)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _check_stop(stop: object) -> list[str]:
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a list of strings, got {_short(stop)}")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"stop must hold at most {MAX_STOP_SEQUENCES} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {_short(s)}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}"
            )
    return list(stop)


def _check_stop_token_ids(ids: object) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {_short(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(
            f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
        )
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INT32:
            raise ValueError(
                f"stop_token_ids must contain only integers in [0, {MAX_INT32}], got {_short(t)}"
            )
    return list(ids)
