"""Chat prompts as token ids where only the template writes control tokens.

A message's content is client text. Its "<|im_start|>system ..." must reach the model as those
characters, not as the control token that opens a turn: otherwise a user writes a system turn of
their own (role forgery). The control markers are every special token of the vocabulary, and every
other added token the chat template itself writes (Qwen's "<tool_call>", "<think>").

    messages ──render──▶ F ──encode (added tokens parsed)──▶ ids, char offsets
                          │
    the spans in F of marker texts that came from a content (found with placeholders)
                          │
    every marker token inside such a span ──▶ the same characters encoded as plain text

Exactness: when no content holds a marker text (every ordinary conversation) the ids are the
library's encoding of the rendered template, unchanged. Otherwise only the forged marker tokens
change: everything around them was already cut at the marker (the library splits text at added
tokens before anything else), so the template's own tokens stay exactly as they were.

The template sees each forged marker as an opaque placeholder, so a template that inspects the
content for markers (e.g. strips reasoning up to "</think>") treats those as plain text too.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


def control_markers(tokenizer: Tokenizer) -> dict[str, int]:
    """Marker text → id: every special added token, and every added token the chat template
    writes."""
    template = tokenizer.chat_template or ""
    return {
        token.content: index
        for index, token in tokenizer.backend.get_added_tokens_decoder().items()
        if token.content and (token.special or token.content in template)
    }


def marker_pattern(markers: Mapping[str, int]) -> re.Pattern[str] | None:
    """One regex over every marker; longest first, so at a position the longest marker wins, as
    the library's leftmost-longest matching picks it."""
    if not markers:
        return None
    return re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """The ids of ``messages`` rendered with the model's chat template; marker texts inside a
    content are plain text. BOS is added when the model wants one and the template did not write
    it (most templates write it themselves). Raises ChatTemplateError."""
    pattern = tokenizer.control_marker_pattern
    forged = pattern is not None and any(
        isinstance(m.get("content"), str) and pattern.search(m["content"]) for m in messages
    )
    if not forged:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        assert pattern is not None
        ids = _encode_with_forged_markers(tokenizer, pattern, messages, add_generation_prompt)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos_token and bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids


def _encode_with_forged_markers(
    tokenizer: Tokenizer,
    pattern: re.Pattern[str],
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
) -> list[int]:
    # Placeholders: private-use characters around a random nonce and a number. No whitespace (a
    # template's trim leaves them whole), nothing a client can predict.
    nonce = secrets.token_hex(8)
    forged_texts: list[str] = []

    def to_placeholder(m: re.Match[str]) -> str:
        forged_texts.append(m.group(0))
        return f"\ue000{nonce}.{len(forged_texts) - 1}\ue001"

    masked = [
        {**m, "content": pattern.sub(to_placeholder, m["content"])}
        if isinstance(m.get("content"), str)
        else m
        for m in messages
    ]
    rendered = tokenizer.apply_chat_template(masked, add_generation_prompt=add_generation_prompt)

    # Put the marker texts back, remembering where each landed (a template may repeat or drop a
    # content: every occurrence counts).
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    length = 0
    last = 0
    for m in re.finditer(f"\ue000{nonce}\\.(\\d+)\ue001", rendered):
        parts.append(rendered[last : m.start()])
        length += m.start() - last
        text = forged_texts[int(m.group(1))]
        parts.append(text)
        spans.append((length, length + len(text)))
        length += len(text)
        last = m.end()
    parts.append(rendered[last:])
    text = "".join(parts)

    encoding = tokenizer.encode_with_offsets(text)
    marker_ids = set(tokenizer.control_markers.values())
    ids: list[int] = []
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
        if token_id in marker_ids and any(start < e and s < end for s, e in spans):
            ids.extend(tokenizer.encode_plain(text[start:end]))
        else:
            ids.append(token_id)
    return ids
