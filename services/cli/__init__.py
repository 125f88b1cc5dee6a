"""Tooling that starts processes: the ``llmserve`` command line (``main``), its subcommands
(``commands/``), the stack launcher (``launcher``) and the local nats-server/redis-server processes
it runs (``servers``). The services themselves never import this package."""

from services.cli.main import main

__all__ = ["main"]
