"""Subcommands of ``llmserve``; each module exposes ``add_parser(subparsers)`` (see
``services.cli``)."""
