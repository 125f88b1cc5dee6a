"""Deterministic benchmark workloads as token-id prompts (pure logic: no torch, no engine).

Prompts are cut from a corpus of real English text: the docstrings of a fixed list of
standard-library modules (and their public classes and functions), tokenized by the model's own
tokenizer. Each prompt is a slice at its own seeded random offset, so prompts do not share leading
blocks and the prefix cache cannot serve any of them (the benchmarks report the hit count to prove
it). A ``random`` source (uniform token ids that avoid special tokens) is the fallback when text is
not wanted.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

__all__ = [
    "CORPUS_MODULES",
    "TraceRequest",
    "corpus_text",
    "corpus_token_ids",
    "fingerprint",
    "mixed_trace",
    "random_prompts",
    "text_prompts",
]

CORPUS_MODULES = (
    "argparse",
    "collections",
    "json",
    "logging",
    "email",
    "http",
    "unittest",
    "asyncio",
    "pathlib",
    "subprocess",
    "typing",
    "dataclasses",
    "functools",
    "itertools",
    "re",
    "textwrap",
    "datetime",
    "decimal",
    "fractions",
    "statistics",
    "random",
    "heapq",
    "bisect",
    "threading",
    "socket",
    "pickle",
    "csv",
    "sqlite3",
    "zipfile",
    "tarfile",
)


def corpus_text(modules: Sequence[str] = CORPUS_MODULES) -> str:
    """Docstrings of the modules and their public classes/functions, each docstring once, in
    order."""
    seen: set[str] = set()
    parts: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        objects = [module] + [
            getattr(module, attr) for attr in sorted(dir(module)) if not attr.startswith("_")
        ]
        for obj in objects:
            if obj is not module and not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40 and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    return "\n\n".join(parts)


def corpus_token_ids(
    encode: Callable[[str], list[int]], special_ids: Collection[int], text: str | None = None
) -> list[int]:
    """The corpus as one token stream, special tokens dropped (``encode`` must not add BOS/EOS)."""
    special = set(special_ids)
    return [t for t in encode(corpus_text() if text is None else text) if t not in special]


def text_prompts(
    corpus_ids: Sequence[int], lens: Sequence[int], rng: random.Random, *, distinct_prefix: int = 16
) -> list[list[int]]:
    """One slice of the corpus per length, at seeded offsets whose first ``distinct_prefix`` tokens
    differ from every other prompt's (so no two prompts share a first KV block)."""
    if not lens:
        return []
    if max(lens) >= len(corpus_ids):
        raise ValueError(f"corpus has {len(corpus_ids)} tokens, a prompt needs {max(lens)}")
    prompts: list[list[int]] = []
    heads: set[tuple[int, ...]] = set()
    for n in lens:
        for _ in range(1000):
            start = rng.randrange(len(corpus_ids) - n + 1)
            prompt = list(corpus_ids[start : start + n])
            head = tuple(prompt[:distinct_prefix])
            if head not in heads:
                break
        else:
            raise ValueError("could not find distinct prompt offsets; the corpus is too small")
        heads.add(head)
        prompts.append(prompt)
    return prompts


def random_prompts(
    vocab_size: int, special_ids: Collection[int], lens: Sequence[int], rng: random.Random
) -> list[list[int]]:
    """Uniform random token ids in [0, vocab_size) minus the special ids."""
    special = set(special_ids)
    allowed = [t for t in range(vocab_size) if t not in special]
    return [[allowed[rng.randrange(len(allowed))] for _ in range(n)] for n in lens]


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    max_tokens: int


def mixed_trace(
    num_requests: int,
    rng: random.Random,
    *,
    prompt_len_range: tuple[int, int],
    short_tokens: int,
    long_tokens: int,
    long_fraction: float,
) -> list[TraceRequest]:
    """``num_requests`` requests in a shuffled order: exactly round(long_fraction * n) of them ask
    for ``long_tokens`` output tokens, the rest for ``short_tokens``; prompt lengths uniform in the
    range."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    num_long = round(long_fraction * num_requests)
    outs = [long_tokens] * num_long + [short_tokens] * (num_requests - num_long)
    rng.shuffle(outs)
    lo, hi = prompt_len_range
    return [TraceRequest(prompt_len=rng.randint(lo, hi), max_tokens=m) for m in outs]


def fingerprint(prompts: Sequence[Sequence[int]]) -> str:
    """Short hash of a prompt set, so two runs can tell whether they measured the same inputs."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(b"".join(int(t).to_bytes(4, "little") for t in p))
    return h.hexdigest()[:16]
