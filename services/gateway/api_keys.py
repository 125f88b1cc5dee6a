"""API keys and their limits: parsing the keys file, finding a request's key, and what a request
costs against its key's token rate. Pure module: no I/O but reading the file's text.

The keys file (``--api-keys-file``) holds one JSON object a line; blank lines and lines starting
with ``#`` are skipped::

    {"key": "sk-team-a-...", "name": "team-a", "requests_per_minute": 60,
     "tokens_per_minute": 20000, "max_concurrent": 4}

``key`` and ``name`` are required, each limit optional (absent or null: unlimited). ``name`` is what
logs, metrics and error messages show (the key itself never is) and what the limits are kept under
in Redis, so names are distinct, as are keys.

What a request costs against ``tokens_per_minute`` (``reserved_tokens``): its prompt as the gateway
sees it before tokenization, and ``max_tokens`` for each of its ``n`` choices, reserved at
admission. The prompt counts one token per 4 UTF-8 bytes of its text (rounded up), or the number of
its token ids when it was given as ids. When the request ends, what it did not use is given back
(``Limiter.release``): it is charged its prompt (as tokenized, once known) and the tokens it
generated.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shared.wire.messages import GenerateRequest

__all__ = [
    "LIMIT_NAMES",
    "ApiKey",
    "KeyRing",
    "parse_api_keys",
    "reserved_tokens",
]

# A name goes into Redis keys, metric labels and messages: keep it plain.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LIMIT_NAMES = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_FIELDS = frozenset({"key", "name", *LIMIT_NAMES})
# The bytes of prompt text counted as one token (a prompt is not tokenized at the gateway).
BYTES_PER_TOKEN = 4
# max_tokens absent on a chat request (until the context is full): what is reserved for it.
DEFAULT_RESERVED_MAX_TOKENS = 1024


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: str = field(repr=False)  # never printed
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"a key's name must be 1-64 letters, digits, '_', '.' or '-' (starting with a "
                f"letter or digit), got {self.name!r}"
            )
        if not self.key or any(c.isspace() for c in self.key):
            raise ValueError(f"key {self.name!r}: the key must be non-empty without whitespace")
        for limit in LIMIT_NAMES:
            value = getattr(self, limit)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(
                    f"key {self.name!r}: {limit} must be a positive integer (or absent), "
                    f"got {value!r}"
                )

    @property
    def limited(self) -> bool:
        return any(getattr(self, limit) is not None for limit in LIMIT_NAMES)


def parse_api_keys(text: str, source: str = "the keys file") -> tuple[ApiKey, ...]:
    """The keys of a keys file's text; ValueError naming the line and what is wrong with it (never
    the key itself)."""
    keys: list[ApiKey] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}, line {number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - _FIELDS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
        for required in ("key", "name"):
            if not isinstance(obj.get(required), str):
                raise ValueError(f"{where}: '{required}' must be a string")
        try:
            keys.append(ApiKey(**obj))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not keys:
        raise ValueError(f"{source} holds no key")
    _check_distinct(keys, source)
    return tuple(keys)


def _check_distinct(keys: Iterable[ApiKey], source: str) -> None:
    names: set[str] = set()
    digests: set[bytes] = set()
    for k in keys:
        if k.name in names:
            raise ValueError(f"{source}: the name {k.name!r} is given twice")
        if _digest(k.key) in digests:
            raise ValueError(f"{source}: key {k.name!r} is the same key as an earlier one")
        names.add(k.name)
        digests.add(_digest(k.key))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The configured keys, looked up by the SHA-256 of the presented key: a lookup's timing
    depends on the digest, never on how much of a real key a guess got right."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        keys = tuple(keys)
        _check_distinct(keys, "the API keys")
        self._by_digest: Mapping[bytes, ApiKey] = {_digest(k.key): k for k in keys}

    def __len__(self) -> int:
        return len(self._by_digest)

    def find(self, presented: str) -> ApiKey | None:
        return self._by_digest.get(_digest(presented))


def estimated_prompt_tokens(generate: GenerateRequest) -> int:
    """The request's prompt in tokens as the gateway counts it before tokenization."""
    if generate.prompt_token_ids is not None:
        return len(generate.prompt_token_ids)
    if generate.prompt is not None:
        return math.ceil(len(generate.prompt.encode()) / BYTES_PER_TOKEN)
    text = sum(len(m.content.encode()) for m in generate.messages or ())
    return math.ceil(text / BYTES_PER_TOKEN)


def reserved_tokens(generate: GenerateRequest) -> int:
    """The tokens a request takes from its key's token rate at admission (see the module doc)."""
    params = generate.params
    max_tokens = params.max_tokens if params.max_tokens is not None else DEFAULT_RESERVED_MAX_TOKENS
    return max(1, estimated_prompt_tokens(generate) + max_tokens * params.n)
