"""``EngineConfig``: every engine setting declared once, importable without torch.

Each field declared with ``_setting`` is a command-line setting (a plain field is not), and that one
declaration gives its default, its type and choices, its help, its flag ``--<name-with-dashes>`` and
its environment variable ``LLMSERVE_<NAME>``. From it are derived, with nothing written per setting:

- the engine flags of ``llmserve up``, ``llmserve generate`` and ``python -m services.executor``
  (``add_engine_arguments``), and the tokenizer's subset of them;
- the config those command lines produce (``EngineConfig.from_args``), over the environment
  (``EngineConfig.from_env``): a flag beats its variable, which beats the command's default;
- the argv the launcher gives each executor (``to_argv``; ``from_argv`` reads it back).

So adding an engine setting is adding one field here (and using it in the engine).

A command may differ from the engine's defaults, but only by passing its own ``defaults`` config
(``up`` and the executor: ``services.executor.config.SERVED_ENGINE_DEFAULTS``), never by declaring
a flag again.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.engine.memory import parse_bytes
from shared.engine.quantization import (
    KV_CACHE_DTYPE_HELP,
    KV_CACHE_DTYPES,
    QUANTIZATION_HELP,
    QUANTIZATIONS,
)
from shared.field_checks import require_positive

# The weight dtypes the loader maps to torch dtypes (``models.loader.DTYPES`` has exactly these
# keys).
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")

ENV_PREFIX = "LLMSERVE_"

# Long prefills (scheduler.LongPrefill, engine.py), sized on the 2-core CPU host: a request that
# arrives while a long prompt prefills waits for the slice in flight (or one layer of a chunk, if
# longer) before its own step; both must stay under a 5-token request's idle time to first token
# for its TTFT to stay within twice that (loadtests/bench_long_prefill.py, loadtests/RESULTS.md).
# Smaller chunks make that wait shorter and the long prompt's own prefill slower. Long prefills go
# one at a time, so a prompt is long only past a threshold well above a chat turn's uncached part
# (a few hundred tokens): those prefill in the shared steps, many at once, as chunked prefill does.
LONG_PREFILL_TOKEN_THRESHOLD = 1024
LONG_PREFILL_CHUNK_TOKENS = 128
PREFILL_SLICE_MS = 20

SPECULATIVE_METHODS = ("ngram", "draft")
SPECULATIVE_HELP = (
    "speculative decoding: ngram proposes the tokens that followed the sequence's last few tokens "
    "where they occurred before in it; draft runs the model's int8-weight twin as a draft (CPU "
    "kernels; about half the bytes a step reads). Proposals are verified in one forward: the "
    "output is exactly what decoding without them gives"
)
# Sized on the 2-core CPU host (loadtests/bench_speculative.py, loadtests/RESULTS.md): the larger
# the batch, the more a step is compute-bound and the more the K proposals each sequence verifies
# cost; n-gram speculation still gained at 8 sequences, by less than at 4.
SPECULATIVE_MAX_NUM_SEQS = 8


def _setting(
    default: Any, help: str, *, type: type = str, choices: tuple[Any, ...] | None = None
) -> Any:
    """A command-line setting: a dataclass field whose metadata says how to read and show it.
    ``type`` is ``str``, ``int`` or ``bool`` (a bool is a ``--flag/--no-flag`` pair)."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _setting(
        None, "GGUF file or Hugging Face directory (default: the bundled SmolLM2-135M-Instruct)"
    )
    dtype: str = _setting("bfloat16", "weight and activation dtype", choices=WEIGHT_DTYPES)
    device: str = _setting("cpu", "torch device the model runs on")
    block_size: int = _setting(16, "tokens per KV cache block", type=int)
    memory_budget: str = _setting(
        "1GiB", "weights + activations + KV cache, e.g. 2GiB; the KV cache gets what is left"
    )
    num_kv_blocks: int | None = _setting(  # padding block included
        None, "KV cache blocks (overrides --memory-budget)", type=int
    )
    max_num_batched_tokens: int = _setting(512, "token budget of one engine step", type=int)
    max_num_seqs: int = _setting(64, "sequences one engine batches at once", type=int)
    # Fairness between prompts: a long prefill runs in a forward of its own, a slice at a time
    # between the batches of everything else (scheduler.LongPrefill, engine.py).
    long_prefill_token_threshold: int = _setting(
        LONG_PREFILL_TOKEN_THRESHOLD,
        "a prompt with more tokens than this left to prefill is long: it prefills in chunks "
        "(--long-prefill-chunk-tokens), each in a forward of its own run a slice at a time "
        "between the other requests' steps, one long prompt at a time",
        type=int,
    )
    long_prefill_chunk_tokens: int = _setting(
        LONG_PREFILL_CHUNK_TOKENS,
        "tokens of each chunk of a long prefill (at most the threshold)",
        type=int,
    )
    prefill_slice_ms: int = _setting(
        PREFILL_SLICE_MS,
        "milliseconds a long prefill runs (whole layers, at least one) before other requests "
        "get a step",
        type=int,
    )
    max_model_len: int | None = _setting(None, "context length (default: the model's)", type=int)
    enable_prefix_caching: bool = _setting(
        True, "reuse the KV cache blocks of prompt prefixes already computed", type=bool
    )
    num_threads: int | None = _setting(
        None, "torch intra-op threads (default: torch's choice)", type=int
    )
    seed: int = _setting(0, "seed of the engine's global random generator", type=int)
    # "int8": W8A8 decoder linears (CPU kernels); see int8_linear
    quantization: str | None = _setting(None, QUANTIZATION_HELP, choices=QUANTIZATIONS)
    # "int8" / "fp8": K/V rows in int8 / e4m3 with a scale each; see kv_cache
    kv_cache_dtype: str = _setting("auto", KV_CACHE_DTYPE_HELP, choices=KV_CACHE_DTYPES)
    # Speculative decoding (shared/engine/speculative): proposals verified in one forward.
    speculative: str | None = _setting(None, SPECULATIVE_HELP, choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = _setting(
        4, "tokens proposed per sequence and step when --speculative is on", type=int
    )
    speculative_max_num_seqs: int = _setting(
        SPECULATIVE_MAX_NUM_SEQS,
        "speculate only while at most this many sequences decode: in a larger batch, verifying "
        "proposals costs more than their accepted tokens save",
        type=int,
    )
    speculative_draft_layers: int | None = _setting(
        None,
        "layers of the int8 twin that --speculative draft runs to propose (default: all)",
        type=int,
    )

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"unsupported dtype {self.dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}"
            )
        require_positive(
            self,
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "long_prefill_token_threshold",
            "long_prefill_chunk_tokens",
            "num_speculative_tokens",
            "speculative_max_num_seqs",
        )
        if self.prefill_slice_ms < 0:
            raise ValueError(f"prefill_slice_ms cannot be negative, got {self.prefill_slice_ms}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be at least 2 (block 0 is padding), got {self.num_kv_blocks}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be positive (or unset), got {self.num_threads}")
        parse_bytes(self.memory_budget)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be None or one of {SPECULATIVE_METHODS}, "
                f"got {self.speculative!r}"
            )
        if self.speculative_draft_layers is not None and self.speculative_draft_layers < 1:
            raise ValueError(
                "speculative_draft_layers must be positive (or unset), "
                f"got {self.speculative_draft_layers}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )

    # ---- derived from the settings ---------------------------------------------------------------

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        base: EngineConfig | None = None,
        *,
        exclude: Collection[str] = (),
    ) -> EngineConfig:
        """``base`` with every setting given on a command line built by ``add_engine_arguments``
        (a setting not given is absent from ``args``, so ``base`` keeps it). ``exclude``: settings
        the command reads itself (a ``repeatable`` flag's list, say)."""
        given = {
            s.name: getattr(args, s.name)
            for s in settings(exclude=exclude)
            if hasattr(args, s.name)
        }
        return dataclasses.replace(base or cls(), **given)

    @classmethod
    def from_env(
        cls,
        read: Callable[[str, type], Any],
        base: EngineConfig | None = None,
        *,
        include: Collection[str] | None = None,
    ) -> EngineConfig:
        """``base`` with every setting whose environment variable is set. ``read(name, type)``
        returns the variable's value as ``type``, or None when it is unset:
        ``services.runtime.env_value``, the one reader of the environment (this module reads none
        itself)."""
        found = {
            s.name: value for s in settings(include) if (value := read(s.env, s.type)) is not None
        }
        return dataclasses.replace(base or cls(), **found)

    @classmethod
    def from_argv(cls, argv: list[str], base: EngineConfig | None = None) -> EngineConfig:
        parser = argparse.ArgumentParser(add_help=False)
        add_engine_arguments(parser, base or cls())
        return cls.from_args(parser.parse_args(argv), base)

    def to_argv(
        self, *, include: Collection[str] | None = None, exclude: Collection[str] = ()
    ) -> list[str]:
        """The flags that give a command line this config's settings; a setting that is None is left
        out (no flag says None: the receiving command's default must be None too)."""
        argv: list[str] = []
        for s in settings(include, exclude):
            value = getattr(self, s.name)
            if value is None:
                continue
            if isinstance(value, bool):
                argv.append(s.flag if value else f"--no-{s.flag[2:]}")
            else:
                argv += [s.flag, str(value)]
        return argv


