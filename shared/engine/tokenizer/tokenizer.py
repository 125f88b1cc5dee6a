"""`Tokenizer`: text ↔ token ids and chat prompts for one model, over Hugging Face `tokenizers`.

Built from a GGUF file's metadata (`from_gguf`) or a Hugging Face `tokenizer.json` directory
(`from_pretrained_dir`); `from_path` picks the one a path is. BOS/EOS are added here, not by the
backend's post-processor, so both sources follow one rule: `add_special_tokens=True` adds BOS iff
the model says `add_bos_token` (EOS likewise).

A long text is encoded with the backend's `encode_batch`, which releases the GIL (`encode` holds
it): a long prompt tokenized in a worker thread leaves the caller's event loop running. Short ones
keep `encode`: `encode_batch` runs on the library's thread pool, and a process that has used it
prints a warning in every child it forks.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as Backend

from .chat_encoding import control_markers, encode_chat, marker_pattern
from .chat_template import render_chat_template
from .gguf_metadata import metadata_from_reader, read_gguf_metadata
from .gguf_vocab import build_from_metadata


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is set but the model has no BOS token")
        if add_eos_token and not eos_token_ids:
            raise ValueError("add_eos_token is set but the model has no EOS token")
        self.backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self.all_special_ids: frozenset[int] = frozenset(
            index for index, token in backend.get_added_tokens_decoder().items() if token.special
        )

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a model path, as the loader takes it: a Hugging Face directory or a GGUF file."""
        path = os.fspath(path)
        if os.path.isdir(path):
            return cls.from_pretrained_dir(path)
        if os.path.isfile(path):
            return cls.from_gguf(path)
        raise FileNotFoundError(
            f"tokenizer not found: {path!r} is neither a GGUF file nor a Hugging Face directory"
        )

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike[str] | Any) -> Tokenizer:
        """From a GGUF path, or an open `gguf.GGUFReader` (reusing the model loader's)."""
        if isinstance(path_or_reader, (str, os.PathLike)):
            metadata = read_gguf_metadata(path_or_reader)
        else:
            metadata = metadata_from_reader(path_or_reader)
        backend, info = build_from_metadata(metadata)
        return cls(
            backend,
            vocab_size=info.vocab_size,
            bos_token_id=info.bos_token_id,
            eos_token_ids=info.eos_token_ids,
            pad_token_id=info.pad_token_id,
            unk_token_id=info.unk_token_id,
            add_bos_token=info.add_bos_token,
            add_eos_token=info.add_eos_token,
            chat_template=info.chat_template,
        )

    @classmethod
    def from_pretrained_dir(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """From `tokenizer.json`, with `tokenizer_config.json` (special tokens, add_bos/eos,
        template), `chat_template.jinja` and `generation_config.json` (extra EOS ids) when
        present."""
        directory = os.fspath(directory)
        tokenizer_file = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        backend = Backend.from_file(tokenizer_file)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        generation = _read_json(os.path.join(directory, "generation_config.json"))

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, Mapping):
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos_token_id = token_id("bos_token")
        eos_token_ids = [i for i in [token_id("eos_token")] if i is not None]
        extra_eos = generation.get("eos_token_id")
        if isinstance(extra_eos, int):
            extra_eos = [extra_eos]
        if isinstance(extra_eos, list):
            eos_token_ids += [i for i in extra_eos if isinstance(i, int)]

        # Without an explicit flag, ask the tokenizer.json's own post-processor what it adds.
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        bos_added = (
            bos_token_id is not None and full[:1] == [bos_token_id] and plain[:1] != [bos_token_id]
        )
        eos_added = len(full) > len(plain) and full[-1] in eos_token_ids
        add_bos = config.get("add_bos_token", bos_added)
        add_eos = config.get("add_eos_token", eos_added)

        return cls(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            add_bos_token=bool(add_bos),
            add_eos_token=bool(add_eos),
            chat_template=_chat_template(directory, config),
        )

    # -- encoding / decoding ------------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = True, *, split_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of `text`. Added-token texts inside it (e.g. "<|im_start|>") become their ids,
        unless `split_special_tokens`: then the text is all plain text (`encode_plain`).
        `add_special_tokens` adds BOS/EOS as the model says, either way."""
        if split_special_tokens:
            ids = self.encode_plain(text)
        else:
            ids = self.encode_with_offsets(text).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token:
                ids.append(self.eos_token_ids[0])
        return ids

    def encode_with_offsets(self, text: str) -> Encoding:
        """The backend's encoding of `text` (added tokens parsed, nothing added): ids and the
        character span of each."""
        return _encode(self.backend, text)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with no added token parsed: "<|im_start|>" is the characters "<",
        "|", ... A text holding no added token encodes exactly as `encode` encodes it."""
        ids: list[int] = _encode(self._plain_backend, text).ids
        return ids

    @cached_property
    def _plain_backend(self) -> Backend:
        # The same pipeline, every added token marked special and special tokens not parsed
        # (`encode_special_tokens`): the library's own text path, so plain runs encode the same.
        data = json.loads(self.backend.to_str())
        for token in data.get("added_tokens", []):
            token["special"] = True
        plain = Backend.from_str(json.dumps(data))
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def control_markers(self) -> dict[str, int]:
        """The texts that are control tokens in a chat prompt (see chat_encoding)."""
        return control_markers(self)

    @cached_property
    def control_marker_pattern(self) -> re.Pattern[str] | None:
        return marker_pattern(self.control_markers)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_text(self, token_id: int | None) -> str | None:
        return self.id_to_token(token_id) if token_id is not None else None

    # -- chat ---------------------------------------------------------------------------------

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """The prompt ids of a conversation: the template's control tokens, and each message's
        content as plain text, whatever it holds (see chat_encoding). Raises ChatTemplateError."""
        return encode_chat(self, messages, add_generation_prompt)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text (not ids). Encode it with `add_special_tokens=False` when the template
        already writes BOS, as most do."""
        special_tokens = {
            "bos_token": self.token_text(self.bos_token_id),
            "eos_token": self.token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            "unk_token": self.token_text(self.unk_token_id),
            "pad_token": self.token_text(self.pad_token_id),
        }
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            special_tokens=special_tokens,
            **extra,
        )


# Below this many characters an encode takes well under a millisecond: holding the GIL is harmless.
_RELEASE_GIL_MIN_CHARS = 4096


def _encode(backend: Backend, text: str) -> Encoding:
    if len(text) < _RELEASE_GIL_MIN_CHARS:
        return backend.encode(text, add_special_tokens=False)
    return backend.encode_batch([text], add_special_tokens=False)[0]


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _chat_template(directory: str, config: Mapping[str, Any]) -> str | None:
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(
        os.path.join(directory, "chat_template.json")
    ).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {
            entry.get("name"): entry.get("template")
            for entry in template
            if isinstance(entry, Mapping)
        }
        template = named.get("default")
    return template if isinstance(template, str) else None
