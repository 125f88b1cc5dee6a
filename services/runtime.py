"""What every service's ``__main__`` does the same way: logging to stderr, uvloop, and SIGTERM/SIGINT
turned into a stop event the service drains on.

    def main() -> int:
        config = MyConfig.from_args(...)
        return run_service("tokenizer", lambda stop: serve(config, stop))
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

__all__ = ["setup_logging", "run_service", "env_str", "env_int", "env_float"]


def setup_logging(service: str) -> None:
    level = os.environ.get("LLMSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {service}[{os.getpid()}] %(levelname)s %(name)s: %(message)s")


def env_str(name: str, default: str | None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def env_int(name: str, default: int | None) -> int | None:
    value = env_str(name, None)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"error: environment variable {name} must be an integer, got {value!r}") from None


def env_float(name: str, default: float | None) -> float | None:
    value = env_str(name, None)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"error: environment variable {name} must be a number, got {value!r}") from None


def run_service(name: str, serve: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``serve(stop)`` on uvloop; the first SIGTERM/SIGINT sets ``stop`` (serve drains and
    returns), a second one exits at once. Returns the process exit code."""
    setup_logging(name)
    log = logging.getLogger(f"llmserve.{name}")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                log.warning("second %s: exiting without draining", signal.Signals(signum).name)
                os._exit(1)
            log.info("%s: draining", signal.Signals(signum).name)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await serve(stop)

    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # uvloop is a dependency, but a plain loop works too
        runner = asyncio.run
    try:
        runner(main())
    except Exception:
        log.exception("%s failed", name)
        return 1
    log.info("stopped")
    return 0
