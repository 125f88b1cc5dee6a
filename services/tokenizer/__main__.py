"""``python -m services.tokenizer``: chat template, encoding and prompt validation (queue group)."""

from __future__ import annotations

import sys

from services.runtime import run_service
from services.tokenizer.config import parse_config
from services.tokenizer.service import serve
from shared.engine.tokenizer import Tokenizer


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    tokenizers = {m.name: Tokenizer.from_path(m.path) for m in config.models}
    return run_service("tokenizer", lambda stop: serve(config, tokenizers, stop))


if __name__ == "__main__":
    sys.exit(main())
