"""What every service's ``__main__`` does the same way: logging to stderr, uvloop, and
SIGTERM/SIGINT turned into a stop event the service drains on.

    def main() -> int:
        config = MyConfig.from_args(...)
        return run_service("tokenizer", lambda stop: serve(config, stop))
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from shared.tracing import setup_tracing
from shared.wire.bus_auth import AccessRefused

__all__ = [
    "env_bool",
    "env_float",
    "env_int",
    "env_str",
    "env_value",
    "read_secret_file",
    "refuse_secret_flag",
    "run_service",
    "service_name",
    "setup_logging",
]

T = TypeVar("T")


def setup_logging(service: str) -> None:
    level = (env_str("LLMSERVE_LOG_LEVEL", None) or "INFO").upper()
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s {service}[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_TYPE_NAMES: dict[object, str] = {
    int: "an integer",
    float: "a number",
    bool: f"one of {'/'.join(_TRUE + _FALSE)}",
}


def env_value(name: str, type: Callable[[str], T]) -> T | None:
    """The one place settings are read from the environment: ``$name`` as ``type`` (``str``,
    ``int``, ``float`` or ``bool``: 1/true/yes/on or 0/false/no/off, any case), or None when it is
    unset or empty. A value that does not parse ends the process with a message naming the
    variable."""
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    if type is bool:
        value = text.strip().lower()
        if value in _TRUE + _FALSE:
            return value in _TRUE  # type: ignore[return-value]
    else:
        try:
            return type(text)
        except ValueError:
            pass
    raise SystemExit(
        f"error: environment variable {name} must be {_TYPE_NAMES.get(type, type)}, got {text!r}"
    )


def env_str(name: str, default: str | None) -> str | None:
    value = env_value(name, str)
    return default if value is None else value


def env_int(name: str, default: int | None) -> int | None:
    value = env_value(name, int)
    return default if value is None else value


def env_float(name: str, default: float | None) -> float | None:
    value = env_value(name, float)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    value = env_value(name, bool)
    return default if value is None else value


def read_secret_file(path: str, what: str) -> str:
    """A secret (a password, an API key) from the file ``path``: its first line, without the line
    break. ValueError naming ``what`` and the path if it cannot be read or is empty; a file that
    other users may read is used, with a warning (they may have read the secret too)."""
    try:
        with open(path) as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.readline().rstrip("\r\n")
    except OSError as e:
        raise ValueError(f"cannot read the {what} from {path}: {e.strerror or e}") from None
    if not secret:
        raise ValueError(f"the {what} file {path} is empty")
    if mode & 0o077:
        logging.getLogger("llmserve").warning(
            "the %s file %s is readable by other users (mode %o): chmod 600 it",
            what,
            path,
            mode & 0o777,
        )
    return secret


def refuse_secret_flag(p: argparse.ArgumentParser, flag: str, instead: str) -> None:
    """Make ``flag VALUE`` an error that says how to give the secret instead: argv is public
    (``ps``). Declared, the flag also stops argparse from taking it for an abbreviation of a longer
    one (``--nats-password`` for ``--nats-password-file``), which would treat the secret as a
    path and print it in the error."""

    class Refuse(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
            parser.error(
                f"{flag} would put a secret on the command line, where `ps` shows it to every "
                f"user of this machine: {instead}"
            )

    p.add_argument(flag, action=Refuse, help=argparse.SUPPRESS)


def run_service(name: str, serve: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``serve(stop)`` on uvloop; the first SIGTERM/SIGINT sets ``stop`` (serve drains and
    returns), a second one exits at once. Returns the process exit code."""
    setup_logging(name)
    log = logging.getLogger(f"llmserve.{name}")
    try:
        tracer_provider = setup_tracing(service_name(name))
    except ValueError as e:
        log.error("%s cannot start: %s", name, e)
        return 2

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

    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a dependency, but a plain loop works too
        runner = asyncio.run
    try:
        runner(main())
    except AccessRefused as e:  # wrong credentials: the message says it all, no traceback
        log.error("%s cannot start: %s", name, e)
        return 1
    except Exception:
        log.exception("%s failed", name)
        return 1
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # exports the spans still buffered
    log.info("stopped")
    return 0


def service_name(name: str) -> str:
    """The OpenTelemetry service.name of a service (``prefix_index`` → ``llmserve-prefix-index``),
    unless OTEL_SERVICE_NAME says otherwise."""
    return "llmserve-" + name.replace("_", "-")
