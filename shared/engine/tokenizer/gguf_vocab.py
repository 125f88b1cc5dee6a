"""A Hugging Face `tokenizers.Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

Invariant: token id i of the GGUF vocabulary is id i of the backend, for every i, so ids are
interchangeable with llama.cpp's and with the model's embedding rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, decoders, normalizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from .pretokenizers import PreTokenizerSpec, pre_tokenizer_spec

logger = logging.getLogger(__name__)

# llama.cpp `llama_token_type`, stored per token in `tokenizer.ggml.token_type`.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

SPM_SPACE = "\u2581"  # "▁": SentencePiece's visible space
SUPPORTED_MODELS = ("gpt2", "llama")


class UnsupportedTokenizerError(ValueError):
    """The GGUF names a tokenizer model (`tokenizer.ggml.model`) that cannot be rebuilt here."""


@dataclass(frozen=True)
class GgufTokenizerInfo:
    """Everything besides the backend that `Tokenizer` needs, read from the same metadata."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def build_from_metadata(metadata: dict[str, Any]) -> tuple[Backend, GgufTokenizerInfo]:
    model = metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise UnsupportedTokenizerError(
            f"GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise UnsupportedTokenizerError("GGUF file has no tokenizer.ggml.tokens")
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(
        tokens
    )
    if len(token_types) != len(tokens):
        raise UnsupportedTokenizerError(
            "tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length"
        )

    if model == "gpt2":
        spec = pre_tokenizer_spec(metadata.get("tokenizer.ggml.pre"))
        backend = _byte_level_bpe(tokens, metadata, spec)
        add_bos_default = spec.add_bos_default
    else:
        backend = _sentencepiece_bpe(tokens, token_types, metadata)
        add_bos_default = (
            True  # llama.cpp's default for a SentencePiece vocabulary that does not say
        )
    _add_special_tokens(backend, tokens, token_types)

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = token_id(key)
        if value is not None and value not in eos_ids:
            eos_ids.append(value)
    info = GgufTokenizerInfo(
        vocab_size=len(tokens),
        bos_token_id=token_id("bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        pad_token_id=token_id("padding_token_id"),
        unk_token_id=token_id("unknown_token_id"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
    return backend, info


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if len(vocab) != len(tokens):
        # A repeated text keeps its first id; encode() can never produce the later ids.
        logger.warning(
            "GGUF vocabulary repeats %d token texts; only the first id of each is used",
            len(tokens) - len(vocab),
        )
    return vocab


def _byte_level_bpe(tokens: list[str], metadata: dict[str, Any], spec: PreTokenizerSpec) -> Backend:
    raw_merges: list[str] | None = metadata.get("tokenizer.ggml.merges")
    if not raw_merges:
        raise UnsupportedTokenizerError("GGUF 'gpt2' tokenizer has no tokenizer.ggml.merges")
    merges: list[tuple[str, str]] = []
    for merge in raw_merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise UnsupportedTokenizerError(
                f"malformed BPE merge {merge!r} in tokenizer.ggml.merges"
            )
        merges.append((left, right))
    backend = Backend(BPE(vocab=_vocab(tokens), merges=merges, ignore_merges=spec.ignore_merges))
    normalizer = spec.normalizer()
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = spec.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], token_types: list[int], metadata: dict[str, Any]
) -> Backend:
    """llama.cpp's SPM tokenizer: whole text (no pre-split), spaces as "▁", pairs merged best score
    first, characters outside the vocabulary as <0xXX> byte tokens.

    Expressed as BPE with one merge per (left, right) split of every token, ranked by the merged
    token's score, which is how Hugging Face converts Llama/Mistral SentencePiece models. The two
    agree whenever the best-scoring adjacent pairs are distinct tokens; they can differ only when
    two overlapping pairs spell the same token (SentencePiece takes the leftmost, BPE the lower
    rank).
    """
    scores: list[float] | None = metadata.get("tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise UnsupportedTokenizerError(
            "GGUF 'llama' tokenizer needs tokenizer.ggml.scores, one per token"
        )
    vocab = _vocab(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if token_types[index] == TOKEN_TYPE_BYTE or vocab[token] != index:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    merges = [(left, right) for _, _, _, left, right in ranked]

    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Backend(
        BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # Added tokens are cut out of the text before normalizing, so Prepend runs at the start of every
    # text run, including right after a special token: llama.cpp's `is_prev_special` rule.
    steps = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    decode_steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _add_special_tokens(backend: Backend, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens (matched whole in text, skipped when decoding with
    skip_special_tokens); user-defined ones become plain added tokens (matched whole, always
    decoded). Their texts are already in the model vocabulary, so they keep their GGUF ids."""
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_CONTROL and token
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=True)
        if kind == TOKEN_TYPE_USER_DEFINED and token
    ]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)
