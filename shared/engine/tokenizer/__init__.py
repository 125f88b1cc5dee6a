"""Tokenization for the engine and the services: `Tokenizer` (text, ids, chat prompts) and
`IncrementalDetokenizer` (ids → text deltas while streaming)."""

from .chat_template import ChatTemplateError
from .detokenizer import IncrementalDetokenizer
from .gguf_metadata import GGUFFormatError, read_gguf_metadata
from .gguf_vocab import UnsupportedTokenizerError
from .tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "GGUFFormatError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "UnsupportedTokenizerError",
    "read_gguf_metadata",
]
