"""``llmserve`` command line: one subcommand per module in ``services/cli/commands/``.

Each command module exposes ``add_parser(subparsers)`` and sets ``func(args) -> int`` as the parser
default. Command modules keep their top-level imports light (no torch): every command's parser is
built on every invocation, so a heavy import there would slow down all of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from shared.engine.models.config import UnsupportedModelError

# Add a command by adding its module here.
COMMAND_MODULES: list[str] = [
    "services.cli.commands.plan",
    "services.cli.commands.generate",
    "services.cli.commands.up",
    "services.cli.commands.credentials",
    "services.cli.commands.bench",
]

# Errors a user can fix (bad flag value, missing file, unsupported model): one line, no traceback.
_USER_ERRORS = (ValueError, FileNotFoundError, UnsupportedModelError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmserve", description="LLM inference server for Llama-family models"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except _USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
