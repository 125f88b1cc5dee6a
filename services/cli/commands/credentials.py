"""``llmserve credentials DIR``: a closed bus for servers you run yourself (compose, a cluster).

Writes what ``llmserve up`` generates for its own servers: a NATS user per service kind with its
subject permissions, an admin user, the prefix index's Redis user (services/cli/credentials.py).
Each service then takes its kind's ``DIR/<kind>.env`` as its environment, and ``llmserve up
--credentials DIR`` hands them out itself."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "credentials",
        help="write a NATS and Redis configuration with a user per service (a closed bus)",
        description="Write fresh credentials into DIR (0700; files 0600, never overwritten): "
        "nats-users.conf (include it in nats-server's config), redis-users.acl (Redis's aclfile), "
        "and <kind>.env for each service kind (its NATS_USER / NATS_PASSWORD, and the prefix "
        "index's REDIS_USERNAME / REDIS_PASSWORD), plus admin.env for operators.",
    )
    p.add_argument("directory", metavar="DIR")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from services.cli.credentials import NATS_CONFIG_FILE, REDIS_ACL_FILE, StackCredentials

    paths = StackCredentials.generate().write(args.directory)
    d = args.directory
    print(
        "\n".join(paths)
        + f"\n\nnats-server: add `include {NATS_CONFIG_FILE}` to its config (copy the file next "
        f"to it)\nredis-server: `aclfile {d}/{REDIS_ACL_FILE}` in redis.conf\nservices: each "
        f"takes {d}/<kind>.env as its environment (compose: env_file), or run "
        f"`llmserve up --credentials {d}` with NATS_URL / REDIS_URL set",
        file=sys.stdout,
    )
    return 0
