"""Chat templates: the model's jinja2 template rendered the way transformers renders it.

Templates come with model files, so they are untrusted code: they run in jinja2's immutable sandbox,
see only plain JSON-like data, and get the same small set of helpers transformers gives them
(`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape). Same environment options
(trim_blocks, lstrip_blocks, loop controls) so the same template gives the same prompt, byte for
byte.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No chat template, or the template refused the conversation (its `raise_exception`)."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc


def _plain(value: Any) -> Any:
    """A copy built only of JSON types: rich objects (pydantic models, msgspec structs, dataclasses)
    carry methods the sandbox does not know to block, and the template must not mutate the caller's
    data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    # Subclasses (str enums, ...) are cut back to the base type.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def render_chat_template(
    source: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    special_tokens: Mapping[str, str | None] | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages`. `special_tokens` supplies bos_token/eos_token/...
    variables."""
    if not source:
        raise ChatTemplateError(
            "this model has no chat template; use the completions API with a plain prompt instead"
        )
    template = compile_chat_template(source)
    try:
        return template.render(
            messages=_plain(list(messages)),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(dict(special_tokens or {})),
            **_plain(extra),
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
