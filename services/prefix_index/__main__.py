"""``python -m services.prefix_index``: the global prefix index over Redis, fed by the executors'
KV events, answering prefix matches."""

from __future__ import annotations

import sys

from services.prefix_index.config import parse_config
from services.prefix_index.service import serve
from services.runtime import run_service


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    return run_service("prefix_index", lambda stop: serve(config, stop))


if __name__ == "__main__":
    sys.exit(main())
