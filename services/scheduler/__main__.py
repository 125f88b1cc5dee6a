"""``python -m services.scheduler``: admission control and routing of tokenized requests."""

from __future__ import annotations

import sys

from services.runtime import run_service
from services.scheduler.config import parse_config
from services.scheduler.service import serve


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv)
    return run_service("scheduler", lambda stop: serve(config, stop))


if __name__ == "__main__":
    sys.exit(main())
