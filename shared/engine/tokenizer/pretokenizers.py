"""llama.cpp pre-tokenizer names (`tokenizer.ggml.pre`) → Hugging Face `tokenizers` pre-tokenizers.

The pre-tokenizer decides where BPE may not merge, so it must be the one the merges were learned
with; a wrong one still produces valid ids, just not the model's ids. Each entry mirrors the
`tokenizer.json` of the models that carry the name, cross-checked with the regexes in llama.cpp's
`llama-vocab.cpp` (`llm_tokenizer_bpe`), where a pre type may be a sequence of regexes applied in
turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers.normalizers import Normalizer
from tokenizers.pre_tokenizers import PreTokenizer

logger = logging.getLogger(__name__)

# Llama 3 `tokenizer.json`: digits in groups of up to three, letters may take one leading
# non-letter.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 `tokenizer.json`: as Llama 3 but every digit alone.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """What the backend needs for one pre type. `ignore_merges` is the BPE model flag of the same
    name (a whole pre-token that is itself in the vocabulary is taken as is, as Llama 3 does);
    `add_bos_default` is llama.cpp's add-BOS default for the type when the file does not say."""

    kind: str  # "gpt2" | "digits_gpt2" | "llama3" | "qwen2"
    ignore_merges: bool = False
    add_bos_default: bool = False

    def pre_tokenizer(self) -> PreTokenizer:
        byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.kind == "gpt2":
            return byte_level_regex
        if self.kind == "digits_gpt2":
            # llama.cpp: regexes ["\p{N}", <gpt-2 regex>]; tokenizer.json: Digits(individual) then
            # ByteLevel. Splitting digits first changes the whitespace before a number: "\n\n   1"
            # is ["\n\n   ", "1"] here and ["\n\n  ", " 1"] under the plain GPT-2 regex.
            return pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level_regex]
            )
        split = {"llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}[self.kind]
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    def normalizer(self) -> Normalizer | None:
        # Qwen2's tokenizer.json normalizes to NFC before splitting.
        return normalizers.NFC() if self.kind == "qwen2" else None


_DIGITS_GPT2 = PreTokenizerSpec("digits_gpt2")
_GPT2 = PreTokenizerSpec("gpt2")
_LLAMA3 = PreTokenizerSpec("llama3", ignore_merges=True, add_bos_default=True)
_QWEN2 = PreTokenizerSpec("qwen2")

# Only names whose tokenizer.json is known to match one of the specs above.
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "smollm": _DIGITS_GPT2,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "default": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2,
}


def pre_tokenizer_spec(name: str | None) -> PreTokenizerSpec:
    """The spec for a `tokenizer.ggml.pre` value; an unknown name falls back to GPT-2 with a
    warning."""
    if not name:
        return _GPT2
    spec = PRE_TOKENIZERS.get(name)
    if spec is None:
        logger.warning(
            "unknown GGUF pre-tokenizer %r: falling back to the GPT-2 byte-level split; "
            "token ids may differ from the model's own tokenizer",
            name,
        )
        return _GPT2
    return spec