@dataclass(frozen=True)
class Setting:
    """One command-line setting of ``EngineConfig``, read off its field."""

    name: str
    default: Any
    help: str
    type: type
    choices: tuple[Any, ...] | None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


ENGINE_SETTINGS: tuple[Setting, ...] = tuple(
    Setting(f.name, f.default, f.metadata["help"], f.metadata["type"], f.metadata["choices"])
    for f in dataclasses.fields(EngineConfig)
    if "help" in f.metadata
)


def settings(
    include: Collection[str] | None = None, exclude: Collection[str] = ()
) -> list[Setting]:
    """The settings named in ``include`` (default: all) less those in ``exclude``; a name that is no
    setting is an error, so a rename cannot silently drop a flag."""
    names = {s.name for s in ENGINE_SETTINGS}
    unknown = (set(include or ()) | set(exclude)) - names
    if unknown:
        raise ValueError(f"not engine settings: {', '.join(sorted(unknown))}")
    return [
        s
        for s in ENGINE_SETTINGS
        if (include is None or s.name in include) and s.name not in exclude
    ]


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    defaults: EngineConfig | None = None,
    *,
    include: Collection[str] | None = None,
    exclude: Collection[str] = (),
    help: Mapping[str, str] | None = None,
    repeatable: Collection[str] = (),
) -> None:
    """Add the engine settings' flags to ``parser`` (``help`` replaces a setting's help text for
    this command). Their argparse default is SUPPRESS, so ``from_args`` can tell a flag given from
    one left to the environment or to ``defaults``, which only the help shows. A ``repeatable``
    setting's flag may be given several times (``--model`` of a stack serving several models): its
    values come as a list, which the command reads itself (``from_args(..., exclude=...)``); its
    variable still holds one value."""
    defaults = defaults or EngineConfig()
    settings(repeatable)  # a name that is no setting is an error here too
    group = parser.add_argument_group("engine settings")
    for s in settings(include, exclude):
        value = getattr(defaults, s.name)
        text = (help or {}).get(s.name, s.help)
        shown = f" (default: {value})" if value is not None else ""
        kwargs: dict[str, Any] = dict(
            dest=s.name,
            default=argparse.SUPPRESS,
            help=f"{text}{shown} [env {s.env}]".replace("%", "%%"),
        )
        if s.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif s.name in repeatable:
            kwargs.update(type=s.type, choices=s.choices, action="append")
        else:
            kwargs.update(type=s.type, choices=s.choices)
        group.add_argument(s.flag, **kwargs)
